"""The only module that talks to Kompute (``kp``).

Everything device-side in vkattn is one of three things:

* :class:`Buffer`   -- a flat uint32/float32 device buffer (``kp.Tensor``); host-visible ones have
  a mapped staging copy exposed as a numpy view.
* :class:`Program`  -- a compute pipeline bound to fixed buffers, workgroup grid and spec constants
  (``kp.Algorithm``); built once.
* :class:`Recording` -- an ordered list of uploads, dispatches and downloads recorded once into a
  ``kp.Sequence`` and re-evaluated every step.

Ordering. kp 0.9's Python API records a transfer->shader barrier before every dispatch and a
shader->transfer barrier before every download, but nothing between two dispatches. So a recording
is correct only if no dispatch touches a buffer that an earlier dispatch of the same recording wrote
(read-after-write, write-after-write) or read and it now writes (write-after-read), unless a download
sits in between; and no upload overwrites a buffer an earlier dispatch of the recording used, unless
a download sits in between. What a download orders: its barrier's buffer range limits only the
*memory* dependency (availability of that buffer's shader writes), while the execution dependency
of a pipeline barrier covers every earlier command at its source stage. So a download followed by
the transfer->shader barrier of the next dispatch chains (through the transfer stage) into an
execution dependency from every earlier dispatch to every later dispatch or upload: enough for a
write-after-read on any buffer, which needs no memory dependency. A read or write after a
dispatch's write needs that very buffer downloaded in between (its shader writes made available
and then visible to the later access). :class:`Recording` checks these rules while recording and
raises :class:`SyncHazardError`, so every recorded sequence is race-free by construction on any
Vulkan device, not only on lavapipe (which serialises everything). Separate evaluations are
ordered by kp's fence wait plus the next submission.

Host memory. Where the device's host-visible memory is its own (``direct``: lavapipe, integrated
GPUs -- the first host-visible, host-coherent memory type kp would pick is device-local), host-
visible buffers are kp "host" tensors: the numpy view is the memory the shaders read and write, so
an upload records nothing (the host's writes before the submission are visible to it) and a
download records only a barrier from the shaders' writes to the host's reads. A downloaded direct
buffer must then not be written again later in the same recording (the host would read the later
value, not the one at the download): SyncHazardError. Elsewhere (discrete GPUs) they are kp
"device" tensors with a staging copy, copied by uploads and downloads as recorded.
``VKATTN_HOST_MEMORY=staging`` forces the staging copies anywhere (CI runs the parity tests so, to
keep that path tested on lavapipe), ``direct`` forces host tensors (a discrete GPU's shaders then
read system memory over the bus: for tests only).

Barriers (kp built with scripts/kp-0.9.0-features.patch, which exposes kp.OpMemoryBarrier):
:meth:`Recording.barrier` records a buffer memory barrier from shader and transfer writes to
shader and transfer reads and writes on the given buffers, at the compute and transfer stages;
its execution dependency orders every earlier dispatch before every later command, and its memory
dependency makes those buffers' writes visible. ``dispatch(prog, barriers=True)`` inserts one
wherever the rules above would refuse the dispatch (on the buffers concerned), so one recording
can chain any number of dependent dispatches -- a model's layers, vkattn's calls and a caller's
own kp algorithms -- in one submission (vkattn.graph). With a plain kp, :data:`HAS_BARRIER` is
False and such recordings are refused (SyncHazardError) as before.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import weakref

import numpy as np

try:
    import kp
except ImportError as e:    # pip cannot build kp from its sdist here (its CMake downloads the Vulkan headers)
    raise ImportError(
        f"vkattn needs Kompute's Python module kp 0.9.0, built against the system Vulkan headers ({e}). From a "
        f"clone of vkattn, install both into this environment with:  bash scripts/install.sh {sys.prefix}  "
        f"(or: make install VENV={sys.prefix})") from e

from .compiler import first_build, log
from .errors import SyncHazardError

_DTYPES = {np.dtype(np.uint32), np.dtype(np.float32)}
HAS_BARRIER = hasattr(kp, "OpMemoryBarrier")
# the patched kp's Sequence.eval_async() submits and returns (kp 0.9.0's evaluated and waited) and
# Sequence.is_done() reads the fence; with another kp, Recording.submit waits as run() does
HAS_ASYNC = hasattr(getattr(kp, "Sequence", None), "is_done")
# Vulkan flags of Recording.barrier: VK_ACCESS_SHADER_READ/WRITE, TRANSFER_READ/WRITE;
# VK_PIPELINE_STAGE_COMPUTE_SHADER | TRANSFER
_SRC_ACCESS = 0x40 | 0x1000
_DST_ACCESS = 0x20 | 0x40 | 0x800 | 0x1000
_STAGES = 0x800 | 0x1000
# a direct buffer's download: shader and transfer writes -> the host's reads (VK_ACCESS_HOST_READ,
# VK_PIPELINE_STAGE_HOST) as well as every later command (as any barrier)
_HOST_READ, _HOST_STAGE = 0x2000, 0x4000
HOST_MEMORY_MODES = ("auto", "staging", "direct")
# pipelines a device keeps built after their last program is destroyed (Backend.keep_pipeline):
# every kernel variant a workload uses, several cache shapes and formats over. A CPU driver keeps
# fewer: lavapipe's machine code is about 3.7 MiB a pipeline (25 kept: 92 MiB more RSS, session 29),
# and a model's caches use a handful
PIPELINES_KEPT = 64
PIPELINES_KEPT_SOFTWARE = 16


def host_memory_mode(local: bool) -> bool:
    """Whether host-visible buffers are direct (module docstring) on a device whose first
    host-coherent memory type is device-local (``local``), after ``VKATTN_HOST_MEMORY``."""
    mode = os.environ.get("VKATTN_HOST_MEMORY", "auto").strip().lower() or "auto"
    if mode not in HOST_MEMORY_MODES:
        raise ValueError(f"VKATTN_HOST_MEMORY={mode!r}: expected one of {', '.join(HOST_MEMORY_MODES)}")
    if not HAS_BARRIER:         # a direct download is a barrier to the host: the patched kp only
        return False
    return mode == "direct" or (mode == "auto" and local)


def spin_seconds() -> float:
    """VKATTN_SPIN_US: how long a wait for the device polls its fence before it blocks in
    vkWaitForFences, in microseconds (unset or 0: it blocks at once, the default); a bad value is
    a ValueError naming the variable. Polling trades a host core for the driver's wake-up latency.
    On lavapipe (2 cores, perf/RESULTS.md session 41) a small call gains (a decode at L=16, 9/3
    heads: 0.69-0.75x the time) but work that needs every core loses (a 30-layer graph 1.5x, a
    decode at L=4096 1.3-1.9x): its worker threads run on the cores the poll takes. On a GPU it is
    untimed yet (perf/gpu_session.sh's overhead step runs both)."""
    raw = os.environ.get("VKATTN_SPIN_US", "").strip()
    if not raw:
        return 0.0
    try:
        us = int(raw)
    except ValueError:
        us = -1
    if us < 0:
        raise ValueError(f"VKATTN_SPIN_US={raw!r}: expected microseconds, an integer >= 0")
    return us * 1e-6


class Backend:
    """One ``kp.Manager`` on one physical device."""

    def __init__(self, index: int, device_key: str = "", software: bool = False, direct: bool = False,
                 max_texels: int = 0):
        self.index = index
        # uniform texel buffers (the patched kp's set_texel_formats): a binding a shader declares as
        # a (u)samplerBuffer is bound as one, a view of at most max_texels texels (the device's
        # maxTexelBufferElements)
        self.max_texels = int(max_texels)
        self.direct = bool(direct)      # host-visible buffers are kp host tensors (module docstring)
        self.device_key = device_key or f"device {index}"
        self.software = software
        self.spin_s = spin_seconds()
        self._mgr = kp.Manager(index)
        # kp built with scripts/kp-0.9.0-features.patch: the optional features it enabled (each only
        # where the device offers it) and required subgroup sizes; a plain kp 0.9: neither
        self.features = frozenset(self._mgr.enabled_features()) if hasattr(self._mgr, "enabled_features") \
            else frozenset()
        self.can_pin = hasattr(self._mgr, "set_pipeline_subgroup_size")
        self.texel_buffers = hasattr(self._mgr, "set_texel_formats") and self.max_texels > 0
        # the patched kp shares one VkPipeline among all programs of the same SPIR-V, spec
        # constants and layout on this device: a model's layers, caches and plans build each once
        self.shares_pipelines = hasattr(self._mgr, "shared_pipeline_count")
        # one lock per device: every cache on it runs its plans under it, so plans may share the
        # scratch buffers of shared_buffer (inputs written, dispatched, outputs copied out, all
        # inside one locked call). Every evaluation but a graph's submission waits for the device
        # there (kp releases the GIL meanwhile), so little is serialised that the device's one
        # queue would not serialise anyway.
        self.lock = DeviceLock(self)
        self._shared = weakref.WeakValueDictionary()    # holders keep them alive, not the registry
        # the pipelines kept built after their last program goes (keep_pipeline): key -> a pin
        # algorithm over a 1-word tensor, least recently asked for first
        self._pins: dict = {}
        self._pin_tensor = None
        self._pin_lock = threading.Lock()
        self.keep_pipelines = PIPELINES_KEPT_SOFTWARE if software else PIPELINES_KEPT
        # a recording submitted without waiting (vkattn.graph): every later run waits for it first
        self.pending = None

    def wait_pending(self) -> None:
        """Wait for a recording submitted without waiting (call under :attr:`lock`)."""
        if self.pending is not None:
            self.pending.wait()

    def pipeline_count(self) -> int | None:
        """Distinct pipelines alive on this device (patched kp), None with a plain kp."""
        return self._mgr.shared_pipeline_count() if self.shares_pipelines and self._mgr is not None else None

    def buffer(self, size: int, dtype=np.uint32, host_visible: bool = True, name: str = "") -> "Buffer":
        return Buffer(self, size, dtype, host_visible, name)

    def program(self, spirv: bytes, bindings, groups, spec, writes=(), name: str = "",
                subgroup: tuple = (0, False)) -> "Program":
        """``subgroup``: (required subgroup size, full subgroups) of the pipeline, (0, False) for the
        driver's choice; a size needs a patched kp and the device's subgroupSizeControl, full
        subgroups its computeFullSubgroups (ValueError otherwise, nothing built). A binding the
        shader reads as a texel buffer is bound as one of four words a texel (:meth:`texel_formats`)."""
        return Program(self, spirv, bindings, groups, spec, writes, name, subgroup)

    def shared_buffer(self, size: int, dtype=np.float32, host_visible: bool = True, name: str = "") -> "Buffer":
        """The device's buffer for (name, size, dtype, host_visible), made on first request and
        handed to every later one: scratch that a plan fills, uses and reads back within one call
        made under :attr:`lock` (the per-plan q/out/lse/partials of every cache and layer). Each
        holder calls ``destroy()`` once; the last one frees it."""
        key = (name, int(max(size, 1)), np.dtype(dtype).str, bool(host_visible))
        buf = self._shared.get(key)
        if buf is None or buf._t is None:
            buf = self._shared[key] = Buffer(self, size, dtype, host_visible, name)
            buf._shared_key, buf._holders = key, 0
        buf._holders += 1
        return buf

    def texel_formats(self, spirv: bytes, nbytes: list, name: str, words: dict | None = None) -> list:
        """The kp texel formats of a program's bindings (``[]``: all storage buffers): a binding the
        shader declares as a (u|i)samplerBuffer is a uniform texel buffer of four 32-bit components
        per texel, or one where ``words`` maps its index to 1. ``nbytes``: each bound buffer's size.
        ValueError where the kp or the device cannot (the patched kp, maxTexelBufferElements) or a
        buffer holds more texels than the device's limit."""
        want, texel = _spirv_bindings(spirv)
        words = dict(words or {})
        stray = sorted(set(words) - set(texel))
        if stray:
            raise ValueError(f"{name}: texel words given for bindings {stray}, which the shader does not read "
                             f"as texel buffers")
        if not texel:
            return []
        if not self.texel_buffers:
            raise ValueError(f"{name}: the shader reads bindings {sorted(texel)} as texel buffers, which need kp "
                             f"built with scripts/kp-0.9.0-features.patch and the device's maxTexelBufferElements")
        formats = [0] * want
        for i, fmt in texel.items():
            per = words.get(i, 4)
            if per not in (1, 4):
                raise ValueError(f"{name}: texel words of binding {i}: 1 or 4, got {per!r}")
            n = nbytes[i] // (4 * per) if i < len(nbytes) else 0
            if n > self.max_texels:
                raise ValueError(f"{name}: binding {i} is {n} texels, past the device's maxTexelBufferElements "
                                 f"{self.max_texels}")
            formats[i] = fmt - (_TEXEL_ONE_WORD if per == 1 else 0)
        return formats

    def algorithm(self, tensors: list, spirv: bytes, groups, spec, push, formats=(), subgroup=(0, False)):
        """A kp algorithm over ``tensors`` with the texel ``formats`` of :meth:`texel_formats` and
        the pipeline's (required subgroup size, full subgroups): the one place that applies the
        patched kp's per-pipeline manager settings, and resets them after."""
        size, full = subgroup
        if size or full:
            self._mgr.set_pipeline_subgroup_size(size, full)
        if formats:
            self._mgr.set_texel_formats(list(formats))
        try:
            return self._mgr.algorithm(tensors, spirv, [int(g) for g in groups], spec, push)
        finally:
            if formats:
                self._mgr.set_texel_formats([])
            if size or full:
                self._mgr.set_pipeline_subgroup_size(0, False)

    def recording(self) -> "Recording":
        return Recording(self)

    def keep_pipeline(self, spirv: bytes, nbind: int, spec: np.ndarray, subgroup: tuple, formats=()) -> None:
        """Keep the pipeline of (spirv, binding count, spec constants, subgroup settings, texel
        formats) built
        after its last program is destroyed: a pin algorithm that shares it, bound to a 1-word
        tensor and never dispatched. The patched kp frees a pipeline with its last holder, and a
        new cache or plan of a shape that went would build it again (lavapipe JITs it anew: about
        0.2 s for a KVCache's prefill and decode pipelines). The :attr:`keep_pipelines` (at most)
        asked for most recently stay (PIPELINES_KEPT; PIPELINES_KEPT_SOFTWARE on a CPU driver); a
        plain kp shares nothing and keeps nothing. A pin the driver refuses to make (out of
        descriptor pools, say) is logged and skipped: keeping is an optimisation, the program
        stands."""
        if not self.shares_pipelines or self.keep_pipelines <= 0:
            return
        key = (spirv, int(nbind), spec.tobytes(), tuple(subgroup), tuple(formats))
        with self._pin_lock:
            pin = self._pins.pop(key, None)
            if pin is None:
                try:
                    if self._pin_tensor is None:    # one texel of any format a texel binding uses
                        self._pin_tensor = self._mgr.tensor_t(np.zeros(4, np.uint32),
                                                              tensor_type=kp.TensorTypes.storage)
                    pin = self.algorithm([self._pin_tensor] * int(nbind), spirv, (1, 1, 1), spec,
                                         np.zeros(0, np.uint32), formats, subgroup)
                except RuntimeError as e:
                    log.debug("vkattn: a pipeline not kept (%s)", e)
                    return
            self._pins[key] = pin                   # most recent last
            while len(self._pins) > self.keep_pipelines:
                self._pins.pop(next(iter(self._pins))).destroy()

    def release_pipelines(self) -> int:
        """Let go of the kept pipelines (keep_pipeline): each is destroyed unless a program still
        holds it. Returns how many were kept."""
        with self._pin_lock:
            pins, self._pins = self._pins, {}
            for pin in pins.values():
                pin.destroy()
            if self._pin_tensor is not None:
                self._pin_tensor.destroy()
                self._pin_tensor = None
        return len(pins)

    def close(self) -> None:
        if self._mgr is not None:
            with self.lock:             # a graph submitted without waiting finishes first
                self.release_pipelines()
                self._mgr.destroy()
                self._mgr = None


class DeviceLock:
    """A backend's lock (re-entrant): whoever takes it waits first for a recording submitted
    without waiting (:attr:`Backend.pending`, vkattn.graph), so no host call writes memory that
    a running submission reads or reads what it has not written yet -- with direct host memory
    the host's numpy views are the device's memory itself."""

    __slots__ = ("_lock", "_backend")

    def __init__(self, backend: "Backend"):
        self._lock, self._backend = threading.RLock(), backend

    def __enter__(self):
        self._lock.acquire()
        rec = self._backend.pending
        if rec is not None:
            try:
                rec.wait()
            except BaseException:
                self._lock.release()
                raise
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    @property
    def bare(self) -> threading.RLock:
        """The lock without the wait for a pending recording: for reading its state."""
        return self._lock


class Buffer:
    """A device buffer of ``size`` elements (uint32 or float32).

    ``host_visible`` buffers (kp "device" tensors) carry a staging copy: :meth:`view` is a numpy
    view of it, :meth:`Recording.upload` copies it to the device, :meth:`Recording.download` back;
    on a ``direct`` backend they are kp "host" tensors and :meth:`view` is the memory itself
    (module docstring). Others (kp "storage" tensors) live on the device only and cost no host
    memory.
    """

    def __init__(self, backend: Backend, size: int, dtype, host_visible: bool, name: str):
        dtype = np.dtype(dtype)
        if dtype not in _DTYPES:
            raise TypeError(f"buffer dtype must be uint32 or float32, got {dtype}")
        self.size = int(max(size, 1))
        self.dtype = dtype
        self.nbytes = self.size * 4
        self.host_visible = host_visible
        self.direct = host_visible and backend.direct
        self.name = name
        self._backend, self._shared_key, self._holders = backend, None, 0
        kind = kp.TensorTypes.storage if not host_visible else \
            kp.TensorTypes.host if self.direct else kp.TensorTypes.device
        self._t = backend._mgr.tensor_t(np.zeros(self.size, dtype), tensor_type=kind)
        self._view = self._t.data() if host_visible else None

    def view(self) -> np.ndarray:
        if self._view is None:
            raise RuntimeError(f"buffer {self.name!r} is device-only")
        return self._view

    def destroy(self) -> None:
        if self._shared_key is not None:          # Backend.shared_buffer: the last holder frees it
            self._holders -= 1
            if self._holders > 0:
                return
            if self._backend._shared.get(self._shared_key) is self:
                del self._backend._shared[self._shared_key]
        self._view = None
        if self._t is not None:
            self._t.destroy()
            self._t = None

    def __repr__(self) -> str:
        return f"Buffer({self.name!r}, {self.size} x {self.dtype})"


class Program:
    """A compute pipeline: SPIR-V + bound buffers + fixed grid + uint32 spec constants."""

    def __init__(self, backend, spirv, bindings, groups, spec, writes, name, subgroup=(0, False)):
        self.name = name
        size, full = int(subgroup[0]), bool(subgroup[1])
        if size and not (backend.can_pin and "subgroupSizeControl" in backend.features):
            raise ValueError(f"{name}: subgroup: a required subgroup size needs kp with "
                             f"scripts/kp-0.9.0-features.patch and the subgroupSizeControl feature")
        if full and not (backend.can_pin and "computeFullSubgroups" in backend.features):
            raise ValueError(f"{name}: subgroup: full subgroups need kp with scripts/kp-0.9.0-features.patch "
                             f"and the computeFullSubgroups feature")
        self.subgroup = (size, full)
        self.bindings = list(bindings)
        self.writes = {self.bindings[i] for i in writes}
        self.reads = set(self.bindings) - self.writes
        self.groups = tuple(int(g) for g in groups)
        want = _spirv_bindings(spirv)[0]
        if want != len(self.bindings):    # kp would bind past the descriptor set and crash
            raise ValueError(f"{name}: the shader declares {want} buffer bindings, {len(self.bindings)} given")
        formats = backend.texel_formats(spirv, [b.nbytes for b in self.bindings], name)
        spec = np.asarray(spec, dtype=np.uint32)
        if first_build(backend.device_key, spirv, spec, name):
            log.info("vkattn: building the %s pipeline (spec %s) for the first time on %s%s; the driver caches it "
                     "afterwards", name, ",".join(map(str, spec.tolist())), backend.device_key.split(" | ")[0],
                     ": lavapipe compiles it to machine code on its first dispatch, which can take seconds"
                     if backend.software else "")
        self._algo = backend.algorithm([b._t for b in self.bindings], spirv, self.groups, spec,
                                       np.zeros(0, np.uint32), formats, self.subgroup)
        backend.keep_pipeline(spirv, len(self.bindings), spec, self.subgroup, formats)

    def destroy(self) -> None:
        if self._algo is not None:
            self._algo.destroy()
            self._algo = None


_BINDINGS: dict = {}


def _spirv_bindings(spirv: bytes) -> tuple:
    """(number of distinct descriptor bindings a SPIR-V module declares, its uniform texel buffers:
    {binding: the VkFormat of four components of the sampled type}); memoised per module."""
    n = _BINDINGS.get(spirv)
    if n is None:
        n = _BINDINGS[spirv] = _reflect_bindings(spirv)
    return n


# a (u|i)samplerBuffer's view: four 32-bit components of its sampled type per texel
# (VK_FORMAT_R32G32B32A32_UINT / _SINT / _SFLOAT), 16 bytes
_TEXEL_FORMATS = {("int", 0): 107, ("int", 1): 108, ("float", 0): 109}
_TEXEL_ONE_WORD = 9     # the one-component format of the same type (R32_UINT 98, _SINT 99, _SFLOAT 100)


def _reflect_bindings(spirv: bytes) -> tuple:
    words = np.frombuffer(spirv, dtype=np.uint32).tolist()
    binding, var_type, pointee, sampled, images, scalars = {}, {}, {}, {}, {}, {}
    i = 5                                     # 5-word header
    while i < len(words):
        count, op = words[i] >> 16, words[i] & 0xFFFF
        w = words[i:i + max(count, 1)]
        if op == 71 and count >= 4 and w[2] == 33:          # OpDecorate <id> Binding <n>
            binding[w[1]] = w[3]
        elif op == 59 and count >= 4:                        # OpVariable <type> <id> <class>
            var_type[w[2]] = w[1]
        elif op == 32 and count >= 4:                        # OpTypePointer <id> <class> <type>
            pointee[w[1]] = w[3]
        elif op == 27 and count >= 3:                        # OpTypeSampledImage <id> <image>
            sampled[w[1]] = w[2]
        elif op == 25 and count >= 9:                        # OpTypeImage <id> <sampled> Dim ... Sampled
            images[w[1]] = (w[2], w[3], w[7])
        elif op == 21 and count >= 4:                        # OpTypeInt <id> width signedness
            scalars[w[1]] = ("int", w[3])
        elif op == 22 and count >= 3:                        # OpTypeFloat <id> width
            scalars[w[1]] = ("float", 0)
        i += max(count, 1)
    texel = {}
    for var, b in binding.items():
        t = pointee.get(var_type.get(var))
        image = images.get(sampled.get(t, t))
        if image is not None and image[1] == 5 and image[2] == 1:    # Dim Buffer, sampled: uniform texel buffer
            texel[b] = _TEXEL_FORMATS[scalars[image[0]]]
    return len(set(binding.values())), texel


class Recording:
    """Builder for a recorded sequence; see the module docstring for the ordering rules."""

    def __init__(self, backend: Backend):
        self._backend = backend
        self._ops = []
        self._names = []
        self._written = set()   # written by a dispatch, not downloaded since
        self._used = set()      # touched by a dispatch, no download (of any buffer) since
        self._fetched = set()   # direct buffers downloaded (the host reads their final value)
        # transfers: kp's copy commands order an upload before later shader reads only
        self._uploaded = set()  # staged buffers uploaded, no barrier on them since
        self._downloaded = set()    # staged buffers downloaded (into the staging copy an upload sends)
        self._touched = set()   # used by any dispatch of the recording (a direct upload is no command)
        self._seq = None

    def upload(self, *bufs: Buffer) -> "Recording":
        for b in bufs:
            if b in self._used or b in self._written:
                raise SyncHazardError(f"upload of {b.name!r} after a dispatch used it in the same recording")
            if b in self._fetched or b in self._downloaded:
                raise SyncHazardError(f"upload of {b.name!r} after its download in the same recording (the "
                                      f"download overwrites the host copy the upload sends)")
            if b.direct and b in self._touched:
                raise SyncHazardError(f"upload of {b.name!r} after a dispatch of the same recording used it: on "
                                      f"direct host memory an upload is the host's write before the submission, "
                                      f"not a command at this point (record it in a submission of its own)")
        copied = [b for b in bufs if not b.direct]      # a direct buffer's host writes need no copy
        again = [b for b in copied if b in self._uploaded]
        if again:                                       # two copies into one buffer: ordered
            self.barrier(*again)
        self._uploaded.update(copied)
        if copied:
            self._ops.append(kp.OpTensorSyncDevice([b._t for b in copied]))
            self._names.append("upload " + ",".join(b.name for b in copied))
        return self

    def dispatch(self, prog: Program, barriers: bool = False) -> "Recording":
        """Record ``prog``'s dispatch. A buffer an earlier dispatch wrote (no download or barrier
        since), or one it would write that an earlier dispatch used, is a SyncHazardError -- or,
        with ``barriers``, gets a barrier (:meth:`barrier`) first."""
        # a copy's write, then a shader's (aux's split-K counters, a mask's copy into aux): kp's copy
        # orders itself before shader reads only; a barrier, with the dispatch's others where it has some
        uploaded = [b for b in prog.writes if b in self._uploaded] if HAS_BARRIER else []
        hazards = [b for b in prog.reads | prog.writes if b in self._written] + \
                  [b for b in prog.writes if b in self._used and b not in self._written]
        if hazards and barriers:
            self.barrier(*uploaded, *hazards)
        else:
            if uploaded:
                self.barrier(*uploaded)
            for b in prog.reads | prog.writes:
                if b in self._written:
                    raise SyncHazardError(
                        f"{prog.name}: {b.name!r} was written by an earlier dispatch with no barrier between")
            for b in prog.writes:
                if b in self._used:
                    raise SyncHazardError(
                        f"{prog.name}: writes {b.name!r} that an earlier dispatch used, with no barrier between")
        for b in prog.writes:
            if b in self._fetched:
                raise SyncHazardError(f"{prog.name}: writes {b.name!r} after its download in the same recording "
                                      f"(direct host memory: the host would read this write, not the downloaded value)")
        self._written |= prog.writes
        self._used |= prog.reads | prog.writes
        self._touched |= prog.reads | prog.writes
        self._ops.append(kp.OpAlgoDispatch(prog._algo))
        self._names.append(prog.name)
        return self

    def barrier(self, *bufs: Buffer) -> "Recording":
        """A pipeline barrier (module docstring): every earlier dispatch happens before every
        later command, and the writes to ``bufs`` are visible to them. Needs the patched kp."""
        if not HAS_BARRIER:
            raise SyncHazardError("a barrier between two dispatches needs kp built with "
                                  "scripts/kp-0.9.0-features.patch (kp.OpMemoryBarrier)")
        bufs = list(dict.fromkeys(bufs))
        self._ops.append(kp.OpMemoryBarrier([b._t for b in bufs], _SRC_ACCESS, _DST_ACCESS, _STAGES, _STAGES))
        self._names.append("barrier " + ",".join(b.name for b in bufs))
        for b in bufs:
            self._written.discard(b)
            self._uploaded.discard(b)
        self._used.clear()
        return self

    def upload_after(self, *bufs: Buffer) -> "Recording":
        """:meth:`upload`, with a barrier first where an earlier dispatch used one of ``bufs``."""
        used = [b for b in bufs if b in self._used or b in self._written]
        if used:
            self.barrier(*used)
        return self.upload(*bufs)

    def download(self, *bufs: Buffer) -> "Recording":
        again = [b for b in bufs if b in self._uploaded]
        if again and HAS_BARRIER:                       # an upload's copy, then this one's
            self.barrier(*again)
        for b in bufs:
            if not b.host_visible:
                raise RuntimeError(f"download of device-only buffer {b.name!r}")
            self._written.discard(b)
            if not b.direct:
                self._downloaded.add(b)
        self._used.clear()      # every earlier dispatch now happens-before every later op
        copied = [b for b in bufs if not b.direct]
        direct = [b for b in bufs if b.direct]
        if copied:
            self._ops.append(kp.OpTensorSyncLocal([b._t for b in copied]))
            self._names.append("download " + ",".join(b.name for b in copied))
        if direct:      # no copy: the writes made visible to the host (and ordered before what follows)
            self._ops.append(kp.OpMemoryBarrier([b._t for b in direct], _SRC_ACCESS, _DST_ACCESS | _HOST_READ,
                                                _STAGES, _STAGES | _HOST_STAGE))
            self._names.append("host barrier " + ",".join(b.name for b in direct))
            self._fetched.update(direct)
        return self

    def build(self, timestamps: bool = False) -> "Recording":
        """The sequence, recorded once. A recording with no command (on direct host memory, one
        that only uploads) builds none: running it submits nothing (an empty command buffer is
        not a valid submission, VUID-vkQueueSubmit-pCommandBuffers-00070)."""
        if not self._ops:
            self._seq = None
            return self
        seq = self._backend._mgr.sequence(0, len(self._ops) + 1 if timestamps else 0)
        for op in self._ops:
            seq.record(op)
        self._seq = seq
        return self

    @property
    def submits(self) -> bool:
        """Whether running it submits anything (False: no command was recorded)."""
        return bool(self._ops)

    def run(self) -> None:
        pending = self._backend.pending
        if pending is not None:
            pending.wait()
        if self._seq is not None:
            if self._backend.spin_s and HAS_ASYNC:
                self._seq.eval_async()
                self._await()
            else:
                self._seq.eval()

    def _await(self) -> None:
        """eval_await of the running sequence, after polling its fence for the backend's
        ``spin_s`` (VKATTN_SPIN_US) where that is set."""
        seq, spin = self._seq, self._backend.spin_s
        if spin and HAS_ASYNC:
            end = time.perf_counter() + spin
            while not seq.is_done() and time.perf_counter() < end:
                pass
        seq.eval_await()

    def submit(self) -> None:
        """Submit without waiting (kp's eval_async; with a kp without :data:`HAS_ASYNC`, waited
        for there); :meth:`wait` completes it."""
        if self._seq is not None:
            if HAS_ASYNC:
                self._seq.eval_async()
            else:
                self._seq.eval()

    def finished(self) -> bool:
        """Whether the device is done with the last submission (its fence, read without
        waiting): True where it was waited for or nothing ran. :meth:`wait` still completes it."""
        return self._seq is None or not self._seq.is_running() or self._seq.is_done()

    def wait(self) -> None:
        if self._seq is not None and self._seq.is_running():
            self._await()
        if self._backend.pending is self:
            self._backend.pending = None

    @property
    def ops(self) -> list:
        """The recorded ops in order: "upload <buffers>", the dispatched programs' names,
        "download <buffers>"."""
        return list(self._names)

    def timings(self, tick_ns: float) -> list:
        """(op name, device ms) for each op of the last run; needs ``build(timestamps=True)``."""
        if self._seq is None:
            return []
        ticks = self._seq.get_timestamps()
        return [(n, (b - a) * tick_ns * 1e-6) for n, a, b in zip(self._names, ticks[:-1], ticks[1:])]

    def destroy(self) -> None:
        if self._backend.pending is self:
            self.wait()
        if self._seq is not None:
            self._seq.destroy()
            self._seq = None
        self._ops = []
