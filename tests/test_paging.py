"""Host bookkeeping of the paged KV cache: BlockPool, AppendPlan (no device needed)."""
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from vkattn.errors import CacheFullError
from vkattn.paging import AppendPlan, BlockPool, UnknownSequenceError


def ceil_div(a, b):
    return -(-a // b)


def state(pool):
    """Everything observable about a pool, to prove an error changed nothing."""
    return (pool.free_blocks, pool.sequences,
            {s: (pool.length(s), pool.block_table(s)) for s in pool.sequences})


def appended(pool, s, n):
    """Append n tokens to sequence s via a one-entry plan, return the plan."""
    plan = pool.plan_append([s], [n])
    plan.commit()
    pool.check()
    return plan


# ---------------------------------------------------------------------------------------------
# Harness: a pool, a plain-python model of every sequence, and a fake device array of slots.


class Harness:
    """Runs operations on a pool and a model side by side and checks they agree.

    The model is one python list of token values per sequence. ``device`` stands for the KV
    buffer: one int per slot. Appends write fresh token values at the slots the pool gives, fork
    and truncate perform the block copies the pool asks for; after every operation each sequence
    read back through its slots must equal its list. A write into a shared block, or a missing or
    wrong copy, shows up as a mismatch in some sequence.
    """

    def __init__(self, num_blocks, block_size):
        self.pool = BlockPool(num_blocks, block_size)
        self.bs = block_size
        self.model = {}
        self.device = np.full(num_blocks * block_size, -1, np.int64)
        self.next_token = 0
        self.counts = dict(add=0, remove=0, fork=0, fork_full=0, truncate=0, truncate_copy=0,
                           truncate_full=0, append=0, append_full=0)

    # -- observations derived only from the public API

    def refcount(self, block):
        return sum(self.pool.block_table(s).count(block) for s in self.pool.sequences)

    def used_blocks(self):
        return {b for s in self.pool.sequences for b in self.pool.block_table(s)}

    def verify(self):
        pool = self.pool
        pool.check()
        assert pool.sequences == sorted(self.model)
        assert pool.free_blocks + len(self.used_blocks()) == pool.num_blocks
        for s, tokens in self.model.items():
            assert pool.length(s) == len(tokens)
            assert len(pool.block_table(s)) == ceil_div(len(tokens), self.bs)
            got = self.device[pool.slots(s, 0, len(tokens))]
            assert got.tolist() == tokens, f"sequence {s}: read back {got.tolist()}, expected {tokens}"

    def copy_block(self, copy):
        src, dst, rows = copy
        assert 0 < rows < self.bs
        assert src != dst
        self.device[dst * self.bs:dst * self.bs + rows] = self.device[src * self.bs:src * self.bs + rows]
        # scribble over the rest of the fresh block: nothing may read it
        self.device[dst * self.bs + rows:(dst + 1) * self.bs] = -2

    # -- operations

    def add(self, seq_id=None):
        s = self.pool.add(seq_id)
        assert s not in self.model
        if seq_id is not None:
            assert s == seq_id
        else:
            assert s == min(set(range(len(self.model) + 1)) - set(self.model))
        self.model[s] = []
        self.counts["add"] += 1
        self.verify()
        return s

    def remove(self, s):
        freed = {b for b in self.pool.block_table(s) if self.refcount(b) == 1}
        before = self.pool.free_blocks
        self.pool.remove(s)
        del self.model[s]
        assert self.pool.free_blocks == before + len(freed)
        self.counts["remove"] += 1
        self.verify()

    def fork(self, src):
        length = len(self.model[src])
        rows = length % self.bs
        src_table = self.pool.block_table(src)
        before = state(self.pool)
        if rows and self.pool.free_blocks == 0:
            with pytest.raises(CacheFullError, match="1 block needed, 0 free"):
                self.pool.fork(src)
            assert state(self.pool) == before
            self.counts["fork_full"] += 1
            self.verify()
            return None
        new, copy = self.pool.fork(src)
        table = self.pool.block_table(new)
        assert table[:length // self.bs] == src_table[:length // self.bs]
        if rows:
            assert copy == (src_table[-1], table[-1], rows)
            assert table[-1] not in src_table
            self.copy_block(copy)
            assert self.pool.free_blocks == before[0] - 1
        else:
            assert copy is None and table == src_table
            assert self.pool.free_blocks == before[0]
        self.model[new] = list(self.model[src])
        self.counts["fork"] += 1
        self.verify()
        return new

    def truncate(self, s, length):
        table = self.pool.block_table(s)
        keep = ceil_div(length, self.bs)
        rows = length % self.bs
        shared_tail = rows and self.refcount(table[keep - 1]) > 1
        released = sum(1 for b in table[keep:] if self.refcount(b) == 1)
        before = state(self.pool)
        if shared_tail and self.pool.free_blocks + released == 0:
            with pytest.raises(CacheFullError, match="1 block needed, 0 free"):
                self.pool.truncate(s, length)
            assert state(self.pool) == before
            self.counts["truncate_full"] += 1
            self.verify()
            return
        copy = self.pool.truncate(s, length)
        new_table = self.pool.block_table(s)
        assert new_table[:keep - 1] == table[:keep - 1] if keep else new_table == []
        if shared_tail:
            assert copy == (table[keep - 1], new_table[-1], rows)
            self.copy_block(copy)
            self.counts["truncate_copy"] += 1
        else:
            assert copy is None and new_table == table[:keep]
        self.model[s] = self.model[s][:length]
        self.counts["truncate"] += 1
        self.verify()

    def append(self, ids, ns):
        pool = self.pool
        need = [ceil_div(len(self.model[s]) + n, self.bs) - ceil_div(len(self.model[s]), self.bs)
                for s, n in zip(ids, ns)]
        before = state(pool)
        if sum(need) > pool.free_blocks:
            with pytest.raises(CacheFullError) as info:
                pool.plan_append(ids, ns)
            assert f"needs {sum(need)} new blocks, {pool.free_blocks} free" in str(info.value)
            assert state(pool) == before
            self.counts["append_full"] += 1
            self.verify()
            return
        plan = pool.plan_append(ids, ns)
        assert state(pool) == before  # planning alone changes nothing
        assert plan.seq_ids == list(ids) and plan.n_new == list(ns)
        assert plan.past == [len(self.model[s]) for s in ids]
        assert [len(b) for b in plan.new_blocks] == need
        assert plan.total_new_blocks == sum(need)
        plan_slots = [plan.slots(i) for i in range(len(ids))]
        # slots of the other sequences' live positions: an append may touch none of them
        live = {s: set(self.device_slots(s)) for s in self.model}
        plan.commit()
        for i, (s, n) in enumerate(zip(ids, ns)):
            assert pool.block_table(s) == plan.tables[i]
            assert len(plan.tables[i]) == ceil_div(plan.past[i] + n, self.bs)
            slots = pool.slots(s, plan.past[i], plan.past[i] + n)
            assert np.array_equal(slots, plan_slots[i])
            for other, taken in live.items():
                assert not taken.intersection(slots.tolist()), f"append to {s} writes into {other}'s slots"
            tokens = list(range(self.next_token, self.next_token + n))
            self.next_token += n
            self.device[slots] = tokens
            self.model[s].extend(tokens)
        assert pool.free_blocks == before[0] - sum(need)
        with pytest.raises(RuntimeError, match="stale plan"):
            plan.commit()  # committing twice is a stale commit
        self.counts["append"] += 1
        self.verify()

    def device_slots(self, s):
        return self.pool.slots(s, 0, len(self.model[s])).tolist()


# ---------------------------------------------------------------------------------------------
# Random operations: hypothesis state machine and a long seeded loop.


class PoolMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 10), block_size=st.sampled_from([1, 2, 3, 4, 16]))
    def setup(self, num_blocks, block_size):
        self.h = Harness(num_blocks, block_size)

    @precondition(lambda self: len(self.h.model) < 6)
    @rule(explicit=st.booleans(), seq_id=st.integers(0, 12))
    def add(self, explicit, seq_id):
        if explicit:
            if seq_id in self.h.model:
                before = state(self.h.pool)
                with pytest.raises(ValueError, match="already in the pool"):
                    self.h.pool.add(seq_id)
                assert state(self.h.pool) == before
                return
            self.h.add(seq_id)
        else:
            self.h.add()

    @precondition(lambda self: self.h.model)
    @rule(data=st.data())
    def remove(self, data):
        self.h.remove(data.draw(st.sampled_from(sorted(self.h.model))))

    @precondition(lambda self: self.h.model)
    @rule(data=st.data())
    def fork(self, data):
        self.h.fork(data.draw(st.sampled_from(sorted(self.h.model))))

    @precondition(lambda self: self.h.model)
    @rule(data=st.data())
    def truncate(self, data):
        s = data.draw(st.sampled_from(sorted(self.h.model)))
        self.h.truncate(s, data.draw(st.integers(0, len(self.h.model[s]))))

    @precondition(lambda self: self.h.model)
    @rule(data=st.data(), source=st.booleans())
    def fork_then_truncate(self, data, source):
        """Speculative branches: fork, then roll one side back, often into a shared block."""
        s = data.draw(st.sampled_from(sorted(self.h.model)))
        f = self.h.fork(s)
        if f is not None:
            t = s if source else f
            self.h.truncate(t, data.draw(st.integers(0, len(self.h.model[t]))))

    @precondition(lambda self: self.h.model)
    @rule(data=st.data())
    def append(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.h.model)), min_size=1, unique=True))
        ns = data.draw(st.lists(st.integers(0, 2 * self.h.bs + 1), min_size=len(ids), max_size=len(ids)))
        self.h.append(ids, ns)

    @precondition(lambda self: self.h.model)
    @rule(data=st.data())
    def stale_plan(self, data):
        """A plan, then a change of the pool: the old plan cannot be committed."""
        s = data.draw(st.sampled_from(sorted(self.h.model)))
        try:
            plan = self.h.pool.plan_append([s], [1])
        except CacheFullError:
            return
        self.h.add()
        before = state(self.h.pool)
        with pytest.raises(RuntimeError, match="stale plan"):
            plan.commit()
        assert state(self.h.pool) == before
        self.h.verify()

    @invariant()
    def consistent(self):
        if hasattr(self, "h"):
            self.h.verify()


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestPoolMachine = PoolMachine.TestCase


