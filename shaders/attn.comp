#version 450
// attn.comp -- flash attention over the persistent cache (plus a call's new rows), one dispatch;
// the GPU kernel (CPU Vulkan drivers use attn_lane.comp). Per-call values, the sequences of a
// batch and the score rules (window, sinks, softcap, ALiBi, mask) are in aux: attn_common.glsl.
//
// Contract
//   grid (SPLITS, tiles, HKV); workgroup (sp, y, h) takes tile y of the aux tile table =
//   (sequence i, query tile qt), so
//     * the G query heads h*G .. h*G+G-1 that share kv head h (GQA/MQA; G = 1 is plain MHA),
//     * query rows qt*BQ .. qt*BQ+BQ-1 of the q_len_i rows of sequence i,
//     * keys kstart_i + sp*chunk_i .. (+ chunk_i) of its T_i = past_i + n_new_i positions.
//   kc, vc   : cache uvec4 rows, row of (head, slot) from aux (common.glsl, attn_common.glsl).
//              A sequence with new rows (n_new_i > 0: forward, the append fused in) first stores
//              them (nk, nv: float32 [HKV, NN, DK4*CH | DV4*CH] vec4, rounded / quantised as
//              stored) into their slots, then reads them back like any cache row.
//   q        : float32 [HKV*G, R, DK4*CH] vec4, zero padded
//   out      : float32 [HKV*G, R, DV] normalised (a row that sees nothing gives zeros, never NaN)
//   lse      : float32 [HKV*G, R] natural log-sum-exp of the row's scores (-inf: nothing seen),
//              then (TILE_SHUFFLE) one word: gl_SubgroupSize of this pipeline, as uint bits
//   part, ml : with SPLIT, each split's un-normalised sums, float32 [SPLITS, HKV*G*R, DV4*CH*4],
//              and (running max in log2 units, running sum) vec2 [SPLITS, HKV*G*R]. The last
//              workgroup of a tile to finish (a device-scope counter in aux, zeroed by the call's
//              upload) merges them into out and lse: one dispatch, no host round trip.
//
// Split-K ordering by the Vulkan memory model (appendix "Memory Model"), without the optional
// vulkanMemoryModel feature (kp 0.9 enables none), so in what glslang emits for core GLSL:
//   memoryBarrierBuffer() = OpMemoryBarrier, scope Device, semantics AcquireRelease|UniformMemory:
//                           a release and acquire barrier over storage buffers, device wide
//   barrier()             = OpControlBarrier, execution scope Workgroup (its memory semantics,
//                           WorkgroupMemory only, do not order buffer accesses by themselves)
//   atomicAdd             = OpAtomicIAdd, scope Device, semantics Relaxed (StorageBuffer class)
//   coherent (part, ml)   = per-access availability / visibility at device scope (the appendix
//                           maps GLSL coherent to MakePointerAvailable / MakePointerVisible)
// The rules used: a release barrier A synchronizes-with an acquire barrier B when A is
// program-ordered before a control barrier C and C before B, all in C's execution scope instance
// (C1: each thread's F1 -> thread 0's F2; C2: thread 0's F3 -> each thread's F4); and when A is
// program-ordered before an atomic write X, B after an atomic read Y that reads X or a later
// read-modify-write of X's release sequence, with X's storage class in both semantics (F2 of
// every earlier split -> F3 of the last; a relaxed X heads a release sequence for this rule).
// Each link carries UniformMemory, so inter-thread-happens-before<UniformMemory> chains from every
// partial write to every merge read, and the coherent accesses make the write available to and
// visible from the shader domain along that chain: no data race, the merge reads the partials.
// numpy, one q head of one sequence:
//   s = scale * q @ K[:T].T (+ variants, invisible keys -inf);  out = softmax(s) @ V[:T]
//
// Thread layout. A key row is read by a cluster of DS adjacent threads: thread d of the cluster
// loads the uvec4 words d, d+DS, .. of the row, so a cluster reads one contiguous run of DS*16
// bytes per load (coalesced), and the partial dot products are summed over the cluster with xor
// shuffles (DS <= the subgroup size), or without them (TILE_SHUFFLE 0, no subgroup operation at
// all) through shared memory between two barriers, every thread of a cluster adding the DS
// partials in the same order (DS = 1: one thread per whole row, nothing to sum). Thread
// t = d + DS*(c + COLS*rg): column c of COLS walks its own keys, row group rg owns query vectors
// rg*RPT .. rg*RPT+RPT-1 (qv = g*BQ + row). Every thread keeps its slice of its rows' scaled
// queries and output accumulators, and their running max and sum, in registers: the key loop has
// no shared memory and no barrier. KB keys per column and step are loaded before they are used
// (memory-level parallelism). COLS > 1 merges the columns through shared memory once at the end.
// Per key and thread: KW = ceil(DK4/DS) + VW = ceil(DV4/DS) 16-byte loads. fp32 accumulation.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#if TILE_SHUFFLE
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_KHR_shader_subgroup_vote : require
#endif
#define HALF_NATIVE 1
#include "common.glsl"

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint G = 1u;       // q heads per kv head
layout(constant_id = 2) const uint BQ = 1u;      // query rows per workgroup
layout(constant_id = 3) const uint DK4 = 16u;    // uvec4 per K row
layout(constant_id = 4) const uint DV4 = 16u;    // uvec4 per V row
layout(constant_id = 5) const uint DV = 128u;    // v_head_dim (unpadded)
layout(constant_id = 6) const uint SPLIT = 0u;   // 1: the keys are split over the grid's x (gl_NumWorkGroups.x)
layout(constant_id = 7) const uint FLAGS = 0u;   // variants (attn_common.glsl)
layout(constant_id = 8) const uint ROPE_DIM = 8u;  // rotated elements (ROPE_K / ROPE_Q)
layout(constant_id = 9) const uint DS = 1u;      // threads per key row (a power of two)
layout(constant_id = 10) const uint RPT = 1u;    // query vectors per thread
layout(constant_id = 11) const uint COLS = 1u;   // key columns per workgroup
layout(constant_id = 12) const uint KB = 1u;     // keys per column and step

