"""Decode: one query token per q head over a cache of L positions (``attend``), per context and
capacity; and the decode step of a model (``forward``: store the token's K/V row at position L-1,
then attend all L, one submission; the cache is rolled back by one position before each call).
Reports effective K/V bandwidth (K/V bytes of the live length read per call / time). For the
longest context the same two calls also run on the other formats the shape's is compared with
(COMPARE: int8, and for a 16-bit format the other one), so float16, bfloat16 and int8 decode are
compared in one run, on the same data."""
from __future__ import annotations

import dataclasses
import os

import numpy as np

import vkattn
from vkattn.reference import attention, round_to

from .common import PerfConfigError, Row, Shape, check, env_int_list, selected, time_calls, torch_case

DEFAULT_CONTEXT = [512, 4096]
# the formats a shape's dtype is compared with at the longest context, in this order
COMPARE = {"float32": ("int8",), "float16": ("bfloat16", "int8"), "bfloat16": ("float16", "int8"), "int8": ()}


def capacities(shape: Shape, L: int) -> list:
    """VKATTN_PERF_CAPACITY if set, else L and 8 x L (capacity must cost nothing)."""
    if shape.capacity:
        return [shape.capacity_for(L)]
    mult = os.environ.get("VKATTN_PERF_CAPACITY_MULT", "8")
    try:
        m = int(mult)
    except ValueError:
        raise PerfConfigError(f"VKATTN_PERF_CAPACITY_MULT={mult!r}: expected a positive integer")
    return [L] if m <= 1 else [L, m * L]


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
    return rows


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
                torch_ms=tt, extra={"L": L, "capacity": cap, "kv_bytes": kv_bytes})]
