#version 450
// append.comp -- write new K/V rows into the persistent cache, each at a cache row the host gives.
//
// Contract
//   kc, vc : blocks [*, HKV, BS, DK4|DV4] uvec4 (layout in common.glsl), written in place
//   nk, nv : new rows, float32 [HKV, n, DK4*CH|DV4*CH] vec4, zero padded: row hr = h * n + r
//   dst    : [0] count = HKV * n; then for each hr: [1 + 2hr] the cache row of new row r of kv head h
//            (slot s of head h is row ((s / BS) * HKV + h) * BS + s % BS, as gather_slots.comp
//            reads it: KVCache slot = position, PagedKVCache paging.AppendPlan.slots), [2 + 2hr] r,
//            its row in the rotary table; distinct rows, checked by the host
//   rope_tab: ROPE_K: rotary table row r for the position of new row r (rope.glsl)
//   kscale, vscale: KV_I8: float32 scale of each cache row (common.glsl, quantise), written;
//            KV_FP8: float32 scale of each kv head (HKV floats), read
//   KV_Q4  : rows of Q4_ROW(DK4) / Q4_ROW(DV4) words (common.glsl), each block's parameter word
//            (scale and zero point) in the row
//   HKV    : kv heads (KV_FP8: new row hr = h * n + r belongs to kv head h, n = count / HKV)
// numpy:  K[rows] = k_new.astype(storage);  V[rows] = v_new.astype(storage)
//         (ROPE_K: k_new = reference.rope(k_new, positions) first)
// Only the new rows are touched; the work is O(n), independent of the capacity. The row count and
// the slot layout are per-call values, not specialisation constants: one pipeline serves every
// batch size and every capacity of a storage format (fewer pipelines to build).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint DK4 = 16u;
layout(constant_id = 2) const uint DV4 = 16u;
layout(constant_id = 3) const uint FLAGS = 0u;
layout(constant_id = 4) const uint ROPE_DIM = 8u;
layout(constant_id = 5) const uint HKV = 1u;

layout(std430, binding = 0) writeonly buffer KC { uvec4 kc[]; };
layout(std430, binding = 1) writeonly buffer VC { uvec4 vc[]; };
layout(std430, binding = 2) readonly buffer NK { vec4 nk[]; };
layout(std430, binding = 3) readonly buffer NV { vec4 nv[]; };
layout(std430, binding = 4) readonly buffer DST { uint dst[]; };
layout(std430, binding = 5) readonly buffer ROPE { vec4 rope_tab[]; };
#if KV_FP8
layout(std430, binding = 6) readonly buffer KS { float kscale[]; };    // KV_FP8: scale per kv head
layout(std430, binding = 7) readonly buffer VS { float vscale[]; };
#else
layout(std430, binding = 6) writeonly buffer KS { float kscale[]; };   // KV_I8: scale per cache row
layout(std430, binding = 7) writeonly buffer VS { float vscale[]; };
#endif

#include "rope.glsl"

// vec4 u of new row hr, rotated for K with ROPE_K (at rotary-table row t)
vec4 new_val(bool is_k, uint hr, uint u, uint t) {
    if (!is_k) return nv[hr * DV4 * CH + u];
    const uint row = hr * DK4 * CH;
    vec4 x = nk[row + u];
    if (HAS(F_ROPE_K)) x = rope_rotate(x, nk[row + rope_partner(u)], u, t);
    return x;
}