layout(std430, binding = 0) buffer KC { uvec4 kc[]; };
layout(std430, binding = 1) buffer VC { uvec4 vc[]; };
layout(std430, binding = 2) readonly buffer NK { vec4 nk[]; };
layout(std430, binding = 3) readonly buffer NV { vec4 nv[]; };
layout(std430, binding = 4) readonly buffer QB { vec4 qbuf[]; };
layout(std430, binding = 5) readonly buffer AUX { uint aux[]; };
layout(std430, binding = 5) coherent buffer AUXC { uint auxc[]; };   // the same buffer: split counters
layout(std430, binding = 6) writeonly buffer OUT { float outbuf[]; };
layout(std430, binding = 6) writeonly buffer OUT4 { vec4 outbuf4[]; };   // the same buffer by vec4
layout(std430, binding = 7) coherent buffer PART { vec4 part[]; };
layout(std430, binding = 8) coherent buffer ML { vec2 mlbuf[]; };
layout(std430, binding = 9) writeonly buffer LSE { float lsebuf[]; };
layout(std430, binding = 10) readonly buffer ROPE { vec4 rope_tab[]; };
layout(std430, binding = 11) buffer KS { float kscale[]; };   // KV_I8: scale of each cache row; KV_FP8: of each kv head
layout(std430, binding = 12) buffer VS { float vscale[]; };

// A thread loads a row in units: the 16-byte storage word (float16: 8 values, float32: 4), or for
// int8 and fp8 half a word (8 bytes, 8 values), so such a key costs a thread no more registers
// than a float16 one. UV: float vec4 per unit; DKU, DVU: units per K, V row.
#if KV_Q4
// q4: a unit is one uint (8 values); block u / 2 of the row has its parameter word (scale and
// zero point, common.glsl layout)
#define UV 2u
layout(std430, binding = 0) buffer KC1 { uint kc1[]; };   // the same buffers by 4 bytes
layout(std430, binding = 1) buffer VC1 { uint vc1[]; };
// (q - z) * s as one multiply-add per value, n * s + (-z * s): |z| < 2^12 and s has 12
// significant bits, so -z * s is exact, and so is the sum (a 12-bit integer times s), fused or not
void q4_dequant(uint w, uint p, out vec4 x[UV]) {
    const float s = q4_scale(p), o = -q4_zero(p) * s;
    unpack_q4x8(w, x[0], x[1]);
    x[0] = fma(x[0], vec4(s), vec4(o));
    x[1] = fma(x[1], vec4(s), vec4(o));
}
void k_load(uint row, uint u, out vec4 x[UV]) {
    const uint base = row * Q4_ROW(DK4) * 4u;
    q4_dequant(kc1[base + u], kc1[base + DK4 * 4u + u / 2u], x);
}
void v_load(uint row, uint u, out vec4 x[UV]) {
    const uint base = row * Q4_ROW(DV4) * 4u;
    q4_dequant(vc1[base + u], vc1[base + DV4 * 4u + u / 2u], x);
}
#elif KV_I8 || KV_FP8
#define UV 2u
layout(std430, binding = 0) buffer KC2 { uvec2 kc2[]; };   // the same buffers by 8 bytes
layout(std430, binding = 1) buffer VC2 { uvec2 vc2[]; };
uvec2 k_unit(uint row, uint u) { return kc2[row * DK4 * 2u + u]; }
uvec2 v_unit(uint row, uint u) { return vc2[row * DV4 * 2u + u]; }
#if KV_FP8
// the values times 1 / FP8_RESTORE (common.glsl fp8x4_native): the key loop restores it per key
void unpack_unit(uvec2 w, out vec4 x[UV]) { x[0] = fp8x4_native(w.x); x[1] = fp8x4_native(w.y); }
#else
void unpack_unit(uvec2 w, out vec4 x[UV]) { x[0] = unpack_i8x4(w.x); x[1] = unpack_i8x4(w.y); }
#endif
#define VRAW uvec2
#else
#define UV CH
#define VRAW uvec4
uvec4 k_unit(uint row, uint u) { return kc[row * DK4 + u]; }
uvec4 v_unit(uint row, uint u) { return vc[row * DV4 + u]; }
void unpack_unit(uvec4 w, out vec4 x[UV]) { unpack_chunk(w, x); }
#endif
#if !KV_Q4
void k_load(uint row, uint u, out vec4 x[UV]) { unpack_unit(k_unit(row, u), x); }
void v_load(uint row, uint u, out vec4 x[UV]) { unpack_unit(v_unit(row, u), x); }
#endif

