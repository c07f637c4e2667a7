"""Host bookkeeping of a paged multi-sequence KV cache: a flat pool of fixed-size blocks.

No device code lives here. The pool owns ``num_blocks`` blocks of ``block_size`` token slots; a
sequence is a length and a block table, and position ``pos`` of a sequence lives in the flat slot

    table[pos // block_size] * block_size + pos % block_size

Blocks are reference counted so that forked sequences share their full blocks. The invariant the
device kernels rely on: the block holding a sequence's next write position (its last, partially
filled block) is never shared. Writes only go to positions ``>= length``, which lie in that private
tail block or in freshly allocated ones, so a shared block is never written. ``fork`` and
``truncate`` keep the invariant by handing a private copy of a partial block to the caller, as a
``(src_block, dst_block, rows)`` instruction: copy the first ``rows`` slots of ``src_block`` into
``dst_block`` on the device.

Every check runs before anything changes: on any error the pool is exactly as it was.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple

import numpy as np

from .checks import check_int
from .errors import CacheFullError

__all__ = ["BlockPool", "AppendPlan", "UnknownSequenceError", "BlockCopy"]

BlockCopy = Tuple[int, int, int]
"""``(src_block, dst_block, rows)``: copy the first ``rows`` slots of ``src_block`` into ``dst_block``."""


class UnknownSequenceError(KeyError):
    """A sequence id that the pool does not hold."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class AppendPlan:
    """A checked, not yet applied allocation for appending ``n_new[i]`` tokens to ``seq_ids[i]``.

    ``past[i]`` is the length before the append, ``tables[i]`` the full block table after it and
    ``new_blocks[i]`` the blocks it allocates (the tail of ``tables[i]``). Nothing changes in the
    pool until ``commit()``; a plan made stale by any later change of the pool cannot be committed.
    """

    seq_ids: list
    past: list
    n_new: list
    tables: list
    new_blocks: list
    _pool: "BlockPool" = field(repr=False, compare=False)
    _version: int = field(repr=False, compare=False)

    @property
    def total_new_blocks(self) -> int:
        return sum(len(b) for b in self.new_blocks)

    def slots(self, i: int) -> np.ndarray:
        """Flat slots (int64) of the positions ``past[i] .. past[i] + n_new[i] - 1`` of batch entry ``i``."""
        i = check_int("i", i, 0, len(self.seq_ids) - 1)
        pos = np.arange(self.past[i], self.past[i] + self.n_new[i], dtype=np.int64)
        return _slots_of(self.tables[i], self._pool.block_size, pos)

    def commit(self) -> None:
        """Apply the plan: allocate its blocks and advance the lengths.

        Raises RuntimeError if the pool changed since the plan was made (this includes committing
        the same plan twice).
        """
        pool = self._pool
        if pool._version != self._version:
            raise RuntimeError(
                f"AppendPlan.commit: stale plan: the pool changed since the plan was made "
                f"(version {self._version}, pool at version {pool._version}); make a new plan")
        pool._apply_append(self)


