"""PagedKVCache: batched ragged decode and prefill against the single-sequence KVCache and the numpy
reference; fork, truncate, remove, transactional batches; variants through the paged path."""
import numpy as np
import pytest

import vkattn
from conftest import assert_close, assert_unchanged, snapshot
from vkattn.reference import attention, round_to

KERNELS = ["lane", "tile"]


class Model:
    """Host copy of every sequence of a paged cache (rounded like the cache rounds)."""

    def __init__(self, cache):
        self.c = cache
        self.k, self.v = {}, {}

    def add_sequences(self, n):
        """n new sequences in the cache, mirrored here; their ids."""
        sids = [self.c.add_sequence() for _ in range(n)]
        for sid in sids:
            self.add(sid)
        return sids

    def add(self, sid):
        c = self.c
        self.k[sid] = np.zeros((c.num_kv_heads, 0, c.head_dim), np.float32)
        self.v[sid] = np.zeros((c.num_kv_heads, 0, c.v_head_dim), np.float32)

    def append(self, sid, k, v):
        self.k[sid] = np.concatenate([self.k[sid], round_to(k, self.c.dtype)], axis=1)
        self.v[sid] = np.concatenate([self.v[sid], round_to(v, self.c.dtype)], axis=1)

    def check_stored(self):
        for sid in self.c.sequences:
            k, v = self.c.read(sid)
            assert np.array_equal(k, self.k[sid]) and np.array_equal(v, self.v[sid]), f"sequence {sid}"


