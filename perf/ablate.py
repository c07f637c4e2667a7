"""``python -m perf ablate [prefill] [decode]``: where a GPU kernel's time goes, by taking parts of
it away.

On the H100 (session 21) attn_coopmat.comp's prefill took about 12.5 us per block of 32 keys and
workgroup (S=512 over 0 / 3584 / 15872 cached keys: 0.514 / 1.924 / 6.599 ms, 256 workgroups
resident at once), some twenty times what a block's 64 matrix multiply-adds per subgroup need at
the tensor cores' rate; attn.comp's decode at L=16384 took 0.124 ms, 16% of the memory bandwidth
and 1.7x torch's time. Nothing measured without a GPU says which part of either kernel costs it.
This script times a kernel on the device in front of you with one part taken out at a time,
beside the whole kernel, in alternated rounds (each round starting one variant later). Each variant is built from a copy of shaders/ with
the kernel's source edited as TARGETS says (its results wrong by design: only the whole kernel's
are checked, against the reference, at the smallest size).

prefill -- attn_coopmat.comp (VKATTN_KERNEL=coopmat), causal prefill of VKATTN_ABLATE_ROWS (512)
query rows over each past in VKATTN_ABLATE_PAST ("0,15872"):
  whole         the kernel as shipped
  no-kv-loads   a key block's K and V global loads replaced by constants (the shared stores kept)
  no-qk         S = Q K^T's multiply-adds taken out
  no-pv         O += P V's multiply-adds taken out
  hi-only       the lo halves of Q and P not multiplied: half the matrix work, what float16-only
                operands would cost (their accuracy dropped)
  no-exp        the softmax's exp2 replaced by an add and a max (finite, 0 for invisible keys)
  no-rescale    O's rescale never taken
decode -- attn.comp (VKATTN_KERNEL=tile), one query row over each length in VKATTN_ABLATE_DECODE_L
("16384"), the cache's capacity that length (its split count as perf decode's "cap" rows):
  whole         the kernel as shipped
  no-k-loads    the K words replaced by constants
  no-v-loads    the V words replaced by constants
  no-exp        the softmax's exp2 replaced by an add and a max
  no-merge      every workgroup returns before the split merge (out not written)

32/8 heads d128, float16 cache. Device time per call from timestamp queries (the attention
dispatches' sum; wall time where the device has none): the median of VKATTN_ABLATE_ITERS (5)
calls after a warm-up, in VKATTN_ABLATE_ROUNDS (2) rounds, each running every variant in turn.
prefill needs attn_coopmat.comp to run on the device (its self-test's verdict is taken first, on
the shipped shaders); without it only decode runs. Output: a table per target, and
perf/out/ablate.json (VKATTN_PERF_OUT).
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

# target: (shader file, kernel forced, [(variant, [(regex, replacement)])]); each regex must match
# the shader at least once
TARGETS = {
    "prefill": ("attn_coopmat.comp", "coopmat", [
        ("whole", []),
        ("no-kv-loads", [(r"kw\[t\] = kc\[[^;]*\];", "kw[t] = uvec4(i * 0x00010001u);"),
                         (r"vw\[t\] = vc\[[^;]*\];", "vw[t] = uvec4(i * 0x00010001u);")]),
        ("no-qk", [(r"acc\[ni\] = coopMatMulAdd\((?:qh\[d\]|ql), kb, acc\[ni\]\);", "")]),
        ("no-pv", [(r"acc = coopMatMulAdd\((?:ph|pl), vb, acc\);", "")]),
        ("hi-only", [(r"acc\[ni\] = coopMatMulAdd\(ql, kb, acc\[ni\]\);", ""),
                     (r"acc = coopMatMulAdd\(pl, vb, acc\);", "")]),
        ("no-exp", [(r"const float pe = exp2\(p\[k\]\[i\] - mnew\);", "const float pe = max(p[k][i] - mnew + 1.0, 0.0);")]),
        ("no-rescale", [(r"if \(rescale\) \{", "if (false) {")]),
    ]),
    "decode": ("attn.comp", "tile", [
        ("whole", []),
        ("no-k-loads", [(r"uvec4 k_unit\(uint row, uint u\) \{ return kc\[row \* DK4 \+ u\]; \}",
                         "uvec4 k_unit(uint row, uint u) { return uvec4(row * 0x00010001u + u); }")]),
        ("no-v-loads", [(r"uvec4 v_unit\(uint row, uint u\) \{ return vc\[row \* DV4 \+ u\]; \}",
                         "uvec4 v_unit(uint row, uint u) { return uvec4(row * 0x00010001u + u); }")]),
        ("no-exp", [(r"p\[r \* KB \+ i\] = exp2\(s\[i\] - mn\);", "p[r * KB + i] = max(s[i] - mn + 1.0, 0.0);")]),
        ("no-merge", [(r"if \(s_last != gl_NumWorkGroups\.x - 1u\) return;", "return;")]),
    ]),
}
SHAPE = (32, 8, 128)            # q heads, kv heads, head dim


def ablated_source(source: str, edits: list, shader: str = "the shader") -> str:
    """``source`` with ``edits`` applied; ValueError naming an edit that matches nothing (the
    shader changed under the script)."""
    for pattern, repl in edits:
        source, n = re.subn(pattern, repl, source)
        if n == 0:
            raise ValueError(f"ablation edit {pattern!r} matches nothing in {shader}")
    return source


def shader_trees(root: Path, target: str) -> dict:
    """{variant: folder}: a copy of the shaders per variant of ``target``, its kernel edited."""
    shader, _, variants = TARGETS[target]
    src = Path(str(compiler.shader_dir()))
    text = src.joinpath(shader).read_text()
    out = {}
    for name, edits in variants:
        d = root / target / name
        shutil.copytree(src, d)
        d.joinpath(shader).write_text(ablated_source(text, edits, shader))
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


def time_variant(dev, folder: Path, kernel: str, past: int, rows: int, iters: int, data, check: bool) -> dict:
    """{ms, clock, splits[, max_err, ok]} of a call of ``rows`` query rows over ``past`` cached
    keys (the cache's capacity ``past``) built from ``folder``'s shaders."""
    hq, hkv, d = SHAPE
    k, v, q = data
    with shaders_from(folder), kernel_forced(kernel):
        cache = vkattn.KVCache(past, hkv, d, dtype="float16", device=dev, timestamps=True)
        try:
            cache.append(k, v)
            out = cache.attend(q)                   # builds the plan, warms up
            plan = [p for p in cache._plans.values() if getattr(p, "cfg", None) is not None][-1]
            if plan.cfg.kernel != kernel:
                raise RuntimeError(f"the call went to {plan.cfg.kernel}, not {kernel}")
            res = {"splits": plan.cfg.splits}
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


def _ints(name: str, default: str, least: int) -> list:
    raw = os.environ.get(name, "").strip() or default
    try:
        values = [int(x) for x in raw.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < least:
        raise PerfConfigError(f"{name}={raw!r}: expected a comma list of integers >= {least}")
    return values


def target_sizes(target: str) -> tuple:
    """(query rows, sizes, {size: keys in the cache at the call}) of ``target`` from its
    variables; PerfConfigError for a bad value."""
    if target == "prefill":
        rows = env_int("VKATTN_ABLATE_ROWS", 512)
        sizes = _ints("VKATTN_ABLATE_PAST", "0,15872", 0)
        return rows, sizes, {p: p + rows for p in sizes}      # past + the call's own rows
    sizes = _ints("VKATTN_ABLATE_DECODE_L", "16384", 1)
    return 1, sizes, {p: p for p in sizes}


def run_target(dev, target: str, iters: int, rounds: int, rows: int, sizes: list, past_of: dict) -> dict:
    """{"sizes", "rows", "table": [{variant, <size>: {ms, runs, vs_whole, ...}}]} of ``target``
    (its target_sizes)."""
    shader, kernel, variants = TARGETS[target]
    hq, hkv, d = SHAPE
    rng = np.random.default_rng(5)
    data = {p: (rng.standard_normal((hkv, past_of[p], d), dtype=np.float32),
                rng.standard_normal((hkv, past_of[p], d), dtype=np.float32),
                rng.standard_normal((hq, rows, d), dtype=np.float32)) for p in sizes}
    found = {(name, p): [] for name, _ in variants for p in sizes}
    info = {}
    with tempfile.TemporaryDirectory() as tmp:
        trees = shader_trees(Path(tmp), target)
        for rnd in range(rounds):
            shift = rnd % len(variants)          # each round starts one variant later: none always first
            for name, _ in variants[shift:] + variants[:shift]:
                for p in sizes:
                    try:
                        r = time_variant(dev, trees[name], kernel, past_of[p], rows, iters, data[p],
                                         check=(name == "whole" and rnd == 0 and p == min(sizes)))
                    except Exception as exc:       # noqa: BLE001 -- reported in the table
                        r = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
                    info.setdefault((name, p), {}).update({k: v for k, v in r.items() if k != "ms"})
                    if "ms" in r:
                        found[(name, p)].append(r["ms"])
    table = []
    for name, _ in variants:
        row = {"variant": name}
        for p in sizes:
            t, whole = found[(name, p)], found[("whole", p)]
            row[str(p)] = {"ms": float(np.median(t)) if t else None, "runs": t, **info.get((name, p), {}),
                           "vs_whole": (float(np.median(t)) / float(np.median(whole))) if t and whole else None}
        table.append(row)
    return {"shader": shader, "kernel": kernel, "rows": rows, "sizes": sizes, "table": table}


def print_target(target: str, res: dict, dev, iters: int, rounds: int) -> bool:
    """The table; True where the whole kernel's results were within tolerance."""
    hq, hkv, d = SHAPE
    what = (f"causal prefill of {res['rows']} rows over each past" if target == "prefill"
            else "decode of one row over each length")
    print(f"\n{target}: {res['shader']} ({res['kernel']}) on {dev.name}; {what}, {hq}/{hkv} heads d{d} "
          f"float16; median ms of {iters} calls x {rounds} rounds")
    label = "past" if target == "prefill" else "L"
    print(f"{'variant':12} " + " ".join(f"{label + ' ' + str(p):>24}" for p in res["sizes"]))
    ok = True
    for row in res["table"]:
        cells = []
        for p in res["sizes"]:
            c = row[str(p)]
            cells.append(f"{c['ms']:9.3f} ms ({c['vs_whole']:.2f}x)" if c["ms"] is not None else "failed")
        print(f"{row['variant']:12} " + " ".join(f"{x:>24}" for x in cells))
        for p in res["sizes"]:
            c = row[str(p)]
            if "error" in c:
                print(f"  {label} {p}: {c['error']}")
            if row["variant"] == "whole" and "ok" in c:
                ok = ok and c["ok"]
                print(f"  whole kernel, {label} {p}: max abs error {c['max_err']:.2e}, "
                      f"{'within' if c['ok'] else 'OUTSIDE'} the float16 tolerance; {c['splits']} splits")
    return ok


def main(argv=None) -> int:
    argv = list(sys.argv[2:] if argv is None else argv) or list(TARGETS)
    bad = [a for a in argv if a not in TARGETS]
    if bad:
        print(f"perf ablate: unknown target(s) {bad}; choose from {list(TARGETS)}", file=sys.stderr)
        return 2
    try:
        iters = env_int("VKATTN_ABLATE_ITERS", 5)
        rounds = env_int("VKATTN_ABLATE_ROUNDS", 2)
        sizes = {t: target_sizes(t) for t in argv}
    except PerfConfigError as e:
        print(f"perf ablate: {e}", file=sys.stderr)
        return 2
    dev = vkattn.default_device()
    results, ok = {}, True
    for target in argv:
        if target == "prefill":
            with kernel_forced("coopmat"):
                problem = dev.coopmat_problem()   # the self-test's verdict, on the shipped shaders
            if problem:
                print(f"\nprefill: attn_coopmat.comp does not run on {dev.name}: {problem}")
                results[target] = {"skipped": problem}
                continue
        results[target] = run_target(dev, target, iters, rounds, *sizes[target])
        ok = print_target(target, results[target], dev, iters, rounds) and ok
    o = Path(os.environ.get("VKATTN_PERF_OUT") or Path(__file__).parent / "out")
    o.mkdir(parents=True, exist_ok=True)
    path = o / "ablate.json"
    path.write_text(json.dumps({"device": dev.name, "iters": iters, "rounds": rounds, **results}, indent=1))
    print(f"\nresults: {path}")
    return 0 if ok else 1
