"""Vulkan device selection, the limits vkattn plans against, and the verdicts recorded for it.

Layering: this module knows devices, their limits and features, and stores the verdicts of
per-device measurements (vkattn.measure registers and runs them); it builds no cache.
"""
from __future__ import annotations

import contextlib
import os
import threading

import numpy as np

from . import _driverfix, _kp
from ._vkinfo import DeviceInfo, VulkanUnavailableError, query_devices
from . import compiler
from .checks import env_flag
from .errors import CacheClosedError
from .tuning import (COMPUTE_STAGE, COOPMAT_MARGIN, COOPMAT_SUBGROUP, SUBGROUP_SHUFFLE, SUBGROUP_VOTE,
                     TILE_CLUSTER, WORKGROUP)


class _Limits:
    """The limits the planner reads, from ``self.info`` (a DeviceInfo)."""

    info: DeviceInfo

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def is_software(self) -> bool:
        return self.info.is_software

    @property
    def max_storage_buffer_range(self) -> int:
        return self.info.max_storage_buffer_range

    @property
    def max_memory_allocation_size(self) -> int:
        return self.info.max_memory_allocation_size

    @property
    def max_buffer_bytes(self) -> int:
        """The largest buffer vkattn binds whole: maxStorageBufferRange, or the allocation limit
        (maintenance3) where that is lower."""
        return min(self.max_storage_buffer_range, self.max_memory_allocation_size or self.max_storage_buffer_range)

    @property
    def max_shared_memory(self) -> int:
        return self.info.max_compute_shared_memory_size

    @property
    def subgroup_size(self) -> int:
        return self.info.subgroup_size

    @property
    def max_workgroup_size(self) -> int:
        return min(self.info.max_compute_workgroup_invocations, self.info.max_compute_workgroup_size[0])

    @property
    def max_workgroup_count(self) -> tuple:
        return self.info.max_compute_workgroup_count

    def _shuffles(self, vote: bool = False) -> bool:
        """Compute shaders have subgroup shuffles (and, with ``vote``, votes: attn.comp's
        subgroupAny)."""
        ops = SUBGROUP_SHUFFLE | (SUBGROUP_VOTE if vote else 0)
        return bool(self.info.subgroup_supported_operations & ops == ops and
                    self.info.subgroup_supported_stages & COMPUTE_STAGE)

    def _cluster_wanted(self) -> int:
        """attn.comp's key-row cluster if the reported subgroup holds: the largest power of two
        <= min(TILE_CLUSTER, subgroup size) where compute shaders have shuffles and votes, else 1."""
        if not self._shuffles(vote=True):
            return 1
        want = 1
        while 2 * want <= min(TILE_CLUSTER, self.subgroup_size):
            want *= 2
        return want

    def _forced_cluster(self, largest: int) -> int:
        """VKATTN_TILE_CLUSTER if set (validated: a power of two up to TILE_CLUSTER, and at most
        ``largest``, what the device's shuffles hold), else ``largest``."""
        env = forced_tile_cluster()
        if env is None:
            return largest
        if env > largest:
            raise ValueError(f"VKATTN_TILE_CLUSTER={env}: subgroup shuffles on {self.name!r} hold clusters of at "
                             f"most {largest}")
        return env

    def subgroup_pin(self, wg: int, need: int) -> tuple:
        """(required subgroup size, full subgroups) to pin a ``wg``-invocation compute pipeline
        whose shuffles need a subgroup of ``need`` invocations or more, or (0, False) where the
        device cannot pin it (no subgroupSizeControl enabled, compute not in
        requiredSubgroupSizeStages, no power of two in min..maxSubgroupSize >= need). The size is
        the reported subgroupSize when it qualifies (what the cluster was sized and probed for),
        else the smallest qualifying one; full subgroups where computeFullSubgroups is enabled and
        ``wg`` is a multiple of the size. VKATTN_PIN_SUBGROUP=0 turns pinning off."""
        info = self.info
        feats = self._pin_features()
        if ("subgroupSizeControl" not in feats or not info.required_subgroup_size_stages & COMPUTE_STAGE
                or not pinning_enabled()):
            return 0, False
        sizes = [1 << i for i in range(8) if info.min_subgroup_size <= 1 << i <= info.max_subgroup_size
                 and 1 << i >= need]
        if not sizes:
            return 0, False
        size = info.subgroup_size if info.subgroup_size in sizes else sizes[0]
        return size, "computeFullSubgroups" in feats and wg % size == 0

    def _pin_features(self) -> frozenset:
        return frozenset()

    def _coopmat_features(self) -> frozenset:
        """The optional features attn_coopmat.comp needs that this device has turned on (a Device:
        what kp enabled; a PlanningDevice: what the device offers)."""
        return frozenset()

    def coopmat_subgroup(self) -> int:
        """The subgroup size attn_coopmat.comp pipelines are pinned to: COOPMAT_SUBGROUP (32: NVIDIA's
        only size, RDNA's wave32, which its matrix instructions use) where the device's
        min..maxSubgroupSize holds it, else the reported subgroupSize (lavapipe: 8)."""
        info = self.info
        if info.min_subgroup_size <= COOPMAT_SUBGROUP <= info.max_subgroup_size:
            return COOPMAT_SUBGROUP
        return self.subgroup_size

    def coopmat_pin(self) -> tuple:
        """(required subgroup size, full subgroups) of attn_coopmat.comp's pipelines: the size
        coopmat_subgroup() where the device can require it of a compute pipeline
        (requiredSubgroupSizeStages), else 0 -- a device whose subgroups always have that size
        needs no requirement, and NVK (min = max = 32) lists no stage there, so requiring one would
        be invalid; full subgroups always (coopmat_problem asks for computeFullSubgroups)."""
        info, sg = self.info, self.coopmat_subgroup()
        if info.required_subgroup_size_stages & COMPUTE_STAGE and info.min_subgroup_size <= sg <= info.max_subgroup_size:
            return sg, True
        return 0, True

    def coopmat_problem(self) -> str:
        """Why attn_coopmat.comp cannot run on this device ("" when it can): it needs
        VK_KHR_cooperative_matrix in compute with a float16 x float16 -> float32 subgroup shape of
        sides 8 or 16 (DeviceInfo.coopmat_shape), the features cooperativeMatrix, shaderFloat16,
        vulkanMemoryModel (+ device scope: the split-K merge), subgroupSizeControl and
        computeFullSubgroups turned on (kp built with scripts/kp-0.9.0-features.patch), subgroup
        shuffles and votes in compute, a pipeline subgroup size it can pin (VKATTN_PIN_SUBGROUP not
        0) or subgroups that always have that size (coopmat_pin), and a glslangValidator with
        GL_KHR_cooperative_matrix; and no known driver fault with them (lavapipe away from 256
        bits: _driverfix.coopmat_fault, checked before any of its pipelines is built)."""
        info = self.info
        if not info.cooperative_matrix or not info.coopmat_stages & COMPUTE_STAGE:
            return f"{self.name!r} does not offer VK_KHR_cooperative_matrix in compute shaders"
        fault = _driverfix.coopmat_fault(info.name, info.driver_name)
        if fault:                           # a known driver fault: no pipeline built, no self-test
            return fault
        if self.coopmat_shape() is None:
            return (f"{self.name!r} lists no float16 x float16 -> float32 subgroup matrix of sides 8 or 16 "
                    f"(it lists: {', '.join(info.coopmat_shapes) or 'none'})")
        need = ("cooperativeMatrix", "shaderFloat16", "vulkanMemoryModel", "vulkanMemoryModelDeviceScope",
                "subgroupSizeControl", "computeFullSubgroups")
        missing = [f for f in need if f not in self._coopmat_features()]
        if missing:
            return (f"device features {', '.join(missing)} are not enabled on {self.name!r} (kp needs "
                    f"scripts/kp-0.9.0-features.patch, and the device must offer them)")
        if not self._shuffles(vote=True):
            return f"{self.name!r} has no subgroup shuffles and votes in compute shaders"
        sg = self.coopmat_subgroup()
        pin = self.coopmat_pin()[0]
        if not pin and not info.min_subgroup_size == info.max_subgroup_size == sg:
            return (f"{self.name!r} cannot pin a compute pipeline's subgroup size to {sg}, and its subgroups "
                    f"are not always {sg} (sizes {info.min_subgroup_size}..{info.max_subgroup_size})")
        if pin and not pinning_enabled():
            return "VKATTN_PIN_SUBGROUP=0: the kernel's matrices need a pinned subgroup size"
        if getattr(self, "_coopmat_broken", ""):
            return self._coopmat_broken
        problem = compiler.coopmat_compiler_problem()
        if problem:
            return f"the shader compiler cannot build GL_KHR_cooperative_matrix ({problem})"
        return self._coopmat_self_test()

    def _coopmat_self_test(self) -> str:
        """Why the kernel's self-test on this device failed ("" when it passed; a planning device
        runs nothing)."""
        return ""

    def coopmat_pays(self) -> bool:
        """Whether the speed probe timed attn_coopmat.comp faster than the other kernel (a
        planning device times nothing: no)."""
        return False

    def coopmat_shape(self):
        """(M, N, K) of the float16 -> float32 subgroup matrices attn_coopmat.comp is built for."""
        return self.info.coopmat_shape()


