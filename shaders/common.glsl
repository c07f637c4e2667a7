// common.glsl -- storage helpers shared by every vkattn kernel.
//
// Cache layout (both K and V, every format):
//   cache[h, j, :] for h in [0, HKV), j in [0, CAP) is row (h * CAP + j) of a flat array of
//   uvec4 words.  A row holds one head's vector for one position, padded with zeros to a whole
//   number of uvec4 (16 bytes): DK4 uvec4 per K row, DV4 per V row.  Positions of one head are
//   contiguous, so a split-K workgroup streams one contiguous byte range per head.
//
//   KV_I8 = 1: a uvec4 holds 16 int8 (low byte first) and every row has a float32 scale in a
//              separate buffer (symmetric, per position and head: value = int8 * scale).
//   KV_F16 = 1: a uvec4 holds 8 halves (two per uint, low half first), numpy's float16 bits.
//   KV_BF16 = 1: a uvec4 holds 8 bfloat16 (two per uint, low first): the top 16 bits of float32,
//              rounded as vkattn.reference.bfloat16_bits (float_to_bf16).
//   KV_FP8 = 1 (e4m3, "fn": no Inf) or 2 (e5m2): a uvec4 holds 16 fp8 bytes (four per uint, low
//              byte first), vkattn.reference.fp8_bits of value / scale with one float32 scale per
//              kv head for K and one for V, fixed at cache creation, in the kscale / vscale
//              buffers (HKV floats each); value = decode(byte) * scale, applied by the kernels
//              after the dot product (K) and to the softmax weight (V), as int8's row scales.
//   KV_Q4 = 1: a uvec4 holds two blocks of 16 values as 4-bit unsigned integers 0 .. 15 (8
//              nibbles per uint, low nibble first; block b of a row covers elements 16b ..
//              16b+15, uints 2b % 4 and 2b % 4 + 1 of word b / 2; zeros past the head dim),
//              vkattn.reference.quantize_q4. A row is DK4 such data words followed by
//              (DK4 + 1) / 2 parameter words: block b's parameter P is component b % 4 of word
//              b / 4 (unused components 0), its scale the float32 with
//              bits (P >> 13) << 12 and its zero point z the 13-bit two's complement P & 0x1fff;
//              value = (q - z) * scale, exact in float32 (q4_param). Padding past the head dim
//              holds the nibble of 0 (z). Q4_ROW(D4) is the row's stride in words.
//   otherwise: a uvec4 holds 4 float32 bit patterns.
// One format define is 1 (vkattn.formats.FORMATS lists them); a format sets CH below and its
// load (unpack_chunk) and store (pack_chunk), and the kernels follow from those.
//
// Host-side float32 rows (new K/V, queries) are padded to the same width: CH vec4 per uvec4.
#ifndef KV_F16
#error "KV_F16 must be defined (0 or 1)"
#endif
#ifndef KV_I8
#define KV_I8 0
#endif
#ifndef KV_BF16
#define KV_BF16 0
#endif
#if KV_BF16 && (KV_F16 || KV_I8)
#error "KV_BF16 excludes KV_F16 and KV_I8"
#endif
#ifndef KV_FP8
#define KV_FP8 0
#endif
#if KV_FP8 && (KV_F16 || KV_I8 || KV_BF16)
#error "KV_FP8 excludes KV_F16, KV_I8 and KV_BF16"
#endif
#if KV_FP8 > 2
#error "KV_FP8 is 1 (e4m3) or 2 (e5m2)"
#endif
#ifndef KV_Q4
#define KV_Q4 0
#endif
#if KV_Q4 && (KV_F16 || KV_I8 || KV_BF16 || KV_FP8)
#error "KV_Q4 excludes the other formats"
#endif
// words per stored row of D4 data words (q4: the scale words after them)
#if KV_Q4
#define Q4_ROW(d4) ((d4) + ((d4) + 1u) / 2u)
#else
#define Q4_ROW(d4) (d4)
#endif
#ifndef HALF_NATIVE
#define HALF_NATIVE 0   // 1: unpackHalf2x16 (GPUs convert halves in one instruction, or fold the
#endif                  // conversion into v_fma_mix): exact for normal halves and zeros, half
                        // subnormals as the driver's float16 denormal mode says; 0: halves_to_float,
                        // exact on every driver (lavapipe, append). The integer form on RADV navi21
                        // costs the decode key loop 70 -> 390 VALU and 2 waves: not used on GPUs.

