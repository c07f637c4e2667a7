"""Every bad input raises a typed error naming the argument and leaves the cache byte-identical."""
import numpy as np
import pytest

import vkattn
from conftest import assert_unchanged, rand_kv, snapshot

H, D, DV = 2, 16, 12


@pytest.fixture
def cache(device, rng):
    c = vkattn.KVCache(30, H, D, DV, device=device)
    c.append(*rand_kv(rng, c, 20))
    return c


def f32(*shape):
    return np.ones(shape, np.float32)


BAD_KV = [
    ("list", lambda: ([[0.0]], f32(H, 1, DV)), TypeError, "k: expected a numpy.ndarray"),
    ("int dtype", lambda: (np.ones((H, 1, D), np.int32), f32(H, 1, DV)), TypeError, "k: expected dtype"),
    ("float64", lambda: (f32(H, 1, D), np.ones((H, 1, DV))), TypeError, "v: expected dtype"),
    ("rank", lambda: (f32(1, D), f32(H, 1, DV)), ValueError, "k: expected 3 dims"),
    ("kv heads", lambda: (f32(H + 1, 1, D), f32(H + 1, 1, DV)), ValueError, "k: expected shape"),
    ("head dim", lambda: (f32(H, 1, D + 1), f32(H, 1, DV)), ValueError, "k: expected shape"),
    ("v head dim", lambda: (f32(H, 1, D), f32(H, 1, D)), ValueError, "v: expected shape"),
    ("length mismatch", lambda: (f32(H, 2, D), f32(H, 3, DV)), ValueError, "v: expected 2 positions"),
    ("empty", lambda: (f32(H, 0, D), f32(H, 0, DV)), ValueError, "k: expected shape"),
    ("nan", lambda: (f32(H, 1, D) * np.nan, f32(H, 1, DV)), ValueError, "k: contains NaN"),
    ("inf", lambda: (f32(H, 1, D), f32(H, 1, DV) * np.inf), ValueError, "v: contains NaN or Inf"),
    ("fp16 overflow", lambda: (f32(H, 1, D) * 7e4, f32(H, 1, DV)), ValueError, "float16 range"),
    ("overflow capacity", lambda: (f32(H, 11, D), f32(H, 11, DV)), vkattn.CacheFullError, "capacity 30"),
]


@pytest.mark.parametrize("make,exc,msg", [b[1:] for b in BAD_KV], ids=[b[0] for b in BAD_KV])
def test_bad_append_and_forward(cache, make, exc, msg):
    snap = snapshot(cache)
    k, v = make()
    with pytest.raises(exc, match=msg):
        cache.append(k, v)
    assert_unchanged(cache, snap)
    with pytest.raises(exc, match=msg):
        cache.forward(f32(H, 1, D), k, v)
    assert_unchanged(cache, snap)


BAD_Q = [
    ("tuple", lambda: (1, 2), {}, TypeError, "q: expected a numpy.ndarray"),
    ("rank", lambda: f32(H, D), {}, ValueError, "q: expected 3 dims"),
    ("heads not multiple", lambda: f32(3, 1, D), {}, ValueError, "multiple of num_kv_heads=2"),
    ("head dim", lambda: f32(H, 1, D - 1), {}, ValueError, "q: expected shape"),
    ("too many rows", lambda: f32(H, 21, D), {}, ValueError, "21 query rows"),
    ("nan", lambda: f32(H, 1, D) * np.nan, {}, ValueError, "q: contains NaN"),
    ("causal", lambda: f32(H, 1, D), {"causal": "yes"}, TypeError, "causal: expected a bool"),
    ("scale type", lambda: f32(H, 1, D), {"scale": "0.1"}, TypeError, "scale: expected a float"),
    ("scale value", lambda: f32(H, 1, D), {"scale": -1.0}, ValueError, "scale: expected a finite float > 0"),
    ("scale nan", lambda: f32(H, 1, D), {"scale": float("nan")}, ValueError, "scale"),
]


@pytest.mark.parametrize("make,kw,exc,msg", [b[1:] for b in BAD_Q], ids=[b[0] for b in BAD_Q])
def test_bad_query(cache, make, kw, exc, msg):
    snap = snapshot(cache)
    with pytest.raises(exc, match=msg):
        cache.attend(make(), **kw)
    assert_unchanged(cache, snap)
    if "rows" not in msg:   # forward appends one row first, so 21 rows would fit there
        with pytest.raises(exc, match=msg):
            cache.forward(make(), f32(H, 1, D), f32(H, 1, DV), **kw)
        assert_unchanged(cache, snap)


