"""``python -m perf lpjit``: the machine code llvmpipe (lavapipe) compiled for a running attention
call, sampled and read -- a kernel change measured by what the CPU executes, not by wall times
that move 1.5-2x on a shared 2-vCPU machine (perf/RESULTS.md, sessions 37-38).

A child process repeats one call (VKATTN_PERF_JIT_CASE: ``decode`` -- KVCache.attend of one
query row at VKATTN_PERF_CONTEXT keys (4096) --, ``paged`` -- PagedKVCache.forward of one token
over as many --, ``window`` -- the decode with a window of 3/4 of the keys, 4 sinks and a softcap
of 30 --, ``mask`` -- the decode with a per-head mask --, ``prompt`` -- the whole-model
example's 37-token prompt, float16 weights, SmolLM2-135M's shape with 4 layers of random weights:
its hottest loop is the gate/up matmul's), with lavapipe in one thread
(LP_NUM_THREADS=0: the samples fall on one copy of the code). After VKATTN_PERF_JIT_WARMUP
seconds (10: the pipeline is compiled and running), ``perf record`` samples it for
VKATTN_PERF_JIT_SECONDS (3). The anonymous executable mapping with the most samples is llvmpipe's
code; it is read from /proc/PID/mem and disassembled by ``objdump``. Shapes: VKATTN_PERF_HEADS,
_KV_HEADS, _HEAD_DIM, _DTYPE as for the other scripts.

The report, per case (``analyse``): the hottest loop (a backward jump's range, by samples) -- its
instructions by kind (float multiplies and adds, fused multiply-adds, moves to and from the stack,
calls, blends, other: llvmpipe 22.3 issues no fused multiply-add for a shader's ``fma()``, session
43) --, the share of the samples in it, in each other function of the mapping (texel fetches
are called functions), and in **per-lane loads**: the small loops in which llvmpipe 22.3 loads a
storage-buffer word lane by lane and inserts each lane's copy into the vector through the stack
(a scalar store to ``(%rsp,%reg,4)``): a load whose address every lane shares costs that too.

Needs Linux ``perf`` (package linux-perf; sampling a child process of the same user) and binutils'
``objdump``; says which is missing and exits 2 where one is."""
from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

CASES = ("decode", "paged", "window", "mask", "prompt")
_INSN = re.compile(r"^\s*([0-9a-f]+):\t[0-9a-f ]+\t(\S+)\s*(.*)$")
_TARGET = re.compile(r"^(?:0x)?([0-9a-f]+)\b")
_LANE_INSERT = re.compile(r"\(%rsp,%r\w+,4\)$")     # a scalar into lane %reg of a stack vector
ARITH = ("vaddps", "vsubps", "vmulps")
FUSED = ("vfmadd", "vfmsub", "vfnmadd", "vfnmsub")   # a multiply-add in one instruction


class LpjitError(RuntimeError):
    """A tool the report needs is missing, or the sampled process had no JIT code."""


def parse(asm: str) -> list:
    """objdump -D lines -> [(address, mnemonic, operands)] in address order."""
    out = []
    for line in asm.splitlines():
        m = _INSN.match(line)
        if m:
            out.append((int(m.group(1), 16), m.group(2), m.group(3).strip()))
    return out


def kind(op: str, args: str) -> str:
    """An instruction's kind in the report's mix."""
    if op.startswith(ARITH):
        return "arith"
    if op.startswith(FUSED):
        return "fma"
    if op.startswith("vmov") and ("(%rsp)" in args or "(%rbp)" in args):
        return "stack move"
    if op == "call":
        return "call"
    if op.startswith("vblend") or op.startswith("vpblend"):
        return "blend"
    return "other"


def _backward_jumps(ins: list) -> list:
    """(target, address of the jump) of every jump to a lower address."""
    out = []
    for a, op, args in ins:
        if op.startswith("j"):
            m = _TARGET.match(args)
            if m and int(m.group(1), 16) < a:
                out.append((int(m.group(1), 16), a))
    return out


