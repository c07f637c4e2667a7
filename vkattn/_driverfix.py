"""Settings for a known driver fault, applied before this process loads any Vulkan driver (and
two faults vkattn avoids by not using what triggers them: :func:`texel_fault`, Mesa's shader
cache mixing llvmpipe's vector widths for texel-fetching pipelines; :func:`coopmat_fault`,
lavapipe's compiler crashing on cooperative matrices away from 256 bits).

**llvmpipe (lavapipe) of Mesa 25 on a CPU with AVX-512.** Mesa 25.0.7's llvmpipe (Debian 13,
LLVM 19) aborts the whole process while compiling some tile-kernel pipelines (``attn_tile``):
``LLVM ERROR: Cannot emit physreg copy instruction``, then ``Fatal Python error: Aborted``. The
fault is in LLVM's x86 back end for the AVX-512 code llvmpipe asks for; no shader-level check can
catch it, so it is avoided before the driver loads: llvmpipe reads its settings once per process,
when it first creates its device. Measured cause, cost and choice: ``docs/platforms.md``. Mesa
22.3 (Debian 12) and Mesa 26.1 (trixie-backports) do not crash and are left alone.

:func:`apply` runs when ``vkattn`` is imported. It acts only where every condition holds: the CPU
has AVX-512 (Linux ``/proc/cpuinfo``), a lavapipe ICD is installed, neither
``LP_NATIVE_VECTOR_WIDTH`` nor ``GALLIUM_OVERRIDE_CPU_CAPS`` is already set, and
``VKATTN_DRIVER_WORKAROUNDS`` is not ``0``. The lavapipe version is read once per installed
driver library in a child process (``_vkinfo.py --json``, a few hundred ms) and remembered under
the vkattn cache directory, keyed by the library's path, size and mtime. Only a process that
imports vkattn before it creates any Vulkan instance is covered.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from ._files import replace_file
from .checks import env_flag

# what apply() sets for an affected llvmpipe (docs/platforms.md: measured against the others)
FIX = {"GALLIUM_OVERRIDE_CPU_CAPS": "avx"}
_KNOBS = ("LP_NATIVE_VECTOR_WIDTH", "GALLIUM_OVERRIDE_CPU_CAPS")
applied: dict = {}          # what this process set, for python -m vkattn devices and the tests


def affected(driver_name: str, driver_info: str) -> bool:
    """True for the llvmpipe versions that crash: Mesa 25.x (measured: 25.0.7, LLVM 19)."""
    m = re.match(r"Mesa (\d+)\.", driver_info or "")
    return driver_name == "llvmpipe" and m is not None and int(m.group(1)) == 25


def texel_fault(name: str, driver_name: str, driver_info: str) -> bool:
    """True where uniform texel buffers must not be bound (vkattn._kp.Backend.texel_buffers):
    llvmpipe of a Mesa newer than 22 running at a vector width other than its CPU's own (the
    width in its device name, against 256 bits where the CPU has AVX and 128 otherwise: set so by
    LP_NATIVE_VECTOR_WIDTH or GALLIUM_OVERRIDE_CPU_CAPS), with Mesa's shader cache on.

    Measured (session 31, Debian 13, Mesa 25.0.7 and 26.1.6, LLVM 19, on an AVX-512 CPU): these
    Mesas keep a texel-fetching pipeline's compiled code in the shader cache under a key that
    does not tell the vector widths apart. A pipeline compiled at 256 bits and loaded by a
    process at 128 kills it with a segmentation fault on its first dispatch (the four-line
    shaders of tests/test_texel.py too); one compiled at 128 and loaded at 256 read garbage (NaN
    in a test_texel_kv result, once). With the cache off (MESA_SHADER_CACHE_DISABLE=true) both
    Mesas ran every texel test at 128 bits and at 256, and with one width only a cache never
    mixes them. Session 30 took the crash for a fault of 128-bit llvmpipe (its CI runs the
    128-bit tests after 256-bit ones on a shared cache). So a process at its CPU's own width
    binds texel buffers (every process on the machine then compiles them at that width: an ARM
    host at 128, not measured); one at another width does not, and its pipelines -- none of
    them fetching from a texel buffer -- are safe to share the cache. Mesa 22.3 caches no
    machine code (it ran them at 128 bits after 256)."""
    m = re.match(r"Mesa (\d+)\.", driver_info or "")
    width = _llvmpipe_width(name, driver_name)
    if m is None or int(m.group(1)) <= 22 or width is None:
        return False
    if os.environ.get("MESA_SHADER_CACHE_DISABLE", "").strip().lower() in ("1", "true", "yes", "y", "t"):
        return False
    return width != _natural_width()


def _llvmpipe_width(name: str, driver_name: str) -> int | None:
    """llvmpipe's vector width in bits, read from its device name (``llvmpipe (LLVM 19.1.7, 512
    bits)``); None for another driver or a name without one."""
    w = re.search(r"(\d+) bits\)", name or "") if driver_name == "llvmpipe" else None
    return None if w is None else int(w.group(1))


def coopmat_fault(name: str, driver_name: str) -> str:
    """Why cooperative matrices must not be compiled on this device ("" where nothing is known
    against them): llvmpipe (lavapipe) at a vector width other than 256 bits.

    Measured (session 42, Debian 13, Mesa 26.1.6, LLVM 19, an Intel CPU with AVX-512): at 256
    bits (subgroup 8) lavapipe offers VK_KHR_cooperative_matrix (8x8x8 shapes, the
    cooperativeMatrix feature) and runs vkattn's kernel; at 512 bits (subgroup 16,
    ``LP_NATIVE_VECTOR_WIDTH=512``, AVX-512 CPUs) it offers the same, but the pipeline of a
    minimal shader -- one 8x8x8 float16 multiply-add, loaded and stored row-major -- killed the
    process while it was created (a bus error; vkattn's self-test: a segmentation fault), with
    or without a required subgroup size; at 128 bits it lists the shapes with the feature off
    (a pipeline built anyway crashed the same way). No shader-level check can catch that, so
    vkattn builds no cooperative-matrix pipeline on llvmpipe away from 256 bits
    (``Device.coopmat_problem`` names this before anything is built: ``python -m vkattn check``
    and ``VKATTN_KERNEL=coopmat`` killed the process at 512 bits before); attn_lane.comp runs
    prefill there as on every CPU driver. The width is read from the device's name (``llvmpipe
    (LLVM 19.1.7, 512 bits)``)."""
    width = _llvmpipe_width(name, driver_name)
    if width is None or width == 256:
        return ""
    return (f"{name!r}: llvmpipe builds cooperative matrices only at 256 bits (subgroup 8); at "
            f"{width} bits its compiler kills the process on them (Mesa 26.1.6, "
            f"vkattn._driverfix.coopmat_fault)")


def _cpu_flags() -> set | None:
    """The CPU's feature flags (Linux /proc/cpuinfo: x86 "flags", ARM "Features"), None where
    unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return set()


