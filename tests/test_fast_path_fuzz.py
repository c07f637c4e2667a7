"""Both caches' fast paths against the general path on random calls, valid and not: the same
result bit for bit, or the same error (type and text), the same lengths and stored rows after
every call. Seeded: a failure names its seed, iteration and step."""
import random

import numpy as np
import pytest

import vkattn

ROPE = vkattn.RoPE(base=100.0)
HKV, D = 2, 32


def _outcome(fn):
    try:
        return ("ok", fn())
    except (TypeError, ValueError, vkattn.CacheFullError, vkattn.UnknownSequenceError) as e:
        return ("error", type(e).__name__, str(e))


def _same(a, b) -> bool:
    if a[0] != b[0] or (a[0] == "error" and a[1:] != b[1:]):
        return False
    if a[0] == "error":
        return True
    x, y = (a[1], b[1]) if isinstance(a[1], tuple) else ((a[1],), (b[1],))
    return all(np.array_equal(p, q) for p, q in zip(x, y))


class _Draw:
    def __init__(self, seed):
        self.r, self.rng = random.Random(seed), np.random.default_rng(seed)

    def pick(self, *xs):
        return self.r.choice(xs)

    def chance(self, p) -> bool:
        return self.r.random() < p

    def array(self, shape, dtype=np.float32):
        return self.rng.standard_normal(shape).astype(dtype)

    def variant(self, hq: int) -> dict:
        kw = {}
        if self.chance(0.3):
            kw["alibi_slopes"] = self.pick(np.linspace(0.1, 1, hq), np.linspace(0.1, 1, hq).astype(np.float32),
                                           np.ones(hq + 1), np.full(hq, np.nan))
        if self.chance(0.2):
            kw["causal"] = self.pick(False, True, 1)
        if self.chance(0.2):
            kw["window"] = self.pick(1, 3, 0, 2.5)
        if self.chance(0.1):
            kw["n_sink"] = self.pick(1, 2)
        if self.chance(0.1):
            kw["softcap"] = self.pick(5.0, 30.0, -1.0)
        if self.chance(0.2):
            kw["rope_q"] = self.pick(True, False)
        if self.chance(0.1):
            kw["return_lse"] = True
        return kw

    def mask(self, shape):
        m = self.array(shape, self.pick(np.float32, np.float64, np.float16))
        if self.chance(0.2) and m.size:
            with np.errstate(over="ignore"):        # 1e300: +inf in the mask's own dtype
                m[..., 0] = self.pick(np.nan, np.inf, -np.inf, 1e300)
        return m


@pytest.mark.parametrize("seed", [11, 12])
def test_kvcache_fast_path_equals_the_general_path_on_random_calls(device, seed):
    draw = _Draw(seed)
    for it in range(25):
        dtype, rope = draw.pick("float32", "float16", "int8", "q4"), draw.pick(ROPE, None)
        fast, general = (vkattn.KVCache(24, HKV, D, dtype=dtype, device=device, rope=rope) for _ in range(2))
        general._fast_call = lambda *a, **kw: None          # the general path, call by call
        for step in range(7):
            n, hq = draw.pick(0, 1, 1, 2, 5), draw.pick(4, 4, 3, 2)
            s = draw.pick(1, 1, 2, max(n, 1))
            total = fast.length + n
            q, k, v = draw.array((hq, s, D)), draw.array((HKV, max(n, 1), D)), draw.array((HKV, max(n, 1), D))
            if draw.chance(0.05):
                k = k * 1e5                             # past float16's range
            if draw.chance(0.03):
                q[0, 0, 0] = np.nan
            kw = draw.variant(hq)
            if draw.chance(0.3):
                kw["mask"] = draw.mask(draw.pick((s, total), (hq, s, total), (s, total + 1)))
            if draw.chance(0.1):
                kw["scale"] = draw.pick(0.3, -1.0, 2)
            with np.errstate(over="ignore"):
                if n:
                    got, want = (_outcome(lambda c=c: c.forward(q, k, v, **kw)) for c in (fast, general))
                else:
                    got, want = (_outcome(lambda c=c: c.attend(q, **kw)) for c in (fast, general))
            assert _same(got, want) and fast.length == general.length, (seed, it, step, dtype, kw.keys(), got[0],
                                                                       want[0], got[1:] if got[0] == "error" else "")
        for a, b in zip(fast.read(), general.read()):
            assert np.array_equal(a, b), (seed, it)
        fast.close()
        general.close()