@pytest.mark.parametrize("num_blocks,block_size", [(1, 1), (5, 1), (7, 3), (12, 16), (40, 4)])
def test_random_operations(num_blocks, block_size):
    rng = np.random.default_rng(1000 * num_blocks + block_size)
    h = Harness(num_blocks, block_size)
    for _ in range(1500):
        ops = ["add", "remove", "fork", "truncate", "append", "append", "append"]
        if h.pool.free_blocks == 0:
            ops += ["remove", "truncate"]  # a full pool mostly drains, but sometimes stays full
        op = rng.choice(ops) if h.model else "add"
        ids = sorted(h.model)
        if op == "add":
            if len(h.model) < 8:
                h.add()
        elif op == "remove":
            h.remove(int(rng.choice(ids)))
        elif op == "fork":
            if len(h.model) < 8:
                h.fork(int(rng.choice(ids)))
        elif op == "truncate":
            s = int(rng.choice(ids))
            n = len(h.model[s])
            # bias towards short rollbacks (speculative decoding) but cover all lengths
            length = max(0, n - int(rng.integers(0, 4))) if rng.random() < 0.7 else int(rng.integers(0, n + 1))
            h.truncate(s, length)
        else:
            k = int(rng.integers(1, len(ids) + 1))
            batch = [int(x) for x in rng.choice(ids, size=k, replace=False)]
            top = 2 * block_size + 2 if rng.random() < 0.3 else block_size + 1
            ns = [int(x) for x in rng.integers(0, top, size=k)]
            h.append(batch, ns)
    # every branch was exercised, the full-cache ones included
    for key in ("add", "remove", "fork", "truncate", "append", "append_full"):
        assert h.counts[key] > 0, (key, h.counts)
    if block_size > 1:
        assert h.counts["truncate_copy"] > 0, h.counts


