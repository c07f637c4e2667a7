"""llama.cpp's Vulkan flash attention as the anchor of ``perf gpu``, compiled on the same compiler.

llama.cpp's scalar ``flash_attn.comp`` and cooperative-matrix ``flash_attn_cm1.comp`` are built
from a llama.cpp (or ggml) checkout the user names -- nothing of theirs is copied into this
project -- with the defines llama.cpp's shader generator gives them and the specialisation
constants its host code picks for the device at hand, then compiled by RADV/ACO for each AMD
family the installed Mesa reaches without the GPU (``vkattn.tools.vkpipeline``):

    VKATTN_LLAMA_CPP_SHADERS=<llama.cpp>/ggml/src/ggml-vulkan/vulkan-shaders python -m perf llama
    (or ``python -m perf gpu`` with the same variable: the report's anchor is then measured)

What is reproduced (read from ggml at d99724f2, 2026-08-21, the sync of llama.cpp of that day:
``vulkan-shaders-gen.cpp`` and ``ggml-vulkan.cpp``; the rules below are this module's own code):

* the call: attention of 32 query / 8 KV heads, head dim 128, float16 K and V, float32 queries and
  output, a float16 mask (llama.cpp always passes one), float32 accumulation (llama.cpp sets
  GGML_PREC_F32 on every flash attention). Decode: 1 query row over 4096 keys; prefill: 512 rows
  from an empty cache (512 keys, llama.cpp's cache padded to 256). Strides and key counts are
  aligned (no bounds clamp).
* device facts the host reads: AMD GCN = subgroup sizes 64..64; integrated = UMA; the default
  subgroup size; maxComputeSharedMemorySize; float16 (shaderFloat16 + 16-bit storage);
  VK_VALVE_shader_mixed_float_dot_product's float16->float32 dot (the DOT2_F16 build, compiled
  without ``-O``); cooperative matrices with full subgroups (RADV's 16x16x16 float16->float32).
* decode with grouped queries: the 4 query heads of a KV head become the rows of one workgroup
  (N = 4 rows); the tile shape (workgroup size, Br, Bc, D_split, row_split, subgroup size, the
  RDNA occupancy limiter through unused shared memory) chosen by its tuning function for those
  rows; the mask-optimisation flag where its rule sets it. The pipeline requires full subgroups
  of that size, as llama.cpp creates it; 7 storage buffers and 128 bytes of push constants.
* glslc (shaderc) with ``--target-env=vulkan1.2`` and ``-O`` except for the cooperative-matrix
  and dot2 builds, as llama.cpp's generator runs it.

Where the device has cooperative matrices llama.cpp's host itself picks ``flash_attn_cm1`` (decode
with GQA too, as the 4 rows are not 1); the scalar build is reported all the same: it is the
anchor issue 21 names, and cm1 the one issue 22 names.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vkattn.tools import vkpipeline as vp

from .disasm import STAT_KEYS, key_loop

GGML_F16 = 1                      # ggml_type enumerants (llama.cpp's spec constants 12 and 13)
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
CASES = {"decode": (1, 4096), "prefill": (512, 512)}      # (query rows, keys)
SOURCES = ("flash_attn.comp", "flash_attn_cm1.comp")
PUSH_CONSTANT_BYTES = 128        # 32 words: llama.cpp's vk_flash_attn_push_constants
BINDINGS = 7


class LlamaCppError(RuntimeError):
    """The llama.cpp sources or glslc are missing, or a source did not compile."""


@dataclass(frozen=True)
class FaDevice:
    """What llama.cpp's flash-attention set-up reads of a device."""
    gcn: bool
    uma: bool
    subgroup_size: int
    shared_memory: int
    fp16: bool
    dot2: bool
    coopmat: bool
    size_control: bool        # a pipeline may require its subgroup size (compute stage)
    full_subgroups: bool      # computeFullSubgroups


    @classmethod
    def of(cls, info, support) -> "FaDevice":
        """From ``vkattn._vkinfo.DeviceInfo`` and ``vkattn.tools.vkpipeline.DeviceSupport``."""
        f = support.features
        return cls(gcn=info.min_subgroup_size == info.max_subgroup_size == 64,
                   uma=info.device_type == "integrated",
                   subgroup_size=info.subgroup_size, shared_memory=info.max_compute_shared_memory_size,
                   fp16=bool(f.get("shaderFloat16") and f.get("storageBuffer16BitAccess")),
                   dot2=bool(f.get("shaderMixedFloatDotProductFloat16AccFloat32")),
                   coopmat=bool(f.get("cooperativeMatrix") and f.get("computeFullSubgroups")),
                   size_control=bool(f.get("subgroupSizeControl") and info.required_subgroup_size_stages & 0x20),
                   full_subgroups=bool(f.get("computeFullSubgroups")))


