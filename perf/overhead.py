"""Per-step overhead: decode at a tiny context vs a bare Kompute round trip in the same run.

The bare round trip is the floor any Vulkan call from Python pays here: one recorded sequence
(upload 64 bytes, one trivial dispatch copying 64 bytes, download 64 bytes) re-evaluated.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np

import vkattn
from vkattn.compiler import compile_shader
from vkattn.reference import attention, round_to

from .common import Row, Shape, check, env_int, env_int_list, selected, time_calls


def bare_round_trip(device):
    """(run, destroy): a recorded bare round trip and the function that frees it."""
    be = device.backend
    src, dst = be.buffer(16, np.uint32, name="src"), be.buffer(16, np.uint32, name="dst")
    params = be.buffer(5, np.uint32, name="params")
    params.view()[:] = (4, 0, 1, 2, 3)
    unused = [be.buffer(1, np.float32, name="unused") for _ in range(4)]
    # gather_slots.comp as a plain copy of 4 uvec4 words (one kv head, slot = row)
    prog = be.program(compile_shader("gather_slots"), [src, src, dst, dst, params] + unused, (1, 1, 1),
                      [64, 1, 1], writes=(2, 3, 7, 8), name="copy")
    rec = be.recording().upload(src, params).dispatch(prog).download(dst).build()

    def destroy():
        for o in [rec, prog, src, dst, params] + unused:
            o.destroy()
    return rec.run, destroy


def bare_round_trip_ms(device, iters: int, warmup: int) -> dict:
    run, destroy = bare_round_trip(device)
    t = time_calls(run, iters, warmup)
    destroy()
    return t


def interleaved_ms(cases: dict, rounds: int, per: int) -> dict:
    """Median wall ms of each ``name: (fn, reset)`` over ``rounds`` rounds, each a block of
    ``per`` timed calls of every case in turn (two untimed first); ``reset`` (or None) runs
    untimed after each call. Blocks keep each case in its steady state; rounds spread the
    machine's drift over all cases alike."""
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (fn, reset) in cases.items():
            for i in range(per + 2):
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                if reset is not None:
                    reset()
                if i >= 2:
                    times[name].append(dt)
    return {name: float(np.median(t)) * 1e3 for name, t in times.items()}


def run(shape: Shape, device) -> list:
    out = []
    L = env_int("VKATTN_PERF_OVERHEAD_CONTEXT", 16)
    name = f"overhead decode L={L} vs bare round trip"
    if selected(name):
        out.append(attend_row(name, L, shape, device))
    small = Shape(heads=9, kv_heads=3, head_dim=64, v_head_dim=64, dtype=shape.dtype, qlen=shape.qlen,
                  capacity=None, iters=shape.iters, warmup=shape.warmup)      # SmolLM2-135M's attention
    if selected("overhead device path"):
        out += device_path(shape, device)
        out += device_path(small, device)
    if selected("overhead paged batch"):
        for sh in (shape, small):
            out += paged_path(sh, device)
    if selected("overhead masked decode"):
        for sh in (shape, small):
            out += mask_path(sh, device)
    if selected("overhead numpy calls"):
        for sh in (shape, small):
            out += calls_path(sh, device)
    return out


def python_us_interleaved(cases: dict, rounds: int, per: int) -> dict:
    """python_us of each ``name: (fn, reset)`` (submissions stubbed out), as interleaved_ms
    times them: ``rounds`` rounds of a block of ``per`` calls of every case in turn (two untimed
    first), so the machine's drift falls on all cases alike; median us per case."""
    with stubbed_submissions():
        return {name: ms * 1e3 for name, ms in interleaved_ms(cases, rounds, per).items()}


LOOP = 48      # a paged decode loop's calls between two truncates (calls_path, paged_path)


