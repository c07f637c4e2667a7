#version 450
// attn_coopmat.comp -- flash attention for prefill and chunks on cooperative matrices
// (VK_KHR_cooperative_matrix, GL_KHR_cooperative_matrix): S = Q K^T and O += P V as subgroup
// matrix products, float16 inputs and float32 accumulation; the online softmax in float32. The
// third attention kernel beside attn.comp (tile) and attn_lane.comp: same bindings, the same aux
// buffer and score rules (attn_common.glsl), the same outputs, split-K merge and fused append.
//
// Contract (as attn.comp; the tuning picks this kernel only for calls with more than one query row)
//   grid (SPLITS, tiles, HKV); workgroup (sp, y, h) takes tile y of the aux tile table =
//   (sequence i, query tile qt): the G query heads h*G .. h*G+G-1 of kv head h, query rows
//   qt*BQ .. qt*BQ+BQ-1 of sequence i, keys kstart_i + sp*chunk_i .. (+ chunk_i).
//   kc, vc   : cache uvec4 rows (common.glsl), float16 (KV_F16) or int8 (KV_I8) storage only.
//              A sequence's new rows (n_new_i > 0) are stored into their slots as attn.comp does;
//              the key loop takes those keys from nk/nv again (rounded / quantised exactly as
//              stored, attn_fresh.glsl), never from the slots it wrote, so no invocation reads a
//              buffer word another one wrote in this dispatch.
//   q        : float32 [HKV*G, R, DK4*CH] vec4, zero padded
//   out      : float32 [HKV*G, R, DV] normalised (a row that sees nothing gives zeros, never NaN)
//   lse      : float32 [HKV*G, R] natural log-sum-exp (-inf: nothing seen), then one word: the
//              pipeline's gl_SubgroupSize as uint bits (the host checks it is SG)
//   part, ml : with SPLIT, float32 [SPLITS, HKV*G*R, DV4*CH*4] un-normalised sums and vec2
//              (max in log2 units, sum) [SPLITS, HKV*G*R]; the last workgroup of a tile merges them
//              (the chain of attn.comp's header; glslang builds every cooperative-matrix shader
//              on the Vulkan memory model, where memoryBarrierBuffer() is an acquire-release over
//              uniform memory at queue-family scope and `coherent` makes accesses available and
//              visible at that scope: the same links, one dispatch, one queue).
// numpy, one q head of one sequence:
//   s = scale * q @ K[:T].T (+ variants, invisible keys -inf);  out = softmax(s) @ V[:T]
//
// Matrices (subgroup scope, MM x MN x MK, from the device's VkCooperativeMatrixPropertiesKHR: 8x8x8
// on lavapipe, 16x16x16 on RDNA3/RDNA4/NVIDIA): the workgroup's BR query vectors (qv = g*BQ + row:
// the GQA heads folded into the matrix rows, padded to a multiple of MM) are MT = BR/MM row tiles;
// a block of BC keys (a multiple of MN and MK) is staged into shared memory as float16 rows (cache
// rows found through the block table, int8 converted to its integers), then
//   S (BR x BC)  = Q (BR x DKS) . K^T       MT x BC/MN tiles, DKS/MK steps each
//   O (BR x DVS) += P (BR x BC) . V          MT x DVS/MN accumulators held by the subgroups
// float32 results from float16 operands: Q and P are each split into two float16 matrices, hi
// (x with 13 mantissa bits cleared) and lo = f16(x - hi), and both are multiplied
// (|x - hi - lo| <= 2^-21 |x|, or 2^-25 absolute below float16's normal range), while K and
// V are float16 already (or int8 integers, exact in float16). Every product of two float16 values
// is exact in float32, so the scores and sums have the accuracy of float32 arithmetic, within
// vkattn.reference.TOLERANCE, at twice the matrix work. Each Q row is scaled by a power of two
// 2^-e first (max |q| in [0.5, 1)), so no query overflows float16, and its scores by 2^e after.
// int8: S column j times the key's scale; P column j times v_scale_j / (the block's largest
// v_scale) before the split, and the block's product times that largest scale is added to O.
//
// Online softmax (float32, log2 units), BR rows by teams of TPR threads (xor shuffles within a
// team, TPR <= SG): a row's running max m moves only when a score passes it by more than TAU
// (P = 2^(s - m) <= 2^TAU stays far inside float16): m then rarely moves after a row's first
// keys, and O's rows are rescaled (alpha = 2^(m_old - m_new)) only in a block where some row's
// max moved and that row already holds a sum -- through a per-subgroup shared scratch tile,
// since a cooperative matrix has no per-row operation. out = O / l, lse = (m + log2 l) ln 2.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_KHR_shader_subgroup_vote : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#include "common.glsl"

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint G = 1u;       // q heads per kv head
layout(constant_id = 2) const uint BQ = 1u;      // query rows per workgroup
layout(constant_id = 3) const uint DK4 = 16u;    // uvec4 per K row
layout(constant_id = 4) const uint DV4 = 16u;    // uvec4 per V row
layout(constant_id = 5) const uint DV = 128u;    // v_head_dim (unpadded)
layout(constant_id = 6) const uint SPLIT = 0u;   // 1: the keys are split over the grid's x
layout(constant_id = 7) const uint FLAGS = 0u;   // variants (attn_common.glsl)
layout(constant_id = 8) const uint ROPE_DIM = 8u;  // rotated elements (ROPE_K / ROPE_Q)
layout(constant_id = 9) const uint SG = 8u;      // subgroup size the pipeline is pinned to
layout(constant_id = 10) const uint MM = 8u;     // matrix shape: A is MM x MK, B MK x MN, C MM x MN
layout(constant_id = 11) const uint MN = 8u;
layout(constant_id = 12) const uint MK = 8u;
layout(constant_id = 13) const uint BC = 16u;    // keys per block (a multiple of MN and MK)
layout(constant_id = 14) const uint BR = 8u;     // query vectors per workgroup: G*BQ rounded up to MM
layout(constant_id = 15) const uint TPR = 1u;    // softmax threads per row (a power of two <= SG, 4 TPR | BC)

