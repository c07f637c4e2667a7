"""Attention variants on KVCache (window + sinks, mask, softcap, ALiBi, log-sum-exp, merge) against
the numpy reference, on both kernels, decode (split-K, merged on the device) and prefill (direct) paths."""
import numpy as np
import pytest

import vkattn
from conftest import LSE_TOL, Mirror, assert_close, rand_kv, rand_q, variant_args

KERNELS = ["lane", "tile"]


VARIANTS = ["window", "window_sinks", "softcap", "alibi", "mask", "mask_heads", "all"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("hkv,group,d,past,s,dtype,splits", [
    (2, 4, 64, 250, 1, "float16", "4"),     # decode: split-K, merged by the last workgroup
    (1, 3, 13, 61, 1, "float32", None),     # odd head_dim, group 3; the machine's split count
    (2, 2, 24, 100, 9, "float16", None),    # prefill with past: direct output
    (3, 1, 37, 0, 29, "float32", None),     # prefill from empty
])
def test_variant_forward(device, rng, monkeypatch, kernel, variant, hkv, group, d, past, s, dtype, splits):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    if splits:                          # whatever the machine's cores would choose (tuning.decode_splits)
        monkeypatch.setenv("VKATTN_DECODE_SPLITS", splits)
    cache = vkattn.KVCache(past + s + 5, hkv, d, dtype=dtype, device=device)
    mirror = Mirror(cache)
    if past:
        k, v = rand_kv(rng, cache, past)
        cache.append(k, v)
        mirror.append(k, v)
    k, v = rand_kv(rng, cache, s)
    q = rand_q(rng, cache, group, s)
    kw = variant_args(variant, rng, hkv * group, s, past + s)
    out, lse = cache.forward(q, k, v, return_lse=True, **kw)
    mirror.append(k, v)
    ref, ref_lse = vkattn.reference.attention(q, mirror.k, mirror.v, return_lse=True, **kw)
    assert_close(out, ref, dtype)
    np.testing.assert_allclose(lse, ref_lse, **LSE_TOL)
    # and the same again through attend (no new rows), non-causal
    q2 = rand_q(rng, cache, group, s)
    out2 = cache.attend(q2, causal=False, **kw)
    assert_close(out2, vkattn.reference.attention(q2, mirror.k, mirror.v, causal=False, **kw), dtype)


@pytest.mark.parametrize("kernel", KERNELS)
def test_sliding_window_decode_long(device, rng, monkeypatch, kernel):
    # a window far shorter than the cache: most splits see no key; sinks come from split 0
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    monkeypatch.setenv("VKATTN_DECODE_SPLITS", "6")
    cache = vkattn.KVCache(3000, 2, 32, device=device)
    mirror = Mirror(cache)
    k, v = rand_kv(rng, cache, 2900)
    cache.append(k, v)
    mirror.append(k, v)
    for n_sink in (0, 5):
        for _ in range(3):
            k, v = rand_kv(rng, cache, 1)
            q = rand_q(rng, cache, 4, 1)
            out = cache.forward(q, k, v, window=100, n_sink=n_sink)
            mirror.append(k, v)
            assert_close(out, vkattn.reference.attention(q, mirror.k, mirror.v, window=100, n_sink=n_sink),
                         "float16")


def test_window_changes_the_result(device, rng):
    # the variant really reaches the kernel: a window gives a different answer than none
    cache = vkattn.KVCache(100, 1, 16, dtype="float32", device=device)
    cache.append(*rand_kv(rng, cache, 80))
    q = rand_q(rng, cache, 2, 1)
    full, windowed = cache.attend(q), cache.attend(q, window=10)
    assert np.abs(full - windowed).max() > 1e-3


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("s", [1, 6])
def test_split_keys_and_merge_equals_whole(device, rng, monkeypatch, kernel, s):
    # attend to two disjoint key sets (masks), merge with lse: equals attending to all keys
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    cache = vkattn.KVCache(400, 2, 40, dtype="float32", device=device)
    cache.append(*rand_kv(rng, cache, 333))
    q = rand_q(rng, cache, 2, s)
    whole, whole_lse = cache.attend(q, causal=False, return_lse=True)
    part = rng.random(333) < 0.4
    mask_a = np.where(part, 0.0, -np.inf).astype(np.float32)[None].repeat(s, 0)
    mask_b = np.where(part, -np.inf, 0.0).astype(np.float32)[None].repeat(s, 0)
    oa, la = cache.attend(q, causal=False, mask=mask_a, return_lse=True)
    ob, lb = cache.attend(q, causal=False, mask=mask_b, return_lse=True)
    merged, merged_lse = vkattn.merge_states(oa, la, ob, lb)
    np.testing.assert_allclose(merged, whole, atol=2e-5, rtol=2e-4)
    np.testing.assert_allclose(merged_lse, whole_lse, **LSE_TOL)


@pytest.mark.parametrize("bad,exc", [
    (dict(window=0), ValueError), (dict(window=2.5), TypeError), (dict(n_sink=-1), ValueError),
    (dict(n_sink=3), ValueError),                      # sinks without a window
    (dict(softcap=0.0), ValueError), (dict(softcap=float("nan")), ValueError), (dict(softcap=1e-31), ValueError),
    (dict(softcap=float("inf")), ValueError), (dict(softcap="1"), TypeError),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError), (dict(alibi_slopes=[1.0] * 4), TypeError),
    (dict(alibi_slopes=np.array([1, 2, 3, 4])), TypeError),
    (dict(alibi_slopes=np.array([1, 2, np.nan, 4], np.float32)), ValueError),
    (dict(mask=np.zeros((2, 10), np.float32)), ValueError), (dict(mask=np.zeros((3, 11), np.float32)), ValueError),
    (dict(mask=np.full((3, 10), np.inf, np.float32)), ValueError), (dict(mask=np.zeros((3, 10), int)), TypeError),
    (dict(return_lse=1), TypeError),
])
def test_bad_variant_arguments_change_nothing(device, rng, bad, exc):
    from conftest import assert_unchanged, snapshot
    cache = vkattn.KVCache(20, 2, 8, device=device)
    cache.append(*rand_kv(rng, cache, 7))
    snap = snapshot(cache)
    k, v = rand_kv(rng, cache, 3)
    with pytest.raises(exc):
        cache.forward(rand_q(rng, cache, 2, 3), k, v, **bad)
    assert_unchanged(cache, snap)


