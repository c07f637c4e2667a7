"""int8 K/V storage: symmetric per-(position, head) scales, quantised on the device when rows are
stored, dequantised in the attention kernels.

Parity: the device result against the reference computed on the values the cache holds (read
back: int8 * scale) -- the usual atol 2e-5, rtol 2e-4, because dequantisation is exact in float32.
Quantisation: the stored values equal numpy's ``quantize_int8`` of the inputs bit for bit (scales
and integers are computed exactly on every driver, shaders/common.glsl; adversarial inputs in
test_exact.py); and the end-to-end error against float32 attention on the unquantised inputs is
bounded by INT8_E2E below.
"""
import numpy as np
import pytest

import vkattn
from conftest import assert_close, rand_kv, rand_q, skip_without_lane
from vkattn.reference import attention, quantize_int8, round_to

KERNELS = ["lane", "tile"]
INT8_E2E = 0.05      # max abs error vs float attention for N(0, 1) inputs (0.005-0.007 seen)


def assert_quantised(stored, x):
    q, scale = quantize_int8(x)
    want = q.astype(np.float32) * scale[..., None]
    bad = np.argwhere(stored.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, f"{len(bad)} stored values differ from quantize_int8's, first at {bad[:4].tolist()}"


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("hkv,group,d,dv", [(2, 4, 64, 64), (1, 3, 13, 13), (3, 1, 40, 24), (2, 2, 128, 128)])
def test_int8_append_forward_decode(device, rng, monkeypatch, kernel, hkv, group, d, dv):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    cache = vkattn.KVCache(400, hkv, d, dv, dtype="int8", device=device)
    k0, v0 = rand_kv(rng, cache, 131)
    cache.append(k0, v0)                                      # append.comp quantises
    k1, v1 = rand_kv(rng, cache, 11)
    q1 = rand_q(rng, cache, group, 11)
    out1 = cache.forward(q1, k1, v1)                          # fused append quantises (prefill path)
    k2, v2 = rand_kv(rng, cache, 1)
    q2 = rand_q(rng, cache, group, 1)
    out2 = cache.forward(q2, k2, v2)                          # decode (split-K path)
    ks, vs = cache.read()
    assert_quantised(ks, np.concatenate([k0, k1, k2], axis=1))
    assert_quantised(vs, np.concatenate([v0, v1, v2], axis=1))
    assert_close(out1, attention(q1, ks[:, :142], vs[:, :142]), "int8")
    assert_close(out2, attention(q2, ks, vs), "int8")
    kf, vf = np.concatenate([k0, k1, k2], axis=1), np.concatenate([v0, v1, v2], axis=1)
    assert np.abs(out2 - attention(q2, kf, vf)).max() < INT8_E2E


def test_int8_memory_per_token(device):
    f16 = vkattn.KVCache(1024, 8, 128, dtype="float16", device=device)
    i8 = vkattn.KVCache(1024, 8, 128, dtype="int8", device=device)
    assert f16.bytes_per_token == 8 * 2 * 256
    assert i8.bytes_per_token == 8 * (2 * 128 + 8)         # 128 int8 per row + a float32 scale, K and V
    assert i8.nbytes == 1024 * i8.bytes_per_token


def test_int8_zero_rows_and_extremes(device, rng):
    cache = vkattn.KVCache(20, 1, 16, dtype="int8", device=device)
    k = np.zeros((1, 3, 16), np.float32)
    k[0, 1] = 1e6 * rng.standard_normal(16)                # beyond float16's range is fine for int8
    k[0, 2, 5] = -3.0
    cache.append(k, k)
    ks, vs = cache.read()
    assert not ks[0, 0].any()                              # scale 0, no NaN
    assert ks[0, 2, 5] == -3.0 and not np.delete(ks[0, 2], 5).any()
    q = rng.standard_normal((1, 1, 16)).astype(np.float32)
    assert_close(cache.attend(q), attention(q, ks, vs), "int8")


@pytest.mark.parametrize("kernel", KERNELS)
def test_int8_paged_fork_and_variants(device, rng, monkeypatch, kernel):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    pool = vkattn.PagedKVCache(30, 8, 2, 32, dtype="int8", device=device, rope=vkattn.RoPE())
    a = pool.add_sequence()
    x = rng.standard_normal((2, 21, 32)).astype(np.float32)
    pool.forward([a], rng.standard_normal((4, 21, 32)).astype(np.float32), x, x, n_new=[21], rope_q=True)
    b = pool.fork(a)                                       # copies the partial block's rows and scales
    ka, va = pool.read(a)
    kb, vb = pool.read(b)
    assert np.array_equal(ka, kb) and np.array_equal(va, vb)
    q = rng.standard_normal((4, 2, 32)).astype(np.float32)
    k = rng.standard_normal((2, 2, 32)).astype(np.float32)
    out, lse = pool.forward([a, b], q, k, k, window=9, n_sink=1, softcap=4.0, return_lse=True, rope_q=True)
    for i, sid in enumerate((a, b)):
        ks, vs = pool.read(sid)
        qr = vkattn.reference.rope(q[:, i:i + 1], [21])
        ref, ref_lse = attention(qr, ks, vs, window=9, n_sink=1, softcap=4.0, return_lse=True)
        assert_close(out[:, i:i + 1], ref, "int8")
        np.testing.assert_allclose(lse[:, i:i + 1], ref_lse, atol=2e-5, rtol=2e-4)


def test_int8_verify_mode(device, rng, monkeypatch):
    cache = vkattn.KVCache(50, 2, 24, dtype="int8", device=device, verify=True)
    cache.append(*rand_kv(rng, cache, 30))
    cache.forward(rand_q(rng, cache, 2, 3), *rand_kv(rng, cache, 3))     # passes against the int8 values
    monkeypatch.setitem(vkattn.reference.TOLERANCE, "int8", (-1.0, 0.0))   # any result fails now
    with pytest.raises(vkattn.VerificationError, match="max abs error"):
        cache.attend(rand_q(rng, cache, 2, 1))
    assert round_to(np.ones((1, 1, 4), np.float32), "int8").tolist() == [[[1.0, 1.0, 1.0, 1.0]]]


def test_int8_long_prefill_takes_the_long_lane_state(device, rng, monkeypatch):
    """A prefill of tuning.LANE_LONG_ROWS rows or more on attn_lane.comp gets LANE_STATE_VEC4_LONG
    (twice the query vectors per workgroup at head_dim 128): int8 K/V on that pipeline, from empty
    and over a past, against the reference on the stored values."""
    skip_without_lane(device)                   # a GPU: VKATTN_KERNEL=lane is a ValueError there
    monkeypatch.setenv("VKATTN_KERNEL", "lane")
    t = vkattn.tuning
    hkv, group, d = 1, 4, 128
    cache = vkattn.KVCache(2 * t.LANE_LONG_ROWS + 40, hkv, d, dtype="int8", device=device)
    for n in (t.LANE_LONG_ROWS + 3, t.LANE_LONG_ROWS - 1):       # from empty, then over that past
        k, v = rand_kv(rng, cache, n)
        q = rand_q(rng, cache, group, n)
        out = cache.forward(q, k, v)
        assert_close(out, attention(q, *cache.read()), "int8")
    long = t.lane_config(device, group, t.LANE_LONG_ROWS, cache._dk4, cache._dv4, cache._ch, hkv, cache.capacity)
    short = t.lane_config(device, group, t.LANE_LONG_ROWS // 2, cache._dk4, cache._dv4, cache._ch, hkv,
                          cache.capacity)
    assert long.bq > short.bq, (long, short)
    bqs = {p.cfg.bq for p in cache._plans.values() if hasattr(p, "cfg") and p.cfg.kernel == "lane"}
    assert long.bq in bqs, bqs