layout(std430, binding = 0) buffer KC { uvec4 kc[]; };
layout(std430, binding = 1) buffer VC { uvec4 vc[]; };
layout(std430, binding = 2) readonly buffer NK { vec4 nk[]; };
layout(std430, binding = 3) readonly buffer NV { vec4 nv[]; };
layout(std430, binding = 4) readonly buffer QB { vec4 qbuf[]; };
layout(std430, binding = 5) readonly buffer AUX { uint aux[]; };
layout(std430, binding = 5) coherent buffer AUXC { uint auxc[]; };   // the same buffer: split counters
layout(std430, binding = 6) writeonly buffer OUT { float outbuf[]; };
layout(std430, binding = 7) coherent buffer PART { float part[]; };
layout(std430, binding = 8) coherent buffer ML { vec2 mlbuf[]; };
layout(std430, binding = 9) writeonly buffer LSE { float lsebuf[]; };
layout(std430, binding = 10) readonly buffer ROPE { vec4 rope_tab[]; };
layout(std430, binding = 11) buffer KS { float kscale[]; };   // KV_I8: scale of each cache row
layout(std430, binding = 12) buffer VS { float vscale[]; };

#include "attn_common.glsl"
#include "rope.glsl"

Seq sq;
#include "attn_fresh.glsl"

#ifndef COOPMAT_UNROLL
#define COOPMAT_UNROLL 1
#endif
#if COOPMAT_UNROLL
#define OPT_LOOP [[unroll]]
#else
#define OPT_LOOP [[dont_unroll]]
#endif
#define ACC coopmat<float, gl_ScopeSubgroup, MM, MN, gl_MatrixUseAccumulator>
#define MAT_A coopmat<float16_t, gl_ScopeSubgroup, MM, MK, gl_MatrixUseA>
#define MAT_B coopmat<float16_t, gl_ScopeSubgroup, MK, MN, gl_MatrixUseB>
#define ROW_MAJOR gl_CooperativeMatrixLayoutRowMajor
#define COL_MAJOR gl_CooperativeMatrixLayoutColumnMajor

