#version 450
// attn_coopmat.comp -- flash attention for prefill and chunks on cooperative matrices
// (VK_KHR_cooperative_matrix, GL_KHR_cooperative_matrix): S = Q K^T and O += P V as subgroup
// matrix products, float16 inputs and float32 accumulation; the online softmax in float32. The
// third attention kernel beside attn.comp (tile) and attn_lane.comp: same bindings, the same aux
// buffer and score rules (attn_common.glsl), the same outputs and split-K merge.
//
// Contract (the tuning picks this kernel only for calls with more than one query row)
//   grid (SPLITS, tiles, HKV); workgroup (sp, y, h) takes tile y of the aux tile table =
//   (sequence i, query tile qt): the G query heads h*G .. h*G+G-1 of kv head h, query rows
//   qt*BQ .. qt*BQ+BQ-1 of sequence i, keys kstart_i + sp*chunk_i .. (+ chunk_i).
//   kc, vc   : cache uvec4 rows (common.glsl), float16 (KV_F16), int8 (KV_I8) or fp8 (KV_FP8)
//              storage, read only: every sequence's n_new is 0 (the host appends a call's new rows first,
//              CacheBase._appends_first), so its T = past keys are all in the cache.
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
// Matrices (subgroup scope, MM x MN x MK from the device's VkCooperativeMatrixPropertiesKHR: 8x8x8
// on lavapipe 26, 16x16x16 on RDNA3/RDNA4/NVIDIA). The workgroup's BR = NSG * MM query vectors
// (qv = g*BQ + row: the GQA heads folded into the matrix rows; NQ = G*BQ of them exist) are one
// row tile per subgroup, and a subgroup owns its tile's whole flash-attention state: its Q
// matrices (loaded once: hi in registers, lo in shared memory), its S tile, its rows' softmax,
// its O accumulators (all DV columns). Per block of BC keys (a multiple of MN, MK and 8*TPR):
//   all threads     stage the block's K and V rows into shared memory as float16 (int8: its
//                   integers, exact in float16, the row scales beside them; fp8: its values,
//                   exact in float16, e4m3's times 2^-8: common.glsl fp8x4_halves)     barrier
//   each subgroup   S (MM x BC) = Q . K^T into its scratch tile; its lanes read their rows' scores
//                   (TPR lanes a row, runs of 8 adjacent columns each), the online softmax in
//                   registers, each row's rescale into s_alpha                         barrier
//                   where some row of the workgroup moved its max: O's rows times alpha through
//                   the scratch tile; P (hi, lo) into the scratch tile; O += P . V      barrier
// The workgroup barriers are the same for every subgroup, and so are the subgroup barriers (a
// subgroup with no live row skips only its matrix work): lavapipe 26 turns a subgroup barrier into
// a workgroup-wide suspension point, and subgroups that pass different counts of them lose their
// state.
//
// Shared memory is one uvec4 array (8 float16 or 4 float32 a word) and every matrix row, tile and
// stride is a whole number of words: every cooperative-matrix load and store starts on a 16-byte
// boundary whatever the driver's layout of shared variables (VUID-RuntimeSpirv-
// OpCooperativeMatrixLoadKHR-08986), and every invocation stores whole 32-bit words (P: whole
// uvec4 words per lane) -- no two invocations store into one word.
//
// float32 results from float16 operands: Q and P are each split into two float16 matrices, hi
// (x with 13 mantissa bits cleared) and lo = f16(x - hi), and both are multiplied
// (|x - hi - lo| <= 2^-21 |x|, or 2^-25 absolute below float16's normal range), while K and
// V are float16 already (or int8 integers, or fp8 values, exact in float16). Every product of two
// float16 values is exact in float32, so the scores and sums have the accuracy of float32
// arithmetic, within vkattn.reference.TOLERANCE, at twice the matrix work. Each Q row is scaled by a power of two
// 2^-e first (max |q| in [0.5, 1)), so no query overflows float16, and its scores by 2^e after.
// int8: S column j times the key's scale; P column j times v_scale_j / (the block's largest
// v_scale) before the split, and the block's product times that largest scale is added to O.
// fp8: one scale per kv head for K and one for V (times FP8_HALF_SCALE): S times K's, O's
// columns times V's where they are written (out, or the split's partial sums).
//
// Online softmax (float32, log2 units): a row's running max m moves only when a score passes it
// by more than TAU (P = 2^(s - m) <= 2^TAU stays far inside float16): m then rarely moves after a
// row's first keys, and O's rows are rescaled (alpha = 2^(m_old - m_new)) only in a block where
// some row's max moved and that row already holds a sum -- through the subgroup's scratch tile,
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
#if KV_BF16 || KV_Q4
// bfloat16's exponent range does not fit in float16 matrices: such caches never come here
// (vkattn.formats: matrices=False; tuning.coopmat_config falls back to attn.comp / attn_lane.comp).
// q4 takes the same fallback (its levels q - z reach 3855, past the integers float16 holds exactly,
// 2048, and a scale per 16 values would need a rescale inside each matrix product; not built)
#error "attn_coopmat.comp takes float16, int8 and fp8 storage only"
#endif

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint G = 1u;       // q heads per kv head
layout(constant_id = 2) const uint BQ = 1u;      // query rows per workgroup
layout(constant_id = 3) const uint DK4 = 16u;    // uvec4 per K row
layout(constant_id = 4) const uint DV4 = 16u;    // uvec4 per V row
layout(constant_id = 5) const uint DV = 128u;    // v_head_dim (unpadded)
layout(constant_id = 6) const uint SPLIT = 0u;   // 1: the keys are split over the grid's x
layout(constant_id = 7) const uint FLAGS = 0u;   // variants (attn_common.glsl)
layout(constant_id = 8) const uint ROPE_DIM = 8u;  // rotated elements (ROPE_Q)
layout(constant_id = 9) const uint SG = 8u;      // subgroup size the pipeline is pinned to
layout(constant_id = 10) const uint MM = 8u;     // matrix shape: A is MM x MK, B MK x MN, C MM x MN
layout(constant_id = 11) const uint MN = 8u;
layout(constant_id = 12) const uint MK = 8u;
layout(constant_id = 13) const uint BC = 16u;    // keys per block (a multiple of MN, MK and 8 * TPR)
layout(constant_id = 14) const uint BR = 32u;    // query vectors per workgroup: NSG * MM (>= G*BQ)
layout(constant_id = 15) const uint TPR = 1u;    // softmax lanes per row: SG / MM, at least 1

