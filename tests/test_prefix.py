"""Prefix caching in BlockPool (no device needed): a hypothesis state machine over
add / append / fork / truncate / remove / evict / set_token_ids / a failed append, run on a pool and
on a plain-python model of it side by side, plus focused cases.

The model keeps blocks as python objects and keys cached blocks by ``(salt, full token prefix)``
-- no hashes, no block ids, no free list order -- and predicts: each sequence's length after a
prefix match, which blocks sequences share, which cached block an allocation evicts (least
recently released first), when the pool is out of blocks (only when nothing is cached), and what
``match_prefix`` reports. A fake device (one int per slot) holds, at every position, a value
determined by the salt and the sequence's token ids up to that position -- what K/V are for a
real model -- written between plan and commit as a forward writes it. Every sequence read back
through its slots, and every cached block, must hold exactly the values its tokens give: a reused
block with other contents, a cached block overwritten while still registered, or a write into a
shared block shows up as a mismatch.
"""
import hashlib

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from vkattn.errors import CacheFullError
from vkattn.paging import BlockPool, block_hash, root_hash

SALTS = [None, "x", b"x"]


def value(salt, prefix):
    """The fake K/V of the last position of ``prefix`` (token ids) under ``salt``."""
    h = hashlib.blake2b(repr((salt, tuple(prefix))).encode(), digest_size=7).digest()
    return int.from_bytes(h, "little")


