"""ACO disassembly and statistics, read the same way for vkattn's pipelines (perf/gpu.py,
perf/features.py) and llama.cpp's (perf/llama_cpp.py): the key loop's VALU, loads and matrix
multiply-adds, and the statistics every report lists."""
from __future__ import annotations

import re

_BRANCH = re.compile(r"^\s*s_c?branch\w*\s+(BB\d+)")
_LABEL = re.compile(r"^(BB\d+):")


def key_loop(asm: str) -> dict:
    """The key loop of an ACO disassembly: the backward-branch range with the most VALU
    instructions that loads from memory and stores nothing (the attention kernels' loop storing a
    call's new rows, before the key loop, is not it). {"valu": VALU instructions of a pass that skips the
    loop's conditional blocks (forward branches inside it: the rescale when no row's max grew),
    "valu_cond": those in the conditional blocks, "loads": buffer loads per pass, "valu_total":
    every VALU instruction of the shader, "wmma" / "wmma_total": the matrix multiply-adds
    (v_wmma_*, v_swmmac_*; not counted as VALU) in the loop / in the shader}."""
    lines = [ln.strip() for ln in asm.splitlines()]
    labels = {}
    for i, line in enumerate(lines):
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = i
    best = {"valu": 0, "valu_cond": 0, "loads": 0, "wmma": 0}
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
        valu = [k for k in range(start, i + 1) if _is_valu(lines[k])]
        loads = sum(lines[k].startswith(("buffer_load", "global_load")) for k in range(start, i + 1))
        if any(lines[k].startswith(("buffer_store", "global_store")) for k in range(start, i + 1)):
            continue                                    # a loop that stores (the new rows), not the key loop
        every = sum(k not in cond for k in valu)
        if loads and len(valu) > best["valu"] + best["valu_cond"]:
            best = {"valu": every, "valu_cond": len(valu) - every, "loads": loads,
                    "wmma": sum(_is_matrix(lines[k]) for k in range(start, i + 1))}
    best["valu_total"] = sum(_is_valu(ln) for ln in lines)
    best["wmma_total"] = sum(_is_matrix(ln) for ln in lines)
    return best


def _is_matrix(line: str) -> bool:
    return line.startswith(("v_wmma_", "v_swmmac_"))


def _is_valu(line: str) -> bool:
    return line.startswith("v_") and not _is_matrix(line)


STAT_KEYS = ("VGPRs", "SGPRs", "Spilled VGPRs", "Spilled SGPRs", "Scratch size", "LDS size",
             "Subgroups per SIMD", "Instructions")
