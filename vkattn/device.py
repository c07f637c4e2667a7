"""Vulkan device selection and the limits vkattn plans against."""
from __future__ import annotations

import os
import threading

from . import _kp
from ._vkinfo import DeviceInfo, VulkanUnavailableError, query_devices
from .errors import CacheClosedError


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

    def _shuffles(self) -> bool:
        from .tuning import COMPUTE_STAGE, SUBGROUP_SHUFFLE
        return bool(self.info.subgroup_supported_operations & SUBGROUP_SHUFFLE and
                    self.info.subgroup_supported_stages & COMPUTE_STAGE)

    def _cluster_wanted(self) -> int:
        """attn.comp's key-row cluster if the reported subgroup holds: min(TILE_CLUSTER, subgroup
        size) where compute shaders have shuffles and votes (TILE_SHUFFLE uses subgroupAny), else 1."""
        from .tuning import SUBGROUP_VOTE, TILE_CLUSTER
        want = min(TILE_CLUSTER, self.subgroup_size)
        votes = self.info.subgroup_supported_operations & SUBGROUP_VOTE
        return want if self._shuffles() and votes and want > 1 and want & (want - 1) == 0 else 1


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
        key = f"{self.info.name} | {self.info.driver_name} {self.info.driver_info} {self.info.driver_version}"
        self._backend = _kp.Backend(index, key, self.info.is_software)
        self._lane_subgroup = None
        self._tile_cluster = None

    def lane_subgroup(self) -> int:
        """The workgroup size attn_lane.comp may use here: the reported subgroup size if a probe
        dispatch confirms that a workgroup of that many invocations is exactly one subgroup with
        working xor shuffles (power of two, at most 16), else 0. Probed once per device."""
        if self._lane_subgroup is None:
            sg = self.subgroup_size
            ok = self._shuffles() and 1 <= sg <= 16 and sg & (sg - 1) == 0
            self._lane_subgroup = sg if ok and self._probe(sg, sg, need_one_subgroup=True) else 0
        return self._lane_subgroup

    def tile_cluster(self) -> int:
        """How many adjacent invocations of an attn.comp workgroup may share a key row (summing
        with xor shuffles): min(TILE_CLUSTER, subgroup size) if a probe dispatch of a WORKGROUP-
        sized workgroup confirms it, else 1 (no shuffles: one invocation per row). Once per device."""
        if self._tile_cluster is None:
            from .tuning import WORKGROUP
            want = self._cluster_wanted()
            self._tile_cluster = want if want > 1 and self._probe(WORKGROUP, want) else 1
        return self._tile_cluster

    def _probe(self, wg: int, cluster: int, need_one_subgroup: bool = False) -> bool:
        """subgroup_probe.comp: do clusters of ``cluster`` invocations of a ``wg``-invocation
        workgroup shuffle correctly (and, if asked, is the workgroup one subgroup of ``wg``)?"""
        import numpy as np

        from .compiler import compile_shader
        be = self.backend
        out = be.buffer(2 + wg, np.uint32, name="probe")
        prog = be.program(compile_shader("subgroup_probe"), [out], (1, 1, 1), [wg, cluster], writes=(0,),
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

    def tile_cluster(self) -> int:
        return self._cluster_wanted()

    def __repr__(self) -> str:
        return f"PlanningDevice({self.name!r})"


def _pick(devices, selector: str | None) -> int:
    if selector:
        sel = selector.strip()
        if sel.isdigit():
            return int(sel)
        for d in devices:
            if sel.lower() in d.name.lower():
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
