"""K/V read from texel views (attn_lane.comp KV_TEXEL, tuning.texel_kv): the lane kernel's plans
without a fused append read the cache through uniform texel buffers on a device that binds them
(lavapipe gathers those with vector instructions); a decode whose attention reads at least
TEXEL_APPEND_MIN_WORDS K/V words appends its rows first to get there. Every result equals the
storage path's bit for bit (the same stored bits, the same arithmetic) and the reference."""
import numpy as np
import pytest

import vkattn
from vkattn import _base

from conftest import Mirror, assert_close, rand_kv, rand_q, require_texel

FORMATS = ["float32", "float16", "bfloat16", "int8", "fp8_e4m3", "q4"]


@pytest.fixture
def lane_texel(device, monkeypatch):
    """The device, with the lane kernel picked (whatever VKATTN_KERNEL the run forces: these
    tests are that kernel's)."""
    if not (device.is_software and device.lane_subgroup()):
        pytest.skip("the lane kernel runs on CPU drivers")
    require_texel(device)
    monkeypatch.setenv("VKATTN_KERNEL", "lane")
    return device


def _texel_plans(cache):
    """KV_TEXEL of each attention plan the cache holds."""
    return [p._pipe.defines.get("KV_TEXEL", 0) for p in cache._plans.values()
            if getattr(getattr(p, "_pipe", None), "shader", "") == "attn_lane"]


@pytest.mark.parametrize("dtype", FORMATS)
def test_attend_and_prefill_from_texel_views_equal_the_storage_path(lane_texel, rng, monkeypatch, dtype):
    """An odd shape (3 kv heads, d 40, 5 query heads a group): a 45-row prefill (more than
    FUSED_APPEND_MAX_ROWS: appended first) and an attend, from texel views and from storage."""
    results = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("VKATTN_TEXEL_KV", mode)
        r = np.random.default_rng(7)
        cache = vkattn.KVCache(80, 3, 40, dtype=dtype, device=lane_texel)
        mirror = Mirror(cache)
        try:
            k, v = rand_kv(r, cache, 45)
            q = rand_q(r, cache, 5, 45)
            out = cache.forward(q, k, v)
            mirror.append(k, v)
            q1 = rand_q(r, cache, 5, 1)
            o1 = cache.attend(q1, window=17)
            plans = _texel_plans(cache)
            assert plans and all(t == int(mode) for t in plans), plans
            assert_close(out, mirror.ref(q), dtype)
            assert_close(o1, vkattn.reference.attention(q1, mirror.k, mirror.v, causal=True, window=17), dtype)
            results[mode] = (out, o1)
        finally:
            cache.close()
    for a, b in zip(results["1"], results["0"]):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("dtype", ["float16", "q4"])
def test_a_long_decode_appends_first_and_reads_texels(lane_texel, rng, monkeypatch, dtype):
    """With the word threshold lowered to this cache's size, a decode forward appends its row
    first and attends from texel views (numpy path and a graph's replay: each one submission with
    a barrier between the append and the attention); below it the append stays fused. Results
    equal the fused path's bit for bit."""
    cache = vkattn.KVCache(300, 2, 64, dtype=dtype, device=lane_texel)
    mirror = Mirror(cache)
    try:
        k, v = rand_kv(rng, cache, 200)
        cache.append(k, v)
        mirror.append(k, v)
        per_key = cache.num_kv_heads * 4 * (cache._rk4 + cache._rv4)
        monkeypatch.setattr(_base, "TEXEL_APPEND_MIN_WORDS", 256 * per_key)    # the key bound of 200 keys
        q1, k1, v1 = rand_q(rng, cache, 3, 1), *rand_kv(rng, cache, 1)
        got = cache.forward(q1, k1, v1)
        assert any(_texel_plans(cache))
        # the numpy path: the append and the attention in one recording, a barrier between
        ops = cache._last_rec.ops
        assert ops[-1].startswith(("download", "host barrier")), ops   # (direct host memory: no upload op)
        dispatches = [op for op in ops if not op.startswith(("upload", "download", "host barrier", "barrier"))]
        assert len(dispatches) == 2 and dispatches[0].startswith("append"), ops
        assert any(op.startswith("barrier") for op in ops[ops.index(dispatches[0]):ops.index(dispatches[1])]), ops
        mirror.append(k1, v1)
        assert_close(got, mirror.ref(q1), dtype)
        # the same call fused (the threshold out of reach): the same bits
        monkeypatch.setattr(_base, "TEXEL_APPEND_MIN_WORDS", 1 << 62)
        cache.truncate(200)
        fused = cache.forward(q1, k1, v1)
        assert np.array_equal(got.view(np.uint32), fused.view(np.uint32))
        # a graph: the append and the texel attention in one submission, replayed
        monkeypatch.setattr(_base, "TEXEL_APPEND_MIN_WORDS", 256 * per_key)
        cache.truncate(200)
        mirror.truncate(200)
        dq, dk, dv = vkattn.to_device(q1, lane_texel), vkattn.to_device(k1, lane_texel), vkattn.to_device(v1, lane_texel)
        do = vkattn.empty(q1.shape, lane_texel)
        g = vkattn.Graph(lane_texel)
        try:
            with g.capture():
                cache.forward(dq, dk, dv, out=do)
            for _ in range(3):
                g.run()
                mirror.append(k1, v1)
            assert any(op.startswith("barrier") for op in g.ops), g.ops
            assert g.submissions == 3 and cache.length == 203
            assert_close(do.numpy(), mirror.ref(q1)[:, :, :], dtype)
        finally:
            g.close()
            for a in (dq, dk, dv, do):
                a.close()
    finally:
        cache.close()