def step(rng, cache, model, sids, counts, group, **kw):
    """One batched forward with fresh random tokens; checks every sequence against the reference."""
    total = sum(counts)
    hkv = cache.num_kv_heads
    q = rng.standard_normal((hkv * group, total, cache.head_dim)).astype(np.float32)
    k = rng.standard_normal((hkv, total, cache.head_dim)).astype(np.float32)
    v = rng.standard_normal((hkv, total, cache.v_head_dim)).astype(np.float32)
    out, lse = cache.forward(sids, q, k, v, n_new=counts, return_lse=True, **kw)
    a = 0
    for i, (sid, n) in enumerate(zip(sids, counts)):
        rows = slice(a, a + n)
        model.append(sid, k[:, rows], v[:, rows])
        extra = dict(kw)
        if "mask" in extra:
            extra["mask"] = extra["mask"][i]
        ref, ref_lse = attention(q[:, rows], model.k[sid], model.v[sid], return_lse=True, **extra)
        assert_close(out[:, rows], ref, cache.dtype)
        np.testing.assert_allclose(lse[:, rows], ref_lse, atol=2e-5, rtol=2e-4)
        a += n
    return q, k, v, out


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("block_size,hkv,group,d,dtype", [
    (16, 2, 4, 64, "float16"), (5, 1, 3, 13, "float32"), (1, 3, 1, 40, "float16"), (64, 2, 2, 128, "float32"),
])
def test_ragged_prefill_then_batch_decode(device, rng, monkeypatch, kernel, block_size, hkv, group, d, dtype):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    cache = vkattn.PagedKVCache(-(-700 // block_size) + 8, block_size, hkv, d, dtype=dtype, device=device)
    model = Model(cache)
    sids = model.add_sequences(4)
    step(rng, cache, model, sids, [37, 1, 120, 9], group)          # ragged chunked prefill
    step(rng, cache, model, sids[::-1], [2, 17, 1, 30], group)      # another chunk, other order
    for _ in range(3):                                                # batch decode
        step(rng, cache, model, sids, [1, 1, 1, 1], group)
    step(rng, cache, model, sids[1:3], [1, 1], group)               # a sub-batch
    model.check_stored()


@pytest.mark.parametrize("kernel", KERNELS)
def test_batch_decode_matches_single_sequence_cache(device, rng, monkeypatch, kernel):
    # each sequence's output equals what a KVCache holding only that sequence gives
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    lens = [100, 7, 611, 1, 250]
    paged = vkattn.PagedKVCache(64, 16, 2, 64, device=device)
    singles = [vkattn.KVCache(700, 2, 64, device=device) for _ in lens]
    sids = [paged.add_sequence() for _ in lens]
    for sid, n, single in zip(sids, lens, singles):
        k = rng.standard_normal((2, n, 64)).astype(np.float32)
        v = rng.standard_normal((2, n, 64)).astype(np.float32)
        q = rng.standard_normal((4, n, 64)).astype(np.float32)
        paged.forward([sid], q, k, v, n_new=[n])
        single.append(k, v)
    q = rng.standard_normal((4, len(lens), 64)).astype(np.float32)
    k = rng.standard_normal((2, len(lens), 64)).astype(np.float32)
    v = rng.standard_normal((2, len(lens), 64)).astype(np.float32)
    out = paged.forward(sids, q, k, v)
    for i, single in enumerate(singles):
        one = single.forward(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1])
        np.testing.assert_allclose(out[:, i:i + 1], one, atol=2e-6, rtol=2e-5)
        ref = attention(q[:, i:i + 1], *single.read())
        assert_close(out[:, i:i + 1], ref, "float16")


@pytest.mark.parametrize("kernel", KERNELS)
def test_fork_truncate_remove(device, rng, monkeypatch, kernel):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    cache = vkattn.PagedKVCache(40, 8, 2, 16, device=device)
    model = Model(cache)
    a = cache.add_sequence()
    model.add(a)
    step(rng, cache, model, [a], [21], 2)                 # 2 full blocks + 5 rows
    b = cache.fork(a)                                     # shares 2 blocks, copies the partial one
    model.k[b], model.v[b] = model.k[a].copy(), model.v[a].copy()
    assert cache.length(b) == 21 and cache.block_table(b)[:2] == cache.block_table(a)[:2]
    assert cache.block_table(b)[2] != cache.block_table(a)[2]
    model.check_stored()
    step(rng, cache, model, [a, b], [4, 6], 2)            # diverge: neither overwrites the other
    model.check_stored()
    c = cache.fork(b)
    model.k[c], model.v[c] = model.k[b].copy(), model.v[b].copy()
    cache.truncate(c, 12)                                 # into a shared block: private copy
    model.k[c], model.v[c] = model.k[c][:, :12], model.v[c][:, :12]
    step(rng, cache, model, [c, a], [3, 1], 2)
    model.check_stored()
    cache.pop(a, 5)                                       # speculative rollback
    model.k[a], model.v[a] = model.k[a][:, :-5], model.v[a][:, :-5]
    step(rng, cache, model, [a, b, c], [2, 1, 1], 2)
    model.check_stored()
    free = cache.free_blocks
    cache.remove_sequence(b)
    assert cache.free_blocks > free
    del model.k[b], model.v[b]
    step(rng, cache, model, [a, c], [1, 9], 2)
    model.check_stored()
    assert sorted(cache.lengths()) == sorted([a, c])


@pytest.mark.parametrize("dtype,rope", [("float32", None), ("float16", "neox"), ("int8", None)])
def test_append_without_attending(device, rng, dtype, rope):
    """append() stores ragged rows (rotated like forward's) that a later forward attends; a batch
    that does not fit, or a bad one, changes nothing."""
    rope = vkattn.RoPE(rope) if rope else None
    cache = vkattn.PagedKVCache(10, 5, 2, 16, dtype=dtype, device=device, rope=rope)
    model = Model(cache)
    sids = model.add_sequences(3)
    counts = [7, 1, 12]
    k = rng.standard_normal((2, 20, 16)).astype(np.float32)
    v = rng.standard_normal((2, 20, 16)).astype(np.float32)
    cache.append(sids, k, v, n_new=counts)
    a = 0
    for sid, n in zip(sids, counts):
        kr = k[:, a:a + n] if rope is None else rope.apply(k[:, a:a + n], np.arange(n), 16)
        model.append(sid, kr, v[:, a:a + n])
        a += n
    if dtype == "int8":                                   # stored values are checked by the int8 tests
        for sid in sids:
            model.k[sid], model.v[sid] = cache.read(sid)
    model.check_stored()
    assert [cache.length(s) for s in sids] == counts
    before = cache.lengths(), [cache.read(s) for s in sids], cache.free_blocks
    x = rng.standard_normal((2, 30, 16)).astype(np.float32)
    with pytest.raises(vkattn.CacheFullError):
        cache.append(sids, x, x, n_new=[10, 10, 10])
    with pytest.raises(ValueError, match="at least one new token"):
        cache.append(sids, x[:, :2], x[:, :2], n_new=[1, 0, 1])
    with pytest.raises(ValueError, match="k: expected shape"):
        cache.append(sids, x[:, :4], x[:, :3], n_new=[1, 1, 1])
    assert (cache.lengths(), cache.free_blocks) == (before[0], before[2])
    model.check_stored()
    if rope is None:                                      # (forward with rope needs rope_q for a reference)
        step(rng, cache, model, sids, [1, 3, 1], 2)       # the appended rows are attended


def test_batch_that_does_not_fit_changes_nothing(device, rng):
    cache = vkattn.PagedKVCache(6, 4, 1, 8, device=device)
    model = Model(cache)
    sids = model.add_sequences(2)
    step(rng, cache, model, sids, [7, 6], 1)              # 4 blocks used, 2 free
    before = cache.lengths(), [cache.block_table(s) for s in sids], cache.free_blocks
    q = rng.standard_normal((1, 13, 8)).astype(np.float32)
    kv = rng.standard_normal((1, 13, 8)).astype(np.float32)
    with pytest.raises(vkattn.CacheFullError, match="needs 4 new blocks, 2 free"):
        cache.forward(sids, q, kv, kv, n_new=[6, 7])     # each alone would fit; together they do not
    assert (cache.lengths(), [cache.block_table(s) for s in sids], cache.free_blocks) == before
    model.check_stored()
    with pytest.raises(vkattn.CacheFullError):
        cache.check_fits(sids, [6, 7])
    cache.check_fits(sids, [6, 1])


@pytest.mark.parametrize("bad,exc", [
    (dict(seq_ids=[0, 0]), ValueError), (dict(seq_ids=[0, 9]), vkattn.UnknownSequenceError),
    (dict(seq_ids=[]), ValueError), (dict(n_new=[2]), ValueError), (dict(n_new=[3, 0]), ValueError),
    (dict(n_new=[2, 1]), ValueError),                       # 3 tokens given, 4 expected? no: q has 3
    (dict(q=np.zeros((3, 3, 8), np.float32)), ValueError), (dict(k=np.zeros((2, 2, 8), np.float32)), ValueError),
    (dict(v=np.full((2, 3, 8), np.nan, np.float32)), ValueError), (dict(q=[[0.0]]), TypeError),
    (dict(window=0), ValueError), (dict(mask=np.zeros((3, 3), np.float32)), TypeError),
    (dict(mask=[np.zeros((1, 5), np.float32)]), ValueError),
])
def test_bad_batches_change_nothing(device, rng, bad, exc):
    cache = vkattn.PagedKVCache(8, 4, 2, 8, device=device)
    sids = [cache.add_sequence(), cache.add_sequence()]
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    cache.forward(sids, rng.standard_normal((4, 3, 8)).astype(np.float32), x, x, n_new=[1, 2])
    before = cache.lengths(), [cache.read(s) for s in sids], cache.free_blocks
    args = dict(seq_ids=sids, q=rng.standard_normal((4, 3, 8)).astype(np.float32), k=x, v=x, n_new=[2, 1])
    if bad.get("n_new") == [2, 1]:
        args["q"] = rng.standard_normal((4, 4, 8)).astype(np.float32)
    args.update(bad)
    with pytest.raises(exc):
        cache.forward(**args)
    after = cache.lengths(), [cache.read(s) for s in sids], cache.free_blocks
    assert after[0] == before[0] and after[2] == before[2]
    for (k1, v1), (k2, v2) in zip(before[1], after[1]):
        assert np.array_equal(k1, k2) and np.array_equal(v1, v2)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("variant", ["window_sinks", "softcap_alibi", "mask", "mask_heads"])
def test_variants_through_the_paged_path(device, rng, monkeypatch, kernel, variant):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    cache = vkattn.PagedKVCache(30, 16, 2, 24, device=device)
    model = Model(cache)
    sids = model.add_sequences(3)
    counts = [40, 3, 77]
    kw = {"window_sinks": dict(window=19, n_sink=2),
          "softcap_alibi": dict(softcap=3.0, alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625], np.float32)),
          "mask": dict(mask=[rng.standard_normal((n, n)).astype(np.float32) for n in counts]),
          # per-head masks of a different shape for each sequence: each has its own head stride
          "mask_heads": dict(mask=[rng.standard_normal((4, n, n)).astype(np.float32) for n in counts])}[variant]
    step(rng, cache, model, sids, counts, 2, **kw)
    if variant.startswith("mask"):
        heads = (4,) if variant == "mask_heads" else ()
        kw["mask"] = [rng.standard_normal(heads + (1, cache.length(s) + 1)).astype(np.float32) for s in sids]
    step(rng, cache, model, sids, [1, 1, 1], 2, **kw)
    monkeypatch.setenv("VKATTN_DECODE_SPLITS", "3")    # the batch decode again, its keys split and merged
    if variant.startswith("mask"):
        kw["mask"] = [rng.standard_normal(heads + (1, cache.length(s) + 1)).astype(np.float32) for s in sids]
    step(rng, cache, model, sids, [1, 1, 1], 2, **kw)


