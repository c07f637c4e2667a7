"""``python -m perf features``: what the Vulkan features kp 0.9 leaves off would change, measured
with the GPU compilers here (RADV's null hardware, as ``perf gpu``).

kp creates its device with no optional features, so vkattn's kernels store float16 as uint32 pairs
and do all arithmetic in float32. This compiles variants of attn.comp for the perf shape (32/8
heads, head_dim 128, float16 cache; decode and prefill 512) with

* ``16bit-storage`` -- K and V read as f16vec4 through VK_KHR_16bit_storage
  (storageBuffer16BitAccess) instead of unpackHalf2x16 of uint32 words;
* ``16bit-storage+fp16-math`` -- also the query slice held in float16 and the score dot products
  as packed float16 FMAs (shaderFloat16), summed in float32 across the cluster;

and reports VGPRs, waves per SIMD and the VALU instructions of one key-loop pass beside the
shipped kernel. The variants are made from the current shaders/attn.comp by the substitutions
below (each must match, or the study stops), in a temporary directory: the shipped kernel carries
no feature code. Cooperative matrices need a driver that lists VK_KHR_cooperative_matrix (RADV
22.3 does not): ``perf/coopmat_tile.comp`` is compiled where one does.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from vkattn.tools import vkpipeline as vp
from vkattn._attn import StorageFormat, attn_pipeline
from vkattn.compiler import compile_shader, shader_dir
from vkattn.device import PlanningDevice

from .disasm import key_loop

FEATURES = ["shaderFloat16", "storageBuffer16BitAccess"]
VARIANTS = {"shipped": {}, "16bit-storage": {"F16_STORAGE": 1},
            "16bit-storage+fp16-math": {"F16_STORAGE": 1, "F16_MATH": 1}}

# (anchor in attn.comp, replacement): the study's variant switches
SUBSTITUTIONS = [
    ("#extension GL_EXT_control_flow_attributes : require\n",
     "#extension GL_EXT_control_flow_attributes : require\n#if F16_STORAGE\n"
     "#extension GL_EXT_shader_16bit_storage : require\n#endif\n#if F16_MATH\n"
     "#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require\n#endif\n"),
    ("#else\n#define UV CH\n",
     "#elif F16_STORAGE && KV_F16\n#define UV CH\n"
     "layout(std430, binding = 0) readonly buffer KC16 { f16vec4 kc16[]; };\n"
     "layout(std430, binding = 1) readonly buffer VC16 { f16vec4 vc16[]; };\n"
     "#define LOAD16 1\n#else\n#define UV CH\n"),
    ("                unpack_unit(k_unit(rows[i], my_unit(w, DKU)), t);\n",
     "#if LOAD16\n                { const uint k16 = (rows[i] * DK4 + my_unit(w, DKU)) * 2u;"
     " t[0] = vec4(kc16[k16]); t[1] = vec4(kc16[k16 + 1u]); }\n#else\n"
     "                unpack_unit(k_unit(rows[i], my_unit(w, DKU)), t);\n#endif\n"),
    ("                unpack_unit(v_unit(rows[i], my_unit(w, DVU)), t);\n",
     "#if LOAD16\n                { const uint v16 = (rows[i] * DV4 + my_unit(w, DVU)) * 2u;"
     " t[0] = vec4(vc16[v16]); t[1] = vec4(vc16[v16 + 1u]); }\n#else\n"
     "                unpack_unit(v_unit(rows[i], my_unit(w, DVU)), t);\n#endif\n"),
    ("vec4 qr[RPT * KW * UV];",
     "#if F16_MATH\nf16vec4 qh[RPT * KW * UV];\n#endif\nvec4 qr[RPT * KW * UV];"),
    ("                qr[(r * KW + w) * UV + e] = x * qscale;\n",
     "                qr[(r * KW + w) * UV + e] = x * qscale;\n#if F16_MATH\n"
     "                qh[(r * KW + w) * UV + e] = f16vec4(x * qscale);\n#endif\n"),
    ("                [[unroll]] for (uint x = 0u; x < KW * UV; ++x) dsum += dot(qr[r * KW * UV + x], kx[i * KW * UV + x]);\n",
     "#if F16_MATH\n                f16vec4 h = f16vec4(0.0hf);\n"
     "                [[unroll]] for (uint w = 0u; w < KW; ++w) {\n"
     "                    const uint k16 = (rows[i] * DK4 + my_unit(w, DKU)) * 2u;\n"
     "                    h = fma(qh[(r * KW + w) * UV], kc16[k16], h);\n"
     "                    h = fma(qh[(r * KW + w) * UV + 1u], kc16[k16 + 1u], h);\n"
     "                }\n                dsum = float(h.x) + float(h.y) + float(h.z) + float(h.w);\n#else\n"
     "                [[unroll]] for (uint x = 0u; x < KW * UV; ++x) dsum += dot(qr[r * KW * UV + x], kx[i * KW * UV + x]);\n"
     "#endif\n"),
]


def variant_sources(dst: Path) -> None:
    """shaders/ copied to ``dst`` with attn.comp carrying the variant switches."""
    src = Path(str(shader_dir()))
    for f in src.iterdir():
        if f.suffix in (".comp", ".glsl"):
            shutil.copy(f, dst / f.name)
    text = (dst / "attn.comp").read_text()
    for anchor, repl in SUBSTITUTIONS:
        if text.count(anchor) != 1:
            raise SystemExit(f"perf features: attn.comp changed; anchor not found once: {anchor[:60]!r}")
        text = text.replace(anchor, repl)
    (dst / "attn.comp").write_text(text)


def study(families=None) -> list:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        variant_sources(Path(tmp))
        for fam in families or vp.default_families():
            info = vp.family_device_info(fam)
            if info is None:
                continue
            dev = PlanningDevice(info)
            jobs = []
            for kind, qrows in (("decode", 1), ("prefill 512", 512)):
                fmt = StorageFormat(8, 128, dtype="float16", block_size=4096)
                _, p = attn_pipeline(dev, fmt, 32, qrows, 0, 1, 0, 4096, qrows == 1)
                for var, defs in VARIANTS.items():
                    d = {**p.defines, "F16_STORAGE": 0, "F16_MATH": 0, **defs}
                    jobs.append(vp.Job(f"{kind}|{var}", compile_shader("attn", d, src_dir=tmp), list(p.spec),
                                       p.bindings))
            coop = Path(__file__).parent / "coopmat_tile.comp"
            res = vp.family_stats([fam], jobs, features=FEATURES, ir=True)[fam]
            if res.device and res.device.features.get("cooperativeMatrix") and coop.exists():
                cm = vp.family_stats([fam], [vp.Job("coopmat tile|cooperative-matrix",
                                                    compile_shader("coopmat_tile", {}, src_dir=coop.parent))],
                                     features=["cooperativeMatrix", "shaderFloat16", "storageBuffer16BitAccess"],
                                     ir=True)[fam]
                res.jobs += cm.jobs
            absent = set(res.not_supported)
            for j in res.jobs:
                kind, var = j.name.split("|")
                row = {"family": fam, "kernel": kind, "variant": var, "ok": j.ok, "error": j.error,
                       "absent": ("shaderFloat16" in absent and "fp16" in var) or
                                 ("storageBuffer16BitAccess" in absent and "16bit" in var)}
                if j.ok:
                    e = j.executables[0]
                    asm = next((v for k, v in e.ir.items() if "Assembly" in k), "")
                    row.update(VGPRs=e["VGPRs"], waves=e["Subgroups per SIMD"], instructions=e["Instructions"],
                               **key_loop(asm))
                rows.append(row)
    return rows


def main(argv=None) -> int:
    mechanism = vp.null_mechanism()
    if not mechanism.available:
        print(f"perf features: {mechanism.reason}", file=sys.stderr)
        return 2
    fams = [f for f in os.environ.get("VKATTN_GPU_FAMILIES", "").split(",") if f.strip()] or None
    rows = study(fams)
    print("| family | kernel | variant | VGPRs | waves/SIMD | VALU per key-loop pass | vs shipped |")
    print("|---|---|---|---:|---:|---:|---:|")
    base = {(r["family"], r["kernel"]): r for r in rows if r["variant"] == "shipped" and r["ok"]}
    for r in rows:
        if not r["ok"]:
            print(f"| {r['family']} | {r['kernel']} | {r['variant']} | failed: {r['error'][:60]} | | | |")
            continue
        b = base.get((r["family"], r["kernel"]))
        rel = f"{r['valu'] / b['valu'] - 1:+.0%}" if b and b["valu"] else ""
        note = " (the device lacks the feature)" if r["absent"] else ""
        print(f"| {r['family']} | {r['kernel']} | {r['variant']}{note} | {r['VGPRs']} | {r['waves']} | {r['valu']}"
              f"{' (+%d cond.)' % r['valu_cond'] if r['valu_cond'] else ''} | {rel} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
