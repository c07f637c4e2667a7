"""Prefill: QLEN causal query rows appended and attended (``forward``) on top of a past."""
from __future__ import annotations

import numpy as np

import vkattn
from vkattn.reference import attention, round_to

from .common import Row, Shape, check, env_int_list, selected, time_calls, torch_case

DEFAULT_PAST = [0, 1536]


def causal_flops(hq, s, past, d, dv) -> float:
    keys = s * past + s * (s + 1) / 2          # visible (query, key) pairs
    return 2.0 * hq * keys * (d + dv)


def run(shape: Shape, device) -> list:
    rows = []
    s = shape.qlen
    rng = np.random.default_rng(1)
    # VKATTN_PERF_CONTEXT here is the total context after the prefill (past = context - QLEN)
    contexts = env_int_list("VKATTN_PERF_CONTEXT", [s + p for p in DEFAULT_PAST])
    for ctx in contexts:
        past = ctx - s
        name = f"prefill S={s} past={past}"
        if past < 0 or not selected(name):     # (shorter than its rows: no case; none at all exits 2)
            continue
        cap = shape.capacity_for(ctx)
        cache = vkattn.KVCache(cap, shape.kv_heads, shape.head_dim, shape.v_head_dim, dtype=shape.dtype,
                               device=device, timestamps=True)
        kp_ = rng.standard_normal((shape.kv_heads, past, shape.head_dim), dtype=np.float32)
        vp = rng.standard_normal((shape.kv_heads, past, shape.v_head_dim), dtype=np.float32)
        if past:
            cache.append(kp_, vp)
        q = rng.standard_normal((shape.heads, s, shape.head_dim), dtype=np.float32)
        k = rng.standard_normal((shape.kv_heads, s, shape.head_dim), dtype=np.float32)
        v = rng.standard_normal((shape.kv_heads, s, shape.v_head_dim), dtype=np.float32)
        kall = round_to(np.concatenate([kp_, k], 1), shape.dtype)
        vall = round_to(np.concatenate([vp, v], 1), shape.dtype)

        def step():
            cache.truncate(past)
            return cache.forward(q, k, v)

        ref = attention(q, kall, vall)
        ok = check(step(), ref, shape.dtype)
        t = time_calls(step, shape.iters, shape.warmup, device_of=cache)
        tr = time_calls(lambda: attention(q, kall, vall), max(1, shape.iters // 4), min(1, shape.warmup))
        torch_ok, tt = torch_case(q, kall, vall, True, ref, shape.dtype, shape.iters, shape.warmup)
        ok = ok and torch_ok
        flops = causal_flops(shape.heads, s, past, shape.head_dim, shape.v_head_dim)
        rows.append(Row(case=name, kernel="prefill",
                        shape=f"hq={shape.heads} hkv={shape.kv_heads} d={shape.head_dim} {shape.dtype}",
                        vkattn_ms=t["median_ms"], vkattn_min_ms=t["min_ms"], numpy_ms=tr["median_ms"],
                        speedup_vs_numpy=tr["median_ms"] / t["median_ms"], metric="GFLOP/s",
                        value=flops / (t["median_ms"] * 1e-3) / 1e9, verified=ok, device_ms=t["device_ms"],
                        torch_ms=tt, extra={"S": s, "past": past, "flops": flops, "kernel_ms": t["kernel_ms"]}))
        cache.close()
    return rows
