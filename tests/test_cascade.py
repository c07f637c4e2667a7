"""Cascade (shared-prefix) batch attention in PagedKVCache.forward: sequences sharing leading full
blocks attend them once per group and merge with their own keys by log-sum-exp (vkattn.cascade).
Each call runs on two caches fed the same tokens, one with VKATTN_CASCADE=1 and one with =0 (today's
path): both against the numpy reference at TOLERANCE, against each other at CASCADE_TOL, and the
K/V both store must be identical."""
import os
import sys

import numpy as np
import pytest

import vkattn
from conftest import assert_close
from vkattn import cascade
from vkattn.reference import attention, merge_states

KERNELS = ["lane", "tile"]
# cascade against today's path, both float32 on the same stored K/V: only the summation order
# differs (the shared keys' partial sums are formed over another row tiling and merged once more)
CASCADE_TOL = (5e-6, 5e-5)


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def took_cascade(cache) -> bool:
    return "merge_lse" in cache._last_rec.ops


def twin_forward(rng, monkeypatch, caches, sids, counts, hq, expect, **kw):
    """One forward of the same fresh tokens on the cascade cache and today's; checks both against
    the reference (K/V as stored) and each other, and which path ran. Returns the cascade out."""
    c0 = caches[0]
    total = sum(counts)
    q = rand(rng, hq, total, c0.head_dim)
    k = rand(rng, c0.num_kv_heads, total, c0.head_dim)
    v = rand(rng, c0.num_kv_heads, total, c0.v_head_dim)
    res = []
    for cache, mode in zip(caches, ("1", "0")):
        monkeypatch.setenv("VKATTN_CASCADE", mode)
        res.append(cache.forward(sids, q, k, v, n_new=counts, return_lse=True, **kw))
        assert took_cascade(cache) == (expect and mode == "1"), f"VKATTN_CASCADE={mode}: {cache._last_rec.ops}"
    (out, lse), (out0, lse0) = res
    extra = {n: kw[n] for n in ("softcap", "window", "n_sink", "alibi_slopes", "scale") if n in kw}
    a = 0
    for i, (sid, n) in enumerate(zip(sids, counts)):
        K, V = caches[0].read(sid)
        K0, V0 = caches[1].read(sid)
        assert np.array_equal(K, K0) and np.array_equal(V, V0), f"sequence {sid}: the caches store other rows"
        rows = slice(a, a + n)
        mask = kw["mask"][i] if "mask" in kw else None
        ref, ref_lse = attention(q[:, rows], K, V, return_lse=True, mask=mask, **extra)
        assert_close(out[:, rows], ref, c0.dtype)
        assert_close(lse[:, rows], ref_lse, c0.dtype)
        a += n
    np.testing.assert_allclose(out, out0, atol=CASCADE_TOL[0], rtol=CASCADE_TOL[1])
    np.testing.assert_allclose(lse, lse0, atol=CASCADE_TOL[0], rtol=CASCADE_TOL[1])
    return out


def twin_caches(num_blocks, block_size, hkv, d, dtype, device, **kw):
    return [vkattn.PagedKVCache(num_blocks, block_size, hkv, d, dtype=dtype, device=device, **kw) for _ in range(2)]


