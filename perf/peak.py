"""Multiply-add ceiling: the rate at which this device's compiled shaders multiply and add
(``perf/peak.comp``: independent vec4 chains, no loads), beside the rate numpy's and torch's CPU
matmuls reach on the whole-model example's prompt shapes (SmolLM2-135M: a 37-token prompt through
its gate/up, down and q/k/v matrices). On lavapipe the shader runs on the same CPU as torch, so the
ceiling against torch's achieved rate says how far a matmul kernel of any design can go there
(issue 30: the example's prompt at eager's tokens per second).

Rows: one per chain count (``CHAINS`` vec4 chains an invocation: 4 * CHAINS vector registers a
lane on a CPU driver), metric GFLOP/s from the device time (2 flops a multiply-add);
``numpy ms`` / ``torch ms`` are the time numpy's / torch's matmul takes for the same flops at
the best rate it reached on the prompt shapes (so ``x numpy`` > 1: the shader's ceiling is above
numpy's matmul). ``extra`` holds each matmul's GFLOP/s. The shaders and the matmuls are timed in
alternated rounds (this machine's speed drifts by up to 2x between minutes), medians of all
calls. Checked: the shader's sums equal numpy's (a = 0.5 makes every product exact: a fused or a
split multiply-add gives the same bits).
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from vkattn.compiler import compile_shader

from .common import Row, Shape, selected

ITERS = 2048
GROUPS = 512                                    # workgroups on a CPU driver (a few ms of work)
GPU_GROUPS = 16384                              # on a GPU: enough invocations to fill an H200's 132 SMs
PROMPT = 37                                     # the example's chat prompt (perf model)
MATMULS = {"gate/up": (576, 3072), "down": (1536, 576), "qkv": (576, 960)}      # SmolLM2-135M (K, N)


def _expected(a: np.ndarray, b: np.ndarray, lanes: int, chains: int) -> np.ndarray:
    """peak.comp's output for ``lanes`` invocations in numpy: (lanes, 4) float32 (an invocation's
    sums depend on its index & 7 only: eight computed, repeated)."""
    acc = b[None] + np.arange(8, dtype=np.float32)[:, None, None]       # (8, chains, 4)
    for _ in range(ITERS):
        acc = acc * a[None] + b[None]           # float32: the product exact, the sum rounded once
    s = acc[:, 0]
    for c in range(1, chains):
        s = s + acc[:, c]
    return s[np.arange(lanes) & 7]


ROUNDS = 5


def run(shape: Shape, device) -> list:
    be = device.backend
    wg = device.lane_subgroup() or device.subgroup_size
    chain_counts = [c for c in (1, 2, 3, 4, 6) if selected(f"peak multiply-add, {c} vec4 chains")]
    if not chain_counts:
        return []
    try:
        import torch
    except ImportError:                         # torch is optional (make setup-hf installs it)
        torch = None
    groups = GROUPS if device.is_software else GPU_GROUPS
    out = be.buffer(groups * wg * 4, np.float32, name="peak out")
    shaders, owned = {}, []
    for chains in chain_counts:                 # each chain count's program, checked once
        a = np.full((chains, 4), 0.5, np.float32)
        b = (np.arange(chains * 4, dtype=np.float32).reshape(chains, 4) % 5) + 1.0
        ab = be.buffer(2 * chains * 4, np.float32, name="peak ab")
        ab.view()[:] = np.concatenate([a.ravel(), b.ravel()])
        up = be.recording().upload(ab).build()
        up.run()
        up.destroy()
        prog = be.program(compile_shader("peak", {"CHAINS": chains}, src_dir=Path(__file__).parent),
                          [ab, out], (groups, 1, 1), [wg, ITERS], writes=(1,), name="peak")
        rec = be.recording().dispatch(prog).download(out).build(timestamps=True)
        rec.run()
        ok = bool(np.array_equal(out.view().reshape(-1, 4), _expected(a, b, groups * wg, chains)))
        shaders[chains] = (rec, ok)
        owned += [rec, prog, ab]
    rng = np.random.default_rng(3)
    mats = {}
    for name, (k, n) in MATMULS.items():
        x = rng.standard_normal((PROMPT, k), dtype=np.float32)
        w = rng.standard_normal((n, k), dtype=np.float32)
        mats[name] = (2.0 * PROMPT * k * n, x, w)
    walls = {c: [] for c in chain_counts}
    stamps = {c: [] for c in chain_counts}
    secs = {(lib, name): [] for lib in ("numpy", "torch") for name in MATMULS}
    per = max(5, shape.iters // ROUNDS)
    for _ in range(ROUNDS):
        for chains in chain_counts:
            rec = shaders[chains][0]
            for _ in range(per):
                t0 = time.perf_counter()
                rec.run()
                walls[chains].append(time.perf_counter() - t0)
                stamps[chains].append(rec.timings(device.info.timestamp_period)[0][1])
        for name, (flops, x, w) in mats.items():
            fns = [("numpy", lambda: x @ w.T)]
            if torch is not None:
                xt, wt = torch.from_numpy(x), torch.from_numpy(w)
                fns.append(("torch", lambda: torch.nn.functional.linear(xt, wt)))
            for lib, fn in fns:
                for _ in range(3):              # its threads awake again after the shaders' turn
                    fn()
                for _ in range(per):
                    t0 = time.perf_counter()
                    fn()
                    secs[(lib, name)].append(time.perf_counter() - t0)
    rates = {f"{lib} {name} GFLOP/s": round(mats[name][0] / np.median(t) / 1e9, 2)
             for (lib, name), t in secs.items() if t}
    best = {lib: max((r for k, r in rates.items() if k.startswith(lib)), default=None) for lib in ("numpy", "torch")}
    rows = []
    for chains in chain_counts:
        flops = 2.0 * groups * wg * chains * 4 * ITERS
        dev_ms = float(np.median(stamps[chains]))
        same = {lib: None if r is None else flops / (r * 1e9) * 1e3 for lib, r in best.items()}
        rows.append(Row(case=f"peak multiply-add, {chains} vec4 chains", kernel="peak",
                        shape=f"{groups} x {wg} invocations, {ITERS} steps",
                        vkattn_ms=float(np.median(walls[chains])) * 1e3, vkattn_min_ms=min(walls[chains]) * 1e3,
                        numpy_ms=same["numpy"], speedup_vs_numpy=same["numpy"] / dev_ms, metric="GFLOP/s",
                        value=flops / (dev_ms * 1e-3) / 1e9, verified=shaders[chains][1], device_ms=dev_ms,
                        torch_ms=same["torch"], extra={"chains": chains, "flops": flops, **rates}))
    for x in owned:
        x.destroy()
    out.destroy()
    return rows
