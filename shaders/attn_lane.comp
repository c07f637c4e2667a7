#version 450
// attn_lane.comp -- flash attention (decode and prefill) for CPU-like Vulkan devices.
//
// A workgroup is one subgroup of WG lanes and owns NQ = G*BQ query vectors: the G query heads of
// kv head h for BQ consecutive query rows. It streams its key range one key at a time: lane l
// holds uvec4 chunks l, l+WG, ... of every K/V row (one key costs ceil(DK4/WG) + ceil(DV4/WG)
// loads per lane, none repeated), partial dot products are summed over the lanes with an xor
// butterfly, and every lane keeps the online-softmax state and its slice of the NQ accumulators in
// private memory. No shared memory and no barrier. This suits drivers where a memory instruction
// costs a per-lane loop while arithmetic and shuffles run SIMD-wide (lavapipe: subgroup 8);
// GPUs use attn.comp. WG is the device's subgroup size, read at plan time (a power of two).
//
// Contract (kc, vc, nk, nv, q as in attn.comp)
//   grid (SPLITS, ceil(S / BQ), HKV); workgroup (sp, qt, h): rows qt*BQ .., keys sp*chunk ..
//   params : [0] past, [1] n_new, [2] causal, [3] float bits of scale*log2(e), [4] chunk,
//            [5] write new rows, [6] CAP (cache rows per head), [7] rows per head of nk/nv, [8] S
//   query row r sits at position T - S + r (T = past + n_new); causal: it sees keys j <= T - S + r
//   SPLITS == 1: out float32 [HKV*G, S, DV] normalised (a row that sees nothing gives zeros)
//   SPLITS  > 1: out float32 [SPLITS, HKV*G*S, DV4*CH*4] partial sums, ml vec2 [SPLITS, HKV*G*S]
//                (running max in log2 units, running sum) for reduce.comp
// numpy, q head h*G+g, row r, split keys J:
//   s = scale * K[J] @ q[r] (masked -inf);  m = s.max();  p = exp(s - m);  acc = p @ V[J]
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#include "common.glsl"

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint G = 1u;
layout(constant_id = 2) const uint BQ = 1u;
layout(constant_id = 3) const uint DK4 = 16u;
layout(constant_id = 4) const uint DV4 = 16u;
layout(constant_id = 5) const uint DV = 128u;
layout(constant_id = 6) const uint SPLITS = 1u;

layout(std430, binding = 0) buffer KC { uvec4 kc[]; };
layout(std430, binding = 1) buffer VC { uvec4 vc[]; };
layout(std430, binding = 2) readonly buffer NK { vec4 nk[]; };
layout(std430, binding = 3) readonly buffer NV { vec4 nv[]; };
layout(std430, binding = 4) readonly buffer QB { vec4 qbuf[]; };
layout(std430, binding = 5) readonly buffer PARAMS { uint params[]; };
layout(std430, binding = 6) writeonly buffer OUT { float outbuf[]; };
layout(std430, binding = 7) writeonly buffer ML { vec2 mlbuf[]; };

const uint WG = gl_WorkGroupSize.x;
const uint NQ = G * BQ;                  // query vectors of this workgroup, qv = g * BQ + i
const uint KPL = (DK4 + WG - 1u) / WG;   // K chunks per lane
const uint VPL = (DV4 + WG - 1u) / WG;   // V chunks per lane
const uint PK = DK4 * CH;
const uint PV = DV4 * CH;

// chunk c of new row r (rows past.. of this call), rounded to the storage dtype
uvec4 new_chunk(bool is_k, uint h, uint r, uint c) {
    const uint d4 = is_k ? DK4 : DV4;
    if (c >= d4) return uvec4(0u);
    vec4 y[CH];
    const uint src = ((h * params[7] + r) * d4 + c) * CH;
    [[unroll]] for (uint e = 0u; e < CH; ++e) y[e] = is_k ? nk[src + e] : nv[src + e];
    return pack_chunk(y);
}