def forked(rng, monkeypatch, caches, prefix, batch, group):
    """A root sequence prefilled with ``prefix`` tokens, forked into ``batch`` sequences (full blocks
    shared, a partial last block copied) on both caches; their ids."""
    hkv, d = caches[0].num_kv_heads, caches[0].head_dim
    roots = [c.add_sequence() for c in caches]
    twin_forward(rng, monkeypatch, caches, [roots[0]], [prefix], hkv * group, False)
    sids = [roots[0]] + [caches[0].fork(roots[0]) for _ in range(batch - 1)]
    assert [caches[1].fork(roots[1]) for _ in range(batch - 1)] == sids[1:]
    return sids


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("batch,block_size,hkv,group,d,dtype,prefix", [
    (2, 16, 2, 4, 64, "float16", 48),        # the prefix ends on a block boundary
    (5, 16, 1, 3, 40, "float32", 37),        # .. inside a block (its partial block is copied)
    (3, 5, 2, 1, 24, "int8", 23),            # odd block size, MHA
    (4, 7, 3, 2, 128, "float16", 70),
])
def test_forked_batch_decode(device, rng, monkeypatch, kernel, batch, block_size, hkv, group, d, dtype, prefix):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    caches = twin_caches(-(-(prefix + 64) // block_size) * batch + 4, block_size, hkv, d, dtype, device)
    sids = forked(rng, monkeypatch, caches, prefix, batch, group)
    hq = hkv * group
    # ragged own parts (chunks: a causal own part of several rows), then batch decode steps
    twin_forward(rng, monkeypatch, caches, sids, [3, 1, 9, 2, 5][:batch], hq, prefix >= block_size)
    for _ in range(3):
        twin_forward(rng, monkeypatch, caches, sids, [1] * batch, hq, prefix >= block_size)
    twin_forward(rng, monkeypatch, caches, sids[::-1], [1] * batch, hq, prefix >= block_size)   # another order


@pytest.mark.parametrize("kernel", KERNELS)
def test_groups_and_loners(device, rng, monkeypatch, kernel):
    """Two families of forks and a sequence of its own, interleaved in the batch: two groups with
    prefixes of their own length, the loner attends everything itself."""
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    bs, hkv, group, d = 8, 2, 2, 32
    caches = twin_caches(60, bs, hkv, d, "float16", device)
    hq = hkv * group
    roots = [[c.add_sequence() for _ in range(3)] for c in caches]
    assert roots[0] == roots[1]
    a, b, lone = roots[0]
    twin_forward(rng, monkeypatch, caches, [a, b, lone], [29, 17, 40], hq, False)
    fa = [c.fork(a) for c in caches]
    fb = [[c.fork(b), c.fork(b)] for c in caches]
    assert fa[0] == fa[1] and fb[0] == fb[1]
    sids = [fb[0][0], a, lone, b, fa[0], fb[0][1]]
    groups = cascade.shared_groups([caches[0].block_table(s) for s in sids],
                                   [caches[0].length(s) for s in sids], bs)
    assert [(g.members, g.tokens) for g in groups] == [((0, 3, 5), 16), ((1, 4), 24)]
    twin_forward(rng, monkeypatch, caches, sids, [1, 2, 1, 1, 3, 1], hq, True)
    for _ in range(2):
        twin_forward(rng, monkeypatch, caches, sids, [1] * 6, hq, True)


def test_batch_of_one_and_nothing_shared(device, rng, monkeypatch):
    """Forced on, a batch with nothing to share runs today's path: one sequence, sequences without
    a common full block, a shared block that is still partial."""
    caches = twin_caches(30, 8, 1, 16, "float32", device)
    sids = forked(rng, monkeypatch, caches, 20, 2, 2)
    twin_forward(rng, monkeypatch, caches, sids[:1], [1], 2, False)
    others = [c.add_sequence() for c in caches]
    twin_forward(rng, monkeypatch, caches, [others[0]], [9], 2, False)
    twin_forward(rng, monkeypatch, caches, [sids[0], others[0]], [1, 1], 2, False)
    short = forked(rng, monkeypatch, caches, 5, 3, 2)      # 5 tokens: no full block yet
    twin_forward(rng, monkeypatch, caches, short, [1, 1, 1], 2, False)


@pytest.mark.parametrize("kernel", KERNELS)
def test_softcap_scale_and_long_chunks(device, rng, monkeypatch, kernel):
    """Softcap and a custom scale go through the cascade; a batch where one sequence brings more
    than FUSED_APPEND_MAX_ROWS rows (appended in a submission first) too."""
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    caches = twin_caches(40, 16, 2, 32, "float16", device)
    sids = forked(rng, monkeypatch, caches, 50, 3, 2)
    twin_forward(rng, monkeypatch, caches, sids, [1, 1, 1], 4, True, softcap=2.5, scale=0.3)
    long = vkattn.tuning.FUSED_APPEND_MAX_ROWS + 3
    twin_forward(rng, monkeypatch, caches, sids, [2, long, 1], 4, True)
    twin_forward(rng, monkeypatch, caches, sids, [1, 1, 1], 4, True, softcap=0.7)


@pytest.mark.parametrize("variant", ["window", "alibi", "mask", "rope_q"])
def test_unsupported_variants_take_todays_path(device, rng, monkeypatch, variant):
    caches = twin_caches(30, 8, 2, 16, "float32", device, rope=vkattn.RoPE() if variant == "rope_q" else None)
    sids = forked(rng, monkeypatch, caches, 26, 3, 2)
    counts = [1, 2, 1]
    if variant == "rope_q":
        total = sum(counts)
        q, k, v = rand(rng, 4, total, 16), rand(rng, 2, total, 16), rand(rng, 2, total, 16)
        past = [caches[0].length(s) for s in sids]
        outs = []
        for cache, mode in zip(caches, ("1", "0")):
            monkeypatch.setenv("VKATTN_CASCADE", mode)
            outs.append(cache.forward(sids, q, k, v, n_new=counts, rope_q=True))
            assert not took_cascade(cache)
        np.testing.assert_array_equal(outs[0], outs[1])
        a = 0
        for sid, p, n in zip(sids, past, counts):
            qr = vkattn.RoPE().apply(q[:, a:a + n], np.arange(p, p + n), 16)
            assert_close(outs[0][:, a:a + n], attention(qr, *caches[0].read(sid)), "float32")
            a += n
        return
    kw = {"window": dict(window=12, n_sink=2),
          "alibi": dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625], np.float32)),
          "mask": dict(mask=[rand(rng, n, caches[0].length(s) + n) for s, n in zip(sids, counts)])}[variant]
    twin_forward(rng, monkeypatch, caches, sids, counts, 4, False, **kw)


