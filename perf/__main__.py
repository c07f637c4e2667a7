"""``python -m perf [decode|prefill|append|overhead|batch|cascade|loads|peak|hf|newlen|prefix|subgroup ...]``: run the perf cases, print a table, write
perf/out/results.{json,csv}. Shapes come from VKATTN_PERF_* (see perf/common.py).
``python -m perf gpu``: the GPU compiler report (perf/gpu.py), without a GPU.
``python -m perf nvk``: the attention pipelines on NVK's compiler for NVIDIA chips, without a GPU (perf/nvk.py).
``python -m perf gpubench``: the perf cases on a Vulkan GPU (perf/gpubench.py, ``make gpu-bench``).
``python -m perf llama [DIR]``: llama.cpp's flash attention compiled like vkattn's (perf/llama_cpp.py).
``python -m perf model``: the whole-model example (SmolLM2 on the device) against transformers eager (perf/model.py).
``python -m perf quality``: perplexity and KL of each K/V cache format on SmolLM2 through vkattn.hf (perf/quality.py).
``python -m perf q4study``: candidate 4-bit K/V layouts simulated on the host, same model and text (perf/q4_study.py).
``python -m perf ablate [prefill] [decode]``: attn_coopmat.comp's prefill and attn.comp's decode timed with parts taken out (perf/ablate.py).
``python -m perf lpjit``: llvmpipe's machine code of a running decode, sampled and read (perf/lpjit.py).
``python -m perf modelgpu``: the whole-model example's pipelines through GPU compilers, no GPU (perf/modelgpu.py)."""
from __future__ import annotations

import os
import sys

import vkattn

from . import append, batch, cascade, decode, hf, loads, newlen, overhead, peak, prefill, prefix, subgroup_ops
from .common import PerfConfigError, Shape, copy_bandwidth, kernels_line, print_table, write_results

SCRIPTS = {"decode": decode, "prefill": prefill, "append": append, "overhead": overhead, "batch": batch,
           "cascade": cascade, "loads": loads, "peak": peak, "hf": hf, "newlen": newlen, "prefix": prefix,
           "subgroup": subgroup_ops}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["gpu"]:                 # the compiler report: no device of its own, a table of its own
        from . import gpu
        return gpu.main()
    if argv == ["gpubench"]:            # the perf cases on a Vulkan GPU, torch on the same GPU
        from . import gpubench
        return gpubench.main()
    if argv[:1] == ["llama"]:           # llama.cpp's flash attention on the same compiler (the anchor)
        from . import llama_cpp
        return llama_cpp.main(argv[1:])
    if argv[:1] == ["model"]:           # the whole-model example against transformers eager
        from . import model
        return model.main(argv[1:])
    if argv[:1] == ["quality"]:         # each cache format's perplexity / KL on a real model
        from . import quality
        return quality.main(argv[1:])
    if argv[:1] == ["q4study"]:         # candidate 4-bit layouts simulated on the host, same model and text
        from . import q4_study
        return q4_study.main(argv[1:])
    if argv[:1] == ["ablate"]:          # a kernel with parts of it taken out, timed (prefill, decode)
        from . import ablate
        return ablate.main(argv[1:])
    if argv[:1] == ["nvk"]:             # the pipelines on NVK's compiler (NAK), nouveau's drm-shim
        from . import nvk
        return nvk.main(argv[1:])
    if argv[:1] == ["lpjit"]:           # lavapipe's JIT code of a running call: its hot loop read
        from . import lpjit
        return lpjit.main(argv[1:])
    if argv[:1] == ["modelgpu"]:        # the whole-model example's pipelines through GPU compilers
        from . import modelgpu
        return modelgpu.main(argv[1:])
    if argv == ["features"]:            # what the features kp leaves off would change (compiler study)
        from . import features
        return features.main()
    names = argv or list(SCRIPTS)
    bad = [n for n in names if n not in SCRIPTS]
    if bad:
        print(f"unknown perf script(s) {bad}; choose from {list(SCRIPTS)}", file=sys.stderr)
        return 2
    try:
        shape = Shape.from_env()
        device = vkattn.default_device()
        rows = []
        for n in names:
            rows += SCRIPTS[n].run(shape, device)
    except PerfConfigError as e:
        print(f"perf: {e}", file=sys.stderr)
        return 2
    except vkattn.DeviceLimitError as e:    # a VKATTN_PERF_* shape past this device's limits: a setting, not a result
        print(f"perf: the VKATTN_PERF_* shape is past this device's limits: {e}", file=sys.stderr)
        return 2
    if not rows:                    # a VKATTN_PERF_CASE that matches nothing: not a pass, and no results written
        print(f"perf: no case of {', '.join(names)} ran: VKATTN_PERF_CASE="
              f"{os.environ.get('VKATTN_PERF_CASE', '')!r} matches none, or VKATTN_PERF_CONTEXT leaves none (a "
              f"prefill's context counts its VKATTN_PERF_QLEN rows)", file=sys.stderr)
        return 2
    print_table(rows, device.name)
    print(f"\nmachine copy bandwidth (read + write): {copy_bandwidth():.1f} GB/s")
    for r in rows:
        if r.kernel in ("decode", "decode step", "batch"):
            print(f"  {r.case}: {r.value:.2f} GB/s = {100 * r.value / copy_bandwidth():.1f}% of copy bandwidth")
        if r.kernel == "peak":
            mm = ", ".join(f"{k[:-8]} {v:.1f}" for k, v in r.extra.items() if k.endswith(" GFLOP/s"))
            print(f"  {r.case}: {r.value:.1f} GFLOP/s on the device; matmuls of a {peak.PROMPT}-token prompt, "
                  f"GFLOP/s: {mm}")
        if r.kernel == "decode alternated":
            ratio = next((f", {v:.3f}x the time of {k[8:]}" for k, v in r.extra.items() if k.startswith("time_vs_")), "")
            print(f"  {r.case}: median {r.vkattn_ms:.3f} ms, min {r.vkattn_min_ms:.3f} ms over {r.extra['calls']} "
                  f"calls in {r.extra['rounds']} alternated rounds{ratio}")
        if r.kernel == "loads":
            print(f"  {r.case}: {r.value:.3f} ns per word; the K/V loads of decode L=4096 alone would take "
                  f"{r.extra['decode_L4096_floor_ms']:.2f} ms at that rate")
    for r in rows:       # where a submission holds copies (staging: discrete GPUs), the kernels alone
        if r.extra.get("kernel_ms") is not None and r.device_ms is not None and r.extra["kernel_ms"] < r.device_ms:
            print(kernels_line(r))
    hf.notes(rows)
    cascade.notes(rows)
    out = write_results(rows, device.name, copy_bandwidth())
    print(f"\nresults: {out}/results.json, {out}/results.csv")
    if any(r.kernel == "decode" for r in rows):
        from .plot import plot_decode
        png = plot_decode(rows, out / "decode_latency.png", device.name)
        if png:
            print(f"plot: {png}")
    return 0 if all(r.verified for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