def test_attend_on_empty_cache(device):
    c = vkattn.KVCache(8, 1, 4, device=device)
    with pytest.raises(ValueError, match="cache would hold only 0"):
        c.attend(f32(1, 1, 4))


@pytest.mark.parametrize("length,exc", [(-1, ValueError), (21, ValueError), (1.5, TypeError), (None, TypeError)])
def test_bad_truncate(cache, length, exc):
    snap = snapshot(cache)
    with pytest.raises(exc, match="length"):
        cache.truncate(length)
    assert_unchanged(cache, snap)


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(capacity=0), ValueError, "capacity"),
    (dict(capacity=2.5), TypeError, "capacity"),
    (dict(num_kv_heads=0), ValueError, "num_kv_heads"),
    (dict(head_dim="64"), TypeError, "head_dim"),
    (dict(v_head_dim=-3), ValueError, "v_head_dim"),
    (dict(dtype="int4"), TypeError, "dtype"),
    (dict(dtype=np.float64), TypeError, "dtype"),
    (dict(device="gpu"), TypeError, "device"),
    (dict(verify="no"), TypeError, "verify"),           # a string was taken as True
    (dict(timestamps=1), TypeError, "timestamps"),
])
def test_bad_construction(device, kwargs, exc, msg):
    args = dict(capacity=16, num_kv_heads=2, head_dim=8)
    args.update(kwargs)
    with pytest.raises(exc, match=msg):
        vkattn.KVCache(**args)


def test_dtype_spellings(device):
    assert vkattn.KVCache(4, 1, 8, dtype=np.float32, device=device).dtype == "float32"
    assert vkattn.KVCache(4, 1, 8, dtype=np.dtype("float16"), device=device).dtype == "float16"


def test_capacity_over_device_limit(device):
    limit = min(device.max_storage_buffer_range, device.max_memory_allocation_size)
    row = 8 * 128 * 2   # 8 kv heads x 128 halves
    too_big = limit // row + 1
    with pytest.raises(vkattn.DeviceLimitError, match=f"largest capacity for this shape is {limit // row}"):
        vkattn.KVCache(too_big, 8, 128, device=device)


def test_closed_cache(device, rng):
    c = vkattn.KVCache(10, 1, 8, device=device)
    c.append(*rand_kv(rng, c, 2))
    c.close()
    assert c.closed
    c.close()   # idempotent
    for call in (lambda: c.append(f32(1, 1, 8), f32(1, 1, 8)), lambda: c.attend(f32(1, 1, 8)),
                 lambda: c.forward(f32(1, 1, 8), f32(1, 1, 8), f32(1, 1, 8)), lambda: c.truncate(0),
                 c.reset, c.read):
        with pytest.raises(vkattn.CacheClosedError):
            call()


def test_context_manager_closes(device):
    with vkattn.KVCache(10, 1, 8, device=device) as c:
        c.append(f32(1, 2, 8), f32(1, 2, 8))
    assert c.closed


def test_error_types_are_value_errors():
    assert issubclass(vkattn.CacheFullError, ValueError)
    assert issubclass(vkattn.DeviceLimitError, ValueError)


@pytest.mark.parametrize("limit,dtype", [(vkattn.checks.FP16_MAX, "float16"),
                                         (vkattn.reference.BF16_FINITE_INPUT, "bfloat16"),
                                         (vkattn.reference.Q4_MAX_ABS, "q4")])
def test_check_array_quick_test_refuses_what_the_exact_checks_refuse(limit, dtype):
    """check_array's one-dot quick test only lets through arrays every value of which is finite and
    within the limit; the rest go to the exact checks: a value just past the limit among tiny ones
    (and one just within it, which passes), NaN, +-Inf, and sums of squares that overflow float32
    while every value is fine."""
    from vkattn.checks import check_array
    x = np.full((1, 4097, 8), 1e-3, np.float32)
    above = np.nextafter(np.float32(limit), np.float32(np.inf))
    for bad in (above, -above, np.float32(np.nan), np.float32(np.inf), -np.float32(np.inf)):
        y = x.copy()
        y[0, 4000, 5] = bad
        with pytest.raises(ValueError, match="range|NaN or Inf"):
            check_array("k", y, (1, None, 8), max_abs=(limit, dtype))
    y = x.copy()
    y[0, 17, 2] = -np.float32(limit)                   # exactly at the limit: accepted (exact path)
    assert check_array("k", y, (1, None, 8), max_abs=(limit, dtype)) is y
    huge = np.full((1, 3, 8), 1e25, np.float32)        # squares overflow; values within every limit but float16's
    if limit > 1e25:
        assert check_array("k", huge, (1, None, 8), max_abs=(limit, dtype)) is huge
    with pytest.raises(ValueError, match="NaN or Inf"):
        check_array("q", np.full((1, 2, 8), np.nan, np.float32), (1, None, 8))
    assert check_array("q", huge, (1, None, 8)) is huge  # finite only: no limit