def _paged_twins(device, draw, blocks: int, n: int = 3, **add) -> tuple:
    """(fast, general, ids): two PagedKVCaches of ``blocks`` blocks of 4 in a format and RoPE
    drawn, the second always on the general path, the same ``n`` sequences in each (``add``: the
    add_sequence keywords)."""
    dtype, rope = draw.pick("float32", "float16", "int8", "q4"), draw.pick(ROPE, None)
    fast, general = (vkattn.PagedKVCache(blocks, 4, HKV, D, dtype=dtype, device=device, rope=rope)
                     for _ in range(2))
    general._fast_forward = lambda *a, **kw: None
    ids = [fast.add_sequence(**add) for _ in range(n)]
    assert ids == [general.add_sequence(**add) for _ in range(n)]
    return fast, general, ids


def _same_rows_then_close(fast, general, ids, seed, it) -> None:
    """Every sequence's stored rows equal in both caches, bit for bit; then both closed."""
    for sid in ids:
        if fast.length(sid):
            for a, b in zip(fast.read(sid), general.read(sid)):
                assert np.array_equal(a, b), (seed, it, sid)
    fast.close()
    general.close()


@pytest.mark.parametrize("seed", [21, 22])
def test_paged_fast_path_equals_the_general_path_on_random_calls(device, seed):
    draw = _Draw(seed)
    for it in range(20):
        fast, general, ids = _paged_twins(device, draw, 12)
        dtype = fast.dtype
        for step in range(7):
            seqs = draw.r.sample(ids, draw.pick(1, 2, 3))
            if draw.chance(0.05):
                seqs = seqs + [seqs[0]]
            counts = [draw.pick(1, 1, 2, 3) for _ in seqs]
            hq, rows = draw.pick(4, 4, 2, 3), sum(counts)
            q, k, v = draw.array((hq, rows, D)), draw.array((HKV, rows, D)), draw.array((HKV, rows, D))
            if draw.chance(0.03):
                k[0, 0, 0] = np.inf
            kw = draw.variant(hq)
            kw["n_new"] = None if set(counts) == {1} and draw.chance(0.5) else counts
            if draw.chance(0.35):
                per_head = draw.chance(0.5)
                masks = []
                for sid, c in zip(seqs, counts):
                    keys = fast.length(sid) + c + (1 if draw.chance(0.05) else 0)
                    masks.append(draw.mask((hq, c, keys) if per_head else (c, keys)))
                if draw.chance(0.05):
                    masks = masks[:-1]
                kw["mask"] = masks
            with np.errstate(over="ignore"):
                got, want = (_outcome(lambda c=c: c.forward(seqs, q, k, v, **kw)) for c in (fast, general))
            assert _same(got, want) and fast.lengths() == general.lengths(), \
                (seed, it, step, dtype, kw.keys(), got[0], want[0], got[1:] if got[0] == "error" else "")
        _same_rows_then_close(fast, general, ids, seed, it)


@pytest.mark.parametrize("seed,steady,wide", [(31, False, False), (32, False, False), (33, True, False),
                                              (34, True, False), (35, True, True)])
