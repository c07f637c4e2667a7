"""CPU numpy reference: the definition every device result is checked against."""
from __future__ import annotations

import functools
import numbers

import numpy as np

# Logits elements (float32) one block of ``attention`` holds at a time: long caches with many query
# rows are processed in row blocks, so temporaries stay at a few hundred MiB (L = 70000, s = 512).
_BLOCK = 1 << 25
# a mask entry below -MASK_LIMIT counts as -inf (masks built from float32's lowest value, as
# transformers builds them, mask their keys); the caches refuse numpy masks with entries above it
# (the kernels scale entries by log2(e), which must stay a float32)
MASK_LIMIT = 2.0 ** 127


def attention(q, k, v, causal: bool = True, scale: float | None = None, *, window: int | None = None,
              n_sink: int = 0, mask=None, softcap: float | None = None, alibi_slopes=None,
              return_lse: bool = False):
    """Scaled dot-product attention over a whole cache, in float32.

    q: (num_qo_heads, s, head_dim); k: (num_kv_heads, L, head_dim); v: (num_kv_heads, L, v_head_dim)
    with num_qo_heads a multiple of num_kv_heads (q head i reads kv head i // group) and s <= L.
    Query row r sits at position p = L - s + r, key j at position j.
    Logits: ``scale`` * q.k (``scale`` defaults to 1/sqrt(head_dim)); then with ``softcap`` (> 0)
    softcap * tanh(logits / softcap); then with ``alibi_slopes`` ((num_qo_heads,)) + slope[head] * (j - p);
    then with ``mask`` ((s, L), shared by all heads, or (num_qo_heads, s, L); may hold -inf; entries
    below -MASK_LIMIT = -2**127 count as -inf) + mask.
    Key j is visible to row r iff (not ``causal`` or j <= p) and (``window`` is None or p - j < window
    or j < ``n_sink``). Softmax runs over visible keys; a row that sees no key (or only -inf logits)
    gives zeros. Returns (num_qo_heads, s, v_head_dim) float32, or with ``return_lse`` (out, lse) where
    lse (num_qo_heads, s) float32 is the natural log of the sum of exp(logits) over visible keys
    (-inf for a row that sees nothing).
    """
    q = np.asarray(q, dtype=np.float32)
    k = np.asarray(k, dtype=np.float32)
    v = np.asarray(v, dtype=np.float32)
    hq, s, d = q.shape
    hkv, n, _ = k.shape
    dv = v.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"num_qo_heads {hq} is not a multiple of num_kv_heads {hkv}")
    if scale is None:
        scale = 1.0 / np.sqrt(d)
    group = hq // hkv
    if window is not None and int(window) < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    if int(n_sink) < 0:
        raise ValueError(f"n_sink must be >= 0, got {n_sink}")
    if softcap is not None and not float(softcap) > 0:
        raise ValueError(f"softcap must be > 0, got {softcap}")
    slopes = None
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, dtype=np.float32)
        if slopes.shape != (hq,):
            raise ValueError(f"alibi_slopes shape {slopes.shape} != (num_qo_heads,) = ({hq},)")
    if mask is not None:
        mask = np.asarray(mask, dtype=np.float32)
        if mask.shape not in ((s, n), (hq, s, n)):
            raise ValueError(f"mask shape {mask.shape} is neither (s, L) = {(s, n)} nor "
                             f"(num_qo_heads, s, L) = {(hq, s, n)}")
        if mask.size and mask.min() < -MASK_LIMIT:
            mask = np.where(mask < -MASK_LIMIT, np.float32(-np.inf), mask)

    # With a window, keys in [n_sink, lo) are out of every row's reach: drop them up front.
    pos = np.arange(n)
    if window is not None:
        lo = max(0, n - s - int(window) + 1)
        if lo > int(n_sink):
            pos = np.concatenate([np.arange(min(int(n_sink), n)), np.arange(lo, n)])
            k, v = k[:, pos], v[:, pos]
            if mask is not None:
                mask = mask[..., pos]
    nk = pos.size

    out = np.zeros((hkv, group, s, dv), np.float32)
    lse = np.full((hkv, group, s), -np.inf, np.float32)
    if nk == 0 or s == 0:
        out = out.reshape(hq, s, dv)
        return (out, lse.reshape(hq, s)) if return_lse else out
    # GQA without copying K/V: the group's query heads become extra rows of one matmul per kv head
    qs = q.reshape(hkv, group, s, d) * np.float32(scale)
    rows = max(1, _BLOCK // (group * nk))
    for h in range(hkv):
        heads = slice(h * group, (h + 1) * group)
        for r0 in range(0, s, rows):
            r1 = min(s, r0 + rows)
            sc = r1 - r0
            logits = np.matmul(qs[h, :, r0:r1].reshape(group * sc, d), k[h].T).reshape(group, sc, nk)
            prow = np.arange(r0, r1) + (n - s)          # absolute positions of the block's rows
            if softcap is not None:
                c = np.float32(softcap)
                logits = c * np.tanh(logits / c)
            if slopes is not None:
                rel = (pos[None, :] - prow[:, None]).astype(np.float32)
                logits += slopes[heads, None, None] * rel
            if mask is not None:
                logits += mask[r0:r1] if mask.ndim == 2 else mask[heads, r0:r1]
            visible = None
            if causal and prow[0] < pos[-1]:            # otherwise every key is at or before the row
                visible = pos[None, :] <= prow[:, None]
            if window is not None:
                near = (prow[:, None] - pos[None, :] < int(window)) | (pos[None, :] < int(n_sink))
                visible = near if visible is None else visible & near
            if visible is not None:
                logits = np.where(visible, logits, -np.inf)
            m = logits.max(axis=-1, keepdims=True)
            p = np.exp(logits - np.where(np.isfinite(m), m, 0.0))
            denom = p.sum(axis=-1, keepdims=True)
            p /= np.where(denom > 0, denom, 1.0)
            out[h, :, r0:r1] = np.matmul(p.reshape(group * sc, nk), v[h]).reshape(group, sc, dv)
            if return_lse:
                with np.errstate(divide="ignore", invalid="ignore"):
                    row_lse = m[..., 0] + np.log(denom[..., 0])
                lse[h, :, r0:r1] = np.where(denom[..., 0] > 0, row_lse, -np.inf)
    out = out.reshape(hq, s, dv)
    return (out, lse.reshape(hq, s)) if return_lse else out


def merge_states(out_a, lse_a, out_b, lse_b):
    """Combine two attention results over disjoint key sets into the result over their union.

    out_a, out_b: (..., v_head_dim), e.g. (num_qo_heads, s, v_head_dim); lse_a, lse_b: (...), e.g.
    (num_qo_heads, s), as ``attention(..., return_lse=True)`` gives them. lse = logaddexp(lse_a, lse_b),
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse). A side with lse -inf (no key) contributes
    nothing; both -inf gives zeros and -inf. Returns (out, lse) float32 with the input shapes.
    """
    args = {"out_a": out_a, "lse_a": lse_a, "out_b": out_b, "lse_b": lse_b}
    for name, x in args.items():
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name} must be a numpy array, got {type(x).__name__}")
    if out_a.ndim < 1:
        raise ValueError(f"out_a must have a trailing v_head_dim axis, got shape {out_a.shape}")
    if out_b.shape != out_a.shape:
        raise ValueError(f"out_b shape {out_b.shape} != out_a shape {out_a.shape}")
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if x.shape != out_a.shape[:-1]:
            raise ValueError(f"{name} shape {x.shape} != out shape without its last axis {out_a.shape[:-1]}")
    oa, ob = out_a.astype(np.float32, copy=False), out_b.astype(np.float32, copy=False)
    la, lb = lse_a.astype(np.float32, copy=False), lse_b.astype(np.float32, copy=False)
    with np.errstate(invalid="ignore", over="ignore"):
        lse = np.logaddexp(la, lb)
        empty = np.isneginf(lse)
        wa = np.where(empty | np.isneginf(la), np.float32(0), np.exp(la - lse))[..., None]
        wb = np.where(empty | np.isneginf(lb), np.float32(0), np.exp(lb - lse))[..., None]
        out = np.where(wa > 0, oa * wa, np.float32(0)) + np.where(wb > 0, ob * wb, np.float32(0))
    return out.astype(np.float32, copy=False), lse.astype(np.float32, copy=False)


