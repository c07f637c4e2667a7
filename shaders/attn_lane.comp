#version 450
// attn_lane.comp -- flash attention (decode and prefill) for CPU-like Vulkan devices.
//
// A workgroup is one subgroup of WG lanes and owns NQ = G*BQ query vectors: the G query heads of
// kv head h for BQ consecutive query rows. Lane l holds uvec4 chunks l, l+WG, ... of every K/V row
// (one key costs ceil(DK4/WG) + ceil(DV4/WG) loads per lane, none repeated). Keys go in blocks of
// WG: the lanes' partial dot products for the block are reduce-scattered with xor shuffles so that
// lane b holds the scores of key b, the softmax update (one exp2 per query vector and block, SIMD
// across the block's keys) runs on those, and the weights are broadcast back for the V
// accumulation (a small GEMM per block: each output element sums the block's keys in a
// register). Every lane keeps the softmax state and its slice of the NQ accumulators in private
// memory. A call's new rows (n_new > 0) are stored first, by every workgroup of the sequence,
// and then read like any cache row. No shared memory and no barrier. This suits drivers where a memory instruction
// costs a per-lane loop while arithmetic and shuffles run SIMD-wide (lavapipe: subgroup 8); GPUs
// use attn.comp. WG is the device's subgroup size, probed at plan time (a power of two, <= 16).
//
// Contract (bindings as in attn.comp; per-call values in aux, see attn_common.glsl)
//   grid (SPLITS, tiles, HKV); workgroup (sp, y, h): tile y of the aux tile table = (sequence i,
//   query tile qt) -> its rows qt*BQ .. of sequence i, the G query heads of kv head h, keys
//   kstart_i + sp*chunk_i .. (+ chunk_i) of the sequence's T_i = past_i + n_new_i keys
//   out float32 [HKV*G, R, DV] normalised (a row that sees nothing gives zeros), lse float32
//   [HKV*G, R] natural log-sum-exp of the scores (-inf: nothing seen). with SPLIT, each split
//   writes its partial (part, ml as in attn.comp) and the last workgroup of the tile to finish
//   (a counter in aux) merges them into out and lse, in the same dispatch
// numpy, q head h*G+g, row r of a sequence, split keys J (scores as in attn_common.glsl):
//   s = scale * K[J] @ q[r] (+ variants, invisible -inf);  m = s.max();  p = exp(s - m);  acc = p @ V[J]
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#include "common.glsl"

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint G = 1u;
layout(constant_id = 2) const uint BQ = 1u;
layout(constant_id = 3) const uint DK4 = 16u;
layout(constant_id = 4) const uint DV4 = 16u;
layout(constant_id = 5) const uint DV = 128u;
layout(constant_id = 6) const uint SPLIT = 0u;   // 1: the keys are split over the grid's x (gl_NumWorkGroups.x)
layout(constant_id = 7) const uint FLAGS = 0u;
layout(constant_id = 8) const uint ROPE_DIM = 8u;

#ifndef KV_TEXEL
#define KV_TEXEL 0
#endif
#if KV_TEXEL
// KV_TEXEL: K and V are read from uniform texel buffers (vkattn binds a usamplerBuffer so: four
// words a texel), which a CPU driver loads by vector gathers where a storage load is a
// per-lane loop (lavapipe: 0.125 against 0.416 ns a word, python -m perf loads). Read-only: the
// variant has no fused append (its plans carry no new rows, nn = 0: the rows were appended first)
layout(binding = 0) uniform usamplerBuffer kt;
layout(binding = 1) uniform usamplerBuffer vt;
#else
layout(std430, binding = 0) buffer KC { uvec4 kc[]; };
layout(std430, binding = 1) buffer VC { uvec4 vc[]; };
#endif
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

