#version 450
// linear.comp -- the model's matmuls: y = W @ x for T tokens (decode: T = 1, the prompt: T = its
// rows), with the options of a Llama layer folded in (defines):
//   NORM  x is RMS-normalised first: x_t * (1 / sqrt(mean(x_t^2) + EPS)) * g   (binding 3: g)
//   ACC   y += W @ x (the residual add, in place)
//   GLU   W holds 2N rows, gate then up: y = silu(W[:N] @ x) * (W[N:] @ x)
//   QKV   rows [0, NQ) go to y (q), [NQ, NQ+NKV) to yk (binding 4), the rest to yv (binding 5)
//   W_F16 W is float16, two per uint32 word (low half first), else float32
// Contract: W row-major (rows, K), K a multiple of 8, rows 16-byte aligned; x and y float32.
// Activations are (T, K) rows (IN_HD = K) or vkattn's head-major (K / IN_HD, TX, IN_HD) layout
// (IN_HD = head_dim: the attention output); the tokens read are T0 .. T0 + T - 1 of the TX in x.
// Outputs likewise (OUT_HD = N: rows, OUT_HD = head_dim: (heads, T, head_dim) for the cache).
// What it computes, in numpy (x as (TX, K) rows, W float32 after unpacking):
//   xs = x[T0:T0+T]; if NORM: xs = xs / np.sqrt((xs**2).mean(-1, keepdims=True) + EPS) * g
//   y = xs @ W.T   (GLU: a, b = xs @ W[:N].T, xs @ W[N:].T; y = a / (1 + np.exp(-a)) * b)
//   ACC: y += previous y
// Layout of the work: LANES invocations per output row (LANES = 1: one row per invocation, the
// weight row read with 16-byte loads while x is the same word for every invocation -- fastest on
// lavapipe, where a subgroup is a SIMD register), WG / LANES rows per workgroup, LANES > 1 sums
// through shared memory; TT tokens per workgroup (grid y = ceil(T / TT)), so each weight is read
// once per TT tokens (the prompt's tiled case).
layout(local_size_x = WG) in;

layout(constant_id = 0) const uint K = 64;        // input features
layout(constant_id = 1) const uint N = 64;        // output rows (GLU: per half)
layout(constant_id = 2) const uint T = 1;         // tokens computed
layout(constant_id = 3) const uint IN_HD = 64;    // input head dim (K: row layout)
layout(constant_id = 4) const uint OUT_HD = 64;   // output head dim (N or NQ: row layout)
layout(constant_id = 5) const uint T0 = 0;        // first token of x read
layout(constant_id = 6) const uint TX = 1;        // tokens in x
layout(constant_id = 7) const float EPS = 1e-5;   // RMSNorm epsilon
layout(constant_id = 8) const uint NQ = 64;       // QKV: q rows
layout(constant_id = 9) const uint NKV = 64;      // QKV: k rows (= v rows)

#ifdef W_F16
layout(std430, binding = 0) readonly buffer Wb { uvec4 w[]; };    // 8 halves per element
#define CHUNKS (K / 8)
#else
layout(std430, binding = 0) readonly buffer Wb { vec4 w[]; };     // 2 elements per 8 weights
#define CHUNKS (K / 8)
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

const uint RPW = WG / LANES;
shared float red[WG];
#ifdef NORM
shared float rnorm[TT];
#endif

uint xi(uint t, uint k) {            // index of feature k of token t (absolute) in x
    return ((k / IN_HD) * TX + t) * IN_HD + (k % IN_HD);
}

void load8(uint row, uint c, out vec4 a, out vec4 b) {
#ifdef W_F16
    uvec4 u = w[row * CHUNKS + c];
    a = vec4(unpackHalf2x16(u.x), unpackHalf2x16(u.y));
    b = vec4(unpackHalf2x16(u.z), unpackHalf2x16(u.w));
#else
    a = w[(row * CHUNKS + c) * 2];
    b = w[(row * CHUNKS + c) * 2 + 1];
#endif
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
    const uint n = gl_WorkGroupID.x * RPW + lid / LANES;
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
    float acc[TT];
#ifdef GLU
    float acc2[TT];
#endif
    for (uint j = 0; j < TT; j++) {
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
    if (n < ROWS) {
        for (uint c = lane; c < CHUNKS; c += LANES) {
            vec4 wa, wb;
            load8(n, c, wa, wb);
#ifdef GLU
            vec4 ua, ub;
            load8(n + N, c, ua, ub);
#endif
            const uint k = c * 8;
#ifdef NORM
            const vec4 ga = vec4(g[k], g[k + 1], g[k + 2], g[k + 3]);
            const vec4 gb = vec4(g[k + 4], g[k + 5], g[k + 6], g[k + 7]);
#endif
            for (uint j = 0; j < TT; j++) {
                const uint t = T0 + min(tbase + j, T - 1);
                const uint i0 = xi(t, k);            // 8 features of one head: contiguous
                vec4 xa = vec4(x[i0], x[i0 + 1], x[i0 + 2], x[i0 + 3]);
                vec4 xb = vec4(x[i0 + 4], x[i0 + 5], x[i0 + 6], x[i0 + 7]);
#ifdef NORM
                xa = (xa * rnorm[j]) * ga;
                xb = (xb * rnorm[j]) * gb;
#endif
                acc[j] += dot(wa, xa) + dot(wb, xb);
#ifdef GLU
                acc2[j] += dot(ua, xa) + dot(ub, xb);
#endif
            }
        }
    }
#if LANES > 1
    for (uint j = 0; j < TT; j++) {
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
    if (n < ROWS && lane == 0) {
        for (uint j = 0; j < TT; j++) {
            if (tbase + j < T) {
#ifdef GLU
                const float a = acc[j];
                store(n, tbase + j, a / (1.0 + exp(-a)) * acc2[j]);
#else
                store(n, tbase + j, acc[j]);
#endif
            }
        }
    }
}
