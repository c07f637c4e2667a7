"""Shared perf helpers: shapes from environment variables, timing, the result table.

Environment (a bad value is an error, never a silent default):
  VKATTN_PERF_HEADS (32)        query heads          VKATTN_PERF_KV_HEADS (8)   kv heads
  VKATTN_PERF_HEAD_DIM (128)    head_dim             VKATTN_PERF_V_HEAD_DIM     v_head_dim (= head_dim)
  VKATTN_PERF_CONTEXT (per script, comma list)       context lengths L
  VKATTN_PERF_CAPACITY          cache capacity (default: the context a case needs; decode also 8x it:
                                VKATTN_PERF_CAPACITY_MULT)
  VKATTN_PERF_QLEN (512)        prefill query rows   VKATTN_PERF_DTYPE (float16) cache dtype
  VKATTN_PERF_ITERS (20)        timed iterations     VKATTN_PERF_WARMUP (3) untimed iterations
  VKATTN_PERF_CASE              run only cases whose name contains this substring
  VKATTN_PERF_OUT (perf/out)    where results.json / results.csv go (and every script's reports)
  VKATTN_PERF_TORCH_DEVICE (cpu) torch beside vkattn: cpu or cuda
Empty means the default.
"""
from __future__ import annotations

import csv
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np


class PerfConfigError(SystemExit):
    pass


def env_int(name: str, default: int | None, minimum: int = 1) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise PerfConfigError(f"{name}={raw!r}: expected an integer >= {minimum}")
    if value < minimum:
        raise PerfConfigError(f"{name}={raw!r}: expected an integer >= {minimum}")
    return value


def env_int_list(name: str, default: list) -> list:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return list(default)
    out = []
    for part in raw.split(","):
        try:
            value = int(part)
        except ValueError:
            raise PerfConfigError(f"{name}={raw!r}: expected a comma list of positive integers")
        if value < 1:
            raise PerfConfigError(f"{name}={raw!r}: expected a comma list of positive integers")
        out.append(value)
    return out


def env_choice(name: str, default: str, choices: tuple) -> str:
    raw = os.environ.get(name, "").strip() or default
    if raw not in choices:
        raise PerfConfigError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
    return raw


@dataclass
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: str
    qlen: int
    capacity: int | None
    iters: int
    warmup: int

    @classmethod
    def from_env(cls) -> "Shape":
        heads = env_int("VKATTN_PERF_HEADS", 32)
        kv = env_int("VKATTN_PERF_KV_HEADS", 8)
        if heads % kv:
            raise PerfConfigError(f"VKATTN_PERF_HEADS={heads} must be a multiple of VKATTN_PERF_KV_HEADS={kv}")
        d = env_int("VKATTN_PERF_HEAD_DIM", 128)
        return cls(heads=heads, kv_heads=kv, head_dim=d, v_head_dim=env_int("VKATTN_PERF_V_HEAD_DIM", d),
                   dtype=env_choice("VKATTN_PERF_DTYPE", "float16", ("float16", "float32", "int8", "bfloat16", "fp8_e4m3", "fp8_e5m2", "q4")),
                   qlen=env_int("VKATTN_PERF_QLEN", 512), capacity=env_int("VKATTN_PERF_CAPACITY", None),
                   iters=env_int("VKATTN_PERF_ITERS", 20), warmup=env_int("VKATTN_PERF_WARMUP", 3, minimum=0))

    def capacity_for(self, needed: int) -> int:
        cap = self.capacity or needed
        if cap < needed:
            raise PerfConfigError(f"VKATTN_PERF_CAPACITY={cap} is smaller than the {needed} positions a case needs")
        return cap


def selected(name: str) -> bool:
    want = os.environ.get("VKATTN_PERF_CASE", "")
    return want in name