def test_bad_calls_found_by_the_api_review(device, rng):
    """Calls an adversarial review found taken silently or refused with an unclear error: a plan
    with rope_q on a cache without a rope (refused as its forward is), a paged batch whose ids
    are not a list, an array shape of the wrong kind -- each a typed error naming the argument,
    nothing changed."""
    cache = vkattn.KVCache(16, 2, 8, device=device)
    for bad, exc in ((True, ValueError), ("yes", TypeError)):
        with pytest.raises(exc, match="rope_q"):
            cache.plan(4, rope_q=bad)
    pool = vkattn.PagedKVCache(4, 4, 2, 8, device=device)
    sid = pool.add_sequence()
    k = v = np.zeros((2, 1, 8), np.float32)
    for ids in (0, None, "ab"):
        with pytest.raises(TypeError, match="seq_ids: expected a list"):
            pool.forward(ids, np.zeros((4, 1, 8), np.float32), k, v)
        with pytest.raises(TypeError, match="seq_ids: expected a list"):
            pool.append(ids, k, v)
    assert pool.length(sid) == 0
    for shape in (2.0, None, "ab"):
        with pytest.raises(TypeError, match="shape: expected an int or a tuple"):
            vkattn.empty(shape, device)
    assert vkattn.empty(np.array([2, 3]), device).shape == (2, 3)


def test_a_bad_glslang_path_is_a_shader_compile_error(tmp_path, monkeypatch):
    """VKATTN_GLSLANG naming a missing file, a file that is not executable or a folder: the
    ShaderCompileError docs/errors.md lists for a missing compiler, naming the variable (it was
    FileNotFoundError / PermissionError from subprocess at the first build)."""
    from vkattn import compiler
    plain = tmp_path / "glslangValidator"
    plain.write_text("not a program")
    for bad in (tmp_path / "missing", plain, tmp_path):
        monkeypatch.setenv("VKATTN_GLSLANG", str(bad))
        with pytest.raises(vkattn.ShaderCompileError, match="VKATTN_GLSLANG="):
            compiler._glslang()
    monkeypatch.setenv("VKATTN_GLSLANG", "glslangValidator")       # a name on PATH still works
    assert compiler._glslang().endswith("glslangValidator")


def test_decode_splits_past_the_workgroup_count_are_refused(cache, rng, monkeypatch):
    """VKATTN_DECODE_SPLITS above the device's workgroups in x (each split is one): a ValueError
    naming the variable, nothing written (it dispatched past maxComputeWorkGroupCount[0], which
    the validation layer reports and a GPU need not survive)."""
    limit = cache.device.max_workgroup_count[0]
    before = snapshot(cache)
    q = rng.standard_normal((2 * H, 1, D), dtype=np.float32)
    monkeypatch.setenv("VKATTN_DECODE_SPLITS", str(limit + 1))
    with pytest.raises(ValueError, match="VKATTN_DECODE_SPLITS='%d': the device allows %d" % (limit + 1, limit)):
        cache.forward(q, *rand_kv(rng, cache, 1))
    assert_unchanged(cache, before)
    monkeypatch.setenv("VKATTN_DECODE_SPLITS", "3")
    k, v = rand_kv(rng, cache, 1)
    out = cache.forward(q, k, v)
    ks, vs = cache.read()
    np.testing.assert_allclose(out, vkattn.reference.attention(q, ks, vs), atol=2e-5, rtol=2e-4)


@pytest.mark.parametrize("var", ["VKATTN_VERIFY", "VKATTN_TEXEL_KV", "VKATTN_HALF_NATIVE", "VKATTN_MEASURE_CACHE",
                                 "VKATTN_DRIVER_WORKAROUNDS", "VKATTN_PIN_SUBGROUP", "VKATTN_TILE_V_EARLY"])
