"""Cases every rounded K/V storage format runs alike (test_bfloat16.py, test_fp8.py, test_q4.py):
what a format's cache stores, bit for bit against ``vkattn.reference.round_to``; a paged ragged
prefill, a fork and a batch decode with variants; a cascade decode over a cached prefix; and the
planner's kernel for its prefill. Each format's file calls them with its own dtype and scales."""
import numpy as np

import vkattn
from conftest import assert_close, rand_kv, rand_q
from test_coopmat import GPU, planning
from vkattn import tuning
from vkattn._attn import StorageFormat, attn_pipeline
from vkattn._base import appends_first
from vkattn.reference import attention, round_to


def bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def assert_stored(stored, x, cache, which="k"):
    """``stored`` (a read() of ``cache``, (hkv, n, d)) is round_to(x) of the cache's format and
    its K (``which`` "k") or V scales, bit for bit."""
    scale = getattr(cache, f"{which}_scale", None)
    want = round_to(x, cache.dtype, 1.0 if scale is None else scale)
    bad = np.argwhere(bits(stored) != bits(want))
    assert bad.size == 0, f"{len(bad)} stored values differ from round_to's, first at {bad[:4].tolist()}"


def paged_batch_fork_and_variants(device, rng, dtype, **scales):
    """A ragged chunked prefill of two sequences (21 and 6 rows), a fork of the first (its partial
    block's rows copied), then a batch decode of the three with a window, a sink and softcap,
    lse returned: stored rows, outputs and lse against the reference on the stored values; the
    fork shares its past with its parent and not its new row."""
    pool = vkattn.PagedKVCache(40, 8, 2, 40, 24, dtype=dtype, device=device, **scales)
    a, b = pool.add_sequence(), pool.add_sequence()
    k = rng.standard_normal((2, 27, 40)).astype(np.float32)
    v = rng.standard_normal((2, 27, 24)).astype(np.float32)
    q = rng.standard_normal((6, 27, 40)).astype(np.float32)
    out = pool.forward([a, b], q, k, v, n_new=[21, 6])
    for sid, rows in ((a, slice(0, 21)), (b, slice(21, 27))):
        ks, vs = pool.read(sid)
        assert_stored(ks, k[:, rows], pool, "k")
        assert_stored(vs, v[:, rows], pool, "v")
        assert_close(out[:, rows], attention(q[:, rows], ks, vs), dtype)
    c = pool.fork(a)
    assert all(np.array_equal(bits(x), bits(y)) for x, y in zip(pool.read(a), pool.read(c)))
    q = rng.standard_normal((6, 3, 40)).astype(np.float32)
    k = rng.standard_normal((2, 3, 40)).astype(np.float32)
    v = rng.standard_normal((2, 3, 24)).astype(np.float32)
    out, lse = pool.forward([a, b, c], q, k, v, window=9, n_sink=1, softcap=4.0, return_lse=True)
    for i, sid in enumerate((a, b, c)):
        ks, vs = pool.read(sid)
        ref, ref_lse = attention(q[:, i:i + 1], ks, vs, window=9, n_sink=1, softcap=4.0, return_lse=True)
        assert_close(out[:, i:i + 1], ref, dtype)
        np.testing.assert_allclose(lse[:, i:i + 1], ref_lse, atol=2e-5, rtol=2e-4)
    ka, kc = pool.read(a)[0], pool.read(c)[0]
    assert np.array_equal(bits(ka[:, :21]), bits(kc[:, :21])) and not np.array_equal(ka[:, 21], kc[:, 21])


def cascade_and_prefix_cache(device, rng, dtype, d=32, **scales):
    """Sequences sharing a cached prefix (the second request takes the first's four full
    blocks) decode by cascade -- the shared blocks attended once, merged by log-sum-exp: the
    taken blocks hold the first's stored rows, the outputs match the reference."""
    bs, hkv = 4, 2
    pool = vkattn.PagedKVCache(64, bs, hkv, d, dtype=dtype, device=device, **scales)
    prompt = list(range(100, 117))                             # 17 tokens: 4 full blocks
    k = rng.standard_normal((hkv, 17, d)).astype(np.float32)
    v = rng.standard_normal((hkv, 17, d)).astype(np.float32)
    a = pool.add_sequence()
    pool.forward([a], rng.standard_normal((4, 17, d)).astype(np.float32), k, v, n_new=[17], token_ids=[prompt])
    assert pool.match_prefix(prompt + [7]) == 16
    b = pool.add_sequence(token_ids=prompt + [7])
    assert pool.length(b) == 16 and pool.block_table(b)[:4] == pool.block_table(a)[:4]
    kb, vb = pool.read(b)
    assert_stored(kb, k[:, :16], pool, "k")
    assert_stored(vb, v[:, :16], pool, "v")
    q = rng.standard_normal((4, 3, d)).astype(np.float32)
    kn = rng.standard_normal((hkv, 3, d)).astype(np.float32)
    out = pool.forward([a, b], q, kn, kn, n_new=[1, 2])
    assert "merge_lse" in pool._last_rec.ops                    # the cascade ran
    for sid, rows in ((a, slice(0, 1)), (b, slice(1, 3))):
        ks, vs = pool.read(sid)
        assert_close(out[:, rows], attention(q[:, rows], ks, vs), dtype)


