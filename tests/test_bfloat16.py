"""bfloat16 K/V storage: two bfloat16 per uint32 (the top halves of float32, rounded to nearest
even on the bits when rows are stored, shaders/common.glsl), read back by a 16-bit shift inside
every kernel that reads the cache.

Parity: the device result against the reference computed on the values the cache holds (read
back: reference.round_bfloat16 of the inputs, bit for bit) with the float32 tolerances, since the
load is exact. Odd and round head dims, odd lengths, GQA, both caches, the score variants on a
subset; the planner never sends bfloat16 to attn_coopmat.comp (float16 matrices cannot hold its
range). Adversarial rounding cases are in test_exact.py.
"""
import numpy as np
import pytest

import vkattn
from conftest import assert_close, rand_kv, rand_q, variant_args
from kv_formats import (bits, cascade_and_prefix_cache, paged_batch_fork_and_variants, planner_never_picks_coopmat,
                        rope_rounded_after_rotation)
from vkattn import tuning
from vkattn.reference import BF16_FINITE_INPUT, BF16_MAX, attention, round_bfloat16, round_to

KERNELS = ["lane", "tile"]
BF16_E2E = 0.05     # max abs error vs float32 attention on the unrounded N(0, 1) inputs


def assert_stored(stored, x):
    want = round_bfloat16(x)
    bad = np.argwhere(bits(stored) != bits(want))
    assert bad.size == 0, f"{len(bad)} stored values differ from round_bfloat16's, first at {bad[:4].tolist()}"


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("hkv,group,d,dv,past", [(2, 4, 64, 64, 131), (1, 3, 13, 13, 57), (3, 1, 40, 24, 200),
                                                 (2, 2, 128, 128, 131), (1, 4, 80, 80, 77), (2, 3, 37, 29, 9)])
def test_bfloat16_append_forward_decode(device, rng, monkeypatch, kernel, hkv, group, d, dv, past):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    cache = vkattn.KVCache(400, hkv, d, dv, dtype="bfloat16", device=device)
    k0, v0 = rand_kv(rng, cache, past)
    cache.append(k0, v0)                                      # append.comp rounds
    k1, v1 = rand_kv(rng, cache, 11)
    q1 = rand_q(rng, cache, group, 11)
    out1 = cache.forward(q1, k1, v1)                          # fused append (a chunk over the past)
    k2, v2 = rand_kv(rng, cache, 1)
    q2 = rand_q(rng, cache, group, 1)
    out2 = cache.forward(q2, k2, v2)                          # decode (split-K)
    ks, vs = cache.read()
    kf, vf = np.concatenate([k0, k1, k2], axis=1), np.concatenate([v0, v1, v2], axis=1)
    assert_stored(ks, kf)
    assert_stored(vs, vf)
    n1 = past + 11
    assert_close(out1, attention(q1, ks[:, :n1], vs[:, :n1]), "bfloat16")
    assert_close(out2, attention(q2, ks, vs), "bfloat16")
    q3 = rand_q(rng, cache, group, 5)
    assert_close(cache.attend(q3, causal=False), attention(q3, ks, vs, causal=False), "bfloat16")
    assert np.abs(out2 - attention(q2, kf, vf)).max() < BF16_E2E


@pytest.mark.parametrize("kernel", KERNELS)
def test_bfloat16_prefill_from_empty_and_long_prompt(device, rng, monkeypatch, kernel):
    # a prefill from an empty cache (fused store) and a prompt over FUSED_APPEND_MAX_ROWS rows
    # (appended first, then attended)
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    cache = vkattn.KVCache(300, 2, 72, dtype="bfloat16", device=device)
    for n in (19, tuning.FUSED_APPEND_MAX_ROWS + 45):
        k, v = rand_kv(rng, cache, n)
        q = rand_q(rng, cache, 2, n)
        out = cache.forward(q, k, v)
        ks, vs = cache.read()
        assert_stored(ks[:, -n:], k)
        assert_close(out, attention(q, ks, vs), "bfloat16")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", ["window_sinks", "softcap", "alibi", "mask_heads", "all"])
def test_bfloat16_variants(device, rng, monkeypatch, kernel, name):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    hkv, group, d, past, s = 2, 3, 48, 70, 6
    cache = vkattn.KVCache(128, hkv, d, dtype="bfloat16", device=device)
    cache.append(*rand_kv(rng, cache, past))
    q = rand_q(rng, cache, group, s)
    k, v = rand_kv(rng, cache, s)
    kw = variant_args(name, rng, hkv * group, s, past + s)
    out, lse = cache.forward(q, k, v, return_lse=True, **kw)
    ks, vs = cache.read()
    ref, ref_lse = attention(q, ks, vs, return_lse=True, **kw)
    assert_close(out, ref, "bfloat16")
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5, rtol=2e-4)


@pytest.mark.parametrize("kernel", KERNELS)
def test_bfloat16_rope_is_rounded_after_rotation(device, rng, monkeypatch, kernel):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)

    def within(ks, rotated, cache):             # bfloat16 values, within one step of the rounded rotation
        assert not (bits(ks) & 0xffff).any()
        np.testing.assert_allclose(ks, round_bfloat16(rotated), rtol=2 ** -7, atol=1e-6)
    rope_rounded_after_rotation(device, rng, "bfloat16", within)


@pytest.mark.parametrize("kernel", KERNELS)
def test_bfloat16_paged_batch_fork_and_variants(device, rng, monkeypatch, kernel):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    paged_batch_fork_and_variants(device, rng, "bfloat16")


