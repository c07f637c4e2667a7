#version 450
// attn.comp -- flash attention over the persistent cache (plus optional new rows), one dispatch.
//
// Contract
//   grid (SPLITS, ceil(S / BQ), HKV); workgroup (sp, qt, h) takes
//     * the G query heads h*G .. h*G+G-1 that share kv head h (GQA/MQA; G = 1 is plain MHA),
//     * query rows qt*BQ .. qt*BQ+BQ-1 of the S rows; row r sits at position T - S + r,
//     * keys sp*chunk .. min(T, (sp+1)*chunk) - 1 of the T = past + n_new visible positions.
//   kc, vc   : cache [HKV, CAP, DK4|DV4] uvec4 (common.glsl). Keys j < past come from here.
//   nk, nv   : new rows, float32 [HKV, NNEW, DK4*CH|DV4*CH] vec4. Keys past <= j < T come from
//              here, rounded to the storage dtype; when params[5] != 0 the workgroups of head h
//              also store them into cache rows past .. T-1. No workgroup reads those cache rows
//              in this dispatch, so the fused append cannot race with the attention.
//   q        : float32 [HKV*G, S, DK4*CH] vec4, zero padded
//   params   : [0] past, [1] n_new, [2] causal, [3] float bits of scale*log2(e), [4] chunk,
//              [5] write new rows, [6] CAP, [7] NNEW (rows per head of nk/nv), [8] S
//   out      : SPLITS == 1: float32 [HKV*G, S, DV], normalised
//              SPLITS  > 1: float32 [SPLITS, HKV*G*S, DV4*CH*4] un-normalised partial sums
//   ml       : SPLITS  > 1: vec2 [SPLITS, HKV*G*S] running (max, sum), max in log2 units
// numpy, one q head (SPLITS == 1):
//   s = scale * q @ K[:T].T;  s[j > T - S + r] = -inf if causal;  out = softmax(s) @ V[:T]
//   (a row that sees no key gives zeros, never NaN)
//
// Per tile of BK = WG keys: thread t scores key t against the NQ = G*BQ query vectors (pre-scaled,
// in shared memory); NQ threads update the running max and sum (online softmax, exp2 domain);
// then thread (c, qg, kg) accumulates V chunk c for query vectors qg, qg+TQ, ... over keys
// kg, kg+KG, ... of the tile. KG > 1 (decode) spreads keys over threads; the KG partial sums
// are added through shared memory once at the end. fp32 accumulation throughout.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint G = 1u;       // q heads per kv head
layout(constant_id = 2) const uint BQ = 1u;      // query rows per workgroup
layout(constant_id = 3) const uint DK4 = 16u;    // uvec4 per K row
layout(constant_id = 4) const uint DV4 = 16u;    // uvec4 per V row
layout(constant_id = 5) const uint DV = 128u;    // v_head_dim (unpadded)
layout(constant_id = 6) const uint SPLITS = 1u;  // key splits (grid x)
layout(constant_id = 7) const uint TQ = 1u;      // query groups in the V phase
layout(constant_id = 8) const uint KG = 1u;      // key groups in the V phase

layout(std430, binding = 0) buffer KC { uvec4 kc[]; };
layout(std430, binding = 1) buffer VC { uvec4 vc[]; };
layout(std430, binding = 2) readonly buffer NK { vec4 nk[]; };
layout(std430, binding = 3) readonly buffer NV { vec4 nv[]; };
layout(std430, binding = 4) readonly buffer QB { vec4 qbuf[]; };
layout(std430, binding = 5) readonly buffer PARAMS { uint params[]; };
layout(std430, binding = 6) writeonly buffer OUT { float outbuf[]; };
layout(std430, binding = 7) writeonly buffer ML { vec2 mlbuf[]; };

const uint WG = gl_WorkGroupSize.x;
const uint BK = WG;
const uint NQ = G * BQ;
const uint QPT = (NQ + TQ - 1u) / TQ;
const uint PK = DK4 * CH;
const uint PV = DV4 * CH;
const uint RED = (KG > 1u) ? WG * QPT * CH : 1u;

