"""Per-device measurements that need the caches: attn_coopmat.comp's self-test and speed probe.

This module sits above the caches (it builds KVCache and PagedKVCache objects to run its cases)
and records its verdicts on the :class:`vkattn.device.Device`, which only stores them: the device
knows its limits, features and verdicts and builds no cache. ``import vkattn`` registers the two
measurements with vkattn.device (``register_measure``); the planner asks the device for a verdict
(``Device.coopmat_problem``, ``Device.coopmat_pays``) and the device runs the registered
measurement the first time, under its lock.

Verdicts are cached on disk (``cache_dir()/measures-<device>.json``) per device, driver version and
shader build (the compiler's version, every kernel's source and the case list), so a process does
not pay them again; ``python -m vkattn check --remeasure`` (or :func:`remeasure`) runs them afresh,
and ``VKATTN_MEASURE_CACHE=0`` neither reads nor writes the file.

The self-test (:data:`COOPMAT_CASES`) is built to exercise what a GPU can get wrong and lavapipe
cannot show: on a 16x16x16 device its long cases give each workgroup many key blocks with a
running maximum that grows block after block (the rescale of O and of the sums), split the keys
at least three ways (the split-K merge of the last workgroup of a tile), and the variant,
rotary and paged cases run every score rule of attn_common.glsl on the kernel; each result is
checked against the numpy reference with the library's tolerances, and a failure names its case.
The speed probe checks its 512-row result against the reference too before it times anything.
"""
from __future__ import annotations

import hashlib
import json
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from . import compiler, reference, tuning
from ._files import replace_file
from .checks import env_flag
from ._attn import RoPE
from .cache import KVCache
from .device import register_measure
from .paged import PagedKVCache
from .tuning import COOPMAT_PROBE, COOPMAT_PROBE_ROUNDS, kernel_for, kernel_forced

CASES_VERSION = 3               # bump when the cases change: cached verdicts of other versions are stale
LONG_KEYS = 1593                # the long cases' keys: capacity 1600 splits >= 3 ways (tuning.coopmat_config)
MIN_LONG_SPLITS = 3


class CaseFailed(Exception):
    """A self-test case's result differs from the reference (its message names what)."""


def _compare(name: str, out, ref, dtype: str) -> None:
    atol, rtol = reference.TOLERANCE[dtype]
    bad = np.abs(out - ref) > atol + rtol * np.abs(ref)
    if out.shape != ref.shape or not np.all(np.isfinite(out)) or bad.any():
        worst = float(np.nanmax(np.abs(out - ref))) if out.shape == ref.shape else float("nan")
        raise CaseFailed(f"{name}: wrong results ({int(bad.sum())} of {bad.size} values off, "
                         f"max error {worst:.3g}, tolerance {atol} + {rtol} |ref|)")


def _qkv(rng, hkv: int, group: int, n: int, d: int, dv: int):
    q = rng.standard_normal((hkv * group, n, d)).astype(np.float32)
    k = rng.standard_normal((hkv, n, d)).astype(np.float32)
    v = rng.standard_normal((hkv, n, dv)).astype(np.float32)
    return q, k, v


def _case_short(dev, rng, dtype, hkv, group, d, dv, n0, n1):
    """A prefill from empty, then a chunk over it (odd head dims, GQA)."""
    with KVCache(n0 + n1, hkv, d, dv, dtype=dtype, device=dev) as cache:
        for n in (n0, n1):
            q, k, v = _qkv(rng, hkv, group, n, d, dv)
            out = cache.forward(q, k, v)
            ks, vs = cache.read()
            _compare(f"{dtype} {n} rows over {cache.length - n} cached", out, reference.attention(q, ks, vs), dtype)


def _rising_keys(rng, hkv: int, n: int, d: int, qdir):
    """Keys whose scores against queries near ``qdir`` grow with the position: every key block
    raises the running maximum, so the kernel rescales O and the sums block after block."""
    k = 0.5 * rng.standard_normal((hkv, n, d))
    ramp = np.linspace(0.0, 3.0, n)[None, :, None]
    return (k + ramp * qdir[:, None, :]).astype(np.float32)


