"""Buffer bounds sweep: odd shapes, every storage dtype, every variant, paged batches, every kernel.

Each case is an ordinary parity test against the numpy reference, and the module is also the
GPU-assisted-validation pass of `make test-validation` (scripts/validation.sh runs it under the
Khronos layer with `gpuav_buffer_oob`, once per kernel, and fails on any message): every kernel
dispatch -- attn.comp, attn_lane.comp, attn_coopmat.comp (where the device has cooperative
matrices), append.comp, gather_slots.comp, copy_rows.comp, scatter_slots.comp -- must stay inside
every buffer it is bound to. Out-of-bounds reads do not show in results on lavapipe (the bytes
past a buffer are there, or read as zero), so the validation pass is what catches
them; the shapes are chosen so that a stray read leaves its buffer: the masks end at the very
last word of the aux buffer (issue 20 finding 5: mask words of padded query rows were read past
it), query tiles have padding rows and padding heads, head dims are not multiples of a storage
word. The pipelines are few (every variant at once per call) and their tiles small (query rows
x heads per workgroup at most 8 or so: the lane kernel's key block is unrolled over them) so the
pass stays short: GPU-AV instruments every buffer access, and lavapipe compiles each instrumented
pipeline cold (a 16-query-vector lane prefill took 50 s on this 2-core machine).
"""
import kp
import numpy as np
import pytest

import vkattn
from conftest import Mirror, assert_close
from vkattn._attn import AttnPlan, aux_bucket
from vkattn.reference import attention, rope, round_to

KERNELS = ["lane", "tile", "coopmat"]    # coopmat: prefill and chunks (decode: the device's other kernel)
LSE_TOL = dict(atol=2e-5, rtol=2e-4)

# The cases scripts/validation.sh runs under GPU-assisted validation (`-m gpuav`; every case here
# also runs as a parity test in the suite). Mesa 22.3's lavapipe compiles each instrumented
# pipeline cold in 1-5 min apiece on a 2-core machine without AVX-512 (Mesa 26's, where CI runs the
# sweep since session 23, in seconds to 2 min), so the sweep takes each buffer-access pattern once:
# - every storage layout on both kernels' odd-shape case: 32-bit (float32), 16-bit (float16;
#   bfloat16 reads the same words), bytes with a row scale (int8), bytes with a head scale
#   (fp8_e4m3; e5m2 differs in arithmetic only), 4-bit blocks with their scale inside the row (q4)
#   (lane float32 and fp8 joined in session 23: 15 s and 18 s of instrumented compiling on Mesa
#   26, where fp8's alone had taken 12 min on Mesa 22.3 in session 18);
# - the variants' own buffers (mask words, ALiBi slopes, sinks, the aux block) with float16 and
#   float32 (test_every_variant_odd_shapes turns them on there only; they do not depend on storage);
# - paged block tables: float16 on the lane kernel, int8 (row scales through the table) on tile;
# - the mask ending at the aux buffer's last word: per head on both kernels, group 3 (padding query
#   vectors) on tile;
# - attn_coopmat.comp's float16, int8 and fp8_e4m3 cases where the device has cooperative matrices
#   (Mesa 26).
GPUAV_SWEEP = {
    "test_every_variant_odd_shapes": ["lane-float16", "lane-float32", "lane-int8", "lane-fp8_e4m3", "lane-q4",
                                      "tile-float16", "tile-float32", "tile-int8", "tile-fp8_e4m3", "tile-q4",
                                      "coopmat-float16", "coopmat-int8", "coopmat-fp8_e4m3"],
    "test_paged_batch_fork_read": ["lane-float16", "tile-int8", "coopmat-float16", "coopmat-int8"],
    "test_mask_at_the_end_of_aux": ["lane-2-2-64-3-True", "tile-2-2-64-3-True", "tile-1-3-24-2-True",
                                    "coopmat-1-3-24-2-True"],
    "test_device_mask_at_the_end_of_aux": ["tile-2-2-64-3-True"],     # mask_copy.comp's writes into aux
}


@pytest.fixture(scope="module")
def _one_more_submission(device):
    """A 4-float upload recorded once (kp itself: with lavapipe's host-visible memory a vkattn
    round trip submits nothing), submitted again by each case."""
    a = vkattn.DeviceArray((4,), device)
    return a, a.manager.sequence().record(kp.OpTensorSyncDevice([a.tensor]))


