"""KVCache.forward's and PagedKVCache.forward's fast paths (the common call: numpy float32 in,
causal, no variant, a fused append): bit for bit the general path's result, the same errors (they
hand anything unusual to the general path, whose checks raise), the aux words patched
(KVCache) or written without SeqCall records (PagedKVCache, AttnPlan.fill_batch) rather than
rebuilt."""
import numpy as np
import pytest

import vkattn
from vkattn import _attn


def _call(rng, hq, hkv, s, n, d):
    return (rng.standard_normal((hq, s, d)).astype(np.float32), rng.standard_normal((hkv, n, d)).astype(np.float32),
            rng.standard_normal((hkv, n, d)).astype(np.float32))


def _strided(x):
    """x's values as a view that is not C-contiguous (rows of another array's transpose)."""
    y = np.ascontiguousarray(np.swapaxes(x, 0, 1))
    view = np.swapaxes(y, 0, 1)
    assert not view.flags.c_contiguous and np.array_equal(view, x)
    return view


ROPES = {"none": None, "neox": vkattn.RoPE(base=500.0), "gptj partial": vkattn.RoPE(base=10000.0, rotary_dim=32,
                                                                                    style="gptj")}


WINDOWED = dict(window=6, n_sink=2, softcap=15.0)


@pytest.mark.parametrize("dtype,rope,variant", [(d, "none", {}) for d in ("float32", "float16", "int8", "bfloat16")]
                         + [("float16", "neox", {}), ("int8", "gptj partial", {}), ("q4", "neox", {}),
                            ("float16", "neox", WINDOWED), ("float32", "none", dict(window=5)),
                            ("float32", "none", dict(softcap=3.0))])
def test_fast_path_equals_the_general_path(device, rng, dtype, rope, variant, monkeypatch):
    """Also with the cache's RoPE rotating K (the fast path writes the rotary rows of the new
    positions, shared between caches of the same RoPE and position), and with a sliding window,
    sinks and a softcap."""
    fast, general = (vkattn.KVCache(96, 2, 40, dtype=dtype, device=device, rope=ROPES[rope]) for _ in range(2))
    general._fast_call = lambda *a, **kw: None          # the twin always takes the general path
    fills = []
    real = _attn.AttnPlan.fill
    monkeypatch.setattr(_attn.AttnPlan, "fill", lambda self, *a, **kw: fills.append(1) or real(self, *a, **kw))
    shapes = [(6, 6), (1, 1), (1, 1), (1, 1), (3, 5), (1, 1), (2, 2), (1, 1)]
    for s, n in shapes:
        q, k, v = _call(rng, 4, 2, s, n, 40)
        scale = 0.3 if s == 2 else None
        lse = s == 3                                            # lse asked for once: on the fast path too
        if s == 2:                                              # strided views (transformers' are)
            q, k = _strided(q), _strided(k)
        got = fast.forward(q, k, v, scale=scale, return_lse=lse, **variant)
        want = general.forward(q, k, v, scale=scale, return_lse=lse, **variant)
        if lse:
            assert np.array_equal(got[1], want[1]) and got[1].shape == (4, s), (s, n)
            got, want = got[0], want[0]
        assert got.dtype == np.float32 and np.array_equal(got, want), (s, n)
    assert fast.length == general.length == sum(n for _, n in shapes)
    for a, b in zip(fast.read(), general.read()):
        assert np.array_equal(a, b)
    # the general path filled its aux every call; the fast one only when the counts changed
    assert len(fills) < 2 * len(shapes) - 2


def test_fast_path_keeps_every_check(device, rng):
    cache = vkattn.KVCache(8, 1, 16, dtype="float16", device=device)
    q, k, v = _call(rng, 2, 1, 1, 1, 16)
    for bad, match in ((np.full_like(k, np.nan), "NaN or Inf"), (np.full_like(k, 7e4), "float16 range")):
        with pytest.raises(ValueError, match=match):
            cache.forward(q, bad, v)
        with pytest.raises(ValueError, match=match):
            cache.forward(q, k, bad)
    with pytest.raises(ValueError, match="NaN or Inf"):
        cache.forward(np.full_like(q, np.inf), k, v)
    with pytest.raises(ValueError, match="scale"):
        cache.forward(q, k, v, scale=-1.0)
    with pytest.raises(ValueError, match="n_sink"):
        cache.forward(q, k, v, n_sink=1)
    with pytest.raises(TypeError, match="window"):
        cache.forward(q, k, v, window=2.5)
    with pytest.raises(ValueError, match="softcap"):
        cache.forward(q, k, v, softcap=float("nan"))
    with pytest.raises(ValueError, match="query rows"):
        cache.forward(*_call(rng, 2, 1, 3, 1, 16))
    with pytest.raises(ValueError, match="q: expected shape"):
        cache.forward(np.zeros((0, 1, 16), np.float32), k, v)      # no query head
    assert cache.length == 0
    for _ in range(8):
        cache.forward(q, k, v)
    with pytest.raises(vkattn.CacheFullError):
        cache.forward(q, k, v)
    assert cache.length == 8
    big = vkattn.KVCache(4, 1, 16, dtype="float32", device=device)
    huge = np.full_like(k, 1e25)                    # finite: its squares overflow, the exact check passes
    out = big.forward(q, huge, v)
    assert np.isfinite(out).all() and big.length == 1


# the calls the fast paths took from the general one in session 35 (mask: its dims; alibi: slopes)
MASKED = [("float32", "none", dict(mask=2)), ("float16", "neox", dict(mask=3)), ("int8", "none", dict(alibi=True)),
          ("float16", "gptj partial", dict(rope_q=True, alibi=True)), ("bfloat16", "none", dict(causal=False, mask=2)),
          ("float16", "neox", dict(causal=False, window=3, n_sink=1)),
          ("q4", "none", dict(mask=2, alibi=True, softcap=5.0))]


def _mask(rng, heads, s, total, dtype=np.float32):
    """An additive mask of finite values and -inf (every row keeps its last key)."""
    m = rng.standard_normal((heads, s, total) if heads else (s, total)).astype(dtype)
    m[..., :-1][rng.random(m[..., :-1].shape) < 0.3] = -np.inf
    return m


