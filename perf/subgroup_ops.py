"""Subgroup operations: what a shuffle, a broadcast and a subgroupAdd cost on this device against a
multiply-add (``perf/subgroup_ops.comp``: ITERS iterations of 8 dependent operations per
invocation, one subgroup a workgroup). The kernels exchange values between a subgroup's lanes;
on lavapipe (Mesa 22.3, 2-vCPU Zen 4) the form matters: session 29 read, over three runs, a
shuffle (by a constant lane or by lane ^ h) at 0.7-1.8x the cost of a float multiply-add, a
subgroupBroadcast at 11-19x and a subgroupAdd at 13-15x -- which is why attn_lane.comp sums and
maxes by xor shuffles and linear.comp shares x by constant-lane shuffles, never by broadcasts
or subgroup arithmetic (linear.comp's x shared by broadcasts instead, a scratch build: the
prompt no faster).

Checked: every lane's result equals a numpy simulation of the same steps (uint32 arithmetic; the
float multiply-add in float64, within 1e-5). ``value``: ns per subgroup operation (all lanes).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from vkattn.compiler import compile_shader

from .common import Row, Shape, selected

ITERS = 4096
GROUPS = 64
MODES = ("float fma", "uint multiply-add", "shuffle, constant lane", "shuffle, lane ^ h",
         "broadcast, constant lane", "subgroupAdd")
LANE = (1, 2, 3, 0, 1, 2, 3, 0)          # the constant lane of step i
XOR = (1, 2, 4, 1, 2, 4, 1, 2)           # h of step i


def simulate(mode: int, wg: int, iters: int) -> np.ndarray:
    """One group's output per lane, as subgroup_ops.comp computes it (its header)."""
    lanes = np.arange(wg, dtype=np.uint64)
    if mode == 0:
        f = [(lanes * 8 + i + 1).astype(np.float64) / 64 for i in range(8)]
        for _ in range(iters):
            for i in range(8):
                f[i] = f[i] * 0.5 + f[(i + 1) % 8]
        return sum(f)
    a = [(lanes * 8 + i + 1) % 2**32 for i in range(8)]
    for _ in range(iters):
        for i in range(8):
            n = a[(i + 1) % 8]
            if mode == 1:
                a[i] = (a[i] * 3 + n) % 2**32
            elif mode in (2, 4):
                a[i] = np.full(wg, (int(n[LANE[i]]) + 1) % 2**32, np.uint64)
            elif mode == 3:
                a[i] = (n[lanes ^ (XOR[i] % wg)] + 1) % 2**32
            else:
                a[i] = np.full(wg, (int(n.sum()) + 1) % 2**32, np.uint64)
    r = np.zeros(wg, np.uint64)
    for x in a:
        r ^= x
    return r.astype(np.uint32)


def run(shape: Shape, device) -> list:
    rows = []
    be = device.backend
    wg = device.subgroup_size
    info = device.info
    need = 0x1 | 0x4 | 0x8 | 0x10       # VK_SUBGROUP_FEATURE_ BASIC, ARITHMETIC, BALLOT, SHUFFLE
    if wg < 4 or info.subgroup_supported_operations & need != need or not info.subgroup_supported_stages & 0x20:
        print(f"skip subgroup ops: subgroup of {wg}, operations {info.subgroup_supported_operations:#x} "
              f"in compute: {bool(info.subgroup_supported_stages & 0x20)}")
        return rows
    spv = compile_shader("subgroup_ops", {}, src_dir=Path(__file__).parent)
    out = be.buffer(GROUPS * wg, np.uint32, name="subgroup ops")
    base = None
    for mode, what in enumerate(MODES):
        name = f"subgroup ops: {what} x{wg} lanes"
        if not selected(name):
            continue
        prog = be.program(spv, [out], (GROUPS, 1, 1), [wg, mode, ITERS], writes=(0,), name="subgroup_ops")
        rec = be.recording().dispatch(prog).download(out).build(timestamps=True)
        stamps = []
        for _ in range(max(3, shape.iters // 4)):
            rec.run()
            stamps.append(rec.timings(device.info.timestamp_period)[0][1])
        got = out.view().reshape(GROUPS, wg)
        want = simulate(mode, wg, ITERS)
        if mode == 0:
            ok = bool(np.allclose(got.view(np.float32), want, rtol=1e-5))
        else:
            ok = bool((got == want).all())
        dev_ms = float(np.median(stamps[1:]))
        ns = dev_ms * 1e6 / (GROUPS * ITERS * 8)
        base = ns if mode == 0 else base
        rows.append(Row(case=name, kernel="subgroup_ops", shape=f"{GROUPS} groups x {ITERS} x 8 ops",
                        vkattn_ms=dev_ms, vkattn_min_ms=float(np.min(stamps[1:])), numpy_ms=float("nan"),
                        speedup_vs_numpy=float("nan"), metric="ns/op", value=ns, verified=ok, device_ms=dev_ms,
                        extra={"x_fma": ns / base if base else None}))
        print(f"  {name}: {ns:.2f} ns per subgroup op" + (f", {ns / base:.1f}x a float fma" if base else ""))
        rec.destroy()
        prog.destroy()
    out.destroy()
    return rows
