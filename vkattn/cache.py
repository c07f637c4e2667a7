"""The persistent K/V cache and its plans (plan once, run cheaply)."""
from __future__ import annotations

import numpy as np

from .checks import check_array, check_bool, check_int, check_scale
from ._base import CacheBase, fast_call_ok
from .device import Device
from . import persist
from .errors import CacheFullError
from .tuning import FUSED_APPEND_MAX_ROWS, decode_key_bound, row_bucket
from ._attn import AttnPlan, RoPE, SeqCall, aux_bucket, check_mask, check_variant, fast_mask, mask_words
from .array import DeviceArray, buffers



class KVCache(CacheBase):
    """A K/V cache allocated once at ``capacity`` on a Vulkan device; the live length is a number.

    Shapes use fixed symbols: ``num_kv_heads``, ``head_dim``, ``v_head_dim``, ``capacity``, and for
    queries ``num_qo_heads`` (a multiple of ``num_kv_heads``: q head i reads kv head
    ``i // (num_qo_heads // num_kv_heads)``).

    Device layout: K is ``[num_kv_heads, capacity, head_dim]``, V ``[num_kv_heads, capacity,
    v_head_dim]``, each row padded with zeros to 16 bytes (8 halves or 4 floats). float16 is packed
    two per uint32 word. Allocation happens here and never again; appends write rows in place.

    ``dtype`` "fp8_e4m3" / "fp8_e5m2": one byte per value (vkattn.reference.fp8_bits of value /
    scale) with ``k_scale`` / ``v_scale`` -- a number or (num_kv_heads,) numbers, each a finite
    float32 > 0, default 1.0 -- fixed here for the cache's life (the ``k_scale`` / ``v_scale``
    properties); other dtypes take no scale (ValueError).
    """

    def __init__(self, capacity: int, num_kv_heads: int, head_dim: int, v_head_dim: int | None = None,
                 dtype="float16", device: Device | None = None, verify: bool | None = None,
                 timestamps: bool = False, rope: RoPE | None = None, *, k_scale=None, v_scale=None):
        self.capacity = check_int("capacity", capacity, 1)
        self._setup(num_kv_heads, head_dim, v_head_dim, dtype, device, verify, timestamps, rope)
        self._set_scales(k_scale, v_scale)
        # row of (head h, position j) = h * capacity + j: head-major, i.e. one block of capacity
        # positions in the block layout of PagedKVCache (attn_common.glsl, gather_slots.comp)
        self._head_stride = self._block_size = self.capacity
        self._block_stride = self.num_kv_heads * self.capacity
        self._allocate(self.capacity, "capacity", 1, "positions")
        self._length = 0

    # ------------------------------------------------------------------ properties
    @property
    def length(self) -> int:
        """Live length: rows 0 .. length-1 of every head hold data."""
        return self._length

    @property
    def nbytes(self) -> int:
        """Device bytes held by K and V (and int8 scales), fixed at construction."""
        return self.capacity * self.bytes_per_token

    # ------------------------------------------------------------------ public API
    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """Write ``n`` new positions at the live length.

        k: (num_kv_heads, n, head_dim), v: (num_kv_heads, n, v_head_dim), float32 or float16.
        Raises CacheFullError if ``length + n > capacity``; on any error nothing is written.
        """
        with self._lock:
            self._check_open()
            self._check_not_capturing("append")
            k, v = self._check_kv(k, v)
            n = k.shape[1]
            self._check_fits(n)
            self._append_plan(n).run(k, v, range(self._length, self._length + n))
            self._length += n

    def attend(self, q: np.ndarray, causal: bool = True, scale: float | None = None, *,
               window: int | None = None, n_sink: int = 0, mask: np.ndarray | None = None,
               softcap: float | None = None, alibi_slopes: np.ndarray | None = None,
               return_lse: bool = False, rope_q: bool = False, out=None, lse=None):
        """Attention of ``s`` query rows, the last ``s`` positions of the cache, over the cache.

        q: (num_qo_heads, s, head_dim) -> (num_qo_heads, s, v_head_dim) float32, and with
        ``return_lse`` also the log-sum-exp of each row's scores, (num_qo_heads, s) float32.
        Row i sits at position ``p = length - s + i``; with ``causal`` it sees keys 0 .. p.
        ``scale`` defaults to 1/sqrt(head_dim). Variants (docs/variants.md):
        ``window`` (keys p - j >= window are masked) with ``n_sink`` sink keys always visible,
        ``mask`` (s, length) or (num_qo_heads, s, length) added to the scores, ``softcap``
        (scores become softcap * tanh(scores / softcap)), ``alibi_slopes`` (num_qo_heads,)
        (score += slope * (j - p)). ``rope_q``: rotate the queries at their positions with the
        cache's ``rope`` (keys were rotated when appended).

        Device arrays (vkattn.DeviceArray, same shapes): ``q`` is read where it lies; ``out``
        ((num_qo_heads, s, v_head_dim)) and ``lse`` ((num_qo_heads, s)) are written in place and
        returned instead of numpy copies. Nothing crosses to the host that is not asked for.
        ``mask`` may be a DeviceArray (s, C) or (num_qo_heads, s, C) with C >= length: its first
        ``length`` columns are copied into the call's aux block on the device
        (shaders/mask_copy.comp), its values unchecked (NaN or +inf there give NaN rows), so a
        mask the caller's own dispatches write -- one as wide as the capacity -- serves every
        replay of a graph.
        """
        if fast_call_ok(causal, scale, rope_q, return_lse, out, lse):
            fast = self._fast_call(q, None, None, causal, scale, out, window, n_sink, softcap, mask, alibi_slopes,
                                   rope_q, return_lse)
            if fast is not None:
                return fast
        with self._lock:
            self._check_open()
            q = self._check_q(q, self._length)
            call = self._check_call(q, self._length, causal, scale, window, n_sink, mask, softcap,
                                    alibi_slopes, return_lse, rope_q, out, lse, (q,))
            return self._run(q, None, None, call)

    def forward(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = True,
                scale: float | None = None, *, window: int | None = None, n_sink: int = 0,
                mask: np.ndarray | None = None, softcap: float | None = None,
                alibi_slopes: np.ndarray | None = None, return_lse: bool = False, rope_q: bool = False,
                out=None, lse=None):
        """Append ``k``/``v`` then attend ``q``. Up to ``vkattn.tuning.FUSED_APPEND_MAX_ROWS``
        new rows go in one device submission (the append is fused into the attention dispatch,
        which reads those rows from the input); more are appended in a submission of their own
        first and attended from the cache. Shapes as in :meth:`append` and :meth:`attend` (a mask
        covers the ``length + n`` positions after the append); the ``s`` query rows are the last
        ``s`` positions after the append. All checks run first: on any error the cache is
        unchanged. q, k, v, ``out`` and ``lse`` may be device arrays, as in :meth:`attend`."""
        if fast_call_ok(causal, scale, rope_q, return_lse, out, lse):
            fast = self._fast_call(q, k, v, causal, scale, out, window, n_sink, softcap, mask, alibi_slopes,
                                   rope_q, return_lse)
            if fast is not None:
                return fast
        with self._lock:
            self._check_open()
            k, v = self._check_kv(k, v)
            n = k.shape[1]
            q = self._check_q(q, self._length + n)
            call = self._check_call(q, self._length + n, causal, scale, window, n_sink, mask, softcap,
                                    alibi_slopes, return_lse, rope_q, out, lse, (q, k, v))
            if self.device.capturing_graph() is None:   # a captured call fits or not when it is submitted
                self._check_fits(n)
            return self._run(q, k, v, call)

    def plan(self, num_qo_heads: int, s: int = 1, n_new: int = 0, rope_q: bool = False) -> None:
        """Build (or fetch) everything a call shape needs -- pipelines, buffers, the recorded
        sequence -- and have the driver compile the pipelines now (one empty dispatch each; seconds
        on lavapipe the first time a pipeline is seen, then cached by the driver), so the first
        :meth:`attend` (``n_new == 0``) or :meth:`forward` (``n_new`` new rows) with
        ``num_qo_heads`` heads, ``s`` query rows, no score variant and ``rope_q`` only writes
        inputs and evaluates. Writes nothing to the cache."""
        with self._lock:
            self._check_open()
            hq = self._check_qo_heads(num_qo_heads)
            s = check_int("s", s, 1, self.capacity)
            n_new = check_int("n_new", n_new, 0, self.capacity)
            rope_q = self._check_rope_q(rope_q)           # bool, and no rope_q without a rope
            flags = self.rope.flags(rope_q) if self.rope else 0
            total = min(self._length + n_new, self.capacity)
            for p in self._forward_plans(hq, s, n_new, flags, AttnPlan.aux_need(1, row_bucket(s), hq, 0, 0), total):
                if p is not None:
                    p.warm()

    def truncate(self, length: int) -> None:
        """Roll back to ``length`` live positions (0 <= length <= self.length); no device work."""
        with self._lock:
            self._check_open()
            self._length = check_int("length", length, 0, self._length)

    def reset(self) -> None:
        """Empty the cache (length 0). The device buffers stay allocated."""
        self.truncate(0)

    def read(self) -> tuple:
        """The live part as float32 arrays: K (num_kv_heads, length, head_dim) and
        V (num_kv_heads, length, v_head_dim), exactly as stored (float16-rounded for float16)."""
        with self._lock:
            self._check_open()
            return self._read_slots(np.arange(self._length))

    def save(self, path, token_ids=None) -> None:
        """Write the live part to the file ``path`` (safetensors; layout in vkattn.persist): K
        (num_kv_heads, length, head_dim) and V (num_kv_heads, length, v_head_dim) exactly as
        stored -- float16, float32, or int8 with its scales; keys rotated with a ``rope`` -- with
        the settings a load checks and a sha256 checksum. ``token_ids``: optional (length,)
        integers, the token at each position, stored with them and returned by :meth:`load`.
        An existing file is replaced atomically. The cache is not changed."""
        with self._lock:
            self._check_open()
            persist.save_sequence(self, np.arange(self._length), path, token_ids)

    def load(self, path):
        """Replace the contents with a file :meth:`save` (or PagedKVCache.save_sequence) wrote,
        on this device or another: afterwards the cache holds exactly the file's positions, bit
        for bit as they were stored (nothing is rotated or quantised again), and attends as the
        saved cache did. The file must be intact (vkattn.CacheFileCorruptError: unreadable,
        truncated, checksum mismatch), written for this cache's dtype, num_kv_heads, head_dim,
        v_head_dim and rope (vkattn.CacheFileMismatchError, naming the setting; the capacity
        may differ) and fit (CacheFullError: length > capacity). Every check runs before
        anything is written: on any error the cache is unchanged. Returns the token ids saved
        with it, (length,) int64, or None."""
        with self._lock:
            self._check_open()
            n, tensors, token_ids = persist.read_sequence(self, path)
            if n > self.capacity:
                raise CacheFullError(f"load: the file holds {n} positions, more than capacity {self.capacity}; "
                                     f"nothing was written")
            self._restore(n, tensors)
            return token_ids

    def _restore(self, n: int, tensors: dict, prefix: str = "") -> None:
        """Replace the contents with ``n`` positions of checked file tensors (names prefixed by
        ``prefix``; vkattn.persist), written as stored."""
        try:
            persist.write_stored(self, np.arange(n), tensors, prefix)
        except BaseException:
            self._length = 0        # a device failure part-way: the old contents are gone
            raise
        self._length = n

    def _fast_call(self, q, k, v, causal, scale, out, window, n_sink, softcap, mask, alibi, rope_q, return_lse):
        """attend() (k, v None) or forward() of the common call -- numpy float32 q, k, v (any
        strides) (or DeviceArrays of this device with ``out`` one too), at most
        FUSED_APPEND_MAX_ROWS new rows (fused into the attention, or appended first where
        _forward_plans says so: the append staged and recorded ahead of the attention in one
        submission), causal or not, any score variant, a numpy mask (no DeviceArray: its copy
        program is the general path's), q rotated by the cache's RoPE or not, nothing asked but
        the output (and lse, for numpy calls) -- with the same checks in fewer steps: shapes
        compared as tuples, numpy values by one dot product each (checks.plainly_finite), a
        mask's by one maximum, the plan's aux words patched (AttnPlan.fill_simple). None where
        any of that does not hold: the caller takes the general path, whose checks raise the
        precise error."""
        shapes = self._fast_shapes(q, k, v, out)
        if shapes is None:
            return None
        hq, n, s = shapes
        if s < 1 or n > FUSED_APPEND_MAX_ROWS or (rope_q and self.rope is None):
            return None
        scale = self._fast_scale(q, k, v, out, scale)
        if scale is None:
            return None
        with self._lock:
            total = self._length + n
            if self._closed or self.device.closed or self.device._graph is not None or s > total \
                    or total > self.capacity:
                return None
            if mask is not None:
                mask = fast_mask(mask, hq, s, total)
                if mask is None:
                    return None
            variant = check_variant(hq, window, n_sink, softcap, alibi)    # raises as the general path would
            # the plans of (hq, s, n) at this key bound (_forward_plans'), memoised with what
            # decides the path: [attention plan key, plan, out's host view once used, append
            # plan key, append plan (both None: fused)], the keys touched in the LRU; or None (the
            # output width checked after the run: the general path). A mask's words grow with
            # the keys: so may the aux it needs
            bound = self.capacity if s != 1 else decode_key_bound(total, self.capacity)
            flags = variant.flags(mask is not None) | (self.rope.flags(rope_q) if self.rope is not None else 0)
            words = None if mask is None else AttnPlan.aux_need(1, row_bucket(s), hq, 0, mask.size)
            mkey = (hq, s, n, bound, flags) if words is None else (hq, s, n, bound, flags, aux_bucket(words))
            memo = self._fast_plans
            if memo is None:
                memo = self._fast_plans = {}
            hit = memo.get(mkey, 0)
            if hit == 0:
                if words is None:
                    words = AttnPlan.aux_need(1, row_bucket(s), hq, 0, 0)
                append, plan = self._forward_plans(hq, s, n, flags, words, total)
                hit = None
                if not plan._check_width:
                    hit = [self._plan_key(plan), plan, None, None, None]
                    if append is not None:
                        hit[3:] = self._plan_key(append), append
                memo = self._fast_plans = self._fast_plans or {}     # a plan built may have evicted some
                memo[mkey] = hit
            if hit is None:
                return None
            key, plan, result, akey, append = hit
            self._plans.move_to_end(key)
            if append is None:
                plan.fill_simple(q, k, v, self._length, scale, self.rope, variant, causal, mask)
                if out is not None:
                    rec = plan.bound(q._buf, None if k is None else k._buf, None if v is None else v._buf,
                                     out._buf, None)[1]
                else:
                    rec = plan.rec if return_lse else plan.out_only()
            else:                       # appended first: one submission with the patched kp
                self._plans.move_to_end(akey)
                first = append.stage(k, v, range(self._length, total))
                plan.fill_simple(q, None, None, total, scale, self.rope, variant, causal, mask)
                rec = plan.after(first, plan.rec if out is None else plan.bound(q._buf, None, None, out._buf, None)[1])
            rec.run()
            self._last_rec = rec
            self._length = total
            if out is not None:
                return out
            if return_lse:                  # numpy only: out and lse copied back
                return plan.result(s)
            if result is None:
                dv = self.v_head_dim
                result = hit[2] = plan.out.view()[:hq * s * dv].reshape(hq, s, dv)
            return result.copy()

    def _step_plans(self, step, q, n: int, call, total: int) -> tuple:
        """_call_plans of a graph step (its q, n and call fixed at capture) at ``total`` keys,
        memoised per step and key bound in ``_fast_plans`` (dropped whenever a plan is destroyed),
        the plans touched in the LRU as a lookup would: a replay does not search again."""
        bound = self.capacity if q.shape[1] != 1 else decode_key_bound(total, self.capacity)
        mask = call["mask"]
        if mask is not None:            # a device mask's words grow with the keys: so may the aux it needs
            bound = (bound, aux_bucket(AttnPlan.aux_need(1, row_bucket(q.shape[1]), q.shape[0], 0,
                                                         mask_words(mask, total))))
        memo = self._fast_plans
        hit = None if memo is None else memo.get((step, bound))
        if hit is None:
            plans = self._call_plans(q, n, call)
            keys = tuple(self._plan_key(plan) for plan in plans if plan is not None)
            memo = self._fast_plans = self._fast_plans or {}     # a plan built may have evicted some
            if len(memo) > 256:
                memo.clear()
            hit = memo[(step, bound)] = (plans, keys)
        for key in hit[1]:
            self._plans.move_to_end(key)
        return hit[0]

    def _call_flags(self, call) -> int:
        return call["variant"].flags(call["mask"] is not None) | (self.rope.flags(call["rope_q"]) if self.rope else 0)

    def _call_plans(self, q, n: int, call) -> tuple:
        """(append plan or None, attention plan) of a call of q with ``n`` new rows at the
        current length; the aux sized for the row bucket (lengths that share a plan share it)."""
        hq, s, mask = q.shape[0], q.shape[1], call["mask"]
        words = AttnPlan.aux_need(1, row_bucket(s), hq, 0, 0 if mask is None else mask_words(mask, self._length + n))
        return self._forward_plans(hq, s, n, self._call_flags(call), words, self._length + n)

    @staticmethod
    def _seq_call(s: int, fused: int, total: int, mask) -> SeqCall:
        """The one sequence of a call: ``fused`` new rows carried by the dispatch, ``total`` keys."""
        return SeqCall(past=total - fused, n_new=fused, q_start=0, q_len=s, mask=mask,
                       rope_pos=total - max(s, fused))

    def _capture(self, graph, q, k, v, call):
        """The call as a graph step: its plans are looked up and their host words filled when the
        graph is submitted, for the length the cache has then."""
        self._check_graph_call(q, k, v, call)
        s, n = q.shape[1], 0 if k is None else k.shape[1]
        cache = self
        # no mask (fill checks a numpy one's width at each replay; a device one's words come from
        # its copy program): fill_simple
        simple = call["mask"] is None

        class Step:
            def prepare(self):
                cache._check_open()
                cache._check_fits(n)
                total = cache._length + n
                append, plan = cache._step_plans(self, q, n, call, total)
                work, kk, vv = [], k, v
                if append is not None:
                    prog, up, _ = append.stage(k, v, range(cache._length, total))
                    work.append((prog, up))
                    kk = vv = None
                fused = 0 if kk is None else n
                if simple:                  # the rows appended first (or none) counted in the length
                    plan.fill_simple(q, kk, vv, cache._length if fused else total, call["scale"], cache.rope,
                                     call["variant"], call["causal"])
                copies = []
                if not simple:
                    seqs = [cache._seq_call(s, fused, total, call["mask"])]
                    plan.fill(q, kk, vv, seqs, call["causal"], call["scale"], call["variant"], cache.rope)
                    copies = plan.mask_programs(seqs)
                prog, _, up = plan.bound(*buffers(q, kk, vv, call["out"], call["lse"]))  # device tested above
                if copies:                  # a device mask: copied into aux after its upload
                    work += [(copies[0], up)] + [(c, []) for c in copies[1:]]
                    up = []
                work.append((prog, up))
                return work

            def commit(self):
                cache._length += n

        graph.add_cache_call(self, Step())
        return (call["out"], call["lse"]) if call["return_lse"] else call["out"]

    def __repr__(self) -> str:
        return (f"KVCache(length={self._length}, capacity={self.capacity}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, v_head_dim={self.v_head_dim}, dtype={self.dtype!r}, "
                f"device={self.device.name!r})")

    # ------------------------------------------------------------------ internals
    def _check_kv(self, k, v):
        if isinstance(k, DeviceArray) or isinstance(v, DeviceArray):
            k, v = self._check_device_kv(k, v, None)
        else:
            k = check_array("k", k, (self.num_kv_heads, None, self.head_dim), max_abs=self._max_abs,
                            rotary=self._rotary)
            v = check_array("v", v, (self.num_kv_heads, None, self.v_head_dim), max_abs=self._max_abs)
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"v: expected {k.shape[1]} positions like k, got {v.shape[1]}")
        return k, v

    def _check_q(self, q, total: int):
        q = self._check_q_array(q, None)
        if q.shape[0] % self.num_kv_heads:
            raise ValueError(f"q: expected num_qo_heads a multiple of num_kv_heads={self.num_kv_heads}, "
                             f"got {q.shape[0]}")
        if q.shape[1] > total:
            raise ValueError(f"q: {q.shape[1]} query rows but the cache would hold only {total} positions")
        return q

    def _check_fits(self, n: int) -> None:
        if self._length + n > self.capacity:
            raise CacheFullError(f"cannot add {n} positions: length {self._length} + {n} > capacity "
                                 f"{self.capacity} ({self.capacity - self._length} free)")

    def _check_call(self, q, total, causal, scale, window, n_sink, mask, softcap, alibi_slopes,
                    return_lse, rope_q, out=None, lse=None, ins=()) -> dict:
        hq, s = q.shape[0], q.shape[1]
        variant = check_variant(hq, window, n_sink, softcap, alibi_slopes)
        if mask is not None:
            mask = check_mask(mask, hq, s, total, self.device)
        out, lse = self._check_outputs(out, lse, hq, s, ins)
        return dict(causal=check_bool("causal", causal), scale=check_scale(scale, self.head_dim),
                    variant=variant, mask=mask, return_lse=check_bool("return_lse", return_lse),
                    rope_q=self._check_rope_q(rope_q), out=out, lse=lse)

    def _forward_plans(self, hq, s, n_new, flags, words, total) -> tuple:
        """(append plan or None, attention plan) for a call with ``n_new`` new rows and ``total``
        keys: fused into the attention dispatch, or appended first (CacheBase._appends_first)."""
        if self._appends_first(n_new, s, decode_key_bound(total, self.capacity) if s == 1 else 0):
            return self._append_plan(n_new), self._attn_plan(hq, s, 0, flags, words, total)
        return None, self._attn_plan(hq, s, n_new, flags, words, total)

    def _attn_plan(self, hq, s, n_new, flags, words, total) -> AttnPlan:
        bucket = aux_bucket(words)
        # decode: sized for the live length's power-of-two bucket (the split count follows the
        # context); prefill and chunks: for the capacity, and for the row bucket of s and n_new
        # (a new prompt length reuses the plan of its bucket)
        bound = decode_key_bound(total, self.capacity) if s == 1 else self.capacity
        rows, nn = row_bucket(s), (row_bucket(n_new) if n_new else 0)
        return self._plan(("attn", hq, rows, nn, flags, bucket, bound),
                          lambda: AttnPlan(self, hq, rows, nn, 1, flags, bucket, bound, s == 1,
                                           self._rope_dim))

    def _run(self, q, k, v, call):
        """Plan (cached) and run one attend/forward; the length grows only after it succeeded.
        Inside a graph's capture (vkattn.graph) the call is recorded there instead."""
        graph = self.device.capturing_graph()
        if graph is not None:
            return self._capture(graph, q, k, v, call)
        s, n = q.shape[1], 0 if k is None else k.shape[1]
        total = self._length + n
        append, plan = self._call_plans(q, n, call)    # both built before either runs
        first = None
        if append is not None:                  # the new rows go in first (one submission with a barrier)
            first = append.stage(k, v, range(self._length, total))
            k = v = None
        seq = self._seq_call(s, 0 if k is None else n, total, call["mask"])
        out, lse = plan.run(q, k, v, [seq], call["causal"], call["scale"], call["variant"],
                            rope=self.rope, out=call["out"], lse=call["lse"], first=first)
        self._length += n
        out = call["out"] if out is None else out
        lse = call["lse"] if lse is None else lse
        if self.verify:
            last = self._last_rec                       # last_timings: the call's, not the read's
            self._verify_rows(*self._host(out, lse, q), *self.read(), self._length - s, call)
            self._last_rec = last
        return (out, lse) if call["return_lse"] else out
