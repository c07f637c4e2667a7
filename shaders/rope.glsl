// rope.glsl -- rotary position embedding of one vec4 of a K or Q row (RoPE on the fly).
//
// The host supplies, per position row t of the call, a table of the R/2 rotation angles' cosines
// then sines (float32, computed in float64: vkattn.reference.rope_table), as vec4:
//   rope_tab[t * (R/4) + i/4] = cos[i .. i+3],  rope_tab[t * (R/4) + R/8 + i/4] = sin[i .. i+3]
// R = ROPE_DIM (a multiple of 8) elements of the head are rotated; the rest pass unchanged.
//   NeoX pairs (i, i + R/2):  a' = a cos - b sin,  b' = b cos + a sin
//   GPT-J pairs (2i, 2i + 1): the same within each vec4 (two pairs)
// numpy: vkattn.reference.rope(x, positions, rotary_dim=R, style=...), bit for bit: the two products
// and the sum are `precise` (no fused multiply-add) and each is correctly rounded, so every
// conforming driver computes numpy's float32 a*cos - b*sin and a*sin + b*cos (addition commutes
// exactly). Only a float32 denormal product or result (|value| < 2^-126) may differ: a driver may
// flush it to zero.
// Include after declaring the FLAGS and ROPE_DIM spec constants and `rope_tab` (vec4 buffer).

#define F_ROPE_K 32u      // rotate new keys (as they are stored)
#define F_ROPE_Q 64u      // rotate queries
#define F_ROPE_NEOX 128u  // NeoX pairs (else GPT-J)
#ifndef HAS
#define HAS(f) ((FLAGS & (f)) != 0u)
#endif
#define ROPE_NEOX HAS(F_ROPE_NEOX)

// vec4 u (elements 4u .. 4u+3) of a row at table row t; x is that vec4, partner the vec4 R/8
// vec4s away in the same row (NeoX only; ignored for GPT-J)
vec4 rope_rotate(vec4 x, vec4 partner, uint u, uint t) {
    const uint Q = ROPE_DIM / 4u;            // vec4s of rotated elements
    if (u >= Q) return x;
    const uint base = t * Q;
    if (ROPE_NEOX) {
        const uint H = Q / 2u;               // vec4s per half
        const uint k = u % H;
        const vec4 c = rope_tab[base + k], s = rope_tab[base + H + k];
        precise vec4 y = u < H ? x * c - partner * s : x * c + partner * s;
        return y;
    }
    // GPT-J: vec4 u holds pairs 2u, 2u+1 -> angles 2u, 2u+1 (table vec4 u/2, half u%2)
    const vec4 c4 = rope_tab[base + u / 2u], s4 = rope_tab[base + Q / 2u + u / 2u];
    const vec2 c = (u % 2u == 0u) ? c4.xy : c4.zw, s = (u % 2u == 0u) ? s4.xy : s4.zw;
    precise vec4 y = vec4(x.x * c.x - x.y * s.x, x.x * s.x + x.y * c.x, x.z * c.y - x.w * s.y, x.z * s.y + x.w * c.y);
    return y;
}

// the partner vec4 index of u for NeoX (u itself for GPT-J or outside the rotated part)
uint rope_partner(uint u) {
    const uint Q = ROPE_DIM / 4u;
    if (!ROPE_NEOX || u >= Q) return u;
    return u < Q / 2u ? u + Q / 2u : u - Q / 2u;
}
