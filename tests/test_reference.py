"""The numpy reference itself (no Vulkan): attention variants against naive float64 loops, merge_states,
rope and int8 quantisation."""
import numpy as np
import pytest

from vkattn import reference
from vkattn.reference import (attention, dequantize_int8, merge_states, quantize_int8, rope,
                              rope_table)

ATOL, RTOL = 1e-5, 1e-4

# (num_qo_heads, num_kv_heads, s, L, head_dim, v_head_dim): odd sizes, GQA groups 4 / 1 / 3 / 2,
# s == L, decode (s = 1) and s = 2 (only the first row misses a key under causal)
SHAPES = [
    (8, 2, 5, 37, 13, 11),
    (4, 1, 37, 37, 16, 8),
    (3, 3, 1, 50, 7, 9),
    (6, 2, 16, 64, 32, 32),
    (2, 1, 2, 9, 5, 3),
]


def rand(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def rand_qkv(rng, hq, hkv, s, L, d, dv):
    return rand(rng, (hq, s, d)), rand(rng, (hkv, L, d)), rand(rng, (hkv, L, dv))


def old_loop(q, k, v, causal=True, scale=None):
    """The original reference's definition: K/V repeated per query head, one head at a time, float64."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    hq, s, d = q.shape
    L = k.shape[1]
    group = hq // k.shape[0]
    k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    out = np.zeros((hq, s, v.shape[2]))
    for h in range(hq):
        logits = scale * q[h] @ k[h].T
        if causal:
            logits[np.arange(L)[None, :] > np.arange(s)[:, None] + L - s] = -np.inf
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        out[h] = (w / w.sum(axis=1, keepdims=True)) @ v[h]
    return out


def naive(q, k, v, causal=True, scale=None, window=None, n_sink=0, mask=None, softcap=None,
          alibi_slopes=None):
    """Independent float64 definition, one head and one query row at a time. Returns (out, lse, logits)
    with logits (num_qo_heads, s, L) holding -inf for every invisible key."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    hq, s, d = q.shape
    hkv, L, _ = k.shape
    group = hq // hkv
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    out = np.zeros((hq, s, v.shape[2]))
    lse = np.full((hq, s), -np.inf)
    all_logits = np.full((hq, s, L), -np.inf)
    for h in range(hq):
        kh, vh = k[h // group], v[h // group]
        for r in range(s):
            p = L - s + r
            j = np.arange(L)
            x = scale * (kh @ q[h, r])
            if softcap is not None:
                x = softcap * np.tanh(x / softcap)
            if alibi_slopes is not None:
                x = x + float(alibi_slopes[h]) * (j - p)
            if mask is not None:
                x = x + (mask[r] if mask.ndim == 2 else mask[h, r])
            seen = np.ones(L, bool)
            if causal:
                seen &= j <= p
            if window is not None:
                seen &= (p - j < window) | (j < n_sink)
            seen &= x > -np.inf
            if not seen.any():
                continue
            xs = x[seen]
            all_logits[h, r, seen] = xs
            m = xs.max()
            w = np.exp(xs - m)
            lse[h, r] = m + np.log(w.sum())
            out[h, r] = (w / w.sum()) @ vh[seen]
    return out, lse, all_logits


def check(got, want):
    assert got.dtype == np.float32 and got.shape == want.shape
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


def check_lse(got, want):
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], atol=ATOL, rtol=RTOL)


# ----------------------------------------------------------------------------------------- defaults


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("scale", [None, 0.37])
def test_defaults_match_original_definition(rng, shape, causal, scale):
    q, k, v = rand_qkv(rng, *shape)
    out = attention(q, k, v, causal, scale)          # positional, as every existing caller passes it
    assert isinstance(out, np.ndarray)
    check(out, old_loop(q, k, v, causal, scale))


def test_accepts_float16_and_float64_inputs(rng):
    q, k, v = rand_qkv(rng, 4, 2, 3, 20, 8, 8)
    want = old_loop(q.astype(np.float16), k.astype(np.float16), v)
    check(attention(q.astype(np.float16), k.astype(np.float16), v.astype(np.float64)), want)


# ----------------------------------------------------------------------------------------- variants


