"""Prefix caching in PagedKVCache on the device: a request that reuses cached blocks computes
exactly (bit for bit) what the same request computes without the cache, its reported cached-token
count is right, and eviction under a full pool keeps every sequence's K/V intact.

K, V and queries of a position are a function of the token ids up to it (as a model's are), so a
cached block holds what a request would compute for it. "Without the cache" is a twin
PagedKVCache that never gets token ids: it computes the cached part itself, as a separate
forward, then the same call the cached request makes; outputs and stored rows must be equal,
and both within tolerance of the numpy reference. Sequences that matched one prefix share its
blocks, which a batch may attend once for all (vkattn.cascade, VKATTN_CASCADE=1): its summation
order differs from the twin's, so there outputs are compared within the cascade's tolerance
(atol 5e-6, rtol 5e-5) and stored rows still bit for bit; with the cascade off, bit for bit.
"""
import hashlib

import numpy as np
import pytest

import vkattn
from conftest import assert_close
from vkattn.errors import CacheFullError
from vkattn.reference import attention

KERNELS = ["lane", "tile"]
HKV, GROUP, D = 2, 2, 16


def rows_for(tokens, start, stop, salt=""):
    """q (HKV*GROUP, n, D), k, v (HKV, n, D) of positions start..stop-1 of a token sequence:
    each position's rows seeded by its token prefix."""
    q = np.empty((HKV * GROUP, stop - start, D), np.float32)
    k = np.empty((HKV, stop - start, D), np.float32)
    v = np.empty((HKV, stop - start, D), np.float32)
    for j, p in enumerate(range(start, stop)):
        seed = hashlib.blake2b(repr((salt, tuple(tokens[:p + 1]))).encode(), digest_size=8).digest()
        r = np.random.default_rng(int.from_bytes(seed, "little"))
        q[:, j] = r.standard_normal((HKV * GROUP, D), dtype=np.float32)
        k[:, j] = r.standard_normal((HKV, D), dtype=np.float32)
        v[:, j] = r.standard_normal((HKV, D), dtype=np.float32)
    return q, k, v


class Twin:
    """A prefix-caching PagedKVCache and a no-cache twin run the same requests."""

    def __init__(self, device, num_blocks, block_size, twin_blocks=None, exact=True):
        self.exact = exact
        self.a = vkattn.PagedKVCache(num_blocks, block_size, HKV, D, device=device)
        self.b = vkattn.PagedKVCache(twin_blocks or 4 * num_blocks, block_size, HKV, D, device=device)
        self.tokens = {}        # sid -> token ids of its positions
        self.calls = 0

    def forward(self, sids, new_tokens):
        """Append new_tokens[i] to sids[i] in both caches; outputs equal bit for bit, and within
        tolerance of the reference. Returns the output."""
        qs, ks, vs = [], [], []
        for s, t in zip(sids, new_tokens):
            full = self.tokens[s] + list(t)
            q, k, v = rows_for(full, len(self.tokens[s]), len(full))
            qs.append(q), ks.append(k), vs.append(v)
        q, k, v = (np.concatenate(x, axis=1) for x in (qs, ks, vs))
        n_new = [len(t) for t in new_tokens]
        out_a = self.a.forward(sids, q, k, v, n_new=n_new, token_ids=[list(t) for t in new_tokens])
        out_b = self.b.forward(sids, q, k, v, n_new=n_new)
        self.same(out_a, out_b)
        at = 0
        for s, t in zip(sids, new_tokens):
            self.tokens[s] = self.tokens[s] + list(t)
            full = self.tokens[s]
            ka, va = self.a.read(s)
            _, kf, vf = rows_for(full, 0, len(full))
            ref = attention(q[:, at:at + len(t)], vkattn.reference.round_to(kf, "float16"),
                            vkattn.reference.round_to(vf, "float16"))
            assert_close(out_a[:, at:at + len(t)], ref, "float16")
            at += len(t)
        self.calls += 1
        return out_a

    def same(self, out_a, out_b):
        if self.exact:
            assert np.array_equal(out_a, out_b), "the prefix-caching cache computed other values"
        else:
            np.testing.assert_allclose(out_a, out_b, atol=5e-6, rtol=5e-5)

    def request(self, prompt):
        """A new sequence for ``prompt`` in both caches: the cache reuses what it can, the twin
        computes that part itself first. Returns (sid, cached tokens)."""
        predicted = self.a.match_prefix(prompt)
        sid = self.a.add_sequence(token_ids=prompt)
        n = self.a.length(sid)
        assert n == predicted and n % self.a.block_size == 0 and n < len(prompt)
        assert self.a.token_ids(sid) == list(prompt[:n])
        assert self.b.add_sequence(sid) == sid
        self.tokens[sid] = []
        if n:
            q, k, v = rows_for(list(prompt), 0, n)
            self.b.forward([sid], q, k, v, n_new=[n])
            self.tokens[sid] = list(prompt[:n])
        self.forward([sid], [list(prompt[n:])])
        self.check_stored()
        return sid, n

    def check_stored(self):
        assert self.a.sequences == self.b.sequences
        for s in self.a.sequences:
            ka, va = self.a.read(s)
            kb, vb = self.b.read(s)
            assert np.array_equal(ka, kb) and np.array_equal(va, vb), f"sequence {s}: stored rows differ"

    def close(self):
        self.a.close()
        self.b.close()


