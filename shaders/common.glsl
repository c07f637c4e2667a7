// common.glsl -- storage helpers shared by every vkattn kernel.
//
// Cache layout (both K and V, both dtypes):
//   cache[h, j, :] for h in [0, HKV), j in [0, CAP) is row (h * CAP + j) of a flat array of
//   uvec4 words.  A row holds one head's vector for one position, padded with zeros to a whole
//   number of uvec4 (16 bytes): DK4 uvec4 per K row, DV4 per V row.  Positions of one head are
//   contiguous, so a split-K workgroup streams one contiguous byte range per head.
//
//   KV_I8 = 1: a uvec4 holds 16 int8 (low byte first) and every row has a float32 scale in a
//              separate buffer (symmetric, per position and head: value = int8 * scale).
//   KV_F16 = 1: a uvec4 holds 8 halves (packHalf2x16 pairs, low half first).
//   KV_F16 = 0: a uvec4 holds 4 float32 bit patterns.
//
// Host-side float32 rows (new K/V, queries) are padded to the same width: CH vec4 per uvec4.
#ifndef KV_F16
#error "KV_F16 must be defined (0 or 1)"
#endif
#ifndef KV_I8
#define KV_I8 0
#endif
#ifndef HALF_NATIVE
#define HALF_NATIVE 0   // 1: unpackHalf2x16 (GPUs convert halves in one instruction); 0: the integer
#endif                  // form below (llvmpipe)

#if KV_I8
#define CH 4u
#elif KV_F16
#define CH 2u
#else
#define CH 1u
#endif

#define NEG_INF uintBitsToFloat(0xff800000u)
#define LOG2E 1.4426950408889634
#define LN2 0.6931471805599453

// uvec4 storage word -> CH float vec4
#if KV_F16
// IEEE half -> float for finite values with integer ops (attn_lane.comp, append: lavapipe): move exponent and mantissa into place
// and rescale by 2^112 (this also turns half subnormals into the right floats). The cache holds no
// Inf/NaN (rejected at the door).
vec4 halves_to_float(uvec4 h) {
    const vec4 mag = uintBitsToFloat((h & 0x7fffu) << 13) * 5.192296858534828e33;   // 2^112
    return uintBitsToFloat(floatBitsToUint(mag) | ((h & 0x8000u) << 16));
}
#endif

// four int8 (low byte first) <-> a float vec4 of integers -127 .. 127
vec4 unpack_i8x4(uint w) { return vec4((ivec4(w) << ivec4(24, 16, 8, 0)) >> 24); }

uint pack_i8x4(vec4 x) {
    const uvec4 b = uvec4(ivec4(x) & 0xff);
    return b.x | (b.y << 8) | (b.z << 16) | (b.w << 24);
}

// (KV_I8: the int8 values, still to be multiplied by the row's scale)
void unpack_chunk(uvec4 w, out vec4 x[CH]) {
#if KV_I8
    for (uint e = 0u; e < 4u; ++e) x[e] = unpack_i8x4(w[e]);
#elif KV_F16 && HALF_NATIVE
    x[0] = vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y));
    x[1] = vec4(unpackHalf2x16(w.z), unpackHalf2x16(w.w));
#elif KV_F16
    x[0] = halves_to_float(uvec4(w.x & 0xffffu, w.x >> 16, w.y & 0xffffu, w.y >> 16));
    x[1] = halves_to_float(uvec4(w.z & 0xffffu, w.z >> 16, w.w & 0xffffu, w.w >> 16));
#else
    x[0] = uintBitsToFloat(w);
#endif
}

// CH float vec4 -> uvec4 storage word (fp16: round to nearest even; KV_I8: x holds the
// quantised integers -127 .. 127, see quantise)
uvec4 pack_chunk(vec4 x[CH]) {
#if KV_I8
    return uvec4(pack_i8x4(x[0]), pack_i8x4(x[1]), pack_i8x4(x[2]), pack_i8x4(x[3]));
#elif KV_F16
    return uvec4(packHalf2x16(x[0].xy), packHalf2x16(x[0].zw),
                 packHalf2x16(x[1].xy), packHalf2x16(x[1].zw));
#else
    return floatBitsToUint(x[0]);
#endif
}

// KV_I8 symmetric quantisation of a row with max |x| = amax: scale = amax / 127, q = roundEven(x /
// scale) (numpy: vkattn.reference.quantize_int8); a zero row has scale 0 and q 0
float quant_scale(float amax) { return amax / 127.0; }

vec4 quantise(vec4 x, float scale) {
    return scale > 0.0 ? clamp(roundEven(x / scale), -127.0, 127.0) : vec4(0.0);
}

float vmax_abs(vec4 x) { const vec4 a = abs(x); return max(max(a.x, a.y), max(a.z, a.w)); }
