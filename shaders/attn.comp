#version 450
// attn.comp -- flash attention over the persistent cache (plus optional new rows), one dispatch;
// the GPU kernel (CPU Vulkan drivers use attn_lane.comp). Per-call values, the sequences of a
// batch and the score rules (window, sinks, softcap, ALiBi, mask) are in aux: attn_common.glsl.
//
// Contract
//   grid (SPLITS, tiles, HKV); workgroup (sp, y, h) takes tile y of the aux tile table =
//   (sequence i, query tile qt), so
//     * the G query heads h*G .. h*G+G-1 that share kv head h (GQA/MQA; G = 1 is plain MHA),
//     * query rows qt*BQ .. qt*BQ+BQ-1 of the q_len_i rows of sequence i,
//     * keys kstart_i + sp*chunk_i .. (+ chunk_i) of its T_i = past_i + n_new_i positions.
//   kc, vc   : cache uvec4 rows, row of (head, slot) from aux (common.glsl, attn_common.glsl).
//              Keys j < past_i come from here.
//   nk, nv   : new rows, float32 [HKV, NN, DK4*CH|DV4*CH] vec4. Keys past_i <= j < T_i come from
//              here (row new_start_i + j - past_i), rounded to the storage dtype; when aux[3] != 0
//              the workgroups of the sequence also store them into its cache slots. No workgroup
//              reads those slots in this dispatch, so the fused append cannot race with attention.
//   q        : float32 [HKV*G, R, DK4*CH] vec4, zero padded
//   out      : SPLITS == 1: float32 [HKV*G, R, DV], normalised; lse float32 [HKV*G, R]
//              SPLITS  > 1: float32 [SPLITS, HKV*G*R, DV4*CH*4] un-normalised partial sums
//   ml       : SPLITS  > 1: vec2 [SPLITS, HKV*G*R] running (max, sum), max in log2 units
// numpy, one q head of one sequence (SPLITS == 1):
//   s = scale * q @ K[:T].T (+ variants, invisible keys -inf);  out = softmax(s) @ V[:T]
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
layout(constant_id = 7) const uint FLAGS = 0u;   // variants (attn_common.glsl)
layout(constant_id = 8) const uint TQ = 1u;      // query groups in the V phase
layout(constant_id = 9) const uint KG = 1u;      // key groups in the V phase
layout(constant_id = 10) const uint ROPE_DIM = 8u;  // rotated elements (ROPE_K / ROPE_Q)

layout(std430, binding = 0) buffer KC { uvec4 kc[]; };
layout(std430, binding = 1) buffer VC { uvec4 vc[]; };
layout(std430, binding = 2) readonly buffer NK { vec4 nk[]; };
layout(std430, binding = 3) readonly buffer NV { vec4 nv[]; };
layout(std430, binding = 4) readonly buffer QB { vec4 qbuf[]; };
layout(std430, binding = 5) readonly buffer AUX { uint aux[]; };
layout(std430, binding = 6) writeonly buffer OUT { float outbuf[]; };
layout(std430, binding = 7) writeonly buffer ML { vec2 mlbuf[]; };
layout(std430, binding = 8) writeonly buffer LSE { float lsebuf[]; };
layout(std430, binding = 9) readonly buffer ROPE { vec4 rope_tab[]; };
layout(std430, binding = 10) buffer KS { float kscale[]; };   // KV_I8: scale of each cache row
layout(std430, binding = 11) buffer VS { float vscale[]; };

#include "attn_common.glsl"
#include "rope.glsl"

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
shared uint srow[BK];
shared float svsc[BK];   // KV_I8: V scale of each key of the tile
shared vec4 sred[RED];

Seq seq;
uint hh, qt;

// vec4 u of new row r of nk (rotated with ROPE_K at its position)
vec4 new_k(uint r, uint u) {
    const uint row = (hh * aux[11] + r) * PK;
    vec4 x = nk[row + u];
    if (HAS(F_ROPE_K)) x = rope_rotate(x, nk[row + rope_partner(u)], u, seq.rope_row + seq.past + r - seq.new_start - seq.rope_pos);
    return x;
}

vec4 new_v(uint r, uint u) { return nv[(hh * aux[11] + r) * PV + u]; }

// KV_I8: quantisation scale of new row r (1 otherwise)
float new_scale(bool is_k, uint r) {
#if KV_I8
    float amax = 0.0;
    for (uint u = 0u; u < (is_k ? PK : PV); ++u) amax = max(amax, vmax_abs(is_k ? new_k(r, u) : new_v(r, u)));
    return quant_scale(amax);
#else
    return 1.0;
#endif
}