def _case_long(dev, rng, dtype, hkv=1, group=3, d=64, rows=7):
    """A chunk of ``rows`` over LONG_KEYS keys with a rising maximum, split >= 3 ways."""
    with KVCache(LONG_KEYS + rows, hkv, d, dtype=dtype, device=dev) as cache:
        qdir = rng.standard_normal((hkv, d)) / np.sqrt(d)
        k = _rising_keys(rng, hkv, LONG_KEYS, d, qdir)
        v = rng.standard_normal((hkv, LONG_KEYS, d)).astype(np.float32)
        cache.append(k, v)
        q = (np.repeat(qdir, group, axis=0)[:, None, :] * 2.0 * np.sqrt(d)
             + 0.3 * rng.standard_normal((hkv * group, rows, d))).astype(np.float32)
        kn, vn = _rising_keys(rng, hkv, rows, d, qdir), rng.standard_normal((hkv, rows, d)).astype(np.float32)
        out = cache.forward(q, kn, vn)
        plans = [p for p in cache._plans.values() if getattr(p, "cfg", None) is not None]
        cfg = plans[-1].cfg
        if cfg.kernel != "coopmat" or cfg.splits < MIN_LONG_SPLITS:
            raise CaseFailed(f"{dtype} long: planned {cfg.kernel} with {cfg.splits} splits, not "
                             f"attn_coopmat.comp with >= {MIN_LONG_SPLITS} (the case tests nothing)")
        ks, vs = cache.read()
        _compare(f"{dtype} {rows} rows over {LONG_KEYS} keys, rising max, {cfg.splits} splits", out,
                 reference.attention(q, ks, vs), dtype)


def _case_variants(dev, rng, dtype="float16", hkv=2, group=2, d=32, past=301, rows=9):
    """window + sinks, softcap, ALiBi and a mask (some -inf) in one call."""
    hq, total = hkv * group, past + rows
    with KVCache(total, hkv, d, dtype=dtype, device=dev) as cache:
        q, k, v = _qkv(rng, hkv, group, total, d, d)
        cache.append(k[:, :past], v[:, :past])
        mask = (0.5 * rng.standard_normal((rows, total))).astype(np.float32)
        mask[rng.random((rows, total)) < 0.05] = -np.inf
        kw = dict(window=97, n_sink=5, softcap=7.5, alibi_slopes=np.linspace(0.01, 0.2, hq).astype(np.float32),
                  mask=mask)
        out = cache.forward(q[:, past:], k[:, past:], v[:, past:], **kw)
        ks, vs = cache.read()
        _compare(f"{dtype} variants (window 97 + 5 sinks, softcap, ALiBi, mask)", out,
                 reference.attention(q[:, past:], ks, vs, **kw), dtype)


def _case_rope(dev, rng, dtype="float16", hkv=1, group=4, d=48, past=150, rows=11):
    """Keys rotated as stored, queries rotated in the kernel (rope_q), partial rotary dims."""
    rope = RoPE(style="neox", base=10000.0, rotary_dim=32)
    total = past + rows
    with KVCache(total, hkv, d, dtype=dtype, device=dev, rope=rope) as cache:
        q, k, v = _qkv(rng, hkv, group, total, d, d)
        cache.append(k[:, :past], v[:, :past])
        out = cache.forward(q[:, past:], k[:, past:], v[:, past:], rope_q=True)
        ks, vs = cache.read()
        qr = reference.rope(q[:, past:], np.arange(past, total), base=rope.base, rotary_dim=rope.rotary_dim,
                            style=rope.style)
        _compare(f"{dtype} rotary (neox, 32 of 48 dims, rotated q)", out, reference.attention(qr, ks, vs), dtype)


def _case_paged(dev, rng, dtype="int8", hkv=2, group=3, d=40, block=16):
    """Two sequences of a block pool (tables, different lengths), one batched chunk each."""
    pasts, rows = (37, 70), (5, 9)
    with PagedKVCache(16, block, hkv, d, dtype=dtype, device=dev) as cache:
        seqs = [cache.add_sequence() for _ in pasts]
        data = [_qkv(rng, hkv, group, p + r, d, d) for p, r in zip(pasts, rows)]
        for sid, p, (q, k, v) in zip(seqs, pasts, data):
            cache.append([sid], k[:, :p], v[:, :p], n_new=[p])
        q = np.concatenate([q[:, p:] for p, (q, _, _) in zip(pasts, data)], axis=1)
        k = np.concatenate([k[:, p:] for p, (_, k, _) in zip(pasts, data)], axis=1)
        v = np.concatenate([v[:, p:] for p, (_, _, v) in zip(pasts, data)], axis=1)
        out = cache.forward(seqs, q, k, v, n_new=list(rows))
        at = 0
        for sid, r in zip(seqs, rows):
            ks, vs = cache.read(sid)
            _compare(f"{dtype} paged sequence of {cache.length(sid)}", out[:, at:at + r],
                     reference.attention(q[:, at:at + r], ks, vs), dtype)
            at += r


