"""The device path (issue 30): DeviceArrays in and out of both caches, bit for bit what the numpy
path gives; recorded submissions (vkattn.Graph) chaining several caches and the caller's own kp
dispatches with barriers, replayed at new lengths without recording again. Run under the Khronos
layer's synchronization validation by make test-validation (0 messages)."""
import textwrap

import numpy as np
import pytest

import vkattn
from vkattn import _kp
from vkattn.compiler import compile_shader
from vkattn.reference import attention

DTYPES = ["float32", "float16", "int8", "bfloat16"]


def _data(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_device_array_round_trip_and_errors(device):
    x = np.arange(2 * 3 * 5, dtype=np.float32).reshape(2, 3, 5) / 7
    a = vkattn.to_device(x, device)
    assert a.shape == (2, 3, 5) and a.dtype == np.float32 and a.nbytes == 120 and a.device is device
    assert np.array_equal(a.numpy(), x)
    a.write(x[::-1] * 2)
    assert np.array_equal(a.numpy(), x[::-1] * 2)
    assert a.manager.kp is device.backend._mgr and a.tensor.size() >= a.size
    assert np.array_equal(vkattn.zeros((4,), device).numpy(), np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="expected shape"):
        a.write(np.zeros((3, 2, 5)))
    with pytest.raises(TypeError, match="float"):
        vkattn.to_device(np.arange(4), device)
    with pytest.raises(ValueError, match="shape"):
        vkattn.empty((2, 0), device)
    a.close()
    with pytest.raises(vkattn.CacheClosedError):
        a.numpy()
    a.close()                                            # twice: nothing


@pytest.mark.parametrize("dtype", DTYPES)
def test_kvcache_device_arrays_equal_the_numpy_path_bit_for_bit(device, rng, dtype):
    hkv, g, d, dv = 2, 3, 32, 48
    twin = [vkattn.KVCache(80, hkv, d, dv, dtype=dtype, device=device) for _ in range(2)]
    steps = [(rng, 9), (rng, 1), (rng, 40), (rng, 1)]      # prefill, decode, appended-first chunk, decode
    for _, n in steps:
        q, k, v = _data(rng, hkv * g, n, d), _data(rng, hkv, n, d), _data(rng, hkv, n, dv)
        want, want_lse = twin[0].forward(q, k, v, return_lse=True)
        out, lse = vkattn.empty((hkv * g, n, dv), device), vkattn.empty((hkv * g, n), device)
        got = twin[1].forward(vkattn.to_device(q, device), vkattn.to_device(k, device), vkattn.to_device(v, device),
                              out=out, lse=lse, return_lse=True)
        assert got[0] is out and got[1] is lse
        assert np.array_equal(out.numpy(), want) and np.array_equal(lse.numpy(), want_lse)
        ks, vs = twin[1].read()
        np.testing.assert_allclose(out.numpy(), attention(q, ks, vs), atol=2e-5, rtol=2e-4)
    assert twin[0].length == twin[1].length == 51
    # attend and append on device arrays; numpy out where out= is not given
    q = _data(rng, hkv * g, 4, d)
    assert np.array_equal(twin[1].attend(vkattn.to_device(q, device)), twin[0].attend(q))
    k, v = _data(rng, hkv, 3, d), _data(rng, hkv, 3, dv)
    twin[0].append(k, v)
    twin[1].append(vkattn.to_device(k, device), vkattn.to_device(v, device))
    for a, b in zip(twin[0].read(), twin[1].read()):
        assert np.array_equal(a, b)


def test_device_array_checks_lose_nothing(device, rng):
    cache = vkattn.KVCache(16, 1, 24, dtype="float16", device=device)
    k, v = vkattn.to_device(_data(rng, 1, 2, 24), device), vkattn.to_device(_data(rng, 1, 2, 24), device)
    with pytest.raises(ValueError, match="multiple of 8"):          # float16 rows: 24 is one
        vkattn.KVCache(16, 1, 20, dtype="float16", device=device).append(
            vkattn.empty((1, 2, 20), device), vkattn.empty((1, 2, 20), device))
    with pytest.raises(ValueError, match="3 query rows but the cache would hold only 2"):
        cache.forward(vkattn.empty((2, 3, 24), device), k, v)
    with pytest.raises(ValueError, match="expected shape"):
        cache.forward(vkattn.empty((2, 2, 23), device), k, v)
    with pytest.raises(TypeError, match="both numpy arrays or both"):
        cache.append(k, _data(rng, 1, 2, 24))
    with pytest.raises(ValueError, match="out: expected shape"):
        cache.forward(vkattn.empty((2, 2, 24), device), k, v, out=vkattn.empty((2, 2, 23), device))
    with pytest.raises(TypeError, match="DeviceArray"):
        cache.forward(_data(rng, 2, 2, 24), _data(rng, 1, 2, 24), _data(rng, 1, 2, 24), out=np.zeros((2, 2, 24)))
    assert cache.length == 0
    int8 = vkattn.KVCache(16, 1, 24, dtype="int8", device=device)
    with pytest.raises(ValueError, match="multiple of 16"):
        int8.append(k, v)
    assert int8.length == 0


SCALE_SHADER = textwrap.dedent("""\
    #version 450
    // the caller's own kernel of the graph tests: y = 0.5 * x + 1 over n floats
    layout(local_size_x = 64) in;
    layout(constant_id = 0) const uint N = 1u;
    layout(std430, binding = 0) readonly buffer X { float x[]; };
    layout(std430, binding = 1) writeonly buffer Y { float y[]; };
    void main() {
        uint i = gl_GlobalInvocationID.x;
        if (i < N) y[i] = 0.5 * x[i] + 1.0;
    }
    """)


@pytest.fixture(scope="module")
def scale_spirv(tmp_path_factory):
    d = tmp_path_factory.mktemp("shader")
    (d / "scale.comp").write_text(SCALE_SHADER)
    return compile_shader("scale", src_dir=d)


def _scale(arr_in, arr_out, spirv):
    n = arr_in.size
    return arr_in.manager.algorithm([arr_in.tensor, arr_out.tensor], spirv, [-(-n // 64), 1, 1],
                                    np.array([n], np.uint32), np.zeros(0, np.uint32))


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_graph_chains_layers_and_the_callers_dispatches_and_replays(device, rng, dtype, scale_spirv):
    """Three layers: attention of layer i -> the caller's kernel (0.5 x + 1) -> q of layer i+1, in
    one submission; replayed over steps; every value equal, bit for bit, to the numpy path run
    call by call with the same kernel applied on the host in float32."""
    layers, hkv, g, d = 3, 2, 2, 32
    hq = hkv * g
    gpu = [vkattn.KVCache(64, hkv, d, dtype=dtype, device=device) for _ in range(layers)]
    cpu = [vkattn.KVCache(64, hkv, d, dtype=dtype, device=device) for _ in range(layers)]
    for a, b in zip(gpu, cpu):
        k, v = _data(rng, hkv, 7, d), _data(rng, hkv, 7, d)
        a.append(k, v)
        b.append(k, v)
    q = [vkattn.empty((hq, 1, d), device) for _ in range(layers + 1)]
    out = [vkattn.empty((hq, 1, d), device) for _ in range(layers)]
    k = [vkattn.empty((hkv, 1, d), device) for _ in range(layers)]
    v = [vkattn.empty((hkv, 1, d), device) for _ in range(layers)]
    algos = [_scale(out[i], q[i + 1], scale_spirv) for i in range(layers)]
    graph = vkattn.Graph(device)
    with graph.capture():
        graph.upload(q[0], *k, *v)
        for i in range(layers):
            gpu[i].forward(q[i], k[i], v[i], out=out[i])
            graph.dispatch(algos[i], reads=[out[i]], writes=[q[i + 1]])
        graph.download(q[layers])
    for step in range(5):
        q0 = _data(rng, hq, 1, d)
        ks = [_data(rng, hkv, 1, d) for _ in range(layers)]
        vs = [_data(rng, hkv, 1, d) for _ in range(layers)]
        q[0].host_view()[...] = q0
        for i in range(layers):
            k[i].host_view()[...] = ks[i]
            v[i].host_view()[...] = vs[i]
        handle = graph.submit()
        x = q0
        for i in range(layers):                       # the numpy path, call by call
            x = (np.float32(0.5) * cpu[i].forward(x, ks[i], vs[i]) + np.float32(1.0)).astype(np.float32)
        handle.wait()
        assert np.array_equal(q[layers].host_view(), x), step
        assert [c.length for c in gpu] == [c.length for c in cpu] == [8 + step] * layers
    assert graph.submissions == 5 and graph.recordings == 1          # replayed, not recorded again
    assert sum(op.startswith("barrier") for op in graph.ops) >= 2 * layers - 1
    graph.close()


def _long_graph(device, rng, layers=3, keys=3000):
    """A graph of ``layers`` decode calls over ``keys`` cached keys each (milliseconds of work on
    lavapipe), its arrays and caches."""
    hkv, d, hq = 4, 64, 8
    caches = [vkattn.KVCache(keys + 64, hkv, d, dtype="float16", device=device) for _ in range(layers)]
    for c in caches:
        c.append(_data(rng, hkv, keys, d), _data(rng, hkv, keys, d))
    q, k, v = (vkattn.to_device(_data(rng, h, 1, d), device) for h in (hq, hkv, hkv))
    outs = [vkattn.empty((hq, 1, d), device) for _ in range(layers)]
    graph = vkattn.Graph(device)
    with graph.capture():
        for c, o in zip(caches, outs):
            c.forward(q, k, v, out=o)
    return graph, caches, (q, k, v), outs


@pytest.mark.skipif(not _kp.HAS_ASYNC, reason="kp without scripts/kp-0.9.0-features.patch submits waiting")
def test_graph_submit_returns_before_the_device_is_done_and_lets_threads_run(device, rng):
    """Graph.submit() returns with the submission still running (its kp sequence not yet
    waited for: kp 0.9.0's own eval_async() waited), ``done`` reads the fence without waiting,
    a host call on the device waits for it first, and while the host waits (``wait()``, or
    ``run()``'s evaluation) other Python threads run: kp releases the GIL there."""
    import sys
    import threading
    import time
    graph, caches, (q, k, v), outs = _long_graph(device, rng)
    graph.run()
    for c in caches:
        c.truncate(c.length - 1)
    handle = graph.submit()
    assert handle._rec._seq.is_running() and not handle._waited     # submitted, not waited for
    handle.wait()
    assert handle.done and not handle._rec._seq.is_running()
    for c in caches:
        c.truncate(c.length - 1)
    handle = graph.submit()
    polled, deadline = [], time.monotonic() + 60
    while not handle.done and time.monotonic() < deadline:          # the fence, read without waiting
        polled.append(False)
        time.sleep(0.001)
    assert handle.done and not handle._waited and handle._rec._seq.is_running(), len(polled)
    handle.wait()
    # the GIL: a thread spinning in Python, with a switch interval of 0.2 s, gets it only where the
    # host releases it -- kp's C++ submission and wait (kp 0.9.0's bindings: never) -- not by
    # preemption. Whether it is scheduled inside a given wait depends on the CPU (llvmpipe's
    # workers hold every core while they run), so up to 20 tries, submit + wait and run() in turn
    count, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.2)
    worker = threading.Thread(target=spin)
    progress = []
    try:
        worker.start()
        time.sleep(0.01)
        for attempt in range(20):
            for c in caches:
                c.truncate(c.length - 1)
            before = count[0]
            if attempt % 2:
                graph.run()
            else:
                graph.submit().wait()
            progress.append(count[0] - before)
            if progress[-1]:
                break
    finally:
        stop.set()
        worker.join()
        sys.setswitchinterval(interval)
    assert progress[-1] > 0, progress
    # a host call while a submission runs waits for it: the outputs are the finished ones
    first, length = [o.numpy() for o in outs], caches[0].length
    for c in caches:
        c.truncate(c.length - 1)
    graph.submit()
    assert [c.length for c in caches] == [length] * 3               # committed at the submission
    assert all(np.array_equal(o.numpy(), f) for o, f in zip(outs, first))   # the same call again
    graph.close()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_graphs_in_flight_interleaved_with_host_calls_equal_the_numpy_path(device, seed):
    """Two graphs of two decode layers each, submitted without waiting, in a random order with
    the host calls an engine makes meanwhile -- polling ``done``, writing the next inputs
    (``write``), reading outputs (``numpy``) and a graph's caches (``read``), a numpy call on a
    third cache, truncating a graph's caches, a paged batch call -- each host call waiting for the
    submission in flight where it must: every output and every cache's contents bit for bit
    those of the same calls made one by one on numpy twins."""
    r = np.random.default_rng(100 + seed)
    hkv, d, hq = 2, 32, 4
    dt = ["float16", "int8", "float32"][seed % 3]

    def cache_pair(n):
        a, b = (vkattn.KVCache(96, hkv, d, dtype=dt, device=device) for _ in range(2))
        k, v = _data(r, hkv, n, d), _data(r, hkv, n, d)
        a.append(k, v)
        b.append(k, v)
        return a, b
    graphs = []
    for g in range(2):
        pairs = [cache_pair(5 + 3 * g + i) for i in range(2)]
        q, k, v = vkattn.empty((hq, 1, d), device), vkattn.empty((hkv, 1, d), device), vkattn.empty((hkv, 1, d), device)
        outs = [vkattn.empty((hq, 1, d), device) for _ in pairs]
        # ballast: a long cache's call first in each submission, so that a submission is still
        # running when the host's next call comes, even on a fast driver (Mesa 26's lavapipe ran
        # the small calls alone to the end before the host's next step: seed 2, sessions 42-43)
        ballast = vkattn.KVCache(2048, hkv, d, dtype=dt, device=device)
        rb = np.random.default_rng(7)
        ballast.append(_data(rb, hkv, 1920, d), _data(rb, hkv, 1920, d))
        graph = vkattn.Graph(device)
        with graph.capture():
            ballast.forward(q, k, v, out=vkattn.empty((hq, 1, d), device))
            for (c, _), o in zip(pairs, outs):
                c.forward(q, k, v, out=o)
        graphs.append(dict(graph=graph, pairs=pairs, ins=(q, k, v), outs=outs, want=None, handle=None))
    third = cache_pair(9)
    pool = vkattn.PagedKVCache(24, 4, hkv, d, dtype=dt, device=device)
    twin_pool = vkattn.PagedKVCache(24, 4, hkv, d, dtype=dt, device=device)
    seqs = [p.add_sequence() for p in (pool, twin_pool)]
    assert seqs[0] == seqs[1]
    in_flight = 0                                   # host calls made while a submission ran
    for step in range(60):
        g = graphs[r.integers(2)]
        op = r.choice(["submit", "submit", "submit", "poll", "read", "kv", "numpy", "truncate", "paged"])
        in_flight += any(h is not None and not h._waited and not h._rec.finished()
                         for h in (x["handle"] for x in graphs))
        if op == "submit" and g["pairs"][0][0].length < 90:
            x = [_data(r, hq, 1, d), _data(r, hkv, 1, d), _data(r, hkv, 1, d)]
            g["want"] = [twin.forward(*x) for _, twin in g["pairs"]]     # (a host call: it would wait)
            for a, host in zip(g["ins"], x):
                a.write(host)                       # waits for whatever graph is in flight
            g["handle"] = g["graph"].submit()
            # whether it is in flight is seen right after submit() too
            h = g["handle"]
            in_flight += not h._waited and not h._rec.finished()
        elif op == "poll" and g["handle"] is not None:
            assert g["handle"].done in (True, False)
        elif op == "read" and g["want"] is not None:
            for o, w in zip(g["outs"], g["want"]):
                assert np.array_equal(o.numpy(), w), (seed, step)
        elif op == "kv":                            # the rows a submission in flight is writing
            for c, twin in g["pairs"]:
                assert all(np.array_equal(a, b) for a, b in zip(c.read(), twin.read())), (seed, step)
        elif op == "numpy":
            c, twin = third
            x = [_data(r, hq, 1, d), _data(r, hkv, 1, d), _data(r, hkv, 1, d)]
            assert np.array_equal(c.forward(*x), twin.forward(*x)), (seed, step)
            c.truncate(9)
            twin.truncate(9)
        elif op == "truncate":
            for c, twin in g["pairs"]:
                n = max(1, c.length - int(r.integers(3)))
                c.truncate(n)
                twin.truncate(n)
            g["want"] = None                        # its outputs stay as the last submission left them
        elif op == "paged" and pool.length(seqs[0]) < 80:
            x = [_data(r, hq, 1, d), _data(r, hkv, 1, d), _data(r, hkv, 1, d)]
            assert np.array_equal(pool.forward([seqs[0]], *x), twin_pool.forward([seqs[1]], *x)), (seed, step)
    assert in_flight > 0 or not device.is_software, seed
    for g in graphs:
        if g["handle"] is not None:
            g["handle"].wait()
            assert g["handle"].done
        if g["want"] is not None:
            for o, w in zip(g["outs"], g["want"]):
                assert np.array_equal(o.numpy(), w), seed
        for c, twin in g["pairs"]:
            assert c.length == twin.length and all(np.array_equal(a, b) for a, b in zip(c.read(), twin.read()))
        g["graph"].close()
    for c in [x for g in graphs for pair in g["pairs"] for x in pair] + list(third) + [pool, twin_pool]:
        c.close()


def test_closing_a_device_waits_for_a_submitted_graph(rng):
    """A device closed while a graph it submitted runs waits for it before anything is freed."""
    dev = vkattn.Device()
    graph, caches, _, outs = _long_graph(dev, rng, layers=2, keys=2000)
    be = dev.backend
    graph.submit()
    assert be.pending is not None
    dev.close()
    assert be.pending is None and be._mgr is None


def test_spin_waits_give_the_same_bits(rng, monkeypatch):
    """VKATTN_SPIN_US (poll the fence before blocking): numpy calls and a graph's submit / wait
    give the same results bit for bit as the blocking wait; a bad value is a ValueError naming the
    variable, before any device is made."""
    monkeypatch.setenv("VKATTN_SPIN_US", "-3")
    with pytest.raises(ValueError, match="VKATTN_SPIN_US='-3'"):
        vkattn.Device()
    results = {}
    for spin in ("", "3000"):
        monkeypatch.setenv("VKATTN_SPIN_US", spin)
        dev = vkattn.Device()
        assert dev.backend.spin_s == (0.003 if spin else 0.0)
        data = np.random.default_rng(3)
        got = []
        graph, caches, (q, k, v), outs = _long_graph(dev, data, layers=2, keys=300)
        got += [caches[0].forward(_data(data, 8, 1, 64), _data(data, 4, 1, 64), _data(data, 4, 1, 64))]
        for _ in range(2):
            handle = graph.submit()
            handle.wait()
            got += [o.numpy() for o in outs]
        graph.close()
        results[spin] = got
    assert all(np.array_equal(a, b) for a, b in zip(results[""], results["3000"]))


def test_graph_submit_waits_with_a_kp_that_cannot_submit_without_waiting(device, rng, monkeypatch):
    """Where kp cannot submit without waiting, submit() evaluates and waits; the handle is done."""
    monkeypatch.setattr(_kp, "HAS_ASYNC", False)
    graph, caches, _, outs = _long_graph(device, rng, layers=1, keys=100)
    handle = graph.submit()
    assert not handle._rec._seq.is_running() and handle.done
    handle.wait()
    graph.close()


def test_graph_records_again_when_a_plan_changes_and_refuses_what_breaks_its_rules(device, rng):
    hkv, d = 1, 16
    cache = vkattn.KVCache(4200, hkv, d, dtype="float32", device=device)
    cache.append(_data(rng, hkv, 4090, d), _data(rng, hkv, 4090, d))
    q, k, v, o = (vkattn.empty(s, device) for s in ((2, 1, d), (hkv, 1, d), (hkv, 1, d), (2, 1, d)))
    g = vkattn.Graph(device)
    with g.capture():
        cache.forward(q, k, v, out=o)
    for _ in range(8):                                 # 4091 .. 4098: the decode key bound passes 4096
        g.run()
    assert cache.length == 4098 and g.recordings == 2 and g.submissions == 8
    other = vkattn.Graph(device)
    with other.capture():
        with pytest.raises(ValueError, match="DeviceArrays for q, k, v and out"):
            cache.forward(_data(rng, 2, 1, d), k, v, out=o)
        with pytest.raises(ValueError, match="DeviceArrays for q, k, v and out"):
            cache.forward(q, k, v)
        cache.forward(q, k, v, out=o)
        with pytest.raises(ValueError, match="one call per cache"):
            cache.forward(q, k, v, out=o)
        with pytest.raises(ValueError, match="already capturing"):
            with vkattn.Graph(device).capture():
                pass
        # append runs at once and is not recorded: refused while a graph captures, nothing written
        n = cache.length
        with pytest.raises(ValueError, match="append: a graph is capturing"):
            cache.append(_data(rng, hkv, 2, d), _data(rng, hkv, 2, d))
        pool = vkattn.PagedKVCache(4, 4, hkv, d, dtype="float32", device=device)
        sid = pool.add_sequence()
        with pytest.raises(ValueError, match="append: a graph is capturing"):
            pool.append([sid], _data(rng, hkv, 2, d), _data(rng, hkv, 2, d), n_new=[2])
        assert cache.length == n and pool.length(sid) == 0
    pool.append([sid], _data(rng, hkv, 2, d), _data(rng, hkv, 2, d), n_new=[2])    # after the capture: runs
    assert pool.length(sid) == 2
    pool.close()
    full = vkattn.KVCache(2, hkv, d, dtype="float32", device=device)
    g2 = vkattn.Graph(device)
    with g2.capture():
        full.forward(q, k, v, out=o)
    g2.run()
    g2.run()
    with pytest.raises(vkattn.CacheFullError):
        g2.run()                                       # nothing submitted, nothing changed
    assert full.length == 2 and g2.submissions == 2
    g3 = vkattn.Graph(device)                          # captured on the full cache: its fit is the
    with g3.capture():                                 # submission's (a capture refused it: a model's
        full.forward(q, k, v, out=o)                   # prompt that filled its caches could not decode)
    with pytest.raises(vkattn.CacheFullError):
        g3.run()
    full.truncate(1)
    g3.run()
    assert full.length == 2 and g3.submissions == 1
    with pytest.raises(ValueError, match="inside `with graph.capture"):
        g2.upload(q)


@pytest.mark.parametrize("dtype", ["float16", "q4"])
def test_graph_replay_with_rope_equals_the_general_path(device, rng, dtype):
    """Two caches sharing one RoPE (a model's layers): the replayed decode step writes only the
    words that follow the length and the rotary rows of the new position (memoised across the
    caches); each step's outputs equal, bit for bit, the general path's call by call.
    The second layer slides a window with a sink and a softcap (Gemma's alternating layers), the
    third adds ALiBi slopes, rotates q and is not causal."""
    hkv, d, hq = 2, 32, 4
    kw = [{}, dict(window=4, n_sink=1, softcap=20.0),
          dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625], np.float32), rope_q=True, causal=False)]
    rope = vkattn.RoPE(base=1000.0)
    gpu = [vkattn.KVCache(40, hkv, d, dtype=dtype, device=device, rope=rope) for _ in kw]
    cpu = [vkattn.KVCache(40, hkv, d, dtype=dtype, device=device, rope=rope) for _ in kw]
    for c in cpu:
        c._fast_call = lambda *a, **kw: None            # the general path, call by call
    for a, b in zip(gpu, cpu):
        k, v = _data(rng, hkv, 9, d), _data(rng, hkv, 9, d)
        a.append(k, v)
        b.append(k, v)
    q = [vkattn.empty((hq, 1, d), device) for _ in gpu]
    k = [vkattn.empty((hkv, 1, d), device) for _ in gpu]
    v = [vkattn.empty((hkv, 1, d), device) for _ in gpu]
    out = [vkattn.empty((hq, 1, d), device) for _ in gpu]
    g = vkattn.Graph(device)
    with g.capture():
        g.upload(*q, *k, *v)
        for i, c in enumerate(gpu):
            c.forward(q[i], k[i], v[i], out=out[i], **kw[i])
        g.download(*out)
    for step in range(6):
        data = [(_data(rng, hq, 1, d), _data(rng, hkv, 1, d), _data(rng, hkv, 1, d)) for _ in gpu]
        for i, (qq, kk, vv) in enumerate(data):
            q[i].host_view()[...], k[i].host_view()[...], v[i].host_view()[...] = qq, kk, vv
        g.run()
        for i, (qq, kk, vv) in enumerate(data):
            want, _ = cpu[i].forward(qq, kk, vv, return_lse=True, **kw[i])
            assert np.array_equal(out[i].host_view(), want), (step, i)
    assert [c.length for c in gpu] == [c.length for c in cpu] == [15] * len(kw) and g.recordings == 1
    for a, b in zip(gpu, cpu):
        for x, y in zip(a.read(), b.read()):
            assert np.array_equal(x, y)
    g.close()


