"""Decode: one query token per q head over a cache of L positions (``attend``), per context and
capacity; and the decode step of a model (``forward``: store the token's K/V row at position L-1,
then attend all L, one submission; the cache is rolled back by one position before each call).
Reports effective K/V bandwidth (K/V bytes of the live length read per call / time). For the
longest context the same two calls also run on the other formats the shape's is compared with
(COMPARE: int8, and for a 16-bit format the other one, float16 also q4; for a fp8 format
float16, int8 and the other fp8; for q4 float16 and int8), so float16, bfloat16, int8, fp8 and q4
decode are compared in one run, on the same data
(fp8 caches with the default scale 1.0). Then ``attend`` at the longest context on those formats
again, timed in alternated rounds (ROUNDS, the order reversed every other round; each format's
median and min over all its calls), so a machine whose load changes during the run slows them
alike: the rows "decode L=... <dtype> alternated"."""
from __future__ import annotations

import dataclasses
import time

import numpy as np

import vkattn
from vkattn.formats import FORMATS
from vkattn.reference import attention, round_to

from .common import Row, Shape, check, env_int, env_int_list, selected, time_calls, torch_case

DEFAULT_CONTEXT = [512, 4096]
ROUNDS = 4
# the formats a shape's dtype is compared with at the longest context, in this order
COMPARE = {"float32": ("int8",), "float16": ("bfloat16", "int8", "q4"), "bfloat16": ("float16", "int8"), "int8": (),
           "fp8_e4m3": ("float16", "int8", "fp8_e5m2"), "fp8_e5m2": ("float16", "int8", "fp8_e4m3"),
           "q4": ("float16", "int8")}


def capacities(shape: Shape, L: int) -> list:
    """VKATTN_PERF_CAPACITY if set, else L and 8 x L (capacity must cost nothing)."""
    if shape.capacity:
        return [shape.capacity_for(L)]
    m = env_int("VKATTN_PERF_CAPACITY_MULT", 8)      # a positive integer (empty: the default)
    return [L] if m == 1 else [L, m * L]


def run(shape: Shape, device) -> list:
    rows = []
    contexts = env_int_list("VKATTN_PERF_CONTEXT", DEFAULT_CONTEXT)
    rng = np.random.default_rng(0)
    for L in contexts:
        for cap in capacities(shape, L):
            rows += _case(shape, device, rng, f"decode L={L} cap={cap}", L, cap, step=False)
        rows += _case(shape, device, rng, f"decode step L={L} (forward 1 token)", L, L, step=True)
    for other in COMPARE[shape.dtype] if contexts else ():
        L, alt = max(contexts), dataclasses.replace(shape, dtype=other)
        rows += _case(alt, device, rng, f"decode L={L} cap={L} {other}", L, L, step=False)
        rows += _case(alt, device, rng, f"decode step L={L} {other}", L, L, step=True)
    if contexts and COMPARE[shape.dtype]:
        rows += _alternated(shape, device, rng, max(contexts), (shape.dtype,) + COMPARE[shape.dtype])
    return rows


