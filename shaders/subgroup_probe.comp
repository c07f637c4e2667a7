#version 450
// subgroup_probe.comp -- what a one-subgroup workgroup of WG invocations really gets.
//
// Contract: one workgroup; out[0] = gl_SubgroupSize, out[1] = gl_NumSubgroups, out[2] = 1 if an
// xor-shuffle butterfly over the lanes sums 0..WG-1 correctly in every lane, else 0.
// numpy: out = [subgroup_size, num_subgroups, sum(range(WG)) == butterfly_sum]
// attn_lane.comp relies on all three (WG lanes = one subgroup, working shuffles); the planner runs
// this once per device instead of assuming the reported subgroup size holds for compute.
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_KHR_shader_subgroup_vote : require
layout(local_size_x_id = 0) in;
layout(std430, binding = 0) writeonly buffer OUT { uint outbuf[]; };

void main() {
    const uint WG = gl_WorkGroupSize.x;
    uint x = gl_LocalInvocationID.x;
    for (uint w = 1u; w < WG; w <<= 1) x += subgroupShuffleXor(x, w);
    const bool ok = subgroupAll(x == WG * (WG - 1u) / 2u);
    if (gl_LocalInvocationID.x == 0u) {
        outbuf[0] = gl_SubgroupSize;
        outbuf[1] = gl_NumSubgroups;
        outbuf[2] = ok ? 1u : 0u;
    }
}
