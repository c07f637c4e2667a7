"""q4 K/V storage: blocks of 16 values per (kv head, position), each block 16 4-bit integers
q in 0 .. 15 and a parameter word (a float32 scale with 12 significant bits, the block's range
over 15 rounded up, and a 13-bit integer zero point z), value = (q - z) * scale (vkattn.reference.quantize_q4, integer arithmetic in shaders/common.glsl), the parameter
words in the row after its data words; every kernel that reads the cache dequantises a block as
(q - z) * scale.

Parity: the device result against the reference computed on the values the cache holds -- read
back, and checked bit for bit against reference.round_to(x, "q4") -- with the float32
tolerances. Head dims that are and are not multiples of 32 (a last partial block), odd lengths,
GQA, both kernels, split-K decode, prefill, chunks over a past, forks, prefix sharing and
cascade, persistence; non-finite input refused with nothing written. Adversarial rounding cases
are in test_exact.py.
"""
import numpy as np
import pytest

import vkattn
from conftest import append_chunk_decode, assert_close, rand_kv, rand_q
from kv_formats import (bits, cascade_and_prefix_cache, lengths_prefill_and_long_decode, paged_batch_fork_and_variants,
                        planner_never_picks_coopmat, rope_rounded_after_rotation)
from vkattn.reference import (Q4_ZMAX, attention, dequantize_q4, q4_split, q4_words, q4_words_to_float32, quantize_q4,
                              round_to)

KERNELS = ["lane", "tile"]


def assert_stored(stored, x):
    want = round_to(x, "q4")
    bad = np.argwhere(bits(stored) != bits(want))
    assert bad.size == 0, f"{len(bad)} stored values differ from round_to's, first at {bad[:4].tolist()}"


def test_reference_definition():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, 70)).astype(np.float32)      # 5 blocks of 16, the last partial
    x[0, 0, 16:32] = 0.0                                          # a zero block
    x[0, 1, :16] = 1e-39                                          # denormal values: a zero block
    x[1, 2, :16] = np.abs(x[1, 2, :16]) + 3                       # all positive: z < 0
    x[1, 3, :16] = -np.abs(x[1, 3, :16]) - 3                      # all negative: z > 15
    x[1, 4, :16] = 1000 + np.arange(16, dtype=np.float32) / 1024  # spread below 1/256 of the size
    q, p = quantize_q4(x)
    assert q.shape == (2, 5, 70) and q.dtype == np.uint8 and p.shape == (2, 5, 5) and p.dtype == np.uint32
    assert q.max() == 15 and q.min() == 0
    scale, z = q4_split(p)
    assert not (p[0, 0, 1] or p[0, 1, 0] or q[0, 1, :16].any() or q[0, 0, 16:32].any())
    assert z[1, 2, 0] < 0 and z[1, 3, 0] > 15 and np.abs(z).max() <= Q4_ZMAX
    assert not (scale.view(np.uint32) & 0xFFF).any()              # 12 significant bits
    xp = np.pad(x, ((0, 0), (0, 0), (0, 10))).reshape(2, 5, 5, 16)
    spread = xp.max(-1) - xp.min(-1)
    live = scale > 0
    wide = live & (spread * 256 > np.abs(xp).max(-1) * 1.01)
    ratio = scale[wide] * 15 / spread[wide]
    assert np.all(ratio >= 1 - 2.0 ** -20) and np.all(ratio < 1 + 2.0 ** -10)   # the range over 15, rounded up
    assert scale[1, 4, 0] * 15 * 256 >= 1000 and z[1, 4, 0] < -3800 # the bound on z decides
    assert np.array_equal(z[live], -np.rint(xp.min(-1)[live].astype(np.float64) / scale[live]))
    # every value within half a step of its level (up to the range's truncation), each level exact
    y = dequantize_q4(q, p)
    step = np.repeat(scale, 16, -1)[..., :70]
    assert np.all(np.abs(y - x) <= step * (0.5 + 2.0 ** -12) + (step == 0) * 1e-38)
    assert np.array_equal(y.astype(np.float64), (q.astype(np.float64) - np.repeat(z, 16, -1)[..., :70]) * step)
    assert np.array_equal(dequantize_q4(*quantize_q4(np.zeros((1, 1, 32), np.float32))), np.zeros((1, 1, 32)))
    # stored words: 3 data words (6 block slots: block 5 wholly past d), 2 parameter words
    w = q4_words(q, p)
    assert w.shape == (2, 5, 4 * (3 + 2)) and not w[..., 17:].any()   # block 5 (a zero block), 2 unused slots
    assert np.array_equal(w[..., 12:17], p)
    pad = (w[..., 8:12, None] >> (4 * np.arange(8, dtype=np.uint32)) & 0xF).reshape(2, 5, 32)
    assert np.array_equal(pad[..., 6:16], np.broadcast_to(z[..., 4:5], (2, 5, 10)))   # padding: the level of 0
    assert not pad[..., 16:].any()
    assert np.array_equal(bits(q4_words_to_float32(w, 70)), bits(y))
    with pytest.raises(ValueError, match="finite"):
        quantize_q4(np.full((1, 1, 4), np.inf, np.float32))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("hkv,group,d,dv,past", [(2, 4, 64, 64, 131), (1, 3, 37, 37, 57), (3, 1, 37, 72, 200),
                                                 (2, 4, 128, 128, 260), (8, 1, 72, 40, 0), (3, 1, 128, 64, 9)])