@pytest.fixture(autouse=True)
def _last_dispatch_reported(_one_more_submission):
    """One more queue submission after each case: Debian 13's GPU-assisted validation (1.4.309)
    reports a submission's out-of-bounds accesses when the queue next submits, and one left for
    the process's exit sometimes went unreported (the probe: 1 run of 8 in session 23, about 1 of
    4 before; docs/platforms.md); so a case's last dispatch is checked within the case."""
    yield
    _one_more_submission[1].eval()


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch):
    monkeypatch.setenv("VKATTN_KERNEL", request.param)
    return request.param


def past_filling_aux(s, hq, per_head, lo):
    """The smallest past >= lo for which a KVCache call of s new rows (one query tile) with a mask
    has its mask end closer to the end of the aux buffer than one mask row: a padding row's mask
    words would then lie past the buffer. (aux_need counts 2*s + hq words besides the header,
    sequence record and mask; the tile table takes 2 of them.)"""
    for past in range(lo, lo + 100000):
        need = AttnPlan.aux_need(1, s, hq, 0, (hq if per_head else 1) * s * (past + s))
        if aux_bucket(need) - need + 2 * s + hq < past + s:
            return past
    raise AssertionError("no such past")


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("hkv,group,d,s,per_head", [
    (2, 2, 64, 3, True),            # a per-head mask ending near the aux buffer's last word
    (2, 2, 64, 3, False),           # a broadcast one (issue 20 finding 5: 137 cached + 7 new rows)
    (1, 3, 24, 2, True),            # group 3: the tile kernel has padding query vectors past G heads
])
def test_mask_at_the_end_of_aux(device, rng, kernel, hkv, group, d, s, per_head):
    hq = hkv * group
    past = past_filling_aux(s, hq, per_head, 100)
    cache = vkattn.KVCache(past + s + 3, hkv, d, dtype="float16", device=device)
    mirror = Mirror(cache)
    k, v = rand(rng, hkv, past, d), rand(rng, hkv, past, d)
    cache.append(k, v)
    mirror.append(k, v)
    k, v, q = rand(rng, hkv, s, d), rand(rng, hkv, s, d), rand(rng, hq, s, d)
    mask = rand(rng, *((hq,) if per_head else ()), s, past + s)
    out, lse = cache.forward(q, k, v, mask=mask, return_lse=True)
    mirror.append(k, v)
    ref, ref_lse = attention(q, mirror.k, mirror.v, mask=mask, return_lse=True)
    assert_close(out, ref, "float16")
    np.testing.assert_allclose(lse, ref_lse, **LSE_TOL)


@pytest.mark.parametrize("hkv,group,d,s,per_head", [(2, 2, 64, 3, True), (1, 3, 24, 2, False)])
def test_device_mask_at_the_end_of_aux(device, rng, kernel, hkv, group, d, s, per_head):
    """The same with the mask a DeviceArray 5 columns wider than the keys: shaders/mask_copy.comp
    writes its words up to the aux buffer's last one and reads only the columns it needs."""
    hq = hkv * group
    past = past_filling_aux(s, hq, per_head, 100)
    cache = vkattn.KVCache(past + s + 3, hkv, d, dtype="float16", device=device)
    k, v = rand(rng, hkv, past, d), rand(rng, hkv, past, d)
    cache.append(k, v)
    k2, v2, q = rand(rng, hkv, s, d), rand(rng, hkv, s, d), rand(rng, hq, s, d)
    wide = rand(rng, *((hq,) if per_head else ()), s, past + s + 5)
    out, lse = cache.forward(q, k2, v2, mask=vkattn.to_device(wide, device), return_lse=True)
    ks, vs = cache.read()
    ref, ref_lse = attention(q, ks, vs, mask=wide[..., :past + s], return_lse=True)
    assert_close(out, ref, "float16")
    np.testing.assert_allclose(lse, ref_lse, **LSE_TOL)


# float32, bfloat16 and q4 storage are not attn_coopmat.comp's (they fall back to the lane/tile
# kernel, swept there): those pairs are not generated. fp8_e5m2 shares e4m3's every buffer access
# (the format define changes the arithmetic only)
@pytest.mark.parametrize("kernel,dtype", [(k, dt) for dt in ("float16", "float32", "int8", "bfloat16", "fp8_e4m3", "q4")
                                          for k in KERNELS
                                          if not (k == "coopmat" and dt in ("float32", "bfloat16", "q4"))],
                         indirect=["kernel"])
