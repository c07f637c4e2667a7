"""Device arrays: float32 arrays that live in a buffer of a vkattn.Device.

A :class:`DeviceArray` is what a caller hands the caches instead of numpy when its data is on the
GPU already, or should stay there: q, k and v of a call are read from it, and ``out=`` / ``lse=``
are written into it, with no host copy on the way. It exposes the kp tensor and the device's
``kp.Manager`` (:attr:`DeviceArray.tensor`, :attr:`DeviceArray.manager`), so a caller's own kp
algorithms read and write the same memory (vkattn.graph chains them with vkattn's calls in one
submission).

Layout: C-contiguous float32, element ``(i, j, k)`` of a ``(H, S, D)`` array at float index
``(i * S + j) * D + k`` of the buffer. The buffer holds :data:`SLACK` floats past the last element:
the attention kernel writes one word after lse's rows (the subgroup width it ran with).

What the caches read from a device array is what they would read from numpy after its checks
(shape, dtype): the values are not inspected on the host (that would need a readback). A q, k or
v device array of a cache must have a last dimension the kernels read unpadded: head_dim (and
v_head_dim) a multiple of 4 for float32, 8 for float16 and bfloat16 and 16 for int8 storage (every common LLM
head dim: 64, 80, 96, 128, 256); the check names the rule otherwise.

Memory: where the device's host-visible memory is device-local (lavapipe, integrated GPUs), kp
"host" tensors: :meth:`DeviceArray.numpy` and :meth:`DeviceArray.write` copy from and into the
memory itself, with no submission. Elsewhere kp's "device" tensors -- device-local memory plus a
host staging copy, which they go through (one submission each). vkattn._kp says which, and
``VKATTN_HOST_MEMORY`` overrides it.
"""
from __future__ import annotations

import itertools
import numbers

import numpy as np

from .checks import check_shape
from .device import Device, default_device
from .errors import CacheClosedError

SLACK = 4           # floats past the last element (module docstring)


_CLOSES = itertools.count(1)


