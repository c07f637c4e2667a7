#version 450
#extension GL_EXT_control_flow_attributes : require
// peak.comp -- the device's multiply-add rate: every invocation runs CHAINS independent vec4
// chains acc = acc * a + b for ITERS steps (a, b read from a buffer, so nothing folds), the
// shape of a register-tiled matmul's inner loop without its loads. On a CPU driver one
// invocation is one SIMD lane, so CHAINS * 4 is the vector registers the loop keeps live: few
// chains leave the multiply-add pipes waiting on their latency, many spill.
//
// Contract: ab float32 [2 * CHAINS * 4]: a (the multipliers) then b; out float32 [GROUPS * WG * 4]
// numpy (a = 0.5: every product exact, so a fused or a split multiply-add gives the same bits):
//   acc = b[c] + lane-dependent start; ITERS times: acc = acc * a[c] + b[c] (float32 each step)
//   out[g, l] = sum over chains of acc (in chain order, float32)
layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint ITERS = 1024u;    // a multiple of 8
layout(std430, binding = 0) readonly buffer AB { vec4 ab[]; };
layout(std430, binding = 1) writeonly buffer O { vec4 o[]; };

void main() {
    const uint gid = gl_GlobalInvocationID.x;
    vec4 a[CHAINS], b[CHAINS], acc[CHAINS];
    [[unroll]] for (uint c = 0u; c < CHAINS; ++c) {
        a[c] = ab[c];
        b[c] = ab[CHAINS + c];
        acc[c] = b[c] + float(gid & 7u);
    }
    for (uint it = 0u; it < ITERS; it += 8u)           // 8 steps a trip: the loop's own test amortised
        [[unroll]] for (uint u = 0u; u < 8u; ++u)
            [[unroll]] for (uint c = 0u; c < CHAINS; ++c) acc[c] = fma(acc[c], a[c], b[c]);
    vec4 s = acc[0];
    [[unroll]] for (uint c = 1u; c < CHAINS; ++c) s += acc[c];
    o[gid] = s;
}