def planner_never_picks_coopmat(device, monkeypatch, dtype, define):
    """The stated fallback of a format attn_coopmat.comp cannot hold (float16 matrices: not
    bfloat16's range, not q4's blocks): its prefill and chunks go to attn.comp on a GPU (the
    shader built with ``define`` = 1) even where attn_coopmat.comp is available and pays, or is
    forced with VKATTN_KERNEL=coopmat, and a forward keeps its fused append (no append-first
    submission for a kernel it does not use); float16 goes to attn_coopmat.comp there."""
    monkeypatch.delenv("VKATTN_KERNEL", raising=False)
    gpu = planning(device, monkeypatch, **GPU)
    monkeypatch.setattr(gpu, "coopmat_pays", lambda: True)
    f16 = StorageFormat(8, 128, dtype="float16")
    fmt = StorageFormat(8, 128, dtype=dtype)
    for forced in ("", "coopmat"):
        if forced:
            monkeypatch.setenv("VKATTN_KERNEL", forced)
        for rows in (2, 17, 512):
            assert attn_pipeline(gpu, f16, 32, rows, 0, 1, 0, 4096, False)[0].kernel == "coopmat"
            cfg, pipe = attn_pipeline(gpu, fmt, 32, rows, 0, 1, 0, 4096, False)
            assert cfg.kernel == "tile" and pipe.shader == "attn" and pipe.defines[define] == 1
        assert appends_first(gpu, 5, 5, f16._ch, f16._matrices)
        assert not appends_first(gpu, 5, 5, fmt._ch, fmt._matrices)
        assert not tuning.coopmat_takes(gpu, 64, fmt._ch, fmt._matrices)
    monkeypatch.setenv("VKATTN_KERNEL", "coopmat")             # this machine's device with coopmat forced
    if device.coopmat_problem() == "":
        assert attn_pipeline(device, fmt, 32, 64, 0, 1, 0, 4096, False)[0].kernel in ("tile", "lane")


def lengths_prefill_and_long_decode(device, rng, dtype, e2e, **scales):
    """Lengths 1 .. 300 of one cache (2/8 heads, d 64): a one-row prefill, a long prompt over
    FUSED_APPEND_MAX_ROWS rows (appended first, then attended), decode steps with split-K
    (VKATTN_DECODE_SPLITS: the caller's) across the whole past: each step's stored rows and
    output against the reference on the stored values; the last output within ``e2e`` (max abs)
    of float32 attention on the unrounded inputs."""
    cache = vkattn.KVCache(310, 2, 64, dtype=dtype, device=device, **scales)
    allk, allv = [], []
    for n in (1, tuning.FUSED_APPEND_MAX_ROWS + 45, 300 - 1 - tuning.FUSED_APPEND_MAX_ROWS - 45 - 3, 1, 1, 1):
        k, v = rand_kv(rng, cache, n)
        q = rand_q(rng, cache, 4, n)
        out = cache.forward(q, k, v)
        allk.append(k)
        allv.append(v)
        ks, vs = cache.read()
        assert_stored(ks[:, -n:], k, cache, "k")
        assert_stored(vs[:, -n:], v, cache, "v")
        assert_close(out, attention(q, ks, vs), dtype)
    assert cache.length == 300
    kf, vf = np.concatenate(allk, axis=1), np.concatenate(allv, axis=1)
    assert np.abs(out - attention(q, kf, vf)).max() < e2e


def rope_rounded_after_rotation(device, rng, dtype, within, **scales):
    """A RoPE cache (neox, 32 of 48 dims rotated): 13 rows by append.comp with ROPE_K, then 8 by
    a forward's fused store, q rotated too. ``within(ks, rotated, cache)`` checks the stored K
    against the reference's rotation of the inputs (the format's rounding of it, within a step:
    the rotation's own float rounding may cross a tie); V is stored as given, and the output
    matches the reference on the stored values and the rotated q."""
    rope = vkattn.RoPE(style="neox", rotary_dim=32)
    cache = vkattn.KVCache(64, 2, 48, dtype=dtype, device=device, rope=rope, **scales)
    k, v = rand_kv(rng, cache, 21)
    cache.append(k[:, :13], v[:, :13])
    q = rand_q(rng, cache, 2, 8)
    out = cache.forward(q, k[:, 13:], v[:, 13:], rope_q=True)
    ks, vs = cache.read()
    within(ks, vkattn.reference.rope(k, np.arange(21), rotary_dim=32), cache)
    assert_stored(vs, v, cache, "v")
    qr = vkattn.reference.rope(q, np.arange(13, 21), rotary_dim=32)
    assert_close(out, attention(qr, ks, vs), dtype)