#ifndef AUX_TEXEL
#define AUX_TEXEL 0
#endif
#if AUX_TEXEL
// AUX_TEXEL: aux (binding 5) once more as a uniform texel buffer of four words a texel, for the
// words each lane reads at its own address in the key loop -- a mask's values, a block table's
// entries: a CPU driver gathers those from a texel view and loads them lane by lane from a
// storage buffer (vkattn.tuning.texel_aux). aux is not written where they lie (the split
// counters follow every word the host writes)
layout(binding = 13) uniform usamplerBuffer auxt;
#define AUX_LANE(i) aux_lane(i)
uint aux_lane(uint i) { return texelFetch(auxt, int(i / 4u))[i & 3u]; }
#endif
// the header words attn_common.glsl's score and visibility rules read, loaded once (main)
uint aux_window, aux_sinks, aux_softcap, aux_mask_heads;
#define AUX_WINDOW aux_window
#define AUX_SINKS aux_sinks
#define AUX_SOFTCAP aux_softcap
#define AUX_MASK_HEADS aux_mask_heads
#include "attn_common.glsl"
#include "rope.glsl"

const uint WG = gl_WorkGroupSize.x;
const uint NQ = G * BQ;                  // query vectors of this workgroup, qv = g * BQ + i
// a lane's chunk: a storage word (LCH float vec4), or for q4 one block (8 bytes, 16 values;
// LCH 4), so a d-128 q4 row spreads over 8 lanes as a float16 row's 16 words do
#if KV_Q4
#define LCH 4u
const uint LK4 = DK4 * 2u, LV4 = DV4 * 2u;     // chunks per K, V row
#if !KV_TEXEL
layout(std430, binding = 0) buffer KC2 { uvec2 kc2[]; };   // the same buffers by 8 and 4 bytes
layout(std430, binding = 1) buffer VC2 { uvec2 vc2[]; };
layout(std430, binding = 0) buffer KC1 { uint kc1[]; };
layout(std430, binding = 1) buffer VC1 { uint vc1[]; };
#endif
#else
#define LCH CH
const uint LK4 = DK4, LV4 = DV4;
#endif
const uint KPL = (LK4 + WG - 1u) / WG;   // K chunks per lane
const uint VPL = (LV4 + WG - 1u) / WG;   // V chunks per lane
const uint PK = LK4 * LCH;
const uint PV = LV4 * LCH;

Seq sq;             // this workgroup's sequence

#include "attn_fresh.glsl"

// xor butterflies over the WG lanes (CPU drivers make these in-register shuffles), written out
// rather than looped: lavapipe caps the loop iterations of one invocation
float lanes_sum(float x) {
    if (WG > 1u) x += subgroupShuffleXor(x, 1u);
    if (WG > 2u) x += subgroupShuffleXor(x, 2u);
    if (WG > 4u) x += subgroupShuffleXor(x, 4u);
    if (WG > 8u) x += subgroupShuffleXor(x, 8u);
    return x;
}

float lanes_max(float x) {
    if (WG > 1u) x = max(x, subgroupShuffleXor(x, 1u));
    if (WG > 2u) x = max(x, subgroupShuffleXor(x, 2u));
    if (WG > 4u) x = max(x, subgroupShuffleXor(x, 4u));
    if (WG > 8u) x = max(x, subgroupShuffleXor(x, 8u));
    return x;
}

// one reduce-scatter step: values a[0 .. 2w) -> a[0 .. w), this lane keeping the half its bit w
// selects and adding the partner lane's copy of it
void scatter_step(inout float a[WG], uint w) {
    const bool hi = (gl_SubgroupInvocationID & w) != 0u;
    [[unroll]] for (uint k = 0u; k < w; ++k) {
        const float keep = hi ? a[w + k] : a[k];
        const float send = hi ? a[k] : a[w + k];
        a[k] = keep + subgroupShuffleXor(send, w);
    }
}

// KV_I8: quantisation scale of new row nr (every lane gets it: max over the lanes' words);
// KV_FP8: kv head h's scale
float new_row_scale(bool is_k, uint h, uint nr) {
#if KV_FP8
    return is_k ? kscale[h] : vscale[h];
#elif KV_I8
    float amax = 0.0;
    [[unroll]] for (uint i = 0u; i < (is_k ? KPL : VPL); ++i) {
        const uint c = gl_LocalInvocationID.x + i * WG;
        if (c < (is_k ? DK4 : DV4)) amax = max(amax, fresh_amax(is_k, h, nr, c));
    }
    return quant_scale(lanes_max(amax));
#else
    return 1.0;
#endif
}