def variant_kwargs(name, rng, hq, s, L):
    if name == "window":
        return dict(window=6)
    if name == "window_sinks":
        return dict(window=5, n_sink=3)
    if name == "window_1":
        return dict(window=1, n_sink=2)
    if name == "mask_2d":
        mask = rng.standard_normal((s, L)).astype(np.float32)
        mask[rng.random((s, L)) < 0.3] = -np.inf
        return dict(mask=mask)
    if name == "mask_3d":
        mask = rng.standard_normal((hq, s, L)).astype(np.float32)
        mask[rng.random((hq, s, L)) < 0.3] = -np.inf
        return dict(mask=mask)
    if name == "softcap":
        return dict(softcap=1.5, scale=2.0)            # large logits so the cap bites
    if name == "alibi":
        return dict(alibi_slopes=2.0 ** -np.arange(1, hq + 1, dtype=np.float32))
    if name == "everything":
        mask = rng.standard_normal((hq, s, L)).astype(np.float32)
        mask[rng.random((hq, s, L)) < 0.2] = -np.inf
        return dict(window=7, n_sink=2, softcap=3.0, mask=mask,
                    alibi_slopes=rng.uniform(0.01, 0.3, hq).astype(np.float32))
    raise AssertionError(name)


VARIANTS = ["window", "window_sinks", "window_1", "mask_2d", "mask_3d", "softcap", "alibi", "everything"]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_against_naive(rng, shape, causal, variant):
    q, k, v = rand_qkv(rng, *shape)
    kw = variant_kwargs(variant, rng, shape[0], shape[2], shape[3])
    out, lse = attention(q, k, v, causal, return_lse=True, **kw)
    want, want_lse, _ = naive(q, k, v, causal, **kw)
    check(out, want)
    check_lse(lse, want_lse)
    check(attention(q, k, v, causal, **kw), want)     # return_lse does not change out


def test_variants_change_the_result(rng):
    """Each option has an effect on these inputs, so the parity tests above do compare something."""
    hq, hkv, s, L, d, dv = 8, 2, 5, 37, 13, 11
    q, k, v = rand_qkv(rng, hq, hkv, s, L, d, dv)
    plain = attention(q, k, v)
    for name in VARIANTS:
        assert not np.allclose(attention(q, k, v, **variant_kwargs(name, rng, hq, s, L)), plain), name
    assert not np.allclose(attention(q, k, v, window=5, n_sink=3), attention(q, k, v, window=5))


def test_window_on_long_cache_skips_unreachable_keys(rng):
    """A short window on a long cache (keys out of every row's reach are dropped up front)."""
    q, k, v = rand_qkv(rng, 4, 2, 6, 3001, 16, 8)
    for kw in (dict(window=9), dict(window=9, n_sink=4), dict(window=9, n_sink=5000), dict(window=0, n_sink=3)):
        for causal in (True, False):
            out, lse = attention(q, k, v, causal, return_lse=True, **kw)
            want, want_lse, _ = naive(q, k, v, causal, **kw)
            check(out, want)
            check_lse(lse, want_lse)