// chunk c of new row r in storage form (rounded / quantised with scale)
uvec4 new_chunk(bool is_k, uint r, uint c, float scale) {
    vec4 y[CH];
    for (uint e = 0u; e < CH; ++e) {
        y[e] = is_k ? new_k(r, c * CH + e) : new_v(r, c * CH + e);
#if KV_I8
        y[e] = quantise(y[e], scale);
#endif
    }
    return pack_chunk(y);
}

// K/V chunk c of key j (cache row `row` or new row), as stored (KV_I8: before the scale)
void load_k(uint row, uint j, uint c, float scale, out vec4 x[CH]) {
    if (j < seq.past) unpack_chunk(kc[row * DK4 + c], x);
    else unpack_chunk(new_chunk(true, seq.new_start + j - seq.past, c, scale), x);
}

void load_v(uint row, uint j, uint c, float scale, out vec4 x[CH]) {
    if (j < seq.past) unpack_chunk(vc[row * DV4 + c], x);
    else unpack_chunk(new_chunk(false, seq.new_start + j - seq.past, c, scale), x);
}

float key_scale(bool is_k, uint row, uint j) {
#if KV_I8
    if (j >= seq.past) return new_scale(is_k, seq.new_start + j - seq.past);
    return is_k ? kscale[row] : vscale[row];
#else
    return 1.0;
#endif
}

void store_new_rows(uint sp, uint t) {
    const uint nw = SPLITS * ((seq.q_len + BQ - 1u) / BQ);
    for (uint r = qt * SPLITS + sp; r < seq.n_new; r += nw) {
        const uint row = cache_row(seq.bt, hh, seq.past + r);
        const float ksc = new_scale(true, seq.new_start + r), vsc = new_scale(false, seq.new_start + r);
        for (uint c = t; c < DK4 + DV4; c += WG) {
            if (c < DK4) kc[row * DK4 + c] = new_chunk(true, seq.new_start + r, c, ksc);
            else vc[row * DV4 + c - DK4] = new_chunk(false, seq.new_start + r, c - DK4, vsc);
        }
#if KV_I8
        if (t == 0u) { kscale[row] = ksc; vscale[row] = vsc; }
#endif
    }
}

// keys k0 .. k1-1 in tiles of BK (workgroup-uniform bounds: every thread reaches the barriers)
void consume(uint k0, uint k1, uint t, uint cv, uint qg, uint kg, bool vact, inout vec4 acc[QPT][CH]) {
    const bool causal = aux[1] != 0u;
    const uint T = seq.past + seq.n_new;
    for (uint j0 = k0; j0 < k1; j0 += BK) {
        const uint n = min(BK, k1 - j0);
        {
            const uint j = j0 + t;
            const uint row = (t < n && j < seq.past) ? cache_row(seq.bt, hh, j) : 0u;
            srow[t] = row;
            float dots[NQ];
            for (uint qv = 0u; qv < NQ; ++qv) dots[qv] = 0.0;
            if (t < n) {
                const float ksc = key_scale(true, row, j);
                if (KV_I8 != 0) svsc[t] = key_scale(false, row, j);
                for (uint c = 0u; c < DK4; ++c) {
                    vec4 kx[CH];
                    load_k(row, j, c, ksc, kx);
                    for (uint qv = 0u; qv < NQ; ++qv)
                        for (uint e = 0u; e < CH; ++e) dots[qv] += dot(sq[qv * PK + c * CH + e], kx[e]);
                }
                if (KV_I8 != 0) for (uint qv = 0u; qv < NQ; ++qv) dots[qv] *= ksc;
            }
            for (uint qv = 0u; qv < NQ; ++qv) {
                const uint r = qt * BQ + qv % BQ;
                const uint p = T - seq.q_len + r;
                float sc = NEG_INF;
                if (t < n && r < seq.q_len && key_visible(j, p, causal)) {
                    const float slope = HAS(F_ALIBI) ? uintBitsToFloat(aux[aux[15] + hh * G + qv / BQ]) : 0.0;
                    sc = shape_score(dots[qv], slope, j, p);
                    if (HAS(F_MASK)) sc += mask_at(seq, hh * G + qv / BQ, r, j);
                }
                ss[qv * BK + t] = sc;
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
                const float vsc = KV_I8 != 0 ? svsc[kk] : 1.0;
                load_v(srow[kk], j0 + kk, cv, vsc, vx);
                for (uint k = 0u; k < QPT; ++k) {
                    const uint qv = qg + k * TQ;
                    if (qv < NQ) {
                        const float p = ss[qv * BK + kk] * vsc;
                        for (uint e = 0u; e < CH; ++e) acc[k][e] += p * vx[e];
                    }
                }
            }
        }
        barrier();
    }
}

