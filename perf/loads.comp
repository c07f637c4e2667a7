#version 450
// loads.comp -- what one 32-bit word read from a storage buffer costs, streamed the way
// attn_lane.comp streams the K/V cache: each lane reads a uvec4, the lanes of a subgroup read
// consecutive uvec4s, every workgroup walks its own contiguous range.
//
// Contract: buf uint32 [GROUPS * ITERS * WG * 4 * (MODE == 1 ? 1 : 1)], out uint32 [GROUPS * WG]
//   MODE 0: uvec4 loads (one load instruction brings 4 words per lane)
//   MODE 1: the same words as 4 separate uint loads (one word per load instruction)
//   TEXEL:  MODE 0 from a uniform texel buffer (binding 0 a usamplerBuffer, 4 words a texel)
//   MODE 2: the same words, each uvec4 read by the whole subgroup at one address (known uniform:
//           from the workgroup id and loop counters only), lane l keeping the l-th of every WG --
//           what a driver with a uniform-load path (one load, broadcast) would make cheap
// numpy: out[g, l] = xor of every word lane l of group g read (only to keep the loads alive)
layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint MODE = 0u;
layout(constant_id = 2) const uint ITERS = 1024u;
#ifdef TEXEL
// TEXEL: binding 0 is a uniform texel buffer (RGBA32UI) and MODE 0 reads it by texelFetch: what a
// driver that gathers texel fetches (lavapipe) makes of the same stream
layout(binding = 0) uniform usamplerBuffer b4t;
#define B4(i) texelFetch(b4t, int(i))
#else
layout(std430, binding = 0) readonly buffer B4 { uvec4 b4[]; };
#define B4(i) b4[i]
#endif
layout(std430, binding = 1) readonly buffer B1 { uint b1[]; };
layout(std430, binding = 2) writeonly buffer O { uint o[]; };

void main() {
    const uint wg = gl_WorkGroupSize.x, lane = gl_LocalInvocationID.x;
    const uint base = gl_WorkGroupID.x * ITERS * wg;
    uvec4 acc = uvec4(0u);
    for (uint it = 0u; it < ITERS; ++it) {
        const uint c = base + it * wg + lane;
        if (MODE == 0u) acc ^= B4(c);
        else if (MODE == 1u) acc ^= uvec4(b1[4u * c], b1[4u * c + 1u], b1[4u * c + 2u], b1[4u * c + 3u]);
        else
            for (uint s = 0u; s < wg; ++s) {
                const uvec4 v = B4(base + it * wg + s);
                acc ^= s == lane ? v : uvec4(0u);
            }
    }
    o[gl_WorkGroupID.x * wg + lane] = acc.x ^ acc.y ^ acc.z ^ acc.w;
}
