"""Decode: one query token per q head over a cache of L positions (``attend``), per context."""
from __future__ import annotations

import numpy as np

import vkattn
from vkattn.reference import attention, round_to

from .common import Row, Shape, check, env_int_list, selected, time_calls

DEFAULT_CONTEXT = [512, 4096]


def run(shape: Shape, device) -> list:
    rows = []
    contexts = env_int_list("VKATTN_PERF_CONTEXT", DEFAULT_CONTEXT)
    rng = np.random.default_rng(0)
    for L in contexts:
        name = f"decode L={L}"
        if not selected(name):
            continue
        cap = shape.capacity_for(L)
        cache = vkattn.KVCache(cap, shape.kv_heads, shape.head_dim, shape.v_head_dim, dtype=shape.dtype, device=device)
        k = rng.standard_normal((shape.kv_heads, L, shape.head_dim), dtype=np.float32)
        v = rng.standard_normal((shape.kv_heads, L, shape.v_head_dim), dtype=np.float32)
        cache.append(k, v)
        k, v = round_to(k, shape.dtype), round_to(v, shape.dtype)
        q = rng.standard_normal((shape.heads, 1, shape.head_dim), dtype=np.float32)
        ok = check(cache.attend(q), attention(q, k, v), shape.dtype)
        t = time_calls(lambda: cache.attend(q), shape.iters, shape.warmup)
        tr = time_calls(lambda: attention(q, k, v), shape.iters, shape.warmup)
        kv_bytes = cache.nbytes * L / cap
        rows.append(Row(case=f"{name} cap={cap}", kernel="decode",
                        shape=f"hq={shape.heads} hkv={shape.kv_heads} d={shape.head_dim} dv={shape.v_head_dim} {shape.dtype}",
                        vkattn_ms=t["median_ms"], vkattn_min_ms=t["min_ms"], numpy_ms=tr["median_ms"],
                        speedup_vs_numpy=tr["median_ms"] / t["median_ms"], metric="GB/s",
                        value=kv_bytes / (t["median_ms"] * 1e-3) / 1e9, verified=ok))
        cache.close()
    return rows