@pytest.mark.parametrize("dtype,rope,variant", MASKED)
def test_fast_path_takes_masks_alibi_rope_q_causal_and_attend(device, rng, dtype, rope, variant, monkeypatch):
    """forward() and attend() with a numpy mask (2-D or per head, float64 ones converted), ALiBi
    slopes, rope_q, causal=False: the fast path -- the aux block filled whole only when the
    counts, flags or slopes change, the length's words and the mask's written otherwise -- bit
    for bit the general path's results and stored rows, through decode steps whose masks grow,
    chunks and a FUSED_APPEND_MAX_ROWS-row prefill."""
    from vkattn.tuning import FUSED_APPEND_MAX_ROWS
    hq = 4
    fast, general = (vkattn.KVCache(96, 2, 40, dtype=dtype, device=device, rope=ROPES[rope]) for _ in range(2))
    general._fast_call = lambda *a, **kw: None              # the twin always takes the general path
    fills, calls = [], []
    real, real_fast = _attn.AttnPlan.fill, vkattn.KVCache._fast_call
    monkeypatch.setattr(_attn.AttnPlan, "fill", lambda self, *a, **kw: fills.append(self.c) or real(self, *a, **kw))
    monkeypatch.setattr(vkattn.KVCache, "_fast_call",
                        lambda self, *a: calls.append(real_fast(self, *a)) or calls[-1])
    slopes = np.array([0.5, 0.25, 0.125, 0.0625]) if variant.get("alibi") else None     # float64: converted
    mask_dims = variant.get("mask")
    kw = {k: x for k, x in variant.items() if k not in ("mask", "alibi")}
    # (new rows, query rows): 0 new rows is an attend of the last positions
    steps = [(5, 5), (1, 1), (1, 1), (1, 1), (3, 3), (1, 1), (0, 1), (FUSED_APPEND_MAX_ROWS, FUSED_APPEND_MAX_ROWS),
             (1, 1), (0, 2)]
    total = 0
    for step, (n, s) in enumerate(steps):
        q, k, v = _call(rng, hq, 2, s, max(n, 1), 40)
        total += n
        mask = None
        if mask_dims:
            mask = _mask(rng, hq if mask_dims == 3 else 0, s, total, np.float64 if step == 2 else np.float32)
        args = dict(kw, mask=mask, alibi_slopes=slopes)
        calls.clear()
        if step == 2:
            fills.clear()
        if n == 0:
            got, want = fast.attend(q, **args), general.attend(q, **args)
        else:
            got, want = fast.forward(q, k, v, **args), general.forward(q, k, v, **args)
        assert calls and calls[0] is not None, step          # the fast path took it
        assert got.dtype == np.float32 and np.array_equal(got, want), step
        if step == 3:       # the decode steps after the first: the general path filled, the fast one patched
            assert fills.count(general) == 2 and fills.count(fast) == 0, fills
    assert fast.length == general.length == total
    for a, b in zip(fast.read(), general.read()):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_device_array_fast_path_takes_numpy_masks_and_slopes(device, rng, dtype, monkeypatch):
    """forward(q, k, v, out=) and attend(q, out=) on DeviceArrays with a numpy mask per head,
    ALiBi slopes and rope_q: the fast path, bit for bit the general path's numpy results."""
    fast, general = (vkattn.KVCache(64, 2, 32, dtype=dtype, device=device, rope=vkattn.RoPE(base=100.0))
                     for _ in range(2))
    general._fast_call = lambda *a, **kw: None
    calls = []
    real_fast = vkattn.KVCache._fast_call
    monkeypatch.setattr(vkattn.KVCache, "_fast_call", lambda self, *a: calls.append(real_fast(self, *a)) or calls[-1])
    slopes = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    for step, (n, s) in enumerate([(5, 5), (1, 1), (1, 1), (0, 1), (3, 3), (1, 1)]):
        q, k, v = _call(rng, 4, 2, s, max(n, 1), 32)
        kw = dict(mask=_mask(rng, 4, s, fast.length + n), alibi_slopes=slopes, rope_q=True)
        out = vkattn.empty((4, s, 32), device)
        calls.clear()
        if n:
            got = fast.forward(*(vkattn.to_device(x, device) for x in (q, k, v)), out=out, **kw)
            want = general.forward(q, k, v, **kw)
        else:
            got, want = fast.attend(vkattn.to_device(q, device), out=out, **kw), general.attend(q, **kw)
        assert calls and calls[0] is out and got is out, step
        assert np.array_equal(out.numpy(), want), step
    assert fast.length == general.length == 11


def test_fast_path_masks_and_slopes_keep_every_check(device, rng):
    """The checks of a mask and of ALiBi slopes on the fast path's calls raise the general path's
    errors, and nothing changes."""
    cache = vkattn.KVCache(8, 1, 16, dtype="float16", device=device)
    q, k, v = _call(rng, 2, 1, 1, 1, 16)
    cache.forward(q, k, v)
    # (the forward's mask over 2 keys, the attend's over 1, the error)
    for bad, bad1, match in ((np.array([[0.0, np.nan]]), np.array([[np.nan]]), "NaN or \\+inf"),
                             (np.array([[0.0, np.inf]]), np.array([[np.inf]]), "NaN or \\+inf"),
                             (np.array([[0.0, 1e300]]), np.array([[1e300]]), "NaN or \\+inf"),   # +inf in float32
                             (np.zeros((1, 3), np.float32), np.zeros((1, 2), np.float32), "expected shape"),
                             (np.zeros((1, 2), np.int32), np.zeros((1, 1), np.int32), "float array"),
                             (np.zeros((3, 1, 2), np.float32), np.zeros((3, 1, 1), np.float32), "expected shape"),
                             ([[0.0, 0.0]], [[0.0]], "numpy.ndarray")):
        with pytest.raises((ValueError, TypeError), match=match):
            cache.forward(q, k, v, mask=bad)
        with pytest.raises((ValueError, TypeError), match=match):
            cache.attend(q, mask=bad1)
    for bad, match in ((np.array([0.5, np.nan]), "NaN or Inf"), (np.array([0.5]), "shape"),
                       (np.array([1, 2]), "float array"), ([0.5, 0.5], "numpy.ndarray")):
        with pytest.raises((ValueError, TypeError), match=match):
            cache.forward(q, k, v, alibi_slopes=bad)
    with pytest.raises(ValueError, match="rope_q"):
        cache.forward(q, k, v, rope_q=True)
    with pytest.raises(TypeError, match="causal"):
        cache.forward(q, k, v, causal=1)
    assert cache.length == 1


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_device_array_fast_path_equals_the_general_path(device, rng, dtype, monkeypatch):
    """forward(q, k, v, out=) on DeviceArrays takes the fast path (no fill of the whole aux block
    after the first call of a shape) and gives the numpy path's bits; an out of the wrong shape
    still raises the general path's error, with nothing written."""
    fast, numpy_twin = (vkattn.KVCache(64, 2, 32, dtype=dtype, device=device) for _ in range(2))
    fills = []
    real = _attn.AttnPlan.fill
    monkeypatch.setattr(_attn.AttnPlan, "fill", lambda self, *a, **kw: fills.append(1) or real(self, *a, **kw))
    for s, n in [(5, 5), (1, 1), (1, 1), (1, 1), (3, 3), (1, 1)]:
        q, k, v = _call(rng, 6, 2, s, n, 32)
        out = vkattn.empty((6, s, 32), device)
        got = fast.forward(*(vkattn.to_device(x, device) for x in (q, k, v)), out=out)
        assert got is out and np.array_equal(out.numpy(), numpy_twin.forward(q, k, v))
    assert len(fills) <= 2 * 3          # twice per shape at most (numpy twin and device path)
    dq, dk, dv = (vkattn.to_device(x, device) for x in _call(rng, 6, 2, 1, 1, 32))
    with pytest.raises(ValueError, match="out: expected shape"):
        fast.forward(dq, dk, dv, out=vkattn.empty((6, 2, 32), device))
    assert fast.length == numpy_twin.length == 12


def test_fast_path_survives_plan_eviction(device, rng):
    """More call shapes than a cache keeps plans for (the LRU destroys the oldest): the fast
    path's memo of plans drops them too, and every result stays the reference's."""
    cache = vkattn.KVCache(200, 1, 16, dtype="float32", device=device)
    for step in range(3 * (vkattn._base.MAX_PLANS + 2)):
        hq = 1 + step % (vkattn._base.MAX_PLANS + 2)        # a new query-head count: a new plan
        q, k, v = _call(rng, hq, 1, 1, 1, 16)
        got = cache.forward(q, k, v)
        ks, vs = cache.read()
        np.testing.assert_allclose(got, vkattn.reference.attention(q, ks, vs), atol=2e-6, rtol=2e-5)


def _paged_twins(device, dtype, rope, monkeypatch) -> tuple:
    """(fast, general, fills, ids): two PagedKVCaches of 40 blocks of 4 (2 kv heads, d 40), the
    second always on the general path, the same 3 sequences in each; ``fills`` gets an entry
    per AttnPlan.fill (a general-path call)."""
    fast, general = (vkattn.PagedKVCache(40, 4, 2, 40, dtype=dtype, device=device, rope=ROPES[rope])
                     for _ in range(2))
    general._fast_forward = lambda *a, **kw: None          # the twin always takes the general path
    fills = []
    real = _attn.AttnPlan.fill
    monkeypatch.setattr(_attn.AttnPlan, "fill", lambda self, *a, **kw: fills.append(1) or real(self, *a, **kw))
    ids = [[c.add_sequence() for _ in range(3)] for c in (fast, general)]
    assert ids[0] == ids[1]
    return fast, general, fills, ids[0]


