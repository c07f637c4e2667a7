#version 450
// scatter_slots.comp -- write stored rows, exactly as they were read, into the pool rows of a list
// of slots (the inverse of gather_slots.comp: loading a saved cache, vkattn/persist.py). Nothing is
// converted, rotated or quantised: the words and int8 scales land bit for bit.
//
// Contract
//   kc, vc : pools [num_blocks, HKV, BS, DK4|DV4] uvec4; slot s = block s / BS, row s % BS; written
//   rk, rv : [ROWS, HKV, DK4|DV4] uvec4, rows 0 .. count-1 read
//   params : [0] count * HKV (<= ROWS * HKV), [1 + i] the pool row of (slot i / HKV, head i % HKV):
//            ((slot / BS) * HKV + head) * BS + slot % BS, computed by the host; distinct rows
//   rks, rvs -> ks, vs : KV_I8: scales, float32 bits [ROWS, HKV] -> one per pool row
// numpy:  kc[slots // BS, :, slots % BS] = rk[:count];  vc likewise
layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint DK4 = 1u;
layout(constant_id = 2) const uint DV4 = 1u;

layout(std430, binding = 0) writeonly buffer KC { uvec4 kc[]; };
layout(std430, binding = 1) writeonly buffer VC { uvec4 vc[]; };
layout(std430, binding = 2) readonly buffer RK { uvec4 rk[]; };
layout(std430, binding = 3) readonly buffer RV { uvec4 rv[]; };
layout(std430, binding = 4) readonly buffer PARAMS { uint params[]; };
// the scales as their bits: a float move may flush a denormal or quiet a NaN on some drivers
layout(std430, binding = 5) writeonly buffer KS { uint ks[]; };
layout(std430, binding = 6) writeonly buffer VS { uint vs[]; };
layout(std430, binding = 7) readonly buffer RKS { uint rks[]; };
layout(std430, binding = 8) readonly buffer RVS { uint rvs[]; };
#ifndef KV_I8
#define KV_I8 0
#endif

// uvec4 index in the pool of word i of the [count, HKV, D4] rows
uint dst_word(uint i, uint d4) { return params[1u + i / d4] * d4 + i % d4; }

void main() {
    const uint n = params[0];
    const uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < n * DK4; i += stride) kc[dst_word(i, DK4)] = rk[i];
    for (uint i = gl_GlobalInvocationID.x; i < n * DV4; i += stride) vc[dst_word(i, DV4)] = rv[i];
#if KV_I8
    for (uint i = gl_GlobalInvocationID.x; i < n; i += stride) {
        const uint j = params[1u + i];   // pool row of (slot i / HKV, head i % HKV)
        ks[j] = rks[i];
        vs[j] = rvs[i];
    }
#endif
}