def calls_path(shape: Shape, device) -> list:
    """vkattn's Python per call (submissions stubbed out, us) of each kind of numpy call at
    length L (VKATTN_PERF_OVERHEAD_CONTEXT, 16) -- KVCache decode forward plain, with a mask
    (hq, 1, L + 1), ALiBi slopes, a window with sinks and a softcap, not causal, with lse; attend;
    append; PagedKVCache batch decode of one sequence, truncated back to L after each call (so
    each takes a block, L being a multiple of 16, on a pool changed since its last call) and in
    a decode loop (the sequence grows from L for LOOP calls, then is truncated untimed: the calls
    an engine's steps make) -- timed interleaved (issue 30's budget: 40
    us a numpy call); each call's result checked against the reference first. Rows: python us;
    vkattn ms: the wall ms of the same call, its submission run; numpy ms: the reference's plain
    decode, for scale."""
    L = env_int("VKATTN_PERF_OVERHEAD_CONTEXT", 16)
    tag = f"hq={shape.heads} hkv={shape.kv_heads} d={shape.head_dim}"
    iters = max(shape.iters, 50)
    rng = np.random.default_rng(13)
    hq, hkv, d, dv = shape.heads, shape.kv_heads, shape.head_dim, shape.v_head_dim
    cache = vkattn.KVCache(L + 8, hkv, d, dv, dtype=shape.dtype, device=device)
    k0, v0 = rng.standard_normal((hkv, L, d), dtype=np.float32), rng.standard_normal((hkv, L, dv), dtype=np.float32)
    cache.append(k0, v0)
    pool = vkattn.PagedKVCache(-(-(L + 8) // 16) + 1, 16, hkv, d, dv, dtype=shape.dtype, device=device)
    sid = pool.add_sequence()
    pool.append([sid], k0, v0, n_new=[L])
    loop = vkattn.PagedKVCache(-(-(L + LOOP) // 16) + 1, 16, hkv, d, dv, dtype=shape.dtype, device=device)
    lid = loop.add_sequence()
    loop.append([lid], k0, v0, n_new=[L])
    q = rng.standard_normal((hq, 1, d), dtype=np.float32)
    k = rng.standard_normal((hkv, 1, d), dtype=np.float32)
    v = rng.standard_normal((hkv, 1, dv), dtype=np.float32)
    mask = rng.standard_normal((hq, 1, L + 1), dtype=np.float32)
    slopes = (2.0 ** -np.arange(1, hq + 1)).astype(np.float32)
    variants = {"plain": {}, "mask": dict(mask=mask), "alibi": dict(alibi_slopes=slopes),
                "window, sinks, softcap": dict(window=8, n_sink=2, softcap=30.0), "not causal": dict(causal=False)}
    calls = {f"forward, {name}": (lambda kw=kw: cache.forward(q, k, v, **kw)) for name, kw in variants.items()}
    calls["forward, lse"] = lambda: cache.forward(q, k, v, return_lse=True)
    calls["attend"] = lambda: cache.attend(q)
    calls["append"] = lambda: cache.append(k, v)
    calls["paged forward, B=1"] = lambda: pool.forward([sid], q, k, v)
    calls["paged forward, B=1, decode loop"] = lambda: loop.forward([lid], q, k, v)
    reset = {name: (lambda: pool.truncate(sid, L)) if name.startswith("paged") else
             (lambda: cache.truncate(L)) for name in calls}
    reset["paged forward, B=1, decode loop"] = lambda: loop.length(lid) >= L + LOOP and loop.truncate(lid, L)
    ok = True
    for name, fn in calls.items():
        got = fn()
        if name.startswith("forward"):
            kw = variants.get(name.split(", ", 1)[1], {})
            ks, vs = cache.read()
            want = attention(q, ks, vs, **{a: b for a, b in kw.items()})
            got = got[0] if isinstance(got, tuple) else got
            ok = ok and check(got, want, shape.dtype)
        elif name == "attend":
            ok = ok and check(got, attention(q, *cache.read()), shape.dtype)
        elif name.startswith("paged"):
            c, i = (loop, lid) if name.endswith("loop") else (pool, sid)
            ok = ok and check(got, attention(q, *c.read(i)), shape.dtype)
        reset[name]()
    ks, vs = cache.read()
    tr = time_calls(lambda: attention(q, ks, vs), iters, 5)["median_ms"]     # numpy's plain decode, for scale
    cases = {name: (fn, reset[name]) for name, fn in calls.items()}
    per = max(iters // 5, 10)
    wall = interleaved_ms(cases, rounds=3, per=per)
    py = python_us_interleaved(cases, rounds=5, per=4 * per)
    rows = []
    for name in calls:
        print(f"{tag} {name} L={L}: vkattn's Python {py[name]:.1f} us per call, wall {wall[name]:.4f} ms")
        rows.append(Row(case=f"numpy call L={L}: {name}", kernel="overhead", shape=tag, vkattn_ms=wall[name],
                        vkattn_min_ms=wall[name], numpy_ms=tr, speedup_vs_numpy=tr / wall[name],
                        metric="python us", value=py[name], verified=ok, extra={"python_us": py[name]}))
    cache.close()
    pool.close()
    loop.close()
    return rows


def mask_path(shape: Shape, device) -> list:
    """A decode ``forward`` at length L (VKATTN_PERF_OVERHEAD_CONTEXT, 16) with a per-head mask,
    numpy q, k, v: the mask as numpy (hq, 1, L + 1) against the same mask in a DeviceArray as wide
    as the capacity (copied into aux on the device, shaders/mask_copy.comp), and the unmasked call
    for scale, timed in interleaved rounds; each masked result checked against the reference
    first. Rows: wall ms per call; extra: vkattn's Python (us, submissions stubbed out)."""
    L = env_int("VKATTN_PERF_OVERHEAD_CONTEXT", 16)
    tag = f"hq={shape.heads} hkv={shape.kv_heads} d={shape.head_dim}"
    iters = max(shape.iters, 50)
    rng = np.random.default_rng(11)
    hq, hkv, d, dv = shape.heads, shape.kv_heads, shape.head_dim, shape.v_head_dim
    cap = L + 8
    cache = vkattn.KVCache(cap, hkv, d, dv, dtype=shape.dtype, device=device)
    cache.append(rng.standard_normal((hkv, L, d), dtype=np.float32), rng.standard_normal((hkv, L, dv), dtype=np.float32))
    q = rng.standard_normal((hq, 1, d), dtype=np.float32)
    k = rng.standard_normal((hkv, 1, d), dtype=np.float32)
    v = rng.standard_normal((hkv, 1, dv), dtype=np.float32)
    wide = rng.standard_normal((hq, 1, cap), dtype=np.float32)
    host = np.ascontiguousarray(wide[..., :L + 1])
    dmask = vkattn.to_device(wide, device)
    calls = {"no mask": lambda: cache.forward(q, k, v), "numpy mask": lambda: cache.forward(q, k, v, mask=host),
             "device mask": lambda: cache.forward(q, k, v, mask=dmask)}
    ok = True
    for name in ("numpy mask", "device mask"):
        got = calls[name]()
        ok = ok and check(got, attention(q, *cache.read(), mask=host), shape.dtype)
        cache.truncate(L)
    kr, vr = cache.read()
    tr = time_calls(lambda: attention(q, kr, vr, mask=host[..., :L]), iters, 5)["median_ms"]     # numpy's own
    reset = (lambda: cache.truncate(L))
    m = interleaved_ms({name: (fn, reset) for name, fn in calls.items()}, rounds=5, per=max(iters // 5, 10))
    rows = []
    for name, fn in calls.items():
        py = python_us(fn, 10 * iters, reset=reset)
        print(f"{tag} decode L={L}, {name}: wall {m[name]:.4f} ms, vkattn's Python {py:.1f} us per call")
        rows.append(Row(case=f"masked decode forward L={L}, {name}", kernel="overhead", shape=tag,
                        vkattn_ms=m[name], vkattn_min_ms=m[name], numpy_ms=tr, speedup_vs_numpy=tr / m[name],
                        metric="x unmasked", value=m[name] / m["no mask"], verified=ok,
                        extra={"python_us": py}))
    dmask.close()
    cache.close()
    return rows


def attend_row(name: str, L: int, shape: Shape, device) -> Row:
    """KVCache.attend of one query row at length L against a bare kp round trip."""
    iters, warmup = max(shape.iters, 50), max(shape.warmup, 10)
    rng = np.random.default_rng(3)
    cache = vkattn.KVCache(max(L, 64), shape.kv_heads, shape.head_dim, shape.v_head_dim, dtype=shape.dtype, device=device)
    k = rng.standard_normal((shape.kv_heads, L, shape.head_dim), dtype=np.float32)
    v = rng.standard_normal((shape.kv_heads, L, shape.v_head_dim), dtype=np.float32)
    cache.append(k, v)
    q = rng.standard_normal((shape.heads, 1, shape.head_dim), dtype=np.float32)
    ok = check(cache.attend(q), attention(q, round_to(k, shape.dtype), round_to(v, shape.dtype)), shape.dtype)
    bare = bare_round_trip_ms(device, iters, warmup)
    t = time_calls(lambda: cache.attend(q), iters, warmup)
    tr = time_calls(lambda: attention(q, k, v), iters, warmup)
    cache.close()
    return Row(case=name, kernel="overhead", shape=f"hq={shape.heads} hkv={shape.kv_heads} d={shape.head_dim}",
               vkattn_ms=t["median_ms"], vkattn_min_ms=t["min_ms"], numpy_ms=tr["median_ms"],
               speedup_vs_numpy=tr["median_ms"] / t["median_ms"], metric="x bare",
               value=t["median_ms"] / bare["median_ms"], verified=ok, extra={"bare_ms": bare["median_ms"]})


@contextmanager
def stubbed_submissions():
    """Every recorded submission (run, and a graph's submit) replaced by nothing inside: what is
    timed is the host code around the device (vkattn's Python, numpy, kp's bindings up to the
    submit)."""
    from vkattn import _kp
    real = _kp.Recording.run, _kp.Recording.submit
    _kp.Recording.run = _kp.Recording.submit = lambda self: None
    try:
        yield
    finally:
        _kp.Recording.run, _kp.Recording.submit = real


def python_us(fn, iters: int, reset=None) -> float:
    """Median microseconds of ``fn`` with its submissions stubbed out (stubbed_submissions);
    ``reset`` (untimed) runs after each call."""
    times = []
    with stubbed_submissions():
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            if reset is not None:
                reset()
    return float(np.median(times)) * 1e6


def device_path(shape: Shape, device) -> list:
    """A decode step at length L (VKATTN_PERF_OVERHEAD_CONTEXT, 16) of ``forward`` (one new token)
    in three ways, each timed in this run beside a bare kp round trip: numpy in and out; device
    arrays in and out (out=); and a vkattn.Graph of VKATTN_PERF_OVERHEAD_LAYERS (30) such calls,
    one per cache, replayed (per layer). Rows: wall ms (caches without timestamps, whose queries
    cost 0.1 ms and more per call on lavapipe); extra: device ms (the timestamps of a twin cache
    making the same calls), vkattn's Python per call (us, the submissions stubbed out), the bare
    round trip; metric: (wall - device) / bare, both from the twin's own calls (per call, then the
    median): the host's share of a call, an upper bound, since it includes the timestamps' own
    cost (on lavapipe about 0.1 ms a call: the twin's wall exceeds the plain cache's, so a
    difference across the two loops can go negative). Then the same ratio with a device time that
    has no timestamps in it (printed "interleaved" lines, extra ``x_bare_marginal``): one more
    layer's cost in a replayed graph, (graph of ``layers`` - graph of 1 - their Python's
    difference) / (layers - 1), the single calls, both graphs and the bare round trip timed in
    interleaved rounds (interleaved_ms)."""
    L = env_int("VKATTN_PERF_OVERHEAD_CONTEXT", 16)
    layers = env_int("VKATTN_PERF_OVERHEAD_LAYERS", 30)
    tag = f"hq={shape.heads} hkv={shape.kv_heads} d={shape.head_dim}"
    iters, warmup = max(shape.iters, 50), max(shape.warmup, 10)
    rng = np.random.default_rng(5)
    hq, hkv, d, dv = shape.heads, shape.kv_heads, shape.head_dim, shape.v_head_dim
    caches = [vkattn.KVCache(L + 2 * (iters + warmup) + 4, hkv, d, dv, dtype=shape.dtype, device=device,
                             timestamps=i == layers) for i in range(layers + 1)]
    timed = caches.pop()            # the twin with timestamps: device time only
    k0 = rng.standard_normal((hkv, L, d), dtype=np.float32)
    v0 = rng.standard_normal((hkv, L, dv), dtype=np.float32)
    for c in caches + [timed]:
        c.append(k0, v0)
    q = rng.standard_normal((hq, 1, d), dtype=np.float32)
    k = rng.standard_normal((hkv, 1, d), dtype=np.float32)
    v = rng.standard_normal((hkv, 1, dv), dtype=np.float32)
    c0 = caches[0]
    qd, kd, vd = vkattn.to_device(q, device), vkattn.to_device(k, device), vkattn.to_device(v, device)
    od = vkattn.empty((hq, 1, dv), device)

    def numpy_only():
        c0.forward(q, k, v)

    def device_only():
        c0.forward(qd, kd, vd, out=od)

    def numpy_call():
        numpy_only()
        c0.truncate(L)

    def device_call():
        device_only()
        c0.truncate(L)

    def timed_call(arrays):
        def call():
            if arrays:
                timed.forward(qd, kd, vd, out=od)
            else:
                timed.forward(q, k, v)
            timed.truncate(L)
        return call

    ok = check(c0.forward(q, k, v), attention(q, *c0.read()), shape.dtype)
    c0.truncate(L)
    bare = bare_round_trip_ms(device, iters, warmup)
    kr, vr = c0.read()
    tr = time_calls(lambda: attention(q, kr, vr), iters, warmup)["median_ms"]     # numpy's own attention
    rows = []
    for name, fn, only in (("numpy", numpy_call, numpy_only), ("device arrays", device_call, device_only)):
        t = time_calls(fn, iters, warmup)
        td = time_calls(timed_call(name != "numpy"), iters, warmup, device_of=timed)
        t["device_ms"], host_ms = td["device_ms"], td["host_ms"]
        py = python_us(only, 10 * iters, reset=lambda: c0.truncate(L))
        print(f"{tag} {name}: vkattn's Python {py:.1f} us per call (submission stubbed out)")
        rows.append(Row(case=f"decode forward L={L}, {name}", kernel="overhead", shape=tag,
                        vkattn_ms=t["median_ms"], vkattn_min_ms=t["min_ms"], numpy_ms=tr, speedup_vs_numpy=tr / t["median_ms"],
                        metric="x bare",
                        value=(host_ms if host_ms is not None else t["median_ms"]) / bare["median_ms"], verified=ok,
                        device_ms=t["device_ms"],
                        extra={"bare_ms": bare["median_ms"], "device_ms": t["device_ms"], "python_us": py,
                               "timestamped_wall_ms": td["median_ms"], "host_ms": host_ms}))
    qs = [vkattn.to_device(q, device) for _ in caches]
    ks = [vkattn.to_device(k, device) for _ in caches]
    vs = [vkattn.to_device(v, device) for _ in caches]
    outs = [vkattn.empty((hq, 1, dv), device) for _ in caches]
    graph = vkattn.Graph(device)
    with graph.capture():
        for c, a, b, e, o in zip(caches, qs, ks, vs, outs):
            c.forward(a, b, e, out=o)

    def step():
        graph.run()
        for c in caches:
            c.truncate(L)
    step()
    graph.run()                                       # one step checked against the reference
    gok = check(outs[-1].numpy(), attention(q, *caches[-1].read()), shape.dtype)
    for c in caches:
        c.truncate(L)
    t = time_calls(step, max(iters // 5, 10), max(warmup // 5, 2))

    def truncate_all():
        for c in caches:
            c.truncate(L)
    gpy = python_us(graph.submit, max(iters // 5, 10), reset=truncate_all)
    print(f"{tag} graph of {layers} layers: vkattn's Python {gpy:.1f} us per replay, "
          f"{gpy / layers:.1f} us per layer (submission stubbed out)")
    held = []                                         # how long submit() keeps the host (not the wait)
    for _ in range(max(iters // 5, 10)):
        t0 = time.perf_counter()
        handle = graph.submit()
        held.append(time.perf_counter() - t0)
        handle.wait()
        truncate_all()
    submit_ms = float(np.median(held)) * 1e3
    print(f"{tag} graph of {layers} layers: submit() returns after {submit_ms:.3f} ms of a "
          f"{t['median_ms']:.3f} ms step (the host's own until it waits)")
    # Device time without timestamps: what one more layer adds to a submission. The graph of
    # `layers` calls and a graph of the first cache's call alone, the two single calls and the
    # bare round trip are timed in interleaved rounds (truncations untimed); one call's device
    # time is (T_n - T_1 - their Python's difference) / (n - 1), every per-submission cost
    # (submit, fence, wake-up) left on the host's side of the call.
    one = vkattn.Graph(device)
    with one.capture():
        c0.forward(qs[0], ks[0], vs[0], out=outs[0])
    bare_run, bare_destroy = bare_round_trip(device)
    m = interleaved_ms({"bare": (bare_run, None), "numpy": (numpy_only, lambda: c0.truncate(L)),
                        "device arrays": (device_only, lambda: c0.truncate(L)),
                        "graph": (graph.run, truncate_all), "one": (one.run, truncate_all)},
                       rounds=5, per=max(iters // 5, 10))
    bare_destroy()
    py1 = python_us(one.submit, max(iters // 5, 10), reset=truncate_all)
    dev = (m["graph"] - m["one"] - (gpy - py1) / 1e3) / (layers - 1) if layers > 1 else None
    one.close()
    if dev is not None:
        for r, name in zip(rows, ("numpy", "device arrays")):
            host = m[name] - dev
            print(f"{tag} {name}, interleaved: wall {m[name]:.4f} ms, device {dev:.4f} ms (graphs of {layers} / 1 "
                  f"layer {m['graph']:.3f} / {m['one']:.3f} ms), wall - device {host:.4f} ms = "
                  f"{host / m['bare']:.2f}x bare ({m['bare']:.4f} ms)")
            r.extra.update({"interleaved_wall_ms": m[name], "device_marginal_ms": dev,
                            "host_marginal_ms": host, "bare_interleaved_ms": m["bare"],
                            "x_bare_marginal": host / m["bare"], "graph_ms": m["graph"], "graph_one_ms": m["one"]})
    rows.append(Row(case=f"decode step of {layers} layers L={L}, one graph submission", kernel="overhead",
                    shape=tag, vkattn_ms=t["median_ms"], vkattn_min_ms=t["min_ms"], numpy_ms=tr,
                    speedup_vs_numpy=tr * layers / t["median_ms"], metric="ms per layer",
                    value=t["median_ms"] / layers, verified=ok and gok,
                    extra={"bare_ms": bare["median_ms"], "recordings": graph.recordings,
                           "submissions": graph.submissions, "python_us_per_replay": gpy,
                           "submit_ms": submit_ms}))
    graph.close()
    for o in qs + ks + vs + outs + [qd, kd, vd, od]:
        o.close()
    for c in caches + [timed]:
        c.close()
    return rows


def paged_path(shape: Shape, device) -> list:
    """A batch decode step of PagedKVCache.forward (numpy in and out, one new token for each of
    B sequences at length L: VKATTN_PERF_OVERHEAD_BATCHES, default 1,4,16; blocks of 16) beside
    a bare kp round trip: wall ms, and vkattn's Python per call with the submission stubbed out
    (the metric, extra ``python_us``; issue 30's budget for a numpy call is 40 us), each call
    truncated back to L (a block taken every call) and in a decode loop (LOOP calls from L, then
    truncated untimed); the same call with each new token's id (prefix caching; its wall time is the plain call's); a model's
    step of such caches (paged_layers_row); and, for B > 1, a decode loop of staggered lengths
    (staggered_row)."""
    L = env_int("VKATTN_PERF_OVERHEAD_CONTEXT", 16)
    tag = f"hq={shape.heads} hkv={shape.kv_heads} d={shape.head_dim}"
    iters, warmup = max(shape.iters, 50), max(shape.warmup, 10)
    rng = np.random.default_rng(7)
    hq, hkv, d, dv = shape.heads, shape.kv_heads, shape.head_dim, shape.v_head_dim
    bare = bare_round_trip_ms(device, iters, warmup)
    rows = []
    for b in env_int_list("VKATTN_PERF_OVERHEAD_BATCHES", [1, 4, 16]):
        blocks = b * (-(-(L + LOOP) // 16) + 1)
        cache = vkattn.PagedKVCache(blocks, 16, hkv, d, dv, dtype=shape.dtype, device=device)
        ids = [cache.add_sequence(token_ids=[]) for _ in range(b)]     # they know their token ids
        cache.append(ids, rng.standard_normal((hkv, b * L, d), dtype=np.float32),
                     rng.standard_normal((hkv, b * L, dv), dtype=np.float32), n_new=[L] * b,
                     token_ids=[list(range(1000 * i, 1000 * i + L)) for i in range(b)])
        q = rng.standard_normal((hq, b, d), dtype=np.float32)
        k = rng.standard_normal((hkv, b, d), dtype=np.float32)
        v = rng.standard_normal((hkv, b, dv), dtype=np.float32)

        def reset():
            for sid in ids:
                cache.truncate(sid, L)
        got = cache.forward(ids, q, k, v)
        kv = [cache.read(sid) for sid in ids]
        ok = all(check(got[:, i:i + 1], attention(q[:, i:i + 1], *kv[i]), shape.dtype) for i in range(b))
        reset()
        tr = time_calls(lambda: [attention(q[:, i:i + 1], *kv[i]) for i in range(b)], iters, warmup)["median_ms"]

        def call():
            cache.forward(ids, q, k, v)
            reset()
        t = time_calls(call, iters, warmup)

        def python_row(what: str, fn, reset_fn, **extra) -> None:
            """vkattn's Python per call of ``fn`` (what: the row's case suffix), printed and kept."""
            py = python_us(fn, 10 * iters, reset=reset_fn)
            print(f"{tag} paged batch decode B={b} L={L}{what}: vkattn's Python {py:.1f} us per call "
                  f"(submission stubbed out), wall {t['median_ms']:.4f} ms, bare round trip {bare['median_ms']:.4f} ms")
            rows.append(Row(case=f"paged batch decode B={b} L={L}, numpy{what}", kernel="overhead", shape=tag,
                            vkattn_ms=t["median_ms"], vkattn_min_ms=t["min_ms"], numpy_ms=tr,
                            speedup_vs_numpy=tr / t["median_ms"], metric="python us", value=py,
                            verified=ok, extra=dict(extra, python_us=py, batch=b)))
        python_row("", lambda: cache.forward(ids, q, k, v), reset, bare_ms=bare["median_ms"])
        # a decode loop: LOOP calls from L (each takes the one before it on), then truncated untimed
        python_row(", decode loop", lambda: cache.forward(ids, q, k, v),
                   lambda: cache.length(ids[0]) >= L + LOOP and reset())
        toks = [[7] for _ in ids]          # a prefix-caching engine's call: each new token's id
        python_row(", token ids", lambda: cache.forward(ids, q, k, v, token_ids=toks), reset)
        rows.append(paged_layers_row(cache, ids, L, b, shape, tag, iters, rng, tr))
        cache.close()
        if b > 1:
            rows.append(staggered_row(b, L, shape, tag, device, iters, rng, bare["median_ms"]))
    return rows


def staggered_row(b: int, L: int, shape: Shape, tag: str, device, iters: int, rng, bare_ms: float) -> Row:
    """A decode loop of B sequences of staggered lengths (L + 7i mod 16, blocks of 16: some
    sequence starts a block at almost every step, as in an engine's batch): vkattn's Python per
    call (submissions stubbed; LOOP calls from the lengths, then truncated untimed), the first
    call's output checked against the reference; wall ms of the same loop."""
    hq, hkv, d, dv = shape.heads, shape.kv_heads, shape.head_dim, shape.v_head_dim
    lens = [L + (7 * i) % 16 for i in range(b)]
    cache = vkattn.PagedKVCache(b * (-(-(L + 16 + LOOP) // 16) + 1), 16, hkv, d, dv, dtype=shape.dtype, device=device)
    ids = [cache.add_sequence() for _ in range(b)]
    for sid, n in zip(ids, lens):
        cache.append([sid], rng.standard_normal((hkv, n, d), dtype=np.float32),
                     rng.standard_normal((hkv, n, dv), dtype=np.float32), n_new=[n])
    q = rng.standard_normal((hq, b, d), dtype=np.float32)
    k = rng.standard_normal((hkv, b, d), dtype=np.float32)
    v = rng.standard_normal((hkv, b, dv), dtype=np.float32)

    def reset():
        if cache.length(ids[0]) >= lens[0] + LOOP:
            for sid, n in zip(ids, lens):
                cache.truncate(sid, n)
    got = cache.forward(ids, q, k, v)
    kv = [cache.read(sid) for sid in ids]
    ok = all(check(got[:, i:i + 1], attention(q[:, i:i + 1], *kv[i]), shape.dtype) for i in range(b))
    tr = time_calls(lambda: [attention(q[:, i:i + 1], *kv[i]) for i in range(b)], iters, 3)["median_ms"]

    def call():
        cache.forward(ids, q, k, v)
        reset()
    t = time_calls(call, iters, 10)
    py = python_us(lambda: cache.forward(ids, q, k, v), 10 * iters, reset=reset)
    cache.close()
    print(f"{tag} paged batch decode B={b} L={L}, staggered decode loop: vkattn's Python {py:.1f} us per call "
          f"(submission stubbed out), wall {t['median_ms']:.4f} ms, bare round trip {bare_ms:.4f} ms")
    return Row(case=f"paged batch decode B={b} L={L}, numpy, staggered decode loop", kernel="overhead", shape=tag,
               vkattn_ms=t["median_ms"], vkattn_min_ms=t["min_ms"], numpy_ms=tr, speedup_vs_numpy=tr / t["median_ms"],
               metric="python us", value=py, verified=ok, extra={"python_us": py, "batch": b, "bare_ms": bare_ms})


def paged_layers_row(first, ids: list, L: int, b: int, shape: Shape, tag: str, iters: int, rng, numpy_ms) -> Row:
    """A model's step: VKATTN_PERF_OVERHEAD_LAYERS (30) PagedKVCaches of one family (``first`` and
    copies of its state), each called in turn with the same B sequences, as a model's layers are
    (the later layers take the first one's step plan: vkattn.paged._Step); wall ms and vkattn's
    Python per layer (submission stubbed out), each layer's output checked against the reference;
    ``numpy_ms``: the numpy reference's time for one layer's B sequences."""
    n = env_int("VKATTN_PERF_OVERHEAD_LAYERS", 30)
    hq, hkv, d, dv = shape.heads, shape.kv_heads, shape.head_dim, shape.v_head_dim
    layers = [first]
    for _ in range(n - 1):
        c = vkattn.PagedKVCache(first.num_blocks, 16, hkv, d, dv, dtype=shape.dtype, device=first.device)
        for sid in ids:
            c.add_sequence(sid)
        c.append(ids, rng.standard_normal((hkv, b * L, d), dtype=np.float32),
                 rng.standard_normal((hkv, b * L, dv), dtype=np.float32), n_new=[L] * b)
        layers.append(c)
    data = [(rng.standard_normal((hq, b, d), dtype=np.float32), rng.standard_normal((hkv, b, d), dtype=np.float32),
             rng.standard_normal((hkv, b, dv), dtype=np.float32)) for _ in layers]

    def reset():
        for c in layers:
            for sid in ids:
                c.truncate(sid, L)

    def step():
        for c, (q, k, v) in zip(layers, data):
            c.forward(ids, q, k, v)
    got = [c.forward(ids, *x) for c, x in zip(layers, data)]
    ok = True
    for c, (q, _, _), out in zip(layers, data, got):
        kv = [c.read(sid) for sid in ids]
        ok = ok and all(check(out[:, i:i + 1], attention(q[:, i:i + 1], *kv[i]), shape.dtype) for i in range(b))
    reset()

    def timed():
        step()
        reset()
    t = time_calls(timed, max(iters // 5, 10), 3)
    py = python_us(step, max(iters, 50), reset=reset) / n
    for c in layers[1:]:
        c.close()
    per = t["median_ms"] / n
    print(f"{tag} paged batch decode B={b} L={L}, {n} layers of one family: vkattn's Python {py:.1f} us per layer "
          f"(submission stubbed out), wall {per:.4f} ms per layer (truncations included)")
    return Row(case=f"paged batch decode B={b} L={L}, {n} layers", kernel="overhead", shape=tag, vkattn_ms=per,
               vkattn_min_ms=t["min_ms"] / n, numpy_ms=numpy_ms, speedup_vs_numpy=numpy_ms / per,
               metric="python us", value=py, verified=ok,
               extra={"python_us": py, "batch": b, "layers": n})