def _batch(rng, hq, hkv, counts, d):
    return _call(rng, hq, hkv, sum(counts), sum(counts), d)


@pytest.mark.parametrize("dtype,rope,variant", [("float32", "none", {}), ("float16", "neox", {}),
                                                ("int8", "gptj partial", {}), ("q4", "neox", {}),
                                                ("fp8_e4m3", "none", {}), ("float16", "neox", WINDOWED),
                                                ("float32", "none", dict(window=3))])
def test_paged_fast_path_equals_the_general_path(device, rng, dtype, rope, variant, monkeypatch):
    """Batches of odd lengths in blocks of 4 (new blocks taken mid-batch), chunks of several
    rows and batch decode, sequences in a changing order; with the cache's RoPE the rotary rows of
    every sequence's positions come from one table (fill_batch) instead of one per sequence; a
    sliding window with sinks and a softcap as well."""
    fast, general, fills, ids = _paged_twins(device, dtype, rope, monkeypatch)
    steps = [([0, 1, 2], [5, 3, 7]), ([0, 1, 2], [1, 1, 1]), ([2, 0, 1], [1, 1, 1]), ([1, 2], [2, 1]),
             ([0, 1, 2], [1, 1, 1]), ([2], [1]), ([0, 1, 2], [3, 1, 2]), ([0, 1, 2], [1, 1, 1])]
    calls = 0
    for order, counts in steps:
        seqs = [ids[i] for i in order]
        q, k, v = _batch(rng, 6, 2, counts, 40)
        n_new = None if set(counts) == {1} else counts
        fills.clear()
        if order == [2, 0, 1]:                              # strided views (transformers' are)
            q, v = _strided(q), _strided(v)
        lse = counts == [2, 1]                              # lse asked for once: on the fast path too
        got = fast.forward(seqs, q, k, v, n_new=n_new, return_lse=lse, **variant)
        assert not fills, (order, counts)           # the fast path: no SeqCall fill
        want = general.forward(seqs, q, k, v, n_new=n_new, return_lse=lse, **variant)
        assert fills
        if lse:
            assert np.array_equal(got[1], want[1]) and got[1].shape == (6, 3), (order, counts)
            got, want = got[0], want[0]
        assert got.dtype == np.float32 and np.array_equal(got, want), (order, counts)
        calls += 1
    for sid in ids:
        assert fast.length(sid) == general.length(sid)
        for a, b in zip(fast.read(sid), general.read(sid)):
            assert np.array_equal(a, b)
    if 40 % (4 * fast._ch):
        return          # device arrays' rows must be unpadded for this storage
    # device arrays in and out take it too, with the numpy path's bits
    q, k, v = _batch(rng, 6, 2, [1, 1, 1], 40)
    out = vkattn.empty((6, 3, 40), device)
    fills.clear()
    got = fast.forward(ids, *(vkattn.to_device(x, device) for x in (q, k, v)), out=out, **variant)
    assert got is out and not fills
    assert np.array_equal(out.numpy(), general.forward(ids, q, k, v, **variant))


@pytest.mark.parametrize("dtype,rope,variant", MASKED)
def test_paged_fast_path_takes_masks_alibi_rope_q_and_causal(device, rng, dtype, rope, variant, monkeypatch):
    """PagedKVCache.forward with a list of numpy masks (2-D or per head; a float64 one
    converted), ALiBi slopes, rope_q, causal=False: the fast path (no SeqCall fill), bit for
    bit the general path's results and stored rows, over chunks and batch decode of sequences
    in a changing order, with new blocks taken mid-batch; a model's next layer (the same
    sequences and counts) takes the step's plan unless the call is masked."""
    from vkattn import paged
    hq = 6
    fast, general, fills, ids = _paged_twins(device, dtype, rope, monkeypatch)
    slopes = np.linspace(0.1, 0.6, hq) if variant.get("alibi") else None          # float64: converted
    mask_dims = variant.get("mask")
    kw = {k: x for k, x in variant.items() if k not in ("mask", "alibi")}
    steps = [([0, 1, 2], [5, 3, 7]), ([0, 1, 2], [1, 1, 1]), ([2, 0, 1], [1, 1, 1]), ([1, 2], [2, 1]),
             ([0, 1, 2], [1, 1, 1]), ([0, 1, 2], [3, 1, 2])]
    for step, (order, counts) in enumerate(steps):
        seqs = [ids[i] for i in order]
        q, k, v = _batch(rng, hq, 2, counts, 40)
        masks = None
        if mask_dims:
            masks = [_mask(rng, hq if mask_dims == 3 else 0, n, fast.length(sid) + n,
                           np.float64 if step == 2 and i == 0 else np.float32)
                     for i, (sid, n) in enumerate(zip(seqs, counts))]
        args = dict(kw, mask=masks, alibi_slopes=slopes, n_new=None if set(counts) == {1} else counts)
        fills.clear()
        got = fast.forward(seqs, q, k, v, **args)
        assert not fills, (order, counts)           # the fast path: no SeqCall fill
        want = general.forward(seqs, q, k, v, **args)
        assert got.dtype == np.float32 and np.array_equal(got, want), (order, counts)
    for sid in ids:
        assert fast.length(sid) == general.length(sid)
        for a, b in zip(fast.read(sid), general.read(sid)):
            assert np.array_equal(a, b)
    # a model's next layer: the step's plan where unmasked
    layer = vkattn.PagedKVCache(40, 4, 2, 40, dtype=dtype, device=device, rope=ROPES[rope])
    for sid in ids:
        layer.add_sequence(sid)
    hits = []
    real_for = paged._Step.plan_for
    monkeypatch.setattr(paged._Step, "plan_for", lambda self, *a: hits.append(1) or real_for(self, *a))
    ref = vkattn.PagedKVCache(40, 4, 2, 40, dtype=dtype, device=device, rope=ROPES[rope])
    ref._fast_forward = lambda *a, **kw: None
    for sid in ids:
        ref.add_sequence(sid)
    for c in (fast, layer):
        for sid in ids:
            c.truncate(sid, 0)
    q, k, v = _batch(rng, hq, 2, [2, 2, 2], 40)
    masks = [_mask(rng, hq if mask_dims == 3 else 0, 2, 2) for _ in ids] if mask_dims else None
    args = dict(kw, mask=masks, alibi_slopes=slopes, n_new=[2, 2, 2])
    fast.forward(ids, q, k, v, **args)
    hits.clear()
    got = layer.forward(ids, q, k, v, **args)
    assert bool(hits) == (not mask_dims)
    assert np.array_equal(got, ref.forward(ids, q, k, v, **args))


def test_paged_fast_path_masks_keep_every_check(device, rng):
    """A bad mask list on a batch call raises the general path's error, nothing changed."""
    cache = vkattn.PagedKVCache(6, 4, 1, 16, dtype="float16", device=device)
    a, b = cache.add_sequence(), cache.add_sequence()
    q, k, v = _batch(rng, 2, 1, [1, 1], 16)
    good = np.zeros((1, 1), np.float32)
    for bad, match in (([good, np.array([[np.nan]])], "NaN or \\+inf"), ([good, np.array([[1e300]])], "NaN or \\+inf"),
                       ([good], "expected 2 arrays"), ([good, np.zeros((1, 2), np.float32)], "expected shape"),
                       ([good, np.zeros((2, 1, 1), np.float32)], "2-D"), (good, "list"),
                       ([good, [[0.0]]], "numpy.ndarray")):
        with pytest.raises((ValueError, TypeError), match=match):
            cache.forward([a, b], q, k, v, mask=bad)
    with pytest.raises(ValueError, match="rope_q"):
        cache.forward([a, b], q, k, v, rope_q=True)
    with pytest.raises(ValueError, match="alibi_slopes"):
        cache.forward([a, b], q, k, v, alibi_slopes=np.array([0.5, np.inf]))
    assert cache.lengths() == {a: 0, b: 0}
    cache.forward([a, b], q, k, v, mask=[good, np.zeros((2, 1, 1), np.float32)[0]])
    assert cache.lengths() == {a: 1, b: 1}


