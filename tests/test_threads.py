"""Threads on one device: what an engine's threads do at once -- a scheduler replaying graphs,
others making caches, calling their own caches, closing arrays, building their own kp
algorithms -- each case a defect a concurrency review found (session 44), run so that it would
fail again: results equal to the same calls made alone, and no thread left hanging (joined
with a timeout)."""
import threading

import numpy as np
import pytest

import vkattn
from test_device_path import _data, _scale, scale_spirv  # noqa: F401  (scale_spirv: a fixture)
from vkattn.reference import attention

HKV, D, HQ = 2, 32, 4


def _run(*fns, timeout=120.0):
    """Run each fn in its own thread; the exceptions they raised (a hung thread: a failure)."""
    errors = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as e:     # noqa: BLE001 -- reported to the test
                errors.append(e)
        return run
    threads = [threading.Thread(target=wrap(fn), daemon=True) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


def _decode_graph(device, rng, keys=600):
    caches = [vkattn.KVCache(keys + 400, HKV, D, dtype="float16", device=device) for _ in range(2)]
    for c in caches:
        c.append(_data(rng, HKV, keys, D), _data(rng, HKV, keys, D))
    q, k, v = (vkattn.to_device(_data(rng, h, 1, D), device) for h in (HQ, HKV, HKV))
    outs = [vkattn.empty((HQ, 1, D), device) for _ in caches]
    graph = vkattn.Graph(device)
    with graph.capture():
        for c, o in zip(caches, outs):
            c.forward(q, k, v, out=o)
    return graph, caches, keys


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "int8"])
def test_caches_made_while_another_thread_replays_a_graph(device, rng, dtype):
    """A scheduler thread replays a graph (submit, wait) while another makes and closes caches:
    an fp8 cache's constructor uploads its scales and waited for the graph in flight outside the
    device's lock, both threads then in kp's wait on one fence -- a hang within a few replays, 6
    runs of 6 -- now under the lock."""
    graph, caches, keys = _decode_graph(device, rng)
    stop = threading.Event()
    made = [0]

    def scheduler():
        try:
            for _ in range(150):
                graph.submit().wait()
                for c in caches:
                    c.truncate(keys)
        finally:
            stop.set()

    def maker():
        while not stop.is_set() or made[0] < 5:
            vkattn.KVCache(16, HKV, D, dtype=dtype, device=device).close()
            made[0] += 1
    assert _run(scheduler, maker) == []
    assert graph.submissions == 150 and made[0] >= 5
    graph.close()
    for c in caches:
        c.close()


def test_a_capture_records_its_own_threads_calls_only(device, rng):
    """While thread A is inside ``with graph.capture():``, thread B's calls on its own caches run
    as without it: its numpy forward was refused (a ValueError: a captured call takes device
    arrays) and its device-array forward silently recorded into A's graph, run by A's replays."""
    graph = vkattn.Graph(device)
    mine = vkattn.KVCache(64, HKV, D, dtype="float32", device=device)
    theirs = vkattn.KVCache(64, HKV, D, dtype="float32", device=device)
    theirs.append(_data(rng, HKV, 5, D), _data(rng, HKV, 5, D))
    qa, ka, va, oa = (vkattn.empty(s, device) for s in ((HQ, 1, D), (HKV, 1, D), (HKV, 1, D), (HQ, 1, D)))
    inside, done = threading.Event(), threading.Event()
    seen = {}

    def capturer():
        with graph.capture():
            mine.forward(qa, ka, va, out=oa)
            inside.set()
            assert done.wait(60)

    def other():
        assert inside.wait(60)
        try:
            x = [_data(rng, HQ, 1, D), _data(rng, HKV, 1, D), _data(rng, HKV, 1, D)]
            seen["numpy"] = theirs.forward(*x), attention(x[0], *theirs.read())
            q, k, v = (vkattn.to_device(a, device) for a in (_data(rng, HQ, 1, D), _data(rng, HKV, 1, D),
                                                             _data(rng, HKV, 1, D)))
            out = vkattn.empty((HQ, 1, D), device)
            theirs.forward(q, k, v, out=out)
            seen["device"] = out.numpy(), attention(q.numpy(), *theirs.read())
            theirs.append(_data(rng, HKV, 2, D), _data(rng, HKV, 2, D))
            seen["length"] = theirs.length
        finally:
            done.set()
    assert _run(capturer, other) == []
    for got, want in (seen["numpy"], seen["device"]):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-4)
    assert seen["length"] == 9 and len(graph._items) == 1 and mine.length == 0
    graph.run()
    assert mine.length == 1 and theirs.length == 9
    graph.close()
    for c in (mine, theirs):
        c.close()


def test_two_threads_closing_one_array(device):
    """close() from two threads at once: both saw the memory there, then the second found it gone
    under the lock and raised AttributeError (39% of concurrent double closes in the review).
    Here both wait for the lock this thread holds, so both pass the first look every time."""
    for _ in range(3):
        a = vkattn.empty((4, 64), device)
        errors = []

        def close():
            try:
                a.close()
            except BaseException as e:     # noqa: BLE001 -- reported below
                errors.append(e)
        with device.backend.lock:
            threads = [threading.Thread(target=close, daemon=True) for _ in range(2)]
            for t in threads:
                t.start()
            threading.Event().wait(0.2)     # both blocked on the lock by now
        for t in threads:
            t.join(60)
        assert errors == [] and a.closed


def test_a_callers_kp_algorithm_waits_for_the_device_lock(device, rng, scale_spirv):  # noqa: F811
    """DeviceArray.manager's calls take the device's lock: vkattn sets per-pipeline options on
    the manager (texel formats, a subgroup size) while it builds its own algorithms, and a
    caller's algorithm built by another thread in that window took them (its kernel then read
    texel buffers: all zeros). Held here by this thread, the lock keeps the caller's build
    waiting; released, it builds a kernel that computes 0.5 x + 1."""
    a, b = vkattn.to_device(_data(rng, 4, 64), device), vkattn.empty((4, 64), device)
    built = threading.Event()
    algo = []

    def build():
        algo.append(_scale(a, b, scale_spirv))
        built.set()
    with device.backend.lock:
        t = threading.Thread(target=build, daemon=True)
        t.start()
        assert not built.wait(0.3)
    t.join(60)
    assert built.is_set()
    graph = vkattn.Graph(device)
    with graph.capture():
        graph.dispatch(algo[0], reads=[a], writes=[b])
    graph.run()
    np.testing.assert_array_equal(b.numpy(), np.float32(0.5) * a.numpy() + np.float32(1.0))
    graph.close()