#if KV_Q4
#define CH 8u
#elif KV_I8 || KV_FP8
#define CH 4u
#elif KV_F16 || KV_BF16
#define CH 2u
#else
#define CH 1u
#endif

#define NEG_INF uintBitsToFloat(0xff800000u)
#define LOG2E 1.4426950408889634
#define LN2 0.6931471805599453

// uvec4 storage word -> CH float vec4
#if KV_F16
// Exact float16 <-> float32 with integer arithmetic on the bits, the same on every conforming
// driver: GLSL leaves packHalf2x16's rounding to the implementation (RADV: v_cvt_pkrtz_f16_f32,
// round toward zero) and lets a driver flush denormals in any float operation (a half subnormal
// decoded as a float32 denormal times 2^112 comes back 0 on Mesa 26's lavapipe).
//
// half bits (low 16 bits of each component) -> float32. Normal halves: exponent rebiased
// (15 -> 127) in the bits; subnormal halves (exponent field 0): mantissa * 2^-24, an exact
// int -> float conversion and a product that is a normal float32 (>= 2^-24), so nothing a driver
// may flush; zeros keep their sign. The cache holds no Inf/NaN (rejected at the door).
vec4 halves_to_float(uvec4 h) {
    const uvec4 t = (h & 0x7fffu) << 13;                          // exponent and mantissa, float32 places
    const vec4 sub = vec4(h & 0x3ffu) * 5.9604644775390625e-8;    // 2^-24
    const uvec4 mag = mix(floatBitsToUint(sub), t + 0x38000000u, greaterThanEqual(t, uvec4(0x00800000u)));
    return uintBitsToFloat(mag | ((h & 0x8000u) << 16));
}

// float32 -> half bits, rounded to nearest even as numpy's astype(float16) rounds: |x| >= 65520
// -> Inf, half subnormals rounded once (not via float32), float32 denormals -> signed zero. Finite
// x only (NaN is rejected at the door; it would give Inf).
uvec4 float_to_halves(vec4 x) {
    const uvec4 f = floatBitsToUint(x);
    const uvec4 a = f & 0x7fffffffu;
    // |x| >= 2^-14: drop 13 mantissa bits; adding 0xfff plus the lowest kept bit rounds half to
    // even, and a carry runs into the exponent, up to Inf (0x7c00) and no further
    const uvec4 nrm = min((a - 0x38000000u + 0x0fffu + bitfieldExtract(a, 13, 1)) >> 13, uvec4(0x7c00u));
    // |x| < 2^-14: the half subnormal m * 2^-24 nearest |x|, m = roundEven(|x| * 2^24). The
    // product only moves the exponent (|x| normal: exact, no rounding mode involved; a float32
    // denormal a driver flushes gives 0, its correct m) and roundEven is exact.
    const uvec4 sub = uvec4(roundEven(uintBitsToFloat(a) * 16777216.0));
    return ((f >> 16) & 0x8000u) | mix(sub, nrm, greaterThanEqual(a, uvec4(0x38800000u)));
}
#endif

#if KV_BF16
// float32 -> bfloat16 bits (the low 16 bits of each component), round to nearest, ties to even,
// on the float32 bits alone (vkattn.reference.bfloat16_bits): the 16 dropped bits plus 0x7fff
// plus the lowest kept bit carry into the kept half exactly when they pass half, or equal it
// with an odd kept half; a carry runs into the exponent and, past 0x7f7f8000, to Inf (0x7f80).
// No float operation touches x, so neither the driver's rounding nor its denormal mode enters:
// float32 denormals round to bfloat16 denormals (a driver may flush denormals only in float
// conversions, arithmetic, comparisons and extended instructions; loads and bitcasts keep them).
// NaN (rejected at the door; a device array may hold one) stays a quiet NaN with its sign -- the
// rounding alone would make a NaN with a small payload Inf.
uvec4 float_to_bf16(vec4 x) {
    const uvec4 f = floatBitsToUint(x);
    const uvec4 r = (f + 0x7fffu + bitfieldExtract(f, 16, 1)) >> 16;
    return mix(r, (f >> 16) | 0x40u, greaterThan(f & 0x7fffffffu, uvec4(0x7f800000u)));
}
#endif