const uint WG = gl_WorkGroupSize.x;
const uint NSG = WG / SG;                 // subgroups per workgroup
const uint NQ = G * BQ;                   // query vectors that exist (rows NQ .. BR-1 are padding)
const uint MT = BR / MM;                  // row tiles
const uint HW = CH * 4u;                  // halves per 16-byte storage word (8 float16, 16 int8)
const uint DKP = DK4 * HW, DVP = DV4 * HW;   // values per stored (padded) K, V row
const uint DKS = (DKP + MK - 1u) / MK * MK;  // staged K row: a multiple of the matrix K
const uint DVS = (DVP + MN - 1u) / MN * MN;  // staged V row and O columns: a multiple of N
const uint DKSW = DKS / HW, DVSW = DVS / HW; // storage words per staged row
const uint NT = BC / MN;                  // S column tiles
const uint VT = DVS / MN;                 // O column tiles per row tile
const uint OT = MT * VT;                  // O tiles
const uint OPT = (OT + NSG - 1u) / NSG;   // O accumulators per subgroup
// shared row strides (float16 arrays in halves, float32 in floats): 16 bytes of padding against
// bank conflicts, and every row and tile 16-byte aligned (cooperative matrix loads and stores)
const uint QST = DKS + 8u;
const uint KVST = (DKS > DVS ? DKS : DVS) + 8u;
const uint SST = BC + 4u;
const uint PST = BC + 8u;
const uint XST = MN + 4u;
const uint TEAMS = WG / TPR;              // softmax teams; team t takes rows t, t + TEAMS, ..
const uint RPT = (BR + TEAMS - 1u) / TEAMS;   // rows per team
const uint CPT = BC / TPR;                // columns per thread: CPT / 4 runs of 4 adjacent columns,
                                          // so each thread writes whole f16vec4 words of P (no two
                                          // invocations store into one word: a driver may store a
                                          // half as a read-modify-write of its word)
const float TAU = 8.0;                    // log2 units a score may pass the running max by
const uint FRESH = 32u;                   // new rows per sequence at most (tuning.FUSED_APPEND_MAX_ROWS)
#define M_EMPTY uintBitsToFloat(0xff7fffffu)

// The arrays the matrix loads and stores touch come first, each a multiple of 16 bytes long, so
// that a driver laying the variables out in order at their natural alignment puts every matrix
// row at a 16-byte boundary (the alignment OpCooperativeMatrixLoadKHR / StoreKHR require of their
// pointer and stride); the scalar arrays after them may leave any alignment.
shared f16vec4 s_q[2u * BR * QST / 4u];        // Q hi rows, then lo rows (scaled by 2^-e)
shared f16vec4 s_kv[BC * KVST / 4u];           // the block's K rows, then its V rows
shared float s_s[BR * SST];                    // S
shared f16vec4 s_p[2u * BR * PST / 4u];        // P hi rows, then lo rows
shared float s_x[NSG * MM * XST];              // per subgroup: one accumulator tile
shared float s_alpha[BR];                      // this block's rescale of each row
shared int s_qe[BR];                           // each Q row's exponent e
shared float s_m[BR], s_l[BR];                 // the rows' final max and sum
shared float s_ksc[KV_I8 != 0 ? BC : 1u], s_vsc[KV_I8 != 0 ? BC : 1u];   // int8 row scales
shared float s_fsc[KV_I8 != 0 ? 2u * FRESH : 1u];   // int8 scales of the new rows (K, then V)
shared uint s_grew[NSG];                       // per subgroup: some row's max moved
shared uint s_last;

// this invocation's indices
#define hh gl_WorkGroupID.z
#define tid gl_LocalInvocationID.x
#define sid gl_SubgroupID
#define lane gl_SubgroupInvocationID
#define team (tid / TPR)                  // softmax team state: rows team + k*TEAMS
#define tl (tid % TPR)
float m_r[RPT], l_r[RPT], slope[RPT];
uint qrow[RPT], qpos[RPT], vis_end[RPT];

f16vec4 half4(uint a, uint b) { return f16vec4(unpackFloat2x16(a), unpackFloat2x16(b)); }

