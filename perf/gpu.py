"""``python -m perf gpu``: vkattn's pipelines as GPU compilers build them, without a GPU.

For a list of call shapes (the perf shapes 32/8 heads d128, 8/8 d64 and 16/2 d256; float16,
float32, int8, bfloat16, fp8_e4m3 and q4; attend, decode step, a 16-row chunk and a 512-token prefill at L=4096; the score
variants; a paged batch; read and fork) this plans every pipeline vkattn would build -- the same
planner the caches use (vkattn._attn.attn_pipeline, append/gather/copy pipelines), run against the
device limits of RADV's null hardware for each AMD family the installed Mesa knows -- compiles
each with ACO there (vkattn.tools.vkpipeline) and reports per pipeline and family: VGPRs, SGPRs,
spills, scratch, LDS, waves per SIMD and instructions, plus the VALU instructions of the key loop
read from the disassembly.

Per call it adds a traffic model -- device bytes each dispatch reads and writes, bytes crossing
host <-> device, submissions and dispatches -- and three time bounds on reference GPUs from their
datasheets: memory (unique bytes / bandwidth), arithmetic (flops / fp32 rate) and, where a family's
compiler is here, instruction issue (the VALU instructions the compiled code executes / the
chip's issue rate). The largest is the model time.

The compiler is RADV/ACO of the installed Mesa, reached without the GPU as vkattn.tools.vkpipeline
finds best: RADV_FORCE_FAMILY up to Mesa 25 (Debian 12's 22.3: polaris10, vega10, navi10, navi21,
gfx1100), AMDGPU's drm-shim on Mesa 26 (trixie-backports' 26.1: the same chips, RDNA3 spelled
navi31, and gfx1201 = RDNA4). Beside vkattn's pipelines the report puts llama.cpp's flash attention
on the same compiler (the anchor: recorded figures, or measured by perf/llama_cpp.py when
VKATTN_LLAMA_CPP_SHADERS names its shader sources) and, where the device offers
VK_KHR_cooperative_matrix, the cooperative-matrix prefill kernel: vkattn's attn_coopmat.comp once it
exists (planned with VKATTN_KERNEL=coopmat), else the study kernel perf/coopmat_tile.comp, with its
WMMA and VALU instructions per 16x16 block and a modelled prefill time.

Environment: VKATTN_GPU_FAMILIES (comma list; default every family of the mechanism),
VKATTN_PERF_OUT (perf/out), VKATTN_LLAMA_CPP_SHADERS. Writes gpu_report.{json,csv,md} there on
Mesa 22.3 (the report committed as perf/gpu_report.*) and gpu_report_mesa<major>.{json,csv,md}
on any other Mesa (perf/gpu_report_mesa26.* from Debian 13 with trixie-backports' Mesa).
"""
from __future__ import annotations

import csv
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vkattn.tools import vkpipeline as vp
from vkattn import tuning
from vkattn._attn import (F_ALIBI, F_MASK, F_PAGED, F_SOFTCAP, F_WINDOW, HEADER, SEQ_WORDS, AttnPlan,
                          RoPE, StorageFormat, aux_bucket, attn_pipeline, split_keys)
from vkattn._base import READ_ROWS, appends_first, append_pipeline, gather_pipeline
from vkattn.compiler import compile_shader, shader_dir
from vkattn.device import PlanningDevice
from vkattn.cascade import MERGE_PARAMS, merge_pipeline, shared_splits
from vkattn.paged import copy_pipeline
from vkattn.tuning import decode_key_bound, kernel_for, own_splits, row_bucket

from .disasm import STAT_KEYS, key_loop

L = 4096                # context of the decode cases
PREFILL = 512
CHUNK = 16
SHAPES = {"32/8 d128": (32, 8, 128), "8/8 d64": (8, 8, 64), "16/2 d256": (16, 2, 256)}
DTYPES = ("float16", "float32", "int8", "bfloat16", "fp8_e4m3", "q4")
BATCH_LENS = [100 + round(i * 3900 / 15) for i in range(16)]     # perf batch: 16 of 100 .. 4000
BLOCK = 16
CASCADE_SHARED = 2048                                             # perf cascade: 16 sequences sharing 2048
CASCADE_OWN = [64 + round(i * 192 / 15) for i in range(16)]      # tokens, each with 64 .. 256 of its own


@dataclass(frozen=True)
class GPU:
    """Datasheet figures of a reference GPU; ``family``: its RADV family (compiled here) or None."""
    name: str
    family: str | None
    cus: int            # compute units (AMD), Xe cores (Intel), SMs (NVIDIA)
    clock_ghz: float    # boost clock
    bandwidth_gbs: float
    fp32_tflops: float
    f16_matrix_tflops: float | None = None  # dense float16 matrix rate (WMMA), where it has one


REFERENCE_GPUS = [
    GPU("Radeon RX 580", "polaris10", 36, 1.340, 256.0, 6.17),
    GPU("Radeon RX Vega 64", "vega10", 64, 1.546, 483.8, 12.66),
    GPU("Radeon RX 5700 XT", "navi10", 40, 1.905, 448.0, 9.75),
    GPU("Radeon RX 6800 XT", "navi21", 72, 2.250, 512.0, 20.74),
    GPU("Radeon RX 7900 XTX", "gfx1100", 96, 2.500, 960.0, 61.4, 122.8),
    GPU("Radeon RX 9070 XT", "gfx1201", 64, 2.970, 640.0, 48.7, 194.7),
    GPU("Arc A770", None, 32, 2.100, 560.0, 17.2),
    GPU("GeForce RTX 4090", None, 128, 2.520, 1008.0, 82.6),
]


# llama.cpp's flash attention (float16 K/V, the spec constants its host code picks for an AMD
# discrete GPU) on the same compiler: waves per SIMD as RADV reports them, per Mesa version.
# 22.3: issue 16's measurement (its scalar flash_attn.comp of then; not re-measured here).
# 26.1: perf/llama_cpp.py at ggml d99724f2 (2026-08-21), glslc 2025.2 (shaderc, Debian 13), Mesa
# 26.1.6 drm-shim -- VGPRs / LDS bytes / waves, and for cm1 the key loop's WMMA and VALU per pass
# (one 16x16 block per subgroup pass); `python -m perf llama` reproduces them.
LLAMA_CPP = {
    (22, 3): {"source": "issue 16",
              "waves": {"decode 128": {"vega10": 4, "navi21": 18, "gfx1100": 24},
                        "decode 256": {"vega10": 2, "navi21": 14, "gfx1100": 18},
                        "prefill 128": {"vega10": 1, "navi21": 6, "gfx1100": 8}}},
    (26, 1): {"source": "perf/llama_cpp.py, ggml d99724f2",
              "waves": {"decode 128": {"polaris10": 4, "vega10": 4, "navi10": 16, "navi21": 18, "gfx1100": 32,
                                       "gfx1201": 32},
                        "prefill 128": {"polaris10": 2, "vega10": 3, "navi10": 8, "navi21": 8, "gfx1100": 8,
                                        "gfx1201": 8}},
              "cm1": {"gfx1100": {"VGPRs": 96, "LDS size": 16384, "Subgroups per SIMD": 16, "Spilled VGPRs": 0,
                                  "subgroup_size": 64, "wmma": 16, "loop_valu": 434, "valu_cond": 434, "valu_total": 990},
                      "gfx1201": {"VGPRs": 96, "LDS size": 16384, "Subgroups per SIMD": 16, "Spilled VGPRs": 0,
                                  "subgroup_size": 64, "wmma": 16, "loop_valu": 363, "valu_cond": 363, "valu_total": 866}}},
}