# Measurements that need the caches (vkattn.measure, a layer above them) are registered here by
# name and run by the device the first time a verdict is asked for: the device stores verdicts and
# builds no cache. {name: function(device, fresh=False) -> verdict}
_MEASURES: dict = {}


def register_measure(name: str, fn) -> None:
    """Makes ``fn(device, fresh=False)`` the measurement ``name`` (vkattn.measure registers
    "coopmat_self_test" and "coopmat_speed" when ``import vkattn`` runs)."""
    _MEASURES[name] = fn


class Device(_Limits):
    """One Vulkan physical device with a Kompute manager on it.

    ``Device()`` picks ``$VKATTN_DEVICE`` (an index, or a case-insensitive substring of the name)
    if set, else the first GPU, else the first device (lavapipe on a machine without a GPU).
    ``Device(index)`` takes the device at that index in the Vulkan loader's order.
    """

    def __init__(self, index: int | None = None):
        devices = query_devices()
        if index is None:
            index = _pick(devices, os.environ.get("VKATTN_DEVICE"))
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(devices):
            raise ValueError(f"index: expected an int in [0, {len(devices)}), got {index!r}")
        self.info: DeviceInfo = devices[index]
        self.index = index
        self.key = f"{self.info.name} | {self.info.driver_name} {self.info.driver_info} {self.info.driver_version}"
        self._backend = _kp.Backend(index, self.key, self.info.is_software,
                                    direct=_kp.host_memory_mode(self.info.host_memory_local),
                                    max_texels=0 if _driverfix.texel_fault(self.info.name, self.info.driver_name,
                                                                          self.info.driver_info)
                                    else self.info.max_texel_buffer_elements)
        self._lane_subgroup = None
        self._tile_cluster = None
        self._half_native = None

    def _pin_features(self) -> frozenset:
        return self.backend.features

    def _coopmat_features(self) -> frozenset:
        return self.backend.features

    _coopmat_test_result = None     # the self-test's verdict: None before it ran, "" passed (or running)
    _coopmat_speed = None           # the speed probe's figures: None before it ran
    _graph = None                   # the vkattn.Graph capturing this device's cache calls, if any,
    _graph_thread = None            # .. in this thread (threading.get_ident): other threads' calls run

    def capturing_graph(self):
        """The vkattn.Graph capturing the calling thread's cache calls on this device, or None:
        a capture records the calls of the thread inside ``with graph.capture():`` only, and the
        calls other threads make meanwhile run as they would without it."""
        g = self._graph
        return g if g is not None and self._graph_thread == threading.get_ident() else None
    _fresh = False                  # measure afresh, not from the disk cache (vkattn.measure.remeasure)

    def _measure(self, name: str):
        fn = _MEASURES.get(name)
        if fn is None:
            raise RuntimeError(f"no measurement {name!r} registered (vkattn.measure, which import vkattn loads)")
        return fn(self, fresh=self._fresh)

    def forget_measures(self) -> None:
        """Drops the verdicts recorded in this process (the next request runs or reads them again)."""
        with self.backend.lock:
            self._coopmat_test_result = None
            self._coopmat_speed = None
            self._coopmat_broken = ""

    @contextlib.contextmanager
    def fresh_measures(self):
        """Within it, measurements run afresh instead of coming from the disk cache."""
        with self.backend.lock:
            self._fresh = True
            try:
                yield
            finally:
                self._fresh = False

    def _coopmat_self_test(self) -> str:
        """attn_coopmat.comp's self-test verdict, once per device and shader build (vkattn.measure:
        the cases, and the disk cache that keeps verdicts across processes), before the first
        plan that would use the kernel. A device whose matrices give wrong results then never
        runs the kernel: the default planner falls back to the device's other kernel and
        VKATTN_KERNEL=coopmat raises, naming the failed case (coopmat_failed). A guard for drivers
        nobody has tested on, not a replacement for the parity suite."""
        with self.backend.lock:          # a second thread waits for the verdict; this one's own
            if self._coopmat_test_result is None:      # plans inside the test see "" (running)
                self._coopmat_test_result = ""
                why = self._measure("coopmat_self_test")
                self._coopmat_test_result = why
                if why:
                    self.coopmat_failed(why)
            return self._coopmat_test_result

    def coopmat_speed(self) -> dict:
        """attn_coopmat.comp's speed probe, once per device and shader build (vkattn.measure): a
        float16 prefill of tuning.COOPMAT_PROBE on it and on the device's other kernel, its result
        checked against the reference, then timed. {"coopmat": ms, "other": kernel, kernel: ms,
        "clock": "device" or "wall"}, or {"error": why} where the probe could not run or its result
        was wrong. Call it where coopmat_problem() is ""."""
        with self.backend.lock:
            if self._coopmat_speed is None:
                self._coopmat_speed = {"error": "running"}     # plans inside the probe are forced
                self._coopmat_speed = self._measure("coopmat_speed")
            return self._coopmat_speed

    def coopmat_pays(self) -> bool:
        """Whether the speed probe timed attn_coopmat.comp at most tuning.COOPMAT_MARGIN of the
        other kernel's time (tuning.coopmat_wanted's default)."""
        speed = self.coopmat_speed()
        return "error" not in speed and speed["coopmat"] <= COOPMAT_MARGIN * speed[speed["other"]]

    def coopmat_failed(self, why: str) -> None:
        """A cooperative-matrix pipeline did not run as planned (``why``): the kernel is not picked
        on this device again (VKATTN_KERNEL=coopmat then raises, naming ``why``)."""
        self._coopmat_broken = why

    def lane_subgroup(self) -> int:
        """The workgroup size attn_lane.comp may use here: the reported subgroup size if a probe
        dispatch confirms that a workgroup of that many invocations is exactly one subgroup with
        working xor shuffles (power of two, at most 16), else 0. Probed once per device."""
        if self._lane_subgroup is None:
            sg = self.subgroup_size
            ok = self._shuffles() and 1 <= sg <= 16 and sg & (sg - 1) == 0
            self._lane_subgroup = sg if ok and self._probe(sg, sg, need_one_subgroup=True) else 0
        return self._lane_subgroup

    def half_native(self) -> bool:
        """Whether this device's ``unpackHalf2x16`` gives every finite half exactly the float32
        numpy gives (``h.view(float16).astype(float32)``): subnormal halves included, which a
        driver that flushes float16 denormals turns into zeros. A probe dispatch
        (numerics_probe.comp MODE 1 with HALF_NATIVE, all 63488 finite halves) answers it, once per
        device. Where it holds, attn_lane.comp decodes float16 K/V with it (HALF_NATIVE) instead of
        the integer construction that is exact everywhere (common.glsl halves_to_float), and fp8
        through its half bit patterns (fp8x4_native): the same bits, cheaper (lavapipe with F16C: decode L=4096 32/8 heads d128 about 2.05 -> 1.65 ms,
        session 31). ``VKATTN_HALF_NATIVE=0`` keeps the integer form."""
        if not env_flag("VKATTN_HALF_NATIVE", True):
            return False
        if self._half_native is None:
            self._half_native = self._probe_halves()
        return self._half_native

    def _probe_halves(self) -> bool:
        h = np.arange(0x10000, dtype=np.uint32)
        h = h[(h & 0x7c00) != 0x7c00].astype(np.uint16)        # the finite halves
        words = h.view(np.uint32)
        n = words.size // 4                                     # items of 8 halves
        be = self.backend
        params = be.buffer(1, np.uint32, name="probe_params")
        inv = be.buffer(words.size, np.uint32, name="probe_halves")
        out = be.buffer(2 * words.size, np.uint32, name="probe_floats")
        unused = be.buffer(1, np.uint32, name="probe_unused")
        params.view()[0] = n
        inv.view()[:] = words
        prog = be.program(compiler.compile_shader("numerics_probe", {"MODE": 1, "KV_F16": 1, "HALF_NATIVE": 1}),
                          [params, inv, out, unused], (-(-n // 64), 1, 1), [64, 1], writes=(2, 3),
                          name="half_probe")
        rec = be.recording().upload(params, inv).dispatch(prog).download(out).build()
        try:
            rec.run()
            got = out.view()[:2 * words.size].copy()
        finally:
            for o in (rec, prog, params, inv, out, unused):
                o.destroy()
        return bool(np.array_equal(got, h.view(np.float16).astype(np.float32).view(np.uint32)))

    def tile_cluster(self) -> int:
        """How many adjacent invocations of an attn.comp workgroup may share a key row summing with
        xor shuffles: the largest of min(TILE_CLUSTER, subgroup size), then its halves (32, 16, 8,
        4, 2) that a probe dispatch of a WORKGROUP-sized workgroup confirms, else 1 (no shuffles:
        tile_config sums through shared memory). Probed once per device; VKATTN_TILE_CLUSTER
        forces a smaller one. A plan that cannot pin its subgroup size checks the real pipeline's
        subgroup too and lowers this (``lower_tile_cluster``)."""
        if self._tile_cluster is None:
            want = self._cluster_wanted()
            while want > 1 and not self._probe(WORKGROUP, want):
                want //= 2
            self._tile_cluster = want
        return self._forced_cluster(self._tile_cluster)

    def lower_tile_cluster(self, subgroup: int) -> None:
        """A pipeline ran with subgroups of ``subgroup`` invocations: clusters no wider from now on."""
        c = max(1, min(self.tile_cluster(), subgroup))
        while c & (c - 1):
            c &= c - 1
        self._tile_cluster = c

    def _probe(self, wg: int, cluster: int, need_one_subgroup: bool = False) -> bool:
        """subgroup_probe.comp: do clusters of ``cluster`` invocations of a ``wg``-invocation
        workgroup shuffle correctly (and, if asked, is the workgroup one subgroup of ``wg``)?"""
        be = self.backend
        out = be.buffer(2 + wg, np.uint32, name="probe")
        prog = be.program(compiler.compile_shader("subgroup_probe"), [out], (1, 1, 1), [wg, cluster], writes=(0,),
                          name="probe")
        rec = be.recording().dispatch(prog).download(out).build()
        rec.run()
        res = out.view().copy()
        for o in (rec, prog, out):
            o.destroy()
        ok = bool(res[2:2 + wg].all())
        if need_one_subgroup:
            ok = ok and int(res[0]) == wg and int(res[1]) == 1
        return ok

    @property
    def backend(self) -> "_kp.Backend":
        if self._backend is None:
            raise CacheClosedError(f"device {self.name!r} is closed")
        return self._backend

    @property
    def closed(self) -> bool:
        return self._backend is None

    @property
    def texel_buffers(self) -> bool:
        """Whether programs on this device may read uniform texel buffers (``usamplerBuffer``):
        kp built with scripts/kp-0.9.0-features.patch, a maxTexelBufferElements limit
        (vkattn.algorithm) and no known driver fault with them (_driverfix.texel_fault)."""
        return self.backend.texel_buffers

    def close(self) -> None:
        """Free the Kompute manager; caches made on this device become unusable."""
        if self._backend is not None:
            self._backend.close()
            self._backend = None

    def __repr__(self) -> str:
        kind = "software" if self.is_software else self.info.device_type
        return f"Device({self.index}, {self.name!r}, {kind})"


class PlanningDevice(_Limits):
    """A device as the planner sees it, from its DeviceInfo alone: no Kompute manager, nothing
    dispatched, so it works for devices that can only compile (RADV's null hardware in ``perf
    gpu``). The subgroup facts a Device probes are taken as reported: no lane kernel (a GPU), and
    attn.comp clusters of min(TILE_CLUSTER, subgroup size) where shuffles are supported."""

    def __init__(self, info: DeviceInfo):
        self.info = info

    def lane_subgroup(self) -> int:
        return 0

    def half_native(self) -> bool:
        return False

    def tile_cluster(self) -> int:
        return self._forced_cluster(self._cluster_wanted())

    def _coopmat_features(self) -> frozenset:
        i = self.info
        offered = {"cooperativeMatrix": i.cooperative_matrix, "shaderFloat16": i.shader_float16,
                   "vulkanMemoryModel": i.vulkan_memory_model,
                   "vulkanMemoryModelDeviceScope": i.vulkan_memory_model_device_scope,
                   "subgroupSizeControl": i.subgroup_size_control, "computeFullSubgroups": i.compute_full_subgroups}
        return frozenset(k for k, v in offered.items() if v)

    def __repr__(self) -> str:
        return f"PlanningDevice({self.name!r})"


def forced_tile_cluster():
    """VKATTN_TILE_CLUSTER as an int (a power of two from 1 to TILE_CLUSTER), None if unset;
    ValueError naming it otherwise. 1 forces attn.comp's no-shuffle path."""
    env = os.environ.get("VKATTN_TILE_CLUSTER", "").strip()
    if not env:
        return None
    if not env.isdigit() or not 1 <= int(env) <= TILE_CLUSTER or int(env) & (int(env) - 1):
        raise ValueError(f"VKATTN_TILE_CLUSTER={env!r}: expected a power of two from 1 to {TILE_CLUSTER}")
    return int(env)


def pinning_enabled() -> bool:
    """VKATTN_PIN_SUBGROUP: "0" turns required subgroup sizes off (the probing fallback), "1" or
    unset leaves them on where the device offers them; anything else is a ValueError."""
    return env_flag("VKATTN_PIN_SUBGROUP", True)


def _pick(devices, selector: str | None) -> int:
    if selector:
        sel = selector.strip()
        if sel.isdigit() and int(sel) < len(devices):
            return int(sel)
        for d in devices:
            if not sel.isdigit() and sel.lower() in d.name.lower():     # digits: an index only
                return d.index
        names = ", ".join(f"{d.index}: {d.name}" for d in devices)
        raise ValueError(f"VKATTN_DEVICE={selector!r} matches no Vulkan device ({names})")
    for d in devices:
        if not d.is_software:
            return d.index
    return devices[0].index


_default = None
_default_lock = threading.Lock()


def default_device() -> Device:
    """The shared default device, created on first use."""
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            _default = Device()
        return _default


def list_devices() -> list:
    """DeviceInfo for every Vulkan device, in the loader's order."""
    return query_devices()


__all__ = ["Device", "default_device", "list_devices", "VulkanUnavailableError"]