# ---------------------------------------------------------------------------------------------
# Construction, ids, properties


@pytest.mark.parametrize("args,exc,msg", [
    ((0, 4), ValueError, "num_blocks: expected an int >= 1, got 0"),
    ((4, 0), ValueError, "block_size: expected an int >= 1, got 0"),
    ((-1, 4), ValueError, "num_blocks"),
    ((4.0, 4), TypeError, "num_blocks: expected an int, got float"),
    ((4, "16"), TypeError, "block_size: expected an int, got str"),
    ((True, 4), TypeError, "num_blocks: expected an int, got bool"),
])
def test_constructor_rejects(args, exc, msg):
    with pytest.raises(exc, match=msg):
        BlockPool(*args)


def test_fresh_pool():
    pool = BlockPool(np.int64(6), 4)
    assert (pool.num_blocks, pool.block_size, pool.free_blocks, pool.sequences) == (6, 4, 6, [])
    assert type(pool.num_blocks) is int
    assert len(pool) == 0 and 0 not in pool
    assert "num_blocks=6" in repr(pool)
    pool.check()


def test_add_ids():
    pool = BlockPool(4, 2)
    assert [pool.add() for _ in range(3)] == [0, 1, 2]
    assert pool.add(7) == 7
    pool.remove(1)
    assert pool.add() == 1  # smallest unused
    assert pool.add() == 3
    assert pool.add(np.int32(5)) == 5
    assert pool.sequences == [0, 1, 2, 3, 5, 7]
    assert all(pool.length(s) == 0 and pool.block_table(s) == [] for s in pool.sequences)
    assert pool.free_blocks == 4 and 5 in pool and 4 not in pool and len(pool) == 6
    pool.check()