def rope_table(positions, rotary_dim: int, base: float = 10000.0):
    """Rotary tables: positions (n,) integer; inv_freq_i = base ** (-2 i / rotary_dim) for
    i < rotary_dim / 2, angles positions * inv_freq in float64.
    Returns (cos, sin), each (n, rotary_dim // 2) float32."""
    rotary_dim = int(rotary_dim)
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    positions = np.asarray(positions)
    if positions.ndim != 1:
        raise ValueError(f"positions must be 1-D (n,), got shape {positions.shape}")
    angles = positions.astype(np.float64)[:, None] * _inv_freq(rotary_dim, float(base))[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@functools.lru_cache(maxsize=64)
def _inv_freq(rotary_dim: int, base: float) -> np.ndarray:
    """base ** (-2 i / rotary_dim), i < rotary_dim / 2, float64 (rope_table's; read-only: shared)."""
    f = np.float64(base) ** (-2.0 * np.arange(rotary_dim // 2, dtype=np.float64) / rotary_dim)
    f.flags.writeable = False
    return f


def rope(x, positions, *, base: float = 10000.0, rotary_dim: int | None = None, style: str = "neox"):
    """Rotary position embedding in float32: x (heads, n, head_dim), positions (n,) absolute positions.

    The first ``rotary_dim`` (default head_dim, even) elements rotate in pairs (a, b) by angle
    position * inv_freq_i (``rope_table``): "neox" pairs (i, i + rotary_dim / 2), "gptj" pairs (2i, 2i + 1);
    a' = a cos - b sin, b' = a sin + b cos. Elements from rotary_dim on are unchanged.
    Returns (heads, n, head_dim) float32.
    """
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 3:
        raise ValueError(f"x must be (heads, n, head_dim), got shape {x.shape}")
    d = x.shape[2]
    rotary_dim = d if rotary_dim is None else int(rotary_dim)
    if not 0 < rotary_dim <= d or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even and in (0, head_dim = {d}], got {rotary_dim}")
    positions = np.asarray(positions)
    if positions.shape != (x.shape[1],):
        raise ValueError(f"positions shape {positions.shape} != (n,) = ({x.shape[1]},)")
    half = rotary_dim // 2
    if style == "neox":
        ia, ib = slice(0, half), slice(half, rotary_dim)
    elif style == "gptj":
        ia, ib = slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)
    else:
        raise ValueError(f"style must be 'neox' or 'gptj', got {style!r}")
    cos, sin = rope_table(positions, rotary_dim, base)
    a, b = x[..., ia], x[..., ib]
    out = x.copy()
    out[..., ia] = a * cos - b * sin
    out[..., ib] = a * sin + b * cos
    return out


def quantize_int8(x):
    """Symmetric int8 quantisation per (head, token): x (heads, n, d) float, taken as float32.

    Defined exactly, so that every device stores the same bits (the shaders compute the same values
    with integer arithmetic, shaders/common.glsl ``quant_scale`` / ``quantise``):
    amax = max |x| over d; a row whose amax is 0 or a float32 denormal (< 2^-126, which a GPU may
    flush to 0) gets scale 0 and q 0. Otherwise scale = amax / 127 correctly rounded to float32
    (round half to even; numpy's float32 division), and q = the integer nearest the exact quotient
    x / scale, ties to even, clipped to -127 .. 127. The quotient is taken in float64: both operands
    have 24-bit significands, so a quotient that is not exactly a .5 tie lies more than 2^-25 away
    from one, far beyond float64's rounding error (2^-46 at 128), and rint of the float64 quotient
    is the exact rounding. Returns q (heads, n, d) int8 and scale (heads, n) float32.
    """
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 3:
        raise ValueError(f"x must be (heads, n, d), got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("x must be finite")
    amax = np.abs(x).max(axis=-1) if x.shape[2] else np.zeros(x.shape[:2], np.float32)
    with np.errstate(under="ignore"):
        scale = np.where(amax >= np.finfo(np.float32).tiny, amax / np.float32(127), np.float32(0))
    scale = scale.astype(np.float32, copy=False)
    safe = np.where(scale > 0, scale, np.float32(1)).astype(np.float64)
    q = np.clip(np.rint(x.astype(np.float64) / safe[..., None]), -127, 127).astype(np.int8)
    return q, scale


Q4_BLOCK = 16     # values per q4 block (half a 16-byte word of nibbles)
Q4_WORD = 32      # values per stored data word (two blocks)


Q4_ZMAX = 3840    # the largest |zero point|: the scale is at least max |x| / (256 * 15)
# the largest |x| a q4 cache accepts from numpy (2^126): a level may lie half a step past its
# block's range, and RoPE may grow a key by sqrt(2), so larger inputs could round past float32's
# largest value
Q4_MAX_ABS = float(2.0 ** 126)


def _q4_params(lo, hi):
    """The block parameter words (uint32, same shape) from each block's lo = min and hi = max
    (float32), as quantize_q4 defines them; 0 for a zero block."""
    def aligned(v):
        b = v.astype(np.float32).view(np.uint32).astype(np.int64)
        e = (b >> 23) & 0xFF
        m = np.where(e > 0, (b & 0x7FFFFF) | 0x800000, 0)
        return e, m, np.where(b >> 31 == 1, -1, 1)
    eh, mh, sh = aligned(hi)
    el, ml, sl = aligned(lo)
    big = np.maximum(eh, el)
    hh = sh * (mh >> np.minimum(big - eh, 31))
    ll = sl * (ml >> np.minimum(big - el, 31))
    r = np.maximum(hh - ll, (np.maximum(np.abs(hh), np.abs(ll)) + 255) >> 8)   # the range, in 2^(E - 150)
    f = np.floor(np.log2(np.maximum(r, 1).astype(np.float64))).astype(np.int64)   # exact: r < 2^25
    j = np.maximum(f - 15, 0)
    j = j + (r > (15 << (12 + j)))
    div = np.int64(15) << j
    qd = -(-r // div)                                                           # ceil
    carry = qd == 1 << 12
    qd, j = np.where(carry, 1 << 11, qd), j + carry
    ed = big + j - 12
    sbits = (ed << 23) | ((qd << 12) & 0x7FFFFF)
    live = ed >= 25
    scale = np.where(live, sbits, 0).astype(np.uint32).view(np.float32).astype(np.float64)
    safe = np.where(live, scale, 1.0)
    z = np.where(live, -np.rint(lo.astype(np.float64) / safe), 0).astype(np.int64)
    return np.where(live, ((sbits >> 12) << 13) | (z & 0x1FFF), 0).astype(np.uint32)


def quantize_q4(x, block: int = Q4_BLOCK):
    """q4 quantisation, blocks of 16 values per (head, token), asymmetric with an integer zero
    point: x (heads, n, d) float, taken as float32. Returns q (heads, n, d) uint8 in 0 .. 15 and
    params (heads, n, ceil(d / 16)) uint32; value = (q - z) * scale (``q4_split``: scale the
    float32 with bits (params >> 13) << 12, z the signed 13-bit integer params & 0x1FFF).

    Why this layout (``python -m perf q4study``, perf/RESULTS.md): K vectors carry outlier
    channels, so a block's values sit off centre; 16 levels over [min, max] instead of 15 over
    [-max |x|, max |x|] nearly halve the step there, and blocks of 16 rather than 32 cut the mean
    KL by a third again. The zero point is an integer, so every level (q - z) * scale is an exact
    float32; the scale keeps float32's exponent range with 12 significant bits, so scale and zero
    point share one 32-bit word: 6 bits a value, a d-128 row 96 bytes (float16's: 256).

    Block b covers x[..., 16b : 16b + 16] (a last partial block: the values there and the zeros
    the cache pads it with, so its range includes 0 and its padding is stored as the nibble z,
    the level of 0; ``q4_words``). Defined exactly, on the bits, so that every device stores the same bits
    (shaders/common.glsl ``q4_param`` / ``quantise_q4``, integer arithmetic):
      lo, hi = the block's min and max, each taken as 0 if it is a float32 denormal (which a GPU
      may flush); with E the larger of their exponent fields, each becomes a signed integer in
      units of 2^(E - 150): its 24-bit significand shifted right by (E - its exponent field),
      the bits shifted out dropped (so H and L, |H|, |L| < 2^24);
      R = max(H - L, ceil(max(|H|, |L|) / 256)) (the second bounds |z|; it decides only for a
      block whose spread is below 1/256 of its size);
      scale = R * 2^(E - 150) / 15 rounded UP to 12 significant bits (so 15 steps span the
      range); a scale below 2^-102 (a block within about 2^-98 of 0, or all zero): a zero
      block, params 0 and q 0;
      z = -(lo / scale rounded half to even) (exact quotient; |z| <= 3840);
      q = (x / scale rounded half to even, exact quotient) + z, clipped to 0 .. 15.
    Every value lies within half a step (scale / 2) of its level, up to the range's truncation
    (2^-14 of a step at most). The float64 quotients are exact enough for rint: the scale has
    12 significant bits and x 24, so a quotient that is not a .5 tie lies at least 2^-13 / 2^12
    of a unit from one (far beyond float64's rounding error at 4096). Non-finite x: ValueError
    (the caches refuse it at the door, and |x| above Q4_MAX_ABS). ``block``: another block size,
    for studies only (perf/q4_study.py); the caches store blocks of Q4_BLOCK.
    """
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 3:
        raise ValueError(f"x must be (heads, n, d), got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("x must be finite")
    h, n, d = x.shape
    nb = -(-d // block)
    if nb == 0:
        return np.zeros((h, n, d), np.uint8), np.zeros((h, n, 0), np.uint32)
    xp = np.zeros((h, n, nb * block), np.float32)
    xp[..., :d] = x
    blocks = xp.reshape(h, n, nb, block)
    params = _q4_params(blocks.min(axis=-1), blocks.max(axis=-1))
    scale, z = q4_split(params)
    safe = np.where(scale > 0, scale, np.float32(1)).astype(np.float64)
    r = np.where(scale[..., None] > 0, np.rint(blocks.astype(np.float64) / safe[..., None]), 0)
    q = np.clip(r + z[..., None], 0, 15).astype(np.uint8)
    return q.reshape(h, n, nb * block)[..., :d], params


def q4_split(params):
    """Block parameter words (..., nb) uint32 -> (scale (..., nb) float32, z (..., nb) float32)."""
    params = np.asarray(params, np.uint32)
    scale = ((params >> np.uint32(13)) << np.uint32(12)).view(np.float32)
    z = (((params & np.uint32(0x1FFF)).astype(np.int32) ^ 0x1000) - 0x1000).astype(np.float32)
    return scale, z


def dequantize_q4(q, params, block: int = Q4_BLOCK):
    """q (heads, n, d) integers 0 .. 15 and params (heads, n, ceil(d / 16)) uint32 -> (q - z) *
    scale of its block as float32 (heads, n, d); every such product is exact in float32."""
    q = np.asarray(q)
    params = np.asarray(params, dtype=np.uint32)
    if q.ndim != 3 or params.shape != q.shape[:2] + (-(-q.shape[2] // block),):
        raise ValueError(f"q shape {q.shape} and params shape {params.shape} must be (heads, n, d) and "
                         f"(heads, n, ceil(d / 16))")
    scale, z = q4_split(params)
    d = q.shape[2]
    return (q.astype(np.float32) - np.repeat(z, block, axis=-1)[..., :d]) * np.repeat(scale, block, axis=-1)[..., :d]


def q4_row_words(d: int) -> int:
    """uint32 words of a stored q4 row of head dim d: 4 per data word (ceil(d / 32) of them), then
    its two blocks' parameter words, in whole 16-byte words."""
    w = -(-d // Q4_WORD)
    return 4 * (w + (w + 1) // 2)


def q4_words(q, params):
    """The stored rows: q (..., d) integers 0 .. 15 and params (..., nb) uint32, nb = ceil(d / 16)
    -> (..., q4_row_words(d)) uint32: ceil(d / 32) data words of 8 nibbles per uint32 (low first;
    past d the nibble of 0, its block's z clipped to 0 .. 15; a block wholly past d is a zero
    block), then the parameter words (block b's at uint32 4 * words + b, unused 0)."""
    q = np.asarray(q)
    params = np.asarray(params, np.uint32)
    d = q.shape[-1]
    w = -(-d // Q4_WORD)
    p = np.zeros(q.shape[:-1] + (2 * w,), np.uint32)
    p[..., :params.shape[-1]] = params
    zq = np.clip(q4_split(p)[1], 0, 15).astype(np.uint32)
    nib = np.repeat(zq, Q4_BLOCK, axis=-1)
    nib[..., :d] = q.astype(np.uint32) & 0xF
    nib = nib.reshape(q.shape[:-1] + (w * 4, 8)) << (4 * np.arange(8, dtype=np.uint32))
    out = np.zeros(q.shape[:-1] + (q4_row_words(d),), np.uint32)
    out[..., :w * 4] = np.bitwise_or.reduce(nib, axis=-1)
    out[..., w * 4:w * 6] = p
    return out


def q4_words_to_float32(words, d: int):
    """Stored q4 rows (..., q4_row_words(d)) uint32 -> (..., d) float32 values, each (nibble - its
    block's z) times its block's scale (exact)."""
    words = np.asarray(words, np.uint32)
    w = -(-d // Q4_WORD)
    data = words[..., :w * 4, None] >> (4 * np.arange(8, dtype=np.uint32))
    q = (data & 0xF).reshape(words.shape[:-1] + (w * Q4_WORD,))[..., :d].astype(np.float32)
    scale, z = q4_split(words[..., w * 4:w * 6])
    return (q - np.repeat(z, Q4_BLOCK, axis=-1)[..., :d]) * np.repeat(scale, Q4_BLOCK, axis=-1)[..., :d]


def dequantize_int8(q, scale):
    """q (heads, n, d) int8 and scale (heads, n) -> q * scale as float32 (heads, n, d)."""
    q = np.asarray(q)
    scale = np.asarray(scale, dtype=np.float32)
    if q.ndim != 3 or scale.shape != q.shape[:2]:
        raise ValueError(f"q shape {q.shape} and scale shape {scale.shape} must be (heads, n, d) and (heads, n)")
    return q.astype(np.float32) * scale[..., None]


# the largest finite bfloat16, 0x7f7f: (2 - 2^-7) * 2^127; and the largest float32 that rounds to a
# finite bfloat16 (0x7f7f7fff, rounded down to BF16_MAX): a bfloat16 cache refuses larger inputs
BF16_MAX = float(np.uint32(0x7f7f0000).view(np.float32))
BF16_FINITE_INPUT = float(np.uint32(0x7f7f7fff).view(np.float32))


def bfloat16_bits(x):
    """float32 -> bfloat16 bits (uint16, same shape): x taken as float32, rounded to the nearest
    bfloat16 with ties to even, computed on the float32 bits alone (no float operation, so no
    rounding or denormal mode is involved; shaders/common.glsl ``float_to_bf16`` is the same
    integer recipe). bfloat16 is the top half of a float32: sign, the 8-bit exponent, 7 mantissa
    bits. With b the float32 bits and lsb = bit 16 of b, the result is (b + 0x7fff + lsb) >> 16:
    the 16 dropped bits above half (0x8000) round up, below it down, exactly half up only when
    the kept part is odd (ties to even). So:

    - a carry out of the mantissa runs into the exponent (0x3f7fffff -> 0x3f80, 1.0);
    - |x| >= 0x7f7f8000 (3.3961775e38: BF16_MAX plus half its ULP, a tie that rounds to the even
      0x7f80) becomes +-Inf, every larger finite float32 too; +-Inf stays +-Inf;
    - -0.0 stays -0.0 (0x8000), and a negative value that rounds to zero keeps its sign;
    - float32 denormals are rounded by the same rule to bfloat16 denormals (bfloat16 has
      float32's exponent range; nothing is flushed to zero, and the largest denormals carry into
      the smallest normal, 2^-126);
    - NaN becomes a quiet NaN with its sign and top payload bits: (b >> 16) | 0x0040 (never Inf:
      the rounding rule alone would turn a NaN with a small payload into Inf).

    A cache refuses NaN and Inf from numpy, and values that would round to Inf (|x| >
    BF16_FINITE_INPUT), before they reach the device; this function defines the rest for any
    input."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32)
    nan = (b & np.uint32(0x7fffffff)) > np.uint32(0x7f800000)
    rounded = (b + np.uint32(0x7fff) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.where(nan, (b >> np.uint32(16)) | np.uint32(0x40), rounded).astype(np.uint16)


def bfloat16_to_float32(h):
    """bfloat16 bits (uint16) -> float32 values: the bits shifted into a float32's top half
    (exact: every bfloat16 is a float32)."""
    return (np.asarray(h, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_bfloat16(x):
    """x as a bfloat16 cache stores it, as float32: bfloat16_to_float32(bfloat16_bits(x))."""
    return bfloat16_to_float32(bfloat16_bits(x))


# The two 8-bit float formats (issue 32), as (mantissa bits P, exponent bias, largest finite bit
# pattern, largest finite value): "fp8_e4m3" is the "fn" variant (no Inf; 0x7f / 0xff are its only
# NaNs, so 0x7e = 448 is its largest finite value), "fp8_e5m2" is IEEE-like (0x7c = Inf, 0x7d ..
# 0x7f NaN; 0x7b = 57344 its largest finite value). The smallest normal exponent is 1 - bias, the
# subnormals are m * 2^(1 - bias - P), m = 1 .. 2^P - 1 (e4m3: 2^-9 steps, e5m2: 2^-16).
FP8_FORMATS = {"fp8_e4m3": (3, 7, 0x7E, 448.0), "fp8_e5m2": (2, 15, 0x7B, 57344.0)}


def _fp8_kind(fmt: str) -> tuple:
    try:
        return FP8_FORMATS[fmt]
    except KeyError:
        raise ValueError(f"fp8 format must be 'fp8_e4m3' or 'fp8_e5m2', got {fmt!r}") from None


def _msb(a: np.ndarray) -> np.ndarray:
    """Index of the highest set bit of each positive int64 (integer steps only)."""
    n = np.zeros(a.shape, np.int64)
    for step in (16, 8, 4, 2, 1):
        up = (a >> (n + step)) != 0
        n += np.where(up, step, 0)
    return n


def _significand(bits: np.ndarray) -> tuple:
    """Positive finite float32 bits (int64, nonzero) -> (m, e), value = m * 2^e with m in
    [2^23, 2^24): normals take their hidden bit, denormals are shifted up to it."""
    normal = bits >= 0x00800000
    lz = np.where(normal, 0, 23 - _msb(np.maximum(bits, 1)))
    m = np.where(normal, (bits & 0x7FFFFF) | 0x800000, bits << lz)
    e = np.where(normal, (bits >> 23) - 150, -149 - lz)
    return m, e


def check_fp8_scale(scale, num_kv_heads: int, fmt: str, name: str = "scale") -> np.ndarray:
    """A fp8 cache's scale argument -> (num_kv_heads,) float32. ``scale``: a number (every kv head)
    or a sequence / array of num_kv_heads numbers. Each must be a finite float32 > 0 whose product
    with the format's largest finite value is a finite float32 (so every finite stored value
    dequantises to a finite float32). Raises TypeError / ValueError naming ``name``."""
    _, _, _, fmax = _fp8_kind(fmt)
    listed = isinstance(scale, (list, tuple, np.ndarray))
    items = np.asarray(scale, dtype=object).ravel() if listed else [scale]
    if not all(isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_)) for x in items):
        raise TypeError(f"{name}: expected a number or {num_kv_heads} numbers (one per kv head), got "
                        f"{type(scale).__name__}")
    try:
        arr = np.asarray(scale, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a number or {num_kv_heads} numbers, got {scale!r}") from None
    if arr.ndim == 0:
        arr = np.full(num_kv_heads, float(arr))
    if arr.shape != (num_kv_heads,):
        raise ValueError(f"{name}: expected a number or shape ({num_kv_heads},) (one per kv head), got shape "
                         f"{arr.shape}")
    with np.errstate(over="ignore", invalid="ignore"):
        f32 = arr.astype(np.float32)
        top = f32.astype(np.float64) * fmax
    bad = ~np.isfinite(arr) | ~(f32 > 0) | ~(top <= float(np.finfo(np.float32).max))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name}: kv head {i}'s scale {arr[i]!r} must be a finite float32 > 0 with "
                         f"{fmax:g} * scale finite in float32")
    return f32


def fp8_bits(x, fmt: str, scale=1.0):
    """x / scale rounded to an 8-bit float: the bits (uint8, x's shape) a ``fmt`` cache stores.

    x: any shape, taken as float32; fmt: "fp8_e4m3" or "fp8_e5m2"; scale: a float32 > 0 (finite),
    a number or an array that broadcasts against x (a cache: its (num_kv_heads,) scales as
    scale[:, None, None] for x (num_kv_heads, n, d)). Defined exactly and computed with integer
    arithmetic on the float32 bits of x and scale (never a float division or cast, whose result
    could depend on the platform), as shaders/common.glsl ``fp8_encode`` does on the device:

    - the stored value is the exact real quotient x / scale rounded once to the format, to the
      nearest representable value, ties to even (the quotient is never rounded to float32 first:
      with significands mx, ms of x and scale, floor(2 mx 2^k / ms) and its remainder give the
      kept bits, the half bit and a sticky bit exactly);
    - finite overflow saturates: a quotient past the largest finite value (448 for e4m3, 57344
      for e5m2) -- even one that would round to e4m3's NaN pattern or e5m2's Inf -- stores
      +-max finite, for both formats;
    - Inf: e4m3 (which has no Inf) saturates to +-448; e5m2 keeps +-Inf (0x7c / 0xfc);
    - NaN: the canonical NaN 0x7f with x's sign (0x7f / 0xff), for both formats;
    - subnormals are kept (no flush): quotients below 2^(1 - bias) round to multiples of
      2^(1 - bias - P) (e4m3 2^-9, e5m2 2^-16), and a quotient of at most half the smallest
      subnormal rounds to zero; float32 denormal inputs take part like any value;
    - the sign is kept: -0.0 stores 0x80, and a negative x that rounds to zero stores -0.

    A cache stores fp8_bits(x, fmt, its kv head's scale); the value it holds (and attends with) is
    fp8_to_float32(bits, fmt) * scale (``round_to``).
    """
    p, bias, maxbits, _ = _fp8_kind(fmt)
    xb = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.int64)
    sb = np.asarray(scale, dtype=np.float32).view(np.uint32).astype(np.int64)
    xb, sb = np.broadcast_arrays(xb, sb)
    if ((sb & 0x7FFFFFFF) == 0).any() or (sb >= 0x7F800000).any():
        raise ValueError("scale must be a finite float32 > 0")
    sign = (xb >> 24) & 0x80
    xa = xb & 0x7FFFFFFF
    emin = 1 - bias
    mx, ex = _significand(np.maximum(xa, 1))
    ms, es = _significand(sb)
    # x / scale = (mx / ms) * 2^d, mx / ms in (1/2, 2): its binade e is d or d - 1
    d = ex - es
    e = d - (mx < ms)
    # in units of the quotient's ulp 2^u (u = max(e, emin) - P), doubled for the half bit:
    # t = floor(2 x / (scale 2^u)) = floor(mx 2^sh / ms), 0 <= sh <= P + 2 wherever it is used
    sh = np.clip(d - (np.maximum(e, emin) - p) + 1, 0, p + 2)
    num = mx << sh
    t = num // ms
    sticky = (num - t * ms) != 0
    k = t >> 1
    k = k + ((t & 1) & (sticky | (k & 1)))                     # round half to even
    bits = np.where(e >= emin, (e + bias - 1) << p, 0) + k       # a carry runs into the exponent
    bits = np.minimum(bits, maxbits)                             # saturate finite overflow
    bits = np.where(e > (maxbits >> p) - bias, maxbits, bits)    # far past the range (e > emax)
    bits = np.where(e < emin - p - 1, 0, bits)                   # below half the smallest subnormal
    bits = np.where(xa == 0, 0, bits)
    if fmt == "fp8_e5m2":
        bits = np.where(xa == 0x7F800000, 0x7C, bits)            # Inf stays Inf
    else:
        bits = np.where(xa == 0x7F800000, maxbits, bits)         # no Inf: saturate
    bits = np.where(xa > 0x7F800000, 0x7F, bits)                 # NaN
    return (bits | sign).astype(np.uint8)


def fp8_to_float32(b, fmt: str):
    """fp8 bits (uint8, any shape) -> their values as float32 (exact: every fp8 value is a float32),
    unscaled. e4m3: 0x7f / 0xff are NaN; e5m2: exponent field 31 is Inf (mantissa 0) or NaN."""
    p, bias, _, _ = _fp8_kind(fmt)
    b = np.asarray(b, dtype=np.uint8).astype(np.uint32)
    mag = b & np.uint32(0x7F)
    normal = (mag << np.uint32(23 - p)) + np.uint32((127 - bias) << 23)
    # subnormal: mag * 2^(1 - bias - p), built in the bits: mag's leading bit becomes the hidden one
    m = mag.astype(np.int64)
    lead = _msb(np.maximum(m, 1))
    sub = ((lead + (1 - bias - p) + 127) << 23) | ((m << (23 - lead)) & 0x7FFFFF)
    f = np.where(mag >= np.uint32(1 << p), normal, np.where(mag == 0, 0, sub).astype(np.uint32))
    if fmt == "fp8_e4m3":
        f = np.where(mag == 0x7F, np.uint32(0x7FC00000), f)
    else:
        f = np.where(mag >= 0x7C, np.uint32(0x7F800000) | ((mag & np.uint32(3)) << np.uint32(21)), f)
    return (f.astype(np.uint32) | ((b & np.uint32(0x80)) << np.uint32(24))).view(np.float32)


def round_fp8(x, fmt: str, scale=1.0):
    """x as a ``fmt`` cache with ``scale`` holds it, as float32: fp8_to_float32(fp8_bits(x, fmt,
    scale), fmt) * scale (the float32 product, rounded to nearest even)."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        return fp8_to_float32(fp8_bits(x, fmt, scale), fmt) * np.asarray(scale, dtype=np.float32)


def round_to(x: np.ndarray, dtype: str, scale=1.0) -> np.ndarray:
    """x as the cache stores it, as float32: float16 rounding for a float16 cache, bfloat16
    rounding (``bfloat16_bits``) for a bfloat16 cache, fp8 (``round_fp8``; ``scale``: the cache's
    (num_kv_heads,) scales of K or V, or one number; x is (heads, n, d)) for a fp8 cache,
    symmetric per-(head, position) int8 quantisation for an int8 cache (``quantize_int8``; x is
    (heads, n, d)), q4 block quantisation for a q4 cache (``quantize_q4``), unchanged for float32."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return round_bfloat16(x)
    if dtype in FP8_FORMATS:
        s = np.asarray(scale, dtype=np.float32)
        return round_fp8(x, dtype, s.reshape(-1, 1, 1) if s.ndim == 1 else s)
    if dtype == "int8":
        return dequantize_int8(*quantize_int8(x))
    if dtype == "q4":
        return dequantize_q4(*quantize_q4(x))
    return x


# Parity tolerances (|got - ref| <= atol + rtol * |ref|) for device results against ``attention``
# on the values the cache holds. K/V are compared after storage rounding, so the dtypes differ
# only by accumulation order and exp2 vs exp. An int8 cache is compared the same way against the
# dequantised values it stores (``dequantize_int8``), so it gets the same tolerance: quantisation
# error is in the reference's inputs, not in the comparison.
TOLERANCE = {"float32": (2e-5, 2e-4), "float16": (2e-5, 2e-4), "bfloat16": (2e-5, 2e-4), "int8": (2e-5, 2e-4),
             "fp8_e4m3": (2e-5, 2e-4), "fp8_e5m2": (2e-5, 2e-4), "q4": (2e-5, 2e-4)}
