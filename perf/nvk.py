"""``python -m perf nvk``: vkattn's attention pipelines as an NVIDIA compiler builds them, without a GPU.

Mesa's NVK (compiler NAK) on nouveau's drm-shim compiles for an NVIDIA chip that is not there
(vkattn.tools.vkpipeline.nvk_mechanism: Debian 13 with trixie-backports' Mesa 26, packages
mesa-vulkan-drivers and mesa-drm-shim; Turing and Ampere chips, Mesa 26.1's shim enumerates no
NVK device for Ada, Hopper or Blackwell). Each pipeline is planned by the caches' own planner
against the chip's device limits as NVK reports them (vendor 0x10de: the NVIDIA decode shape of
vkattn.tuning), compiled there, and NAK's statistics read back: registers per thread (GPRs), warps
per SM it allows, spills (to memory, and register moves), instruction count and NAK's static cycle
estimate.

NAK is not NVIDIA's own compiler: the H100 runs the proprietary driver's, so these counts are what
an NVIDIA ISA asks of each kernel's source (registers the code needs live, whether it spills), not
the H100's figures. Read them beside perf/RESULTS.md's H100 timings and the RADV report
(perf/gpu_report*.md).

Cases (32/8 heads d128 unless named): the decode at L=4096 for every storage format; the decode at
L=16384 (the H100 timing's case) in float16 at each attn.comp decode shape (VKATTN_TILE_DECODE
rows,keys: the default and the sweep perf/gpu_session.sh times), and with the split merge's
batch at 0 and 4 (default 2) and V loaded early; a 512-token prefill from empty and over 15872
cached keys on attn.comp (tile) and on attn_coopmat.comp (VKATTN_KERNEL=coopmat), and the
cooperative-matrix kernel's builds before session 24 (COOPMAT_FIXED_TRIPS, COOPMAT_STAGE_BATCH);
the decode at d64 (8/8) and d256 (16/2).

    python -m perf nvk [--chips ga100,ga102,tu102]

Writes perf/out/gpu_report_nvk.{json,md} (VKATTN_PERF_OUT); `make gpu-report-nvk` runs it in the
Debian 13 root and leaves perf/gpu_report_nvk.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from vkattn import tuning
from vkattn.device import PlanningDevice
from vkattn.tools import vkpipeline as vp

from .gpu import Call, _features_for, _job_key, _job_name, pipeline_job, plan_call

DTYPES = ("float16", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2", "q4", "float32")
DECODE_SHAPES = ((None, "default"), ("1,2", "1,2"), ("2,2", "2,2"), ("2,4", "2,4"), ("1,4", "1,4"),
                 ("4,2", "4,2"), ("4,4", "4,4"))
STATS = ("Number of GPRs", "Max warps/SM", "Spills to memory", "Fills from memory", "Spills to reg",
         "Fills from reg", "Instruction count", "Static cycle count", "SLM size")


def cases() -> list:
    """[(label, Call, {VKATTN_* variable: value or None})]: VKATTN_KERNEL, VKATTN_TILE_DECODE,
    VKATTN_TILE_MERGE_BATCH, VKATTN_TILE_V_EARLY, VKATTN_COOPMAT_FIXED_TRIPS and
    VKATTN_COOPMAT_STAGE_BATCH as each case plans (None: unset)."""
    base = {"VKATTN_KERNEL": None, "VKATTN_TILE_DECODE": None, "VKATTN_COOPMAT_FIXED_TRIPS": None,
            "VKATTN_COOPMAT_STAGE_BATCH": None, "VKATTN_TILE_MERGE_BATCH": None, "VKATTN_TILE_V_EARLY": None}
    out = []
    for dt in DTYPES:
        out.append((f"decode L=4096 {dt}", Call("decode step L=4096", "32/8 d128", dt, "forward", past=4095,
                                                 n_new=1), base))
    for env, name in DECODE_SHAPES:
        out.append((f"decode L=16384 float16, decode shape {name}",
                    Call("decode step L=16384", "32/8 d128", "float16", "forward", past=16383, n_new=1,
                         capacity=16384), dict(base, VKATTN_TILE_DECODE=env)))
    out.append(("decode L=16384 float16, TILE_V_EARLY=1 (default 0)",
                Call("decode step L=16384", "32/8 d128", "float16", "forward", past=16383, n_new=1, capacity=16384),
                dict(base, VKATTN_TILE_V_EARLY="1")))
    for mb in ("0", "4"):
        out.append((f"decode L=16384 float16, TILE_MERGE_BATCH={mb} (default 2)",
                    Call("decode step L=16384", "32/8 d128", "float16", "forward", past=16383, n_new=1,
                         capacity=16384), dict(base, VKATTN_TILE_MERGE_BATCH=mb)))
    for past in (0, 15872):
        call = Call(f"prefill 512 over {past}", "32/8 d128", "float16", "forward", past=past, s=512, n_new=512,
                    capacity=past + 512)
        out.append((f"prefill 512 over {past} float16, tile", call, dict(base, VKATTN_KERNEL="tile")))
        out.append((f"prefill 512 over {past} float16, coopmat", call, dict(base, VKATTN_KERNEL="coopmat")))
    for dt in ("int8", "fp8_e4m3"):        # the other formats attn_coopmat.comp takes: their staging
        out.append((f"prefill 512 over 0 {dt}, coopmat",
                    Call("prefill 512 over 0", "32/8 d128", dt, "forward", s=512, n_new=512, capacity=512),
                    dict(base, VKATTN_KERNEL="coopmat")))
    for trips, batch, what in (("0", "0", "the kernel before session 24"), ("1", "0", "O in registers only"),
                               ("0", "1", "the batched staging only")):
        out.append((f"prefill 512 over 0 float16, coopmat, COOPMAT_FIXED_TRIPS={trips} COOPMAT_STAGE_BATCH={batch} "
                    f"({what})",
                    Call("prefill 512 over 0", "32/8 d128", "float16", "forward", s=512, n_new=512, capacity=512),
                    dict(base, VKATTN_KERNEL="coopmat", VKATTN_COOPMAT_FIXED_TRIPS=trips,
                         VKATTN_COOPMAT_STAGE_BATCH=batch)))
    for shape in ("8/8 d64", "16/2 d256"):
        out.append((f"decode L=4096 float16 {shape}", Call("decode step L=4096", shape, "float16", "forward",
                                                            past=4095, n_new=1), base))
    return out


def plan_chip(info) -> list:
    """[(label, [(role, job name, pipeline, cfg)], note)] of every case on the chip ``info``."""
    dev = PlanningDevice(info)
    out = []
    for label, call, env in cases():
        try:
            with tuning.env_set(**env):
                pc = plan_call(dev, call)
            out.append((label, [(d.role, _job_name(d.pipeline), d.pipeline, d.cfg) for d in pc.dispatches], ""))
        except Exception as exc:        # a case the chip cannot plan (reported, the rest go on)
            out.append((label, [], f"{type(exc).__name__}: {exc}"))
    return out


def build(chips, mechanism=None) -> dict:
    mechanism = mechanism or vp.nvk_mechanism()
    report = {"compiler": mechanism.describe(), "chips": {}}
    if not mechanism.available:
        report["unavailable"] = mechanism.reason
        return report
    for chip in chips:
        info = vp.family_device_info(chip, mechanism=mechanism)
        if info is None:
            report["chips"][chip] = {"unavailable": f"no NVK device for {chip} "
                                     f"(NOUVEAU_CHIPSET={vp.NVK_CHIPSETS.get(chip, chip)})"}
            continue
        planned = plan_chip(info)
        pin = PlanningDevice(info).coopmat_pin()
        jobs, cfgs, seen = [], [], set()
        for _, disps, _ in planned:
            for _, name, p, cfg in disps:
                if _job_key(p) not in seen:
                    seen.add(_job_key(p))
                    jobs.append(pipeline_job(name, p, cfg, pin=pin))
                    cfgs.append(cfg)
        res = vp.family_stats([chip], jobs, features=_features_for(cfgs), mechanism=mechanism)[chip]
        stats = {}
        for jr in res.jobs:
            if jr.ok and jr.executables:
                exe = jr.executables[0]
                stats[jr.name] = {**{k: exe.stats.get(k) for k in STATS}, "subgroup_size": exe.subgroup_size}
            else:
                stats[jr.name] = {"error": f"{jr.result}: {jr.error}"}
        rows = []
        for label, disps, note in planned:
            for role, name, p, cfg in disps:
                rows.append({"case": label, "role": role, "pipeline": name, "groups": list(p.groups),
                             "config": None if cfg is None else {k: getattr(cfg, k) for k in
                                                                 ("kernel", "wg", "bq", "splits", "rpt", "cols", "kb",
                                                                  "sg", "br", "bc") if hasattr(cfg, k)},
                             **stats.get(name, {})})
            if note:
                rows.append({"case": label, "error": note})
        report["chips"][chip] = {"device": info.name, "driver": info.driver_version,
                                 "subgroup_size": info.subgroup_size,
                                 "shared_memory": info.max_compute_shared_memory_size,
                                 "available": res.available, "rows": rows}
    return report


def _cfg_text(c) -> str:
    if not c:
        return ""
    if c.get("kernel") == "coopmat":
        return f"coopmat wg {c.get('wg')}, {c.get('br')}x{c.get('bc')} tile, splits {c.get('splits')}"
    return (f"{c.get('kernel')} wg {c.get('wg')}, rows/thread {c.get('rpt')}, keys/step {c.get('kb')}, "
            f"cols {c.get('cols')}, splits {c.get('splits')}")


def markdown(report: dict) -> str:
    lines = ["# vkattn on an NVIDIA compiler without a GPU (`python -m perf nvk`)", "",
             f"Compiler: {report['compiler']}.", ""]
    if "unavailable" in report:
        return "\n".join(lines + [f"Not available here: {report['unavailable']}", ""])
    lines += ["NAK's statistics per pipeline (NVK's `VK_KHR_pipeline_executable_properties`): GPRs per "
              "thread, the warps per SM they allow, local memory per thread (NAK's \"SLM size\": private "
              "arrays it could not keep in registers, and spills), spills to memory / register moves, "
              "instructions, NAK's static cycle estimate. Not the proprietary compiler the H100 runs: "
              "what the kernels' source asks of an NVIDIA ISA. perf/nvk.py says how each case is planned.", ""]
    for chip, c in report["chips"].items():
        lines.append(f"## {chip.upper()} ({c.get('device', '').strip() or 'NVK'}; "
                     f"subgroup {c.get('subgroup_size')}, {c.get('shared_memory', 0) // 1024} KiB shared memory "
                     f"per workgroup)" if "rows" in c else f"## {chip.upper()}: {c.get('unavailable')}")
        lines.append("")
        if "rows" not in c:
            continue
        lines += ["| case | dispatch | plan | GPRs | warps/SM | local memory B | spills mem / reg | instructions "
                  "| static cycles |",
                  "| --- | --- | --- | ---: | ---: | ---: | --- | ---: | ---: |"]
        for r in c["rows"]:
            if "error" in r and "pipeline" not in r:
                lines.append(f"| {r['case']} | | {r['error']} | | | | | | |")
                continue
            if "error" in r:
                lines.append(f"| {r['case']} | {r['role']} | {r['error']} | | | | | | |")
                continue
            lines.append(
                f"| {r['case']} | {r['role']} {r['pipeline'].split('[')[0]} | {_cfg_text(r.get('config'))} "
                f"| {r.get('Number of GPRs')} | {r.get('Max warps/SM')} | {r.get('SLM size')} "
                f"| {r.get('Spills to memory')} / {r.get('Spills to reg')} | {r.get('Instruction count')} "
                f"| {r.get('Static cycle count')} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf nvk", description=__doc__.split("\n")[0])
    ap.add_argument("--chips", default=",".join(vp.NVK_FAMILIES),
                    help=f"comma list of {', '.join(vp.NVK_CHIPSETS)} (or NOUVEAU_CHIPSET hex ids)")
    args = ap.parse_args(argv)
    report = build([c.strip().lower() for c in args.chips.split(",") if c.strip()])
    out = Path(os.environ.get("VKATTN_PERF_OUT", Path(__file__).resolve().parent / "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_report_nvk.json").write_text(json.dumps(report, indent=1))
    md = markdown(report)
    (out / "gpu_report_nvk.md").write_text(md + "\n")
    print(md)
    print(f"\nresults: {out / 'gpu_report_nvk.md'}, {out / 'gpu_report_nvk.json'}")
    if "unavailable" in report:
        print(f"perf nvk: {report['unavailable']}", file=sys.stderr)
        return 1
    return 0