#if KV_Q4 && !KV_TEXEL
// q4: chunk c (block c) of new row nr with its parameter word; the last chunk also zeroes the
// row's unused parameter slots
void store_q4(bool is_k, uint row, uint h, uint nr, uint c) {
    const uint d4 = is_k ? DK4 : DV4;
    const uint pw = fresh_q4_param(is_k, h, nr, c);
    vec4 y[4];
    [[unroll]] for (uint e = 0u; e < 4u; ++e) y[e] = quantise_q4(fresh_vec4(is_k, h, nr, c * 4u + e), pw);
    const uvec2 w = uvec2(pack_q4x8(y[0], y[1]), pack_q4x8(y[2], y[3]));
    const uint base = row * Q4_ROW(d4), sc = (base + d4) * 4u;
    if (is_k) {
        kc2[base * 2u + c] = w;
        kc1[sc + c] = pw;
        if (c == 2u * DK4 - 1u) for (uint z = c + 1u; z < (DK4 + 1u) / 2u * 4u; ++z) kc1[sc + z] = 0u;
    } else {
        vc2[base * 2u + c] = w;
        vc1[sc + c] = pw;
        if (c == 2u * DV4 - 1u) for (uint z = c + 1u; z < (DV4 + 1u) / 2u * 4u; ++z) vc1[sc + z] = 0u;
    }
}
#endif

// per-invocation state: its slice of the NQ scaled queries and accumulators, softmax state
vec4 q[NQ * KPL * LCH];
#if KV_Q4
float qsum[NQ * KPL];   // the sum of each chunk's query values (q4's zero point: sum q (n - z) = sum q n - z qsum)
#endif
vec4 acc[NQ * VPL * LCH];
float m[NQ], l[NQ];
uint vis_end[NQ];   // key j < vis_end[qv] passes the causal rule (0: no such row)
uint qpos[NQ];      // position of the row
uint qrow[NQ];      // row index within the sequence
float slope[NQ];    // ALiBi slope * log2(e) of the head
uint hh;            // its kv head

// chunk (lane + i*WG) of cache row `row` of K or V; of this call's new rows, these are the
// chunks this lane stored itself (main). bs, bz: q4 its block's scale and zero point (t holds the
// nibbles n; the caller takes z off and applies the scale once per chunk, to a partial dot
// product or to the softmax weight, rather than per value), 1 and 0 otherwise
void load_chunk(bool is_k, uint row, uint i, out vec4 t[LCH], out float bs, out float bz) {
    const uint c = min(gl_LocalInvocationID.x + i * WG, (is_k ? LK4 : LV4) - 1u);
#if KV_Q4
    // a block: its 16 nibbles, its scale and zero point
    const uint base = row * Q4_ROW(is_k ? DK4 : DV4);
#if KV_TEXEL
    // the block's two data words are half of texel base + c/2, its parameter component c%4 of
    // texel base + D4 + c/4: two fetches of four words (three of one word each took 6% longer,
    // decode L=4096 32/8 d128 on lavapipe: 1.65 against 1.56 ms, alternated, session 31)
    const uint pt = base + (is_k ? DK4 : DV4) + c / 4u;
    const uvec4 wq = is_k ? texelFetch(kt, int(base + c / 2u)) : texelFetch(vt, int(base + c / 2u));
    const uvec4 pq = is_k ? texelFetch(kt, int(pt)) : texelFetch(vt, int(pt));
    const uvec2 w = (c & 1u) != 0u ? wq.zw : wq.xy;
    const uint p = pq[c & 3u];
#else
    const uvec2 w = is_k ? kc2[base * 2u + c] : vc2[base * 2u + c];
    const uint p = is_k ? kc1[(base + DK4) * 4u + c] : vc1[(base + DV4) * 4u + c];
#endif
    unpack_q4x8(w.x, t[0], t[1]);
    unpack_q4x8(w.y, t[2], t[3]);
    bs = q4_scale(p);
    bz = q4_zero(p);
#else
#if KV_TEXEL
    const uvec4 w = is_k ? texelFetch(kt, int(row * DK4 + c)) : texelFetch(vt, int(row * DV4 + c));
#else
    const uvec4 w = is_k ? kc[row * DK4 + c] : vc[row * DV4 + c];
#endif
#if KV_FP8 && HALF_NATIVE
    // through the device's exact half conversion (vkattn Device.half_native): the values times
    // 1 / FP8_RESTORE, which key_scale restores (a power of two: the same products and sums)
    [[unroll]] for (uint e = 0u; e < CH; ++e) t[e] = fp8x4_native(w[e]);
#else
    unpack_chunk(w, t);
#endif
    bs = 1.0;
    bz = 0.0;
#endif
}