// sum over the WG lanes with an xor butterfly (CPU drivers make these in-register shuffles),
// written out rather than looped: lavapipe caps the loop iterations of one invocation
float lanes_sum(float x) {
    if (WG > 1u) x += subgroupShuffleXor(x, 1u);
    if (WG > 2u) x += subgroupShuffleXor(x, 2u);
    if (WG > 4u) x += subgroupShuffleXor(x, 4u);
    if (WG > 8u) x += subgroupShuffleXor(x, 8u);
    if (WG > 16u) x += subgroupShuffleXor(x, 16u);
    if (WG > 32u) x += subgroupShuffleXor(x, 32u);
    if (WG > 64u) x += subgroupShuffleXor(x, 64u);
    return x;
}

// per-invocation state: its slice of the NQ scaled queries and accumulators, softmax state
vec4 q[NQ * KPL * CH];
vec4 acc[NQ * VPL * CH];
float m[NQ], l[NQ];
uint vis_end[NQ];   // key j is visible to query vector qv iff j < vis_end[qv]

// one key j: NQ scores, online softmax update, V accumulation
void consume(uint j, uvec4 kw[KPL], uvec4 vw[VPL]) {
    const uint lane = gl_LocalInvocationID.x;
    float d[NQ];
    [[unroll]] for (uint qv = 0u; qv < NQ; ++qv) d[qv] = 0.0;
    [[unroll]] for (uint i = 0u; i < KPL; ++i) {
        vec4 kx[CH];
        unpack_chunk(kw[i], kx);
        const float on = lane + i * WG < DK4 ? 1.0 : 0.0;   // lanes past the row's end add nothing
        [[unroll]] for (uint qv = 0u; qv < NQ; ++qv)
            [[unroll]] for (uint e = 0u; e < CH; ++e) d[qv] += on * dot(q[(qv * KPL + i) * CH + e], kx[e]);
    }
    float alpha[NQ], p[NQ];
    [[unroll]] for (uint qv = 0u; qv < NQ; ++qv) {
        const float s = j < vis_end[qv] ? lanes_sum(d[qv]) : NEG_INF;
        const float mn = max(m[qv], s);
        alpha[qv] = mn == NEG_INF ? 1.0 : exp2(m[qv] - mn);
        p[qv] = mn == NEG_INF ? 0.0 : exp2(s - mn);
        l[qv] = l[qv] * alpha[qv] + p[qv];
        m[qv] = mn;
    }
    [[unroll]] for (uint i = 0u; i < VPL; ++i) {
        vec4 vx[CH];
        unpack_chunk(vw[i], vx);
        [[unroll]] for (uint qv = 0u; qv < NQ; ++qv)
            [[unroll]] for (uint e = 0u; e < CH; ++e) {
                const uint a = (qv * VPL + i) * CH + e;
                acc[a] = acc[a] * alpha[qv] + p[qv] * vx[e];
            }
    }
}

