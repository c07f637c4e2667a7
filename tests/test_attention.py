"""Parity of append / decode / prefill / forward against the numpy reference."""
import numpy as np
import pytest

import vkattn
from conftest import Mirror, assert_close, rand_kv, rand_q

# (num_kv_heads, group, head_dim, v_head_dim, capacity): GQA 1/4/8, head dims 64/128 and odd ones,
# v_head_dim != head_dim (MLA-like 192/128), capacities that are not powers of two.
SHAPES = [
    (2, 1, 64, 64, 300),
    (2, 4, 128, 128, 777),
    (1, 8, 128, 128, 515),
    (3, 4, 37, 37, 203),
    (2, 2, 192, 128, 333),
    (1, 4, 72, 40, 160),
    (4, 1, 5, 3, 97),
]
DTYPES = ["float16", "float32"]
KERNELS = ["lane", "tile"]   # both decode kernels run on every device (tuning picks one per device)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hkv%d-g%d-d%d-dv%d-cap%d" % s)
def test_decode_prefill_forward(device, rng, shape, dtype, kernel, monkeypatch):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    hkv, group, d, dv, cap = shape
    cache = vkattn.KVCache(cap, hkv, d, dv, dtype=dtype, device=device)
    mirror = Mirror(cache)
    # append in odd-sized chunks, mixing float16 and float32 inputs
    for i, n in enumerate([7, 1, 13, 30]):
        k, v = rand_kv(rng, cache, n, np.float16 if i % 2 else np.float32)
        cache.append(k, v)
        mirror.append(k, v)
    kk, vv = cache.read()
    assert kk.shape == (hkv, 51, d) and vv.shape == (hkv, 51, dv)
    assert np.array_equal(kk, mirror.k) and np.array_equal(vv, mirror.v)

    for causal in (True, False):
        q = rand_q(rng, cache, group, 1)                      # decode
        assert_close(cache.attend(q, causal=causal), mirror.ref(q, causal), dtype)
        q = rand_q(rng, cache, group, 9)                      # prefill rows over a past of 42
        assert_close(cache.attend(q, causal=causal, scale=0.3), mirror.ref(q, causal, 0.3), dtype)

    k, v = rand_kv(rng, cache, 11)                            # prefill forward (fused append)
    q = rand_q(rng, cache, group, 11)
    out = cache.forward(q, k, v)
    mirror.append(k, v)
    assert_close(out, mirror.ref(q), dtype)
    for _ in range(3):                                        # decode steps with forward
        k, v = rand_kv(rng, cache, 1)
        q = rand_q(rng, cache, group, 1)
        out = cache.forward(q, k, v)
        mirror.append(k, v)
        assert_close(out, mirror.ref(q), dtype)
    assert cache.length == 65
    kk, vv = cache.read()
    assert np.array_equal(kk, mirror.k) and np.array_equal(vv, mirror.v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_from_empty_and_long_decode(device, rng, dtype):
    cache = vkattn.KVCache(1100, 2, 128, dtype=dtype, device=device)
    mirror = Mirror(cache)
    k, v = rand_kv(rng, cache, 257)
    q = rand_q(rng, cache, 4, 257)
    out = cache.forward(q, k, v)                              # causal prefill, empty cache
    mirror.append(k, v)
    assert_close(out, mirror.ref(q), dtype)
    k, v = rand_kv(rng, cache, 800)
    cache.append(k, v)
    mirror.append(k, v)
    q = rand_q(rng, cache, 4, 1)
    assert_close(cache.attend(q), mirror.ref(q), dtype)      # split-K decode over 1057 keys


def test_fill_exactly_to_capacity_then_overflow(device, rng):
    cache = vkattn.KVCache(37, 2, 16, device=device)
    mirror = Mirror(cache)
    for n in (30, 7):
        k, v = rand_kv(rng, cache, n)
        cache.append(k, v)
        mirror.append(k, v)
    assert cache.length == cache.capacity == 37
    q = rand_q(rng, cache, 2, 3)
    assert_close(cache.attend(q), mirror.ref(q), cache.dtype)
    k, v = rand_kv(rng, cache, 1)
    with pytest.raises(vkattn.CacheFullError):
        cache.append(k, v)
    with pytest.raises(vkattn.CacheFullError):
        cache.forward(rand_q(rng, cache, 2, 1), k, v)
    assert cache.length == 37
    kk, vv = cache.read()
    assert np.array_equal(kk, mirror.k) and np.array_equal(vv, mirror.v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_truncate_then_continue(device, rng, dtype):
    cache = vkattn.KVCache(90, 2, 64, dtype=dtype, device=device)
    mirror = Mirror(cache)
    k, v = rand_kv(rng, cache, 40)
    cache.append(k, v)
    mirror.append(k, v)
    cache.truncate(23)                      # reject 17 speculative tokens
    mirror.truncate(23)
    assert cache.length == 23
    k, v = rand_kv(rng, cache, 5)
    q = rand_q(rng, cache, 3, 5)
    out = cache.forward(q, k, v)
    mirror.append(k, v)
    assert_close(out, mirror.ref(q), dtype)
    kk, vv = cache.read()
    assert np.array_equal(kk, mirror.k) and np.array_equal(vv, mirror.v)
    cache.reset()
    assert cache.length == 0 and cache.read()[0].shape == (2, 0, 64)
    k, v = rand_kv(rng, cache, 3)
    cache.append(k, v)
    q = rand_q(rng, cache, 1, 1)
    assert_close(cache.attend(q), vkattn.reference.attention(q, *cache.read()), dtype)


def test_decode_equals_prefill_rows(device, rng):
    cache = vkattn.KVCache(200, 2, 64, device=device)
    k, v = rand_kv(rng, cache, 150)
    cache.append(k, v)
    q = rand_q(rng, cache, 4, 20)
    rows = cache.attend(q)
    for i in (0, 7, 19):
        cache.truncate(150 - 19 + i)
        one = cache.attend(q[:, i:i + 1])
        np.testing.assert_allclose(one, rows[:, i:i + 1], atol=2e-6, rtol=1e-5)
        if cache.length < 150:
            cache.append(k[:, cache.length:], v[:, cache.length:])


@pytest.mark.parametrize("kernel", KERNELS)
def test_capacity_and_split_count_do_not_change_results(device, rng, monkeypatch, kernel):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    k = rng.standard_normal((2, 300, 64)).astype(np.float32)
    v = rng.standard_normal((2, 300, 64)).astype(np.float32)
    q = rng.standard_normal((8, 1, 64)).astype(np.float32)
    ref = vkattn.reference.attention(q, k, v)
    for splits in ("1", "3", "16"):
        monkeypatch.setenv("VKATTN_DECODE_SPLITS", splits)
        for cap in (300, 4001):
            cache = vkattn.KVCache(cap, 2, 64, dtype="float32", device=device)
            cache.append(k, v)
            assert_close(cache.attend(q), ref, "float32")
            cache.close()


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_fused_decode_steps_with_split_keys(device, rng, monkeypatch, dtype):
    """forward of one token at a time from an empty cache with the keys split over 3 and 16
    workgroups per kv head: in the lane kernel each of them stores the new row and reads it back
    as a key. Every output matches the reference on the stored values, and the cache ends up
    holding exactly what one append of the same tokens writes."""
    hkv, hq, d, n = 3, 6, 40, 21
    k = rng.standard_normal((hkv, n, d)).astype(np.float32)
    v = rng.standard_normal((hkv, n, d)).astype(np.float32)
    q = rng.standard_normal((hq, n, d)).astype(np.float32)
    appended = vkattn.KVCache(32, hkv, d, dtype=dtype, device=device)
    appended.append(k, v)
    want_k, want_v = appended.read()
    appended.close()
    for splits in ("3", "16"):
        monkeypatch.setenv("VKATTN_DECODE_SPLITS", splits)
        cache = vkattn.KVCache(32, hkv, d, dtype=dtype, device=device)
        for t in range(n):
            out = cache.forward(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1])
            kk, vv = cache.read()
            assert_close(out, vkattn.reference.attention(q[:, t:t + 1], kk, vv), dtype)
        kk, vv = cache.read()
        np.testing.assert_array_equal(kk, want_k)
        np.testing.assert_array_equal(vv, want_v)
        cache.close()


def test_large_logits_stay_finite_fp16(device, rng):
    cache = vkattn.KVCache(64, 1, 32, device=device)
    k = (rng.standard_normal((1, 50, 32)) * 100).astype(np.float32)   # |logits| up to ~1e4
    v = rng.standard_normal((1, 50, 32)).astype(np.float32)
    cache.append(k, v)
    q = (rng.standard_normal((2, 4, 32)) * 10).astype(np.float32)
    out = cache.attend(q, causal=False, scale=1.0)
    kk, vv = cache.read()
    assert_close(out, vkattn.reference.attention(q, kk, vv, causal=False, scale=1.0), "float16")


def test_non_contiguous_and_float16_inputs(device, rng):
    cache = vkattn.KVCache(40, 2, 16, dtype="float32", device=device)
    k = rng.standard_normal((2, 16, 10)).astype(np.float32).transpose(0, 2, 1)   # strided view
    v = rng.standard_normal((2, 10, 16)).astype(np.float16)
    cache.append(k, v)
    q = rng.standard_normal((4, 16, 3)).astype(np.float32).transpose(0, 2, 1)
    assert_close(cache.attend(q), vkattn.reference.attention(q, k, v), "float32")


def test_verify_mode(device, rng, monkeypatch):
    cache = vkattn.KVCache(20, 1, 8, device=device, verify=True)
    k, v = rand_kv(rng, cache, 5)
    cache.forward(rand_q(rng, cache, 2, 5), k, v)          # passes the reference check
    monkeypatch.setitem(vkattn.reference.TOLERANCE, "float16", (-1.0, 0.0))   # any result fails now
    with pytest.raises(vkattn.VerificationError, match="max abs error"):
        cache.attend(rand_q(rng, cache, 2, 1))
    monkeypatch.setenv("VKATTN_VERIFY", "1")
    assert vkattn.KVCache(4, 1, 8, device=device).verify
    monkeypatch.setenv("VKATTN_VERIFY", "0")
    assert not vkattn.KVCache(4, 1, 8, device=device).verify


@pytest.mark.parametrize("kernel", KERNELS)
def test_long_context_beyond_per_invocation_loop_cap(device, rng, monkeypatch, kernel):
    # lavapipe ends any loop after 65535 iterations per invocation: the planner must split the keys
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    monkeypatch.setenv("VKATTN_DECODE_SPLITS", "1")      # ask for one split; the cap must win
    cache = vkattn.KVCache(70001, 1, 16, dtype="float32", device=device)
    mirror = Mirror(cache)
    k, v = rand_kv(rng, cache, 70000)
    cache.append(k, v)
    mirror.append(k, v)
    q = rand_q(rng, cache, 2, 1)
    assert_close(cache.attend(q), mirror.ref(q), "float32")
    q = rand_q(rng, cache, 2, 5)
    assert_close(cache.attend(q), mirror.ref(q), "float32")


@pytest.mark.parametrize("kernel", KERNELS)
def test_float16_extremes_subnormal_and_large(device, rng, monkeypatch, kernel):
    # the kernels convert stored halves themselves: subnormals, signed zeros and values near
    # 65504 must come back exactly as numpy's float16 holds them
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    tiny = np.array([0.0, -0.0, 6e-8, -3e-7, 2.4e-6, -6.1e-5, 6.2e-5], np.float32)   # subnormals and around
    big = np.array([1.0, -2.5, 1000.0, 6.0e4, -65504.0], np.float32)
    for mags, atol in ((tiny, 1e-12), (big, 1e-2)):
        cache = vkattn.KVCache(50, 1, 24, device=device)
        v = rng.choice(mags, size=(1, 40, 24)).astype(np.float32)
        cache.append(np.zeros((1, 40, 24), np.float32), v)   # zero keys: every weight is 1/n
        kk, vv = cache.read()
        assert np.array_equal(vv, v.astype(np.float16).astype(np.float32))
        q = rng.standard_normal((2, 3, 24)).astype(np.float32)
        out = cache.attend(q, causal=False)
        ref = np.broadcast_to(vv.astype(np.float64).mean(axis=1, keepdims=True), out.shape)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("s", [1, 5])
def test_fully_masked_rows_give_zeros(device, rng, monkeypatch, kernel, s):
    # an additive mask of -inf hides every key from rows 0 and s-1: zeros and lse -inf, no NaN,
    # through the direct-output path (prefill) and the split-K partials + merge path (decode: 4
    # splits asked, as the lane kernel takes 1 on a 2-core machine by itself; a merge without its
    # guard for a split that saw no key gave NaN rows there, unnoticed)
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    monkeypatch.setenv("VKATTN_DECODE_SPLITS", "4")
    cache = vkattn.KVCache(300, 2, 16, device=device)
    cache.append(*rand_kv(rng, cache, 200))
    q = rand_q(rng, cache, 2, s)
    mask = rng.standard_normal((s, 200)).astype(np.float32)
    mask[0] = -np.inf
    mask[-1] = -np.inf
    out, lse = cache.attend(q, mask=mask, return_lse=True)
    ref, ref_lse = vkattn.reference.attention(q, *cache.read(), mask=mask, return_lse=True)
    assert np.isfinite(out).all() and not out[:, 0].any() and not out[:, -1].any()
    assert np.isneginf(lse[:, 0]).all() and np.isneginf(lse[:, -1]).all()
    assert_close(out, ref, "float16")
    np.testing.assert_allclose(lse[:, 1:-1], ref_lse[:, 1:-1], atol=2e-5, rtol=2e-4)
    if s == 1:
        assert [p.cfg.splits for p in cache._plans.values() if hasattr(p, "cfg")] == [4]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype,style", [("float16", None), ("int8", "neox"), ("float32", "gptj")])
def test_forward_fused_and_separate_append(device, rng, monkeypatch, kernel, dtype, style):
    """forward() fuses up to FUSED_APPEND_MAX_ROWS new rows into the attention dispatch and appends
    more in a submission of their own first: both sides of the threshold, with rope, a window, a
    mask and ALiBi, match the reference on the K/V as stored, and store the same rows as append()."""
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    n0 = vkattn.tuning.FUSED_APPEND_MAX_ROWS
    cfg = vkattn.RoPE(style=style) if style else None
    hkv, group, d = 2, 3, 40
    cache = vkattn.KVCache(4 * n0 + 40, hkv, d, dtype=dtype, device=device, rope=cfg)
    twin = vkattn.KVCache(4 * n0 + 40, hkv, d, dtype=dtype, device=device, rope=cfg)
    k, v = rand_kv(rng, cache, 17)
    cache.append(k, v)
    twin.append(k, v)
    # the last call's n - 3 rows stay within one row bucket of 2 * n0 (a long prefill's lane state,
    # tuning.LANE_LONG_ROWS, is another pipeline, whose compile is tested elsewhere)
    for n in (n0, n0 + 1, 2 * n0 - 1):
        past = cache.length
        k, v = rand_kv(rng, cache, n)
        q = rand_q(rng, cache, group, n - 3)          # the last n - 3 positions
        total = past + n
        kw = dict(window=n // 2, n_sink=2, mask=rng.standard_normal((n - 3, total)).astype(np.float32),
                  alibi_slopes=np.linspace(0.05, 0.4, hkv * group).astype(np.float32))
        out, lse = cache.forward(q, k, v, return_lse=True, rope_q=cfg is not None, **kw)
        twin.append(k, v)
        ks, vs = cache.read()
        k2, v2 = twin.read()
        assert cache.length == total and ks.shape[1] == total
        assert np.array_equal(ks, k2) and np.array_equal(vs, v2), "forward stored other rows than append"
        qr = cfg.apply(q, np.arange(total - q.shape[1], total), cfg.dim(d)) if cfg else q
        ref, ref_lse = vkattn.reference.attention(qr, ks, vs, return_lse=True, **kw)
        assert_close(out, ref, dtype)
        assert_close(lse, ref_lse, dtype)


def _forward_checked(rng, cache, mirror, group, s, dtype):
    """forward of s random rows (group q heads per kv head); out and lse against the reference."""
    k, v = rand_kv(rng, cache, s)
    q = rand_q(rng, cache, group, s)
    out, lse = cache.forward(q, k, v, return_lse=True)
    mirror.append(k, v)
    ref, ref_lse = vkattn.reference.attention(q, mirror.k, mirror.v, return_lse=True)
    assert_close(out, ref, dtype)
    assert_close(lse, ref_lse, dtype)


def _split_decode(device, rng, monkeypatch, kernel, dtype, steps):
    """A cache of 600 rows decoding ``steps`` steps over 7 splits on ``kernel``, each step checked
    against the reference: (cache, its attention plan)."""
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    monkeypatch.setenv("VKATTN_DECODE_SPLITS", "7")
    cache = vkattn.KVCache(900, 2, 48, dtype=dtype, device=device)
    mirror = Mirror(cache)
    k, v = rand_kv(rng, cache, 600)
    cache.append(k, v)
    mirror.append(k, v)
    for step in range(steps):
        _forward_checked(rng, cache, mirror, 3, 1, dtype)
    plan = next(p for p in cache._plans.values() if hasattr(p, "cfg"))
    assert plan.cfg.splits == 7
    return cache, plan


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_split_decode_merges_on_the_device(device, rng, monkeypatch, kernel, dtype):
    # split-K decode: one submission, one dispatch, and the only download is the output (+ lse):
    # the splits' partials stay on the device and the last workgroup of each tile merges them.
    # Many steps in a row, so the per-tile counters must come back to zero every call.
    cache, plan = _split_decode(device, rng, monkeypatch, kernel, dtype, 12)
    if cache.device.backend.direct:     # host memory the device reads: no copies, a barrier to the host
        assert plan.rec.ops == [plan.attn.name, "host barrier out,lse"]
    else:
        # a barrier after aux's copy: the kernel writes its split counters there (write after write)
        barrier = ["barrier aux"] if vkattn._kp.HAS_BARRIER else []
        assert plan.rec.ops == ["upload q,aux,new_k,new_v", *barrier, plan.attn.name, "download out,lse"]
    assert not plan.part.host_visible and not plan.ml.host_visible
    cache.close()


@pytest.mark.parametrize("env", [("VKATTN_TILE_MERGE_BATCH", "0"), ("VKATTN_TILE_MERGE_BATCH", "3"),
                                 ("VKATTN_TILE_V_EARLY", "1")])
@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_tile_builds_for_a_gpus_timing(device, rng, monkeypatch, env, dtype):
    # attn.comp's builds perf/gpu_session.sh times against the default (the split merge one split
    # at a time or three at once, V loaded with K): the same results, 7 splits (an odd count)
    name, value = env
    monkeypatch.setenv(name, value)
    cache, plan = _split_decode(device, rng, monkeypatch, "tile", dtype, 3)
    assert plan._pipe.defines[name.replace("VKATTN_", "")] == int(value)
    q, (k, v) = rand_q(rng, cache, 3, 1), rand_kv(rng, cache, 1)
    cache.close()
    monkeypatch.setenv(name, "9")
    with vkattn.KVCache(64, 2, 48, dtype=dtype, device=device) as fresh, pytest.raises(ValueError, match=name):
        fresh.forward(q, k, v)


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_tile_chunk_splits_keys(device, rng, monkeypatch, dtype):
    # attn.comp splits the keys of a few query tiles over a long past as well (a chunk, a
    # speculative verify): the splits' partials are merged on the device like decode's
    monkeypatch.setenv("VKATTN_KERNEL", "tile")
    cache = vkattn.KVCache(1500, 1, 64, dtype=dtype, device=device)
    mirror = Mirror(cache)
    k, v = rand_kv(rng, cache, 1200)
    cache.append(k, v)
    mirror.append(k, v)
    for s in (9, 3):
        _forward_checked(rng, cache, mirror, 4, s, dtype)
        q = rand_q(rng, cache, 4, 5)
        assert_close(cache.attend(q, causal=False), mirror.ref(q, causal=False), dtype)
    plans = [p for p in cache._plans.values() if hasattr(p, "cfg")]
    assert all(p.cfg.splits > 1 for p in plans) and any(p.rows > 1 for p in plans)
    cache.close()