def llama_cpp_anchor(mesa, families, mechanism=None) -> dict:
    """The llama.cpp figures for this report: measured now (perf/llama_cpp.py) when
    VKATTN_LLAMA_CPP_SHADERS names its sources, else the ones recorded for this Mesa (or none).
    {"source", "waves": {"decode 128": {family: n}}, "cm1": {family: stats}}, families as the
    report names them."""
    if os.environ.get("VKATTN_LLAMA_CPP_SHADERS"):
        from . import llama_cpp
        found = llama_cpp.anchors(families, mechanism=mechanism)
        waves, cm1 = {}, {}
        for fam, per in found.items():
            for key, st in per.items():
                if key == "device" or "error" in st:
                    continue
                path, case = key.split()
                if path == "scalar":
                    waves.setdefault(f"{case} 128", {})[fam] = st["Subgroups per SIMD"]
                elif case == "prefill":
                    cm1[fam] = st
        return {"source": "perf/llama_cpp.py, measured with this report", "waves": waves, "cm1": cm1,
                "stats": found}
    rec = LLAMA_CPP.get(tuple(mesa[:2]) if mesa else None)
    if rec is None:
        return {"source": None, "waves": {}, "cm1": {}}
    rename = {vp.canonical_family(f): f for f in families}
    return {"source": rec["source"],
            "waves": {k: {rename[vp.canonical_family(f)]: n for f, n in v.items() if vp.canonical_family(f) in rename}
                      for k, v in rec["waves"].items()},
            "cm1": {rename[vp.canonical_family(f)]: st for f, st in rec.get("cm1", {}).items()
                    if vp.canonical_family(f) in rename}}


@dataclass
class Call:
    """One call as a user makes it. ``kind``: attend (KVCache.attend), forward (KVCache.forward of
    ``n_new`` rows), paged (PagedKVCache.forward, one token per sequence), cascade (the same with a
    prefix of ``shared`` tokens all ``lens`` sequences share, vkattn.cascade; ``lens`` their own
    tokens), read, fork. Paged and cascade calls plan with ``capacity`` as the decode key bound."""
    name: str
    shape: str
    dtype: str
    kind: str
    past: int = 0           # cached positions before the call (paged: per sequence, lens)
    s: int = 1              # query rows
    n_new: int = 0
    capacity: int = L
    window: int | None = None
    n_sink: int = 0
    flags: int = 0          # score variants (F_SOFTCAP, F_ALIBI, F_MASK, F_WINDOW)
    rope: bool = False
    lens: tuple = ()
    shared: int = 0

    @property
    def heads(self) -> tuple:
        return SHAPES[self.shape]