def analyse(asm: str, samples: dict, lane_loop_max: int = 40) -> dict:
    """The report of one disassembled mapping: ``asm`` objdump's text (addresses relative to the
    mapping), ``samples`` {address: samples}. Functions are the ranges between ``ret``s. Returns
    {"loop": {"start", "end", "instructions", "kinds": {kind: n}, "samples_share"},
    "functions": [(start, end, instructions, samples_share)] by share, "lane_loads":
    {"loops": n, "samples_share": s} (innermost loops of at most ``lane_loop_max`` instructions
    that store a scalar into (%rsp,%reg,4)), "lane_loads_in_loop": such loops inside the hottest
    loop}."""
    ins = parse(asm)
    if not ins:
        raise LpjitError("no instruction in the disassembly")
    total = sum(samples.values()) or 1

    def share(lo, hi):
        return sum(c for x, c in samples.items() if lo <= x <= hi) / total

    funcs, start = [], 0
    for i, (a, op, _) in enumerate(ins):
        if op.startswith("ret") or i == len(ins) - 1:
            lo, hi = ins[start][0], a
            funcs.append((lo, hi, i + 1 - start, share(lo, hi)))
            start = i + 1
    funcs.sort(key=lambda f: -f[3])
    jumps = _backward_jumps(ins)
    if not jumps:
        raise LpjitError("no loop in the disassembly")
    lo, hi = max(jumps, key=lambda j: (share(*j), j[1] - j[0]))
    body = [(a, op, args) for a, op, args in ins if lo <= a <= hi]
    kinds = collections.Counter(kind(op, args) for _, op, args in body)
    loops = {}                                          # a loop per jump target: its furthest jump back
    for t, a in jumps:
        loops[t] = max(a, loops.get(t, a))
    lanes = []
    for t, a in loops.items():
        inner = [(x, op, args) for x, op, args in ins if t <= x <= a]
        nested = any(t2 != t and t <= t2 and a2 <= a for t2, a2 in loops.items())
        if not nested and len(inner) <= lane_loop_max and \
                any(op == "mov" and _LANE_INSERT.search(args) for _, op, args in inner):
            lanes.append((t, a))
    in_lanes = {x for x, _, _ in ins if any(t <= x <= a for t, a in lanes)}
    return {"loop": {"start": lo, "end": hi, "instructions": len(body), "kinds": dict(kinds),
                     "samples_share": share(lo, hi)},
            "functions": funcs,
            "lane_loads": {"loops": len(lanes), "samples_share": sum(samples.get(x, 0) for x in in_lanes) / total},
            "lane_loads_in_loop": sum(1 for t, a in lanes if lo <= t and a <= hi)}


def _tools() -> dict:
    need = {"perf": "linux-perf", "objdump": "binutils"}
    found = {t: shutil.which(t) for t in need}
    missing = [f"{t} (package {p})" for t, p in need.items() if not found[t]]
    if missing:
        raise LpjitError("python -m perf lpjit needs " + " and ".join(missing))
    return found


def hot_mapping(pid: int, ips: dict) -> tuple:
    """(bytes, {offset: samples}) of the anonymous executable mapping of ``pid`` holding the most of
    the sampled addresses ``ips`` ({address: samples})."""
    maps = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if "x" in parts[1] and len(parts) < 6:          # executable, no file behind it
                maps.append((lo, hi))
    hits = collections.Counter()
    for ip, c in ips.items():
        for lo, hi in maps:
            if lo <= ip < hi:
                hits[(lo, hi)] += c
                break
    if not hits:
        raise LpjitError("no sample fell in JIT code: is the call running on lavapipe?")
    (lo, hi), _ = hits.most_common(1)[0]
    with open(f"/proc/{pid}/mem", "rb") as f:
        f.seek(lo)
        code = f.read(hi - lo)
    return code, {ip - lo: c for ip, c in ips.items() if lo <= ip < hi}


