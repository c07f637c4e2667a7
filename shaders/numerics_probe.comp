#version 450
// numerics_probe.comp -- the storage conversions of common.glsl on their own: the float16 and
// bfloat16 encoders and decoders and the int8 quantiser that append.comp, attn.comp and
// attn_lane.comp store and load K/V with, run on given bits. tests/test_exact.py compares them bit
// for bit with numpy on inputs built to catch a wrong rounding; `python -m perf gpu` audits their
// GPU code (numerics audit).
//
// Contract (one pipeline per MODE define, with the storage defines of common.glsl)
//   params[0] = n: the number of items; workgroups of WG invocations, one item per invocation
//   MODE 0 (KV_F16=1): item i: float32 inv[2i], inv[2i+1] (8 values, as uvec4 of bits) -> out[i]
//                      = pack_chunk: 8 halves, low half first.  numpy: x.astype(float16)
//                      (KV_BF16=1: 8 bfloat16.  numpy: vkattn.reference.bfloat16_bits)
//   MODE 1 (KV_F16=1, HALF_NATIVE 0 or 1): item i: inv[i] (8 halves) -> out[2i], out[2i+1] = the
//                      float32 bits of unpack_chunk.  numpy: h.view(float16).astype(float32)
//                      (KV_BF16=1: 8 bfloat16.  numpy: vkattn.reference.bfloat16_to_float32)
//   MODE 2 (KV_I8=1): item i: a row of 16*D16 float32, inv[4*D16*i ..] -> out[D16*i ..] its int8
//                      words (low byte first) and scale[i] its float32 scale bits, as append.comp
//                      stores them.  numpy: vkattn.reference.quantize_int8
//   MODE 3 (KV_FP8=1|2): item i: 16 float32 inv[4i .. 4i+3] -> out[i] = pack_chunk_fp8 with the
//                      scale whose bits are params[1]: 16 fp8 bytes, low byte first.
//                      numpy: vkattn.reference.fp8_bits(x, fmt, scale)
//   MODE 4 (KV_FP8=1|2, HALF_NATIVE 0 or 1): item i: inv[i] (16 fp8) -> out[4i .. 4i+3] = the
//                      float32 bits of unpack_chunk (unscaled; HALF_NATIVE: of fp8x4_native times
//                      FP8_RESTORE, attn.comp's decode).  numpy: vkattn.reference.fp8_to_float32
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint D16 = 1u;    // MODE 2: uvec4 words (16 int8) per row

layout(std430, binding = 0) readonly buffer PARAMS { uint params[]; };
layout(std430, binding = 1) readonly buffer IN { uvec4 inv[]; };
layout(std430, binding = 2) writeonly buffer OUT { uvec4 outv[]; };
layout(std430, binding = 3) writeonly buffer SCALE { uint scale_bits[]; };

void main() {
    const uint i = gl_GlobalInvocationID.x;
    if (i >= params[0]) return;
#if MODE == 0
    vec4 x[CH];
    x[0] = uintBitsToFloat(inv[2u * i]);
    x[1] = uintBitsToFloat(inv[2u * i + 1u]);
    outv[i] = pack_chunk(x);
#elif MODE == 1
    vec4 x[CH];
    unpack_chunk(inv[i], x);
    outv[2u * i] = floatBitsToUint(x[0]);
    outv[2u * i + 1u] = floatBitsToUint(x[1]);
#elif MODE == 2
    const uint row = 4u * D16 * i;
    float amax = 0.0;
    for (uint u = 0u; u < 4u * D16; ++u) amax = max(amax, vmax_abs(uintBitsToFloat(inv[row + u])));
    const float scale = quant_scale(amax);
    for (uint c = 0u; c < D16; ++c) {
        vec4 x[CH];
        for (uint e = 0u; e < CH; ++e) x[e] = quantise(uintBitsToFloat(inv[row + c * CH + e]), scale);
        outv[D16 * i + c] = pack_chunk(x);
    }
    scale_bits[i] = floatBitsToUint(scale);
#elif MODE == 3
    vec4 x[CH];
    for (uint e = 0u; e < CH; ++e) x[e] = uintBitsToFloat(inv[4u * i + e]);
    outv[i] = pack_chunk_fp8(x, fp8_prep(uintBitsToFloat(params[1])));
#elif MODE == 4
    vec4 x[CH];
#if HALF_NATIVE
    for (uint e = 0u; e < CH; ++e) x[e] = fp8x4_native(inv[i][e]) * FP8_RESTORE;
#else
    unpack_chunk(inv[i], x);
#endif
    for (uint e = 0u; e < CH; ++e) outv[4u * i + e] = floatBitsToUint(x[e]);
#else
#error "MODE must be 0 .. 4"
#endif
}
