"""Save and load (vkattn.persist): a KVCache, PagedKVCache sequences and a vkattn.hf.VkattnCache
to a safetensors file and back, bit-exact -- the stored bits equal, read() equal, and the calls
that follow give identical results -- and every bad file refused with a typed error naming what
is wrong, the cache unchanged.

Shapes: num_kv_heads 2, head_dim 24, v_head_dim 20 (rows end inside a storage word), group 2.
"""
import json
import os

import numpy as np
import pytest
from conftest import HF_SKIP, TRANSFORMERS_MIN

import vkattn
from vkattn import persist

HKV, D, DV, GROUP = 2, 24, 20, 2
DTYPES = ["float16", "float32", "int8", "bfloat16"]
ROPES = {"none": None, "neox16": vkattn.RoPE(style="neox", rotary_dim=16), "gptj": vkattn.RoPE(style="gptj", base=500.0,
                                                                                                 rotary_dim=24)}


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def kv_cache(device, dtype="float16", rope=None, capacity=64, **kw):
    shape = dict(num_kv_heads=HKV, head_dim=D, v_head_dim=DV)
    shape.update(kw)
    return vkattn.KVCache(capacity, dtype=dtype, device=device, rope=rope, **shape)


def filled(device, rng, n, **kw):
    c = kv_cache(device, **kw)
    if n:
        c.append(rand(rng, c.num_kv_heads, n, c.head_dim), rand(rng, c.num_kv_heads, n, c.v_head_dim))
    return c


def bits(c, slots=None):
    """The stored bits of a KVCache's live part (or of ``slots``): the file tensors."""
    return persist.stored_tensors(c, np.arange(c.length) if slots is None else slots)


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[n].shape == b[n].shape and a[n].dtype == b[n].dtype and a[n].tobytes() == b[n].tobytes() for n in a)


def state(c):
    """Everything a failed load must leave as it was."""
    if isinstance(c, vkattn.KVCache):
        return c.length, bits(c), c.read()
    return (c.lengths(), c.free_blocks, {s: c.block_table(s) for s in c.sequences},
            {s: c.read(s) for s in c.sequences})


def same_state(a, b) -> bool:
    def eq(x, y):
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, (tuple, list)):
            return len(x) == len(y) and all(eq(p, q) for p, q in zip(x, y))
        if isinstance(x, np.ndarray):
            return x.shape == y.shape and x.tobytes() == y.tobytes()
        return x == y
    return eq(a, b)


# ---------------------------------------------------------------------- KVCache round trips

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", list(ROPES))
def test_kvcache_round_trip_is_bit_exact(device, rng, tmp_path, dtype, rope):
    rope = ROPES[rope]
    a = filled(device, rng, 37, dtype=dtype, rope=rope)
    path = tmp_path / "a.safetensors"
    ids = rng.integers(0, 50000, 37)
    a.save(path, token_ids=ids)
    b = kv_cache(device, dtype=dtype, rope=rope)
    b.append(rand(rng, HKV, 5, D), rand(rng, HKV, 5, DV))           # load replaces what was there
    got = b.load(path)
    assert b.length == 37 and got.dtype == np.int64 and np.array_equal(got, ids)
    assert same_bits(bits(a), bits(b))
    ka, va = a.read()
    kb, vb = b.read()
    assert np.array_equal(ka, kb) and np.array_equal(va, vb)
    # what follows is identical: a prefill chunk through the fused append, then decode steps
    for s in (3, 1, 1):
        q, k, v = rand(rng, HKV * GROUP, s, D), rand(rng, HKV, s, D), rand(rng, HKV, s, DV)
        oa, la = a.forward(q, k, v, rope_q=rope is not None, return_lse=True)
        ob, lb = b.forward(q, k, v, rope_q=rope is not None, return_lse=True)
        assert np.array_equal(oa, ob) and np.array_equal(la, lb)
    assert same_bits(bits(a), bits(b))
    # saved again from the loaded cache: the same file contents (vkattn_version aside, the same checksum)
    b.truncate(37)
    b.save(tmp_path / "b.safetensors", token_ids=ids)
    assert persist.file_info(path)["checksum"] == persist.file_info(tmp_path / "b.safetensors")["checksum"]