#if KV_FP8
// fp8 <-> float32 with integer arithmetic on the bits (vkattn.reference.fp8_bits /
// fp8_to_float32, the same recipe): P mantissa bits, exponent bias, the largest finite pattern
// and exponent, the subnormal step 2^(EMIN - P).
#if KV_FP8 == 1
#define FP8_P 3
#define FP8_BIAS 7
#define FP8_MAXBITS 0x7eu     // 448; 0x7f is NaN (no Inf)
#define FP8_EMAX 8
#define FP8_SUB_STEP 0.001953125             // 2^-9
#else
#define FP8_P 2
#define FP8_BIAS 15
#define FP8_MAXBITS 0x7bu     // 57344; 0x7c is Inf, 0x7d .. 0x7f NaN
#define FP8_EMAX 15
#define FP8_SUB_STEP 1.52587890625e-05       // 2^-16
#endif
#define FP8_EMIN (1 - FP8_BIAS)

// positive float32 bits a (nonzero) -> (m, e), value = m * 2^e, m in [2^23, 2^24): normals take
// their hidden bit, denormals are shifted up to it (bits only: no float operation may flush them)
ivec2 f32_significand(uint a) {
    const bool nrm = a >= 0x00800000u;
    const int lz = nrm ? 0 : 23 - findMSB(a);
    const uint m = nrm ? (a & 0x7fffffu) | 0x800000u : a << lz;
    return ivec2(int(m), nrm ? int(a >> 23) - 150 : -149 - lz);
}

// a kv head's scale (a finite float32 > 0, checked by the host) as fp8_encode takes it
ivec2 fp8_prep(float scale) { return f32_significand(floatBitsToUint(scale)); }

// x / scale rounded once to fp8, nearest even, as the exact real quotient: with significands mx,
// ms (in [2^23, 2^24)) the quotient is (mx / ms) 2^d, in binade e = d or d - 1; in units of half
// its ulp 2^u (u = max(e, EMIN) - P) t = floor(mx 2^sh / ms), sh = d - u + 1 in [0, P + 2]
// wherever the result is used, so mx << sh < 2^29 and t < 2^(P + 3). t and the remainder come
// from a restoring long division over those P + 3 bits (compare, subtract, shift): exact, and no
// division instruction at all -- a driver lowers GLSL's integer `/` through a float reciprocal
// (RADV: v_rcp_iflag_f32), exact by the spec but outside what the numerics audit can check.
// k = t / 2 rounded half to even by the half bit (t odd) and the sticky remainder; the bits are
// (biased exponent - 1) << P plus k, so a rounding carry runs into the exponent. Finite overflow
// saturates to the largest finite value; Inf: e4m3 saturates, e5m2 keeps Inf; NaN -> 0x7f; the
// sign is kept (-0 too); subnormals are kept, anything at most half the smallest one gives 0.
uint fp8_encode(float x, ivec2 s) {
    const uint xb = floatBitsToUint(x), xa = xb & 0x7fffffffu;
    const ivec2 q = f32_significand(max(xa, 1u));
    const uint mx = uint(q.x), ms = uint(s.x);
    const int d = q.y - s.y;
    const int e = d - (mx < ms ? 1 : 0);
    const int sh = clamp(d - (max(e, FP8_EMIN) - FP8_P) + 1, 0, FP8_P + 2);
    uint r = mx << sh, t = 0u;
    for (int i = FP8_P + 2; i >= 0; --i) {
        const uint dv = ms << uint(i);
        const bool ge = r >= dv;
        r -= ge ? dv : 0u;
        t |= ge ? 1u << uint(i) : 0u;
    }
    const uint sticky = r != 0u ? 1u : 0u;
    uint k = t >> 1;
    k += (t & 1u) & (sticky | (k & 1u));
    uint bits = (e >= FP8_EMIN ? uint(e + FP8_BIAS - 1) << FP8_P : 0u) + k;
    bits = e > FP8_EMAX ? FP8_MAXBITS : min(bits, FP8_MAXBITS);
    bits = e < FP8_EMIN - FP8_P - 1 || xa == 0u ? 0u : bits;
#if KV_FP8 == 2
    bits = xa == 0x7f800000u ? 0x7cu : bits;
#else
    bits = xa == 0x7f800000u ? FP8_MAXBITS : bits;
#endif
    bits = xa > 0x7f800000u ? 0x7fu : bits;
    return bits | ((xb >> 24) & 0x80u);
}