def _alternated(shape: Shape, device, rng, L: int, dtypes: tuple) -> list:
    """``attend`` over the same L positions stored in each of ``dtypes``, the caches timed in turn:
    ROUNDS rounds of max(1, iters // ROUNDS) calls per format (after ``warmup`` calls each),
    every other round in reverse order."""
    names = {dt: f"decode L={L} {dt} alternated" for dt in dtypes}
    dtypes = tuple(dt for dt in dtypes if selected(names[dt]))
    if len(dtypes) < 2:
        return []
    k = rng.standard_normal((shape.kv_heads, L, shape.head_dim), dtype=np.float32)
    v = rng.standard_normal((shape.kv_heads, L, shape.v_head_dim), dtype=np.float32)
    q = rng.standard_normal((shape.heads, 1, shape.head_dim), dtype=np.float32)
    caches, ok = {}, {}
    try:
        for dt in dtypes:
            caches[dt] = vkattn.KVCache(L, shape.kv_heads, shape.head_dim, shape.v_head_dim, dtype=dt,
                                        device=device, timestamps=True)
            caches[dt].append(k, v)
            ok[dt] = check(caches[dt].attend(q), attention(q, round_to(k, dt), round_to(v, dt)), dt)
            for _ in range(shape.warmup):
                caches[dt].attend(q)
        wall = {dt: [] for dt in dtypes}
        dev = {dt: [] for dt in dtypes}
        per_round = max(1, shape.iters // ROUNDS)
        for r in range(ROUNDS):
            for dt in (dtypes if r % 2 == 0 else dtypes[::-1]):
                cache = caches[dt]
                for _ in range(per_round):
                    t0 = time.perf_counter()
                    cache.attend(q)
                    wall[dt].append(time.perf_counter() - t0)
                    if cache.last_timings():
                        dev[dt].append(sum(ms for _, ms in cache.last_timings()))
    finally:
        for cache in caches.values():
            cache.close()
    tr = time_calls(lambda: attention(q, k, v), shape.iters, shape.warmup)
    rows = []
    for dt in dtypes:
        med = float(np.median(wall[dt])) * 1e3
        kv_bytes = L * token_bytes_of(shape, dt)
        rows.append(Row(case=names[dt], kernel="decode alternated",
                        shape=f"hq={shape.heads} hkv={shape.kv_heads} d={shape.head_dim} dv={shape.v_head_dim} {dt}",
                        vkattn_ms=med, vkattn_min_ms=float(np.min(wall[dt])) * 1e3, numpy_ms=tr["median_ms"],
                        speedup_vs_numpy=tr["median_ms"] / med, metric="GB/s",
                        value=kv_bytes / (med * 1e-3) / 1e9, verified=ok[dt],
                        device_ms=float(np.median(dev[dt])) if dev[dt] else None,
                        extra={"L": L, "capacity": L, "kv_bytes": kv_bytes, "calls": len(wall[dt]), "rounds": ROUNDS}))
    base = rows[0].vkattn_ms
    for r in rows[1:]:
        r.extra[f"time_vs_{dtypes[0]}"] = r.vkattn_ms / base
    return rows


def token_bytes_of(shape: Shape, dtype: str) -> int:
    """K/V bytes per position of a ``dtype`` cache of ``shape`` (vkattn.formats: 16-byte words,
    int8 with a float32 scale per row, q4 with its rows' scale words)."""
    f = FORMATS[dtype]
    words = f.row_words(-(-shape.head_dim // f.per_word)) + f.row_words(-(-shape.v_head_dim // f.per_word))
    return shape.kv_heads * (16 * words + (8 if f.row_scale else 0))


def _case(shape: Shape, device, rng, name: str, L: int, cap: int, step: bool) -> list:
    """``attend`` over L cached positions, or (``step``) ``forward`` storing position L-1 and
    attending all L, the cache rolled back to L-1 positions before each call."""
    if not selected(name):
        return []
    try:
        cache = vkattn.KVCache(cap, shape.kv_heads, shape.head_dim, shape.v_head_dim, dtype=shape.dtype,
                               device=device, timestamps=True)
    except vkattn.DeviceLimitError as e:
        print(f"skip {name}: {e}")
        return []
    k = rng.standard_normal((shape.kv_heads, L, shape.head_dim), dtype=np.float32)
    v = rng.standard_normal((shape.kv_heads, L, shape.v_head_dim), dtype=np.float32)
    kept = L - 1 if step else L
    if kept:
        cache.append(k[:, :kept], v[:, :kept])
    k_new, v_new = k[:, kept:], v[:, kept:]
    k, v = round_to(k, shape.dtype), round_to(v, shape.dtype)
    q = rng.standard_normal((shape.heads, 1, shape.head_dim), dtype=np.float32)
    ref = attention(q, k, v)

    def call():
        if not step:
            return cache.attend(q)
        cache.truncate(L - 1)
        return cache.forward(q, k_new, v_new)

    ok = check(call(), ref, shape.dtype)
    t = time_calls(call, shape.iters, shape.warmup, device_of=cache)
    tr = time_calls(lambda: attention(q, k, v), shape.iters, shape.warmup)
    torch_ok, tt = torch_case(q, k, v, True, ref, shape.dtype, shape.iters, shape.warmup)
    kv_bytes = cache.nbytes * L / cap
    cache.close()
    return [Row(case=name, kernel="decode step" if step else "decode",
                shape=f"hq={shape.heads} hkv={shape.kv_heads} d={shape.head_dim} dv={shape.v_head_dim} {shape.dtype}",
                vkattn_ms=t["median_ms"], vkattn_min_ms=t["min_ms"], numpy_ms=tr["median_ms"],
                speedup_vs_numpy=tr["median_ms"] / t["median_ms"], metric="GB/s",
                value=kv_bytes / (t["median_ms"] * 1e-3) / 1e9, verified=ok and torch_ok, device_ms=t["device_ms"],
                torch_ms=tt, extra={"L": L, "capacity": cap, "kv_bytes": kv_bytes, "kernel_ms": t["kernel_ms"]})]