layout(std430, binding = 0) readonly buffer KC { uvec4 kc[]; };
layout(std430, binding = 1) readonly buffer VC { uvec4 vc[]; };
layout(std430, binding = 2) readonly buffer NK { vec4 nk[]; };   // new rows: unused (n_new is 0)
layout(std430, binding = 3) readonly buffer NV { vec4 nv[]; };
layout(std430, binding = 4) readonly buffer QB { vec4 qbuf[]; };
layout(std430, binding = 5) readonly buffer AUX { uint aux[]; };
layout(std430, binding = 5) coherent buffer AUXC { uint auxc[]; };   // the same buffer: split counters
layout(std430, binding = 6) writeonly buffer OUT { float outbuf[]; };
layout(std430, binding = 7) coherent buffer PART { float part[]; };
layout(std430, binding = 8) coherent buffer ML { vec2 mlbuf[]; };
layout(std430, binding = 9) writeonly buffer LSE { float lsebuf[]; };
layout(std430, binding = 10) readonly buffer ROPE { vec4 rope_tab[]; };
layout(std430, binding = 11) readonly buffer KS { float kscale[]; };   // KV_I8: scale of each cache row; KV_FP8: of each kv head
layout(std430, binding = 12) readonly buffer VS { float vscale[]; };

#include "attn_common.glsl"
#include "rope.glsl"