def time_calls(fn, iters: int, warmup: int, device_of=None) -> dict:
    """Wall time per call (median, min); with ``device_of`` (a KVCache built with timestamps=True)
    also the median device time of the call's whole submission, ``kernel_ms``: the median of its
    dispatches' time alone (the submission less its uploads and downloads: what a kernel-only
    timer such as torch's CUDA events around SDPA measures), and ``host_ms``: the median over the
    same calls of wall minus device time (the host's share of a call, its timestamps' own cost
    included)."""
    for _ in range(warmup):
        fn()
    times, dev, kern, host = [], [], [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        ops = device_of.last_timings() if device_of is not None else []
        if ops:
            dev.append(sum(ms for _, ms in ops))
            kern.append(sum(ms for op, ms in ops if not op.startswith(("upload ", "download "))))
            host.append(times[-1] * 1e3 - dev[-1])
    return {"median_ms": float(np.median(times)) * 1e3, "min_ms": float(np.min(times)) * 1e3,
            "device_ms": float(np.median(dev)) if dev else None,
            "kernel_ms": float(np.median(kern)) if kern else None,
            "host_ms": float(np.median(host)) if host else None}


def kernels_line(r) -> str | None:
    """'<case>: K of D ms of device time in the kernels alone' (the submission less its copies;
    with the K/V read rate and torch's time where the row has them), or None where the row has no
    kernel time (no timestamps)."""
    k = r.extra.get("kernel_ms")
    if k is None or r.device_ms is None:
        return None
    rate = f", {r.extra['kv_bytes'] / (k * 1e-3) / 1e9:.0f} GB/s of K/V" if "kv_bytes" in r.extra else ""
    tt = f" (torch {r.torch_ms:.3f} ms)" if r.torch_ms is not None else ""
    return f"{r.case}: {k:.3f} of {r.device_ms:.3f} ms of device time in the kernels alone{rate}{tt}"


def torch_case(q, k, v, causal: bool, ref, dtype: str, iters: int, warmup: int):
    """torch's scaled_dot_product_attention on the same values (tensors made once): (its result
    matches ``ref``, median ms), or (True, None) when torch is not installed. On the CPU in float32;
    with VKATTN_PERF_TORCH_DEVICE=cuda (``perf gpubench`` sets it where torch sees a CUDA or ROCm
    GPU) on that GPU, in float16 for a float16 cache, timed to completion (synchronised), and
    checked at float16 tolerance there. vkattn's causal rows are the last s positions
    (bottom-right aligned): with a past that is an explicit mask, since torch's ``is_causal``
    aligns top-left."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return True, None
    dev = torch_device()
    half = dev != "cpu" and dtype == "float16"
    qt, kt, vt = (torch.from_numpy(np.ascontiguousarray(x))[None].to(dev, torch.float16 if half else torch.float32)
                  for x in (q, k, v))
    s, n = q.shape[1], k.shape[1]
    mask = None
    if causal and s > 1 and s < n:
        mask = torch.from_numpy(np.arange(n)[None, :] <= np.arange(s)[:, None] + (n - s)).to(dev)
    kw = dict(attn_mask=mask, is_causal=causal and s > 1 and s == n, enable_gqa=q.shape[0] != k.shape[0])
    sync = torch.cuda.synchronize if dev != "cpu" else (lambda: None)

    def run():
        with torch.no_grad():
            out = F.scaled_dot_product_attention(qt, kt, vt, **kw)
        sync()
        return out

    got = run()[0].float().cpu().numpy()
    ok = check(got, ref, dtype) if not half else bool(np.allclose(got, ref, atol=2e-3, rtol=2e-3))
    return ok, time_calls(run, iters, warmup)["median_ms"]


_COPY_GBS = None


def copy_bandwidth() -> float:
    """This machine's memory copy bandwidth in GB/s: bytes read + bytes written per second of a
    256 MiB numpy copy (best of 5), the limit a memory-bound kernel is compared against."""
    global _COPY_GBS
    if _COPY_GBS is None:
        src = np.ones(64 << 20, np.float32)
        dst = np.empty_like(src)
        best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(5))
        _COPY_GBS = 2 * src.nbytes / best / 1e9
    return _COPY_GBS


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@dataclass
class Row:
    case: str
    kernel: str
    shape: str
    vkattn_ms: float
    vkattn_min_ms: float
    numpy_ms: float
    speedup_vs_numpy: float
    metric: str = ""
    value: float = 0.0
    verified: bool = False
    device_ms: float | None = None      # Vulkan timestamp queries: the whole submission, median
    torch_ms: float | None = None       # torch CPU scaled_dot_product_attention, median
    extra: dict = field(default_factory=dict)


def print_table(rows: list, device_name: str, torch_label: str = "torch") -> None:
    print(f"\ndevice: {device_name}")
    head = (f"{'case':34} {'vkattn ms':>10} {'(min)':>8} {'device ms':>9} {'numpy ms':>9} {'x numpy':>8} "
            f"{torch_label + ' ms':>9} {'x ' + torch_label:>8} {'metric':>16}  ok")
    print(head)
    print("-" * len(head))
    for r in rows:
        metric = f"{r.value:.2f} {r.metric}" if r.metric else ""
        dev = f"{r.device_ms:9.3f}" if r.device_ms is not None else f"{'-':>9}"
        tt = (f"{r.torch_ms:9.3f} {r.torch_ms / r.vkattn_ms:8.2f}" if r.torch_ms is not None
              else f"{'-':>9} {'-':>8}")
        print(f"{r.case:34} {r.vkattn_ms:10.3f} {r.vkattn_min_ms:8.3f} {dev} {r.numpy_ms:9.3f} "
              f"{r.speedup_vs_numpy:8.2f} {tt} {metric:>16}  {'yes' if r.verified else 'NO'}")


def torch_device() -> str:
    """VKATTN_PERF_TORCH_DEVICE: "cpu" (also where empty or unset) or "cuda" (torch's GPU: CUDA or
    ROCm); PerfConfigError naming it for anything else."""
    dev = os.environ.get("VKATTN_PERF_TORCH_DEVICE", "").strip() or "cpu"
    if dev not in ("cpu", "cuda"):
        raise PerfConfigError(f"VKATTN_PERF_TORCH_DEVICE={dev!r}: expected cpu or cuda")
    return dev


def out_dir() -> Path:
    """Where the perf scripts write their reports: VKATTN_PERF_OUT, default perf/out (made)."""
    out = Path(os.environ.get("VKATTN_PERF_OUT") or Path(__file__).parent / "out")
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_results(rows: list, device_name: str, copy_gbs: float | None = None, stem: str = "results",
                  extra: dict | None = None) -> Path:
    out = out_dir()
    data = {"device": device_name, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "copy_bandwidth_gbs": copy_gbs,
            **(extra or {}), "rows": [asdict(r) for r in rows]}
    (out / f"{stem}.json").write_text(json.dumps(data, indent=2))
    with open(out / f"{stem}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["device"] + list(asdict(rows[0]).keys()) if rows else ["device"])
        for r in rows:
            w.writerow([device_name] + list(asdict(r).values()))
    return out


def check(out, ref, dtype: str) -> bool:
    from vkattn.reference import TOLERANCE     # here, not at the top: perf's modules that time no
                                               # vkattn call load without kp (vkattn's __init__ needs it)
    atol, rtol = TOLERANCE[dtype]
    return bool(np.all(np.abs(out - ref) <= atol + rtol * np.abs(ref)))
