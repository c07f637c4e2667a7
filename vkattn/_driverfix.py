"""Settings for a known driver fault, applied before this process loads any Vulkan driver (and
:func:`texel_fault`, a fault vkattn avoids by not using what triggers it).

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
    llvmpipe on vectors narrower than 256 bits (its device name says "128 bits": a CPU without
    AVX, an ARM host, or LP_NATIVE_VECTOR_WIDTH=128) of a Mesa newer than 22. Measured: Mesa
    26.1.6 (trixie-backports, LLVM 19) at 128 bits kills the process with a segmentation fault on
    the first dispatch of any shader that fetches from a texel buffer (tests/test_texel.py's
    four-line ones too), at 256 bits it runs them all; Mesa 22.3 at 128 bits runs them (session
    30). The versions between are not measured, so they are treated as Mesa 26."""
    m = re.match(r"Mesa (\d+)\.", driver_info or "")
    w = re.search(r"(\d+) bits\)", name or "")
    return driver_name == "llvmpipe" and m is not None and int(m.group(1)) > 22 and w is not None \
        and int(w.group(1)) < 256


def _avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return " avx512f" in line
    except OSError:
        pass
    return False


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
    if os.environ.get("VKATTN_DRIVER_WORKAROUNDS", "1") == "0" or any(k in os.environ for k in _KNOBS):
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
            try:
                cache.parent.mkdir(parents=True, exist_ok=True)
                tmp = cache.with_name(f"{cache.name}.{os.getpid()}")
                tmp.write_text(json.dumps(known, indent=1))
                tmp.replace(cache)
            except OSError:
                pass
    else:
        hit = bool(known[key].get("affected"))
    if hit:
        os.environ.update(FIX)
        applied.update(FIX)
    return dict(applied)
