// weights.glsl -- how linear.comp and embed.comp read a UNIT-weight piece of a weight row, as
// float32 vec4s, for each storage format (define one, or none for float32):
//   W_F16   float16, two per uint32 word (low half first): a piece of 8 is one uvec4
//   W_Q4_1  blocks of 32 in 5 words (quant.py): d * code + m, computed as the gguf package does
//   W_Q8_0  blocks of 32 in 9 words (quant.py): d * code
//   (none)  float32: a piece of 8 is two vec4
// Contract: the binding "Wb" is declared here at binding 0; K (row length, a multiple of UNIT)
// must be a constant declared before the include. piece c of row `row` is weights
// c*UNIT .. c*UNIT+UNIT-1; numpy: wv = W[row, c*UNIT:(c+1)*UNIT].reshape(UNIT // 4, 4)
#if defined(W_Q4_1) || defined(W_Q8_0)
#define UNIT 32
layout(std430, binding = 0) readonly buffer Wb { uint w[]; };
#elif defined(W_F16)
#define UNIT 8
layout(std430, binding = 0) readonly buffer Wb { uvec4 w[]; };
#else
#define UNIT 8
layout(std430, binding = 0) readonly buffer Wb { vec4 w[]; };
#endif
#define V4 (UNIT / 4)
#define PIECES (K / UNIT)

void load_piece(uint row, uint c, out vec4 wv[V4]) {
#if defined(W_Q4_1)
    const uint b = (row * PIECES + c) * 5u;
    const vec2 dm = unpackHalf2x16(w[b]);
    for (uint i = 0; i < 4; i++) {
        const uint q = w[b + 1 + i];
        const vec4 lo = vec4(q & 15u, (q >> 4) & 15u, (q >> 8) & 15u, (q >> 12) & 15u);
        const vec4 hi = vec4((q >> 16) & 15u, (q >> 20) & 15u, (q >> 24) & 15u, q >> 28);
        precise vec4 a = lo * dm.x + dm.y;      // the product is exact (11 x 4 bits): one rounding
        precise vec4 h = hi * dm.x + dm.y;
        wv[2 * i] = a;
        wv[2 * i + 1] = h;
    }
#elif defined(W_Q8_0)
    const uint b = (row * PIECES + c) * 9u;
    const float d = unpackHalf2x16(w[b]).x;
    for (uint i = 0; i < 8; i++) {
        const int q = int(w[b + 1 + i]);
        wv[i] = vec4(bitfieldExtract(q, 0, 8), bitfieldExtract(q, 8, 8), bitfieldExtract(q, 16, 8),
                     bitfieldExtract(q, 24, 8)) * d;    // exact: 11 x 8 bits
    }
#elif defined(W_F16)
    const uvec4 u = w[row * PIECES + c];
    wv[0] = vec4(unpackHalf2x16(u.x), unpackHalf2x16(u.y));
    wv[1] = vec4(unpackHalf2x16(u.z), unpackHalf2x16(u.w));
#else
    wv[0] = w[(row * PIECES + c) * 2];
    wv[1] = w[(row * PIECES + c) * 2 + 1];
#endif
}