@pytest.mark.parametrize("kernel", KERNELS)
def test_shared_prefix_request_is_bit_identical(device, monkeypatch, kernel):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    monkeypatch.setenv("VKATTN_CASCADE", "0")
    t = Twin(device, 24, 8)
    r = np.random.default_rng(3)
    system = r.integers(0, 1000, 37).tolist()
    first, n = t.request(system + r.integers(0, 1000, 8).tolist())       # 45 tokens
    assert n == 0
    for _ in range(3):
        t.forward([first], [[int(r.integers(1000))]])                    # decode, ids given
    assert t.a.match_prefix(system + [5]) == 32                          # 4 full blocks of the 37
    second, n = t.request(system + r.integers(0, 1000, 20).tolist())     # while the first is live
    assert n == 32
    assert t.a.block_table(second)[:4] == t.a.block_table(first)[:4]     # shared, not copied
    first_tokens = t.tokens.pop(first)                                   # 45 + 3: 6 full blocks
    t.a.remove_sequence(first), t.b.remove_sequence(first)
    assert t.a.cached_blocks == 2                                        # its own blocks 4, 5; 0-3 held
    t.forward([second], [[7]])
    # the whole first request again: its full blocks are all there (held or cached), at most 47 tokens
    third, n = t.request(first_tokens)
    assert n == 40 and t.a.cached_blocks == 1
    t.check_stored()
    t.close()


def test_fully_cached_prompt_computes_its_last_block(device, monkeypatch):
    monkeypatch.setenv("VKATTN_CASCADE", "0")
    t = Twin(device, 16, 4)
    prompt = list(range(100, 112))                                        # exactly 3 blocks
    s, n = t.request(prompt)
    assert n == 0
    t.a.remove_sequence(s), t.b.remove_sequence(s)
    s2, n = t.request(prompt)                                             # all 12 cached: 8 reused
    assert n == 8 and t.a.cached_blocks == 1          # its block 2 stays cached; the recomputed copy is not registered
    t.close()