@pytest.mark.parametrize("n", [0, 1, 7, 63, 64])
def test_kvcache_odd_lengths_and_the_full_capacity(device, rng, tmp_path, n):
    a = filled(device, rng, n, dtype="int8")
    a.save(tmp_path / "a.safetensors")
    b = filled(device, rng, 9, dtype="int8")
    assert b.load(tmp_path / "a.safetensors") is None            # no token ids saved
    assert b.length == n and same_bits(bits(a), bits(b))
    k, v = b.read()
    assert k.shape == (HKV, n, D) and v.shape == (HKV, n, DV)


def test_more_positions_than_one_submission_and_another_capacity(device, rng, tmp_path):
    # READ_ROWS positions per submission: a file longer than that is read and written in parts
    n = persist.READ_ROWS + 37
    a = vkattn.KVCache(n + 3, 1, 8, dtype="float16", device=device)
    a.append(rand(rng, 1, n, 8), rand(rng, 1, n, 8))
    a.save(tmp_path / "long.safetensors")
    b = vkattn.KVCache(n + 100, 1, 8, dtype="float16", device=device)     # another capacity is fine
    b.load(tmp_path / "long.safetensors")
    assert b.length == n and same_bits(bits(a), bits(b))
    q = rand(rng, 2, 1, 8)
    ref = vkattn.reference.attention(q, *a.read())
    np.testing.assert_allclose(b.attend(q), ref, **dict(zip(("atol", "rtol"), vkattn.reference.TOLERANCE["float16"])))


def test_the_file_holds_the_stored_values(device, rng, tmp_path):
    """The tensors in the file are the cache's rows in the storage dtype (int8 with scales):
    what read() dequantises, and what another safetensors reader sees."""
    from safetensors.numpy import load_file
    a = filled(device, rng, 11, dtype="int8")
    a.save(tmp_path / "a.safetensors", token_ids=list(range(11)))
    t = load_file(str(tmp_path / "a.safetensors"))
    assert sorted(t) == ["k", "k_scale", "token_ids", "v", "v_scale"]
    assert t["k"].dtype == np.int8 and t["k"].shape == (HKV, 11, D) and t["k_scale"].shape == (HKV, 11)
    k, v = a.read()
    assert np.array_equal(t["k"].astype(np.float32) * t["k_scale"][..., None], k)
    assert np.array_equal(t["v"].astype(np.float32) * t["v_scale"][..., None], v)
    info = vkattn.cache_file_info(tmp_path / "a.safetensors")
    assert (info["format"], info["format_version"], info["dtype"], info["num_kv_heads"], info["head_dim"],
            info["v_head_dim"], info["length"], info["rope"], info["source"]) == \
        ("vkattn.sequence", 1, "int8", HKV, D, DV, 11, None, "KVCache")
    assert info["checksum"].startswith("sha256:") and np.array_equal(info["token_ids"], np.arange(11))


def test_save_replaces_a_file_atomically(device, rng, tmp_path):
    path = tmp_path / "a.safetensors"
    path.write_bytes(b"old contents")
    a = filled(device, rng, 5)
    a.save(str(path))
    assert os.listdir(tmp_path) == ["a.safetensors"]              # no temporary file left behind
    assert vkattn.cache_file_info(path)["length"] == 5


def test_save_and_load_keep_no_buffers_and_leave_the_last_timings(device, rng, tmp_path):
    """Their readback / upload plans are one-off (a many-layer model would otherwise hold one
    per layer): the cache's plans are the same before and after, and last_timings() still
    describes the last attention call."""
    a = vkattn.KVCache(64, HKV, D, v_head_dim=DV, device=device, timestamps=True)
    q, k, v = rand(rng, HKV * GROUP, 9, D), rand(rng, HKV, 9, D), rand(rng, HKV, 9, DV)
    a.forward(q, k, v)
    plans, timings = list(a._plans), [name for name, _ in a.last_timings()]
    a.save(tmp_path / "a.safetensors")
    a.load(tmp_path / "a.safetensors")
    assert list(a._plans) == plans and [name for name, _ in a.last_timings()] == timings


# ---------------------------------------------------------------------- PagedKVCache

def paged(device, num_blocks=24, block_size=5, dtype="float16", rope=None):
    return vkattn.PagedKVCache(num_blocks, block_size, HKV, D, v_head_dim=DV, dtype=dtype, device=device, rope=rope)