#ifndef COOPMAT_UNROLL
#define COOPMAT_UNROLL 1
#endif
// COOPMAT_FIXED_TRIPS (vkattn.tuning.coopmat_fixed_trips): the loops over a tile of O's words,
// SG lanes at a time, take a fixed ceil(words / SG) steps, so that the loops over O's tiles around
// them unroll and o[] stays in registers (NVK's compiler kept o[] in local memory, 256 bytes a
// thread read and written at every key block, while these loops started from the lane index and
// ran to the end: perf/gpu_report_nvk.md); 0 builds those earlier loops
#ifndef COOPMAT_FIXED_TRIPS
#define COOPMAT_FIXED_TRIPS 1
#endif
// COOPMAT_STAGE_BATCH (vkattn.tuning.coopmat_stage_batch): stage() issues all of a block's K/V
// loads before its shared stores (see there); 0 builds the loop that loads and stores a word at a
// time
#ifndef COOPMAT_STAGE_BATCH
#define COOPMAT_STAGE_BATCH 1
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
const uint NSG = WG / SG;                 // subgroups per workgroup, one row tile each
const uint NQ = G * BQ;                   // query vectors that exist (rows NQ .. BR-1 are padding)
const uint HW = CH * 4u;                  // values per storage word (8 float16, 16 int8)
const uint DKP = DK4 * HW, DVP = DV4 * HW;   // values per stored (padded) K, V row
const uint DKS = (DKP + MK - 1u) / MK * MK;  // staged K row: a multiple of the matrix K
const uint DVS = (DVP + MN - 1u) / MN * MN;  // staged V row and O columns: a multiple of N
const uint QS = DKS / MK;                 // d steps of S = Q K^T
const uint NT = BC / MN;                  // S column tiles
const uint KB = BC / MK;                  // key steps of O += P V
const uint VT = DVS / MN;                 // O column tiles (a subgroup's accumulators)
const uint SKW = DK4 * CH / 2u, SVW = DV4 * CH / 2u;   // shared words a K, V row is staged into
const uint PADK = DKS / 8u - SKW, PADV = DVS / 8u - SVW;  // words past them, kept zero
const uint PADW = PADK + PADV, PADD = PADW > 0u ? PADW : 1u;
const uint TEAMS = SG / TPR;              // rows a subgroup's lanes take at once (<= MM)
const uint RPL = MM / TEAMS;              // rows per lane: team + k * TEAMS of its subgroup's tile
const uint CPL = BC / TPR;                // columns per lane: runs of 8 adjacent columns
const float TAU = 8.0;                    // log2 units a score may pass the running max by
#define M_EMPTY uintBitsToFloat(0xff7fffffu)

// shared words (uvec4) per row: 16 bytes of padding against bank conflicts
const uint KROW = DKS / 8u + 1u, VROW = DVS / 8u + 1u, QROW = KROW;
const uint SROW = BC / 4u + 1u;           // S: float32
const uint PROW = BC / 8u + 1u;           // P: float16, hi rows then lo rows
const uint OROW = MN / 4u + 1u;           // one O tile: float32
const uint XA = MM * SROW, XB = 2u * MM * PROW, XC = MM * OROW;
const uint XAB = XA > XB ? XA : XB;
const uint XW = XAB > XC ? XAB : XC;      // a subgroup's scratch tile: S, then P; O at the end
const uint VOFF = BC * KROW, XOFF = BC * (KROW + VROW);
const uint LOOPW = XOFF + NSG * XW, QW = BR * QROW;
const uint QLO = LOOPW > QW ? LOOPW : QW;    // Q's lo rows, for the whole dispatch; before them the
const uint SMEM = QLO + QW;                  // loop's K, V and scratch tiles, or (before the loop)
shared uvec4 s_mem[SMEM];                    // the staging of Q's hi rows
shared float s_alpha[BR];                 // this block's rescale of each row
shared float s_l[BR];                     // the rows' final sums
shared float s_ksc[KV_I8 != 0 ? BC : 1u], s_vsc[KV_I8 != 0 ? BC : 1u];   // int8 row scales
shared uint s_grew[NSG];                  // per subgroup: some row's max moved (and it holds a sum)
shared uint s_last;

// this invocation's indices
#define hh gl_WorkGroupID.z
#define tid gl_LocalInvocationID.x
#define sid gl_SubgroupID
#define lane gl_SubgroupInvocationID
#define team (lane / TPR)
#define tl (lane % TPR)
#define XBASE (XOFF + sid * XW)

