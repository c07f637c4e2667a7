"""Prefix-cache hit savings: a second request that shares an N-token prefix with a first one, its
time to first token (the attention part) with and without the prefix cache, over
VKATTN_PERF_PREFIX_LAYERS (4) layers of the perf shape.

A "model" is one PagedKVCache per layer (block size 16, VKATTN_PERF_DTYPE, room for four
requests). The first request -- the prefix (VKATTN_PERF_PREFIX tokens, default 1024) and its own
VKATTN_PERF_PREFIX_OWN (64) tokens -- runs through every layer with its token ids and is removed:
its full blocks stay cached. Then, alternately (VKATTN_PERF_ITERS / 4 times, at least 3), the
second request -- the same prefix, other own tokens:

- ``miss``: a sequence without token ids, all N + own tokens forwarded in one call per layer (what
  every request costs without the cache);
- ``hit``: ``add_sequence(token_ids=...)`` finds the prefix's N tokens cached (whole blocks) and
  only the own tokens are forwarded, with their ids.

Each is removed after its run; every hit's own token ids are new (its own full blocks are cached
too when it is removed). ``value`` is the miss median over the hit median (how many times
faster the first token's attention is). Layer 0's outputs of both are checked against the numpy
reference on the whole prompt; ``extra.bit_identical`` says whether the hit's rows equal the miss's
last rows bit for bit (the same K/V, but one call of N + own rows against one of own rows)."""
from __future__ import annotations

import time

import numpy as np

import vkattn
from vkattn.reference import attention, round_to

from .common import Row, Shape, check, env_int, selected

BLOCK = 16


def run(shape: Shape, device) -> list:
    layers = env_int("VKATTN_PERF_PREFIX_LAYERS", 4)
    n_prefix = env_int("VKATTN_PERF_PREFIX", 1024)
    n_own = env_int("VKATTN_PERF_PREFIX_OWN", 64)
    name = f"prefix cache N={n_prefix}+{n_own}, {layers} layers"
    if not selected(name):
        return []
    rng = np.random.default_rng(23)
    total = n_prefix + n_own
    blocks = 4 * (-(-total // BLOCK)) + 4
    caches = [vkattn.PagedKVCache(blocks, BLOCK, shape.kv_heads, shape.head_dim, shape.v_head_dim,
                                  dtype=shape.dtype, device=device) for _ in range(layers)]

    def rows(n):
        return (rng.standard_normal((shape.heads, n, shape.head_dim), dtype=np.float32),
                rng.standard_normal((shape.kv_heads, n, shape.head_dim), dtype=np.float32),
                rng.standard_normal((shape.kv_heads, n, shape.v_head_dim), dtype=np.float32))

    prefix_ids = rng.integers(0, 32000, n_prefix).tolist()
    pq, pk, pv = rows(n_prefix)                     # the prefix's rows: the same in every request
    first_ids = prefix_ids + rng.integers(0, 32000, n_own).tolist()
    q1, k1, v1 = (np.concatenate([a, b], axis=1) for a, b in zip((pq, pk, pv), rows(n_own)))
    q2, k2, v2 = (np.concatenate([a, b], axis=1) for a, b in zip((pq, pk, pv), rows(n_own)))

    for c in caches:                                # the first request: its blocks stay cached
        sid = c.add_sequence(token_ids=first_ids)
        c.forward([sid], q1, k1, v1, n_new=[total], token_ids=[first_ids])
        c.remove_sequence(sid)

    def miss():
        t0 = time.perf_counter()
        out0 = None
        for c in caches:
            sid = c.add_sequence()
            out = c.forward([sid], q2, k2, v2, n_new=[total])
            out0 = out if out0 is None else out0
        dt = time.perf_counter() - t0
        for c in caches:
            c.remove_sequence(c.sequences[0])
        return dt, out0

    def hit():
        # own token ids never seen before (an earlier hit's own blocks are cached too): only the
        # prefix matches; the rows are the same, which the cache cannot tell (it trusts the ids)
        second_ids = prefix_ids + rng.integers(0, 32000, n_own).tolist()
        t0 = time.perf_counter()
        out0, cached = None, None
        for c in caches:
            sid = c.add_sequence(token_ids=second_ids)
            n = c.length(sid)
            out = c.forward([sid], q2[:, n:], k2[:, n:], v2[:, n:], n_new=[total - n],
                            token_ids=[second_ids[n:]])
            out0, cached = (out, n) if out0 is None else (out0, cached)
        dt = time.perf_counter() - t0
        for c in caches:
            c.remove_sequence(c.sequences[0])
        return dt, out0, cached

    miss()                                           # both call shapes have run once (their plans exist)
    hit()
    t_miss, t_hit = [], []
    for _ in range(max(3, shape.iters // 4)):
        dt, out_miss = miss()
        t_miss.append(dt)
        dt, out_hit, cached = hit()
        t_hit.append(dt)
    ref = attention(q2, round_to(k2, shape.dtype), round_to(v2, shape.dtype))
    ok = (cached == n_prefix // BLOCK * BLOCK and check(out_miss, ref, shape.dtype)
          and check(out_hit, ref[:, cached:], shape.dtype))
    same = bool(np.array_equal(out_hit, out_miss[:, cached:]))
    for c in caches:
        c.close()
    m, h = float(np.median(t_miss)), float(np.median(t_hit))
    shp = f"hq={shape.heads} hkv={shape.kv_heads} d={shape.head_dim} {shape.dtype}"
    extra = {"layers": layers, "prefix": n_prefix, "own": n_own, "cached_tokens": cached, "miss_ms": m * 1e3,
             "hit_ms": h * 1e3, "bit_identical": same, "iters": len(t_miss)}
    return [Row(case=f"{name}: miss", kernel="prefix", shape=shp, vkattn_ms=m * 1e3, vkattn_min_ms=min(t_miss) * 1e3,
                numpy_ms=float("nan"), speedup_vs_numpy=float("nan"), metric="", value=0.0, verified=ok,
                extra=extra),
            Row(case=f"{name}: hit", kernel="prefix", shape=shp, vkattn_ms=h * 1e3, vkattn_min_ms=min(t_hit) * 1e3,
                numpy_ms=float("nan"), speedup_vs_numpy=float("nan"), metric="x miss", value=m / h, verified=ok,
                extra=extra)]