def test_graph_timestamps_time_each_command_and_change_no_result(device, rng):
    """A graph made with timestamps=True gives each recorded command's device time (in ``ops``'
    order) and the same bits as one without; without, or on a device with no timestamp queries,
    an empty list."""
    hkv, d = 2, 24
    caches = [vkattn.KVCache(32, hkv, d, dtype="float16", device=device) for _ in range(2)]
    q, k, v = (vkattn.empty(s, device) for s in ((4, 1, d), (hkv, 1, d), (hkv, 1, d)))
    outs = [vkattn.empty((4, 1, d), device) for _ in range(2)]
    graphs = [vkattn.Graph(device, timestamps=t) for t in (False, True)]
    for c, g, o in zip(caches, graphs, outs):
        with g.capture():
            g.upload(q, k, v)
            c.forward(q, k, v, out=o)
            g.download(o)
    for step in range(3):
        for a in (q, k, v):
            a.host_view()[...] = _data(rng, *a.shape)
        got = []
        for g, o in zip(graphs, outs):
            g.run()
            got.append(o.host_view().copy())
        assert np.array_equal(got[0], got[1]), step
    assert graphs[0].last_timings() == []
    timed = graphs[1].last_timings()
    if device.info.timestamp_compute_and_graphics:
        assert graphs[1].timestamps and [n for n, _ in timed] == graphs[1].ops
        assert all(np.isfinite(ms) and ms >= 0 for _, ms in timed) and sum(ms for _, ms in timed) > 0
    else:
        assert not graphs[1].timestamps and timed == []
    with pytest.raises(TypeError, match="timestamps: expected a bool"):
        vkattn.Graph(device, timestamps="yes")
    for g in graphs:
        g.close()