@pytest.mark.parametrize("kernel", KERNELS)
def test_bfloat16_cascade_and_prefix_cache(device, rng, monkeypatch, kernel):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    monkeypatch.setenv("VKATTN_CASCADE", "1")
    cascade_and_prefix_cache(device, rng, "bfloat16")


def test_bfloat16_save_load_round_trip(device, rng, tmp_path):
    cache = vkattn.KVCache(64, 2, 40, 24, dtype="bfloat16", device=device)
    k, v = rand_kv(rng, cache, 37)
    k[0, 0, :4] = [0.0, -0.0, 1e-40, -BF16_MAX]                # -0, a denormal, the largest value
    cache.append(k, v)
    path = tmp_path / "bf16.safetensors"
    cache.save(path, token_ids=np.arange(37))
    info = vkattn.cache_file_info(path)
    assert info["dtype"] == "bfloat16" and info["length"] == 37
    from safetensors.numpy import load_file
    t = load_file(str(path))
    assert t["k"].dtype == np.uint16 and t["k"].shape == (2, 37, 40)
    assert np.array_equal(t["k"], vkattn.reference.bfloat16_bits(k))
    other = vkattn.KVCache(50, 2, 40, 24, dtype="bfloat16", device=device)
    ids = other.load(path)
    assert ids.tolist() == list(range(37))
    for x, y in zip(cache.read(), other.read()):
        assert np.array_equal(bits(x), bits(y))
    q = rand_q(rng, cache, 2, 1)
    assert np.array_equal(cache.attend(q), other.attend(q))
    with pytest.raises(vkattn.CacheFileMismatchError, match="dtype is bfloat16 in the file but float16"):
        vkattn.KVCache(64, 2, 40, 24, dtype="float16", device=device).load(path)
    pool = vkattn.PagedKVCache(16, 8, 2, 40, 24, dtype="bfloat16", device=device)
    sid, _ = pool.load_sequence(path)
    assert all(np.array_equal(bits(x), bits(y)) for x, y in zip(cache.read(), pool.read(sid)))


def test_bfloat16_range_and_bad_input(device, rng):
    cache = vkattn.KVCache(16, 1, 8, dtype="bfloat16", device=device)
    k = np.zeros((1, 2, 8), np.float32)
    k[0, 0, :3] = [BF16_FINITE_INPUT, -BF16_FINITE_INPUT, 1e30]    # the largest inputs that stay finite
    cache.append(k, k)
    ks, _ = cache.read()
    assert ks[0, 0, :3].tolist() == [BF16_MAX, -BF16_MAX, float(round_bfloat16(np.float32(1e30)))]
    big = np.zeros((1, 1, 8), np.float32)
    big[0, 0, 3] = np.nextafter(np.float32(BF16_FINITE_INPUT), np.float32(np.inf))   # rounds to Inf
    for bad, match in ((big, "bfloat16 range"), (np.full((1, 1, 8), np.nan, np.float32), "NaN or Inf")):
        with pytest.raises(ValueError, match=match):
            cache.append(bad, np.zeros_like(bad))
        with pytest.raises(ValueError, match=match):
            cache.forward(np.zeros((1, 1, 8), np.float32), bad, np.zeros_like(bad))
    assert cache.length == 2 and np.array_equal(bits(cache.read()[0]), bits(ks))   # nothing written
    with pytest.raises(TypeError, match="dtype: expected .*'bfloat16'"):
        vkattn.KVCache(16, 1, 8, dtype="bf16", device=device)
    # float16's range does not apply: 1e30 is stored (a float16 cache refuses it)
    with pytest.raises(ValueError, match="float16 range"):
        vkattn.KVCache(16, 1, 8, dtype="float16", device=device).append(k, k)


def test_bfloat16_memory_and_round_to(device):
    f16 = vkattn.KVCache(1024, 8, 128, dtype="float16", device=device)
    bf = vkattn.KVCache(1024, 8, 128, dtype="bfloat16", device=device)
    assert bf.bytes_per_token == f16.bytes_per_token == 8 * 2 * 256
    assert bf._ch == 2 and bf._defines == {"KV_F16": 0, "KV_I8": 0, "KV_BF16": 1}
    x = np.array([[[1.0, 1.00390625, 1.01171875, 3.0e38]]], np.float32)   # a tie down, a tie up
    assert round_to(x, "bfloat16").tolist() == [[[1.0, 1.0, 1.015625, float(round_bfloat16(np.float32(3.0e38)))]]]


def test_planner_never_picks_coopmat_for_bfloat16(device, monkeypatch):
    planner_never_picks_coopmat(device, monkeypatch, "bfloat16", "KV_BF16")


@pytest.mark.skipif(not vkattn.default_device().coopmat_problem() == "",
                    reason="attn_coopmat.comp cannot run on this device")
def test_bfloat16_prefill_with_coopmat_forced_runs_the_fallback(device, rng, monkeypatch):
    monkeypatch.setenv("VKATTN_KERNEL", "coopmat")
    cache = vkattn.KVCache(64, 2, 32, dtype="bfloat16", device=device)
    k, v = rand_kv(rng, cache, 20)
    q = rand_q(rng, cache, 2, 20)
    out = cache.forward(q, k, v)
    assert_close(out, attention(q, *cache.read()), "bfloat16")
    assert all(p.cfg.kernel != "coopmat" for p in cache._plans.values() if hasattr(p, "cfg"))
