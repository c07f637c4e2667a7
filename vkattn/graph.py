"""Recorded submissions: many calls -- several caches' attention, a caller's own kp dispatches --
in one submission with the barriers each dependency needs, submitted without waiting, replayed.

    g = vkattn.Graph(device)
    with g.capture():                          # calls are recorded, not run
        for i, cache in enumerate(caches):     # one call per cache: q, k, v, out are DeviceArrays
            cache.forward(q[i], k[i], v[i], out=o[i])
            g.dispatch(my_algorithm, reads=[o[i]], writes=[x[i + 1]])   # the caller's own kp work
    h = g.submit()                             # one submission, nothing waited for
    ...                                        # host work meanwhile
    h.wait()                                   # or g.run(): submit and wait
    g.run()                                    # replay: the same calls at the caches' new lengths

What a replay costs: each cache call fills its plan's host words (lengths, positions, tables) and
the recorded command buffer is submitted again; it is recorded again only where a call's plan
changed (a decode's key bound crosses a power of two, a row count crosses its bucket): a recorded
decode step of a 30-layer model is one submission per token, as CUDA graphs replay a step.

Ordering: the recording inserts a buffer memory barrier (vkattn._kp.Recording.barrier: kp built
with scripts/kp-0.9.0-features.patch) before any dispatch that reads or writes what an earlier
dispatch of the submission wrote, or writes what one read, and orders uploads and downloads the
same way (an upload of an array the graph downloaded earlier is refused; on direct host memory,
one after a dispatch used the array too: SyncHazardError at submit), so the chain is correct on
any Vulkan device, whatever the driver overlaps. A caller's dispatches say what they read and write
(``reads=`` / ``writes=``) for that. Host calls on the device wait for a submitted graph first.

Waiting: :meth:`Graph.submit` returns as soon as the command buffer is queued (kp with vkattn's
patch; kp 0.9.0's own ``eval_async()`` waited for the device); ``h.done`` reads the submission's
fence without waiting, ``h.wait()`` blocks. kp releases the GIL while it waits (here and in every
numpy call's evaluation), so the host's other threads -- a tokenizer, a scheduler -- run meanwhile.
Between submit and wait the caller must not write the host side of an array the graph reads
(``host_view()``); vkattn's own calls on the device wait first.

Rules (ValueError when broken, at capture; nothing recorded): inside :meth:`Graph.capture`,
every cache call takes DeviceArrays for q, k, v and ``out`` (and ``lse`` with ``return_lse``),
no ``verify``, and each cache appears once per graph (its plan's host words hold one call). A
cache call's new rows count from the cache's length when the graph is submitted; its length
grows then. A submission that does not fit a cache (CacheFullError) submits nothing and changes
no cache. A numpy ``mask`` holds the keys of the call it came with, so a replay at another length
refuses it (ValueError, nothing submitted); a DeviceArray mask is read on the device, its first
columns as many as the keys, so one as wide as the cache's capacity replays as the cache grows.
"""
from __future__ import annotations

import contextlib
import threading

import numpy as np

from ._kp import HAS_BARRIER
from .array import DeviceArray, same_device_hint
from .device import Device, default_device
from .errors import CacheClosedError, SyncHazardError


def algorithm(arrays, spirv: bytes, groups, spec=(), push=(), texel_words: dict | None = None):
    """A caller's kp.Algorithm over DeviceArrays (``arrays``, binding i = arrays[i], all on one
    device), for :meth:`Graph.dispatch`: ``spirv`` the module (vkattn.compiler.compile_shader),
    ``groups`` the grid (up to 3 ints), ``spec`` / ``push`` uint32 specialisation and push
    constants. A binding the shader declares as a ``usamplerBuffer`` (or ``isamplerBuffer`` /
    ``samplerBuffer``) is bound as a uniform texel buffer over the whole array, four 32-bit
    components a texel, or one where ``texel_words`` maps the binding to 1 (texelFetch(b, i).x is
    then word i): read-only data a CPU driver loads by vector gathers rather than a per-lane loop
    (lavapipe, Mesa 22.3: 0.11 against 0.39 ns a word streamed; ``python -m perf loads``).
    Device.texel_buffers says whether the device can (the patched kp). ValueError: arrays on
    another device or closed, a texel binding the device cannot make, too many texels."""
    arrays = list(arrays)
    if not arrays or any(not isinstance(a, DeviceArray) for a in arrays):
        raise ValueError("algorithm: arrays must be a non-empty list of DeviceArrays")
    dev = arrays[0].device
    if any(a.device is not dev for a in arrays):
        raise ValueError("algorithm: the arrays must all live on one device")
    for a in arrays:
        a._check_open()
    groups = [int(g) for g in groups] + [1] * (3 - len(groups))
    be = dev.backend
    formats = be.texel_formats(spirv, [a.buffer.nbytes for a in arrays], "algorithm", texel_words)
    with be.lock:
        return be.algorithm([a.tensor for a in arrays], spirv, groups, np.asarray(spec, dtype=np.uint32),
                            np.asarray(push, dtype=np.uint32), formats)