shared vec4 sq[NQ * PK];
shared float ss[NQ * BK];
shared float sm[NQ];
shared float sl[NQ];
shared float salpha[NQ];
shared vec4 sred[RED];

// per-call sizes from params (not spec constants, so one pipeline serves every capacity and
// chunk length): cache rows per head, rows per head of nk/nv, query rows
uint CAP, NNEW, S;

void load_k(uint h, uint j, uint past, uint c, out vec4 x[CH]) {
    if (j < past) {
        unpack_chunk(kc[(h * CAP + j) * DK4 + c], x);
    } else {
        vec4 y[CH];
        const uint src = ((h * NNEW + (j - past)) * DK4 + c) * CH;
        for (uint e = 0u; e < CH; ++e) y[e] = nk[src + e];
        unpack_chunk(pack_chunk(y), x);
    }
}

void load_v(uint h, uint j, uint past, uint c, out vec4 x[CH]) {
    if (j < past) {
        unpack_chunk(vc[(h * CAP + j) * DV4 + c], x);
    } else {
        vec4 y[CH];
        const uint src = ((h * NNEW + (j - past)) * DV4 + c) * CH;
        for (uint e = 0u; e < CH; ++e) y[e] = nv[src + e];
        unpack_chunk(pack_chunk(y), x);
    }
}

void store_new_rows(uint h, uint past, uint n_new, uint t) {
    const uint nw = gl_NumWorkGroups.x * gl_NumWorkGroups.y;
    for (uint r = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x; r < n_new; r += nw) {
        for (uint c = t; c < DK4 + DV4; c += WG) {
            vec4 y[CH];
            if (c < DK4) {
                const uint src = ((h * NNEW + r) * DK4 + c) * CH;
                for (uint e = 0u; e < CH; ++e) y[e] = nk[src + e];
                kc[(h * CAP + past + r) * DK4 + c] = pack_chunk(y);
            } else {
                const uint cv = c - DK4;
                const uint src = ((h * NNEW + r) * DV4 + cv) * CH;
                for (uint e = 0u; e < CH; ++e) y[e] = nv[src + e];
                vc[(h * CAP + past + r) * DV4 + cv] = pack_chunk(y);
            }
        }
    }
}

