"""``python -m vkattn check``: the self-test for the Vulkan device in front of you.

Runs every kernel path vkattn selects on the chosen device (``VKATTN_DEVICE`` picks one, as
everywhere) against the numpy reference and prints one row per case, the device and driver
facts, one verdict line, and writes a JSON report to attach to a bug report. Exit status 0 when
every case passed, 1 when any failed, 2 when there is no Vulkan device.

Cases, for each attention kernel that runs on the device (attn.comp "tile" everywhere;
attn_lane.comp "lane" where a subgroup of at most 16 shuffles, i.e. CPU drivers;
attn_coopmat.comp "coopmat" wherever it can run -- the device has cooperative matrices, glslang
compiles them and the kernel passed its self-test, Device.coopmat_problem -- whether or not vkattn
picks it there (tuning.coopmat_wanted: on GPUs whose speed probe times it faster); it takes the
prefill and chunk calls of its cases, decode goes to the device's other kernel; it runs the cases
of the storage formats its matrices hold -- float16, int8, fp8 -- the others' prefill falling back
to the device's other kernel, whose own pass checks them), the ones vkattn picks by default marked
``*``:

- float32, float16, bfloat16, int8, fp8 (e4m3, e5m2; scale 1.0) and q4 caches: decode (split-K, merged on the device), a causal prefill
  from an empty cache, a chunk over a past (fused append), a long prompt (appended first, then
  attended), odd head dims with ``v_head_dim != head_dim``, non-causal attend;
- variants on float16: window + sinks, broadcast and per-head masks, softcap, ALiBi, LSE,
  RoPE (NeoX, partial rotary) on keys and queries;
- a paged batch: ragged chunked prefill, batch decode, a fork, every sequence checked;
- bit-exact storage: adversarial rows (half-ULP ties, half subnormals, values near the float16
  maximum, float32 denormals; bfloat16 ties both ways, the carry into the exponent, bfloat16's
  largest value, denormals, -0; int8 rows whose quotients land on .5; fp8 with per-head scales
  whose reciprocal is inexact: quotients exactly on the midpoints between fp8 values (ties both
  ways) and one float32 either side, saturation past the largest value, subnormals, half the
  smallest subnormal, float32 denormals, -0, and through a device array NaN and +-Inf; q4
  blocks of 16 whose quotients land on .5 (ties both ways) and one float32 either side, with the
  zero point inside 0 .. 15 and far outside it, scales from 2^-90 to 2^60, ranges whose scale
  carries or sits on a shift boundary, zero, denormal and -0 blocks, a last partial block (d 72);
  ``q4_adversarial_blocks``) appended and read back, compared bit
  for bit with ``reference.round_to`` / ``reference.fp8_bits`` (q4: also the stored row words,
  scales included, with ``reference.q4_words``);
- a split-K stress: a long decode split over many workgroups (coopmat: a 7-row chunk over the
  same past), repeated, every repetition equal bit for bit to the first and within tolerance of
  the reference.

Per case: max |got - ref|, NMSE = sum((got - ref)^2) / sum(ref^2), and pass/fail at
``reference.TOLERANCE`` (``|got - ref| <= atol + rtol * |ref|``; storage cases: 0 differing bits).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

import numpy as np

from . import KVCache, PagedKVCache, RoPE, __version__, default_device, measure, reference, tuning
from .array import to_device
from .formats import FORMATS
from ._vkinfo import VulkanUnavailableError
from .reference import Q4_MAX_ABS, TOLERANCE, attention, round_to

DTYPES = ("float32", "float16", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2", "q4")
# the fp8 storage case's per-head scales: the reciprocal of neither is a float32 (a division or
# a reciprocal multiply would round the quotient before fp8 does)
FP8_SCALES = (0.0137, 0.375)


@dataclass
class CaseResult:
    name: str
    kernel: str
    dtype: str
    ok: bool
    max_err: float = 0.0
    nmse: float = 0.0
    checked: int = 0            # result arrays (or stored rows) compared
    seconds: float = 0.0
    detail: str = ""


@dataclass
class Report:
    device: dict
    vkattn: str
    default_kernel: str
    kernels: list
    environment: dict
    prefill_kernel: str = ""        # the kernel of prefill and chunks (coopmat where picked), else default_kernel
    cases: list = field(default_factory=list)

    @property
    def failed(self) -> list:
        return [c for c in self.cases if not c.ok]

    def to_json(self) -> dict:
        d = asdict(self)
        d["verdict"] = "PASS" if not self.failed else "FAIL"
        d["passed"] = len(self.cases) - len(self.failed)
        d["failed"] = len(self.failed)
        return d


class _Acc:
    """Accumulates the comparisons of one case."""

    def __init__(self, dtype: str):
        self.atol, self.rtol = TOLERANCE[dtype]
        self.max_err, self.num, self.den, self.checked, self.bad = 0.0, 0.0, 0.0, 0, []

    def compare(self, got, ref, label: str = "out", atol=None, rtol=None):
        got = np.asarray(got, np.float64)
        ref = np.asarray(ref, np.float64)
        atol = self.atol if atol is None else atol
        rtol = self.rtol if rtol is None else rtol
        if got.shape != ref.shape:
            self.bad.append(f"{label}: shape {got.shape} != {ref.shape}")
            return
        if not np.isfinite(got).all():
            self.bad.append(f"{label}: {int((~np.isfinite(got)).sum())} non-finite values")
            return
        err = np.abs(got - ref)
        self.checked += 1
        self.max_err = max(self.max_err, float(err.max(initial=0.0)))
        self.num += float((err ** 2).sum())
        self.den += float((ref ** 2).sum())
        over = err > atol + rtol * np.abs(ref)
        if over.any():
            self.bad.append(f"{label}: {int(over.sum())} of {over.size} values beyond atol {atol:g} rtol {rtol:g}")

    def exact(self, got, ref, label: str):
        got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
        self.checked += 1
        diff = got.view(np.uint32) != ref.view(np.uint32)
        if diff.any():
            self.max_err = max(self.max_err, float(np.abs(got.astype(np.float64) - ref).max()))
            self.bad.append(f"{label}: {int(diff.sum())} of {diff.size} stored values differ from the reference's bits")

    def nmse(self) -> float:
        return self.num / self.den if self.den > 0 else 0.0


class _Mirror:
    """What a KVCache must hold: every appended row as the cache stores it."""

    def __init__(self, hkv, d, dv, dtype):
        self.dtype = dtype
        self.k = np.zeros((hkv, 0, d), np.float32)
        self.v = np.zeros((hkv, 0, dv), np.float32)

    def append(self, k, v):
        self.k = np.concatenate([self.k, round_to(k, self.dtype)], axis=1)
        self.v = np.concatenate([self.v, round_to(v, self.dtype)], axis=1)


def _rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


# ------------------------------------------------------------------------------------- cases


def _case_kv_paths(dev, rng, acc, dtype, hkv, group, d, dv, past, steps, chunk, long_s):
    """Prefill (causal, from empty or over `past` appended rows), a chunk, a long prompt, decode
    steps, then non-causal attend: all against the reference on the stored values."""
    cap = past + long_s + chunk + steps + 7
    hq = hkv * group
    with KVCache(cap, hkv, d, dv, dtype=dtype, device=dev) as c:
        m = _Mirror(hkv, d, dv, dtype)
        if past:
            k, v = _rand(rng, hkv, past, d), _rand(rng, hkv, past, dv)
            c.append(k, v)
            m.append(k, v)
        for label, s in (("long prompt", long_s), ("chunk", chunk)) + tuple(("decode", 1) for _ in range(steps)):
            q, k, v = _rand(rng, hq, s, d), _rand(rng, hkv, s, d), _rand(rng, hkv, s, dv)
            out = c.forward(q, k, v)
            m.append(k, v)
            acc.compare(out, attention(q, m.k, m.v), f"{label} s={s} at L={c.length}")
        q = _rand(rng, hq, 3, d)
        acc.compare(c.attend(q, causal=False), attention(q, m.k, m.v, causal=False), "attend non-causal")
        ks, vs = c.read()
        acc.exact(ks, m.k, "stored K")
        acc.exact(vs, m.v, "stored V")


def _variants(rng, hq, s, total):
    return {
        "window+sinks": dict(window=19, n_sink=3),
        "mask": dict(mask=np.where(rng.random((s, total)) < 0.2, -np.inf, rng.standard_normal((s, total))).astype(np.float32)),
        "mask per head": dict(mask=rng.standard_normal((hq, s, total)).astype(np.float32)),
        "softcap": dict(softcap=3.0),
        "alibi": dict(alibi_slopes=(2.0 ** -np.arange(1, hq + 1)).astype(np.float32)),
    }


def _case_variant(dev, rng, acc, name, dtype="float16", hkv=2, group=2, d=40, past=90):
    hq = hkv * group
    with KVCache(past + 16, hkv, d, dtype=dtype, device=dev) as c:
        m = _Mirror(hkv, d, d, dtype)
        k, v = _rand(rng, hkv, past, d), _rand(rng, hkv, past, d)
        c.append(k, v)
        m.append(k, v)
        for s in (7, 1):                                  # a chunk (fused), then a decode step
            q, k, v = _rand(rng, hq, s, d), _rand(rng, hkv, s, d), _rand(rng, hkv, s, d)
            kw = _variants(rng, hq, s, c.length + s)[name]
            out, lse = c.forward(q, k, v, return_lse=True, **kw)
            m.append(k, v)
            ref, ref_lse = attention(q, m.k, m.v, return_lse=True, **kw)
            acc.compare(out, ref, f"s={s}")
            acc.compare(lse, ref_lse, f"lse s={s}")


def _case_rope(dev, rng, acc, dtype="float16", hkv=2, group=3, d=64):
    cfg = RoPE(style="neox", base=10000.0, rotary_dim=32)
    with KVCache(200, hkv, d, dtype=dtype, device=dev, rope=cfg) as c:
        k0, v0 = _rand(rng, hkv, 120, d), _rand(rng, hkv, 120, d)
        c.append(k0, v0)
        k1, v1, q1 = _rand(rng, hkv, 9, d), _rand(rng, hkv, 9, d), _rand(rng, hkv * group, 9, d)
        out = c.forward(q1, k1, v1, rope_q=True)
        ks, vs = c.read()
        pos = np.arange(129)
        kr = round_to(reference.rope(np.concatenate([k0, k1], 1), pos, rotary_dim=32), dtype)
        acc.compare(ks, kr, "stored rotated K", atol=1e-6, rtol=2e-3)   # fp32 rotation may fuse: an ulp
        qr = reference.rope(q1, pos[120:], rotary_dim=32)
        acc.compare(out, attention(qr, ks, vs), "rotated queries")


def _case_paged(dev, rng, acc, dtype, hkv=2, group=4, d=64, block=16):
    hq = hkv * group
    with PagedKVCache(-(-600 // block) + 8, block, hkv, d, dtype=dtype, device=dev) as c:
        mk, mv = {}, {}
        sids = [c.add_sequence() for _ in range(3)]
        for sid in sids:
            mk[sid], mv[sid] = np.zeros((hkv, 0, d), np.float32), np.zeros((hkv, 0, d), np.float32)

        def step(ids, counts):
            n = sum(counts)
            q, k, v = _rand(rng, hq, n, d), _rand(rng, hkv, n, d), _rand(rng, hkv, n, d)
            out = c.forward(ids, q, k, v, n_new=counts)
            a = 0
            for sid, cnt in zip(ids, counts):
                mk[sid] = np.concatenate([mk[sid], round_to(k[:, a:a + cnt], dtype)], 1)
                mv[sid] = np.concatenate([mv[sid], round_to(v[:, a:a + cnt], dtype)], 1)
                acc.compare(out[:, a:a + cnt], attention(q[:, a:a + cnt], mk[sid], mv[sid]), f"seq {sid} +{cnt}")
                a += cnt

        step(sids, [37, 1, 130])          # ragged chunked prefill
        step(sids[::-1], [1, 5, 20])
        child = c.fork(sids[2])
        mk[child], mv[child] = mk[sids[2]].copy(), mv[sids[2]].copy()
        for _ in range(2):
            step(sids + [child], [1, 1, 1, 1])
        for sid in sids + [child]:
            ks, vs = c.read(sid)
            acc.exact(ks, mk[sid], f"stored K seq {sid}")
            acc.exact(vs, mv[sid], f"stored V seq {sid}")


def adversarial_rows(rng, hkv: int, n: int, d: int, dtype: str) -> np.ndarray:
    """Rows that expose a storage conversion which does not round like the reference: float16
    half-ULP ties and their neighbours, half subnormals, values near the float16 maximum, float32
    denormals; bfloat16 ties (even and odd kept halves) and their float32 neighbours, mantissas
    that carry into the exponent, the largest bfloat16 and the float32 just below its rounding
    to Inf, float32 denormals (bfloat16 keeps them) and signed zeros; int8 rows whose x / scale
    lands on .5 and near it, tiny and zero rows; q4 blocks of 16 (see ``q4_adversarial_blocks``)."""
    x = rng.standard_normal((hkv, n, d)).astype(np.float32)
    flat = x.reshape(-1, d)
    if dtype == "float16":
        h = rng.integers(0x0001, 0x7bff, size=flat.shape, dtype=np.uint16).view(np.float16).astype(np.float32)
        nxt = (h.astype(np.float16).view(np.uint16) + 1).view(np.float16).astype(np.float32)
        tie = (h.astype(np.float64) + nxt) / 2                  # exactly half-way (exact in float32)
        kind = rng.integers(0, 6, size=flat.shape)
        out = np.select([kind == 0, kind == 1, kind == 2, kind == 3, kind == 4],
                        [tie, np.nextafter(tie.astype(np.float32), np.float32(np.inf)),
                         np.nextafter(tie.astype(np.float32), np.float32(0)),
                         rng.uniform(-6.1e-5, 6.1e-5, flat.shape),            # half subnormals
                         rng.choice([65504.0, 65503.0, -65490.0, 1e-40, -1e-40, 3e-45], flat.shape)],
                        flat).astype(np.float32)
        signs = np.where(rng.random(flat.shape) < 0.5, -1, 1).astype(np.float32)
        out = np.where(kind < 3, out * signs, out)
        return out.reshape(x.shape)
    if dtype == "bfloat16":
        # kept halves in [2^-40, 2^40): ties 0x8000 below them (even and odd kept halves), one
        # float32 either side; then denormals, carries and the range's edges
        kept = rng.integers(0x2b80, 0x5380, size=flat.shape, dtype=np.uint32) << np.uint32(16)
        tie = kept | np.uint32(0x8000)
        kind = rng.integers(0, 7, size=flat.shape)
        edges = np.array([0x7f7f0000, 0x7f7f7fff, 0x7f7f7fff, 0x3f7fffff, 0x3f7f8000, 0x007fffff, 0x007f8000,
                          0x00008000, 0x00018000, 0x00000001, 0x80000000, 0x00000000, 0x0000ffff], np.uint32)
        bits = np.select([kind == 0, kind == 1, kind == 2, kind == 3, kind == 4],
                         [tie, tie + np.uint32(1), tie - np.uint32(1),
                          rng.integers(0, 0x800000, size=flat.shape, dtype=np.uint32),        # float32 denormals
                          rng.choice(edges, size=flat.shape)],
                         flat.view(np.uint32))
        signs = np.where(rng.random(flat.shape) < 0.5, np.uint32(0x80000000), np.uint32(0))
        return (bits.astype(np.uint32) | signs).view(np.float32).reshape(x.shape)
    if dtype in reference.FP8_FORMATS:
        # per kv head h (scale FP8_SCALES[h % 2]): quotients on the midpoints between adjacent
        # fp8 values and one float32 either side, the top of the range and past it, half the
        # smallest subnormal, float32 denormals, zeros; both signs
        vals = reference.fp8_to_float32(np.arange(0x80, dtype=np.uint8), dtype)
        vals = vals[np.isfinite(vals)].astype(np.float64)
        mids = (vals[1:] + vals[:-1]) / 2
        for h in range(hkv):
            s = np.float64(np.float32(FP8_SCALES[h % 2]))
            tie = (mids * s).astype(np.float32)
            pool = np.concatenate([tie, np.nextafter(tie, np.float32(0)), np.nextafter(tie, np.float32(np.inf)),
                                   (np.array([vals[-1], vals[-1] * 1.1, vals[1] / 2, vals[1] * 0.51, 0.0, 1e30]) * s)
                                   .astype(np.float32),
                                   rng.integers(1, 0x800000, 8, dtype=np.uint32).view(np.float32)])
            hx = x[h].reshape(-1)
            hx[:] = rng.choice(pool, hx.size)
            hx[:min(pool.size, hx.size)] = pool[:hx.size]
            hx *= np.where(rng.random(hx.size) < 0.5, -1, 1).astype(np.float32)
        return x
    if dtype == "q4":
        pool, bs = q4_adversarial_blocks(rng), reference.Q4_BLOCK
        for r in range(flat.shape[0]):
            for b in range(0, d, bs):
                flat[r, b:b + bs] = pool[(r * 7 + b // bs) % len(pool)][:min(bs, d - b)]
        return x
    if dtype == "int8":
        for r in range(flat.shape[0]):
            kind = r % 4
            if kind == 3:                             # a zero row (scale 0) every fourth row
                flat[r] = 0.0
                continue
            amax = np.float32(rng.uniform(0.5, 4.0) * (1e-30 if kind == 2 else 1.0))    # kind 2: tiny
            scale = amax / np.float32(127)
            row = ((rng.integers(-126, 126, size=d) + 0.5) * np.float64(scale)).astype(np.float32)  # x/scale ~ k + 1/2
            if kind == 1:
                row = np.nextafter(row, np.float32(np.inf))
            row[rng.integers(0, d)] = amax if r % 2 else -amax                 # the row's max |x|
            flat[r] = row
        return x
    return x


def q4_adversarial_blocks(rng) -> np.ndarray:
    """Blocks (n, 16) float32 whose q4 quantisation (``reference.quantize_q4``) a careless
    implementation gets wrong: quotients x / scale exactly on k + 1/2 (ties to the even
    neighbour, down and up) and one float32 either side, with the zero point inside 0 .. 15 and
    far outside it (one-sided blocks), over scales from 2^-90 to 2^60; ranges whose scale rounds
    up to a carry (qd 4096) or sits on a shift boundary; a lo and hi whose alignment drops bits;
    a spread below 1/256 of the size (the zero point's bound decides); tiny blocks either side of
    the zero-block threshold, denormals, zeros and -0, one nonzero element, the largest values a
    q4 cache accepts."""
    B = reference.Q4_BLOCK
    f32 = lambda u: np.asarray(u, np.uint32).view(np.float32)
    blocks = []
    for e in (-90, -60, -3, 0, 9, 60):
        for zl in (0, 7, 15, -40, 300, -3000):
            qd = int(rng.integers(1024, 2048)) * 2 + 1                 # an odd 12-bit significand
            s = np.float64(qd) * 2.0 ** (e - 11)
            k = rng.integers(-zl, 15 - zl, B - 2)
            for nudge in (None, np.inf, -np.inf):
                x = ((k + 0.5) * s).astype(np.float32)
                if nudge is not None:
                    x = np.nextafter(x, np.float32(nudge))
                blocks.append(np.concatenate([np.float32([-zl * s, (15 - zl) * s]), x]))
    u = 2.0 ** -20
    for r in (15 * 4095 + 1, 15 * 4096, 15 * 4096 + 1, 15 * 8191 + 1, 2 ** 24 - 1):   # carry, shift edges
        for lo in (0.0, -3.0 * u):
            hi = np.float32(r * u + lo)
            blocks.append(np.concatenate([np.float32([lo, hi]), rng.uniform(lo, float(hi), B - 2).astype(np.float32)]))
    blocks.append(np.float32([3.0000002, -0.70000005, 1e-9, -1e-9] * (B // 4)))     # alignment drops bits
    blocks.append(np.float32([1.0, -2.0 ** -30, 0.5, 2.0 ** -25] * (B // 4)))
    for sign in (1, -1):                                                            # spread < size / 256
        blocks.append(np.float32(sign * (1000 + np.arange(B) / 1024)))
        blocks.append(np.float32(sign * (3 + rng.uniform(0, 2.0 ** -10, B))))
    for e in (-96, -97, -98, -99, -100):                                            # the zero-block threshold
        blocks.append((rng.uniform(-1, 1, B) * 2.0 ** e).astype(np.float32))
        blocks.append(np.float32(np.linspace(0, 2.0 ** e, B)))
    blocks += [f32(rng.integers(1, 0x7fffff, B, dtype=np.uint32)),
               f32(rng.integers(0x80000001, 0x807fffff, B, dtype=np.uint32)),
               np.concatenate([np.float32([1e-3]), f32(rng.integers(1, 0x7fffff, B - 1, dtype=np.uint32))]),
               np.zeros(B, np.float32), np.full(B, -0.0, np.float32),
               np.concatenate([[np.float32(2.5)], np.full(B - 1, -0.0, np.float32)]),
               np.eye(1, B, 5, dtype=np.float32)[0] * np.float32(-3.0),
               rng.uniform(-Q4_MAX_ABS, Q4_MAX_ABS, B).astype(np.float32),
               np.float32([Q4_MAX_ABS, -Q4_MAX_ABS] * (B // 2)),
               np.float32(rng.uniform(1e36, Q4_MAX_ABS, B))]
    for _ in range(8):
        blocks.append((rng.standard_normal(B) * rng.uniform(0.1, 10) + rng.uniform(-5, 5)).astype(np.float32))
    return np.stack(blocks).astype(np.float32)


def _case_storage(dev, rng, acc, dtype, hkv=2, n=67, d=72):
    k = adversarial_rows(rng, hkv, n, d, dtype)
    v = adversarial_rows(rng, hkv, n, d, dtype)
    fp8 = dtype in reference.FP8_FORMATS
    sk = sv = 1.0
    extra = {}
    if fp8:
        sk = np.float32([FP8_SCALES[h % 2] for h in range(hkv)])
        sv = sk[::-1].copy()
        extra = {"k_scale": sk, "v_scale": sv}
    with KVCache(2 * n + 8 + (4 if fp8 else 0), hkv, d, dtype=dtype, device=dev, **extra) as c:
        c.append(k, v)                                    # append.comp
        q = _rand(rng, hkv, 5, d) * np.float32(1e-3)
        c.forward(q, k[:, :5], v[:, :5])                  # the fused store of the attention kernel
        ks, vs = c.read()
        acc.exact(ks[:, :n], round_to(k, dtype, sk), "append K")
        acc.exact(vs[:, :n], round_to(v, dtype, sv), "append V")
        acc.exact(ks[:, n:n + 5], round_to(k[:, :5], dtype, sk), "fused store K")
        acc.exact(vs[:, n:n + 5], round_to(v[:, :5], dtype, sv), "fused store V")
        if dtype == "q4":                                 # the row words: nibbles, scales, zero padding
            kw, vw, _, _ = c._read_stored(np.arange(n + 5))
            for label, got, x in (("K", kw, k), ("V", vw, v)):
                want = reference.q4_words(*reference.quantize_q4(np.concatenate([x, x[:, :5]], 1))).transpose(1, 0, 2)
                acc.checked += 1
                if not np.array_equal(got, want):
                    acc.bad.append(f"q4 {label}: {int((got != want).sum())} stored words differ from q4_words")
        if fp8:
            # NaN and +-Inf (a numpy input's are refused; a device array's are stored): append
            # and the fused store, compared as bits (NaN != NaN as values)
            # (d: a multiple of 16, the width a fp8 cache reads device rows in)
            x = np.zeros((hkv, 2, d), np.float32)
            x[:, :, :6] = [np.inf, -np.inf, np.nan, -np.float32(np.nan), 3e38, -0.0]
            dk, dq = to_device(x, dev), to_device(np.zeros((hkv, 2, d), np.float32), dev)
            try:
                c.append(dk, dk)
                c.forward(dq, dk, dk)
                words = c._read_stored(np.arange(n + 5, n + 9))
                for label, got, s in (("K", words[0], sk), ("V", words[1], sv)):
                    got = got.view(np.uint8)[..., :d].transpose(1, 0, 2)
                    want = reference.fp8_bits(np.concatenate([x, x], 1), dtype, s[:, None, None])
                    acc.checked += 1
                    if not np.array_equal(got, want):
                        acc.bad.append(f"NaN/Inf {label}: {int((got != want).sum())} stored bytes differ "
                                       f"from fp8_bits")
            finally:
                dk.close()
                dq.close()


def _case_splitk(dev, rng, acc, dtype, repeats, hkv=2, group=8, d=128, length=6000, rows=1):
    with tuning.env_set(VKATTN_DECODE_SPLITS="64"), KVCache(length + 1, hkv, d, dtype=dtype, device=dev) as c:
        k, v = _rand(rng, hkv, length, d), _rand(rng, hkv, length, d)
        c.append(k, v)
        ks, vs = c.read()
        q = _rand(rng, hkv * group, rows, d)
        ref = attention(q, ks, vs)
        first = c.attend(q)
        acc.compare(first, ref, "run 0")
        differ = 0
        for _ in range(repeats - 1):
            got = c.attend(q)
            differ += int(not np.array_equal(got.view(np.uint32), first.view(np.uint32)))
            acc.compare(got, ref, "repeat")
        if differ:
            acc.bad.append(f"{differ} of {repeats - 1} repetitions differ bit for bit from the first")


# ------------------------------------------------------------------------------------- driver


def _cases(quick: bool, repeats: int, kernel: str = "tile"):
    """(name, dtype, function(dev, rng, acc)) in order."""
    out = []
    rows = 7 if kernel == "coopmat" else 1          # coopmat: its split-K is a chunk's
    # coopmat: the formats its matrices hold (the others' calls would run the fallback's kernel,
    # which its own pass checks, under coopmat's name)
    dtypes = [d for d in DTYPES if kernel != "coopmat" or FORMATS[d].matrices]
    for dtype in dtypes:
        out.append(("decode+prefill 8/2 heads d128", dtype,
                    lambda dev, rng, acc, dt=dtype: _case_kv_paths(dev, rng, acc, dt, 2, 4, 128, 128, 300, 3, 9, 45)))
        if not quick:
            out.append(("odd dims 3/1 heads d37 dv24", dtype,
                        lambda dev, rng, acc, dt=dtype: _case_kv_paths(dev, rng, acc, dt, 1, 3, 37, 24, 0, 2, 13, 40)))
            out.append(("paged batch, fork", dtype, lambda dev, rng, acc, dt=dtype: _case_paged(dev, rng, acc, dt)))
        out.append(("storage bit-exact", dtype, lambda dev, rng, acc, dt=dtype:
                    _case_storage(dev, rng, acc, dt, d=80 if dt in reference.FP8_FORMATS else 72)))
    names = ["window+sinks", "mask", "mask per head", "softcap", "alibi"] if not quick else ["mask", "softcap"]
    for name in names:
        out.append((f"variant {name} (+lse)", "float16", lambda dev, rng, acc, n=name: _case_variant(dev, rng, acc, n)))
    out.append(("rope neox partial, rotated q", "float16", lambda dev, rng, acc: _case_rope(dev, rng, acc)))
    for dtype in (("float16",) if quick else [d for d in ("float16", "bfloat16", "int8", "fp8_e4m3", "q4") if d in dtypes]):
        out.append((f"split-K stress x{repeats}" + (" (chunk)" if rows > 1 else ""), dtype,
                    lambda dev, rng, acc, dt=dtype: _case_splitk(dev, rng, acc, dt, repeats, rows=rows)))
    return out


def device_facts(dev) -> dict:
    info = asdict(dev.info)
    info["is_software"] = dev.is_software
    info["tile_cluster"] = dev.tile_cluster()
    info["lane_subgroup"] = dev.lane_subgroup()
    info["texel_buffers"] = dev.texel_buffers                      # attn_lane.comp reads K/V as texel views
    info["half_native"] = dev.half_native()                        # its float16 / fp8 decode: the device's conversion
    info["kp_enabled_features"] = sorted(dev.backend.features)      # empty: kp unpatched or none offered
    info["coopmat_shape"] = dev.coopmat_shape()
    info["coopmat_problem"] = dev.coopmat_problem()                # "": attn_coopmat.comp runs here
    info["coopmat_speed"] = dev._coopmat_speed          # the speed probe's figures, where it ran
    return info


def run_check(dev=None, *, quick: bool = False, repeats: int = 20, progress=None) -> Report:
    """All cases on ``dev`` (default: vkattn's default device); returns the report."""
    dev = dev or default_device()
    default = tuning.kernel_for(dev)
    try:
        prefill_default = "coopmat" if tuning.coopmat_wanted(dev) else default
    except ValueError:                  # VKATTN_KERNEL=coopmat where it cannot run: the cases say why
        prefill_default = default
    # attn_coopmat.comp wherever it can run, picked or not (VKATTN_KERNEL=coopmat where it cannot:
    # the cases fail, naming why)
    forced = tuning.forced_kernel() == "coopmat"
    kernels = ["tile"] + (["lane"] if dev.lane_subgroup() else []) + \
        (["coopmat"] if forced or prefill_default == "coopmat" or not dev.coopmat_problem() else [])
    env = {k: v for k, v in os.environ.items() if k.startswith(("VKATTN_", "LP_", "MESA_", "RADV_", "VK_"))}
    rep = Report(device=device_facts(dev), vkattn=__version__, default_kernel=default, kernels=kernels,
                 prefill_kernel=prefill_default,
                 environment={"python": platform.python_version(), "numpy": np.__version__,
                              "platform": platform.platform(), **env})
    for kernel in kernels:
        for i, (name, dtype, fn) in enumerate(_cases(quick, repeats, kernel)):
            rng = np.random.default_rng(1000 * i + (kernel == "lane") + 2 * (kernel == "coopmat"))
            acc = _Acc(dtype)
            t0 = time.perf_counter()
            try:
                with tuning.env_set(VKATTN_KERNEL=kernel):
                    fn(dev, rng, acc)
                detail = "; ".join(acc.bad[:3]) + (f" (+{len(acc.bad) - 3} more)" if len(acc.bad) > 3 else "")
                ok = not acc.bad
            except Exception as e:  # a case that cannot run on this device is a failure, with the reason
                ok, detail = False, f"{type(e).__name__}: {e}".splitlines()[0][:300]
                if os.environ.get("VKATTN_CHECK_TRACEBACK"):
                    traceback.print_exc()
            res = CaseResult(name=name, kernel=kernel + ("*" if kernel in (default, prefill_default) else ""),
                             dtype=dtype, ok=ok,
                             max_err=acc.max_err, nmse=acc.nmse(), checked=acc.checked,
                             seconds=round(time.perf_counter() - t0, 3), detail=detail)
            rep.cases.append(res)
            if progress:
                progress(res)
    return rep


def _row(c: CaseResult) -> str:
    return (f"{c.name:32} {c.kernel:6} {c.dtype:8} {c.max_err:10.2e} {c.nmse:10.2e} {c.checked:5d} "
            f"{c.seconds:7.2f}  {'ok' if c.ok else 'FAIL  ' + c.detail}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vkattn check", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="vkattn-check.json", help="report file (default: %(default)s; '-' for none)")
    p.add_argument("--quick", action="store_true", help="fewer cases (one shape per dtype, two variants)")
    p.add_argument("--remeasure", action="store_true",
                   help="run the cooperative-matrix self-test and speed probe again (not their verdicts cached on disk)")
    p.add_argument("--repeats", type=int, default=20, help="split-K stress repetitions (default: %(default)s)")
    args = p.parse_args(argv)
    if args.repeats < 2:
        p.error("--repeats: expected an integer >= 2")
    if args.json != "-":                # a report path that cannot be written fails now, not after every case
        try:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "a"):
                pass
        except OSError as e:
            p.error(f"--json {args.json}: cannot write the report there ({type(e).__name__}: {e.strerror or e})")
    logging.getLogger("vkattn").setLevel(logging.WARNING)     # the table, not every first pipeline build
    try:
        dev = default_device()
    except VulkanUnavailableError as e:
        print(f"vkattn check: no Vulkan device: {e}", file=sys.stderr)
        return 2
    i = dev.info
    print(f"device   : [{dev.index}] {dev.name} ({i.device_type}), driver {i.driver_name or '?'} {i.driver_info}, "
          f"Vulkan {i.api_version}")
    print(f"limits   : subgroup {i.subgroup_size}, shared memory {i.max_compute_shared_memory_size} B, "
          f"storage range {i.max_storage_buffer_range} B, workgroup {dev.max_workgroup_size}")
    print(f"kernels  : tile cluster {dev.tile_cluster()}, lane subgroup {dev.lane_subgroup() or 'unusable'}; "
          f"device features enabled: {', '.join(sorted(dev.backend.features)) or 'none'}")
    if dev.lane_subgroup():
        loads = "texel views" if dev.texel_buffers else "storage buffers"
        halves = "the device's half conversion (probed exact)" if dev.half_native() else "integer operations"
        print(f"lane     : K/V from {loads} where nothing is appended in the dispatch; float16 / fp8 decoded "
              f"by {halves}")
    if args.remeasure:
        measure.remeasure(dev)
    problem = dev.coopmat_problem()
    if not problem:
        print(f"matrices : cooperative {'x'.join(map(str, dev.coopmat_shape()))} float16 -> float32, subgroup "
              f"{dev.coopmat_subgroup()}, self-test passed ({len(measure.COOPMAT_CASES)} cases"
              f"{', run now' if args.remeasure else ''})")
    elif dev.info.cooperative_matrix:
        print(f"matrices : attn_coopmat.comp does not run here: {problem}")
    print(f"prefill  : {tuning.coopmat_choice(dev)}")
    print("(the first run on a machine builds every pipeline: up to a few minutes on lavapipe)")
    print(f"\n{'case':32} {'kernel':6} {'dtype':8} {'max|err|':>10} {'NMSE':>10} {'n':>5} {'s':>7}  result")
    print("-" * 100)
    rep = run_check(dev, quick=args.quick, repeats=args.repeats, progress=lambda c: print(_row(c), flush=True))
    n, bad = len(rep.cases), len(rep.failed)
    print("-" * 100)
    picks = rep.default_kernel if rep.prefill_kernel == rep.default_kernel else \
        f"{rep.prefill_kernel} for prefill and chunks, {rep.default_kernel} for decode"
    print(f"kernel * = what vkattn picks on this device ({picks}); tolerances "
          f"{', '.join(f'{k} atol {a:g} rtol {r:g}' for k, (a, r) in TOLERANCE.items())}; storage: bit-exact")
    if args.json != "-":
        with open(args.json, "w") as f:
            json.dump(rep.to_json(), f, indent=1, default=str)
        print(f"report   : {args.json}")
    if bad:
        print(f"verdict  : FAIL -- {bad} of {n} cases failed on {dev.name}: "
              + ", ".join(f"{c.name} [{c.kernel} {c.dtype}]" for c in rep.failed[:6]))
        return 1
    print(f"verdict  : PASS -- {n} of {n} cases on {dev.name}")
    return 0