Seq sq;
MAT_A qh[QS];                             // this subgroup's Q rows: hi part (lo: shared, at QLO)
ACC o[VT];                                // .. and their O columns
float m_r[RPL], l_r[RPL], slope[RPL];
float ksc = 1.0, vsc = 1.0;               // fp8: the kv head's K and V scales, times FP8_HALF_SCALE
int qe[RPL];
uint qrow[RPL], qpos[RPL], vis_end[RPL];

// query vector of this lane's k-th row
uint lane_row(uint k) { return sid * MM + team + k * TEAMS; }

// 8 int8 (two words, low byte first) -> 8 float16 integers, one shared word
uvec4 i8_halves(uint a, uint b) {
    const f16vec4 x = f16vec4(unpack_i8x4(a)), y = f16vec4(unpack_i8x4(b));
    return uvec4(packFloat2x16(x.xy), packFloat2x16(x.zw), packFloat2x16(y.xy), packFloat2x16(y.zw));
}

// 8 float32 -> 8 float16 in one word (the values are float16 values: conversion exact, except
// below float16's normal range, where it rounds)
uvec4 halves8(vec4 a, vec4 b) {
    const f16vec4 x = f16vec4(a), y = f16vec4(b);
    return uvec4(packFloat2x16(x.xy), packFloat2x16(x.zw), packFloat2x16(y.xy), packFloat2x16(y.zw));
}

// x = hi + lo: hi is x with its 13 lowest mantissa bits cleared, a float16 value (|x| in float16's
// normal range: exact; below it the conversion rounds, by at most 2^-25), lo = x - hi exactly, 13
// significant bits of which float16 keeps 11. Bit operations, not a float16 round trip: a
// conversion's rounding is the driver's (lavapipe 26 keeps float16 values in float32 registers,
// so f16(x) - x there is 0 until stored).
vec4 hi_part(vec4 x) { return uintBitsToFloat(floatBitsToUint(x) & 0xffffe000u); }

float team_max(float x) {
    [[unroll]] for (uint o = 1u; o < TPR; o *= 2u) x = max(x, subgroupShuffleXor(x, o));
    return x;
}

float team_sum(float x) {
    [[unroll]] for (uint o = 1u; o < TPR; o *= 2u) x += subgroupShuffleXor(x, o);
    return x;
}

// keys j0 .. j0+BC-1 (those below hi exist; the rest are zeros) of K and V into shared memory as
// float16 rows; int8: the key and value scales of the block (0 past hi)
// a staged word: K or V row c's word ww at shared row base (int8: two words of float16 integers;
// fp8: two words of float16 values, e4m3's times 2^-8)
void put_word(uint base, uint ww, uvec4 word) {
#if KV_I8
    s_mem[base + 2u * ww] = i8_halves(word.x, word.y);
    s_mem[base + 2u * ww + 1u] = i8_halves(word.z, word.w);
#elif KV_FP8
    s_mem[base + 2u * ww] = uvec4(fp8x4_halves(word.x), fp8x4_halves(word.y));
    s_mem[base + 2u * ww + 1u] = uvec4(fp8x4_halves(word.z), fp8x4_halves(word.w));
#else
    s_mem[base + ww] = word;
#endif
}