void main() {
    const uint count = dst[0];
    const uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
#if KV_I8
    // one invocation per new row of K or V: its scale (max |x|), then its quantised chunks
    for (uint i = gl_GlobalInvocationID.x; i < 2u * count; i += stride) {
        const bool is_k = i < count;
        const uint hr = is_k ? i : i - count, row = dst[1u + 2u * hr], t = dst[2u + 2u * hr];
        const uint d4 = is_k ? DK4 : DV4;
        float amax = 0.0;
        for (uint u = 0u; u < d4 * CH; ++u) amax = max(amax, vmax_abs(new_val(is_k, hr, u, t)));
        const float scale = quant_scale(amax);
        const uvec3 qp = quant_prep(scale);
        for (uint c = 0u; c < d4; ++c) {
            vec4 x[CH];
            for (uint e = 0u; e < CH; ++e) x[e] = quantise_prep(new_val(is_k, hr, c * CH + e, t), qp);
            if (is_k) kc[row * DK4 + c] = pack_chunk(x);
            else vc[row * DV4 + c] = pack_chunk(x);
        }
        if (is_k) kscale[row] = scale;
        else vscale[row] = scale;
    }
#elif KV_Q4
    // invocation i: data word c (blocks 2c, 2c + 1) of new row hr, for K and for V, as below; it
    // writes the word and its blocks' components of the row's parameter words (the last word also
    // zeroes the unused components, so a row's bytes are fully defined)
    const uint NC = DK4 > DV4 ? DK4 : DV4;
    for (uint i = gl_GlobalInvocationID.x; i < count * NC; i += stride) {
        const uint c = i % NC, hr = i / NC;
        const uint row = dst[1u + 2u * hr], t = dst[2u + 2u * hr];
        vec4 x[CH];
        for (uint pass = 0u; pass < 2u; ++pass) {
            const bool is_k = pass == 0u;
            const uint d4 = is_k ? DK4 : DV4;
            if (c >= d4) continue;
            for (uint e = 0u; e < CH; ++e) x[e] = new_val(is_k, hr, c * CH + e, t);
            uvec2 pw;
            for (uint half_ = 0u; half_ < 2u; ++half_) {          // block 2c + half_: x[4 half_ ..]
                float lo = x[4u * half_].x, hi = lo;
                for (uint e = 0u; e < 4u; ++e) q4_range(x[4u * half_ + e], lo, hi);
                pw[half_] = q4_param(lo, hi);
                for (uint e = 0u; e < 4u; ++e) x[4u * half_ + e] = quantise_q4(x[4u * half_ + e], pw[half_]);
            }
            const uint base = row * Q4_ROW(d4), pc = 2u * c;
            const uvec4 w = pack_chunk(x);
            if (is_k) {
                kc[base + c] = w;
                kc[base + DK4 + pc / 4u][pc % 4u] = pw.x;
                kc[base + DK4 + pc / 4u][pc % 4u + 1u] = pw.y;
                if (c == DK4 - 1u && pc % 4u == 0u) kc[base + DK4 + pc / 4u].zw = uvec2(0u);
            } else {
                vc[base + c] = w;
                vc[base + DV4 + pc / 4u][pc % 4u] = pw.x;
                vc[base + DV4 + pc / 4u][pc % 4u + 1u] = pw.y;
                if (c == DV4 - 1u && pc % 4u == 0u) vc[base + DV4 + pc / 4u].zw = uvec2(0u);
            }
        }
    }
#else
    // invocation i: chunk c of new row hr, for K (c < DK4) and for V (c < DV4), so a subgroup never
    // runs a K and a V path side by side (SIMD drivers execute both sides of a divergent branch),
    // and every index is a division by a specialisation constant
    const uint NC = DK4 > DV4 ? DK4 : DV4;
    for (uint i = gl_GlobalInvocationID.x; i < count * NC; i += stride) {
        const uint c = i % NC, hr = i / NC;
        const uint row = dst[1u + 2u * hr], t = dst[2u + 2u * hr];
        vec4 x[CH];
#if KV_FP8
        const uint h = small_quotient(hr, count / HKV);     // HKV: a constant; no division by a run-time value
#endif
        if (c < DK4) {
            for (uint e = 0u; e < CH; ++e) x[e] = new_val(true, hr, c * CH + e, t);
#if KV_FP8
            kc[row * DK4 + c] = pack_chunk_fp8(x, fp8_prep(kscale[h]));
#else
            kc[row * DK4 + c] = pack_chunk(x);
#endif
        }
        if (c < DV4) {
            for (uint e = 0u; e < CH; ++e) x[e] = new_val(false, hr, c * CH + e, t);
#if KV_FP8
            vc[row * DV4 + c] = pack_chunk_fp8(x, fp8_prep(vscale[h]));
#else
            vc[row * DV4 + c] = pack_chunk(x);
#endif
        }
    }
#endif
}