@pytest.mark.parametrize("dtype,variant", [("float16", False), ("int8", False), ("float16", True)])
def test_paged_batches_on_device_arrays_equal_the_numpy_path_and_replay(device, rng, dtype, variant, monkeypatch):
    """A ragged prefill and a batch decode captured once and replayed, on device arrays: bit for
    bit the numpy path; ``variant``: with ALiBi slopes and not causal. Each step after the
    first takes the one before it on (vkattn.paged._Step.following), new blocks included."""
    from vkattn import paged
    taken = []
    real = paged._Step.following
    monkeypatch.setattr(paged._Step, "following", lambda self, *a: taken.append(real(self, *a)) or taken[-1])
    monkeypatch.setattr(paged._Steady, "of", classmethod(lambda cls, *a: None))     # every step planned
    hkv, g, d = 2, 2, 32
    hq = hkv * g
    kw = dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625], np.float32), causal=False) if variant else {}
    pools = [vkattn.PagedKVCache(32, 16, hkv, d, dtype=dtype, device=device) for _ in range(2)]
    ids = [[p.add_sequence() for _ in range(3)] for p in pools]
    counts = [5, 40, 1]                                   # a ragged prefill: 40 rows go in first
    n = sum(counts)
    q, k, v = _data(rng, hq, n, d), _data(rng, hkv, n, d), _data(rng, hkv, n, d)
    want = pools[0].forward(ids[0], q, k, v, n_new=counts, **kw)
    out = vkattn.empty((hq, n, d), device)
    got = pools[1].forward(ids[1], vkattn.to_device(q, device), vkattn.to_device(k, device),
                           vkattn.to_device(v, device), n_new=counts, out=out, **kw)
    assert got is out and np.array_equal(out.numpy(), want)
    # batch decode, captured once and replayed: bit for bit the numpy path each step
    qd, kd, vd, od = (vkattn.empty(s, device) for s in ((hq, 3, d), (hkv, 3, d), (hkv, 3, d), (hq, 3, d)))
    graph = vkattn.Graph(device)
    with graph.capture():
        graph.upload(qd, kd, vd)
        pools[1].forward(ids[1], qd, kd, vd, out=od, **kw)
        graph.download(od)
    for step in range(20):                              # sequence 0 crosses into a new block
        q1, k1, v1 = _data(rng, hq, 3, d), _data(rng, hkv, 3, d), _data(rng, hkv, 3, d)
        qd.host_view()[...], kd.host_view()[...], vd.host_view()[...] = q1, k1, v1
        graph.run()
        assert np.array_equal(od.host_view(), pools[0].forward(ids[0], q1, k1, v1, **kw)), step
    assert [pools[1].length(s) for s in ids[1]] == [25, 60, 21] and graph.recordings == 1
    # each step after the first: one twin takes the step before it on, the other takes that
    # twin's (the family's, _Step.plan_for: their pools agree)
    assert len(taken) == 19 and all(taken), [t is not None for t in taken]
    for a, b in zip(pools[0].read(ids[0][1]), pools[1].read(ids[1][1])):
        assert np.array_equal(a, b)