@pytest.mark.parametrize("seq_id,exc,msg", [
    (-1, ValueError, "seq_id: expected an int >= 0, got -1"),
    (1.0, TypeError, "seq_id: expected an int, got float"),
    ("3", TypeError, "seq_id: expected an int, got str"),
    (True, TypeError, "seq_id: expected an int, got bool"),
    (2, ValueError, "seq_id: expected an unused sequence id, got 2"),
])
def test_add_rejects(seq_id, exc, msg):
    pool = BlockPool(4, 2)
    pool.add(2)
    before = state(pool)
    with pytest.raises(exc, match=msg):
        pool.add(seq_id)
    assert state(pool) == before
    pool.check()


def test_unknown_ids():
    pool = BlockPool(4, 2)
    pool.add(3)
    calls = [lambda: pool.remove(9), lambda: pool.length(9), lambda: pool.block_table(9),
             lambda: pool.fork(9), lambda: pool.truncate(9, 0), lambda: pool.slots(9, 0, 0),
             lambda: pool.plan_append([3, 9], [1, 1])]
    for call in calls:
        with pytest.raises(UnknownSequenceError) as info:
            call()
        assert isinstance(info.value, KeyError)
        assert "unknown sequence id 9" in str(info.value)
        assert "ids [3]" in str(info.value)
        assert not str(info.value).startswith("'")  # readable, not KeyError's repr quoting
    with pytest.raises(UnknownSequenceError, match="seq_ids\\[1\\]: unknown sequence id 9"):
        pool.plan_append([3, 9], [1, 1])
    with pytest.raises(UnknownSequenceError, match="src: unknown sequence id -1"):
        pool.fork(-1)
    with pytest.raises(TypeError, match="seq_id: expected an int sequence id, got str"):
        pool.length("3")
    with pytest.raises(TypeError, match="got bool"):
        pool.remove(True)
    pool.remove(3)
    with pytest.raises(UnknownSequenceError, match="holds no sequences"):
        pool.remove(3)
    pool.check()


def test_block_table_is_a_copy():
    pool = BlockPool(4, 2)
    s = pool.add()
    appended(pool, s, 3)
    table = pool.block_table(s)
    assert table == [0, 1]
    table.append(3)
    table[0] = 2
    assert pool.block_table(s) == [0, 1]
    pool.check()


# ---------------------------------------------------------------------------------------------
# plan_append


def test_plan_append_plans_without_changing():
    pool = BlockPool(8, 4)
    a, b, c = pool.add(), pool.add(), pool.add()
    appended(pool, a, 3)  # a: [0], partial
    before = state(pool)
    plan = pool.plan_append((a, b, c), [6, 4, 0])
    assert isinstance(plan, AppendPlan)
    assert plan.seq_ids == [a, b, c] and plan.past == [3, 0, 0] and plan.n_new == [6, 4, 0]
    assert plan.tables == [[0, 1, 2], [3], []]
    assert plan.new_blocks == [[1, 2], [3], []]
    assert plan.total_new_blocks == 3
    assert state(pool) == before
    del plan  # a plan never committed changes nothing
    assert state(pool) == before
    pool.check()


def test_plan_append_commit():
    pool = BlockPool(8, 4)
    a, b = pool.add(), pool.add()
    plan = pool.plan_append([a, b], [5, 4])
    assert plan.slots(0).tolist() == [0, 1, 2, 3, 4]
    assert plan.slots(1).tolist() == [8, 9, 10, 11]
    plan.commit()
    pool.check()
    assert pool.length(a) == 5 and pool.length(b) == 4
    assert pool.block_table(a) == [0, 1] and pool.block_table(b) == [2]
    assert pool.free_blocks == 5
    # b is exactly full: one more token takes a new block, a's partial block takes 3 more for free
    plan = pool.plan_append([b, a], [1, 3])
    assert plan.new_blocks == [[3], []]
    plan.commit()
    pool.check()
    assert pool.slots(a, 0, 8).tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert pool.slots(b, 3, 5).tolist() == [11, 12]