#include "attn_common.glsl"
#include "rope.glsl"

const uint WG = gl_WorkGroupSize.x;
const uint NQ = G * BQ;
const uint DKU = DK4 * CH / UV, DVU = DV4 * CH / UV;
const uint KW = (DKU + DS - 1u) / DS;   // K units per thread and key
const uint VW = (DVU + DS - 1u) / DS;   // V units per thread and key
const uint PV = DV4 * CH;               // vec4 per padded output row
const uint MERGE = COLS > 1u ? COLS * NQ : 1u;
// running max of a row that has seen no key: the most negative finite float, below every finite
// score, so exp2(-inf score - max) = 0 and no -inf - -inf case needs a test
#define M_EMPTY uintBitsToFloat(0xff7fffffu)
const uint LAZY_RESCALE = 8u;           // vec4 accumulators per thread from which the rescale is skipped

shared float s_m[MERGE], s_l[MERGE];
shared vec4 s_acc[COLS > 1u ? MERGE * PV : 1u];
shared uint s_last;
#if !TILE_SHUFFLE
// the cluster sums' exchange without shuffles: NRED floats per thread
const uint NT = DS * COLS * ((NQ + RPT - 1u) / RPT);   // = WG
const uint NRED = RPT * KB > 2u ? RPT * KB : 2u;
shared float s_red[DS > 1u ? NT * NRED : 1u];
#endif

Seq sq;
uint hh, lane_d, col, rg;
vec4 qr[RPT * KW * UV];     // this thread's slice of its rows' scaled queries
vec4 acc[RPT * VW * UV];    // .. and output accumulators
float m[RPT], l[RPT];       // running max (log2 units) and sum per row
float dots[RPT * KB];       // a step's partial dot products, summed over the cluster in place
uint vis_end[RPT];          // key j < vis_end passes the causal rule (0: not a row of this call)
uint qpos[RPT], qrow[RPT];  // position and row index within the sequence
float slope[RPT];

#include "attn_fresh.glsl"

// sums / maxima over the DS threads of a key row (xor butterflies, written out: compilers do not
// unroll a loop whose counter doubles, and a rolled butterfly costs a branch per step)
float cluster_sum(float x) {
#if TILE_SHUFFLE
    if (DS > 1u) x += subgroupShuffleXor(x, 1u);
    if (DS > 2u) x += subgroupShuffleXor(x, 2u);
    if (DS > 4u) x += subgroupShuffleXor(x, 4u);
    if (DS > 8u) x += subgroupShuffleXor(x, 8u);
    if (DS > 16u) x += subgroupShuffleXor(x, 16u);
#endif
    return x;
}

float cluster_max(float x) {
#if TILE_SHUFFLE
    if (DS > 1u) x = max(x, subgroupShuffleXor(x, 1u));
    if (DS > 2u) x = max(x, subgroupShuffleXor(x, 2u));
    if (DS > 4u) x = max(x, subgroupShuffleXor(x, 4u));
    if (DS > 8u) x = max(x, subgroupShuffleXor(x, 8u));
    if (DS > 16u) x = max(x, subgroupShuffleXor(x, 16u));
#endif
    return x;
}

// every thread of the workgroup calls these at the same point (uniform control flow): without
// shuffles they exchange through shared memory between barriers
void cluster_sum_dots() {
#if TILE_SHUFFLE
    [[unroll]] for (uint x = 0u; x < RPT * KB; ++x) dots[x] = cluster_sum(dots[x]);
#else
    if (DS > 1u) {
        const uint t = gl_LocalInvocationID.x, c0 = (t - t % DS) * NRED;
        [[unroll]] for (uint x = 0u; x < RPT * KB; ++x) s_red[t * NRED + x] = dots[x];
        barrier();
        [[unroll]] for (uint x = 0u; x < RPT * KB; ++x) {
            float sum = 0.0;
            // rolled: unrolled, a compiler issues all DS * RPT * KB reads at once (gfx1100, d 128,
            // RPT 4: 132 VGPRs and spills)
            [[dont_unroll]] for (uint d = 0u; d < DS; ++d) sum += s_red[c0 + d * NRED + x];
            dots[x] = sum;
        }
        barrier();
    }
#endif
}

vec2 cluster_max2(vec2 v) {
#if TILE_SHUFFLE
    return vec2(cluster_max(v.x), cluster_max(v.y));
#else
    if (DS > 1u) {
        const uint t = gl_LocalInvocationID.x, c0 = (t - t % DS) * NRED;
        s_red[t * NRED] = v.x;
        s_red[t * NRED + 1u] = v.y;
        barrier();
        [[unroll]] for (uint d = 0u; d < DS; ++d)
            v = max(v, vec2(s_red[c0 + d * NRED], s_red[c0 + d * NRED + 1u]));
        barrier();
    }
    return v;
#endif
}

