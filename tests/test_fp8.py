"""fp8 K/V storage ("fp8_e4m3", "fp8_e5m2"): four bytes per uint32, each value / its kv head's
scale rounded once to the format (vkattn.reference.fp8_bits, integer arithmetic in
shaders/common.glsl), decoded exactly inside every kernel that reads the cache and multiplied by
the scale (K: after the dot product; V: into the softmax weight).

Parity: the device result against the reference computed on the values the cache holds -- read
back, and checked bit for bit against reference.round_to(x, fmt, scales) -- with the float32
tolerances, since the decode is exact. Odd and round head dims, odd lengths, GQA, per-head
scales, both caches, forks, prefix sharing and cascade, persistence; bad scales are refused
before anything is allocated. Adversarial rounding cases are in test_exact.py.
"""
import numpy as np
import pytest

import vkattn
from conftest import append_chunk_decode, assert_close, rand_kv, rand_q
from kv_formats import (assert_stored, bits, cascade_and_prefix_cache, lengths_prefill_and_long_decode,
                        paged_batch_fork_and_variants, rope_rounded_after_rotation)
from test_coopmat import GPU, planning
from vkattn import tuning
from vkattn._attn import StorageFormat, attn_pipeline
from vkattn._base import appends_first
from vkattn.reference import FP8_FORMATS, attention, fp8_bits, round_to

KERNELS = ["lane", "tile"]
FP8 = ["fp8_e4m3", "fp8_e5m2"]
# max abs error vs float32 attention on the unrounded N(0, 1) inputs (scale 1/16: the values sit
# in the normal range), per format: e4m3 keeps 3 mantissa bits, e5m2 2
FP8_E2E = {"fp8_e4m3": 0.2, "fp8_e5m2": 0.4}


def scales(hkv, seed):
    """Per-head scales that are not powers of two (so a division would round)."""
    return (np.float32(0.05) + np.arange(hkv, dtype=np.float32) * np.float32(0.0371 + seed * 0.01)).astype(np.float32)


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("hkv,group,d,dv,past", [(2, 4, 64, 64, 131), (1, 3, 37, 37, 57), (3, 1, 40, 24, 200),
                                                 (2, 4, 128, 128, 260), (2, 3, 37, 29, 0)])
