// attn_common.glsl -- the per-call aux buffer and the score/visibility rules shared by the
// attention kernels (attn.comp, attn_lane.comp). Include after common.glsl, with the FLAGS spec
// constant and an `aux` uint array (binding 5) declared.
//
// One call attends NSEQ sequences (KVCache: one). Their query rows are packed: the q buffer is
// [HQ, R, DK4*CH] vec4 and sequence i owns rows q_start_i .. q_start_i + q_len_i - 1. Its new K/V
// rows (n_new_i of them, appended at positions past_i ..) are rows new_start_i .. of nk/nv
// ([HKV, NN, D*4*CH] vec4). Everything per call lives in one uint32 buffer, uploaded once:
//
//   aux[0 .. 31] header
//     [0] NSEQ  [1] causal  [2] float bits of scale*log2(e)  [3] unused (0)
//     [4] head_stride, [5] block_stride: the cache row of head h, position j is
//         KVCache (not PAGED): h*head_stride + j                        (head_stride = capacity)
//         PagedKVCache: table[j / block_size]*block_stride + h*head_stride + j % block_size
//         (head_stride = block_size, block_stride = HKV*block_size: a block is [HKV, block_size]
//         rows, one contiguous range, and one head's rows of a block are contiguous)
//     [6] block_size (PAGED)  [7] window (WINDOW)  [8] n_sink (WINDOW)
//     [9] float bits of softcap*log2(e) (SOFTCAP)  [10] R (query rows per head in q/out)
//     [11] NN (rows per head of nk/nv)  [12] offset of the sequence records  [13] offset of the
//     tile table  [14] number of tiles  [15] offset of the ALiBi slopes (float bits of
//     slope*log2(e) per q head, ALIBI)  [16] 1: each sequence's mask is per q head (MASK;
//     0: one mask broadcast over heads)  [17] offset of the split-K counters (SPLITS > 1): one
//     uint per (kv head h, tile y) at aux[17] + h * tiles + y, zero when the call starts (they
//     follow the aux words the host writes, so every upload zeroes them); the kernels count the
//     workgroups of a tile that have written their partials, and the last one merges them
//   sequence record i (SEQ_WORDS words at aux[12] + SEQ_WORDS*i)
//     [0] past  [1] n_new  [2] q_start  [3] q_len  [4] chunk (keys per split)
//     [5] offset of its block table (PAGED)  [6] kstart (first key the splits cover)
//     [7] offset of its additive mask (MASK): float bits, q head hq, row r, key j at
//         + (hq*q_len + r)*(past+n_new) + j (per head) or + r*(past+n_new) + j, natural units
//     [8] new_start (its first row in nk/nv)  [9] its first row in the rotary table (ROPE),
//     [10] the position that row holds (rope.glsl)
//   tile table (2 words per tile at aux[13]): sequence index, query tile index
//   block tables, masks: wherever the records point
//
// Positions: the T = past + n_new keys of a sequence are positions 0 .. T-1; its query row r sits
// at position p = T - q_len + r. Key j is visible to row r iff (!causal || j <= p) and, with
// WINDOW, (p - j < window || j < n_sink). Scores are in log2 units (q is pre-scaled by
// scale*log2(e)): s = scale*log2(e) * q.k; SOFTCAP: s = c*tanh(s/c) with c = softcap*log2(e) (softcap_score);
// ALIBI: s += slope*log2(e) * (j - p); MASK: s += mask[r, j] * log2(e).
// ROPE_K / ROPE_Q (rope.glsl): new keys / queries are rotated at their positions on load.

#define F_PAGED 1u
#define F_WINDOW 2u
#define F_SOFTCAP 4u
#define F_ALIBI 8u
#define F_MASK 16u

#define HAS(f) ((FLAGS & (f)) != 0u)

// aux words the rules below read. A kernel may define these before including this file: AUX_LANE
// as another way to read a word at each lane's own address, AUX_WINDOW (with the three after it)
// as copies of the header words it loaded once -- attn_lane.comp, for llvmpipe, which loads a
// storage word lane by lane through memory even where every lane reads the same address
#ifndef AUX_LANE
#define AUX_LANE(i) aux[i]   // a word at each lane's own address (a mask value, a block table entry)
#endif
#ifndef AUX_WINDOW
#define AUX_WINDOW aux[7]
#define AUX_SINKS aux[8]
#define AUX_SOFTCAP aux[9]
#define AUX_MASK_HEADS aux[16]
#endif