// a wave-uniform test where subgroups are usable (a branch the whole subgroup takes or skips)
bool any_lane(bool x) {
#if TILE_SHUFFLE
    return subgroupAny(x);
#else
    return x;
#endif
}

// unit i of this thread in a row of n units (clamped: units past the row read its last unit and
// are zeroed or skipped by the caller)
uint my_unit(uint i, uint n) { return min(lane_d + i * DS, n - 1u); }
bool unit_ok(uint i, uint n) { return n % DS == 0u || lane_d + i * DS < n; }

// keys lo .. hi-1 (workgroup-uniform bounds); column col takes keys j0 + col*KB + i of each step
// TILE_V_EARLY (VKATTN_TILE_V_EARLY=1; 0 by default): consume() loads a step's V words with its K
// words instead of after the scores (not for q4). Off until a GPU times it (perf/gpu_session.sh's
// vearly step): RADV's code is the same either way (ACO issues those loads early already), NVK's
// float16 decode takes 128 GPRs instead of 120 at the same 16 warps per SM
#ifndef TILE_V_EARLY
#define TILE_V_EARLY 0
#endif
void consume(uint lo, uint hi) {
    for (uint j0 = lo; j0 < hi; j0 += COLS * KB) {
        uint rows[KB];
        uint js[KB];
        vec4 kx[KB * KW * UV];
        [[unroll]] for (uint i = 0u; i < KB; ++i) {
            js[i] = j0 + col * KB + i;
            rows[i] = cache_row(sq.bt, hh, min(js[i], hi - 1u));
            [[unroll]] for (uint w = 0u; w < KW; ++w) {
                vec4 t[UV];
                k_load(rows[i], my_unit(w, DKU), t);
                [[unroll]] for (uint e = 0u; e < UV; ++e)
                    kx[(i * KW + w) * UV + e] = unit_ok(w, DKU) ? t[e] : vec4(0.0);
            }
        }
#if TILE_V_EARLY && !KV_Q4
        // the step's V words loaded with its K words, before the scores: their latency overlaps
        // the dot products, shuffles and softmax (KB * VW raw words a thread more in registers)
        VRAW vraw[KB * VW];
        [[unroll]] for (uint i = 0u; i < KB; ++i)
            [[unroll]] for (uint w = 0u; w < VW; ++w) vraw[i * VW + w] = v_unit(rows[i], my_unit(w, DVU));
#endif
        [[unroll]] for (uint r = 0u; r < RPT; ++r)
            [[unroll]] for (uint i = 0u; i < KB; ++i) {
                float dsum = 0.0;
                [[unroll]] for (uint x = 0u; x < KW * UV; ++x) dsum += dot(qr[r * KW * UV + x], kx[i * KW * UV + x]);
                dots[r * KB + i] = dsum;
            }
        cluster_sum_dots();
        float p[RPT * KB], alphas[RPT];
        bool grew = false;
        [[unroll]] for (uint r = 0u; r < RPT; ++r) {
            float s[KB];
            float smax = NEG_INF;
            [[unroll]] for (uint i = 0u; i < KB; ++i) {
                float dsum = dots[r * KB + i];
#if KV_I8
                dsum *= kscale[rows[i]];
#elif KV_FP8
                dsum *= FP8_RESTORE * kscale[hh];   // finite: scale * 448 is (check_fp8_scale)
#endif
                const uint j = js[i];
                bool vis = j < hi && j < vis_end[r];
                if (HAS(F_WINDOW)) vis = vis && key_visible(j, qpos[r], false);
                float sc = shape_score(dsum, slope[r], j, qpos[r]);
                if (HAS(F_MASK)) sc += mask_at(sq, hh * G + (rg * RPT + r) / BQ, qrow[r], min(j, hi - 1u));
                s[i] = vis ? sc : NEG_INF;
                smax = max(smax, s[i]);
            }
            const float mn = max(m[r], smax);
            const float alpha = exp2(m[r] - mn);
            float psum = 0.0;
            [[unroll]] for (uint i = 0u; i < KB; ++i) {
                p[r * KB + i] = exp2(s[i] - mn);
                psum += p[r * KB + i];
            }
            l[r] = l[r] * alpha + psum;
            m[r] = mn;
            alphas[r] = alpha;
            grew = grew || alpha != 1.0;
        }
        // a row's max grows rarely after its first keys: the whole subgroup skips the rescale
        // unless one of its rows grew -- where there is enough to skip (a branch around fewer
        // instructions is turned into selects, which cost more than the multiplies)
        if (RPT * VW * UV < LAZY_RESCALE || any_lane(grew))
            [[unroll]] for (uint r = 0u; r < RPT; ++r)
                [[unroll]] for (uint x = 0u; x < VW * UV; ++x) acc[r * VW * UV + x] *= alphas[r];
        [[unroll]] for (uint i = 0u; i < KB; ++i) {
#if KV_I8
            const float vsc = vscale[rows[i]];
#elif KV_FP8
            const float vsc = FP8_RESTORE * vscale[hh];
#else
            const float vsc = 1.0;
#endif
            [[unroll]] for (uint w = 0u; w < VW; ++w) {
                vec4 t[UV];
#if TILE_V_EARLY && !KV_Q4
                unpack_unit(vraw[i * VW + w], t);
#else
                v_load(rows[i], my_unit(w, DVU), t);
#endif
                [[unroll]] for (uint r = 0u; r < RPT; ++r) {
                    const float pw = p[r * KB + i] * vsc;
                    [[unroll]] for (uint e = 0u; e < UV; ++e)
                        acc[(r * VW + w) * UV + e] += pw * t[e];
                }
            }
        }
    }
}