def test_fp8_append_forward_decode(device, rng, monkeypatch, fmt, kernel, hkv, group, d, dv, past):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    cache = vkattn.KVCache(300, hkv, d, dv, dtype=fmt, device=device, k_scale=scales(hkv, 0), v_scale=scales(hkv, 1))
    ks, vs, kf, vf, calls = append_chunk_decode(rng, cache, group, past)   # append, fused chunk, decode, attend
    assert_stored(ks, kf, cache, "k")
    assert_stored(vs, vf, cache, "v")
    for q, out, n in calls:
        assert_close(out, attention(q, ks[:, :n], vs[:, :n]), fmt)
    # the scales are applied: the stored values are not the unscaled fp8 values
    assert not np.array_equal(ks, round_to(kf, fmt, 1.0))


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("kernel", KERNELS)
def test_fp8_lengths_prefill_and_long_decode(device, rng, monkeypatch, fmt, kernel):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    monkeypatch.setenv("VKATTN_DECODE_SPLITS", "8")
    lengths_prefill_and_long_decode(device, rng, fmt, FP8_E2E[fmt], k_scale=0.0625, v_scale=[0.03, 0.07])


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("kernel", KERNELS)
def test_fp8_rope_is_rounded_after_rotation(device, rng, monkeypatch, fmt, kernel):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)

    def within(ks, rotated, cache):             # one fp8 step of the rounded rotation
        p = FP8_FORMATS[fmt][0]
        np.testing.assert_allclose(ks, round_to(rotated, fmt, cache.k_scale), rtol=2.0 ** -p, atol=1e-6)
    rope_rounded_after_rotation(device, rng, fmt, within, k_scale=[0.1, 0.3])


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("kernel", KERNELS)
def test_fp8_paged_batch_fork_and_variants(device, rng, monkeypatch, fmt, kernel):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    paged_batch_fork_and_variants(device, rng, fmt, k_scale=[0.2, 0.07], v_scale=0.11)


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_cascade_and_prefix_cache(device, rng, monkeypatch, fmt):
    monkeypatch.setenv("VKATTN_CASCADE", "1")
    cascade_and_prefix_cache(device, rng, fmt, k_scale=[0.09, 0.4], v_scale=[0.3, 0.02])


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_save_load_round_trip(device, rng, tmp_path, fmt):
    ksc, vsc = [0.015, 0.5], 0.125
    cache = vkattn.KVCache(64, 2, 40, 24, dtype=fmt, device=device, k_scale=ksc, v_scale=vsc)
    k, v = rand_kv(rng, cache, 37)
    k[0, 0, :4] = [0.0, -0.0, 1e-40, -1e9]                      # -0, a denormal, a saturated value
    cache.append(k, v)
    path = tmp_path / "fp8.safetensors"
    cache.save(path, token_ids=np.arange(37))
    info = vkattn.cache_file_info(path)
    assert info["dtype"] == fmt and info["length"] == 37
    from safetensors.numpy import load_file
    t = load_file(str(path))
    assert t["k"].dtype == np.uint8 and t["k"].shape == (2, 37, 40)
    assert np.array_equal(t["k"], fp8_bits(k, fmt, cache.k_scale[:, None, None]))
    other = vkattn.KVCache(50, 2, 40, 24, dtype=fmt, device=device, k_scale=ksc, v_scale=vsc)
    ids = other.load(path)
    assert ids.tolist() == list(range(37))
    for x, y in zip(cache.read(), other.read()):
        assert np.array_equal(bits(x), bits(y))
    q = rand_q(rng, cache, 2, 1)
    assert np.array_equal(cache.attend(q), other.attend(q))
    # other scales mean other values: refused, the cache unchanged
    wrong = vkattn.KVCache(64, 2, 40, 24, dtype=fmt, device=device, k_scale=ksc, v_scale=0.25)
    with pytest.raises(vkattn.CacheFileMismatchError, match="v_scale"):
        wrong.load(path)
    assert wrong.length == 0
    with pytest.raises(vkattn.CacheFileMismatchError, match=f"dtype is {fmt} in the file but float16"):
        vkattn.KVCache(64, 2, 40, 24, dtype="float16", device=device).load(path)
    pool = vkattn.PagedKVCache(16, 8, 2, 40, 24, dtype=fmt, device=device, k_scale=ksc, v_scale=vsc)
    sid, _ = pool.load_sequence(path)
    assert all(np.array_equal(bits(x), bits(y)) for x, y in zip(cache.read(), pool.read(sid)))


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_bad_scales_and_input(device, rng, fmt):
    fmax = FP8_FORMATS[fmt][3]
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e-46, [1.0], [1.0, 2.0, 3.0], [1.0, -2.0],
                3.4e38 / fmax * 2):
        for key in ("k_scale", "v_scale"):
            with pytest.raises(ValueError, match=key):
                vkattn.KVCache(16, 2, 8, dtype=fmt, device=device, **{key: bad})
            with pytest.raises(ValueError, match=key):
                vkattn.PagedKVCache(4, 4, 2, 8, dtype=fmt, device=device, **{key: bad})
    for bad in ("1.0", None.__class__, True):
        with pytest.raises(TypeError, match="k_scale"):
            vkattn.KVCache(16, 2, 8, dtype=fmt, device=device, k_scale=bad)
    with pytest.raises(ValueError, match="only the fp8 formats"):
        vkattn.KVCache(16, 2, 8, dtype="float16", device=device, k_scale=0.5)
    cache = vkattn.KVCache(16, 1, 8, dtype=fmt, device=device, k_scale=2.0)
    assert cache.k_scale.tolist() == [2.0] and cache.v_scale.tolist() == [1.0]
    s = cache.k_scale
    s[0] = 5.0                                                 # a copy
    assert cache.k_scale.tolist() == [2.0]
    k = np.zeros((1, 2, 8), np.float32)
    k[0, 0, :3] = [3e38, -1e30, fmax * 2 + 1]                  # finite overflow saturates (no range check)
    cache.append(k, k)
    ks, vs = cache.read()
    assert ks[0, 0, :3].tolist() == [2 * fmax, -2 * fmax, 2 * fmax] and vs[0, 0, :3].tolist() == [fmax, -fmax, fmax]
    nan = np.full((1, 1, 8), np.nan, np.float32)
    with pytest.raises(ValueError, match="NaN or Inf"):
        cache.append(nan, np.zeros_like(nan))
    with pytest.raises(ValueError, match="NaN or Inf"):
        cache.forward(np.zeros((1, 1, 8), np.float32), nan, np.zeros_like(nan))
    assert cache.length == 2 and np.array_equal(bits(cache.read()[0]), bits(ks))   # nothing written