void main() {
    const uint sp = gl_WorkGroupID.x, qt = gl_WorkGroupID.y, h = gl_WorkGroupID.z;
    const uint lane = gl_LocalInvocationID.x;
    const uint past = params[0], n_new = params[1];
    const bool causal = params[2] != 0u;
    const float qscale = uintBitsToFloat(params[3]);
    const uint chunk = params[4], cap = params[6], S = params[8];
    const uint T = past + n_new;

    if (params[5] != 0u) {   // fused append: this workgroup stores new rows w, w+nw, ... of head h
        const uint nw = gl_NumWorkGroups.x * gl_NumWorkGroups.y, w = qt * gl_NumWorkGroups.x + sp;
        for (uint r = w; r < n_new; r += nw) {
            [[unroll]] for (uint i = 0u; i < KPL; ++i) {
                const uint c = lane + i * WG;
                if (c < DK4) kc[(h * cap + past + r) * DK4 + c] = new_chunk(true, h, r, c);
            }
            [[unroll]] for (uint i = 0u; i < VPL; ++i) {
                const uint c = lane + i * WG;
                if (c < DV4) vc[(h * cap + past + r) * DV4 + c] = new_chunk(false, h, r, c);
            }
        }
    }

    uint kend = 0u;   // one past the last key any row of this workgroup sees
    [[unroll]] for (uint qv = 0u; qv < NQ; ++qv) {
        const uint g = qv / BQ, r = qt * BQ + qv % BQ;
        vis_end[qv] = r >= S ? 0u : (causal ? T - S + r + 1u : T);
        kend = max(kend, vis_end[qv]);
        m[qv] = NEG_INF;
        l[qv] = 0.0;
        [[unroll]] for (uint i = 0u; i < KPL; ++i) {
            const uint c = lane + i * WG;
            [[unroll]] for (uint e = 0u; e < CH; ++e)
                q[(qv * KPL + i) * CH + e] = (c < DK4 && r < S) ? qbuf[((h * G + g) * S + r) * PK + c * CH + e] * qscale : vec4(0.0);
        }
        [[unroll]] for (uint i = 0u; i < VPL * CH; ++i) acc[qv * VPL * CH + i] = vec4(0.0);
    }

    const uint k0 = min(T, sp * chunk), k1 = min(kend, k0 + chunk);
    for (uint j = k0; j < min(k1, past); ++j) {            // keys in the cache
        uvec4 kw[KPL], vw[VPL];
        [[unroll]] for (uint i = 0u; i < KPL; ++i) kw[i] = kc[(h * cap + j) * DK4 + min(lane + i * WG, DK4 - 1u)];
        [[unroll]] for (uint i = 0u; i < VPL; ++i) vw[i] = vc[(h * cap + j) * DV4 + min(lane + i * WG, DV4 - 1u)];
        consume(j, kw, vw);
    }
    for (uint j = max(k0, past); j < k1; ++j) {             // keys this call appends (forward)
        uvec4 kw[KPL], vw[VPL];
        [[unroll]] for (uint i = 0u; i < KPL; ++i) kw[i] = new_chunk(true, h, j - past, lane + i * WG);
        [[unroll]] for (uint i = 0u; i < VPL; ++i) vw[i] = new_chunk(false, h, j - past, lane + i * WG);
        consume(j, kw, vw);
    }

    const uint nrows = gl_NumWorkGroups.z * G * S;
    [[unroll]] for (uint qv = 0u; qv < NQ; ++qv) {
        const uint g = qv / BQ, r = qt * BQ + qv % BQ;
        if (r >= S) continue;
        const uint row = (h * G + g) * S + r;
        if (SPLITS == 1u) {
            const float inv = l[qv] > 0.0 ? 1.0 / l[qv] : 0.0;
            [[unroll]] for (uint i = 0u; i < VPL; ++i)
                [[unroll]] for (uint e = 0u; e < CH; ++e)
                    [[unroll]] for (uint x = 0u; x < 4u; ++x) {
                        const uint d = ((lane + i * WG) * CH + e) * 4u + x;
                        if (d < DV) outbuf[row * DV + d] = acc[(qv * VPL + i) * CH + e][x] * inv;
                    }
        } else {
            const uint base = (sp * nrows + row) * PV * 4u;
            [[unroll]] for (uint i = 0u; i < VPL; ++i) {
                const uint c = lane + i * WG;
                if (c < DV4)
                    [[unroll]] for (uint e = 0u; e < CH; ++e)
                        [[unroll]] for (uint x = 0u; x < 4u; ++x)
                            outbuf[base + (c * CH + e) * 4u + x] = acc[(qv * VPL + i) * CH + e][x];
            }
            if (lane == 0u) mlbuf[sp * nrows + row] = vec2(m[qv], l[qv]);
        }
    }
}