@pytest.mark.parametrize("variant", [{}, dict(window=100)])
def test_paged_fast_path_splits_long_sequences_as_the_general_path(device, rng, variant):
    """Sequences long enough for every split-size rule (all keys in one split, MIN_CHUNK keys a
    split, more), with and without a window, 18 of them (more than a handful of records)."""
    fast, general = (vkattn.PagedKVCache(300, 16, 1, 16, dtype="float32", device=device) for _ in range(2))
    general._fast_forward = lambda *a, **kw: None
    lengths = [3, 40, 63, 64, 65, 150, 255, 256, 257, 700, 1000, 9, 129, 300, 17, 513, 80, 1]
    for c in (fast, general):
        ids = [c.add_sequence() for _ in lengths]
    data = np.random.default_rng(3)
    k, v = (data.standard_normal((1, sum(lengths), 16)).astype(np.float32) for _ in range(2))
    for c in (fast, general):
        c.append(ids, k, v, n_new=lengths)
    for step in range(3):
        q, k1, v1 = _batch(rng, 2, 1, [1] * len(ids), 16)
        got = fast.forward(ids, q, k1, v1, **variant)
        assert np.array_equal(got, general.forward(ids, q, k1, v1, **variant)), step


def test_paged_fast_path_keeps_every_check(device, rng):
    """The paged fast path raises the general path's errors and changes nothing on any of them."""
    cache = vkattn.PagedKVCache(3, 4, 1, 16, dtype="float16", device=device)
    a, b = cache.add_sequence(), cache.add_sequence()
    q, k, v = _batch(rng, 2, 1, [1, 1], 16)
    for bad, match in ((np.full_like(k, np.nan), "NaN or Inf"), (np.full_like(k, 7e4), "float16 range")):
        with pytest.raises(ValueError, match=match):
            cache.forward([a, b], q, bad, v)
        with pytest.raises(ValueError, match=match):
            cache.forward([a, b], q, k, bad)
    with pytest.raises(ValueError, match="NaN or Inf"):
        cache.forward([a, b], np.full_like(q, np.inf), k, v)
    with pytest.raises(vkattn.UnknownSequenceError):
        cache.forward([a, 7], q, k, v)
    with pytest.raises(ValueError, match="distinct"):
        cache.forward([a, a], q, k, v)
    with pytest.raises(TypeError, match="int sequence id"):
        cache.forward([a, 1.0], q, k, v)
    with pytest.raises(ValueError, match="n_new"):
        cache.forward([a, b], q, k, v, n_new=[2, 0])
    with pytest.raises(ValueError, match="k: expected shape"):
        cache.forward([a, b], q, k, v, n_new=[2, 1])
    with pytest.raises(ValueError, match="scale"):
        cache.forward([a, b], q, k, v, scale=-1.0)
    with pytest.raises(ValueError, match="n_sink"):
        cache.forward([a, b], q, k, v, n_sink=2)
    with pytest.raises(ValueError, match="window"):
        cache.forward([a, b], q, k, v, window=0)
    with pytest.raises(TypeError, match="softcap"):
        cache.forward([a, b], q, k, v, softcap="big")
    with pytest.raises(ValueError, match="distinct"):      # the ids first, as the general path checks them
        cache.forward([a, a], q, k, v, window=0)
    assert cache.lengths() == {a: 0, b: 0}
    q1, k1, v1 = _batch(rng, 2, 1, [1], 16)
    for _ in range(8):                                  # two blocks for a, and one for b after
        cache.forward([a], q1, k1, v1)
    cache.forward([b], q1, k1, v1)
    for _ in range(3):
        cache.forward([b], q1, k1, v1)
    with pytest.raises(vkattn.CacheFullError):
        cache.forward([a, b], q, k, v)                  # a needs a fourth block
    assert cache.lengths() == {a: 8, b: 4}


def test_paged_fast_path_leaves_shared_prefixes_to_cascade(device, rng, monkeypatch):
    """Sequences that share blocks (a fork) go the general way, where cascade may attend their
    shared prefix once (VKATTN_CASCADE=1: any shared block); the results stay the reference's."""
    from vkattn import cascade
    monkeypatch.setenv("VKATTN_CASCADE", "1")
    cache = vkattn.PagedKVCache(16, 4, 1, 16, dtype="float32", device=device)
    a = cache.add_sequence()
    cache.append([a], *_batch(rng, 2, 1, [9], 16)[1:], n_new=[9])
    b = cache.fork(a)
    c = cache.add_sequence()
    cache.append([c], *_batch(rng, 2, 1, [6], 16)[1:], n_new=[6])
    plans = []
    real = cascade.cascade_plan
    monkeypatch.setattr(cascade, "cascade_plan", lambda *a, **kw: plans.append(1) or real(*a, **kw))
    for batch in ([a, b], [a, c], [c, b, a]):
        q, k, v = _batch(rng, 2, 1, [1] * len(batch), 16)
        plans.clear()
        got = cache.forward(batch, q, k, v)
        assert bool(plans) == (a in batch and b in batch) or not device.is_software
        for i, sid in enumerate(batch):
            ks, vs = cache.read(sid)
            np.testing.assert_allclose(got[:, i:i + 1], vkattn.reference.attention(q[:, i:i + 1], ks, vs),
                                       atol=2e-6, rtol=2e-5)


def test_paged_layers_share_one_step_plan(device, rng, monkeypatch):
    """A model's layers -- PagedKVCaches of one family (device, pool geometry, format, RoPE) called
    with the same sequences and counts in turn -- plan a step once: a layer whose pool agrees with
    the family's last step on the sequences' lengths, block tables and next free blocks takes its
    AppendPlan and aux words (vkattn.paged._Step), bit for bit what planning gives (twins that
    always plan); a layer whose pool differs (another free-block order; a truncated sequence)
    plans for itself, and the layer after it matches that layer's step, not the first one's."""
    from vkattn import paged
    rope = ROPES["neox"]
    make = lambda: vkattn.PagedKVCache(40, 4, 2, 40, dtype="float16", device=device, rope=rope)  # noqa: E731
    layers, twins = [make() for _ in range(5)], [make() for _ in range(5)]
    ids = [3, 5, 8]
    for c in layers + twins:
        if c in (layers[2], twins[2]):              # churn: blocks come back in another order
            for sid in (98, 99):
                c.add_sequence(sid)
                c.append([sid], *_batch(rng, 6, 2, [4], 40)[1:], n_new=[4])
            c.remove_sequence(98)
            c.remove_sequence(99)
        for sid in ids:
            c.add_sequence(sid)
    hits = []
    real = paged._Step.plan_for

    def spy(self, pool, *a):
        plan = real(self, pool, *a)
        hits.extend(i for i, c in enumerate(layers + twins) if plan is not None and c._pool is pool)
        return plan
    monkeypatch.setattr(paged._Step, "plan_for", spy)
    steps = [([3, 5, 8], [5, 3, 7]), ([3, 5, 8], [1, 1, 1]), ([8, 3, 5], [1, 1, 1]), ([5, 8], [2, 1]),
             ([3, 5, 8], [1, 1, 1]), ([3, 5, 8], [3, 1, 2]), ([3, 5, 8], [1, 1, 1])]
    data = [[_batch(rng, 6, 2, counts, 40) for _ in layers] for _, counts in steps]
    # the layers that take the last step's plan: 1 (layer 0's), 4 (layer 3's: 2 and 3 planned for
    # themselves, sequence 3's blocks differ in 2) -- all where sequence 3 sits out and the churned
    # pool agrees on 5 and 8 -- and after layer 4 truncates sequence 5, layer 1 alone
    expect = [[1, 4], [1, 4], [1, 4], [1, 2, 3, 4], [1], [1], [1]]
    got = []
    for s, (seqs, counts) in enumerate(steps):
        n_new = None if set(counts) == {1} else counts
        if s == 4:                                  # layer 4 leaves the others' state
            layers[4].truncate(5, layers[4].length(5) - 1)
        hits.clear()
        got.append([c.forward(seqs, *data[s][i], n_new=n_new) for i, c in enumerate(layers)])
        assert hits == expect[s], (s, hits)
    monkeypatch.setattr(paged._Step, "plan_for", lambda *a: None)     # the twins always plan
    for s, (seqs, counts) in enumerate(steps):
        n_new = None if set(counts) == {1} else counts
        if s == 4:
            twins[4].truncate(5, twins[4].length(5) - 1)
        for i, c in enumerate(twins):
            assert np.array_equal(got[s][i], c.forward(seqs, *data[s][i], n_new=n_new)), (s, i)
    for a, b in zip(layers, twins):
        assert a.lengths() == b.lengths()
        for sid in ids:
            assert a.block_table(sid) == b.block_table(sid)
            for x, y in zip(a.read(sid), b.read(sid)):
                assert np.array_equal(x, y)
    assert layers[2].block_table(3) != layers[0].block_table(3)      # the churned pool's own blocks
    assert layers[1].block_table(3) == layers[0].block_table(3)
    # the family's step keeps no pool alive
    import gc
    import weakref
    pools = [weakref.ref(c._pool) for c in layers + twins]
    for c in layers + twins:
        c.close()
    del layers, twins, a, b, c
    gc.collect()
    assert all(p() is None for p in pools)


