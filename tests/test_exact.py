"""Bit-exact storage on any conforming Vulkan driver: float16, bfloat16 and fp8 (e4m3, e5m2)
encode/decode and int8 quantisation.

vkattn promises that a float16 cache stores exactly numpy's ``astype(float16)`` of the input (round
to nearest even), a bfloat16 cache exactly ``reference.bfloat16_bits`` (nearest even on the float32
bits: torch's rounding) and an int8 cache exactly ``reference.quantize_int8`` (scale = amax / 127 correctly
rounded, q = the exact quotient rounded half to even). GLSL leaves all of these roundings to the
driver (RADV packs halves with round toward zero, divides with a reciprocal; lavapipe happens to
round to nearest), so the shaders compute them with integer arithmetic (shaders/common.glsl).

The inputs below are built to catch a wrong rounding: exact half-ULP ties and their float32
neighbours, values next to 65504 and Inf, half subnormals and their ties, float32 denormals and
signed zeros; int8 rows whose quotients land exactly on .5 (with scales that are not powers of two,
so a reciprocal is inexact), amax values whose reciprocal-multiply scale differs from the division,
tiny and denormal amax. Each test also checks that its inputs would catch the rounding today's
main compiles to on RADV (round toward zero; multiply by a float reciprocal): they are adversarial,
not merely random. They run through shaders/numerics_probe.comp (the helpers alone) and through the
real append and fused-forward stores of both kernels.
"""
import numpy as np
import pytest

import vkattn
from vkattn.check import q4_adversarial_blocks
from vkattn.compiler import compile_shader
from vkattn.reference import (BF16_FINITE_INPUT, BF16_MAX, FP8_FORMATS, bfloat16_bits, fp8_bits, fp8_to_float32,
                              Q4_ZMAX, q4_split, q4_words, quantize_int8, quantize_q4, round_bfloat16, round_to)

F16_MAX = 65504.0


def f32(bits):
    return np.asarray(bits, np.uint32).view(np.float32)


def bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def run_probe(device, defines, inv: np.ndarray, n: int, out_words: int, d16: int = 1, scales: int = 1):
    """numerics_probe.comp on ``device``: inv uint32 words in, (out uint32 words, scale words) back."""
    be = device.backend
    params = be.buffer(1, np.uint32, name="params")
    ib = be.buffer(inv.size, np.uint32, name="in")
    ob = be.buffer(out_words, np.uint32, name="out")
    sb = be.buffer(scales, np.uint32, name="scales")
    params.view()[0] = n
    ib.view()[:inv.size] = inv.ravel()
    prog = be.program(compile_shader("numerics_probe", defines), [params, ib, ob, sb], (-(-n // 64), 1, 1),
                      [64, d16], writes=(2, 3), name="numerics_probe")
    rec = be.recording().upload(params, ib).dispatch(prog).download(ob, sb).build()
    rec.run()
    out, sc = ob.view().copy(), sb.view().copy()
    for o in (rec, prog, params, ib, ob, sb):
        o.destroy()
    return out[:out_words], sc


# ------------------------------------------------------------------------------ float16

def half_ties_and_neighbours(rng, count=600):
    """Exact midpoints between adjacent finite halves (normal and subnormal), with the float32 just
    below and just above each, both signs; the subnormal/normal boundary; 65504 .. Inf."""
    h = np.concatenate([rng.integers(0, 0x7bff, count), np.arange(0, 40), np.arange(0x3f0, 0x410),
                        [0x7bfe]]).astype(np.uint16)
    lo = h.view(np.float16).astype(np.float32)
    hi = (h + 1).view(np.float16).astype(np.float32)
    mid = (lo + hi) / 2                                  # exact in float32 (11-bit significands)
    vals = np.concatenate([mid, np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf))])
    return np.concatenate([vals, -vals])


def rtz_half(x):
    """float32 -> float16 rounding toward zero (what v_cvt_pkrtz_f16_f32 does), as float32."""
    x = np.asarray(x, np.float32)
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)
    hb = h.view(np.uint16).copy()
    over = np.abs(h.astype(np.float32)) > np.abs(x)      # rounded away from zero: step back
    hb[over] -= 1
    return hb.view(np.float16).astype(np.float32)


def specials():
    s = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-40, -3e-39, 1.1754942e-38,       # float32 denormals
                  2.0 ** -25, -(2.0 ** -25), 3 * 2.0 ** -25, 2.0 ** -24, 2.0 ** -14 - 2.0 ** -25,
                  F16_MAX, -F16_MAX, 65519.996, 65520.0, -65520.0, 1e5, 3e38, 1.0, -2.5], np.float32)
    return np.concatenate([s, np.nextafter(s, np.float32(np.inf)), np.nextafter(s, np.float32(-np.inf))])


def test_half_inputs_would_catch_round_toward_zero(rng):
    x = half_ties_and_neighbours(rng)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    assert (bits(rtz_half(x)) != bits(want)).mean() > 0.3


@pytest.mark.parametrize("native", [0, 1])
def test_probe_float16_encode_matches_numpy(device, rng, native):
    x = np.concatenate([half_ties_and_neighbours(rng), specials(),
                        f32(rng.integers(0, 0xffffffff, 4000, dtype=np.uint32) & 0xc7ffffff)])
    x = np.concatenate([x, np.zeros(-x.size % 8, np.float32)])
    out, _ = run_probe(device, {"MODE": 0, "KV_F16": 1, "HALF_NATIVE": native}, bits(x), x.size // 8, x.size // 2)
    got = out.view(np.uint16)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(float(x[i]), hex(got[i]), hex(want[i])) for i in bad[:8]]