def grow(c, rng, sid, n):
    c.append([sid], rand(rng, HKV, n, D), rand(rng, HKV, n, DV), n_new=[n])


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_sequences_and_forks_round_trip(device, rng, tmp_path, dtype):
    rope = ROPES["neox16"] if dtype != "int8" else None
    a = paged(device, dtype=dtype, rope=rope)
    s0, s1, s2 = (a.add_sequence() for _ in range(3))
    grow(a, rng, s0, 12)
    grow(a, rng, s1, 3)
    f = a.fork(s0)                  # shares s0's full blocks, a private copy of its partial one
    grow(a, rng, f, 4)
    g = a.fork(s1)
    a.truncate(f, 9)
    lengths = a.lengths()
    assert lengths == {s0: 12, s1: 3, s2: 0, f: 9, g: 3}
    paths = {}
    for sid in a.sequences:
        paths[sid] = tmp_path / f"seq{sid}.safetensors"
        a.save_sequence(sid, paths[sid], token_ids=np.arange(lengths[sid]) + 100 * sid)
    assert vkattn.cache_file_info(paths[s0])["block_size"] == 5
    # onto another pool of the same settings, in another order: identical reads and calls
    b = paged(device, dtype=dtype, rope=rope)
    b.add_sequence(7)
    got = {}
    for sid in reversed(a.sequences):
        new, ids = b.load_sequence(paths[sid])
        assert np.array_equal(ids, np.arange(lengths[sid]) + 100 * sid)
        got[sid] = new
    assert sorted(got.values()) == [0, 1, 2, 3, 4] and b.lengths()[7] == 0
    for sid, new in got.items():
        assert b.length(new) == lengths[sid]
        assert same_bits(persist.stored_tensors(a, a._pool.slots(sid, 0, lengths[sid])),
                         persist.stored_tensors(b, b._pool.slots(new, 0, lengths[sid])))
        assert same_state(a.read(sid), b.read(new))
    live = [s0, f, s1]
    n_new = [1, 2, 1]
    q, k, v = rand(rng, HKV * GROUP, 4, D), rand(rng, HKV, 4, D), rand(rng, HKV, 4, DV)
    oa = a.forward(live, q, k, v, n_new=n_new, rope_q=rope is not None)
    ob = b.forward([got[s] for s in live], q, k, v, n_new=n_new, rope_q=rope is not None)
    assert np.array_equal(oa, ob)
    # into the same pool under a chosen id, and into another block size
    sid, _ = a.load_sequence(paths[f], seq_id=40)
    assert sid == 40 and same_state(a.read(40), tuple(x[:, :9] for x in b.read(got[f])))
    c = paged(device, num_blocks=8, block_size=4, dtype=dtype, rope=rope)
    new, _ = c.load_sequence(paths[s2])                 # an empty sequence
    assert c.length(new) == 0 and c.free_blocks == 8
    new, _ = c.load_sequence(paths[s0])
    assert same_state(c.read(new), tuple(x[:, :12] for x in b.read(got[s0])))


def test_a_kvcache_file_loads_into_a_paged_sequence_and_back(device, rng, tmp_path):
    a = filled(device, rng, 13, dtype="int8")
    a.save(tmp_path / "kv.safetensors")
    p = paged(device, dtype="int8")
    sid, _ = p.load_sequence(tmp_path / "kv.safetensors")
    assert same_state(p.read(sid), a.read())
    p.save_sequence(sid, tmp_path / "seq.safetensors")
    b = kv_cache(device, dtype="int8")
    b.load(tmp_path / "seq.safetensors")
    assert same_bits(bits(a), bits(b))


