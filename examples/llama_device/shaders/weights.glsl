// weights.glsl -- how linear.comp and embed.comp read a UNIT-weight piece of a weight row, for
// each storage format (define one, or none for float32):
//   W_F16   float16, two per uint32 word (low half first): a piece of 8 is one uvec4
//   W_Q4_1  blocks of 32: 4 code words and a parameter word (quant.py): d * code + m, computed
//           as the gguf package does
//   W_Q8_0  blocks of 32: 8 code words and a parameter word (quant.py): d * code
//   (a block format's row: its blocks' code words, then their parameter words, padded to a
//   multiple of 4 words: quant.row_words; where the rows sit: wtex / ptex below)
//   (none)  float32: a piece of 8 is two vec4
// Contract: W is declared here at binding 0 (a storage buffer "Wb", or with W_TEXEL a usamplerBuffer); K (row length, a multiple of UNIT)
// must be a constant declared before the include. piece c of row `row` is weights
// c*UNIT .. c*UNIT+UNIT-1.
//   load_piece(row, c, wv)       numpy: wv = W[row, c*UNIT:(c+1)*UNIT].reshape(UNIT // 4, 4)
//   prep_x(xv) -> xs; load_codes(row, c, wq) -> dm; codes_dot(wq, dm, xv, xs) (or
//   codes_sum(dm, s, xs) over the sum s of wq[i] . xv[i] taken in order elsewhere)
//                                numpy: W[row, c*UNIT:(c+1)*UNIT] @ x_piece (xv: x_piece as
//                                vec4s, prepared once per token and piece for every row; wq, dm
//                                the row's piece, loaded once for every token)
// codes_dot never materialises the dequantised weights where a block format lets it factor them
// out: Q4_1 sum(x * (d * q + m)) = d * sum(q * x) + m * sum(x) (sum(x): prep_x's xs, once for
// all rows), its nibbles read in place -- nibble k of a word as (word & (15 << 4k)) = q * 16^k,
// against x * 16^-k prepared once, so q * x rounds as it would without the scalings and needs no
// shift (powers of two commute with rounding while x * 2^-28 stays normal: |x| >= 2^-98); Q8_0 d * sum(q * x), byte k as (word << (24 - 8k)) & 0xff000000
// = q * 2^24 (signed) against x * 2^-24. Products and sums are float32; the order differs from
// a dot over dequantised weights by roundings only (the weights themselves are exactly the
// blocks' values).
// W_TEXEL: W is a uniform texel buffer instead of a storage buffer (vkattn.algorithm binds it,
// four words a texel), read by texelFetch -- CPU drivers load a texel buffer by vector gathers, a
// storage buffer by a per-lane loop (lavapipe: 0.11 against 0.39 ns a word). W4(i): words
// 4i .. 4i+3 in every format
#ifdef W_TEXEL
layout(binding = 0) uniform usamplerBuffer wt;
#define W4(i) texelFetch(wt, int(i))
#else
layout(std430, binding = 0) readonly buffer Wb { uvec4 w[]; };
#define W4(i) w[i]
#endif
#if defined(W_Q4_1) || defined(W_Q8_0)
#define UNIT 32
#else
#define UNIT 8
#endif
#define V4 (UNIT / 4)
#define PIECES (K / UNIT)
#if defined(W_Q4_1) || defined(W_F16)
#define WT 1u                       // texels a piece of a row (its codes, for the block formats)
#else
#define WT 2u
#endif
#if defined(W_Q4_1) || defined(W_Q8_0)
#define WP ((PIECES + 3u) / 4u)     // parameter texels a row (4 blocks' parameter words each)
#else
#define WP 0u
#endif

// wtex(row, c, t): the texel index of texel t of row `row`'s piece c; ptex(row, c): of the texel
// whose component c % 4 is the piece's parameter word (block formats). Row-major (quant.py's
// rows one after another), or with W_LANES / W_RPL (CPU drivers, the decode's layout: W_LANES
// lanes of a SIMD vector, each with W_RPL consecutive rows) each group of W_LANES * W_RPL rows
// interleaved in the order those lanes read it (quant.interleave): piece c's texels of the
// group's rows in (row within the lane, lane) order, then the next piece's, then the group's
// parameter texels so, so that a decode streams each matrix front to back instead of walking
// W_LANES * W_RPL rows at once (lavapipe, SmolLM2: the rows' streams defeated the CPU's
// prefetchers, and decode matmuls reading 256 rows' worth of cache took 0.67-0.70x the time)
#ifdef W_LANES
const uint WGR = W_LANES * W_RPL;                         // rows a group
const uint WGT = WGR * (PIECES * WT + WP);                 // texels a group
uint wtex(uint row, uint c, uint t) {
    const uint q = row % WGR;
    return (row / WGR) * WGT + ((c * W_RPL + q % W_RPL) * W_LANES + q / W_RPL) * WT + t;
}
uint ptex(uint row, uint c) {
    const uint q = row % WGR;
    return (row / WGR) * WGT + WGR * PIECES * WT + ((c / 4u) * W_RPL + q % W_RPL) * W_LANES + q / W_RPL;
}
#else
uint wtex(uint row, uint c, uint t) { return row * (PIECES * WT + WP) + c * WT + t; }
uint ptex(uint row, uint c) { return row * (PIECES * WT + WP) + PIECES * WT + c / 4u; }
#endif