#if KV_FP8
float head_ks, head_vs;   // the kv head's K and V scales times FP8_RESTORE, loaded once (main)
#endif

// the factors a lane's key's raw score and softmax weight take: KV_I8 the scales of its cache
// row ``row`` (each lane loads its own key's: distinct addresses, one load a block, where a load
// per key at an address every lane shares is llvmpipe's slowest), KV_FP8 its kv head's (times
// FP8_RESTORE: what a HALF_NATIVE fp8 decode leaves out), 1 otherwise
float key_scale(bool is_k, uint row) {
#if KV_I8
    return is_k ? kscale[row] : vscale[row];
#elif KV_FP8
    return is_k ? head_ks : head_vs;
#else
    return 1.0;
#endif
}

// cache_row's words, loaded once (main): the key loop reads no aux word at an address every lane
// shares (llvmpipe loads those lane by lane, through memory: 5% of a float16 decode's samples when
// each block re-read aux[4], L=4096 32/8 d128, python -m perf lpjit, session 38)
uint head_row;      // hh * aux[4]: kv head hh's first row (of the cache, or of each block: paged)
uint blk_size;      // paged: aux[6], the block size
uint blk_rows;      // paged: aux[5], the rows one block spans

// cache_row(sq.bt, hh, j) from those words
uint head_cache_row(uint j) {
    if (!HAS(F_PAGED)) return head_row + j;
    return AUX_LANE(sq.bt + j / blk_size) * blk_rows + head_row + j % blk_size;
}

// cache row of key j (non-paged: arithmetic; paged: lane b looked key j0+b up, shuffled to all)
uint key_row(uint j, uint b, uint row_l) {
    if (HAS(F_PAGED)) return subgroupShuffle(row_l, b);
    return head_cache_row(j);
}