// storage word -> HW/4 float16 vec4 (float16 bits as they are; int8 as its integers, exact)
void word_halves(uvec4 w, out f16vec4 x[CH]) {
#if KV_I8
    [[unroll]] for (uint e = 0u; e < 4u; ++e) x[e] = f16vec4(unpack_i8x4(w[e]));
#else
    x[0] = half4(w.x, w.y);
    x[1] = half4(w.z, w.w);
#endif
}

// stored word w of key j (< T) of this kv head: the cache's, or a new row's from nk/nv
uvec4 key_word(bool is_k, uint j, uint w) {
    if (j >= sq.past) {
        const uint r = j - sq.past;
#if KV_I8
        const float sc = s_fsc[(is_k ? 0u : FRESH) + min(r, FRESH - 1u)];
#else
        const float sc = 0.0;
#endif
        return fresh_word(is_k, hh, sq.new_start + r, w, sc);
    }
    const uint row = cache_row(sq.bt, hh, j);
    return is_k ? kc[row * DK4 + w] : vc[row * DV4 + w];
}

// keys j0 .. j0+BC-1 of K (or V) into s_kv as float16 rows; keys at or past hi and the padding
// past the stored row are zeros. int8 K: the key and value scales of the block (0 past hi).
void stage(bool is_k, uint j0, uint hi) {
    const uint words = is_k ? DKSW : DVSW, stored = is_k ? DK4 : DV4;
    for (uint i = tid; i < BC * words; i += WG) {
        const uint c = i / words, w = i % words, j = j0 + c;
        uvec4 word = uvec4(0u);
        if (j < hi && w < stored) word = key_word(is_k, j, w);
        f16vec4 x[CH];
        word_halves(word, x);
        [[unroll]] for (uint e = 0u; e < CH; ++e) s_kv[(c * KVST + w * HW) / 4u + e] = x[e];
#if KV_I8
        if (is_k && w == 0u) {
            float ks = 0.0, vs = 0.0;
            if (j < hi && j >= sq.past) {
                ks = s_fsc[min(j - sq.past, FRESH - 1u)];
                vs = s_fsc[FRESH + min(j - sq.past, FRESH - 1u)];
            } else if (j < hi) {
                const uint row = cache_row(sq.bt, hh, j);
                ks = kscale[row];
                vs = vscale[row];
            }
            s_ksc[c] = ks;
            s_vsc[c] = vs;
        }
#endif
    }
}

// S = Q K^T of the staged block into s_s: the subgroups share the MT x NT tiles
void scores() {
    for (uint t = sid; t < MT * NT; t += NSG) {
        const uint mi = t / NT, ni = t % NT;
        ACC acc = ACC(0.0);
        for (uint d = 0u; d < DKS / MK; ++d) {
            MAT_B kb;
            coopMatLoad(kb, s_kv, (ni * MN * KVST + d * MK) / 4u, KVST / 4u, COL_MAJOR);
            MAT_A qa;
            coopMatLoad(qa, s_q, (mi * MM * QST + d * MK) / 4u, QST / 4u, ROW_MAJOR);
            acc = coopMatMulAdd(qa, kb, acc);
            coopMatLoad(qa, s_q, ((BR + mi * MM) * QST + d * MK) / 4u, QST / 4u, ROW_MAJOR);
            acc = coopMatMulAdd(qa, kb, acc);
        }
        coopMatStore(acc, s_s, mi * MM * SST + ni * MN, SST, ROW_MAJOR);
    }
}

float team_max(float x) {
    [[unroll]] for (uint o = 1u; o < TPR; o *= 2u) x = max(x, subgroupShuffleXor(x, o));
    return x;
}

float team_sum(float x) {
    [[unroll]] for (uint o = 1u; o < TPR; o *= 2u) x += subgroupShuffleXor(x, o);
    return x;
}

// x = hi + lo: hi is x with its 13 lowest mantissa bits cleared, a float16 value (|x| in float16's
// normal range: exact; below it the conversion rounds, by at most 2^-25), lo = x - hi exactly, 13
// significant bits of which float16 keeps 11. Bit operations, not a float16 round trip: a
// conversion's rounding is the driver's (lavapipe 26 keeps float16 values in float32 registers,
// so f16(x) - x there is 0 until stored).
vec4 hi_part(vec4 x) { return uintBitsToFloat(floatBitsToUint(x) & 0xffffe000u); }