def test_row_blocks_match_single_block(rng, monkeypatch):
    q, k, v = rand_qkv(rng, 8, 2, 23, 41, 13, 11)
    kw = dict(mask=rand(rng, (8, 23, 41)), alibi_slopes=rng.uniform(0, 0.2, 8), window=9, n_sink=1,
              return_lse=True)
    out, lse = attention(q, k, v, **kw)
    monkeypatch.setattr(reference, "_BLOCK", 4 * 41 * 5)      # 5 rows per block, last block partial
    out2, lse2 = attention(q, k, v, **kw)
    np.testing.assert_allclose(out2, out, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(lse2, lse, atol=1e-6, rtol=1e-6)
    check(out2, naive(q, k, v, **{a: b for a, b in kw.items() if a != "return_lse"})[0])


@pytest.mark.parametrize("shape", SHAPES)
def test_lse_is_log_sum_exp_of_logits(rng, shape):
    q, k, v = rand_qkv(rng, *shape)
    for kw in (dict(), dict(window=4, n_sink=1, softcap=2.0), dict(causal=False, alibi_slopes=np.ones(shape[0]))):
        _, lse = attention(q, k, v, return_lse=True, **kw)
        causal = kw.pop("causal", True)
        _, _, logits = naive(q, k, v, causal, **kw)
        with np.errstate(divide="ignore"):
            direct = np.log(np.exp(logits).sum(axis=-1))   # small logits: no max subtraction needed
        check_lse(lse, direct)


@pytest.mark.filterwarnings("error")
def test_rows_that_see_nothing_give_zeros_and_minus_inf(rng):
    hq, hkv, s, L, d, dv = 8, 2, 5, 37, 13, 11
    q, k, v = rand_qkv(rng, hq, hkv, s, L, d, dv)
    mask = np.zeros((hq, s, L), np.float32)
    mask[1, 2] = -np.inf                                     # one (head, row) fully masked
    mask[:, 4] = -np.inf                                     # one row masked for all heads
    mask[3, 0, :L - s + 1] = -np.inf                         # causal hides the rest of this row
    out, lse = attention(q, k, v, mask=mask, return_lse=True)
    dead = np.zeros((hq, s), bool)
    dead[1, 2] = dead[:, 4] = dead[3, 0] = True
    assert np.isfinite(out).all()
    assert (out[dead] == 0).all() and np.isneginf(lse[dead]).all()
    assert np.isfinite(lse[~dead]).all() and (np.abs(out[~dead]).sum(axis=-1) > 0).all()
    want, want_lse, _ = naive(q, k, v, mask=mask)
    check(out, want)
    check_lse(lse, want_lse)

    # window 0 without sinks: a causal row sees nothing at all
    out, lse = attention(q, k, v, window=0, return_lse=True)
    assert (out == 0).all() and np.isneginf(lse).all()
    # ... while sinks stay visible
    out, lse = attention(q, k, v, window=0, n_sink=2, return_lse=True)
    check(out, naive(q, k, v, window=0, n_sink=2)[0])
    assert np.isfinite(lse).all()


def test_bad_options_raise(rng):
    q, k, v = rand_qkv(rng, 4, 2, 3, 10, 8, 8)
    with pytest.raises(ValueError, match="mask"):
        attention(q, k, v, mask=np.zeros((4, 10)))
    with pytest.raises(ValueError, match="alibi_slopes"):
        attention(q, k, v, alibi_slopes=np.ones(2))
    with pytest.raises(ValueError, match="softcap"):
        attention(q, k, v, softcap=0.0)
    with pytest.raises(ValueError, match="window"):
        attention(q, k, v, window=-1)
    with pytest.raises(TypeError):
        attention(q, k, v, True, None, 4)                    # the new options are keyword-only


# ---------------------------------------------------------------------------------------- merge


def split_mask(keep, s):
    return np.where(np.broadcast_to(keep, (s, keep.size)), 0.0, -np.inf).astype(np.float32)


@pytest.mark.parametrize("shape", [(8, 2, 30, 37, 13, 11), (4, 4, 5, 37, 16, 8), (4, 1, 1, 64, 32, 32)])
@pytest.mark.parametrize("split", ["first17", "interleaved"])
@pytest.mark.parametrize("causal", [True, False])
def test_merge_of_disjoint_key_sets_equals_attending_to_all(rng, shape, split, causal):
    hq, hkv, s, L, d, dv = shape
    q, k, v = rand_qkv(rng, *shape)
    kw = dict(window=20, n_sink=3) if split == "interleaved" else {}
    keep = np.arange(L) < 17 if split == "first17" else np.arange(L) % 2 == 0
    a = attention(q, k, v, causal, mask=split_mask(keep, s), return_lse=True, **kw)
    b = attention(q, k, v, causal, mask=split_mask(~keep, s), return_lse=True, **kw)
    out, lse = merge_states(*a, *b)
    want, want_lse = attention(q, k, v, causal, return_lse=True, **kw)
    check(out, want)
    check_lse(lse, want_lse)
    check(out, naive(q, k, v, causal, **kw)[0])


def test_merge_of_sliced_caches(rng):
    """Non-causal attention over k[:, :17] and k[:, 17:] merged equals attention over all of k."""
    q, k, v = rand_qkv(rng, 8, 2, 5, 37, 13, 11)
    a = attention(q, k[:, :17], v[:, :17], causal=False, return_lse=True)
    b = attention(q, k[:, 17:], v[:, 17:], causal=False, return_lse=True)
    out, lse = merge_states(*a, *b)
    want, want_lse, _ = naive(q, k, v, causal=False)
    check(out, want)
    check_lse(lse, want_lse)
    assert not np.allclose(a[0], want, atol=1e-3) and not np.allclose(b[0], want, atol=1e-3)


def test_causal_split_has_empty_rows(rng):
    """With causal rows at positions below 17, the second half is empty for them (lse -inf)."""
    q, k, v = rand_qkv(rng, 4, 2, 30, 37, 8, 8)
    _, lse_b = attention(q, k, v, mask=split_mask(np.arange(37) >= 17, 30), return_lse=True)
    assert np.isneginf(lse_b[:, :10]).all() and np.isfinite(lse_b[:, 10:]).all()


@pytest.mark.filterwarnings("error")
def test_merge_with_empty_side_returns_the_other(rng):
    out = rand(rng, (4, 5, 7))
    lse = rand(rng, (4, 5))
    zeros, none = np.zeros_like(out), np.full_like(lse, -np.inf)
    for merged in (merge_states(out, lse, zeros, none), merge_states(zeros, none, out, lse)):
        assert merged[0].dtype == np.float32 and merged[1].dtype == np.float32
        np.testing.assert_array_equal(merged[0], out)
        np.testing.assert_array_equal(merged[1], lse)
    o, l = merge_states(zeros, none, zeros, none)
    assert (o == 0).all() and np.isneginf(l).all()


@pytest.mark.filterwarnings("error")
def test_merge_is_commutative_and_weighs_by_lse(rng):
    oa, ob = rand(rng, (3, 6, 5)), rand(rng, (3, 6, 5))
    la, lb = rand(rng, (3, 6)) * 4, rand(rng, (3, 6)) * 4
    la[0, 0] = -np.inf
    lb[1, 1] = lb[2, 2] = -np.inf
    la[2, 2] = -np.inf
    ab, ba = merge_states(oa, la, ob, lb), merge_states(ob, lb, oa, la)
    np.testing.assert_array_equal(ab[0], ba[0])
    np.testing.assert_array_equal(ab[1], ba[1])
    la64, lb64 = la.astype(np.float64), lb.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.logaddexp(la64, lb64)
        wa = np.where(np.isneginf(la64), 0.0, np.exp(la64 - lse))
        wb = np.where(np.isneginf(lb64), 0.0, np.exp(lb64 - lse))
    want = oa * wa[..., None] + ob * wb[..., None]
    check(ab[0], want)
    check_lse(ab[1], lse)
    assert (ab[0][2, 2] == 0).all() and np.isneginf(ab[1][2, 2])


def test_merge_validates_arguments(rng):
    out, lse = rand(rng, (2, 3, 4)), rand(rng, (2, 3))
    with pytest.raises(ValueError, match="out_b"):
        merge_states(out, lse, out[:, :2], lse)
    with pytest.raises(ValueError, match="lse_a"):
        merge_states(out, lse[:, :2], out, lse)
    with pytest.raises(ValueError, match="lse_b"):
        merge_states(out, lse, out, lse[..., None])
    with pytest.raises(TypeError, match="lse_b"):
        merge_states(out, lse, out, lse.tolist())
    with pytest.raises(TypeError, match="out_a"):
        merge_states(1.0, lse, out, lse)


# ----------------------------------------------------------------------------------------- rope


def rope_complex(x, positions, base, rotary_dim, style):
    """Independent float64 rope: each pair is a complex number multiplied by exp(i * angle)."""
    x = np.asarray(x, np.float64).copy()
    half = rotary_dim // 2
    theta = np.asarray(positions, np.float64)[:, None] / base ** (np.arange(half) * 2.0 / rotary_dim)
    ia = np.arange(half) if style == "neox" else 2 * np.arange(half)
    ib = ia + half if style == "neox" else ia + 1
    z = (x[..., ia] + 1j * x[..., ib]) * np.exp(1j * theta)
    x[..., ia], x[..., ib] = z.real, z.imag
    return x


def pair_indices(style, rotary_dim):
    half = rotary_dim // 2
    return (np.arange(half), np.arange(half) + half) if style == "neox" else \
        (2 * np.arange(half), 2 * np.arange(half) + 1)


def test_rope_table():
    pos = np.array([0, 1, 7, 65535])
    cos, sin = rope_table(pos, 6, base=500.0)
    assert cos.shape == sin.shape == (4, 3) and cos.dtype == sin.dtype == np.float32
    ang = pos[:, None] * 500.0 ** (-np.array([0.0, 2.0, 4.0]) / 6)
    np.testing.assert_allclose(cos, np.cos(ang), atol=1e-7)
    np.testing.assert_allclose(sin, np.sin(ang), atol=1e-7)
    assert (cos[0] == 1).all() and (sin[0] == 0).all()
    with pytest.raises(ValueError, match="rotary_dim"):
        rope_table(pos, 7)


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(16, None), (64, 64), (13, 8), (32, 10)])
def test_rope_against_complex_rotation(rng, style, head_dim, rotary_dim):
    x = rand(rng, (3, 9, head_dim))
    pos = rng.integers(0, 5000, 9)
    got = rope(x, pos, rotary_dim=rotary_dim, style=style, base=10000.0)
    assert got.dtype == np.float32 and got.shape == x.shape
    rd = head_dim if rotary_dim is None else rotary_dim
    np.testing.assert_allclose(got, rope_complex(x, pos, 10000.0, rd, style), atol=1e-5, rtol=1e-4)
    # each rotated pair keeps its norm
    ia, ib = pair_indices(style, rd)
    np.testing.assert_allclose(np.hypot(got[..., ia], got[..., ib]), np.hypot(x[..., ia], x[..., ib]),
                               rtol=1e-5, atol=1e-6)
    # the tail past rotary_dim is untouched, bit for bit
    np.testing.assert_array_equal(got[..., rd:], x[..., rd:])
    assert not np.allclose(got[..., :rd], x[..., :rd])


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rope_position_zero_is_identity(rng, style):
    x = rand(rng, (2, 4, 12))
    np.testing.assert_array_equal(rope(x, np.zeros(4, int), style=style), x)
    assert not np.allclose(rope(x, np.arange(4), style=style)[:, 1:], x[:, 1:])