#if defined(W_Q4_1)
// nibble k of a word: weight 8i + k of word i; its x is scaled by 16^-k (k < 7; the top nibble is
// shifted down instead: (word & 0xf0000000) does not fit a signed conversion)
const vec4 Q4_XLO = vec4(1.0, 1.0 / 16.0, 1.0 / 256.0, 1.0 / 4096.0);
const vec4 Q4_XHI = vec4(1.0 / 65536.0, 1.0 / 1048576.0, 1.0 / 16777216.0, 1.0);
#elif defined(W_Q8_0)
const float Q8_X = 1.0 / 16777216.0;
#endif

// the token's x piece as codes_dot reads it (in place); returns what it needs besides (Q4_1: the
// piece's sum of x, else 0)
float prep_x(inout vec4 xv[V4]) {
#if defined(W_Q4_1)
    float xs = 0.0;
    [[unroll]] for (uint i = 0; i < 4; i++) {
        xs += dot(xv[2 * i], vec4(1.0)) + dot(xv[2 * i + 1], vec4(1.0));
        xv[2 * i] *= Q4_XLO;
        xv[2 * i + 1] *= Q4_XHI;
    }
    return xs;
#elif defined(W_Q8_0)
    [[unroll]] for (uint i = 0; i < 8; i++) xv[i] *= Q8_X;
    return 0.0;
#else
    return 0.0;
#endif
}

// a row's piece as codes_dot reads it, loaded and converted once for all tokens: Q4_1 its codes q
// (nibble k as q * 16^k, see above) and returns (d, m); Q8_0 its codes times 2^24 and (d, 0);
// float formats the weights themselves and (1, 0)
vec2 load_codes(uint row, uint c, out vec4 wq[V4]) {
#if defined(W_Q4_1) || defined(W_Q8_0)
    // the block's parameter word: component c % 4 of the texel holding blocks c - c % 4 .. + 3
    const uint p = W4(ptex(row, c))[c % 4u];
#endif
#if defined(W_Q4_1)
    const uvec4 qw = W4(wtex(row, c, 0u));
    [[unroll]] for (uint i = 0; i < 4; i++) {
        const uint q = qw[i];
        wq[2 * i] = vec4(ivec4(uvec4(q & 0xfu, q & 0xf0u, q & 0xf00u, q & 0xf000u)));
        wq[2 * i + 1] = vec4(ivec4(uvec4(q & 0xf0000u, q & 0xf00000u, q & 0xf000000u, q >> 28)));
    }
    return unpackHalf2x16(p);
#elif defined(W_Q8_0)
    const uvec4 qa = W4(wtex(row, c, 0u)), qb = W4(wtex(row, c, 1u));
    [[unroll]] for (uint i = 0; i < 8; i++) {
        const uint q = i < 4 ? qa[i] : qb[i - 4];
        wq[i] = vec4(ivec4(uvec4(q << 24, q << 16, q << 8, q) & 0xff000000u));
    }
    return vec2(unpackHalf2x16(p).x, 0.0);
#elif defined(W_F16)
    const uvec4 u = W4(wtex(row, c, 0u));
    wq[0] = vec4(unpackHalf2x16(u.x), unpackHalf2x16(u.y));
    wq[1] = vec4(unpackHalf2x16(u.z), unpackHalf2x16(u.w));
    return vec2(1.0, 0.0);
#else
    wq[0] = uintBitsToFloat(W4(wtex(row, c, 0u)));
    wq[1] = uintBitsToFloat(W4(wtex(row, c, 1u)));
    return vec2(1.0, 0.0);
#endif
}

// the dequantised piece (embed.comp): d * q + m rounded once, as the gguf package computes it --
// the codes' power-of-two scalings folded into d exactly, the product d * q exact (11 x 4 or
// 11 x 8 bits), so the fused multiply-add rounds only the sum
void load_piece(uint row, uint c, out vec4 wv[V4]) {
    const vec2 dm = load_codes(row, c, wv);
#if defined(W_Q4_1)
    [[unroll]] for (uint i = 0; i < 4; i++) {
        wv[2 * i] = fma(wv[2 * i], dm.x * Q4_XLO, vec4(dm.y));
        wv[2 * i + 1] = fma(wv[2 * i + 1], dm.x * Q4_XHI, vec4(dm.y));
    }
#elif defined(W_Q8_0)
    [[unroll]] for (uint i = 0; i < 8; i++) wv[i] *= dm.x * Q8_X;
#endif
}

// W[row, piece] @ x_piece from the piece's sum of codes times x, s = sum(wq[i] . xv[i]) over i
// in order, and load_codes' dm and prep_x's xs
float codes_sum(vec2 dm, float s, float xs) {
#if defined(W_Q4_1)
    return fma(dm.x, s, dm.y * xs);
#elif defined(W_Q8_0)
    return dm.x * s;
#else
    return s;
#endif
}

// W[row, piece] @ x_piece from load_codes' (wq, dm) and prep_x's (xv, xs)
float codes_dot(vec4 wq[V4], vec2 dm, vec4 xv[V4], float xs) {
    float s = 0.0;
    [[unroll]] for (uint i = 0; i < V4; i++) s += dot(wq[i], xv[i]);
    return codes_sum(dm, s, xs);
}