def test_host_memory_modes_give_the_same_bits(rng, monkeypatch):
    """Host memory the device uses directly (kp host tensors: lavapipe, integrated GPUs) and the
    staging copies of a discrete GPU give the same results bit for bit, over decode steps that
    split K (the per-tile counters must come back to zero with no upload), a chunk of 37 rows
    and an append, each checked against the reference; a device array round trip; a bad
    VKATTN_HOST_MEMORY is a ValueError; on direct memory a download fixes what the host reads, so
    a later write of that buffer in the same recording is refused, and a recording of uploads
    alone submits nothing (an empty command buffer is no valid submission)."""
    from test_device import gather_program
    monkeypatch.setenv("VKATTN_DECODE_SPLITS", "5")
    results = {}
    for mode in ("staging", "direct"):
        monkeypatch.setenv("VKATTN_HOST_MEMORY", mode)
        dev = vkattn.Device()
        assert dev.backend.direct == (mode == "direct")
        data = np.random.default_rng(7)
        got = []
        with vkattn.KVCache(300, 2, 40, dtype="float16", device=dev) as c:
            c.append(_data(data, 2, 200, 40), _data(data, 2, 200, 40))
            for n in (1, 1, 37, 1, 1):
                q = _data(data, 6, n, 40)
                got.append(c.forward(q, _data(data, 2, n, 40), _data(data, 2, n, 40)))
                k, v = c.read()
                np.testing.assert_allclose(got[-1], attention(q, k, v), atol=2e-5, rtol=2e-4)
            x = _data(data, 3, 8)
            a = vkattn.to_device(x, dev)
            assert np.array_equal(a.numpy(), x) and a.buffer.direct == (mode == "direct")
            got += [a.numpy(), k]
            a.close()
        results[mode] = got
        if mode == "direct":
            be = dev.backend
            src, dst = be.buffer(64, np.uint32, name="src"), be.buffer(64, np.uint32, name="dst")
            params = be.buffer(17, np.uint32, name="params")
            copy, dummies = gather_program(be, src, dst, params, "copy")
            assert be.recording().upload(src, params).dispatch(copy).download(dst).ops == ["copy", "host barrier dst"]
            only_uploads = be.recording().upload(src, params).build()   # nothing to submit: no empty submission
            assert only_uploads.ops == [] and not only_uploads.submits and only_uploads.timings(1.0) == []
            only_uploads.run()
            only_uploads.submit()
            only_uploads.wait()
            only_uploads.destroy()
            with pytest.raises(vkattn.SyncHazardError, match="after its download"):
                be.recording().dispatch(copy).download(dst).dispatch(copy, barriers=True)
            with pytest.raises(vkattn.SyncHazardError, match="after its download"):
                be.recording().download(src).upload(src)
        dev.close()
    assert len(results["staging"]) == len(results["direct"]) == 7
    for s, d in zip(results["staging"], results["direct"]):
        assert np.array_equal(s, d)
    monkeypatch.setenv("VKATTN_HOST_MEMORY", "mapped")
    with pytest.raises(ValueError, match="VKATTN_HOST_MEMORY"):
        vkattn.Device()


