#version 450
// copy_rows.comp -- copy one contiguous range of uvec4 words inside the K pool and one inside the V
// pool (PagedKVCache: the private copy of a shared partial block on fork / truncate).
//
// Contract
//   kc, vc : the pools, uvec4 (block b is one contiguous range: [HKV, block_size] rows)
//   params : [0] K source word, [1] K destination word, [2] K words, [3..5] the same for V;
//            source and destination ranges do not overlap (different blocks)
// numpy:  kc[dk:dk+nk] = kc[sk:sk+nk];  vc[dv:dv+nv] = vc[sv:sv+nv]
layout(local_size_x_id = 0) in;

layout(std430, binding = 0) buffer KC { uvec4 kc[]; };
layout(std430, binding = 1) buffer VC { uvec4 vc[]; };
layout(std430, binding = 2) readonly buffer PARAMS { uint params[]; };

void main() {
    const uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < params[2]; i += stride) kc[params[1] + i] = kc[params[0] + i];
    for (uint i = gl_GlobalInvocationID.x; i < params[5]; i += stride) vc[params[4] + i] = vc[params[3] + i];
}