def test_switches_take_0_or_1_only(device, monkeypatch, var):
    """Every 0/1 switch is read alike (checks.env_flag): "false", "off", "no" -- which turned
    VKATTN_VERIFY on and left the texel and half paths on before -- are a ValueError naming the
    variable; blanks around 0 / 1 are fine."""
    from vkattn import _driverfix, device as device_mod, measure, tuning
    read = {"VKATTN_VERIFY": lambda: vkattn.KVCache(8, 1, 8, device=device).verify,
            "VKATTN_TEXEL_KV": lambda: tuning._texel_views(device, "lane", 4),
            "VKATTN_HALF_NATIVE": device.half_native,
            "VKATTN_MEASURE_CACHE": measure._enabled,
            "VKATTN_DRIVER_WORKAROUNDS": _driverfix.apply,
            "VKATTN_PIN_SUBGROUP": device_mod.pinning_enabled,
            "VKATTN_TILE_V_EARLY": tuning.tile_v_early}[var]
    for bad in ("false", "off", "no", "2", "yes"):
        monkeypatch.setenv(var, bad)
        with pytest.raises(ValueError, match=f"{var}='{bad}': expected 0 or 1"):
            read()
    monkeypatch.setenv(var, " 0 ")
    read()
    if var == "VKATTN_VERIFY":
        assert read() is False
        monkeypatch.setenv(var, "1")
        assert read() is True


@pytest.mark.parametrize("dtype,big", [("float16", 60000.0), ("bfloat16", 3e38), ("float32", 3e38), ("fp8_e5m2", 3e38),
                                       ("int8", 3e38)])
@pytest.mark.parametrize("paged", [False, True])
def test_keys_a_rope_would_rotate_past_the_range_are_refused(device, rng, dtype, big, paged):
    """A cache with a RoPE stores rotated keys, and a rotated value is as large as its pair's
    length (up to sqrt(2) times its larger value): keys within the format's range whose rotation
    is not were stored as Inf, and every later output that saw them was NaN. Now a ValueError
    naming the rope, nothing written; the same keys at 2/3 the size are stored finite, as the
    reference rotates and rounds them."""
    rope = vkattn.RoPE(style="neox" if dtype != "int8" else "gptj")
    if paged:
        c = vkattn.PagedKVCache(4, 4, 1, 8, dtype=dtype, device=device, rope=rope)
        sid = c.add_sequence()
        call = lambda k: c.append([sid], k, np.ones((1, 2, 8), np.float32), n_new=[2])   # noqa: E731
        length = lambda: c.length(sid)                                                   # noqa: E731
        read = lambda: c.read(sid)                                                       # noqa: E731
    else:
        c = vkattn.KVCache(8, 1, 8, dtype=dtype, device=device, rope=rope)
        call = lambda k: c.append(k, np.ones((1, 2, 8), np.float32))                     # noqa: E731
        length = lambda: c.length                                                        # noqa: E731
        read = c.read
    k = np.full((1, 2, 8), big, np.float32)
    with pytest.raises(ValueError, match="k: the cache's rope rotates pairs of values"):
        call(k)
    assert length() == 0
    call(k / 1.5)
    ks, _ = read()
    assert length() == 2 and np.isfinite(ks).all()
    want = vkattn.reference.round_to(vkattn.reference.rope(k / 1.5, np.arange(2), style=rope.style), dtype,
                                     **({"scale": c.k_scale} if dtype.startswith("fp8") else {}))
    assert np.array_equal(ks, want)


def test_an_int8_row_at_float32s_largest_value_is_refused(device):
    """int8 stores max / 127 as each row's scale: at float32's largest value that rounds up and
    127 times it is Inf (the row read back Inf, as the reference's definition has it); that one
    value is refused, the one below it stored finite."""
    from vkattn.formats import INT8_MAX_ABS
    c = vkattn.KVCache(8, 1, 4, dtype="int8", device=device)
    with pytest.raises(ValueError, match="int8 range"):
        c.append(np.array([[[np.finfo(np.float32).max, 1, -1, 0]]], np.float32), np.ones((1, 1, 4), np.float32))
    assert c.length == 0
    c.append(np.array([[[INT8_MAX_ABS, 1, -1, 0]]], np.float32), np.ones((1, 1, 4), np.float32))
    assert np.isfinite(c.read()[0]).all() and c.read()[0][0, 0, 0] == np.float32(INT8_MAX_ABS)