// store the call's new rows of this sequence: this thread writes units lane_d + w*DS of every
// row, exactly the units it reads back in consume (no barrier needed; other threads and
// workgroups store the same values)
float unit_amax(bool is_k, uint nr, uint u) {
    float a = 0.0;
    [[unroll]] for (uint e = 0u; e < UV; ++e) a = max(a, vmax_abs(fresh_vec4(is_k, hh, nr, u * UV + e)));
    return a;
}

#if KV_Q4
// q4: unit u's block parameter word from the block's 16 new values (every thread storing a unit
// of the block computes and stores the same word), its 8 values quantised; the last unit also
// zeroes the unused parameter components
void store_unit_q4(bool is_k, uint row, uint nr, uint u) {
    const uint b = u / 2u, d4 = is_k ? DK4 : DV4;
    const uint pw = fresh_q4_param(is_k, hh, nr, b);
    const uint w = pack_q4x8(quantise_q4(fresh_vec4(is_k, hh, nr, u * UV), pw),
                             quantise_q4(fresh_vec4(is_k, hh, nr, u * UV + 1u), pw));
    const uint base = row * Q4_ROW(d4) * 4u;
    if (is_k) {
        kc1[base + u] = w;
        kc1[base + DK4 * 4u + b] = pw;
        if (u == DK4 * 4u - 1u) for (uint z = b + 1u; z < (DK4 + 1u) / 2u * 4u; ++z) kc1[base + DK4 * 4u + z] = 0u;
    } else {
        vc1[base + u] = w;
        vc1[base + DV4 * 4u + b] = pw;
        if (u == DV4 * 4u - 1u) for (uint z = b + 1u; z < (DV4 + 1u) / 2u * 4u; ++z) vc1[base + DV4 * 4u + z] = 0u;
    }
}
#endif

void store_unit(bool is_k, uint row, uint nr, uint u, float scale) {
#if KV_Q4
    store_unit_q4(is_k, row, nr, u);          // its own block scale, not the row's
#else
    vec4 y[UV];
    [[unroll]] for (uint e = 0u; e < UV; ++e) y[e] = fresh_vec4(is_k, hh, nr, u * UV + e);
#if KV_I8
    const uvec2 w = uvec2(pack_i8x4(quantise(y[0], scale)), pack_i8x4(quantise(y[1], scale)));
    if (is_k) kc2[row * DK4 * 2u + u] = w;
    else vc2[row * DV4 * 2u + u] = w;
#elif KV_FP8
    const ivec2 sp = fp8_prep(scale);
    const uvec2 w = uvec2(fp8_pack4(y[0], sp), fp8_pack4(y[1], sp));
    if (is_k) kc2[row * DK4 * 2u + u] = w;
    else vc2[row * DV4 * 2u + u] = w;
#else
    if (is_k) kc[row * DK4 + u] = pack_chunk(y);
    else vc[row * DV4 + u] = pack_chunk(y);
#endif
#endif
}

void store_fresh() {
    for (uint r = 0u; r < sq.n_new; ++r) {
        const uint row = cache_row(sq.bt, hh, sq.past + r);
        const uint nr = sq.new_start + r;
        float kamax = 0.0, vamax = 0.0;
#if KV_I8
        [[unroll]] for (uint w = 0u; w < KW; ++w) if (unit_ok(w, DKU)) kamax = max(kamax, unit_amax(true, nr, my_unit(w, DKU)));
        [[unroll]] for (uint w = 0u; w < VW; ++w) if (unit_ok(w, DVU)) vamax = max(vamax, unit_amax(false, nr, my_unit(w, DVU)));
#endif
#if KV_I8
        const vec2 amax = cluster_max2(vec2(kamax, vamax));
#else
        const vec2 amax = vec2(0.0);      // unused: no scale
#endif
#if KV_FP8
        const float ksc = kscale[hh], vsc = vscale[hh];     // the kv head's, fixed
#else
        const float ksc = quant_scale(amax.x), vsc = quant_scale(amax.y);
#endif
        [[unroll]] for (uint w = 0u; w < KW; ++w) if (unit_ok(w, DKU)) store_unit(true, row, nr, my_unit(w, DKU), ksc);
        [[unroll]] for (uint w = 0u; w < VW; ++w) if (unit_ok(w, DVU)) store_unit(false, row, nr, my_unit(w, DVU), vsc);
#if KV_I8
        kscale[row] = ksc;
        vscale[row] = vsc;
#endif
    }
}