def test_paged_fast_path_takes_token_ids(device, rng, monkeypatch):
    """A batch call with token ids (a prefix-caching engine passes them every step) takes the fast
    path: the same outputs, token ids, hashed blocks and prefix matches as the general path; bad
    token ids raise the general path's errors and change nothing; a model's layers passing the
    same ids share the step's plan."""
    from vkattn import paged
    monkeypatch.setattr(paged._Steady, "of", classmethod(lambda cls, *a: None))     # every step planned
    fast, general, layer = (vkattn.PagedKVCache(30, 4, 2, 16, dtype="float16", device=device) for _ in range(3))
    general._fast_forward = lambda *a, **kw: None
    fills = []
    real = _attn.AttnPlan.fill
    monkeypatch.setattr(_attn.AttnPlan, "fill", lambda self, *a, **kw: fills.append(1) or real(self, *a, **kw))
    hits = []
    real_for = paged._Step.plan_for

    def spy(self, pool, *a):
        plan = real_for(self, pool, *a)
        if plan is not None:
            hits.append(pool)
        return plan
    monkeypatch.setattr(paged._Step, "plan_for", spy)
    ids = [0, 1]
    for c in (fast, general, layer):
        for sid in ids:
            c.add_sequence(sid, token_ids=[])
    prompts = [list(range(100, 107)), list(range(200, 203))]
    steps = [([0, 1], [p[:] for p in prompts])] + [([0, 1], [[300 + i], [400 + i]]) for i in range(6)] \
        + [([1], [[500]]), ([1, 0], [[501], None])]
    for seqs, toks in steps:
        counts = [len(t) if t is not None else 1 for t in toks]
        q, k, v = _batch(rng, 4, 2, counts, 16)
        n_new = None if set(counts) == {1} else counts
        fills.clear()
        hits.clear()
        got = fast.forward(seqs, q, k, v, n_new=n_new, token_ids=toks)
        assert not fills, toks
        assert np.array_equal(got, general.forward(seqs, q, k, v, n_new=n_new, token_ids=toks)), toks
        fills.clear()
        layer.forward(seqs, *_batch(rng, 4, 2, counts, 16), n_new=n_new, token_ids=toks)
        assert hits == [layer._pool] and not fills       # the layer took fast's step
    for sid in ids:
        assert fast.token_ids(sid) == general.token_ids(sid) == layer.token_ids(sid), sid
        assert fast.block_table(sid) == general.block_table(sid) == layer.block_table(sid)
    assert fast.token_ids(0) == prompts[0] + [300 + i for i in range(6)]
    assert fast.token_ids(1) == prompts[1] + [400 + i for i in range(6)] + [500, 501]
    assert fast._pool._hash_of == general._pool._hash_of and fast._pool._hash_of
    for c in (fast, general):                           # a new sequence finds sequence 0's full blocks
        assert c.add_sequence(9, token_ids=fast.token_ids(0) + [1]) == 9 and c.length(9) == 12
    # bad token ids: the general path's errors, nothing changed
    q, k, v = _batch(rng, 4, 2, [1, 1], 16)
    before = fast.lengths(), {s: fast.token_ids(s) for s in ids}
    for bad, err, match in (([[1]], ValueError, "2 entries"), ([[1, 2], [3]], ValueError, "expected 1 token ids"),
                            ([[-1], [3]], ValueError, "2\\*\\*63"), ([[True], [3]], TypeError, "integer token ids"),
                            ([[1.0], [3]], TypeError, "integer token ids"), ("ab", TypeError, "token_ids"),
                            ([np.zeros((1, 1), np.int64), [3]], ValueError, "1-D")):
        with pytest.raises(err, match=match):
            fast.forward(ids, q, k, v, token_ids=bad)
        assert (fast.lengths(), {s: fast.token_ids(s) for s in ids}) == before, bad
    np_ids = [np.array([7]), [np.int64(8)]]             # numpy ids: the general check's conversion
    fast.forward(ids, q, k, v, token_ids=np_ids)
    assert fast.token_ids(1)[-1] == 8 and type(fast.token_ids(1)[-1]) is int


def test_paged_decode_loop_replans_where_its_attention_plan_changes(device, rng, monkeypatch):
    """A decode loop takes its last step on (_Step.following) and keeps that step's attention
    plan only while the plan's key would be the same: across the decode key bound (4096 keys,
    inside a block: more splits) and across an aux bucket (block tables past 256 words, blocks of 1) it plans
    anew -- each call's output bit for bit the general path's, every call after the first a
    continuation."""
    from vkattn import paged
    taken = []
    real = paged._Step.following
    monkeypatch.setattr(paged._Step, "following",
                        lambda self, *a: taken.append(real(self, *a)) or taken[-1])
    monkeypatch.setattr(paged._Steady, "of", classmethod(lambda cls, *a: None))     # every step planned
    for blocks, bs, start, steps in ((90, 48, 4093, 6), (300, 1, 200, 10)):     # 4096: inside a block of 48
        fast, general = (vkattn.PagedKVCache(blocks, bs, 2, 16, dtype="float16", device=device) for _ in range(2))
        general._fast_forward = lambda *a, **kw: None
        k, v = rng.standard_normal((2, 2, start, 16), dtype=np.float32)
        for c in (fast, general):
            c.add_sequence()
            c.append([0], k, v, n_new=[start])
        keys, words = set(), set()
        taken.clear()
        for i in range(steps):
            q, k, v = _batch(rng, 4, 2, [1], 16)
            got = fast.forward([0], q, k, v)
            assert np.array_equal(got, general.forward([0], q, k, v)), (bs, i)
            step = fast._next
            keys.add(step.key[7])                   # the decode key bound
            words.add(step.key[6])                  # the aux bucket
        assert len(taken) == steps - 1 and all(taken), (bs, taken)
        assert len(keys if bs == 48 else words) == 2, (bs, keys, words)
        fast.close()
        general.close()