def calls() -> list:
    out = []
    for shape in SHAPES:
        for dt in DTYPES:
            out += [Call(f"attend L={L}", shape, dt, "attend", past=L),
                    Call(f"decode step L={L}", shape, dt, "forward", past=L - 1, n_new=1),
                    Call(f"chunk {CHUNK} on L={L}", shape, dt, "forward", past=L - CHUNK, s=CHUNK, n_new=CHUNK),
                    Call(f"prefill {PREFILL}", shape, dt, "forward", past=0, s=PREFILL, n_new=PREFILL)]
    base = "32/8 d128"
    out += [
        Call(f"decode step window 4096 + 4 sinks L={2 * L}", base, "float16", "forward", past=2 * L - 1,
             n_new=1, capacity=2 * L, window=4096, n_sink=4, flags=F_WINDOW),
        Call(f"decode step softcap L={L}", base, "float16", "forward", past=L - 1, n_new=1, flags=F_SOFTCAP),
        Call(f"prefill {PREFILL} softcap", base, "float16", "forward", s=PREFILL, n_new=PREFILL, flags=F_SOFTCAP),
        Call(f"decode step ALiBi L={L}", base, "float16", "forward", past=L - 1, n_new=1, flags=F_ALIBI),
        Call(f"chunk {CHUNK} mask on L={L}", base, "float16", "forward", past=L - CHUNK, s=CHUNK, n_new=CHUNK,
             flags=F_MASK),
        Call(f"decode step RoPE L={L}", base, "float16", "forward", past=L - 1, n_new=1, rope=True),
        Call(f"prefill {PREFILL} RoPE", base, "float16", "forward", s=PREFILL, n_new=PREFILL, rope=True),
    ]
    for dt in ("float16", "int8"):
        out.append(Call(f"batch decode B=16 L=100..4000 (paged)", base, dt, "paged", lens=tuple(BATCH_LENS),
                        capacity=sum(-(-(n + 1) // BLOCK) for n in BATCH_LENS) * BLOCK))
    own = tuple(CASCADE_OWN)
    bound = decode_key_bound(CASCADE_SHARED + max(own) + 1, 1 << 30)     # as the cache sizes its decode plan
    out += [Call(f"batch decode B=16 L={CASCADE_SHARED}+64..256 (paged)", base, "float16", "paged",
                 lens=tuple(CASCADE_SHARED + n for n in own), capacity=bound),
            Call(f"cascade decode B=16 shared {CASCADE_SHARED} + 64..256 (paged)", base, "float16", "cascade",
                 lens=own, shared=CASCADE_SHARED, capacity=bound)]
    out += [Call(f"read {READ_ROWS} positions", base, "float16", "read", past=L),
            Call("fork (copy a partial block)", base, "float16", "fork", capacity=256 * BLOCK)]
    return out


# ------------------------------------------------------------------------------- planning

@dataclass
class Dispatch:
    role: str
    pipeline: object         # vkattn._attn.Pipeline
    cfg: object = None       # AttnConfig for the attention dispatch
    reads: int = 0           # device bytes its loads read (all workgroups)
    writes: int = 0
    unique: int = 0          # the bytes a perfect cache would fetch from memory
    steps: list = field(default_factory=list)   # attention: key-loop steps of each workgroup


@dataclass
class Planned:
    call: Call
    dispatches: list
    submissions: int
    host_up: int
    host_down: int
    flops: float


def _format(call: Call) -> StorageFormat:
    hq, hkv, d = call.heads
    rope = RoPE("neox") if call.rope else None
    block = BLOCK if call.kind in ("paged", "fork") else call.capacity
    return StorageFormat(hkv, d, dtype=call.dtype, block_size=block, rope=rope)


def plan_call(dev, call: Call) -> Planned:
    """The dispatches, submissions and bytes of ``call`` on ``dev``, as the caches plan them."""
    f = _format(call)
    hq, hkv, d = call.heads
    row = 16 * (f._rk4 + f._rv4) + (8 if f._i8 else 0)      # K+V bytes of one position, one kv head (q4: with its parameter words)
    if call.kind == "read":
        n = min(call.past, READ_ROWS)
        p = gather_pipeline(dev, f)
        disp = Dispatch("gather", p, reads=n * hkv * row, writes=n * hkv * row, unique=2 * n * hkv * row)
        up = 4 * (1 + READ_ROWS)
        return Planned(call, [disp], 1, up, READ_ROWS * hkv * row, 0.0)
    if call.kind == "fork":
        p = copy_pipeline(dev, f)
        blk = BLOCK * hkv * row
        return Planned(call, [Dispatch("copy", p, reads=blk, writes=blk, unique=2 * blk)], 1, 48, 0, 0.0)
    if call.kind == "cascade":
        return _plan_cascade(dev, call, f, row)
    rope_dim = f._rope_dim
    flags = call.flags | (f.rope.flags(True) if f.rope else 0)
    if call.kind == "paged":
        lens = list(call.lens)
        nseq = len(lens)
        total = nseq
        seqs = [(p, 1, 1) for p in lens]            # (past, n_new, q_len)
        split = appends_first(dev, 1, 1, f._ch, f._matrices)
        flags |= F_PAGED
        tables = sum(-(-(p + 1) // BLOCK) for p in lens)
        key_bound = call.capacity
        decode = True
    else:
        nseq, total, tables = 1, call.s, 0
        split = bool(call.n_new) and appends_first(dev, call.n_new, call.s, f._ch, f._matrices)
        seqs = [(call.past + (call.n_new if split else 0), 0 if split else call.n_new, call.s)]
        key_bound = call.capacity
        decode = call.s == 1
    nn = 0 if split else sum(n for _, n, _ in seqs)
    mask_words = call.s * (call.past + call.n_new) if call.flags & F_MASK else 0
    words = aux_bucket(AttnPlan.aux_need(nseq, total, hq, tables, mask_words))
    cfg, pipe = attn_pipeline(dev, f, hq, total, nn, nseq, flags, key_bound, decode, rope_dim)
    dispatches, up = [], 0
    if split:                                    # appended in a submission of its own first
        n = call.n_new if call.kind != "paged" else total
        ap = append_pipeline(dev, f, n)
        dispatches.append(Dispatch("append", ap, reads=n * hkv * 4 * 4 * (f._dk4 + f._dv4) * f._ch,
                                   writes=n * hkv * row, unique=n * hkv * (4 * 4 * (f._dk4 + f._dv4) * f._ch + row)))
        up += (16 * hkv * n * (f._dk4 + f._dv4) * f._ch + 4 * (1 + 2 * hkv * n)
               + (4 * n * max(rope_dim, 4) if rope_dim else 0))
    attn = _attn_traffic(cfg, pipe, f, call, seqs, hq, row)
    dispatches.append(attn)
    # what each submission moves: kp copies whole staging buffers (plan sizes, not call sizes)
    counters = hkv * pipe.groups[1] if cfg.splits > 1 else 0
    up += 16 * hq * total * f._dk4 * f._ch + 4 * (words + counters)
    if nn:
        up += 16 * hkv * nn * (f._dk4 + f._dv4) * f._ch
    if rope_dim:
        up += 4 * max(total, nn, 1) * rope_dim
    down = 4 * hq * total * (f.v_head_dim + 1)
    pairs = sum(_visible_pairs(p + n, q, call.window, call.n_sink) for p, n, q in seqs)
    flops = 2.0 * hq * pairs * (d + f.v_head_dim)
    return Planned(call, dispatches, 2 if split else 1, up, down, flops)


def _plan_cascade(dev, call: Call, f, row: int) -> Planned:
    """A cascade decode step as PagedKVCache plans it (vkattn.cascade): one group of all the
    sequences; the shared dispatch (their rows as one non-causal block against the ``shared``
    keys), the own dispatch (today's, keys from ``shared`` on, fused append), the merge."""
    hq, hkv, d = call.heads
    b, p = len(call.lens), call.shared
    srows = row_bucket(b)
    sbound = decode_key_bound(p, call.capacity)
    scfg, spipe = attn_pipeline(dev, f, hq, srows, 0, 1, F_PAGED, sbound, False,
                                splits=shared_splits(dev, hkv, sbound))
    shared = _attn_traffic(scfg, spipe, f, call, [(p, 0, b)], hq, row, causal=False)
    obound = decode_key_bound(max(call.lens) + 1, call.capacity)
    osplits = own_splits(dev, kernel_for(dev), hkv, b, row_bucket(max(call.lens) + 1))
    ocfg, opipe = attn_pipeline(dev, f, hq, b, b, b, F_PAGED, obound, True, splits=osplits)
    own = _attn_traffic(ocfg, opipe, f, call, [(p + n, 1, 1, p) for n in call.lens], hq, row)
    res = 4 * hq * b * (f.v_head_dim + 1)                 # one result: out and lse of every row
    params = 4 * (MERGE_PARAMS + b)
    merge = Dispatch("merge", merge_pipeline(dev, f, hq * b), reads=2 * res + params, writes=res,
                     unique=3 * res + params)
    tables = b * -(-(p + max(call.lens) + 1) // BLOCK)
    own_words = aux_bucket(AttnPlan.aux_need(b, b, hq, tables, 0))
    shared_words = aux_bucket(AttnPlan.aux_need(1, srows, hq, -(-p // BLOCK), 0))
    counters = sum(hkv * pp.groups[1] for cfg, pp in ((scfg, spipe), (ocfg, opipe)) if cfg.splits > 1)
    q_bytes = 16 * hq * f._dk4 * f._ch
    up = (q_bytes * (b + srows) + 4 * (own_words + shared_words + counters) + params
          + 16 * hkv * b * (f._dk4 + f._dv4) * f._ch)
    pairs = sum(p + n + 1 for n in call.lens)
    return Planned(call, [shared, own, merge], 1, up, 3 * res, 2.0 * hq * pairs * (d + f.v_head_dim))


def _visible_pairs(total: int, q_len: int, window, n_sink: int) -> int:
    """(query row, key) pairs a causal call scores: row r at position total - q_len + r."""
    n = 0
    for r in range(q_len):
        p = total - q_len + r
        seen = p + 1
        if window is not None and p + 1 > window:
            seen = window + min(n_sink, p + 1 - window)
        n += seen
    return n


def _ranges(cfg, past: int, n_new: int, q_len: int, window, n_sink: int, key_lo: int = 0,
            causal: bool = True) -> list:
    """Key ranges [lo, hi) each workgroup of one sequence and kv head consumes (attn.comp's main);
    ``key_lo``: its first key (cascade's own part)."""
    T = past + n_new
    kstart, chunk = split_keys(T, q_len, window, cfg.splits, key_lo)
    out = []
    for qt in range(-(-q_len // cfg.bq)):
        kend = T - q_len + min(q_len, qt * cfg.bq + cfg.bq) if causal else T
        for sp in range(cfg.splits):
            a = min(kend, kstart + sp * chunk)
            b = min(kend, a + chunk)
            if window is None:
                out.append([(a, b)])
                continue
            pmin = T - q_len + qt * cfg.bq
            wlo = pmin + 1 - window if pmin + 1 > window else 0
            parts = [(a, min(b, n_sink)), (max(a, n_sink, wlo), b)]
            if sp == 0:
                parts.insert(0, (0, min(n_sink, kstart, kend)))
            out.append(parts)
    return out


def _attn_traffic(cfg, pipe, f, call: Call, seqs: list, hq: int, row: int, causal: bool = True) -> Dispatch:
    """Bytes of one attention dispatch; ``seqs``: (past, n_new, q_len) or (past, n_new, q_len,
    first key) per sequence."""
    hkv = f.num_kv_heads
    group = hq // hkv
    new_row = 16 * (f._dk4 + f._dv4) * f._ch          # float32 K+V of one new row, one kv head
    q_row = 16 * f._dk4 * f._ch
    pv = 16 * f._dv4 * f._ch
    reads = writes = unique = 0
    steps = []
    step_keys = (cfg.cols * cfg.kb if cfg.kernel == "tile" else
                 getattr(cfg, "bc", 0) or cfg.wg if cfg.kernel == "coopmat" else cfg.wg)
    for past, n_new, q_len, *lo in seqs:
        T = past + n_new
        key_lo = lo[0] if lo else 0
        wgs = _ranges(cfg, past, n_new, q_len, call.window, call.n_sink, key_lo, causal)
        keys = sum(max(0, hi - lo) for parts in wgs for lo, hi in parts)
        seen = T - key_lo if call.window is None else min(T, call.window + q_len - 1 + call.n_sink)
        reads += hkv * (keys * row + len(wgs) * (group * cfg.bq * q_row + n_new * new_row))
        writes += hkv * len(wgs) * n_new * row                   # every workgroup stores the new rows
        unique += hkv * (seen * row + n_new * new_row) + hq * q_len * q_row
        steps += [sum(-(-max(0, hi - lo) // step_keys) for lo, hi in parts) for parts in wgs] * hkv
    nrows = hq * sum(s[2] for s in seqs)
    out_bytes = 4 * nrows * (f.v_head_dim + 1)
    writes += out_bytes
    unique += out_bytes
    if cfg.splits > 1:
        part = cfg.splits * nrows * (pv + 8)
        writes += part
        reads += part
        unique += 2 * part
    return Dispatch("attn", pipe, cfg, reads, writes, unique, steps)


# ------------------------------------------------------------------------------- compiling

def _job_key(p) -> tuple:
    return (p.shader, tuple(sorted(p.defines.items())), p.spec)


def _job_name(p) -> str:
    defs = ",".join(f"{k}={v}" for k, v in sorted(p.defines.items()))
    return f"{p.shader}[{defs}]({','.join(map(str, p.spec))})"


def _is_coopmat(cfg) -> bool:
    return getattr(cfg, "kernel", "") == "coopmat"


def pipeline_job(name: str, p, cfg=None, src_dir=None, pin=None):
    """The vp.Job of a planned pipeline. attn_coopmat.comp's pipelines are pinned to the subgroup
    size its config names (cfg.sg, full subgroups), as the caches create them: compiled at another
    size the kernel runs no matrix (it checks) and the statistics would be a dead shader's. ``pin``:
    the planning device's Device.coopmat_pin() instead (NVK: no required size, its only one)."""
    sg = getattr(cfg, "sg", 0) if _is_coopmat(cfg) else 0
    size, full = (pin if pin is not None else (sg, True)) if sg else (0, False)
    return vp.Job(name, compile_shader(p.shader, p.defines, src_dir=src_dir), list(p.spec), p.bindings,
                  subgroup_size=size or None, full_subgroups=full)


def _features_for(cfgs) -> list:
    """The optional features a set of pipelines needs enabled: the cooperative-matrix ones where one
    of them is attn_coopmat.comp (none otherwise: enabling a feature changes no other shader)."""
    return list(COOPMAT_FEATURES) if any(_is_coopmat(c) for c in cfgs) else []


def compile_family(family: str, planned_calls) -> dict:
    """{job name: stats + key loop} for every distinct pipeline of the calls, on ``family``."""
    jobs, cfgs, seen = [], [], set()
    for pc in planned_calls:
        for disp in pc.dispatches:
            key = _job_key(disp.pipeline)
            if key not in seen:
                seen.add(key)
                jobs.append(pipeline_job(_job_name(disp.pipeline), disp.pipeline, disp.cfg))
                cfgs.append(disp.cfg)
    res = vp.family_stats([family], jobs, features=_features_for(cfgs), ir=True)[family]
    out = {}
    for jr in res.jobs:
        if not jr.ok:
            out[jr.name] = {"error": f"{jr.result}: {jr.error}"}
            continue
        exe = jr.executables[0]
        asm = next((v for k, v in exe.ir.items() if "Assembly" in k or "ISA" in k), "")
        out[jr.name] = {**{k: exe.stats.get(k) for k in STAT_KEYS}, "subgroup_size": exe.subgroup_size,
                        "wave32_units": exe.wave32_units, **key_loop(asm)}
    return out


# ------------------------------------------------------------------------------- numerics audit

# Instructions whose rounding differs from what vkattn promises bit for bit (numpy's float16
# round-to-nearest-even; int8 scales and values from exact quotients), by what they do:
AUDIT_RULES = {
    "round toward zero": re.compile(r"^v_cvt_pk_?rtz\w*"),                    # packHalf2x16 on AMD
    "float->half, mode rounding": re.compile(r"^v_cvt_(pk_)?f16_f32\w*"),    # rounds as the MODE register says
    "reciprocal / division": re.compile(r"^v_(rcp|rcp_iflag|rcp_legacy|rsq|sqrt)_f32\w*|^v_div_(scale|fmas|fixup)\w*"),
}
# numerics_probe.comp: the storage helpers of common.glsl alone (the code the append and attention
# stores and the lavapipe decoder run), every instruction of them audited
NUMERICS_PROBES = [("float16 encode", {"MODE": 0, "KV_F16": 1}),
                   ("float16 decode (integer)", {"MODE": 1, "KV_F16": 1, "HALF_NATIVE": 0}),
                   ("int8 scale + quantise", {"MODE": 2, "KV_F16": 0, "KV_I8": 1}),
                   ("bfloat16 encode", {"MODE": 0, "KV_F16": 0, "KV_I8": 0, "KV_BF16": 1}),
                   ("bfloat16 decode", {"MODE": 1, "KV_F16": 0, "KV_I8": 0, "KV_BF16": 1}),
                   ("fp8_e4m3 encode", {"MODE": 3, "KV_F16": 0, "KV_FP8": 1}),
                   ("fp8_e4m3 decode", {"MODE": 4, "KV_F16": 0, "KV_FP8": 1}),
                   ("fp8_e5m2 encode", {"MODE": 3, "KV_F16": 0, "KV_FP8": 2}),
                   ("fp8_e5m2 decode", {"MODE": 4, "KV_F16": 0, "KV_FP8": 2})]
# the GPU kernels' float16 decode (attn.comp: unpackHalf2x16, or folded into v_fma_mix): exact for
# normal halves and zeros on any driver, half subnormals as the driver's float16 denormal mode says;
# reported, not flagged (the integer decode costs the key loop 70 -> 390 VALU on navi21, RESULTS.md)
NATIVE_DECODE = ("float16 decode (native, GPU kernel)", {"MODE": 1, "KV_F16": 1, "HALF_NATIVE": 1})


def audit_asm(asm: str, rules=AUDIT_RULES) -> dict:
    """{rule: count} of the audited instructions in an ACO disassembly (rules with hits only)."""
    out = {}
    for line in asm.splitlines():
        op = line.strip().split(" ", 1)[0]
        for what, rx in rules.items():
            if rx.match(op):
                out[what] = out.get(what, 0) + 1
    return out


def numerics_audit(family: str, pipelines=None, src_dir=None, cfgs=None) -> dict:
    """The numerics audit on ``family``: numerics_probe.comp's exact helpers (every rule), the
    planned append pipelines (every rule: they only store) and every other planned pipeline (the
    float->half rules: nothing else in them converts to half). ``pipelines``: {name: Pipeline} as
    planned for the report (default none); ``src_dir``: another shader tree (e.g. an older
    checkout's, to measure it); ``cfgs``: {name: AttnConfig} of attention pipelines (the
    cooperative-matrix kernel's subgroup pin). Returns {"probes": {what: {rule: n}}, "pipelines": {name: {rule: n}},
    "native_decode": {instruction: n}, "flagged": total, "error": ...}."""
    jobs = [vp.Job(what, compile_shader("numerics_probe", d, src_dir=src_dir), [64, 2], 4)
            for what, d in NUMERICS_PROBES + [NATIVE_DECODE]]
    pipelines = pipelines or {}
    for name, p in pipelines.items():
        jobs.append(pipeline_job(name, p, (cfgs or {}).get(name), src_dir))
    res = vp.family_stats([family], jobs, features=_features_for((cfgs or {}).values()), ir=True)[family]
    out = {"probes": {}, "pipelines": {}, "native_decode": {}, "flagged": 0}
    if not res.available:
        return {**out, "error": res.reason}
    store_rules = {k: v for k, v in AUDIT_RULES.items() if k != "reciprocal / division"}
    for jr in res.jobs:
        if not jr.ok:
            out.setdefault("failed", []).append(f"{jr.name}: {jr.result} {jr.error}")
            continue
        asm = next((v for k, v in jr.executables[0].ir.items() if "Assembly" in k or "ISA" in k), "")
        if jr.name == NATIVE_DECODE[0]:
            out["native_decode"] = audit_asm(asm, {"v_cvt_f32_f16": re.compile(r"^v_cvt_f32_f16\w*"),
                                                   "v_fma_mix / v_mad_mix": re.compile(r"^v_(fma|mad)_mix\w*")})
            continue
        if jr.name in pipelines:
            rules = AUDIT_RULES if pipelines[jr.name].shader == "append" else store_rules
            found = audit_asm(asm, rules)
            out["pipelines"][jr.name] = found
        else:
            found = audit_asm(asm)
            out["probes"][jr.name] = found
        out["flagged"] += sum(found.values())
    return out


# numerics audit of the main branch before the exact helpers (commit 7a35600, measured with
# numerics_audit(..., src_dir=<that commit's shaders/ plus numerics_probe.comp>) on Mesa 22.3.6):
# flagged instructions per family in the probes + planned pipelines of this report
AUDIT_BEFORE = {"polaris10": 192, "vega10": 192, "navi10": 192, "navi21": 192, "gfx1100": 192}
AUDIT_BEFORE_MESA = (22, 3)


# ------------------------------------------------------------------------------- the model

ARCH = {"polaris10": "gcn", "vega10": "gcn", "navi10": "rdna", "navi21": "rdna", "gfx1100": "rdna",
        "gfx1201": "rdna"}


def same_chip(a, b) -> bool:
    """Family names of one chip (navi31 and gfx1100 are RDNA3's two spellings)."""
    return a is not None and b is not None and vp.canonical_family(a) == vp.canonical_family(b)


def times(pc: Planned, gpu: GPU, stats: dict | None) -> dict:
    """Bounds in microseconds: memory (unique bytes / bandwidth), arithmetic (flops / fp32 rate)
    and, with the family's compiled code, instruction issue: every wave's VALU instructions (the
    key loop's typical pass times its passes, the rest once) at one wave64 VALU instruction per CU
    and cycle -- GCN runs one on each of 4 SIMD16 in 4 cycles, RDNA on each of 2 SIMD32 in 2
    passes (RDNA3's dual issue is not counted: an upper bound there) -- and no faster than the
    longest workgroup's own instruction stream on one SIMD (4 or 2 cycles per instruction). A
    pipeline with matrix instructions (attn_coopmat.comp) adds their time at the GPU's float16
    matrix rate (they issue through the VALU: the two add)."""
    unique = sum(d.unique for d in pc.dispatches)
    t = {"mem_us": unique / (gpu.bandwidth_gbs * 1e3), "flop_us": pc.flops / (gpu.fp32_tflops * 1e6)}
    if stats is not None:
        wave_instr, critical, matrix_us = 0, 0.0, 0.0
        cycles = 4 if ARCH[vp.canonical_family(gpu.family)] == "gcn" else 2
        for d in pc.dispatches:
            st = stats.get(_job_name(d.pipeline), {})
            if "valu" not in st:
                return _decide(t)
            waves = -(-_wg_size(d) // 64)
            if d.role == "attn":
                loop, rest = st["valu"], st["valu_total"] - st["valu"] - st["valu_cond"]
                wave_instr += waves * (loop * sum(d.steps) + rest * len(d.steps))
                critical = max(critical, (loop * max(d.steps) + rest) * cycles)
                if st.get("wmma") and gpu.f16_matrix_tflops:
                    subgroups = max(1, _wg_size(d) // (st.get("subgroup_size") or 64))
                    matrix_us += (subgroups * st["wmma"] * sum(d.steps) * 2 * MMA ** 3
                                  / (gpu.f16_matrix_tflops * 1e6))
            else:
                wave_instr += waves * st["valu_total"] * d.pipeline.groups[0]
        t["issue_us"] = max(wave_instr / gpu.cus, critical) / (gpu.clock_ghz * 1e3) + matrix_us
    return _decide(t)


def _decide(t: dict) -> dict:
    t["model_us"] = max(t.values())
    t["bound"] = max(t, key=lambda k: t[k] if k != "model_us" else -1)[:-3]
    return t


def _wg_size(d: Dispatch) -> int:
    return d.pipeline.spec[0]


# ------------------------------------------------------------------------------- report

def build(families=None, mechanism=None) -> dict:
    mechanism = mechanism or vp.null_mechanism()
    families = list(families or vp.default_families(mechanism))
    all_calls = calls()
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "families": {}, "calls": [], "pipelines": {},
              "gpus": [asdict(g) for g in REFERENCE_GPUS],
              "compiler": {"mesa": list(mechanism.mesa) if mechanism.mesa else None, "mechanism": mechanism.kind,
                           "description": mechanism.describe()}}
    plans = {}
    for fam in families:
        info = vp.family_device_info(fam, mechanism=mechanism)
        if info is None:
            report["families"][fam] = {"available": False}
            continue
        dev = PlanningDevice(info)
        planned = [plan_call(dev, c) for c in all_calls]
        plans[fam] = planned
        stats = compile_family(fam, planned)
        report["families"][fam] = {"available": True, "device": info.name, "driver_version": info.driver_version}
        pipes = {_job_name(d.pipeline): d.pipeline for pc in planned for d in pc.dispatches}
        cfgs = {_job_name(d.pipeline): d.cfg for pc in planned for d in pc.dispatches if d.cfg is not None}
        report.setdefault("numerics_audit", {})[fam] = numerics_audit(fam, pipes, cfgs=cfgs)
        for name, st in stats.items():
            report["pipelines"].setdefault(name, {})[fam] = st
    ref_fam = next(iter(plans), None)
    for i, c in enumerate(all_calls):
        entry = {"call": c.name, "shape": c.shape, "dtype": c.dtype, "per_family": {}}
        for fam, planned in plans.items():
            pc = planned[i]
            fstats = {n: per[fam] for n, per in report["pipelines"].items() if fam in per}
            entry["per_family"][fam] = {
                "pipelines": [_job_name(d.pipeline) for d in pc.dispatches],
                "cfg": [asdict(d.cfg) if d.cfg else None for d in pc.dispatches],
                "submissions": pc.submissions, "dispatches": len(pc.dispatches),
                "host_up": pc.host_up, "host_down": pc.host_down,
                "device_reads": [d.reads for d in pc.dispatches], "device_writes": [d.writes for d in pc.dispatches],
                "unique_bytes": sum(d.unique for d in pc.dispatches), "flops": pc.flops,
                "times": {g.name: times(pc, g, fstats if same_chip(g.family, fam) else None)
                          for g in REFERENCE_GPUS if same_chip(g.family, fam) or (g.family is None and fam == ref_fam)},
            }
        report["calls"].append(entry)
    avail = [f for f in plans]
    report["llama_cpp"] = llama_cpp_anchor(mechanism.mesa, avail, mechanism)
    report["coopmat"] = coopmat_study(avail, report, mechanism)
    return report


def _fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


def occupancy_table(report: dict) -> list:
    """Rows (what, family, vkattn waves, llama.cpp waves, VGPRs, LDS) for the anchor shapes."""
    picks = {("decode", 128): ("32/8 d128", f"decode step L={L}"), ("decode", 256): ("16/2 d256", f"decode step L={L}"),
             ("prefill", 128): ("32/8 d128", f"prefill {PREFILL}")}
    anchor = (report.get("llama_cpp") or {}).get("waves", {})
    rows = []
    for key, (shape, call) in picks.items():
        entry = next(c for c in report["calls"] if c["shape"] == shape and c["call"] == call and c["dtype"] == "float16")
        for fam, want in anchor.get(f"{key[0]} {key[1]}", {}).items():
            pf = entry["per_family"].get(fam)
            if pf is None:
                continue
            name = pf["pipelines"][-1]
            st = report["pipelines"][name][fam]
            shader = name.split("[", 1)[0]
            rows.append((f"{key[0]} float16 head_dim {key[1]}" + ("" if shader == "attn" else f" ({shader})"), fam,
                         st.get("Subgroups per SIMD"), want, st.get("VGPRs"), st.get("LDS size")))
    return rows


def markdown(report: dict) -> str:
    fams = [f for f, v in report["families"].items() if v.get("available")]
    comp = report.get("compiler") or {}
    mesa = tuple(comp.get("mesa") or ())
    out = []
    if mesa[:2] != (22, 3):       # the Mesa 22.3 report keeps its form; others say whose compiler
        out += [f"Compiler: {comp.get('description')}.", ""]
    source = (report.get("llama_cpp") or {}).get("source") or "none recorded for this Mesa"
    out += ["### Occupancy against llama.cpp's scalar flash attention (same compiler)", "",
            f"| kernel | family | vkattn waves/SIMD | llama.cpp ({source}) | vkattn VGPRs | vkattn LDS |",
            "|---|---|---:|---:|---:|---:|"]
    for what, fam, got, want, vg, lds in occupancy_table(report):
        flag = "" if got is not None and got >= want else " **below**"
        out.append(f"| {what} | {fam} | {got}{flag} | {want} | {vg} | {lds} |")
    out += ["", "### Pipelines (RADV/ACO, " + ", ".join(report["families"][f]["device"] for f in fams) + ")", "",
           "VGPRs / LDS bytes / waves per SIMD as RADV reports them (gfx10+ counts wave32 slots) / "
           "VALU instructions per key-loop pass; spills and scratch are listed only where not 0.", ""]
    head = "| pipeline | calls | " + " | ".join(fams) + " |"
    out += [head, "|" + "---|" * (len(fams) + 2)]
    users = {}
    for c in report["calls"]:
        for fam, pf in c["per_family"].items():
            for p in pf["pipelines"]:
                users.setdefault(p, set()).add(f"{c['shape']} {c['dtype']} {c['call']}")
    problems = []
    for name, per in report["pipelines"].items():
        cells = []
        for fam in fams:
            st = per.get(fam)
            if st is None:
                cells.append("-")
            elif "error" in st:
                cells.append("FAILED")
                problems.append(f"{name} on {fam}: {st['error']}")
            else:
                cell = f"{st['VGPRs']} / {st['LDS size']} / {st['Subgroups per SIMD']} / {st.get('valu', '-')}"
                if st["Spilled VGPRs"] or st["Spilled SGPRs"] or st["Scratch size"]:
                    cell += f" SPILL {st['Spilled VGPRs']}v {st['Spilled SGPRs']}s {st['Scratch size']} B"
                    problems.append(f"{name} on {fam} spills")
                cells.append(cell)
        u = sorted(users.get(name, []))
        label = "; ".join(u[:2]) + (f"; +{len(u) - 2}" if len(u) > 2 else "")
        out.append(f"| `{_short(name)}` | {label} | " + " | ".join(cells) + " |")
    out += ["", f"{len(report['pipelines'])} distinct pipelines; "
            + ("problems: " + "; ".join(problems) if problems else "0 spilled registers and 0 scratch on every family.")]
    out += [""] + audit_markdown(report)
    out += coopmat_markdown(report)
    gpus = [g for g in REFERENCE_GPUS if g.family is None or any(same_chip(g.family, f) for f in fams)]
    out += ["", "### Calls: traffic and model time (microseconds, the larger bound decides)", "",
            "| call | shape | dtype | subm. | disp. | host up / down | device read / unique | "
            + " | ".join(g.name for g in gpus) + " |",
            "|" + "---|" * (7 + len(gpus))]
    for c in report["calls"]:
        pfs = c["per_family"]
        if not pfs:
            continue
        first = next(iter(pfs.values()))
        cells = []
        for g in gpus:
            t = None
            for pf in pfs.values():
                t = pf["times"].get(g.name) or t
            cells.append("-" if t is None else f"{t['model_us']:.1f} ({t['bound']})")
        out.append(f"| {c['call']} | {c['shape']} | {c['dtype']} | {first['submissions']} | {first['dispatches']} | "
                   f"{_fmt_bytes(first['host_up'])} / {_fmt_bytes(first['host_down'])} | "
                   f"{_fmt_bytes(sum(first['device_reads']))} / {_fmt_bytes(first['unique_bytes'])} | "
                   + " | ".join(cells) + " |")
    return "\n".join(out)


def audit_markdown(report: dict) -> list:
    """The numerics audit section of the report (empty without audit results)."""
    audit = report.get("numerics_audit") or {}
    fams = [f for f in audit if "error" not in audit[f]]
    if not fams:
        return []
    out = ["### Numerics audit: instructions whose rounding differs from the reference's, in paths that must be exact",
           "",
           "Flagged: " + "; ".join(f"{k} (`{v.pattern.split('|')[0].lstrip('^')}`...)" for k, v in AUDIT_RULES.items())
           + ". Audited: numerics_probe.comp's float16 encoder, integer float16 decoder, int8 quantiser and "
           "bfloat16 encoder and decoder "
           "(every rule), the planned append pipelines (every rule) and every other planned pipeline "
           "(the float->half rules).", "",
           "| code | " + " | ".join(fams) + " |", "|" + "---|" * (len(fams) + 1)]
    def cell(found):
        return "0" if not found else "**" + ", ".join(f"{n} {k}" for k, n in found.items()) + "**"
    for what, _ in NUMERICS_PROBES:
        out.append(f"| {what} | " + " | ".join(cell(audit[f]["probes"].get(what, {})) for f in fams) + " |")
    names = sorted({n for f in fams for n in audit[f]["pipelines"]})
    for kind in ("append", "attn"):
        group = [n for n in names if n.startswith(kind)]
        out.append(f"| {len(group)} planned {kind} pipelines | " + " | ".join(
            cell({k: sum(audit[f]["pipelines"].get(n, {}).get(k, 0) for n in group)
                  for k in AUDIT_RULES if any(audit[f]["pipelines"].get(n, {}).get(k) for n in group)})
            for f in fams) + " |")
    out.append("| **flagged in all** | " + " | ".join(f"**{audit[f]['flagged']}**" for f in fams) + " |")
    mesa = tuple((report.get("compiler") or {}).get("mesa") or (22, 3))
    before = [AUDIT_BEFORE.get(f) if mesa[:2] == AUDIT_BEFORE_MESA else None for f in fams]
    if any(b is not None for b in before):
        out.append("| before (main at 7a35600) | " + " | ".join("-" if b is None else str(b) for b in before) + " |")
    out += ["", "The GPU kernel's float16 decode (reported, not flagged): "
            + "; ".join(f"{f} " + (", ".join(f"{n} {k}" for k, n in audit[f]["native_decode"].items()) or "none")
                        for f in fams)
            + ". Exact for normal halves and zeros on any conforming driver; half subnormals follow the "
            "driver's float16 denormal mode (preserved by RADV)."]
    return out


# ------------------------------------------------------------------------------- cooperative matrices

COOPMAT_FEATURES = ["cooperativeMatrix", "shaderFloat16", "storageBuffer16BitAccess", "vulkanMemoryModel",
                    "subgroupSizeControl", "computeFullSubgroups"]
STUDY_KERNEL = Path(__file__).parent / "coopmat_tile.comp"
MMA = 16                     # 16x16x16 multiply-adds: 2 * 16^3 flops each
COOPMAT_SHAPE = "32/8 d128"  # the call modelled: prefill 512 from empty, float16
# the scalar prefill's model time on an RX 7900 XTX in the Mesa 22.3 report of session 8
# (perf/RESULTS.md; 157.1 in today's perf/gpu_report.md): issue 22's baseline, its target a third
SCALAR_PREFILL_7900XTX_MESA22_US = 155.5


@dataclass
class CoopKernel:
    """A cooperative-matrix prefill pipeline and what its key loop covers.

    ``tile_rows`` query rows of each head per workgroup, ``heads_per_group`` query heads one
    workgroup serves (GQA folded into the matrix rows), ``step_keys`` keys per loop pass of a
    workgroup, ``waves`` subgroups per workgroup, ``blocks_per_pass``: 16x16 (rows x keys) blocks
    of S one subgroup computes per pass of the loop (None: derived from the loop's WMMA count, 2 x
    head_dim / 16 per block)."""
    label: str
    job: object
    tile_rows: int = 16
    step_keys: int = 16
    waves: int = 1
    blocks_per_pass: float | None = 1
    heads_per_group: int = 1
    note: str = ""


COOPMAT_DTYPES = ("float16", "int8", "fp8_e4m3")    # the formats attn_coopmat.comp takes (matrices=True)


def _prefill_call(dtype: str = "float16") -> Call:
    return Call(f"prefill {PREFILL}", COOPMAT_SHAPE, dtype, "forward", s=PREFILL, n_new=PREFILL)


def _scalar_prefill_model(fam: str, info, gpus) -> dict:
    """{gpu: model us} of the prefill on attn.comp (VKATTN_KERNEL=tile), for the comparison where
    the report's own plan of the call took another kernel."""
    with tuning.kernel_forced("tile"):
        pc = plan_call(PlanningDevice(info), _prefill_call())
    stats = compile_family(fam, [pc])
    return {g.name: times(pc, g, stats)["model_us"] for g in gpus}


def _coopmat_kernels(fam: str, info) -> list:
    """vkattn's cooperative-matrix prefill pipelines for the modelled call where the package has
    them (shaders/attn_coopmat.comp, planned by the caches' own planner with VKATTN_KERNEL=coopmat),
    one per storage format it takes (COOPMAT_DTYPES: the model counts each with float16's bytes),
    else the study kernel perf/coopmat_tile.comp (one subgroup: 16 rows x 16 keys per pass)."""
    out, note = [], ""
    for dtype in COOPMAT_DTYPES if (shader_dir() / "attn_coopmat.comp").is_file() else ():
        try:
            with tuning.kernel_forced("coopmat"):
                pc = plan_call(PlanningDevice(info), _prefill_call(dtype))
            d = next(x for x in pc.dispatches if x.role == "attn")
            if "coopmat" in d.pipeline.shader:
                p, cfg = d.pipeline, d.cfg
                hq, hkv, _ = SHAPES[COOPMAT_SHAPE]
                sg = getattr(cfg, "sg", 0) or info.subgroup_size
                waves = max(1, _wg_size(d) // max(1, sg))
                br, bc = getattr(cfg, "br", 0), getattr(cfg, "bc", 0)
                m, n = (tuple(getattr(cfg, "mnk", ())) + (MMA, MMA))[:2]
                per_pass = (br // m) * (bc // n) * (m * n / 256) / waves if br and bc else None
                job = pipeline_job(_job_name(p), p, cfg)
                out.append(CoopKernel(f"vkattn {_job_name(p)}" + (f" ({dtype})" if dtype != "float16" else ""),
                                      job, tile_rows=getattr(cfg, "bq", 16),
                                      step_keys=bc or MMA, waves=waves, blocks_per_pass=per_pass,
                                      heads_per_group=hq // hkv))
            else:
                note = f"VKATTN_KERNEL=coopmat planned {d.pipeline.shader}, not a cooperative-matrix kernel"
        except Exception as exc:      # reported in the table, the study kernel stands in
            note = f"vkattn's cooperative-matrix kernel could not be planned: {type(exc).__name__}: {exc}"
    if not out:
        out.append(CoopKernel("study kernel perf/coopmat_tile.comp",
                              vp.Job("coopmat_tile", compile_shader("coopmat_tile", {}, src_dir=STUDY_KERNEL.parent)),
                              note=note))
    return out


def causal_blocks(q_len: int, tile_rows: int, step_keys: int, group: int = 1) -> int:
    """16x16 blocks of S a causal prefill of ``q_len`` rows from an empty cache computes for one
    workgroup column: query tiles of ``tile_rows`` rows of each of ``group`` heads (folded into
    group x tile_rows matrix rows) walking keys ``step_keys`` at a time up to the tile's last row
    (the diagonal tile computed whole)."""
    total = 0
    for t in range(-(-q_len // tile_rows)):
        kend = min(q_len, (t + 1) * tile_rows)
        total += -(-group * tile_rows // 16) * (-(-kend // step_keys) * step_keys // 16)
    return total


def coopmat_model(st: dict, k: CoopKernel, gpu: GPU, unique_bytes: int, d: int = 128) -> dict | None:
    """Model time (us) of the 512-token prefill on ``gpu`` from a cooperative-matrix kernel's compiled
    key loop: matrix time (its WMMA at the datasheet float16 matrix rate, float32 accumulation
    assumed at that rate) + VALU time (the loop's VALU per block and the rest once per wave, one
    wave64 instruction per CU and cycle; WMMA and VALU share the issue, so the two add) against
    memory (the call's unique bytes / bandwidth)."""
    if gpu.f16_matrix_tflops is None or not st.get("wmma"):
        return None
    hq, hkv, _ = SHAPES[COOPMAT_SHAPE]
    per_pass = k.blocks_per_pass or st["wmma"] / (2 * d / MMA)
    columns = hq // k.heads_per_group              # workgroup columns: heads, or KV heads with GQA folded
    blocks = causal_blocks(PREFILL, k.tile_rows, k.step_keys, k.heads_per_group) * columns
    waves = -(-PREFILL // k.tile_rows) * columns * k.waves
    wmma_block = st["wmma"] / per_pass
    valu_block = st["loop_valu"] / per_pass
    rest = max(0, st["valu_total"] - st["loop_valu"])
    scale = st["subgroup_size"] / 64
    t = {"matrix_us": blocks * wmma_block * 2 * MMA ** 3 / (gpu.f16_matrix_tflops * 1e6),
         "valu_us": (blocks * valu_block + waves * rest) * scale / (gpu.cus * gpu.clock_ghz * 1e3),
         "mem_us": unique_bytes / (gpu.bandwidth_gbs * 1e3)}
    t["issue_us"] = t["matrix_us"] + t["valu_us"]
    t["model_us"] = max(t["issue_us"], t["mem_us"])
    t["bound"] = "issue" if t["issue_us"] >= t["mem_us"] else "mem"
    t.update(blocks=blocks, wmma_per_block=wmma_block, valu_per_block=valu_block,
             branch_valu_per_block=st.get("valu_cond", 0) / per_pass)
    return t


def _stats_of(jr) -> dict:
    exe = jr.executables[0]
    asm = next((v for key, v in exe.ir.items() if "Assembly" in key or "ISA" in key), "")
    loop = key_loop(asm)
    return {**{key: exe.stats.get(key) for key in STAT_KEYS}, "subgroup_size": exe.subgroup_size, **loop,
            "loop_valu": loop["valu"] + loop["valu_cond"]}


def coopmat_study(families, report: dict, mechanism=None) -> dict:
    """{family: {"kernels": [{label, stats, model: {gpu: times}}], "llama_cpp_cm1": {...}}} for the
    families whose device offers VK_KHR_cooperative_matrix (none on Mesa 22.3)."""
    out = {}
    entry = next((c for c in report["calls"] if c["shape"] == COOPMAT_SHAPE and c["dtype"] == "float16"
                  and c["call"] == f"prefill {PREFILL}"), None)
    for fam in families:
        head = vp.family_stats([fam], [], features=COOPMAT_FEATURES, mechanism=mechanism)[fam]
        if not head.available or not head.device.features.get("cooperativeMatrix"):
            continue
        info = vp.family_device_info(fam, mechanism=mechanism)
        kernels = _coopmat_kernels(fam, info)
        res = vp.family_stats([fam], [k.job for k in kernels], features=COOPMAT_FEATURES, ir=True,
                              mechanism=mechanism)[fam]
        gpus = [g for g in REFERENCE_GPUS if same_chip(g.family, fam)]
        pf = entry["per_family"].get(fam) if entry else None
        unique = pf["unique_bytes"] if pf else 0
        if pf and not (pf.get("pipelines") or ["attn["])[-1].startswith("attn["):
            scalar = _scalar_prefill_model(fam, info, gpus)    # the report planned another kernel
        else:
            scalar = {g.name: pf["times"][g.name]["model_us"] for g in gpus if pf and g.name in pf["times"]}
        rows = []
        for k, jr in zip(kernels, res.jobs):
            row = {"label": k.label, "note": k.note}
            if not jr.ok:
                row["error"] = f"{jr.result}: {jr.error}"
            else:
                st = row["stats"] = _stats_of(jr)
                row["model"] = {g.name: coopmat_model(st, k, g, unique) for g in gpus}
                row["scalar_model_us"] = scalar
            rows.append(row)
        cm1 = (report.get("llama_cpp") or {}).get("cm1", {}).get(fam)
        llama = None
        if cm1 and cm1.get("wmma"):
            # llama.cpp's cm1: 16 rows x 64 keys per workgroup pass, 4 subgroups of one block each;
            # no GQA folding in prefill
            k = CoopKernel("llama.cpp flash_attn_cm1.comp", None, tile_rows=16, step_keys=64, waves=4)
            llama = {"stats": cm1, "model": {g.name: coopmat_model(cm1, k, g, unique) for g in gpus}}
        out[fam] = {"kernels": rows, "llama_cpp_cm1": llama}
    return out


def coopmat_markdown(report: dict) -> list:
    """The cooperative-matrix section (empty where no device offers the extension)."""
    study = report.get("coopmat") or {}
    if not study:
        return []
    out = ["", "### Cooperative matrices (VK_KHR_cooperative_matrix, 16x16x16 float16 -> float32): prefill",
           "",
           f"Per 16x16 block of S (16 query rows x 16 keys; S = QK^T and O += PV at head_dim 128 take 16 "
           f"WMMA): the key loop's WMMA and VALU instructions, every instruction of the loop body counted "
           f"once (static; in brackets the VALU inside its forward branches -- a rescale taken rarely, or a "
           f"guard every pass takes), divided by the 16x16 blocks one subgroup computes per pass. Where not "
           f"every pass or subgroup runs every branch this is an upper bound, and so is the model: prefill "
           f"{PREFILL} from empty, {COOPMAT_SHAPE}, float16 -- WMMA at the "
           f"datasheet float16 matrix rate + VALU at one wave64 instruction per CU and cycle, against "
           f"memory; beside it the scalar kernel's model on this compiler. Issue 22's baseline: the "
           f"scalar prefill at {SCALAR_PREFILL_7900XTX_MESA22_US} us on an RX 7900 XTX (Mesa 22.3, "
           f"session 8); its target a third of it, {SCALAR_PREFILL_7900XTX_MESA22_US / 3:.1f} us.", "",
           "| kernel | family | subgroup | VGPRs | spilled | LDS | waves/SIMD | WMMA / block | VALU / block "
           "| model us (bound) | scalar model us |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]

    def line(label, fam, st, model, scalar=None):
        models = "; ".join(f"{g}: {t['model_us']:.1f} ({t['bound']})" for g, t in model.items() if t) or "-"
        m = next((t for t in model.values() if t), None)
        per = (f"{m['wmma_per_block']:g} | {m['valu_per_block']:.0f} ({m['branch_valu_per_block']:.0f})" if m
               else f"{st.get('wmma')} | -")
        sc = "; ".join(f"{v:.1f}" for v in (scalar or {}).values()) or "-"
        return (f"| {label} | {fam} | {st['subgroup_size']} | {st['VGPRs']} | {st['Spilled VGPRs']} | "
                f"{st['LDS size']} | {st['Subgroups per SIMD']} | {per} | {models} | {sc} |")

    for fam, per in study.items():
        for row in per["kernels"]:
            if "error" in row:
                out.append(f"| {row['label']} | {fam} | failed: {row['error'][:100]} | | | | | | | | |")
                continue
            out.append(line(row["label"], fam, row["stats"], row["model"], row.get("scalar_model_us")))
            if row.get("note"):
                out.append(f"| ({row['note']}) | {fam} | | | | | | | | | |")
        if per.get("llama_cpp_cm1"):
            ll = per["llama_cpp_cm1"]
            out.append(line("llama.cpp flash_attn_cm1.comp", fam, ll["stats"], ll["model"]))
    return out


def _short(name: str) -> str:
    return name.replace("KV_F16=", "f16=").replace("KV_I8=", "i8=").replace("TILE_SHUFFLE=", "sh=")


def report_stem(mesa) -> str:
    """gpu_report for Mesa 22.3 (Debian 12's, the committed perf/gpu_report.*), else
    gpu_report_mesa<major> (perf/gpu_report_mesa26.* from trixie-backports)."""
    if not mesa or tuple(mesa[:2]) == (22, 3):
        return "gpu_report"
    return f"gpu_report_mesa{mesa[0]}"


def write(report: dict, out_dir: Path) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = report_stem((report.get("compiler") or {}).get("mesa"))
    (out_dir / f"{stem}.json").write_text(json.dumps(report, separators=(",", ":"), default=str))
    with open(out_dir / f"{stem}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["pipeline", "family"] + list(STAT_KEYS) + ["subgroup_size", "key_loop_valu", "key_loop_loads"])
        for name, per in report["pipelines"].items():
            for fam, st in per.items():
                w.writerow([name, fam] + [st.get(k) for k in STAT_KEYS] +
                           [st.get("subgroup_size"), st.get("valu"), st.get("loads")])
    (out_dir / f"{stem}.md").write_text(markdown(report) + "\n")
    return stem


def main(argv=None) -> int:
    fams = os.environ.get("VKATTN_GPU_FAMILIES", "").strip()
    families = [f.strip() for f in fams.split(",") if f.strip()] or None
    mechanism = vp.null_mechanism()
    if not mechanism.available:
        print(f"perf gpu: {mechanism.reason}", file=sys.stderr)
        return 2
    t0 = time.time()
    report = build(families, mechanism)
    out = Path(os.environ.get("VKATTN_PERF_OUT") or Path(__file__).parent / "out")
    stem = write(report, out)
    print(markdown(report))
    print(f"\n{len(report['pipelines'])} pipelines on {sum(v.get('available', False) for v in report['families'].values())}"
          f" families ({mechanism.describe()}) in {time.time() - t0:.0f} s; written to {out}/{stem}.{{json,csv,md}}")
    bad = [1 for per in report["pipelines"].values() for st in per.values() if "error" in st]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
