#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_shader_subgroup_shuffle : enable
#extension GL_EXT_control_flow_attributes : require
// linear.comp -- the model's matmuls: y = W @ x for T tokens (decode: T = 1, the prompt: T = its
// rows), with the options of a Llama layer folded in (defines):
//   NORM  x is RMS-normalised first: x_t * (1 / sqrt(mean(x_t^2) + EPS)) * g   (binding 3: g),
//         applied as (W @ (x_t * g)) * (1 / sqrt(mean(x_t^2) + EPS)) (the same up to rounding)
//   ACC   y += W @ x (the residual add, in place)
//   GLU   W holds 2N rows, gate then up: y = silu(W[:N] @ x) * (W[N:] @ x)
//   QKV   rows [0, NQ) go to y (q), [NQ, NQ+NKV) to yk (binding 4), the rest to yv (binding 5)
//   W_F16 / W_Q4_1 / W_Q8_0: W's storage (weights.glsl), float32 without one
//   W_TEXEL / X_TEXEL: W (weights.glsl) / x and g read from uniform texel buffers (CPU drivers:
//         vector gathers instead of a per-lane loop per storage word)
//   XSHARE (the subgroup size; LANES = 1): x and g pieces fetched by the subgroup's lanes between
//         them and shared by shuffles (with X_TEXEL: a fetch brings XSHARE vec4s, not one)
// Contract: W (rows, K) as weights.glsl lays it out (row-major, or grouped: W_LANES), K a multiple of UNIT (8; 32 for the block formats); x and y
// float32, head dims multiples of 4.
// T, T0, TX: push constants. Activations are (T, K) rows (IN_HD = K) or vkattn's head-major (K / IN_HD, TX, IN_HD) layout
// (IN_HD = head_dim: the attention output); the tokens read are T0 .. T0 + T - 1 of the TX in x.
// Outputs likewise (OUT_HD = N: rows, OUT_HD = head_dim: (heads, T, head_dim) for the cache).
// What it computes, in numpy (x as (TX, K) rows, W float32 after unpacking):
//   xs = x[T0:T0+T]; if NORM: xs = xs / np.sqrt((xs**2).mean(-1, keepdims=True) + EPS) * g
//   y = xs @ W.T   (GLU: a, b = xs @ W[:N].T, xs @ W[N:].T; y = a / (1 + np.exp(-a)) * b)
//   ACC: y += previous y
// Layout of the work: a group of LANES invocations computes RPL consecutive output rows for TT
// tokens; WG / LANES groups per workgroup; grid (ceil(T / TT), row groups). Each x piece (UNIT features) is
// loaded once for the RPL rows and each weight piece (16-byte loads for float16) once for the TT tokens: on
// lavapipe every storage-buffer word costs a per-lane scalar loop, so words loaded per
// multiply-add is what sets the speed (LANES = 1, RPL = 8 there: DeviceLlama.LAYOUTS). LANES > 1 (GPUs: lanes of a
// row read consecutive chunks) sums the partials through shared memory. A piece's loops are
// unrolled; the tile's (rows, tokens) where its x pieces are few (TILE_LOOP below).
// NORM without a pass of its own: the RMS factor is one number per token, so it comes out of the
// sum -- y = (W @ (x * g)) / rms(x) -- and the sum of squares is taken from the x pieces the main
// loop loads anyway (XSHARE: each lane's share, summed over the subgroup by shuffles; LANES > 1:
// summed with the partials). No barrier, no second read of x (before: every workgroup read its
// tokens' x once more and reduced them through shared memory, log2(WG) barriers a token).
layout(local_size_x = WG) in;

layout(constant_id = 0) const uint K = 64;        // input features
layout(constant_id = 1) const uint N = 64;        // output rows (GLU: per half)
layout(constant_id = 2) const uint IN_HD = 64;    // input head dim (K: row layout)
layout(constant_id = 3) const uint OUT_HD = 64;   // output head dim (N or NQ: row layout)
layout(constant_id = 4) const float EPS = 1e-5;   // RMSNorm epsilon
layout(constant_id = 5) const uint NQ = 64;       // QKV: q rows
layout(constant_id = 6) const uint NKV = 64;      // QKV: k rows (= v rows)
// the token counts are push constants, so a new prompt length builds no new pipeline
layout(push_constant) uniform Tokens {
    uint T;                                       // tokens computed
    uint T0;                                      // first token of x read
    uint TX;                                      // tokens in x
};

