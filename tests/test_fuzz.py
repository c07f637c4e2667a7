"""Property-based tests (hypothesis): parity fuzz of append / attend / forward / truncate against
the numpy reference on both attention kernels, and malformed-input fuzz (typed errors that name the
argument, cache byte-identical afterwards).

Bounded for lavapipe: every distinct (kernel, GQA group, query tile, head dims, dtype, splits, ...)
compiles a pipeline (~0.3-2 s cold, then cached on disk by Mesa), so
shapes come from a small fixed menu and the example counts below are modest. ``derandomize=True`` makes every run test the same
examples, so a warm run re-uses the Mesa pipeline cache.
"""
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vkattn
from vkattn import tuning
from conftest import Mirror, assert_close, assert_unchanged, snapshot
from vkattn.checks import FP16_MAX

# Example counts, visible in the settings of each test (and with --hypothesis-show-statistics).
PARITY_EXAMPLES = 32
MALFORMED_EXAMPLES_PER_KIND = 10  # test_malformed_input is parametrized over MALFORMED_KINDS

# (head_dim, v_head_dim): odd and even, 8..256, v_head_dim equal to or different from head_dim.
HEAD_DIMS = [(8, 8), (13, 13), (64, 64), (100, 72), (128, 128), (256, 256)]
DTYPES = ["float16", "float32"]
KERNELS = ["lane", "tile"]
MAX_QO_HEADS = 16
MAX_QUERY_ROWS = 24