@pytest.mark.parametrize("native", [0, 1])
def test_probe_float16_decode_every_finite_half(device, native):
    # every finite half, subnormals and both zeros included: the float32 bits numpy gives. The
    # lavapipe decoder multiplied a float32 denormal by 2^112, which a flushing driver (Mesa 26's
    # lavapipe) turns into 0 for all 2046 non-zero half subnormals.
    h = np.arange(0x10000, dtype=np.uint32)
    h = h[(h & 0x7c00) != 0x7c00].astype(np.uint16)
    words = h.view(np.uint32)
    out, _ = run_probe(device, {"MODE": 1, "KV_F16": 1, "HALF_NATIVE": native}, words, words.size // 4, 2 * words.size)
    want = bits(h.view(np.float16).astype(np.float32))
    bad = np.flatnonzero(out != want)
    assert bad.size == 0, [(hex(h[i]), hex(out[i]), hex(want[i])) for i in bad[:8]]
    assert ((h & 0x7c00) == 0).sum() == 2048


# ------------------------------------------------------------------------------ bfloat16

def bf16_ties_and_neighbours(rng, count=600):
    """Exact midpoints between adjacent finite bfloat16 values -- kept halves odd (a tie rounds up)
    and even (down), normal and denormal -- with the float32 just below and just above each, both
    signs. Among them the carries: a tie above 0x3f7f rounds into the next exponent (1.0), one
    above 0x007f from the largest denormal into the smallest normal, one above 0x7f7f (the largest
    finite value) to Inf, while the float32 just below it stays 0x7f7f."""
    h = np.concatenate([rng.integers(0, 0x7f7f, count), np.arange(0, 40), np.arange(0x7f40, 0x7f80),
                        [0x3f7f, 0x3f7e, 0x007f, 0x007e, 0x0080]]).astype(np.uint32)
    mid = (h << np.uint32(16)) | np.uint32(0x8000)
    vals = np.concatenate([mid, mid - np.uint32(1), mid + np.uint32(1)])
    return np.concatenate([vals, vals | np.uint32(0x80000000)]).view(np.float32)


def bf16_specials():
    """Zeros, float32 denormals, the largest finite bfloat16 and values round it, Inf and NaNs
    (quiet, signalling, negative, payloads that the rounding carry alone would turn into Inf or
    into a sign flip)."""
    b = np.array([0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x00007fff, 0x00008000, 0x00018000,
                  0x000f8000, 0x007fffff, 0x807f8000, 0x00800000, 0x7f7f0000, 0xff7f0000, 0x7f7f7fff,
                  0x7f7f8000, 0xff7f8000, 0x7f7fffff, 0x7f800000, 0xff800000, 0x7fc00000, 0x7f800001,
                  0x7f807fff, 0xff800001, 0x7fffffff, 0xffffffff, 0x3f800000, 0x3f7fffff], np.uint32)
    return b.view(np.float32)


def truncate_bf16(x):
    """float32 -> bfloat16 by dropping the low 16 bits (round toward zero), as float32."""
    return (np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xffff0000)).view(np.float32)


def test_bfloat16_reference_definition(rng):
    # against the rounding computed another way: the two neighbouring bfloat16 values of x in
    # float64 (exact) and the nearer one, ties to the even kept half; Inf past the largest value
    x = np.concatenate([bf16_ties_and_neighbours(rng), bf16_specials(),
                        f32(rng.integers(0, 0xffffffff, 20000, dtype=np.uint64).astype(np.uint32))])
    x = x[np.isfinite(x)]
    got = bfloat16_bits(x)
    b = x.view(np.uint32)
    lo = np.abs((b & np.uint32(0xffff0000)).view(np.float32).astype(np.float64))   # toward zero
    e = ((b >> np.uint32(23)) & np.uint32(0xff)).astype(np.int64)
    ulp = np.ldexp(1.0, np.maximum(e, 1) - 127 - 7)                 # one step of the kept half, exactly
    up_bits = (b >> np.uint32(16)) + np.uint32(1)                  # away from zero (past 0x7f7f: Inf)
    ax = np.abs(x.astype(np.float64))
    dlo, dhi = ax - lo, lo + ulp - ax
    up = (dhi < dlo) | ((dhi == dlo) & ((b >> np.uint32(16)) & np.uint32(1) == 1))
    up &= (b & np.uint32(0xffff)) != 0
    want = np.where(up, up_bits, b >> np.uint32(16)).astype(np.uint16)
    assert np.array_equal(got, want), np.flatnonzero(got != want)[:8]
    # the stated cases, one by one
    one = lambda v: int(bfloat16_bits(np.uint32(v).view(np.float32)))
    assert one(0x3f808000) == 0x3f80 and one(0x3f818000) == 0x3f82      # ties to even, both ways
    assert one(0x3f808001) == 0x3f81 and one(0x3f817fff) == 0x3f81
    assert one(0x3f7f8000) == 0x3f80                                      # carry into the exponent
    assert one(0x7f7f7fff) == 0x7f7f and one(0x7f7f8000) == 0x7f80 and one(0xff7fffff) == 0xff80
    assert float(round_bfloat16(np.float32(BF16_FINITE_INPUT))) == BF16_MAX
    assert one(0x80000000) == 0x8000 and one(0x80000001) == 0x8000       # -0, and a tiny negative
    assert one(0x00018000) == 0x0002 and one(0x00008000) == 0x0000 and one(0x007f8000) == 0x0080
    assert one(0x7f800000) == 0x7f80 and one(0xff800000) == 0xff80
    assert one(0x7f800001) == 0x7fc0 and one(0xffffffff) == 0xffff and one(0x7fc00000) == 0x7fc0
    assert float(BF16_MAX) == float(np.uint32(0x7f7f0000).view(np.float32))


