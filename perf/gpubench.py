"""``python -m perf gpubench`` (``make gpu-bench``): the decode, prefill and batch perf cases on a
Vulkan GPU, and torch's scaled_dot_product_attention on the same GPU beside them where torch sees
a CUDA or ROCm device. Prints the table with the Vulkan device and driver and writes
perf/out/gpu_bench.{json,csv}.

The GPU is the one vkattn picks (the first non-CPU Vulkan device; ``VKATTN_DEVICE`` = an index or
a part of the name chooses another). Where that device runs attn_coopmat.comp (cooperative matrices,
Device.coopmat_problem), the prefill cases run twice: on it ("[coopmat]") and on attn.comp
("[tile]", VKATTN_KERNEL=tile), side by side, and a line says which one vkattn picks there and
its speed probe's figures (tuning.coopmat_choice); elsewhere the line above the table says why the
cooperative-matrix kernel is not timed. Shapes and iterations come from the VKATTN_PERF_* variables of
perf/common.py; decode contexts default to 512, 4096 and 16384 here. A machine whose only Vulkan
device is a CPU driver (lavapipe) is refused with a message, unless
VKATTN_GPU_BENCH_ALLOW_SOFTWARE=1 (how the test suite runs it end to end)."""
from __future__ import annotations

import dataclasses
import os
import sys

import vkattn
from vkattn import tuning

from . import batch, decode, prefill
from .common import PerfConfigError, Shape, kernels_line, print_table, write_results

DEFAULT_CONTEXT = "512,4096,16384"


def torch_gpu() -> str | None:
    """The name of the GPU torch can use (CUDA, or ROCm through torch.cuda), else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def prefill_rows(shape, dev) -> list:
    """The prefill cases; on a device that runs attn_coopmat.comp, once on it and once on
    attn.comp (VKATTN_KERNEL=tile), each case name marked with its kernel."""
    if dev.coopmat_problem():
        return prefill.run(shape, dev)
    rows = []
    for kernel in ("coopmat", "tile"):
        with tuning.kernel_forced(kernel):
            rows += [dataclasses.replace(r, case=f"{r.case} [{kernel}]", extra=dict(r.extra, attention=kernel))
                     for r in prefill.run(shape, dev)]
    return rows


def main(argv=None) -> int:
    try:
        dev = vkattn.default_device()
    except vkattn.VulkanUnavailableError as e:
        print(f"gpu-bench: {e}", file=sys.stderr)
        return 2
    info = dev.info
    label = f"{dev.name} ({info.device_type}; driver {info.driver_name or '?'} {info.driver_info}; Vulkan {info.api_version})"
    if dev.is_software and os.environ.get("VKATTN_GPU_BENCH_ALLOW_SOFTWARE", "") in ("", "0"):
        names = ", ".join(f"{d.index}: {d.name}" for d in vkattn.list_devices())
        print(f"gpu-bench: no Vulkan GPU here (devices: {names}). Install the GPU's Vulkan driver (docs/gpu.md), "
              f"or pick one with VKATTN_DEVICE; `python -m perf` measures lavapipe.", file=sys.stderr)
        return 2
    tgpu = torch_gpu()
    if tgpu:
        os.environ["VKATTN_PERF_TORCH_DEVICE"] = "cuda"
    os.environ.setdefault("VKATTN_PERF_CONTEXT", DEFAULT_CONTEXT)
    try:
        shape = Shape.from_env()
        rows = decode.run(shape, dev) + prefill_rows(shape, dev) + batch.run(shape, dev)
    except PerfConfigError as e:
        print(f"gpu-bench: {e}", file=sys.stderr)
        return 2
    if not rows:
        print(f"gpu-bench: no case ran (VKATTN_PERF_CASE={os.environ.get('VKATTN_PERF_CASE', '')!r} matches none)",
              file=sys.stderr)
        return 2
    problem = dev.coopmat_problem()
    print("cooperative matrices: " + (f"attn_coopmat.comp, {'x'.join(map(str, dev.coopmat_shape()))} float16 -> "
                                      f"float32, subgroup {dev.coopmat_subgroup()}" if not problem else
                                      f"not timed: {problem}"))
    print(f"vkattn's prefill kernel here: {tuning.coopmat_choice(dev)}")
    torch_label = "torch GPU" if tgpu else "torch CPU"
    print(f"torch beside it: {tgpu or 'CPU (no CUDA/ROCm device visible to torch)'}")
    print_table(rows, label, torch_label)
    kern = [line for line in map(kernels_line, rows) if line]
    if kern:
        print(f"\nthe kernels alone (the submission less its uploads and downloads), beside {torch_label}'s SDPA:")
        print("\n".join("  " + line for line in kern))
    out = write_results(rows, label, stem="gpu_bench", extra={"torch_device": tgpu or "cpu",
                                                               "driver": f"{info.driver_name} {info.driver_info}"})
    print(f"\nresults: {out}/gpu_bench.json, {out}/gpu_bench.csv")
    return 0 if all(r.verified for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