// keys j0 .. j0+WG-1 (those >= k1 masked): scores, online softmax update, V accumulation.
// Straight-line code on purpose: lavapipe runs every branch of a loop body under an exec mask and
// blends each write of a loop-carried value with it, so the block is branch-free and touches the
// carried state (m, l, acc) once per block, not once per key. Each score and each V sum is one
// register chain (llvmpipe splits fma into a multiply and an add; a sum kept in memory would add
// a load and a store to each). Keys past k1 re-read row max(k1, 1) - 1 with weight 0 instead of
// branching around the read (k1 = 0: an empty range, run once by consume_range).
void consume_block(uint j0, uint k1) {
    const uint lane = gl_LocalInvocationID.x;
    const uint kl = max(k1, 1u) - 1u;   // the row keys past k1 read (weight 0)
    const uint row_l = HAS(F_PAGED) ? head_cache_row(min(j0 + lane, kl)) : 0u;
    float d[NQ][WG];
    [[unroll]] for (uint b = 0u; b < WG; ++b) {
        const uint j = min(j0 + b, kl);
        const uint row = key_row(j, b, row_l);
        vec4 kx[KPL * LCH];
        float kbs[KPL], kbz[KPL];
        [[unroll]] for (uint i = 0u; i < KPL; ++i) {
            vec4 t[LCH];
            load_chunk(true, row, i, t, kbs[i], kbz[i]);
            [[unroll]] for (uint e = 0u; e < LCH; ++e)   // zero past the row's end (constant-folded)
                kx[i * LCH + e] = (LK4 % WG != 0u && lane + i * WG >= LK4) ? vec4(0.0) : t[e];
        }
        // each score is one register chain over the lane's K slice (q comes from memory)
        [[unroll]] for (uint qv = 0u; qv < NQ; ++qv) {
            float s = 0.0;
#if KV_Q4
            // q4: each chunk's dot product with the nibbles, less z times the chunk's query sum,
            // times its block's scale
            [[unroll]] for (uint i = 0u; i < KPL; ++i) {
                float si = -kbz[i] * qsum[qv * KPL + i];
                [[unroll]] for (uint e = 0u; e < LCH; ++e) {
                    const vec4 qq = q[(qv * KPL + i) * LCH + e], kk = kx[i * LCH + e];
                    si = fma(qq.x, kk.x, fma(qq.y, kk.y, fma(qq.z, kk.z, fma(qq.w, kk.w, si))));
                }
                s = fma(si, kbs[i], s);
            }
#else
            [[unroll]] for (uint x = 0u; x < KPL * LCH; ++x) {
                const vec4 qq = q[qv * KPL * LCH + x];
                s = fma(qq.x, kx[x].x, fma(qq.y, kx[x].y, fma(qq.z, kx[x].z, fma(qq.w, kx[x].w, s))));
            }
#endif
            d[qv][b] = s;
        }
    }
    const uint jl = j0 + lane;          // the key whose scores this lane ends up with
    // its row's scales (int8; fp8: the head's), applied to its scores and weights
    const uint row_own = KV_I8 == 0 ? 0u : (HAS(F_PAGED) ? row_l : head_cache_row(min(jl, kl)));
    const float ks_own = key_scale(true, row_own), vs_own = key_scale(false, row_own);
    float pl[NQ], alpha[NQ];
    [[unroll]] for (uint qv = 0u; qv < NQ; ++qv) {
        if (WG > 8u) scatter_step(d[qv], 8u);
        if (WG > 4u) scatter_step(d[qv], 4u);
        if (WG > 2u) scatter_step(d[qv], 2u);
        if (WG > 1u) scatter_step(d[qv], 1u);
        bool vis = jl < k1 && jl < vis_end[qv];
        if (HAS(F_WINDOW)) vis = vis && key_visible(jl, qpos[qv], false);
        float s = shape_score(KV_I8 != 0 || KV_FP8 != 0 ? d[qv][0] * ks_own : d[qv][0], slope[qv], jl, qpos[qv]);
        if (HAS(F_MASK)) s += mask_at(sq, hh * G + qv / BQ, qrow[qv], min(jl, kl));
        const float sc = vis ? s : NEG_INF;
        const float mn = max(m[qv], lanes_max(sc));
        const bool none = mn == NEG_INF;
        alpha[qv] = none ? 1.0 : exp2(m[qv] - mn);
        pl[qv] = none ? 0.0 : exp2(sc - mn);
        l[qv] = fma(l[qv], alpha[qv], lanes_sum(pl[qv]));
        m[qv] = mn;
    }
    // V as a small GEMM, acc[qv] = alpha*acc[qv] + sum_b p[qv][b] * V[b]. The
    // block's V chunks are unpacked first, then each output element sums over the WG keys in a
    // register: the carried accumulator is read and written once per block, and no partial sum
    // goes through memory (llvmpipe splits fma into a multiply and an add, and a sum kept in
    // memory adds a load and a store to each)
    vec4 vx[WG * VPL * LCH];
    float vbs[WG * VPL], vbz[WG * VPL];   // q4 block scales, zero points
    [[unroll]] for (uint b = 0u; b < WG; ++b) {
        const uint j = min(j0 + b, kl);
        const uint row = key_row(j, b, row_l);
        [[unroll]] for (uint i = 0u; i < VPL; ++i) {
            vec4 t[LCH];
            load_chunk(false, row, i, t, vbs[b * VPL + i], vbz[b * VPL + i]);
            [[unroll]] for (uint e = 0u; e < LCH; ++e) vx[(b * VPL + i) * LCH + e] = t[e];
        }
    }
    [[unroll]] for (uint qv = 0u; qv < NQ; ++qv) {
        float p[WG];
        const float pv = KV_I8 != 0 || KV_FP8 != 0 ? pl[qv] * vs_own : pl[qv];   // the weight, V's scale in it
        [[unroll]] for (uint b = 0u; b < WG; ++b) p[b] = subgroupShuffle(pv, b);
        [[unroll]] for (uint y = 0u; y < VPL * LCH; ++y) {
            vec4 sum = vec4(0.0);
#if KV_Q4
            // q4: the weight times the chunk's block scale (once per chunk after unrolling) times
            // the nibbles, less the weighted zero points
            float zs = 0.0;
            [[unroll]] for (uint b = 0u; b < WG; ++b) {
                const float w = p[b] * vbs[b * VPL + y / LCH];
                sum = fma(vec4(w), vx[b * VPL * LCH + y], sum);
                zs = fma(w, vbz[b * VPL + y / LCH], zs);
            }
            sum -= vec4(zs);
#else
            [[unroll]] for (uint b = 0u; b < WG; ++b) sum = fma(vec4(p[b]), vx[b * VPL * LCH + y], sum);
#endif
            const uint x = qv * VPL * LCH + y;
            acc[x] = fma(acc[x], vec4(alpha[qv]), sum);
        }
    }
}