uint fp8_pack4(vec4 x, ivec2 s) {
    return fp8_encode(x.x, s) | (fp8_encode(x.y, s) << 8) | (fp8_encode(x.z, s) << 16) | (fp8_encode(x.w, s) << 24);
}

// four fp8 (low byte first) -> their float32 values, unscaled and exact: normals rebias the
// exponent in the bits; subnormals are m * 2^(EMIN - P), an exact int -> float conversion times a
// power of two with a normal result (>= 2^-16: nothing a driver may flush); e4m3's 0x7f is NaN,
// e5m2's exponent field 31 Inf / NaN; zeros keep their sign
vec4 fp8x4_to_float(uint w) {
    const uvec4 b = (uvec4(w) >> uvec4(0u, 8u, 16u, 24u)) & 0xffu;
    const uvec4 mag = b & 0x7fu;
    const uvec4 nrm = (mag << (23 - FP8_P)) + uint((127 - FP8_BIAS) << 23);
    const vec4 sub = vec4(mag) * FP8_SUB_STEP;
    uvec4 f = mix(floatBitsToUint(sub), nrm, greaterThanEqual(mag, uvec4(1u << FP8_P)));
#if KV_FP8 == 1
    f = mix(f, uvec4(0x7fc00000u), equal(mag, uvec4(0x7fu)));
#else
    f = mix(f, 0x7f800000u | ((mag & 3u) << 21), greaterThanEqual(mag, uvec4(0x7cu)));
#endif
    return uintBitsToFloat(f | ((b & 0x80u) << 24));
}

// four fp8 (one uint, low byte first) -> their float16 bit patterns (two uints, low half first),
// by integer operations alone, exact: e5m2 is a half's top byte (Inf and NaN included); e4m3's
// sign and 7 magnitude bits moved into a half's sign and under its exponent give the value times
// 2^-8 (FP8_HALF_SCALE undoes it: a power of two, exact), fp8 subnormals becoming half subnormals,
// and its NaN pattern 0x7f a half NaN (the exponent all ones; not 1.875). attn_coopmat.comp stages
// fp8 rows so into its float16 matrices; HALF_NATIVE kernels convert the halves (fp8x4_native).
#if KV_FP8 == 1
#define FP8_HALF_SCALE 256.0
// two bytes at bits 0 and 16 of a -> two halves: the magnitude shifted under the exponent, the sign
// (bit 7) carried from bit 14 to 15 by adding it once more; 0x7f (NaN) gets the exponent all ones
uint e4m3x2_halves(uint a) {
    const uint nan = (((a & 0x007f007fu) + 0x00010001u) & 0x00800080u) * 0xf8u;
    return ((a + (a & 0x00800080u)) << 7u) | nan;
}
uvec2 fp8x4_halves(uint w) {
    const uint lo = w & 0xffffu, hi = w >> 16;
    return uvec2(e4m3x2_halves((lo | (lo << 8u)) & 0x00ff00ffu), e4m3x2_halves((hi | (hi << 8u)) & 0x00ff00ffu));
}
#else
#define FP8_HALF_SCALE 1.0
uvec2 fp8x4_halves(uint w) {
    return uvec2(((w & 0xffu) << 8u) | ((w & 0xff00u) << 16u), ((w >> 8u) & 0xff00u) | (w & 0xff000000u));
}
#endif