def test_verify_mode_and_memory_report(device, rng):
    cache = vkattn.PagedKVCache(10, 4, 2, 8, device=device, verify=True)
    sids = [cache.add_sequence(7), cache.add_sequence()]
    assert sids == [7, 0]
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    cache.forward(sids, rng.standard_normal((2, 5, 8)).astype(np.float32), x, x, n_new=[2, 3])
    # verify mode checks each sequence of a batch: a tolerance nothing meets fails the next call,
    # and a wrong row in one sequence only (its output patched after the kernel) fails it too
    q1 = rng.standard_normal((2, 2, 8)).astype(np.float32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(vkattn.reference.TOLERANCE, "float16", (-1.0, 0.0))
        with pytest.raises(vkattn.VerificationError, match="max abs error"):
            cache.forward(sids, q1, x[:, :2], x[:, :2])
    assert [cache.length(s) for s in sids] == [3, 4]     # checked after the call: its rows stay (docs/errors.md)
    for s, n in zip(sids, (2, 3)):
        cache.truncate(s, n)
    with pytest.MonkeyPatch.context() as mp:
        real = vkattn.reference.attention
        def off_in_the_second(q, *a, **k):
            got = real(q, *a, **k)
            if a[0].shape[1] != 4:                    # the second sequence's 3 + 1 keys: off by one
                return got
            return (got[0] + 1.0, got[1]) if isinstance(got, tuple) else got + 1.0
        mp.setattr(vkattn.reference, "attention", off_in_the_second)
        with pytest.raises(vkattn.VerificationError):
            cache.forward(sids, q1, x[:, :2], x[:, :2])
    assert cache.bytes_per_token == 2 * 16 * 2          # 8 halves = one 16-byte row per head, K and V
    assert cache.nbytes == 10 * 4 * cache.bytes_per_token
    cache.close()
    with pytest.raises(vkattn.CacheClosedError):
        cache.add_sequence()


def test_pool_larger_than_the_device_allows_is_refused(device):
    with pytest.raises(vkattn.DeviceLimitError, match="largest num_blocks for this shape"):
        vkattn.PagedKVCache(1 << 20, 64, 8, 128, device=device)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype,style", [("float16", "neox"), ("int8", "gptj")])
def test_long_prefill_is_appended_first(device, rng, monkeypatch, kernel, dtype, style):
    """A batch where a sequence brings more than FUSED_APPEND_MAX_ROWS tokens appends every new
    token at its slot in a dispatch of its own, then attends from the pool (one submission, a
    barrier between): the rows stored equal those of the same tokens sent in fused chunks, and the
    outputs match the reference."""
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    n0 = vkattn.tuning.FUSED_APPEND_MAX_ROWS
    cfg = vkattn.RoPE(style=style)
    hkv, group, d = 2, 2, 24
    # verify mode on the split pool: its check (RoPE'd queries at their positions) must pass too
    split, fused = (vkattn.PagedKVCache(40, 8, hkv, d, dtype=dtype, device=device, rope=cfg, verify=ver)
                    for ver in (True, False))
    sids = [split.add_sequence() for _ in range(3)]
    for s in sids:
        fused.add_sequence(s)
    # a fused batch, then a split one (within the row bucket of 2 * n0: tuning.LANE_LONG_ROWS)
    for counts in ([5, 1, 2], [n0 + 1, 3, n0 // 2 + 7]):
        past = [split.length(s) for s in sids]
        total = sum(counts)
        q = rng.standard_normal((hkv * group, total, d)).astype(np.float32)
        k = rng.standard_normal((hkv, total, d)).astype(np.float32)
        v = rng.standard_normal((hkv, total, d)).astype(np.float32)
        out, lse = split.forward(sids, q, k, v, n_new=counts, return_lse=True, rope_q=True)
        ops = split._last_rec.ops
        if max(counts) > n0 and vkattn._kp.HAS_BARRIER:     # the append, a barrier, the attention
            i = ops.index("append")
            assert ops[i + 1].startswith("barrier") and ops[i + 2] in ("attn", "attn_lane"), ops
        a = 0
        for sid, p, n in zip(sids, past, counts):
            for c0 in range(a, a + n, n0):                          # the same tokens, fused chunks
                rows = slice(c0, min(c0 + n0, a + n))
                fused.forward([sid], q[:, rows], k[:, rows], v[:, rows], n_new=[rows.stop - rows.start],
                              rope_q=True)
            ks, vs = split.read(sid)
            k2, v2 = fused.read(sid)
            assert np.array_equal(ks, k2) and np.array_equal(vs, v2), f"sequence {sid} stored other rows"
            assert ks.shape[1] == p + n
            qr = cfg.apply(q[:, a:a + n], np.arange(p, p + n), cfg.dim(d))
            ref, ref_lse = attention(qr, ks, vs, return_lse=True)
            assert_close(out[:, a:a + n], ref, dtype)
            assert_close(lse[:, a:a + n], ref_lse, dtype)
            a += n


@pytest.mark.parametrize("kernel", KERNELS)
def test_plan_builds_ahead_and_writes_nothing(device, rng, monkeypatch, kernel):
    """plan() builds the plans forward will use -- a fused chunk, a long prefill appended first, a
    batch decode -- writes nothing, takes no block, and the planned calls add no plan."""
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    cache = vkattn.PagedKVCache(40, 8, 2, 24, device=device)
    model = Model(cache)
    sids = model.add_sequences(3)
    step(rng, cache, model, sids, [3, 9, 1], 2)
    long = vkattn.tuning.FUSED_APPEND_MAX_ROWS + 5
    batches = [[4, 2, 7], [1, long, 2], [1, 1, 1]]
    before = cache.lengths(), cache.free_blocks, [cache.block_table(s) for s in sids]
    for counts in batches:
        cache.plan(sids, 4, counts)
    assert (cache.lengths(), cache.free_blocks, [cache.block_table(s) for s in sids]) == before
    model.check_stored()
    planned = len(cache._plans)
    for counts in batches:
        step(rng, cache, model, sids, counts, 2)
    assert len(cache._plans) == planned            # every call found its plan
    model.check_stored()


@pytest.mark.parametrize("args,exc,match", [
    (dict(seq_ids=[0, 7]), vkattn.UnknownSequenceError, None),
    (dict(seq_ids=[]), ValueError, "seq_ids"),
    (dict(n_new=[1, 0]), ValueError, "n_new"),
    (dict(n_new=[40, 40]), vkattn.CacheFullError, None),
    (dict(num_qo_heads=3), ValueError, "num_qo_heads"),
    (dict(num_qo_heads=0), ValueError, "num_qo_heads"),
])
def test_plan_checks_like_forward(device, args, exc, match):
    cache = vkattn.PagedKVCache(6, 4, 2, 8, device=device)
    sids = [cache.add_sequence(), cache.add_sequence()]
    call = dict(seq_ids=sids, num_qo_heads=4, n_new=[2, 1])
    call.update(args)
    with pytest.raises(exc, match=match):
        cache.plan(**call)
    assert cache.lengths() == {s: 0 for s in sids} and cache.free_blocks == 6


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_batch_decode_with_mostly_empty_splits(device, rng, monkeypatch, kernel, dtype):
    """A GPU's tile kernel splits a batch decode's keys as many ways as its compute units want (32
    and more on an H100), whatever the sequences' lengths: a batch of one key, one split's worth, a
    split and a key, and 33 splits' worth of keys leaves most workgroups of the short sequences
    with no key at all. Their partials must drop out of the merge (lse -inf), on both kernels,
    plain and with a window that leaves the long sequence's early splits empty."""
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    monkeypatch.setenv("VKATTN_DECODE_SPLITS", "32")
    mc = vkattn.tuning.MIN_CHUNK
    cache = vkattn.PagedKVCache(-(-(40 * mc) // 16) + 16, 16, 2, 48, dtype=dtype, device=device)
    model = Model(cache)
    sids = model.add_sequences(4)
    step(rng, cache, model, sids, [1, mc - 1, mc, 33 * mc - 1], 3)   # prefill: 1, mc-1, mc and 33 mc - 1 keys
    for _ in range(2):                                                # then decode: 2, mc, mc+1, 33 mc keys
        step(rng, cache, model, sids, [1, 1, 1, 1], 3)
    step(rng, cache, model, sids, [1, 1, 1, 1], 3, window=mc + 3, n_sink=1)
    step(rng, cache, model, sids[::-1], [1, 1, 1, 1], 3, softcap=5.0)
    model.check_stored()
    cache.close()


def test_appended_first_without_barriers_runs_the_append_alone(device, rng, monkeypatch):
    """With a kp that records no barrier (plain kp 0.9), a forward of more than
    FUSED_APPEND_MAX_ROWS rows runs the append as a submission of its own before the attention,
    never skipped: KVCache and PagedKVCache store the rows and match the reference."""
    from vkattn import _attn
    monkeypatch.setattr(_attn, "HAS_BARRIER", False)
    n = vkattn.tuning.FUSED_APPEND_MAX_ROWS + 5
    hkv, d = 2, 32
    q = rng.standard_normal((2 * hkv, n, d)).astype(np.float32)
    k = rng.standard_normal((hkv, n, d)).astype(np.float32)
    v = rng.standard_normal((hkv, n, d)).astype(np.float32)
    kv = vkattn.KVCache(64, hkv, d, device=device)
    pool = vkattn.PagedKVCache(16, 8, hkv, d, device=device)
    try:
        out = kv.forward(q, k, v)
        assert "append" not in kv._last_rec.ops                 # the attention's own recording
        sk, sv = kv.read()
        assert np.array_equal(sk, round_to(k, kv.dtype)) and np.array_equal(sv, round_to(v, kv.dtype))
        assert_close(out, attention(q, sk, sv), kv.dtype)
        sid = pool.add_sequence()
        out = pool.forward([sid], q, k, v, n_new=[n])
        assert "append" not in pool._last_rec.ops
        sk, sv = pool.read(sid)
        assert np.array_equal(sk, round_to(k, pool.dtype)) and np.array_equal(sv, round_to(v, pool.dtype))
        assert_close(out, attention(q, sk, sv), pool.dtype)
    finally:
        kv.close()
        pool.close()
