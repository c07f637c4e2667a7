"""What KVCache and PagedKVCache share: argument checks, the K/V (and int8 scale) device buffers,
the plan LRU, timings and closing."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from . import reference
from .array import DeviceArray, check_device_array
from ._attn import Pipeline, RoPE, destroy, grid_groups, host_mask, put_rows, set_storage, token_bytes, unpack_rows
from .checks import SCALE_MAX, check_array, check_bool, check_int, check_scale, env_flag, plainly_finite
from .compiler import compile_shader
from .device import Device, default_device
from .errors import CacheClosedError, DeviceLimitError, VerificationError
from .formats import DTYPES, dtype_list
from .reference import check_fp8_scale
from .tuning import FUSED_APPEND_MAX_ROWS, TEXEL_APPEND_MIN_WORDS, WORKGROUP, coopmat_takes, kernel_for, row_bucket, \
    texel_kv

MAX_PLANS = 8
READ_ROWS = 4096        # positions per read() submission


def appends_first(device, most_new_rows: int, rows: int, ch: int, matrices: bool = True) -> bool:
    """Whether a forward whose largest sequence brings ``most_new_rows`` new rows (and ``rows``
    query rows) appends them in a dispatch of its own and then attends from the cache, instead
    of fusing the append into the attention dispatch: more than FUSED_APPEND_MAX_ROWS, or a call
    attn_coopmat.comp takes (it reads every key from the cache; tuning.coopmat_takes). One
    submission with a barrier between the two dispatches (AttnPlan.run's ``first``); two with a
    plain kp, which records no barrier."""
    if most_new_rows > FUSED_APPEND_MAX_ROWS:
        return True
    return most_new_rows > 0 and coopmat_takes(device, rows, ch, matrices)


_F32 = np.dtype(np.float32)    # compared as a dtype: against the scalar type, numpy converts it every time (0.1 us)


def fast_call_ok(causal, scale, rope_q, return_lse, out, lse) -> bool:
    """The arguments a fast path takes as they are (anything else: the general path's checks):
    bool causal and rope_q, a float scale or None, no ``lse=``, lse returned only on numpy."""
    return (type(causal) is bool and (scale is None or type(scale) is float) and type(rope_q) is bool
            and lse is None and (return_lse is False or (return_lse is True and out is None)))


class CacheBase:
    """Set up by :meth:`_setup`; subclasses say how many rows (``rows_per_head`` positions of every
    kv head) the K and V buffers hold and what ``capacity``/``num_blocks`` is called."""

    def _setup(self, num_kv_heads, head_dim, v_head_dim, dtype, device, verify, timestamps, rope) -> None:
        self.num_kv_heads = check_int("num_kv_heads", num_kv_heads, 1)
        self.head_dim = check_int("head_dim", head_dim, 1)
        self.v_head_dim = self.head_dim if v_head_dim is None else check_int("v_head_dim", v_head_dim, 1)
        self._scale = check_scale(None, self.head_dim)     # the default scale, for the fast paths
        key = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", None) or getattr(dtype, "name", None)
        if key not in DTYPES:
            raise TypeError(f"dtype: expected {dtype_list()}, got {dtype!r}")
        self.dtype = key
        if device is not None and not isinstance(device, Device):
            raise TypeError(f"device: expected a vkattn.Device or None, got {type(device).__name__}")
        self.device = device or default_device()
        self.verify = env_flag("VKATTN_VERIFY", False) if verify is None \
            else check_bool("verify", verify)
        if rope is not None and not isinstance(rope, RoPE):
            raise TypeError(f"rope: expected a vkattn.RoPE or None, got {type(rope).__name__}")
        self.rope = rope
        self._rope_dim = rope.dim(self.head_dim) if rope else 0
        set_storage(self)
        self._scales = None
        self.timestamps = check_bool("timestamps", timestamps) and self.device.info.timestamp_compute_and_graphics
        self._plans: OrderedDict = OrderedDict()
        self._last_rec = None
        # the device's lock: plans of all caches on a device share scratch buffers (Backend.shared_buffer)
        self._lock = self.device.backend.lock
        self._closed = False

    def _allocate(self, positions: int, name: str, unit: int, what: str) -> None:
        """K and V buffers for ``positions`` positions of every kv head, allocated once. Refused
        with DeviceLimitError naming the largest ``name`` that fits (in steps of ``unit``
        positions) if one buffer would pass the device's limit."""
        dev = self.device
        limit = dev.max_buffer_bytes
        unit_bytes = unit * self.num_kv_heads * 16 * max(self._rk4, self._rv4)
        need = unit_bytes * (positions // unit)
        if need > limit:
            raise DeviceLimitError(
                f"{name}: {positions // unit} {what} need a {need}-byte buffer; {dev.name} allows {limit} bytes "
                f"per buffer, so the largest {name} for this shape is {limit // unit_bytes}")
        be = dev.backend
        rows = self.num_kv_heads * positions
        # under the device's lock, as every call: kp's manager is not for two threads at once, and
        # fp8's upload waits for a graph another thread has in flight (without the lock both
        # threads waited on one fence, and one forever)
        with be.lock:
            self._k = be.buffer(rows * 4 * self._rk4, np.uint32, host_visible=False, name="k_cache")
            self._v = be.buffer(rows * 4 * self._rv4, np.uint32, host_visible=False, name="v_cache")
            if self._fp8:                # fp8: one float32 scale per kv head for K and for V, fixed
                self._ks = be.buffer(self.num_kv_heads, np.float32, name="k_scale")
                self._vs = be.buffer(self.num_kv_heads, np.float32, name="v_scale")
                self._ks.view()[:] = self._scales[0]
                self._vs.view()[:] = self._scales[1]
                rec = be.recording().upload(self._ks, self._vs).build()
                rec.run()
                rec.destroy()
                return
            n = rows if self._i8 else 1  # int8: one float32 scale per K row and per V row
            self._ks = be.buffer(n, np.float32, host_visible=False, name="k_scale")
            self._vs = be.buffer(n, np.float32, host_visible=False, name="v_scale")

    def _set_scales(self, k_scale, v_scale) -> None:
        """The fp8 scales (``_scales``: K's and V's, (num_kv_heads,) float32 each), checked before
        anything is allocated: ValueError / TypeError for a bad one, or for a scale given to a
        cache of another dtype."""
        if not self._fp8:
            for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
                if s is not None:
                    raise ValueError(f"{name}: only the fp8 formats ('fp8_e4m3', 'fp8_e5m2') take a scale; this "
                                     f"cache's dtype is {self.dtype!r}")
            return
        self._scales = (check_fp8_scale(1.0 if k_scale is None else k_scale, self.num_kv_heads, self.dtype, "k_scale"),
                        check_fp8_scale(1.0 if v_scale is None else v_scale, self.num_kv_heads, self.dtype, "v_scale"))

    @property
    def k_scale(self):
        """fp8: K's scale per kv head, (num_kv_heads,) float32 (a copy; value = decode(byte) *
        scale), fixed at creation; None for the other dtypes."""
        return None if self._scales is None else self._scales[0].copy()

    @property
    def v_scale(self):
        """fp8: V's scale per kv head, (num_kv_heads,) float32 (a copy); None for the other dtypes."""
        return None if self._scales is None else self._scales[1].copy()

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
            if not self.device.closed:
                self.device.backend.wait_pending()  # a graph in flight may hold this cache's calls
            for plan in self._plans.values():
                plan.destroy()
            self._plans.clear()
            self._fast_plans = None
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

    # ------------------------------------------------------------------ numpy or device arrays
    def _check_q_array(self, q, rows):
        """q (num_qo_heads, rows or any, head_dim): numpy (checked, as float32) or a DeviceArray
        on this cache's device whose rows the kernels read unpadded."""
        if isinstance(q, DeviceArray):
            return check_device_array("q", q, (None, rows, self.head_dim), self.device, 4 * self._ch)
        return check_array("q", q, (None, rows, self.head_dim))

    def _check_device_kv(self, k, v, n):
        """Both DeviceArrays on this device: k (num_kv_heads, n, head_dim), v (.., v_head_dim).
        Their values are the caller's (no readback): a float16 or bfloat16 cache stores them
        rounded, and values past its range become infinities there (numpy inputs are refused
        instead)."""
        if not (isinstance(k, DeviceArray) and isinstance(v, DeviceArray)):
            raise TypeError(f"k, v: both numpy arrays or both vkattn.DeviceArray, got {type(k).__name__} and "
                            f"{type(v).__name__}")
        k = check_device_array("k", k, (self.num_kv_heads, n, self.head_dim), self.device, 4 * self._ch)
        v = check_device_array("v", v, (self.num_kv_heads, n, self.v_head_dim), self.device, 4 * self._ch)
        return k, v

    def _check_outputs(self, out, lse, hq: int, s: int, ins=()) -> tuple:
        """``out=`` (num_qo_heads, s, v_head_dim) and ``lse=`` (num_qo_heads, s): None or
        DeviceArrays on this device (written in place), neither one of the call's inputs ``ins``
        (q, k, v): one dispatch reads those while its other workgroups write out (out=k of 24 new
        int8 rows corrupted the output and the cache)."""
        if out is not None:
            if any(out is x for x in ins):
                raise ValueError("out: the same DeviceArray as q, k or v of the call; the kernel reads those while "
                                 "it writes out: give out an array of its own")
            out = check_device_array("out", out, (hq, s, self.v_head_dim), self.device)
        if lse is not None:
            lse = check_device_array("lse", lse, (hq, s), self.device)
        return out, lse

    # ------------------------------------------------------------------ the fast paths' tests
    def _fast_kinds(self, q, k, v, out) -> bool:
        """Whether q, k, v are what a fast path takes: numpy float32 (h, n, d) arrays (any
        strides) with ``out`` None, or DeviceArrays of this device, open and 3-D, with ``out`` one
        too and head dims the kernels read unpadded; k and v both None for an attend. Shapes are
        the caller's to compare."""
        if out is None:
            if type(q) is not np.ndarray or q.dtype != _F32 or q.ndim != 3:
                return False
            if k is None and v is None:
                return True
            return (type(k) is np.ndarray and type(v) is np.ndarray and k.dtype == _F32
                    and v.dtype == _F32 and k.ndim == 3 and v.ndim == 3)
        dev = self.device
        for a in (q, out) if k is None and v is None else (q, k, v, out):
            if type(a) is not DeviceArray or a.device is not dev or a._buf is None or len(a.shape) != 3:
                return False
        if out is q or out is k or out is v:
            return False                # the general path refuses it
        return not (self.head_dim | self.v_head_dim) % (4 * self._ch)

    def _fast_shapes(self, q, k, v, out):
        """(hq, new rows, query rows) where q, k, v (and ``out``) are what a fast path takes
        (_fast_kinds) and agree with this cache and each other: k and v (hkv, n >= 1, head dims)
        or both None (n = 0), q (hq, s, head_dim) with hq a multiple of hkv, out (hq, s,
        v_head_dim); None otherwise (the general path decides). Counts are the caller's to bound."""
        if not self._fast_kinds(q, k, v, out):
            return None
        hkv, n = self.num_kv_heads, 0 if k is None else k.shape[1]
        hq, s = q.shape[0], q.shape[1]
        if k is not None and (n < 1 or k.shape != (hkv, n, self.head_dim) or v.shape != (hkv, n, self.v_head_dim)):
            return None
        if q.shape[2] != self.head_dim or hq < 1 or hq % hkv:
            return None
        if out is not None and out.shape != (hq, s, self.v_head_dim):
            return None
        return hq, n, s

    def _fast_scale(self, q, k, v, out, scale):
        """After _fast_shapes and the caller's count tests: the call's scale (the default where
        None), or None where the general path must decide -- verify mode, a scale not a finite
        positive float, numpy values not plainly finite (and, for a float16 cache, within its
        range: checks.plainly_finite, one dot product each)."""
        if self.verify:
            return None
        if scale is None:
            scale = self._scale
        elif not 0.0 < scale <= SCALE_MAX:
            return None
        if out is None and not (plainly_finite(q) and (k is None or (plainly_finite(k, self._f16)
                                                              and plainly_finite(v, self._f16)))):
            return None
        return scale

    def _check_not_capturing(self, what: str) -> None:
        """ValueError for a call that runs at once and that a graph does not record, made while
        a graph captures this device's calls (vkattn.graph): it would run before the calls
        captured ahead of it."""
        if self.device.capturing_graph() is not None:
            raise ValueError(f"{what}: a graph is capturing this device's calls, and {what} runs at once (it is "
                             f"not recorded): call it before or after `with graph.capture():` (a captured forward "
                             f"appends its rows when the graph is submitted)")

    def _check_graph_call(self, q, k, v, call) -> None:
        """vkattn.graph's rules for a captured call (ValueError naming the first broken one)."""
        for name, x in (("q", q), ("k", k), ("v", v), ("out", call["out"])):
            if (x is not None or name == "out") and not isinstance(x, DeviceArray):
                raise ValueError(f"{name}: a call captured into a graph takes DeviceArrays for q, k, v and out "
                                 f"(got {'nothing' if x is None else type(x).__name__} for {name})")
        if call["return_lse"] and call["lse"] is None:
            raise ValueError("lse: a captured call with return_lse=True writes lse into a DeviceArray (lse=)")
        if self.verify:
            raise ValueError("verify: a captured call cannot be verified on the host (build the cache with "
                             "verify=False, or run the call outside the graph)")

    @staticmethod
    def _host(out, lse, q) -> tuple:
        """numpy copies of whichever of out, lse, q are DeviceArrays (verify mode)."""
        return tuple(x.numpy() if isinstance(x, DeviceArray) else x for x in (out, lse, q))

    def _check_rope_q(self, rope_q) -> bool:
        rope_q = check_bool("rope_q", rope_q)
        if rope_q and self.rope is None:
            raise ValueError(f"rope_q: this cache has no rope; build it with {type(self).__name__}(..., "
                             f"rope=vkattn.RoPE(...))")
        return rope_q

    def _read_slots(self, slots: np.ndarray) -> tuple:
        """K (num_kv_heads, n, head_dim) and V of the cache rows at ``slots`` (positions of
        ``_block_size`` per block), as float32 exactly as stored; READ_ROWS per submission."""
        hkv, n = self.num_kv_heads, len(slots)
        k = np.empty((hkv, n, self.head_dim), np.float32)
        v = np.empty((hkv, n, self.v_head_dim), np.float32)
        if n:
            plan = self._plan(("read",), lambda: _SlotReadPlan(self))
            for a in range(0, n, READ_ROWS):
                k[:, a:a + READ_ROWS], v[:, a:a + READ_ROWS] = plan.run(slots[a:a + READ_ROWS])
        return k, v

    def _read_stored(self, slots: np.ndarray) -> tuple:
        """The rows at ``slots`` exactly as stored, copies: K words (n, num_kv_heads, _rk4 * 4)
        uint32, V words (n, num_kv_heads, _rv4 * 4) uint32, and int8 the K and V scales
        (n, num_kv_heads) float32 (else None, None); READ_ROWS per submission. A one-off plan
        sized for min(n, READ_ROWS) positions, destroyed afterwards: saving a many-layer model
        holds one readback buffer at a time, not one per layer."""
        hkv, n = self.num_kv_heads, len(slots)
        kw = np.zeros((n, hkv, self._rk4 * 4), np.uint32)
        vw = np.zeros((n, hkv, self._rv4 * 4), np.uint32)
        ks = np.zeros((n, hkv), np.float32) if self._i8 else None
        vs = np.zeros((n, hkv), np.float32) if self._i8 else None
        if n:
            plan, last = _SlotReadPlan(self, min(n, READ_ROWS)), self._last_rec
            try:
                for a in range(0, n, READ_ROWS):
                    got = plan.words(slots[a:a + READ_ROWS])
                    for dst, src in zip((kw, vw, ks, vs), got):
                        if dst is not None:       # copied as bits: no float conversion on the way
                            dst[a:a + READ_ROWS].view(np.uint32)[...] = src.view(np.uint32)
            finally:
                plan.destroy()
                self._last_rec = last
        return kw, vw, ks, vs

    def _verify_rows(self, out, lse, q, k, v, q_pos: int, call) -> None:
        """Verify mode: ``out``/``lse`` of query rows ``q`` (at positions ``q_pos`` ..) against
        the reference on K/V as stored; VerificationError beyond tolerance."""
        variant = call["variant"]
        if call["rope_q"]:
            q = self.rope.apply(q, np.arange(q_pos, q_pos + q.shape[1]), self._rope_dim)
        ref, ref_lse = reference.attention(
            q, k, v, causal=call["causal"], scale=call["scale"], window=variant.window,
            n_sink=variant.n_sink, mask=None if call["mask"] is None else host_mask(call["mask"], k.shape[1]),
            softcap=variant.softcap,
            alibi_slopes=variant.alibi, return_lse=True)
        check_parity(out, ref, lse, ref_lse, self.dtype)

    def _check_qo_heads(self, num_qo_heads) -> int:
        """num_qo_heads of a plan() call: a positive multiple of num_kv_heads."""
        hq = check_int("num_qo_heads", num_qo_heads, 1)
        if hq % self.num_kv_heads:
            raise ValueError(f"num_qo_heads: expected a multiple of num_kv_heads={self.num_kv_heads}, got {hq}")
        return hq

    def _appends_first(self, most_new_rows: int, rows: int | None = None, key_bound: int = 0) -> bool:
        """appends_first for this cache's device and storage (``rows``: default as many); and where
        the attention would read ``key_bound`` keys of every kv head, enough K/V words
        (TEXEL_APPEND_MIN_WORDS) that reading them from texel views (attn_lane.comp KV_TEXEL,
        which takes no fused append) pays for the append's own dispatch and barrier."""
        if appends_first(self.device, most_new_rows, most_new_rows if rows is None else rows, self._ch,
                         self._matrices):
            return True
        if most_new_rows < 1 or key_bound * self.num_kv_heads * 4 * (self._rk4 + self._rv4) < TEXEL_APPEND_MIN_WORDS:
            return False
        return texel_kv(self.device, kernel_for(self.device), 0, self)

    def _append_plan(self, n: int) -> "_SlotWritePlan":
        """append.comp for ``n`` rows: the plan of n's row bucket (tuning.row_bucket)."""
        b = row_bucket(n)
        return self._plan(("append", b), lambda: _SlotWritePlan(self, b))

    # vkattn.cache's fast path: (hq, s, n, key bound) -> (plan key, plan) or None where the call
    # takes the general path; dropped whenever a plan is destroyed
    _fast_plans = None

    def _plan_key(self, plan) -> tuple:
        """The LRU key of a plan it holds (newest first: a plan just looked up is found at once)."""
        return next(k for k, p in reversed(self._plans.items()) if p is plan)

    def _plan(self, key, make):
        """The plan for ``key`` from a small LRU, built by ``make()`` on a miss."""
        plan = self._plans.get(key)
        if plan is None:
            plan = make()
            self._plans[key] = plan
            while len(self._plans) > MAX_PLANS:
                self._plans.popitem(last=False)[1].destroy()
                self._fast_plans = None         # it may hold the plan just destroyed
        else:
            self._plans.move_to_end(key)
        return plan


def check_parity(out, ref, lse, ref_lse, dtype) -> None:
    """Verify mode: raise VerificationError if ``out``/``lse`` differ from the reference."""
    atol, rtol = reference.TOLERANCE[dtype]
    for name, got, want in (("output", out, ref), ("log-sum-exp", lse, ref_lse)):
        same_inf = np.isneginf(got) & np.isneginf(want)
        err = np.where(same_inf, 0.0, np.abs(got - want))
        bad = ~(err <= atol + rtol * np.where(same_inf, 0.0, np.abs(want)))
        if bad.any():
            worst = np.nan_to_num(np.where(bad, err, -1.0), nan=np.inf)
            at = np.unravel_index(int(np.argmax(worst)), err.shape)
            raise VerificationError(f"device {name} differs from the numpy reference: max abs error "
                                    f"{float(worst[at]):.3g} at {at} (atol {atol}, rtol {rtol}, "
                                    f"{int(bad.sum())} elements off)")


class _SlotReadPlan:
    """gather_slots.comp: up to READ_ROWS positions of K and V (and int8 scales) into readback
    buffers. Both layouts are blocks of [num_kv_heads, _block_size] rows: KVCache is one block of
    ``capacity``, PagedKVCache ``num_blocks`` blocks."""

    def __init__(self, c: CacheBase, rows: int = READ_ROWS):
        """``rows``: positions per run, at most READ_ROWS (the grid is READ_ROWS' either way)."""
        be = c.device.backend
        self.c = c
        self.ok, self.ov, self.params, self.oks, self.ovs = slot_buffers(c, rows, "read")
        pipe = gather_pipeline(c.device, c)
        self.prog = be.program(compile_shader(pipe.shader, pipe.defines),
                               [c._k, c._v, self.ok, self.ov, self.params, c._ks, c._vs, self.oks, self.ovs],
                               pipe.groups, pipe.spec, writes=(2, 3, 7, 8), name=pipe.name)
        self.rec = (be.recording().upload(self.params).dispatch(self.prog)
                    .download(self.ok, self.ov, self.oks, self.ovs).build(c.timestamps))

    def run(self, slots: np.ndarray):
        c = self.c
        kw, vw, ks, vs = self.words(slots)
        if c._fp8:
            ks, vs = c._scales
        return (unpack_rows(c, kw, ks, c.head_dim).transpose(1, 0, 2),
                unpack_rows(c, vw, vs, c.v_head_dim).transpose(1, 0, 2))

    def words(self, slots: np.ndarray) -> tuple:
        """The rows of up to READ_ROWS ``slots`` as stored, views of the readback buffers (valid
        until the next run): K words (n, num_kv_heads, _rk4 * 4) uint32, V words (n,
        num_kv_heads, _rv4 * 4), and int8 the K and V scales (n, num_kv_heads) float32 (else
        None, None)."""
        c, n = self.c, len(slots)
        p = self.params.view()
        p[0] = n * c.num_kv_heads
        p[1:1 + n * c.num_kv_heads] = slot_rows(c, slots).ravel()
        self.rec.run()
        c._last_rec = self.rec
        hkv = c.num_kv_heads
        ks = self.oks.view()[: n * hkv].reshape(n, hkv) if c._i8 else None
        vs = self.ovs.view()[: n * hkv].reshape(n, hkv) if c._i8 else None
        kw = self.ok.view()[: n * hkv * c._rk4 * 4].reshape(n, hkv, c._rk4 * 4)
        vw = self.ov.view()[: n * hkv * c._rv4 * 4].reshape(n, hkv, c._rv4 * 4)
        return kw, vw, ks, vs

    def destroy(self) -> None:
        destroy(self.rec, self.prog, self.ok, self.ov, self.params, self.oks, self.ovs)


class _SlotWritePlan:
    """append.comp for batches of up to ``n`` rows, each written at a slot the caller gives, in
    the slot numbering of _SlotReadPlan (KVCache: the position; PagedKVCache:
    ``paging.AppendPlan.slots``): upload rows, slots and rotary table, one dispatch. The row count
    is a per-call value (dst[0]); buffers and grid are sized for ``n``."""

    def __init__(self, c: CacheBase, n: int):
        be, hkv = c.device.backend, c.num_kv_heads
        self.n, self.c = n, c
        buf = be.shared_buffer                   # scratch shared on the device (see AttnPlan)
        self.nk = buf(hkv * n * c._dk4 * c._ch * 4, np.float32, name="new_k")
        self.nv = buf(hkv * n * c._dv4 * c._ch * 4, np.float32, name="new_v")
        # the plan's own (host-filled per call; see AttnPlan.rope)
        self.dst = be.buffer(1 + 2 * hkv * n, np.uint32, name="append_rows")
        self.rope = be.buffer(n * max(c._rope_dim, 4), np.float32, name="rope_table")
        pipe = append_pipeline(c.device, c, n)
        self._pipe, self._spirv = pipe, compile_shader(pipe.shader, pipe.defines)
        self.prog = be.program(self._spirv, [c._k, c._v, self.nk, self.nv, self.dst, self.rope, c._ks, c._vs],
                               pipe.groups, pipe.spec, writes=(0, 1, 6, 7), name=pipe.name)
        inputs = self._inputs = [self.nk, self.nv, self.dst] + ([self.rope] if c.rope else [])
        self.rec = be.recording().upload(*inputs).dispatch(self.prog).build(c.timestamps)
        self._binds = OrderedDict()
        self._rows = {}                          # fill_rows' templates per row count

    def bound(self, nk, nv) -> tuple:
        """(program, recording, uploads) with device arrays' buffers ``nk`` / ``nv`` as the new rows
        (AttnPlan.bound's rule: built once per pair, a few kept)."""
        key = (nk, nv)
        hit = self._binds.get(key)
        if hit is not None and nk._t is not None and nv._t is not None:
            self._binds.move_to_end(key)
            return hit
        if hit is not None:
            destroy(*self._binds.pop(key)[:2])
        c, be = self.c, self.c.device.backend
        prog = be.program(self._spirv, [c._k, c._v, nk, nv, self.dst, self.rope, c._ks, c._vs],
                          self._pipe.groups, self._pipe.spec, writes=(0, 1, 6, 7), name=self._pipe.name)
        up = [self.dst] + ([self.rope] if c.rope else [])
        hit = self._binds[key] = (prog, be.recording().upload(*up).dispatch(prog).build(c.timestamps), up)
        while len(self._binds) > 4:
            destroy(*self._binds.pop(next(iter(self._binds)))[:2])
        return hit

    def run(self, k, v, slots: np.ndarray, positions: np.ndarray | None = None) -> None:
        """k (num_kv_heads, n, head_dim), v (num_kv_heads, n, v_head_dim); new row r goes to
        ``slots[r]`` (distinct, checked by the caller) and is rotated at ``positions[r]``
        (default: the slots, which are the positions of a KVCache)."""
        rec = self.stage(k, v, slots, positions)[2]
        rec.run()
        self.c._last_rec = rec

    def stage(self, k, v, slots: np.ndarray, positions: np.ndarray | None = None) -> tuple:
        """What :meth:`run` does short of submitting: the rows, slots and rotary table written
        to the host side of their buffers. Returns (program, uploads, recording): the dispatch
        and what it uploads, which a later plan may record ahead of its own in one submission
        (AttnPlan.run's ``first``), and the recording that runs it alone."""
        c = self.c
        n = k.shape[1]
        if isinstance(k, DeviceArray):
            self.fill_rows(n, slots, positions)
            prog, rec, up = self.bound(k.buffer, v.buffer)
            return prog, up, rec
        put_rows(self.nk, k, c._dk4 * c._ch * 4)
        put_rows(self.nv, v, c._dv4 * c._ch * 4)
        self.fill_rows(n, slots, positions)
        return self.prog, self._inputs, self.rec

    def fill_rows(self, n: int, slots, positions: np.ndarray | None = None) -> None:
        """The row list and rotary table of a call of ``n`` rows (what run uploads besides K/V).
        ``slots``: an array, or a ``range`` of consecutive slots in the first block (KVCache's
        positions, rotated at themselves), whose words come from a template of the count's kept
        here plus the first slot."""
        c = self.c
        hkv = c.num_kv_heads
        d = self.dst.view()                      # [count, (cache row, rotary-table row) per h, r]
        d[0] = hkv * n
        if type(slots) is range and positions is None and slots.step == 1 and slots.stop <= c._block_size:
            words = self._rows.get(n)
            if words is None:                    # the words of range(n): row h * block + r, then r
                if len(self._rows) > 8:
                    self._rows.clear()
                words = self._rows[n] = np.empty(2 * hkv * n, np.uint32)
                words[0::2] = slot_rows(c, range(n)).T.ravel()
                words[1::2] = np.tile(np.arange(n, dtype=np.uint32), hkv)
            end = 1 + 2 * hkv * n
            d[1:end] = words
            d[1:end:2] += slots.start
            if c.rope:
                self.rope.view()[:n * c._rope_dim] = c.rope.rows(slots.start, n, c._rope_dim)
            return
        d[1:1 + 2 * hkv * n:2] = slot_rows(c, slots).T.ravel()    # row of (h, r) at h * n + r
        d[2:2 + 2 * hkv * n:2] = np.tile(np.arange(n, dtype=np.uint32), hkv)
        if c.rope:
            pos = slots if positions is None else positions
            self.rope.view()[:n * c._rope_dim] = c.rope.table(np.asarray(pos), c._rope_dim).ravel()

    def warm(self) -> None:
        """One dispatch that writes no row (count 0): the driver builds the pipeline now."""
        self.dst.view()[0] = 0
        self.rec.run()

    def destroy(self) -> None:
        for prog, rec, _ in self._binds.values():
            destroy(rec, prog)
        self._binds.clear()
        destroy(self.rec, self.prog, self.nk, self.nv, self.dst, self.rope)


def slot_buffers(c, rows: int, what: str) -> tuple:
    """Host buffers of a slot gather (read) or scatter (load) of ``rows`` positions, all kv heads:
    K words, V words, the row list (count + one cache row per position and head), int8 K and V
    scales (one word each for other dtypes)."""
    be, hkv = c.device.backend, c.num_kv_heads
    n = rows * hkv
    return (be.buffer(n * c._rk4 * 4, np.uint32, name=f"{what}_k"), be.buffer(n * c._rv4 * 4, np.uint32, name=f"{what}_v"),
            be.buffer(1 + n, np.uint32, name=f"{what}_rows"),
            be.buffer(n if c._i8 else 1, np.float32, name=f"{what}_kscale"),
            be.buffer(n if c._i8 else 1, np.float32, name=f"{what}_vscale"))


def slot_rows(c, slots) -> np.ndarray:
    """(n, num_kv_heads) uint32: the cache row of each slot for each kv head, in the block layout
    both caches share (KVCache: one block of ``capacity`` positions, slot = position)."""
    s = np.asarray(slots, dtype=np.int64)[:, None]
    h = np.arange(c.num_kv_heads, dtype=np.int64)[None, :]
    bs = c._block_size
    return (((s // bs) * c.num_kv_heads + h) * bs + s % bs).astype(np.uint32)


def gather_pipeline(dev, c) -> Pipeline:
    """gather_slots.comp of _SlotReadPlan for the storage format ``c`` (a cache or StorageFormat):
    one pipeline per format (the rows come from the host)."""
    groups = grid_groups(READ_ROWS * c.num_kv_heads * max(c._rk4, c._rv4), dev)
    return Pipeline("gather_slots", "gather_slots", {"KV_I8": int(c._i8)}, (WORKGROUP, c._rk4, c._rv4),
                    (groups, 1, 1), 9)


def append_pipeline(dev, c, n: int) -> Pipeline:
    """append.comp of _SlotWritePlan: ``n`` rows per call (the grid; the pipeline serves any n)."""
    hkv = c.num_kv_heads
    # invocations append.comp loops over: one per row (int8), else one per row chunk of K and V
    total = 2 * hkv * n if c._i8 else hkv * n * max(c._dk4, c._dv4)
    flags = c.rope.flags(False) if c.rope else 0
    return Pipeline("append", "append", dict(c._defines), (WORKGROUP, c._dk4, c._dv4, flags, max(c._rope_dim, 8), hkv),
                    (grid_groups(total, dev), 1, 1), 8)
