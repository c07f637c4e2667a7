#version 450
// attn_lane.comp -- flash attention (decode and prefill) for CPU-like Vulkan devices.
//
// A workgroup is one subgroup of WG lanes and owns NQ = G*BQ query vectors: the G query heads of
// kv head h for BQ consecutive query rows. Lane l holds uvec4 chunks l, l+WG, ... of every K/V row
// (one key costs ceil(DK4/WG) + ceil(DV4/WG) loads per lane, none repeated). Keys go in blocks of
// WG: the lanes' partial dot products for the block are reduce-scattered with xor shuffles so that
// lane b holds the scores of key b, the softmax update (one exp2 per query vector and block, SIMD
// across the block's keys) runs on those, and the weights are broadcast back for the V
// accumulation. Every lane keeps the softmax state and its slice of the NQ accumulators in private
// memory. No shared memory and no barrier. This suits drivers where a memory instruction costs a
// per-lane loop while arithmetic and shuffles run SIMD-wide (lavapipe: subgroup 8); GPUs use
// attn.comp. WG is the device's subgroup size, probed at plan time (a power of two, <= 16).
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

// xor butterflies over the WG lanes (CPU drivers make these in-register shuffles), written out
// rather than looped: lavapipe caps the loop iterations of one invocation
float lanes_sum(float x) {
    if (WG > 1u) x += subgroupShuffleXor(x, 1u);
    if (WG > 2u) x += subgroupShuffleXor(x, 2u);
    if (WG > 4u) x += subgroupShuffleXor(x, 4u);
    if (WG > 8u) x += subgroupShuffleXor(x, 8u);
    return x;
}

float lanes_max(float x) {
    if (WG > 1u) x = max(x, subgroupShuffleXor(x, 1u));
    if (WG > 2u) x = max(x, subgroupShuffleXor(x, 2u));
    if (WG > 4u) x = max(x, subgroupShuffleXor(x, 4u));
    if (WG > 8u) x = max(x, subgroupShuffleXor(x, 8u));
    return x;
}

// one reduce-scatter step: values a[0 .. 2w) -> a[0 .. w), this lane keeping the half its bit w
// selects and adding the partner lane's copy of it
void scatter_step(inout float a[WG], uint w) {
    const bool hi = (gl_SubgroupInvocationID & w) != 0u;
    [[unroll]] for (uint k = 0u; k < w; ++k) {
        const float keep = hi ? a[w + k] : a[k];
        const float send = hi ? a[k] : a[w + k];
        a[k] = keep + subgroupShuffleXor(send, w);
    }
}

// per-invocation state: its slice of the NQ scaled queries and accumulators, softmax state
vec4 q[NQ * KPL * CH];
vec4 acc[NQ * VPL * CH];
float m[NQ], l[NQ];
uint vis_end[NQ];   // key j is visible to query vector qv iff j < vis_end[qv]

// chunk (lane + i*WG) of key j's K or V row: from the cache or (fresh) from this call's new rows.
// fresh is a constant at every call site, so each inlined copy keeps one path: a branch around
// loads costs both paths on SIMD CPU drivers
uvec4 k_chunk(uint h, uint j, uint past, uint i, bool fresh) {
    const uint c = gl_LocalInvocationID.x + i * WG;
    if (fresh) return new_chunk(true, h, j - past, c);
    return kc[(h * params[6] + j) * DK4 + min(c, DK4 - 1u)];
}

uvec4 v_chunk(uint h, uint j, uint past, uint i, bool fresh) {
    const uint c = gl_LocalInvocationID.x + i * WG;
    if (fresh) return new_chunk(false, h, j - past, c);
    return vc[(h * params[6] + j) * DV4 + min(c, DV4 - 1u)];
}

// keys j0 .. j0+WG-1 (those >= k1 masked): scores, online softmax update, V accumulation
void consume_block(uint h, uint j0, uint k1, uint past, bool fresh) {
    const uint lane = gl_LocalInvocationID.x;
    float d[NQ][WG];
    [[unroll]] for (uint b = 0u; b < WG; ++b) {
        const uint j = min(j0 + b, k1 - 1u);
        [[unroll]] for (uint qv = 0u; qv < NQ; ++qv) d[qv][b] = 0.0;
        [[unroll]] for (uint i = 0u; i < KPL; ++i) {
            vec4 kx[CH];
            unpack_chunk(k_chunk(h, j, past, i, fresh), kx);
            const float on = (DK4 % WG == 0u || lane + i * WG < DK4) ? 1.0 : 0.0;  // past the row's end
            [[unroll]] for (uint qv = 0u; qv < NQ; ++qv)
                [[unroll]] for (uint e = 0u; e < CH; ++e) d[qv][b] += on * dot(q[(qv * KPL + i) * CH + e], kx[e]);
        }
    }
    const uint jl = j0 + lane;          // the key whose scores this lane ends up with
    float pl[NQ];
    [[unroll]] for (uint qv = 0u; qv < NQ; ++qv) {
        if (WG > 8u) scatter_step(d[qv], 8u);
        if (WG > 4u) scatter_step(d[qv], 4u);
        if (WG > 2u) scatter_step(d[qv], 2u);
        if (WG > 1u) scatter_step(d[qv], 1u);
        const float sc = (jl < k1 && jl < vis_end[qv]) ? d[qv][0] : NEG_INF;
        const float mn = max(m[qv], lanes_max(sc));
        const float alpha = mn == NEG_INF ? 1.0 : exp2(m[qv] - mn);
        pl[qv] = mn == NEG_INF ? 0.0 : exp2(sc - mn);
        l[qv] = l[qv] * alpha + lanes_sum(pl[qv]);
        m[qv] = mn;
        [[unroll]] for (uint i = 0u; i < VPL * CH; ++i) acc[qv * VPL * CH + i] *= alpha;
    }
    [[unroll]] for (uint b = 0u; b < WG; ++b) {
        if (j0 + b >= k1) break;
        [[unroll]] for (uint i = 0u; i < VPL; ++i) {
            vec4 vx[CH];
            unpack_chunk(v_chunk(h, j0 + b, past, i, fresh), vx);
            [[unroll]] for (uint qv = 0u; qv < NQ; ++qv) {
                const float p = subgroupShuffle(pl[qv], b);
                [[unroll]] for (uint e = 0u; e < CH; ++e) acc[(qv * VPL + i) * CH + e] += p * vx[e];
            }
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
    const uint kc1 = min(k1, past);
    for (uint j0 = k0; j0 < kc1; j0 += WG) consume_block(h, j0, kc1, past, false);   // keys in the cache
    for (uint j0 = max(k0, past); j0 < k1; j0 += WG) consume_block(h, j0, k1, past, true);  // appended now

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
