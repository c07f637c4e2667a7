#version 450
// mask_copy.comp -- a device-resident additive mask (a caller's vkattn.DeviceArray) copied into the
// aux block of the attention dispatch that follows it, where the kernels read masks
// (attn_common.glsl mask_at). The host never sees the mask: a recorded step that reads a mask the
// caller's own dispatches wrote replays with the mask's current contents.
//
// Contract
//   src : float32 [HEADS, Q, COLS] (HEADS 1: one mask for every q head), the caller's array;
//         row h*Q + r, key j at (h*Q + r)*COLS + j; COLS >= the sequence's keys
//   aux : the attention call's aux block (attn_common.glsl), written by the host before this
//         dispatch: sequence record SEQ (at aux[12] + 12*SEQ) gives past, n_new, q_len (= Q) and
//         the mask's offset; this dispatch fills aux[offset .. offset + HEADS*q_len*T), T = past
//         + n_new, with src's first T keys of every row (the rule below applied), in the
//         kernels' order
// numpy (T = past + n_new, o = the record's mask offset, rule(): below):
//   aux[o:o + HEADS*q_len*T] = rule(src.reshape(HEADS*q_len, COLS)[:, :T]).ravel().view(np.uint32)
//
// Each value is copied with vkattn.reference.attention's MASK_LIMIT rule applied: below -2^127 it
// is -inf, above 2^127 it is 2^127 (the kernels' mask_at reads entries up to 2^127 only: the host
// refuses larger numpy masks), any other value bit for bit (NaN stays undefined: the host checks
// shapes, not values, as the mask is not read back).
//   rule(m) = np.where(m < -2**127, -inf, np.minimum(m, 2**127))
// One invocation per word, a grid-stride loop over HEADS*q_len*T.
layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint COLS = 1u;     // src's last dimension (keys per row)
layout(constant_id = 2) const uint HEADS = 1u;    // 1, or the call's q heads (a per-head mask)
layout(constant_id = 3) const uint SEQ = 0u;      // the sequence record whose mask this is

layout(std430, binding = 0) readonly buffer SRC { uint src[]; };
layout(std430, binding = 1) buffer AUX { uint aux[]; };

void main() {
    const uint rec = aux[12] + 12u * SEQ;
    const uint T = aux[rec] + aux[rec + 1u], q_len = aux[rec + 3u], dst = aux[rec + 7u];
    const uint n = HEADS * q_len * T;
    const uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    const float LIM = uintBitsToFloat(0x7f000000u);       // 2^127
    for (uint i = gl_GlobalInvocationID.x; i < n; i += stride) {
        const uint row = i / T;
        const float m = uintBitsToFloat(src[row * COLS + (i - row * T)]);
        aux[dst + i] = m < -LIM ? 0xff800000u : floatBitsToUint(min(m, LIM));   // -inf, or at most 2^127
    }
}