void main() {
    const uint sp = gl_WorkGroupID.x, y = gl_WorkGroupID.y;
    hh = gl_WorkGroupID.z;
    const uint h = hh;
    const uint t = gl_LocalInvocationID.x;
    if (y >= aux[14]) return;                 // the grid is sized for the largest batch
    seq = load_seq(aux[aux[13] + 2u * y]);
    qt = aux[aux[13] + 2u * y + 1u];
    const bool causal = aux[1] != 0u;
    const float qscale = uintBitsToFloat(aux[2]);
    const uint T = seq.past + seq.n_new, R = aux[10];
    const uint NROWS = gl_NumWorkGroups.z * G * R;

    if (aux[3] != 0u) store_new_rows(sp, t);

    for (uint i = t; i < NQ * PK; i += WG) {
        const uint qv = i / PK, e = i % PK;
        const uint r = qt * BQ + qv % BQ;
        const uint qbase = ((h * G + qv / BQ) * R + seq.q_start + r) * PK;
        vec4 x = (r < seq.q_len) ? qbuf[qbase + e] : vec4(0.0);
        if (HAS(F_ROPE_Q) && r < seq.q_len)
            x = rope_rotate(x, qbuf[qbase + rope_partner(e)], e, seq.rope_row + T - seq.q_len + r - seq.rope_pos);
        sq[i] = x * qscale;
    }
    for (uint i = t; i < NQ; i += WG) { sm[i] = NEG_INF; sl[i] = 0.0; }

    // keys of this split; past the tile's last row nothing is visible when causal
    uint kend = T;
    if (causal) kend = T - seq.q_len + min(seq.q_len, qt * BQ + BQ);
    const uint a = min(kend, seq.kstart + sp * seq.chunk), b = min(kend, a + seq.chunk);

    const uint cv = t % DV4, vr = t / DV4;
    const uint qg = vr % TQ, kg = vr / TQ;
    const bool vact = vr < TQ * KG;
    vec4 acc[QPT][CH];
    for (uint k = 0u; k < QPT; ++k)
        for (uint e = 0u; e < CH; ++e) acc[k][e] = vec4(0.0);
    barrier();

    if (HAS(F_WINDOW)) {
        const uint win = aux[7], sinks = aux[8];
        const uint pmin = T - seq.q_len + qt * BQ;              // the tile's first row
        const uint wlo = pmin + 1u > win ? pmin + 1u - win : 0u;
        if (sp == 0u) consume(0u, min(sinks, min(seq.kstart, kend)), t, cv, qg, kg, vact, acc);
        consume(a, min(b, sinks), t, cv, qg, kg, vact, acc);
        consume(max(a, max(sinks, wlo)), b, t, cv, qg, kg, vact, acc);
    } else {
        consume(a, b, t, cv, qg, kg, vact, acc);
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
        if (qv >= NQ || r >= seq.q_len) continue;
        const uint row = (h * G + qv / BQ) * R + seq.q_start + r;
        if (SPLITS == 1u) {
            const float l = sl[qv];
            const float inv = l > 0.0 ? 1.0 / l : 0.0;
            for (uint e = 0u; e < CH; ++e)
                for (uint i = 0u; i < 4u; ++i) {
                    const uint d = (cv * CH + e) * 4u + i;
                    if (d < DV) outbuf[row * DV + d] = acc[k][e][i] * inv;
                }
            if (cv == 0u) lsebuf[row] = l > 0.0 ? (sm[qv] + log2(l)) * LN2 : NEG_INF;
        } else {
            const uint base = (sp * NROWS + row) * PV * 4u;
            for (uint e = 0u; e < CH; ++e)
                for (uint i = 0u; i < 4u; ++i)
                    outbuf[base + (cv * CH + e) * 4u + i] = acc[k][e][i];
            if (cv == 0u) mlbuf[sp * NROWS + row] = vec2(sm[qv], sl[qv]);
        }
    }
}