void main() {
    const uint sp = gl_WorkGroupID.x, qt = gl_WorkGroupID.y, h = gl_WorkGroupID.z;
    const uint t = gl_LocalInvocationID.x;
    const uint past = params[0], n_new = params[1];
    const bool causal = params[2] != 0u;
    const float qscale = uintBitsToFloat(params[3]);
    const uint chunk = params[4];
    const uint T = past + n_new;
    CAP = params[6];
    NNEW = params[7];
    S = params[8];
    const uint NROWS = gl_NumWorkGroups.z * G * S;

    if (params[5] != 0u) store_new_rows(h, past, n_new, t);

    for (uint i = t; i < NQ * PK; i += WG) {
        const uint qv = i / PK, e = i % PK;
        const uint r = qt * BQ + qv % BQ;
        sq[i] = (r < S) ? qbuf[((h * G + qv / BQ) * S + r) * PK + e] * qscale : vec4(0.0);
    }
    for (uint i = t; i < NQ; i += WG) { sm[i] = NEG_INF; sl[i] = 0.0; }

    const uint k0 = sp * chunk;
    uint k1 = min(T, k0 + chunk);
    if (causal) k1 = min(k1, T - S + min(S, qt * BQ + BQ));  // past the tile's last row: masked

    const uint cv = t % DV4, vr = t / DV4;
    const uint qg = vr % TQ, kg = vr / TQ;
    const bool vact = vr < TQ * KG;
    vec4 acc[QPT][CH];
    for (uint k = 0u; k < QPT; ++k)
        for (uint e = 0u; e < CH; ++e) acc[k][e] = vec4(0.0);
    barrier();

    for (uint j0 = k0; j0 < k1; j0 += BK) {
        const uint n = min(BK, k1 - j0);
        {
            const uint j = j0 + t;
            float dots[NQ];
            for (uint qv = 0u; qv < NQ; ++qv) dots[qv] = 0.0;
            if (t < n) {
                for (uint c = 0u; c < DK4; ++c) {
                    vec4 kx[CH];
                    load_k(h, j, past, c, kx);
                    for (uint qv = 0u; qv < NQ; ++qv)
                        for (uint e = 0u; e < CH; ++e) dots[qv] += dot(sq[qv * PK + c * CH + e], kx[e]);
                }
            }
            for (uint qv = 0u; qv < NQ; ++qv) {
                const uint r = qt * BQ + qv % BQ;
                const bool vis = t < n && r < S && (!causal || j <= T - S + r);
                ss[qv * BK + t] = vis ? dots[qv] : NEG_INF;
            }
        }
        barrier();
        for (uint qv = t; qv < NQ; qv += WG) {
            float mt = NEG_INF;
            for (uint k = 0u; k < n; ++k) mt = max(mt, ss[qv * BK + k]);
            const float mold = sm[qv];
            const float mnew = max(mold, mt);
            float alpha = 1.0, lsum = 0.0;
            if (mnew != NEG_INF) {
                alpha = exp2(mold - mnew);
                for (uint k = 0u; k < n; ++k) {
                    const float p = exp2(ss[qv * BK + k] - mnew);
                    ss[qv * BK + k] = p;
                    lsum += p;
                }
            } else {
                for (uint k = 0u; k < n; ++k) ss[qv * BK + k] = 0.0;
            }
            sm[qv] = mnew;
            sl[qv] = sl[qv] * alpha + lsum;
            salpha[qv] = alpha;
        }
        barrier();
        if (vact) {
            for (uint k = 0u; k < QPT; ++k) {
                const uint qv = qg + k * TQ;
                if (qv < NQ)
                    for (uint e = 0u; e < CH; ++e) acc[k][e] *= salpha[qv];
            }
            for (uint kk = kg; kk < n; kk += KG) {
                vec4 vx[CH];
                load_v(h, j0 + kk, past, cv, vx);
                for (uint k = 0u; k < QPT; ++k) {
                    const uint qv = qg + k * TQ;
                    if (qv < NQ) {
                        const float p = ss[qv * BK + kk];
                        for (uint e = 0u; e < CH; ++e) acc[k][e] += p * vx[e];
                    }
                }
            }
        }
        barrier();
    }

    if (KG > 1u) {
        if (vact && kg > 0u)
            for (uint k = 0u; k < QPT; ++k)
                for (uint e = 0u; e < CH; ++e) sred[(t * QPT + k) * CH + e] = acc[k][e];
        barrier();
        if (vact && kg == 0u)
            for (uint g2 = 1u; g2 < KG; ++g2) {
                const uint t2 = (g2 * TQ + qg) * DV4 + cv;
                for (uint k = 0u; k < QPT; ++k)
                    for (uint e = 0u; e < CH; ++e) acc[k][e] += sred[(t2 * QPT + k) * CH + e];
            }
    }

    if (!vact || kg != 0u) return;
    for (uint k = 0u; k < QPT; ++k) {
        const uint qv = qg + k * TQ;
        const uint r = qt * BQ + qv % BQ;
        if (qv >= NQ || r >= S) continue;
        const uint row = (h * G + qv / BQ) * S + r;
        if (SPLITS == 1u) {
            const float l = sl[qv];
            const float inv = l > 0.0 ? 1.0 / l : 0.0;
            for (uint e = 0u; e < CH; ++e)
                for (uint i = 0u; i < 4u; ++i) {
                    const uint d = (cv * CH + e) * 4u + i;
                    if (d < DV) outbuf[row * DV + d] = acc[k][e][i] * inv;
                }
        } else {
            const uint base = (sp * NROWS + row) * PV * 4u;
            for (uint e = 0u; e < CH; ++e)
                for (uint i = 0u; i < 4u; ++i)
                    outbuf[base + (cv * CH + e) * 4u + i] = acc[k][e][i];
            if (cv == 0u) mlbuf[sp * NROWS + row] = vec2(sm[qv], sl[qv]);
        }
    }
}