def test_a_salted_sequence_keeps_its_salt_through_save_and_load(device, rng, tmp_path):
    """The prefix cache's salt survives save / load: the loaded sequence's full blocks match
    requests of its salt only (they came back unsalted, so another salt's -- or no salt's --
    request with the same ids was handed this salt's K/V); an explicit ``salt=`` is checked
    against the file's (CacheFileMismatchError naming it, nothing changed) and supplies one
    where the file keeps none (a KVCache's file)."""
    ids = list(range(100, 112))
    p = paged(device)
    a = p.add_sequence(token_ids=[], salt="adapter-A")
    x = rand(rng, HKV, 12, D)
    p.append([a], x, rand(rng, HKV, 12, DV), n_new=[12], token_ids=[ids])
    assert p.match_prefix(ids + [1], salt="adapter-A") == 10 and p.match_prefix(ids + [1]) == 0
    p.save_sequence(a, tmp_path / "a.safetensors", token_ids=ids)
    q = paged(device)
    with pytest.raises(vkattn.CacheFileMismatchError, match="another salt") as e:
        q.load_sequence(tmp_path / "a.safetensors", salt="adapter-B")
    assert e.value.field == "salt" and q.sequences == [] and q.free_blocks == q.num_blocks
    sid, got = q.load_sequence(tmp_path / "a.safetensors")
    assert got.tolist() == ids and same_state(q.read(sid), p.read(a))
    assert q.match_prefix(ids + [1], salt="adapter-A") == 10
    assert q.match_prefix(ids + [1]) == 0 and q.match_prefix(ids + [1], salt="adapter-B") == 0
    q.load_sequence(tmp_path / "a.safetensors", salt="adapter-A")        # the file's own salt: fine
    # a KVCache's file keeps no salt: ``salt=`` gives its blocks one
    k = filled(device, rng, 12)
    k.save(tmp_path / "kv.safetensors", token_ids=ids)
    r = paged(device)
    r.load_sequence(tmp_path / "kv.safetensors", salt=b"adapter-C")
    assert r.match_prefix(ids + [1], salt=b"adapter-C") == 10 and r.match_prefix(ids + [1]) == 0


def test_an_empty_sequence_saves_with_its_empty_token_ids(device, tmp_path):
    """``token_ids=[]`` -- what token_ids() gives for an empty sequence -- saves and loads (numpy
    reads [] as float64: it was a TypeError about a dtype the caller never gave)."""
    p = paged(device)
    s = p.add_sequence(token_ids=[])
    p.save_sequence(s, tmp_path / "e.safetensors", token_ids=p.token_ids(s))
    sid, got = p.load_sequence(tmp_path / "e.safetensors")
    assert p.length(sid) == 0 and got.tolist() == []
    kv_cache(device).save(tmp_path / "k.safetensors", token_ids=[])
    with pytest.raises(TypeError, match="expected integers"):
        p.save_sequence(s, tmp_path / "f.safetensors", token_ids=[0.5])     # a float id: still refused


# ---------------------------------------------------------------------- errors

@pytest.fixture
def saved(device, tmp_path):
    """An int8 cache file with token ids (every tensor kind), and a cache it loads into."""
    rng = np.random.default_rng(5)
    a = filled(device, rng, 6, dtype="int8", rope=ROPES["neox16"])
    path = tmp_path / "a.safetensors"
    a.save(path, token_ids=[5, 4, 3, 2, 1, 0])
    target = filled(device, rng, 4, dtype="int8", rope=ROPES["neox16"])
    return path, target


@pytest.mark.parametrize("field,kw", [
    ("dtype", dict(dtype="float16")),
    ("num_kv_heads", dict(num_kv_heads=1)),
    ("head_dim", dict(head_dim=32)),
    ("v_head_dim", dict(v_head_dim=24)),
    ("rope", dict(rope=None)),
    ("rope", dict(rope=vkattn.RoPE(style="gptj", rotary_dim=16))),
    ("rope", dict(rope=vkattn.RoPE(style="neox", rotary_dim=24))),
    ("rope", dict(rope=vkattn.RoPE(style="neox", base=10001.0, rotary_dim=16))),
])
def test_a_file_for_other_settings_is_refused_naming_the_setting(device, rng, tmp_path, saved, field, kw):
    path, _ = saved
    kw = dict(dict(dtype="int8", rope=ROPES["neox16"]), **kw)
    c = filled(device, rng, 3, **kw)
    before = state(c)
    with pytest.raises(vkattn.CacheFileMismatchError, match=field) as e:
        c.load(path)
    assert e.value.field == field
    assert same_state(state(c), before)
    p = vkattn.PagedKVCache(8, 4, kw.get("num_kv_heads", HKV), kw.get("head_dim", D),
                            v_head_dim=kw.get("v_head_dim", DV), dtype=kw["dtype"], device=device, rope=kw["rope"])
    p.add_sequence()
    before = state(p)
    with pytest.raises(vkattn.CacheFileMismatchError, match=field):
        p.load_sequence(path)
    assert same_state(state(p), before)