def test_every_variant_odd_shapes(device, rng, kernel, dtype, tmp_path):
    # head_dim 37 / v_head_dim 29: rows end inside a storage word; RoPE on 16 of 37 dims; window +
    # sinks + softcap + ALiBi + mask in one call (one pipeline; float16 and float32 only: those
    # buffers do not depend on the storage format, and they double an instrumented pipeline's
    # compile), with the log-sum-exp; append.comp
    # (append), a prefill with a past whose tile has padding rows, split-K decode steps with a
    # per-head mask, read() (gather_slots.comp), save and load (scatter_slots.comp)
    hkv, group, d, dv = 2, 2, 37, 29
    hq = hkv * group
    # int8, q4 and fp8 without RoPE: their rotated quantising stores multiplies the instrumented loads, and
    # lavapipe builds every compute shader as an LLVM coroutine whose frame analysis grows with the
    # blocks GPU-AV adds (7.4 min for this case cold with RoPE); RoPE's reads are covered by the others
    rotary = 0 if dtype in ("int8", "q4", "fp8_e4m3") else 16
    variants = dtype in ("float16", "float32")
    cfg = vkattn.RoPE(style="neox", rotary_dim=rotary) if rotary else None
    scales = dict(k_scale=[0.5, 3.0], v_scale=[2.0, 0.25]) if dtype.startswith("fp8") else {}   # per kv head
    cache = vkattn.KVCache(300, hkv, d, v_head_dim=dv, dtype=dtype, device=device, rope=cfg, **scales)
    slopes = np.linspace(0.02, 0.4, hq).astype(np.float32)
    cache.append(rand(rng, hkv, 93, d), rand(rng, hkv, 93, dv))

    def call(s, mask_heads):
        k, v, q = rand(rng, hkv, s, d), rand(rng, hkv, s, dv), rand(rng, hq, s, d)
        total = cache.length + s
        mask = rand(rng, *((hq,) if mask_heads else ()), s, total)
        mask[..., :: 7] = -np.inf
        kw = dict(window=19, n_sink=3, softcap=3.0, alibi_slopes=slopes, mask=mask) if variants else {}
        out, lse = cache.forward(q, k, v, rope_q=bool(rotary), return_lse=True, **kw)
        k_all, v_all = cache.read()
        qr = rope(q, np.arange(total - s, total), rotary_dim=rotary, style="neox") if rotary else q
        ref, ref_lse = attention(qr, k_all, v_all, return_lse=True, **kw)
        assert_close(out, ref, dtype)
        np.testing.assert_allclose(lse, ref_lse, **LSE_TOL)

    call(3, False)         # fused append, a query tile with a padding row
    call(1, True)          # decode: split-K merged by the last workgroup
    call(1, True)
    assert cache.read()[0].shape == (hkv, 98, d)
    # save and load (scatter_slots.comp) of rows that end inside a storage word: the same bits back
    cache.save(tmp_path / "odd.safetensors")
    other = vkattn.KVCache(100, hkv, d, v_head_dim=dv, dtype=dtype, device=device, rope=cfg, **scales)
    other.load(tmp_path / "odd.safetensors")
    assert all(np.array_equal(a, b) for a, b in zip(cache.read(), other.read()))


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_paged_batch_fork_read(device, rng, kernel, dtype):
    # ragged batch over blocks of 5 with per-sequence masks (the last one ends the aux buffer's
    # data), batch decode with per-head masks, a fork (copy_rows.comp), an append-only call
    # (append.comp), reads (gather_slots.comp)
    hkv, group, d = 2, 2, 24
    hq = hkv * group
    cache = vkattn.PagedKVCache(60, 5, hkv, d, dtype=dtype, device=device)
    sids = [cache.add_sequence() for _ in range(3)]
    model = {sid: (np.zeros((hkv, 0, d), np.float32), np.zeros((hkv, 0, d), np.float32)) for sid in sids}

    def add(sid, k, v):           # the stored rows, as the cache rounds them (int8: not mirrored)
        if dtype == "int8" or sid not in model:
            return
        mk, mv = model[sid]
        model[sid] = (np.concatenate([mk, round_to(k, dtype)], 1), np.concatenate([mv, round_to(v, dtype)], 1))

    def step(ids, counts, heads, **kw):
        total = sum(counts)
        q, k, v = rand(rng, hq, total, d), rand(rng, hkv, total, d), rand(rng, hkv, total, d)
        masks = [rand(rng, *((hq,) if heads else ()), n, cache.length(sid) + n) for sid, n in zip(ids, counts)]
        out, lse = cache.forward(ids, q, k, v, n_new=counts, mask=masks, return_lse=True, **kw)
        a = 0
        for sid, n, mask in zip(ids, counts, masks):
            rows = slice(a, a + n)
            k_sid, v_sid = cache.read(sid)
            ref, ref_lse = attention(q[:, rows], k_sid, v_sid, mask=mask, return_lse=True, **kw)
            assert_close(out[:, rows], ref, dtype)
            np.testing.assert_allclose(lse[:, rows], ref_lse, **LSE_TOL)
            add(sid, k[:, rows], v[:, rows])
            a += n

    k, v = rand(rng, hkv, 41, d), rand(rng, hkv, 41, d)
    cache.append(sids, k, v, n_new=[7, 22, 12])       # append.comp, no attention
    for sid, rows in zip(sids, (slice(0, 7), slice(7, 29), slice(29, 41))):
        add(sid, k[:, rows], v[:, rows])
    kw = dict(softcap=4.0, window=6, n_sink=2)        # the same variant throughout: two pipelines
    step(sids, [1, 2, 1], False, **kw)
    step(sids[::-1], [2, 1, 1], True, **kw)
    step(sids, [1, 1, 1], True, **kw)
    child = cache.fork(sids[1])                       # a partial last block: copied on the device
    k, v = rand(rng, hkv, 2, d), rand(rng, hkv, 2, d)
    cache.append([child, sids[0]], k, v, n_new=[1, 1])
    step([child, sids[2]], [1, 1], False, **kw)
    if dtype != "int8":
        for sid in sids[1:]:
            k_sid, v_sid = cache.read(sid)
            assert np.array_equal(k_sid, model[sid][0]) and np.array_equal(v_sid, model[sid][1])
    assert np.array_equal(cache.read(child)[0][:, :cache.length(sids[1])], cache.read(sids[1])[0])