// column of the block this thread's i-th score of a row is (runs of 4 adjacent columns per thread)
uint p_col(uint i) { return 4u * (tl + (i / 4u) * TPR) + i % 4u; }

// P row r, columns c .. c+3 (c a multiple of 4): hi and lo halves, one whole word each
void put_p4(uint r, uint c, vec4 p) {
    const vec4 hi = hi_part(p);
    s_p[(r * PST + c) / 4u] = f16vec4(hi);
    s_p[((BR + r) * PST + c) / 4u] = f16vec4(p - hi);
}

// the online softmax of the block's scores (keys j0 + c, those below hi exist): P into s_p,
// each row's rescale into s_alpha, whether any row that holds a sum moved its max into s_grew
void softmax(uint j0, uint hi) {
#if KV_I8
    float vmx = 0.0;
    for (uint c = 0u; c < BC; ++c) vmx = max(vmx, s_vsc[c]);
#endif
    bool grew = false;
    [[unroll]] for (uint k = 0u; k < RPT; ++k) {
        const uint r = team + k * TEAMS, rr = min(r, BR - 1u);
        const uint qv = min(rr, NQ - 1u);
        float s[CPT];
        float smax = NEG_INF;
        [[unroll]] for (uint i = 0u; i < CPT; ++i) {
            const uint c = p_col(i), j = j0 + c;
            float x = ldexp(s_s[rr * SST + c], s_qe[rr]);
#if KV_I8
            x *= s_ksc[c];
#endif
            bool vis = r < BR && j < hi && j < vis_end[k];
            if (HAS(F_WINDOW)) vis = vis && key_visible(j, qpos[k], false);
            x = shape_score(x, slope[k], j, qpos[k]);
            if (HAS(F_MASK)) x += mask_at(sq, hh * G + qv / BQ, qrow[k], min(j, hi - 1u));
            s[i] = vis ? x : NEG_INF;
            smax = max(smax, s[i]);
        }
        smax = team_max(smax);
        const float mold = m_r[k];
        const float mnew = smax > mold + TAU ? smax : mold;
        const float alpha = exp2(mold - mnew);
        grew = grew || (alpha != 1.0 && l_r[k] > 0.0);
        float psum = 0.0;
        [[unroll]] for (uint i4 = 0u; i4 < CPT; i4 += 4u) {
            vec4 pv;
            [[unroll]] for (uint e = 0u; e < 4u; ++e) {
                const float p = exp2(s[i4 + e] - mnew);
                psum += p;
#if KV_I8
                pv[e] = vmx > 0.0 ? p * (s_vsc[p_col(i4 + e)] / vmx) : 0.0;
#else
                pv[e] = p;
#endif
            }
            if (r < BR) put_p4(r, p_col(i4), pv);
        }
        l_r[k] = l_r[k] * alpha + team_sum(psum);
        m_r[k] = mnew;
        if (tl == 0u && r < BR) s_alpha[r] = alpha;
    }
    const bool any = subgroupAny(grew);
    if (subgroupElect()) s_grew[sid] = any ? 1u : 0u;
}

// Q rows into s_q: hi and lo float16 halves of q * scale * log2(e) (rotated with ROPE_Q) * 2^-e
vec4 q_vec4(uint k, uint qbase, uint u, bool ok, float qscale) {
    if (!ok || u >= DK4 * CH) return vec4(0.0);
    vec4 x = qbuf[qbase + u];
    if (HAS(F_ROPE_Q)) x = rope_rotate(x, qbuf[qbase + rope_partner(u)], u, sq.rope_row + qpos[k] - sq.rope_pos);
    return x * qscale;
}