class DeviceArray:
    """A float32 array of ``shape`` on ``device`` (default: vkattn.default_device()).

    Create with :func:`empty`, :func:`zeros` or :func:`to_device`; read back with
    :meth:`numpy`; free with :meth:`close` (or ``with``). Thread-safe per device (the
    device's lock)."""

    closes = 0      # changes at every close (a fresh number each: a graph compares it with the one it saw)

    def __init__(self, shape, device: Device | None = None):
        if not isinstance(shape, numbers.Integral) and (isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__")):
            raise TypeError(f"shape: expected an int or a tuple of ints, got {type(shape).__name__}")
        shape = (shape,) if isinstance(shape, numbers.Integral) else tuple(shape)
        if not shape or any(isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1 for n in shape):
            raise ValueError(f"shape: expected a tuple of ints >= 1, got {shape!r}")
        if device is not None and not isinstance(device, Device):
            raise TypeError(f"device: expected a vkattn.Device or None, got {type(device).__name__}")
        self.shape = tuple(int(n) for n in shape)
        self.device = device or default_device()
        self.dtype = np.dtype(np.float32)
        self.size = int(np.prod(self.shape))
        self.nbytes = 4 * self.size
        be = self.device.backend
        with be.lock:
            self._buf = be.buffer(self.size + SLACK, np.float32, host_visible=True, name="device_array")
        self._up = self._down = None

    # ------------------------------------------------------------------ what a caller's kp code uses
    @property
    def tensor(self):
        """The kp.Tensor holding the array (a kp "device" tensor: its ``data()`` is the host
        staging copy, not the device memory)."""
        self._check_open()
        return self._buf._t

    @property
    def manager(self) -> "CallerManager":
        """The device's kp.Manager, as :class:`CallerManager` hands it out (each of its calls
        under the device's lock): build algorithms on it to read or write :attr:`tensor`."""
        self._check_open()
        be = self.device.backend
        return CallerManager(be._mgr, be.lock)

    @property
    def buffer(self):
        """vkattn's own handle (vkattn._kp.Buffer) of the memory."""
        self._check_open()
        return self._buf

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def closed(self) -> bool:
        return self._buf is None

    # ------------------------------------------------------------------ host transfers
    def write(self, x) -> "DeviceArray":
        """Copy the numpy array ``x`` (this shape, any float dtype) to the device: one
        submission, waited for. Returns self."""
        x = np.asarray(x)
        if x.shape != self.shape:
            raise ValueError(f"x: expected shape {self.shape}, got {x.shape}")
        if x.dtype.kind != "f":
            raise TypeError(f"x: expected a float array, got {x.dtype}")
        be = self.device.backend
        with be.lock:
            self._check_open()
            be.wait_pending()       # a submitted graph may read this memory (or its staging copy)
            self._buf.view()[:self.size] = x.reshape(-1)
            if self._buf.direct:    # the memory itself: nothing to copy
                return self
            if self._up is None:
                self._up = be.recording().upload(self._buf).build()
            self._up.run()
        return self

    def numpy(self) -> np.ndarray:
        """A numpy copy of the array: one submission (a device-to-host copy), waited for."""
        be = self.device.backend
        with be.lock:
            self._check_open()
            if self._buf.direct:    # the memory itself, once the device is done with it
                be.wait_pending()
                return self._buf.view()[:self.size].reshape(self.shape).copy()
            if self._down is None:
                self._down = be.recording().download(self._buf).build()
            self._down.run()
            return self._buf.view()[:self.size].reshape(self.shape).copy()

    def host_view(self) -> np.ndarray:
        """The host side as a numpy view of ``shape`` (no transfer): the staging copy -- what
        the last :meth:`numpy` or graph download read, what the next upload sends -- or, on direct
        host memory, the memory itself (uploads and downloads then copy nothing). For code that
        fills many arrays and uploads them in one recorded submission (vkattn.graph): write it
        only while no submitted graph runs (after ``Handle.wait()``)."""
        self._check_open()
        return self._buf.view()[:self.size].reshape(self.shape)

    # ------------------------------------------------------------------ life
    def close(self) -> None:
        """Free the device memory; later use raises CacheClosedError."""
        be = self.device.backend if not self.device.closed else None
        if self._buf is None:
            return
        if be is None:
            self._buf = self._up = self._down = None
            DeviceArray.closes = next(_CLOSES)
            return
        with be.lock:                       # (a graph checks and submits under it too)
            if self._buf is None:           # another thread closed it meanwhile
                return
            be.wait_pending()               # a submitted graph may still read or write this memory
            for rec in (self._up, self._down):
                if rec is not None:
                    rec.destroy()
            self._buf.destroy()
            self._buf = self._up = self._down = None
            DeviceArray.closes = next(_CLOSES)  # a graph looks at its arrays again (vkattn.graph)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self) -> None:
        if self._buf is None:
            raise CacheClosedError("this DeviceArray is closed")
        if self.device.closed:
            raise CacheClosedError(f"the device {self.device.name!r} of this DeviceArray is closed")

    def __repr__(self) -> str:
        state = "closed" if self._buf is None else self.device.name
        return f"DeviceArray(shape={self.shape}, dtype=float32, device={state!r})"


class CallerManager:
    """The device's kp.Manager as a caller's code gets it (:attr:`DeviceArray.manager`): every
    attribute kp's (``kp``: the manager itself), each method call made under the device's lock.
    vkattn sets per-pipeline options on the manager while it builds its own algorithms (texel
    formats, a required subgroup size: vkattn._kp.Backend.algorithm), and an algorithm another
    thread built in that window took them (a review built a caller's kernel as texel buffers
    there: all zeros); and kp's manager is not for two threads at once. A sequence it makes
    submits to the device's one queue: evaluate it under ``device.backend.lock`` too (or record the
    dispatch into a vkattn.Graph, which takes the lock)."""

    __slots__ = ("kp", "_lock")

    def __init__(self, mgr, lock):
        self.kp, self._lock = mgr, lock

    def __getattr__(self, name):
        attr = getattr(self.kp, name)
        if not callable(attr):
            return attr
        lock = self._lock

        def locked(*args, **kwargs):
            with lock:
                return attr(*args, **kwargs)
        locked.__name__ = name
        return locked


def same_device_hint(a: Device, b: Device) -> str:
    """What an error about an array on Device ``a`` where ``b`` was wanted adds when both are
    objects of one physical device (their reprs read alike)."""
    return (" (another vkattn.Device object of the same device: arrays, caches and graphs need the same "
            "Device object)" if a.index == b.index else "")


def buffers(*arrays) -> list:
    """Each array's buffer (DeviceArray.buffer; None for None) for a caller that has tested the
    device already (a graph step, after its cache's _check_open): only a closed array takes the
    property, which raises; the others cost an attribute read, not a call and two tests."""
    return [None if a is None else a.buffer if a._buf is None else a._buf for a in arrays]


def empty(shape, device: Device | None = None) -> DeviceArray:
    """A DeviceArray of ``shape`` whose contents are unspecified (zeros today)."""
    return DeviceArray(shape, device)


def zeros(shape, device: Device | None = None) -> DeviceArray:
    """A DeviceArray of ``shape`` filled with zeros (kp allocates tensors zeroed)."""
    return DeviceArray(shape, device).write(np.zeros(shape, np.float32))


def to_device(x, device: Device | None = None) -> DeviceArray:
    """A DeviceArray holding the numpy array ``x`` (converted to float32): one submission."""
    x = np.asarray(x)
    if x.dtype.kind != "f":
        raise TypeError(f"x: expected a float array, got {x.dtype}")
    return DeviceArray(x.shape, device).write(x)


def check_device_array(name: str, x: DeviceArray, shape: tuple, device: Device, width_rule: int = 0) -> DeviceArray:
    """Validate a device array argument: open, on ``device``, of ``shape`` (an int or None a
    size >= 1 per axis); ``width_rule``: its last axis must be a multiple of this many floats
    (the kernels read those rows unpadded)."""
    if not isinstance(x, DeviceArray):
        raise TypeError(f"{name}: expected a vkattn.DeviceArray, got {type(x).__name__}")
    x._check_open()
    if x.device is not device:
        raise ValueError(f"{name}: this DeviceArray lives on {x.device!r}, the cache on {device!r}"
                         + same_device_hint(x.device, device))
    check_shape(name, x.shape, shape)
    if width_rule and x.shape[-1] % width_rule:
        raise ValueError(f"{name}: a device array's last dimension must be a multiple of {width_rule} for this "
                         f"cache's storage (the kernels read its rows unpadded); got {x.shape[-1]}. Pass numpy, "
                         f"which is padded on the way")
    return x
