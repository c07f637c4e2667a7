#version 450
// subgroup_probe.comp -- what a workgroup of WG invocations really gets from subgroup shuffles.
//
// Contract: one workgroup of WG invocations; out[0] = gl_SubgroupSize, out[1] = gl_NumSubgroups
// (from invocation 0), out[2 + i] = 1 if invocation i's xor-shuffle butterfly over its cluster of
// CLUSTER adjacent invocations (a power of two) summed their indices correctly, else 0.
// numpy: ok[i] = butterfly_sum(i) == sum(range(i & ~(CLUSTER-1), (i & ~(CLUSTER-1)) + CLUSTER))
// attn_lane.comp needs WG lanes = one subgroup (CLUSTER = WG), attn.comp clusters of DS adjacent
// invocations inside a subgroup: the planner runs this once per device instead of assuming the
// reported subgroup size holds for compute.
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint CLUSTER = 1u;
layout(std430, binding = 0) writeonly buffer OUT { uint outbuf[]; };

void main() {
    const uint i = gl_LocalInvocationID.x;
    uint x = i;
    for (uint w = 1u; w < CLUSTER; w <<= 1) x += subgroupShuffleXor(x, w);
    const uint base = i & ~(CLUSTER - 1u);
    outbuf[2u + i] = x == CLUSTER * base + CLUSTER * (CLUSTER - 1u) / 2u ? 1u : 0u;
    if (i == 0u) {
        outbuf[0] = gl_SubgroupSize;
        outbuf[1] = gl_NumSubgroups;
    }
}