def test_paged_chunked_prefill_then_decode_take_each_step_on(device, rng, monkeypatch):
    """A chunked prefill (chunks of 32, 32, 17 rows) and then decode steps of two sequences: every
    call after the first takes the one before it on whatever its counts, each output bit for bit
    the general path's; a bad count after them is the general path's error, nothing changed, and
    so is a call on a sequence removed since."""
    from vkattn import paged
    taken = []
    real = paged._Step.following
    monkeypatch.setattr(paged._Step, "following", lambda self, *a: taken.append(real(self, *a)) or taken[-1])
    monkeypatch.setattr(paged._Steady, "of", classmethod(lambda cls, *a: None))     # every step planned
    fast, general = (vkattn.PagedKVCache(40, 16, 2, 16, dtype="float16", device=device) for _ in range(2))
    general._fast_forward = lambda *a, **kw: None
    for c in (fast, general):
        c.add_sequence()
        c.add_sequence()
    steps = [[32, 5], [32, 3], (17, 1)] + [None] * 4 + [[1, 2]]
    for counts in steps:
        rows = [1, 1] if counts is None else list(counts)
        q, k, v = _batch(rng, 4, 2, rows, 16)
        got = fast.forward([0, 1], q, k, v, n_new=counts)
        assert np.array_equal(got, general.forward([0, 1], q, k, v, n_new=counts)), counts
    assert len(taken) == len(steps) - 1 and all(taken), [t is not None for t in taken]
    before = fast.lengths()
    q, k, v = _batch(rng, 4, 2, [1, 1], 16)
    for bad, err in (([1, 1.0], TypeError), ([1, 0], ValueError), ([1], ValueError)):
        with pytest.raises(err) as fe:
            fast.forward([0, 1], q, k, v, n_new=bad)
        with pytest.raises(err) as ge:
            general.forward([0, 1], q, k, v, n_new=bad)
        assert str(fe.value) == str(ge.value) and fast.lengths() == before, bad
    for c in (fast, general):                          # a sequence gone since the last call
        c.remove_sequence(1)
    with pytest.raises(vkattn.UnknownSequenceError) as fe:
        fast.forward([0, 1], q, k, v)
    with pytest.raises(vkattn.UnknownSequenceError) as ge:
        general.forward([0, 1], q, k, v)
    assert str(fe.value) == str(ge.value)
    fast.close()
    general.close()


def _aux_as_planned(cache) -> None:
    """The aux words of the step a PagedKVCache's _Steady just ran are those fill_batch computes
    for that step (_batch_words: records, rotary rows), each record's block table where its word
    5 points (the steady step may lay them out with free words between), the tables apart from
    each other, before the counters."""
    m = cache._steady
    attn, n = m.attn, len(m.ids)
    seq_off, _, free = attn._batch_head[1]
    past = [cache.length(s) - 1 for s in m.ids]
    tables = [cache.block_table(s) for s in m.ids]
    want, _, rtab = attn._batch_words(past, [1] * n, tables, attn.cfg.splits, m.variant.window, free, cache.rope)
    aux = attn.aux.view()
    got, want = aux[seq_off:seq_off + want.size].reshape(n, -1), want.reshape(n, -1)
    assert np.array_equal(np.delete(got, 5, axis=1), np.delete(want, 5, axis=1))
    ends = free
    spans = sorted((int(got[i, 5]), len(t), t) for i, t in enumerate(tables))
    for bt, size, t in spans:
        assert bt >= ends and aux[bt:bt + size].tolist() == t, (bt, ends, t)
        ends = bt + size
    assert ends <= attn._counters
    if rtab is not None:
        assert np.array_equal(attn.rope.view()[:rtab.size], rtab)


def test_a_plans_kept_input_views_follow_every_shape(device, rng):
    """AttnPlan's numpy inputs go through the views the last call of the same three shapes kept
    (_dst3): a call whose q keeps its shape but whose k and v bring another row count, or
    another q with the same k and v, writes exactly its own rows (the host copies compared)."""
    hkv, d, hq = 2, 32, 4
    c = vkattn.KVCache(64, hkv, d, dtype="float32", device=device)
    c.append(*(rng.standard_normal((2, hkv, 8, d), dtype=np.float32)))
    c.forward(rng.standard_normal((hq, 4, d), dtype=np.float32), *rng.standard_normal((2, hkv, 4, d), dtype=np.float32))
    attn = next(p for p in c._plans.values() if isinstance(p, _attn.AttnPlan) and p.nk.size >= hkv * 4 * d)
    for s, n in [(1, 1), (1, 3), (1, 3), (2, 3), (1, 1), (4, 4), (1, 3)]:
        q = rng.standard_normal((hq, s, d), dtype=np.float32)
        k, v = rng.standard_normal((2, hkv, n, d), dtype=np.float32)
        assert attn._copy_inputs(q, k, v) == (s, n)
        for buf, x in ((attn.q, q), (attn.nk, k), (attn.nv, v)):
            assert np.array_equal(buf.view()[:x.size], x.reshape(-1)), (s, n)
    c.close()


def test_decode_chunks_are_split_keys_chunks():
    """The steady step's chunk rule (by cases: all keys, MIN_CHUNK, ceil(n / splits)) is
    split_keys' max() form for every span up to well past MIN_CHUNK * splits, the boundaries
    included."""
    for splits in (2, 3, 5, 8, 31, 128):
        spans = list(range(1, _attn.MIN_CHUNK * splits + 3 * splits + 2))
        assert _attn.decode_chunks(spans, splits) == [_attn.split_keys(n, 1, None, splits)[1] for n in spans]


def _twin_sequences(rng, fast, general, lengths: list) -> list:
    """New sequences of the given lengths in both twins, the same random K/V in each; their ids."""
    ids = [fast.add_sequence() for _ in lengths]
    assert ids == [general.add_sequence() for _ in lengths]
    for sid, n in zip(ids, lengths):
        k, v = rng.standard_normal((2, fast.num_kv_heads, n, fast.head_dim), dtype=np.float32)
        for c in (fast, general):
            c.append([sid], k, v, n_new=[n])
    return ids


def _failing_run(monkeypatch):
    """A context in which every recording's run raises (a device lost mid-call)."""
    import contextlib
    from vkattn import _kp

    @contextlib.contextmanager
    def failing():
        real = _kp.Recording.run

        def boom(self, *a, **kw):
            raise RuntimeError("device lost (injected)")
        monkeypatch.setattr(_kp.Recording, "run", boom)
        try:
            yield
        finally:
            monkeypatch.setattr(_kp.Recording, "run", real)
    return failing


@pytest.mark.parametrize("dtype,rope,variant", [("float16", "none", {}), ("q4", "neox", dict(rope_q=True)),
                                                ("int8", "gptj partial", dict(softcap=4.0, causal=False)),
                                                ("float32", "none", dict(alibi=True)),
                                                ("float16", "neox", WINDOWED), ("bfloat16", "none", dict(window=3))])