def test_checked_variants_are_kept_and_bad_ones_raise_every_time():
    """check_variant keeps the Variant of a window / sinks / softcap of plain types (a model's
    layers pass the same one call after call): the same object again, equal to the checked one;
    another type, ALiBi, or a bad value takes the whole check, and a bad value raises each time."""
    from vkattn._attn import _PLAIN, Variant, check_variant
    assert check_variant(4) is _PLAIN
    a = check_variant(4, window=8, n_sink=2, softcap=30.0)
    assert a == Variant(8, 2, 30.0) and check_variant(2, window=8, n_sink=2, softcap=30.0) is a
    assert check_variant(4, window=8) is check_variant(4, window=8) != a
    assert check_variant(4, softcap=30.0).softcap == 30.0 and check_variant(4, softcap=30.0).window is None
    assert check_variant(4, window=np.int64(8)) == Variant(8) and check_variant(4, softcap=30) == Variant(softcap=30.0)
    for _ in range(2):
        for bad, exc in ((dict(window=0), ValueError), (dict(window=2.5), TypeError), (dict(n_sink=3), ValueError),
                         (dict(window=4, n_sink=-1), ValueError), (dict(softcap=float("nan")), ValueError),
                         (dict(softcap=0.0), ValueError), (dict(window=True), TypeError)):
            with pytest.raises(exc):
                check_variant(4, **bad)
    slopes = np.linspace(0.1, 1, 4).astype(np.float32)
    b = check_variant(4, window=8, alibi_slopes=slopes)
    assert b is not check_variant(4, window=8, alibi_slopes=slopes) and b.key() == Variant(8, 0, None, slopes).key()
    for w in range(1, 200):                     # bounded: kept anew past 64
        assert check_variant(4, window=w).window == w


