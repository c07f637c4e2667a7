"""Shared-prefix batch attention (cascade) for PagedKVCache.forward.

When sequences of a batch hold the same leading full blocks (after ``fork``, or blocks a prefix
cache hands to several sequences), every query row of those sequences sees all of that prefix:
the prefix lies before each row's position, so causality does not cut it. A call then runs as
three dispatches in one recorded submission:

1. **shared**: per group of sequences sharing ``P`` tokens, the group's query rows (all its
   sequences' rows, times the GQA group) are the rows of one *non-causal* query block against
   the ``P`` shared keys -- attn.comp / attn_lane.comp with a prefill-shaped tile, so each query
   tile reads those keys once instead of once per sequence;
2. **own**: today's batch dispatch (fused append included), each grouped sequence attending only
   its keys from ``P`` on (``SeqCall.key_lo``);
3. **merge** (shaders/merge_lse.comp): per row, the two normalised results combined through their
   log-sum-exps (numpy: ``vkattn.reference.merge_states``).

A download of each attention dispatch's out / lse sits between the dispatches: it orders the
merge's reads after their writes, and the own dispatch's fused append (a write to the K/V pools)
after the shared dispatch's reads of them (vkattn._kp's ordering rules).

Groups: sequences are grouped by their first ``min_blocks`` full blocks; a group of two or more
attends the longest run of leading full blocks all its members share. ``VKATTN_CASCADE``: ``0``
never, ``1`` whenever a group shares at least one block (tests), unset: on software devices
(lavapipe), groups sharing at least ``tuning.CASCADE_MIN_PREFIX`` tokens whose shared query tile
holds two rows or more (otherwise the shared dispatch would read the prefix once per row, as
today). Unset on a GPU: never -- measured on an NVIDIA H100 (16 sequences, 32/8 heads, d 128,
2048 to 32768 shared tokens), today's decode is not bound by the bytes it reads there (the L2
serves the sequences' repeated reads of the prefix), the shared pass does as many multiply-adds
as today's dispatch and its prefill-shaped tile does them slower: the cascade step took 1.3-1.8x
today's device time. Supported: the log-sum-exp output,
softcap, the cache's RoPE on keys, chunks (several new tokens per sequence). Not supported -- the
call takes today's path: a sliding window (with sinks), ALiBi and masks (they depend on each
row's position or sequence inside the shared keys) and ``rope_q`` (the queries are rotated at
their own positions by the kernel, which the shared block's rows do not share).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np

from ._attn import F_PAGED, AttnPlan, Pipeline, SeqCall, aux_bucket, destroy, grid_groups
from .compiler import compile_shader
from .tuning import (CASCADE_MIN_PREFIX, WORKGROUP, attention_config, decode_key_bound, decode_splits, kernel_for,
                     row_bucket)

NO_ROW = 0xFFFFFFFF
MERGE_PARAMS = 3        # merge_lse.comp params header: rows (all heads), R, RB


def cascade_mode() -> str:
    """VKATTN_CASCADE: "off" (0), "on" (1: any group sharing a block), "auto" (unset or empty);
    anything else is a ValueError naming the variable."""
    env = os.environ.get("VKATTN_CASCADE", "")
    mode = _MODES.get(env)              # every batch call asks: no strip, no dict made, where it is plain
    if mode is None:
        mode = _MODES.get(env.strip())
        if mode is None:
            raise ValueError(f"VKATTN_CASCADE={env.strip()!r}: expected 0 (off) or 1 (on), or unset (automatic)")
    return mode


_MODES = {"": "auto", "0": "off", "1": "on"}


@dataclass(frozen=True)
class SharedGroup:
    """Sequences of a batch (indices into it, in batch order) whose block tables begin with the
    same full blocks ``blocks``: ``tokens`` = len(blocks) * block_size shared positions."""
    members: tuple
    blocks: tuple
    tokens: int


def shared_groups(tables, past, block_size: int, min_blocks: int = 1) -> list:
    """The sharing groups of a batch: ``tables[i]`` the block table of sequence i (any blocks
    past its ``past[i]`` tokens are ignored: only full blocks are compared), grouped by their first
    ``min_blocks`` (>= 1) blocks; every group of two or more sequences, with the longest run of
    leading full blocks all its members share. Sequences with fewer full blocks join no group."""
    if min_blocks < 1:
        raise ValueError(f"min_blocks: expected at least 1, got {min_blocks}")
    full = [list(t[:p // block_size]) for t, p in zip(tables, past)]
    by_head: dict = {}
    for i, f in enumerate(full):
        if len(f) >= min_blocks:
            by_head.setdefault(tuple(f[:min_blocks]), []).append(i)
    groups = []
    for members in by_head.values():
        if len(members) < 2:
            continue
        n = min(len(full[i]) for i in members)
        first = full[members[0]]
        for i in members[1:]:
            f = full[i]
            k = min_blocks
            while k < n and f[k] == first[k]:
                k += 1
            n = k
        groups.append(SharedGroup(tuple(members), tuple(first[:n]), n * block_size))
    groups.sort(key=lambda g: g.members[0])
    return groups


def may_share(cache, plan) -> bool:
    """False where plan_groups of AppendPlan ``plan`` is sure to be [] for any variant: cascade
    off, one sequence, a GPU in automatic mode, or no sequence whose first block is held by
    another (a shared prefix is shared blocks: forks and the prefix cache hold them twice). A
    cheap test, without the table copies shared_groups makes: plan_groups starts with it, and
    PagedKVCache's fast path takes it alone."""
    if len(plan.seq_ids) < 2 or not may_share_blocks(cache):
        return False
    refs = cache._pool._refs
    return any(refs[t[0]] > 1 for t in plan.tables if t)