@pytest.mark.parametrize("cascade", ["0", "1"])
def test_random_requests_decode_fork_truncate_evict(device, monkeypatch, cascade):
    """Requests sharing prefixes over a small pool (evictions), batched decode with and without
    token ids, forks, rollbacks, removals: every output and every stored row as without the cache."""
    monkeypatch.setenv("VKATTN_CASCADE", cascade)
    r = np.random.default_rng(11)
    t = Twin(device, 14, 4, twin_blocks=80, exact=cascade == "0")
    stems = [r.integers(0, 50, 14).tolist() for _ in range(3)]
    counts = dict(reused=0, evicted=0, full=0)
    for step in range(70):
        live = t.a.sequences
        op = r.choice(["request", "decode", "decode", "fork", "truncate", "remove", "evict"]) if live else "request"
        if op == "request" and len(live) < 4:
            stem = stems[int(r.integers(len(stems)))]
            prompt = stem[:int(r.integers(1, len(stem) + 1))] + r.integers(0, 50, int(r.integers(1, 6))).tolist()
            need = -(-(len(prompt) - t.a.match_prefix(prompt)) // 4)
            if need > t.a.free_blocks:
                counts["full"] += 1
                continue
            hashes = set(t.a._pool._index)
            _, n = t.request(prompt)
            counts["reused"] += n > 0
            counts["evicted"] += bool(hashes - set(t.a._pool._index))
        elif op == "decode":
            sids = sorted(r.choice(live, size=int(r.integers(1, len(live) + 1)), replace=False).tolist())
            new = [r.integers(0, 50, int(r.integers(1, 3))).tolist() for _ in sids]
            try:
                t.a.check_fits(sids, [len(x) for x in new])
            except CacheFullError:
                counts["full"] += 1
                continue
            if r.random() < 0.2:        # ids unknown: these positions are not cached (the twin never knows them)
                qs = [rows_for(t.tokens[s] + x, len(t.tokens[s]), len(t.tokens[s]) + len(x)) for s, x in zip(sids, new)]
                q, k, v = (np.concatenate([z[i] for z in qs], axis=1) for i in range(3))
                oa = t.a.forward(sids, q, k, v, n_new=[len(x) for x in new])
                ob = t.b.forward(sids, q, k, v, n_new=[len(x) for x in new])
                t.same(oa, ob)
                for s, x in zip(sids, new):
                    t.tokens[s] = t.tokens[s] + x
            else:
                t.forward(sids, new)
        elif op == "fork" and len(live) < 4:
            s = int(r.choice(live))
            try:
                f = t.a.fork(s)
            except CacheFullError:
                counts["full"] += 1
                continue
            assert t.b.fork(s, f) == f
            t.tokens[f] = list(t.tokens[s])
        elif op == "truncate":
            s = int(r.choice(live))
            n = int(r.integers(0, t.a.length(s) + 1))
            try:
                t.a.truncate(s, n)
            except CacheFullError:
                counts["full"] += 1
                continue
            t.b.truncate(s, n)
            t.tokens[s] = t.tokens[s][:n]
        elif op == "remove":
            s = int(r.choice(live))
            t.a.remove_sequence(s), t.b.remove_sequence(s)
            del t.tokens[s]
        elif op == "evict":
            t.a.evict_cached(int(r.integers(0, 3)))
        t.a._pool.check()
        t.check_stored()
    assert counts["reused"] > 0 and counts["evicted"] > 0, counts
    t.close()


def test_a_rejected_forward_evicts_nothing(device, rng):
    c = vkattn.PagedKVCache(3, 4, HKV, D, device=device)
    s = c.add_sequence(token_ids=list(range(13)))
    q, k, v = rows_for(list(range(13)), 0, 12)
    c.forward([s], q, k, v, n_new=[12], token_ids=[list(range(12))])
    c.remove_sequence(s)
    assert c.cached_blocks == 3 and c.free_blocks == 3
    t = c.add_sequence()
    q, k, v = rows_for([9] * 8, 0, 8)
    with pytest.raises(ValueError, match="q: expected shape"):
        c.forward([t], q[:, :7], k, v, n_new=[8], token_ids=[[9] * 8])
    with pytest.raises(ValueError, match="token_ids\\[0\\]: expected 8 token ids, got 7"):
        c.forward([t], q, k, v, n_new=[8], token_ids=[[9] * 7])
    assert c.cached_blocks == 3 and c.match_prefix(list(range(13))) == 12
    c.forward([t], q, k, v, n_new=[8], token_ids=[[9] * 8])         # takes 2: the least recently released
    assert c.cached_blocks == 1 and c.match_prefix(list(range(13))) == 4
    with pytest.raises(CacheFullError, match="needs 2 new blocks, 1 free \\(of 3, 1 of them cached\\)"):
        c.check_fits([t], [5])
    c.check_fits([t], [4])                                           # fits: evicts the last cached block
    c.close()


def test_perf_prefix_case_small(device, monkeypatch):
    """``python -m perf prefix`` on a tiny shape: both rows verified, the hit reuses the whole
    prefix (no timing is asserted)."""
    import perf.prefix
    from perf.common import Shape
    for name, value in (("VKATTN_PERF_PREFIX_LAYERS", "2"), ("VKATTN_PERF_PREFIX", "40"),
                        ("VKATTN_PERF_PREFIX_OWN", "8"), ("VKATTN_PERF_CASE", "")):
        monkeypatch.setenv(name, value)
    shape = Shape(heads=4, kv_heads=2, head_dim=16, v_head_dim=16, dtype="float16", qlen=8, capacity=None,
                  iters=4, warmup=0)
    miss, hit = perf.prefix.run(shape, device)
    assert miss.verified and hit.verified
    assert hit.extra["cached_tokens"] == 32 and hit.extra["layers"] == 2
    assert hit.value == miss.vkattn_ms / hit.vkattn_ms


def test_a_loaded_sequence_with_token_ids_is_cached(device, tmp_path):
    """load_sequence records the saved token ids: its full blocks serve a later prompt; and a load
    that takes cached blocks evicts them before writing (the prefix cache never serves other rows)."""
    c = vkattn.PagedKVCache(6, 4, HKV, D, device=device)
    ids = list(range(200, 210))
    q, k, v = rows_for(ids, 0, 10)
    s = c.add_sequence()
    c.forward([s], q, k, v, n_new=[10])
    c.save_sequence(s, tmp_path / "s.safetensors", token_ids=ids)
    c.remove_sequence(s)
    other = list(range(300, 309))
    q2, k2, v2 = rows_for(other, 0, 9)
    t = c.add_sequence()
    c.forward([t], q2, k2, v2, n_new=[9], token_ids=[other])
    c.remove_sequence(t)                                # 2 blocks of `other` cached, 4 free
    assert c.cached_blocks == 2 and c.match_prefix(other) == 8
    u = c.add_sequence()
    c.forward([u], q[:, :8], k[:, :8], v[:, :8], n_new=[8])   # takes 2 free blocks: 2 free left
    loaded, got = c.load_sequence(tmp_path / "s.safetensors")  # 3 blocks: 2 free, 1 evicted
    assert got.tolist() == ids and c.token_ids(loaded) == ids
    assert c.match_prefix(ids + [1]) == 8 and c.match_prefix(other) == 4
    kl, vl = c.read(loaded)
    new = c.add_sequence(token_ids=ids + [7])
    assert c.length(new) == 8 and c.block_table(new) == c.block_table(loaded)[:2]
    kn, vn = c.read(new)
    assert np.array_equal(kn, kl[:, :8]) and np.array_equal(vn, vl[:, :8])
    c._pool.check()
    c.close()