def test_rope_styles_differ(rng):
    x = rand(rng, (2, 5, 16))
    pos = np.arange(3, 8)
    assert not np.allclose(rope(x, pos, style="neox"), rope(x, pos, style="gptj"), atol=1e-3)
    with pytest.raises(ValueError, match="style"):
        rope(x, pos, style="llama")
    with pytest.raises(ValueError, match="rotary_dim"):
        rope(x, pos, rotary_dim=5)


def test_rope_partial_rotary_equals_rope_on_the_head(rng):
    x = rand(rng, (2, 6, 20))
    pos = np.arange(100, 106)
    got = rope(x, pos, rotary_dim=8, base=100.0)
    np.testing.assert_array_equal(got[..., :8], rope(x[..., :8], pos, base=100.0))


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("dist", [0, 3, 40])
def test_rope_scores_depend_only_on_relative_position(rng, style, dist):
    q = rand(rng, (1, 1, 32))
    k = rand(rng, (1, 1, 32))
    q /= np.linalg.norm(q)
    k /= np.linalg.norm(k)
    scores = [float(rope(q, [p], style=style)[0, 0] @ rope(k, [p - dist], style=style)[0, 0])
              for p in (dist, dist + 1, dist + 17, dist + 1000, dist + 4093)]
    np.testing.assert_allclose(scores, scores[0], atol=1e-4)
    if dist:   # and they do depend on the distance
        assert abs(scores[0] - float(q[0, 0] @ k[0, 0])) > 1e-3


