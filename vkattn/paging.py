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

Prefix caching. A sequence may know the token ids of its positions (given to :meth:`BlockPool.add`,
to :meth:`BlockPool.plan_append` or later to :meth:`BlockPool.set_token_ids`). A full block whose
tokens are all known gets a hash chained over its parent block's hash and its own token ids (the
first block's parent is a root hash of the sequence's optional ``salt``)::

    root = sha256(b"vkattn prefix v1" + salt)       h_i = sha256(h_{i-1} + token_ids of block i, int64 LE)

and is registered in the pool's index under that hash, unless the hash is there already (the first
block registered under a hash keeps it). A new sequence given its token ids (:meth:`BlockPool.add`)
starts with the blocks of its longest cached prefix -- reference counted, never copied -- and its
length is the number of tokens it need not compute. At most ``len(token_ids) - 1`` tokens are
matched (whole blocks), so at least one token is left for the caller to compute and get logits
from. A block nobody holds any more but that is registered stays cached: it is handed out again
by a match, or evicted (unregistered and reused) when the pool needs a block and none is free,
least recently released first. ``free_blocks`` counts both: a full pool evicts before it refuses.

A registered block is full and never written again: appends go past a sequence's length, and a
``truncate`` into a registered block either copies it (shared, as before) or, when the truncating
sequence is its only holder, unregisters it first. Token ids are trusted: equal ids (and salt) must
mean equal K/V, so a caller whose K/V also depend on something else (model, adapter, rotary
settings) puts that in the salt.

Every check runs before anything changes: on any error the pool is exactly as it was.
"""
from __future__ import annotations

import hashlib
import numbers
import sys
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import chain, islice
from typing import Optional, Sequence, Tuple

import numpy as np

from .checks import check_int
from .errors import CacheFullError

__all__ = ["BlockPool", "AppendPlan", "UnknownSequenceError", "BlockCopy", "root_hash", "block_hash"]

_INT = {int}                        # set(map(type, values)) of plain ints, or a subset
_LIST = {list}

HASH_DOMAIN = b"vkattn prefix v1"

BlockCopy = Tuple[int, int, int]
"""``(src_block, dst_block, rows)``: copy the first ``rows`` slots of ``src_block`` into ``dst_block``."""


class UnknownSequenceError(KeyError):
    """A sequence id that the pool does not hold."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def root_hash(salt=None) -> bytes:
    """The parent hash of a sequence's first block: sha256 of the domain tag and the salt (None, a
    str -- hashed as UTF-8 -- or bytes; the three kinds never collide)."""
    if salt is None:
        tagged = b"-"
    elif isinstance(salt, str):
        tagged = b"s" + salt.encode("utf-8")
    elif isinstance(salt, (bytes, bytearray)):
        tagged = b"b" + bytes(salt)
    else:
        raise TypeError(f"salt: expected None, a str or bytes, got {type(salt).__name__}")
    return hashlib.sha256(HASH_DOMAIN + len(tagged).to_bytes(8, "little") + tagged).digest()


def block_hash(parent: bytes, token_ids) -> bytes:
    """The hash of a full block: sha256 of its parent's hash and its ``block_size`` token ids as
    little-endian int64."""
    if _LITTLE:                         # plain ints in range (checked): array's int64 is the machine's order
        return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()
    return hashlib.sha256(parent + np.asarray(token_ids, dtype="<i8").tobytes()).digest()


_LITTLE = sys.byteorder == "little"


def _plain_ids(ids: list) -> bool:
    """Whether a list holds plain ints in [0, 2**63) only (C loops: check_token_ids's common case)."""
    return set(map(type, ids)) <= _INT and (not ids or (min(ids) >= 0 and max(ids) < 1 << 63))