@dataclass(frozen=True)
class Tile:
    path: str                 # "scalar" or "cm1"
    workgroup: int
    br: int
    bc: int
    d_split: int
    row_split: int
    subgroup: int
    limit_occupancy: int = 0  # vec4s of unused shared memory (LIMIT_OCCUPANCY_SHMEM)


def _lowest_bit(d: int) -> int:
    return d & -d


def _scalar_shared_bytes(dev: FaDevice, t: Tile, hsk: int, hsv: int) -> int:
    """flash_attn.comp's shared memory, as llama.cpp estimates it before creating a pipeline."""
    ft = 2 if dev.fp16 else 4
    wg = t.workgroup
    qf = t.br * (hsk // 4 + 1) * 4 * ft
    return wg * 4 + wg * 4 * ft + t.bc * (t.br + 1) * ft + 16 * ft + qf + 4 * ft


def scalar_tile(dev: FaDevice, hsk: int, hsv: int, rows: int, keys: int) -> Tile:
    """llama.cpp's scalar tuning for an AMD device (it has other rules for Intel and NVIDIA)."""
    sg = (32 if rows < 4 else dev.subgroup_size) if not dev.gcn else dev.subgroup_size
    max_hsk = 64
    if not dev.gcn and not dev.uma:
        max_hsk = 64 if rows <= 8 else 128
    row_split = 1 if (rows < 4 or hsk <= max_hsk) else 4
    wide = sg > 32 and (rows < 4 or hsk < (128 if row_split == 1 else 64))
    wg = sg * 2 if wide else sg * 4
    d = hsk | hsv
    reduce_rows = bool(d & 8) or keys < 1024
    if rows == 1:
        br, bc = 1, 64
    else:
        if row_split == 1:
            br = 2 if rows == 2 else (4 if (rows <= 4 or reduce_rows) else 8)
        else:
            br = 4 if rows <= 4 else (8 if (rows <= 8 or reduce_rows) else 16)
        bc = 64 if d & 8 else 32
    d_split = min(sg, 8, _lowest_bit(d) // 4)
    t = Tile("scalar", wg, br, bc, d_split, row_split, sg)
    if not reduce_rows and _scalar_shared_bytes(dev, t, hsk, hsv) > dev.shared_memory:
        t = Tile("scalar", wg, br // 2, bc, d_split, row_split, sg)
    limit = 0
    if dev.shared_memory == 65536:
        if not dev.gcn and rows >= 64 and hsk <= 128:
            limit = (26 if hsk <= 64 else 30) * 1024 // 16
        elif dev.gcn and rows <= 8 and hsk >= 256:
            limit = (14 if rows < 4 else 26) * 1024 // 16
    return Tile("scalar", t.workgroup, t.br, t.bc, t.d_split, t.row_split, t.subgroup, limit)


def cm1_tile(dev: FaDevice, hsk: int, hsv: int) -> Tile:
    """llama.cpp's cooperative-matrix (KHR, 16x16x16) tuning: 4 subgroups, 16 rows x 64 keys."""
    d = hsk | hsv
    sg = dev.subgroup_size
    return Tile("cm1", 4 * sg, 16, 64, min(sg, 8, _lowest_bit(d) // 4), 4, sg)


@dataclass(frozen=True)
class Config:
    """One pipeline as llama.cpp would create it for a case."""
    case: str
    source: str
    defines: tuple
    optimise: bool
    tile: Tile
    rows: int                 # query rows the kernel sees (GQA folded)
    keys: int
    flags: int

    @property
    def spec(self) -> list:
        t = self.tile
        return [t.workgroup, t.br, t.bc, HEAD_DIM, HEAD_DIM, 0, t.d_split, t.row_split, t.subgroup,
                0, self.flags, t.limit_occupancy, GGML_F16, GGML_F16, 2, 2]

    @property
    def name(self) -> str:
        t = self.tile
        return (f"llama.cpp {t.path} {self.case} (wg {t.workgroup}, Br {t.br}, Bc {t.bc}, rows "
                f"{self.rows}, flags {self.flags}{', dot2' if ('DOT2_F16', '1') in self.defines else ''})")


def configs(dev: FaDevice, path: str) -> list:
    """The decode and prefill pipelines of ``path`` ("scalar" or "cm1") on ``dev``."""
    if dev.fp16:
        defines = {"FLOAT_TYPE": "float16_t", "FLOAT_TYPEV2": "f16vec2", "FLOAT_TYPEV4": "f16vec4",
                   "FLOAT16": "1", "FLOAT_TYPE_MAX": "float16_t(65504.0)"}
    else:           # llama.cpp's "_fp32" build: float16 K/V read, float32 math
        defines = {"FLOAT_TYPE": "float", "FLOAT_TYPEV2": "vec2", "FLOAT_TYPEV4": "vec4"}
    defines.update({"ACC_TYPE": "float", "ACC_TYPEV2": "vec2", "ACC_TYPEV4": "vec4",
                    "DATA_A_IQ4_NL": "1", "Q_TYPE": "float", "D_TYPE": "float", "D_TYPEV4": "vec4"})
    if path == "cm1":
        if not dev.fp16:
            raise LlamaCppError("llama.cpp's cooperative-matrix build needs float16")
        if not dev.coopmat:
            raise LlamaCppError("the device has no cooperative matrices with full subgroups")
        defines["COOPMAT"] = "1"
        source, optimise = "flash_attn_cm1.comp", False
    else:
        source, optimise = "flash_attn.comp", True
        if dev.dot2 and dev.fp16:
            defines["DOT2_F16"] = "1"
            optimise = False
    out = []
    for case, (rows, keys) in CASES.items():
        # the tile for 512 rows bounds how many grouped query heads fold into the rows
        big = cm1_tile(dev, HEAD_DIM, HEAD_DIM) if path == "cm1" else \
            scalar_tile(dev, HEAD_DIM, HEAD_DIM, 512, keys)
        group = HEADS // KV_HEADS
        n = group if rows <= 8 and 1 < group <= min(big.br, 32) else rows
        tile = cm1_tile(dev, HEAD_DIM, HEAD_DIM) if path == "cm1" else \
            scalar_tile(dev, HEAD_DIM, HEAD_DIM, n, keys)
        mask_rows, mask_cols = rows, keys
        mask_opt = (mask_rows >= 32 and mask_cols * mask_rows > 32768 and mask_cols >= tile.bc * 16
                    and not dev.gcn)
        flags = (1 if mask_opt else 0) | 2
        out.append(Config(case, source, tuple(sorted(defines.items())), optimise, tile, n, keys, flags))
    return out


def glslc() -> str:
    exe = os.environ.get("VKATTN_GLSLC") or shutil.which("glslc")
    if not exe:
        raise LlamaCppError("glslc not found (Debian: apt-get install glslc; or VKATTN_GLSLC): "
                            "llama.cpp's shaders are built with shaderc's glslc")
    return exe


def shader_dir(path=None) -> Path:
    """The llama.cpp ``vulkan-shaders`` directory: ``path`` or $VKATTN_LLAMA_CPP_SHADERS."""
    path = path or os.environ.get("VKATTN_LLAMA_CPP_SHADERS")
    if not path:
        raise LlamaCppError("name llama.cpp's vulkan-shaders directory (VKATTN_LLAMA_CPP_SHADERS="
                            "<llama.cpp>/ggml/src/ggml-vulkan/vulkan-shaders)")
    d = Path(path)
    missing = [s for s in SOURCES if not (d / s).is_file()]
    if missing:
        raise LlamaCppError(f"{d} lacks {', '.join(missing)}: not llama.cpp's vulkan-shaders directory")
    return d


def compile_config(cfg: Config, src: Path, out_dir: Path) -> bytes:
    """SPIR-V of ``cfg`` built from the checkout ``src`` into ``out_dir`` (a temporary directory)."""
    out = out_dir / f"{cfg.source}.{abs(hash(cfg.defines))}.spv"
    if not out.exists():
        cmd = [glslc(), "-fshader-stage=compute", "--target-env=vulkan1.2", str(src / cfg.source),
               "-o", str(out)] + (["-O"] if cfg.optimise else []) + [f"-D{k}={v}" for k, v in cfg.defines]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            raise LlamaCppError(f"glslc failed on {cfg.source}: {proc.stderr.strip()[-2000:]}")
    return out.read_bytes()


FEATURES = ["shaderFloat16", "storageBuffer16BitAccess", "storageBuffer8BitAccess", "shaderInt8",
            "cooperativeMatrix", "vulkanMemoryModel", "shaderMixedFloatDotProductFloat16AccFloat32"]


def anchors(families, src=None, mechanism=None) -> dict:
    """{family: {"scalar decode": stats, "scalar prefill": ..., "cm1 decode": ..., ...}}: llama.cpp's
    pipelines compiled for each family (cm1 where the device offers cooperative matrices). Stats:
    the statistics of ``perf gpu`` plus the configuration ("config", "spec") and, from the
    disassembly, the key loop's VALU and WMMA counts."""
    src = shader_dir(src)
    mechanism = mechanism or vp.null_mechanism()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fam in families:
            info = vp.family_device_info(fam, mechanism=mechanism)
            head = vp.family_stats([fam], [], mechanism=mechanism)[fam]
            if info is None or not head.available:
                out[fam] = {"error": head.reason or "no device"}
                continue
            dev = FaDevice.of(info, head.device)
            cfgs = configs(dev, "scalar") + (configs(dev, "cm1") if dev.coopmat else [])
            # the size is required only where the device lets compute require one (not GCN)
            jobs = [vp.Job(c.name, compile_config(c, src, Path(tmp)), c.spec, BINDINGS,
                           subgroup_size=c.tile.subgroup if dev.size_control else None,
                           full_subgroups=dev.full_subgroups,
                           push_constant_bytes=PUSH_CONSTANT_BYTES) for c in cfgs]
            res = vp.family_stats([fam], jobs, features=FEATURES, ir=True, mechanism=mechanism)[fam]
            fam_out = {"device": dev.__dict__}
            for cfg, jr in zip(cfgs, res.jobs):
                key = f"{cfg.tile.path} {cfg.case}"
                if not jr.ok:
                    fam_out[key] = {"error": f"{jr.result}: {jr.error}", "config": cfg.name}
                    continue
                exe = jr.executables[0]
                asm = next((v for k, v in exe.ir.items() if "Assembly" in k or "ISA" in k), "")
                loop = key_loop(asm)
                fam_out[key] = {**{k: exe.stats.get(k) for k in STAT_KEYS}, "subgroup_size": exe.subgroup_size,
                                "config": cfg.name, "spec": cfg.spec, **loop,
                                "loop_valu": loop["valu"] + loop["valu_cond"]}
            out[fam] = fam_out
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    src = argv[0] if argv else None
    mech = vp.null_mechanism()
    if not mech.available:
        print(f"perf llama: {mech.reason}", file=sys.stderr)
        return 2
    fams = [f for f in os.environ.get("VKATTN_GPU_FAMILIES", "").split(",") if f.strip()] or \
        list(vp.default_families(mech))
    try:
        found = anchors(fams, src, mech)
    except LlamaCppError as exc:
        print(f"perf llama: {exc}", file=sys.stderr)
        return 2
    print(f"llama.cpp flash attention on {mech.describe()}\n")
    print("| family | pipeline | VGPRs | spilled | LDS | waves/SIMD | subgroup | key-loop VALU | key-loop WMMA |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    bad = 0
    for fam, per in found.items():
        for key, st in per.items():
            if key == "device":
                continue
            if "error" in st:
                bad += 1
                print(f"| {fam} | {key} | failed: {st['error'][:80]} | | | | | | |")
                continue
            print(f"| {fam} | {st['config']} | {st['VGPRs']} | {st['Spilled VGPRs']} | {st['LDS size']} | "
                  f"{st['Subgroups per SIMD']} | {st['subgroup_size']} | {st['loop_valu']} | {st['wmma']} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