def _mask(rng, *shape):
    """An additive mask with -inf entries (never a whole row: column 0 stays finite)."""
    m = _data(rng, *shape)
    m[..., 1:][rng.random(m[..., 1:].shape) < 0.2] = -np.inf
    return m


@pytest.mark.parametrize("dtype,per_head", [("float32", False), ("float16", True), ("int8", False)])
def test_device_masks_equal_numpy_masks_bit_for_bit(device, rng, dtype, per_head):
    """A mask given as a DeviceArray wider than the keys (its first length + n columns read, on
    the device: shaders/mask_copy.comp) gives the numpy mask's result bit for bit: a prefill, a
    decode, a chunk appended first (41 rows), attend, on numpy and on device q / out; and the
    reference's within the dtype's tolerance."""
    hkv, g, d = 2, 3, 40 if dtype == "float32" else 48
    hq, cap = hkv * g, 96
    twin = [vkattn.KVCache(cap, hkv, d, dtype=dtype, device=device) for _ in range(2)]
    for step, n in enumerate((9, 1, 41, 1)):
        q, k, v = _data(rng, hq, n, d), _data(rng, hkv, n, d), _data(rng, hkv, n, d)
        total = twin[0].length + n
        wide = _mask(rng, *((hq,) if per_head else ()), n, cap + 3)      # columns past total: ignored
        want, want_lse = twin[0].forward(q, k, v, mask=np.ascontiguousarray(wide[..., :total]), return_lse=True)
        mask = vkattn.to_device(wide, device)
        if step % 2:                              # device q, k, v and out
            out = vkattn.empty((hq, n, d), device)
            twin[1].forward(*(vkattn.to_device(x, device) for x in (q, k, v)), mask=mask, out=out)
            got = out.numpy()
        else:
            got, lse = twin[1].forward(q, k, v, mask=mask, return_lse=True)
            assert np.array_equal(lse, want_lse)
        assert np.array_equal(got, want), step
        ks, vs = twin[1].read()
        ref = attention(q, ks, vs, mask=wide[..., :total])
        np.testing.assert_allclose(got, ref, atol=2e-5, rtol=2e-4)
    q = _data(rng, hq, 3, d)
    wide = _mask(rng, *((hq,) if per_head else ()), 3, cap)
    assert np.array_equal(twin[1].attend(q, mask=vkattn.to_device(wide, device)),
                          twin[0].attend(q, mask=np.ascontiguousarray(wide[..., :twin[0].length])))


