"""``python -m perf model``: tokens per second of the whole-model example (examples/llama_device:
SmolLM2-135M-Instruct entirely on the Vulkan device) against transformers' eager model on the CPU
(torch, float32), in the same run.

For each weight setting (float32, float16, q4_1 = the GGUF's own blocks), alternately: eager, then
the device, each on the same chat prompt, greedy, ``--new`` tokens, after one warm-up generation
of the same length (lavapipe compiles a pipeline on its first dispatch; torch warms its caches).
Each figure is the median of ``--runs`` runs. Prompt tok/s = prompt tokens / the prompt's one
submission (eager: its first forward); decode tok/s = (new - 1) / the time of the remaining
steps (each one replay of the decode graph; eager: one forward each). Tokens are compared too
(a run whose tokens differ from eager's is flagged). Needs `make model`.

    python -m perf model [--weights float32 float16 q4_1] [--new 16] [--runs 3]

Writes perf/out/model.json.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import subprocess
import sys


def cpu_name() -> str:
    """lscpu's model name, and how many of /proc/cpuinfo's flag lines list avx512f."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    except OSError:
        name = platform.processor() or "?"
    try:
        avx512 = sum("avx512f" in ln for ln in open("/proc/cpuinfo") if ln.startswith("flags"))
    except OSError:
        avx512 = -1
    import os
    return f"{name}, {os.cpu_count()} CPUs, avx512f on {avx512}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf model", description=__doc__.split("\n")[0])
    ap.add_argument("--weights", nargs="+", default=["float32", "float16", "q4_1"],
                    choices=["float32", "float16", "q4_1"])
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    from examples.llama_device.__main__ import PROMPTS, prompt_ids
    from examples.llama_device.model import DeviceLlama
    from examples.llama_device.reference import eager_generate, eager_model
    from examples.llama_device.weights import available, load, load_blocks
    why = available()
    if why:
        print(f"perf model: SmolLM2 is not installed ({why})", file=sys.stderr)
        return 2
    import torch
    cfg, sd, tok = load()
    ids = prompt_ids(tok, PROMPTS[0])
    import vkattn
    dev = vkattn.default_device()
    rows = []
    for wd in args.weights:
        eager = eager_model(cfg, sd, round_float16=wd == "float16")
        dm = DeviceLlama(cfg, sd, weight_dtype=wd, capacity=len(ids) + args.new, device=dev,
                         blocks=load_blocks() if wd == "q4_1" else None)
        dm.generate(ids, args.new)
        eager_generate(eager, ids, args.new)
        ep, ed, dp, dd, same = [], [], [], [], True
        for _ in range(args.runs):
            want, _, (tp, td) = eager_generate(eager, ids, args.new)
            ep.append(len(ids) / tp)
            ed.append((args.new - 1) / td)
            got = dm.generate(ids, args.new)
            dp.append(len(ids) / dm.last_times[0])
            dd.append((args.new - 1) / dm.last_times[1])
            same = same and got == want
        g = dm.decode_graph(False)
        rows.append(dict(weights=wd, weight_mb=dm.weight_bytes / 1e6, prompt_tokens=len(ids), new=args.new,
                         device_prompt_tps=statistics.median(dp), device_decode_tps=statistics.median(dd),
                         eager_prompt_tps=statistics.median(ep), eager_decode_tps=statistics.median(ed),
                         tokens_equal=same, graph_recordings=g.recordings, graph_submissions=g.submissions,
                         runs=dict(device_prompt=dp, device_decode=dd, eager_prompt=ep, eager_decode=ed)))
        dm.close()
        del eager
    print(f"SmolLM2-135M-Instruct, prompt {len(ids)} tokens, {args.new} new, median of {args.runs} runs")
    print(f"device: {dev.name}; CPU: {cpu_name()}; torch {torch.__version__} on {torch.get_num_threads()} threads")
    print("| weights | MB on device | device prompt tok/s | eager prompt tok/s | device decode tok/s "
          "| eager decode tok/s | decode device / eager | tokens equal |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['weights']} | {r['weight_mb']:.0f} | {r['device_prompt_tps']:.2f} | {r['eager_prompt_tps']:.2f} "
              f"| {r['device_decode_tps']:.2f} | {r['eager_decode_tps']:.2f} "
              f"| {r['device_decode_tps'] / r['eager_decode_tps']:.2f} | {r['tokens_equal']} |")
    out = pathlib.Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    (out / "model.json").write_text(json.dumps(dict(device=dev.name, cpu=cpu_name(), rows=rows), indent=1))
    print(f"\nresults: {out / 'model.json'}")
    return 0 if all(r["tokens_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
