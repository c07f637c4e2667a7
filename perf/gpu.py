"""``python -m perf gpu``: vkattn's pipelines as GPU compilers build them, without a GPU.

For a list of call shapes (the perf shapes 32/8 heads d128, 8/8 d64 and 16/2 d256; float16,
float32 and int8; attend, decode step, a 16-row chunk and a 512-token prefill at L=4096; the score
variants; a paged batch; read and fork) this plans every pipeline vkattn would build -- the same
planner the caches use (vkattn._attn.attn_pipeline, append/gather/copy pipelines), run against the
device limits of RADV's null hardware for each AMD family the installed Mesa knows -- compiles
each with ACO there (vkattn._vkpipeline) and reports per pipeline and family: VGPRs, SGPRs,
spills, scratch, LDS, waves per SIMD and instructions, plus the VALU instructions of the key loop
read from the disassembly.

Per call it adds a traffic model -- device bytes each dispatch reads and writes, bytes crossing
host <-> device, submissions and dispatches -- and three time bounds on reference GPUs from their
datasheets: memory (unique bytes / bandwidth), arithmetic (flops / fp32 rate) and, where a family's
compiler is here, instruction issue (the VALU instructions the compiled code executes / the
chip's issue rate). The largest is the model time.

Environment: VKATTN_GPU_FAMILIES (comma list; default all five), VKATTN_PERF_OUT (perf/out).
Writes gpu_report.json, gpu_report.csv and gpu_report.md there.
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

from vkattn import _vkpipeline as vp
from vkattn._attn import (F_ALIBI, F_MASK, F_PAGED, F_SOFTCAP, F_WINDOW, HEADER, SEQ_WORDS, AttnPlan,
                          RoPE, StorageFormat, aux_bucket, attn_pipeline, split_keys)
from vkattn._base import CacheBase, READ_ROWS, append_pipeline, gather_pipeline
from vkattn.compiler import compile_shader
from vkattn.device import PlanningDevice
from vkattn.cascade import MERGE_PARAMS, merge_pipeline, shared_splits
from vkattn.paged import copy_pipeline
from vkattn.tuning import decode_key_bound, row_bucket

L = 4096                # context of the decode cases
PREFILL = 512
CHUNK = 16
SHAPES = {"32/8 d128": (32, 8, 128), "8/8 d64": (8, 8, 64), "16/2 d256": (16, 2, 256)}
DTYPES = ("float16", "float32", "int8")
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


REFERENCE_GPUS = [
    GPU("Radeon RX 580", "polaris10", 36, 1.340, 256.0, 6.17),
    GPU("Radeon RX Vega 64", "vega10", 64, 1.546, 483.8, 12.66),
    GPU("Radeon RX 5700 XT", "navi10", 40, 1.905, 448.0, 9.75),
    GPU("Radeon RX 6800 XT", "navi21", 72, 2.250, 512.0, 20.74),
    GPU("Radeon RX 7900 XTX", "gfx1100", 96, 2.500, 960.0, 61.4),
    GPU("Arc A770", None, 32, 2.100, 560.0, 17.2),
    GPU("GeForce RTX 4090", None, 128, 2.520, 1008.0, 82.6),
]


# llama.cpp's scalar Vulkan flash attention (flash_attn.comp, float16 K/V, the spec constants its
# host code picks for an AMD discrete GPU) on the same Mesa 22.3 ACO: waves per SIMD as RADV reports
# them, measured and given in issue 16 (not re-measured here)
LLAMA_CPP = {("decode", 128): {"vega10": 4, "navi21": 18, "gfx1100": 24},
             ("decode", 256): {"vega10": 2, "navi21": 14, "gfx1100": 18},
             ("prefill", 128): {"vega10": 1, "navi21": 6, "gfx1100": 8}}


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
    row = 16 * (f._dk4 + f._dv4) + (8 if f._i8 else 0)      # K+V bytes of one position, one kv head
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
        split = CacheBase._appends_first(1)
        flags |= F_PAGED
        tables = sum(-(-(p + 1) // BLOCK) for p in lens)
        key_bound = call.capacity
        decode = True
    else:
        nseq, total, tables = 1, call.s, 0
        split = call.n_new and CacheBase._appends_first(call.n_new)
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
    ocfg, opipe = attn_pipeline(dev, f, hq, b, b, b, F_PAGED, obound, True)
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
    step_keys = cfg.cols * cfg.kb if cfg.kernel == "tile" else cfg.wg
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


_BRANCH = re.compile(r"^\s*s_c?branch\w*\s+(BB\d+)")
_LABEL = re.compile(r"^(BB\d+):")


def key_loop(asm: str) -> dict:
    """The key loop of an ACO disassembly: the backward-branch range with the most VALU
    instructions that loads from memory and stores nothing (the attention kernels' loop storing a
    call's new rows, before the key loop, is not it). {"valu": VALU instructions of a pass that skips the
    loop's conditional blocks (forward branches inside it: the rescale when no row's max grew),
    "valu_cond": those in the conditional blocks, "loads": buffer loads per pass, "valu_total":
    every VALU instruction of the shader}."""
    lines = [ln.strip() for ln in asm.splitlines()]
    labels = {}
    for i, line in enumerate(lines):
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = i
    best = {"valu": 0, "valu_cond": 0, "loads": 0}
    for i, line in enumerate(lines):
        m = _BRANCH.match(line)
        if not (m and m.group(1) in labels and labels[m.group(1)] < i):
            continue
        start = labels[m.group(1)]
        cond = set()
        for k in range(start, i):                       # forward branches to a label in the loop
            f = _BRANCH.match(lines[k])
            if f and f.group(1) in labels and k < labels[f.group(1)] <= i:
                cond.update(range(k + 1, labels[f.group(1)]))
        valu = [k for k in range(start, i + 1) if lines[k].startswith("v_")]
        loads = sum(lines[k].startswith(("buffer_load", "global_load")) for k in range(start, i + 1))
        if any(lines[k].startswith(("buffer_store", "global_store")) for k in range(start, i + 1)):
            continue                                    # a loop that stores (the new rows), not the key loop
        every = sum(k not in cond for k in valu)
        if loads and len(valu) > best["valu"] + best["valu_cond"]:
            best = {"valu": every, "valu_cond": len(valu) - every, "loads": loads}
    best["valu_total"] = sum(ln.startswith("v_") for ln in lines)
    return best


STAT_KEYS = ("VGPRs", "SGPRs", "Spilled VGPRs", "Spilled SGPRs", "Scratch size", "LDS size",
             "Subgroups per SIMD", "Instructions")


def compile_family(family: str, planned_calls) -> dict:
    """{job name: stats + key loop} for every distinct pipeline of the calls, on ``family``."""
    jobs, seen = [], set()
    for pc in planned_calls:
        for disp in pc.dispatches:
            key = _job_key(disp.pipeline)
            if key not in seen:
                seen.add(key)
                p = disp.pipeline
                jobs.append(vp.Job(_job_name(p), compile_shader(p.shader, p.defines), list(p.spec), p.bindings))
    res = vp.family_stats([family], jobs, ir=True)[family]
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
                   ("int8 scale + quantise", {"MODE": 2, "KV_F16": 0, "KV_I8": 1})]
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


def numerics_audit(family: str, pipelines=None, src_dir=None) -> dict:
    """The numerics audit on ``family``: numerics_probe.comp's exact helpers (every rule), the
    planned append pipelines (every rule: they only store) and every other planned pipeline (the
    float->half rules: nothing else in them converts to half). ``pipelines``: {name: Pipeline} as
    planned for the report (default none); ``src_dir``: another shader tree (e.g. an older
    checkout's, to measure it). Returns {"probes": {what: {rule: n}}, "pipelines": {name: {rule: n}},
    "native_decode": {instruction: n}, "flagged": total, "error": ...}."""
    jobs = [vp.Job(what, compile_shader("numerics_probe", d, src_dir=src_dir), [64, 2], 4)
            for what, d in NUMERICS_PROBES + [NATIVE_DECODE]]
    pipelines = pipelines or {}
    for name, p in pipelines.items():
        jobs.append(vp.Job(name, compile_shader(p.shader, p.defines, src_dir=src_dir), list(p.spec), p.bindings))
    res = vp.family_stats([family], jobs, ir=True)[family]
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


# ------------------------------------------------------------------------------- the model

ARCH = {"polaris10": "gcn", "vega10": "gcn", "navi10": "rdna", "navi21": "rdna", "gfx1100": "rdna"}


def times(pc: Planned, gpu: GPU, stats: dict | None) -> dict:
    """Bounds in microseconds: memory (unique bytes / bandwidth), arithmetic (flops / fp32 rate)
    and, with the family's compiled code, instruction issue: every wave's VALU instructions (the
    key loop's typical pass times its passes, the rest once) at one wave64 VALU instruction per CU
    and cycle -- GCN runs one on each of 4 SIMD16 in 4 cycles, RDNA on each of 2 SIMD32 in 2
    passes (RDNA3's dual issue is not counted: an upper bound there) -- and no faster than the
    longest workgroup's own instruction stream on one SIMD (4 or 2 cycles per instruction)."""
    unique = sum(d.unique for d in pc.dispatches)
    t = {"mem_us": unique / (gpu.bandwidth_gbs * 1e3), "flop_us": pc.flops / (gpu.fp32_tflops * 1e6)}
    if stats is not None:
        wave_instr, critical = 0, 0.0
        cycles = 4 if ARCH[gpu.family] == "gcn" else 2
        for d in pc.dispatches:
            st = stats.get(_job_name(d.pipeline), {})
            if "valu" not in st:
                return _decide(t)
            waves = -(-_wg_size(d) // 64)
            if d.role == "attn":
                loop, rest = st["valu"], st["valu_total"] - st["valu"] - st["valu_cond"]
                wave_instr += waves * (loop * sum(d.steps) + rest * len(d.steps))
                critical = max(critical, (loop * max(d.steps) + rest) * cycles)
            else:
                wave_instr += waves * st["valu_total"] * d.pipeline.groups[0]
        t["issue_us"] = max(wave_instr / gpu.cus, critical) / (gpu.clock_ghz * 1e3)
    return _decide(t)


def _decide(t: dict) -> dict:
    t["model_us"] = max(t.values())
    t["bound"] = max(t, key=lambda k: t[k] if k != "model_us" else -1)[:-3]
    return t


def _wg_size(d: Dispatch) -> int:
    return d.pipeline.spec[0]


# ------------------------------------------------------------------------------- report

def build(families=None) -> dict:
    families = list(families or vp.DEFAULT_FAMILIES)
    all_calls = calls()
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "families": {}, "calls": [], "pipelines": {},
              "gpus": [asdict(g) for g in REFERENCE_GPUS]}
    plans = {}
    for fam in families:
        info = vp.family_device_info(fam)
        if info is None:
            report["families"][fam] = {"available": False}
            continue
        dev = PlanningDevice(info)
        planned = [plan_call(dev, c) for c in all_calls]
        plans[fam] = planned
        stats = compile_family(fam, planned)
        report["families"][fam] = {"available": True, "device": info.name, "driver_version": info.driver_version}
        pipes = {_job_name(d.pipeline): d.pipeline for pc in planned for d in pc.dispatches}
        report.setdefault("numerics_audit", {})[fam] = numerics_audit(fam, pipes)
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
                "times": {g.name: times(pc, g, fstats if g.family == fam else None)
                          for g in REFERENCE_GPUS if g.family == fam or (g.family is None and fam == ref_fam)},
            }
        report["calls"].append(entry)
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
    rows = []
    for key, (shape, call) in picks.items():
        entry = next(c for c in report["calls"] if c["shape"] == shape and c["call"] == call and c["dtype"] == "float16")
        for fam, want in LLAMA_CPP[key].items():
            pf = entry["per_family"].get(fam)
            if pf is None:
                continue
            st = report["pipelines"][pf["pipelines"][-1]][fam]
            rows.append((f"{key[0]} float16 head_dim {key[1]}", fam, st.get("Subgroups per SIMD"), want,
                         st.get("VGPRs"), st.get("LDS size")))
    return rows


def markdown(report: dict) -> str:
    fams = [f for f, v in report["families"].items() if v.get("available")]
    out = ["### Occupancy against llama.cpp's scalar flash attention (same compiler)", "",
           "| kernel | family | vkattn waves/SIMD | llama.cpp (issue 16) | vkattn VGPRs | vkattn LDS |",
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
    gpus = [g for g in REFERENCE_GPUS]
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
           + ". Audited: numerics_probe.comp's float16 encoder, integer float16 decoder and int8 quantiser "
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
    before = [AUDIT_BEFORE.get(f) for f in fams]
    if any(b is not None for b in before):
        out.append("| before (main at 7a35600) | " + " | ".join("-" if b is None else str(b) for b in before) + " |")
    out += ["", "The GPU kernel's float16 decode (reported, not flagged): "
            + "; ".join(f"{f} " + (", ".join(f"{n} {k}" for k, n in audit[f]["native_decode"].items()) or "none")
                        for f in fams)
            + ". Exact for normal halves and zeros on any conforming driver; half subnormals follow the "
            "driver's float16 denormal mode (preserved by RADV)."]
    return out


def _short(name: str) -> str:
    return name.replace("KV_F16=", "f16=").replace("KV_I8=", "i8=").replace("TILE_SHUFFLE=", "sh=")


def write(report: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_report.json").write_text(json.dumps(report, separators=(",", ":"), default=str))
    with open(out_dir / "gpu_report.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["pipeline", "family"] + list(STAT_KEYS) + ["subgroup_size", "key_loop_valu", "key_loop_loads"])
        for name, per in report["pipelines"].items():
            for fam, st in per.items():
                w.writerow([name, fam] + [st.get(k) for k in STAT_KEYS] +
                           [st.get("subgroup_size"), st.get("valu"), st.get("loads")])
    (out_dir / "gpu_report.md").write_text(markdown(report) + "\n")


def main(argv=None) -> int:
    fams = os.environ.get("VKATTN_GPU_FAMILIES", "").strip()
    families = [f.strip() for f in fams.split(",") if f.strip()] or None
    if vp.radeon_icd() is None:
        print("perf gpu: RADV is not installed (Debian: apt-get install mesa-vulkan-drivers)", file=sys.stderr)
        return 2
    t0 = time.time()
    report = build(families)
    out = Path(os.environ.get("VKATTN_PERF_OUT") or Path(__file__).parent / "out")
    write(report, out)
    print(markdown(report))
    print(f"\n{len(report['pipelines'])} pipelines on {sum(v.get('available', False) for v in report['families'].values())}"
          f" families in {time.time() - t0:.0f} s; written to {out}/gpu_report.{{json,csv,md}}")
    bad = [1 for per in report["pipelines"].values() for st in per.values() if "error" in st]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
