#version 450
// gather_slots.comp -- copy the pool rows of a list of slots into readback buffers
// (PagedKVCache.read: one sequence's positions, through its block table).
//
// Contract
//   kc, vc : pools [num_blocks, HKV, BS, DK4|DV4] uvec4; slot s = block s / BS, row s % BS
//   rk, rv : [ROWS, HKV, DK4|DV4] uvec4, rows 0 .. count-1 written
//   params : [0] count * HKV (<= ROWS * HKV), [1 + i] the pool row of (slot i / HKV, head i % HKV):
//            ((slot / BS) * HKV + head) * BS + slot % BS, computed by the host (the block size and
//            the head count are per-call values: one pipeline per storage format)
//   ks, vs -> rks, rvs : KV_I8: scales, float32 per pool row -> [ROWS, HKV]
// numpy:  rk[:count] = kc[slots // BS, :, slots % BS];  rv likewise
layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint DK4 = 1u;
layout(constant_id = 2) const uint DV4 = 1u;

layout(std430, binding = 0) readonly buffer KC { uvec4 kc[]; };
layout(std430, binding = 1) readonly buffer VC { uvec4 vc[]; };
layout(std430, binding = 2) writeonly buffer OK { uvec4 rk[]; };
layout(std430, binding = 3) writeonly buffer OV { uvec4 rv[]; };
layout(std430, binding = 4) readonly buffer PARAMS { uint params[]; };
layout(std430, binding = 5) readonly buffer KS { float ks[]; };
layout(std430, binding = 6) readonly buffer VS { float vs[]; };
layout(std430, binding = 7) writeonly buffer RKS { float rks[]; };
layout(std430, binding = 8) writeonly buffer RVS { float rvs[]; };
#ifndef KV_I8
#define KV_I8 0
#endif

// uvec4 index of word i of the gathered [count, HKV, D4] rows
uint src_word(uint i, uint d4) { return params[1u + i / d4] * d4 + i % d4; }

void main() {
    const uint n = params[0];
    const uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < n * DK4; i += stride) rk[i] = kc[src_word(i, DK4)];
    for (uint i = gl_GlobalInvocationID.x; i < n * DV4; i += stride) rv[i] = vc[src_word(i, DV4)];
#if KV_I8
    for (uint i = gl_GlobalInvocationID.x; i < n; i += stride) {
        const uint j = params[1u + i];   // pool row of (slot i / HKV, head i % HKV)
        rks[i] = ks[j];
        rvs[i] = vs[j];
    }
#endif
}