def _slots_of(table: Sequence[int], block_size: int, pos: np.ndarray) -> np.ndarray:
    blocks = np.asarray(table, dtype=np.int64)
    return blocks[pos // block_size] * block_size + pos % block_size


class BlockPool:
    """Reference-counted pool of ``num_blocks`` blocks of ``block_size`` slots, shared by sequences."""

    def __init__(self, num_blocks: int, block_size: int):
        self._num_blocks = check_int("num_blocks", num_blocks, 1)
        self._block_size = check_int("block_size", block_size, 1)
        self._refs = [0] * self._num_blocks
        # A stack: allocation pops from the end, so a fresh pool hands out 0, 1, 2, ...
        self._free = list(range(self._num_blocks - 1, -1, -1))
        self._tables: dict = {}
        self._lengths: dict = {}
        self._version = 0

    # ------------------------------------------------------------------ properties

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def sequences(self) -> list:
        return sorted(self._tables)

    def __contains__(self, seq_id) -> bool:
        return (not isinstance(seq_id, bool) and isinstance(seq_id, numbers.Integral)
                and int(seq_id) in self._tables)

    def __len__(self) -> int:
        return len(self._tables)

    def __repr__(self) -> str:
        return (f"BlockPool(num_blocks={self._num_blocks}, block_size={self._block_size}, "
                f"free_blocks={self.free_blocks}, sequences={len(self._tables)})")

    # ------------------------------------------------------------------ argument checks

    def _known(self, name: str, seq_id) -> int:
        if isinstance(seq_id, bool) or not isinstance(seq_id, numbers.Integral):
            raise TypeError(f"{name}: expected an int sequence id, got {type(seq_id).__name__}")
        seq_id = int(seq_id)
        if seq_id not in self._tables:
            raise UnknownSequenceError(
                f"{name}: unknown sequence id {seq_id} (the pool holds {self._describe_ids()})")
        return seq_id

    def _new_id(self, name: str, seq_id) -> int:
        if seq_id is None:
            seq_id = 0
            while seq_id in self._tables:
                seq_id += 1
            return seq_id
        seq_id = check_int(name, seq_id, 0)
        if seq_id in self._tables:
            raise ValueError(f"{name}: expected an unused sequence id, got {seq_id} (already in the pool)")
        return seq_id

    def _describe_ids(self) -> str:
        ids = self.sequences
        if not ids:
            return "no sequences"
        shown = ", ".join(map(str, ids[:8])) + (", ..." if len(ids) > 8 else "")
        return f"ids [{shown}]"

    # ------------------------------------------------------------------ block helpers

    def _take(self) -> int:
        block = self._free.pop()
        self._refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)

    # ------------------------------------------------------------------ sequences

    def add(self, seq_id: Optional[int] = None) -> int:
        """Add an empty sequence (no blocks) and return its id (the smallest unused one if None)."""
        seq_id = self._new_id("seq_id", seq_id)
        self._tables[seq_id] = []
        self._lengths[seq_id] = 0
        self._version += 1
        return seq_id

    def remove(self, seq_id: int) -> None:
        """Drop a sequence; blocks no other sequence references go back to the free list."""
        seq_id = self._known("seq_id", seq_id)
        table = self._tables.pop(seq_id)
        del self._lengths[seq_id]
        for block in reversed(table):
            self._release(block)
        self._version += 1

    def length(self, seq_id: int) -> int:
        return self._lengths[self._known("seq_id", seq_id)]

    def block_table(self, seq_id: int) -> list:
        """A copy of the sequence's block table: ``ceil(length / block_size)`` block ids."""
        return list(self._tables[self._known("seq_id", seq_id)])

    def fork(self, src: int, dst: Optional[int] = None) -> Tuple[int, Optional[BlockCopy]]:
        """Add a sequence with ``src``'s contents; return ``(new_id, copy)``.

        The new sequence shares ``src``'s full blocks. A partial tail block is not shared: the fork
        gets a fresh block and ``copy = (src_block, dst_block, rows)`` asks the caller to copy its
        first ``rows`` slots on the device. ``copy`` is None when ``src``'s length is a multiple of
        ``block_size``. Raises CacheFullError (nothing changed) if that fresh block is not there.
        """
        src = self._known("src", src)
        dst = self._new_id("dst", dst)
        length = self._lengths[src]
        table = self._tables[src]
        n_full, rows = divmod(length, self._block_size)
        if rows and not self._free:
            raise CacheFullError(
                f"fork: sequence {src} ends in a partial block ({rows} of {self._block_size} rows) "
                f"that needs a private copy: 1 block needed, 0 free (of {self._num_blocks})")
        shared = table[:n_full]
        for block in shared:
            self._refs[block] += 1
        new_table = list(shared)
        copy = None
        if rows:
            new_block = self._take()
            new_table.append(new_block)
            copy = (table[n_full], new_block, rows)
        self._tables[dst] = new_table
        self._lengths[dst] = length
        self._version += 1
        return dst, copy

    def truncate(self, seq_id: int, length: int) -> Optional[BlockCopy]:
        """Roll ``seq_id`` back to ``length`` tokens, releasing the blocks past the new end.

        If the new last block is partial and shared with another sequence, the sequence gets a
        fresh private block instead and ``(old_block, new_block, rows)`` is returned for the caller
        to copy on the device (blocks released by this very call count as free); otherwise None.
        Raises CacheFullError (nothing changed) if no block is available for that copy.
        """
        seq_id = self._known("seq_id", seq_id)
        current = self._lengths[seq_id]
        length = check_int("length", length, 0, current)
        table = self._tables[seq_id]
        keep = _ceil_div(length, self._block_size)
        rows = length % self._block_size
        dropped = table[keep:]
        needs_copy = bool(rows) and self._refs[table[keep - 1]] > 1
        if needs_copy:
            released = sum(1 for b in set(dropped) if self._refs[b] == 1)
            if not self._free and not released:
                raise CacheFullError(
                    f"truncate: sequence {seq_id} at length {length} ends inside block "
                    f"{table[keep - 1]}, which is shared, so it needs a private copy "
                    f"({rows} of {self._block_size} rows): 1 block needed, 0 free "
                    f"(of {self._num_blocks})")
        for block in reversed(dropped):
            self._release(block)
        del table[keep:]
        copy = None
        if needs_copy:
            old_block = table[-1]
            self._refs[old_block] -= 1  # still > 0: another sequence holds it
            new_block = self._take()
            table[-1] = new_block
            copy = (old_block, new_block, rows)
        self._lengths[seq_id] = length
        self._version += 1
        return copy

    # ------------------------------------------------------------------ batched append

    def plan_append(self, seq_ids: Sequence[int], n_new: Sequence[int]) -> AppendPlan:
        """Check and plan appending ``n_new[i]`` tokens to ``seq_ids[i]``, without changing the pool.

        Raises ValueError for a duplicate id or mismatched lengths, UnknownSequenceError for an
        unknown id, CacheFullError if the batch needs more new blocks than are free. Call
        ``commit()`` on the returned plan to apply it.
        """
        seq_ids = _as_list("seq_ids", seq_ids)
        n_new = _as_list("n_new", n_new)
        if len(n_new) != len(seq_ids):
            raise ValueError(
                f"n_new: expected {len(seq_ids)} counts (one per entry of seq_ids), got {len(n_new)}")
        ids = []
        seen = set()
        for i, s in enumerate(seq_ids):
            s = self._known(f"seq_ids[{i}]", s)
            if s in seen:
                raise ValueError(f"seq_ids[{i}]: expected distinct sequence ids, got {s} twice")
            seen.add(s)
            ids.append(s)
        counts = [check_int(f"n_new[{i}]", n, 0) for i, n in enumerate(n_new)]

        bs = self._block_size
        need = [_ceil_div(self._lengths[s] + n, bs) - len(self._tables[s]) for s, n in zip(ids, counts)]
        total = sum(need)
        if total > len(self._free):
            short = ", ".join(f"{s}: {k}" for s, k in zip(ids, need) if k)
            raise CacheFullError(
                f"plan_append: the batch needs {total} new blocks, {len(self._free)} free "
                f"(of {self._num_blocks}); new blocks per sequence {{{short}}}")
        picks = self._free[len(self._free) - total:][::-1]  # the order _take() would pop them
        tables, new_blocks, at = [], [], 0
        for s, k in zip(ids, need):
            new_blocks.append(picks[at:at + k])
            tables.append(self._tables[s] + picks[at:at + k])
            at += k
        return AppendPlan(seq_ids=ids, past=[self._lengths[s] for s in ids], n_new=counts,
                          tables=tables, new_blocks=new_blocks, _pool=self, _version=self._version)

    def _apply_append(self, plan: AppendPlan) -> None:
        for s, blocks, n in zip(plan.seq_ids, plan.new_blocks, plan.n_new):
            for want in blocks:
                got = self._take()
                if got != want:  # cannot happen while the version matches
                    raise AssertionError(f"AppendPlan.commit: planned block {want}, free list gave {got}")
                self._tables[s].append(got)
            self._lengths[s] += n
        self._version += 1

    # ------------------------------------------------------------------ addressing & debugging

    def slots(self, seq_id: int, start: int, stop: int) -> np.ndarray:
        """Flat slot indices (int64) of positions ``start .. stop - 1`` of ``seq_id``."""
        seq_id = self._known("seq_id", seq_id)
        length = self._lengths[seq_id]
        start = check_int("start", start, 0, length)
        stop = check_int("stop", stop, start, length)
        pos = np.arange(start, stop, dtype=np.int64)
        return _slots_of(self._tables[seq_id], self._block_size, pos)

    def check(self) -> None:
        """Verify every invariant of the pool; raise AssertionError naming the first one broken."""
        bs = self._block_size
        counted = [0] * self._num_blocks
        for s, table in self._tables.items():
            length = self._lengths.get(s)
            if length is None or length < 0:
                raise AssertionError(f"sequence {s}: bad length {length!r}")
            if len(table) != _ceil_div(length, bs):
                raise AssertionError(
                    f"sequence {s}: {len(table)} blocks for length {length}, expected {_ceil_div(length, bs)}")
            if len(set(table)) != len(table):
                raise AssertionError(f"sequence {s}: a block appears twice in its table {table}")
            for b in table:
                if not 0 <= b < self._num_blocks:
                    raise AssertionError(f"sequence {s}: block {b} out of range")
                counted[b] += 1
        if set(self._lengths) != set(self._tables):
            raise AssertionError("lengths and tables hold different sequence ids")
        for b in range(self._num_blocks):
            if self._refs[b] != counted[b]:
                raise AssertionError(f"block {b}: refcount {self._refs[b]}, referenced {counted[b]} times")
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("the free list holds a block twice")
        unused = {b for b in range(self._num_blocks) if counted[b] == 0}
        if free != unused:
            raise AssertionError(
                f"free list {sorted(free)} differs from the unreferenced blocks {sorted(unused)}")
        for s, table in self._tables.items():
            if self._lengths[s] % bs and self._refs[table[-1]] != 1:
                raise AssertionError(
                    f"sequence {s}: its partial tail block {table[-1]} is shared "
                    f"(refcount {self._refs[table[-1]]})")


def _as_list(name: str, values) -> list:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or not hasattr(values, "__iter__"):
        raise TypeError(f"{name}: expected a sequence of ints, got {type(values).__name__}")
    if isinstance(values, np.ndarray) and values.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got an array of shape {values.shape}")
    return list(values)
