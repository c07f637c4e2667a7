"""``python -m perf ablate``: where attn_coopmat.comp's time goes, by taking parts of it away.

On the H100 (session 21) the cooperative-matrix prefill took about 12.5 us per block of 32 keys
and workgroup (S=512 over 0 / 3584 / 15872 cached keys: 0.514 / 1.924 / 6.599 ms, 256 workgroups
resident at once), some twenty times what a block's 64 matrix multiply-adds per subgroup need at
the tensor cores' rate; nothing measured without a GPU says which part of the block costs it.
This script times the kernel on the device in front of you with one part of its key loop taken
out at a time, beside the whole kernel, in alternated rounds. Each variant is built from a copy of
shaders/ with attn_coopmat.comp edited as ABLATIONS says (its results wrong by design: only the
whole kernel's are checked, against the reference):

  whole         the kernel as shipped
  no-kv-loads   a key block's K and V global loads replaced by constants (the shared stores kept)
  no-qk         S = Q K^T's multiply-adds taken out
  no-pv         O += P V's multiply-adds taken out
  hi-only       the lo halves of Q and P not multiplied: half the matrix work, what float16-only
                operands would cost (their accuracy dropped)
  no-exp        the softmax's exp2 replaced by a subtraction
  no-rescale    O's rescale never taken

Prefill (causal) of VKATTN_ABLATE_ROWS (512) query rows over each past in VKATTN_ABLATE_PAST
("0,15872"), 32/8 heads d128, float16 cache, VKATTN_KERNEL=coopmat. Device time per call from
timestamp queries (the attention dispatches' sum; wall time where the device has none): the
median of VKATTN_ABLATE_ITERS (5) calls after a warm-up, in VKATTN_ABLATE_ROUNDS (2) rounds, each
running every variant in turn. The kernel's self-test verdict is taken first, on the shipped
shaders. Output: a table, and perf/out/ablate.json (VKATTN_PERF_OUT).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

import vkattn
from vkattn import compiler, reference
from vkattn.tuning import kernel_forced

from .common import PerfConfigError, env_int

# (name, [(regex, replacement)]): each regex must match attn_coopmat.comp at least once
ABLATIONS = [
    ("whole", []),
    ("no-kv-loads", [(r"kw\[t\] = kc\[[^;]*\];", "kw[t] = uvec4(i * 0x00010001u);"),
                     (r"vw\[t\] = vc\[[^;]*\];", "vw[t] = uvec4(i * 0x00010001u);")]),
    ("no-qk", [(r"acc\[ni\] = coopMatMulAdd\((?:qh\[d\]|ql), kb, acc\[ni\]\);", "")]),
    ("no-pv", [(r"acc = coopMatMulAdd\((?:ph|pl), vb, acc\);", "")]),
    ("hi-only", [(r"acc\[ni\] = coopMatMulAdd\(ql, kb, acc\[ni\]\);", ""),
                 (r"acc = coopMatMulAdd\(pl, vb, acc\);", "")]),
    ("no-exp", [(r"const float pe = exp2\(p\[k\]\[i\] - mnew\);", "const float pe = p[k][i] - mnew;")]),
    ("no-rescale", [(r"if \(rescale\) \{", "if (false) {")]),
]
SHAPE = (32, 8, 128)            # q heads, kv heads, head dim


def ablated_source(source: str, edits: list) -> str:
    """attn_coopmat.comp's ``source`` with ``edits`` applied; ValueError naming an edit that
    matches nothing (the shader changed under the script)."""
    for pattern, repl in edits:
        source, n = re.subn(pattern, repl, source)
        if n == 0:
            raise ValueError(f"ablation edit {pattern!r} matches nothing in attn_coopmat.comp")
    return source


def shader_trees(root: Path) -> dict:
    """{variant: folder}: a copy of the shaders per variant, attn_coopmat.comp edited."""
    src = Path(str(compiler.shader_dir()))
    text = src.joinpath("attn_coopmat.comp").read_text()
    out = {}
    for name, edits in ABLATIONS:
        d = root / name
        shutil.copytree(src, d)
        d.joinpath("attn_coopmat.comp").write_text(ablated_source(text, edits))
        out[name] = d
    return out


@contextmanager
def shaders_from(folder: Path):
    """compiler.shader_dir() answers ``folder`` inside (the plans built there compile from it)."""
    real = compiler.shader_dir
    compiler.shader_dir = lambda: folder
    try:
        yield
    finally:
        compiler.shader_dir = real


def time_variant(dev, folder: Path, past: int, rows: int, iters: int, data, check: bool) -> dict:
    """{ms, clock, splits[, max_err]} of the variant's prefill over ``past`` keys."""
    hq, hkv, d = SHAPE
    k, v, q = data
    with shaders_from(folder), kernel_forced("coopmat"):
        cache = vkattn.KVCache(past + rows, hkv, d, dtype="float16", device=dev, timestamps=True)
        try:
            cache.append(k, v)
            out = cache.attend(q)                   # builds the plan, warms up
            plan = [p for p in cache._plans.values() if getattr(p, "cfg", None) is not None][-1]
            if plan.cfg.kernel != "coopmat":
                raise RuntimeError(f"the call went to {plan.cfg.kernel}, not attn_coopmat.comp")
            res = {"splits": plan.cfg.splits, "bc": plan.cfg.bc, "br": plan.cfg.br}
            if check:
                ks, vs = cache.read()
                ref = reference.attention(q, ks, vs)
                res["max_err"] = float(np.max(np.abs(out - ref)))
                atol, rtol = reference.TOLERANCE["float16"]
                res["ok"] = bool(np.all(np.abs(out - ref) <= atol + rtol * np.abs(ref)))
            times, clock = [], "device"
            for _ in range(iters):
                t0 = time.perf_counter()
                cache.attend(q)
                wall = (time.perf_counter() - t0) * 1e3
                ops = [ms for op, ms in cache.last_timings() if not op.startswith(("upload ", "download "))]
                if not ops:
                    clock = "wall"
                times.append(sum(ops) if ops else wall)
            res.update(ms=float(np.median(times)), clock=clock)
            return res
        finally:
            cache.close()


