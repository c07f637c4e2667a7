"""Batch decode on a PagedKVCache: one new token for each of B sequences of ragged lengths, the
whole batch in one submission. Compared with the numpy reference and torch CPU SDPA run sequence
by sequence (neither has a ragged batch), and with the machine's copy bandwidth.

Environment (besides the shape variables of perf/common.py):
  VKATTN_PERF_BATCH (16)          sequences in the batch
  VKATTN_PERF_BATCH_LENS          comma list of B lengths (default: B lengths spread over 100 .. 4000)
  VKATTN_PERF_BLOCK_SIZE (16)     tokens per block
"""
from __future__ import annotations

import numpy as np

import vkattn
from vkattn.reference import attention, round_to

from .common import PerfConfigError, Row, Shape, check, env_int, env_int_list, selected, time_calls, torch_case


def run(shape: Shape, device) -> list:
    b = env_int("VKATTN_PERF_BATCH", 16)
    lens = env_int_list("VKATTN_PERF_BATCH_LENS", [int(x) for x in np.linspace(100, 4000, b).round()])
    if len(lens) != b:
        raise PerfConfigError(f"VKATTN_PERF_BATCH_LENS has {len(lens)} lengths; VKATTN_PERF_BATCH={b}")
    bs = env_int("VKATTN_PERF_BLOCK_SIZE", 16)
    name = f"batch decode B={b} L={min(lens)}..{max(lens)}"
    if not selected(name):
        return []
    rng = np.random.default_rng(3)
    steps = shape.iters + shape.warmup + 2
    blocks = sum(-(-(n + steps) // bs) for n in lens)
    cache = vkattn.PagedKVCache(blocks, bs, shape.kv_heads, shape.head_dim, shape.v_head_dim, dtype=shape.dtype,
                                device=device, timestamps=True)
    sids = [cache.add_sequence() for _ in lens]
    hk, hv = [], []
    for sid, n in zip(sids, lens):       # prefill each sequence (its own submission; not timed)
        k = rng.standard_normal((shape.kv_heads, n, shape.head_dim), dtype=np.float32)
        v = rng.standard_normal((shape.kv_heads, n, shape.v_head_dim), dtype=np.float32)
        cache.forward([sid], rng.standard_normal((shape.heads, n, shape.head_dim), dtype=np.float32), k, v,
                      n_new=[n])
        hk.append(round_to(k, shape.dtype))
        hv.append(round_to(v, shape.dtype))
    q = rng.standard_normal((shape.heads, b, shape.head_dim), dtype=np.float32)
    k1 = rng.standard_normal((shape.kv_heads, b, shape.head_dim), dtype=np.float32)
    v1 = rng.standard_normal((shape.kv_heads, b, shape.v_head_dim), dtype=np.float32)

    out = cache.forward(sids, q, k1, v1)        # checked once against the reference
    ks = [np.concatenate([hk[i], round_to(k1[:, i:i + 1], shape.dtype)], axis=1) for i in range(b)]
    vs = [np.concatenate([hv[i], round_to(v1[:, i:i + 1], shape.dtype)], axis=1) for i in range(b)]
    refs = [attention(q[:, i:i + 1], ks[i], vs[i]) for i in range(b)]
    ok = all(check(out[:, i:i + 1], refs[i], shape.dtype) for i in range(b))

    t = time_calls(lambda: cache.forward(sids, q, k1, v1), shape.iters, shape.warmup, device_of=cache)
    tr = time_calls(lambda: [attention(q[:, i:i + 1], ks[i], vs[i]) for i in range(b)], shape.iters, shape.warmup)
    torch_ms = None
    try:
        import torch  # noqa: F401
        total = 0.0
        for i in range(b):
            good, ms = torch_case(q[:, i:i + 1], ks[i], vs[i], True, refs[i], shape.dtype, shape.iters, shape.warmup)
            ok = ok and good
            total += ms
        torch_ms = total
    except ImportError:
        pass
    kv_bytes = sum(lens) * cache.bytes_per_token
    row = Row(case=name, kernel="batch",
              shape=f"hq={shape.heads} hkv={shape.kv_heads} d={shape.head_dim} dv={shape.v_head_dim} "
                    f"{shape.dtype} bs={bs}",
              vkattn_ms=t["median_ms"], vkattn_min_ms=t["min_ms"], numpy_ms=tr["median_ms"],
              speedup_vs_numpy=tr["median_ms"] / t["median_ms"], metric="GB/s",
              value=kv_bytes / (t["median_ms"] * 1e-3) / 1e9, verified=ok, device_ms=t["device_ms"],
              torch_ms=torch_ms, extra={"lengths": lens, "block_size": bs, "kv_bytes": kv_bytes})
    cache.close()
    return [row]