def test_device_masks_apply_the_mask_limit_rule(device, rng):
    """A device mask's entries past 2**127 (which the host never reads): below -2**127 -- float32's
    lowest value, -2.5e38, just past the limit -- they mask their key (-inf), as the reference's
    rule has it for numpy masks; above 2**127 they count as 2**127; -2**127 itself is a finite
    entry like any other. shaders/mask_copy.comp applies the rule while copying (the kernels read
    entries as written); the result equals the numpy mask's with the rule applied, bit for bit."""
    hkv, g, d = 1, 2, 24
    big = np.float32(np.finfo(np.float32).max)
    twin = [vkattn.KVCache(32, hkv, d, dtype="float32", device=device) for _ in range(2)]
    for c in twin:
        c.append(*(_data(np.random.default_rng(3), hkv, 7, d) for _ in range(2)))
    for low in (-big, np.float32(-2.5e38), np.float32(-2.0 ** 127 * 1.01)):
        m = np.zeros((1, 8), np.float32)
        m[0, :-1] = -np.inf
        m[0, -1] = low                                        # every key masked
        q, k, v = _data(rng, hkv * g, 1, d), _data(rng, hkv, 1, d), _data(rng, hkv, 1, d)
        got = twin[1].forward(q, k, v, mask=vkattn.to_device(m, device))
        twin[0].forward(q, k, v, mask=m)
        assert not got.any()                                  # a row that sees no key gives zeros
        for c in twin:
            c.truncate(7)
    m = np.zeros((2, 9), np.float32)                          # 7 keys and 2 new rows
    m[0, 1:] = -np.inf
    m[0, 0] = np.float32(-2.0 ** 127)                         # the limit itself: key 0 stays visible
    m[1, :3] = np.float32(3e38)                               # past the limit: 2**127 on each
    q, k, v = _data(rng, hkv * g, 2, d), _data(rng, hkv, 2, d), _data(rng, hkv, 2, d)
    got = twin[1].forward(q, k, v, mask=vkattn.to_device(m, device))
    ruled = np.minimum(m, np.float32(2.0 ** 127))
    assert np.array_equal(got, twin[0].forward(q, k, v, mask=ruled))
    ks, vs = twin[1].read()
    np.testing.assert_allclose(got, attention(q, ks, vs, mask=ruled), atol=2e-5, rtol=2e-4)
    np.testing.assert_array_equal(got[:, 0], np.repeat(vs[:, 0], g, axis=0))    # v of key 0, each head
    for c in twin:
        c.close()


def test_device_mask_checks_lose_nothing(device, rng):
    """A device mask of the wrong rows or heads, narrower than the keys, or closed: a typed error
    naming it, the cache unchanged; a numpy mask inside a graph replayed at another length, or a
    device mask the grown cache outruns, refused at the submission with nothing changed."""
    hkv, d = 1, 16
    cache = vkattn.KVCache(40, hkv, d, dtype="float16", device=device)
    cache.append(_data(rng, hkv, 5, d), _data(rng, hkv, 5, d))
    q, k, v = _data(rng, 2, 2, d), _data(rng, hkv, 2, d), _data(rng, hkv, 2, d)
    for shape in ((3, 8), (2, 6), (3, 2, 8), (2, 2, 2, 8)):        # 7 keys after the append
        with pytest.raises(ValueError, match=r"expected a DeviceArray of shape \(2, C\) or \(2, 2, C\) with C >= 7"):
            cache.forward(q, k, v, mask=vkattn.empty(shape, device))
    closed = vkattn.empty((2, 7), device)
    closed.close()
    with pytest.raises(vkattn.CacheClosedError):
        cache.forward(q, k, v, mask=closed)
    with pytest.raises(TypeError, match="numpy.ndarray or a vkattn.DeviceArray"):
        cache.forward(q, k, v, mask=[[0.0] * 7] * 2)
    assert cache.length == 5
    qd, kd, vd, od = (vkattn.empty(s, device) for s in ((2, 1, d), (hkv, 1, d), (hkv, 1, d), (2, 1, d)))
    g = vkattn.Graph(device)
    with g.capture():
        cache.forward(qd, kd, vd, out=od, mask=np.zeros((1, 6), np.float32))
    g.run()
    with pytest.raises(ValueError, match="a numpy mask covers the 6 keys"):
        g.run()
    assert cache.length == 6 and g.submissions == 1
    narrow = vkattn.zeros((1, 8), device)
    g2 = vkattn.Graph(device)
    with g2.capture():
        cache.forward(qd, kd, vd, out=od, mask=narrow)
    g2.run()
    g2.run()
    with pytest.raises(ValueError, match="DeviceArray of 8 columns, but the call attends 9 keys"):
        g2.run()
    assert cache.length == 8 and g2.submissions == 2


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_graph_replays_a_mask_the_callers_dispatch_writes(device, rng, dtype, scale_spirv):
    """The caller's own kernel writes the mask (0.5 x + 1 of an array it uploads) and the cache
    call reads it in the same submission (a barrier between): replayed over decode steps, one
    recording, every output bit for bit the numpy path with the mask computed on the host."""
    hkv, g, d, cap = 2, 2, 32, 64
    hq = hkv * g
    gpu, cpu = (vkattn.KVCache(cap, hkv, d, dtype=dtype, device=device) for _ in range(2))
    k0, v0 = _data(rng, hkv, 11, d), _data(rng, hkv, 11, d)
    gpu.append(k0, v0)
    cpu.append(k0, v0)
    src, mask = vkattn.empty((hq, 1, cap), device), vkattn.empty((hq, 1, cap), device)
    q, k, v, out = (vkattn.empty(s, device) for s in ((hq, 1, d), (hkv, 1, d), (hkv, 1, d), (hq, 1, d)))
    graph = vkattn.Graph(device)
    with graph.capture():
        graph.upload(src, q, k, v)
        graph.dispatch(_scale(src, mask, scale_spirv), reads=[src], writes=[mask])
        gpu.forward(q, k, v, out=out, mask=mask)
        graph.download(out)
    for step in range(6):
        x, q1, k1, v1 = _data(rng, hq, 1, cap), _data(rng, hq, 1, d), _data(rng, hkv, 1, d), _data(rng, hkv, 1, d)
        src.host_view()[...], q.host_view()[...], k.host_view()[...], v.host_view()[...] = x, q1, k1, v1
        graph.run()
        m = (np.float32(0.5) * x + np.float32(1.0)).astype(np.float32)[..., :cpu.length + 1]
        assert np.array_equal(out.host_view(), cpu.forward(q1, k1, v1, mask=np.ascontiguousarray(m))), step
    assert gpu.length == cpu.length == 17 and graph.recordings == 1
    assert "mask_copy" in graph.ops and sum(op.startswith("barrier") for op in graph.ops) >= 2
    graph.close()