def test_paged_decode_loops_take_the_last_step_on_and_equal_the_general_path(device, seed, steady, wide,
                                                                            monkeypatch, request):
    """Decode loops -- the same sequences and counts call after call, as an engine's step does --
    with the pool changed between some calls (truncate, fork, remove, new token ids, another
    batch): the fast path takes its last step on where nothing changed the pool -- planned from
    it (_Step.following), or, with ``steady``, run again as it was (_Steady.step) -- blocks
    taken at the boundaries too, and matches the general path bit for bit: results, errors,
    lengths, block tables (the same blocks picked), token ids and stored rows. ``wide``: batches
    of up to 8 of 9 sequences, mostly one row each, in pools that fill (the steady step's table
    layouts and a full pool's errors, fork's among them)."""
    from vkattn import paged
    if steady:
        taken = request.getfixturevalue("steady_hits")     # blocks taken per steady step
    else:
        taken = []
        real = paged._Step.following

        def spy(self, *a):
            step = real(self, *a)
            if step is not None:
                taken.append(sum(map(len, step.plan.new_blocks)))
            return step
        monkeypatch.setattr(paged._Step, "following", spy)
        monkeypatch.setattr(paged._Steady, "of", classmethod(lambda cls, *a: None))
    draw = _Draw(seed)
    sizes = (1, 2, 3, 5, 8) if wide else (1, 2, 3)
    for it in range(10):
        fast, general, ids = _paged_twins(device, draw, draw.pick(40, 80, 160) if wide else 40,
                                          9 if wide else 3, token_ids=[])
        caches, dtype = (fast, general), fast.dtype
        seqs, counts = draw.r.sample(ids, draw.pick(*sizes)), None
        hq = draw.pick(4, 2)
        kw = {k: v for k, v in draw.variant(hq).items() if k != "return_lse"}
        for step in range(40 if wide else 24):
            if draw.chance(0.06 if wide else 0.12):     # the pool changed between two calls
                what, sid = draw.pick("truncate", "fork", "remove", "tokens"), draw.r.choice(ids)
                if what == "truncate" and fast.length(sid):
                    n = draw.r.randrange(fast.length(sid))
                    for c in caches:
                        c.truncate(sid, n)
                elif what == "fork":                    # a full pool: the same CacheFullError
                    forked = [_outcome(lambda c=c: c.fork(sid)) for c in caches]
                    assert forked[0] == forked[1], forked
                elif what == "remove" and len(ids) > 1:
                    for c in caches:
                        c.remove_sequence(sid)
                    ids.remove(sid)
                    seqs = [s for s in seqs if s != sid] or [ids[0]]
                elif what == "tokens" and fast.length(sid):
                    known = fast.token_ids(sid)
                    for c in caches:
                        c.set_token_ids(sid, known + list(range(fast.length(sid) - len(known))))
            if counts is None or draw.chance(0.1):      # another batch
                seqs = draw.r.sample(ids, min(len(ids), draw.pick(*sizes)))
                counts = [1] * len(seqs) if wide and draw.chance(0.7) else [draw.pick(1, 1, 1, 2) for _ in seqs]
            elif draw.chance(0.05 if wide else 0.15):   # the same sequences, other counts (chunks)
                counts = [draw.pick(1, 2, 3, 5) for _ in seqs]
            rows = sum(counts)
            q, k, v = draw.array((hq, rows, D)), draw.array((HKV, rows, D)), draw.array((HKV, rows, D))
            call = dict(kw, n_new=None if set(counts) == {1} and draw.chance(0.7) else
                        draw.pick(list(counts), tuple(counts)))
            if draw.chance(0.03):
                call["n_new"] = draw.pick([0] * len(counts), [1.0] * len(counts), list(counts) + [1])
            if draw.chance(0.3):
                call["token_ids"] = [[draw.r.randrange(1000) for _ in range(c)] for c in counts]
            if draw.chance(0.03):
                call["token_ids"] = [[-1] * c for c in counts]
            with np.errstate(over="ignore"):
                got, want = (_outcome(lambda c=c: c.forward(list(seqs), q, k, v, **call)) for c in caches)
            assert _same(got, want) and fast.lengths() == general.lengths(), \
                (seed, it, step, dtype, call.keys(), got[0], want[0], got[1:] if got[0] == "error" else "")
            for sid in ids:
                assert fast.block_table(sid) == general.block_table(sid), (seed, it, step, sid)
                assert fast.token_ids(sid) == general.token_ids(sid), (seed, it, step, sid)
        _same_rows_then_close(fast, general, ids, seed, it)
    # (a steady step takes one row a sequence and no mask, after a planned call: fewer of the calls)
    assert len(taken) >= (15 if steady else 50) and any(taken), (len(taken), sum(map(bool, taken)))