# (name, function(device, rng)): run in this order, each on attn_coopmat.comp
COOPMAT_CASES = (
    ("float16 prefill + chunk, d40, 3 q heads per kv head",
     lambda dev, rng: _case_short(dev, rng, "float16", 2, 3, 40, 40, 19, 7)),
    ("int8 prefill + chunk, d24/dv16, 4 q heads per kv head",
     lambda dev, rng: _case_short(dev, rng, "int8", 1, 4, 24, 16, 11, 5)),
    ("float16 long chunk: many key blocks, rising max, split-K", lambda dev, rng: _case_long(dev, rng, "float16")),
    ("int8 long chunk: many key blocks, rising max, split-K", lambda dev, rng: _case_long(dev, rng, "int8")),
    ("fp8_e4m3 prefill + chunk, d40, 2 q heads per kv head",
     lambda dev, rng: _case_short(dev, rng, "fp8_e4m3", 2, 2, 40, 40, 19, 7)),
    ("fp8_e5m2 long chunk: many key blocks, rising max, split-K", lambda dev, rng: _case_long(dev, rng, "fp8_e5m2")),
    ("float16 window + sinks, softcap, ALiBi, mask", lambda dev, rng: _case_variants(dev, rng)),
    ("float16 RoPE (keys stored rotated, q rotated in the kernel)", lambda dev, rng: _case_rope(dev, rng)),
    ("int8 paged batch", lambda dev, rng: _case_paged(dev, rng)),
)


def coopmat_self_test(device) -> str:
    """Every case of COOPMAT_CASES on attn_coopmat.comp: "" when all pass, else the first
    failure, naming its case."""
    rng = np.random.default_rng(22)
    with kernel_forced("coopmat"):
        for name, case in COOPMAT_CASES:
            try:
                case(device, rng)
            except CaseFailed as e:
                return f"its self-test case '{name}' failed: {e}"
            except Exception as e:      # noqa: BLE001 -- any failure is the verdict, named
                return f"its self-test case '{name}' failed: {type(e).__name__}: {e}"
    return ""


