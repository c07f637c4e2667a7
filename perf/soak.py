"""``python -m perf.soak``: endurance run of a model-shaped decode loop, then a create/close churn.

Phase 1, the decode loop. One KVCache; each step is one ``cache.forward(q, k, v)``:
  * a decode step: one new token (s = n = 1);
  * every VKATTN_SOAK_SPEC_EVERY steps a speculative step instead: SPEC draft tokens verified in
    one forward (s = n = SPEC), then 1..SPEC of them rejected with ``truncate``;
  * at step 0 and whenever the next token would not fit (the cache is full): ``reset`` then a
    short prefill (s = n = one of PREFILL/4, PREFILL/2, PREFILL, in turn), so the loop wraps.
A host mirror (preallocated at capacity, float16-rounded like the cache) follows every append and
truncate. A priming pass first fills the cache to capacity once (so the pages the loop will touch
are resident before the baseline memory sample). Every VERIFY_EVERY steps (and at the end of the
priming pass, the first and the last step) the step's output is compared
with ``vkattn.reference.attention`` on the mirror at ``vkattn.reference.TOLERANCE``, and
``cache.read()`` with the mirror, bit for bit. Every call shape is planned before step 0, so after
the warm-up nothing should be allocated any more: resident memory (VmRSS) is sampled after the
warm-up, at the middle and at the end, beside the number of plans, of live vkattn device objects
(buffers, programs, recorded sequences not yet destroyed), of threads and of memory mappings.

Phase 2, create/close: VKATTN_SOAK_CYCLES small caches, each created, used once (a one-token
forward, checked against the reference) and closed; VmRSS and live device objects before and after.

Exit status: 0 pass, 1 a verification failed or memory grew beyond its limit, 2 a bad setting.

Environment (a bad value is an error, as in perf/common.py):
  VKATTN_SOAK_STEPS (10000)        decode-loop steps
  VKATTN_SOAK_VERIFY_EVERY (100)   verify every this many steps
  VKATTN_SOAK_WARMUP (200)         steps before the baseline memory sample (< STEPS / 2)
  VKATTN_SOAK_PREFILL (32)         longest prefill after a reset
  VKATTN_SOAK_SPEC (4)             draft tokens per speculative step
  VKATTN_SOAK_SPEC_EVERY (25)      a speculative step every this many steps (0: never)
  VKATTN_SOAK_SEED (0)             input random seed
  VKATTN_SOAK_RSS_PCT (10), VKATTN_SOAK_RSS_MIB (8)
                                   allowed VmRSS growth warm-up -> end: PCT % of warm-up RSS + MIB
  VKATTN_SOAK_CYCLES (200)         create/close cycles (0: skip phase 2)
  VKATTN_SOAK_CYCLE_CAPACITY (4096) capacity of each small cache
  VKATTN_SOAK_CYCLE_RSS_MIB (4)    allowed VmRSS growth over the create/close cycles
  VKATTN_PERF_HEADS (32), _KV_HEADS (8), _HEAD_DIM (128), _V_HEAD_DIM (= head dim),
  _DTYPE (float16), _CAPACITY (1024)   the decode loop's shape
"""
from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass, field

import numpy as np

import vkattn
from vkattn import _kp
from vkattn.reference import TOLERANCE, attention, round_to

from .common import PerfConfigError, env_choice, env_int


