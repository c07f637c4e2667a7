#version 450
// coopmat_tile.comp -- a study kernel for `python -m perf features`, not used by vkattn: the key
// loop of a causal prefill tile with cooperative matrices (VK_KHR_cooperative_matrix), to compare
// what a compiler makes of it with attn.comp's scalar loop. Needs a glslang with
// GL_KHR_cooperative_matrix (13.1+) and a driver that lists the extension.
//
// One subgroup takes 16 query rows of one head (head_dim 128, float16 Q/K/V, float32
// accumulation) and walks keys in blocks of 16:
//   S = Q K^T (8 16x16x16 multiply-adds), then per row m' = max(m, rowmax S), P = exp2(S - m'),
//   l = l * 2^(m - m') + rowsum P (through shared memory, 16 lanes, one row each), and
//   O += P V (8 multiply-adds into 8 float32 16x16 accumulators). O is rescaled only when a
//   row's max grew (rare after the first blocks): through shared memory, outside the common path.
// numpy (one head): s = q @ k.T * scale (log2 units); o = softmax(s) @ v  (causal masking omitted)
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_vote : require
#extension GL_EXT_control_flow_attributes : require

layout(local_size_x = 32) in;
layout(std430, binding = 0) readonly buffer QB { float16_t qh[]; };   // [rows, 128], pre-scaled
layout(std430, binding = 1) readonly buffer KB { float16_t kh[]; };   // [keys, 128]
layout(std430, binding = 2) readonly buffer VB { float16_t vh[]; };   // [keys, 128]
layout(std430, binding = 3) writeonly buffer OB { float ob[]; };      // [rows, 128]
layout(std430, binding = 4) readonly buffer PR { uint nkeys; };

const uint D = 128u, T = 16u, DT = D / T;
shared float s_s[T * T];
shared float16_t s_p[T * T];
shared float s_m[T], s_l[T], s_a[T];
shared float s_o[T * D];

void main() {
    const uint lane = gl_SubgroupInvocationID, q0 = gl_WorkGroupID.x * T;
    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> qa[DT];
    [[unroll]] for (uint d = 0u; d < DT; ++d)
        coopMatLoad(qa[d], qh, q0 * D + d * T, D, gl_CooperativeMatrixLayoutRowMajor);
    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> o[DT];
    [[unroll]] for (uint d = 0u; d < DT; ++d) o[d] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
    if (lane < T) { s_m[lane] = uintBitsToFloat(0xff7fffffu); s_l[lane] = 0.0; }
    for (uint j0 = 0u; j0 < nkeys; j0 += T) {
        coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> s =
            coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
        [[unroll]] for (uint d = 0u; d < DT; ++d) {
            coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> kb;
            coopMatLoad(kb, kh, j0 * D + d * T, D, gl_CooperativeMatrixLayoutColumnMajor);   // K^T
            s = coopMatMulAdd(qa[d], kb, s);
        }
        coopMatStore(s, s_s, 0, T, gl_CooperativeMatrixLayoutRowMajor);
        subgroupBarrier();
        bool grew = false;
        if (lane < T) {
            float mx = s_m[lane];
            [[unroll]] for (uint c = 0u; c < T; ++c) mx = max(mx, s_s[lane * T + c]);
            const float a = exp2(s_m[lane] - mx);
            float sum = 0.0;
            [[unroll]] for (uint c = 0u; c < T; ++c) {
                const float p = exp2(s_s[lane * T + c] - mx);
                s_p[lane * T + c] = float16_t(p);
                sum += p;
            }
            s_l[lane] = s_l[lane] * a + sum;
            s_m[lane] = mx;
            s_a[lane] = a;
            grew = a != 1.0;
        }
        subgroupBarrier();
        if (subgroupAny(grew)) {          // rare: rescale O's rows through shared memory
            [[unroll]] for (uint d = 0u; d < DT; ++d) {
                coopMatStore(o[d], s_o, d * T, D, gl_CooperativeMatrixLayoutRowMajor);
            }
            subgroupBarrier();
            for (uint i = lane; i < T * D; i += gl_SubgroupSize) s_o[i] *= s_a[i / D];
            subgroupBarrier();
            [[unroll]] for (uint d = 0u; d < DT; ++d)
                coopMatLoad(o[d], s_o, d * T, D, gl_CooperativeMatrixLayoutRowMajor);
        }
        coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> pa;
        coopMatLoad(pa, s_p, 0, T, gl_CooperativeMatrixLayoutRowMajor);
        [[unroll]] for (uint d = 0u; d < DT; ++d) {
            coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> vb;
            coopMatLoad(vb, vh, j0 * D + d * T, D, gl_CooperativeMatrixLayoutRowMajor);
            o[d] = coopMatMulAdd(pa, vb, o[d]);
        }
    }
    [[unroll]] for (uint d = 0u; d < DT; ++d) coopMatStore(o[d], s_o, d * T, D, gl_CooperativeMatrixLayoutRowMajor);
    subgroupBarrier();
    for (uint i = lane; i < T * D; i += gl_SubgroupSize) ob[q0 * D + i] = s_o[i] / s_l[i / D];
}