def coopmat_speed_probe(device) -> dict:
    """The speed probe: a float16 prefill from empty of tuning.COOPMAT_PROBE on attn_coopmat.comp
    and on the device's other kernel (tuning.kernel_for), one cache each (a cache keeps the plans
    it built), a warm-up round whose results are checked against the reference, then
    COOPMAT_PROBE_ROUNDS alternated timed rounds; the medians, device time from timestamp queries
    where the device has them, else wall time. {"coopmat": ms, "other": kernel, kernel: ms,
    "clock": "device" or "wall"}, or {"error": why}."""
    hkv, group, d, rows = COOPMAT_PROBE
    with kernel_forced(""):
        other = kernel_for(device)
    rng = np.random.default_rng(22)
    k, v = (rng.standard_normal((hkv, rows, d), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((hkv * group, rows, d), dtype=np.float32)
    caches = {}
    try:
        for kernel in ("coopmat", other):
            caches[kernel] = KVCache(rows, hkv, d, dtype="float16", device=device, timestamps=True)
            caches[kernel].append(k, v)
        ks, vs = caches["coopmat"].read()
        ref = reference.attention(q, ks, vs)
        times = {kernel: [] for kernel in caches}
        for rnd in range(COOPMAT_PROBE_ROUNDS + 1):      # round 0 builds the plans, warms up, checks
            for kernel, cache in caches.items():
                with kernel_forced(kernel):
                    t0 = time.perf_counter()
                    out = cache.attend(q)
                    wall = (time.perf_counter() - t0) * 1e3
                ran = [p.cfg.kernel for p in cache._plans.values() if getattr(p, "cfg", None) is not None]
                if ran[-1] != kernel:
                    return {"error": f"its call ({hkv * group}/{hkv} heads, d{d}, {rows} rows) went to {ran[-1]}, "
                                     f"not {kernel}"}
                if rnd == 0:
                    _compare(f"the probe's prefill on {kernel}", out, ref, "float16")
                    continue
                ops = [ms for op, ms in cache.last_timings() if not op.startswith(("upload ", "download "))]
                times[kernel].append(sum(ops) if ops else wall)
        found = {kernel: float(np.median(t)) for kernel, t in times.items()}
        return dict(found, other=other, clock="device" if caches[other].timestamps else "wall")
    except Exception as exc:        # noqa: BLE001 -- any failure is the verdict
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        for cache in caches.values():
            cache.close()


# ------------------------------------------------------------------------------ on disk

def _build_key() -> str:
    """The shader build the verdicts hold for: compiler, every kernel source, the build switches
    that change attn_coopmat.comp's pipelines (VKATTN_COOPMAT_TILE, _FIXED_TRIPS, _STAGE_BATCH:
    a run with other switches measures its own build), the planner's code (tuning.py, _attn.py:
    how the kernels are planned), the cases."""
    h = hashlib.sha256(compiler.compiler_version().encode())
    h.update(f"cases {CASES_VERSION} {COOPMAT_PROBE} {COOPMAT_PROBE_ROUNDS}".encode())
    h.update(f"switches {tuning.coopmat_tile()} {tuning.coopmat_fixed_trips()} {tuning.coopmat_stage_batch()}".encode())
    here = Path(__file__).resolve().parent
    for name in ("tuning.py", "_attn.py"):
        h.update(here.joinpath(name).read_bytes())
    src = compiler.shader_dir()
    for name in sorted(p.name for p in src.iterdir() if p.name.endswith((".comp", ".glsl"))):
        h.update(name.encode())
        h.update(src.joinpath(name).read_bytes())
    return h.hexdigest()[:24]


def _path(device):
    return compiler.cache_dir() / f"measures-{hashlib.sha256(device.key.encode()).hexdigest()[:16]}.json"


def _enabled() -> bool:
    return env_flag("VKATTN_MEASURE_CACHE", True)


def _load(device) -> dict:
    try:
        found = json.loads(_path(device).read_text())
    except (OSError, ValueError):
        return {}
    entry = found.get(_build_key()) if isinstance(found, dict) else None
    return entry if isinstance(entry, dict) else {}


def _store(device, name: str, value) -> None:
    path = _path(device)
    try:
        found = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(found, dict):
            found = {}
    except (OSError, ValueError):
        found = {}
    key = _build_key()
    entry = found.get(key) if isinstance(found.get(key), dict) else {}
    entry[name] = value
    entry["device"] = device.key
    entry[f"{name}_when"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    found = {key: entry}                # verdicts of other builds are stale: dropped
    replace_file(path, json.dumps(found, indent=1).encode())     # (a read-only home: measured per process)


def _valid_speed(v) -> bool:
    """A stored speed probe's figures as coopmat_speed_probe returns them (errors are not stored)."""
    num = (int, float)
    return (isinstance(v, dict) and isinstance(v.get("coopmat"), num) and isinstance(v.get("other"), str)
            and isinstance(v.get(v["other"]), num))


# what a stored value of each measure must be to be taken: anything else (a damaged file, another
# version's layout) is measured again (a speed entry without "other" raised KeyError in the planner)
_VALID = {"coopmat_self_test": lambda v: isinstance(v, str), "coopmat_speed": _valid_speed}


def _cached(name: str, run):
    valid = _VALID.get(name, lambda v: True)

    def measure(device, fresh: bool = False):
        if _enabled() and not fresh:
            entry = _load(device)
            if name in entry and valid(entry[name]):
                return entry[name]
        value = run(device)
        if _enabled() and not (isinstance(value, dict) and value.get("error")):
            _store(device, name, value)
        return value
    measure.__name__ = f"measure_{name}"
    return measure


register_measure("coopmat_self_test", _cached("coopmat_self_test", coopmat_self_test))
register_measure("coopmat_speed", _cached("coopmat_speed", coopmat_speed_probe))


def remeasure(device) -> dict:
    """Runs the device's measurements afresh (not from the disk cache) and records them:
    {"coopmat_self_test": verdict, "coopmat_speed": figures or None where the kernel cannot run}."""
    device.forget_measures()
    with device.fresh_measures():
        problem = device.coopmat_problem()
        speed = device.coopmat_speed() if not problem else None
    return {"coopmat_self_test": device._coopmat_test_result, "coopmat_speed": speed}