#include "weights.glsl"
#ifdef XSHARE
// XSHARE = the subgroup size (the device's, fixed at compile time; it divides WG and UNIT, and
// LANES = 1): the subgroup's lanes load one x piece between them and share it by shuffles, so
// every lane runs the piece loop (rows past the end are clamped, not skipped)
#define PER (UNIT / XSHARE)
#define ALL_LANES true
#else
#define ALL_LANES false
#endif
#if defined(X_TEXEL) && defined(XSHARE)
#define XF ((TT * V4 + XSHARE - 1) / XSHARE)    // x fetches a piece (the tile's TT * V4 vec4s)
#define GF ((V4 + XSHARE - 1) / XSHARE)         // g fetches a piece
#endif
#ifdef X_TEXEL
// x and g as uniform texel buffers of vec4s (vkattn.algorithm binds a samplerBuffer so), which a
// CPU driver fetches by one vector gather per vec4 instead of a per-lane loop per word; with
// XSHARE too the subgroup's lanes fetch different vec4s and share them (below)
layout(binding = 1) uniform samplerBuffer xt;
#define X4(i) texelFetch(xt, int((i) / 4u))
#else
layout(std430, binding = 1) readonly buffer Xb { float x[]; };
#define X4(i) vec4(x[i], x[(i) + 1], x[(i) + 2], x[(i) + 3])
#endif
layout(std430, binding = 2) buffer Yb { float y[]; };
#ifdef NORM
#ifdef X_TEXEL
layout(binding = 3) uniform samplerBuffer gt;
#define G4(k) texelFetch(gt, int((k) / 4u))
#else
layout(std430, binding = 3) readonly buffer Gb { float g[]; };
#define G4(k) vec4(g[k], g[(k) + 1], g[(k) + 2], g[(k) + 3])
#endif
#endif
#ifdef QKV
layout(std430, binding = 4) writeonly buffer YKb { float yk[]; };
layout(std430, binding = 5) writeonly buffer YVb { float yv[]; };
#endif

// TILE_LOOP: the loops over the tile's rows and tokens, unrolled where the tile's x pieces are
// few (TT * UNIT floats a lane: float formats, q4_1 up to 4 tokens, or one token). Measured on
// lavapipe (a prompt's wall time, alternated): unrolled, float16's 8 x 8 tile took about 0.7x its
// rolled time (session 26); q4_1's 16 x 8 (TT * UNIT = 256) 1.3-1.9x (spilled), its 8 x 4 (128)
// 0.75x (session 33)
#if TT * UNIT <= 128
#define TILE_LOOP [[unroll]]
#else
#define TILE_LOOP
#endif
const uint RPW = WG / LANES;               // row groups per workgroup
#if LANES > 1
shared float red[WG];

// the LANES partial sums of v over this group's lanes (every invocation calls it: barriers)
float lanes_sum(float v, uint lid, uint lane) {
    red[lid] = v;
    barrier();
    for (uint h = LANES / 2; h > 0; h >>= 1) {
        if (lane < h) red[lid] += red[lid + h];
        barrier();
    }
    v = red[lid - lane];
    barrier();
    return v;
}
#endif

uint xi(uint t, uint k) {            // index of feature k of token t (absolute) in x
    return ((k / IN_HD) * TX + t) * IN_HD + (k % IN_HD);
}

void store(uint n, uint t, float v) {
#ifdef QKV
    if (n < NQ) {
        y[((n / OUT_HD) * T + t) * OUT_HD + (n % OUT_HD)] = v;
    } else if (n < NQ + NKV) {
        n -= NQ;
        yk[((n / OUT_HD) * T + t) * OUT_HD + (n % OUT_HD)] = v;
    } else {
        n -= NQ + NKV;
        yv[((n / OUT_HD) * T + t) * OUT_HD + (n % OUT_HD)] = v;
    }
#else
    uint i = ((n / OUT_HD) * T + t) * OUT_HD + (n % OUT_HD);
#ifdef ACC
    y[i] += v;
#else
    y[i] = v;
#endif
#endif
}

