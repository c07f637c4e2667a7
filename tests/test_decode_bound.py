"""Decode plans follow the live length (tuning.decode_key_bound): the split count of a decode grows
with the context in power-of-two buckets instead of being fixed by the capacity, and a decode that
crosses bucket boundaries stays equal to the numpy reference on both kernels."""
import types

import numpy as np
import pytest

import vkattn
from conftest import Mirror, assert_close, rand_kv, rand_q
from vkattn import tuning


def test_key_bound_buckets():
    b = tuning.DECODE_BOUND_MIN
    assert tuning.decode_key_bound(1, 10 ** 6) == b
    assert tuning.decode_key_bound(b, 10 ** 6) == b
    assert tuning.decode_key_bound(b + 1, 10 ** 6) == 2 * b
    assert tuning.decode_key_bound(5 * b, 10 ** 6) == 8 * b
    assert tuning.decode_key_bound(5 * b, 6 * b) == 6 * b        # never above the capacity
    assert tuning.decode_key_bound(10, 300) == 300


def test_gpu_decode_splits_follow_the_context(monkeypatch):
    monkeypatch.delenv("VKATTN_DECODE_SPLITS", raising=False)
    gpu = types.SimpleNamespace(is_software=False)
    got = {n: tuning.decode_splits(gpu, "tile", 8, tuning.decode_key_bound(n, 1 << 20))
           for n in (100, 4096, 16384, 65536, 1 << 20)}
    # H100 sweep (perf/RESULTS.md, session 10): 32 splits up to 4096 keys, 128 at 16384, 256 beyond
    assert got == {100: 32, 4096: 32, 16384: 128, 65536: 256, 1 << 20: 256}
    assert tuning.decode_splits(gpu, "tile", 8, 1000) == 16      # small caches: a workgroup's worth each


@pytest.mark.parametrize("kernel", ["lane", "tile"])
@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_decode_across_key_bound_buckets(device, rng, monkeypatch, kernel, dtype):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    monkeypatch.setattr(tuning, "DECODE_BOUND_MIN", 16)
    cache = vkattn.KVCache(700, 2, 40, dtype=dtype, device=device)
    mirror = Mirror(cache)
    splits = set()
    for n in (5, 11, 40, 50, 100, 200, 250):                 # prefill chunks, then decode steps after each
        k, v = rand_kv(rng, cache, n)
        cache.append(k, v)
        mirror.append(k, v)
        for _ in range(2):
            k, v = rand_kv(rng, cache, 1)
            q = rand_q(rng, cache, 3, 1)
            out = cache.forward(q, k, v)
            mirror.append(k, v)
            assert_close(out, mirror.ref(q), dtype)
            plan = next(reversed(cache._plans.values()))
            splits.add((plan.cfg.splits, tuning.decode_key_bound(cache.length, cache.capacity)))
    bounds = {b for _, b in splits}
    assert bounds == {16, 32, 64, 128, 256, 512, 700}         # every bucket up to the capacity was used
    if kernel == "tile":
        assert len({s for s, _ in splits}) > 1                 # and the split count followed them


@pytest.mark.parametrize("kernel", ["lane", "tile"])
def test_new_prompt_lengths_reuse_their_row_bucket_plan(device, rng, monkeypatch, kernel):
    # prompts of 33..64 rows (appended first, then attended) share one attention and one append
    # plan; chunks of 9..16 fused rows share one; every result against the reference
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    cache = vkattn.KVCache(400, 2, 24, dtype="float16", device=device)
    mirror = Mirror(cache)
    keys = []
    for s in (40, 33, 64, 9, 16, 13):
        before = set(cache._plans)
        k, v = rand_kv(rng, cache, s)
        q = rand_q(rng, cache, 2, s)
        out = cache.forward(q, k, v)
        mirror.append(k, v)
        assert_close(out, mirror.ref(q), "float16")
        keys.append(set(cache._plans) - before)
    assert keys[0] and not keys[1] and not keys[2]          # 40 built the 64-row plans; 33 and 64 reuse them
    assert keys[3] and not keys[4] and not keys[5]          # 9 built the 16-row fused plan; 16 and 13 reuse it
    k_st, v_st = cache.read()
    assert np.array_equal(k_st, mirror.k) and np.array_equal(v_st, mirror.v)


def test_decode_shape_per_vendor(monkeypatch):
    """tuning.tile_decode_shape: NVIDIA GPUs take TILE_DECODE_NVIDIA (2 query vectors per thread, 4
    keys a step: timed faster on an H200) for 16- and 32-bit formats, int8 and other GPUs and CPU drivers (1, TILE_KB_DECODE);
    VKATTN_TILE_DECODE overrides both, and a malformed value is a ValueError naming it."""
    monkeypatch.delenv("VKATTN_TILE_DECODE", raising=False)
    dev = lambda vendor, software=False: types.SimpleNamespace(is_software=software,
                                                                info=types.SimpleNamespace(vendor_id=vendor))
    assert tuning.tile_decode_shape(dev(0x10de)) == tuning.TILE_DECODE_NVIDIA == (2, 4)
    assert tuning.tile_decode_shape(dev(0x10de), ch=1) == (2, 4)                      # float32
    assert tuning.tile_decode_shape(dev(0x10de), ch=4) == (1, tuning.TILE_KB_DECODE)  # int8
    assert tuning.tile_decode_shape(dev(0x1002)) == (1, tuning.TILE_KB_DECODE)
    assert tuning.tile_decode_shape(dev(0x10de, software=True)) == (1, tuning.TILE_KB_DECODE)
    monkeypatch.setenv("VKATTN_TILE_DECODE", "4,8")
    assert tuning.tile_decode_forced() == (4, 8)
    for bad in ("4", "0,2", "2,9", "a,b", "2,2,2"):
        monkeypatch.setenv("VKATTN_TILE_DECODE", bad)
        with pytest.raises(ValueError, match="VKATTN_TILE_DECODE"):
            tuning.tile_decode_forced()


@pytest.mark.parametrize("shape", ["2,4", "8,2"])
@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_decode_shapes_a_gpu_may_take(device, rng, monkeypatch, shape, dtype):
    """attn.comp decode with several query vectors per thread and keys per step (VKATTN_TILE_DECODE;
    NVIDIA's default is 2,4): a group of 3 (one thread's second vector past the group), a group of
    8, odd head dims, split K, against the reference."""
    monkeypatch.setenv("VKATTN_KERNEL", "tile")
    monkeypatch.setenv("VKATTN_TILE_DECODE", shape)
    monkeypatch.setenv("VKATTN_DECODE_SPLITS", "3")
    for hkv, group, d in ((1, 3, 37), (2, 8, 64)):
        cache = vkattn.KVCache(160, hkv, d, dtype=dtype, device=device)
        mirror = Mirror(cache)
        k, v = rand_kv(rng, cache, 141)
        cache.append(k, v)
        mirror.append(k, v)
        for _ in range(2):
            k, v = rand_kv(rng, cache, 1)
            q = rand_q(rng, cache, group, 1)
            out = cache.forward(q, k, v)
            mirror.append(k, v)
            assert_close(out, mirror.ref(q), dtype)
        plan = next(reversed(cache._plans.values()))
        rpt, kb = map(int, shape.split(","))
        assert (plan.cfg.kernel, plan.cfg.kb, plan.cfg.rpt, plan.cfg.splits) == ("tile", kb, min(rpt, group), 3)
        cache.close()