def test_plan_append_zero_and_empty():
    pool = BlockPool(2, 3)
    s = pool.add()
    plan = pool.plan_append([s], [0])
    assert plan.tables == [[]] and plan.new_blocks == [[]]
    plan.commit()
    plan = pool.plan_append([], [])
    assert plan.seq_ids == [] and plan.tables == []
    plan.commit()
    assert pool.length(s) == 0 and pool.free_blocks == 2
    pool.check()


def test_plan_append_accepts_numpy():
    pool = BlockPool(4, 2)
    pool.add(), pool.add()
    plan = pool.plan_append(np.array([1, 0]), np.array([3, 1], dtype=np.int32))
    assert plan.seq_ids == [1, 0] and plan.n_new == [3, 1]
    assert all(type(x) is int for x in plan.seq_ids + plan.n_new)
    plan.commit()
    assert pool.length(1) == 3 and pool.length(0) == 1
    pool.check()


@pytest.mark.parametrize("ids,ns,exc,msg", [
    ([0, 1, 0], [1, 1, 1], ValueError, "seq_ids\\[2\\]: expected distinct sequence ids, got 0 twice"),
    ([0, 1], [1], ValueError, "n_new: expected 2 counts .* got 1"),
    ([0], [1, 2], ValueError, "n_new: expected 1 counts"),
    ([0, 1], [1, -1], ValueError, "n_new\\[1\\]: expected an int >= 0, got -1"),
    ([0, 1], [1, 2.0], TypeError, "n_new\\[1\\]: expected an int, got float"),
    ([0], [True], TypeError, "n_new\\[0\\]: expected an int, got bool"),
    ([0, "1"], [1, 1], TypeError, "seq_ids\\[1\\]: expected an int sequence id, got str"),
    (0, [1], TypeError, "seq_ids: expected a sequence of ints, got int"),
    ([0], 1, TypeError, "n_new: expected a sequence of ints, got int"),
    ("01", [1, 1], TypeError, "seq_ids: expected a sequence of ints, got str"),
    ([0], np.ones((1, 1), int), ValueError, "n_new: expected a 1-D sequence"),
    ([0, 5], [1, 1], UnknownSequenceError, "seq_ids\\[1\\]: unknown sequence id 5"),
])
def test_plan_append_rejects(ids, ns, exc, msg):
    pool = BlockPool(4, 2)
    pool.add(), pool.add()
    appended(pool, 0, 1)
    before = state(pool)
    with pytest.raises(exc, match=msg):
        pool.plan_append(ids, ns)
    assert state(pool) == before
    pool.check()


def test_plan_append_cache_full_is_atomic():
    pool = BlockPool(5, 4)
    a, b, c = pool.add(), pool.add(), pool.add()
    appended(pool, a, 6)   # 2 blocks
    appended(pool, b, 4)   # 1 block
    before = state(pool)  # 2 free
    # a fits (2 more tokens into its partial block), b needs 2, c needs 1: 3 > 2
    with pytest.raises(CacheFullError) as info:
        pool.plan_append([a, b, c], [2, 5, 1])
    msg = str(info.value)
    assert "needs 3 new blocks, 2 free" in msg
    assert "1: 2" in msg and "2: 1" in msg and "0:" not in msg  # names the sequences that need blocks
    assert isinstance(info.value, ValueError)
    assert state(pool) == before
    pool.check()
    # exactly enough fits, and fills the pool
    pool.plan_append([a, b, c], [2, 4, 1]).commit()
    pool.check()
    assert pool.free_blocks == 0
    assert [pool.length(s) for s in (a, b, c)] == [8, 8, 1]
    # c can still grow inside its partial block, nothing else can
    pool.plan_append([c], [3]).commit()
    with pytest.raises(CacheFullError, match="needs 1 new blocks, 0 free"):
        pool.plan_append([c], [1])
    pool.check()


def test_stale_plan_rejected_after_every_kind_of_change():
    changes = [
        lambda p: p.add(),
        lambda p: p.remove(1),
        lambda p: p.fork(0),
        lambda p: p.truncate(0, 1),
        lambda p: p.plan_append([1], [1]).commit(),
    ]
    for change in changes:
        pool = BlockPool(10, 4)
        pool.add(), pool.add()
        appended(pool, 0, 3)
        plan = pool.plan_append([0], [4])
        change(pool)
        pool.check()
        before = state(pool)
        with pytest.raises(RuntimeError, match="stale plan"):
            plan.commit()
        assert state(pool) == before
        pool.check()