def test_q4_append_forward_decode(device, rng, monkeypatch, kernel, hkv, group, d, dv, past):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    cache = vkattn.KVCache(300, hkv, d, dv, dtype="q4", device=device)
    ks, vs, kf, vf, calls = append_chunk_decode(rng, cache, group, past)   # append, fused chunk, decode, attend
    assert_stored(ks, kf)
    assert_stored(vs, vf)
    for q, out, n in calls:
        assert_close(out, attention(q, ks[:, :n], vs[:, :n]), "q4")
    # quantised, and not to one scale per row: the stored values differ from int8's
    assert not np.array_equal(ks, kf) and not np.array_equal(ks, round_to(kf, "int8"))


@pytest.mark.parametrize("kernel", KERNELS)
def test_q4_lengths_prefill_and_long_decode(device, rng, monkeypatch, kernel):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    monkeypatch.setenv("VKATTN_DECODE_SPLITS", "8")
    lengths_prefill_and_long_decode(device, rng, "q4", 0.5)       # 4 bits a value: a loose bound


@pytest.mark.parametrize("kernel", KERNELS)
def test_q4_rope_is_quantised_after_rotation(device, rng, monkeypatch, kernel):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)

    def within(ks, rotated, cache):             # one step of the quantised rotation
        step = np.repeat(q4_split(quantize_q4(rotated)[1])[0], 16, axis=-1)[..., :48]
        assert np.all(np.abs(ks - round_to(rotated, "q4")) <= step * 1.0001)
    rope_rounded_after_rotation(device, rng, "q4", within)


@pytest.mark.parametrize("kernel", KERNELS)
def test_q4_paged_batch_fork_and_variants(device, rng, monkeypatch, kernel):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    paged_batch_fork_and_variants(device, rng, "q4")


def test_q4_cascade_and_prefix_cache(device, rng, monkeypatch):
    monkeypatch.setenv("VKATTN_CASCADE", "1")
    cascade_and_prefix_cache(device, rng, "q4", d=40)


def test_q4_save_load_round_trip(device, rng, tmp_path):
    cache = vkattn.KVCache(64, 2, 40, 72, dtype="q4", device=device)
    k, v = rand_kv(rng, cache, 37)
    k[0, 0, :4] = [0.0, -0.0, 1e-40, -1e9]                      # -0, a denormal, the block's max
    k[1, 2, 32:] = 0.0                                          # a zero (partial) block, then one past d
    cache.append(k, v)
    path = tmp_path / "q4.safetensors"
    cache.save(path, token_ids=np.arange(37))
    info = vkattn.cache_file_info(path)
    assert info["dtype"] == "q4" and info["length"] == 37
    from safetensors.numpy import load_file
    t = load_file(str(path))
    # the stored row words: 2 data words + 1 parameter word (K, d 40), 3 + 2 (V, d 72)
    assert t["k"].dtype == np.uint32 and t["k"].shape == (2, 37, 12) and t["v"].shape == (2, 37, 20)
    assert np.array_equal(t["k"], q4_words(*quantize_q4(k)))
    assert np.array_equal(t["v"], q4_words(*quantize_q4(v)))
    other = vkattn.KVCache(50, 2, 40, 72, dtype="q4", device=device)
    ids = other.load(path)
    assert ids.tolist() == list(range(37))
    for x, y in zip(cache.read(), other.read()):
        assert np.array_equal(bits(x), bits(y))
    q = rand_q(rng, cache, 2, 1)
    assert np.array_equal(cache.attend(q), other.attend(q))
    # a file of the earlier symmetric q4 blocks (no q4_layout) is refused, the cache unchanged
    from safetensors import safe_open
    from safetensors.numpy import save_file
    with safe_open(str(path), framework="np") as f:
        meta = {k: v for k, v in f.metadata().items() if k != "q4_layout"}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta["checksum"] = vkattn.persist.checksum(meta, tensors)
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata=meta)
    with pytest.raises(vkattn.CacheFileMismatchError, match="q4_layout") as e:
        other.load(tmp_path / "old.safetensors")
    assert e.value.field == "q4_layout" and other.length == 37
    with pytest.raises(vkattn.CacheFileMismatchError, match="dtype is q4 in the file but int8"):
        vkattn.KVCache(64, 2, 40, 72, dtype="int8", device=device).load(path)
    pool = vkattn.PagedKVCache(16, 8, 2, 40, 72, dtype="q4", device=device)
    sid, _ = pool.load_sequence(path)
    assert all(np.array_equal(bits(x), bits(y)) for x, y in zip(cache.read(), pool.read(sid)))