def test_paged_device_masks_equal_numpy_masks_bit_for_bit(device, rng):
    """A batch of three sequences, one mask each -- two DeviceArrays (wider than their keys) and
    one numpy array -- equals the all-numpy call bit for bit, fused and appended first."""
    hkv, g, d = 2, 2, 32
    hq = hkv * g
    pools = [vkattn.PagedKVCache(32, 16, hkv, d, dtype="float16", device=device) for _ in range(2)]
    ids = [[p.add_sequence() for _ in range(3)] for p in pools]
    for counts in ([5, 40, 1], [1, 2, 3]):
        n = sum(counts)
        q, k, v = _data(rng, hq, n, d), _data(rng, hkv, n, d), _data(rng, hkv, n, d)
        totals = [pools[0].length(s) + c for s, c in zip(ids[0], counts)]
        wide = [_mask(rng, hq, c, t + 5) for c, t in zip(counts, totals)]
        want = pools[0].forward(ids[0], q, k, v, n_new=counts,
                                mask=[np.ascontiguousarray(m[..., :t]) for m, t in zip(wide, totals)])
        masks = [vkattn.to_device(wide[0], device), np.ascontiguousarray(wide[1][..., :totals[1]]),
                 vkattn.to_device(wide[2], device)]
        got = pools[1].forward(ids[1], q, k, v, n_new=counts, mask=masks)
        assert np.array_equal(got, want), counts


@pytest.mark.parametrize("paged", [False, True])
def test_a_graph_whose_array_was_closed_refuses_its_replay(device, rng, paged):
    """An array a captured call reads or writes, closed before a replay (of a KVCache's call or a
    PagedKVCache's): the replay is a CacheClosedError naming it, nothing is submitted and the
    cache keeps its length."""
    hkv, d = 2, 16
    k, v = _data(rng, hkv, 5, d), _data(rng, hkv, 5, d)
    if paged:
        cache = vkattn.PagedKVCache(8, 4, hkv, d, dtype="float16", device=device)
        sid = cache.add_sequence()
        cache.append([sid], k, v, n_new=[5])
        length = lambda: cache.length(sid)
    else:
        cache = vkattn.KVCache(40, hkv, d, dtype="float16", device=device)
        cache.append(k, v)
        length = lambda: cache.length
    arrays = [vkattn.empty(s, device) for s in ((4, 1, d), (hkv, 1, d), (hkv, 1, d), (4, 1, d))]
    graph = vkattn.Graph(device)
    with graph.capture():
        if paged:
            cache.forward([sid], *arrays[:3], out=arrays[3])
        else:
            cache.forward(*arrays[:3], out=arrays[3])
    graph.run()
    assert length() == 6
    for a in (arrays[3], arrays[0]):
        a.close()
        with pytest.raises(vkattn.CacheClosedError, match="DeviceArray is closed"):
            graph.run()
        assert length() == 6 and graph.submissions == 1
    graph.close()
    cache.close()


@pytest.mark.parametrize("item", ["upload", "download", "dispatch"])
@pytest.mark.parametrize("when", ["before the first run", "before a replay"])
def test_a_graph_whose_callers_array_was_closed_refuses_to_run(device, rng, scale_spirv, item, when):
    """The caller's own items -- an upload, a download, a kp dispatch -- over an array closed
    after capture: the run is a CacheClosedError and nothing is submitted (the recorded command
    buffer would reach freed memory: a segmentation fault before the check), the other arrays
    as the last run left them."""
    a, b = vkattn.to_device(_data(rng, 4, 64), device), vkattn.empty((4, 64), device)
    graph = vkattn.Graph(device)
    with graph.capture():
        if item == "upload":
            graph.upload(a)
        elif item == "download":
            graph.download(a)
        else:
            graph.dispatch(_scale(a, b, scale_spirv), reads=[a], writes=[b])
    if when == "before a replay":
        graph.run()
    before = b.numpy()
    a.close()
    for _ in range(2):
        with pytest.raises(vkattn.CacheClosedError, match="DeviceArray is closed"):
            graph.run()
    assert graph.submissions == (1 if when == "before a replay" else 0)
    assert np.array_equal(b.numpy(), before)
    graph.close()


def test_a_graphs_upload_download_and_dispatch_check_their_arrays(device, rng, scale_spirv):
    """upload / download / dispatch take DeviceArrays of the graph's own Device object, open:
    anything else is refused before anything is recorded (a bad second array leaves the first
    unrecorded too)."""
    a, b = vkattn.to_device(_data(rng, 4, 64), device), vkattn.empty((4, 64), device)
    other = vkattn.Device(device.index)                 # another Device object: its own kp.Manager
    c = vkattn.empty((4, 64), other)
    closed = vkattn.empty((4, 64), device)
    closed.close()
    graph = vkattn.Graph(device)
    with graph.capture():
        for record in (graph.upload, graph.download):
            with pytest.raises(ValueError, match="must be DeviceArrays on .* got ndarray"):
                record(a, _data(rng, 4, 64))
            with pytest.raises(ValueError, match="must be DeviceArrays on .* got list"):
                record([a])
            with pytest.raises(ValueError, match="another vkattn.Device object of the same device"):
                record(a, c)
            with pytest.raises(vkattn.CacheClosedError, match="DeviceArray is closed"):
                record(a, closed)
        with pytest.raises(ValueError, match="another vkattn.Device object"):
            graph.dispatch(_scale(a, b, scale_spirv), reads=[a], writes=[c])
        with pytest.raises(vkattn.CacheClosedError):
            graph.dispatch(_scale(a, b, scale_spirv), reads=[a], writes=[closed])
    assert graph._items == []
    graph.close()
    c.close()
    other.close()