#define SEQ_WORDS 12u

struct Seq {
    uint past, n_new, q_start, q_len, chunk, bt, kstart, mask, new_start, rope_row, rope_pos;
};

Seq load_seq(uint i) {
    const uint o = aux[12] + SEQ_WORDS * i;
    return Seq(aux[o], aux[o + 1u], aux[o + 2u], aux[o + 3u], aux[o + 4u], aux[o + 5u], aux[o + 6u],
               aux[o + 7u], aux[o + 8u], aux[o + 9u], aux[o + 10u]);
}

// cache row (in units of rows; multiply by DK4/DV4) of head h, position j of a sequence whose
// block table starts at aux[bt] (PAGED)
uint cache_row(uint bt, uint h, uint j) {
    if (!HAS(F_PAGED)) return h * aux[4] + j;
    const uint bs = aux[6];
    return aux[bt + j / bs] * aux[5] + h * aux[4] + j % bs;
}

// additive mask of q head hq, row r, key j (natural units) in log2 units. Callers evaluate it
// for every query vector of a tile, also the padding ones (a row past q_len, a head past the
// tile's G): the head and row are clamped into the mask (the caller discards those scores) and
// j must be a key of the sequence (< past + n_new), so the read never leaves the sequence's mask.
// An entry below -2^127 counts as -inf (a mask built from float32's lowest value, as transformers
// builds them, masks its key; times log2(e) such entries would overflow from -2.36e38 on, and
// mask only some) -- vkattn.reference.attention's MASK_LIMIT rule. None lies above 2^127: the
// host refuses such numpy masks, and mask_copy.comp clamps device masks to 2^127 as it copies
// them (it applies the whole rule; this test stays for the numpy masks the host writes as they
// are: a pass over a large mask on the host would cost more than the test per score).
float mask_at(Seq sq, uint hq, uint r, uint j) {
    const uint r_in = min(r, sq.q_len - 1u);
    const uint row = AUX_MASK_HEADS != 0u ? min(hq, gl_NumWorkGroups.z * G - 1u) * sq.q_len + r_in : r_in;
    const float m = uintBitsToFloat(AUX_LANE(sq.mask + row * (sq.past + sq.n_new) + j));
    return (m < -uintBitsToFloat(0x7f000000u) ? uintBitsToFloat(0xff800000u) : m) * LOG2E;
}

// c * tanh(s / c), finite for every s (c > 0, a normal float: the host checks the softcap). GLSL
// leaves tanh's precision to the implementation, and a driver that builds it as
// (e^2x - 1) / (e^2x + 1) returns inf / inf = NaN once e^2x overflows (|s/c| above ~44). Here
// tanh|x| = (1 - e) / (1 + e) with e = 2^(-2 log2(e) |x|) in (0, 1] (|x| clamped to 16, where
// tanh is 1.0 in float32): no overflow, and the divisor lies in [1, 2], inside the range where
// GLSL specifies division (2.5 ULP); c itself lies in [2^-126, 2^126], so s / c is specified
// too. Below |x| = 1/8, where 1 - e cancels (e rounds to 1 once |x| < 2^-25: a large softcap
// made every score 0), the series x (1 - x^2/3 + 2 x^4/15), within 2.1e-7 of tanh there (its
// next term, 17 x^7 / 315, over x). Against numpy's tanh: a relative error of about 1e-6 of the
// score, at any softcap the host accepts.
float softcap_score(float s, float c) {
    const float x = min(abs(s / c), 16.0);
    const float e = exp2(x * (-2.0 * LOG2E));
    const float x2 = x * x;
    const float t = x < 0.125 ? x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0))) : (1.0 - e) / (1.0 + e);
    return sign(s) * c * t;
}

// score transforms; s in log2 units, already scaled
float shape_score(float s, float alibi, uint j, uint p) {
    if (HAS(F_SOFTCAP)) s = softcap_score(s, uintBitsToFloat(AUX_SOFTCAP));
    if (HAS(F_ALIBI)) s += alibi * (float(j) - float(p));
    return s;
}

bool key_visible(uint j, uint p, bool causal) {
    if (causal && j > p) return false;
    if (HAS(F_WINDOW) && !(j > p || p - j < AUX_WINDOW || j < AUX_SINKS)) return false;
    return true;
}