@pytest.mark.parametrize("kernel", KERNELS)
def test_q4_bad_input_refused(device, rng, monkeypatch, kernel):
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    cache = vkattn.KVCache(16, 1, 40, dtype="q4", device=device)
    k, v = rand_kv(rng, cache, 2)
    cache.append(k, v)
    before = [bits(x).copy() for x in cache.read()]
    for bad in (np.nan, np.inf, -np.inf):
        x = np.zeros((1, 1, 40), np.float32)
        x[0, 0, 33] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            cache.append(x, np.zeros_like(x))
        with pytest.raises(ValueError, match="NaN or Inf"):
            cache.forward(np.zeros((1, 1, 40), np.float32), np.zeros_like(x), x)
    with pytest.raises(ValueError):
        cache.append(np.zeros((1, 1, 39), np.float32), np.zeros((1, 1, 40), np.float32))
    with pytest.raises(TypeError, match="dtype"):
        vkattn.KVCache(16, 1, 40, dtype="int4", device=device)
    with pytest.raises(ValueError, match="only the fp8 formats"):
        vkattn.KVCache(16, 1, 40, dtype="q4", device=device, k_scale=0.5)
    assert cache.length == 2 and all(np.array_equal(bits(x), b) for x, b in zip(cache.read(), before))
    # values up to 2^126 are taken (the scale keeps float32's range); above, refused with nothing
    # written (a level half a step past its block could pass float32's largest value)
    big = np.full((1, 1, 40), 2.0 ** 126, np.float32)
    big[0, 0, 1] = -big[0, 0, 1]
    cache.append(big, -big)
    ks, vs = cache.read()
    assert np.all(ks[0, 2] == round_to(big, "q4")[0, 0]) and np.all(vs[0, 2] == -ks[0, 2])
    assert np.isfinite(ks).all() and np.abs(ks[0, 2] / big[0, 0] - 1).max() <= (1 + 2.0 ** -10) / 15   # half a step
    with pytest.raises(ValueError, match=r"q4 range \(\|x\| > 8.50705"):
        cache.append(np.nextafter(big, np.float32(np.inf)), big)
    assert cache.length == 3


def test_q4_memory_and_format_table(device):
    f16 = vkattn.KVCache(1024, 8, 128, dtype="float16", device=device)
    q4 = vkattn.KVCache(1024, 8, 128, dtype="q4", device=device)
    # d 128: 4 data words of 16 bytes (8 blocks) and 2 16-byte parameter words per row: 96 bytes
    # against 256
    assert q4.bytes_per_token == 8 * 2 * 96 and f16.bytes_per_token == 8 * 2 * 256
    assert q4._ch == 8 and q4._dk4 == 4 and q4._rk4 == 6 and q4._defines == {"KV_F16": 0, "KV_I8": 0, "KV_Q4": 1}
    assert not q4._matrices and q4.k_scale is None
    odd = vkattn.KVCache(16, 1, 37, 72, dtype="q4", device=device)
    assert (odd._dk4, odd._rk4, odd._dv4, odd._rv4) == (2, 3, 3, 5)


def test_planner_never_picks_coopmat_for_q4(device, monkeypatch):
    planner_never_picks_coopmat(device, monkeypatch, "q4", "KV_Q4")