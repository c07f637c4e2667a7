#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_shader_subgroup_shuffle : enable
// linear.comp -- the model's matmuls: y = W @ x for T tokens (decode: T = 1, the prompt: T = its
// rows), with the options of a Llama layer folded in (defines):
//   NORM  x is RMS-normalised first: x_t * (1 / sqrt(mean(x_t^2) + EPS)) * g   (binding 3: g)
//   ACC   y += W @ x (the residual add, in place)
//   GLU   W holds 2N rows, gate then up: y = silu(W[:N] @ x) * (W[N:] @ x)
//   QKV   rows [0, NQ) go to y (q), [NQ, NQ+NKV) to yk (binding 4), the rest to yv (binding 5)
//   W_F16 / W_Q4_1 / W_Q8_0: W's storage (weights.glsl), float32 without one
// Contract: W row-major (rows, K), K a multiple of UNIT (8; 32 for the block formats); x and y
// float32, head dims multiples of 4.
// T, T0, TX: push constants. Activations are (T, K) rows (IN_HD = K) or vkattn's head-major (K / IN_HD, TX, IN_HD) layout
// (IN_HD = head_dim: the attention output); the tokens read are T0 .. T0 + T - 1 of the TX in x.
// Outputs likewise (OUT_HD = N: rows, OUT_HD = head_dim: (heads, T, head_dim) for the cache).
// What it computes, in numpy (x as (TX, K) rows, W float32 after unpacking):
//   xs = x[T0:T0+T]; if NORM: xs = xs / np.sqrt((xs**2).mean(-1, keepdims=True) + EPS) * g
//   y = xs @ W.T   (GLU: a, b = xs @ W[:N].T, xs @ W[N:].T; y = a / (1 + np.exp(-a)) * b)
//   ACC: y += previous y
// Layout of the work: a group of LANES invocations computes RPL consecutive output rows for TT
// tokens (grid y = ceil(T / TT)); WG / LANES groups per workgroup. Each x piece (UNIT features) is
// loaded once for the RPL rows and each weight piece (16-byte loads for float16) once for the TT tokens: on
// lavapipe every storage-buffer word costs a per-lane scalar loop, so words loaded per
// multiply-add is what sets the speed (LANES = 1, RPL = 8 there). LANES > 1 (GPUs: lanes of a
// row read consecutive chunks) sums the partials through shared memory.
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
layout(std430, binding = 1) readonly buffer Xb { float x[]; };
layout(std430, binding = 2) buffer Yb { float y[]; };
#ifdef NORM
layout(std430, binding = 3) readonly buffer Gb { float g[]; };
#endif
#ifdef QKV
layout(std430, binding = 4) writeonly buffer YKb { float yk[]; };
layout(std430, binding = 5) writeonly buffer YVb { float yv[]; };
#endif

const uint RPW = WG / LANES;               // row groups per workgroup
shared float red[WG];
#ifdef NORM
shared float rnorm[TT];
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
    const uint n0 = (gl_WorkGroupID.x * RPW + lid / LANES) * RPL;     // this group's first row
    const uint tbase = gl_WorkGroupID.y * TT;
#ifdef NORM
    // 1 / rms of each token of the tile: the workgroup sums the squares through shared memory
    for (uint j = 0; j < TT; j++) {
        float s = 0.0;
        if (tbase + j < T) {
            for (uint k = lid; k < K; k += WG) {
                float v = x[xi(T0 + tbase + j, k)];
                s += v * v;
            }
        }
        red[lid] = s;
        barrier();
        for (uint h = WG / 2; h > 0; h >>= 1) {
            if (lid < h) red[lid] += red[lid + h];
            barrier();
        }
        if (lid == 0) rnorm[j] = 1.0 / sqrt(red[0] / float(K) + EPS);
        barrier();
    }
#endif
    float acc[RPL * TT];
#ifdef GLU
    float acc2[RPL * TT];
#endif
    for (uint j = 0; j < RPL * TT; j++) {
        acc[j] = 0.0;
#ifdef GLU
        acc2[j] = 0.0;
#endif
    }