# ---------------------------------------------------------------------------------- configuration
@dataclass
class SoakConfig:
    steps: int = 10000
    verify_every: int = 100
    warmup: int = 200
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    v_head_dim: int | None = None
    dtype: str = "float16"
    capacity: int = 1024
    prefill: int = 32
    spec: int = 4
    spec_every: int = 25
    seed: int = 0
    rss_pct: int = 10
    rss_mib: int = 8
    cycles: int = 200
    cycle_capacity: int = 4096
    cycle_rss_mib: int = 4

    def __post_init__(self):
        if self.v_head_dim is None:
            self.v_head_dim = self.head_dim
        self.validate()

    @classmethod
    def from_env(cls) -> "SoakConfig":
        d = env_int("VKATTN_PERF_HEAD_DIM", 128)
        return cls(
            steps=env_int("VKATTN_SOAK_STEPS", 10000),
            verify_every=env_int("VKATTN_SOAK_VERIFY_EVERY", 100),
            warmup=env_int("VKATTN_SOAK_WARMUP", 200),
            heads=env_int("VKATTN_PERF_HEADS", 32),
            kv_heads=env_int("VKATTN_PERF_KV_HEADS", 8),
            head_dim=d,
            v_head_dim=env_int("VKATTN_PERF_V_HEAD_DIM", d),
            dtype=env_choice("VKATTN_PERF_DTYPE", "float16", ("float16", "float32")),
            capacity=env_int("VKATTN_PERF_CAPACITY", 1024),
            prefill=env_int("VKATTN_SOAK_PREFILL", 32),
            spec=env_int("VKATTN_SOAK_SPEC", 4),
            spec_every=env_int("VKATTN_SOAK_SPEC_EVERY", 25, minimum=0),
            seed=env_int("VKATTN_SOAK_SEED", 0, minimum=0),
            rss_pct=env_int("VKATTN_SOAK_RSS_PCT", 10, minimum=0),
            rss_mib=env_int("VKATTN_SOAK_RSS_MIB", 8, minimum=0),
            cycles=env_int("VKATTN_SOAK_CYCLES", 200, minimum=0),
            cycle_capacity=env_int("VKATTN_SOAK_CYCLE_CAPACITY", 4096),
            cycle_rss_mib=env_int("VKATTN_SOAK_CYCLE_RSS_MIB", 4, minimum=0),
        )

    def validate(self) -> None:
        if self.heads % self.kv_heads:
            raise PerfConfigError(f"VKATTN_PERF_HEADS={self.heads} must be a multiple of "
                                  f"VKATTN_PERF_KV_HEADS={self.kv_heads}")
        if self.prefill > self.capacity:
            raise PerfConfigError(f"VKATTN_SOAK_PREFILL={self.prefill} exceeds VKATTN_PERF_CAPACITY={self.capacity}")
        if self.spec_every and self.spec > self.capacity:
            raise PerfConfigError(f"VKATTN_SOAK_SPEC={self.spec} exceeds VKATTN_PERF_CAPACITY={self.capacity}")
        if not self.warmup < self.steps // 2:
            raise PerfConfigError(f"VKATTN_SOAK_WARMUP={self.warmup} must be below half of "
                                  f"VKATTN_SOAK_STEPS={self.steps}")

    @property
    def prefill_lengths(self) -> tuple:
        return tuple(sorted({max(1, self.prefill // 4), max(1, self.prefill // 2), self.prefill}))

    def describe(self) -> str:
        return (f"hq={self.heads} hkv={self.kv_heads} d={self.head_dim} dv={self.v_head_dim} {self.dtype} "
                f"capacity={self.capacity}")


# ---------------------------------------------------------------------------------- process probes
def proc_status() -> dict:
    """/proc/self/status as {field: value}; the kB fields (VmRSS, VmSize, ...) as ints in kB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            rest = rest.strip()
            if rest.endswith(" kB"):
                out[key] = int(rest[:-3])
            elif rest.isdigit():
                out[key] = int(rest)
            else:
                out[key] = rest
    return out


def rss_mib() -> float:
    """Resident set size of this process in MiB (VmRSS)."""
    return proc_status()["VmRSS"] / 1024


def live_device_objects() -> dict:
    """vkattn's device wrappers still holding a kp object (not yet destroyed), by kind."""
    counts = {"buffers": 0, "programs": 0, "sequences": 0}
    for o in gc.get_objects():
        t = type(o)
        if t is _kp.Buffer:
            counts["buffers"] += getattr(o, "_t", None) is not None
        elif t is _kp.Program:
            counts["programs"] += getattr(o, "_algo", None) is not None
        elif t is _kp.Recording:
            counts["sequences"] += getattr(o, "_seq", None) is not None
    return counts


@dataclass
class Snapshot:
    label: str
    step: int
    rss_mib: float
    vmsize_mib: float
    threads: int
    maps: int
    plans: int
    objects: dict

    @classmethod
    def take(cls, label: str, step: int = 0, cache=None) -> "Snapshot":
        gc.collect()
        st = proc_status()
        with open("/proc/self/maps") as f:
            maps = sum(1 for _ in f)
        return cls(label, step, st["VmRSS"] / 1024, st["VmSize"] / 1024, int(st.get("Threads", 0)), maps,
                   len(cache._plans) if cache is not None else 0, live_device_objects())

    def line(self) -> str:
        o = self.objects
        return (f"{self.label:>16} (step {self.step:>6}): RSS {self.rss_mib:8.1f} MiB  VmSize {self.vmsize_mib:8.1f} MiB  "
                f"plans {self.plans}  live buffers/programs/sequences {o['buffers']}/{o['programs']}/{o['sequences']}  "
                f"threads {self.threads}  maps {self.maps}")


# ---------------------------------------------------------------------------------- phase 1
class HostMirror:
    """What the cache must hold, preallocated at capacity: appends write rows, truncate moves a
    number (as the cache does), so keeping it costs O(new rows) per step."""

    def __init__(self, cache):
        self.dtype = cache.dtype
        self.k = np.zeros((cache.num_kv_heads, cache.capacity, cache.head_dim), np.float32)
        self.v = np.zeros((cache.num_kv_heads, cache.capacity, cache.v_head_dim), np.float32)
        self.length = 0

    def append(self, k, v) -> None:
        n = k.shape[1]
        self.k[:, self.length:self.length + n] = round_to(k, self.dtype)
        self.v[:, self.length:self.length + n] = round_to(v, self.dtype)
        self.length += n

    def truncate(self, n: int) -> None:
        self.length = n

    def ref(self, q) -> np.ndarray:
        return attention(q, self.k[:, :self.length], self.v[:, :self.length])


@dataclass
class DecodeReport:
    config: SoakConfig
    device: str
    steps: int = 0
    decode_steps: int = 0
    spec_steps: int = 0
    tokens_rolled_back: int = 0
    resets: int = 0
    verifications: int = 0
    verified_ok: int = 0
    failures: list = field(default_factory=list)
    snapshots: list = field(default_factory=list)
    decode_ms: list = field(default_factory=list)
    spec_ms: list = field(default_factory=list)
    prefill_ms: list = field(default_factory=list)
    seconds: float = 0.0
    max_err: float = 0.0
    trace: list = field(default_factory=list)    # (step, VmRSS MiB) every steps/40 steps, no gc

    @property
    def complete(self) -> bool:
        return self.steps == self.config.steps and len(self.snapshots) == 3

    @property
    def rss_growth_mib(self) -> float:
        return self.snapshots[-1].rss_mib - self.snapshots[0].rss_mib if self.snapshots else float("nan")

    @property
    def rss_limit_mib(self) -> float:
        return self.snapshots[0].rss_mib * self.config.rss_pct / 100 + self.config.rss_mib

    @property
    def objects_stable(self) -> bool:
        first, last = self.snapshots[0], self.snapshots[-1]
        return first.objects == last.objects and first.plans == last.plans

    @property
    def ok(self) -> bool:
        return (self.complete and not self.failures and self.verified_ok == self.verifications > 0
                and self.rss_growth_mib <= self.rss_limit_mib and self.objects_stable)

    def lines(self) -> list:
        c = self.config
        atol, rtol = TOLERANCE[c.dtype]
        out = [f"decode loop: {c.describe()}, {self.steps} steps in {self.seconds:.1f} s: {self.decode_steps} decode, "
               f"{self.spec_steps} speculative (s=n={c.spec}, {self.tokens_rolled_back} tokens rolled back), "
               f"{self.resets} reset+prefill (n in {list(c.prefill_lengths)})",
               f"  verifications: {self.verified_ok}/{self.verifications} passed (attention vs reference at "
               f"atol {atol} rtol {rtol}, max abs err {self.max_err:.2g}; cache.read() bit-exact vs the mirror)"]
        out += [f"  FAILED {f}" for f in self.failures[:10]]
        out.append(f"  step latency: decode median {_ms(self.decode_ms, 50)} ms, p99 {_ms(self.decode_ms, 99)} ms, "
                   f"max {_ms(self.decode_ms, 100)} ms; speculative median {_ms(self.spec_ms, 50)} ms; "
                   f"prefill median {_ms(self.prefill_ms, 50)} ms")
        half = len(self.decode_ms) // 2
        if half:
            out.append(f"  decode median, first vs second half after warm-up: {_ms(self.decode_ms[:half], 50)} / "
                       f"{_ms(self.decode_ms[half:], 50)} ms")
        out += ["  " + s.line() for s in self.snapshots]
        if not self.complete:
            out.append(f"  INCOMPLETE: stopped after {self.steps} of {c.steps} steps")
            return out
        s = self.snapshots
        out.append(f"  RSS MiB warm-up/middle/end: {s[0].rss_mib:.1f} / {s[1].rss_mib:.1f} / {s[-1].rss_mib:.1f}, "
                   f"growth {self.rss_growth_mib:+.1f} MiB (limit {self.rss_limit_mib:.1f} = {c.rss_pct}% + "
                   f"{c.rss_mib} MiB): {'ok' if self.rss_growth_mib <= self.rss_limit_mib else 'FAIL'}; "
                   f"device objects {'stable' if self.objects_stable else 'CHANGED'}")
        after = [r for step, r in self.trace if step >= c.warmup]
        if after:
            out.append(f"  RSS sampled every {max(1, c.steps // 40)} steps after warm-up (no gc): min {min(after):.1f}, "
                       f"max {max(after):.1f} MiB")
        return out


def _ms(xs, pct) -> str:
    return f"{np.percentile(xs, pct) * 1e3:.3f}" if len(xs) else "-"


def run_decode_soak(cfg: SoakConfig, device=None, progress=None) -> DecodeReport:
    """Phase 1 (see the module docstring). ``progress(step, report)``, if given, is called at each
    memory sample."""
    device = device or vkattn.default_device()
    rep = DecodeReport(cfg, device.name)
    rng = np.random.default_rng(cfg.seed)
    atol, rtol = TOLERANCE[cfg.dtype]
    hq, hkv, d, dv, cap = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.v_head_dim, cfg.capacity
    trace_every = max(1, cfg.steps // 40)
    samples = {cfg.warmup: "after warm-up", cfg.steps // 2: "middle", cfg.steps: "end"}
    cache = vkattn.KVCache(cap, hkv, d, dv, dtype=cfg.dtype, device=device)
    try:
        mirror = HostMirror(cache)
        # plan every call shape up front: after this the loop should allocate nothing
        shapes = sorted({1, *cfg.prefill_lengths, *((cfg.spec,) if cfg.spec_every else ())}, reverse=True)
        for s in shapes:
            cache.plan(hq, s, s)
        # priming pass: fill the cache to capacity once and verify there, so that every page the
        # loop will ever touch (device K/V, the mirror, read()'s and the reference's largest
        # temporaries) is resident before the baseline sample, which then sees only real growth
        # (a plan's first run allocates too, on lavapipe: every call shape runs here at least once)
        i = 0
        while cache.length < cap:
            n = next((s for s in shapes[i % len(shapes):] if cache.length + s <= cap), 1)
            i += 1
            q = rng.standard_normal((hq, n, d), dtype=np.float32)
            k = rng.standard_normal((hkv, n, d), dtype=np.float32)
            v = rng.standard_normal((hkv, n, dv), dtype=np.float32)
            out = cache.forward(q, k, v)
            mirror.append(k, v)
        rep.verifications += 1
        problem = _verify(cache, mirror, q, out, atol, rtol, rep)
        if problem:
            rep.failures.append(f"priming pass (length {cache.length}): {problem}")
        else:
            rep.verified_ok += 1

        t_start = time.perf_counter()
        for step in range(cfg.steps):
            if step == 0 or cache.length + 1 > cap:
                kind, n = "prefill", cfg.prefill_lengths[rep.resets % len(cfg.prefill_lengths)]
                cache.reset()
                mirror.truncate(0)
                rep.resets += 1
            elif cfg.spec_every and step % cfg.spec_every == 0 and cache.length + cfg.spec <= cap:
                kind, n = "spec", cfg.spec
            else:
                kind, n = "decode", 1
            q = rng.standard_normal((hq, n, d), dtype=np.float32)
            k = rng.standard_normal((hkv, n, d), dtype=np.float32)
            v = rng.standard_normal((hkv, n, dv), dtype=np.float32)
            t0 = time.perf_counter()
            out = cache.forward(q, k, v)
            dt = time.perf_counter() - t0
            mirror.append(k, v)
            {"decode": rep.decode_ms, "spec": rep.spec_ms, "prefill": rep.prefill_ms}[kind].append(dt)
            if kind == "decode":
                rep.decode_steps += 1
            elif kind == "spec":
                rep.spec_steps += 1

            if step % cfg.verify_every == 0 or step == cfg.steps - 1:
                rep.verifications += 1
                problem = _verify(cache, mirror, q, out, atol, rtol, rep)
                if problem:
                    rep.failures.append(f"step {step} ({kind}, length {cache.length}): {problem}")
                else:
                    rep.verified_ok += 1

            if kind == "spec":   # reject the tail of the draft, as speculative decoding does
                r = int(rng.integers(1, cfg.spec + 1))
                cache.truncate(cache.length - r)
                mirror.truncate(mirror.length - r)
                rep.tokens_rolled_back += r

            rep.steps = step + 1
            if cache.length != mirror.length:   # O(1) every step; the mirror is useless past this
                rep.failures.append(f"step {step} ({kind}): cache.length {cache.length} != mirror "
                                    f"length {mirror.length}; stopping")
                break
            if rep.steps % trace_every == 0:
                rep.trace.append((rep.steps, rss_mib()))
            if rep.steps in samples:
                if rep.steps == cfg.warmup:   # latency is reported for steps after the warm-up
                    rep.decode_ms.clear(), rep.spec_ms.clear(), rep.prefill_ms.clear()
                rep.snapshots.append(Snapshot.take(samples[rep.steps], rep.steps, cache))
                if progress:
                    progress(rep.steps, rep)
        rep.seconds = time.perf_counter() - t_start
    finally:
        cache.close()
    return rep


def _verify(cache, mirror, q, out, atol, rtol, rep) -> str | None:
    if cache.length != mirror.length:
        return f"cache.length {cache.length} != mirror length {mirror.length}"
    ref = mirror.ref(q)
    err = np.abs(out - ref)
    rep.max_err = max(rep.max_err, float(err.max()))
    bad = err > atol + rtol * np.abs(ref)
    if bad.any():
        return (f"attention off the reference: max abs error {float(err.max()):.3g}, "
                f"{int(bad.sum())} elements beyond tolerance")
    k, v = cache.read()
    L = mirror.length
    if not (np.array_equal(k, mirror.k[:, :L]) and np.array_equal(v, mirror.v[:, :L])):
        return "cache.read() differs from the mirror"
    return None


# ---------------------------------------------------------------------------------- phase 2
@dataclass
class CycleReport:
    cycles: int
    capacity: int
    dtype: str
    limit_mib: float
    before: Snapshot | None = None
    after: Snapshot | None = None
    failures: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def rss_growth_mib(self) -> float:
        return self.after.rss_mib - self.before.rss_mib

    @property
    def ok(self) -> bool:
        return (not self.failures and self.rss_growth_mib <= self.limit_mib
                and self.after.objects == self.before.objects)

    def lines(self) -> list:
        out = [f"create/close: {self.cycles} caches (hq=2 hkv=1 d=8 {self.dtype} capacity={self.capacity}; "
               f"forward one token, check, close) in {self.seconds:.1f} s",
               "  " + self.before.line(), "  " + self.after.line(),
               f"  RSS MiB before/after: {self.before.rss_mib:.1f} / {self.after.rss_mib:.1f}, growth "
               f"{self.rss_growth_mib:+.1f} MiB (limit {self.limit_mib} MiB): "
               f"{'ok' if self.rss_growth_mib <= self.limit_mib else 'FAIL'}; live device objects "
               f"{'unchanged' if self.after.objects == self.before.objects else 'CHANGED'}"]
        out += [f"  FAILED {f}" for f in self.failures[:10]]
        return out


def run_create_close(cycles: int = 200, capacity: int = 4096, dtype: str = "float16", limit_mib: float = 4,
                     device=None, seed: int = 1, warmup: int = 3) -> CycleReport:
    """Phase 2: ``cycles`` times KVCache(capacity, 1 kv head, head_dim 8) -> one-token forward with
    2 query heads (checked against the reference) -> close. ``warmup`` untimed cycles first."""
    device = device or vkattn.default_device()
    rep = CycleReport(cycles, capacity, dtype, limit_mib)
    rng = np.random.default_rng(seed)
    atol, rtol = TOLERANCE[dtype]

    def one(i):
        q = rng.standard_normal((2, 1, 8), dtype=np.float32)
        k = rng.standard_normal((1, 1, 8), dtype=np.float32)
        v = rng.standard_normal((1, 1, 8), dtype=np.float32)
        cache = vkattn.KVCache(capacity, 1, 8, dtype=dtype, device=device)
        try:
            out = cache.forward(q, k, v)
        finally:
            cache.close()
        ref = attention(q, round_to(k, dtype), round_to(v, dtype))
        if not np.all(np.abs(out - ref) <= atol + rtol * np.abs(ref)):
            rep.failures.append(f"cycle {i}: max abs error {float(np.abs(out - ref).max()):.3g}")
        if not cache.closed:
            rep.failures.append(f"cycle {i}: cache not closed")

    for i in range(warmup):
        one(-1 - i)
    rep.before = Snapshot.take("before", 0)
    t0 = time.perf_counter()
    for i in range(cycles):
        one(i)
    rep.seconds = time.perf_counter() - t0
    rep.after = Snapshot.take("after", cycles)
    return rep


# ---------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    try:
        cfg = SoakConfig.from_env()
        device = vkattn.default_device()
    except PerfConfigError as e:
        print(f"perf.soak: {e}", file=sys.stderr)
        return 2
    print(f"device: {device.name}")
    print(f"soak: {cfg.describe()}, {cfg.steps} steps, verify every {cfg.verify_every}, warm-up {cfg.warmup}",
          flush=True)
    rep = run_decode_soak(cfg, device, progress=lambda step, r: print(
        f"  [{r.snapshots[-1].label}: step {step}, RSS {r.snapshots[-1].rss_mib:.1f} MiB]", flush=True))
    print("\n".join(rep.lines()), flush=True)
    ok = rep.ok
    if cfg.cycles:
        crep = run_create_close(cfg.cycles, cfg.cycle_capacity, cfg.dtype, cfg.cycle_rss_mib, device)
        print("\n".join(crep.lines()))
        ok = ok and crep.ok
    print(f"soak: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