def test_paged_steady_decode_runs_its_last_step_again(device, rng, dtype, rope, variant, monkeypatch, steady_hits):
    """A batch decode loop of five sequences of staggered lengths in blocks of 4: every step after
    the first runs the last one's attention plan again (vkattn.paged._Steady), the sequences whose
    row starts a block taking the blocks the planned way takes (a word written after a table, or
    the tables laid out again with room after each) -- cached blocks of the prefix
    cache evicted in its order once the unused ones are gone -- and each output (lse too, device
    arrays too) is bit for bit the general path's; lengths, block tables and cached blocks agree,
    and both pools keep their invariants."""
    hits = steady_hits
    from vkattn import paged
    layouts, real_tables = [], paged._Steady._tables     # per step taking blocks: words after tables, or laid out
    monkeypatch.setattr(paged._Steady, "_tables", lambda self, *a: layouts.append(real_tables(self, *a)) or layouts[-1])
    hkv, d, hq = 2, 40, 6
    if variant.pop("alibi", False):
        variant["alibi_slopes"] = np.array([0.5, 0.25, 0.125, 0.0625, 0.03, 0.01], np.float32)
    fast, general = (vkattn.PagedKVCache(31, 4, hkv, d, dtype=dtype, device=device, rope=ROPES[rope])
                     for _ in range(2))
    general._fast_forward = lambda *a, **kw: None
    lengths = [1, 3, 4, 6, 9]
    for c in (fast, general):                       # a prompt of 12 tokens whose 3 blocks stay cached
        tmp = c.add_sequence(token_ids=list(range(12)))
        k, v = rng.standard_normal((2, hkv, 12, d), dtype=np.float32)
        c.forward([tmp], rng.standard_normal((hq, 12, d), dtype=np.float32), k, v, n_new=[12],
                  token_ids=[list(range(12))])
        c.remove_sequence(tmp)
        assert c.cached_blocks == 3
    ids = _twin_sequences(rng, fast, general, lengths)
    steps, failed, failing = 18, False, _failing_run(monkeypatch)
    for step in range(steps):
        q, k, v = _batch(rng, hq, hkv, [1] * 5, d)
        grow = sum(fast.length(s) % 4 == 0 for s in ids)
        if step and not failed and grow > len(fast._pool._free):
            # the step takes a cached block and fails on the device: the block is evicted before
            # the device writes it (no stale hash left), as the planned way does, nothing else changes
            failed, before = True, fast.lengths()
            for c in (fast, general):
                with failing(), pytest.raises(RuntimeError, match="injected"):
                    c.forward(ids, q, k, v, **variant)
            assert fast.lengths() == before == general.lengths()
            assert fast.cached_blocks == general.cached_blocks < 3
            assert fast.match_prefix(list(range(13))) == general.match_prefix(list(range(13)))
        lse = step % 5 == 3
        got = fast.forward(ids, q, k, v, return_lse=lse, **variant)
        want = general.forward(ids, q, k, v, return_lse=lse, **variant)
        if lse:
            assert np.array_equal(got[1], want[1]), step
            got, want = got[0], want[0]
        assert np.array_equal(got, want), step
        assert fast.lengths() == general.lengths() and fast.cached_blocks == general.cached_blocks, step
        assert [fast.block_table(s) for s in ids] == [general.block_table(s) for s in ids], step
        if step:
            _aux_as_planned(fast)
    assert failed and len(hits) == steps - 1 and sum(hits) >= 15, (failed, hits)
    kinds = ["word" if x[1] is not None else "layout" for x in layouts]
    assert kinds.count("word") >= 5 and "layout" in kinds, kinds     # most blocks need one word, some a new layout
    assert fast.cached_blocks < 3                   # the prefix cache's blocks were taken too
    for c in (fast, general):
        c._pool.check()
    if d % (4 * fast._ch) == 0:                     # device arrays in and out take it too
        q, k, v = _batch(rng, hq, hkv, [1] * 5, d)
        out = vkattn.empty((hq, 5, d), device)
        got = fast.forward(ids, *(vkattn.to_device(x, device) for x in (q, k, v)), out=out, **variant)
        assert got is out and len(hits) == steps
        assert np.array_equal(out.numpy(), general.forward(ids, q, k, v, **variant))
    fast.close()
    general.close()


