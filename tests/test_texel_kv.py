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
def lane_texel(device):
    if not (device.is_software and device.lane_subgroup()):
        pytest.skip("the lane kernel runs on CPU drivers")
    require_texel(device)
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
    first and attends from texel views (numpy path and a graph's replay: one submission with a
    barrier between the append and the attention); below it the append stays fused. Results
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
