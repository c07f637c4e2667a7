"""``python -m perf model``: tokens per second of the whole-model example (examples/llama_device:
SmolLM2-135M-Instruct entirely on the Vulkan device) against transformers' eager model on the CPU
(torch, float32), in the same run.

For each weight setting (float32, float16, q4_1 = the GGUF's own blocks), alternately: eager, then
the device, each on the same chat prompt, greedy, ``--new`` tokens, after one warm-up generation
of the same length (lavapipe compiles a pipeline on its first dispatch; torch warms its caches).
Each figure is the median of ``--runs`` runs. Prompt tok/s = prompt tokens / the prompt's one
submission (eager: its first forward): the device replays the last prompt's graph when the prompt
is as long (each run after the warm-up); "recorded" is the same prompt after one of another
length, its graph recorded and its activations allocated anew (what a new prompt length costs);
decode tok/s = (new - 1) / the time of the remaining
steps (each one replay of the decode graph; eager: one forward each); generate tok/s = new / (the
prompt's time + the steps'), the rate a caller of generate() sees (the replayed prompt's run).
Tokens are compared too
(a run whose tokens differ from eager's is flagged). Needs `make model`.

    python -m perf model [--weights float32 float16 q4_1] [--new 16] [--runs 3]

``--random``: the host's share of a token on a device with no SmolLM2 and no transformers (a GPU
machine): SmolLM2-135M's shape (30 layers, 9/3 heads of 64, vocab 49152, tied; ``--layers`` fewer)
with seeded random weights, no eager beside it. Per decode token, medians over ``--new`` tokens:
the wall time of one replay of the decode graph and the token read back, the device time of the
same graph built with timestamp queries (the sum of its commands), host time = wall - device, and
the Python of a replay with the submission stubbed out (every cache call's host words filled).
``--ops`` adds where the device time goes: per op kind (the layers' "qkv", "attn_lane",
"gate_up", ... summed over layers; "barriers" all barriers), medians of the device ms of the
replayed prompt (``--prompt`` tokens, 32; 3 runs) and of a decode token (``--new`` runs), from
Vulkan timestamps (lavapipe's read more than its wall time: compare ops with each other there).

Writes model.json (``--random``: model_random.json) in VKATTN_PERF_OUT (default perf/out).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import subprocess
import sys

from .common import out_dir


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
    ap.add_argument("--random", action="store_true", help="SmolLM2's shape, random weights: host time per token")
    ap.add_argument("--layers", type=int, default=30, help="--random: decoder layers (SmolLM2: 30)")
    ap.add_argument("--prompt", type=int, default=32, help="--random: prompt tokens (the chat prompt: 37)")
    ap.add_argument("--ops", action="store_true",
                    help="--random: device ms per op kind, of the prompt and of a decode token")
    ap.add_argument("--layout", default="", metavar="WG,LANES,ROWS",
                    help="linear.comp's layout (default: DeviceLlama.LAYOUTS' for the device)")
    ap.add_argument("--weight-loads", choices=["auto", "texel", "storage"], default="auto",
                    help="weights read as uniform texel buffers or storage buffers (auto: the example's "
                         "choice for the device: texel on CPU drivers)")
    args = ap.parse_args(argv)
    try:
        args.layout_kw = dict(zip(("wg", "lanes", "rows"), map(int, args.layout.split(",")))) if args.layout else {}
    except ValueError:
        args.layout_kw = None
    if args.layout_kw is None or (args.layout and len(args.layout_kw) != 3):
        ap.error(f"--layout: expected three integers WG,LANES,ROWS, got {args.layout!r}")
    if args.weight_loads != "auto":
        args.layout_kw["texel"] = args.weight_loads == "texel"
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    if args.random:
        return random_main(args)
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
                         blocks=load_blocks() if wd == "q4_1" else None, **args.layout_kw)
        dm.generate(ids, args.new)
        eager_generate(eager, ids, args.new)
        ep, ed, dp, dd, dr, eg, dg, same = [], [], [], [], [], [], [], True
        for _ in range(args.runs):
            want, _, (tp, td) = eager_generate(eager, ids, args.new)
            ep.append(len(ids) / tp)
            ed.append((args.new - 1) / td)
            eg.append(args.new / (tp + td))
            got = dm.generate(ids, args.new)                  # the prompt's graph replayed
            dp.append(len(ids) / dm.last_times[0])
            dd.append((args.new - 1) / dm.last_times[1])
            dg.append(args.new / sum(dm.last_times))
            same = same and got == want
            dm.generate(ids[:-1], 1)                           # another length, then ids recorded again
            same = same and dm.generate(ids, 1) == want[:1]
            dr.append(len(ids) / dm.last_times[0])
        g = dm.decode_graph(False)
        rows.append(dict(weights=wd, weight_mb=dm.weight_bytes / 1e6, prompt_tokens=len(ids), new=args.new,
                         device_prompt_tps=statistics.median(dp), device_prompt_recorded_tps=statistics.median(dr),
                         device_decode_tps=statistics.median(dd),
                         eager_prompt_tps=statistics.median(ep), eager_decode_tps=statistics.median(ed),
                         device_generate_tps=statistics.median(dg), eager_generate_tps=statistics.median(eg),
                         tokens_equal=same, graph_recordings=g.recordings, graph_submissions=g.submissions,
                         runs=dict(device_prompt=dp, device_prompt_recorded=dr, device_decode=dd, eager_prompt=ep,
                                   eager_decode=ed, device_generate=dg, eager_generate=eg)))
        dm.close()
        del eager
    print(f"SmolLM2-135M-Instruct, prompt {len(ids)} tokens, {args.new} new, median of {args.runs} runs")
    print(f"device: {dev.name}; CPU: {cpu_name()}; torch {torch.__version__} on {torch.get_num_threads()} threads")
    print("| weights | MB on device | device prompt tok/s (replayed / recorded) | eager prompt tok/s "
          "| prompt device / eager | device decode tok/s | eager decode tok/s | decode device / eager "
          "| generate tok/s device / eager | tokens equal |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['weights']} | {r['weight_mb']:.0f} | {r['device_prompt_tps']:.2f} / "
              f"{r['device_prompt_recorded_tps']:.2f} | {r['eager_prompt_tps']:.2f} "
              f"| {r['device_prompt_tps'] / r['eager_prompt_tps']:.2f} "
              f"| {r['device_decode_tps']:.2f} | {r['eager_decode_tps']:.2f} "
              f"| {r['device_decode_tps'] / r['eager_decode_tps']:.2f} "
              f"| {r['device_generate_tps']:.2f} / {r['eager_generate_tps']:.2f} "
              f"({r['device_generate_tps'] / r['eager_generate_tps']:.2f}) | {r['tokens_equal']} |")
    out = out_dir()
    (out / "model.json").write_text(json.dumps(dict(device=dev.name, cpu=cpu_name(), rows=rows), indent=1))
    print(f"\nresults: {out / 'model.json'}")
    return 0 if all(r["tokens_equal"] for r in rows) else 1


SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                     rope_theta=100000.0, tie_word_embeddings=True, hidden_act="silu")


def random_weights(cfg: dict, seed: int = 0) -> dict:
    """Seeded float32 weights under Hugging Face's names for a Llama config (numpy; matrices
    N(0, 0.02) as transformers initialises them, norm gains near 1)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nq, nkv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    m = lambda *s: (rng.standard_normal(s, dtype=np.float32) * np.float32(0.02))
    g = lambda n: (1 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)
    sd = {"model.embed_tokens.weight": m(V, H), "model.norm.weight": g(H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd.update({p + "self_attn.q_proj.weight": m(nq, H), p + "self_attn.k_proj.weight": m(nkv, H),
                   p + "self_attn.v_proj.weight": m(nkv, H), p + "self_attn.o_proj.weight": m(H, nq),
                   p + "mlp.gate_proj.weight": m(I, H), p + "mlp.up_proj.weight": m(I, H),
                   p + "mlp.down_proj.weight": m(H, I),
                   p + "input_layernorm.weight": g(H), p + "post_attention_layernorm.weight": g(H)})
    return sd


def op_kinds(timings) -> dict:
    """Graph.last_timings() ([(op, ms)]) summed by kind: a layer's ops lose their layer number
    ("gate_up12" -> "gate_up"), every barrier is "barriers", uploads and downloads "upload" and
    "download"."""
    out = {}
    for name, ms in timings:
        first = name.split(" ", 1)[0]
        if "barrier" in name.split(" ", 2)[:2]:
            kind = "barriers"
        elif first in ("upload", "download"):
            kind = first
        else:
            kind = name.rstrip("0123456789") or name
        out[kind] = out.get(kind, 0.0) + ms
    return out


def median_ops(runs: list) -> dict:
    """The median of each op kind's ms over ``runs`` (op_kinds dicts; a kind a run lacks counts 0)."""
    kinds = set().union(*runs) if runs else set()
    return {k: statistics.median([r.get(k, 0.0) for r in runs]) for k in kinds}


def random_main(args) -> int:
    """--random: wall, device and host time per decode token (module docstring)."""
    import time

    import numpy as np

    import vkattn
    from examples.llama_device.model import DeviceLlama

    from .overhead import python_us
    if args.layers < 1 or args.new < 2 or args.prompt < 1:
        print("perf model: --layers >= 1, --new >= 2 and --prompt >= 1", file=sys.stderr)
        return 2
    cfg = dict(SMOLLM2_SHAPE, num_hidden_layers=args.layers)
    sd = random_weights(cfg)
    dev = vkattn.default_device()
    ids = np.random.default_rng(1).integers(0, cfg["vocab_size"], args.prompt)
    rows = []
    for wd in args.weights:
        dm = DeviceLlama(cfg, sd, weight_dtype=wd, capacity=len(ids) + 2 * args.new + 2, device=dev,
                         timestamps=args.ops, **args.layout_kw)
        try:
            dm.generate(ids, 2)                                    # warm-up: pipelines built
            wall = []
            dm.generate(ids, 1)                                    # the caches hold the prompt
            g = dm.decode_graph(False)
            for _ in range(args.new):
                t0 = time.perf_counter()
                g.run()
                dm._token()
                wall.append((time.perf_counter() - t0) * 1e3)
            gt = dm.decode_graph(False, timestamps=True)          # the same step, timed on the device
            devs, dec_ops = [], []
            for _ in range(args.new):
                gt.run()
                devs.append(sum(ms for _, ms in gt.last_timings()))
                dec_ops.append(op_kinds(gt.last_timings()))
            held = dm.caches[0].length
            py = python_us(g.submit, 2 * args.new, reset=lambda: [c.truncate(held) for c in dm.caches]) / 1e3
            w = statistics.median(wall)
            d = statistics.median(devs) if gt.timestamps else None
            ops = None
            if args.ops:
                pro_ops = []
                for _ in range(3):
                    dm.generate(ids, 1)                            # the prompt's graph replayed
                    pro_ops.append(op_kinds(dm.prompt_timings()))
                ops = {"prompt": median_ops(pro_ops), "decode": median_ops(dec_ops)}
            rows.append(dict(weights=wd, layout=[dm._wg, dm._lanes, dm._rows], weight_mb=dm.weight_bytes / 1e6,
                             layers=args.layers, tokens=args.new, prompt_tokens=len(ids),
                             wall_ms=w, device_ms=d, host_ms=None if d is None else w - d, python_ms=py,
                             submissions_per_token=1, wall_runs=wall, device_runs=devs, ops=ops))
        finally:
            dm.close()
    print(f"SmolLM2-135M's shape ({args.layers} layers, random weights), decode after a {len(ids)}-token prompt, "
          f"median of {args.new} tokens")
    print(f"device: {dev.name}; CPU: {cpu_name()}; linear.comp layout (wg, lanes, rows) "
          f"{rows[0]['layout'] if rows else '-'}")
    print("| weights | MB on device | wall ms per token | device ms per token | host ms per token (wall - device) "
          "| vkattn's Python per token, submission stubbed (ms) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        dms = "-" if r["device_ms"] is None else f"{r['device_ms']:.3f}"
        hms = "- (no timestamp queries)" if r["host_ms"] is None else f"{r['host_ms']:.3f}"
        print(f"| {r['weights']} | {r['weight_mb']:.0f} | {r['wall_ms']:.3f} | {dms} | {hms} | {r['python_ms']:.3f} |")
    for r in rows:
        if r["ops"] is None:
            continue
        pro, dec = r["ops"]["prompt"], r["ops"]["decode"]
        if not pro and not dec:
            print(f"\n{r['weights']}: no per-op times (this device has no timestamp queries)")
            continue
        print(f"\n{r['weights']}: device ms per op kind, the {r['prompt_tokens']}-token prompt (median of 3) and a "
              f"decode token (median of {r['tokens']})")
        print("| op | prompt ms | decode ms |")
        print("| --- | ---: | ---: |")
        for op in sorted(set(pro) | set(dec), key=lambda o: (-pro.get(o, 0.0), -dec.get(o, 0.0))):
            print(f"| {op} | {pro.get(op, 0.0):.3f} | {dec.get(op, 0.0):.3f} |")
        print(f"| all | {sum(pro.values()):.3f} | {sum(dec.values()):.3f} |")
    out = out_dir()
    (out / "model_random.json").write_text(json.dumps(dict(device=dev.name, cpu=cpu_name(), rows=rows), indent=1))
    print(f"\nresults: {out / 'model_random.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
