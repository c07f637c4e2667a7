"""Device.half_native: attn_lane.comp decodes float16 and fp8 K/V with the device's own half
conversion (unpackHalf2x16, HALF_NATIVE; fp8 through its half bit patterns, e4m3's times 2^-8
restored with the kv head's scale) where a probe shows it gives every finite half exactly -- and
the integer constructions (common.glsl halves_to_float, fp8x4_to_float) elsewhere. Either way
the same bits: these tests compare the two on K/V full of subnormals, and check the verdict
against the probe."""
import numpy as np
import pytest

import vkattn
from vkattn import reference

from conftest import assert_close, rand_q, skip_without_lane


@pytest.fixture
def lane(device, monkeypatch):
    """The device, with the lane kernel picked (whatever VKATTN_KERNEL the run forces)."""
    skip_without_lane(device)
    monkeypatch.setenv("VKATTN_KERNEL", "lane")
    return device


def _lane_defines(cache):
    return [p._pipe.defines for p in cache._plans.values()
            if getattr(getattr(p, "_pipe", None), "shader", "") == "attn_lane"]


# a scale that makes most stored values subnormal in the format (float16 < 2^-14, e4m3 < 2^-6,
# e5m2 < 2^-14), the rows scaled by 4096 normal
TINY = {"float16": 2.0 ** -16, "fp8_e4m3": 2.0 ** -8, "fp8_e5m2": 2.0 ** -16}


def _tiny_kv(rng, hkv, n, d, dtype="float16"):
    """K/V whose stored values are mostly subnormal in ``dtype``, some normal, some zero."""
    scale = np.float32(TINY[dtype])
    k = (rng.standard_normal((hkv, n, d)) * scale).astype(np.float32)
    v = (rng.standard_normal((hkv, n, d)) * scale).astype(np.float32)
    k[:, ::5] *= 4096          # some normal rows among them
    v[:, 1::7] = 0.0
    return k, v


def test_the_verdict_is_the_probe(device, monkeypatch):
    """half_native() is the probe's answer, asked once per device; VKATTN_HALF_NATIVE=0 says no
    without asking; a planning device (no dispatch) says no."""
    got = device.half_native()
    assert isinstance(got, bool)
    calls = []
    monkeypatch.setattr(type(device), "_probe_halves", lambda self: calls.append(1) or False)
    assert device.half_native() is got and not calls          # cached
    monkeypatch.setenv("VKATTN_HALF_NATIVE", "0")
    assert device.half_native() is False
    planning = vkattn.device.PlanningDevice(device.info)
    assert planning.half_native() is False


@pytest.mark.parametrize("dtype,kind", [("float16", "decode"), ("float16", "prefill"), ("float16", "forward"),
                                        ("fp8_e4m3", "decode"), ("fp8_e4m3", "forward"), ("fp8_e5m2", "prefill")])
def test_native_and_integer_half_decodes_give_the_same_bits(lane, rng, monkeypatch, dtype, kind):
    """float16 / fp8 K/V of mostly subnormal values through the lane kernel: with the device's
    verdict (HALF_NATIVE where it holds) and with the integer decode forced, bit for bit the
    same, and the reference's values on the stored K/V."""
    device = lane
    hkv, group, d, n = 3, 3, 40, 45
    k, v = _tiny_kv(rng, hkv, n, d, dtype)
    q = (rng.standard_normal((hkv * group, 1 if kind == "decode" else 13, d)) * 300).astype(np.float32)
    results, natives = {}, {}
    verdict = device.half_native()
    for mode in ("", "0"):
        if mode:
            monkeypatch.setenv("VKATTN_HALF_NATIVE", mode)
        else:
            monkeypatch.delenv("VKATTN_HALF_NATIVE", raising=False)
        cache = vkattn.KVCache(64, hkv, d, dtype=dtype, device=device)
        try:
            if kind == "forward":
                cache.append(k[:, :40], v[:, :40])
                out = cache.forward(q[:, :5], k[:, 40:], v[:, 40:])
                sk, sv = cache.read()
                ref = reference.attention(q[:, :5], sk, sv, causal=True)
            else:
                cache.append(k, v)
                out = cache.attend(q)
                sk, sv = cache.read()
                ref = reference.attention(q, sk, sv, causal=True)
            assert np.array_equal(sk, reference.round_to(k, dtype))
            assert_close(out, ref, dtype)
            natives[mode] = {df.get("HALF_NATIVE", 0) for df in _lane_defines(cache)}
            results[mode] = out
        finally:
            cache.close()
    assert natives[""] == {int(verdict)} and natives["0"] == {0}
    assert np.array_equal(results[""].view(np.uint32), results["0"].view(np.uint32))


def test_a_device_whose_conversion_fails_keeps_the_integer_decode(lane, rng, monkeypatch):
    """A probe that finds one wrong half: no HALF_NATIVE pipeline is planned."""
    device = lane
    monkeypatch.setattr(device, "_half_native", None)
    monkeypatch.setattr(type(device), "_probe_halves", lambda self: False)
    cache = vkattn.KVCache(32, 2, 32, dtype="float16", device=device)
    try:
        k, v = _tiny_kv(rng, 2, 20, 32)
        cache.append(k, v)
        q = rand_q(rng, cache, 2, 1)
        out = cache.attend(q)
        assert _lane_defines(cache) and all(not df.get("HALF_NATIVE") for df in _lane_defines(cache))
        sk, sv = cache.read()
        assert_close(out, reference.attention(q, sk, sv, causal=True), "float16")
    finally:
        cache.close()