class _CallerProgram:
    """A caller's kp.Algorithm as vkattn._kp.Recording.dispatch takes it; ``arrays``: the
    DeviceArrays it reads and writes (each submission checks they are still open)."""

    def __init__(self, algorithm, reads, writes, name):
        self._algo = algorithm
        self.arrays = list(reads) + list(writes)
        self.reads = {a.buffer for a in reads}
        self.writes = {a.buffer for a in writes}
        self.reads -= self.writes
        self.name = name


class Handle:
    """A submitted graph: :meth:`wait` blocks until the device finished it (and completes the
    submission: any host call on the device waits for it first); :attr:`done` tells, without
    waiting, whether the device has finished it."""

    def __init__(self, graph: "Graph", rec):
        self._graph, self._rec, self._waited = graph, rec, False

    def wait(self) -> None:
        if not self._waited:
            with self._graph.device.backend.lock:
                self._rec.wait()
                self._waited = True

    @property
    def done(self) -> bool:
        """Whether the device has finished the submission (its fence, read without waiting; a
        kp without vkattn's patch submits waiting: always True)."""
        if self._waited:
            return True
        with self._graph.device.backend.lock.bare:
            return self._waited or self._rec.finished()


class Graph:
    """A recorded submission on ``device`` (default: vkattn.default_device()); module docstring."""

    def __init__(self, device: Device | None = None, timestamps: bool = False):
        if device is not None and not isinstance(device, Device):
            raise TypeError(f"device: expected a vkattn.Device or None, got {type(device).__name__}")
        if not isinstance(timestamps, bool):
            raise TypeError(f"timestamps: expected a bool, got {type(timestamps).__name__}")
        if not HAS_BARRIER:
            raise SyncHazardError("vkattn.Graph needs kp built with scripts/kp-0.9.0-features.patch "
                                  "(kp.OpMemoryBarrier): make setup builds it")
        self.device = device or default_device()
        # a timestamp query around every recorded command (last_timings), where the device has them
        self.timestamps = timestamps and self.device.info.timestamp_compute_and_graphics
        self._items = []            # ("cache", step) | ("dispatch", program) | ("upload"/"download", DeviceArray)
        self._caches = set()
        self._rec = None
        self._progs = None
        self._handle = None
        self.recordings = 0         # how often the command buffer was recorded (replays reuse it)
        self.submissions = 0
        self._capturing = False
        self._open_at = None        # DeviceArray.closes when the caller's arrays were last seen open

    # ------------------------------------------------------------------ capture
    @contextlib.contextmanager
    def capture(self):
        """Calls of the device's caches inside, made by this thread, are recorded into this
        graph instead of run (appended to what it holds); other threads' calls run meanwhile."""
        be = self.device.backend
        with be.lock:
            if getattr(self.device, "_graph", None) is not None:
                raise ValueError("a graph is already capturing on this device (one capture at a time a device, "
                                 "in one thread: the others' calls run meanwhile)")
            self.device._graph, self.device._graph_thread = self, threading.get_ident()
            self._capturing = True
        try:
            yield self
        finally:
            with be.lock:
                self.device._graph = self.device._graph_thread = None
                self._capturing = False
                self._rec, self._progs = self._destroy_rec(), None

    def add_cache_call(self, cache, step) -> None:
        """A cache's call (vkattn.cache / vkattn.paged): ``step`` has prepare() -> [(program,
        uploads)] and commit()."""
        if cache in self._caches:
            raise ValueError(f"a graph holds one call per cache: this {type(cache).__name__} has one already "
                             f"(record the next step in the next graph, or replay this one)")
        self._caches.add(cache)
        self._items.append(("cache", step))

    def dispatch(self, algorithm, reads=(), writes=(), name: str = "caller") -> None:
        """The caller's kp.Algorithm (built on this device's kp.Manager over DeviceArray
        tensors), dispatched at this point of the graph; ``reads`` / ``writes``: the DeviceArrays
        it reads and writes (the barriers follow from them)."""
        self._check_capture()
        reads, writes = list(reads), list(writes)
        self._check_arrays("dispatch", "reads and writes", reads + writes)
        self._items.append(("dispatch", _CallerProgram(algorithm, reads, writes, name)))
        self._open_at = None

    def upload(self, *arrays: DeviceArray) -> None:
        """Copy each array's host staging copy (DeviceArray.host_view) to the device at this
        point of the graph, as it is when the graph is submitted."""
        self._check_capture()
        self._check_arrays("upload", "arrays", arrays)
        self._items.extend(("upload", a) for a in arrays)
        self._open_at = None

    def download(self, *arrays: DeviceArray) -> None:
        """Copy each array to its host staging copy at this point (read it with host_view()
        after the wait)."""
        self._check_capture()
        self._check_arrays("download", "arrays", arrays)
        self._items.extend(("download", a) for a in arrays)
        self._open_at = None

    def _check_capture(self) -> None:
        if not self._capturing:
            raise ValueError("record into a graph inside `with graph.capture():`")

    def _check_arrays(self, what: str, which: str, arrays) -> None:
        """Every one of ``arrays`` a DeviceArray on this graph's device (ValueError) and open
        (CacheClosedError), checked before anything is recorded."""
        for a in arrays:
            if not isinstance(a, DeviceArray):
                raise ValueError(f"{what}: {which} must be DeviceArrays on {self.device.name!r}, "
                                 f"got {type(a).__name__}")
            if a.device is not self.device:
                raise ValueError(f"{what}: {which} must be DeviceArrays on this graph's device {self.device!r}, "
                                 f"got one on {a.device!r}" + same_device_hint(a.device, self.device))
            a._check_open()

    def _caller_arrays(self):
        """The DeviceArrays the caller's own items (dispatches, uploads, downloads) use."""
        for kind, item in self._items:
            if kind == "dispatch":
                yield from item.arrays
            elif kind != "cache":
                yield item

    # ------------------------------------------------------------------ submit
    def submit(self) -> Handle:
        """Prepare every cache call for the caches' current lengths, record the command buffer
        if a plan changed (or on the first submission), submit it and return at once."""
        be = self.device.backend
        with be.lock:
            if self.device.closed:
                raise CacheClosedError(f"the device {self.device.name!r} is closed")
            if self._open_at != DeviceArray.closes:   # a closed array's memory is gone: nothing submitted
                for a in self._caller_arrays():     # (looked at again only after some array was closed)
                    a._check_open()
                self._open_at = DeviceArray.closes
            if self._handle is not None:
                self._handle.wait()
            if be.pending is not None:
                be.pending.wait()
            # the cache calls' programs for their lengths now: the recording is kept while they are
            # the same (the other items are fixed at capture); one program a call, mostly
            work, progs = [], []
            for kind, item in self._items:
                if kind == "cache":
                    w = item.prepare()
                    progs.append(w[0][0] if len(w) == 1 else tuple([p for p, _ in w]))
                    work.append(w)
                else:
                    work.append(item)
            if self._rec is None or progs != self._progs:
                self._destroy_rec()
                rec = be.recording()
                for (kind, _), w in zip(self._items, work):
                    if kind == "cache":
                        for prog, up in w:
                            if up:
                                rec.upload_after(*up)
                            rec.dispatch(prog, barriers=True)
                    elif kind == "dispatch":
                        rec.dispatch(w, barriers=True)
                    elif kind == "upload":
                        rec.upload_after(w.buffer)
                    else:
                        rec.download(w.buffer)
                self._rec, self._progs = rec.build(self.timestamps), progs
                self.recordings += 1
            self._rec.submit()
            be.pending = self._rec
            for kind, item in self._items:
                if kind == "cache":
                    item.commit()
            self.submissions += 1
            self._handle = Handle(self, self._rec)
            return self._handle

    def run(self) -> None:
        """submit() and wait."""
        self.submit().wait()

    def last_timings(self) -> list:
        """Device time of each recorded command of the last submission, waited for, as ``[(op,
        ms), ...]`` in ``ops``' order, from Vulkan timestamp queries: a graph made with
        ``timestamps=True`` on a device that has them (``Device.info.timestamp_compute_and_graphics``;
        otherwise an empty list). Their sum is the submission's device time."""
        if not self.timestamps or self._rec is None:
            return []
        if self._handle is not None:
            self._handle.wait()
        return self._rec.timings(self.device.info.timestamp_period)

    @property
    def ops(self) -> list:
        """The recorded commands of the last recording, in order (uploads, dispatches, barriers,
        downloads)."""
        return self._rec.ops if self._rec is not None else []

    def _destroy_rec(self):
        if self._rec is not None:
            if self._handle is not None:
                self._handle.wait()
            self._rec.destroy()
        self._rec = None
        return None

    def close(self) -> None:
        """Wait for a pending submission and free the recording. After the device's close (which
        freed everything on it) it only forgets the recording: harmless, as a cache's close is, so
        a ``with Graph(dev)`` body's own error is the one raised."""
        if self.device.closed:
            self._rec = self._handle = None
            self._items, self._caches = [], set()
            return
        with self.device.backend.lock:
            self._destroy_rec()
            self._items, self._caches = [], set()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
