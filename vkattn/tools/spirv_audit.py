"""Every shader variant vkattn plans, compiled by each given glslang, validated by spirv-val.

    python -m vkattn.tools.spirv_audit --glslang /usr/bin/glslangValidator --glslang OLD \\
        --spirv-val /path/to/spirv-val [--log SHADER_LOG] [--json OUT]

A variant is a shader and its preprocessor defines (the tile sizes, head dims and subgroup widths
are specialisation constants of the same module): :func:`planned_variants` lists them all, from
the storage formats and kernels the planners choose between. ``--log`` adds what a test run built
(``VKATTN_SHADER_LOG``, vkattn.compiler): every module the run built is compiled and validated
too, and the ones beyond the list (the tests' and the GPU report's own variants: numerics
probes, partial defines) are named. A compiler that cannot build cooperative matrices (glslang before 13.1) skips
attn_coopmat.comp, saying so. Each module is also checked by vkattn.spirv (the matrix uses) and,
with ``--spirv-val``, for ``--target-env vulkan1.1`` and ``vulkan1.3``. Exit status 1 on any
failure.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from .. import compiler
from ..formats import FORMATS as STORAGE
from ..spirv import matrix_problem

FORMATS = {name: dict(f.defines) for name, f in STORAGE.items()}
# attn_coopmat.comp's formats: those its float16 matrices hold exactly (float32 and bfloat16 caches
# keep attn.comp / attn_lane.comp; vkattn.formats)
COOPMAT_FORMATS = tuple(name for name, f in STORAGE.items() if f.matrices)


def planned_variants() -> list:
    """(shader, defines) of every pipeline the runtime builds: per storage format the append,
    attn.comp (with and without its subgroup shuffles), attn_lane.comp (storage and texel K/V, aux through a texel view or not) and, for the formats its
    matrices hold (float16, int8, fp8), attn_coopmat.comp (loops rolled or unrolled, COOPMAT_FIXED_TRIPS and COOPMAT_STAGE_BATCH either way); the paged and persistence copies; the split
    merge; the subgroup probe and the half-conversion probe."""
    out = []
    for fmt, d in FORMATS.items():
        out.append(("append", dict(d)))
        out += [("attn", dict(d, TILE_SHUFFLE=s)) for s in (0, 1)]
        out.append(("attn", dict(d, TILE_SHUFFLE=1, TILE_MERGE_BATCH=0)))     # VKATTN_TILE_MERGE_BATCH=0
        out.append(("attn", dict(d, TILE_SHUFFLE=1, TILE_V_EARLY=1)))         # VKATTN_TILE_V_EARLY=1
        lane = [dict(d), dict(d, KV_TEXEL=1)]               # K/V from texel views (tuning.texel_kv)
        if d.get("KV_F16") or d.get("KV_FP8"):               # the device's exact half conversion (Device.half_native)
            lane += [dict(d, HALF_NATIVE=1), dict(d, KV_TEXEL=1, HALF_NATIVE=1)]
        # each also with masks and block tables from a texel view of aux (tuning.texel_aux)
        out += [("attn_lane", x) for x in lane] + [("attn_lane", dict(x, AUX_TEXEL=1)) for x in lane]
        if fmt in COOPMAT_FORMATS:
            out += [("attn_coopmat", dict(d, COOPMAT_UNROLL=u, COOPMAT_FIXED_TRIPS=t, COOPMAT_STAGE_BATCH=b))
                    for u in (0, 1) for t in (0, 1) for b in (0, 1)]
    for i8 in (0, 1):
        out += [("gather_slots", {"KV_I8": i8}), ("scatter_slots", {"KV_I8": i8})]
    out += [("copy_rows", {}), ("merge_lse", {}), ("mask_copy", {}), ("subgroup_probe", {}),
            ("numerics_probe", {"MODE": 1, "KV_F16": 1, "HALF_NATIVE": 1})]      # Device.half_native
    return out


def _key(name: str, defines: dict) -> str:
    return f"{name} {json.dumps(dict(sorted(defines.items())), sort_keys=True)}"


def read_log(path) -> list:
    """(shader, defines) pairs of a VKATTN_SHADER_LOG file, each once."""
    seen, out = set(), []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        name, defines = line.split("\t", 1)
        defines = json.loads(defines)
        if _key(name, defines) not in seen:
            seen.add(_key(name, defines))
            out.append((name, defines))
    return out


def version_of(glslang: str) -> str:
    out = subprocess.run([glslang, "--version"], capture_output=True, text=True).stdout
    return out.splitlines()[0] if out else "?"


def coopmat_capable(glslang: str) -> str:
    """"" if ``glslang`` compiles the cooperative-matrix probe into well-formed SPIR-V, else why not."""
    with tempfile.TemporaryDirectory() as tmp:
        src, spv = Path(tmp) / "probe.comp", Path(tmp) / "probe.spv"
        src.write_text(compiler._COOPMAT_PROBE)
        res = subprocess.run([glslang, "-V", "--target-env", compiler.TARGET_ENV, "-o", str(spv), str(src)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            return "no GL_KHR_cooperative_matrix"
        return matrix_problem(spv.read_bytes())


def audit(glslangs, spirv_val=None, log=None) -> dict:
    """{"rows": [...], "failures": [...], "unlisted": [...]} for the variants on each compiler."""
    variants = planned_variants()
    listed = {_key(n, d) for n, d in variants}
    unlisted = []
    if log:
        for n, d in read_log(log):
            if _key(n, d) not in listed:
                unlisted.append(_key(n, d))
                variants.append((n, d))
    rows, failures = [], []
    for exe in glslangs:
        ver = version_of(exe)
        cm = coopmat_capable(exe)
        for name, defines in variants:
            row = {"glslang": ver, "shader": name, "defines": defines}
            if name == "attn_coopmat" and cm:
                row["result"] = f"skipped: this glslang has {cm}"
                rows.append(row)
                continue
            try:
                spirv = compiler._run_glslang(name, compiler.shader_dir(), dict(sorted(defines.items())), exe=exe)
            except Exception as e:          # noqa: BLE001 -- a compile error is a finding, reported below
                row["result"] = f"compile error: {e}"
            else:
                bad = matrix_problem(spirv)
                if not bad and spirv_val:
                    bad = compiler.validate(spirv, spirv_val)
                row["result"] = bad or "valid"
                row["bytes"] = len(spirv)
            rows.append(row)
            if row["result"] != "valid":
                failures.append(row)
    return {"rows": rows, "failures": failures, "unlisted": unlisted,
            "spirv_val": version_of(spirv_val) if spirv_val else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vkattn.tools.spirv_audit", description=__doc__.splitlines()[0])
    ap.add_argument("--glslang", action="append", help="a glslangValidator (repeat; default: the one vkattn uses)")
    ap.add_argument("--spirv-val", help="SPIRV-Tools' spirv-val (one that knows SPV_KHR_cooperative_matrix)")
    ap.add_argument("--log", help="a VKATTN_SHADER_LOG file of a test run: its variants too, and none unlisted")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    res = audit(a.glslang or [compiler._glslang()], a.spirv_val, a.log)
    for r in res["rows"]:
        d = ",".join(f"{k}={v}" for k, v in r["defines"].items()) or "-"
        print(f"{r['glslang']:<28} {r['shader']:<15} {d:<40} {r['result'].splitlines()[0][:160]}")
    n_ok = sum(r["result"] == "valid" for r in res["rows"])
    n_skip = sum(r["result"].startswith("skipped") for r in res["rows"])
    print(f"spirv_audit: {n_ok} valid, {len(res['failures'])} failed, {n_skip} skipped "
          f"(spirv-val: {res['spirv_val'] or 'not run'})")
    for u in res["unlisted"]:
        print(f"spirv_audit: also audited, built by the test run beyond planned_variants(): {u}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
