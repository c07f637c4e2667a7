#version 450
// append.comp -- write NNEW new K/V rows into the persistent cache, each at its slot.
//
// Contract
//   kc, vc : blocks [*, HKV, BS, DK4|DV4] uvec4 (layout in common.glsl), written in place; slot s
//            is row s % BS of block s / BS, as in gather_slots.comp
//            KVCache: one block of BS = capacity rows, slot = position
//            PagedKVCache: slot = table[pos / BS]*BS + pos % BS (paging.AppendPlan.slots)
//   nk, nv : new rows, float32 [HKV, NNEW, DK4*CH|DV4*CH] vec4, zero padded
//   slots  : [r] slot of new row r (distinct slots); a plan is built for exactly NNEW rows
//   rope_tab: ROPE_K: rotary table row r for the position of new row r (rope.glsl)
//   kscale, vscale: KV_I8: float32 scale of each cache row (common.glsl, quantise)
// numpy:  K[:, slots] = k_new.astype(storage);  V[:, slots] = v_new.astype(storage)
//         (ROPE_K: k_new = reference.rope(k_new, positions) first)
// Only the NNEW rows per head are touched; the work is O(NNEW), independent of the capacity.
// The caller has checked that every slot lies in the cache before dispatching.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint DK4 = 16u;
layout(constant_id = 2) const uint DV4 = 16u;
layout(constant_id = 3) const uint BS = 1u;
layout(constant_id = 4) const uint HKV = 1u;
layout(constant_id = 5) const uint NNEW = 1u;
layout(constant_id = 6) const uint FLAGS = 0u;
layout(constant_id = 7) const uint ROPE_DIM = 8u;

layout(std430, binding = 0) writeonly buffer KC { uvec4 kc[]; };
layout(std430, binding = 1) writeonly buffer VC { uvec4 vc[]; };
layout(std430, binding = 2) readonly buffer NK { vec4 nk[]; };
layout(std430, binding = 3) readonly buffer NV { vec4 nv[]; };
layout(std430, binding = 4) readonly buffer SLOTS { uint slots[]; };
layout(std430, binding = 5) readonly buffer ROPE { vec4 rope_tab[]; };
layout(std430, binding = 6) writeonly buffer KS { float kscale[]; };   // KV_I8: scale per cache row
layout(std430, binding = 7) writeonly buffer VS { float vscale[]; };

#include "rope.glsl"

// cache row of kv head h for slot s
uint slot_row(uint s, uint h) { return ((s / BS) * HKV + h) * BS + s % BS; }

// vec4 u of new row r of head h, rotated for K with ROPE_K
vec4 new_val(bool is_k, uint h, uint r, uint u) {
    if (!is_k) return nv[(h * NNEW + r) * DV4 * CH + u];
    const uint row = (h * NNEW + r) * DK4 * CH;
    vec4 x = nk[row + u];
    if (HAS(F_ROPE_K)) x = rope_rotate(x, nk[row + rope_partner(u)], u, r);
    return x;
}

void main() {
#if KV_I8
    // one invocation per new row: its scale (max |x|), then its quantised chunks
    const uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < 2u * HKV * NNEW; i += stride) {
        const bool is_k = i < HKV * NNEW;
        const uint hr = is_k ? i : i - HKV * NNEW, h = hr / NNEW, r = hr % NNEW;
        const uint d4 = is_k ? DK4 : DV4;
        float amax = 0.0;
        for (uint u = 0u; u < d4 * CH; ++u) amax = max(amax, vmax_abs(new_val(is_k, h, r, u)));
        const float scale = quant_scale(amax);
        const uint row = slot_row(slots[r], h);
        for (uint c = 0u; c < d4; ++c) {
            vec4 x[CH];
            for (uint e = 0u; e < CH; ++e) x[e] = quantise(new_val(is_k, h, r, c * CH + e), scale);
            if (is_k) kc[row * DK4 + c] = pack_chunk(x);
            else vc[row * DV4 + c] = pack_chunk(x);
        }
        if (is_k) kscale[row] = scale;
        else vscale[row] = scale;
    }
#else
    // invocation i: chunk c of new row r of kv head h, for K (c < DK4) and for V (c < DV4), so a
    // subgroup never runs a K and a V path side by side (SIMD drivers execute both sides of a
    // divergent branch), and every index is a division by a specialisation constant
    const uint NC = DK4 > DV4 ? DK4 : DV4;
    const uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < HKV * NNEW * NC; i += stride) {
        const uint c = i % NC, r = (i / NC) % NNEW, h = i / (NC * NNEW);
        const uint row = slot_row(slots[r], h);
        vec4 x[CH];
        if (c < DK4) {
            const uint src = (h * NNEW + r) * DK4 * CH;
            for (uint e = 0u; e < CH; ++e) {
                const uint u = c * CH + e;
                x[e] = nk[src + u];
                if (HAS(F_ROPE_K)) x[e] = rope_rotate(x[e], nk[src + rope_partner(u)], u, r);
            }
            kc[row * DK4 + c] = pack_chunk(x);
        }
        if (c < DV4) {
            const uint src = ((h * NNEW + r) * DV4 + c) * CH;
            for (uint e = 0u; e < CH; ++e) x[e] = nv[src + e];
            vc[row * DV4 + c] = pack_chunk(x);
        }
    }
#endif
}