def test_stale_plan_cannot_double_allocate():
    """Two plans made from one state pick the same free blocks: only the first may commit."""
    pool = BlockPool(3, 2)
    a, b = pool.add(), pool.add()
    p1 = pool.plan_append([a], [2])
    p2 = pool.plan_append([b], [2])
    assert p1.new_blocks == p2.new_blocks == [[0]]
    p1.commit()
    with pytest.raises(RuntimeError, match="stale plan"):
        p2.commit()
    pool.check()
    assert pool.length(b) == 0
    pool.plan_append([b], [2]).commit()
    pool.check()
    assert pool.block_table(a) == [0] and pool.block_table(b) == [1]


def test_read_only_calls_do_not_stale_a_plan():
    pool = BlockPool(4, 2)
    s = pool.add()
    appended(pool, s, 3)
    plan = pool.plan_append([s], [2])
    pool.length(s), pool.block_table(s), pool.slots(s, 0, 3), pool.check(), pool.sequences
    pool.plan_append([s], [1])  # another plan, not committed
    with pytest.raises(CacheFullError):
        pool.plan_append([s], [100])
    plan.commit()
    assert pool.length(s) == 5
    pool.check()


# ---------------------------------------------------------------------------------------------
# fork


def test_fork_aligned_shares_everything():
    pool = BlockPool(6, 4)
    s = pool.add()
    appended(pool, s, 8)
    new, copy = pool.fork(s)
    pool.check()
    assert new == 1 and copy is None
    assert pool.block_table(new) == pool.block_table(s) == [0, 1]
    assert pool.length(new) == 8 and pool.free_blocks == 4
    # both grow into private blocks
    pool.plan_append([s, new], [1, 1]).commit()
    pool.check()
    assert pool.block_table(s) == [0, 1, 2] and pool.block_table(new) == [0, 1, 3]
    # the shared blocks survive until their last reference goes
    pool.remove(s)
    pool.check()
    assert pool.free_blocks == 3 and pool.block_table(new) == [0, 1, 3]
    pool.remove(new)
    pool.check()
    assert pool.free_blocks == 6


def test_fork_partial_copies_tail():
    pool = BlockPool(6, 4)
    s = pool.add()
    appended(pool, s, 6)  # [0, 1], 2 rows in block 1
    new, copy = pool.fork(s, dst=10)
    pool.check()
    assert new == 10
    assert copy == (1, 2, 2)
    assert pool.block_table(new) == [0, 2] and pool.length(new) == 6
    assert pool.free_blocks == 3
    # forking a fork
    new2, copy2 = pool.fork(new)
    pool.check()
    assert new2 == 0 + 1 and copy2 == (2, 3, 2) and pool.block_table(new2) == [0, 3]


def test_fork_empty():
    pool = BlockPool(1, 4)
    s = pool.add()
    new, copy = pool.fork(s)
    assert copy is None and pool.block_table(new) == [] and pool.length(new) == 0
    pool.check()


def test_fork_rejects():
    pool = BlockPool(2, 4)
    s = pool.add()
    pool.add(5)
    appended(pool, s, 5)  # pool full: [0, 1]
    before = state(pool)
    with pytest.raises(CacheFullError) as info:
        pool.fork(s)
    assert "partial block (1 of 4 rows)" in str(info.value) and "1 block needed, 0 free" in str(info.value)
    assert state(pool) == before
    with pytest.raises(ValueError, match="dst: expected an unused sequence id, got 5"):
        pool.fork(s, 5)
    with pytest.raises(ValueError, match="dst: expected an int >= 0, got -2"):
        pool.fork(s, -2)
    with pytest.raises(TypeError, match="dst: expected an int, got str"):
        pool.fork(s, "x")
    assert state(pool) == before
    pool.check()
    # rolled back to a block boundary it needs no block: a full pool can still fork it
    assert pool.truncate(s, 4) is None
    new, copy = pool.fork(s)
    assert copy is None and pool.block_table(new) == [0]
    pool.check()


# ---------------------------------------------------------------------------------------------
# truncate


def test_truncate_private():
    pool = BlockPool(6, 4)
    s = pool.add()
    appended(pool, s, 11)  # [0, 1, 2]
    assert pool.truncate(s, 11) is None and pool.block_table(s) == [0, 1, 2]
    assert pool.truncate(s, 9) is None and pool.block_table(s) == [0, 1, 2]
    assert pool.truncate(s, 8) is None and pool.block_table(s) == [0, 1]
    assert pool.free_blocks == 4
    assert pool.truncate(s, 5) is None and pool.block_table(s) == [0, 1]
    assert pool.truncate(s, 0) is None and pool.block_table(s) == []
    assert pool.free_blocks == 6 and pool.length(s) == 0
    pool.check()