@pytest.mark.parametrize("graph", [False, True])
def test_a_paged_batch_of_more_device_masks_than_the_kept_programs(device, rng, graph):
    """Twelve sequences, each with a DeviceArray mask, in one batch call (and in a graph): a plan
    kept its last eight mask-copy programs, so building the ninth destroyed the first, which the
    call then dispatched (a segmentation fault). Bit for bit the numpy masks' result."""
    n, hkv, d, hq = 12, 1, 32, 2
    pools = [vkattn.PagedKVCache(64, 16, hkv, d, dtype="float32", device=device) for _ in range(2)]
    ids = [[p.add_sequence() for _ in range(n)] for p in pools]
    k0 = _data(rng, hkv, 3 * n, d)
    for p, i in zip(pools, ids):
        p.append(i, k0, k0, n_new=[3] * n)
    masks = [_data(rng, 1, 8) for _ in range(n)]
    q, k, v = _data(rng, hq, n, d), _data(rng, hkv, n, d), _data(rng, hkv, n, d)
    want = pools[1].forward(ids[1], q, k, v, mask=[np.ascontiguousarray(m[:, :4]) for m in masks])
    dev_masks = [vkattn.to_device(m, device) for m in masks]
    if graph:
        out = vkattn.empty((hq, n, d), device)
        qd, kd, vd = (vkattn.to_device(x, device) for x in (q, k, v))
        g = vkattn.Graph(device)
        with g.capture():
            pools[0].forward(ids[0], qd, kd, vd, out=out, mask=dev_masks)
        g.run()
        got = out.numpy()
        g.close()
    else:
        got = pools[0].forward(ids[0], q, k, v, mask=dev_masks)
    assert np.array_equal(got, want)
    for p in pools:
        p.close()


@pytest.mark.parametrize("paged", [False, True])
def test_out_must_not_be_an_input_of_the_call(device, rng, paged):
    """``out=`` the very DeviceArray given as q, k or v: one dispatch reads those while its other
    workgroups write out (out=k of 24 new int8 rows corrupted the output and the cache). Refused
    with ValueError, on the fast path and the general one, in a graph too; nothing changed."""
    hkv, d, n = 2, 32, 24
    hq = hkv                                        # q, k, v and out of one shape
    if paged:
        cache = vkattn.PagedKVCache(16, 16, hkv, d, dtype="int8", device=device)
        sid = cache.add_sequence()
        call = lambda *a, **kw: cache.forward([sid], *a, n_new=[n], **kw)
        length = lambda: cache.length(sid)
    else:
        cache = vkattn.KVCache(64, hkv, d, dtype="int8", device=device)
        call, length = cache.forward, lambda: cache.length
    q, k, v = (vkattn.to_device(_data(rng, hkv, n, d), device) for _ in range(3))
    for alias in (q, k, v):
        for kw in ({}, dict(window=8)):             # the fast path, and a call it hands over
            with pytest.raises(ValueError, match="out: the same DeviceArray as q, k or v"):
                call(q, k, v, out=alias, **kw)
        g = vkattn.Graph(device)
        with g.capture():
            with pytest.raises(ValueError, match="out: the same DeviceArray as q, k or v"):
                call(q, k, v, out=alias)
        g.close()
    assert length() == 0
    out = vkattn.empty((hq, n, d), device)
    call(q, k, v, out=out)
    assert length() == n
    cache.close()


def test_transfers_in_a_graph_are_ordered_in_both_host_memory_modes(rng, monkeypatch, scale_spirv):
    """A graph's uploads and downloads against its dispatches (a review under synchronization
    validation): with staging copies, an upload then a dispatch that writes the buffer, an upload
    then a download of it, a device mask copied into an uploaded aux block (a plain call too)
    each get a barrier (they gave write-after-write / read-after-write hazards: kp's copy orders
    an upload before shader reads only); an upload after the buffer's download in the same
    graph is refused in both modes (the download overwrote the staging copy the upload sent: a
    wrong value); on direct memory an upload after a dispatch used the buffer is refused (an
    upload there is the host's write before the submission: the graph computed with the wrong
    value). The results equal in both modes, checked against numpy."""
    results = {}
    for mode in ("staging", "direct"):
        monkeypatch.setenv("VKATTN_HOST_MEMORY", mode)
        dev = vkattn.Device()
        x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
        a, b, c = (vkattn.to_device(x, dev) for _ in range(3))
        f = lambda z: np.float32(0.5) * z + np.float32(1.0)     # noqa: E731
        g = vkattn.Graph(dev)
        with g.capture():
            g.upload(a, b)
            g.dispatch(_scale(a, b, scale_spirv), reads=[a], writes=[b])   # writes what it uploaded
            g.download(b)
            g.upload(c)
            g.download(c)                                                  # an upload, then its download
        a.host_view()[...] = x
        c.host_view()[...] = 2 * x
        g.run()
        got = [b.host_view().copy(), c.host_view().copy()]
        np.testing.assert_array_equal(got[0], f(x))
        np.testing.assert_array_equal(got[1], 2 * x)
        g.close()
        bad = vkattn.Graph(dev)
        with bad.capture():
            bad.dispatch(_scale(a, b, scale_spirv), reads=[a], writes=[b])
            bad.download(b)
            bad.upload(b)
        with pytest.raises(vkattn.SyncHazardError, match="after its download"):
            bad.run()
        bad.close()
        late = vkattn.Graph(dev)
        with late.capture():
            late.dispatch(_scale(a, b, scale_spirv), reads=[a], writes=[b])
            late.upload(a)
            late.dispatch(_scale(a, c, scale_spirv), reads=[a], writes=[c])
        if mode == "direct":
            with pytest.raises(vkattn.SyncHazardError, match="direct host memory an upload is the host's write"):
                late.run()
        else:
            a.host_view()[...] = 3 * x
            late.run()
            np.testing.assert_array_equal(c.numpy(), f(3 * x))
        late.close()
        # a device mask: copied into the aux block the call uploads (a plain call, then a graph)
        cache = vkattn.KVCache(32, 1, 32, dtype="float32", device=dev)
        cache.append(*(np.random.default_rng(5).standard_normal((1, 9, 32)).astype(np.float32) for _ in range(2)))
        q = np.random.default_rng(6).standard_normal((2, 1, 32)).astype(np.float32)
        m = np.random.default_rng(7).standard_normal((1, 16)).astype(np.float32)
        dm = vkattn.to_device(m, dev)
        got.append(cache.attend(q, mask=dm))
        np.testing.assert_allclose(got[-1], attention(q, *cache.read(), causal=True, mask=m[:, :9]),
                                   atol=2e-5, rtol=2e-4)
        results[mode] = got
        cache.close()
        for arr in (a, b, c, dm):
            arr.close()
        dev.close()
    for x, y in zip(results["staging"], results["direct"]):
        assert np.array_equal(x, y)