// row r's state: a split's un-normalised partial (SPLIT) ...
void write_partial(uint r, uint orow, uint sp, uint nrows) {
    const uint base = (sp * nrows + orow) * PV;
    [[unroll]] for (uint w = 0u; w < VW; ++w)
        if (unit_ok(w, DVU))
            [[unroll]] for (uint e = 0u; e < UV; ++e) part[base + my_unit(w, DVU) * UV + e] = acc[(r * VW + w) * UV + e];
    if (lane_d == 0u) mlbuf[sp * nrows + orow] = vec2(m[r], l[r]);
}

// ... or normalised into out and lse
void write_out(uint r, uint orow) {
    const float inv = l[r] > 0.0 ? 1.0 / l[r] : 0.0;
    [[unroll]] for (uint w = 0u; w < VW; ++w)
        if (unit_ok(w, DVU))
            [[unroll]] for (uint e = 0u; e < UV; ++e) {
                const uint dd = (my_unit(w, DVU) * UV + e) * 4u;
                const vec4 y = acc[(r * VW + w) * UV + e] * inv;
                if (DV % 4u == 0u) {          // whole vec4 stores (constant-folded choice)
                    if (dd < DV) outbuf4[(orow * DV + dd) / 4u] = y;
                } else {
                    [[unroll]] for (uint x = 0u; x < 4u; ++x)
                        if (dd + x < DV) outbuf[orow * DV + dd + x] = y[x];
                }
            }
    if (lane_d == 0u) lsebuf[orow] = l[r] > 0.0 ? (m[r] + log2(l[r])) * LN2 : NEG_INF;
}

// COLS > 1: the columns' states of each row (m, l, acc) combined into column 0's -- rescaled to the
// common max, summed in shared memory. Every thread of the workgroup calls it (barriers)
void merge_columns() {
    if (COLS == 1u) return;
    [[unroll]] for (uint r = 0u; r < RPT; ++r)
        if (lane_d == 0u && rg * RPT + r < NQ) s_m[col * NQ + rg * RPT + r] = m[r];
    barrier();
    [[unroll]] for (uint r = 0u; r < RPT; ++r) {
        const uint qv = min(rg * RPT + r, NQ - 1u);
        float mx = M_EMPTY;
        for (uint c2 = 0u; c2 < COLS; ++c2) mx = max(mx, s_m[c2 * NQ + qv]);
        const float f = exp2(m[r] - mx);
        m[r] = mx;
        l[r] *= f;
        [[unroll]] for (uint x = 0u; x < VW * UV; ++x) acc[r * VW * UV + x] *= f;
    }
    barrier();
    [[unroll]] for (uint r = 0u; r < RPT; ++r) {
        const uint qv = rg * RPT + r;
        if (qv >= NQ) continue;
        if (lane_d == 0u) s_l[col * NQ + qv] = l[r];
        [[unroll]] for (uint w = 0u; w < VW; ++w)
            if (unit_ok(w, DVU))
                [[unroll]] for (uint e = 0u; e < UV; ++e)
                    s_acc[(col * NQ + qv) * PV + my_unit(w, DVU) * UV + e] = acc[(r * VW + w) * UV + e];
    }
    barrier();
    if (col == 0u)
        [[unroll]] for (uint r = 0u; r < RPT; ++r) {
            const uint qv = min(rg * RPT + r, NQ - 1u);
            for (uint c2 = 1u; c2 < COLS; ++c2) {
                l[r] += s_l[c2 * NQ + qv];
                [[unroll]] for (uint w = 0u; w < VW; ++w)
                    [[unroll]] for (uint e = 0u; e < UV; ++e)
                        acc[(r * VW + w) * UV + e] += s_acc[(c2 * NQ + qv) * PV + my_unit(w, DVU) * UV + e];
            }
        }
}