def test_truncate_into_shared_block_copies():
    pool = BlockPool(6, 4)
    s = pool.add()
    appended(pool, s, 8)        # [0, 1]
    f, _ = pool.fork(s)         # shares [0, 1]
    copy = pool.truncate(f, 6)  # ends inside block 1, shared with s
    pool.check()
    assert copy == (1, 2, 2)
    assert pool.block_table(f) == [0, 2] and pool.block_table(s) == [0, 1]
    assert pool.free_blocks == 3
    # truncating to a block boundary of a shared block needs no copy
    g, _ = pool.fork(s)
    assert pool.truncate(g, 4) is None and pool.block_table(g) == [0]
    pool.check()


def test_truncate_uses_the_blocks_it_releases():
    pool = BlockPool(4, 4)
    s = pool.add()
    appended(pool, s, 4)        # [0]
    f, _ = pool.fork(s)         # f shares [0]
    appended(pool, f, 8)        # f: [0, 1, 2], 12 tokens
    appended(pool, s, 1)        # s: [0, 3]: pool full
    assert pool.free_blocks == 0
    copy = pool.truncate(f, 2)  # inside shared block 0; releases 1 and 2
    pool.check()
    assert copy[0] == 0 and copy[1] in (1, 2) and copy[2] == 2
    assert pool.block_table(f) == [copy[1]] and pool.free_blocks == 1


def test_truncate_cache_full_is_atomic():
    pool = BlockPool(2, 4)
    s = pool.add()
    appended(pool, s, 4)        # [0]
    f, _ = pool.fork(s)         # [0]
    appended(pool, s, 1)        # s: [0, 1]: full
    before = state(pool)
    with pytest.raises(CacheFullError) as info:
        pool.truncate(f, 3)
    assert "block 0, which is shared" in str(info.value) and "1 block needed, 0 free" in str(info.value)
    assert state(pool) == before
    pool.check()
    # s's own blocks: 1 is private, 0 is shared but a cut at 4 needs no copy
    assert pool.truncate(s, 4) is None
    assert pool.truncate(f, 3) == (0, 1, 3)
    pool.check()


@pytest.mark.parametrize("length,exc,msg", [
    (-1, ValueError, "length: expected an int in \\[0, 5\\], got -1"),
    (6, ValueError, "length: expected an int in \\[0, 5\\], got 6"),
    (2.0, TypeError, "length: expected an int, got float"),
])
def test_truncate_rejects(length, exc, msg):
    pool = BlockPool(4, 2)
    s = pool.add()
    appended(pool, s, 5)
    before = state(pool)
    with pytest.raises(exc, match=msg):
        pool.truncate(s, length)
    assert state(pool) == before
    pool.check()