def _natural_width() -> int:
    """The vector width llvmpipe picks by itself on this CPU: 256 bits with AVX, else 128 (and
    256 where the flags cannot be read: a narrower width is then taken as set by hand)."""
    flags = _cpu_flags()
    return 256 if flags is None or "avx" in flags else 128


def _avx512() -> bool:
    return "avx512f" in (_cpu_flags() or ())


def _icd_files():
    env = os.environ.get("VK_DRIVER_FILES") or os.environ.get("VK_ICD_FILENAMES")
    if env:
        paths = [Path(p) for p in env.split(os.pathsep) if p]
    else:
        dirs = [os.environ.get("XDG_CONFIG_HOME", str(Path.home() / ".config"))]
        dirs += os.environ.get("XDG_CONFIG_DIRS", "/etc/xdg").split(":") + ["/etc"]
        dirs += [os.environ.get("XDG_DATA_HOME", str(Path.home() / ".local/share"))]
        dirs += os.environ.get("XDG_DATA_DIRS", "/usr/local/share:/usr/share").split(":")
        paths = [Path(d) / "vulkan" / "icd.d" for d in dirs if d]
    add = os.environ.get("VK_ADD_DRIVER_FILES")
    if add:
        paths += [Path(p) for p in add.split(os.pathsep) if p]
    for p in paths:
        if p.is_dir():
            yield from sorted(p.glob("*.json"))
        elif p.is_file():
            yield p


def _lavapipe_libraries() -> list:
    libs = []
    for f in _icd_files():
        try:
            lib = json.loads(f.read_text())["ICD"]["library_path"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if "lvp" not in Path(lib).name:
            continue
        for cand in ([lib] if os.path.isabs(lib) else [str(f.parent / lib)] if "/" in lib else
                     [str(Path(d) / lib) for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib",
                                                   "/usr/local/lib")]):
            if os.path.exists(cand):
                st = os.stat(cand)
                libs.append(f"{os.path.realpath(cand)}:{st.st_size}:{st.st_mtime_ns}")
                break
    return sorted(set(libs))


def _probe() -> list:
    """[(driver_name, driver_info), ...] of this machine's Vulkan devices, from a child process
    that already has the fix's settings (so nothing it does can trip the fault)."""
    env = dict(os.environ, **FIX)
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("_vkinfo.py")), "--json"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=120, check=False).stdout
    data = json.loads(out or b"[]")
    return [(d.get("driver_name", ""), d.get("driver_info", "")) for d in data] if isinstance(data, list) else []


def apply() -> dict:
    """Set :data:`FIX` in ``os.environ`` where this machine's lavapipe is affected; returns what
    it set ({} where nothing)."""
    if not env_flag("VKATTN_DRIVER_WORKAROUNDS", True) or any(k in os.environ for k in _KNOBS):
        return {}
    if not _avx512():
        return {}
    libs = _lavapipe_libraries()
    if not libs:
        return {}
    cache = Path(os.environ.get("VKATTN_CACHE_DIR") or Path.home() / ".cache" / "vkattn") / "driverfix.json"
    key = "|".join(libs)
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if not isinstance(known.get(key), dict):    # not there, or not an entry this code wrote: probe
        known.pop(key, None)
    if key not in known:
        try:
            drivers = _probe()
        except (OSError, ValueError, subprocess.SubprocessError):
            drivers = None
        if drivers is None:                 # unknown: apply (cheap) and do not remember
            hit = True
        else:
            hit = any(affected(n, i) for n, i in drivers)
            known[key] = {"affected": hit, "drivers": [f"{n} {i}" for n, i in drivers if n == "llvmpipe"]}
            replace_file(cache, json.dumps(known, indent=1).encode())
    else:
        hit = bool(known[key].get("affected"))
    if hit:
        os.environ.update(FIX)
        applied.update(FIX)
    return dict(applied)