#ifdef QKV
    const uint ROWS = NQ + 2 * NKV;
#else
    const uint ROWS = N;
#endif
    if (ALL_LANES || n0 < ROWS) {
        for (uint c = lane; c < PIECES; c += LANES) {
            const uint k = c * UNIT;
            // the tile's x pieces, loaded once for the RPL rows (4 features of one head are contiguous)
            vec4 xv[TT][V4];
            for (uint j = 0; j < TT; j++) {
                const uint t = T0 + min(tbase + j, T - 1);
#ifdef XSHARE
                // lane l of the subgroup loads features l*PER .. l*PER+PER-1 of the piece (normalised),
                // then shuffles with constant sources hand every lane all UNIT: UNIT / XSHARE words
                // loaded per lane instead of UNIT (llvmpipe loads word by word, lane by lane)
                const uint sl = gl_SubgroupInvocationID;
                float mine[PER];
                for (uint e = 0; e < PER; e++) {
                    const uint f = k + sl * PER + e;
                    mine[e] = x[xi(t, f)];
#ifdef NORM
                    mine[e] = (mine[e] * rnorm[j]) * g[f];
#endif
                }
                for (uint i = 0; i < V4; i++) {
                    for (uint c = 0; c < 4; c++) {
                        xv[j][i][c] = subgroupShuffle(mine[(4 * i + c) % PER], (4 * i + c) / PER);
                    }
                }
#else
                for (uint i = 0; i < V4; i++) {
                    const uint i0 = xi(t, k + 4 * i);
                    xv[j][i] = vec4(x[i0], x[i0 + 1], x[i0 + 2], x[i0 + 3]);
#ifdef NORM
                    xv[j][i] = (xv[j][i] * rnorm[j]) * vec4(g[k + 4 * i], g[k + 4 * i + 1], g[k + 4 * i + 2], g[k + 4 * i + 3]);
#endif
                }
#endif
            }
            for (uint r = 0; r < RPL; r++) {
                const uint n = min(n0 + r, ROWS - 1);       // rows past the end: computed, not stored
                vec4 wv[V4];
                load_piece(n, c, wv);
#ifdef GLU
                vec4 uv[V4];
                load_piece(n + N, c, uv);
#endif
                for (uint j = 0; j < TT; j++) {
                    float s = 0.0;
#ifdef GLU
                    float s2 = 0.0;
#endif
                    for (uint i = 0; i < V4; i++) {
                        s += dot(wv[i], xv[j][i]);
#ifdef GLU
                        s2 += dot(uv[i], xv[j][i]);
#endif
                    }
                    acc[r * TT + j] += s;
#ifdef GLU
                    acc2[r * TT + j] += s2;
#endif
                }
            }
        }
    }
#if LANES > 1
    // the LANES partial sums of each (row, token) through shared memory
    for (uint j = 0; j < RPL * TT; j++) {
#ifdef GLU
        for (uint half_ = 0; half_ < 2; half_++) {
            red[lid] = half_ == 0 ? acc[j] : acc2[j];
#else
        {
            red[lid] = acc[j];
#endif
            barrier();
            for (uint h = LANES / 2; h > 0; h >>= 1) {
                if (lane < h) red[lid] += red[lid + h];
                barrier();
            }
#ifdef GLU
            if (half_ == 0) acc[j] = red[lid - lane]; else acc2[j] = red[lid - lane];
#else
            acc[j] = red[lid - lane];
#endif
            barrier();
        }
    }
#endif
    if (lane == 0) {
        for (uint r = 0; r < RPL; r++) {
            for (uint j = 0; j < TT; j++) {
                if (n0 + r < ROWS && tbase + j < T) {
#ifdef GLU
                    const float a = acc[r * TT + j];
                    store(n0 + r, tbase + j, a / (1.0 + exp(-a)) * acc2[r * TT + j]);
#else
                    store(n0 + r, tbase + j, acc[r * TT + j]);
#endif
                }
            }
        }
    }
}