@pytest.mark.parametrize("kernel", ["lane", "tile"])
def test_scratch_buffers_within_the_devices_buffer_limit(device, rng, monkeypatch, kernel):
    """A plan's scratch buffers stay within the device's per-buffer limit (Device.max_buffer_bytes,
    made small here: on a GPU, 512 sequences of 64 heads d128 over 256 splits need 4 GiB of
    partials, one byte past 2**32 - 1): the partials by fewer key splits -- the result still the
    reference's -- and a call whose q or out cannot fit is a DeviceLimitError with nothing written."""
    monkeypatch.setenv("VKATTN_KERNEL", kernel)
    monkeypatch.setenv("VKATTN_DECODE_SPLITS", "8")
    free, cache = (vkattn.KVCache(700, 2, 32, dtype="float16", device=device) for _ in range(2))
    mirror = Mirror(cache)
    k, v = (rng.standard_normal((2, 600, 32)).astype(np.float32) for _ in range(2))
    for c in (free, cache, mirror):
        c.append(k, v)
    q = rng.standard_normal((4, 1, 32)).astype(np.float32)
    want = free.attend(q)
    assert [p.cfg.splits for p in free._plans.values() if hasattr(p, "cfg")] == [8]
    per_split = 4 * 1 * 32 * 4                          # heads x rows x dv floats
    monkeypatch.setattr(type(device), "max_buffer_bytes", property(lambda self: 3 * per_split + 100))
    out = cache.attend(q)                               # a plan made under the limit
    assert [p.cfg.splits for p in cache._plans.values() if hasattr(p, "cfg")] == [3]
    assert_close(out, attention(q, mirror.k, mirror.v), "float16")
    assert_close(out, want, "float16")
    monkeypatch.setattr(type(device), "max_buffer_bytes", property(lambda self: 4 * 32 * 4 * 20))
    with pytest.raises(vkattn.DeviceLimitError, match="pass fewer rows per call"):
        cache.forward(rng.standard_normal((4, 21, 32)).astype(np.float32), *(rng.standard_normal((2, 21, 32))
                                                                            .astype(np.float32) for _ in range(2)))
    assert cache.length == 600
    cache.close()
    free.close()
