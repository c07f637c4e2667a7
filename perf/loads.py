"""Load cost: what one 32-bit word read from a storage buffer (or a uniform texel buffer) costs in a
shader on this device,
streamed the way the lane kernel streams the K/V cache (``perf/loads.comp``), and the decode time
that cost alone implies for the perf shape at L=4096. On lavapipe every storage-buffer load is a
scalar loop over the subgroup's lanes, so this, not memory bandwidth, bounds decode there; the
third case reads the same words at addresses uniform across the subgroup (Mesa 22.3's lavapipe
still loops over the lanes for those). Where the device can bind texel buffers (the patched kp), a
case reads the same stream by texelFetch from a uniform texel buffer: lavapipe gathers those with
vector instructions (examples/llama_device reads its weights so).

numpy is the same bytes reduced on the CPU (``np.bitwise_xor.reduce``), the ``x numpy`` column
the ratio. Checked: the shader's xor of what each lane read equals numpy's.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from vkattn.compiler import compile_shader

from .common import Row, Shape, selected, time_calls

WORDS = 1 << 22          # 16 MiB: about the K/V bytes of one decode step at L=4096 (float16)
ITERS = 1024


def run(shape: Shape, device) -> list:
    rows = []
    be = device.backend
    wg = device.lane_subgroup() or device.subgroup_size
    groups = WORDS // (4 * ITERS * wg)
    rng = np.random.default_rng(5)
    data = rng.integers(0, 2**32, WORDS, dtype=np.uint32)
    lanes = data.reshape(groups, ITERS, wg, 4)
    want = np.bitwise_xor.reduce(np.bitwise_xor.reduce(lanes, axis=3), axis=1).reshape(-1)
    buf = be.buffer(WORDS, np.uint32, name="words")
    buf.view()[:] = data
    out = be.buffer(groups * wg, np.uint32, name="xor")
    up = be.recording().upload(buf).build()
    up.run()
    up.destroy()
    kv_words = 2 * shape.kv_heads * shape.head_dim * 4096 // 2        # float16 K and V at L=4096
    cases = [(0, "uvec4", {}), (1, "uint", {}), (2, "uvec4 at subgroup-uniform addresses", {})]
    if device.texel_buffers:            # the patched kp binds a usamplerBuffer as a uniform texel buffer
        cases.insert(1, (0, "uvec4 from a texel buffer", {"TEXEL": 1}))
    for mode, what, defines in cases:
        name = f"loads {what} x{wg} lanes, 16 MiB"
        if not selected(name):
            continue
        spv = compile_shader("loads", defines, src_dir=Path(__file__).parent)
        prog = be.program(spv, [buf, buf, out], (groups, 1, 1), [wg, mode, ITERS], writes=(2,), name="loads")
        rec = be.recording().dispatch(prog).download(out).build(timestamps=True)
        stamps = []

        def call():
            rec.run()
            stamps.append(rec.timings(device.info.timestamp_period)[0][1])
        call()
        ok = bool(np.array_equal(out.view(), want))
        t = time_calls(call, shape.iters, shape.warmup)
        dev_ms = float(np.median(stamps[-shape.iters:]))
        tr = time_calls(lambda: np.bitwise_xor.reduce(data), shape.iters, shape.warmup)
        ns_word = dev_ms * 1e6 / WORDS
        rows.append(Row(case=name, kernel="loads", shape=f"{WORDS} words, subgroup {wg}",
                        vkattn_ms=t["median_ms"], vkattn_min_ms=t["min_ms"], numpy_ms=tr["median_ms"],
                        speedup_vs_numpy=tr["median_ms"] / t["median_ms"], metric="ns/word", value=ns_word,
                        verified=ok, device_ms=dev_ms,
                        extra={"decode_L4096_floor_ms": ns_word * kv_words * 1e-6, "words": WORDS}))
        rec.destroy()
        prog.destroy()
    buf.destroy()
    out.destroy()
    return rows