def ceil_div(a, b):
    return -(-a // b)


class MBlock:
    """A model block: its cache key (salt, token prefix) when registered, and the real block id
    it stands for once the pool has shown it."""

    def __init__(self):
        self.key = None
        self.real = None


class MSeq:
    def __init__(self, salt):
        self.salt = salt
        self.truth = []     # token id of every position (the pool may know only the first `known`)
        self.known = 0
        self.table = []


class Model:
    """The prefix-cache policy stated without hashes or block ids."""

    def __init__(self, num_blocks, bs):
        self.bs = bs
        self.n_free = num_blocks    # blocks neither held nor cached
        self.seqs = {}
        self.index = {}             # key -> MBlock
        self.lru = []               # unheld registered MBlocks, least recently released first
        self.refs = {}              # MBlock -> holders

    def key(self, seq, i):
        return (seq.salt, tuple(seq.truth[:(i + 1) * self.bs]))

    @property
    def available(self):
        return self.n_free + len(self.lru)

    def take(self):
        blk = MBlock()
        if self.n_free:
            self.n_free -= 1
        else:                       # evict the least recently released cached block, reuse it
            victim = self.lru.pop(0)
            del self.index[victim.key]
            blk.real = victim.real
        self.refs[blk] = 1
        return blk

    def hold(self, blk):
        if self.refs.get(blk, 0) == 0:
            self.lru.remove(blk)
        self.refs[blk] = self.refs.get(blk, 0) + 1

    def release(self, blk):
        self.refs[blk] -= 1
        if self.refs[blk] == 0:
            del self.refs[blk]
            if blk.key is not None:
                self.lru.append(blk)
            else:
                self.n_free += 1

    def evict_lru(self, n):
        victims, self.lru = self.lru[:n], self.lru[n:]
        for v in victims:
            del self.index[v.key]
            v.key = None
            self.n_free += 1
        return victims

    def learn(self, seq, known):
        for i in range(seq.known // self.bs, known // self.bs):
            key, blk = self.key(seq, i), seq.table[i]
            if blk.key is None and key not in self.index:
                blk.key = key
                self.index[key] = blk
        seq.known = known

    def match(self, tokens, salt):
        blocks = []
        for i in range(max(0, (len(tokens) - 1) // self.bs)):
            blk = self.index.get((salt, tuple(tokens[:(i + 1) * self.bs])))
            if blk is None:
                break
            blocks.append(blk)
        return blocks


class Harness:
    def __init__(self, num_blocks, bs):
        self.pool = BlockPool(num_blocks, bs)
        self.m = Model(num_blocks, bs)
        self.bs = bs
        self.device = np.full(num_blocks * bs, -1, np.int64)
        self.counts = dict(match=0, evicted_by_alloc=0, full=0, unregister_tail=0, cow=0, learned=0,
                           failed_append=0)

    # -- checks

    def verify(self):
        pool, m = self.pool, self.m
        pool.check()
        assert pool.sequences == sorted(m.seqs)
        assert pool.cached_blocks == len(m.lru)
        assert pool.free_blocks == m.available
        live = {}
        for sid, seq in m.seqs.items():
            table = pool.block_table(sid)
            assert pool.length(sid) == len(seq.truth)
            assert pool.token_ids(sid) == seq.truth[:seq.known]
            assert len(table) == len(seq.table)
            for blk, real in zip(seq.table, table):
                if blk.real is None:
                    blk.real = real
                assert blk.real == real, "the pool shares (or evicts) other blocks than the model"
                assert live.setdefault(real, blk) is blk, f"real block {real} stands for two model blocks"
            want = [value(seq.salt, seq.truth[:p + 1]) for p in range(len(seq.truth))]
            got = self.device[pool.slots(sid, 0, len(seq.truth))].tolist()
            assert got == want, f"sequence {sid} reads back other values than its tokens give"
        # the eviction order, and every cached block still holds what its key says
        assert list(pool._cached) == [blk.real for blk in m.lru]
        for blk in m.lru:
            salt, prefix = blk.key
            rows = self.device[blk.real * self.bs:(blk.real + 1) * self.bs].tolist()
            assert rows == [value(salt, prefix[:len(prefix) - self.bs + r + 1]) for r in range(self.bs)]

    def write(self, slots, salt, truth, start):
        self.device[slots] = [value(salt, truth[:p + 1]) for p in range(start, start + len(slots))]

    def copy(self, copy):
        src, dst, rows = copy
        self.device[dst * self.bs:dst * self.bs + rows] = self.device[src * self.bs:src * self.bs + rows]
        self.device[dst * self.bs + rows:(dst + 1) * self.bs] = -2

    def state(self):
        p = self.pool
        return (p.free_blocks, p.cached_blocks, list(p._cached), p.sequences,
                {s: (p.length(s), p.block_table(s), p.token_ids(s)) for s in p.sequences})

    # -- operations

    def add(self, tokens, salt):
        m = self.m
        predicted = len(m.match(tokens, salt)) * self.bs if tokens is not None else 0
        if tokens is not None:
            before = self.state()
            assert self.pool.match_prefix(tokens, salt=salt) == predicted
            assert self.state() == before, "match_prefix changed the pool"
        sid = self.pool.add(token_ids=tokens, salt=salt)
        seq = MSeq(salt)
        if tokens is not None:
            for blk in m.match(tokens, salt):
                m.hold(blk)
                seq.table.append(blk)
            seq.truth = list(tokens[:predicted])
            seq.known = predicted
        m.seqs[sid] = seq
        assert self.pool.length(sid) == predicted
        self.counts["match"] += predicted > 0
        return sid

    def append(self, batch, fail=False, evict_first=True):
        """batch: [(sid, new token ids, give the ids?)]; ``fail``: plan, write, never commit."""
        m, pool = self.m, self.pool
        need = [ceil_div(len(m.seqs[s].truth) + len(t), self.bs) - len(m.seqs[s].table) for s, t, _ in batch]
        ids = [s for s, _, _ in batch]
        ns = [len(t) for _, t, _ in batch]
        token_ids = [list(t) if give else None for _, t, give in batch]
        before = self.state()
        if sum(need) > m.available:
            with pytest.raises(CacheFullError, match=f"needs {sum(need)} new blocks, {m.available} free"):
                pool.plan_append(ids, ns, token_ids=token_ids)
            assert self.state() == before
            self.counts["full"] += 1
            return
        plan = pool.plan_append(ids, ns, token_ids=token_ids)
        assert self.state() == before
        from_lru = max(0, sum(need) - m.n_free)
        if fail:
            # a forward that fails after writing: cached blocks it was to overwrite are evicted first
            assert plan.evict_cached() == from_lru
            m.evict_lru(from_lru)
            for i, (s, t, _) in enumerate(batch):
                self.write(plan.slots(i), m.seqs[s].salt, m.seqs[s].truth + list(t), len(m.seqs[s].truth))
            self.counts["failed_append"] += 1
            return
        taken = [[m.take() for _ in range(k)] for k in need]   # all blocks first, as commit claims them
        predicted_lru = [blk.real for blks in taken for blk in blks if blk.real is not None]
        flat = [b for blks in plan.new_blocks for b in blks]
        assert flat[len(flat) - from_lru:] == predicted_lru, "the pool evicts other blocks than the LRU ones"
        self.counts["evicted_by_alloc"] += from_lru
        if evict_first:
            plan.evict_cached()
        for i, (s, t, _) in enumerate(batch):
            seq = m.seqs[s]
            self.write(plan.slots(i), seq.salt, seq.truth + list(t), len(seq.truth))
        plan.commit()
        for (s, t, give), blks in zip(batch, taken):
            seq = m.seqs[s]
            past = len(seq.truth)
            seq.table += blks
            seq.truth += list(t)
            if give and seq.known == past:
                m.learn(seq, len(seq.truth))

    def fork(self, src):
        m, seq = self.m, self.m.seqs[src]
        rows = len(seq.truth) % self.bs
        before = self.state()
        if rows and m.available == 0:
            with pytest.raises(CacheFullError, match="1 block needed, 0 free"):
                self.pool.fork(src)
            assert self.state() == before
            return None
        new, copy = self.pool.fork(src)
        f = MSeq(seq.salt)
        f.truth, f.known = list(seq.truth), seq.known
        full = len(seq.truth) // self.bs
        for blk in seq.table[:full]:
            m.refs[blk] += 1
        f.table = list(seq.table[:full])
        if rows:
            f.table.append(m.take())
            self.copy(copy)
        else:
            assert copy is None
        m.seqs[new] = f
        return new

    def truncate(self, sid, length):
        m, seq = self.m, self.m.seqs[sid]
        keep, rows = ceil_div(length, self.bs), length % self.bs
        dropped = seq.table[keep:]
        needs_copy = bool(rows) and m.refs[seq.table[keep - 1]] > 1
        released = sum(1 for b in dropped if m.refs[b] == 1)
        before = self.state()
        if needs_copy and m.available == 0 and released == 0:
            with pytest.raises(CacheFullError, match="1 block needed, 0 free"):
                self.pool.truncate(sid, length)
            assert self.state() == before
            return
        copy = self.pool.truncate(sid, length)
        for blk in reversed(dropped):
            m.release(blk)
        del seq.table[keep:]
        if needs_copy:
            m.refs[seq.table[-1]] -= 1
            seq.table[-1] = m.take()
            self.copy(copy)
            self.counts["cow"] += 1
        else:
            assert copy is None
            if rows and seq.table[-1].key is not None:
                del m.index[seq.table[-1].key]
                seq.table[-1].key = None
                self.counts["unregister_tail"] += 1
        del seq.truth[length:]
        seq.known = min(seq.known, length)

    def remove(self, sid):
        self.pool.remove(sid)
        for blk in reversed(self.m.seqs.pop(sid).table):
            self.m.release(blk)

    def evict(self, n):
        assert self.pool.evict(n) == len(self.m.evict_lru(n))

    def set_token_ids(self, sid, k, corrupt):
        seq = self.m.seqs[sid]
        ids = list(seq.truth[:k])
        if corrupt and seq.known:
            at = min(seq.known, k) - 1
            if at >= 0:
                ids[at] += 1
                before = self.state()
                with pytest.raises(ValueError, match=f"token_ids\\[{at}\\]: sequence {sid} holds token id"):
                    self.pool.set_token_ids(sid, ids)
                assert self.state() == before
                return
        self.pool.set_token_ids(sid, ids)
        if k > seq.known:
            self.m.learn(seq, k)
            self.counts["learned"] += 1


# ---------------------------------------------------------------------------------------------
# the state machine


tokens_st = st.lists(st.integers(0, 2), max_size=9)


class PrefixMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 12), bs=st.sampled_from([1, 2, 3, 4]))
    def setup(self, num_blocks, bs):
        self.h = Harness(num_blocks, bs)

    def ids(self):
        return sorted(self.h.m.seqs)

    @precondition(lambda self: len(self.h.m.seqs) < 6)
    @rule(data=st.data(), salt=st.sampled_from(SALTS), tail=tokens_st, give=st.booleans())
    def add(self, data, salt, tail, give):
        """A prompt that often shares a prefix with a live sequence or a cached block."""
        h = self.h
        sources = [s.truth for s in h.m.seqs.values()] + [list(b.key[1]) for b in h.m.lru]
        head = []
        if sources:
            src = data.draw(st.sampled_from(sources))
            head = src[:data.draw(st.integers(0, len(src)))]
        tokens = head + tail
        h.add(tokens if give and tokens else None, salt)

    @precondition(lambda self: self.h.m.seqs)
    @rule(data=st.data(), fail=st.booleans(), evict_first=st.booleans())
    def append(self, data, fail, evict_first):
        ids = data.draw(st.lists(st.sampled_from(self.ids()), min_size=1, max_size=3, unique=True))
        batch = [(s, data.draw(st.lists(st.integers(0, 2), max_size=2 * self.h.bs + 1)), data.draw(st.booleans()))
                 for s in ids]
        self.h.append(batch, fail=fail and data.draw(st.booleans()), evict_first=evict_first)

    @precondition(lambda self: self.h.m.seqs and len(self.h.m.seqs) < 6)
    @rule(data=st.data())
    def fork(self, data):
        self.h.fork(data.draw(st.sampled_from(self.ids())))

    @precondition(lambda self: self.h.m.seqs)
    @rule(data=st.data())
    def truncate(self, data):
        s = data.draw(st.sampled_from(self.ids()))
        self.h.truncate(s, data.draw(st.integers(0, len(self.h.m.seqs[s].truth))))

    @precondition(lambda self: self.h.m.seqs)
    @rule(data=st.data())
    def remove(self, data):
        self.h.remove(data.draw(st.sampled_from(self.ids())))

    @rule(n=st.integers(0, 3))
    def evict(self, n):
        self.h.evict(n)

    @precondition(lambda self: self.h.m.seqs)
    @rule(data=st.data(), corrupt=st.booleans())
    def set_token_ids(self, data, corrupt):
        s = data.draw(st.sampled_from(self.ids()))
        self.h.set_token_ids(s, data.draw(st.integers(0, len(self.h.m.seqs[s].truth))), corrupt)

    @invariant()
    def consistent(self):
        if hasattr(self, "h"):
            self.h.verify()


PrefixMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
TestPrefixMachine = PrefixMachine.TestCase


def test_machine_reaches_every_branch():
    """The harness's branches are reachable in a plain seeded loop (the machine explores more)."""
    rng = np.random.default_rng(5)
    totals = dict.fromkeys(Harness(1, 1).counts, 0)
    for trial in range(40):
        h = Harness(int(rng.integers(3, 10)), int(rng.integers(1, 4)))
        for _ in range(150):
            ids = sorted(h.m.seqs)
            op = rng.choice(["add", "append", "append", "fork", "truncate", "remove", "evict", "learn"]) if ids else "add"
            if op == "add" and len(ids) < 6:
                src = [s.truth for s in h.m.seqs.values()] + [list(b.key[1]) for b in h.m.lru]
                head = list(src[int(rng.integers(len(src)))]) if src else []
                tokens = head[:int(rng.integers(0, len(head) + 1))] + rng.integers(0, 2, int(rng.integers(1, 5))).tolist()
                h.add(tokens, SALTS[int(rng.integers(3))] if rng.random() < 0.2 else None)
            elif op == "append" and ids:
                batch = [(s, rng.integers(0, 2, int(rng.integers(0, 2 * h.bs + 2))).tolist(), rng.random() < 0.8)
                         for s in rng.choice(ids, size=min(len(ids), 2), replace=False).tolist()]
                h.append(batch, fail=rng.random() < 0.1)
            elif op == "fork" and ids and len(ids) < 6:
                h.fork(int(rng.choice(ids)))
            elif op == "truncate" and ids:
                s = int(rng.choice(ids))
                h.truncate(s, int(rng.integers(0, len(h.m.seqs[s].truth) + 1)))
            elif op == "remove" and ids:
                h.remove(int(rng.choice(ids)))
            elif op == "evict":
                h.evict(int(rng.integers(0, 2)))
            elif op == "learn" and ids:
                s = int(rng.choice(ids))
                h.set_token_ids(s, len(h.m.seqs[s].truth), rng.random() < 0.3)
            h.verify()
        for k, v in h.counts.items():
            totals[k] += v
    assert all(v > 0 for v in totals.values()), totals


# ---------------------------------------------------------------------------------------------
# focused cases


def filled(pool, tokens, salt=None):
    """A sequence holding ``tokens`` (a cached prefix reused, the rest appended with their ids)."""
    s = pool.add(token_ids=tokens, salt=salt)
    n = pool.length(s)
    pool.plan_append([s], [len(tokens) - n], token_ids=[tokens[n:]]).commit()
    pool.check()
    return s


def test_hash_chain_is_stable_and_documented():
    # sha256 over the domain tag, the salt and little-endian int64 ids: stable across processes
    root = root_hash(None)
    assert root == hashlib.sha256(b"vkattn prefix v1" + (1).to_bytes(8, "little") + b"-").digest()
    h0 = block_hash(root, [1, 2])
    assert h0 == hashlib.sha256(root + np.array([1, 2], "<i8").tobytes()).digest()
    big = [2**63 - 1, 0, 2**32, 255]
    assert block_hash(h0, big) == hashlib.sha256(h0 + np.array(big, "<i8").tobytes()).digest()
    assert len({root_hash(None), root_hash(""), root_hash(b""), root_hash("x"), root_hash(b"x")}) == 5
    pool = BlockPool(4, 2)
    s = filled(pool, [1, 2, 3, 4, 5])
    assert pool._hashes[s] == [h0, block_hash(h0, [3, 4])]
    with pytest.raises(TypeError, match="salt: expected None, a str or bytes, got int"):
        root_hash(3)


def test_match_reuses_blocks_and_reports_cached_tokens():
    pool = BlockPool(10, 4)
    a = filled(pool, list(range(10)))                 # blocks 0, 1 full and registered; 2 partial
    assert pool.registered_blocks == 2
    assert pool.match_prefix(list(range(10))) == 8
    assert pool.match_prefix(list(range(9))) == 8
    assert pool.match_prefix(list(range(8))) == 4     # at most len - 1 tokens: one is left to compute
    assert pool.match_prefix(list(range(4)) + [9, 9, 9, 9, 9]) == 4
    assert pool.match_prefix([1] + list(range(1, 10))) == 0
    assert pool.match_prefix(list(range(10)), salt="other") == 0
    b = pool.add(token_ids=list(range(9)) + [7, 7])
    assert pool.length(b) == 8 and pool.block_table(b) == pool.block_table(a)[:2]
    assert pool.token_ids(b) == list(range(8))
    assert pool.free_blocks == 7                      # nothing allocated for the match
    pool.check()


def test_fully_cached_prompt_leaves_its_last_block_to_compute():
    pool = BlockPool(6, 4)
    filled(pool, list(range(8)))
    assert pool.match_prefix(list(range(8))) == 4     # 8 cached, but the caller needs logits of token 7
    s = pool.add(token_ids=list(range(8)))
    assert pool.length(s) == 4
    pool.plan_append([s], [4], token_ids=[list(range(4, 8))]).commit()
    # its own copy of block 1 has the same hash: the first registered block keeps it
    assert pool.registered_blocks == 2 and pool.block_table(s)[1] not in pool._hash_of
    pool.check()


def test_blocks_stay_cached_after_remove_and_are_evicted_lru():
    pool = BlockPool(6, 2)
    a = filled(pool, [1, 1, 1, 1, 9])                 # blocks 0, 1 registered, 2 partial
    b = filled(pool, [2, 2, 2, 2, 9])                 # 3, 4 registered, 5 partial
    pool.remove(a)                                    # released 2, 1, 0: 1 and 0 stay cached
    pool.remove(b)                                    # then 4, 3
    assert pool.cached_blocks == 4 and pool.free_blocks == 6
    assert list(pool._cached) == [1, 0, 4, 3]         # last blocks of a sequence go first
    c = pool.add()
    plan = pool.plan_append([c], [7])                 # 4 blocks: free 2 and 5, then evict 1 and 0
    assert plan.new_blocks == [[5, 2, 1, 0]]
    plan.commit()
    assert pool.cached_blocks == 2 and pool.match_prefix([1, 1, 1]) == 0
    assert pool.match_prefix([2, 2, 2, 2, 2]) == 4   # b's blocks survived
    pool.check()


def test_a_match_protects_blocks_from_eviction_and_refreshes_them():
    pool = BlockPool(4, 2)
    pool.remove(filled(pool, [1, 1, 5]))              # block 0 cached
    pool.remove(filled(pool, [2, 2, 5]))              # block 1 (freed by the first) cached, after 0
    assert list(pool._cached) == [0, 1]
    s = pool.add(token_ids=[1, 1, 7])                 # holds block 0 again
    assert pool.block_table(s) == [0] and list(pool._cached) == [1]
    pool.remove(s)                                    # released last: now the most recent
    assert list(pool._cached) == [1, 0]
    t = pool.add()
    new = pool.plan_append([t], [8]).new_blocks[0]
    assert sorted(new[:2]) == [2, 3] and new[2:] == [1, 0]          # free ones first, then LRU
    pool.check()


def test_out_of_blocks_only_when_nothing_is_cached():
    pool = BlockPool(3, 2)
    s = pool.add()
    pool.plan_append([s], [6], token_ids=[[1, 1, 2, 2, 3, 3]]).commit()
    pool.remove(s)
    assert pool.cached_blocks == 3 and pool.free_blocks == 3
    t = pool.add()
    plan = pool.plan_append([t], [6])                 # evicts all three rather than refusing
    assert plan.new_blocks == [[2, 1, 0]]
    plan.commit()
    assert pool.cached_blocks == 0 and pool.registered_blocks == 0
    u = pool.add()
    with pytest.raises(CacheFullError, match="needs 1 new blocks, 0 free \\(of 3\\)"):
        pool.plan_append([u], [1])
    pool.remove(t)                                    # not registered (no token ids): plain free
    assert pool.cached_blocks == 0 and pool.free_blocks == 3
    pool.check()


def test_evict_cached_keeps_the_plan_and_refuses_a_stale_one():
    pool = BlockPool(3, 2)
    s = filled(pool, [1, 1, 2, 2, 3])             # blocks 0, 1 registered
    pool.remove(s)                                # 1, 0 cached; 2 free
    t = pool.add()
    plan = pool.plan_append([t], [6], token_ids=[[1, 1, 2, 2, 4, 4]])
    assert plan.new_blocks == [[2, 1, 0]]
    assert plan.evict_cached() == 2 and pool.cached_blocks == 0 and pool.free_blocks == 3
    assert plan.evict_cached() == 0               # nothing left to evict; the plan is still valid
    plan.commit()
    assert pool.block_table(t) == [2, 1, 0] and pool.registered_blocks == 3
    stale = pool.plan_append([t], [0])
    pool.add()
    with pytest.raises(RuntimeError, match="evict_cached: stale plan"):
        stale.evict_cached()
    pool.check()


def test_cache_full_message_names_cached_blocks():
    pool = BlockPool(3, 2)
    s = pool.add()
    pool.plan_append([s], [6], token_ids=[[1, 1, 2, 2, 3, 3]]).commit()
    pool.truncate(s, 2)                               # blocks 2 and 1 cached
    t = pool.add()
    with pytest.raises(CacheFullError, match="needs 3 new blocks, 2 free \\(of 3, 2 of them cached\\)"):
        pool.plan_append([t], [5])
    pool.check()


def test_truncate_into_a_registered_block():
    pool = BlockPool(6, 4)
    a = filled(pool, list(range(9)))                  # blocks 0, 1 registered
    assert pool.truncate(a, 6) is None                # a alone holds block 1: unregistered in place
    assert pool.registered_blocks == 1 and pool.match_prefix(list(range(9))) == 4
    assert pool.token_ids(a) == list(range(6))
    pool.plan_append([a], [2], token_ids=[[50, 51]]).commit()   # block 1 now holds other tokens
    assert pool.match_prefix(list(range(6)) + [50, 51, 0]) == 8
    b = pool.add(token_ids=list(range(6)) + [50, 51, 0])
    assert pool.block_table(b) == pool.block_table(a)
    copy = pool.truncate(b, 5)                        # shared with a: copied, a's block stays registered
    assert copy == (pool.block_table(a)[1], pool.block_table(b)[1], 1)
    assert pool.registered_blocks == 2
    pool.check()


def test_appends_without_ids_stop_caching_until_told():
    pool = BlockPool(8, 2)
    s = pool.add()
    pool.plan_append([s], [2], token_ids=[[4, 4]]).commit()
    pool.plan_append([s], [2]).commit()               # ids unknown from position 2 on
    pool.plan_append([s], [2], token_ids=[[6, 6]]).commit()    # ignored: position 2, 3 unknown
    assert pool.token_ids(s) == [4, 4] and pool.registered_blocks == 1
    pool.set_token_ids(s, [4, 4, 5, 5, 6, 6])
    assert pool.token_ids(s) == [4, 4, 5, 5, 6, 6] and pool.registered_blocks == 3
    assert pool.match_prefix([4, 4, 5, 5, 6, 6, 0]) == 6
    pool.check()


@pytest.mark.parametrize("call,exc,msg", [
    (lambda p: p.add(token_ids="abc"), TypeError, "token_ids: expected a 1-D sequence of token ids"),
    (lambda p: p.add(token_ids=[[1, 2]]), ValueError, "token_ids: expected a 1-D sequence of token ids, got shape"),
    (lambda p: p.add(token_ids=[1.0, 2.0]), TypeError, "token_ids: expected integer token ids, got dtype float64"),
    (lambda p: p.add(token_ids=[1, -2]), ValueError, "token_ids: expected token ids in \\[0, 2\\*\\*63\\)"),
    (lambda p: p.add(token_ids=[1], salt=2), TypeError, "salt: expected None, a str or bytes, got int"),
    (lambda p: p.add(0, token_ids=[1]), ValueError, "seq_id: expected an unused sequence id"),
    (lambda p: p.match_prefix(5), TypeError, "token_ids: expected a 1-D sequence"),
    (lambda p: p.plan_append([0], [2], token_ids=[[1]]), ValueError, "token_ids\\[0\\]: expected 2 token ids, got 1"),
    (lambda p: p.plan_append([0], [2], token_ids=[1, 2]), ValueError, "token_ids: expected 1 entries"),
    (lambda p: p.plan_append([0], [1], token_ids=[1]), TypeError, "token_ids\\[0\\]: expected a 1-D sequence"),
    (lambda p: p.plan_append([0], [1], token_ids=5), TypeError, "token_ids: expected None or one entry"),
    (lambda p: p.set_token_ids(0, [1, 1, 1, 1, 1]), ValueError, "token_ids: sequence 0 holds 3 positions, got 5"),
    (lambda p: p.set_token_ids(0, [1, 2]), ValueError, "token_ids\\[1\\]: sequence 0 holds token id 1 at position 1, got 2"),
    (lambda p: p.set_token_ids(7, [1]), KeyError, "unknown sequence id 7"),
    (lambda p: p.evict(-1), ValueError, "n: expected an int >= 0"),
])
def test_rejects_and_changes_nothing(call, exc, msg):
    pool = BlockPool(4, 2)
    filled(pool, [1, 1, 1])
    pool.remove(filled(pool, [3, 3, 3]))
    before = (pool.free_blocks, pool.cached_blocks, list(pool._cached), pool.sequences, pool.token_ids(0),
              pool.block_table(0), pool.registered_blocks)
    with pytest.raises(exc, match=msg):
        call(pool)
    assert before == (pool.free_blocks, pool.cached_blocks, list(pool._cached), pool.sequences, pool.token_ids(0),
                      pool.block_table(0), pool.registered_blocks)
    pool.check()


def test_check_detects_prefix_corruption():
    def fresh():
        pool = BlockPool(6, 2)
        a = filled(pool, [1, 2, 3, 4, 5])     # blocks 0, 1 registered, 2 partial
        pool.remove(filled(pool, [7, 7, 7]))  # block 3 cached
        del a
        pool.check()
        return pool

    corruptions = [
        (lambda p: p._cached.pop(3), "differ from the unreferenced blocks"),
        (lambda p: p._index.pop(p._hash_of[0]), "index and the blocks' hashes disagree"),
        (lambda p: p._hash_of.__setitem__(0, p._hash_of[1]), "index and the blocks' hashes disagree"),
        (lambda p: p._tokens[0].__setitem__(0, 9), "block 0's hash is not that of its token ids"),
        (lambda p: p._tokens[0].append(6), "6 token ids for length 5"),
        (lambda p: p._hashes[0].__setitem__(1, p._hashes[0][0]), "block 1's hash is not that of its token ids"),
    ]
    for corrupt, msg in corruptions:
        pool = fresh()
        corrupt(pool)
        with pytest.raises(AssertionError, match=msg):
            pool.check()
    # a registered partial tail: it would be written again
    pool = fresh()
    h = b"\0" * 32
    pool._hash_of[2], pool._index[h] = h, 2
    with pytest.raises(AssertionError, match="block 2 at index 2 is registered but partial"):
        pool.check()
