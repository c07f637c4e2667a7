"""Append: n new tokens written at the live length L (O(n), independent of L and capacity)."""
from __future__ import annotations

import numpy as np

import vkattn
from vkattn.reference import round_to

from .common import Row, Shape, env_int_list, selected, time_calls

DEFAULT_CONTEXT = [128, 8192]


def run(shape: Shape, device) -> list:
    rows = []
    rng = np.random.default_rng(2)
    contexts = env_int_list("VKATTN_PERF_CONTEXT", DEFAULT_CONTEXT)
    for n in (1, 16):
        for L in contexts:
            name = f"append n={n} L={L}"
            if not selected(name):
                continue
            cap = shape.capacity_for(L + n)
            cache = vkattn.KVCache(cap, shape.kv_heads, shape.head_dim, shape.v_head_dim, dtype=shape.dtype, device=device)
            cache.append(np.zeros((shape.kv_heads, L, shape.head_dim), np.float32),
                         np.zeros((shape.kv_heads, L, shape.v_head_dim), np.float32))
            k = rng.standard_normal((shape.kv_heads, n, shape.head_dim), dtype=np.float32)
            v = rng.standard_normal((shape.kv_heads, n, shape.v_head_dim), dtype=np.float32)
            host_k = np.zeros((shape.kv_heads, cap, shape.head_dim), np.float32)
            host_v = np.zeros((shape.kv_heads, cap, shape.v_head_dim), np.float32)

            def step():
                cache.truncate(L)
                cache.append(k, v)

            def numpy_step():   # the numpy equivalent: write n rows in place into a capacity-sized array
                host_k[:, L:L + n] = round_to(k, shape.dtype)
                host_v[:, L:L + n] = round_to(v, shape.dtype)

            step()
            kk, vv = cache.read()
            ok = bool(np.array_equal(kk[:, L:], round_to(k, shape.dtype)) and np.array_equal(vv[:, L:], round_to(v, shape.dtype)))
            t = time_calls(step, shape.iters, shape.warmup)
            tr = time_calls(numpy_step, shape.iters, shape.warmup)
            rows.append(Row(case=f"{name} cap={cap}", kernel="append",
                            shape=f"hkv={shape.kv_heads} d={shape.head_dim} {shape.dtype}",
                            vkattn_ms=t["median_ms"], vkattn_min_ms=t["min_ms"], numpy_ms=tr["median_ms"],
                            speedup_vs_numpy=tr["median_ms"] / t["median_ms"], verified=ok))
            cache.close()
    return rows