def sample(case: str, warmup: float, seconds: float) -> tuple:
    """(disassembly, {offset: samples}) of llvmpipe's code while a child repeats ``case``."""
    tools = _tools()
    env = dict(os.environ, LP_NUM_THREADS=os.environ.get("LP_NUM_THREADS", "0"))
    child = subprocess.Popen([sys.executable, "-m", "perf.lpjit", "--child", case], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + warmup
        while time.time() < deadline:
            if child.poll() is not None:
                raise LpjitError(f"the {case} workload exited: {child.stderr.read().decode()[-2000:]}")
            time.sleep(0.2)
        with tempfile.TemporaryDirectory() as tmp:
            data = os.path.join(tmp, "perf.data")
            subprocess.run([tools["perf"], "record", "-q", "-F", "2000", "-p", str(child.pid), "-o", data,
                            "--", "sleep", str(seconds)], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            script = subprocess.run([tools["perf"], "script", "-i", data, "-F", "ip"], check=True,
                                    capture_output=True, text=True).stdout
            ips = collections.Counter(int(x, 16) for x in script.split())
            code, offsets = hot_mapping(child.pid, ips)
            path = os.path.join(tmp, "jit.bin")
            with open(path, "wb") as f:
                f.write(code)
            asm = subprocess.run([tools["objdump"], "-D", "-b", "binary", "-mi386:x86-64", path], check=True,
                                 capture_output=True, text=True).stdout
    finally:
        child.kill()
        child.wait()
    return asm, offsets


def _workload(case: str):
    """The call the child repeats (perf/common.py's shape variables)."""
    import numpy as np

    import vkattn

    from .common import Shape, env_int
    if case == "prompt":
        from examples.llama_device.model import DeviceLlama

        from .model import SMOLLM2_SHAPE, random_weights
        cfg = dict(SMOLLM2_SHAPE, num_hidden_layers=4)
        model = DeviceLlama(cfg, random_weights(cfg), weight_dtype="float16", capacity=40)
        ids = np.random.default_rng(1).integers(0, cfg["vocab_size"], 37)
        return lambda: model.generate(ids, 1)
    sh = Shape.from_env()
    L = env_int("VKATTN_PERF_CONTEXT", 4096)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((sh.kv_heads, L, sh.head_dim), dtype=np.float32)
    v = rng.standard_normal((sh.kv_heads, L, sh.v_head_dim), dtype=np.float32)
    q = rng.standard_normal((sh.heads, 1, sh.head_dim), dtype=np.float32)
    if case == "paged":
        pool = vkattn.PagedKVCache(L // 16 + 2, 16, sh.kv_heads, sh.head_dim, sh.v_head_dim, dtype=sh.dtype)
        s = pool.add_sequence()
        pool.append([s], k, v, n_new=[L])
        k1, v1 = k[:, :1], v[:, :1]

        def call():
            pool.forward([s], q, k1, v1)
            pool.truncate(s, L)
        return call
    cache = vkattn.KVCache(L, sh.kv_heads, sh.head_dim, sh.v_head_dim, dtype=sh.dtype)
    cache.append(k, v)
    kw = {"window": dict(window=max(1, 3 * L // 4), n_sink=4, softcap=30.0),
          "mask": dict(mask=rng.standard_normal((sh.heads, 1, L), dtype=np.float32))}.get(case, {})
    return lambda: cache.attend(q, **kw)


def report_lines(case: str, r: dict) -> list:
    loop, lanes = r["loop"], r["lane_loads"]
    kinds = dict({"fma": 0}, **loop["kinds"])          # a fused multiply-add's absence shown too
    mix = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items(), key=lambda t: -t[1]))
    fns = "; ".join(f"{n} instructions {100 * s:.1f}%" for _, _, n, s in r["functions"][:3])
    return [f"{case}: hottest loop {loop['instructions']} instructions, {100 * loop['samples_share']:.1f}% of the "
            f"samples ({mix})",
            f"{case}: per-lane load loops {lanes['loops']} ({r['lane_loads_in_loop']} inside the hottest loop), "
            f"{100 * lanes['samples_share']:.1f}% of the samples",
            f"{case}: functions by samples: {fns}"]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        call = _workload(argv[1])
        while True:
            call()
    from .common import PerfConfigError, env_int
    cases = [c.strip() for c in os.environ.get("VKATTN_PERF_JIT_CASE", "decode").split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    try:
        if bad:
            raise PerfConfigError(f"VKATTN_PERF_JIT_CASE: unknown case(s) {bad}; choose from {', '.join(CASES)}")
        warmup = env_int("VKATTN_PERF_JIT_WARMUP", 10)
        seconds = env_int("VKATTN_PERF_JIT_SECONDS", 3)
        for case in cases:
            asm, samples = sample(case, warmup, seconds)
            for line in report_lines(case, analyse(asm, samples)):
                print(line)
    except (PerfConfigError, LpjitError) as e:
        print(f"perf lpjit: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