#if HALF_NATIVE
// the same four values through the GPU's half conversion (GPUs convert two halves in one or two
// instructions; the integer form above costs about ten per value), e4m3's times 2^-8
// (FP8_RESTORE, applied by the caller once per key to the dot product and the probability, undoes
// it). Exact for normals and zeros, fp8 subnormals (half subnormals here) as the driver's float16
// denormal mode says, as float16's HALF_NATIVE decode
#define FP8_RESTORE FP8_HALF_SCALE
// Bytes 0 and 2, and 1 and 3, go into two pairs of halves (one mask, or a shift and a mask, where
// fp8x4_halves' in-order pairs take four operations each), converted and put back in order.
// e4m3: the sign carried from bit 7 to 8 by adding it once more, the magnitude under the half's
// exponent by << 7; a NaN byte (magnitude 0x7f, flagged for all four bytes at once) sets bit 7
// first, which becomes the exponent's top bit: all ones. e5m2: each byte is a half's top byte
vec4 fp8x4_native(uint w) {
    const uint ev = w & 0x00ff00ffu, od = (w >> 8u) & 0x00ff00ffu;
#if KV_FP8 == 1
    const uint nan = ((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u;
    const uint he = ((ev + (ev & 0x00800080u)) | (nan & 0x00800080u)) << 7u;
    const uint ho = ((od + (od & 0x00800080u)) | ((nan >> 8u) & 0x00800080u)) << 7u;
#else
    const uint he = ev << 8u, ho = od << 8u;
#endif
    const vec2 e = unpackHalf2x16(he), o = unpackHalf2x16(ho);
    return vec4(e.x, o.x, e.y, o.y);
}
#else
#define FP8_RESTORE 1.0
vec4 fp8x4_native(uint w) { return fp8x4_to_float(w); }
#endif

// CH float vec4 -> a storage word, each value / scale (fp8_prep) rounded to fp8
uvec4 pack_chunk_fp8(vec4 x[CH], ivec2 s) {
    return uvec4(fp8_pack4(x[0], s), fp8_pack4(x[1], s), fp8_pack4(x[2], s), fp8_pack4(x[3], s));
}
#endif

// four int8 (low byte first) <-> a float vec4 of integers -127 .. 127
vec4 unpack_i8x4(uint w) { return vec4((ivec4(w) << ivec4(24, 16, 8, 0)) >> 24); }

uint pack_i8x4(vec4 x) {
    const uvec4 b = uvec4(ivec4(x) & 0xff);
    return b.x | (b.y << 8) | (b.z << 16) | (b.w << 24);
}

// eight nibbles (low first) <-> two float vec4 of integers 0 .. 15
void unpack_q4x8(uint w, out vec4 a, out vec4 b) {
    a = vec4((uvec4(w) >> uvec4(0, 4, 8, 12)) & 0xfu);
    b = vec4((uvec4(w) >> uvec4(16, 20, 24, 28)) & 0xfu);
}

uint pack_q4x8(vec4 a, vec4 b) {
    const uvec4 x = uvec4(ivec4(a) & 0xf), y = uvec4(ivec4(b) & 0xf);
    return x.x | (x.y << 4) | (x.z << 8) | (x.w << 12) | (y.x << 16) | (y.y << 20) | (y.z << 24) | (y.w << 28);
}

// (KV_I8: the int8 values, still to be multiplied by the row's scale; KV_FP8: the fp8 values,
// still to be multiplied by the kv head's scale; KV_Q4: the block's nibbles 0 .. 15, still to
// have its zero point subtracted and to be multiplied by its scale)
void unpack_chunk(uvec4 w, out vec4 x[CH]) {
#if KV_Q4
    for (uint e = 0u; e < 4u; ++e) unpack_q4x8(w[e], x[2u * e], x[2u * e + 1u]);
#elif KV_I8
    for (uint e = 0u; e < 4u; ++e) x[e] = unpack_i8x4(w[e]);
#elif KV_FP8
    for (uint e = 0u; e < 4u; ++e) x[e] = fp8x4_to_float(w[e]);
#elif KV_BF16
    // bfloat16 -> float32: the bits moved into the top half (exact; no float operation)
    x[0] = uintBitsToFloat(uvec4(w.x << 16, w.x & 0xffff0000u, w.y << 16, w.y & 0xffff0000u));
    x[1] = uintBitsToFloat(uvec4(w.z << 16, w.z & 0xffff0000u, w.w << 16, w.w & 0xffff0000u));
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

// CH float vec4 -> uvec4 storage word (fp16, bf16: round to nearest even; KV_I8: x holds the
// quantised integers -127 .. 127, see quantise; KV_FP8: see pack_chunk_fp8, not this)
uvec4 pack_chunk(vec4 x[CH]) {
#if KV_Q4
    return uvec4(pack_q4x8(x[0], x[1]), pack_q4x8(x[2], x[3]), pack_q4x8(x[4], x[5]), pack_q4x8(x[6], x[7]));
#elif KV_I8 || KV_FP8
    return uvec4(pack_i8x4(x[0]), pack_i8x4(x[1]), pack_i8x4(x[2]), pack_i8x4(x[3]));
#elif KV_BF16
    const uvec4 a = float_to_bf16(x[0]), b = float_to_bf16(x[1]);
    return uvec4(a.x | (a.y << 16), a.z | (a.w << 16), b.x | (b.y << 16), b.z | (b.w << 16));
#elif KV_F16
    const uvec4 a = float_to_halves(x[0]), b = float_to_halves(x[1]);
    return uvec4(a.x | (a.y << 16), a.z | (a.w << 16), b.x | (b.y << 16), b.z | (b.w << 16));
#else
    return floatBitsToUint(x[0]);
#endif
}

// KV_I8 symmetric quantisation of a row with max |x| = amax (numpy: vkattn.reference.quantize_int8):
// scale = amax / 127 correctly rounded to float32 (round to nearest even), q = the integer nearest
// the exact quotient x / scale (ties to even), clamped to -127 .. 127. A row whose amax is 0 or a
// float32 denormal (which a driver may flush in max()) is a zero row: scale 0 and q 0. Both are
// computed with integer arithmetic on the bits -- GLSL's float division is only 2.5 ULP accurate
// (RADV: a multiply by 1/127, v_rcp_f32) -- so every conforming driver stores the same bits.
float quant_scale(float amax) {
    const uint a = floatBitsToUint(amax) & 0x7fffffffu;
    if (a < 0x00800000u) return 0.0;
    const uint e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;   // amax = m * 2^(e - 150)
    // e >= 8: a normal scale q * 2^(e - k - 150) with q = round(m * 2^k / 127) a 24-bit integer
    // (k = 7, or 6 where m * 2^7 / 127 reaches 2^24); its bits are ((e - k - 1) << 23) + q, a
    // rounding carry to 2^24 included. e <= 7: the scale in units of 2^-149 (subnormal, or the
    // smallest normals) is round(m * 2^(e - 1) / 127), and that integer is its bit pattern.
    const uint k = e >= 8u ? (m < 16646144u ? 7u : 6u) : e - 1u;   // 16646144 = 127 * 2^17
    const uint n = m << k;                                          // < 2^31
    uint q = n / 127u;                                              // exact (a constant divisor)
    q += n - q * 127u >= 64u ? 1u : 0u;                             // 127 is odd: never a tie
    return uintBitsToFloat(e >= 8u ? ((e - k - 1u) << 23) + q : q);
}

// quantise: |x| / scale rounded half to even, exactly. scale = s * 2^(es - 150) with s its 24-bit
// significand (normalised with findMSB if scale is subnormal), |x| = m * 2^(ex - 150) (m < 2^24,
// not normalised for a float32 denormal x). With d = ex - es, 2 |x| / scale = n / s for
// n = m << (d + 1) < 2^32 when -1 <= d <= 7; |x| / scale < 1/2 below (m / s < 2) and, for a
// normal x, at least 128 above (m / s > 1/2; a denormal x never has d > 7, since amax >= 2^-126
// keeps es >= -6). t = floor(n / s) < 512 and the remainder r = n - t * s are exact integers; a
// float estimate only proposes t: n * (an approximate 1/s) is within 2^-10 of n / s, so
// floor(estimate - 2^-9) is t or t - 1, and one exact comparison of the remainder with s decides.
// The approximate 1/s (relative error below 2^-20 on any conforming driver, however it rounds or
// fuses) comes from Newton steps y <- y (2 - s y) from a bit-trick first guess (within 1/8): no
// division and no reciprocal instruction.

// the per-row part, once per scale: (scale bits, s, bits of the approximate 1/s)
// 1/f for an integer f >= 1 below 2^24, relative error below 2^-20 on any conforming driver:
// Newton steps from a bit-trick first guess, no division and no reciprocal instruction
float approx_rcp(float f) {
    float y = uintBitsToFloat(0x7ef311c7u - floatBitsToUint(f));     // 1/f within 1/8
    for (int i = 0; i < 4; ++i) y = y * (2.0 - f * y);                // error 1/8 -> 2^-24 + rounding
    return y;
}

// a / b, rounded down, for integers a < 2^24 and 1 <= b < 2^24 with a quotient below 2^16 (a kv
// head's index), with no division instruction (a driver lowers `/` by a value known only at run
// time through a float reciprocal, outside what the numerics audit can check): the estimate is
// within 1/8 of a / b, so t is floor(a / b) or one less, and the exact remainder decides
uint small_quotient(uint a, uint b) {
    const uint t = uint(max(float(a) * approx_rcp(float(b)) - 0.25, 0.0));
    return a - t * b >= b ? t + 1u : t;
}

uvec3 quant_prep(float scale) {
    const uint sb = floatBitsToUint(scale);
    const int lz = max(23 - findMSB(sb), 0);                          // > 0: subnormal scale (or 0)
    const uint s = sb >= 0x00800000u ? (sb & 0x7fffffu) | 0x800000u : sb << lz;
    return uvec3(sb, s, floatBitsToUint(approx_rcp(float(max(s, 1u)))));
}

// one value, written per component so that a compiler evaluates the values one after another
// (vector code would keep the temporaries of all of them live at once)
float quantise1(float x, uvec3 p) {
    const uint sb = p.x, s = p.y;
    const int es = sb >= 0x00800000u ? int(sb >> 23) : findMSB(sb) - 22;   // 1 - lz
    const uint xb = floatBitsToUint(x), xa = xb & 0x7fffffffu;
    const uint m = xa >= 0x00800000u ? (xa & 0x7fffffu) | 0x800000u : xa;
    const int d = max(int(xa >> 23), 1) - es;
    const uint n = m << clamp(d + 1, 0, 8);
    uint t = uint(max(float(n) * uintBitsToFloat(p.z) - 0.001953125, 0.0));   // t or t - 1
    uint r = n - t * s;
    if (r >= s) { t += 1u; r -= s; }
    // round half to even: up when the fraction is above 1/2 (t odd, r > 0), or exactly 1/2 (t
    // odd, r = 0) with an odd floor
    uint q = (t >> 1) + ((t & 1u) & (r != 0u ? 1u : (t >> 1) & 1u));
    q = d > 7 ? 127u : min(q, 127u);
    q = d < -1 || sb == 0u ? 0u : q;
    return xb >= 0x80000000u ? -float(q) : float(q);
}

vec4 quantise_prep(vec4 x, uvec3 p) {
    return vec4(quantise1(x.x, p), quantise1(x.y, p), quantise1(x.z, p), quantise1(x.w, p));
}

vec4 quantise(vec4 x, float scale) { return quantise_prep(x, quant_prep(scale)); }

// max |x| of a vec4. Exact for quant_scale on any driver: max() returns one of its operands, and
// a driver that flushes denormals changes the row maximum only where it is a float32 denormal,
// which quant_scale treats as a zero row either way
float vmax_abs(vec4 x) { const vec4 a = abs(x); return max(max(a.x, a.y), max(a.z, a.w)); }

// KV_Q4: x / scale rounded half to even, exactly, for a q4 scale (12 significant bits, exponent
// field >= 25; pq = q4_prep of its bits) and |x / scale| < 2^13 (quantize_q4 keeps it at most
// 3856). With |x| = m * 2^(ex - 150) (ex = max(field, 1); no hidden bit for a denormal) and scale
// = qd * 2^(ed - 138) (qd its 12-bit significand), 2 |x| / scale = n / dv with n = m << s, dv = qd
// for s = ex - ed - 11 >= 0, or n = m, dv = qd << -s (below 2^-7 for s < -19: 0); n < 2^27 and
// dv < 2^31. The floor t of n / dv comes as quantise1's does, without a division instruction: a
// float estimate n * (1/qd) * 2^min(s, 0) (relative error below 2^-19: n's rounding to float and
// q4_prep's Newton steps) is within 2^-3 of n / dv (< 2^14), so floor(estimate - 2^-2) is t or
// t - 1, and the exact remainder r = n - t dv decides; then ties to even as quantise1. sb 0: 0.
uvec3 q4_prep(uint sb) {
    const uint qd = ((sb >> 12) & 0x7ffu) | 0x800u;
    return uvec3(sb, qd, floatBitsToUint(approx_rcp(float(qd))));
}

float q4_quot(float x, uvec3 pq) {
    if (pq.x == 0u) return 0.0;
    const uint xb = floatBitsToUint(x), xa = xb & 0x7fffffffu;
    const uint m = xa >= 0x00800000u ? (xa & 0x7fffffu) | 0x800000u : xa;
    const int s = max(int(xa >> 23), 1) - int(pq.x >> 23) - 11;
    if (s < -19) return 0.0;
    const uint n = s >= 0 ? m << min(s, 7) : m, dv = s >= 0 ? pq.y : pq.y << uint(-s);
    const float est = float(n) * uintBitsToFloat(pq.z) * exp2(float(min(s, 0)));
    uint t = uint(max(est - 0.25, 0.0));
    uint r = n - t * dv;
    if (r >= dv) { t += 1u; r -= dv; }
    const uint q = (t >> 1) + ((t & 1u) & (r != 0u ? 1u : (t >> 1) & 1u));
    return xb >= 0x80000000u ? -float(q) : float(q);
}

// KV_Q4 block parameter word (numpy: vkattn.reference.quantize_q4) from the block's lo = min and
// hi = max, on the bits alone: (scale bits >> 12) << 13 | the zero point z as a 13-bit two's
// complement integer. A denormal lo or hi counts as 0 (min() and max() return an operand, or 0
// where a driver flushes it). With E the larger exponent field, each is a signed integer in
// units of 2^(E - 150), its 24-bit significand shifted right by its distance from E (bits
// shifted out dropped): H, L. R = max(H - L, ceil(max(|H|, |L|) / 256)); scale = R * 2^(E -
// 150) / 15 rounded up to 12 significant bits: qd = ceil(R / (15 * 2^j)) = ceil(ceil(R / 2^j) /
// 15) with j the smallest shift that keeps it at most 2^12 (a carry to 2^12 renormalised), scale
// = qd * 2^(E + j - 162),
// exponent field E + j - 12; below 25 (a scale under 2^-102): a zero block, P = 0. z = -(lo /
// scale rounded half to even).
uint q4_param(float lo, float hi) {
    const uint hb = floatBitsToUint(hi), lb = floatBitsToUint(lo);
    const uint eh = (hb >> 23) & 0xffu, el = (lb >> 23) & 0xffu, E = max(eh, el);
    const int mh = eh != 0u ? int((hb & 0x7fffffu) | 0x800000u) : 0;
    const int ml = el != 0u ? int((lb & 0x7fffffu) | 0x800000u) : 0;
    const int h0 = mh >> int(min(E - eh, 31u)), l0 = ml >> int(min(E - el, 31u));
    const int H = hb >= 0x80000000u ? -h0 : h0, L = lb >= 0x80000000u ? -l0 : l0;
    const uint R = uint(max(H - L, (max(abs(H), abs(L)) + 255) >> 8));   // < 2^25
    if (R == 0u) return 0u;
    uint j = uint(max(findMSB(R) - 15, 0));
    if (R > (15u << (12u + j))) j += 1u;
    uint qd = (((R + (1u << j) - 1u) >> j) + 14u) / 15u;                // ceil(R / (15 * 2^j)): a constant divisor
    if (qd == 4096u) { qd = 2048u; j += 1u; }
    const int ed = int(E + j) - 12;
    if (ed < 25) return 0u;
    const uint sb = (uint(ed) << 23) | ((qd << 12) & 0x7fffffu);
    const int z = -int(q4_quot(lo, q4_prep(sb)));
    return ((sb >> 12) << 13) | (uint(z) & 0x1fffu);
}

uint q4_sbits(uint p) { return (p >> 13) << 12; }
float q4_scale(uint p) { return uintBitsToFloat(q4_sbits(p)); }
float q4_zero(uint p) { return float(int(p << 19) >> 19); }

// KV_Q4: the stored integers of x with block parameter word p: x / scale rounded half to even
// (q4_quot) plus the zero point, clamped to 0 .. 15
vec4 quantise_q4(vec4 x, uint p) {
    const uvec3 pq = q4_prep(q4_sbits(p));
    const vec4 t = vec4(q4_quot(x.x, pq), q4_quot(x.y, pq), q4_quot(x.z, pq), q4_quot(x.w, pq));
    return clamp(t + q4_zero(p), vec4(0.0), vec4(15.0));
}

// the block's lo and hi folded over its values (start both at one of them; a partial block's
// zero padding counts as values, as in the reference)
void q4_range(vec4 x, inout float lo, inout float hi) {
    lo = min(lo, min(min(x.x, x.y), min(x.z, x.w)));
    hi = max(hi, max(max(x.x, x.y), max(x.z, x.w)));
}