def test_automatic_threshold(device, rng, monkeypatch):
    """Unset, VKATTN_CASCADE attends a prefix by cascade from tuning.CASCADE_MIN_PREFIX shared
    tokens (when the shared query tile takes two rows or more) on a software device, never on a
    GPU (vkattn.cascade)."""
    monkeypatch.delenv("VKATTN_CASCADE", raising=False)
    bs, n0 = 16, vkattn.tuning.CASCADE_MIN_PREFIX
    cache = vkattn.PagedKVCache(4 * (n0 // bs) + 8, bs, 1, 32, device=device)
    for shared, want in ((n0 - bs, False), (n0, device.is_software)):
        root = cache.add_sequence()
        x = rand(rng, 1, shared, 32)
        cache.forward([root], rand(rng, 2, shared, 32), x, x, n_new=[shared])
        sids = [root, cache.fork(root)]
        q, k = rand(rng, 2, 2, 32), rand(rng, 1, 2, 32)
        out, lse = cache.forward(sids, q, k, k, return_lse=True)
        assert took_cascade(cache) == want, shared
        for i, sid in enumerate(sids):
            ref, ref_lse = attention(q[:, i:i + 1], *cache.read(sid), return_lse=True)
            assert_close(out[:, i:i + 1], ref, "float16")
            assert_close(lse[:, i:i + 1], ref_lse, "float16")


def test_bad_mode_changes_nothing(device, rng, monkeypatch):
    caches = twin_caches(20, 4, 1, 8, "float16", device)
    sids = forked(rng, monkeypatch, caches, 9, 2, 1)
    cache = caches[0]
    before = cache.lengths(), [cache.read(s) for s in sids], cache.free_blocks
    monkeypatch.setenv("VKATTN_CASCADE", "yes")
    x = rand(rng, 1, 2, 8)
    with pytest.raises(ValueError, match="VKATTN_CASCADE"):
        cache.forward(sids, x, x, x)
    with pytest.raises(ValueError, match="VKATTN_CASCADE"):
        cache.plan(sids, 1)
    monkeypatch.setenv("VKATTN_CASCADE", "1")
    with pytest.raises(ValueError, match="q: expected shape"):
        cache.forward(sids, rand(rng, 1, 3, 8), x, x)   # a bad batch with shared blocks
    after = cache.lengths(), [cache.read(s) for s in sids], cache.free_blocks
    assert after[0] == before[0] and after[2] == before[2]
    for (k1, v1), (k2, v2) in zip(before[1], after[1]):
        assert np.array_equal(k1, k2) and np.array_equal(v1, v2)


def test_plan_builds_the_cascade_ahead(device, rng, monkeypatch):
    monkeypatch.setenv("VKATTN_CASCADE", "1")
    cache = vkattn.PagedKVCache(30, 8, 2, 16, device=device)
    root = cache.add_sequence()
    x = rand(rng, 2, 19, 16)
    cache.forward([root], rand(rng, 4, 19, 16), x, x, n_new=[19])
    sids = [root, cache.fork(root), cache.fork(root)]
    before = cache.lengths(), cache.free_blocks
    cache.plan(sids, 4)
    assert (cache.lengths(), cache.free_blocks) == before
    planned = len(cache._plans)
    assert any(k[0] == "cascade" for k in cache._plans)
    y = rand(rng, 2, 3, 16)
    cache.forward(sids, rand(rng, 4, 3, 16), y, y)
    assert took_cascade(cache) and len(cache._plans) == planned


def test_shared_groups_from_tables():
    bs = 4
    tables = [[0, 1, 2, 9], [0, 1, 2, 3], [0, 1, 5], [7, 8], [7, 8, 6], [4]]
    past = [16, 14, 12, 8, 9, 3]
    g = cascade.shared_groups(tables, past, bs)
    # sequence 1 has 3 full blocks (14 tokens), 0 has 4: the group shares blocks 0, 1 only with 2
    assert [(x.members, x.blocks, x.tokens) for x in g] == [((0, 1, 2), (0, 1), 8), ((3, 4), (7, 8), 8)]
    assert [x.members for x in cascade.shared_groups(tables, past, bs, min_blocks=3)] == [(0, 1)]
    assert cascade.shared_groups(tables, past, bs, min_blocks=3)[0].blocks == (0, 1, 2)
    assert cascade.shared_groups([[0], [0]], [3, 3], bs) == []        # block 0 is not full
    with pytest.raises(ValueError, match="min_blocks"):
        cascade.shared_groups(tables, past, bs, min_blocks=0)


@pytest.mark.parametrize("dv", [13, 64])
def test_merge_shader(device, rng, dv):
    """merge_lse.comp against reference.merge_states, rows where either side or both saw nothing
    and rows without a second part included."""
    from vkattn.compiler import compile_shader
    be = device.backend
    hq, r, rb = 3, 7, 4
    ao, bo = rand(rng, hq * r, dv), rand(rng, hq * rb, dv)
    al, bl = rand(rng, hq * r) * 5, rand(rng, hq * rb) * 5
    mapping = np.array([2, cascade.NO_ROW, 0, 3, 1, cascade.NO_ROW, 2], np.uint32)
    al[[1, 4]] = -np.inf                 # row 1: a alone at -inf; row 4 of head 0: a empty, b not
    bl[[0, 5]] = -np.inf                 # head 0 row 2 -> b row 0 empty; head 1 row 4 -> b row 1 (5)
    al[r + 4] = -np.inf                  # head 1 row 4: both empty
    ao[[1, 4, r + 4]] = 0.0
    bo[[0, 5]] = 0.0
    bufs = [be.buffer(x.size, np.float32, name=n) for x, n in ((ao, "ao"), (al, "al"), (bo, "bo"), (bl, "bl"))]
    for b, x in zip(bufs, (ao, al, bo, bl)):
        b.view()[:] = x.ravel()
    params = be.buffer(cascade.MERGE_PARAMS + r, np.uint32, name="params")
    params.view()[:] = np.concatenate([[hq * r, r, rb], mapping])
    out, lse = be.buffer(hq * r * dv, np.float32, name="out"), be.buffer(hq * r, np.float32, name="lse")

    class Fmt:
        v_head_dim = dv
    pipe = cascade.merge_pipeline(device, Fmt, hq * r)
    prog = be.program(compile_shader(pipe.shader, pipe.defines), bufs + [params, out, lse], pipe.groups, pipe.spec,
                      writes=(5, 6), name="merge_lse")
    rec = be.recording().upload(*bufs, params).dispatch(prog).download(out, lse).build()
    rec.run()
    got, got_lse = out.view().reshape(hq, r, dv), lse.view().reshape(hq, r)
    a3, al3 = ao.reshape(hq, r, dv), al.reshape(hq, r)
    b3, bl3 = bo.reshape(hq, rb, dv), bl.reshape(hq, rb)
    has = mapping != cascade.NO_ROW
    want, want_lse = a3.copy(), al3.copy()
    want[:, has], want_lse[:, has] = merge_states(a3[:, has], al3[:, has], b3[:, mapping[has]], bl3[:, mapping[has]])
    assert np.isneginf(want_lse[1, 4]) and np.all(want[1, 4] == 0)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(got_lse[fin], want_lse[fin], atol=1e-6, rtol=1e-6)
    rec.destroy()
    for o in bufs + [params, out, lse, prog]:
        o.destroy()


def test_recording_orders_write_after_read_by_any_download(device):
    """vkattn._kp: a download of any buffer orders a write after an earlier dispatch's read of
    another (the cascade's fused append after the shared dispatch's reads of the pools); a read
    after a write still needs that buffer downloaded."""
    from vkattn.compiler import compile_shader
    be = device.backend
    src, mid, out = (be.buffer(64, np.uint32, name=n) for n in ("src", "mid", "out"))
    params = be.buffer(17, np.uint32, name="params")
    dummies = [be.buffer(1, np.float32, name=f"unused{i}") for i in range(8)]

    def copy(a, b, name, extra):        # gather_slots.comp as a word copy b[i] = a[params[1 + i]]
        return be.program(compile_shader("gather_slots"), [a, a, b, b, params] + extra, (1, 1, 1), [64, 1, 1],
                          writes=(2, 3, 7, 8), name=name)
    reader = copy(src, mid, "reader", dummies[:4])      # reads src, writes mid
    writer = copy(out, src, "writer", dummies[4:])      # reads out, writes src
    with pytest.raises(vkattn.SyncHazardError, match="an earlier dispatch used"):
        be.recording().dispatch(reader).dispatch(writer)
    with pytest.raises(vkattn.SyncHazardError, match="written by an earlier dispatch"):
        be.recording().dispatch(writer).download(mid).dispatch(reader)     # src written, not downloaded
    with pytest.raises(vkattn.SyncHazardError, match="upload"):
        be.recording().dispatch(writer).download(mid).upload(src)
    src.view()[:] = np.arange(64)
    out.view()[:] = np.arange(64) + 100
    params.view()[:] = [16] + list(range(15, -1, -1))
    rec = be.recording().upload(src, out, params).dispatch(reader).download(mid).dispatch(writer).download(src).build()
    rec.run()
    words = np.arange(64).reshape(16, 4)
    np.testing.assert_array_equal(mid.view().reshape(16, 4), words[::-1])          # read before the write
    np.testing.assert_array_equal(src.view().reshape(16, 4), words[::-1] + 100)
    rec.destroy()
    for o in [reader, writer, src, mid, out, params] + dummies:
        o.destroy()


def test_cascade_pipelines_compile_for_a_gpu(monkeypatch):
    """The shared pass and merge_lse.comp as perf gpu plans them for navi21 (16 sequences, 32/8
    heads, head_dim 128, float16, 2048 shared tokens), compiled by RADV/ACO on Mesa's null device:
    no spills, no scratch."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from perf import gpu as pg
    from vkattn.tools import vkpipeline as vp
    from vkattn.device import PlanningDevice
    if vp.radeon_icd() is None:
        pytest.skip("RADV is not installed (no radeon_icd*.json; Debian: mesa-vulkan-drivers)")
    info = vp.family_device_info("navi21")
    if info is None:
        pytest.skip("the installed RADV gives no null device for navi21")
    monkeypatch.delenv("VKATTN_KERNEL", raising=False)
    call = next(c for c in pg.calls() if c.kind == "cascade")
    planned = pg.plan_call(PlanningDevice(info), call)
    assert [d.role for d in planned.dispatches] == ["attn", "attn", "merge"]
    shared = planned.dispatches[0]
    assert shared.cfg.bq >= 2 and shared.cfg.splits > 1
    from vkattn.compiler import compile_shader
    jobs = [vp.Job(n, compile_shader(d.pipeline.shader, d.pipeline.defines), list(d.pipeline.spec), d.pipeline.bindings)
            for n, d in (("shared", shared), ("merge", planned.dispatches[2]))]
    run = vp.family_stats(["navi21"], jobs)["navi21"]
    if not run.available:
        pytest.skip(f"no navi21 null device: {run.reason}")
    for res in run.jobs:
        assert res.ok, (res.name, res.error)
        st = res.stats
        assert st["Spilled VGPRs"] == st["Spilled SGPRs"] == st["Scratch size"] == 0, (res.name, st)


def test_a_narrower_pipeline_is_caught_and_replanned(rng, monkeypatch):
    """As AttnPlan.run: forced onto a shuffle cluster twice the real subgroup, the cascade's
    attention pipelines run narrower; the plan reads their gl_SubgroupSize after the run, shrinks
    the device's cluster, builds again and returns the right result."""
    from vkattn.device import Device
    monkeypatch.setenv("VKATTN_KERNEL", "tile")
    monkeypatch.setenv("VKATTN_CASCADE", "1")
    monkeypatch.delenv("VKATTN_TILE_CLUSTER", raising=False)
    dev = Device(vkattn.default_device().index)
    try:
        real = dev.tile_cluster()
        if real < 2 or 2 * real > vkattn.tuning.TILE_CLUSTER:
            pytest.skip("needs a shuffle cluster below TILE_CLUSTER")
        cache = vkattn.PagedKVCache(40, 16, 1, 256, dtype="float32", device=dev)
        root = cache.add_sequence()
        x = rand(rng, 1, 40, 256)
        cache.append([root], x, x, n_new=[40])
        sids = [root, cache.fork(root), cache.fork(root)]
        probe = cache._plans.copy()
        dev._tile_cluster = 2 * real              # what a probe of another pipeline might claim
        q, k = rand(rng, 2, 3, 256), rand(rng, 1, 3, 256)
        out = cache.forward(sids, q, k, k)
        assert took_cascade(cache) and dev.tile_cluster() == real
        assert any(key[0] == "cascade" for key in cache._plans) and len(probe) < len(cache._plans)
        for i, sid in enumerate(sids):
            assert_close(out[:, i:i + 1], attention(q[:, i:i + 1], *cache.read(sid)), "float32")
        cache.close()
    finally:
        dev.close()


def cascade_plans(cache) -> list:
    return [p for key, p in cache._plans.items() if key[0] == "cascade"]


@pytest.mark.parametrize("own,want_split", [(3, False), (300, True)])
def test_own_part_splits_follow_its_keys(device, rng, monkeypatch, own, want_split):
    """On attn.comp the own dispatch splits its keys by tuning.own_splits (the batch's own keys and
    workgroups, not a lone decode's 32-way rule): one split for a few own keys, several for a long
    own part; both against the reference and today's path."""
    monkeypatch.setenv("VKATTN_KERNEL", "tile")
    monkeypatch.delenv("VKATTN_DECODE_SPLITS", raising=False)
    bs, hkv, group, d, prefix, batch = 8, 2, 2, 32, 40, 3
    caches = twin_caches(-(-(prefix + own + 8) // bs) * batch + 4, bs, hkv, d, "float16", device)
    sids = forked(rng, monkeypatch, caches, prefix, batch, group)
    twin_forward(rng, monkeypatch, caches, sids, [own] * batch, hkv * group, True)
    twin_forward(rng, monkeypatch, caches, sids, [1] * batch, hkv * group, True)
    span = own + 1
    want = vkattn.tuning.own_splits(device, "tile", hkv, batch, vkattn.tuning.row_bucket(span))
    assert (want > 1) == want_split, want
    splits = {p.own.cfg.splits for p in cascade_plans(caches[0]) if p.own.rows == batch}
    assert splits == {want}, splits


def test_own_splits_rule():
    """tuning.own_splits: enough splits to fill TILE_TARGET_WGS workgroups or to give each about
    DECODE_SPLIT_KEYS keys, never below MIN_CHUNK keys a split; None (the decode rule) for the
    lane kernel and under VKATTN_DECODE_SPLITS."""
    t = vkattn.tuning

    class Gpu:
        is_software = False
    # 16 sequences x 8 kv heads = 128 workgroups a split: two splits fill 256, 512 keys want 4
    assert t.own_splits(Gpu(), "tile", 8, 16, 512) == 512 // t.DECODE_SPLIT_KEYS
    assert t.own_splits(Gpu(), "tile", 8, 16, 256) == 2
    assert t.own_splits(Gpu(), "tile", 8, 16, 64) == 64 // t.MIN_CHUNK
    assert t.own_splits(Gpu(), "tile", 8, 64, 128) == 1                 # the batch fills the GPU
    assert t.own_splits(Gpu(), "tile", 1, 1, 1 << 20) == t.DECODE_MAX_SPLITS
    assert t.own_splits(Gpu(), "tile", 2, 2, 4096) == t.TILE_TARGET_WGS // 4
    assert t.own_splits(Gpu(), "lane", 8, 16, 512) is None


def test_own_splits_env_keeps_the_decode_rule(monkeypatch):
    monkeypatch.setenv("VKATTN_DECODE_SPLITS", "7")

    class Gpu:
        is_software = False
    assert vkattn.tuning.own_splits(Gpu(), "tile", 8, 16, 512) is None


def test_cascade_reads_at_most_a_third_on_navi21(monkeypatch):
    """perf gpu's traffic model of the perf case (16 sequences, 2048 shared + 64..256 own tokens,
    32/8 heads, head_dim 128, float16) as RADV navi21's limits plan it: the cascade step reads at
    most a third of today's bytes."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from perf import cascade as pc
    from perf.common import Shape
    from vkattn.tools import vkpipeline as vp
    if vp.radeon_icd() is None:
        pytest.skip("RADV is not installed (no radeon_icd*.json; Debian: mesa-vulkan-drivers)")
    if vp.family_device_info(pc.FAMILY) is None:
        pytest.skip(f"the installed RADV gives no null device for {pc.FAMILY}")
    monkeypatch.delenv("VKATTN_KERNEL", raising=False)
    monkeypatch.delenv("VKATTN_DECODE_SPLITS", raising=False)
    own = [int(x) for x in np.linspace(pc.OWN[0], pc.OWN[1], 16).round()]
    shape = Shape(heads=32, kv_heads=8, head_dim=128, v_head_dim=128, dtype="float16", qlen=1, capacity=None,
                  iters=1, warmup=0)
    t = pc._traffic(vkattn.default_device(), shape, 16, 2048, own)
    assert t[f"reads_ratio_{pc.FAMILY}"] <= 1 / 3, t
