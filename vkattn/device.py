"""Vulkan device selection and the limits vkattn plans against."""
from __future__ import annotations

import os
import threading

from . import _kp
from ._vkinfo import DeviceInfo, VulkanUnavailableError, query_devices
from .errors import CacheClosedError


class Device:
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
        self._backend = _kp.Backend(index)
        self._lane_subgroup = None

    # --- what callers and the planner read -------------------------------------------------
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

    def lane_subgroup(self) -> int:
        """The workgroup size attn_lane.comp may use here: the reported subgroup size if a probe
        dispatch confirms that a workgroup of that many invocations is exactly one subgroup with
        working xor shuffles (power of two, at most 16), else 0. Probed once per device."""
        if self._lane_subgroup is None:
            self._lane_subgroup = 0
            sg = self.subgroup_size
            if 1 <= sg <= 16 and sg & (sg - 1) == 0:
                import numpy as np

                from .compiler import compile_shader
                be = self.backend
                out = be.buffer(4, np.uint32, name="probe")
                prog = be.program(compile_shader("subgroup_probe"), [out], (1, 1, 1), [sg], writes=(0,), name="probe")
                rec = be.recording().dispatch(prog).download(out).build()
                rec.run()
                size, count, ok = (int(x) for x in out.view()[:3])
                if size == sg and count == 1 and ok == 1:
                    self._lane_subgroup = sg
                for o in (rec, prog, out):
                    o.destroy()
        return self._lane_subgroup

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