def test_bfloat16_reference_is_torchs_rounding(rng):
    torch = pytest.importorskip("torch")
    x = np.concatenate([bf16_ties_and_neighbours(rng), bf16_specials(),
                        f32(rng.integers(0, 0xffffffff, 20000, dtype=np.uint64).astype(np.uint32))])
    x = x[~np.isnan(x)]                                   # torch makes every NaN 0x7fc0
    t = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bfloat16_bits(x), t)


def test_bfloat16_inputs_would_catch_truncation(rng):
    x = bf16_ties_and_neighbours(rng)
    with np.errstate(over="ignore"):
        want = round_bfloat16(x)
    assert (bits(truncate_bf16(x)) != bits(want)).mean() > 0.3
    # and a rounding that sends ties away from zero (half the ties)
    tie = (bits(x) & np.uint32(0xffff)) == 0x8000
    even = ((bits(x) >> np.uint32(16)) & np.uint32(1)) == 0
    assert (tie & even).sum() > 100 and (bits(want)[tie & even] == bits(truncate_bf16(x))[tie & even]).all()


def test_probe_bfloat16_encode_matches_reference(device, rng):
    x = np.concatenate([bf16_ties_and_neighbours(rng), bf16_specials(),
                        f32(rng.integers(0, 0xffffffff, 4000, dtype=np.uint64).astype(np.uint32))])
    x = np.concatenate([x, np.zeros(-x.size % 8, np.float32)])
    out, _ = run_probe(device, {"MODE": 0, "KV_F16": 0, "KV_I8": 0, "KV_BF16": 1}, bits(x), x.size // 8, x.size // 2)
    got = out.view(np.uint16)
    want = bfloat16_bits(x)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(hex(bits(x)[i]), hex(got[i]), hex(want[i])) for i in bad[:8]]


def test_probe_bfloat16_decode_every_pattern(device):
    # all 65536 bfloat16 bit patterns (denormals, zeros, Inf and NaN included): the shift is exact
    h = np.arange(0x10000, dtype=np.uint32).astype(np.uint16)
    words = h.view(np.uint32)
    out, _ = run_probe(device, {"MODE": 1, "KV_F16": 0, "KV_I8": 0, "KV_BF16": 1}, words, words.size // 4,
                       2 * words.size)
    want = h.astype(np.uint32) << np.uint32(16)
    bad = np.flatnonzero(out != want)
    assert bad.size == 0, [(hex(h[i]), hex(out[i]), hex(want[i])) for i in bad[:8]]


@pytest.mark.parametrize("kernel", ["lane", "tile"])
@pytest.mark.parametrize("how", ["append", "forward"])
def test_bfloat16_store_is_the_reference_rounding(device, rng, monkeypatch, kernel, how):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    x = np.concatenate([bf16_ties_and_neighbours(rng, 120), bf16_specials()])
    x = x[np.isfinite(x) & (np.abs(x) <= BF16_FINITE_INPUT)]      # a bfloat16 cache refuses the rest
    hkv, n, d, dv = 2, 30, 24, 40
    k = _kv_rows(x, hkv, n, d, rng)
    v = _kv_rows(x, hkv, n, dv, rng)
    cache = vkattn.KVCache(64, hkv, d, dv, dtype="bfloat16", device=device)
    if how == "append":
        cache.append(k, v)
    else:
        q = np.zeros((hkv, n, d), np.float32)             # zero scores whatever K holds
        with np.errstate(over="ignore", invalid="ignore"):
            cache.forward(q, k, v)                          # (V's huge values may overflow the output)
    ks, vs = cache.read()
    for got, want in ((ks, k), (vs, v)):
        ref = round_bfloat16(want)
        bad = np.argwhere(bits(got) != bits(ref))
        assert bad.size == 0, [(hex(bits(want)[tuple(i)]), hex(bits(got)[tuple(i)]), hex(bits(ref)[tuple(i)]))
                               for i in bad[:8]]
    assert (bits(truncate_bf16(k)) != bits(round_bfloat16(k))).mean() > 0.2
    assert (bits(ks) == 0x80000000).any() and ((bits(ks) & 0x7f800000) == 0).sum() > 10   # -0, denormals kept


# ------------------------------------------------------------------------------ int8

