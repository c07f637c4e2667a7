#version 450
// attn_lane.comp -- split-K decode (one query row) for CPU-like Vulkan devices.
//
// A workgroup is one subgroup of WG lanes. It streams its key range one key at a time: lane l
// holds uvec4 chunks l, l+WG, ... of every row (so one key costs ceil(DK4/WG) + ceil(DV4/WG)
// loads per lane and no load is repeated), the G query heads' partial dot products are summed
// with subgroupAdd, and every lane keeps the online-softmax state and its slice of the G output
// accumulators in private memory. No shared memory, no barrier in the key loop. This suits
// drivers where each memory instruction costs a per-lane loop and arithmetic is SIMD-wide
// (lavapipe: subgroup 8); GPUs use attn.comp. WG is the device's subgroup size, read at plan time;
// if the driver runs the workgroup as several subgroups anyway, a shared-memory sum is used.
//
// Contract (see attn.comp for kc, vc, nk, nv, q and params [0..5])
//   grid (SPLITS, 1, HKV); params[6] = CAP (cache rows per head), params[7] = rows per head of nk/nv
//   workgroup (sp, h): keys sp*chunk .. min(T, (sp+1)*chunk) - 1 of T = past + n_new
//   part : float32 [SPLITS, HKV*G, DV4*CH*4] un-normalised sums;  ml : vec2 [SPLITS, HKV*G]
// numpy, q head h*G+g, split keys J:
//   s = scale * K[J] @ q;  m = s.max();  p = exp(s - m);  part = p @ V[J];  ml = (m*log2(e), p.sum())
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#include "common.glsl"

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint G = 1u;
layout(constant_id = 2) const uint DK4 = 16u;
layout(constant_id = 3) const uint DV4 = 16u;

layout(std430, binding = 0) buffer KC { uvec4 kc[]; };
layout(std430, binding = 1) buffer VC { uvec4 vc[]; };
layout(std430, binding = 2) readonly buffer NK { vec4 nk[]; };
layout(std430, binding = 3) readonly buffer NV { vec4 nv[]; };
layout(std430, binding = 4) readonly buffer QB { vec4 qbuf[]; };
layout(std430, binding = 5) readonly buffer PARAMS { uint params[]; };
layout(std430, binding = 6) writeonly buffer PART { vec4 part[]; };
layout(std430, binding = 7) writeonly buffer ML { vec2 mlbuf[]; };

const uint WG = gl_WorkGroupSize.x;
const uint KPL = (DK4 + WG - 1u) / WG;   // K chunks per lane
const uint VPL = (DV4 + WG - 1u) / WG;   // V chunks per lane
const uint PK = DK4 * CH;
const uint PV = DV4 * CH;

// chunk c of row j: from the cache (j < past) or from the new rows, rounded to the storage dtype
uvec4 row_chunk(bool is_k, uint h, uint j, uint past, uint c) {
    const uint cap = params[6], nrows = params[7];
    const uint d4 = is_k ? DK4 : DV4;
    if (c >= d4) return uvec4(0u);
    if (j < past) return is_k ? kc[(h * cap + j) * DK4 + c] : vc[(h * cap + j) * DV4 + c];
    vec4 y[CH];
    const uint src = ((h * nrows + (j - past)) * d4 + c) * CH;
    [[unroll]] for (uint e = 0u; e < CH; ++e) y[e] = is_k ? nk[src + e] : nv[src + e];
    return pack_chunk(y);
}

// per-invocation state: its slice of the G scaled queries and G output accumulators, softmax state
vec4 q[G * KPL * CH];
vec4 acc[G * VPL * CH];
float m[G], l[G];