void stage(uint j0, uint hi) {
#if COOPMAT_STAGE_BATCH
    // every global load of the block first, unconditional (past hi: the last key's row, zeroed
    // after), K's then V's, then the shared stores: straight-line loads stay in flight together,
    // one memory latency a block. (NVK's NAK waited for each load at the end of the branch that
    // held it: 8 latencies a block for a thread's 8 words, float16 d128; perf/gpu_report_nvk.md)
    const uint TK = (BC * DK4 + WG - 1u) / WG, TV = (BC * DV4 + WG - 1u) / WG;
    uvec4 kw[TK], vw[TV];
    OPT_LOOP for (uint t = 0u; t < TK; ++t) {
        const uint i = min(tid + t * WG, BC * DK4 - 1u);
        kw[t] = kc[cache_row(sq.bt, hh, min(j0 + i / DK4, hi - 1u)) * DK4 + i % DK4];
    }
    OPT_LOOP for (uint t = 0u; t < TV; ++t) {
        const uint i = min(tid + t * WG, BC * DV4 - 1u);
        vw[t] = vc[cache_row(sq.bt, hh, min(j0 + i / DV4, hi - 1u)) * DV4 + i % DV4];
    }
    OPT_LOOP for (uint t = 0u; t < TK; ++t) {
        const uint i = tid + t * WG, c = i / DK4;
        if (i < BC * DK4) put_word(c * KROW, i % DK4, j0 + c < hi ? kw[t] : uvec4(0u));
    }
    OPT_LOOP for (uint t = 0u; t < TV; ++t) {
        const uint i = tid + t * WG, c = i / DV4;
        if (i < BC * DV4) put_word(VOFF + c * VROW, i % DV4, j0 + c < hi ? vw[t] : uvec4(0u));
    }
#else
    const uint wpr = DK4 + DV4;
    for (uint i = tid; i < BC * wpr; i += WG) {
        const uint c = i / wpr, w = i % wpr, j = j0 + c;
        const bool is_k = w < DK4;
        const uint ww = is_k ? w : w - DK4;
        uvec4 word = uvec4(0u);
        if (j < hi) {
            const uint row = cache_row(sq.bt, hh, j);
            word = is_k ? kc[row * DK4 + ww] : vc[row * DV4 + ww];
        }
        put_word(is_k ? c * KROW : VOFF + c * VROW, ww, word);
    }
#endif
#if KV_I8
    for (uint c = tid; c < BC; c += WG) {
        const uint j = j0 + c;
        float ks = 0.0, vs = 0.0;
        if (j < hi) {
            const uint row = cache_row(sq.bt, hh, j);
            ks = kscale[row];
            vs = vscale[row];
        }
        s_ksc[c] = ks;
        s_vsc[c] = vs;
    }
#endif
}

// vec4 u of query vector k's row (q * scale * log2(e), rotated with ROPE_Q), zeros past the row
vec4 q_vec4(uint k, uint qbase, uint u, bool ok, float qscale) {
    if (!ok || u >= DK4 * CH) return vec4(0.0);
    vec4 x = qbuf[qbase + u];
    if (HAS(F_ROPE_Q)) x = rope_rotate(x, qbuf[qbase + rope_partner(u)], u, sq.rope_row + qpos[k] - sq.rope_pos);
    return x * qscale;
}

// this lane's rows' state, and the subgroup's Q matrices: each row scaled by 2^-e (its max |x| in
// [0.5, 1)), split into hi and lo; hi staged through shared memory into registers, lo kept in
// shared memory (registers for both would be 128 VGPRs a lane on RDNA3, whose WMMA operands are
// replicated across the wave's halves: spills)
void load_q(uint qt, float qscale, bool causal, bool live) {
    const uint T = sq.past + sq.n_new, R = aux[10];
    uint qbase[RPL];
    bool ok[RPL];
    [[unroll]] for (uint k = 0u; k < RPL; ++k) {
        const uint r = lane_row(k), qv = min(r, NQ - 1u);
        const uint g = qv / BQ, row = qt * BQ + qv % BQ;
        ok[k] = r < NQ && row < sq.q_len;
        qrow[k] = row;
        qpos[k] = T - sq.q_len + row;
        vis_end[k] = ok[k] ? (causal ? qpos[k] + 1u : T) : 0u;
        slope[k] = HAS(F_ALIBI) ? uintBitsToFloat(aux[aux[15] + hh * G + g]) : 0.0;
        m_r[k] = M_EMPTY;
        l_r[k] = 0.0;
        qbase[k] = ((hh * G + g) * R + sq.q_start + min(row, sq.q_len - 1u)) * DK4 * CH;
        float amax = 0.0;
        for (uint u = tl; u < DKS / 4u; u += TPR) amax = max(amax, vmax_abs(q_vec4(k, qbase[k], u, ok[k], qscale)));
        amax = team_max(amax);
        int e;
        frexp(amax, e);                        // amax = f * 2^e, f in [0.5, 1) (0: e = 0)
        qe[k] = amax == 0.0 ? 0 : e;
    }
    [[unroll]] for (uint k = 0u; k < RPL; ++k)
        for (uint w = tl; w < DKS / 8u; w += TPR) {
            const vec4 a = ldexp(q_vec4(k, qbase[k], 2u * w, ok[k], qscale), ivec4(-qe[k]));
            const vec4 b = ldexp(q_vec4(k, qbase[k], 2u * w + 1u, ok[k], qscale), ivec4(-qe[k]));
            const vec4 ah = hi_part(a), bh = hi_part(b);
            s_mem[lane_row(k) * QROW + w] = halves8(ah, bh);
            s_mem[QLO + lane_row(k) * QROW + w] = halves8(a - ah, b - bh);
        }
    barrier();
    if (live)
        OPT_LOOP for (uint d = 0u; d < QS; ++d)
            coopMatLoad(qh[d], s_mem, sid * MM * QROW + d * (MK / 8u), QROW, ROW_MAJOR);
    barrier();
}

