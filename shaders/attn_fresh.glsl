// attn_fresh.glsl -- a call's new K/V rows (forward: the append fused into the attention
// dispatch), shared by attn.comp and attn_lane.comp. Include after common.glsl,
// attn_common.glsl and rope.glsl, with the DK4/DV4 spec constants, the nk/nv bindings and a
// global `Seq sq` (the workgroup's sequence) declared.
//
//   nk, nv : float32 [HKV, NN, DK4*CH | DV4*CH] vec4 (NN = aux[11]), zero padded. New row nr of kv
//            head h is position sq.past + nr - sq.new_start of the sequence; with ROPE_K its key
//            is rotated with rotary-table row sq.rope_row + (that position - sq.rope_pos).
// numpy (KV_I8): reference.quantize_int8 (common.glsl quant_scale / quantise, exact); (KV_FP8)
//        reference.fp8_bits with the kv head's scale (common.glsl fp8_encode, exact); otherwise
//        the row rounded to the storage dtype (reference.round_to), bit for bit.
// The kernels store each new row into its cache slot before the key loop and read it back like
// any cache row: each invocation stores exactly the words it later loads, so no barrier is needed
// (other invocations and workgroups store the same values).

// vec4 u of new row nr (u < DK4*CH or DV4*CH), K rotated with ROPE_K
vec4 fresh_vec4(bool is_k, uint h, uint nr, uint u) {
    const uint base = (h * aux[11] + nr) * (is_k ? DK4 : DV4) * CH;
    if (!is_k) return nv[base + u];
    vec4 y = nk[base + u];
    if (HAS(F_ROPE_K))
        y = rope_rotate(y, nk[base + rope_partner(u)], u, sq.rope_row + sq.past + nr - sq.new_start - sq.rope_pos);
    return y;
}

// max |x| over storage word c of new row nr (KV_I8: the caller reduces it over the row)
float fresh_amax(bool is_k, uint h, uint nr, uint c) {
    float a = 0.0;
    [[unroll]] for (uint e = 0u; e < CH; ++e) a = max(a, vmax_abs(fresh_vec4(is_k, h, nr, c * CH + e)));
    return a;
}

#if KV_Q4
// block b's parameter word of new row nr (common.glsl q4_param; every invocation storing a part
// of the block computes it from the block's 16 values, so no barrier is needed)
uint fresh_q4_param(bool is_k, uint h, uint nr, uint b) {
    const vec4 x0 = fresh_vec4(is_k, h, nr, b * 4u);
    float lo = x0.x, hi = x0.x;
    [[unroll]] for (uint e = 0u; e < 4u; ++e) q4_range(fresh_vec4(is_k, h, nr, b * 4u + e), lo, hi);
    return q4_param(lo, hi);
}
#else
// storage word c of new row nr as stored (KV_I8: quantised with the row's scale; KV_FP8: rounded
// to fp8 after division by the kv head's scale)
uvec4 fresh_word(bool is_k, uint h, uint nr, uint c, float scale) {
    vec4 y[CH];
    [[unroll]] for (uint e = 0u; e < CH; ++e) {
        y[e] = fresh_vec4(is_k, h, nr, c * CH + e);
#if KV_I8
        y[e] = quantise(y[e], scale);
#endif
    }
#if KV_FP8
    return pack_chunk_fp8(y, fp8_prep(scale));
#else
    return pack_chunk(y);
#endif
}
#endif
