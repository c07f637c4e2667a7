"""``python -m perf modelgpu``: the whole-model example's own pipelines (examples/llama_device:
linear.comp, embed.comp, argmax.comp) as GPU compilers build them, without a GPU.

A DeviceLlama of SmolLM2-135M's shape (one decoder layer of seeded random weights: every layer
builds the same pipelines) is made on the host's device with the layout the example takes on a
GPU (``DeviceLlama.LAYOUTS["gpu"]`` and ``PROMPT_LAYOUTS["gpu"]``: 16 lanes a row, storage
buffers, weights row-major) and runs a 37-token prompt and a decode token, once for each weight
format (float16, q4_1; float32 with ``VKATTN_MODELGPU_WEIGHTS``). Every kp algorithm it creates is
recorded -- SPIR-V, spec constants, bindings, push constants, grid -- and each distinct pipeline is
compiled by RADV/ACO for each AMD family the installed Mesa knows (vkattn.tools.vkpipeline: no
GPU needed), as ``python -m perf gpu`` compiles vkattn's. Rows: per pipeline and family, VGPRs,
spills, scratch, LDS, waves per SIMD, instructions and the VALU instructions of its main loop.

A traffic model per decode token: the weights' bytes (every matrix read once a token) over each
reference GPU's bandwidth (perf/gpu.py's datasheet table) -- the time a memory-bound token cannot
beat on that GPU, beside which a measured device time per token (``python -m perf model --random
--ops`` on the GPU, perf/gpu_session.sh) reads as a fraction of the bandwidth.

``--nvk``: NVIDIA's ISA instead, NVK's compiler NAK on nouveau's drm-shim (Debian 13 with
trixie-backports' Mesa 26, as ``python -m perf nvk``; chips ga100, ga102, tu102): GPRs a thread,
spills to memory, warps per SM, NAK's static cycles; writes modelgpu_report_nvk.*.

Environment: VKATTN_GPU_FAMILIES (comma list; default every family the mechanism offers),
VKATTN_MODELGPU_WEIGHTS (comma list, default float16,q4_1), VKATTN_PERF_OUT (perf/out). Writes
modelgpu_report.json and .md there (Mesa 22.3) or modelgpu_report_mesa<major>.* (another Mesa).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

import vkattn
from vkattn.tools import vkpipeline as vp

from . import nvk
from .gpu import REFERENCE_GPUS, report_stem
from .gpu import _stats_of as gpu_stats

PROMPT = 37                         # the example's chat prompt
WEIGHTS = ("float16", "q4_1")


class _Recorder:
    """vkattn.algorithm wrapped: each call's pipeline (SPIR-V, spec, bindings, push words) and grid
    kept, in order."""

    def __init__(self):
        self.calls = []
        self._real = vkattn.algorithm

    def __call__(self, arrays, spirv, groups, spec=(), push=(), **kw):
        self.calls.append(dict(spirv=bytes(spirv), spec=[int(v) for v in spec], bindings=len(arrays),
                               push=len(push), grid=[int(g) for g in groups]))
        return self._real(arrays, spirv, groups, spec, push, **kw)


def _name(spirv: bytes, known: dict) -> str:
    """The example's name of a SPIR-V module: its shader and defines (DeviceLlama._spv's keys)."""
    for (shader, defines), spv in known.items():
        if spv == spirv:
            defs = ",".join(f"{k}={v}" for k, v in defines)
            return f"{shader}[{defs}]"
    return "unknown"


def prompt_layout(weight_dtype: str) -> tuple:
    """(rows, tokens) of the prompt's matmuls: DeviceLlama.PROMPT_LAYOUTS["gpu"], or
    VKATTN_MODELGPU_PROMPT=ROWS,TOKENS for every format (a study of other tiles)."""
    from examples.llama_device.model import DeviceLlama
    env = os.environ.get("VKATTN_MODELGPU_PROMPT", "").strip()
    if not env:
        return tuple(DeviceLlama.PROMPT_LAYOUTS["gpu"][weight_dtype])
    try:
        rows, tile = (int(v) for v in env.split(","))
    except ValueError:
        raise ValueError(f"VKATTN_MODELGPU_PROMPT: expected ROWS,TOKENS, got {env!r}") from None
    return rows, tile


def _model(weight_dtype: str, layers: int, device):
    from examples.llama_device.model import DeviceLlama

    from .model import SMOLLM2_SHAPE, random_weights
    cfg = dict(SMOLLM2_SHAPE, num_hidden_layers=layers)
    wg, lanes, rows = DeviceLlama.LAYOUTS["gpu"]
    prows, ptile = prompt_layout(weight_dtype)
    return DeviceLlama(cfg, random_weights(cfg), weight_dtype=weight_dtype, capacity=PROMPT + 4, device=device,
                       wg=wg, lanes=lanes, rows=rows, prompt_rows=prows, prompt_tile=ptile, texel=False,
                       interleave=False), cfg


def capture(weight_dtype: str, device=None, layers: int = 30) -> tuple:
    """(pipelines, weight bytes a decode token reads) of the example on a GPU's layout: pipelines
    as [{"name", "spirv", "spec", "bindings", "push", "grid", "uses"}], one per distinct (module,
    spec), in first-use order, from a one-layer model (every layer builds the same); "uses": how
    many dispatches of its prompt and two tokens ran it. The bytes: a ``layers``-layer model's
    weights (the head and one layer measured, the others as the one)."""
    rec = _Recorder()
    vkattn.algorithm = rec
    try:
        m, cfg = _model(weight_dtype, 1, device)
        try:
            m.generate(np.arange(PROMPT) % cfg["vocab_size"], 2)
            known, one = dict(m._spv), m.weight_bytes
        finally:
            m.close()
    finally:
        vkattn.algorithm = rec._real
    m2, _ = _model(weight_dtype, 2, device)
    try:
        per_layer = m2.weight_bytes - one
    finally:
        m2.close()
    per_token = one + (layers - 1) * per_layer
    out, seen = [], {}
    for c in rec.calls:
        key = (c["spirv"], tuple(c["spec"]))
        if key in seen:
            out[seen[key]]["uses"] += 1
            continue
        seen[key] = len(out)
        out.append(dict(c, name=_name(c["spirv"], known), uses=1))
    return out, per_token


def _job(p: dict) -> vp.Job:
    return vp.Job(p["name"], p["spirv"], p["spec"], p["bindings"], push_constant_bytes=4 * p["push"])


def _nak_stats(jr) -> dict:
    """NAK's statistics of a compiled job (perf/nvk.py's: GPRs, warps per SM, spills, cycles)."""
    exe = jr.executables[0]
    return {k: exe.stats.get(k) for k in nvk.STATS}


def compile_all(pipes: list, families, mechanism=None) -> dict:
    """{family: [stats per pipeline, or {"error"}]} on the mechanism's null device (RADV's by
    default, read as perf/gpu.py reads them; vp.nvk_mechanism(): NVK's, NAK's statistics)."""
    mechanism = mechanism or vp.null_mechanism()
    nak = mechanism.kind == vp.NOUVEAU_SHIM
    res = vp.family_stats(families, [_job(p) for p in pipes], ir=not nak, mechanism=mechanism)
    read = _nak_stats if nak else gpu_stats
    return {fam: ({"unavailable": cr.reason} if not cr.available else
                  [read(jr) if jr.ok and jr.executables else {"error": f"{jr.result}: {jr.error}"}
                   for jr in cr.jobs])
            for fam, cr in res.items()}


def _cell(st: dict, nvk: bool) -> str:
    if "error" in st:
        return st["error"][:40]
    if nvk:
        return (f"{st.get('Number of GPRs')} / {st.get('Spills to memory')} / {st.get('Max warps/SM')} / "
                f"{st.get('Static cycle count')}")
    return f"{st.get('VGPRs')} / {st.get('Spilled VGPRs')} / {st.get('Subgroups per SIMD')} / {st.get('valu')}"


def _spills(st: dict, nvk: bool) -> int:
    if "error" in st:
        return 0
    if nvk:
        return int(st.get("Spills to memory") or 0)
    return int(st.get("Spilled VGPRs") or 0) + int(st.get("Spilled SGPRs") or 0)


def markdown(report: dict) -> str:
    nvk = report.get("nvk", False)
    what = ("GPRs a thread / spills to memory / warps per SM / NAK's static cycles" if nvk else
            "VGPRs / spilled VGPRs / waves per SIMD / main-loop VALU")
    lines = [f"# The whole-model example's pipelines on GPU compilers ({report['compiler']})", "",
             f"`python -m perf modelgpu{' --nvk' if nvk else ''}`: SmolLM2-135M's shape, the example's GPU layout "
             f"(linear.comp wg, lanes, rows = {report['layout']}; prompt rows, tile by format: "
             f"{report['prompt_layouts']}), storage buffers. Per pipeline and family: {what}.", ""]
    for wd, w in report["weights"].items():
        fams = [f for f, rows in w["families"].items() if isinstance(rows, list)]
        lines += [f"## {wd} weights", "",
                  "| pipeline | spec | uses | " + " | ".join(fams) + " |",
                  "| --- | --- | ---: | " + " | ".join("---" for _ in fams) + " |"]
        for i, p in enumerate(w["pipelines"]):
            cells = []
            for f in fams:
                cells.append(_cell(w["families"][f][i], nvk))
            lines.append(f"| {p['name']} | {','.join(map(str, p['spec']))} | {p['uses']} | " + " | ".join(cells) + " |")
        spills = sum(_spills(st, nvk) for f in fams for st in w["families"][f])
        errors = sum(1 for f in fams for st in w["families"][f] if "error" in st)
        lines += ["", f"Spilled registers over every pipeline and family: **{spills}**; failed compiles: "
                      f"{errors}. A decode token reads {w['weight_mb']:.1f} MB of weights: at the datasheet "
                      "bandwidth " + ", ".join(f"{g} {t:.3f} ms" for g, t in w["bound_ms"].items()) + ".", ""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import argparse

    from examples.llama_device.model import DeviceLlama
    ap = argparse.ArgumentParser(prog="python -m perf modelgpu", description=__doc__.split("\n")[0])
    ap.add_argument("--nvk", action="store_true",
                    help="NVIDIA's ISA: NVK (NAK) on nouveau's drm-shim, Debian 13 with Mesa 26 (perf/nvk.py)")
    args = ap.parse_args(argv)
    weights = [w.strip() for w in os.environ.get("VKATTN_MODELGPU_WEIGHTS", ",".join(WEIGHTS)).split(",")
               if w.strip()]
    bad = [w for w in weights if w not in DeviceLlama.WEIGHT_DTYPES]
    if bad:
        print(f"perf modelgpu: VKATTN_MODELGPU_WEIGHTS: unknown {bad}; choose from {DeviceLlama.WEIGHT_DTYPES}",
              file=sys.stderr)
        return 2
    mech = vp.nvk_mechanism() if args.nvk else vp.null_mechanism()
    if not mech.available:
        print(f"perf modelgpu: no GPU compiler here: {mech.reason}", file=sys.stderr)
        return 2
    env = os.environ.get("VKATTN_GPU_FAMILIES", "")
    families = [f.strip() for f in env.split(",") if f.strip()] or list(vp.default_families(mech))
    report = {"mesa": list(mech.mesa) if mech.mesa else None, "compiler": mech.describe(), "nvk": args.nvk,
              "layout": list(DeviceLlama.LAYOUTS["gpu"]),
              "prompt_layouts": {w: list(prompt_layout(w)) for w in weights}, "weights": {}}
    dev = vkattn.default_device()
    for wd in weights:
        pipes, wbytes = capture(wd, dev)
        fams = compile_all(pipes, families, mech)
        # a decode token reads every matrix once (SmolLM2's 30 layers and the tied head)
        report["weights"][wd] = {"pipelines": [{k: v for k, v in p.items() if k != "spirv"} for p in pipes],
                                 "families": fams, "weight_mb": wbytes / 1e6,
                                 "bound_ms": {g.name: wbytes / (g.bandwidth_gbs * 1e9) * 1e3 for g in REFERENCE_GPUS}}
    out = Path(os.environ.get("VKATTN_PERF_OUT") or Path(__file__).resolve().parent / "out")
    out.mkdir(parents=True, exist_ok=True)
    stem = "modelgpu_report_nvk" if args.nvk else report_stem(report["mesa"]).replace("gpu_report", "modelgpu_report")
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str))
    text = markdown(report)
    (out / f"{stem}.md").write_text(text)
    print(text)
    print(f"results: {out / (stem + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
