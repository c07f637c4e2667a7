"""Shared-prefix batch decode (cascade, vkattn.cascade) against today's paged batch decode: B
sequences forked from one prefix of S tokens (its full blocks shared), each with its own 64 .. 256
tokens (spread over the batch), one new token each per step, the whole batch in one submission.

Two caches hold the same tokens; one decodes with VKATTN_CASCADE=1 (the prefix attended once per
kv head and query tile for the whole batch, merged with each sequence's own keys by log-sum-exp),
the other with =0 (today: every sequence reads the prefix). The steps alternate between them (the
first of each pair alternating too); medians of wall and device time per step and their ratio come
from one run. Both are checked against the numpy reference on the first step.

Traffic: device bytes the step's dispatches read, from the traffic model of ``perf gpu``
(perf/gpu.py: every workgroup's key, query and split-K partial loads), as the caches plan them on
this device and on RADV navi21's limits (the GPU report's tile kernel), for the lengths of the
first timed step.

Environment (besides the shape variables of perf/common.py):
  VKATTN_PERF_CASCADE_BATCH (16)     sequences in the batch
  VKATTN_PERF_CASCADE_SHARED (2048)  shared prefix tokens
  VKATTN_PERF_BLOCK_SIZE (16)        tokens per block
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

import vkattn
from vkattn.device import PlanningDevice
from vkattn.reference import attention, round_to
from vkattn.tools import vkpipeline as vp
from vkattn.tuning import decode_key_bound

from . import gpu
from .common import Row, Shape, check, env_int, selected

OWN = (64, 256)
FAMILY = "navi21"       # the GPU whose planning limits the second traffic figure uses


def run(shape: Shape, device) -> list:
    b = env_int("VKATTN_PERF_CASCADE_BATCH", 16)
    shared = env_int("VKATTN_PERF_CASCADE_SHARED", 2048)
    bs = env_int("VKATTN_PERF_BLOCK_SIZE", 16)
    name = f"cascade decode B={b} shared={shared}+{OWN[0]}..{OWN[1]}"
    if not selected(name):
        return []
    own = [int(x) for x in np.linspace(OWN[0], OWN[1], b).round()]
    rng = np.random.default_rng(11)
    steps = 2 * (shape.iters + shape.warmup) + 4
    blocks = -(-shared // bs) + sum(-(-(n + steps) // bs) + 1 for n in own)
    hq, hkv, d, dv = shape.heads, shape.kv_heads, shape.head_dim, shape.v_head_dim
    caches = [vkattn.PagedKVCache(blocks, bs, hkv, d, dv, dtype=shape.dtype, device=device, timestamps=True)
              for _ in range(2)]
    kp = rng.standard_normal((hkv, shared, d), dtype=np.float32)
    vp = rng.standard_normal((hkv, shared, dv), dtype=np.float32)
    ko = rng.standard_normal((hkv, sum(own), d), dtype=np.float32)
    vo = rng.standard_normal((hkv, sum(own), dv), dtype=np.float32)
    for c in caches:                    # not timed: the prefix, the forks, each sequence's own tokens
        root = c.add_sequence()
        c.append([root], kp, vp, n_new=[shared])
        sids = [root] + [c.fork(root) for _ in range(b - 1)]
        c.append(sids, ko, vo, n_new=own)
    q = rng.standard_normal((hq, b, d), dtype=np.float32)
    k1 = rng.standard_normal((hkv, b, d), dtype=np.float32)
    v1 = rng.standard_normal((hkv, b, dv), dtype=np.float32)
    modes = ("1", "0")                  # cascade, today
    saved = os.environ.get("VKATTN_CASCADE")

    def step(i):
        os.environ["VKATTN_CASCADE"] = modes[i]
        t0 = time.perf_counter()
        out = caches[i].forward(sids, q, k1, v1)
        dt = time.perf_counter() - t0
        took = "merge_lse" in caches[i]._last_rec.ops
        dev = sum(ms for _, ms in caches[i].last_timings()) if caches[i].last_timings() else None
        return out, dt, dev, took

    try:
        lens = [caches[0].length(s) for s in sids]
        traffic = _traffic(device, shape, bs, shared, [n - shared for n in lens])
        outs = [step(i) for i in (0, 1)]            # builds the plans; checked against the reference
        ok = all(outs[i][3] == (modes[i] == "1") for i in (0, 1))
        starts = np.cumsum([0] + own)
        for j, sid in enumerate(sids):   # the reference on the inputs as stored (not the cache's read-back)
            kk, vv = (round_to(np.concatenate([p, o[:, starts[j]:starts[j + 1]], n[:, j:j + 1]], axis=1), shape.dtype)
                      for p, o, n in ((kp, ko, k1), (vp, vo, v1)))
            ref = attention(q[:, j:j + 1], kk, vv)
            ok = ok and all(check(o[0][:, j:j + 1], ref, shape.dtype) for o in outs)
        for _ in range(shape.warmup):
            step(0), step(1)
        wall, dev = ([], []), ([], [])
        for it in range(shape.iters):
            for i in ((0, 1) if it % 2 == 0 else (1, 0)):
                _, dt, dms, took = step(i)
                ok = ok and took == (modes[i] == "1")
                wall[i].append(dt * 1e3)
                if dms is not None:
                    dev[i].append(dms)
    finally:
        if saved is None:
            os.environ.pop("VKATTN_CASCADE", None)
        else:
            os.environ["VKATTN_CASCADE"] = saved
        for c in caches:
            c.close()
    med = [float(np.median(w)) for w in wall]
    dmed = [float(np.median(x)) if x else None for x in dev]
    shp = f"hq={hq} hkv={hkv} d={d} dv={dv} {shape.dtype} bs={bs}"
    extra = {"batch": b, "shared": shared, "own": own, "block_size": bs, "today_ms": med[1],
             "today_min_ms": min(wall[1]), "today_device_ms": dmed[1], "cascade_device_ms": dmed[0],
             "wall_ratio": med[0] / med[1], "device_ratio": dmed[0] / dmed[1] if dmed[1] else None, **traffic}
    row = Row(case=name, kernel="cascade", shape=shp, vkattn_ms=med[0], vkattn_min_ms=min(wall[0]),
              numpy_ms=float("nan"), speedup_vs_numpy=float("nan"), metric="x today", value=med[1] / med[0],
              verified=ok, device_ms=dmed[0], extra=extra)
    return [row]


def _traffic(device, shape: Shape, bs: int, shared: int, own: list) -> dict:
    """Device bytes read by a decode step of the batch (own tokens ``own`` after ``shared``
    shared ones), today's and the cascade's, from perf/gpu.py's model: on ``device`` and on
    FAMILY's planning limits where its RADV null device is here."""
    @dataclass
    class Call(gpu.Call):           # the perf shape's heads, not one of the report's shapes
        dims: tuple = ()

        @property
        def heads(self) -> tuple:
            return self.dims

    out = {}
    dims = (shape.heads, shape.kv_heads, shape.head_dim)
    bound = decode_key_bound(shared + max(own) + 1, 1 << 30)       # as the caches size a decode plan
    calls = [Call("today", "", shape.dtype, "paged", lens=tuple(shared + n for n in own), capacity=bound, dims=dims),
             Call("cascade", "", shape.dtype, "cascade", lens=tuple(own), shared=shared, capacity=bound, dims=dims)]
    devs = [("here", device)]
    try:
        info = vp.family_device_info(FAMILY)
        if info is not None:
            devs.append((FAMILY, PlanningDevice(info)))
    except Exception as e:          # no RADV null device here: the local figure alone
        out["traffic_note"] = f"{FAMILY}: {e}"
    for tag, dev in devs:
        reads = [sum(x.reads for x in gpu.plan_call(dev, c).dispatches) for c in calls]
        out[f"reads_today_{tag}"], out[f"reads_cascade_{tag}"] = reads
        out[f"reads_ratio_{tag}"] = reads[1] / reads[0]
    return out


def notes(rows: list) -> None:
    for r in rows:
        if r.kernel != "cascade":
            continue
        e = r.extra
        dev = (f", device {e['cascade_device_ms']:.2f} vs {e['today_device_ms']:.2f} ms (x{e['device_ratio']:.2f})"
               if e.get("device_ratio") else "")
        print(f"  {r.case}: cascade {r.vkattn_ms:.2f} ms vs today {e['today_ms']:.2f} ms per step "
              f"(x{e['wall_ratio']:.2f} the time){dev}")
        for tag in ("here", FAMILY):
            if f"reads_today_{tag}" in e:
                print(f"    bytes read per step ({tag}): {e[f'reads_cascade_{tag}'] / 2**20:.1f} MiB vs "
                      f"{e[f'reads_today_{tag}'] / 2**20:.1f} MiB today (x{e[f'reads_ratio_{tag}']:.2f})")
