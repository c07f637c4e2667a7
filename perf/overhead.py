"""Per-step overhead: decode at a tiny context vs a bare Kompute round trip in the same run.

The bare round trip is the floor any Vulkan call from Python pays here: one recorded sequence
(upload 64 bytes, one trivial dispatch copying 64 bytes, download 64 bytes) re-evaluated.
"""
from __future__ import annotations

import numpy as np

import vkattn
from vkattn.compiler import compile_shader
from vkattn.reference import attention, round_to

from .common import Row, Shape, check, env_int, selected, time_calls


def bare_round_trip_ms(device, iters: int, warmup: int) -> dict:
    be = device.backend
    src, dst = be.buffer(16, np.uint32, name="src"), be.buffer(16, np.uint32, name="dst")
    params = be.buffer(5, np.uint32, name="params")
    params.view()[:] = (4, 0, 1, 2, 3)
    unused = [be.buffer(1, np.float32, name="unused") for _ in range(4)]
    # gather_slots.comp as a plain copy of 4 uvec4 words (one kv head, slot = row)
    prog = be.program(compile_shader("gather_slots"), [src, src, dst, dst, params] + unused, (1, 1, 1),
                      [64, 1, 1], writes=(2, 3, 7, 8), name="copy")
    rec = be.recording().upload(src, params).dispatch(prog).download(dst).build()
    t = time_calls(rec.run, iters, warmup)
    for o in [rec, prog, src, dst, params] + unused:
        o.destroy()
    return t


def run(shape: Shape, device) -> list:
    L = env_int("VKATTN_PERF_OVERHEAD_CONTEXT", 16)
    name = f"overhead decode L={L} vs bare round trip"
    if not selected(name):
        return []
    iters, warmup = max(shape.iters, 50), max(shape.warmup, 10)
    rng = np.random.default_rng(3)
    cache = vkattn.KVCache(max(L, 64), shape.kv_heads, shape.head_dim, shape.v_head_dim, dtype=shape.dtype, device=device)
    k = rng.standard_normal((shape.kv_heads, L, shape.head_dim), dtype=np.float32)
    v = rng.standard_normal((shape.kv_heads, L, shape.v_head_dim), dtype=np.float32)
    cache.append(k, v)
    q = rng.standard_normal((shape.heads, 1, shape.head_dim), dtype=np.float32)
    ok = check(cache.attend(q), attention(q, round_to(k, shape.dtype), round_to(v, shape.dtype)), shape.dtype)
    bare = bare_round_trip_ms(device, iters, warmup)
    t = time_calls(lambda: cache.attend(q), iters, warmup)
    tr = time_calls(lambda: attention(q, k, v), iters, warmup)
    cache.close()
    return [Row(case=name, kernel="overhead", shape=f"hq={shape.heads} hkv={shape.kv_heads} d={shape.head_dim}",
                vkattn_ms=t["median_ms"], vkattn_min_ms=t["min_ms"], numpy_ms=tr["median_ms"],
                speedup_vs_numpy=tr["median_ms"] / t["median_ms"], metric="x bare",
                value=t["median_ms"] / bare["median_ms"], verified=ok, extra={"bare_ms": bare["median_ms"]})]