void load_q(uint qt, float qscale, bool causal) {
    const uint T = sq.past + sq.n_new, R = aux[10];
    [[unroll]] for (uint k = 0u; k < RPT; ++k) {
        const uint r = team + k * TEAMS, qv = min(r, NQ - 1u);
        const uint g = qv / BQ, row = qt * BQ + qv % BQ;
        const bool ok = r < NQ && row < sq.q_len;
        qrow[k] = row;
        qpos[k] = T - sq.q_len + row;
        vis_end[k] = ok ? (causal ? qpos[k] + 1u : T) : 0u;
        slope[k] = HAS(F_ALIBI) ? uintBitsToFloat(aux[aux[15] + hh * G + g]) : 0.0;
        m_r[k] = M_EMPTY;
        l_r[k] = 0.0;
        const uint qbase = ((hh * G + g) * R + sq.q_start + min(row, sq.q_len - 1u)) * DK4 * CH;
        float amax = 0.0;
        for (uint u = tl; u < DKS / 4u; u += TPR) amax = max(amax, vmax_abs(q_vec4(k, qbase, u, ok, qscale)));
        amax = team_max(amax);
        int e;
        frexp(amax, e);                        // amax = f * 2^e, f in [0.5, 1) (0: e = 0)
        if (amax == 0.0) e = 0;
        if (tl == 0u && r < BR) s_qe[r] = e;
        if (r < BR)
            for (uint u = tl; u < DKS / 4u; u += TPR) {
                const vec4 x = ldexp(q_vec4(k, qbase, u, ok, qscale), ivec4(-e));
                const vec4 xh = hi_part(x);
                s_q[r * QST / 4u + u] = f16vec4(xh);
                s_q[(BR + r) * QST / 4u + u] = f16vec4(x - xh);
            }
    }
}

// the call's new rows of this sequence into their cache slots (every workgroup of the sequence
// stores the same values); int8: each row's scale, also into s_fsc for the key loop
void store_fresh() {
#if KV_I8
    for (uint i = tid; i < 2u * sq.n_new; i += WG) {
        const bool is_k = i < sq.n_new;
        const uint r = is_k ? i : i - sq.n_new, nr = sq.new_start + r;
        const uint row = cache_row(sq.bt, hh, sq.past + r), words = is_k ? DK4 : DV4;
        float amax = 0.0;
        for (uint w = 0u; w < words; ++w) amax = max(amax, fresh_amax(is_k, hh, nr, w));
        const float sc = quant_scale(amax);
        for (uint w = 0u; w < words; ++w) {
            const uvec4 word = fresh_word(is_k, hh, nr, w, sc);
            if (is_k) kc[row * DK4 + w] = word;
            else vc[row * DV4 + w] = word;
        }
        if (is_k) kscale[row] = sc;
        else vscale[row] = sc;
        if (r < FRESH) s_fsc[(is_k ? 0u : FRESH) + r] = sc;
    }
#else
    for (uint i = tid; i < sq.n_new * (DK4 + DV4); i += WG) {
        const uint r = i / (DK4 + DV4), w = i % (DK4 + DV4);
        const uint row = cache_row(sq.bt, hh, sq.past + r), nr = sq.new_start + r;
        if (w < DK4) kc[row * DK4 + w] = fresh_word(true, hh, nr, w, 0.0);
        else vc[row * DV4 + w - DK4] = fresh_word(false, hh, nr, w - DK4, 0.0);
    }
#endif
}

// the output row of query vector qv, or ~0u where it does not exist (padding, past q_len)
uint out_row(uint qv, uint qt) {
    const uint row = qt * BQ + qv % BQ;
    if (qv >= NQ || row >= sq.q_len) return ~0u;
    return (hh * G + qv / BQ) * aux[10] + sq.q_start + row;
}

