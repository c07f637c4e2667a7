"""RoPE inside the append and attention kernels: the cache stores keys rotated at their absolute
positions (NeoX and GPT-J pairings, partial rotary dims, any base); queries on request."""
import numpy as np
import pytest

import vkattn
from conftest import assert_close, rand_kv, rand_q
from vkattn.reference import attention, rope, round_to

KERNELS = ["lane", "tile"]
# stored rotated keys are numpy's rotation then storage rounding, bit for bit: rope.glsl's products
# and sums are `precise` (correctly rounded, never fused), the float16 store rounds to nearest even
# in integer arithmetic (common.glsl)


def rotated(k, pos0, cfg, d, dtype):
    r = cfg.rotary_dim or d
    return round_to(rope(k, np.arange(pos0, pos0 + k.shape[1]), base=cfg.base, rotary_dim=r, style=cfg.style), dtype)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("style,rotary_dim,base,d,dtype", [
    ("neox", None, 10000.0, 64, "float16"),
    ("gptj", None, 10000.0, 40, "float32"),
    ("neox", 16, 500000.0, 40, "float32"),      # partial rotary, Llama-3 base
    ("gptj", 24, 10000.0, 37, "float16"),       # odd head_dim, partial rotary
])
def test_rope_append_forward_attend(device, rng, monkeypatch, kernel, style, rotary_dim, base, d, dtype):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    cfg = vkattn.RoPE(style=style, base=base, rotary_dim=rotary_dim)
    cache = vkattn.KVCache(400, 2, d, dtype=dtype, device=device, rope=cfg)
    k0, v0 = rand_kv(rng, cache, 150)
    cache.append(k0, v0)                                   # append.comp rotates
    k1, v1 = rand_kv(rng, cache, 13)
    q1 = rand_q(rng, cache, 3, 13)
    out = cache.forward(q1, k1, v1, rope_q=True)           # fused append rotates keys and queries
    k2, v2 = rand_kv(rng, cache, 1)
    q2 = rand_q(rng, cache, 3, 1)
    out2 = cache.forward(q2, k2, v2, rope_q=True)          # decode step (split-K path)
    ks, vs = cache.read()
    want = np.concatenate([rotated(k0, 0, cfg, d, dtype), rotated(k1, 150, cfg, d, dtype),
                           rotated(k2, 163, cfg, d, dtype)], axis=1)
    assert np.array_equal(ks.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(vs, round_to(np.concatenate([v0, v1, v2], axis=1), dtype))    # V is not rotated
    r = cfg.rotary_dim or d
    rq = lambda q, p0: rope(q, np.arange(p0, p0 + q.shape[1]), base=base, rotary_dim=r, style=style)
    assert_close(out, attention(rq(q1, 150), ks[:, :163], vs[:, :163]), dtype)
    assert_close(out2, attention(rq(q2, 163), ks, vs), dtype)
    q3 = rand_q(rng, cache, 3, 4)                          # attend: queries are the last 4 positions
    assert_close(cache.attend(q3, rope_q=True), attention(rq(q3, 160), ks, vs), dtype)
    assert_close(cache.attend(q3), attention(q3, ks, vs), dtype)      # rope_q off: q as given


def test_rope_matches_relative_positions(device, rng):
    # the point of RoPE: a query and key rotated at positions p and p - delta score the same for any p
    cfg = vkattn.RoPE()
    scores = []
    for p in (5, 300):
        cache = vkattn.KVCache(400, 1, 32, dtype="float32", device=device, rope=cfg)
        rng2 = np.random.default_rng(0)
        k = rng2.standard_normal((1, 1, 32)).astype(np.float32)
        q = rng2.standard_normal((1, 1, 32)).astype(np.float32)
        cache.append(np.zeros((1, p - 3, 32), np.float32), np.zeros((1, p - 3, 32), np.float32))
        cache.append(k, np.ones((1, 1, 32), np.float32))
        cache.append(np.zeros((1, 2, 32), np.float32), np.zeros((1, 2, 32), np.float32))
        out, lse = cache.attend(q, rope_q=True, window=3, return_lse=True)   # keys p-2 .. p (zeros give score 0)
        scores.append(lse)
    np.testing.assert_allclose(scores[0], scores[1], atol=1e-4)


@pytest.mark.parametrize("kernel", KERNELS)
def test_rope_paged_batch(device, rng, monkeypatch, kernel):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    cfg = vkattn.RoPE(style="gptj", base=10000.0)
    pool = vkattn.PagedKVCache(40, 8, 2, 16, device=device, rope=cfg)
    single = [vkattn.KVCache(200, 2, 16, device=device, rope=cfg) for _ in range(3)]
    sids = [pool.add_sequence() for _ in range(3)]
    for counts in ([20, 3, 41], [1, 1, 1], [2, 5, 1]):
        total = sum(counts)
        q = rng.standard_normal((4, total, 16)).astype(np.float32)
        k = rng.standard_normal((2, total, 16)).astype(np.float32)
        v = rng.standard_normal((2, total, 16)).astype(np.float32)
        out = pool.forward(sids, q, k, v, n_new=counts, rope_q=True)
        a = 0
        for i, n in enumerate(counts):
            rows = slice(a, a + n)
            one = single[i].forward(q[:, rows], k[:, rows], v[:, rows], rope_q=True)
            np.testing.assert_allclose(out[:, rows], one, atol=2e-6, rtol=2e-5)
            ks, vs = pool.read(sids[i])
            k_single, _ = single[i].read()
            np.testing.assert_array_equal(ks, k_single)
            a += n


@pytest.mark.parametrize("make,exc", [
    (lambda: vkattn.RoPE(style="llama"), ValueError),
    (lambda: vkattn.RoPE(base=0.5), ValueError),
    (lambda: vkattn.RoPE(base="1e4"), TypeError),
    (lambda: vkattn.RoPE(rotary_dim=12), None),          # fine alone; refused by a cache (not a multiple of 8)
])
def test_rope_config_errors(device, make, exc):
    if exc is not None:
        with pytest.raises(exc):
            make()
        return
    with pytest.raises(ValueError, match="multiple of 8"):
        vkattn.KVCache(10, 1, 32, device=device, rope=make())


def test_rope_errors(device, rng):
    with pytest.raises(ValueError, match="rotary_dim"):
        vkattn.KVCache(10, 1, 13, device=device, rope=vkattn.RoPE())      # head_dim 13: give rotary_dim
    with pytest.raises(ValueError, match="rotary_dim"):
        vkattn.KVCache(10, 1, 16, device=device, rope=vkattn.RoPE(rotary_dim=24))
    with pytest.raises(TypeError):
        vkattn.KVCache(10, 1, 16, device=device, rope="neox")
    cache = vkattn.KVCache(10, 1, 16, device=device)
    cache.append(*rand_kv(rng, cache, 3))
    with pytest.raises(ValueError, match="no rope"):
        cache.attend(rand_q(rng, cache, 1, 1), rope_q=True)
    with pytest.raises(TypeError):
        cache.attend(rand_q(rng, cache, 1, 1), rope_q=1)
    assert cache.length == 3