// the output row of query vector qv, or ~0u where it does not exist (padding, past q_len)
uint out_row(uint qv, uint qt) {
    const uint row = qt * BQ + qv % BQ;
    if (qv >= NQ || row >= sq.q_len) return ~0u;
    return (hh * G + qv / BQ) * aux[10] + sq.q_start + row;
}

// one block of keys j0 .. j0+BC-1 (those below kh exist) against the subgroup's rows
void block(uint j0, uint kh, bool live) {
    stage(j0, kh);
    barrier();                                // K, V (and their scales) staged
    if (live) {                               // S = Q K^T into the scratch tile
        ACC acc[NT];
        OPT_LOOP for (uint ni = 0u; ni < NT; ++ni) acc[ni] = ACC(0.0);
        OPT_LOOP for (uint d = 0u; d < QS; ++d) {
            MAT_A ql;
            coopMatLoad(ql, s_mem, QLO + sid * MM * QROW + d * (MK / 8u), QROW, ROW_MAJOR);
            OPT_LOOP for (uint ni = 0u; ni < NT; ++ni) {
                MAT_B kb;
                coopMatLoad(kb, s_mem, ni * MN * KROW + d * (MK / 8u), KROW, COL_MAJOR);
                acc[ni] = coopMatMulAdd(qh[d], kb, acc[ni]);
                acc[ni] = coopMatMulAdd(ql, kb, acc[ni]);
            }
        }
        OPT_LOOP for (uint ni = 0u; ni < NT; ++ni)
            coopMatStore(acc[ni], s_mem, XBASE + ni * (MN / 4u), SROW, ROW_MAJOR);
    }
    subgroupMemoryBarrierShared();
    subgroupBarrier();
#if KV_I8
    float vmx = 0.0;
    for (uint c = 0u; c < BC; ++c) vmx = max(vmx, s_vsc[c]);
#endif
    // the online softmax of the lane's rows: its scores, then its P values, in registers
    float p[RPL][CPL];
    bool moved = false;
    [[unroll]] for (uint k = 0u; k < RPL; ++k) {
        const uint r = lane_row(k), lr = r - sid * MM, qv = min(r, NQ - 1u);
        float smax = NEG_INF;
        [[unroll]] for (uint i = 0u; i < CPL; i += 4u) {
            const uint c = 8u * (tl + (i / 8u) * TPR) + i % 8u;
            const vec4 x4 = ldexp(uintBitsToFloat(s_mem[XBASE + lr * SROW + c / 4u]), ivec4(qe[k]));
            [[unroll]] for (uint e = 0u; e < 4u; ++e) {
                const uint j = j0 + c + e;
                float x = x4[e];
#if KV_I8
                x *= s_ksc[c + e];
#elif KV_FP8
                x *= ksc;
#endif
                bool vis = j < kh && j < vis_end[k];
                if (HAS(F_WINDOW)) vis = vis && key_visible(j, qpos[k], false);
                x = shape_score(x, slope[k], j, qpos[k]);
                if (HAS(F_MASK)) x += mask_at(sq, hh * G + qv / BQ, qrow[k], min(j, kh - 1u));
                p[k][i + e] = vis ? x : NEG_INF;
                smax = max(smax, p[k][i + e]);
            }
        }
        smax = team_max(smax);
        const float mold = m_r[k];
        const float mnew = smax > mold + TAU ? smax : mold;
        const float alpha = mnew == mold ? 1.0 : exp2(mold - mnew);
        moved = moved || (mnew != mold && l_r[k] > 0.0);
        float psum = 0.0;
        [[unroll]] for (uint i = 0u; i < CPL; ++i) {
            const float pe = exp2(p[k][i] - mnew);
            psum += pe;
#if KV_I8
            const uint c = 8u * (tl + (i / 8u) * TPR) + i % 8u;
            p[k][i] = vmx > 0.0 ? pe * (s_vsc[c] / vmx) : 0.0;
#else
            p[k][i] = pe;
#endif
        }
        l_r[k] = l_r[k] * alpha + team_sum(psum);
        m_r[k] = mnew;
        if (tl == 0u) s_alpha[r] = alpha;
    }
    const bool any = subgroupAny(moved);
    if (subgroupElect()) s_grew[sid] = any ? 1u : 0u;
    barrier();                                // S read, s_alpha and s_grew written
    bool rescale = false;
    for (uint s = 0u; s < NSG; ++s) rescale = rescale || s_grew[s] != 0u;
    if (rescale) {                            // O's rows times alpha, a tile at a time
        OPT_LOOP for (uint t = 0u; t < VT; ++t) {
            if (live) coopMatStore(o[t], s_mem, XBASE, OROW, ROW_MAJOR);
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            // the tile's words, SG lanes at a time (COOPMAT_FIXED_TRIPS: see its definition)
#if COOPMAT_FIXED_TRIPS
            if (live)
                OPT_LOOP for (uint i = 0u, e = lane; i < (MM * MN / 4u + SG - 1u) / SG; ++i, e += SG) {
                    if (e >= MM * MN / 4u) break;
#else
            if (live)
                for (uint e = lane; e < MM * MN / 4u; e += SG) {
#endif
                    const uint rr = e / (MN / 4u), w = XBASE + rr * OROW + e % (MN / 4u);
                    s_mem[w] = floatBitsToUint(uintBitsToFloat(s_mem[w]) * s_alpha[sid * MM + rr]);
                }
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            if (live) coopMatLoad(o[t], s_mem, XBASE, OROW, ROW_MAJOR);
            subgroupMemoryBarrierShared();
            subgroupBarrier();
        }
    }
    // P (hi rows, then lo rows) into the scratch tile: each lane whole words of its runs
    [[unroll]] for (uint k = 0u; k < RPL; ++k) {
        const uint lr = lane_row(k) - sid * MM;
        [[unroll]] for (uint i = 0u; i < CPL; i += 8u) {
            const uint w = (tl + (i / 8u) * TPR);
            const vec4 a = vec4(p[k][i], p[k][i + 1u], p[k][i + 2u], p[k][i + 3u]);
            const vec4 b = vec4(p[k][i + 4u], p[k][i + 5u], p[k][i + 6u], p[k][i + 7u]);
            const vec4 ah = hi_part(a), bh = hi_part(b);
            s_mem[XBASE + lr * PROW + w] = halves8(ah, bh);
            s_mem[XBASE + (MM + lr) * PROW + w] = halves8(a - ah, b - bh);
        }
    }
    subgroupMemoryBarrierShared();
    subgroupBarrier();
    if (live) {                               // O += P V
        // Each key block's P V is summed afresh in `acc` and added to O in float32 outside the
        // multiply-add: no sum carried across key blocks inside coopMatMulAdd, whose accumulation
        // rounding the extension leaves to the implementation (truncating tensor cores lose about
        // one ulp per block there: 3e-4 relative at 128K keys). One matrix a declaration: glslang
        // 13.1-15.0 drops the use of a second declarator (`MAT_A ph, pl;`), an invalid module.
        OPT_LOOP for (uint t = 0u; t < VT; ++t) {
            ACC acc = ACC(0.0);
            OPT_LOOP for (uint kb = 0u; kb < KB; ++kb) {
                MAT_A ph;
                MAT_A pl;
                coopMatLoad(ph, s_mem, XBASE + kb * (MK / 8u), PROW, ROW_MAJOR);
                coopMatLoad(pl, s_mem, XBASE + MM * PROW + kb * (MK / 8u), PROW, ROW_MAJOR);
                MAT_B vb;
                coopMatLoad(vb, s_mem, VOFF + kb * MK * VROW + t * (MN / 8u), VROW, ROW_MAJOR);
                acc = coopMatMulAdd(ph, vb, acc);
                acc = coopMatMulAdd(pl, vb, acc);
            }
#if KV_I8
            o[t] = o[t] + acc * vmx;
#else
            o[t] = o[t] + acc;
#endif
        }
    }
    barrier();                                // K, V and the scratch tiles free for the next block
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
    const bool live = sid * MM < NQ;          // this subgroup's row tile holds query vectors

#if KV_FP8
    ksc = FP8_HALF_SCALE * kscale[hh];        // finite: scale * 448 is (check_fp8_scale)
    vsc = FP8_HALF_SCALE * vscale[hh];
#endif
    load_q(qt, uintBitsToFloat(aux[2]), causal, live);
    OPT_LOOP for (uint t = 0u; t < VT; ++t) o[t] = ACC(0.0);
    // the staged rows' words past the stored row are zeros, once (the staging never writes them)
    for (uint i = tid; i < BC * PADW; i += WG) {
        const uint c = i / PADD, w = i % PADD;
        s_mem[w < PADK ? c * KROW + SKW + w : VOFF + c * VROW + SVW + w - PADK] = uvec4(0u);
    }

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
    for (uint part_i = 0u; part_i < 3u; ++part_i)
        for (uint j0 = lo[part_i]; j0 < hi[part_i]; j0 += BC) block(j0, hi[part_i], live);

    // the rows' sums, for the output (and the partials' ml, lse: one lane per row)
    [[unroll]] for (uint k = 0u; k < RPL; ++k) {
        const uint r = lane_row(k);
        if (tl == 0u) {
            s_l[r] = l_r[k];
            const uint orow = out_row(r, qt);
            if (orow != ~0u) {
                if (SPLIT != 0u) mlbuf[sp * nrows + orow] = vec2(m_r[k], l_r[k]);
                else lsebuf[orow] = l_r[k] > 0.0 ? (m_r[k] + log2(l_r[k])) * LN2 : NEG_INF;
            }
        }
    }
    subgroupMemoryBarrierShared();
    subgroupBarrier();
    OPT_LOOP for (uint t = 0u; t < VT; ++t) {   // (the same number of subgroup barriers everywhere)
        if (live) coopMatStore(o[t], s_mem, XBASE, OROW, ROW_MAJOR);
        subgroupMemoryBarrierShared();
        subgroupBarrier();
#if COOPMAT_FIXED_TRIPS
        if (live)
            OPT_LOOP for (uint i = 0u, e = lane; i < (MM * MN + SG - 1u) / SG; ++i, e += SG) {
                if (e >= MM * MN) break;
#else
        for (uint e = lane; live && e < MM * MN; e += SG) {
#endif
                const uint qv = sid * MM + e / MN, c = t * MN + e % MN;
                const uint orow = out_row(qv, qt);
                if (orow == ~0u || c >= DV) continue;
                const float x = uintBitsToFloat(s_mem[XBASE + (e / MN) * OROW + (e % MN) / 4u][e % 4u]) * vsc;
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
    // the last one back to zero: the counters are 0 before and after every dispatch, so a
    // recording replays with no upload of them (host memory the device uses directly, graphs)
    if (tid == 0u) atomicExchange(auxc[aux[17] + hh * gl_NumWorkGroups.y + y], 0u);
    memoryBarrierBuffer();                                                    // F4
    [[unroll]] for (uint k = 0u; k < RPL; ++k) {
        const uint orow = out_row(lane_row(k), qt);
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