// keys lo .. hi-1, all in the cache by now. Decode (BQ = 1) tests at the end of the block:
// llvmpipe runs a loop body under the exec mask until every lane has left, so a `for` loop costs
// one pass more than it iterates (the pass where the test fails), and an empty range costs the one
// pass it cost as a `for` (consume_block gives keys past its end weight 0 and reads row
// max(k1, 1) - 1 for them; every sequence has a key 0, written before this loop runs). Prefill
// and chunks (BQ > 1) use a `for` loop: over many blocks llvmpipe's code for it is faster (S=512
// over 1536 cached, float16 32/8 d128, fastest of 10, alternated: 271-277 -> 237-241 ms, from
// empty 46.6-48.2 -> 42.2-42.3 ms), while the decode fixed cost grows with it (L=16: 0.16-0.18 ->
// 0.21-0.24 ms). BQ is a constant: one loop survives in each pipeline.
void consume_range(uint lo, uint hi) {
    if (BQ > 1u) {
        for (uint j0 = lo; j0 < hi; j0 += WG) consume_block(j0, hi);
    } else {
        uint j0 = lo;
        do {
            consume_block(j0, hi);
            j0 += WG;
        } while (j0 < hi);
    }
}

// query vector qv normalised into out row `row` and its log-sum-exp
void write_out(uint qv, uint row) {
    const uint lane = gl_LocalInvocationID.x;
    const float inv = l[qv] > 0.0 ? 1.0 / l[qv] : 0.0;
    [[unroll]] for (uint i = 0u; i < VPL; ++i)
        [[unroll]] for (uint e = 0u; e < LCH; ++e) {
            const uint d = ((lane + i * WG) * LCH + e) * 4u;
            const vec4 y = acc[(qv * VPL + i) * LCH + e] * inv;
            if (DV % 4u == 0u) {         // whole vec4 stores (constant-folded choice)
                if (d < DV) outbuf4[(row * DV + d) / 4u] = y;
            } else {
                [[unroll]] for (uint x = 0u; x < 4u; ++x)
                    if (d + x < DV) outbuf[row * DV + d + x] = y[x];
            }
        }
    if (lane == 0u) lsebuf[row] = l[qv] > 0.0 ? (m[qv] + log2(l[qv])) * LN2 : NEG_INF;
}

