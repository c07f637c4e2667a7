#version 450
// copy_rows.comp -- copy one contiguous range of uvec4 words inside the K pool and one inside the V
// pool (PagedKVCache: the private copy of a shared partial block on fork / truncate).
//
// Contract
//   kc, vc : the pools, uvec4 (block b is one contiguous range: [HKV, block_size] rows)
//   ks, vs : KV_I8 scales, one float per pool row
//   params : [0] K source word, [1] K destination word, [2] K words, [3..5] the same for V,
//            [6..8] the same for the scales (both ks and vs; 0 words unless KV_I8);
//            source and destination ranges do not overlap (different blocks)
// numpy:  kc[dk:dk+nk] = kc[sk:sk+nk];  vc[dv:dv+nv] = vc[sv:sv+nv];  ks, vs likewise
layout(local_size_x_id = 0) in;

layout(std430, binding = 0) buffer KC { uvec4 kc[]; };
layout(std430, binding = 1) buffer VC { uvec4 vc[]; };
layout(std430, binding = 2) readonly buffer PARAMS { uint params[]; };
layout(std430, binding = 3) buffer KS { float ks[]; };
layout(std430, binding = 4) buffer VS { float vs[]; };

void main() {
    const uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < params[2]; i += stride) kc[params[1] + i] = kc[params[0] + i];
    for (uint i = gl_GlobalInvocationID.x; i < params[5]; i += stride) vc[params[4] + i] = vc[params[3] + i];
    for (uint i = gl_GlobalInvocationID.x; i < params[8]; i += stride) {
        ks[params[7] + i] = ks[params[6] + i];
        vs[params[7] + i] = vs[params[6] + i];
    }
}