def check_token_ids(name: str, token_ids, n: Optional[int] = None) -> list:
    """``token_ids`` (a 1-D sequence or array of ints in [0, 2**63)) as a list of int; with ``n``, exactly n of them."""
    if type(token_ids) is list and (n is None or len(token_ids) == n) and _plain_ids(token_ids):
        return token_ids[:]             # plain ints in range: a copy, in C loops (a decode step's one id)
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
        raise TypeError(f"{name}: expected a 1-D sequence of token ids (ints), got {type(token_ids).__name__}")
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size and (arr.dtype.kind not in "iu"):
        raise TypeError(f"{name}: expected integer token ids, got dtype {arr.dtype}")
    if n is not None and arr.size != n:
        raise ValueError(f"{name}: expected {n} token ids, got {arr.size}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 63):
        raise ValueError(f"{name}: expected token ids in [0, 2**63), got values in [{int(arr.min())}, {int(arr.max())}]")
    return arr.astype(np.int64).tolist()


@dataclass(frozen=True)
class AppendPlan:
    """A checked, not yet applied allocation for appending ``n_new[i]`` tokens to ``seq_ids[i]``.

    ``past[i]`` is the length before the append, ``tables[i]`` the full block table after it and
    ``new_blocks[i]`` the blocks it allocates (the tail of ``tables[i]``); ``token_ids[i]`` the
    ids of the new tokens (a list of ``n_new[i]`` ints) or None. Nothing changes in the pool until
    ``commit()``; a plan made stale by any later change of the pool cannot be committed.
    """

    seq_ids: list
    past: list
    n_new: list
    tables: list
    new_blocks: list
    token_ids: list
    _pool: "BlockPool" = field(repr=False, compare=False)
    _version: int = field(repr=False, compare=False)

    @classmethod
    def _of(cls, seq_ids, past, n_new, tables, new_blocks, token_ids, pool: "BlockPool") -> "AppendPlan":
        """A plan of these fields for ``pool`` at its current version, made without the frozen
        dataclass's __init__ (a call per field: 2 us of a 20 us batch call on a 2-core machine);
        the same object. Nothing is checked: plan_append's and vkattn.paged's to do."""
        plan = object.__new__(cls)
        plan.__dict__.update(seq_ids=seq_ids, past=past, n_new=n_new, tables=tables, new_blocks=new_blocks,
                             token_ids=token_ids, _pool=pool, _version=pool._version)
        return plan

    def _rebased(self, pool: Optional["BlockPool"]) -> "AppendPlan":
        """The same plan for ``pool`` at its current version: for a caller that found ``pool`` in
        the state this plan was made from for its sequences (vkattn.paged's step memo); nothing
        is checked here. A copy of the fields (cheaper than dataclasses.replace). ``pool`` None:
        a copy tied to no pool (what the memo keeps), committed nowhere."""
        plan = object.__new__(AppendPlan)
        fields = plan.__dict__
        fields.update(self.__dict__)
        fields["_pool"], fields["_version"] = pool, (None if pool is None else pool._version)
        return plan

    @property
    def total_new_blocks(self) -> int:
        return sum(len(b) for b in self.new_blocks)

    def slots(self, i: int) -> np.ndarray:
        """Flat slots (int64) of the positions ``past[i] .. past[i] + n_new[i] - 1`` of batch entry ``i``."""
        i = check_int("i", i, 0, len(self.seq_ids) - 1)
        pos = np.arange(self.past[i], self.past[i] + self.n_new[i], dtype=np.int64)
        return _slots_of(self.tables[i], self._pool.block_size, pos)

    def evict_cached(self) -> int:
        """Evict the cached blocks among ``new_blocks`` now (unregister them; they stay available
        to this plan), before the device overwrites them: a call that fails between its writes and
        ``commit()`` then leaves no cached block holding other data than its hash says. Changes no
        sequence, and neither ``free_blocks`` nor the plan's validity. Returns how many it evicted.
        Raises RuntimeError for a stale plan (its blocks may be anyone's now), changing nothing."""
        pool = self._pool
        if pool._version != self._version:
            raise RuntimeError(
                f"AppendPlan.evict_cached: stale plan: the pool changed since the plan was made "
                f"(version {self._version}, pool at version {pool._version}); make a new plan")
        n = 0
        for blocks in self.new_blocks:
            for b in blocks:
                if b in pool._cached:
                    pool._evict(b)
                    n += 1
        return n

    def commit(self) -> None:
        """Apply the plan: allocate its blocks, advance the lengths, record the token ids (blocks
        they fill become cacheable).

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
    """Reference-counted pool of ``num_blocks`` blocks of ``block_size`` slots, shared by sequences,
    with a prefix cache of full blocks keyed by their chained token-id hashes (module docstring)."""

    def __init__(self, num_blocks: int, block_size: int):
        self._num_blocks = check_int("num_blocks", num_blocks, 1)
        self._block_size = check_int("block_size", block_size, 1)
        self._refs = [0] * self._num_blocks
        # Free blocks, a stack (insertion-ordered dict): allocation pops the last one, so a fresh
        # pool hands out 0, 1, 2, ...
        self._free: dict = dict.fromkeys(range(self._num_blocks - 1, -1, -1))
        # Unreferenced registered blocks, least recently released first: evicted in this order
        self._cached: OrderedDict = OrderedDict()
        self._hash_of: dict = {}       # registered block -> its hash
        self._index: dict = {}         # hash -> registered block
        self._tables: dict = {}
        self._lengths: dict = {}
        self._tokens: dict = {}        # seq -> token ids of its first positions (those known)
        self._hashes: dict = {}        # seq -> hashes of its full known blocks: len(tokens) // block_size
        self._roots: dict = {}         # seq -> root hash (of its salt)
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
        """Blocks an allocation can take: unused ones plus cached ones nobody holds (evicted first)."""
        return len(self._free) + len(self._cached)

    @property
    def cached_blocks(self) -> int:
        """Blocks nobody holds that the prefix cache keeps (evictable; counted in ``free_blocks``)."""
        return len(self._cached)

    @property
    def registered_blocks(self) -> int:
        """Blocks in the prefix-cache index: the cached ones and registered blocks in use."""
        return len(self._index)

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
                f"free_blocks={self.free_blocks}, cached_blocks={self.cached_blocks}, "
                f"sequences={len(self._tables)})")

    # ------------------------------------------------------------------ argument checks

    def _known(self, name: str, seq_id) -> int:
        if type(seq_id) is int and seq_id in self._tables:
            return seq_id               # the common case, without the ABC checks below
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

    def _describe_free(self) -> str:
        cached = f", {len(self._cached)} of them cached" if self._cached else ""
        return f"{self.free_blocks} free (of {self._num_blocks}{cached})"

    # ------------------------------------------------------------------ block helpers

    def _take(self) -> int:
        """A block for writing: the last freed unused one, else the least recently released cached one."""
        if self._free:
            block = self._free.popitem()[0]
        else:
            block = next(iter(self._cached))
            self._evict(block)
            del self._free[block]
        self._refs[block] = 1
        return block

    def _picks(self, n: int) -> list:
        """The blocks ``n`` calls of ``_take()`` would return, in order; nothing changes."""
        picks = list(islice(reversed(self._free), n))
        return picks + list(islice(self._cached, n - len(picks)))

    def _evict(self, block: int) -> None:
        """An unreferenced cached block leaves the cache: unregistered, onto the free stack."""
        del self._cached[block]
        self._unregister(block)
        self._free[block] = None

    def _unregister(self, block: int) -> None:
        h = self._hash_of.pop(block)
        del self._index[h]

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._hash_of:
                self._cached[block] = None     # most recently released: evicted last
            else:
                self._free[block] = None

    def _hold(self, block: int) -> None:
        """One more reference; a cached block leaves the eviction queue."""
        if self._refs[block] == 0:
            del self._cached[block]
        self._refs[block] += 1

    def _learn(self, seq_id: int, token_ids: list) -> None:
        """Extend ``seq_id``'s known token ids (its first ``len(known) + len(token_ids)`` positions,
        all within its length); every block that becomes full and known gets its hash and is
        registered unless the hash is registered already."""
        self._tokens[seq_id].extend(token_ids)
        self._register_full(seq_id)

    def _register_full(self, seq_id: int) -> None:
        """_learn's second half: every full block of ``seq_id`` whose token ids are known and that
        has no hash yet gets one, registered unless the hash is registered already."""
        tokens, hashes, table = self._tokens[seq_id], self._hashes[seq_id], self._tables[seq_id]
        bs = self._block_size
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            h = block_hash(hashes[-1] if hashes else self._roots[seq_id], tokens[i * bs:(i + 1) * bs])
            hashes.append(h)
            block = table[i]
            if block not in self._hash_of and h not in self._index:
                self._hash_of[block] = h
                self._index[h] = block

    def _match(self, token_ids: list, root: bytes) -> list:
        """(block, hash) of the longest run of cached full blocks that starts ``token_ids``, at
        most ``(len(token_ids) - 1) // block_size`` blocks; nothing changes."""
        bs = self._block_size
        out, parent = [], root
        for i in range(max(0, (len(token_ids) - 1) // bs)):
            h = block_hash(parent, token_ids[i * bs:(i + 1) * bs])
            block = self._index.get(h)
            if block is None:
                break
            out.append((block, h))
            parent = h
        return out

    # ------------------------------------------------------------------ sequences

    def add(self, seq_id: Optional[int] = None, token_ids=None, salt=None, root: Optional[bytes] = None) -> int:
        """Add a sequence and return its id (the smallest unused one if None).

        Without ``token_ids`` it is empty. With them (the ids of the prompt the caller is about to
        compute, a 1-D sequence of ints) it starts with the cached blocks of their longest cached
        prefix, at most ``len(token_ids) - 1`` tokens in whole blocks, shared with whoever holds
        them: ``length(seq_id)`` is then the number of leading tokens the caller need not compute
        (their K/V are in the cache); append the rest, with their token ids so that the blocks
        they fill become cacheable. ``salt`` (None, str or bytes) separates caches whose equal
        token ids do not mean equal K/V; a block matches only blocks registered under the same salt.
        ``root``: the salt's root hash itself (root_hash; a saved sequence's), instead of ``salt``.
        """
        seq_id = self._new_id("seq_id", seq_id)
        root = root_hash(salt) if root is None else root
        token_ids = [] if token_ids is None else check_token_ids("token_ids", token_ids)
        matched = self._match(token_ids, root)
        for block, _ in matched:
            self._hold(block)
        n = len(matched) * self._block_size
        self._tables[seq_id] = [b for b, _ in matched]
        self._lengths[seq_id] = n
        self._tokens[seq_id] = token_ids[:n]
        self._hashes[seq_id] = [h for _, h in matched]
        self._roots[seq_id] = root
        self._version += 1
        return seq_id

    def root(self, seq_id: int) -> bytes:
        """The root hash of ``seq_id``'s blocks (root_hash of the salt it was added with)."""
        return self._roots[self._known("seq_id", seq_id)]

    def match_prefix(self, token_ids, salt=None) -> int:
        """How many leading tokens of ``token_ids`` :meth:`add` would find cached now (whole
        blocks, at most ``len(token_ids) - 1``); changes nothing (not even the eviction order)."""
        return len(self._match(check_token_ids("token_ids", token_ids), root_hash(salt))) * self._block_size

    def remove(self, seq_id: int) -> None:
        """Drop a sequence; blocks no other sequence references become free, or stay cached if
        registered (its last blocks are released first, so they are evicted before its first)."""
        seq_id = self._known("seq_id", seq_id)
        table = self._tables.pop(seq_id)
        for d in (self._lengths, self._tokens, self._hashes, self._roots):
            del d[seq_id]
        for block in reversed(table):
            self._release(block)
        self._version += 1

    def length(self, seq_id: int) -> int:
        return self._lengths[self._known("seq_id", seq_id)]

    def block_table(self, seq_id: int) -> list:
        """A copy of the sequence's block table: ``ceil(length / block_size)`` block ids."""
        return list(self._tables[self._known("seq_id", seq_id)])

    def token_ids(self, seq_id: int) -> list:
        """The known token ids of the sequence's first positions (all of them while every append
        came with its ids; fewer after an append without)."""
        return list(self._tokens[self._known("seq_id", seq_id)])

    def set_token_ids(self, seq_id: int, token_ids) -> None:
        """Tell the pool the token ids of the sequence's first ``len(token_ids)`` positions (at
        most its length), e.g. after appending them without ids: the full blocks they complete
        become cacheable. The ids it already knows must agree (ValueError naming the first
        position that differs; nothing changes)."""
        seq_id = self._known("seq_id", seq_id)
        token_ids = check_token_ids("token_ids", token_ids)
        length, known = self._lengths[seq_id], self._tokens[seq_id]
        if len(token_ids) > length:
            raise ValueError(f"token_ids: sequence {seq_id} holds {length} positions, got {len(token_ids)} token ids")
        head = token_ids[:len(known)]
        if head != known[:len(head)]:
            at = next(i for i, (a, b) in enumerate(zip(head, known)) if a != b)
            raise ValueError(f"token_ids[{at}]: sequence {seq_id} holds token id {known[at]} at position {at}, "
                             f"got {token_ids[at]}")
        if len(token_ids) > len(known):
            self._learn(seq_id, token_ids[len(known):])
            self._version += 1

    def evict(self, n: Optional[int] = None) -> int:
        """Evict up to ``n`` cached blocks nobody holds (all if None), least recently released
        first; they become unused. Returns how many were evicted."""
        n = len(self._cached) if n is None else check_int("n", n, 0)
        victims = list(islice(self._cached, n))
        for block in victims:
            self._evict(block)
        if victims:
            self._version += 1
        return len(victims)

    def fork(self, src: int, dst: Optional[int] = None) -> Tuple[int, Optional[BlockCopy]]:
        """Add a sequence with ``src``'s contents (and known token ids); return ``(new_id, copy)``.

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
        if rows and not self.free_blocks:
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
        self._tokens[dst] = list(self._tokens[src])
        self._hashes[dst] = list(self._hashes[src])
        self._roots[dst] = self._roots[src]
        self._version += 1
        return dst, copy

    def truncate(self, seq_id: int, length: int) -> Optional[BlockCopy]:
        """Roll ``seq_id`` back to ``length`` tokens, releasing the blocks past the new end.

        If the new last block is partial and shared with another sequence, the sequence gets a
        fresh private block instead and ``(old_block, new_block, rows)`` is returned for the caller
        to copy on the device (blocks released by this very call count as free); otherwise None.
        A partial last block that is registered in the prefix cache and held by this sequence
        alone is unregistered (it will be written again). Raises CacheFullError (nothing changed)
        if no block is available for that copy.
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
            if not self.free_blocks and not released:
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
        elif rows and table[-1] in self._hash_of:
            self._unregister(table[-1])
        self._lengths[seq_id] = length
        tokens = self._tokens[seq_id]
        del tokens[length:]
        del self._hashes[seq_id][len(tokens) // self._block_size:]
        self._version += 1
        return copy

    # ------------------------------------------------------------------ batched append

    def plan_append(self, seq_ids: Sequence[int], n_new: Sequence[int], token_ids=None) -> AppendPlan:
        """Check and plan appending ``n_new[i]`` tokens to ``seq_ids[i]``, without changing the pool.

        ``token_ids``: None, or one entry per sequence, each None or the ``n_new[i]`` token ids of
        its new tokens; they are recorded at commit when the sequence knows every earlier token id
        (ignored otherwise), and the full blocks they complete become cacheable.

        Raises ValueError for a duplicate id or mismatched lengths, UnknownSequenceError for an
        unknown id, CacheFullError if the batch needs more new blocks than are free (cached
        blocks nobody holds count as free: they are evicted). Call ``commit()`` on the returned
        plan to apply it.
        """
        seq_ids = _as_list("seq_ids", seq_ids)
        n_new = _as_list("n_new", n_new)
        if len(n_new) != len(seq_ids):
            raise ValueError(
                f"n_new: expected {len(seq_ids)} counts (one per entry of seq_ids), got {len(n_new)}")
        known = self._tables
        if all(type(s) is int and s in known for s in seq_ids) and len(set(seq_ids)) == len(seq_ids):
            ids = seq_ids               # the common case: known, distinct plain ints
        else:
            ids = []
            seen = set()
            for i, s in enumerate(seq_ids):
                s = self._known(f"seq_ids[{i}]", s)
                if s in seen:
                    raise ValueError(f"seq_ids[{i}]: expected distinct sequence ids, got {s} twice")
                seen.add(s)
                ids.append(s)
        if all(type(n) is int and n >= 0 for n in n_new):
            counts = n_new
        else:
            counts = [check_int(f"n_new[{i}]", n, 0) for i, n in enumerate(n_new)]
        return self._plan_checked(ids, counts, self._check_plan_tokens(token_ids, counts))

    def _plan_checked(self, ids: list, counts: list, tokens: list) -> AppendPlan:
        """plan_append once its arguments are checked: ``ids`` known, distinct plain ints,
        ``counts`` plain ints >= 0, ``tokens`` as _check_plan_tokens gives them (vkattn.paged's
        next step of the same sequences comes here directly). CacheFullError where the blocks do
        not fit; nothing changes."""
        bs, lengths, known = self._block_size, self._lengths, self._tables
        need = [(lengths[s] + n + bs - 1) // bs - len(known[s]) for s, n in zip(ids, counts)]
        total = sum(need)
        if total and total > self.free_blocks:
            short = ", ".join(f"{s}: {k}" for s, k in zip(ids, need) if k)
            raise CacheFullError(
                f"plan_append: the batch needs {total} new blocks, {self._describe_free()}; "
                f"new blocks per sequence {{{short}}}")
        if total:
            picks = self._picks(total)  # the order _take() would hand them out
            tables, new_blocks, at = [], [], 0
            for s, k in zip(ids, need):
                new_blocks.append(picks[at:at + k])
                tables.append(known[s] + picks[at:at + k])
                at += k
        else:
            new_blocks = [[] for _ in ids]
            tables = [known[s][:] for s in ids]
        return AppendPlan._of(ids, [lengths[s] for s in ids], counts, tables, new_blocks, tokens, self)

    def _check_plan_tokens(self, token_ids, counts) -> list:
        if token_ids is None:
            return [None] * len(counts)
        if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
            raise TypeError(f"token_ids: expected None or one entry per sequence, got {type(token_ids).__name__}")
        if len(token_ids) != len(counts):
            raise ValueError(f"token_ids: expected {len(counts)} entries (one per entry of seq_ids), got {len(token_ids)}")
        if set(map(type, token_ids)) == _LIST and list(map(len, token_ids)) == counts:
            if _plain_ids(list(chain.from_iterable(token_ids))):     # the common call: lists of plain ints
                return list(map(list.copy, token_ids))
        return [None if t is None else check_token_ids(f"token_ids[{i}]", t, n)
                for i, (t, n) in enumerate(zip(token_ids, counts))]

    def _apply_append(self, plan: AppendPlan) -> None:
        self._advance(plan.seq_ids, plan.n_new, [(s, b) for s, blocks in zip(plan.seq_ids, plan.new_blocks)
                                                 for b in blocks], plan.token_ids, plan.past)

    def _advance(self, ids: list, counts, grown, tokens, past: list) -> None:
        """Append ``counts[i]`` tokens (None: one each) to ``ids[i]`` (known, distinct) as a
        checked plan says: ``grown`` the (seq_id, block) pairs of the blocks it takes, in batch
        order (_picks' order); ``tokens`` None, or per sequence None or its new tokens' ids (with
        ``counts`` None: one plain id each, as vkattn.paged's _one_id_each gives them), learnt
        where the sequence knew the ids of all its ``past[i]`` positions (its length before).
        Every block is claimed first (a hash evicted here may be registered below); a new
        version. _apply_append's, and vkattn.paged's steady decode step's (no AppendPlan)."""
        free, cached, refs = self._free, self._cached, self._refs
        for _, block in grown:              # each planned block taken (free, or cached: evicted now), inline:
            if block in cached:             # a method call a block was half the loop's time (B=16, a block
                self._evict(block)          # each: 2.5 of 5 us)
            if block not in free:
                raise AssertionError(f"AppendPlan.commit: planned block {block} is not free")
            del free[block]
            refs[block] = 1
        tables = self._tables
        for s, block in grown:
            tables[s].append(block)
        lengths = self._lengths
        if counts is None:                  # a decode step
            for s in ids:
                lengths[s] += 1
        else:
            for s, n in zip(ids, counts):
                lengths[s] += n
        if tokens is not None:
            known = self._tokens
            if counts is None:              # one id each: a block is full where its last position came
                bs = self._block_size
                for s, t, p in zip(ids, tokens, past):
                    ts = known[s]
                    if len(ts) == p:
                        ts.append(t)
                        if not (p + 1) % bs:
                            self._register_full(s)
            else:
                for s, t, p in zip(ids, tokens, past):
                    if t is not None and len(known[s]) == p:
                        self._learn(s, t)
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
        for d in (self._lengths, self._tokens, self._hashes, self._roots):
            if set(d) != set(self._tables):
                raise AssertionError("the per-sequence records hold different sequence ids")
        for b in range(self._num_blocks):
            if self._refs[b] != counted[b]:
                raise AssertionError(f"block {b}: refcount {self._refs[b]}, referenced {counted[b]} times")
        free, cached = set(self._free), set(self._cached)
        if free & cached:
            raise AssertionError(f"blocks {sorted(free & cached)} are both free and cached")
        unused = {b for b in range(self._num_blocks) if counted[b] == 0}
        if free | cached != unused:
            raise AssertionError(
                f"free list {sorted(free)} and cached blocks {sorted(cached)} differ from the "
                f"unreferenced blocks {sorted(unused)}")
        if not cached <= set(self._hash_of):
            raise AssertionError(f"cached blocks {sorted(cached - set(self._hash_of))} are not registered")
        if free & set(self._hash_of):
            raise AssertionError(f"free blocks {sorted(free & set(self._hash_of))} are registered")
        if len(self._index) != len(self._hash_of) or any(self._index.get(h) != b for b, h in self._hash_of.items()):
            raise AssertionError("the prefix-cache index and the blocks' hashes disagree")
        for s, table in self._tables.items():
            tokens, hashes = self._tokens[s], self._hashes[s]
            if len(tokens) > self._lengths[s]:
                raise AssertionError(f"sequence {s}: {len(tokens)} token ids for length {self._lengths[s]}")
            if len(hashes) != len(tokens) // bs:
                raise AssertionError(f"sequence {s}: {len(hashes)} block hashes for {len(tokens)} token ids")
            parent = self._roots[s]
            for i, h in enumerate(hashes):
                if h != block_hash(parent, tokens[i * bs:(i + 1) * bs]):
                    raise AssertionError(f"sequence {s}: block {i}'s hash is not that of its token ids")
                parent = h
            # a registered block a sequence holds: full, and under the hash its token ids give (a
            # fork that does not know them may share a block another holder registered)
            for i, b in enumerate(table):
                if b in self._hash_of and (i >= self._lengths[s] // bs
                                           or (i < len(hashes) and self._hash_of[b] != hashes[i])):
                    raise AssertionError(
                        f"sequence {s}: block {b} at index {i} is registered but partial or under a hash its "
                        f"token ids do not give")
            if self._lengths[s] % bs and self._refs[table[-1]] != 1:
                raise AssertionError(
                    f"sequence {s}: its partial tail block {table[-1]} is shared "
                    f"(refcount {self._refs[table[-1]]})")


def _as_list(name: str, values) -> list:
    if type(values) is list or type(values) is tuple:       # the common call
        return list(values)
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or not hasattr(values, "__iter__"):
        raise TypeError(f"{name}: expected a sequence of ints, got {type(values).__name__}")
    if isinstance(values, np.ndarray) and values.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got an array of shape {values.shape}")
    return list(values)