def _pasts() -> list:
    raw = os.environ.get("VKATTN_ABLATE_PAST", "").strip() or "0,15872"
    try:
        pasts = [int(x) for x in raw.split(",")]
    except ValueError:
        pasts = []
    if not pasts or min(pasts) < 0:
        raise PerfConfigError(f"VKATTN_ABLATE_PAST={raw!r}: expected a comma list of integers >= 0")
    return pasts


def main(argv=None) -> int:
    pasts = _pasts()
    rows = env_int("VKATTN_ABLATE_ROWS", 512)
    iters = env_int("VKATTN_ABLATE_ITERS", 5)
    rounds = env_int("VKATTN_ABLATE_ROUNDS", 2)
    dev = vkattn.default_device()
    with kernel_forced("coopmat"):
        problem = dev.coopmat_problem()       # the self-test's verdict, on the shipped shaders
    if problem:
        print(f"perf ablate: attn_coopmat.comp does not run on {dev.name}: {problem}", file=sys.stderr)
        return 2
    hq, hkv, d = SHAPE
    rng = np.random.default_rng(5)
    data = {p: (rng.standard_normal((hkv, p + rows, d), dtype=np.float32),
                rng.standard_normal((hkv, p + rows, d), dtype=np.float32),
                rng.standard_normal((hq, rows, d), dtype=np.float32)) for p in pasts}
    found = {(name, p): [] for name, _ in ABLATIONS for p in pasts}
    info = {}
    with tempfile.TemporaryDirectory() as tmp:
        trees = shader_trees(Path(tmp))
        for rnd in range(rounds):
            for name, _ in ABLATIONS:
                for p in pasts:
                    try:
                        r = time_variant(dev, trees[name], p, rows, iters, data[p],
                                         check=(name == "whole" and rnd == 0 and p == min(pasts)))
                    except Exception as exc:       # noqa: BLE001 -- reported in the table
                        r = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
                    info.setdefault((name, p), {}).update({k: v for k, v in r.items() if k != "ms"})
                    if "ms" in r:
                        found[(name, p)].append(r["ms"])
    table = []
    for name, _ in ABLATIONS:
        row = {"variant": name}
        for p in pasts:
            t = found[(name, p)]
            whole = found[("whole", p)]
            row[f"past {p}"] = {"ms": float(np.median(t)) if t else None, "runs": t, **info.get((name, p), {}),
                                "vs_whole": (float(np.median(t)) / float(np.median(whole))) if t and whole else None}
        table.append(row)
    print(f"device: {dev.name}; prefill {rows} rows, {hq}/{hkv} heads d{d} float16, attn_coopmat.comp; "
          f"median ms of {iters} calls x {rounds} rounds")
    print(f"{'variant':12} " + " ".join(f"{'past ' + str(p):>22}" for p in pasts))
    for row in table:
        cells = []
        for p in pasts:
            c = row[f"past {p}"]
            cells.append(f"{c['ms']:9.3f} ms ({c['vs_whole']:.2f}x)" if c["ms"] is not None
                         else f"{'failed':>22}")
        print(f"{row['variant']:12} " + " ".join(f"{x:>22}" for x in cells))
        for p in pasts:
            if "error" in row[f"past {p}"]:
                print(f"  past {p}: {row[f'past {p}']['error']}")
    w = next(r for r in table if r["variant"] == "whole")[f"past {min(pasts)}"]
    if "ok" in w:
        print(f"whole kernel, past {min(pasts)}: max abs error {w['max_err']:.2e}, "
              f"{'within' if w['ok'] else 'OUTSIDE'} the float16 tolerance")
    o = Path(os.environ.get("VKATTN_PERF_OUT") or Path(__file__).parent / "out")
    o.mkdir(parents=True, exist_ok=True)
    path = o / "ablate.json"
    path.write_text(json.dumps({"device": dev.name, "rows": rows, "pasts": pasts, "iters": iters, "rounds": rounds,
                                "table": table}, indent=1))
    print(f"results: {path}")
    return 0 if w.get("ok", True) else 1