# ---------------------------------------------------------------------------------------- int8


@pytest.mark.filterwarnings("error")
def test_quantize_int8(rng):
    x = rand(rng, (3, 7, 13)) * rng.uniform(0.01, 10, (3, 7, 1)).astype(np.float32)
    x[1, 2] = 0.0                                            # a zero row
    x[2, 4] = -x[2, 4]                                       # sign variety for the max element
    q, scale = quantize_int8(x)
    assert q.dtype == np.int8 and q.shape == x.shape
    assert scale.dtype == np.float32 and scale.shape == (3, 7)
    np.testing.assert_array_equal(scale, np.abs(x).max(axis=-1).astype(np.float32) / np.float32(127))
    assert scale[1, 2] == 0 and (q[1, 2] == 0).all()
    back = dequantize_int8(q, scale)
    assert back.dtype == np.float32 and back.shape == x.shape
    assert (np.abs(back - x) <= scale[..., None] * (0.5 + 1e-4) + 1e-12).all()
    assert (back[1, 2] == 0).all()
    # the largest |element| of each nonzero row lands on +-127 with its sign
    idx = np.abs(x).argmax(axis=-1)[..., None]
    top_q = np.take_along_axis(q, idx, -1)[..., 0].astype(int)
    top_x = np.take_along_axis(x, idx, -1)[..., 0]
    live = scale > 0
    np.testing.assert_array_equal(top_q[live], 127 * np.sign(top_x[live]).astype(int))
    assert np.abs(q.astype(int)).max() == 127


def test_quantize_rounds_half_to_even():
    # scale = 127 / 127 = 1, so x / scale is x itself: halves go to the even neighbour
    x = np.array([[[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -126.5]]], np.float32)
    q, scale = quantize_int8(x)
    assert scale[0, 0] == 1.0
    np.testing.assert_array_equal(q[0, 0], [127, 0, 2, 2, 0, -2, -126])
    np.testing.assert_array_equal(dequantize_int8(q, scale), q.astype(np.float32))


def test_tolerance_has_int8():
    assert reference.TOLERANCE["int8"] == reference.TOLERANCE["float32"] == (2e-5, 2e-4)