void main() {
    const uint sp = gl_WorkGroupID.x, y = gl_WorkGroupID.y;
    hh = gl_WorkGroupID.z;
    const uint h = hh;
    const uint lane = gl_LocalInvocationID.x;
    if (y >= aux[14]) return;                 // the grid is sized for the largest batch
    sq = load_seq(aux[aux[13] + 2u * y]);
    const uint qt = aux[aux[13] + 2u * y + 1u];
    const bool causal = aux[1] != 0u;
    const float qscale = uintBitsToFloat(aux[2]);
    const uint T = sq.past + sq.n_new, R = aux[10];

#if !KV_TEXEL
    if (sq.n_new > 0u) {
        // fused append: every workgroup of the sequence stores all its new rows (identical values
        // from each), lane l the chunks l, l+WG, .. -- the very chunks it reads back as keys
        // (load_chunk), so the key loop needs no barrier and no second path for new keys.
        // A per-call value, not a specialisation: attend and forward share one pipeline. The row
        // loop tests at its end (see consume_range)
        uint r = 0u;
        do {
            const uint row = cache_row(sq.bt, h, sq.past + r), nr = sq.new_start + r;
            const float ksc = new_row_scale(true, h, nr);
            const float vsc = new_row_scale(false, h, nr);
            [[unroll]] for (uint i = 0u; i < KPL; ++i) {
                const uint c = lane + i * WG;
#if KV_Q4
                if (c < LK4) store_q4(true, row, h, nr, c);
#else
                if (c < DK4) kc[row * DK4 + c] = fresh_word(true, h, nr, c, ksc);
#endif
            }
            [[unroll]] for (uint i = 0u; i < VPL; ++i) {
                const uint c = lane + i * WG;
#if KV_Q4
                if (c < LV4) store_q4(false, row, h, nr, c);
#else
                if (c < DV4) vc[row * DV4 + c] = fresh_word(false, h, nr, c, vsc);
#endif
            }
#if KV_I8
            kscale[row] = ksc;   // every lane stores (and later reads) the same value
            vscale[row] = vsc;
#endif
        } while (++r < sq.n_new);
    }
#endif

    aux_window = aux[7];
    aux_sinks = aux[8];
    aux_softcap = aux[9];
    aux_mask_heads = aux[16];
    head_row = h * aux[4];
    blk_size = HAS(F_PAGED) ? aux[6] : 1u;
    blk_rows = HAS(F_PAGED) ? aux[5] : 0u;
#if KV_FP8
    // once, not per key: a load at a subgroup-uniform address is llvmpipe's slowest (perf loads)
    head_ks = FP8_RESTORE * kscale[h];
    head_vs = FP8_RESTORE * vscale[h];
#endif
    uint kend = 0u;   // one past the last key any row of this workgroup sees
    [[unroll]] for (uint qv = 0u; qv < NQ; ++qv) {
        const uint g = qv / BQ, r = qt * BQ + qv % BQ;
        const bool ok = r < sq.q_len;
        qrow[qv] = r;
        qpos[qv] = T - sq.q_len + r;
        vis_end[qv] = ok ? (causal ? qpos[qv] + 1u : T) : 0u;
        slope[qv] = HAS(F_ALIBI) ? uintBitsToFloat(aux[aux[15] + h * G + g]) : 0.0;
        kend = max(kend, vis_end[qv]);
        m[qv] = NEG_INF;
        l[qv] = 0.0;
        const uint qbase = ((h * G + g) * R + sq.q_start + min(r, sq.q_len - 1u)) * PK;   // padding rows: in bounds
        [[unroll]] for (uint i = 0u; i < KPL; ++i) {
            const uint c = lane + i * WG;
            [[unroll]] for (uint e = 0u; e < LCH; ++e) {
                const uint u = c * LCH + e;
                vec4 x = (c < LK4 && ok) ? qbuf[qbase + u] : vec4(0.0);
                if (HAS(F_ROPE_Q) && c < LK4 && ok)
                    x = rope_rotate(x, qbuf[qbase + rope_partner(u)], u, sq.rope_row + qpos[qv] - sq.rope_pos);
                q[(qv * KPL + i) * LCH + e] = x * qscale;
            }
#if KV_Q4
            float qs = 0.0;
            [[unroll]] for (uint e = 0u; e < LCH; ++e) qs += dot(q[(qv * KPL + i) * LCH + e], vec4(1.0));
            qsum[qv * KPL + i] = qs;
#endif
        }
        [[unroll]] for (uint i = 0u; i < VPL * LCH; ++i) acc[qv * VPL * LCH + i] = vec4(0.0);
    }

    const uint a = min(kend, sq.kstart + sp * sq.chunk), b = min(kend, a + sq.chunk);
    if (HAS(F_WINDOW)) {
        const uint win = aux[7], sinks = aux[8];
        const uint pmin = T - sq.q_len + qt * BQ;              // the tile's first row
        const uint wlo = pmin + 1u > win ? pmin + 1u - win : 0u;
        // three ranges -- the sinks below kstart (split 0 only), the sinks in this split, the
        // window -- in one rolled loop: one copy of the key block, not three (compile time)
        uint part = sp == 0u ? 0u : 1u;
        do {
            const uint lo = part == 0u ? 0u : (part == 1u ? a : max(a, max(sinks, wlo)));
            const uint hi = part == 0u ? min(sinks, min(sq.kstart, kend)) : (part == 1u ? min(b, sinks) : b);
            consume_range(lo, hi);
        } while (++part < 3u);
    } else {
        consume_range(a, b);
    }

    const uint nrows = gl_NumWorkGroups.z * G * R;
    [[unroll]] for (uint qv = 0u; qv < NQ; ++qv) {
        const uint r = qt * BQ + qv % BQ;
        if (r >= sq.q_len) continue;
        const uint row = (h * G + qv / BQ) * R + sq.q_start + r;
        if (SPLIT == 0u) {
            write_out(qv, row);
        } else {
            const uint base = (sp * nrows + row) * PV;
            [[unroll]] for (uint i = 0u; i < VPL; ++i) {
                const uint c = lane + i * WG;
                if (c < LV4)
                    [[unroll]] for (uint e = 0u; e < LCH; ++e) part[base + c * LCH + e] = acc[(qv * VPL + i) * LCH + e];
            }
            if (lane == 0u) mlbuf[sp * nrows + row] = vec2(m[qv], l[qv]);
        }
    }
    if (SPLIT == 0u) return;

    // split-K: the last workgroup of this tile to get here merges every split's partial. The
    // memory-model chain of attn.comp (see its header), with the workgroup's one subgroup as the
    // control barriers' execution scope: F1 in every lane, C1, lane 0's F2 / counter / F3, C2,
    // F4 in every lane, then the coherent partials are read
    memoryBarrierBuffer();                                                    // F1
    subgroupBarrier();                                                        // C1
    uint done = 0u;
    if (lane == 0u) {
        memoryBarrierBuffer();                                                // F2
        done = atomicAdd(auxc[aux[17] + h * gl_NumWorkGroups.y + y], 1u);
        memoryBarrierBuffer();                                                // F3
    }
    subgroupBarrier();                                                        // C2
    if (subgroupShuffle(done, 0u) != gl_NumWorkGroups.x - 1u) return;
    // the last one back to zero: the counters are 0 before and after every dispatch, so a
    // recording replays with no upload of them (host memory the device uses directly, graphs)
    if (lane == 0u) atomicExchange(auxc[aux[17] + h * gl_NumWorkGroups.y + y], 0u);
    memoryBarrierBuffer();                                                    // F4
    [[unroll]] for (uint qv = 0u; qv < NQ; ++qv) {
        const uint r = qt * BQ + qv % BQ;
        if (r >= sq.q_len) continue;
        const uint row = (h * G + qv / BQ) * R + sq.q_start + r;
        float mx = NEG_INF;
        for (uint s = 0u; s < gl_NumWorkGroups.x; ++s) mx = max(mx, mlbuf[s * nrows + row].x);
        float lt = 0.0;
        [[unroll]] for (uint i = 0u; i < VPL * LCH; ++i) acc[qv * VPL * LCH + i] = vec4(0.0);
        for (uint s = 0u; s < gl_NumWorkGroups.x; ++s) {
            const vec2 ms = mlbuf[s * nrows + row];
            const float wgt = mx == NEG_INF ? 0.0 : exp2(ms.x - mx);   // 0 for a split that saw nothing
            lt += wgt * ms.y;
            const uint base = (s * nrows + row) * PV;
            [[unroll]] for (uint i = 0u; i < VPL; ++i)
                [[unroll]] for (uint e = 0u; e < LCH; ++e)
                    acc[(qv * VPL + i) * LCH + e] += wgt * part[base + min(lane + i * WG, LV4 - 1u) * LCH + e];
        }
        m[qv] = mx;
        l[qv] = lt;
        write_out(qv, row);
    }
}