// the last workgroup of a tile merges every split's partial of its rows into out/lse, its COLS
// columns side by side: column c takes splits c, c + COLS, ... (their max, then their partials
// weighted by it), and merge_columns combines the columns. Each thread's serial chain of reads is
// 2 * splits / COLS, not 2 * splits. The loops over the splits are rolled and outermost (unrolled
// they would hold every split's values in registers at once; the rows inside them are unrolled)
//
// TILE_MERGE_BATCH = B (vkattn.tuning.tile_merge_batch; 0: the loops before session 24): each
// thread reads B of its splits at once, unconditionally (a split index past the last is clamped to
// it: no max changes, and its weight is 0), before using any, so their memory latencies overlap --
// B times fewer round trips in the chain. (Before, NVK's NAK waited for each read in turn, 8 a
// split; on the H100, 128 splits at L=16384 against 32 at 4096 cost 0.074 ms more, about 0.19 us
// per extra round trip: perf/RESULTS.md sessions 21 and 24.)
#ifndef TILE_MERGE_BATCH
#define TILE_MERGE_BATCH 2
#endif
void merge_split_shares(uint R, uint nrows) {
    uint orow[RPT];
    bool ok[RPT];
    [[unroll]] for (uint r = 0u; r < RPT; ++r) {
        const uint qv = rg * RPT + r;
        ok[r] = qv < NQ && qrow[r] < sq.q_len;
        orow[r] = ok[r] ? (hh * G + qv / BQ) * R + sq.q_start + qrow[r] : 0u;
        m[r] = M_EMPTY;
        l[r] = 0.0;
        [[unroll]] for (uint x = 0u; x < VW * UV; ++x) acc[r * VW * UV + x] = vec4(0.0);
    }
#if TILE_MERGE_BATCH > 0
    // the batch where it costs no registers: a decode's 1 or 2 rows a thread in the 16- and 32-bit
    // formats. The chunks' 4 rows a thread, and int8, read one split at a time (B = 2 took navi21's
    // float16 chunk pipeline from 104 to 136 VGPRs, 8 to 6 waves, float32's 72 to 88; Mesa 26's
    // int8 decode 40 to 48 VGPRs on polaris10, vega10 and navi21; one at a time, unconditionally,
    // costs none)
    const uint MB = RPT <= 2u && KV_I8 == 0 ? TILE_MERGE_BATCH : 1u;
    const uint NS = gl_NumWorkGroups.x, STEP = COLS * MB;
    [[dont_unroll]] for (uint s0 = col; s0 < NS; s0 += STEP) {
        float mx[MB * RPT];
        [[unroll]] for (uint b = 0u; b < MB; ++b)
            [[unroll]] for (uint r = 0u; r < RPT; ++r)
                mx[b * RPT + r] = mlbuf[min(s0 + b * COLS, NS - 1u) * nrows + orow[r]].x;
        [[unroll]] for (uint b = 0u; b < MB; ++b)
            [[unroll]] for (uint r = 0u; r < RPT; ++r)
                if (ok[r]) m[r] = max(m[r], mx[b * RPT + r]);
    }
    [[dont_unroll]] for (uint s0 = col; s0 < NS; s0 += STEP) {
        vec2 ms[MB * RPT];
        vec4 pv[MB * RPT * VW * UV];
        [[unroll]] for (uint b = 0u; b < MB; ++b)
            [[unroll]] for (uint r = 0u; r < RPT; ++r) {
                const uint row = min(s0 + b * COLS, NS - 1u) * nrows + orow[r];
                ms[b * RPT + r] = mlbuf[row];
                [[unroll]] for (uint w = 0u; w < VW; ++w)
                    [[unroll]] for (uint e = 0u; e < UV; ++e)
                        pv[((b * RPT + r) * VW + w) * UV + e] = part[row * PV + my_unit(w, DVU) * UV + e];
            }
        [[unroll]] for (uint b = 0u; b < MB; ++b)
            [[unroll]] for (uint r = 0u; r < RPT; ++r) {
                const vec2 mr = ms[b * RPT + r];
                // 0 for a clamped repeat, a row that does not exist, a split that saw nothing
                const float wgt = ok[r] && s0 + b * COLS < NS ? exp2(mr.x - m[r]) : 0.0;
                l[r] += wgt * mr.y;
                [[unroll]] for (uint x = 0u; x < VW * UV; ++x)
                    acc[r * VW * UV + x] += wgt * pv[(b * RPT + r) * VW * UV + x];
            }
    }
#else
    [[dont_unroll]] for (uint s = col; s < gl_NumWorkGroups.x; s += COLS)
        [[unroll]] for (uint r = 0u; r < RPT; ++r)
            if (ok[r]) m[r] = max(m[r], mlbuf[s * nrows + orow[r]].x);
    [[dont_unroll]] for (uint s = col; s < gl_NumWorkGroups.x; s += COLS)
        [[unroll]] for (uint r = 0u; r < RPT; ++r)
            if (ok[r]) {
                const vec2 ms = mlbuf[s * nrows + orow[r]];
                const float wgt = exp2(ms.x - m[r]);      // 0 for a split that saw nothing
                l[r] += wgt * ms.y;
                const uint base = (s * nrows + orow[r]) * PV;
                [[unroll]] for (uint w = 0u; w < VW; ++w)
                    [[unroll]] for (uint e = 0u; e < UV; ++e)
                        acc[(r * VW + w) * UV + e] += wgt * part[base + my_unit(w, DVU) * UV + e];
            }
#endif
}

