#version 450
#extension GL_KHR_shader_subgroup_shuffle : enable
#extension GL_KHR_shader_subgroup_ballot : enable
#extension GL_KHR_shader_subgroup_arithmetic : enable
#extension GL_EXT_control_flow_attributes : require
// subgroup_ops.comp -- what one subgroup operation costs on this device, against a multiply-add:
// ITERS iterations of 8 dependent operations on 8 values per invocation, one subgroup per
// workgroup (WG = the subgroup size), GROUPS workgroups.
//
// Contract: out uint32 [GROUPS * WG]; lane l of every group starts from a[i] = l * 8 + i + 1
// (i = 0..7) and after the loop writes a[0] ^ a[1] ^ ... ^ a[7] (uint modes) or the float sum's
// bits (MODE 0). Each step below is applied to a0..a7 in turn, a7's using the new a0:
//   MODE 0 float fma:        a_i = fma(a_i, 0.5, a_{i+1}) (a float; starts at float(a_i) / 64)
//   MODE 1 uint multiply-add: a_i = a_i * 3 + a_{i+1}
//   MODE 2 shuffle, constant lane:   a_i = subgroupShuffle(a_{i+1}, (i + 1) % 4) + 1
//   MODE 3 shuffle, lane ^ h:        a_i = subgroupShuffle(a_{i+1}, lane ^ (h_i % WG)) + 1,
//                                    h_i = 1, 2, 4, 1, 2, 4, 1, 2
//   MODE 4 broadcast, constant lane: a_i = subgroupBroadcast(a_{i+1}, (i + 1) % 4) + 1
//   MODE 5 subgroupAdd:              a_i = subgroupAdd(a_{i+1}) + 1
// numpy: perf/subgroup_ops.py simulates every lane of a group (uint32 arithmetic wraps; MODE 0 in
// float64, compared within 1e-5).
layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint MODE = 0u;
layout(constant_id = 2) const uint ITERS = 1024u;
layout(std430, binding = 0) writeonly buffer O { uint o[]; };

const uint WG = gl_WorkGroupSize.x;

// step i of an iteration: a_i from a_n (n = i + 1 mod 8), lane k = (i + 1) % 4 for the constant-lane
// modes (every subgroup here has at least 4 lanes), h for lane ^ h
#define STEP(i, n, k, h) \
    if (MODE == 0u) f[i] = fma(f[i], 0.5, f[n]); \
    else if (MODE == 1u) a[i] = a[i] * 3u + a[n]; \
    else if (MODE == 2u) a[i] = subgroupShuffle(a[n], k) + 1u; \
    else if (MODE == 3u) a[i] = subgroupShuffle(a[n], l ^ ((h) % WG)) + 1u; \
    else if (MODE == 4u) a[i] = subgroupBroadcast(a[n], k) + 1u; \
    else a[i] = subgroupAdd(a[n]) + 1u;

void main() {
    const uint l = gl_LocalInvocationID.x;
    uint a[8];
    float f[8];
    [[unroll]] for (uint i = 0u; i < 8u; i++) {
        a[i] = l * 8u + i + 1u;
        f[i] = float(a[i]) / 64.0;
    }
    for (uint it = 0u; it < ITERS; it++) {
        STEP(0, 1, 1u, 1u) STEP(1, 2, 2u, 2u) STEP(2, 3, 3u, 4u) STEP(3, 4, 0u, 1u)
        STEP(4, 5, 1u, 2u) STEP(5, 6, 2u, 4u) STEP(6, 7, 3u, 1u) STEP(7, 0, 0u, 2u)
    }
    uint r = 0u;
    float s = 0.0;
    [[unroll]] for (uint i = 0u; i < 8u; i++) {
        r ^= a[i];
        s += f[i];
    }
    o[gl_GlobalInvocationID.x] = MODE == 0u ? floatBitsToUint(s) : r;
}