void main() {
    const uint sp = gl_WorkGroupID.x, y = gl_WorkGroupID.y;
    // the subgroup size this pipeline runs with, after lse's rows: the host checks it is SG
    if (gl_WorkGroupID == uvec3(0u) && tid == 0u)
        lsebuf[gl_NumWorkGroups.z * G * aux[10]] = uintBitsToFloat(gl_SubgroupSize);
    if (gl_SubgroupSize != SG || gl_NumSubgroups != NSG) return;   // matrices sized for SG: none run
    if (y >= aux[14]) return;                 // the grid is sized for the largest batch
    sq = load_seq(aux[aux[13] + 2u * y]);
    const uint qt = aux[aux[13] + 2u * y + 1u];
    const bool causal = aux[1] != 0u;
    const uint T = sq.past + sq.n_new, R = aux[10];
    const uint nrows = gl_NumWorkGroups.z * G * R;

    store_fresh();
    load_q(qt, uintBitsToFloat(aux[2]), causal);

    ACC o[OPT];
    OPT_LOOP for (uint i = 0u; i < OPT; ++i) o[i] = ACC(0.0);

    // keys of this split (attn.comp): past the tile's last row nothing is visible when causal;
    // with a window, the sinks (split 0 takes those below kstart) and the window's keys
    uint kend = T;
    if (causal) kend = T - sq.q_len + min(sq.q_len, qt * BQ + BQ);
    const uint a = min(kend, sq.kstart + sp * sq.chunk), b = min(kend, a + sq.chunk);
    uint lo[3], hi[3];
    lo[0] = 0u; hi[0] = 0u; lo[1] = 0u; hi[1] = 0u; lo[2] = a; hi[2] = b;
    if (HAS(F_WINDOW)) {
        const uint win = aux[7], sinks = aux[8];
        const uint pmin = T - sq.q_len + qt * BQ;
        const uint wlo = pmin + 1u > win ? pmin + 1u - win : 0u;
        if (sp == 0u) hi[0] = min(sinks, min(sq.kstart, kend));
        lo[1] = a; hi[1] = min(b, sinks);
        lo[2] = max(a, max(sinks, wlo));
    }
    barrier();                                // s_q, s_qe, s_fsc written

    for (uint part_i = 0u; part_i < 3u; ++part_i) {
        for (uint j0 = lo[part_i]; j0 < hi[part_i]; j0 += BC) {
            const uint kh = hi[part_i];
            stage(true, j0, kh);
            barrier();
            scores();
            barrier();
            stage(false, j0, kh);             // S is in s_s: K's rows are free
            softmax(j0, kh);
            barrier();
#if KV_I8
            float vmx = 0.0;
            for (uint c = 0u; c < BC; ++c) vmx = max(vmx, s_vsc[c]);
#endif
            bool rescale = false;
            for (uint s = 0u; s < NSG; ++s) rescale = rescale || s_grew[s] != 0u;
            // every subgroup runs the same number of iterations and subgroup barriers, also past
            // its last tile (t >= OT): lavapipe 26 turns a subgroup barrier into a workgroup-wide
            // suspension point, and subgroups that pass different counts of them lose their state
            OPT_LOOP for (uint i = 0u; i < OPT; ++i) {
                const uint t = sid + i * NSG;
                const bool mine = t < OT;
                const uint mi = mine ? t / VT : 0u, nv = t % VT;
                if (rescale) {                // O's rows times alpha, through this subgroup's tile
                    if (mine) coopMatStore(o[i], s_x, sid * MM * XST, XST, ROW_MAJOR);
                    subgroupMemoryBarrierShared();
                    subgroupBarrier();
                    if (mine)
                        for (uint e = lane; e < MM * MN; e += SG)
                            s_x[sid * MM * XST + (e / MN) * XST + e % MN] *= s_alpha[mi * MM + e / MN];
                    subgroupMemoryBarrierShared();
                    subgroupBarrier();
                    if (mine) coopMatLoad(o[i], s_x, sid * MM * XST, XST, ROW_MAJOR);
                    subgroupMemoryBarrierShared();
                    subgroupBarrier();
                }
                if (!mine) continue;
#if KV_I8
                ACC acc = ACC(0.0);
#else
                ACC acc = o[i];
#endif
                for (uint kb = 0u; kb < BC / MK; ++kb) {
                    MAT_B vb;
                    coopMatLoad(vb, s_kv, (kb * MK * KVST + nv * MN) / 4u, KVST / 4u, ROW_MAJOR);
                    MAT_A pa;
                    coopMatLoad(pa, s_p, (mi * MM * PST + kb * MK) / 4u, PST / 4u, ROW_MAJOR);
                    acc = coopMatMulAdd(pa, vb, acc);
                    coopMatLoad(pa, s_p, ((BR + mi * MM) * PST + kb * MK) / 4u, PST / 4u, ROW_MAJOR);
                    acc = coopMatMulAdd(pa, vb, acc);
                }
#if KV_I8
                o[i] = o[i] + acc * vmx;
#else
                o[i] = acc;
#endif
            }
            barrier();                        // s_kv, s_p, s_alpha free for the next block
        }
    }

    // the rows' max and sum, for the output (and the partials' ml, lse: one thread per row)
    [[unroll]] for (uint k = 0u; k < RPT; ++k) {
        const uint r = team + k * TEAMS;
        if (tl == 0u && r < BR) {
            s_m[r] = m_r[k];
            s_l[r] = l_r[k];
            const uint orow = out_row(r, qt);
            if (orow != ~0u) {
                if (SPLIT != 0u) mlbuf[sp * nrows + orow] = vec2(m_r[k], l_r[k]);
                else lsebuf[orow] = l_r[k] > 0.0 ? (m_r[k] + log2(l_r[k])) * LN2 : NEG_INF;
            }
        }
    }
    barrier();
    OPT_LOOP for (uint i = 0u; i < OPT; ++i) {   // (the same number of subgroup barriers everywhere)
        const uint t = sid + i * NSG;
        const bool mine = t < OT;
        const uint mi = mine ? t / VT : 0u, nv = t % VT;
        if (mine) coopMatStore(o[i], s_x, sid * MM * XST, XST, ROW_MAJOR);
        subgroupMemoryBarrierShared();
        subgroupBarrier();
        for (uint e = lane; mine && e < MM * MN; e += SG) {
            const uint qv = mi * MM + e / MN, c = nv * MN + e % MN;
            const uint orow = out_row(qv, qt);
            if (orow == ~0u || c >= DV) continue;
            const float x = s_x[sid * MM * XST + (e / MN) * XST + e % MN];
            if (SPLIT != 0u) part[(sp * nrows + orow) * DVP + c] = x;
            else outbuf[orow * DV + c] = s_l[qv] > 0.0 ? x / s_l[qv] : 0.0;
        }
        subgroupMemoryBarrierShared();
        subgroupBarrier();
    }
    if (SPLIT == 0u) return;

    // split-K: the last workgroup of this tile merges the splits, ordered as in attn.comp (its
    // header spells out the chain): F1 release, C1, thread 0: F2, the counter, F3, C2, F4 acquire
    memoryBarrierBuffer();                                                    // F1
    barrier();                                                                // C1
    if (tid == 0u) {
        memoryBarrierBuffer();                                                // F2
        s_last = atomicAdd(auxc[aux[17] + hh * gl_NumWorkGroups.y + y], 1u);
        memoryBarrierBuffer();                                                // F3
    }
    barrier();                                                                // C2
    if (s_last != gl_NumWorkGroups.x - 1u) return;
    memoryBarrierBuffer();                                                    // F4
    [[unroll]] for (uint k = 0u; k < RPT; ++k) {
        const uint r = team + k * TEAMS;
        const uint orow = r < BR ? out_row(r, qt) : ~0u;
        if (orow == ~0u) continue;
        float mx = M_EMPTY;
        for (uint s = 0u; s < gl_NumWorkGroups.x; ++s) mx = max(mx, mlbuf[s * nrows + orow].x);
        float lt = 0.0;
        for (uint s = 0u; s < gl_NumWorkGroups.x; ++s) {
            const vec2 ms = mlbuf[s * nrows + orow];
            lt += exp2(ms.x - mx) * ms.y;
        }
        for (uint c = tl; c < DV; c += TPR) {
            float acc = 0.0;
            for (uint s = 0u; s < gl_NumWorkGroups.x; ++s)
                acc += exp2(mlbuf[s * nrows + orow].x - mx) * part[(s * nrows + orow) * DVP + c];
            outbuf[orow * DV + c] = lt > 0.0 ? acc / lt : 0.0;
        }
        if (tl == 0u) lsebuf[orow] = lt > 0.0 ? (mx + log2(lt)) * LN2 : NEG_INF;
    }
}