def test_fp8_memory_and_format_table(device):
    f16 = vkattn.KVCache(1024, 8, 128, dtype="float16", device=device)
    e4 = vkattn.KVCache(1024, 8, 128, dtype="fp8_e4m3", device=device)
    e5 = vkattn.KVCache(1024, 8, 128, dtype="fp8_e5m2", device=device)
    assert e4.bytes_per_token == e5.bytes_per_token == f16.bytes_per_token // 2 == 8 * 2 * 128
    assert e4._ch == 4 and e4._defines == {"KV_F16": 0, "KV_I8": 0, "KV_FP8": 1}
    assert e5._defines["KV_FP8"] == 2 and e4._matrices and e5._matrices     # attn_coopmat.comp takes them
    assert f16.k_scale is None


def test_planner_picks_coopmat_for_fp8_as_for_float16(device, monkeypatch):
    # since session 25 attn_coopmat.comp takes fp8 (its bytes staged as float16 values): prefill
    # and chunks of a fp8 cache go where float16's go -- to it where it pays or is forced (the
    # forward then appends first, as it reads every key from the cache), to attn.comp where it does
    # not pay; decode stays on attn.comp, with its fused append
    monkeypatch.delenv("VKATTN_KERNEL", raising=False)
    gpu = planning(device, monkeypatch, **GPU)
    f16 = StorageFormat(8, 128, dtype="float16")
    for fmt in FP8:
        f8 = StorageFormat(8, 128, dtype=fmt)
        for pays, forced in ((True, ""), (False, "coopmat"), (False, "")):
            monkeypatch.setattr(gpu, "coopmat_pays", lambda pays=pays: pays)
            if forced:
                monkeypatch.setenv("VKATTN_KERNEL", forced)
            want = "coopmat" if pays or forced else "tile"
            for rows in (2, 17, 512):
                assert attn_pipeline(gpu, f16, 32, rows, 0, 1, 0, 4096, False)[0].kernel == want
                cfg, pipe = attn_pipeline(gpu, f8, 32, rows, 0, 1, 0, 4096, False)
                assert cfg.kernel == want and pipe.defines["KV_FP8"] == (1 if fmt == "fp8_e4m3" else 2)
                assert pipe.shader == ("attn_coopmat" if want == "coopmat" else "attn")
            cfg, pipe = attn_pipeline(gpu, f8, 32, 1, 0, 1, 0, 4096, True)       # decode
            assert cfg.kernel == "tile" and pipe.shader == "attn"
            assert appends_first(gpu, 5, 5, f8._ch, f8._matrices) == (want == "coopmat")
            assert tuning.coopmat_takes(gpu, 64, f8._ch, f8._matrices) == (want == "coopmat")
            assert not appends_first(gpu, 1, 1, f8._ch, f8._matrices)
            monkeypatch.delenv("VKATTN_KERNEL", raising=False)