void main() {
    const uint lid = gl_LocalInvocationID.x;
    const uint lane = lid % LANES;
    // grid (token tiles, row groups): the workgroups that read the same weight rows are
    // consecutive (x varies fastest), so a prompt's weights come from memory once, not once per
    // token tile (lavapipe, SmolLM2's float16 prompt: 7% less time than rows on x, alternated)
    const uint n0 = (gl_WorkGroupID.y * RPW + lid / LANES) * RPL;     // this group's first row
    const uint tbase = gl_WorkGroupID.x * TT;
    float acc[RPL * TT];
#ifdef GLU
    float acc2[RPL * TT];
#endif
    TILE_LOOP for (uint j = 0; j < RPL * TT; j++) {
        acc[j] = 0.0;
#ifdef GLU
        acc2[j] = 0.0;
#endif
    }
    float ss[TT];                          // NORM: sums of squares of the tokens' x (this lane's share)
    TILE_LOOP for (uint j = 0; j < TT; j++) ss[j] = 0.0;
#ifdef QKV
    const uint ROWS = NQ + 2 * NKV;
#else
    const uint ROWS = N;
#endif
    if (ALL_LANES || n0 < ROWS) {
        for (uint c = lane; c < PIECES; c += LANES) {
            const uint k = c * UNIT;
            // the tile's x pieces (times g), loaded once for the RPL rows and prepared for the
            // weight format once (weights.glsl prep_x); 4 features of one head are contiguous
            vec4 xv[TT][V4];
            float xs[TT];
#if defined(X_TEXEL) && defined(XSHARE)
            // the tile's TT * V4 x vec4s (and g's V4) fetched by the subgroup's lanes between them
            // -- lane l the entries l, l + XSHARE, ... -- and handed to every lane by shuffles
            // with constant sources: a CPU driver's texel fetch costs as much at one address for
            // every lane as at XSHARE different ones (llvmpipe: a call, a load per lane and a
            // transpose), so each fetch brings XSHARE vec4s instead of one
            const uint sl = gl_SubgroupInvocationID;
            vec4 got[XF];
            [[unroll]] for (uint f = 0; f < XF; f++) {
                const uint e = min(f * XSHARE + sl, TT * V4 - 1);
                got[f] = X4(xi(T0 + min(tbase + e / V4, T - 1), k + 4 * (e % V4)));
            }
#ifdef NORM
            vec4 gg[GF];
            [[unroll]] for (uint f = 0; f < GF; f++) gg[f] = G4(k + 4 * min(f * XSHARE + sl, V4 - 1));
            vec4 gv[V4];
            [[unroll]] for (uint i = 0; i < V4; i++) gv[i] = subgroupShuffle(gg[i / XSHARE], i % XSHARE);
#endif
            [[unroll]] for (uint j = 0; j < TT; j++) {
                [[unroll]] for (uint i = 0; i < V4; i++) {
                    xv[j][i] = subgroupShuffle(got[(j * V4 + i) / XSHARE], (j * V4 + i) % XSHARE);
#ifdef NORM
                    ss[j] += dot(xv[j][i], xv[j][i]);
                    xv[j][i] *= gv[i];
#endif
                }
                xs[j] = prep_x(xv[j]);
            }
#else
            TILE_LOOP for (uint j = 0; j < TT; j++) {
                const uint t = T0 + min(tbase + j, T - 1);
#ifdef XSHARE
                // lane l of the subgroup loads features l*PER .. l*PER+PER-1 of the piece, then
                // shuffles with constant sources hand every lane all UNIT: UNIT / XSHARE words
                // loaded per lane instead of UNIT (llvmpipe loads word by word, lane by lane)
                const uint sl = gl_SubgroupInvocationID;
                float mine[PER];
                [[unroll]] for (uint e = 0; e < PER; e++) {
                    const uint f = k + sl * PER + e;
                    mine[e] = x[xi(t, f)];
#ifdef NORM
                    ss[j] = fma(mine[e], mine[e], ss[j]);
                    mine[e] *= g[f];
#endif
                }
                [[unroll]] for (uint i = 0; i < V4; i++) {
                    [[unroll]] for (uint c = 0; c < 4; c++) {
                        xv[j][i][c] = subgroupShuffle(mine[(4 * i + c) % PER], (4 * i + c) / PER);
                    }
                }
#else
                [[unroll]] for (uint i = 0; i < V4; i++) {
                    xv[j][i] = X4(xi(t, k + 4 * i));
#ifdef NORM
                    ss[j] += dot(xv[j][i], xv[j][i]);
                    xv[j][i] *= G4(k + 4 * i);
#endif
                }
#endif
                xs[j] = prep_x(xv[j]);
            }
#endif
#if TT > 1
            // a prompt's tile: every row's piece loaded (and converted) first, then summed token
            // by token a code word (8 features: a float format's whole piece, a block format's
            // quarter) at a time -- one token's 8 x values in registers against every row's
            // word, which a CPU compiler then reads as memory operands -- each (row, token) sum
            // kept apart until the piece's last word, then codes_sum (a block's d * s + m *
            // sum(x)): codes_dot's sums in its order, so the rows-first order below gives the
            // same bits. Lavapipe's LLVM keeps far fewer values on the stack so (session 37,
            // AVX2: stack moves a piece 1322 -> 670 in float16's gate/up, 2940 -> 1750 in
            // q4_1's; the matmuls 0.93-0.94x and 0.86-0.91x the time)
            vec4 wq[RPL][V4];
            vec2 dm[RPL];
            float sw[RPL * TT];
#ifdef GLU
            vec4 uq[RPL][V4];
            vec2 um[RPL];
            float su[RPL * TT];
#endif
            TILE_LOOP for (uint r = 0; r < RPL; r++) {
                const uint n = min(n0 + r, ROWS - 1);       // rows past the end: computed, not stored
                dm[r] = load_codes(n, c, wq[r]);
#ifdef GLU
                um[r] = load_codes(n + N, c, uq[r]);
#endif
            }
            TILE_LOOP for (uint i = 0; i < RPL * TT; i++) {
                sw[i] = 0.0;
#ifdef GLU
                su[i] = 0.0;
#endif
            }
            [[unroll]] for (uint h = 0; h < V4; h += 2) {
                TILE_LOOP for (uint j = 0; j < TT; j++) {
                    TILE_LOOP for (uint r = 0; r < RPL; r++) {
                        const uint i = r * TT + j;
                        sw[i] += dot(wq[r][h], xv[j][h]);
                        sw[i] += dot(wq[r][h + 1], xv[j][h + 1]);
#ifdef GLU
                        su[i] += dot(uq[r][h], xv[j][h]);
                        su[i] += dot(uq[r][h + 1], xv[j][h + 1]);
#endif
                        if (h + 2 == V4) {                  // the piece's last word: its sums done
                            acc[i] += codes_sum(dm[r], sw[i], xs[j]);
#ifdef GLU
                            acc2[i] += codes_sum(um[r], su[i], xs[j]);
#endif
                        }
                    }
                }
            }
#else
            TILE_LOOP for (uint r = 0; r < RPL; r++) {
                const uint n = min(n0 + r, ROWS - 1);       // rows past the end: computed, not stored
                vec4 wq[V4];
                const vec2 dm = load_codes(n, c, wq);
#ifdef GLU
                vec4 uq[V4];
                const vec2 um = load_codes(n + N, c, uq);
#endif
                TILE_LOOP for (uint j = 0; j < TT; j++) {
                    acc[r * TT + j] += codes_dot(wq, dm, xv[j], xs[j]);
#ifdef GLU
                    acc2[r * TT + j] += codes_dot(uq, um, xv[j], xs[j]);
#endif
                }
            }
#endif
        }
    }
#if defined(NORM) && defined(XSHARE) && !defined(X_TEXEL)
    // each lane summed the squares of its own features: the token's sum is the subgroup's
    TILE_LOOP for (uint j = 0; j < TT; j++)
        [[unroll]] for (uint h = 1; h < XSHARE; h *= 2)
            ss[j] += subgroupShuffle(ss[j], gl_SubgroupInvocationID ^ h);
#endif
#if LANES > 1
    TILE_LOOP for (uint j = 0; j < RPL * TT; j++) {
        acc[j] = lanes_sum(acc[j], lid, lane);
#ifdef GLU
        acc2[j] = lanes_sum(acc2[j], lid, lane);
#endif
    }
#ifdef NORM
    TILE_LOOP for (uint j = 0; j < TT; j++) ss[j] = lanes_sum(ss[j], lid, lane);
#endif
#endif
    if (lane == 0) {
        TILE_LOOP for (uint j = 0; j < TT; j++) {
#ifdef NORM
            const float rn = 1.0 / sqrt(ss[j] / float(K) + EPS);
#else
            const float rn = 1.0;
#endif
            TILE_LOOP for (uint r = 0; r < RPL; r++) {
                if (n0 + r < ROWS && tbase + j < T) {
#ifdef GLU
                    const float a = acc[r * TT + j] * rn;
                    store(n0 + r, tbase + j, a / (1.0 + exp(-a)) * (acc2[r * TT + j] * rn));
#else
                    store(n0 + r, tbase + j, acc[r * TT + j] * rn);
#endif
                }
            }
        }
    }
}