def test_paged_steady_decode_replans_after_any_change(device, rng, monkeypatch, steady_hits):
    """A steady decode step (vkattn.paged._Steady) runs where its sequences are as the aux holds
    them: after a truncate (a token, or a whole block), a fork, a sequence added or removed, token
    ids set, a block cached, the prefix cache evicted, the next call takes on (lengths read from
    the pool, its aux words the planned way's); where a sequence's block table is no longer a
    prefix of the one the aux holds (a block dropped, another sequence taking it, the sequence
    given another), after a step that raised once it had written the aux, another scale, head
    count or variant, token ids other than one plain int each, its plan built again by plan(),
    its plan dropped from the LRU, its plan's aux filled for another batch between a planned call
    and the next (a graph's prepare) or filled again with the very words the memo holds (its fill
    count), or a fork sharing a first block with cascade on, the next call plans (and the one
    after it is steady again); new tokens' ids are learnt as the planned way learns them; every
    output is bit for bit the general path's, and a batch that no longer fits is the general
    path's CacheFullError with nothing changed."""
    hits = steady_hits
    monkeypatch.setenv("VKATTN_CASCADE", "0")      # a forked prefix attended per sequence (below: by cascade)
    hkv, d = 2, 16
    fast, general = (vkattn.PagedKVCache(72, 4, hkv, d, dtype="float16", device=device) for _ in range(2))
    general._fast_forward = lambda *a, **kw: None
    caches = (fast, general)
    ids = [fast.add_sequence() for _ in range(3)]
    assert ids == [general.add_sequence() for _ in range(3)]
    for sid, n in zip(ids, (2, 5, 7)):
        k, v = rng.standard_normal((2, hkv, n, d), dtype=np.float32)
        for c in caches:
            c.append([sid], k, v, n_new=[n], token_ids=[list(range(n))])

    def call(hq=4, expect=None, **kw):
        q, k, v = _batch(rng, hq, hkv, [1] * 3, d)
        before = len(hits)
        got = fast.forward(ids, q, k, v, **kw)
        assert np.array_equal(got, general.forward(ids, q, k, v, **kw)), kw
        assert fast.lengths() == general.lengths()
        if expect is not None:
            assert len(hits) - before == expect, (kw, expect)
        if len(hits) > before:
            _aux_as_planned(fast)

    call()
    call(expect=1)
    block = rng.standard_normal((2, hkv, 4, d), dtype=np.float32)

    def cache_a_block(c):                           # a full block with token ids, left in the prefix cache
        s = c.add_sequence()
        c.append([s], *block, n_new=[4], token_ids=[[100, 101, 102, 103]])
        c.remove_sequence(s)
        assert c.cached_blocks == 1
    changes = [lambda c: c.truncate(ids[0], c.length(ids[0]) - 1), lambda c: c.fork(ids[1]),
               lambda c: c.add_sequence(), lambda c: c.remove_sequence(max(c.sequences)),
               lambda c: c.set_token_ids(ids[2], c.token_ids(ids[2]) + [0] * (c.length(ids[2]) - len(c.token_ids(ids[2])))),
               cache_a_block, lambda c: c.evict_cached(),
               lambda c: c.truncate(ids[2], 4 * ((c.length(ids[2]) - 1) // 4))]     # its last block dropped
    for change in changes:
        for c in caches:
            change(c)
        call(expect=1)
        call(expect=1)
    row = rng.standard_normal((2, hkv, 1, d), dtype=np.float32)

    def other_block(c):                             # ids[1]'s last block dropped, taken by another
        c.truncate(ids[1], 4 * ((c.length(ids[1]) - 1) // 4))      # sequence, ids[1] given the next
        s = c.add_sequence()
        c.append([s], *row, n_new=[1])
        c.append([ids[1]], *row, n_new=[1])
        c.remove_sequence(s)
    for c in caches:
        other_block(c)
    call(expect=0)
    call(expect=1)
    real_fill = _attn.AttnPlan.fill_decode_step

    def half_way(self, *a, **kw):                   # a step that raises once its aux words are written
        real_fill(self, *a, **kw)
        raise RuntimeError("fault (injected)")
    monkeypatch.setattr(_attn.AttnPlan, "fill_decode_step", half_way)
    before = fast.lengths()
    with pytest.raises(RuntimeError, match="injected"):
        fast.forward(ids, *_batch(rng, 4, hkv, [1] * 3, d))
    monkeypatch.setattr(_attn.AttnPlan, "fill_decode_step", real_fill)
    assert fast.lengths() == before
    call(expect=0)                                  # the memo no longer trusts that aux: planned
    call(expect=1)
    for ids_ in ([[1], [2], [3]], ([4], [5], [6]), [[7], [8], [9]]):    # each new token's id: learnt, as planned
        call(expect=1, token_ids=ids_)
        assert [fast.token_ids(s) for s in ids] == [general.token_ids(s) for s in ids]
        assert fast._pool._index == general._pool._index
    call(expect=0, token_ids=[[1], None, [3]])      # anything but a list of one plain int each: planned
    call(expect=1)
    call(expect=0, token_ids=[[1], [np.int64(2)], [3]])
    call(expect=1)
    for kw in (dict(scale=0.3), dict(hq=6), dict(softcap=2.0), dict(alibi_slopes=np.full(4, 0.5, np.float32)),
               dict(alibi_slopes=np.full(4, 0.25, np.float32)), dict(causal=False), dict(window=3)):
        call(expect=0, **kw)
        call(expect=1, **kw)
        call(expect=0)
        call(expect=1)
    fast.plan(ids, 4)                               # the same plan built or fetched again: it filled its aux
    call()
    call(expect=1)
    for hq in (6, 8, 10, 12, 14, 16, 18, 20, 22):   # as many other plans as the LRU holds: ours dropped
        fast.plan(ids, hq)
    call(expect=0)
    call(expect=1)
    call(expect=0, hq=6)                            # a planned call, then its plan's aux filled for another
    q, k, v = _batch(rng, 6, hkv, [1] * 3, d)       # batch before the next call (as a graph's prepare does)
    fast._plans[fast._steady_next[2]].fill_batch(q, k, v, [1, 2, 3], [1, 1, 1], [[7], [8], [9]], 0.25)
    call(expect=0, hq=6)
    last = fast._steady_next                        # a planned call's memo; steady steps taking blocks after it,
    for _ in range(4):                              # then the aux filled with the very words that call left
        call(expect=1, hq=6)                        # (a graph's prepare copies a family's words): its header
    plan, attn = last[1], last[3]                   # and words the memo's by identity, the fill count not
    attn.fill_batch(q, k, v, plan.past, plan.n_new, plan.tables, last[5], variant=last[4], words=last[8])
    assert attn._batch_head is last[7] and attn.batch_words is last[8]
    call(expect=0, hq=6)
    call(expect=1, hq=6)
    for c in caches:                                # (the fork above gone: no block shared)
        for s in set(c.sequences) - set(ids):
            c.remove_sequence(s)
    monkeypatch.setenv("VKATTN_CASCADE", "1")       # cascade allowed, no block shared: steady; then a fork
    call()                                          # shares the first block of a sequence whose tables it
    call(expect=1)                                  # leaves as they are (a whole number of blocks): the
    while fast.length(ids[1]) % 4:                  # next call is the cascade's
        call()
    forks = [c.fork(ids[1]) for c in caches]
    call(expect=0)
    for c, f in zip(caches, forks):
        c.remove_sequence(f)
    monkeypatch.setenv("VKATTN_CASCADE", "0")
    for c in caches:                                # a shared first block: with cascade allowed
        c.fork(ids[0])
    call(expect=0)
    call(expect=1)
    monkeypatch.setenv("VKATTN_CASCADE", "1")       # ... the next step is the cascade's
    call(expect=0)
    call(expect=0)
    monkeypatch.setenv("VKATTN_CASCADE", "0")
    for c in caches:
        c.remove_sequence(max(c.sequences))
    call(expect=0)
    call(expect=1)
    while len([s for s in ids if fast.length(s) % 4 == 0]) <= fast.free_blocks:
        call()                                      # the pool filled: the last steps take every block
    assert fast.free_blocks < 3
    before = fast.lengths()
    q, k, v = _batch(rng, 4, hkv, [1] * 3, d)
    with pytest.raises(vkattn.CacheFullError) as fe:
        fast.forward(ids, q, k, v)
    with pytest.raises(vkattn.CacheFullError) as ge:
        general.forward(ids, q, k, v)
    assert str(fe.value) == str(ge.value) and fast.lengths() == before
    fast.close()
    general.close()


def test_paged_steady_decode_across_the_key_bound_and_after_a_failed_call(device, rng, monkeypatch, steady_hits):
    """One sequence of 4090 keys and two shorter ones (5 keys: one chunk of all; 300: chunks of
    MIN_CHUNK, the shortest a split takes; the tile kernel, 8 splits):
    the steady steps (vkattn.paged._Steady) stop where the longest passes the plan's decode key
    bound (4096: more splits, planned again) and go on after it; a call of three other sequences
    on the same attention plan that fails on the device (nothing committed, the pool unchanged),
    after a planned step or a steady one, leaves that plan's aux theirs, so the next step plans
    (before the bound: the same plan key). Each output bit for bit the general
    path's, each steady step's aux words the planned way's."""
    hits, failing = steady_hits, _failing_run(monkeypatch)
    monkeypatch.setenv("VKATTN_KERNEL", "tile")     # split keys (the lane kernel's one split a CPU core)
    monkeypatch.setenv("VKATTN_DECODE_SPLITS", "8")
    hkv, d = 2, 16
    fast, general = (vkattn.PagedKVCache(100, 48, hkv, d, dtype="float16", device=device) for _ in range(2))
    general._fast_forward = lambda *a, **kw: None
    lengths = [4090, 5, 300, 7, 8, 9]
    ids = _twin_sequences(rng, fast, general, lengths)
    batch, bounds = ids[:3], []
    for step in range(12):
        q, k, v = _batch(rng, 4, hkv, [1] * 3, d)
        if step in (1, 4):                          # three others on the same plan, failing on the device
            key = fast._steady.key if step == 4 else fast._steady_next[2]     # after a steady step / a planned one
            with failing(), pytest.raises(RuntimeError, match="injected"):
                fast.forward(ids[3:], q, k, v)
            assert fast._plans[key]._batch_head is not None and fast.lengths() == general.lengths()
        before = len(hits)
        got = fast.forward(batch, q, k, v)
        assert np.array_equal(got, general.forward(batch, q, k, v)), step
        last = fast._steady_next                    # a planned call's, for the next call; else the step's own
        bounds.append((fast._steady.key if last is None else last[2])[7])     # the plan's decode key bound
        if len(hits) > before:
            _aux_as_planned(fast)
        else:
            assert step in (0, 1, 4, 6), step       # the first, after the failed calls, past 4096 keys
    assert len(hits) == 8 and bounds[5] == 4096 and bounds[6] > 4096, (hits, bounds)
    assert fast._steady.attn.cfg.splits > 1
    for c in (fast, general):                       # truncated below 4096 keys: the bound of the planned
        c.truncate(batch[0], 4090)                  # way's key (4096) is not the steady plan's: planned
    for expect in (0, 1):
        q, k, v = _batch(rng, 4, hkv, [1] * 3, d)
        before = len(hits)
        assert np.array_equal(fast.forward(batch, q, k, v), general.forward(batch, q, k, v))
        assert len(hits) - before == expect
    fast.close()
    general.close()


def test_paged_step_after_a_truncate_takes_the_planned_key_bound(device, rng, monkeypatch):
    """A decode step whose sequence was truncated within its blocks (the tables unchanged) takes
    the attention plan the planned way would -- the key bound of its lengths now -- also where
    the last step's bound was the pool's whole size (6000 slots, 4500 keys): _Step.following
    reused that key unexamined (a plan sized for 6000 keys where 4011 take one for 4096: on a GPU
    another split count, other bits). Bit for bit the general path's result, and its bound."""
    bound = lambda c: [k for k in c._plans if k[0] == "attn"][-1][7]    # the attention plan used last  # noqa: E731
    fast, general = (vkattn.PagedKVCache(6, 1000, 1, 16, dtype="float32", device=device) for _ in range(2))
    general._fast_forward = lambda *a, **kw: None          # the twin always takes the general path
    (sid,) = _twin_sequences(rng, fast, general, [4500])
    for step in range(6):
        if step == 3:
            for c in (fast, general):
                c.truncate(sid, 4010)                      # 5 blocks of 1000 still: the same table
        q, k, v = _call(rng, 2, 1, 1, 1, 16)
        got, want = fast.forward([sid], q, k, v), general.forward([sid], q, k, v)
        assert np.array_equal(got, want), step
        assert bound(fast) == (6000 if step < 3 else 4096), step
    assert fast.length(sid) == general.length(sid) == 4013