def int8_rows(rng, d=32):
    """Rows (n, d) float32 whose quantisation a reciprocal-based implementation gets wrong."""
    rows = []
    # scale 3 * 2^-e exactly (amax = 381 * 2^-e): quotients (k + 1/2) exactly and one float32 either
    # side; 1/scale is inexact, so x * (1/scale) misses the tie
    for e in (-3, 0, 4, 9, 20, 60, 120):
        scale = np.float32(3.0 * 2.0 ** -e)
        k = rng.integers(-127, 127, d - 1)
        for nudge in (None, np.inf, -np.inf):
            x = ((k + 0.5) * np.float64(scale)).astype(np.float32)
            if nudge is not None:
                x = np.nextafter(x, np.float32(nudge))
            rows.append(np.concatenate([[np.float32(381.0 * 2.0 ** -e)], x]))
    # amax whose scale amax * float32(1/127) is one ULP off amax / 127
    cand = (rng.random(20000) * 10).astype(np.float32) + np.float32(0.01)
    off = cand[cand * np.float32(1 / 127) != cand / np.float32(127)][:24]
    for a in off:
        rows.append(np.concatenate([[a], (rng.standard_normal(d - 1) * a / 3).astype(np.float32)]))
    # tiny and huge rows: subnormal scales, denormal elements, a denormal-only row (a zero row),
    # a zero row, one nonzero element
    tiny = np.float32(2.0 ** -126)
    rows += [np.full(d, tiny * 3, np.float32) * np.linspace(-1, 1, d, dtype=np.float32),
             np.concatenate([[np.float32(1e-37)], f32(rng.integers(1, 0x7fffff, d - 1, dtype=np.uint32))]),
             np.concatenate([[np.float32(2.0 ** -120)], np.float32([2.0 ** -127, -(2.0 ** -128)] * ((d - 1) // 2 + 1))[:d - 1]]),
             f32(rng.integers(1, 0x7fffff, d, dtype=np.uint32)),
             np.zeros(d, np.float32),
             np.eye(1, d, 5, dtype=np.float32)[0] * np.float32(-3.0),
             rng.uniform(-3.3e38, 3.3e38, d).astype(np.float32)]
    return np.stack([r[:d] for r in rows]).astype(np.float32)


def rcp_quantise(x):
    """today's main on RADV: scale = amax * float32(1/127), q = rint(x * float32(1/scale))."""
    amax = np.abs(x).max(axis=-1)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore"):
        scale = amax * np.float32(1 / 127)
        inv = np.float32(1) / np.where(scale > 0, scale, np.float32(1))
        q = np.clip(np.rint(x * inv[..., None]), -127, 127)
    return q.astype(np.int8), scale


def test_int8_rows_would_catch_reciprocal_division(rng):
    x = int8_rows(rng)
    q, scale = quantize_int8(x[None])
    rq, rscale = rcp_quantise(x)
    assert (rscale != scale[0]).sum() >= 20
    assert (rq != q[0]).sum() >= 50


def test_reference_quantisation_definition(rng):
    x = int8_rows(rng)
    q, scale = quantize_int8(x[None])
    q, scale = q[0].astype(np.int64), scale[0].astype(np.float64)
    amax = np.abs(x).max(axis=1).astype(np.float64)
    live = amax >= 2.0 ** -126
    assert not scale[~live].any() and not q[~live].any()
    # scale: the float32 nearest amax / 127 (its neighbours are farther, exactly)
    s = scale[live]
    below, above = np.nextafter(s.astype(np.float32), 0), np.nextafter(s.astype(np.float32), np.inf)
    err = np.abs(s - amax[live] / 127)
    assert (err <= np.abs(below.astype(np.float64) - amax[live] / 127)).all()
    assert (err <= np.abs(above.astype(np.float64) - amax[live] / 127)).all()
    # q: nearest to the quotient, ties to even, from exact rational arithmetic
    from fractions import Fraction
    for i in np.flatnonzero(live)[::5]:
        for j in range(x.shape[1]):
            quo = Fraction(float(x[i, j])) / Fraction(float(scale[i]))
            want = max(-127, min(127, round(quo)))          # Python's round: half to even
            assert q[i, j] == want, (i, j, float(quo))
    # ties are present, and land on even integers
    quo = x.astype(np.float64)[live] / scale[live][:, None]
    tie = np.abs(quo - np.floor(quo)) == 0.5
    assert tie.sum() >= 100 and (q[live][tie] % 2 == 0).all()


def test_probe_int8_quantise_matches_reference(device, rng):
    x = int8_rows(rng)
    n, d = x.shape
    out, sc = run_probe(device, {"MODE": 2, "KV_F16": 0, "KV_I8": 1}, bits(x), n, n * d // 4, d16=d // 16, scales=n)
    q, scale = quantize_int8(x[None])
    got_q = out.view(np.int8).reshape(n, d)
    assert np.array_equal(sc[:n], bits(scale[0])), np.flatnonzero(sc[:n] != bits(scale[0]))
    bad = np.argwhere(got_q != q[0])
    assert bad.size == 0, [(tuple(i), float(x[tuple(i)]), int(got_q[tuple(i)]), int(q[0][tuple(i)])) for i in bad[:8]]


# ------------------------------------------------------------------------------ the real stores

def _kv_rows(vals, hkv, n, d, rng):
    """(hkv, n, d): every value of vals once (in random places), the rest drawn from vals again;
    n <= 32, so forward fuses the append into the attention dispatch."""
    assert n <= 32 and vals.size <= hkv * n * d
    flat = np.concatenate([vals, rng.choice(vals, hkv * n * d - vals.size)])
    return rng.permutation(flat).reshape(hkv, n, d).astype(np.float32)


@pytest.mark.parametrize("kernel", ["lane", "tile"])
@pytest.mark.parametrize("how", ["append", "forward"])
def test_float16_store_is_numpys_rounding(device, rng, monkeypatch, kernel, how):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    x = np.concatenate([half_ties_and_neighbours(rng, 120), specials()])
    x = x[np.abs(x) <= F16_MAX]                          # a float16 cache refuses larger values
    hkv, n, d, dv = 2, 30, 24, 40
    k = _kv_rows(x, hkv, n, d, rng)
    v = _kv_rows(x, hkv, n, dv, rng)
    cache = vkattn.KVCache(64, hkv, d, dv, dtype="float16", device=device)
    if how == "append":
        cache.append(k, v)
    else:
        q = np.zeros((hkv, n, d), np.float32)             # zero scores: no overflow whatever K holds
        cache.forward(q, k, v)
    ks, vs = cache.read()
    for got, want in ((ks, k), (vs, v)):
        ref = want.astype(np.float16).astype(np.float32)
        bad = np.argwhere(bits(got) != bits(ref))
        assert bad.size == 0, [(float(want[tuple(i)]), float(got[tuple(i)]), float(ref[tuple(i)])) for i in bad[:8]]
    assert (bits(rtz_half(k)) != bits(k.astype(np.float16).astype(np.float32))).mean() > 0.2


@pytest.mark.parametrize("kernel", ["lane", "tile"])
@pytest.mark.parametrize("how", ["append", "forward"])
def test_int8_store_is_the_reference_quantisation(device, rng, monkeypatch, kernel, how):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    rows = int8_rows(rng, d=32)                           # (n, 32)
    rows = rows[rng.permutation(len(rows))]
    hkv = 2
    n = min(32, len(rows) // hkv)
    k = rows[:hkv * n].reshape(hkv, n, 32)
    v = np.roll(rows, 7, axis=0)[:hkv * n].reshape(hkv, n, 32)[..., :24]
    cache = vkattn.KVCache(64, hkv, 32, 24, dtype="int8", device=device)
    if how == "append":
        cache.append(k, v)
    else:
        cache.forward(np.zeros((hkv, n, 32), np.float32), k, v)
    ks, vs = cache.read()
    for got, want in ((ks, k), (vs, v)):
        q, scale = quantize_int8(want)
        ref = q.astype(np.float32) * scale[..., None]
        bad = np.argwhere(bits(got) != bits(ref))
        assert bad.size == 0, [(tuple(i), float(want[tuple(i)]), float(got[tuple(i)]), float(ref[tuple(i)]))
                               for i in bad[:8]]


# ------------------------------------------------------------------------------ q4

def q4_blocks(rng):
    """Blocks (n, 16) float32 whose q4 quantisation a careless implementation gets wrong."""
    return q4_adversarial_blocks(rng)


def float_quantise_q4(x):
    """A float recipe: scale = (max - min) / 15 in float32, z = rint(-min / scale), q = rint(x *
    float32(1 / scale)) + z: what the exact definition rules out."""
    lo, hi = x.min(axis=-1), x.max(axis=-1)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore"):
        scale = (hi - lo) / np.float32(15)
        inv = np.float32(1) / np.where(scale > 0, scale, np.float32(1))
        z = np.rint(-lo * inv)
        q = np.nan_to_num(np.clip(np.rint(x * inv[..., None]) + z[..., None], 0, 15))
    return q.astype(np.uint8), scale


def test_q4_blocks_would_catch_float_division(rng):
    x = q4_blocks(rng)
    q, _ = quantize_q4(x[None])
    fq, _ = float_quantise_q4(x)
    assert (fq != q[0]).sum() >= 50


def _q4_definition(block):
    """quantize_q4's definition, again, in Python integers and fractions: (q list, scale, z)."""
    from fractions import Fraction

    def aligned(v):
        b = int(np.float32(v).view(np.uint32))
        e = (b >> 23) & 0xFF
        return e, (((b & 0x7FFFFF) | 0x800000) if e else 0), (-1 if b >> 31 else 1)
    lo, hi = block.min(), block.max()
    (el, ml, sl), (eh, mh, sh) = aligned(lo), aligned(hi)
    big = max(el, eh)
    L, H = sl * (ml >> min(big - el, 31)), sh * (mh >> min(big - eh, 31))
    r = max(H - L, -(-max(abs(H), abs(L)) // 256))
    if r == 0:
        return [0] * len(block), 0.0, 0
    want = Fraction(r) * Fraction(2) ** (big - 150) / 15
    # the smallest float with 12 significant bits at least the range over 15
    e = want.numerator.bit_length() - want.denominator.bit_length() - 12
    while Fraction(2) ** (e + 12) <= want:
        e += 1
    while Fraction(2) ** (e + 11) > want:
        e -= 1
    qd = -(-want.numerator * (2 ** max(-e, 0)) // (want.denominator * (2 ** max(e, 0))))
    scale = Fraction(qd) * Fraction(2) ** e
    if scale < Fraction(2) ** -102:
        return [0] * len(block), 0.0, 0
    z = -round(Fraction(float(lo)) / scale)                     # round(): half to even
    q = [max(0, min(15, round(Fraction(float(x)) / scale) + z)) for x in block]
    return q, float(scale), z


def test_q4_reference_definition(rng):
    x = q4_blocks(rng)
    q, params = quantize_q4(x[None])
    scale, z = q4_split(params)
    q, scale, z = q[0], scale[0, :, 0], z[0, :, 0]
    for i in range(len(x)):
        wq, ws, wz = _q4_definition(x[i])
        assert (float(scale[i]), int(z[i])) == (ws, wz), (i, float(scale[i]), ws, int(z[i]), wz)
        assert q[i].tolist() == wq, i
    live = scale > 0
    assert (~live).sum() >= 6 and live.sum() >= 130
    assert (z < 0).sum() >= 20 and (z > 15).sum() >= 20 and ((z >= 0) & (z <= 15)).sum() >= 40
    assert np.abs(z).max() <= Q4_ZMAX and (np.abs(z) > Q4_ZMAX - 8).any()      # the bound, reached
    quo = x.astype(np.float64)[live] / scale[live, None]
    tie = np.abs(quo - np.floor(quo)) == 0.5
    r = q[live].astype(np.float64) - z[live, None]
    assert tie.sum() >= 400 and (r[tie] % 2 == 0).all()
    assert (np.abs(r[tie]) > np.abs(quo[tie])).any() and (np.abs(r[tie]) < np.abs(quo[tie])).any()


@pytest.mark.parametrize("kernel", ["lane", "tile"])
@pytest.mark.parametrize("how", ["append", "forward"])
def test_q4_store_is_the_reference_quantisation(device, rng, monkeypatch, kernel, how):
    # the stored row words themselves (data nibbles, parameter words, the unused slots zero),
    # K of 4 whole blocks, V of 4 blocks, a partial one and one wholly past d (d 72)
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    blocks = q4_blocks(rng)
    hkv, n = 2, 24
    pick = lambda: blocks[np.concatenate([rng.permutation(len(blocks)), rng.integers(0, len(blocks), 6 * hkv * n)])]
    k = pick()[:4 * hkv * n].reshape(hkv, n, 64)
    v = pick()[:6 * hkv * n].reshape(hkv, n, 96)[..., :72]
    cache = vkattn.KVCache(64, hkv, 64, 72, dtype="q4", device=device)
    if how == "append":
        cache.append(k, v)
    else:
        cache.forward(np.zeros((hkv, n, 64), np.float32), k, v)
    kw, vw, _, _ = cache._read_stored(np.arange(n))
    for got, want in ((kw, k), (vw, v)):
        ref = q4_words(*quantize_q4(want)).transpose(1, 0, 2)
        bad = np.argwhere(got != ref)
        assert bad.size == 0, [(tuple(i), int(got[tuple(i)]), int(ref[tuple(i)])) for i in bad[:8]]
    ks, vs = cache.read()
    assert np.array_equal(bits(ks), bits(round_to(k, "q4"))) and np.array_equal(bits(vs), bits(round_to(v, "q4")))


def _round32(exact, mode):
    """float64 values rounded to float32: "rte" nearest even, "rtz" toward zero."""
    r = exact.astype(np.float32)
    if mode == "rtz":
        away = np.abs(r.astype(np.float64)) > np.abs(exact)
        r[away] = np.nextafter(r[away], np.float32(0))
    return r


@pytest.mark.parametrize("mode", ["rte", "rtz"])
@pytest.mark.parametrize("fused", [False, True])
def test_quantiser_reciprocal_estimate_holds_on_any_rounding(mode, fused):
    # common.glsl quant_prep: y ~ 1/s from a bit trick and 4 Newton steps in float32; quantise1
    # relies on |y s - 1| < 2^-20 whatever the driver's rounding (nearest or toward zero) and
    # whether it fuses y (2 - f y) into an fma. Emulated here for a dense sample of every s.
    s = np.concatenate([np.arange(1 << 23, 1 << 24, 7), [(1 << 24) - 1, 1 << 23, (1 << 23) + 1]]).astype(np.uint32)
    f = s.astype(np.float32)                                      # exact
    y = (np.uint32(0x7ef311c7) - f.view(np.uint32)).view(np.float32)
    assert np.abs(y.astype(np.float64) * s - 1).max() < 0.125
    for _ in range(4):
        fy = f.astype(np.float64) * y                               # exact in float64
        if not fused:
            fy = _round32(fy, mode).astype(np.float64)
        t = _round32(2.0 - fy, mode)
        y = _round32(y.astype(np.float64) * t, mode)
    assert np.abs(y.astype(np.float64) * s - 1).max() < 2.0 ** -20



# ------------------------------------------------------------------------------ fp8 (e4m3, e5m2)

FP8 = ["fp8_e4m3", "fp8_e5m2"]


def fp8_exact(x, fmt, scale):
    """fp8 rounding computed another way, slowly: the exact quotient x / scale as a Fraction,
    rounded half to even among every finite value of the format (saturating past the largest),
    then the bits by table lookup. Finite x only."""
    from fractions import Fraction
    vals = fp8_to_float32(np.arange(0x80, dtype=np.uint8), fmt)            # +0 .. (NaN / Inf at the end)
    table = sorted((Fraction(float(v)), b) for b, v in enumerate(vals) if np.isfinite(v))
    out = []
    for xi in np.asarray(x, np.float32).ravel():
        q = abs(Fraction(float(xi)) / Fraction(float(np.float32(scale))))
        best = table[-1][1]
        for (lo, blo), (hi, bhi) in zip(table, table[1:]):
            if q <= hi:
                mid = (lo + hi) / 2
                best = blo if q < mid or (q == mid and blo % 2 == 0) else bhi
                break
        out.append(best | (0x80 if np.signbit(xi) else 0))
    return np.array(out, np.uint8)


def fp8_adversarial(rng, fmt, scale, normals=200):
    """x such that x / scale lands exactly on the midpoints between adjacent fp8 values (even and
    odd lower neighbours, normal and subnormal, the top of the range), one float32 either side of
    each, half the smallest subnormal, the largest value and past it (saturation), float32
    denormals and signed zeros, both signs. ``scale`` has few significant bits, so mid * scale is
    exact, while 1 / scale is not (a reciprocal multiply misses the ties)."""
    vals = fp8_to_float32(np.arange(0x80, dtype=np.uint8), fmt)
    vals = vals[np.isfinite(vals)].astype(np.float64)
    mids = (vals[1:] + vals[:-1]) / 2
    fmax = vals[-1]
    s = np.float64(np.float32(scale))
    ties = (mids * s).astype(np.float32)
    spec = np.array([0.0, fmax, fmax * 1.03, fmax + (vals[-1] - vals[-2]) / 2, fmax * 1.2, 1e30 / s, vals[1] / 2,
                     vals[1] / 4, vals[1] * 0.51], np.float64) * s
    x = np.concatenate([ties, np.nextafter(ties, np.float32(0)), np.nextafter(ties, np.float32(np.inf)),
                        spec.astype(np.float32),
                        f32(rng.integers(1, 0x800000, 40, dtype=np.uint32)),                    # denormals
                        (rng.standard_normal(normals) * fmax / 8 * s).astype(np.float32)])
    x = np.concatenate([x, -x])
    return x[np.isfinite(x)]


def divided_fp8(x, fmt, scale):
    """float32(x / scale) (a correctly rounded float32 division) then rounded to fp8: the double
    rounding a shader's float division would give at best (GLSL's is 2.5 ULP, worse)."""
    with np.errstate(over="ignore", under="ignore"):
        return fp8_bits((np.asarray(x, np.float32) / np.float32(scale)).astype(np.float32), fmt)


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_reference_definition(rng, fmt):
    # the integer recipe against exact rational rounding, with a scale whose reciprocal is inexact
    # and one that is an arbitrary float32
    for scale in (0.375, 1.0, 0.0137, 3.0e-3):
        x = fp8_adversarial(rng, fmt, scale)
        x = x[rng.permutation(x.size)[:500]]
        got = fp8_bits(x, fmt, scale)
        want = fp8_exact(x, fmt, scale)
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, [(float(x[i]), hex(got[i]), hex(want[i])) for i in bad[:6]]


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_reference_rules(fmt):
    p, bias, maxbits, fmax = FP8_FORMATS[fmt]
    one = lambda v, s=1.0: int(fp8_bits(np.float32(v), fmt, s))
    sub = 2.0 ** (1 - bias - p)
    assert one(fmax) == maxbits and one(-fmax) == 0x80 | maxbits
    assert one(fmax * 1.05) == maxbits and one(3e38) == maxbits and one(-3e38) == 0x80 | maxbits   # saturate
    assert one(np.inf) == (0x7C if fmt == "fp8_e5m2" else maxbits)                                 # Inf
    assert one(-np.inf) == (0xFC if fmt == "fp8_e5m2" else 0x80 | maxbits)
    assert one(np.nan) == 0x7F and one(-np.float32(np.nan)) == 0xFF                                # NaN
    assert one(-0.0) == 0x80 and one(0.0) == 0 and one(-sub / 4) == 0x80                           # signed zeros
    assert one(sub) == 1 and one(sub / 2) == 0 and one(sub * 0.5000001) == 1 and one(sub * 1.5) == 2  # subnormals, ties
    assert one(1e-45) == 0 and one(1e-45, 1e-45) == fp8_bits(np.float32(1.0), fmt)                 # denormal x / scale
    assert one(2.0, 2.0) == one(1.0) and one(7.5, 0.5) == one(15.0)
    assert np.isnan(fp8_to_float32(np.uint8(0x7F), fmt)) and np.isnan(fp8_to_float32(np.uint8(0xFF), fmt))
    if fmt == "fp8_e5m2":
        assert fp8_to_float32(np.uint8(0x7C), fmt) == np.inf and fp8_to_float32(np.uint8(0xFC), fmt) == -np.inf
    else:
        assert fp8_to_float32(np.uint8(0x7E), fmt) == 448.0
    # with scale 0.375 the ties are exact float32 values; a reciprocal multiply would miss them
    vals = fp8_to_float32(np.arange(0x80, dtype=np.uint8), fmt)
    vals = vals[np.isfinite(vals)].astype(np.float64)
    mids = (vals[1:] + vals[:-1]) / 2
    assert np.array_equal((mids * 0.375).astype(np.float32).astype(np.float64), mids * 0.375)
    assert np.array_equal(fp8_bits((mids * 0.375).astype(np.float32), fmt, 0.375) & 1, np.zeros(mids.size, np.uint8))
    # with an arbitrary scale, the float32 quotient lands on ties the exact one misses
    x = fp8_adversarial(np.random.default_rng(1), fmt, 0.0137)
    assert (divided_fp8(x, fmt, 0.0137) != fp8_bits(x, fmt, 0.0137)).sum() > 50


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_reference_is_torchs_rounding(rng, fmt):
    torch = pytest.importorskip("torch")
    tdt = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[fmt]
    fmax = FP8_FORMATS[fmt][3]
    x = np.concatenate([fp8_adversarial(rng, fmt, 1.0), f32(rng.integers(0, 0xffffffff, 200000, dtype=np.uint64)
                                                            .astype(np.uint32))])
    x = x[np.isfinite(x) & (np.abs(x) <= fmax)]                    # torch does not saturate: in range only
    t = torch.from_numpy(x.copy()).to(tdt).view(torch.uint8).numpy()
    assert np.array_equal(fp8_bits(x, fmt), t)
    every = np.arange(256, dtype=np.uint8)
    back = torch.from_numpy(every.copy()).view(tdt).float().numpy()
    ours = fp8_to_float32(every, fmt)
    assert np.array_equal(np.isnan(ours), np.isnan(back))
    assert np.array_equal(bits(ours)[~np.isnan(ours)], bits(back)[~np.isnan(back)])


def run_fp8_probe(device, fmt, x, scale):
    """numerics_probe.comp MODE 3: x (a multiple of 16 float32) -> its fp8 bytes on the device."""
    be = device.backend
    n = x.size // 16
    params = be.buffer(2, np.uint32, name="params")
    ib = be.buffer(x.size, np.uint32, name="in")
    ob = be.buffer(n * 4, np.uint32, name="out")
    sb = be.buffer(1, np.uint32, name="scales")
    params.view()[:] = [n, bits(np.float32(scale))]
    ib.view()[:] = bits(x)
    defines = {"MODE": 3, "KV_F16": 0, "KV_I8": 0, "KV_FP8": 1 if fmt == "fp8_e4m3" else 2}
    prog = be.program(compile_shader("numerics_probe", defines), [params, ib, ob, sb], (-(-n // 64), 1, 1),
                      [64, 1], writes=(2, 3), name="numerics_probe")
    rec = be.recording().upload(params, ib).dispatch(prog).download(ob).build()
    rec.run()
    out = ob.view().copy().view(np.uint8)
    for o in (rec, prog, params, ib, ob, sb):
        o.destroy()
    return out


@pytest.mark.parametrize("fmt", FP8)
def test_probe_fp8_encode_matches_reference(device, rng, fmt):
    specials = f32(np.array([0x7f800000, 0xff800000, 0x7fc00000, 0xffc00001, 0x7f800001, 0x80000000, 0x00000001,
                             0x7f7fffff, 0xff7fffff], np.uint32))
    for scale in (0.375, 1.0, 2.5e-5, 1e-40):                          # 1e-40: a denormal scale
        x = np.concatenate([fp8_adversarial(rng, fmt, scale), specials,
                            f32(rng.integers(0, 0xffffffff, 2000, dtype=np.uint64).astype(np.uint32))])
        x = np.concatenate([x, np.zeros(-x.size % 16, np.float32)])
        got = run_fp8_probe(device, fmt, x, scale)
        want = fp8_bits(x, fmt, scale)
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, [(hex(bits(x)[i]), hex(got[i]), hex(want[i])) for i in bad[:8]]


@pytest.mark.parametrize("native", [0, 1])
@pytest.mark.parametrize("fmt", FP8)
def test_probe_fp8_decode_every_pattern(device, fmt, native):
    """Every byte, through the integer decode (append, attn_lane.comp) and through the halves
    common.glsl's fp8x4_halves makes by bit operations (HALF_NATIVE: attn.comp's GPU decode,
    converted and times FP8_RESTORE; the same bits attn_coopmat.comp stages into its float16
    matrices): numpy's float32 bits, NaN where it is NaN. Bytes are placed so that each word mixes
    patterns (e4m3's NaN bytes 0x7f / 0xff beside normal ones: its mask must touch only theirs)."""
    b = np.arange(256, dtype=np.uint8)
    b = np.concatenate([b, np.random.default_rng(3).permutation(b)])
    words = b.view(np.uint32)
    out, _ = run_probe(device, {"MODE": 4, "KV_F16": 0, "KV_I8": 0, "KV_FP8": 1 if fmt == "fp8_e4m3" else 2,
                                "HALF_NATIVE": native}, words, words.size // 4, b.size)
    want = bits(fp8_to_float32(b, fmt))
    nan = np.isnan(fp8_to_float32(b, fmt))
    assert np.array_equal(np.isnan(out.view(np.float32)), nan)
    bad = np.flatnonzero((out != want) & ~nan)
    assert bad.size == 0, [(hex(b[i]), hex(out[i]), hex(want[i])) for i in bad[:8]]


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("kernel", ["lane", "tile"])
@pytest.mark.parametrize("how", ["append", "forward"])
def test_fp8_store_is_the_reference_rounding(device, rng, monkeypatch, fmt, kernel, how):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    ksc, vsc = np.float32([0.0137, 0.375]), np.float32([2.5e-3, 1.0])     # per kv head
    hkv, n, d, dv = 2, 30, 40, 48
    k = np.stack([_kv_rows(fp8_adversarial(rng, fmt, s, 100), 1, n, d, rng)[0] for s in ksc])
    v = np.stack([_kv_rows(fp8_adversarial(rng, fmt, s, 100), 1, n, dv, rng)[0] for s in vsc])
    cache = vkattn.KVCache(64, hkv, d, dv, dtype=fmt, device=device, k_scale=ksc, v_scale=vsc)
    if how == "append":
        cache.append(k, v)
    else:
        cache.forward(np.zeros((hkv, n, d), np.float32), k, v)      # zero scores whatever K holds
    ks, vs = cache.read()
    for got, want, sc in ((ks, k, ksc), (vs, v, vsc)):
        ref = round_to(want, fmt, sc)
        bad = np.argwhere(bits(got) != bits(ref))
        assert bad.size == 0, [(hex(bits(want)[tuple(i)]), float(got[tuple(i)]), float(ref[tuple(i)]))
                               for i in bad[:8]]
    assert (bits(ks) == 0x80000000).any()                                 # -0 kept
    top = np.float32(FP8_FORMATS[fmt][3]) * ksc[0]
    assert (np.abs(ks[0]) == top).sum() > 3 and (np.abs(k[0]) > top).any()   # saturated
    # the inputs catch a quantiser that divides in float first
    assert (divided_fp8(k[0], fmt, ksc[0]) != fp8_bits(k[0], fmt, ksc[0])).sum() > 10


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_device_array_nan_inf_stored_canonically(device, rng, fmt):
    # numpy inputs with NaN / Inf are refused at the door; a device array's are the caller's, and
    # the stores follow fp8_bits: e4m3 saturates Inf, e5m2 keeps it, NaN is 0x7f with its sign
    hkv, n, d = 1, 2, 16
    x = np.zeros((hkv, n, d), np.float32)
    x[0, 0, :6] = [np.inf, -np.inf, np.nan, -np.float32(np.nan), 1e30, -0.0]
    cache = vkattn.KVCache(8, hkv, d, dtype=fmt, device=device, k_scale=0.5, v_scale=2.0)
    kd, vd = vkattn.to_device(x, device), vkattn.to_device(x, device)
    cache.append(kd, vd)
    cache.forward(vkattn.to_device(np.zeros((1, n, d), np.float32), device), kd, vd)    # the fused store
    words = cache._read_stored(np.arange(2 * n))[0].view(np.uint8)[:, 0, :d]
    for r in range(2 * n):
        assert np.array_equal(words[r], fp8_bits(x[0, r % n], fmt, 0.5)), r
    with pytest.raises(ValueError, match="NaN or Inf"):
        cache.append(x, x)
    for c in (kd, vd):
        c.close()