def test_verify_mode_covers_variants(device, rng, monkeypatch):
    """verify=True checks a call with every score variant against the reference with the same
    variants: the result passes (a check without them would fail it), and a tolerance nothing
    meets makes the same call fail (a check skipped for variants would not)."""
    cache = vkattn.KVCache(64, 1, 8, device=device, verify=True)
    cache.append(*rand_kv(rng, cache, 30))
    q = rand_q(rng, cache, 2, 4)
    kw = dict(window=5, n_sink=2, softcap=3.0, alibi_slopes=np.array([0.1, 0.2], np.float32),
              mask=rng.standard_normal((4, 30)).astype(np.float32))
    out = cache.attend(q, **kw)
    assert_close(out, vkattn.reference.attention(q, *cache.read(), **kw, causal=True), "float16")
    monkeypatch.setitem(vkattn.reference.TOLERANCE, "float16", (-1.0, 0.0))   # any result fails now
    with pytest.raises(vkattn.VerificationError, match="max abs error"):
        cache.attend(q, **kw)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("s", [1, 6])
def test_softcap_with_huge_scores_is_finite(device, rng, monkeypatch, kernel, s):
    # |score / softcap| in the hundreds to thousands: a tanh built as (e^2x - 1) / (e^2x + 1)
    # overflows to inf / inf = NaN there; softcap_score (attn_common.glsl) stays finite
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    cache = vkattn.KVCache(200, 2, 64, dtype="float32", device=device)
    mirror = Mirror(cache)
    k, v = rand_kv(rng, cache, 150)
    k *= 40.0
    cache.append(k, v)
    mirror.append(k, v)
    q = rand_q(rng, cache, 2, s) * 40.0
    for softcap in (0.5, 3.0):
        out, lse = cache.attend(q, softcap=softcap, return_lse=True)
        ref, ref_lse = vkattn.reference.attention(q, mirror.k, mirror.v, softcap=softcap, return_lse=True)
        scores = np.abs(np.einsum("hd,hjd->hj", q[:, -1], np.repeat(mirror.k, 2, axis=0))) / 8.0 / softcap
        assert np.median(scores) > 100 and scores.max() > 1000
        assert np.isfinite(out).all() and np.isfinite(lse).all()
        assert_close(out, ref, "float32")
        np.testing.assert_allclose(lse, ref_lse, **LSE_TOL)


@pytest.mark.parametrize("kernel", KERNELS)
def test_softcap_up_to_its_largest_equals_the_reference(device, rng, monkeypatch, kernel):
    """Softcaps from 1e2 to the largest accepted (1e30), where |score / softcap| is small: tanh's
    1 - e^-2x cancelled (float32 rounds e to 1 below |x| of 2^-25: every score 0, uniform weights
    at softcap 1e10; 2.7e-5 off at 1e3), the series there keeps the float32 tolerance; at the
    largest, the plain attention's result."""
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    cache = vkattn.KVCache(64, 2, 32, dtype="float32", device=device)
    k, v = rand_kv(rng, cache, 41)
    cache.append(k, v)
    q = rand_q(rng, cache, 2, 3) * 3.0
    for softcap in (1e2, 1e3, 1e4, 1e7, 1e10, 1e30):
        out, lse = cache.attend(q, softcap=softcap, return_lse=True)
        ref, ref_lse = vkattn.reference.attention(q, k, v, softcap=softcap, return_lse=True)
        assert_close(out, ref, "float32")
        np.testing.assert_allclose(lse, ref_lse, **LSE_TOL)
    assert_close(out, vkattn.reference.attention(q, k, v), "float32")