// one key: scores of the G heads (partial dots summed over the subgroup), online softmax update,
// V accumulation. Lanes whose chunk lies past the row's end (DK4 or DV4 not a multiple of WG)
// contribute nothing.
void consume(uvec4 kw[KPL], uvec4 vw[VPL]) {
    const uint lane = gl_LocalInvocationID.x;
    float d[G];
    [[unroll]] for (uint g = 0u; g < G; ++g) d[g] = 0.0;
    [[unroll]] for (uint i = 0u; i < KPL; ++i) {
        vec4 kx[CH];
        unpack_chunk(kw[i], kx);
        const float on = lane + i * WG < DK4 ? 1.0 : 0.0;
        [[unroll]] for (uint g = 0u; g < G; ++g)
            [[unroll]] for (uint e = 0u; e < CH; ++e) d[g] += on * dot(q[(g * KPL + i) * CH + e], kx[e]);
    }
    float alpha[G], p[G];
    [[unroll]] for (uint g = 0u; g < G; ++g) {
        const float s = subgroupAdd(d[g]);
        const float mn = max(m[g], s);
        alpha[g] = exp2(m[g] - mn);
        p[g] = exp2(s - mn);
        l[g] = l[g] * alpha[g] + p[g];
        m[g] = mn;
    }
    [[unroll]] for (uint i = 0u; i < VPL; ++i) {
        vec4 vx[CH];
        unpack_chunk(vw[i], vx);
        [[unroll]] for (uint g = 0u; g < G; ++g)
            [[unroll]] for (uint e = 0u; e < CH; ++e) {
                const uint a = (g * VPL + i) * CH + e;
                acc[a] = acc[a] * alpha[g] + p[g] * vx[e];
            }
    }
}

void main() {
    const uint sp = gl_WorkGroupID.x, h = gl_WorkGroupID.z, lane = gl_LocalInvocationID.x;
    const uint splits = gl_NumWorkGroups.x, nrows_out = gl_NumWorkGroups.z * G;
    const uint past = params[0], n_new = params[1];
    const float qscale = uintBitsToFloat(params[3]);
    const uint chunk = params[4];
    const uint T = past + n_new;

    if (params[5] != 0u) {   // fused append: split sp stores new rows sp, sp+splits, ... of head h
        const uint cap = params[6];
        for (uint r = sp; r < n_new; r += splits) {
            for (uint c = lane; c < DK4; c += WG) kc[(h * cap + past + r) * DK4 + c] = row_chunk(true, h, past + r, past, c);
            for (uint c = lane; c < DV4; c += WG) vc[(h * cap + past + r) * DV4 + c] = row_chunk(false, h, past + r, past, c);
        }
    }

    [[unroll]] for (uint g = 0u; g < G; ++g)
        [[unroll]] for (uint i = 0u; i < KPL; ++i) {
            const uint c = lane + i * WG;
            [[unroll]] for (uint e = 0u; e < CH; ++e)
                q[(g * KPL + i) * CH + e] = c < DK4 ? qbuf[(h * G + g) * PK + c * CH + e] * qscale : vec4(0.0);
        }
    [[unroll]] for (uint i = 0u; i < G * VPL * CH; ++i) acc[i] = vec4(0.0);
    [[unroll]] for (uint g = 0u; g < G; ++g) { m[g] = NEG_INF; l[g] = 0.0; }

    const uint k0 = min(T, sp * chunk), k1 = min(T, k0 + chunk);
    const uint cap = params[6];
    // keys already in the cache: plain loads (lanes past a row's end re-read its last chunk)
    for (uint j = k0; j < min(k1, past); ++j) {
        uvec4 kw[KPL], vw[VPL];
        [[unroll]] for (uint i = 0u; i < KPL; ++i) kw[i] = kc[(h * cap + j) * DK4 + min(lane + i * WG, DK4 - 1u)];
        [[unroll]] for (uint i = 0u; i < VPL; ++i) vw[i] = vc[(h * cap + j) * DV4 + min(lane + i * WG, DV4 - 1u)];
        consume(kw, vw);
    }
    // keys this call appends (forward): read from the new rows, rounded as the cache stores them
    for (uint j = max(k0, past); j < k1; ++j) {
        uvec4 kw[KPL], vw[VPL];
        [[unroll]] for (uint i = 0u; i < KPL; ++i) kw[i] = row_chunk(true, h, j, past, lane + i * WG);
        [[unroll]] for (uint i = 0u; i < VPL; ++i) vw[i] = row_chunk(false, h, j, past, lane + i * WG);
        consume(kw, vw);
    }

    [[unroll]] for (uint g = 0u; g < G; ++g) {
        const uint row = sp * nrows_out + h * G + g;
        [[unroll]] for (uint i = 0u; i < VPL; ++i) {
            const uint c = lane + i * WG;
            if (c < DV4)
                [[unroll]] for (uint e = 0u; e < CH; ++e) part[row * PV + c * CH + e] = acc[(g * VPL + i) * CH + e];
        }
        if (lane == 0u) mlbuf[row] = vec2(m[g], l[g]);
    }
}
