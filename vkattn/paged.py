"""PagedKVCache: many sequences in one pool of fixed-size blocks."""
from __future__ import annotations

import weakref
from array import array
from itertools import accumulate, chain, repeat
from operator import add, mod

import numpy as np

from . import cascade
from ._attn import F_PAGED, AttnPlan, Pipeline, RoPE, SeqCall, aux_bucket, check_mask, check_variant, destroy, \
    fast_mask, grid_groups, mask_words, _PLAIN
from ._base import CacheBase, fast_call_ok
from .checks import check_array, check_bool, check_int, check_scale
from .compiler import compile_shader
from . import persist
from .device import Device
from .errors import CacheFileMismatchError, CacheFullError
from .array import DeviceArray, buffers
from .paging import _INT, _LIST, BlockPool, UnknownSequenceError, _plain_ids, _slots_of, root_hash
from .tuning import FUSED_APPEND_MAX_ROWS, WORKGROUP, decode_key_bound, kernel_for, own_splits, row_bucket



class PagedKVCache(CacheBase):
    """K/V of many sequences in one pool of ``num_blocks`` blocks of ``block_size`` token slots,
    allocated once on a Vulkan device.

    Device layout: the K pool is ``[num_blocks, num_kv_heads, block_size, head_dim]`` and the V
    pool ``[num_blocks, num_kv_heads, block_size, v_head_dim]``, rows padded to 16 bytes, float16
    packed two per uint32. Position ``pos`` of a sequence is row ``pos % block_size`` of block
    ``table[pos // block_size]``. A block is one contiguous byte range, so a fork's block copy is
    one memcpy, as in vLLM's flat layout; unlike the flat ``[num_blocks * block_size,
    num_kv_heads, head_dim]`` order, one head's rows of a block are contiguous too, so a decode
    workgroup (one kv head) streams ``block_size`` consecutive rows instead of rows
    ``num_kv_heads`` apart. Measured on lavapipe (8 kv heads, head_dim 128, float16, one
    sequence of 4096): 14.5-16.2 ms per decode step with the flat order, 6.4 ms with this one, the
    same as KVCache. An append writes ``num_kv_heads`` rows per token instead of one.

    Sequences share full blocks after :meth:`fork` (reference counted); a sequence's last, partial
    block is always its own -- fork and truncate copy it -- so an append never writes a shared
    block. Host bookkeeping: :class:`vkattn.paging.BlockPool`.

    Prefix caching: a full block whose token ids are known (``token_ids=`` of :meth:`forward`,
    :meth:`append`, :meth:`add_sequence`, or :meth:`set_token_ids`) is registered under a hash
    chained over its parent's hash and its ids (plus an optional ``salt``). ``add_sequence(
    token_ids=prompt)`` starts a sequence with the cached blocks of the prompt's longest cached
    prefix -- shared, not copied -- and ``length()`` says how many leading tokens the caller need
    not compute (at most ``len(prompt) - 1``, whole blocks: one token is always left to compute,
    for its logits). Blocks nobody holds stay cached until the pool needs them, evicted least
    recently released first; ``free_blocks`` counts them, so a full pool evicts before it refuses.
    Equal token ids (and salt) must mean equal K/V: put whatever else K/V depend on in the salt.

    Batched calls take sequences in the order of ``seq_ids`` and pack their tokens: with ``n_new``
    tokens for sequence i, ``q`` is (num_qo_heads, sum(n_new), head_dim) and ``k``/``v``
    (num_kv_heads, sum(n_new), head_dim / v_head_dim), sequence i's rows following sequence
    i-1's.

    ``dtype`` "fp8_e4m3" / "fp8_e5m2" takes ``k_scale`` / ``v_scale`` as :class:`KVCache` does:
    fixed for the pool, so forks, shared prefix blocks, cascade and saved sequences all mean the
    same values.
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 v_head_dim: int | None = None, dtype="float16", device: Device | None = None,
                 verify: bool | None = None, timestamps: bool = False, rope: RoPE | None = None, *,
                 k_scale=None, v_scale=None):
        self.num_blocks = check_int("num_blocks", num_blocks, 1)
        self.block_size = check_int("block_size", block_size, 1)
        self._setup(num_kv_heads, head_dim, v_head_dim, dtype, device, verify, timestamps, rope)
        self._set_scales(k_scale, v_scale)
        self.slots = self.num_blocks * self.block_size
        # row of head h, position j = table[j // bs] * (hkv * bs) + h * bs + j % bs (attn_common.glsl)
        self._head_stride, self._block_stride = self.block_size, self.num_kv_heads * self.block_size
        self._block_size = self.block_size
        self._allocate(self.slots, "num_blocks", self.block_size, "blocks")
        self._pool = BlockPool(self.num_blocks, self.block_size)
        # caches of one family lay out a batch call's words alike (_Step): a model's layers
        family = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim, self.v_head_dim,
                  self.dtype, self.rope)
        self._steps = _STEPS.setdefault(self.device, {}).setdefault(family, [None])    # [the family's last]
        self._next = None           # this cache's last fast _Step (_step_plan: _Step.following)
        self._steady = None         # the batch decode a next step may take on (_Steady)
        self._steady_next = None    # what _Steady.of takes of the last planned fast call

    # ------------------------------------------------------------------ bookkeeping
    @property
    def sequences(self) -> list:
        """Ids of the sequences held, sorted."""
        return self._pool.sequences

    @property
    def free_blocks(self) -> int:
        """Blocks an append can take: unused ones and cached ones nobody holds (evicted first)."""
        return self._pool.free_blocks

    @property
    def cached_blocks(self) -> int:
        """Blocks nobody holds that the prefix cache keeps for a later match (in ``free_blocks``)."""
        return self._pool.cached_blocks

    @property
    def nbytes(self) -> int:
        """Device bytes held by the K and V pools (and int8 scales), fixed at construction."""
        return self.slots * self.bytes_per_token

    def length(self, seq_id: int) -> int:
        with self._lock:
            return self._pool.length(seq_id)

    def lengths(self) -> dict:
        """{seq_id: length} of every sequence."""
        with self._lock:
            return {s: self._pool.length(s) for s in self._pool.sequences}

    def block_table(self, seq_id: int) -> list:
        with self._lock:
            return self._pool.block_table(seq_id)

    def add_sequence(self, seq_id: int | None = None, token_ids=None, salt=None) -> int:
        """A new sequence; returns its id (the smallest free one if None).

        Without ``token_ids`` it is empty. With the token ids of the prompt it is about to
        compute (a 1-D sequence of ints), it starts with the cached blocks of their longest cached
        prefix (whole blocks, at most ``len(token_ids) - 1`` tokens): ``length(seq_id)`` is the
        number of leading tokens whose K/V are already there. Forward the rest (``q``/``k``/``v``
        of positions ``length(seq_id)`` ..) with ``token_ids=[token_ids[length:]]`` so that the
        blocks they fill are cached too. ``salt`` (None, str or bytes): blocks match only blocks
        cached under the same salt. Takes no free block; changes nothing on the device."""
        with self._lock:
            self._check_open()
            return self._pool.add(seq_id, token_ids=token_ids, salt=salt)

    def match_prefix(self, token_ids, salt=None) -> int:
        """How many leading tokens of ``token_ids`` :meth:`add_sequence` would reuse now (whole
        blocks, at most ``len(token_ids) - 1``); changes nothing."""
        with self._lock:
            return self._pool.match_prefix(token_ids, salt=salt)

    def token_ids(self, seq_id: int) -> list:
        """The token ids the cache knows of the sequence's first positions (every position while
        every append came with its ids)."""
        with self._lock:
            return self._pool.token_ids(seq_id)

    def set_token_ids(self, seq_id: int, token_ids) -> None:
        """The token ids of the sequence's first ``len(token_ids)`` positions, e.g. after they
        were appended without ids (generated tokens): the full blocks they complete become
        cacheable. Ids the cache knows must agree (ValueError naming the position; nothing changes)."""
        with self._lock:
            self._check_open()
            self._pool.set_token_ids(seq_id, token_ids)

    def evict_cached(self, n: int | None = None) -> int:
        """Drop up to ``n`` cached blocks nobody holds from the prefix cache (all if None), least
        recently released first; returns how many. (Appends evict by themselves when no block is
        unused; this only forgets.)"""
        with self._lock:
            self._check_open()
            return self._pool.evict(n)

    def remove_sequence(self, seq_id: int) -> None:
        """Drop a sequence; blocks no other sequence shares return to the pool (cached ones stay
        cached, for a later :meth:`add_sequence` with token ids, until the pool needs them)."""
        with self._lock:
            self._check_open()
            self._pool.remove(seq_id)

    def fork(self, src: int, dst: int | None = None) -> int:
        """A new sequence with ``src``'s tokens (beam search, parallel sampling); returns its id.
        Full blocks are shared (copy-on-write by construction: they are never written again); a
        partial last block is copied on the device now, so each sequence appends into its own."""
        with self._lock:
            self._check_open()
            new, copy = self._pool.fork(src, dst)
            if copy is not None:
                self._copy_block(*copy)
            return new

    def truncate(self, seq_id: int, length: int) -> None:
        """Roll a sequence back to ``length`` tokens (speculative decoding). Blocks past the end
        are released; if the new last block is partial and shared it is replaced by a private copy."""
        with self._lock:
            self._check_open()
            copy = self._pool.truncate(seq_id, length)
            if copy is not None:
                self._copy_block(*copy)

    def pop(self, seq_id: int, n: int = 1) -> None:
        """Drop the last ``n`` tokens of a sequence (0 <= n <= length)."""
        with self._lock:
            length = self._pool.length(seq_id)
            self.truncate(seq_id, length - check_int("n", n, 0, length))

    def check_fits(self, seq_ids, n_new) -> None:
        """Raise CacheFullError (or a ValueError/KeyError for a bad batch) unless appending
        ``n_new[i]`` tokens to each ``seq_ids[i]`` fits (cached blocks nobody holds count as free:
        the append evicts them); changes nothing."""
        with self._lock:
            self._check_open()
            self._pool.plan_append(seq_ids, n_new)

    def append(self, seq_ids, k: np.ndarray, v: np.ndarray, n_new=None, token_ids=None) -> None:
        """Write each sequence's new tokens without attending (one submission): ``n_new[i]``
        tokens (default 1 each) at positions length_i .. of ``seq_ids[i]``, packed as in
        :meth:`forward`: k (num_kv_heads, sum(n_new), head_dim), v (num_kv_heads, sum(n_new),
        v_head_dim); ``token_ids`` as in :meth:`forward`. With the cache's ``rope`` the keys are
        rotated at their positions as they are stored. Every check runs first: on any error no
        sequence changes."""
        with self._lock:
            self._check_open()
            self._check_not_capturing("append")
            plan, k, v = self._check_new(seq_ids, n_new, k, v, token_ids)
            plan.evict_cached()
            self._append_plan(sum(plan.n_new)).run(k, v, *_new_rows(plan, self.block_size))
            plan.commit()

    # ------------------------------------------------------------------ attention
    def forward(self, seq_ids, q: np.ndarray, k: np.ndarray, v: np.ndarray, n_new=None,
                causal: bool = True, scale: float | None = None, *, window: int | None = None,
                n_sink: int = 0, mask=None, softcap: float | None = None,
                alibi_slopes: np.ndarray | None = None, return_lse: bool = False, rope_q: bool = False,
                token_ids=None, out=None, lse=None):
        """Append each sequence's new tokens and attend its queries to its whole cache, the whole
        batch at once (batch decode: one token each; chunked prefill: any).

        seq_ids: distinct sequence ids; n_new: tokens per sequence (default 1 each).
        q: (num_qo_heads, sum(n_new), head_dim); k: (num_kv_heads, sum(n_new), head_dim);
        v: (num_kv_heads, sum(n_new), v_head_dim). Sequence i's query rows are its new tokens,
        at positions length_i .. length_i + n_new_i - 1; with ``causal`` each sees its own past
        and the new tokens up to itself. Returns (num_qo_heads, sum(n_new), v_head_dim) float32
        (and the log-sum-exp (num_qo_heads, sum(n_new)) with ``return_lse``). Variants as in
        :meth:`KVCache.attend`; ``mask`` is a list with one (n_new_i, length_i + n_new_i) or
        (num_qo_heads, n_new_i, length_i + n_new_i) array per sequence (numpy, or a DeviceArray
        at least that wide, read on the device as :meth:`KVCache.attend` says). When a sequence brings
        more than ``vkattn.tuning.FUSED_APPEND_MAX_ROWS`` tokens, every new token is appended in a
        dispatch of its own first and attended from the cache (as :meth:`KVCache.forward`; one
        submission, a barrier between, with the patched kp);
        otherwise the append is fused into the attention dispatch. Every check -- including
        that all new tokens fit in free blocks -- runs before anything is written: on any error
        no sequence changes. With the cache's ``rope``, new keys are rotated at their positions
        as they are stored, and the queries too with ``rope_q``.

        token_ids: None, or one entry per sequence -- None or the ``n_new[i]`` token ids of its
        new tokens. A sequence that knows the ids of all its earlier positions records them, and
        the full blocks they complete enter the prefix cache (see the class docstring). Cached
        blocks the new tokens take are evicted before anything is written to them.

        Device arrays (vkattn.DeviceArray): q, k and v are read where they lie, ``out``
        ((num_qo_heads, sum(n_new), v_head_dim)) and ``lse`` ((num_qo_heads, sum(n_new)))
        written in place and returned (KVCache.attend). A call with device arrays does not take
        the shared-prefix (cascade) path: its result is the same, computed per sequence. Inside
        a vkattn.Graph capture the call is recorded (token_ids not taken there).
        """
        if fast_call_ok(causal, scale, rope_q, return_lse, out, lse):
            fast = self._fast_forward(seq_ids, q, k, v, n_new, scale, out, window, n_sink, softcap, return_lse,
                                      token_ids, causal, mask, alibi_slopes, rope_q)
            if fast is not None:
                return fast
        with self._lock:
            self._check_open()
            plan, k, v = self._check_new(seq_ids, n_new, k, v, token_ids)
            counts = plan.n_new
            total = sum(counts)
            q = self._check_q_array(q, total)
            hq = q.shape[0]
            out, lse = self._check_outputs(out, lse, hq, total, (q, k, v))
            on_device = any(isinstance(x, DeviceArray) for x in (q, k, v, out, lse))
            if hq % self.num_kv_heads:
                raise ValueError(f"q: expected num_qo_heads a multiple of num_kv_heads={self.num_kv_heads}, "
                                 f"got {hq}")
            variant = check_variant(hq, window, n_sink, softcap, alibi_slopes)
            call = dict(causal=check_bool("causal", causal), scale=check_scale(scale, self.head_dim),
                        variant=variant, rope_q=self._check_rope_q(rope_q))
            return_lse = check_bool("return_lse", return_lse)
            masks = self._check_masks(mask, hq, plan)
            on_device = on_device or (masks is not None and any(isinstance(m, DeviceArray) for m in masks))
            split = self._split(plan)               # append all new rows first, attend from the pool
            seqs = _seq_calls(plan, masks, split)
            flags = F_PAGED | variant.flags(masks is not None) | (self.rope.flags(call["rope_q"]) if self.rope else 0)
            if self.device.capturing_graph() is not None:
                if token_ids is not None:
                    raise ValueError("token_ids: a call captured into a graph does not record token ids")
                return self._capture(plan.seq_ids, list(counts), q, k, v, masks, flags, call,
                                     out, lse, return_lse)
            # a prefix of full blocks several sequences share: attended once for all (vkattn.cascade)
            groups = None if on_device else cascade.plan_groups(self, plan, hq, variant, masks is not None,
                                                                 call["rope_q"])
            if groups:
                key, args = self._batch_plan_args(plan, hq, flags, masks, split, cascade.own_from(plan, groups))
                attn = cascade.cascade_plan(self, plan, hq, key, args, groups, variant.flags(False))
            else:
                attn = self._batch_plan(plan, hq, flags, masks, split)
            plan.evict_cached()                     # before the device writes any block it takes
            first = None
            if split:                               # both plans are built before either runs
                first = self._stage_new(plan, k, v)
                k = v = None
            if groups:
                if first is not None:               # the cascade's own submission follows
                    first[2].run()
                out, lse = attn.run(q, k, v, seqs, plan, groups, call["causal"], call["scale"], variant,
                                    rope=self.rope)
            else:
                host_out, host_lse = attn.run(q, k, v, seqs, call["causal"], call["scale"], variant,
                                              rope=self.rope, out=out, lse=lse, first=first)
                out = out if host_out is None else host_out
                lse = lse if host_lse is None else host_lse
            plan.commit()
            if self.verify:
                vout, vlse, vq = self._host(out, lse, q)
                last = self._last_rec                   # last_timings: the call's, not the reads'
                for sid, s in zip(plan.seq_ids, seqs):
                    rows = slice(s.q_start, s.q_start + s.q_len)
                    self._verify_rows(vout[:, rows], vlse[:, rows], vq[:, rows], *self.read(sid),
                                      s.past + s.n_new - s.q_len, dict(call, mask=s.mask))
                self._last_rec = last
            return (out, lse) if return_lse else out

    def _fast_forward(self, seq_ids, q, k, v, n_new, scale=None, out=None, window=None, n_sink=0, softcap=None,
                      return_lse=False, token_ids=None, causal=True, mask=None, alibi=None, rope_q=False):
        """forward() of the common batch call -- numpy float32 q, k, v (any strides) (or
        DeviceArrays of this device with ``out`` one too), causal or not, any score variant, a
        list of numpy masks (no DeviceArray: its copy program is the general path's), token ids,
        K rotated by the cache's RoPE or not (q too with ``rope_q``), every sequence's new rows
        (at most FUSED_APPEND_MAX_ROWS) fused into the attention dispatch or, where _split says
        so, appended first in the same submission, no shared prefix to attend by cascade,
        nothing asked but the output (and lse, for numpy calls) -- with the same checks in fewer
        steps (as KVCache's: shapes compared as tuples, numpy values by one dot product each, a
        mask's by one maximum) and the aux block written by AttnPlan.fill_batch. A masked call
        plans for itself (its aux holds the masks); the others may take the family's last step
        (a model's layers). Bad sequence ids, counts or token ids raise here as in the general
        path (nothing changed); None where anything else does not hold: the general path
        decides, and raises the precise error."""
        if type(seq_ids) is not list and type(seq_ids) is not tuple:
            return None
        if mask is not None and (type(mask) is not list and type(mask) is not tuple or len(mask) != len(seq_ids)):
            return None
        if rope_q and self.rope is None:
            return None
        shapes = self._fast_shapes(q, k, v, out)
        if shapes is None or shapes[1] != shapes[2]:            # every new row is a query row
            return None
        hq, total, _ = shapes
        scale = self._fast_scale(q, k, v, out, scale)
        if scale is None:
            return None
        with self._lock:
            if self._closed or self.device.closed or self.device._graph is not None:
                return None
            try:
                variant = check_variant(hq, window, n_sink, softcap, alibi)
            except (TypeError, ValueError):
                return None         # the general path raises it, or an error it checks first (the ids')
            flags = F_PAGED | variant.flags(mask is not None) | (self.rope.flags(rope_q) if self.rope is not None else 0)
            if mask is None:        # the last fast call's step run again, where its sequences are as it left them
                steady, last = self._steady, self._steady_next
                if last is not None:            # a planned call since: its memo replaces the last one
                    steady = self._steady = _Steady.of(self, last)
                    self._steady_next = None
                if steady is not None:
                    got = steady.step(self, seq_ids, n_new, q, k, v, hq, total, flags, variant, scale, causal, out,
                                      return_lse, token_ids)
                    if got is not None:
                        return got
            if mask is None:        # ids, counts, token ids checked
                plan, step = self._step_plan(seq_ids, n_new, hq, flags, token_ids)
            else:
                plan, step = self._plan_new(seq_ids, n_new, token_ids), None
            counts = plan.n_new
            most = max(counts)
            if sum(counts) != total or most > FUSED_APPEND_MAX_ROWS \
                    or (out is None and cascade.may_share(self, plan)):
                return None
            masks = None
            if mask is not None:
                masks = [fast_mask(m, hq, n, p + n) for m, n, p in zip(mask, counts, plan.past)]
                if any(m is None for m in masks) or len({m.ndim for m in masks}) > 1:
                    return None
            split = self._split(plan)
            # appended first, or masked: the batch's own plan (the step memo is the fused call's,
            # a model's layers sharing it), its words computed
            attn = self._batch_plan(plan, hq, flags, masks, split) if split or step is None \
                else self._step_attn(plan, step)
            if attn._check_width:
                return None
            plan.evict_cached()                     # before the device writes any block it takes
            if not split:
                attn.fill_batch(q, k, v, plan.past, counts, plan.tables, scale, self.rope, variant,
                                None if step is None else step.words, causal, masks,
                                None if step is None else step.prior)
                if step is not None:
                    self._keep_step(step, attn)
                if out is not None:
                    rec = attn.bound(q._buf, k._buf, v._buf, out._buf, None)[1]
                else:
                    rec = attn.rec if return_lse else attn.out_only()
            else:                                   # one submission with the patched kp
                first = self._stage_new(plan, k, v)
                attn.fill_batch(q, None, None, plan.past, counts, plan.tables, scale, self.rope, variant,
                                causal=causal, masks=masks)
                rec = attn.after(first, attn.rec if out is None else attn.bound(q._buf, None, None, out._buf, None)[1])
            rec.run()
            self._last_rec = rec
            plan.commit()
            self._next = step               # the next call of the same sequences: _Step.following
            self._steady_next = None if split or step is None or masks is not None else \
                (self._pool._version, plan, step.key, attn, variant, scale, causal, attn._batch_head, attn.batch_words,
                 attn.fills)
            if out is not None:
                return out
            if return_lse:                  # numpy only: out and lse copied back
                return attn.result(total)
            dv = self.v_head_dim
            return attn.out.view()[:hq * total * dv].reshape(hq, total, dv).copy()

    def _capture(self, seq_ids, counts, q, k, v, masks, flags, call, out, lse, return_lse):
        """The batch call as a graph step (vkattn.graph): the pool's blocks are planned, its plan
        looked up and its host words filled when the graph is submitted, for the sequences'
        lengths then; blocks are taken (and cached ones they reuse evicted) at the submission."""
        call = dict(call, out=out, lse=lse, return_lse=return_lse)
        self._check_graph_call(q, k, v, call)
        hq, variant, cache = q.shape[0], call["variant"], self
        # the common call's words come from fill_batch (no SeqCall records), the rest from fill;
        # whether the rows are appended first is decided again at each submission (_split: the
        # batch's keys then), as a KVCache step's plans are
        # (masks: fill checks a numpy one's width at each replay; a device one's words come from its copy)
        common = masks is None

        class Step:
            plan = step = None
            plain = False

            def prepare(self):
                cache._check_open()
                if common:                  # the family's last step where it applies (a model's layers)
                    plan, self.step = cache._step_plan(seq_ids, counts, hq, flags)
                else:
                    plan = cache._plan_new(seq_ids, counts)
                self.plan = plan
                split = cache._split(plan)
                self.plain = plain = common and not split
                if plain:
                    attn = cache._step_attn(plan, self.step)
                else:
                    attn = cache._batch_plan(plan, hq, flags, masks, split)
                work, kk, vv = [], k, v
                if split:
                    prog, up, _ = cache._stage_new(plan, k, v)
                    work.append((prog, up))
                    kk = vv = None
                if plain:
                    attn.fill_batch(q, kk, vv, plan.past, counts, plan.tables, call["scale"], cache.rope, variant,
                                    self.step.words, call["causal"], prior=self.step.prior)
                    cache._keep_step(self.step, attn)
                elif common:                # appended first: no SeqCall records either
                    attn.fill_batch(q, None, None, plan.past, counts, plan.tables, call["scale"], cache.rope,
                                    variant, causal=call["causal"])
                copies = []
                if not common:
                    seqs = _seq_calls(plan, masks, split)
                    attn.fill(q, kk, vv, seqs, call["causal"], call["scale"], variant, cache.rope)
                    copies = attn.mask_programs(seqs)
                prog, _, up = attn.bound(*buffers(q, kk, vv, out, lse))     # the device tested above
                if copies:                  # device masks: copied into aux after its upload
                    work += [(copies[0], up)] + [(c, []) for c in copies[1:]]
                    up = []
                work.append((prog, up))
                return work

            def commit(self):
                self.plan.evict_cached()
                self.plan.commit()
                if self.plain:              # the next step (a replay's first layer) follows this one
                    cache._next = self.step

        self._graph_step_check(seq_ids)
        self.device.capturing_graph().add_cache_call(self, Step())
        return (out, lse) if return_lse else out

    def _graph_step_check(self, seq_ids) -> None:
        for sid in seq_ids:
            self.length(sid)            # UnknownSequenceError now, not at the submission

    def plan(self, seq_ids, num_qo_heads: int, n_new=None, rope_q: bool = False) -> None:
        """Build (or fetch) everything :meth:`forward` needs for ``seq_ids`` bringing ``n_new``
        tokens each (default 1) with ``num_qo_heads`` heads, no score variant or mask, and
        ``rope_q`` -- pipelines, buffers, the recorded sequences -- and have the driver compile
        the pipelines now (one empty dispatch each; seconds on lavapipe the first time a pipeline
        is seen, then cached by the driver), so that call only writes inputs and evaluates. The
        ids and counts are checked as :meth:`forward` checks them (the tokens must fit); nothing
        is written and no block is taken. A call plan depends on the batch's total tokens and
        sequence count, not on which sequences: plan the shapes a server will run."""
        with self._lock:
            self._check_open()
            plan = self._plan_new(seq_ids, n_new)
            hq = self._check_qo_heads(num_qo_heads)
            rope_q = self._check_rope_q(rope_q)
            flags = F_PAGED | (self.rope.flags(rope_q) if self.rope else 0)
            split = self._split(plan)
            if split:
                self._append_plan(sum(plan.n_new)).warm()
            groups = cascade.plan_groups(self, plan, hq, check_variant(hq), False, rope_q)
            if groups:
                key, args = self._batch_plan_args(plan, hq, flags, None, split, cascade.own_from(plan, groups))
                cascade.cascade_plan(self, plan, hq, key, args, groups, 0).warm()
            else:
                self._batch_plan(plan, hq, flags, None, split).warm()

    def read(self, seq_id: int) -> tuple:
        """One sequence as float32 arrays, exactly as stored: K (num_kv_heads, length, head_dim),
        V (num_kv_heads, length, v_head_dim)."""
        with self._lock:
            self._check_open()
            return self._read_slots(self._pool.slots(seq_id, 0, self._pool.length(seq_id)))

    def save_sequence(self, seq_id: int, path, token_ids=None) -> None:
        """Write sequence ``seq_id`` to the file ``path``, as :meth:`KVCache.save` writes a
        cache (the same file format: either loads into the other): its positions in order, as
        stored, with the settings a load checks, this cache's block size (informational) and a
        checksum. ``token_ids``: optional (length,) integers, returned by :meth:`load_sequence`;
        the file also keeps the hash of the salt the sequence was added with (not the salt), so
        that a load puts its blocks back in the prefix cache under that salt. The cache is not
        changed."""
        with self._lock:
            self._check_open()
            slots = self._pool.slots(seq_id, 0, self._pool.length(seq_id))
            persist.save_sequence(self, slots, path, token_ids, block_size=self.block_size,
                                  salt_root=self._pool.root(seq_id).hex())

    def load_sequence(self, path, seq_id: int | None = None, salt=None) -> tuple:
        """Add a sequence holding a file that :meth:`save_sequence` or KVCache.save wrote (on
        this device or another, any block size), bit for bit as stored. ``seq_id``: its id (an
        unused one; default the smallest free). The file must be intact
        (vkattn.CacheFileCorruptError), written for this cache's dtype, num_kv_heads, head_dim,
        v_head_dim and rope (vkattn.CacheFileMismatchError, naming the setting) and fit in the
        free blocks (CacheFullError); an id in use is a ValueError. Every check runs before
        anything is written: on any error the cache is unchanged. Returns ``(seq_id,
        token_ids)``: the new sequence's id and the token ids saved with it ((length,) int64,
        or None); the sequence knows them, so its full blocks enter the prefix cache -- under the
        salt it was saved with (the file keeps its hash): blocks of one salt never match another
        salt's requests. ``salt``: None (the file's), or the salt the caller expects, checked
        against the file's where it keeps one (CacheFileMismatchError naming ``salt``) and used
        where it keeps none (a KVCache's file)."""
        with self._lock:
            self._check_open()
            root = None if salt is None else root_hash(salt)
            n, tensors, token_ids, saved = persist.read_sequence(self, path, with_root=True)
            if root is not None and saved is not None and root != saved:
                raise CacheFileMismatchError(f"{path}: saved under another salt than the one given", "salt")
            sid = self._restore_sequence(n, tensors, seq_id=seq_id, token_ids=token_ids, root=saved or root)
            return sid, token_ids

    def _restore_sequence(self, n: int, tensors: dict, prefix: str = "", seq_id: int | None = None,
                          token_ids=None, root: bytes | None = None) -> int:
        """A new sequence (id ``seq_id`` or the smallest free) of ``n`` positions of checked file
        tensors (names prefixed by ``prefix``; vkattn.persist), written as stored, knowing
        ``token_ids`` ((n,) ints) if given, under the salt hash ``root`` (None: no salt); its id.
        A bad id or too few free blocks raise before anything is written."""
        sid = self._pool.add(seq_id, root=root)
        try:
            try:
                plan = self._pool.plan_append([sid], [n], token_ids=None if token_ids is None else [token_ids])
            except CacheFullError as e:                 # nothing written yet
                raise CacheFullError(f"load_sequence: the file holds {n} positions, {-(-n // self.block_size)} "
                                     f"blocks of {self.block_size}; {e}") from e
            plan.evict_cached()                         # cached blocks it takes: before they are written
            persist.write_stored(self, plan.slots(0), tensors, prefix)
            plan.commit()
        except BaseException:
            self._pool.remove(sid)
            raise
        return sid

    def __repr__(self) -> str:
        return (f"PagedKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, v_head_dim={self.v_head_dim}, "
                f"dtype={self.dtype!r}, sequences={len(self._pool)}, free_blocks={self.free_blocks}, "
                f"cached_blocks={self.cached_blocks})")

    # ------------------------------------------------------------------ internals
    def _check_new(self, seq_ids, n_new, k, v, token_ids=None):
        """(AppendPlan, k, v) of a batch's new tokens, all checked (ids, counts >= 1, room, token
        ids, shapes, values); nothing changes."""
        plan = self._plan_new(seq_ids, n_new, token_ids)
        total = sum(plan.n_new)
        if isinstance(k, DeviceArray) or isinstance(v, DeviceArray):
            k, v = self._check_device_kv(k, v, total)
        else:
            k = check_array("k", k, (self.num_kv_heads, total, self.head_dim), max_abs=self._max_abs,
                            rotary=self._rotary)
            v = check_array("v", v, (self.num_kv_heads, total, self.v_head_dim), max_abs=self._max_abs)
        return plan, k, v

    def _plan_new(self, seq_ids, n_new, token_ids=None):
        """The pool's AppendPlan for ``n_new`` tokens (default 1) to each of ``seq_ids``: ids,
        counts >= 1, token ids and room checked; nothing changes."""
        if isinstance(seq_ids, (str, bytes)) or not hasattr(seq_ids, "__iter__"):
            raise TypeError(f"seq_ids: expected a list of sequence ids, got {type(seq_ids).__name__}")
        seq_ids = list(seq_ids) if not isinstance(seq_ids, np.ndarray) else seq_ids.tolist()
        if not seq_ids:
            raise ValueError("seq_ids: expected at least one sequence id, got none")
        plan = self._pool.plan_append(seq_ids, [1] * len(seq_ids) if n_new is None else n_new,
                                      token_ids=token_ids)
        if min(plan.n_new) < 1:
            raise ValueError(f"n_new: every sequence needs at least one new token, got {plan.n_new}")
        return plan

    def _step_plan(self, seq_ids, n_new, hq: int, flags: int, token_ids=None) -> tuple:
        """(AppendPlan, _Step) of a batch call that fill_batch fills: the family's last step where
        it applies to this pool (fill_batch copies its words; a model's later layers), else the
        step after this cache's last fast one where the call is on the same sequences
        (_Step.following; a decode loop: fill_batch computes the records, the block tables are
        the last step's), else planned here (a new _Step without words); ids, counts and token
        ids checked as _plan_new checks them. Then _step_attn, and after fill_batch, _keep_step."""
        step = self._steps[0]
        plan = None if step is None else step.plan_for(self._pool, seq_ids, n_new, hq, flags, token_ids)
        if plan is not None:
            return plan, step
        last = self._next
        if last is not None:
            step = last.following(self._pool, seq_ids, n_new, hq, flags, token_ids, self.slots)
            if step is not None:
                return step.plan, step
        plan = self._plan_new(seq_ids, n_new, token_ids)
        return plan, _Step(plan, hq, flags)     # its attention plan's key: at _step_attn; words: at _keep_step

    def _step_attn(self, plan, step) -> AttnPlan:
        """The AttnPlan of a _step_plan (built here on a miss of the LRU)."""
        if step.key is None:
            step.key, step.args = self._batch_plan_args(plan, step.hq, step.flags, None, False)
        args = step.args
        return self._plan(step.key, lambda: AttnPlan(self, *args))

    def _keep_step(self, step, attn) -> None:
        """After fill_batch of a _step_plan: its _Step (planned here: with the words fill_batch
        wrote) is the family's last, the next layer's to match (before this call commits: a
        graph prepares every layer before it submits)."""
        if step.words is None:
            step.words = attn.batch_words
            step.plan = step.plan._rebased(None)        # the memo holds no pool (the caller has its plan)
            self._steps[0] = step
        step.pool = id(self._pool)

    def _batch_plan(self, plan, hq, flags, masks, split) -> AttnPlan:
        """The attention plan of a batch call (AppendPlan ``plan``; ``split``: its rows are appended
        first, so the dispatch carries none)."""
        key, args = self._batch_plan_args(plan, hq, flags, masks, split)
        return self._plan(key, lambda: AttnPlan(self, *args))

    def _batch_plan_args(self, plan, hq, flags, masks, split, key_lo=None) -> tuple:
        """(LRU key, AttnPlan arguments after the cache) of _batch_plan; ``key_lo``: each
        sequence's first attended key (cascade), which sizes a decode plan's key bound."""
        total, nseq = sum(plan.n_new), len(plan.n_new)
        mwords = 0 if masks is None else sum(mask_words(m, p + n) for m, p, n in zip(masks, plan.past, plan.n_new))
        words = AttnPlan.aux_need(nseq, total if total == nseq else row_bucket(total), hq,
                                  sum(map(len, plan.tables)), mwords)
        bucket = aux_bucket(words)
        nn = 0 if split else total
        decode = total == nseq
        # batch decode: sized for the longest sequence's power-of-two bucket (the split count
        # follows the context, tuning.decode_key_bound); prefill and chunks: for the pool
        if key_lo is None:
            span = max(map(add, plan.past, plan.n_new))
        else:
            span = max(p + n - a for p, n, a in zip(plan.past, plan.n_new, key_lo))
        bound = decode_key_bound(span, self.slots) if decode else self.slots
        rows, nn = (total, nn) if decode else (row_bucket(total), row_bucket(nn) if nn else 0)
        splits = None
        if key_lo is not None and decode:       # cascade's own part: few keys per sequence
            splits = own_splits(self.device, kernel_for(self.device), self.num_kv_heads, nseq, row_bucket(span))
        return (("attn", hq, rows, nn, nseq, flags, bucket, bound, splits),
                (hq, rows, nn, nseq, flags, bucket, bound, decode, self._rope_dim, splits))

    def _split(self, plan) -> bool:
        """Whether a batch appends its new rows first and attends from the pool (CacheBase.
        _appends_first): a sequence brings many rows, or the attention reads enough K/V words --
        every key of the batch, its sequences' lengths after the append -- that reading them from
        texel views pays for the append's dispatch (lavapipe, 32/8 heads d128 float16, decode
        of 16 sequences of 100 .. 4000 keys, 33.6 M words: 29.5 -> 23.3 ms a step; 4 of 100 ..
        300 keys, 0.8 M words: 1.20 -> 0.90 ms; q4 of the 16: 20.7 / 21.0 ms, no change)."""
        return self._appends_first(max(plan.n_new), key_bound=sum(plan.past) + sum(plan.n_new))

    def _stage_new(self, plan, k, v) -> tuple:
        """append.comp for every new row of ``plan`` at its slot, rotated at its position, staged
        (_SlotWritePlan.stage: run by the attention's submission, or alone). The caller commits
        the plan."""
        slots, positions = _new_rows(plan, self.block_size)
        return self._append_plan(sum(plan.n_new)).stage(k, v, slots, positions)

    def _check_masks(self, mask, hq, plan):
        if mask is None:
            return None
        if not isinstance(mask, (list, tuple)):
            raise TypeError(f"mask: expected a list of one array per sequence or None, got {type(mask).__name__}")
        if len(mask) != len(plan.seq_ids):
            raise ValueError(f"mask: expected {len(plan.seq_ids)} arrays (one per sequence), got {len(mask)}")
        out = [check_mask(m, hq, n, p + n, self.device, name=f"mask[{i}]")
               for i, (m, n, p) in enumerate(zip(mask, plan.n_new, plan.past))]
        if len({m.ndim for m in out}) > 1:
            raise ValueError("mask: expected every array broadcast over heads (2-D) or every one per head (3-D)")
        return out

    def _copy_block(self, src: int, dst: int, rows: int) -> None:
        """The device side of a BlockPool copy instruction (the first ``rows`` of ``src`` are
        needed; the whole block is copied)."""
        self._plan(("copy",), lambda: _CopyPlan(self)).run(src, dst)


_STEPS = weakref.WeakKeyDictionary()    # Device -> {family: [the family's last _Step]}


class _Step:
    """The last fast batch call of a family of PagedKVCaches -- one device, the same pool
    geometry, storage format and RoPE: a model's layers, each called with the same sequences in
    turn. It holds what that call planned from its pool's state: the AppendPlan (ids, counts,
    each sequence's length and block table, the blocks taken), the attention plan's key and the
    per-sequence aux words fill_batch wrote. plan_append and fill_batch are functions of exactly
    the ids, counts, lengths, tables and the blocks the pool would hand out next, so another pool
    of the family whose state agrees on those takes the plan and the words instead of computing
    them again: the same words, compared, not assumed. ``pool``: the id of the pool that used it
    last (its state has moved on: no match there). It keeps no pool or cache alive."""

    __slots__ = ("ids", "hq", "flags", "before", "picks", "plan", "key", "args", "words", "pool", "prior")

    def __init__(self, plan, hq, flags):
        self.plan, self.hq, self.flags = plan, hq, flags
        self.ids = self.before = self.picks = self.words = self.pool = self.key = self.args = None  # ids..: at the first test
        self.prior = None           # following: the step before's words, where the tables are the same

    def plan_for(self, pool, seq_ids, n_new, hq, flags, token_ids=None):
        """This step's AppendPlan, made current for ``pool``, where the call (its token ids too:
        plain lists of plain ints, or None) and the pool's state match it; else None (the caller
        plans)."""
        if id(pool) == self.pool or hq != self.hq or flags != self.flags or self.words is None:
            return None
        if self.ids is None:               # ids last: another thread may test meanwhile
            plan = self.plan
            self.before = [t[:len(t) - len(b)] if b else t for t, b in zip(plan.tables, plan.new_blocks)]
            self.picks = list(chain.from_iterable(plan.new_blocks))
            self.ids = tuple(plan.seq_ids)
        if tuple(seq_ids) != self.ids:
            return None
        counts = self.plan.n_new
        if n_new is None:
            if counts.count(1) != len(counts):
                return None
        elif type(n_new) is not list and type(n_new) is not tuple or list(n_new) != counts \
                or set(map(type, n_new)) != _INT:
            return None
        if set(map(type, seq_ids)) != _INT:
            return None
        known = self.plan.token_ids
        if token_ids is None:
            if known.count(None) != len(known):
                return None
        elif type(token_ids) is not list and type(token_ids) is not tuple \
                or not set(map(type, token_ids)) <= _LIST_OR_NONE \
                or not set(map(type, chain.from_iterable(filter(None, token_ids)))) <= _INT \
                or list(token_ids) != known:
            return None
        lengths, tables = pool._lengths, pool._tables
        try:
            if list(map(lengths.__getitem__, seq_ids)) != self.plan.past \
                    or list(map(tables.__getitem__, seq_ids)) != self.before:
                return None
        except (KeyError, TypeError):
            return None
        if self.picks and pool._picks(len(self.picks)) != self.picks:
            return None
        return self.plan._rebased(pool)


    def following(self, pool, seq_ids, n_new, hq, flags, token_ids, slots: int):
        """The step of a call on ``pool`` -- the one this step's call ran on -- with the same
        sequences (plain ints, all still there) and flags as this one's, any counts (plain ints
        >= 1; n_new None: 1 each -- a chunked prefill's chunks, then its decode) and token ids.
        Planned by the pool's plan_append less the checks this one's call made
        (BlockPool._plan_checked, from the pool's state now: the token ids checked, the blocks
        picked, CacheFullError where they do not fit). Where its block tables are this one's (a
        decode loop, nothing else having changed them), this one's block-table words are kept
        for fill_batch and, with the same counts and decode key bound (``slots``: the pool's),
        the attention plan's key. A new _Step, words not yet written; None where the call is
        not such a one: the caller plans."""
        if hq != self.hq or flags != self.flags:
            return None
        prev = self.plan
        last, ids = prev.n_new, prev.seq_ids
        if type(seq_ids) is list:
            if seq_ids != ids:
                return None
        elif type(seq_ids) is not tuple or list(seq_ids) != ids:
            return None
        if set(map(type, seq_ids)) != _INT:
            return None
        known = pool._tables
        for s in ids:
            if s not in known:          # removed since: the caller raises
                return None
        if n_new is None:
            counts = last if last.count(1) == len(last) else [1] * len(ids)
        elif type(n_new) is list or type(n_new) is tuple:
            counts = list(n_new)
            if len(counts) != len(ids) or set(map(type, counts)) != _INT or min(counts) < 1:
                return None
        else:
            return None
        plan = pool._plan_checked(ids, counts, pool._check_plan_tokens(token_ids, counts))
        step = _Step(plan, hq, flags)
        if plan.tables != prev.tables:
            return step                 # other tables: their words and the plan's key computed anew
        step.prior = self.words         # fill_batch checks the layout
        key = self.key
        # the decode key bound compared, never assumed: a truncate that kept the tables may have
        # shortened a sequence below the bound's bucket (the planned way then takes a plan of
        # fewer splits: other bits on a GPU), also where the bound was the pool's whole size
        if key is not None and counts == last and (sum(counts) != len(counts)
                                                   or decode_key_bound(max(map(add, plan.past, counts)), slots)
                                                   == key[7]):
            step.key, step.args = key, self.args       # _batch_plan_args: the same (its bound at index 7)
        return step


_LIST_OR_NONE = {list, type(None)}


def _one_id_each(token_ids, n: int):
    """The ids, one per sequence, where ``token_ids`` is a list or tuple of ``n`` lists of one
    plain int in [0, 2**63) each (the token ids a steady step learns); None for anything else
    (planned)."""
    if (type(token_ids) is not list and type(token_ids) is not tuple) or len(token_ids) != n \
            or set(map(type, token_ids)) != _LIST:
        return None
    try:
        ids = [t for [t] in token_ids]
    except ValueError:                  # a list of another length
        return None
    return ids if _plain_ids(ids) else None


TABLE_SLACK = 4         # free words a steady step leaves after each block table it lays out (_Steady._tables)


class _Steady:
    """A batch decode a PagedKVCache's next call may take on without planning: the last fast call
    was one new token for each of the same sequences (no mask, rows fused into the dispatch), and
    its sequences are as the attention plan's aux describes them: nothing has changed the pool
    since (its version), or, where something has (a truncate, other sequences added, removed or
    extended, the prefix cache), each sequence's block table is still a prefix of the one the
    aux holds (``tables``), compared, not assumed, and its length is read from the pool. While
    the decode key bound (the planned way's for those lengths) and the choice to append first
    hold, the blocks rows need are free and the tables fit in the aux, and the attention plan is
    still the cache's with the aux that call left (no fill since: AttnPlan.fills), the next step
    is that plan run again with the words that change written (AttnPlan.fill_decode_step): no
    AppendPlan, no _Step, no per-sequence records built (vkattn's Python of a batch decode loop;
    and of a step after a truncate, as speculative decoding's, or of a model's layers whose pools
    changed since). A row that starts a block takes the block _take would give (the same tables
    as the planned way): one word written after its table where the aux has one free there,
    else every table laid out again with a few free words after each (_tables); each new token's
    id, where given, is learnt as the planned way learns it. Anything else -- another variant,
    scale or head count, a table the aux does not hold -- goes the planned way, which makes a
    new memo."""

    __slots__ = ("pool", "version", "ids", "ids_t", "ones", "past", "bound", "hq", "flags", "variant", "scale",
                 "causal", "key", "attn", "head", "words", "fills", "tables", "shared", "result")

    @classmethod
    def of(cls, cache, last: tuple):
        """The memo of the last planned fast call (PagedKVCache._steady_next: the pool's version
        after its commit, its AppendPlan, the attention plan's LRU key, the attention plan, its
        variant, scale and causality, and the plan's fill_batch header, words and fill count
        that call left), made at the next call (step() compares the pool with it); None where
        its next step could not take on: not a decode of one row per sequence, an output width
        to check."""
        version, plan, key, attn, variant, scale, causal, head, words, fills = last
        counts = plan.n_new
        if key is None or attn._check_width or head is None or counts.count(1) != len(counts):
            return None
        m = object.__new__(cls)
        pool = cache._pool
        m.pool, m.version, m.key, m.attn, m.scale, m.causal = pool, version, key, attn, scale, causal
        m.head, m.words, m.fills = head, words, fills       # step() finds them still the plan's, or plans
        m.tables = plan.tables              # what the aux holds (never changed in place: replaced)
        m.ids, m.ids_t, m.ones = list(plan.seq_ids), tuple(plan.seq_ids), counts[:]
        m.past = list(map(add, plan.past, counts))          # the lengths now: the next call's past
        m.bound, m.hq, m.flags, m.variant = key[7], attn.hq, key[5], variant    # (check_variant keeps a window's)
        refs = pool._refs                   # a first block held twice: the cascade's to consider (may_share)
        m.shared = len(counts) > 1 and any(refs[t[0]] > 1 for t in plan.tables if t)
        m.result = None
        return m

    def step(self, cache, seq_ids, n_new, q, k, v, hq, total, flags, variant, scale, causal, out, return_lse,
             token_ids=None):
        """The next step, run and committed (its output, as PagedKVCache._fast_forward returns
        it), or None where it does not take on (nothing changed: the caller plans). token_ids:
        None, or each new token's id as a list of one plain int (anything else is planned)."""
        pool = cache._pool
        if pool is not self.pool or hq != self.hq or flags != self.flags or scale != self.scale \
                or causal is not self.causal or total != len(self.ones):
            return None
        if type(seq_ids) is list:
            if seq_ids != self.ids:
                return None
        elif seq_ids != self.ids_t:
            return None
        if n_new is not None and ((type(n_new) is not list and type(n_new) is not tuple)
                                  or list(n_new) != self.ones or set(map(type, n_new)) != _INT):
            return None
        if set(map(type, seq_ids)) != _INT or (variant is not self.variant and variant.key() != self.variant.key()):
            return None
        if token_ids is not None:
            token_ids = _one_id_each(token_ids, total)
            if token_ids is None:
                return None
        if pool._version != self.version and not self._resync(pool, cache.slots):
            return None                     # a table the aux does not hold, or another key bound
        past = self.past
        if max(past) >= self.bound or cache._appends_first(1, key_bound=sum(past) + total):
            return None                     # the plan's key bound passed, or the rows go first
        if self.shared and out is None and cascade.may_share_blocks(cache):
            return None
        attn = cache._plans.get(self.key)
        if attn is not self.attn or attn._batch_head is not self.head or attn.batch_words is not self.words \
                or attn.fills != self.fills:
            return None                     # the plan was dropped, or another call filled its aux
        grow = layout = None
        bs = cache.block_size               # a table holds ceil(length / bs) blocks (BlockPool.check)
        if 0 in map(mod, past, repeat(bs)):     # rows that start a block
            grow = [i for i, p in enumerate(past) if p % bs == 0]
            if len(grow) > pool.free_blocks:
                return None                 # the planned way raises CacheFullError
            picks = pool._picks(len(grow))
            layout = self._tables(attn, grow, picks)
            if layout is None:
                return None                 # outgrew the plan's aux: the planned way sizes a new one
            for b in picks:                 # before the device writes them (AppendPlan.evict_cached)
                if b in pool._cached:
                    pool._evict(b)
        cache._plans.move_to_end(self.key)
        ends = [p + 1 for p in past]
        tables, words, held = (None, None, self.tables) if layout is None else layout
        self.fills = -1                     # the aux half written, should this raise: no step takes it on
        attn.fill_decode_step(q, k, v, past, ends, cache.rope, tables, words, self.variant.window)
        self.fills, self.tables = attn.fills, held
        if out is not None:
            rec = attn.bound(q._buf, k._buf, v._buf, out._buf, None)[1]
        else:
            rec = attn.rec if return_lse else attn.out_only()
        rec.run()
        cache._last_rec = rec
        ids = self.ids
        pool._advance(ids, None, () if grow is None else [(ids[i], b) for i, b in zip(grow, picks)],
                      token_ids, past)
        self.version = pool._version
        self.past = ends
        if out is not None:
            return out
        if return_lse:
            return attn.result(total)
        result = self.result
        if result is None:
            dv = cache.v_head_dim
            result = self.result = attn.out.view()[:hq * total * dv].reshape(hq, total, dv)
        return result.copy()

    def _resync(self, pool, slots: int) -> bool:
        """After a change of the pool (its version not this memo's): whether the step may take on
        -- every sequence still there, its block table a prefix of the one the aux holds (a
        truncated table's later words are never read: BlockPool keeps ceil(length / bs) blocks),
        and the decode key bound of their lengths the plan's (the planned way's key: a shorter
        batch would take a plan of fewer splits) -- with the lengths and the shared-first-block
        test taken from the pool now. Nothing changes where it does not."""
        ids, held = self.ids, self.tables
        try:
            past = list(map(pool._lengths.__getitem__, ids))
            live = list(map(pool._tables.__getitem__, ids))
        except KeyError:
            return False                    # removed: the planned way raises
        for t, h in zip(live, held):
            if t != h[:len(t)]:
                return False
        if decode_key_bound(max(past) + 1, slots) != self.bound:
            return False
        refs = pool._refs
        self.shared = len(ids) > 1 and any(refs[t[0]] > 1 for t in live if t)
        self.past, self.version = past, pool._version
        return True

    def _tables(self, attn, grow: list, picks: list):
        """The block-table writes of a step in which the sequences at batch indices ``grow`` take
        blocks ``picks``, read from the aux as it is (each record's word 5: its table's offset;
        the tables lie in batch order, the words up to the counters free after the last): where
        each of them has a free word after its table, those words ((None, [(aux index,
        block)])); else every table laid out again with TABLE_SLACK free words after each where
        the aux has room (((their words, each table's offset), None)); None where the tables no
        longer fit. (A failed step's word is never read: its table is no longer than before.)
        Last in either tuple: the tables the aux then holds (``tables``' next value)."""
        tables, ids = self.pool._tables, self.ids
        offs, n = attn.decode_columns(len(ids))[2].tolist(), len(ids)    # plain ints: numpy's element
        offs.append(attn._counters)         # reads cost 4 of 8 us at B=16, every sequence taking a block
        words, held = [], self.tables[:]
        for i, b in zip(grow, picks):
            t = tables[ids[i]]
            end = offs[i] + len(t)
            if end >= offs[i + 1]:
                break
            words.append((end, b))
            held[i] = t + [b]
        else:
            return None, words, held
        live = [t[:] for t in map(tables.__getitem__, ids)]     # copies: the pool's lists change
        for i, b in zip(grow, picks):
            live[i].append(b)
        free = self.head[1][2]
        slack = min(TABLE_SLACK, (attn._counters - free - sum(map(len, live))) // n)
        if slack < 0:
            return None
        pad = [0] * slack
        words = array("I", chain.from_iterable(chain.from_iterable(zip(live, repeat(pad)))))
        offsets = list(accumulate([len(t) + slack for t in live], initial=free))
        del offsets[-1]
        return (words, offsets), None, live


def _new_rows(plan, block_size: int) -> tuple:
    """(slots, positions), int64, of every new row of AppendPlan ``plan`` in batch order: rows
    past_i .. past_i + n_new_i - 1 of sequence i (np.concatenate of plan.slots(i) and of those
    ranges, in a fixed number of numpy steps however many sequences)."""
    if len(plan.n_new) == 1:            # one sequence: its range
        positions = np.arange(plan.past[0], plan.past[0] + plan.n_new[0], dtype=np.int64)
        return _slots_of(plan.tables[0], block_size, positions), positions
    if all(n == 1 for n in plan.n_new):     # batch decode: one row each, at its length
        positions = np.asarray(plan.past, np.int64)
        blocks = np.asarray([t[p // block_size] for t, p in zip(plan.tables, plan.past)], np.int64)
        return blocks * block_size + positions % block_size, positions
    counts = np.asarray(plan.n_new, np.int64)
    starts = np.cumsum(counts) - counts                    # each sequence's first packed row
    seq = np.repeat(np.arange(len(counts)), counts)        # the sequence of each packed row
    positions = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(np.asarray(plan.past, np.int64) - starts,
                                                                           counts)
    lens = np.fromiter(map(len, plan.tables), np.int64, len(plan.tables))
    flat = np.fromiter(chain.from_iterable(plan.tables), np.int64, int(lens.sum()))
    blocks = flat[(np.cumsum(lens) - lens)[seq] + positions // block_size]
    return blocks * block_size + positions % block_size, positions


def _seq_calls(plan, masks, split: bool) -> list:
    """The SeqCall of each sequence of a batch (AppendPlan ``plan``): its rows packed after the
    previous sequence's; ``split``: its new rows are appended first, so the dispatch carries none."""
    seqs, start = [], 0
    for i, n in enumerate(plan.n_new):
        seqs.append(SeqCall(past=plan.past[i] + (n if split else 0), n_new=0 if split else n,
                            q_start=start, q_len=n, new_start=start,
                            table=np.asarray(plan.tables[i], np.uint32),
                            mask=None if masks is None else masks[i], rope_row=start,
                            rope_pos=plan.past[i]))
        start += n
    return seqs


class _CopyPlan:
    """copy_rows.comp: block ``src`` into block ``dst`` (K, V and int8 scales)."""

    def __init__(self, c: PagedKVCache):
        be = c.device.backend
        self.c = c
        # a block is [num_kv_heads, block_size] rows: the whole block is copied (uvec4 words of K
        # and V, and with int8 one scale per row); rows past those the caller needs are unused
        self.bk, self.bv = c.num_kv_heads * c.block_size * c._rk4, c.num_kv_heads * c.block_size * c._rv4
        self.bs = c.num_kv_heads * c.block_size if c._i8 else 0
        self.params = be.buffer(12, np.uint32, name="copy_params")
        pipe = copy_pipeline(c.device, c)
        self.prog = be.program(compile_shader(pipe.shader, pipe.defines), [c._k, c._v, self.params, c._ks, c._vs],
                               pipe.groups, pipe.spec, writes=(0, 1, 3, 4), name=pipe.name)
        self.rec = be.recording().upload(self.params).dispatch(self.prog).build(c.timestamps)

    def run(self, src: int, dst: int) -> None:
        bk, bv, bs = self.bk, self.bv, self.bs
        self.params.view()[:9] = (src * bk, dst * bk, bk, src * bv, dst * bv, bv, src * bs, dst * bs, bs)
        self.rec.run()
        self.c._last_rec = self.rec

    def destroy(self) -> None:
        destroy(self.rec, self.prog, self.params)


def copy_pipeline(dev, c) -> Pipeline:
    """copy_rows.comp of _CopyPlan (fork / truncate of a shared partial block)."""
    per_block = c._block_size * c.num_kv_heads * max(c._rk4, c._rv4)
    return Pipeline("copy_rows", "copy_rows", {}, (WORKGROUP,), (grid_groups(per_block, dev), 1, 1), 5)


__all__ = ["PagedKVCache", "UnknownSequenceError"]