_COMMON = dict(deadline=None, derandomize=True, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _not_pow2(c):
    return c == 1 or c & (c - 1) != 0


def _layout(rng, shape, dtype, strided, amp=1.0):
    """A normal(0, amp) array of ``shape`` in ``dtype``; with ``strided`` a non-contiguous view."""
    if not strided:
        return (amp * rng.standard_normal(shape)).astype(dtype)
    h, n, d = shape
    x = np.swapaxes((amp * rng.standard_normal((n, h, d))).astype(dtype), 0, 1)   # same shape, other strides
    assert x.shape == shape and (h == 1 or n == 1 or not x.flags.c_contiguous)
    return x


# --------------------------------------------------------------------------------------- parity


@settings(max_examples=PARITY_EXAMPLES, **_COMMON)
@given(data=st.data())
def test_parity_fuzz(data):
    """A random sequence of append+attend / forward / truncate on a fresh cache matches a host
    mirror: every result within reference.TOLERANCE, read() bit-exact after every step."""
    draw = data.draw
    device = vkattn.default_device()
    # attn_lane.comp runs only where a subgroup of at most 16 shuffles (CPU drivers); a GPU draws tile
    kernel = draw(st.sampled_from([k for k in KERNELS if k != "lane" or device.lane_subgroup()]), label="kernel")
    hkv = draw(st.integers(1, 3), label="num_kv_heads")
    d, dv = draw(st.sampled_from(HEAD_DIMS), label="(head_dim, v_head_dim)")
    group = draw(st.sampled_from([g for g in (1, 2, 4, 8) if hkv * g <= MAX_QO_HEADS]), label="group")
    max_rows = MAX_QUERY_ROWS
    dtype = draw(st.sampled_from(DTYPES), label="dtype")
    capacity = draw(st.integers(1, 400).filter(_not_pow2), label="capacity")
    seed = draw(st.integers(0, 2**32 - 1), label="seed")
    n_steps = draw(st.integers(1, 5), label="steps")
    rng = np.random.default_rng(seed)

    with tuning.kernel_forced(kernel), vkattn.KVCache(capacity, hkv, d, dv, dtype=dtype, device=device) as cache:
        mirror = Mirror(cache)
        for step in range(n_steps):
            length, free = cache.length, capacity - cache.length
            ops = []
            if free > 0:
                ops += ["append+attend", "forward"]
            elif length > 0:
                ops += ["attend"]
            if length > 0:
                ops += ["truncate"]
            op = draw(st.sampled_from(ops), label=f"op{step}")

            if op == "truncate":
                to = draw(st.integers(0, length), label=f"truncate_to{step}")
                cache.truncate(to)
                mirror.truncate(to)
            else:
                n = 0 if op == "attend" else draw(st.integers(1, min(free, 64)), label=f"n{step}")
                in_dtype = draw(st.sampled_from([np.float32, np.float16]), label=f"input_dtype{step}")
                strided = draw(st.booleans(), label=f"strided{step}")
                total = length + n
                s = draw(st.integers(1, min(total, max_rows)), label=f"s{step}")
                causal = draw(st.booleans(), label=f"causal{step}")
                # explicit scales are multiples of the default 1/sqrt(head_dim): logits stay O(amp), where
                # the stated tolerance is meaningful (at logit std ~80 -- e.g. scale 1.7, head_dim 256 --
                # the float32 numpy reference itself is off the float64 result by ~0.5x the tolerance)
                factor = draw(st.sampled_from([None, None, 0.3, 1.7]), label=f"scale_factor{step}")
                scale = None if factor is None else factor / float(np.sqrt(d))
                amp = draw(st.sampled_from([1.0, 1.0, 3.0]), label=f"q_amplitude{step}")
                q = _layout(rng, (hkv * group, s, d), in_dtype, strided, amp)
                if n:
                    k = _layout(rng, (hkv, n, d), in_dtype, strided)
                    v = _layout(rng, (hkv, n, dv), in_dtype, strided)
                if op == "forward":
                    out = cache.forward(q, k, v, causal=causal, scale=scale)
                    mirror.append(k, v)
                else:
                    if n:
                        cache.append(k, v)
                        mirror.append(k, v)
                    out = cache.attend(q, causal=causal, scale=scale)
                assert out.shape == (hkv * group, s, dv)
                assert_close(out, mirror.ref(q, causal, scale), dtype)

            assert cache.length == mirror.k.shape[1]
            kk, vv = cache.read()
            assert kk.shape == mirror.k.shape and vv.shape == mirror.v.shape
            assert np.array_equal(kk, mirror.k) and np.array_equal(vv, mirror.v)


# ------------------------------------------------------------------------------------ malformed

MH_DIMS = [(8, 8), (13, 5)]   # small fixed menu for the malformed-input cache
M_CAPACITY = 37
M_GROUP = 2


class Case:
    """One malformed call: ``call()`` must raise ``exc`` with a message matching ``pattern``
    (re.match: anchored at the start, so the message must begin with the argument's name)."""

    def __init__(self, call, exc, pattern, what):
        self.call, self.exc, self.pattern, self.what = call, exc, pattern, what


def _bad_dtype_array(draw, shape):
    dt = draw(st.sampled_from([np.int32, np.float64, np.bool_, np.int8, np.uint16, np.complex64]),
              label="bad dtype")
    return np.ones(shape, dtype=dt)


def _other_than(draw, lo, hi, avoid, label):
    """An int in [lo, hi] other than ``avoid`` (lo <= avoid <= hi), without a rejection filter."""
    x = draw(st.integers(lo, hi - 1), label=label)
    return x + 1 if x >= avoid else x


def _with_value(draw, x, value, label):
    x = np.array(x, copy=True)
    idx = tuple(draw(st.integers(0, s - 1), label=f"{label} index{i}") for i, s in enumerate(x.shape))
    x[idx] = value
    return x


def _kv_case(draw, cache, kind):
    """A bad k or v for append or forward; everything else valid (n fits, q rows fit)."""
    hkv, d, dv = cache.num_kv_heads, cache.head_dim, cache.v_head_dim
    free = cache.capacity - cache.length
    target = draw(st.sampled_from(["k", "v"]), label="target")
    call = draw(st.sampled_from(["append", "forward"]), label="call")
    n = draw(st.integers(1, max(1, free)), label="n")
    dims = {"k": d, "v": dv}
    good = {a: np.full((hkv, n, dims[a]), 0.5, np.float32) for a in ("k", "v")}
    bad = dict(good)
    exc, pattern = ValueError, re.escape(target) + r": expected shape"
    if kind == "not_ndarray":
        conv = draw(st.sampled_from(["list", "tuple", "scalar", "none"]), label="conversion")
        bad[target] = {"list": good[target].tolist(), "tuple": tuple(good[target].tolist()),
                       "scalar": 0.5, "none": None}[conv]
        exc, pattern = TypeError, re.escape(target) + r": expected a numpy\.ndarray"
    elif kind == "bad_dtype":
        bad[target] = _bad_dtype_array(draw, good[target].shape)
        exc, pattern = TypeError, re.escape(target) + r": expected dtype float32 or float16"
    elif kind == "wrong_rank":
        ndim = draw(st.sampled_from([0, 1, 2, 4]), label="ndim")
        shape = {0: (), 1: (n * dims[target],), 2: (n, dims[target]), 4: (hkv, n, dims[target], 1)}[ndim]
        bad[target] = np.ones(shape, np.float32)
        pattern = re.escape(target) + r": expected 3 dims"
    elif kind == "wrong_heads":
        h = _other_than(draw, 0, 6, hkv, "heads")
        bad[target] = np.ones((h, n, dims[target]), np.float32)
    elif kind == "wrong_head_dim":
        dd = _other_than(draw, 0, 300, dims[target], "dim")
        bad[target] = np.ones((hkv, n, dd), np.float32)
    elif kind == "zero_n":
        bad[target] = np.ones((hkv, 0, dims[target]), np.float32)
        if target == "k":   # k checked first
            bad["v"] = np.ones((hkv, 0, dv), np.float32) if draw(st.booleans(), label="v also empty") else good["v"]
    elif kind == "positions_mismatch":
        m = _other_than(draw, 1, n + 5, n, "v positions")
        bad["v"] = np.ones((hkv, m, dv), np.float32)
        pattern = r"v: expected %d positions like k" % n
    elif kind == "nonfinite":
        value = draw(st.sampled_from([np.nan, np.inf, -np.inf]), label="value")
        arr = good[target].astype(draw(st.sampled_from([np.float32, np.float16]), label="input dtype"))
        bad[target] = _with_value(draw, arr, value, target)
        pattern = re.escape(target) + r": contains NaN or Inf"
    elif kind == "fp16_range":
        assert cache.dtype == "float16"
        mag = draw(st.one_of(st.sampled_from([FP16_MAX + 1, 65520.0, 1e5, 3.0e38]),
                             st.floats(FP16_MAX + 1, 3.0e38)), label="magnitude")
        sign = draw(st.sampled_from([1.0, -1.0]), label="sign")
        bad[target] = _with_value(draw, good[target], np.float32(sign * mag), target)
        pattern = re.escape(target) + r": values exceed the float16 range"
    elif kind == "over_capacity":
        m = draw(st.integers(free + 1, free + 40), label="n over free")
        bad = {a: np.full((hkv, m, dims[a]), 0.5, np.float32) for a in ("k", "v")}
        exc = vkattn.CacheFullError
        pattern = r"cannot add %d positions: .*capacity %d \(%d free\)" % (m, cache.capacity, free)
    else:
        raise AssertionError(kind)
    if call == "append":
        fn = lambda: cache.append(bad["k"], bad["v"])          # noqa: E731
    else:
        q = np.full((hkv * M_GROUP, 1, d), 0.25, np.float32)
        fn = lambda: cache.forward(q, bad["k"], bad["v"])      # noqa: E731
    return Case(fn, exc, pattern, f"{call} {target} {kind}")


def _q_case(draw, cache, kind):
    """A bad q / causal / scale for attend or forward; k/v valid and fitting."""
    hkv, d, dv = cache.num_kv_heads, cache.head_dim, cache.v_head_dim
    free = cache.capacity - cache.length
    call = draw(st.sampled_from(["attend", "forward"]), label="call")
    n = draw(st.integers(1, max(1, free)), label="n") if call == "forward" else 0
    total = cache.length + n
    s = draw(st.integers(1, min(total, MAX_QUERY_ROWS)), label="s")
    q = np.full((hkv * M_GROUP, s, d), 0.25, np.float32)
    kw = {}
    exc, pattern = ValueError, r"q: expected shape"
    if kind == "q_not_ndarray":
        conv = draw(st.sampled_from(["list", "tuple", "scalar", "none"]), label="conversion")
        q = {"list": q.tolist(), "tuple": tuple(q.tolist()), "scalar": 0.5, "none": None}[conv]
        exc, pattern = TypeError, r"q: expected a numpy\.ndarray"
    elif kind == "q_bad_dtype":
        q = _bad_dtype_array(draw, q.shape)
        exc, pattern = TypeError, r"q: expected dtype float32 or float16"
    elif kind == "q_wrong_rank":
        ndim = draw(st.sampled_from([0, 1, 2, 4]), label="ndim")
        q = np.ones({0: (), 1: (d,), 2: (s, d), 4: (hkv * M_GROUP, s, d, 1)}[ndim], np.float32)
        pattern = r"q: expected 3 dims"
    elif kind == "q_heads_not_multiple":
        if hkv == 1:   # every head count is a multiple of 1: use zero heads instead
            q = np.ones((0, s, d), np.float32)
        else:
            h = draw(st.integers(1, 20).filter(lambda h: h % hkv), label="heads")
            q = np.ones((h, s, d), np.float32)
            pattern = r"q: expected num_qo_heads a multiple of num_kv_heads=%d" % hkv
    elif kind == "q_wrong_head_dim":
        dd = _other_than(draw, 0, 300, d, "dim")
        q = np.ones((hkv * M_GROUP, s, dd), np.float32)
    elif kind == "q_zero_rows":
        q = np.ones((hkv * M_GROUP, 0, d), np.float32)
    elif kind == "q_too_many_rows":
        rows = draw(st.integers(total + 1, total + 30), label="rows")
        q = np.ones((hkv * M_GROUP, rows, d), np.float32)
        pattern = r"q: %d query rows but the cache would hold only %d positions" % (rows, total)
    elif kind == "q_nonfinite":
        value = draw(st.sampled_from([np.nan, np.inf, -np.inf]), label="value")
        q = _with_value(draw, q.astype(draw(st.sampled_from([np.float32, np.float16]), label="in")), value, "q")
        pattern = r"q: contains NaN or Inf"
    elif kind == "causal_not_bool":
        kw["causal"] = draw(st.sampled_from(["yes", "", 1, 0, None, 1.0, np.int64(1), np.float32(0), [True]]),
                            label="causal")
        exc, pattern = TypeError, r"causal: expected a bool"
    elif kind == "scale_not_positive":
        kw["scale"] = draw(st.one_of(st.sampled_from([0.0, -0.0, -1.0, -np.inf, np.inf, np.nan]),
                                     st.floats(max_value=0.0, allow_nan=False),
                                     st.just(np.float32(-0.5)), st.just(np.float64(np.nan))), label="scale")
        pattern = r"scale: expected a finite float > 0"
    elif kind == "scale_wrong_type":
        kw["scale"] = draw(st.sampled_from(["0.1", b"1", [0.1], (0.1,), True, False, 1j, np.array([0.1])]),
                           label="scale")
        exc, pattern = TypeError, r"scale: expected a float or None"
    else:
        raise AssertionError(kind)
    if call == "attend":
        fn = lambda: cache.attend(q, **kw)                     # noqa: E731
    else:
        k = np.full((hkv, n, d), 0.5, np.float32)
        v = np.full((hkv, n, dv), 0.5, np.float32)
        fn = lambda: cache.forward(q, k, v, **kw)              # noqa: E731
    return Case(fn, exc, pattern, f"{call} {kind}")


def _truncate_case(draw, cache, kind):
    length = cache.length
    if kind == "truncate_out_of_range":
        to = draw(st.one_of(st.integers(-1000, -1), st.integers(length + 1, length + 1000),
                            st.sampled_from([np.int64(-1), np.int32(length + 1)])), label="length")
        pattern = r"length: expected an int in \[0, %d\], got %d" % (length, int(to))
        return Case(lambda: cache.truncate(to), ValueError, pattern, "truncate range")
    to = draw(st.sampled_from([1.5, float(max(length - 1, 0)), None, "3", True, False, np.float64(1.0),
                               [1], np.array(1)]), label="length")
    return Case(lambda: cache.truncate(to), TypeError, r"length: expected an int", "truncate type")


KV_KINDS = ["not_ndarray", "bad_dtype", "wrong_rank", "wrong_heads", "wrong_head_dim", "zero_n",
            "positions_mismatch", "nonfinite", "fp16_range", "over_capacity"]
Q_KINDS = ["q_not_ndarray", "q_bad_dtype", "q_wrong_rank", "q_heads_not_multiple", "q_wrong_head_dim",
           "q_zero_rows", "q_too_many_rows", "q_nonfinite", "causal_not_bool", "scale_not_positive",
           "scale_wrong_type"]
TRUNCATE_KINDS = ["truncate_out_of_range", "truncate_not_int"]
MALFORMED_KINDS = KV_KINDS + Q_KINDS + TRUNCATE_KINDS


@pytest.mark.parametrize("kind", MALFORMED_KINDS)
@settings(max_examples=MALFORMED_EXAMPLES_PER_KIND, **_COMMON)
@given(data=st.data())
def test_malformed_input(kind, data):
    """A malformed argument raises the typed error naming it, and the cache is byte-identical
    afterwards (and still works: a following valid attend matches the reference)."""
    draw = data.draw
    hkv = draw(st.integers(1, 3), label="num_kv_heads")
    d, dv = draw(st.sampled_from(MH_DIMS), label="(head_dim, v_head_dim)")
    dtype = "float16" if kind == "fp16_range" else draw(st.sampled_from(DTYPES), label="dtype")
    # leave room for a valid n (except over_capacity, where a full cache is fine)
    top = M_CAPACITY if kind == "over_capacity" else M_CAPACITY - 1
    low = 0 if kind.startswith("truncate") or kind in KV_KINDS else 1   # attend needs >= 1 position
    prefill = draw(st.integers(low, top), label="prefill")
    seed = draw(st.integers(0, 2**32 - 1), label="seed")
    rng = np.random.default_rng(seed)

    with vkattn.KVCache(M_CAPACITY, hkv, d, dv, dtype=dtype, device=vkattn.default_device()) as cache:
        mirror = Mirror(cache)
        if prefill:
            k = rng.standard_normal((hkv, prefill, d)).astype(np.float32)
            v = rng.standard_normal((hkv, prefill, dv)).astype(np.float32)
            cache.append(k, v)
            mirror.append(k, v)
        snap = snapshot(cache)

        if kind in KV_KINDS:
            case = _kv_case(draw, cache, kind)
        elif kind in Q_KINDS:
            case = _q_case(draw, cache, kind)
        else:
            case = _truncate_case(draw, cache, kind)

        with pytest.raises(case.exc) as info:
            case.call()
        assert type(info.value) is case.exc, f"{case.what}: {type(info.value).__name__}: {info.value}"
        msg = str(info.value)
        assert re.match(case.pattern, msg), f"{case.what}: message {msg!r} does not match {case.pattern!r}"
        assert_unchanged(cache, snap)

        if cache.length:   # still usable: a valid decode step matches the reference
            q = rng.standard_normal((hkv * M_GROUP, 1, d)).astype(np.float32)
            assert_close(cache.attend(q), mirror.ref(q), dtype)