def rewrite(path, out, meta_change=None, tensor_change=None):
    """A copy of a vkattn file with its metadata or tensors changed and a valid checksum: a file
    another writer (or another version) could have made."""
    from safetensors import safe_open
    from safetensors.numpy import save_file
    with safe_open(str(path), framework="np") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta.update(meta_change or {})
    if tensor_change:
        tensors = tensor_change(tensors)
    meta["checksum"] = persist.checksum(meta, tensors)
    save_file(tensors, str(out), metadata=meta)
    return out


def test_another_format_version_or_kind_is_refused(saved, tmp_path):
    path, c = saved
    before = state(c)
    with pytest.raises(vkattn.CacheFileMismatchError, match="format version '2'") as e:
        c.load(rewrite(path, tmp_path / "v2.safetensors", {"format_version": "2"}))
    assert e.value.field == "format_version"
    with pytest.raises(vkattn.CacheFileMismatchError, match="vkattn.hf_cache") as e:
        c.load(rewrite(path, tmp_path / "hf.safetensors", {"format": "vkattn.hf_cache"}))
    assert e.value.field == "format"
    assert same_state(state(c), before)


def test_a_file_longer_than_the_capacity_or_the_free_blocks(device, rng, saved):
    path, _ = saved
    c = filled(device, rng, 2, dtype="int8", rope=ROPES["neox16"], capacity=5)
    before = state(c)
    with pytest.raises(vkattn.CacheFullError, match="6 positions, more than capacity 5"):
        c.load(path)
    assert same_state(state(c), before)
    p = vkattn.PagedKVCache(3, 2, HKV, D, v_head_dim=DV, dtype="int8", device=device, rope=ROPES["neox16"])
    s = p.add_sequence()
    grow(p, rng, s, 1)                              # 2 blocks free, the file needs 3
    before = state(p)
    with pytest.raises(vkattn.CacheFullError, match="6 positions, 3 blocks of 2"):
        p.load_sequence(path)
    assert same_state(state(p), before) and p.sequences == [s]
    with pytest.raises(ValueError, match="already in the pool"):
        p.load_sequence(path, seq_id=s)
    assert same_state(state(p), before)


def test_a_truncated_file_is_refused(saved, tmp_path):
    path, c = saved
    data = path.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    before = state(c)
    cuts = sorted({0, 1, 7, 8, 9, header // 2, header - 1, header, header + 1, (header + len(data)) // 2,
                   len(data) - 1})
    for cut in cuts:
        bad = tmp_path / f"cut{cut}.safetensors"
        bad.write_bytes(data[:cut])
        with pytest.raises(vkattn.CacheFileCorruptError, match="not a readable safetensors file"):
            c.load(bad)
    bad.write_bytes(data + b"\0")                   # something appended is damage too
    with pytest.raises(vkattn.CacheFileCorruptError):
        c.load(bad)
    assert same_state(state(c), before)


def test_every_flipped_byte_is_refused(saved, tmp_path):
    """One bit flipped anywhere -- the length prefix, the header (tensor table, metadata, the
    checksum itself, padding) or any tensor byte -- is refused, the cache unchanged."""
    path, c = saved
    data = path.read_bytes()
    before = state(c)
    bad = tmp_path / "flipped.safetensors"
    kinds = {}
    for i in range(len(data)):
        flipped = bytearray(data)
        flipped[i] ^= 0x01
        bad.write_bytes(bytes(flipped))
        with pytest.raises(vkattn.CacheFileError) as e:
            c.load(bad)
        kinds[type(e.value).__name__] = kinds.get(type(e.value).__name__, 0) + 1
        assert c.length == 4
    assert kinds.get("CacheFileCorruptError", 0) > len(data) // 2    # mostly: unreadable or the checksum
    assert same_state(state(c), before)