@pytest.mark.parametrize("paged", [False, True])
def test_rules_past_32_bits_and_huge_scales_masks_and_slopes(device, rng, paged):
    """A window or sink count of 2**32 and more means what 2**31 - 1 means (the kernels hold
    32-bit words: 2**32 + 1 acted as a window of 1); a scale whose scale * log2(e) is no float32,
    a numpy mask entry above 2**127 (NaN rows on the device) and an ALiBi slope past 2**32 are
    refused with nothing written; mask entries below -2**127 -- a mask from float32's lowest
    value -- count as -inf, in the reference and in the kernels alike (a row whose only key had
    such an entry gave zeros there and v[0] in the reference)."""
    from conftest import assert_unchanged, snapshot
    from vkattn.checks import SCALE_MAX
    hkv, d, hq = 2, 16, 4
    if paged:
        cache = vkattn.PagedKVCache(8, 8, hkv, d, dtype="float32", device=device)
        sid = cache.add_sequence()
        cache.append([sid], *rand_kv(rng, cache, 11), n_new=[11])
        call = lambda q, k, v, **kw: cache.forward([sid], q, k, v, **kw)
        read = lambda: cache.read(sid)
        snap = lambda: [x.copy() for x in cache.read(sid)] + [cache.length(sid)]
        same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(a, b))
    else:
        cache = vkattn.KVCache(24, hkv, d, dtype="float32", device=device)
        cache.append(*rand_kv(rng, cache, 11))
        call, read = cache.forward, cache.read
        snap = lambda: snapshot(cache)
        same = None
    for window, n_sink in ((2 ** 32 + 1, 0), (2 ** 32, 0), (2 ** 40, 2 ** 32 + 1), (3, 2 ** 32 + 1)):
        q, (k, v) = rand_q(rng, cache, 2, 1), rand_kv(rng, cache, 1)
        out = call(q, k, v, window=window, n_sink=n_sink)
        assert_close(out, vkattn.reference.attention(q, *read(), window=window, n_sink=n_sink), "float32")
    assert_close(out, vkattn.reference.attention(q, *read()), "float32")     # every key a sink
    n = read()[0].shape[1] + 1
    bad = [(dict(scale=SCALE_MAX * 1.001), "scale: expected at most"), (dict(scale=1e300), "scale: expected at most"),
           (dict(alibi_slopes=np.array([1, 1, 2.0 ** 33, 1], np.float32)), "alibi_slopes: expected"),
           (dict(mask=np.full((1, n), 2.5e38, np.float32)), "at most 2"),
           (dict(mask=np.where(np.arange(n) % 2, np.float32(-np.inf), np.float32(3e38))[None]), "at most 2")]
    for kw, msg in bad:
        before = snap()
        if paged and "mask" in kw:
            kw = dict(mask=[kw["mask"]])
        with pytest.raises(ValueError, match=msg):
            call(rand_q(rng, cache, 2, 1), *rand_kv(rng, cache, 1), **kw)
        if same is None:
            assert_unchanged(cache, before)
        else:
            assert same(before, snap())
    big = np.float32(np.finfo(np.float32).max)
    for low in (-big, np.float32(-2.5e38), np.float32(-2.0 ** 127 * 1.01)):    # every key masked but the new one
        q, (k, v) = rand_q(rng, cache, 2, 1), rand_kv(rng, cache, 1)
        m = np.zeros((1, n), np.float32)
        m[0, :-1] = -np.inf
        m[0, -1] = low                                 # the only visible key: masked too
        out = call(q, k, v, mask=[m] if paged else m)
        ref = vkattn.reference.attention(q, *read(), mask=m)
        assert not ref.any() and not out.any()        # a row that sees no key gives zeros
        n += 1
    m = np.zeros((1, n), np.float32)                   # just above the limit: a key like any other
    m[0, 1:] = -np.inf
    m[0, 0] = np.float32(-2.0 ** 127)
    q, (k, v) = rand_q(rng, cache, 2, 1), rand_kv(rng, cache, 1)
    out = call(q, k, v, mask=[m] if paged else m)
    assert_close(out, np.repeat(read()[1][:, :1], 2, axis=0), "float32")     # v of key 0, each head
    cache.close()