# ---------------------------------------------------------------------------------------------
# slots, odd sizes, check()


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_slots_formula(block_size):
    pool = BlockPool(40, block_size)
    a, b = pool.add(), pool.add()
    # interleave appends so the tables are not contiguous
    for n in (1, block_size + 2, 2, 3 * block_size):
        pool.plan_append([a, b], [n, n + 1]).commit()
        pool.check()
    for s in (a, b):
        table, length = pool.block_table(s), pool.length(s)
        want = [table[p // block_size] * block_size + p % block_size for p in range(length)]
        got = pool.slots(s, 0, length)
        assert got.dtype == np.int64 and got.tolist() == want
        assert pool.slots(s, 2, 5).tolist() == want[2:5]
        assert pool.slots(s, length, length).tolist() == []
    all_slots = np.concatenate([pool.slots(s, 0, pool.length(s)) for s in (a, b)])
    assert len(np.unique(all_slots)) == len(all_slots)  # private sequences never share a slot


def test_slots_rejects():
    pool = BlockPool(4, 2)
    s = pool.add()
    appended(pool, s, 3)
    with pytest.raises(ValueError, match="start: expected an int in \\[0, 3\\], got 4"):
        pool.slots(s, 4, 4)
    with pytest.raises(ValueError, match="stop: expected an int in \\[2, 3\\], got 4"):
        pool.slots(s, 2, 4)
    with pytest.raises(ValueError, match="stop: expected an int in \\[2, 3\\], got 1"):
        pool.slots(s, 2, 1)
    with pytest.raises(TypeError, match="start: expected an int, got float"):
        pool.slots(s, 0.0, 1)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_odd_block_sizes_fork_truncate(block_size):
    h = Harness(8, block_size)
    a = h.add()
    h.append([a], [2 * block_size + 1])
    b = h.fork(a)
    h.append([a, b], [block_size, 1])
    h.truncate(b, 1)
    c = h.fork(a)
    h.truncate(a, max(0, h.pool.length(a) - block_size - 1))
    h.append([c, b, a], [1, block_size, 2])
    h.remove(a)
    h.truncate(c, 0)
    h.verify()


def test_block_size_one_never_copies():
    pool = BlockPool(6, 1)
    s = pool.add()
    appended(pool, s, 3)
    f, copy = pool.fork(s)
    assert copy is None and pool.block_table(f) == [0, 1, 2]
    assert pool.truncate(f, 1) is None and pool.block_table(f) == [0]
    pool.check()


def test_check_detects_corruption():
    def fresh():
        pool = BlockPool(6, 4)
        s = pool.add()
        appended(pool, s, 6)   # [0, 1]
        pool.fork(s)           # 1: [0, 2]
        pool.check()
        return pool

    corruptions = [
        (lambda p: p._refs.__setitem__(0, 1), "block 0: refcount 1, referenced 2 times"),
        (lambda p: p._cached.__setitem__(3, None), "blocks \\[3\\] are both free and cached"),
        (lambda p: p._free.pop(5), "differ from the unreferenced blocks"),
        (lambda p: p._lengths.__setitem__(0, 9), "2 blocks for length 9, expected 3"),
        (lambda p: p._lengths.__setitem__(0, -1), "bad length"),
        (lambda p: p._tables[0].__setitem__(1, 0), "appears twice"),
    ]
    for corrupt, msg in corruptions:
        pool = fresh()
        corrupt(pool)
        with pytest.raises(AssertionError, match=msg):
            pool.check()

    # a shared partial tail: the invariant the kernels rely on
    pool = fresh()
    pool._tables[1][1] = 1
    pool._refs[1] += 1
    pool._refs[2] -= 1
    pool._free[2] = None
    with pytest.raises(AssertionError, match="partial tail block 1 is shared"):
        pool.check()


def test_new_rows_are_the_plans_slots_and_positions():
    """PagedKVCache's vectorised (slots, positions) of a plan's new rows equal, in batch order, the
    concatenation of AppendPlan.slots(i) and of each sequence's position range -- odd block sizes,
    rows crossing into planned blocks, sequences of every length, a non-fresh pool (blocks freed
    and reused out of order)."""
    from vkattn.paged import _new_rows
    rng = np.random.default_rng(11)
    for trial in range(200):
        bs = int(rng.integers(1, 9))
        pool = BlockPool(600, bs)
        junk = pool.add()
        pool.plan_append([junk], [int(rng.integers(0, 40))]).commit()
        b = int(rng.integers(1, 12))
        ids = [pool.add() for _ in range(b)]
        pool.plan_append(ids, [int(x) for x in rng.integers(0, 30, b)]).commit()
        pool.remove(junk)                               # its blocks go back, to be taken again below
        counts = [int(x) for x in rng.integers(1, 20, b)]
        plan = pool.plan_append(ids, counts)
        slots, positions = _new_rows(plan, bs)
        want_slots = np.concatenate([plan.slots(i) for i in range(b)])
        want_pos = np.concatenate([np.arange(p, p + n) for p, n in zip(plan.past, counts)])
        assert slots.dtype == np.int64 and np.array_equal(slots, want_slots), trial
        assert np.array_equal(positions, want_pos), trial


def test_new_rows_of_one_sequence_and_of_a_batch_decode():
    """_new_rows' shortcuts (one sequence; one row for each) give the general rule's rows."""
    from vkattn.paged import _new_rows
    rng = np.random.default_rng(12)
    for trial in range(100):
        bs = int(rng.integers(1, 6))
        pool = BlockPool(400, bs)
        b = int(rng.integers(1, 9))
        ids = [pool.add() for _ in range(b)]
        pool.plan_append(ids, [int(x) for x in rng.integers(0, 25, b)]).commit()
        for counts in ([1] * b, [int(rng.integers(1, 9))] + [1] * (b - 1)):
            use = ids if trial % 2 else ids[:1]
            plan = pool.plan_append(use, counts[:len(use)])
            slots, positions = _new_rows(plan, bs)
            assert np.array_equal(slots, np.concatenate([plan.slots(i) for i in range(len(use))])), trial
            assert np.array_equal(positions, np.concatenate([np.arange(p, p + n) for p, n in
                                                             zip(plan.past, plan.n_new)])), trial