def _pool(device, dtype, lens, hkv, d, blocks, rope=None):
    """(a PagedKVCache of ``blocks`` blocks of 8, its sequences' ids): one sequence per length in
    ``lens``, filled with the same random rows (V = -K) whatever the rng of the test."""
    c = vkattn.PagedKVCache(blocks, 8, hkv, d, dtype=dtype, device=device, rope=rope)
    sids = [c.add_sequence() for _ in lens]
    r = np.random.default_rng(3)
    for s, n in zip(sids, lens):
        k = r.standard_normal((hkv, n, d)).astype(np.float32)
        c.append([s], k, -k, n_new=[n])
    return c, sids


@pytest.mark.parametrize("dtype", ["bfloat16", "q4"])
def test_a_paged_batch_over_many_keys_appends_first_and_reads_texels(lane_texel, rng, monkeypatch, dtype):
    """PagedKVCache: a batch decode whose sequences hold at least TEXEL_APPEND_MIN_WORDS K/V words
    in all appends its rows first and attends from texel views, the append and the attention one
    submission; the outputs and the stored rows equal the fused path's bit for bit. A graph step
    captured below the threshold decides again at each submission: replayed above it, it appends
    first too, and its results equal the numpy path's."""
    lens = [37, 5, 61]
    hkv, hq = 2, 6
    d = 64 if dtype == "q4" else 40     # a device array's rows are read unpadded: q4's blocks of 32

    def pool():
        return _pool(lane_texel, dtype, lens, hkv, d, 40)

    q = rng.standard_normal((hq, 3, d)).astype(np.float32)
    k1 = rng.standard_normal((hkv, 3, d)).astype(np.float32)
    v1 = rng.standard_normal((hkv, 3, d)).astype(np.float32)
    first, fused = pool(), pool()
    try:
        per_key = hkv * 4 * (first[0]._rk4 + first[0]._rv4)
        keys = sum(lens) + 3
        results = {}
        for name, (c, sids), words in (("first", first, keys * per_key), ("fused", fused, 1 << 62)):
            monkeypatch.setattr(_base, "TEXEL_APPEND_MIN_WORDS", words)
            results[name] = c.forward(sids, q, k1, v1)
            dispatches = [op for op in c._last_rec.ops if op.startswith(("append", "attn"))]
            assert dispatches == (["append", "attn_lane"] if name == "first" else ["attn_lane"]), c._last_rec.ops
            assert any(_texel_plans(c)) == (name == "first")
        assert np.array_equal(results["first"].view(np.uint32), results["fused"].view(np.uint32))
        for s1, s2 in zip(first[1], fused[1]):
            for a, b in zip(first[0].read(s1), fused[0].read(s2)):
                assert np.array_equal(a, b)
        # the reference on what is stored
        for i, s in enumerate(first[1]):
            ks, vs = first[0].read(s)
            ref = vkattn.reference.attention(q[:, i:i + 1], ks, vs, causal=True)
            assert_close(results["first"][:, i:i + 1], ref, dtype)

        # a graph captured with the threshold out of reach, replayed with it reached
        c, sids = first
        for s in sids:
            c.truncate(s, c.length(s) - 1)
        monkeypatch.setattr(_base, "TEXEL_APPEND_MIN_WORDS", 1 << 62)
        dq, dk, dv = (vkattn.to_device(x, lane_texel) for x in (q, k1, v1))
        do = vkattn.empty(q.shape, lane_texel)
        g = vkattn.Graph(lane_texel)
        try:
            with g.capture():
                c.forward(sids, dq, dk, dv, out=do)
            g.run()
            assert not any(op.startswith("append") for op in g.ops), g.ops
            assert np.array_equal(do.numpy().view(np.uint32), results["fused"].view(np.uint32))
            for s in sids:
                c.truncate(s, c.length(s) - 1)
            monkeypatch.setattr(_base, "TEXEL_APPEND_MIN_WORDS", keys * per_key)
            g.run()
            assert any(op.startswith("append") for op in g.ops) and any(op.startswith("barrier") for op in g.ops), g.ops
            assert np.array_equal(do.numpy().view(np.uint32), results["first"].view(np.uint32))
        finally:
            g.close()
            for a in (dq, dk, dv, do):
                a.close()
    finally:
        first[0].close()
        fused[0].close()