def test_a_damaged_tensor_byte_fails_the_checksum(saved, tmp_path):
    path, c = saved
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40                               # inside the last tensor's data
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(vkattn.CacheFileCorruptError, match="checksum mismatch"):
        c.load(bad)
    with pytest.raises(vkattn.CacheFileCorruptError, match="checksum mismatch"):
        vkattn.cache_file_info(bad)


def test_files_that_disagree_with_their_own_metadata(saved, tmp_path):
    path, c = saved
    before = state(c)
    cases = [
        ({"length": "7"}, None, "tensor 'k' is int8 \\(2, 6, 24\\); its metadata says int8 \\(2, 7, 24\\)"),
        ({"length": "six"}, None, "'length' missing or not an integer"),
        (None, lambda t: {k: v for k, v in t.items() if k != "v_scale"}, "'v_scale' is missing"),
        (None, lambda t: dict(t, extra=np.zeros(1, np.float32)), "unexpected tensors \\['extra'\\]"),
        (None, lambda t: dict(t, k=t["k"].astype(np.float16)), "tensor 'k' is float16"),
        (None, lambda t: dict(t, token_ids=t["token_ids"][:5]), "tensor 'token_ids'"),
    ]
    for i, (meta, tensors, match) in enumerate(cases):
        with pytest.raises(vkattn.CacheFileCorruptError, match=match):
            c.load(rewrite(path, tmp_path / f"m{i}.safetensors", meta, tensors))
    from safetensors.numpy import save_file                 # a safetensors file, not a vkattn one
    save_file({"k": np.zeros(3, np.float32)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(vkattn.CacheFileCorruptError, match="no vkattn metadata"):
        c.load(tmp_path / "plain.safetensors")
    assert same_state(state(c), before)


def test_bad_arguments(device, rng, saved, tmp_path):
    path, c = saved
    before = state(c)
    with pytest.raises(FileNotFoundError):
        c.load(tmp_path / "missing.safetensors")
    with pytest.raises(TypeError, match="path: expected a str or os.PathLike"):
        c.load(3)
    with pytest.raises(TypeError, match="path"):
        c.save(None)
    out = tmp_path / "never.safetensors"
    for ids, err, match in [([1, 2], ValueError, r"token_ids: expected shape \(4,\)"),
                            (np.zeros(4), TypeError, "token_ids: expected integers, got dtype float64"),
                            ([0, 1, -2, 3], ValueError, "token_ids: expected ids in"),
                            ("abcd", TypeError, "token_ids")]:
        with pytest.raises(err, match=match):
            c.save(out, token_ids=ids)
    assert not out.exists()
    p = paged(device)
    with pytest.raises(vkattn.UnknownSequenceError):
        p.save_sequence(3, out)
    assert not out.exists()
    assert same_state(state(c), before)
    c.close()
    with pytest.raises(vkattn.CacheClosedError):
        c.save(out)
    with pytest.raises(vkattn.CacheClosedError):
        c.load(path)


# ---------------------------------------------------------------------- vkattn.hf

@pytest.fixture(scope="module")
def hf():
    torch = pytest.importorskip("torch", reason="the hf extra is not installed (make setup-hf)")
    transformers = pytest.importorskip("transformers", minversion=TRANSFORMERS_MIN, reason=HF_SKIP)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import vkattn.hf

    def model(layers=2, window=None):
        cfg = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.2,
                   max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        config = (transformers.MistralConfig(sliding_window=window, **cfg) if window
                  else transformers.LlamaConfig(**cfg))
        m = transformers.AutoModelForCausalLM.from_config(config).eval()
        m.generation_config.eos_token_id = None
        m.set_attn_implementation("vkattn")
        return m
    return torch, vkattn.hf, model


def hf_state(cache):
    out = []
    for layer in cache.layers:
        rows = [(kv.read() if isinstance(kv, vkattn.KVCache) else kv.read(s)) for kv, s in
                ([(layer._store.cache, None)] if hasattr(layer._store, "cache") else
                 [(layer._store.pool, s) for s in layer._store.ids])]
        out.append((layer._seen, layer._pad.tolist(), rows))
    return out


def run(torch, model, ids, mask, cache, new=6):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new, do_sample=False,
                              output_scores=True, return_dict_in_generate=True)


@pytest.mark.parametrize("dtype,batch,load_batch", [("float32", 1, 1), ("int8", 1, 3), ("float16", 3, 4)])
def test_hf_cache_round_trip_then_generate_goes_on_identically(hf, tmp_path, dtype, batch, load_batch):
    torch, vhf, make = hf
    model = make()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 211, (batch, 9), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:                   # left padding: not stored, restored as padding
        mask[1, :4] = 0
        ids[1, :4] = 0
    a = vhf.VkattnCache(model.config, 40, batch_size=batch, dtype=dtype)
    first = run(torch, model, ids, mask, a)
    seen = a.get_seq_length()
    path = tmp_path / "hf.safetensors"
    a.save(path, token_ids=first.sequences[:, :seen])
    b = vhf.VkattnCache(model.config, 40, batch_size=load_batch, dtype=dtype)
    run(torch, model, torch.randint(3, 211, (1, 5), generator=g), None, b, new=2)    # something to replace
    tok = b.load(path)
    assert np.array_equal(tok, first.sequences[:, :seen].numpy()) and b.get_seq_length() == seen
    assert same_state(hf_state(a), hf_state(b))
    assert vkattn.cache_file_info(path)["format"] == "vkattn.hf_cache"
    go_mask = torch.cat([mask, torch.ones_like(first.sequences[:, 9:])], dim=1)
    ra = run(torch, model, first.sequences, go_mask, a)
    rb = run(torch, model, first.sequences, go_mask, b)
    assert torch.equal(ra.sequences, rb.sequences)
    assert all(torch.equal(x, y) for x, y in zip(ra.scores, rb.scores))


def test_hf_cache_errors_leave_it_unchanged(hf, tmp_path):
    torch, vhf, make = hf
    model = make()
    ids = torch.randint(3, 211, (2, 7), generator=torch.Generator().manual_seed(4))
    a = vhf.VkattnCache(model.config, 20, batch_size=2, dtype="float32")
    run(torch, model, ids, None, a, new=3)
    path = tmp_path / "hf.safetensors"
    a.save(path)
    with pytest.raises(ValueError, match=r"token_ids: expected shape \(2, 9\)"):
        a.save(tmp_path / "x.safetensors", token_ids=ids)
    target = vhf.VkattnCache(model.config, 20, batch_size=2, dtype="float32")
    run(torch, model, ids[:, :5], None, target, new=1)
    before = hf_state(target)
    cases = [
        (vhf.VkattnCache(make(layers=3).config, 20, batch_size=2, dtype="float32"), vkattn.CacheFileMismatchError,
         "3 in this cache"),
        (vhf.VkattnCache(model.config, 20, batch_size=2, dtype="int8"), vkattn.CacheFileMismatchError, "dtype"),
        (vhf.VkattnCache(make(window=4).config, 20, batch_size=2, dtype="float32"), vkattn.CacheFileMismatchError,
         "sliding window None in the file, 4"),
        (vhf.VkattnCache(model.config, 8, batch_size=2, dtype="float32"), vkattn.CacheFullError, "max_cache_len=8"),
        (vhf.VkattnCache(model.config, 20, batch_size=1, dtype="float32"), vkattn.CacheFullError, "batch_size=1"),
    ]
    for other, err, match in cases:
        other_before = hf_state(other)
        with pytest.raises(err, match=match):
            other.load(path)
        assert same_state(hf_state(other), other_before)
    kv = tmp_path / "kv.safetensors"
    vkattn.KVCache(4, 2, 16, device=target.layers[0]._store.kv.device).save(kv)
    with pytest.raises(vkattn.CacheFileMismatchError, match="vkattn.sequence"):
        target.load(kv)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(vkattn.CacheFileCorruptError, match="checksum mismatch"):
        target.load(bad)
    bad.write_bytes(bytes(data[:len(data) // 3]))
    with pytest.raises(vkattn.CacheFileCorruptError, match="not a readable"):
        target.load(bad)
    bad = rewrite(path, tmp_path / "pads.safetensors",
                  {"layers": json.dumps([{"seen": 9, "pad": [10, 0], "window": None}] * 2)})
    with pytest.raises(vkattn.CacheFileCorruptError, match="malformed layer metadata"):
        target.load(bad)
    assert same_state(hf_state(target), before)
    target.load(path)                               # and the good file still loads
    assert same_state(hf_state(target), hf_state(a))
