"""attn_coopmat.comp (cooperative-matrix prefill and chunks) against the numpy reference, and the
kernel picker around it.

Parity tests run with VKATTN_KERNEL=coopmat and check that the plan they ran really is the
cooperative-matrix kernel; they skip, naming the reason (Device.coopmat_problem), only on a device
or compiler without VK_KHR_cooperative_matrix / GL_KHR_cooperative_matrix (Mesa 22.3 and 25's
lavapipe, Debian 12's glslang). Mesa 26's lavapipe (8x8x8 matrices) runs them: scripts/distro.sh
trixie --mesa backports -- make test-coopmat. Tolerances: vkattn.reference.TOLERANCE of the cache
dtype, the same as the other kernels (the kernel splits Q and P into float16 hi + lo parts, so its
scores and sums are float32-accurate). The planner tests at the end need no device.
"""
import dataclasses
import os
import re

import numpy as np
import pytest

import vkattn
from conftest import LSE_TOL, Mirror, assert_close, rand_kv, rand_q, skip_or_fail_coopmat, variant_args
from vkattn import tuning
from vkattn._attn import StorageFormat, attn_pipeline
from vkattn.device import PlanningDevice
from vkattn.reference import attention, round_to



@pytest.fixture
def coopmat(device, monkeypatch):
    """The device, with VKATTN_KERNEL=coopmat; skips where the kernel cannot run, naming why."""
    skip_or_fail_coopmat(device.coopmat_problem())
    monkeypatch.setenv("VKATTN_KERNEL", "coopmat")
    return device


def kernels_run(cache) -> set:
    """The kernels of the attention plans a cache built."""
    return {p.cfg.kernel for p in cache._plans.values() if getattr(p, "cfg", None) is not None}


def last_plan(cache):
    """The attention plan used last (plans are kept in LRU order)."""
    return [p for p in cache._plans.values() if getattr(p, "cfg", None) is not None][-1]


def last_cfg(cache):
    """The AttnConfig of the attention plan used last (plans are kept in LRU order)."""
    cfgs = [p.cfg for p in cache._plans.values() if getattr(p, "cfg", None) is not None]
    return cfgs[-1]