void main() {
    const uint sp = gl_WorkGroupID.x, y = gl_WorkGroupID.y;
    hh = gl_WorkGroupID.z;
    const uint t = gl_LocalInvocationID.x;
    lane_d = t % DS;
    col = (t / DS) % COLS;
    rg = t / (DS * COLS);
    if (y >= aux[14]) return;                 // the grid is sized for the largest batch
#if TILE_SHUFFLE
    // the subgroup size this pipeline really runs with, after lse's rows: the host checks it
    // against DS where it could not pin it
    if (gl_WorkGroupID == uvec3(0u) && t == 0u)
        lsebuf[gl_NumWorkGroups.z * G * aux[10]] = uintBitsToFloat(gl_SubgroupSize);
#endif
    sq = load_seq(aux[aux[13] + 2u * y]);
    const uint qt = aux[aux[13] + 2u * y + 1u];
    const bool causal = aux[1] != 0u;
    const float qscale = uintBitsToFloat(aux[2]);
    const uint T = sq.past + sq.n_new, R = aux[10];
    const uint nrows = gl_NumWorkGroups.z * G * R;

    store_fresh();                            // a call's new rows (none: the loop is skipped)

    [[unroll]] for (uint r = 0u; r < RPT; ++r) {
        const uint qv = rg * RPT + r;
        const uint g = min(qv, NQ - 1u) / BQ, row = qt * BQ + qv % BQ;
        const bool ok = qv < NQ && row < sq.q_len;
        qrow[r] = row;
        qpos[r] = T - sq.q_len + row;
        vis_end[r] = ok ? (causal ? qpos[r] + 1u : T) : 0u;
        slope[r] = HAS(F_ALIBI) ? uintBitsToFloat(aux[aux[15] + hh * G + g]) : 0.0;
        m[r] = M_EMPTY;
        l[r] = 0.0;
        const uint qbase = ((hh * G + g) * R + sq.q_start + min(row, sq.q_len - 1u)) * DK4 * CH;
        [[unroll]] for (uint w = 0u; w < KW; ++w)
            [[unroll]] for (uint e = 0u; e < UV; ++e) {
                const uint u = my_unit(w, DKU) * UV + e;
                vec4 x = (ok && unit_ok(w, DKU)) ? qbuf[qbase + u] : vec4(0.0);
                if (HAS(F_ROPE_Q) && ok && unit_ok(w, DKU))
                    x = rope_rotate(x, qbuf[qbase + rope_partner(u)], u, sq.rope_row + qpos[r] - sq.rope_pos);
                qr[(r * KW + w) * UV + e] = x * qscale;
            }
        [[unroll]] for (uint x = 0u; x < VW * UV; ++x) acc[r * VW * UV + x] = vec4(0.0);
    }

    // keys of this split; past the tile's last row nothing is visible when causal
    uint kend = T;
    if (causal) kend = T - sq.q_len + min(sq.q_len, qt * BQ + BQ);
    const uint a = min(kend, sq.kstart + sp * sq.chunk), b = min(kend, a + sq.chunk);
    if (HAS(F_WINDOW)) {
        const uint win = aux[7], sinks = aux[8];
        const uint pmin = T - sq.q_len + qt * BQ;              // the tile's first row
        const uint wlo = pmin + 1u > win ? pmin + 1u - win : 0u;
        if (sp == 0u) consume(0u, min(sinks, min(sq.kstart, kend)));   // sinks below kstart
        consume(a, min(b, sinks));
        consume(max(a, max(sinks, wlo)), b);
    } else {
        consume(a, b);
    }

    merge_columns();

    // rows of this thread that exist (column 0 holds the merged state)
    [[unroll]] for (uint r = 0u; r < RPT; ++r) {
        const uint qv = rg * RPT + r;
        if (col == 0u && qv < NQ && qrow[r] < sq.q_len)
        {
            const uint orow = (hh * G + qv / BQ) * R + sq.q_start + qrow[r];
            if (SPLIT != 0u) write_partial(r, orow, sp, nrows);
            else write_out(r, orow);
        }
    }
    if (SPLIT == 0u) return;

    // split-K: the last workgroup of this tile to get here merges the splits. Ordered by the
    // Vulkan memory model with core features only (the chain is spelled out in the header):
    //   every thread  F1: release barrier over its partial writes ........ memoryBarrierBuffer
    //   C1 (control barrier: F1 of every thread synchronizes-with F2)
    //   thread 0      F2: acquire (the workgroup's partials), release before the counter
    //                 the counter increment (a relaxed device-scope atomic)
    //                 F3: acquire after it (every earlier split's F2 synchronizes-with it)
    //   C2 (control barrier: F3 synchronizes-with every thread's F4; s_last is known to all)
    //   every thread  F4: acquire, then the partials are read (coherent: device-scope visibility)
    memoryBarrierBuffer();                                                    // F1
    barrier();                                                                // C1
    if (t == 0u) {
        memoryBarrierBuffer();                                                // F2
        s_last = atomicAdd(auxc[aux[17] + hh * gl_NumWorkGroups.y + y], 1u);
        memoryBarrierBuffer();                                                // F3
    }
    barrier();                                                                // C2
    if (s_last != gl_NumWorkGroups.x - 1u) return;
    // the last one back to zero: the counters are 0 before and after every dispatch, so a
    // recording replays with no upload of them (host memory the device uses directly, graphs)
    if (t == 0u) atomicExchange(auxc[aux[17] + hh * gl_NumWorkGroups.y + y], 0u);
    memoryBarrierBuffer();                                                    // F4
    merge_split_shares(R, nrows);
    merge_columns();
    [[unroll]] for (uint r = 0u; r < RPT; ++r) {
        const uint qv = rg * RPT + r;
        if (col == 0u && qv < NQ && qrow[r] < sq.q_len)
            write_out(r, (hh * G + qv / BQ) * R + sq.q_start + qrow[r]);
    }
}