@pytest.mark.parametrize("dtype,rope", [("float16", None), ("q4", vkattn.RoPE(base=500.0)), ("int8", None)])
def test_the_fast_path_appends_first_too(lane_texel, rng, monkeypatch, dtype, rope):
    """KVCache.forward's fast path takes a decode that appends first (the texel threshold reached):
    the append and the texel attention in one submission, the aux words patched rather than
    rebuilt after the first call, bit for bit the general path's results and stored rows; with
    device arrays and ``out=`` too."""
    from vkattn import _attn
    fast, general = (vkattn.KVCache(160, 2, 64, dtype=dtype, device=lane_texel, rope=rope) for _ in range(2))
    general._fast_call = lambda *a, **kw: None          # the twin always takes the general path
    try:
        k, v = rand_kv(rng, fast, 100)
        for c in (fast, general):
            c.append(k, v)
        per_key = fast.num_kv_heads * 4 * (fast._rk4 + fast._rv4)
        monkeypatch.setattr(_base, "TEXEL_APPEND_MIN_WORDS", 128 * per_key)    # a key bound of 128
        fills = []
        real = _attn.AttnPlan.fill
        monkeypatch.setattr(_attn.AttnPlan, "fill", lambda self, *a, **kw: fills.append(1) or real(self, *a, **kw))
        calls = 6
        for i in range(calls):
            q1, k1, v1 = rand_q(rng, fast, 3, 1), *rand_kv(rng, fast, 1)
            lse = i == 2
            got = fast.forward(q1, k1, v1, return_lse=lse)
            if i == 0:
                fills_general = len(fills)
            want = general.forward(q1, k1, v1, return_lse=lse)
            if lse:
                assert np.array_equal(got[1].view(np.uint32), want[1].view(np.uint32))
                got, want = got[0], want[0]
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), i
            ops = fast._last_rec.ops
            assert [op for op in ops if op.startswith(("append", "attn"))] == ["append", "attn_lane"], ops
        assert any(_texel_plans(fast))
        assert len(fills) <= fills_general + calls + 1     # the general twin fills each call, the fast path once
        # device arrays, out=: the same bits as the numpy twin
        q1, k1, v1 = rand_q(rng, fast, 3, 1), *rand_kv(rng, fast, 1)
        arrays = [vkattn.to_device(x, lane_texel) for x in (q1, k1, v1)]
        out = vkattn.empty(q1.shape, lane_texel)
        try:
            assert fast.forward(*arrays, out=out) is out
            assert np.array_equal(out.numpy().view(np.uint32), general.forward(q1, k1, v1).view(np.uint32))
        finally:
            for a in arrays + [out]:
                a.close()
        assert fast.length == general.length == 100 + calls + 1
        for a, b in zip(fast.read(), general.read()):
            assert np.array_equal(a, b)
    finally:
        fast.close()
        general.close()


