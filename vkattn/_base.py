"""What KVCache and PagedKVCache share: argument checks, the K/V (and int8 scale) device buffers,
the plan LRU, timings and closing."""
from __future__ import annotations

import os
import threading
from collections import OrderedDict

import numpy as np

from ._attn import RoPE, destroy, set_storage, token_bytes
from .checks import check_int
from .device import Device, default_device
from .errors import CacheClosedError, DeviceLimitError

DTYPES = ("float16", "float32", "int8")
MAX_PLANS = 8


class CacheBase:
    """Set up by :meth:`_setup`; subclasses say how many rows (``rows_per_head`` positions of every
    kv head) the K and V buffers hold and what ``capacity``/``num_blocks`` is called."""

    def _setup(self, num_kv_heads, head_dim, v_head_dim, dtype, device, verify, timestamps, rope) -> None:
        self.num_kv_heads = check_int("num_kv_heads", num_kv_heads, 1)
        self.head_dim = check_int("head_dim", head_dim, 1)
        self.v_head_dim = self.head_dim if v_head_dim is None else check_int("v_head_dim", v_head_dim, 1)
        key = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", None) or getattr(dtype, "name", None)
        if key not in DTYPES:
            raise TypeError(f"dtype: expected 'float16', 'float32' or 'int8', got {dtype!r}")
        self.dtype = key
        if device is not None and not isinstance(device, Device):
            raise TypeError(f"device: expected a vkattn.Device or None, got {type(device).__name__}")
        self.device = device or default_device()
        self.verify = (os.environ.get("VKATTN_VERIFY", "0") not in ("", "0")) if verify is None else bool(verify)
        if rope is not None and not isinstance(rope, RoPE):
            raise TypeError(f"rope: expected a vkattn.RoPE or None, got {type(rope).__name__}")
        self.rope = rope
        self._rope_dim = rope.dim(self.head_dim) if rope else 0
        set_storage(self)
        self.timestamps = bool(timestamps) and self.device.info.timestamp_compute_and_graphics
        self._plans: OrderedDict = OrderedDict()
        self._last_rec = None
        self._lock = threading.RLock()
        self._closed = False

    def _allocate(self, positions: int, name: str, unit: int, what: str) -> None:
        """K and V buffers for ``positions`` positions of every kv head, allocated once. Refused
        with DeviceLimitError naming the largest ``name`` that fits (in steps of ``unit``
        positions) if one buffer would pass the device's limit."""
        dev = self.device
        limit = min(dev.max_storage_buffer_range, dev.max_memory_allocation_size or dev.max_storage_buffer_range)
        unit_bytes = unit * self.num_kv_heads * 16 * max(self._dk4, self._dv4)
        need = unit_bytes * (positions // unit)
        if need > limit:
            raise DeviceLimitError(
                f"{name}: {positions // unit} {what} need a {need}-byte buffer; {dev.name} allows {limit} bytes "
                f"per buffer, so the largest {name} for this shape is {limit // unit_bytes}")
        be = dev.backend
        rows = self.num_kv_heads * positions
        self._k = be.buffer(rows * 4 * self._dk4, np.uint32, host_visible=False, name="k_cache")
        self._v = be.buffer(rows * 4 * self._dv4, np.uint32, host_visible=False, name="v_cache")
        n = rows if self._i8 else 1      # int8: one float32 scale per K row and per V row
        self._ks = be.buffer(n, np.float32, host_visible=False, name="k_scale")
        self._vs = be.buffer(n, np.float32, host_visible=False, name="v_scale")

    @property
    def bytes_per_token(self) -> int:
        """Device bytes one position takes in K and V, all kv heads (int8: with its scales)."""
        return token_bytes(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def last_timings(self) -> list:
        """Device time of each op of the last submission, as ``[(op, ms), ...]`` from Vulkan
        timestamp queries (built with ``timestamps=True`` on a device that supports them;
        otherwise an empty list)."""
        if not self.timestamps or self._last_rec is None:
            return []
        return self._last_rec.timings(self.device.info.timestamp_period)

    def close(self) -> None:
        """Free every device object. Further calls raise CacheClosedError."""
        with self._lock:
            if self._closed:
                return
            for plan in self._plans.values():
                plan.destroy()
            self._plans.clear()
            destroy(self._k, self._v, self._ks, self._vs)
            self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self) -> None:
        kind = type(self).__name__
        if self._closed:
            raise CacheClosedError(f"this {kind} is closed")
        if self.device.closed:
            raise CacheClosedError(f"the device {self.device.name!r} of this {kind} is closed")

    def _plan(self, key, make):
        """The plan for ``key`` from a small LRU, built by ``make()`` on a miss."""
        plan = self._plans.get(key)
        if plan is None:
            plan = make()
            self._plans[key] = plan
            while len(self._plans) > MAX_PLANS:
                self._plans.popitem(last=False)[1].destroy()
        else:
            self._plans.move_to_end(key)
        return plan