def may_share_blocks(cache) -> bool:
    """Whether VKATTN_CASCADE lets ``cache`` attend shared blocks by cascade at all: not off,
    and on, or automatic on a software device."""
    mode = cascade_mode()
    return mode == "on" or (mode == "auto" and cache.device.is_software)


def plan_groups(cache, plan, hq: int, variant, masked: bool, rope_q: bool) -> list:
    """The groups a PagedKVCache.forward of AppendPlan ``plan`` attends by cascade ([] for today's
    path): none for an unsupported variant, VKATTN_CASCADE=0, or (automatic) on a GPU, for groups
    sharing fewer than CASCADE_MIN_PREFIX tokens or whose shared query tile would hold a single
    row."""
    if not may_share(cache, plan) or masked or rope_q or variant.window is not None or variant.alibi is not None:
        return []
    bs = cache.block_size
    if cascade_mode() == "on":
        return shared_groups(plan.tables, plan.past, bs, 1)
    groups = shared_groups(plan.tables, plan.past, bs, -(-CASCADE_MIN_PREFIX // bs))
    if not groups:
        return []
    rows = sum(plan.n_new[i] for g in groups for i in g.members)
    cfg = attention_config(cache.device, hq // cache.num_kv_heads, row_bucket(rows), cache._dk4, cache._dv4,
                           cache._ch, cache.slots, cache.num_kv_heads, matrices=cache._matrices)
    return groups if cfg.bq >= 2 else []


def split_rows(plan, groups: list) -> tuple:
    """(perm, mapping, shared SeqCalls, key_lo per sequence) of a batch (AppendPlan ``plan``,
    rows packed in batch order): ``perm`` the packed rows of the shared call (each group's members'
    rows in turn), ``mapping[r]`` the shared row of packed row r (NO_ROW: none), one SeqCall per
    group (its shared blocks, no causal cut), and each sequence's first own key."""
    starts = np.concatenate([[0], np.cumsum(plan.n_new)]).astype(np.int64)
    total = int(starts[-1])
    mapping = np.full(total, NO_ROW, np.uint32)
    key_lo = own_from(plan, groups)
    perm, shared = [], []
    for g in groups:
        q0 = len(perm)
        for i in g.members:
            rows = np.arange(starts[i], starts[i + 1])
            mapping[rows] = np.arange(len(perm), len(perm) + len(rows), dtype=np.uint32)
            perm.extend(rows.tolist())
        shared.append(SeqCall(past=g.tokens, n_new=0, q_start=q0, q_len=len(perm) - q0,
                              table=np.asarray(g.blocks, np.uint32)))
    return np.asarray(perm, np.int64), mapping, shared, key_lo


def own_from(plan, groups: list) -> list:
    """Each sequence's first own key: its group's shared tokens (0 outside every group)."""
    lo = [0] * len(plan.n_new)
    for g in groups:
        for i in g.members:
            lo[i] = g.tokens
    return lo


def shared_splits(device, num_kv_heads: int, key_bound: int) -> int:
    """Key splits of the shared pass: as a decode step over ``key_bound`` keys splits them
    (tuning.decode_splits). Its query tiles are few (the batch's rows), so a prefill's split rule
    would leave a GPU a few hundred workgroups walking thousands of keys each (NVIDIA H100, 16
    rows x 4 heads per kv head, 2048 shared keys: 8 splits 0.30 ms, 32 splits 0.13 ms; 32768
    keys: 16 splits 2.24 ms, 256 splits 1.49 ms)."""
    return decode_splits(device, kernel_for(device), num_kv_heads, key_bound)


def merge_pipeline(dev, c, rows: int) -> Pipeline:
    """merge_lse.comp for ``rows`` output rows (all heads) of v_head_dim ``c.v_head_dim``."""
    dv4 = -(-c.v_head_dim // 4)
    return Pipeline("merge_lse", "merge_lse", {}, (WORKGROUP, c.v_head_dim), (grid_groups(rows * dv4, dev), 1, 1), 7)


class CascadePlan:
    """The three dispatches of a cascade call in one recording: ``shared`` (an AttnPlan of
    ``srows`` query rows, ``ngroups`` sequences, non-causal), ``own`` (the batch's AttnPlan as
    PagedKVCache builds it, args ``own_args``) and merge_lse.comp into ``out`` / ``lse``."""

    def __init__(self, c, own_args: tuple, srows: int, ngroups: int, sflags: int, swords: int, sbound: int,
                 ssplits: int):
        self._args = (c, own_args, srows, ngroups, sflags, swords, sbound, ssplits)
        be = c.device.backend
        self.c = c
        self.own = AttnPlan(c, *own_args)
        hq, rows = self.own.hq, self.own.rows
        self.hq = hq
        # its own scratch names: the two plans of this recording must not share a buffer
        self.shared = AttnPlan(c, hq, srows, 0, ngroups, sflags, swords, sbound, decode=False, rope_dim=0,
                               splits=ssplits, scratch="shared_")
        # scratch too, shared on the device as AttnPlan's (filled, run and copied out in one call)
        self.params = be.shared_buffer(MERGE_PARAMS + rows, np.uint32, name="merge_params")
        self.out = be.shared_buffer(hq * rows * c.v_head_dim, np.float32, name="merge_out")
        self.lse = be.shared_buffer(hq * rows, np.float32, name="merge_lse")
        pipe = merge_pipeline(c.device, c, hq * rows)
        o, s = self.own, self.shared
        mine = {id(b) for b in (o.q, o.out, o.lse, o.part, o.ml, o.rope)}
        if mine & {id(b) for b in (s.q, s.out, s.lse, s.part, s.ml, s.rope)}:
            raise RuntimeError("cascade: the shared and own attention plans were given one scratch buffer")
        self.merge = be.program(compile_shader(pipe.shader, pipe.defines),
                                [o.out, o.lse, s.out, s.lse, self.params, self.out, self.lse],
                                pipe.groups, pipe.spec, writes=(5, 6), name=pipe.name)
        self.rec = (be.recording().upload(*o.inputs, *s.inputs, self.params)
                    .dispatch(s.attn).download(s.out, s.lse)
                    .dispatch(o.attn).download(o.out, o.lse)
                    .dispatch(self.merge).download(self.out, self.lse).build(c.timestamps))

    def warm(self) -> None:
        """One run with no tiles and no rows: the driver builds the three pipelines now."""
        saved = [int(p.aux.view()[14]) for p in (self.own, self.shared)]
        for p in (self.own, self.shared):
            p.aux.view()[14] = 0
        self.params.view()[0] = 0
        self.rec.run()
        for p, n in zip((self.own, self.shared), saved):
            p.aux.view()[14] = n

    def run(self, q, k, v, seqs: list, plan, groups: list, causal: bool, scale: float, variant, rope=None):
        """q (hq, R, head_dim) packed in batch order, k/v (num_kv_heads, n, d) the new rows or
        None (appended first), ``seqs`` the batch's SeqCalls as today's path makes them, ``plan``
        its AppendPlan, ``groups`` its SharedGroups. Returns out (hq, R, v_head_dim) and lse
        (hq, R) float32."""
        c = self.c
        perm, mapping, shared, key_lo = split_rows(plan, groups)
        own = [replace(s, key_lo=lo) for s, lo in zip(seqs, key_lo)]
        rows = self.own.fill(q, k, v, own, causal, scale, variant, rope)
        srows = self.shared.fill(q[:, perm], None, None, shared, False, scale, variant, None)
        p = self.params.view()
        p[:MERGE_PARAMS] = (self.hq * rows, rows, srows)
        p[MERGE_PARAMS:MERGE_PARAMS + rows] = mapping
        self.rec.run()
        c._last_rec = self.rec
        widths = [w for w in (self.own.narrow_subgroup(rows), self.shared.narrow_subgroup(srows)) if w]
        if widths:                  # as AttnPlan.run: clusters shrink, the plan is rebuilt, run again
            c.device.lower_tile_cluster(min(widths))
            self.destroy()
            self.__init__(*self._args)
            return self.run(q, k, v, seqs, plan, groups, causal, scale, variant, rope)
        dv = c.v_head_dim
        out = self.out.view()[:self.hq * rows * dv].reshape(self.hq, rows, dv).copy()
        return out, self.lse.view()[:self.hq * rows].reshape(self.hq, rows).copy()

    def destroy(self) -> None:
        destroy(self.rec, self.merge, self.params, self.out, self.lse)
        self.own.destroy()
        self.shared.destroy()


def cascade_plan(cache, plan, hq: int, own_key: tuple, own_args: tuple, groups: list,
                 variant_flags: int) -> CascadePlan:
    """The CascadePlan of a batch (from the cache's plan LRU): the own dispatch as today's
    (``own_key`` / ``own_args``: AttnPlan's arguments after the cache, from
    PagedKVCache._batch_plan_args), the shared one for the groups' rows (a row bucket), blocks and
    longest prefix (a decode key bound), with the call's score variant flags (softcap)."""
    rows = sum(plan.n_new[i] for g in groups for i in g.members)
    srows = row_bucket(rows)
    words = aux_bucket(AttnPlan.aux_need(len(groups), srows, hq, sum(len(g.blocks) for g in groups), 0))
    sbound = decode_key_bound(max(g.tokens for g in groups), cache.slots)
    splits = shared_splits(cache.device, cache.num_kv_heads, sbound)
    sflags = F_PAGED | variant_flags
    key = ("cascade",) + own_key + (srows, len(groups), sflags, words, sbound, splits)
    return cache._plan(key, lambda: CascadePlan(cache, own_args, srows, len(groups), sflags, words, sbound, splits))