@pytest.mark.parametrize("dtype,rope", [("float16", vkattn.RoPE(base=500.0)), ("q4", None)])
def test_the_paged_fast_path_appends_first_too(lane_texel, rng, monkeypatch, dtype, rope):
    """PagedKVCache.forward's fast path takes a batch that appends first (the texel threshold
    reached): no SeqCall fill (AttnPlan.fill_batch), the append and the texel attention in one
    submission, bit for bit the general path's outputs and stored rows, decode steps and a
    prefill chunk; with device arrays and ``out=`` too."""
    from vkattn import _attn
    lens, hkv, d, hq = [37, 5, 61], 2, 64, 6

    def pool():
        return _pool(lane_texel, dtype, lens, hkv, d, 48, rope)

    (fast, sids), (general, gsids) = pool(), pool()
    general._fast_forward = lambda *a, **kw: None          # the twin always takes the general path
    try:
        per_key = hkv * 4 * (fast._rk4 + fast._rv4)
        monkeypatch.setattr(_base, "TEXEL_APPEND_MIN_WORDS", sum(lens) * per_key)
        fills = []
        real = _attn.AttnPlan.fill
        monkeypatch.setattr(_attn.AttnPlan, "fill", lambda self, *a, **kw: fills.append(self) or real(self, *a, **kw))
        for counts in ([1, 1, 1], [1, 1, 1], [4, 1, 2], [1, 1, 1]):
            t = sum(counts)
            q = rng.standard_normal((hq, t, d)).astype(np.float32)
            k = rng.standard_normal((hkv, t, d)).astype(np.float32)
            v = rng.standard_normal((hkv, t, d)).astype(np.float32)
            n_fill = len(fills)
            got = fast.forward(sids, q, k, v, n_new=counts)
            assert len(fills) == n_fill, "the fast path filled SeqCall records"
            ops = fast._last_rec.ops
            assert [op for op in ops if op.startswith(("append", "attn"))] == ["append", "attn_lane"], ops
            want = general.forward(gsids, q, k, v, n_new=counts)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), counts
        assert any(_texel_plans(fast))
        q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((hq, 3, d), (hkv, 3, d), (hkv, 3, d)))
        arrays = [vkattn.to_device(x, lane_texel) for x in (q, k, v)]
        out = vkattn.empty(q.shape, lane_texel)
        try:
            assert fast.forward(sids, *arrays, out=out) is out
            assert np.array_equal(out.numpy().view(np.uint32), general.forward(gsids, q, k, v).view(np.uint32))
        finally:
            for a in arrays + [out]:
                a.close()
        for s1, s2 in zip(sids, gsids):
            assert fast.length(s1) == general.length(s2)
            for a, b in zip(fast.read(s1), general.read(s2)):
                assert np.array_equal(a, b)
    finally:
        fast.close()
        general.close()


def _aux_texel_plans(cache):
    """AUX_TEXEL of each attention plan the cache holds."""
    return [p._pipe.defines.get("AUX_TEXEL", 0) for p in cache._plans.values()
            if getattr(getattr(p, "_pipe", None), "shader", "") == "attn_lane"]


@pytest.mark.parametrize("dtype", ["float16", "q4"])
def test_masks_and_block_tables_are_gathered_from_an_aux_texel_view(lane_texel, rng, monkeypatch, dtype):
    """attn_lane.comp gathers a mask's values and a paged block table's entries from a texel view
    of aux (AUX_TEXEL, tuning.texel_aux) and an unmasked KVCache call does not bind one; the
    results equal the storage path's bit for bit and the reference. Odd sizes: 3 kv heads, d 40,
    5 query heads a group, 23 + 2 keys in blocks of 7 (a block table of 4 entries), a per-head
    mask and a 2-D one."""
    results = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("VKATTN_TEXEL_KV", mode)
        r = np.random.default_rng(5)
        cache = vkattn.KVCache(40, 3, 40, dtype=dtype, device=lane_texel)
        pool = vkattn.PagedKVCache(12, 7, 3, 40, dtype=dtype, device=lane_texel)
        mirror = Mirror(cache)
        try:
            k, v = rand_kv(r, cache, 23)
            cache.append(k, v)
            mirror.append(k, v)
            a, b = pool.add_sequence(), pool.add_sequence()
            pool.append([a, b], np.concatenate([k, k[:, :9]], 1), np.concatenate([v, v[:, :9]], 1), n_new=[23, 9])
            plain = cache.attend(rand_q(r, cache, 5, 1))
            assert _aux_texel_plans(cache) == [0]
            q = rand_q(r, cache, 5, 2)
            m3 = r.standard_normal((15, 2, 23)).astype(np.float32)
            m2 = r.standard_normal((2, 23)).astype(np.float32)
            o3, o2 = cache.attend(q, mask=m3), cache.attend(q, mask=m2)
            assert_close(o3, vkattn.reference.attention(q, mirror.k, mirror.v, mask=m3), dtype)
            assert_close(o2, vkattn.reference.attention(q, mirror.k, mirror.v, mask=m2), dtype)
            k2, v2 = rand_kv(r, cache, 2)
            qp = rand_q(r, cache, 5, 2)
            op = pool.forward([a, b], qp, k2, v2)
            for i, sid in enumerate((a, b)):
                ks, vs = pool.read(sid)
                assert_close(op[:, i:i + 1], vkattn.reference.attention(qp[:, i:i + 1], ks, vs), dtype)
            want = int(mode)
            # the plain plan binds none; the two masked plans (per head, 2-D) one where texels are on
            assert sorted(_aux_texel_plans(cache)) == [0, want, want], _aux_texel_plans(cache)
            assert want in _aux_texel_plans(pool), _aux_texel_plans(pool)
            results[mode] = (plain, o3, o2, op)
        finally:
            cache.close()
            pool.close()
    for x, y in zip(results["1"], results["0"]):
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32))