# (num_kv_heads, group, head_dim, v_head_dim, dtype): GQA groups 1, 2, 3, 4, 8, head dims that are
# and are not multiples of the matrix K (5, 13, 37, 40, 72), v_head_dim != head_dim, int8 and fp8
# storage
SHAPES = [
    (2, 1, 64, 64, "float16"),
    (2, 4, 128, 128, "float16"),
    (1, 3, 37, 37, "float16"),
    (2, 2, 72, 40, "float16"),
    (1, 8, 16, 16, "float16"),
    (3, 1, 5, 3, "float16"),
    (2, 4, 64, 64, "int8"),
    (1, 3, 13, 24, "int8"),
    (2, 4, 64, 64, "fp8_e4m3"),
    (1, 3, 13, 24, "fp8_e5m2"),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hkv%d-g%d-d%d-dv%d-%s" % s)
def test_prefill_chunk_attend_long_prompt(coopmat, rng, shape):
    hkv, group, d, dv, dtype = shape
    cache = vkattn.KVCache(160, hkv, d, dv, dtype=dtype, device=coopmat)
    mirror = Mirror(cache)
    # causal prefill from an empty cache, 19 rows (fused append; rows not a multiple of 8 or 16)
    k, v = rand_kv(rng, cache, 19)
    q = rand_q(rng, cache, group, 19)
    out, lse = cache.forward(q, k, v, return_lse=True)
    mirror.append(k, v)
    ref, ref_lse = attention(q, mirror.k, mirror.v, return_lse=True)
    assert_close(out, ref, dtype)
    np.testing.assert_allclose(lse, ref_lse, **LSE_TOL)
    assert last_cfg(cache).kernel == "coopmat"
    # the kernel reads every key from the cache: the 19 new rows went in by append.comp first
    assert any(key[0] == "append" for key in cache._plans) and last_plan(cache).nn == 0
    # a chunk of 9 rows over a past of 19 (float16 inputs), scale given
    k, v = rand_kv(rng, cache, 9, np.float16)
    q = rand_q(rng, cache, group, 9, np.float16)
    out = cache.forward(q, k, v, scale=0.3)
    mirror.append(k, v)
    assert_close(out, mirror.ref(q, True, 0.3), dtype)
    # 7 rows attending the cache without new rows, causal and not
    q = rand_q(rng, cache, group, 7)
    assert_close(cache.attend(q), mirror.ref(q), dtype)
    assert_close(cache.attend(q, causal=False), mirror.ref(q, False), dtype)
    # a prompt longer than the fused append takes: appended first, then attended from the cache
    k, v = rand_kv(rng, cache, 45)
    q = rand_q(rng, cache, group, 45)
    out = cache.forward(q, k, v)
    mirror.append(k, v)
    assert_close(out, mirror.ref(q), dtype)
    assert kernels_run(cache) == {"coopmat"}
    kk, vv = cache.read()                     # the fused append stored what append.comp stores
    assert np.array_equal(kk, mirror.k) and np.array_equal(vv, mirror.v)


@pytest.mark.parametrize("dtype", ["float16", "int8", "fp8_e5m2"])
def test_chunk_over_a_long_past_splits_the_keys(coopmat, rng, dtype):
    cache = vkattn.KVCache(1700, 1, 64, dtype=dtype, device=coopmat)
    mirror = Mirror(cache)
    k, v = rand_kv(rng, cache, 1600)
    cache.append(k, v)
    mirror.append(k, v)
    # a chunk, a short one, and one with a window and sinks (the sinks lie below the first split's
    # keys: split 0 takes them)
    for s, kw in ((12, {}), (3, {}), (9, dict(window=300, n_sink=5))):
        k, v = rand_kv(rng, cache, s)
        q = rand_q(rng, cache, 4, s)
        out, lse = cache.forward(q, k, v, return_lse=True, **kw)
        mirror.append(k, v)
        ref, ref_lse = attention(q, mirror.k, mirror.v, return_lse=True, **kw)
        assert_close(out, ref, dtype)
        np.testing.assert_allclose(lse, ref_lse, **LSE_TOL)
        cfg = last_cfg(cache)
        assert cfg.kernel == "coopmat" and cfg.splits > 1      # merged on the device by the last split


@pytest.mark.parametrize("dtype", ["float16", "int8", "fp8_e4m3"])
def test_the_gpu_build_runs_here_too(coopmat, rng, monkeypatch, dtype):
    """The build a GPU gets (COOPMAT_UNROLL=1: every loop over a subgroup's matrices unrolled, so
    COOPMAT_FIXED_TRIPS keeps O in registers and COOPMAT_STAGE_BATCH's loads go out together), not
    lavapipe's own rolled one, on lavapipe's matrices: a chunk over a past long enough for several
    key blocks and splits, with a window and sinks, against the reference. (In `make
    test-platform`; `make test-coopmat` leaves it out: the same run under the layer would double
    its compile time on the slower CI machine.)"""
    real = tuning.coopmat_config

    def unrolled(*args, **kw):
        cfg = real(*args, **kw)
        return None if cfg is None else dataclasses.replace(cfg, unroll=True)
    monkeypatch.setattr(tuning, "coopmat_config", unrolled)
    cache = vkattn.KVCache(1700, 1, 64, dtype=dtype, device=coopmat)
    mirror = Mirror(cache)
    k, v = rand_kv(rng, cache, 1600)
    cache.append(k, v)
    mirror.append(k, v)
    # one pipeline per dtype (an unrolled build takes lavapipe seconds to compile): a window and
    # sinks, so the sinks' keys, the window's and the keys past it all go through the staging
    kw = dict(window=300, n_sink=5)
    k, v = rand_kv(rng, cache, 9)
    q = rand_q(rng, cache, 4, 9)
    out = cache.forward(q, k, v, **kw)
    mirror.append(k, v)
    assert_close(out, attention(q, mirror.k, mirror.v, **kw), dtype)
    plan = last_plan(cache)
    assert plan.cfg.kernel == "coopmat" and plan.cfg.unroll and plan._pipe.defines["COOPMAT_UNROLL"] == 1
    assert plan._pipe.defines["COOPMAT_FIXED_TRIPS"] == plan._pipe.defines["COOPMAT_STAGE_BATCH"] == 1
    assert plan.cfg.splits > 1                     # merged on the device by the last split


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_head_scales_saturation_and_subnormals(coopmat, rng, dtype):
    """fp8 on the matrices: the stored bytes staged as float16 by bit operations (e4m3's values
    times 2^-8), each kv head's K and V scale applied after the products. Scales far from 1 and
    different per head, keys that saturate (|k| / scale past the format's largest value) and keys
    whose quotients are fp8 subnormals, through a prefill and a chunk over a past split several
    ways, against the reference on the values the cache holds."""
    hkv, group, d = 2, 3, 40
    k_scale, v_scale = np.array([0.004, 3.5], np.float32), np.array([0.02, 0.75], np.float32)
    cache = vkattn.KVCache(1700, hkv, d, dtype=dtype, k_scale=k_scale, v_scale=v_scale, device=coopmat)
    k, v = rand_kv(rng, cache, 1600)
    k[0, ::5] *= 4.0 if dtype == "fp8_e4m3" else 500.0      # head 0: some keys saturate
    k[:, 3::7] *= 1e-6                                        # and some are fp8 subnormals
    v[1, ::11] *= 1e-6
    q = rand_q(rng, cache, group, 23)
    out = cache.forward(q, k[:, :23], v[:, :23])
    kk, vv = cache.read()
    assert np.array_equal(kk, round_to(k[:, :23], dtype, k_scale)) and np.array_equal(vv, round_to(v[:, :23], dtype, v_scale))
    assert_close(out, attention(q, kk, vv), dtype)
    assert last_cfg(cache).kernel == "coopmat"
    cache.append(k[:, 23:], v[:, 23:])
    k, v = rand_kv(rng, cache, 3)
    q = rand_q(rng, cache, group, 3)
    out = cache.forward(q, k, v)
    kk, vv = cache.read()
    assert_close(out, attention(q, kk, vv), dtype)
    cfg = last_cfg(cache)
    assert cfg.kernel == "coopmat" and cfg.splits > 1
    sub = np.abs(kk[kk != 0] / np.repeat(k_scale, kk.shape[1] * d).reshape(kk.shape)[kk != 0])
    assert (sub < (2.0 ** -6 if dtype == "fp8_e4m3" else 2.0 ** -14)).any()     # subnormals were there
    top = np.float32(448.0 if dtype == "fp8_e4m3" else 57344.0) * k_scale[0]
    assert (np.abs(kk[0]) == top).any()                                        # and saturated keys
    cache.close()


def test_query_scale_extremes(coopmat, rng):
    # each Q row is scaled into float16 range by a power of two: huge and tiny queries stay exact
    cache = vkattn.KVCache(64, 2, 32, device=coopmat)
    mirror = Mirror(cache)
    k, v = rand_kv(rng, cache, 40)
    cache.append(k, v)
    mirror.append(k, v)
    for factor in (3e4, 1e-6):
        q = rand_q(rng, cache, 2, 10) * np.float32(factor)
        q[0, 3] = 0.0                                        # an all-zero query row
        ref, ref_lse = attention(q, mirror.k, mirror.v, return_lse=True)
        out, lse = cache.attend(q, return_lse=True)
        assert_close(out, ref, "float16")
        np.testing.assert_allclose(lse, ref_lse, **LSE_TOL)
    assert kernels_run(cache) == {"coopmat"}


@pytest.mark.parametrize("variant", ["window", "window_sinks", "softcap", "alibi", "mask", "mask_heads", "all"])
def test_variants(coopmat, rng, variant):
    hkv, group, d, past, s = 2, 2, 24, 100, 9
    cache = vkattn.KVCache(past + s + 5, hkv, d, device=coopmat)
    mirror = Mirror(cache)
    k, v = rand_kv(rng, cache, past)
    cache.append(k, v)
    mirror.append(k, v)
    k, v = rand_kv(rng, cache, s)
    q = rand_q(rng, cache, group, s)
    kw = variant_args(variant, rng, hkv * group, s, past + s)
    out, lse = cache.forward(q, k, v, return_lse=True, **kw)
    mirror.append(k, v)
    ref, ref_lse = attention(q, mirror.k, mirror.v, return_lse=True, **kw)
    assert_close(out, ref, "float16")
    np.testing.assert_allclose(lse, ref_lse, **LSE_TOL)
    q2 = rand_q(rng, cache, group, s)
    assert_close(cache.attend(q2, causal=False, **kw), attention(q2, mirror.k, mirror.v, causal=False, **kw),
                 "float16")
    assert kernels_run(cache) == {"coopmat"}


@pytest.mark.parametrize("style,rotary_dim", [("neox", 16), ("gptj", None)])
def test_rotated_keys_and_queries(coopmat, rng, style, rotary_dim):
    d = 32
    rope = vkattn.RoPE(style=style, rotary_dim=rotary_dim)
    rdim = rope.dim(d)
    cache = vkattn.KVCache(80, 2, d, device=coopmat, rope=rope)
    k0, v0 = rand_kv(rng, cache, 50)
    cache.append(k0, v0)
    k1, v1 = rand_kv(rng, cache, 11)
    q = rand_q(rng, cache, 3, 11)
    out = cache.forward(q, k1, v1, rope_q=True)
    pos = np.arange(61)
    kr = round_to(rope.apply(np.concatenate([k0, k1], 1), pos, rdim), "float16")
    vr = round_to(np.concatenate([v0, v1], 1), "float16")
    ks, vs = cache.read()
    np.testing.assert_allclose(ks, kr, atol=1e-6, rtol=2e-3)     # a float32 rotation may fuse: an ulp
    assert np.array_equal(vs, vr)
    assert_close(out, attention(rope.apply(q, pos[50:], rdim), ks, vs), "float16")
    assert kernels_run(cache) == {"coopmat"}


class Pages:
    """Host copy of a paged cache's sequences."""

    def __init__(self, cache):
        self.c, self.k, self.v = cache, {}, {}

    def add(self, n):
        sids = [self.c.add_sequence() for _ in range(n)]
        for sid in sids:
            self.k[sid] = np.zeros((self.c.num_kv_heads, 0, self.c.head_dim), np.float32)
            self.v[sid] = np.zeros((self.c.num_kv_heads, 0, self.c.v_head_dim), np.float32)
        return sids

    def step(self, rng, sids, counts, group, **kw):
        c, total = self.c, sum(counts)
        q = rng.standard_normal((c.num_kv_heads * group, total, c.head_dim)).astype(np.float32)
        k = rng.standard_normal((c.num_kv_heads, total, c.head_dim)).astype(np.float32)
        v = rng.standard_normal((c.num_kv_heads, total, c.v_head_dim)).astype(np.float32)
        out, lse = c.forward(sids, q, k, v, n_new=counts, return_lse=True, **kw)
        a = 0
        for i, (sid, n) in enumerate(zip(sids, counts)):
            rows = slice(a, a + n)
            self.k[sid] = np.concatenate([self.k[sid], round_to(k[:, rows], c.dtype)], 1)
            self.v[sid] = np.concatenate([self.v[sid], round_to(v[:, rows], c.dtype)], 1)
            extra = dict(kw)
            if "mask" in extra:
                extra["mask"] = extra["mask"][i]
            ref, ref_lse = attention(q[:, rows], self.k[sid], self.v[sid], return_lse=True, **extra)
            assert_close(out[:, rows], ref, c.dtype)
            np.testing.assert_allclose(lse[:, rows], ref_lse, **LSE_TOL)
            a += n
        for sid in sids:
            ks, vs = c.read(sid)
            assert np.array_equal(ks, self.k[sid]) and np.array_equal(vs, self.v[sid]), f"sequence {sid}"


@pytest.mark.parametrize("block_size,dtype,slots", [(16, "float16", 496), (7, "int8", 1400)])
def test_paged_ragged_batches(coopmat, rng, monkeypatch, block_size, dtype, slots):
    monkeypatch.setattr("os.cpu_count", lambda: 8)     # CPU drivers: split-K plans want 2 workgroups a core
    cache = vkattn.PagedKVCache(-(-slots // block_size), block_size, 2, 40, dtype=dtype, device=coopmat)
    pages = Pages(cache)
    sids = pages.add(3)
    pages.step(rng, sids, [13, 1, 30], 3)              # ragged chunked prefill, one sequence of one row
    pages.step(rng, sids[::-1], [20, 5, 2], 3)         # chunks over the pasts, in another order
    child = cache.fork(sids[1])
    pages.k[child], pages.v[child] = pages.k[sids[1]].copy(), pages.v[sids[1]].copy()
    pages.step(rng, [child, sids[1]], [6, 3], 3)
    assert kernels_run(cache) == {"coopmat"}
    pages.step(rng, [sids[2]], [5], 3)                 # one sequence's chunk: few tiles over the pool,
    assert (last_cfg(cache).splits > 1) == (slots > 1024)   # whose keys the large pool splits


@pytest.mark.parametrize("variant", ["window_sinks", "mask_heads"])
def test_paged_variants(coopmat, rng, variant):
    cache = vkattn.PagedKVCache(30, 16, 2, 24, device=coopmat)
    pages = Pages(cache)
    sids = pages.add(3)
    counts = [20, 3, 31]
    kw = {"window_sinks": dict(window=19, n_sink=2),
          "mask_heads": dict(mask=[rng.standard_normal((4, n, n)).astype(np.float32) for n in counts])}[variant]
    pages.step(rng, sids, counts, 2, **kw)
    assert kernels_run(cache) == {"coopmat"}


# ------------------------------------------------------------------ fallbacks (on the device)

def test_fallbacks_float32_and_decode(coopmat, rng):
    # float32 storage and decode do not take the cooperative-matrix kernel: the device's other one
    other = tuning.kernel_for(coopmat)
    cache = vkattn.KVCache(60, 2, 16, dtype="float32", device=coopmat)
    mirror = Mirror(cache)
    k, v = rand_kv(rng, cache, 20)
    q = rand_q(rng, cache, 2, 20)
    out = cache.forward(q, k, v)
    mirror.append(k, v)
    assert_close(out, mirror.ref(q), "float32")
    assert kernels_run(cache) == {other}
    cache16 = vkattn.KVCache(60, 2, 16, device=coopmat)
    mirror = Mirror(cache16)
    k, v = rand_kv(rng, cache16, 20)
    cache16.append(k, v)
    mirror.append(k, v)
    q = rand_q(rng, cache16, 2, 1)
    assert_close(cache16.attend(q), mirror.ref(q), "float16")
    assert kernels_run(cache16) == {other}


def test_self_test_ran_and_passed(coopmat):
    # the fixture's coopmat_problem() ran the device's self-test (once) before any plan used the kernel
    assert coopmat._coopmat_test_result == ""
    assert len(vkattn.measure.COOPMAT_CASES) >= 7 and coopmat.coopmat_problem() == ""


def test_self_test_cases_each_pass_and_the_long_ones_split(coopmat, monkeypatch):
    # every case afresh (not the disk cache's verdict): the long ones check >= 3 splits themselves
    monkeypatch.setenv("VKATTN_MEASURE_CACHE", "0")
    rng = np.random.default_rng(5)
    with tuning.kernel_forced("coopmat"):
        for name, case in vkattn.measure.COOPMAT_CASES:
            case(coopmat, rng)


@pytest.mark.parametrize("case, trigger", [
    ("float16 long chunk", lambda kw, k: k.shape[1] > 1000 and k.shape[2] == 64),
    ("float16 window + sinks", lambda kw, k: kw.get("window") == 97),
])
def test_a_failed_case_is_named(coopmat, monkeypatch, case, trigger):
    # the reference perturbed for one case's calls only: the verdict names that case
    monkeypatch.setenv("VKATTN_MEASURE_CACHE", "0")
    monkeypatch.setattr(coopmat, "_coopmat_test_result", None)
    monkeypatch.setattr(coopmat, "_coopmat_broken", "", raising=False)
    real = vkattn.reference.attention

    def wrong(q, k, v, *a, **kw):
        out = real(q, k, v, *a, **kw)
        return out + np.float32(0.01) if trigger(kw, k) else out
    monkeypatch.setattr(vkattn.reference, "attention", wrong)
    problem = coopmat.coopmat_problem()
    assert problem.startswith(f"its self-test case '{case}"), problem
    assert "wrong results" in problem


def test_self_test_failure_keeps_the_kernel_off(coopmat, rng, monkeypatch):
    # a device whose matrices give wrong results: the self-test names the case, the default planner
    # would fall back and VKATTN_KERNEL=coopmat raises; the cache loses nothing
    monkeypatch.setenv("VKATTN_MEASURE_CACHE", "0")
    monkeypatch.setattr(coopmat, "_coopmat_test_result", None)
    monkeypatch.setattr(coopmat, "_coopmat_broken", "", raising=False)
    real = vkattn.reference.attention
    monkeypatch.setattr(vkattn.reference, "attention", lambda *a, **kw: real(*a, **kw) + np.float32(0.01))
    problem = coopmat.coopmat_problem()
    assert problem.startswith("its self-test case 'float16 prefill + chunk, d40, 3 q heads per kv head' failed: "
                              "float16 19 rows over 0 cached: wrong results"), problem
    assert coopmat.coopmat_problem() == problem               # not run again
    cache = vkattn.KVCache(40, 1, 16, device=coopmat)
    k, v = rand_kv(rng, cache, 10)
    with pytest.raises(ValueError, match="VKATTN_KERNEL=coopmat: its self-test case 'float16 prefill"):
        cache.forward(rand_q(rng, cache, 2, 10), k, v)
    assert cache.length == 0
    monkeypatch.delenv("VKATTN_KERNEL")
    monkeypatch.setattr(tuning, "COOPMAT_DEFAULT", True)
    monkeypatch.setattr(type(coopmat), "is_software", property(lambda self: False))
    assert not tuning.coopmat_wanted(coopmat)                 # the default: the other kernel


def test_speed_probe_times_both_kernels_and_decides_the_default(coopmat, monkeypatch):
    """Device.coopmat_speed: the probe's prefill runs on attn_coopmat.comp and on the device's other
    kernel, timed (device time where the device has timestamps); coopmat_pays compares them, and
    on a GPU (is_software patched off where the device is a CPU driver) that verdict is the
    default's; a CPU driver never takes it by default. The probe leaves the
    forced kernel as it was. (Which kernel is faster on lavapipe is not asserted: a timing.)"""
    monkeypatch.setenv("VKATTN_MEASURE_CACHE", "0")
    monkeypatch.setattr(coopmat, "_coopmat_speed", None)
    speed = coopmat.coopmat_speed()
    assert "error" not in speed, speed
    with tuning.kernel_forced(""):
        other = tuning.kernel_for(coopmat)
    assert speed["other"] == other and set(speed) == {"coopmat", other, "other", "clock"}
    assert all(np.isfinite(speed[k]) and speed[k] > 0 for k in ("coopmat", other))
    assert speed["clock"] == ("device" if coopmat.info.timestamp_compute_and_graphics else "wall")
    assert os.environ["VKATTN_KERNEL"] == "coopmat" and coopmat.coopmat_speed() is speed      # once
    assert coopmat.coopmat_pays() == (speed["coopmat"] <= tuning.COOPMAT_MARGIN * speed[other])
    monkeypatch.delenv("VKATTN_KERNEL")
    if coopmat.is_software:
        assert not tuning.coopmat_wanted(coopmat)       # a CPU driver: never by default
        assert "a CPU driver" in tuning.coopmat_choice(coopmat)
    monkeypatch.setattr(type(coopmat), "is_software", property(lambda self: False))
    assert tuning.coopmat_wanted(coopmat) == coopmat.coopmat_pays()
    assert f"{speed['coopmat']:.3f} ms" in tuning.coopmat_choice(coopmat)


def test_speed_probe_checks_its_result(coopmat, monkeypatch):
    # a kernel whose 512-row prefill is wrong is not timed, let alone picked: the probe says which
    monkeypatch.setenv("VKATTN_MEASURE_CACHE", "0")
    monkeypatch.setattr(coopmat, "_coopmat_speed", None)
    real = vkattn.reference.attention
    monkeypatch.setattr(vkattn.reference, "attention", lambda *a, **kw: real(*a, **kw) * np.float32(1.01))
    speed = coopmat.coopmat_speed()
    assert "error" in speed and "the probe's prefill on coopmat: wrong results" in speed["error"], speed
    assert not coopmat.coopmat_pays()


def test_default_takes_it_where_the_probe_says_it_pays(coopmat, rng, monkeypatch):
    # the default path end to end on a real implementation: a GPU (is_software patched off) whose
    # probe timed the kernel faster -- prefill and chunk on attn_coopmat.comp, decode on the other
    # kernel, every result against the reference; timed slower, nothing on it
    monkeypatch.delenv("VKATTN_KERNEL")
    monkeypatch.setattr(type(coopmat), "is_software", property(lambda self: False))
    for pays in (True, False):
        monkeypatch.setattr(coopmat, "_coopmat_speed", {"coopmat": 1.0 if pays else 2.0, "other": "tile",
                                                        "tile": 1.5, "clock": "device"})
        cache = vkattn.KVCache(64, 2, 24, dtype="float16", device=coopmat)
        mirror = Mirror(cache)
        for n in (21, 6, 1):
            k, v = rand_kv(rng, cache, n)
            q = rand_q(rng, cache, 3, n)
            out = cache.forward(q, k, v)
            mirror.append(k, v)
            assert_close(out, mirror.ref(q), "float16")
            assert last_cfg(cache).kernel == ("coopmat" if pays and n > 1 else "tile")
        cache.close()


@pytest.mark.parametrize("speed,pays", [
    ({"coopmat": 0.89, "other": "tile", "tile": 1.0, "clock": "device"}, True),
    ({"coopmat": 0.95, "other": "tile", "tile": 1.0, "clock": "device"}, False),      # a near tie
    ({"coopmat": 3.0, "other": "lane", "lane": 1.0, "clock": "wall"}, False),
    ({"error": "DeviceLimitError: too big"}, False),
])
def test_the_default_follows_the_probe(device, monkeypatch, speed, pays):
    # no device work: the probe's figures given, the verdict and the planner's choice on a GPU
    gpu = planning(device, monkeypatch, **GPU)
    monkeypatch.delenv("VKATTN_KERNEL", raising=False)
    monkeypatch.setattr(device, "_coopmat_speed", speed)
    assert device.coopmat_pays() == pays
    monkeypatch.setattr(gpu, "coopmat_pays", device.coopmat_pays)
    monkeypatch.setattr(gpu, "_coopmat_speed", speed, raising=False)
    fmt = StorageFormat(8, 128, dtype="float16")
    assert attn_pipeline(gpu, fmt, 32, 64, 0, 1, 0, 4096, False)[0].kernel == ("coopmat" if pays else "tile")
    line = tuning.coopmat_choice(gpu)
    assert line.startswith("attn_coopmat.comp" if pays else "attn.comp")
    assert ("could not run: DeviceLimitError" in line) if "error" in speed else (f"{speed['coopmat']:.3f} ms" in line)


def test_forcing_it_where_it_cannot_run_is_a_clear_error(device, rng, monkeypatch):
    """VKATTN_KERNEL=coopmat on a device or compiler without cooperative matrices: a ValueError
    naming the reason, and the cache unchanged. (Where the kernel runs, forcing it works.)"""
    monkeypatch.setenv("VKATTN_KERNEL", "coopmat")
    cache = vkattn.KVCache(40, 1, 16, device=device)
    k, v = rand_kv(rng, cache, 10)
    q = rand_q(rng, cache, 2, 10)
    problem = device.coopmat_problem()
    if not problem:
        cache.forward(q, k, v)
        assert cache.length == 10 and kernels_run(cache) == {"coopmat"}
        return
    with pytest.raises(ValueError, match="VKATTN_KERNEL=coopmat: .+"):
        cache.forward(q, k, v)
    assert cache.length == 0


# ------------------------------------------------------------------ the planner, no device needed

def planning(device, monkeypatch, **fields):
    """A PlanningDevice like ``device`` with the given DeviceInfo fields, whose compiler is taken
    to build GL_KHR_cooperative_matrix (these tests check the planner, not glslang)."""
    monkeypatch.setattr("vkattn.compiler.coopmat_compiler_problem", lambda: "")
    base = dict(cooperative_matrix=True, coopmat_stages=tuning.COMPUTE_STAGE, shader_float16=True,
                vulkan_memory_model=True, vulkan_memory_model_device_scope=True, subgroup_size_control=True,
                compute_full_subgroups=True, required_subgroup_size_stages=tuning.COMPUTE_STAGE,
                subgroup_supported_operations=0xff, subgroup_supported_stages=tuning.COMPUTE_STAGE)
    base.update(fields)
    return PlanningDevice(dataclasses.replace(device.info, **base))


GPU = dict(device_type="discrete_gpu", name="a GPU", subgroup_size=64, min_subgroup_size=32, max_subgroup_size=64,
           max_compute_shared_memory_size=65536,
           coopmat_shapes=("16x16x16 f16 f16 f16 f16 subgroup", "16x16x16 f16 f16 f32 f32 subgroup",
                           "16x16x16 s8 s8 s32 s32 subgroup"))


def test_planner_picks_coopmat_for_prefill_on_a_gpu_that_can(device, monkeypatch):
    monkeypatch.delenv("VKATTN_KERNEL", raising=False)
    gpu = planning(device, monkeypatch, **GPU)
    assert gpu.coopmat_problem() == "" and gpu.coopmat_shape() == (16, 16, 16) and gpu.coopmat_subgroup() == 32
    fmt = StorageFormat(8, 128, dtype="float16")
    # by default where the speed probe timed it faster: a planning device times nothing (attn.comp);
    # VKATTN_KERNEL=coopmat forces it without a probe
    assert tuning.COOPMAT_DEFAULT and not gpu.coopmat_pays()
    assert attn_pipeline(gpu, fmt, 32, 64, 0, 1, 0, 4096, False)[0].kernel == "tile"
    monkeypatch.setenv("VKATTN_KERNEL", "coopmat")
    assert attn_pipeline(gpu, fmt, 32, 64, 0, 1, 0, 4096, False)[0].kernel == "coopmat"
    monkeypatch.delenv("VKATTN_KERNEL")
    monkeypatch.setattr(gpu, "coopmat_pays", lambda: True)
    for rows in (2, 17, 512):
        cfg, pipe = attn_pipeline(gpu, fmt, 32, rows, 0, 1, 0, 4096, False)
        assert cfg.kernel == "coopmat" and pipe.shader == "attn_coopmat" and cfg.sg == 32
        assert cfg.wg == tuning.COOPMAT_SUBGROUPS * 32 and cfg.br % 16 == 0 and cfg.br >= 4 * cfg.bq
        assert cfg.bc % 16 == 0 and cfg.bc % (8 * cfg.tpr) == 0 and cfg.tpr == 2 and pipe.defines["COOPMAT_UNROLL"] == 1
        assert len(pipe.spec) == 16
        assert tuning.coopmat_shared_bytes(cfg.br, cfg.bc, fmt._dk4, fmt._dv4, fmt._ch, cfg.mnk,
                                           tuning.COOPMAT_SUBGROUPS) <= gpu.max_shared_memory
    # decode stays on attn.comp; float32 storage falls back to it
    assert attn_pipeline(gpu, fmt, 32, 1, 0, 1, 0, 4096, True)[0].kernel == "tile"
    f32 = StorageFormat(8, 128, dtype="float32")
    assert attn_pipeline(gpu, f32, 32, 64, 0, 1, 0, 4096, False)[0].kernel == "tile"
    i8 = StorageFormat(8, 128, dtype="int8")
    assert attn_pipeline(gpu, i8, 32, 64, 0, 1, 0, 4096, False)[0].kernel == "coopmat"
    # VKATTN_KERNEL=tile keeps attn.comp everywhere; COOPMAT_DEFAULT off too
    monkeypatch.setenv("VKATTN_KERNEL", "tile")
    assert attn_pipeline(gpu, fmt, 32, 64, 0, 1, 0, 4096, False)[0].kernel == "tile"
    monkeypatch.delenv("VKATTN_KERNEL")
    monkeypatch.setattr(tuning, "COOPMAT_DEFAULT", False)
    assert attn_pipeline(gpu, fmt, 32, 64, 0, 1, 0, 4096, False)[0].kernel == "tile"


def test_forward_appends_first_where_coopmat_takes_the_call(device, monkeypatch):
    # attn_coopmat.comp has no fused append: a forward it takes appends its rows in a submission of
    # its own first (more than one query row, float16, int8 or fp8); decode and float32 still fuse
    from vkattn._base import appends_first
    gpu = planning(device, monkeypatch, **GPU)
    monkeypatch.delenv("VKATTN_KERNEL", raising=False)
    assert not appends_first(gpu, 5, 5, 2)
    monkeypatch.setenv("VKATTN_KERNEL", "coopmat")
    assert appends_first(gpu, 5, 5, 2) and appends_first(gpu, 2, 2, 4)
    assert not appends_first(gpu, 1, 1, 2) and not appends_first(gpu, 5, 5, 1) and not appends_first(gpu, 0, 5, 2)
    assert appends_first(gpu, 33, 1, 2)           # over FUSED_APPEND_MAX_ROWS: always


def test_planner_takes_a_swept_tile(device, monkeypatch):
    # VKATTN_COOPMAT_TILE="NSG,KT" (a GPU session's coopsweep step): NSG subgroups of 32, one row
    # tile each, and KT matrix sides of keys per block, still halved to what the shared memory holds
    monkeypatch.setenv("VKATTN_KERNEL", "coopmat")
    gpu = planning(device, monkeypatch, **dict(GPU, max_compute_shared_memory_size=49152))   # NVIDIA's 48 KiB
    fmt = StorageFormat(8, 128, dtype="float16")
    assert tuning.coopmat_tile() == (tuning.COOPMAT_SUBGROUPS, tuning.COOPMAT_KEY_TILES)
    # ("4,4" and "1,4": 64 keys a block would pass 48 KiB and COOPMAT_SHARED_BUDGET's 32 KiB: halved)
    for env, nsg, bc in (("2,2", 2, 32), ("2,1", 2, 16), ("4,4", 4, 32), ("1,4", 1, 32)):
        monkeypatch.setenv("VKATTN_COOPMAT_TILE", env)
        cfg, pipe = attn_pipeline(gpu, fmt, 32, 512, 0, 1, 0, 4096, False)
        assert cfg.kernel == "coopmat" and (cfg.wg, cfg.br, cfg.bc) == (nsg * 32, nsg * 16, bc), env
        assert tuning.coopmat_shared_bytes(cfg.br, cfg.bc, fmt._dk4, fmt._dv4, fmt._ch, cfg.mnk, nsg) <= 49152
    # 8 subgroups: Q's lo rows alone pass 48 KiB at d128 -- the stated fallback, attn.comp
    monkeypatch.setenv("VKATTN_COOPMAT_TILE", "8,1")
    assert attn_pipeline(gpu, fmt, 32, 512, 0, 1, 0, 4096, False)[0].kernel == "tile"
    for bad in ("3,2", "4", "4,8", "x,y"):
        monkeypatch.setenv("VKATTN_COOPMAT_TILE", bad)
        with pytest.raises(ValueError, match="VKATTN_COOPMAT_TILE"):
            attn_pipeline(gpu, fmt, 32, 512, 0, 1, 0, 4096, False)


@pytest.mark.parametrize("tile", ["2,4", "8,1", "1,2"])
def test_other_tiles_keep_parity(coopmat, rng, monkeypatch, tile):
    """The kernel at tiles a GPU sweep may pick (VKATTN_COOPMAT_TILE): more or fewer subgroups per
    workgroup, more keys per block; a prefill and a chunk over a past split several ways, int8's
    scales and a window with sinks on the way."""
    monkeypatch.setenv("VKATTN_COOPMAT_TILE", tile)
    nsg, kt = map(int, tile.split(","))
    for dtype in ("float16", "int8"):
        cache = vkattn.KVCache(700, 2, 40, dtype=dtype, device=coopmat)
        mirror = Mirror(cache)
        k, v = rand_kv(rng, cache, 650)
        q = rand_q(rng, cache, 2, 650)
        assert_close(cache.forward(q, k, v), attention(q, round_to(k, dtype), round_to(v, dtype)), dtype)
        mirror.append(k, v)
        cfg = last_cfg(cache)
        assert cfg.kernel == "coopmat" and cfg.wg == nsg * cfg.sg
        k, v = rand_kv(rng, cache, 3)
        q = rand_q(rng, cache, 2, 3)
        out = cache.forward(q, k, v, window=200, n_sink=3)
        mirror.append(k, v)
        assert_close(out, attention(q, mirror.k, mirror.v, window=200, n_sink=3), dtype)
        assert last_cfg(cache).splits > 1
        cache.close()


def test_planner_falls_back_where_the_tile_does_not_fit(device, monkeypatch):
    monkeypatch.delenv("VKATTN_KERNEL", raising=False)
    small = planning(device, monkeypatch, **dict(GPU, max_compute_shared_memory_size=40960))
    fmt = StorageFormat(1, 128, dtype="float16")
    big = tuning.coopmat_config(planning(device, monkeypatch, **GPU), 1, 64, fmt._dk4, fmt._dv4, fmt._ch, 4096, 1)
    # head_dim 128: even 16 keys per block pass COOPMAT_SHARED_BUDGET, so the device's limit
    # decides: 32 keys within 64 KiB (64 would pass it), 16 within 40 KiB
    assert (big.br, big.bc) == (64, 32)
    assert tuning.coopmat_shared_bytes(64, 64, fmt._dk4, fmt._dv4, fmt._ch, big.mnk, 4) > 65536
    cfg = tuning.coopmat_config(small, 1, 64, fmt._dk4, fmt._dv4, fmt._ch, 4096, 1)
    assert (cfg.br, cfg.bc) == (64, 16)
    assert tuning.coopmat_shared_bytes(cfg.br, cfg.bc, fmt._dk4, fmt._dv4, fmt._ch, cfg.mnk,
                                       tuning.COOPMAT_SUBGROUPS) <= 40960
    # head_dim 64: within the budget
    f64 = StorageFormat(1, 64, dtype="float16")
    cfg = tuning.coopmat_config(small, 1, 64, f64._dk4, f64._dv4, f64._ch, 4096, 1)
    assert tuning.coopmat_shared_bytes(cfg.br, cfg.bc, f64._dk4, f64._dv4, f64._ch, cfg.mnk,
                                       tuning.COOPMAT_SUBGROUPS) <= tuning.COOPMAT_SHARED_BUDGET
    # head_dim 256: over COOPMAT_MAX_DIM (a subgroup's Q and O registers); 128 query heads per kv
    # head: more than the workgroup's 64 matrix rows. Both go to attn.comp
    wide = StorageFormat(1, 256)
    assert tuning.coopmat_config(small, 4, 64, wide._dk4, wide._dv4, wide._ch, 4096, 1) is None
    assert attn_pipeline(small, wide, 4, 64, 0, 1, 0, 4096, False)[0].kernel == "tile"
    assert tuning.coopmat_config(small, 128, 64, fmt._dk4, fmt._dv4, fmt._ch, 4096, 1) is None
    assert attn_pipeline(small, fmt, 128, 64, 0, 1, 0, 4096, False)[0].kernel == "tile"


@pytest.mark.parametrize("fields,reason", [
    (dict(cooperative_matrix=False), "does not offer VK_KHR_cooperative_matrix"),
    (dict(coopmat_shapes=("32x32x8 f16 f16 f32 f32 subgroup",)), "lists no float16"),
    (dict(coopmat_shapes=("16x16x16 f16 f16 f32 f32 workgroup",)), "lists no float16"),
    (dict(coopmat_shapes=("16x16x16 f16 f16 f16 f16 subgroup",)), "lists no float16"),
    (dict(vulkan_memory_model=False), "vulkanMemoryModel"),
    (dict(compute_full_subgroups=False), "computeFullSubgroups"),
    (dict(required_subgroup_size_stages=0), "cannot pin"),
])
def test_planner_names_what_is_missing(device, monkeypatch, fields, reason):
    gpu = planning(device, monkeypatch, **dict(GPU, **fields))
    assert reason in gpu.coopmat_problem()
    fmt = StorageFormat(2, 64)
    monkeypatch.delenv("VKATTN_KERNEL", raising=False)
    assert attn_pipeline(gpu, fmt, 4, 64, 0, 1, 0, 4096, False)[0].kernel == "tile"
    monkeypatch.setenv("VKATTN_KERNEL", "coopmat")
    with pytest.raises(ValueError, match="VKATTN_KERNEL=coopmat: .*" + reason):
        attn_pipeline(gpu, fmt, 4, 64, 0, 1, 0, 4096, False)


def test_a_device_of_one_subgroup_size_runs_the_kernel_unpinned(device, monkeypatch):
    """NVK (Mesa 26.1 on an Ampere, perf/gpu_report_nvk.md) lists no stage in
    requiredSubgroupSizeStages and has subgroups of 32 only: the kernel needs no pin there, and a
    required size would be invalid usage. Its pipelines ask for full subgroups alone."""
    nvk = planning(device, monkeypatch, **dict(GPU, name="NVK", subgroup_size=32, min_subgroup_size=32,
                                               max_subgroup_size=32, required_subgroup_size_stages=0))
    assert nvk.coopmat_problem() == "" and nvk.coopmat_subgroup() == 32 and nvk.coopmat_pin() == (0, True)
    monkeypatch.setenv("VKATTN_KERNEL", "coopmat")
    cfg, pipe = attn_pipeline(nvk, StorageFormat(2, 64, dtype="float16"), 4, 64, 0, 1, 0, 4096, False)
    assert cfg.kernel == "coopmat" and cfg.sg == 32 and pipe.defines["COOPMAT_FIXED_TRIPS"] == 1 \
        and pipe.defines["COOPMAT_STAGE_BATCH"] == 1
    # where the device can pin (the GPU above), it does; sizes 32..64 without a pin: no kernel
    assert planning(device, monkeypatch, **GPU).coopmat_pin() == (32, True)
    wide = planning(device, monkeypatch, **dict(GPU, required_subgroup_size_stages=0))
    assert "not always 32" in wide.coopmat_problem()
    monkeypatch.setenv("VKATTN_COOPMAT_FIXED_TRIPS", "0")
    monkeypatch.setenv("VKATTN_COOPMAT_STAGE_BATCH", "0")
    defines = attn_pipeline(nvk, StorageFormat(2, 64, dtype="float16"), 4, 64, 0, 1, 0, 4096, False)[1].defines
    assert defines["COOPMAT_FIXED_TRIPS"] == 0 and defines["COOPMAT_STAGE_BATCH"] == 0
    monkeypatch.setenv("VKATTN_COOPMAT_FIXED_TRIPS", "yes")
    with pytest.raises(ValueError, match="VKATTN_COOPMAT_FIXED_TRIPS='yes'"):
        attn_pipeline(nvk, StorageFormat(2, 64, dtype="float16"), 4, 64, 0, 1, 0, 4096, False)


def test_planner_leaves_cpu_drivers_on_their_kernel_unless_forced(device, monkeypatch):
    monkeypatch.delenv("VKATTN_KERNEL", raising=False)
    # a 256-bit llvmpipe whatever this host's width (at 512 bits vkattn refuses its matrices:
    # _driverfix.coopmat_fault, tested in test_driverfix.py)
    cpu = planning(device, monkeypatch, device_type="cpu", name="llvmpipe (LLVM 19.1.7, 256 bits)",
                   subgroup_size=8, min_subgroup_size=8, max_subgroup_size=8,
                   coopmat_shapes=("8x8x8 f16 f16 f32 f32 subgroup",))
    assert cpu.coopmat_problem() == "" and cpu.coopmat_subgroup() == 8
    fmt = StorageFormat(2, 64)
    assert attn_pipeline(cpu, fmt, 4, 64, 0, 1, 0, 4096, False)[0].kernel != "coopmat"
    monkeypatch.setenv("VKATTN_KERNEL", "coopmat")
    cfg, pipe = attn_pipeline(cpu, fmt, 4, 64, 0, 1, 0, 4096, False)
    assert cfg.kernel == "coopmat" and cfg.mnk == (8, 8, 8) and cfg.sg == 8 and pipe.defines["COOPMAT_UNROLL"] == 0


def test_kernel_switch_is_validated(device, monkeypatch):
    monkeypatch.setenv("VKATTN_KERNEL", "matrix")
    with pytest.raises(ValueError, match="VKATTN_KERNEL='matrix': expected 'tile', 'lane' or 'coopmat'"):
        tuning.forced_kernel()


SHADER = os.path.join(os.path.dirname(__file__), "..", "shaders", "attn_coopmat.comp")


@pytest.mark.parametrize("shapes", [GPU["coopmat_shapes"], ("8x8x8 f16 f16 f32 f32 subgroup",)],
                         ids=["16x16x16", "8x8x8"])
def test_matrix_memory_is_whole_words_and_words_have_one_writer(device, monkeypatch, shapes):
    """What a GPU requires and lavapipe forgives: every cooperative-matrix load and store goes
    through the one shared uvec4 array (16-byte elements: each matrix starts on a 16-byte
    boundary, VUID-RuntimeSpirv-OpCooperativeMatrixLoadKHR-08986, whatever the driver's layout of
    shared variables), no shared array has 16-bit elements (no invocation stores half of a 32-bit
    word), and every planned tile lets each softmax lane own whole words of P: runs of 8 columns
    (8 * TPR divides BC), the lanes of a subgroup covering its M rows (SG <= M * TPR)."""
    src = open(SHADER).read()
    decls = re.findall(r"^shared\s+(\w+)\s+(\w+)\[(.+?)\];", src, re.M)
    types = {name: typ for typ, name, _ in decls}
    targets = set(re.findall(r"coopMat(?:Load|Store)\(\w+(?:\[\w+\])?,\s*(\w+),", src))
    assert targets == {"s_mem"} and types["s_mem"] == "uvec4"
    assert not any("16" in typ for typ in types.values()), types
    gpu = planning(device, monkeypatch, **dict(GPU, coopmat_shapes=shapes))
    seen = 0
    for dtype in ("float16", "int8"):
        for head_dim, v_dim in ((64, 64), (72, 72), (128, 128), (256, 256), (80, 112), (5, 3)):
            fmt = StorageFormat(head_dim, v_dim, dtype=dtype)
            for group, rows in ((1, 7), (4, 512), (7, 33), (64, 2)):
                cfg = tuning.coopmat_config(gpu, group, rows, fmt._dk4, fmt._dv4, fmt._ch, 4096, 2)
                if cfg is None:
                    assert head_dim == 256 or group > tuning.COOPMAT_SUBGROUPS * gpu.coopmat_shape()[0]
                    continue
                seen += 1
                mm, mn, mk = cfg.mnk
                assert cfg.bc % (8 * cfg.tpr) == 0 and cfg.bc % mn == 0 and cfg.bc % mk == 0
                assert cfg.br == tuning.COOPMAT_SUBGROUPS * mm and group * cfg.bq <= cfg.br
                assert cfg.sg <= mm * cfg.tpr and cfg.sg % cfg.tpr == 0
                assert tuning.coopmat_shared_bytes(cfg.br, cfg.bc, fmt._dk4, fmt._dv4, fmt._ch, cfg.mnk,
                                                   tuning.COOPMAT_SUBGROUPS) <= gpu.max_shared_memory
    assert seen >= 30

