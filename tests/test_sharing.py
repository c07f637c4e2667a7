"""Plans outlive shapes and layers (issue 23 item 1): the pipelines of a model's layers are built
once per device (kp patched to share a VkPipeline among programs of the same SPIR-V, spec constants
and layout), and the per-call scratch buffers (q, new rows, out, lse, rotary table, split-K
partials) are shared by every cache's plans of the same sizes on a device, used under the
device's lock. Results must stay each layer's own."""
import threading

import numpy as np
import pytest

import vkattn
from conftest import Mirror, assert_close, rand_kv, rand_q


@pytest.fixture(scope="module")
def fresh(device):
    """A device of its own (a second kp manager on the same physical device): counts of live
    pipelines and shared buffers are not disturbed by other tests' caches."""
    dev = vkattn.Device(device.index)
    yield dev
    dev.close()


def _layers(device, n, dtype="float16"):
    return [vkattn.KVCache(300, 2, 40, dtype=dtype, device=device) for _ in range(n)]


def _prompt(rng, layers, s):
    """Every layer gets its own prompt; returns [(out, reference)] per layer."""
    got = []
    for c in layers:
        m = Mirror(c)
        q, (k, v) = rand_q(rng, c, 3, s), rand_kv(rng, c, s)
        m.append(k, v)
        got.append((c.forward(q, k, v), m.ref(q)))
    return got


def test_layers_build_the_pipelines_of_one(fresh, rng):
    device = fresh
    be = device.backend
    if not be.shares_pipelines:
        pytest.skip("kp without scripts/kp-0.9.0-features.patch: pipelines are not shared")
    before = be.pipeline_count()
    one = _layers(device, 1)
    _prompt(rng, one, 37)
    after_one = be.pipeline_count()
    assert after_one > before
    many = _layers(device, 5)
    _prompt(rng, many, 37)
    assert be.pipeline_count() == after_one          # five more layers: no pipeline built
    for c in one + many:
        c.close()
    # the device keeps them built (Backend.keep_pipeline): a new layer of the shape builds none
    assert be.pipeline_count() == after_one
    again = _layers(device, 2)
    got = _prompt(rng, again, 37)
    assert be.pipeline_count() == after_one
    for out, ref in got:
        assert_close(out, ref, "float16")
    for c in again:
        c.close()
    # released, the last holder destroys them
    assert be.release_pipelines() >= after_one - before
    assert be.pipeline_count() == before


def test_kept_pipelines_are_bounded_and_least_recent_go_first(device, rng, monkeypatch):
    """keep_pipelines bounds the pipelines kept without a program; the least recently built or
    reused go first, and one still held by a program lives on whatever happens to its pin. A
    device of its own, so the counts are this test's."""
    dev = vkattn.Device(device.index)
    be = dev.backend
    try:
        if not be.shares_pipelines:
            pytest.skip("kp without scripts/kp-0.9.0-features.patch: pipelines are not shared")
        base = be.pipeline_count()
        be.keep_pipelines = 3
        held = vkattn.KVCache(64, 2, 40, dtype="float16", device=dev)
        _prompt(rng, [held], 5)
        n_held = be.pipeline_count() - base
        for dtype in ("float32", "int8", "bfloat16"):      # three more formats, each its own pipelines
            c = vkattn.KVCache(64, 2, 40, dtype=dtype, device=dev)
            _prompt(rng, [c], 5)
            c.close()
            assert len(be._pins) <= 3
        # the held cache's pipelines plus at most 3 kept of the others
        kept = be.pipeline_count()
        assert base + n_held <= kept <= base + n_held + 3
        c = vkattn.KVCache(64, 2, 40, dtype="bfloat16", device=dev)   # the most recent: still built
        _prompt(rng, [c], 5)
        assert be.pipeline_count() == kept
        c.close()
        held.reset()
        got = _prompt(rng, [held], 3)                        # still runs: its pipelines were held
        assert_close(*got[0], "float16")
        be.keep_pipelines = 0                                # keeps nothing new
        c = vkattn.KVCache(64, 1, 24, dtype="float32", device=dev)
        _prompt(rng, [c], 4)
        c.close()
        held.close()
        be.release_pipelines()
        assert be.pipeline_count() == base and not be._pins
    finally:
        dev.close()


def test_scratch_is_shared_and_each_layer_keeps_its_result(fresh, rng):
    device = fresh
    be = device.backend
    layers = _layers(device, 4)
    # every layer's output is a copy: later layers' calls through the same scratch leave it alone
    results = _prompt(rng, layers, 29)
    for out, ref in results:
        assert_close(out, ref, "float16")
    names = {}
    for c in layers:
        for plan in c._plans.values():
            for attr in ("q", "out", "lse", "nk", "nv"):
                b = getattr(plan, attr, None)
                if b is not None:
                    names.setdefault((type(plan).__name__, attr), set()).add(id(b))
    assert names and all(len(ids) == 1 for ids in names.values()), names
    assert all(c.length == 29 for c in layers)
    for c in layers:
        c.close()
    assert not list(be._shared.keys()), list(be._shared.keys())   # the last holder freed each one


def test_closing_one_layer_leaves_the_others_working(device, rng):
    layers = _layers(device, 3, dtype="int8")
    _prompt(rng, layers, 20)
    layers[1].close()
    for out, ref in _prompt(rng, [vkattn.KVCache(300, 2, 40, dtype="int8", device=device)], 20):
        assert_close(out, ref, "int8")
    m = Mirror(layers[2])
    m.k, m.v = layers[2].read()
    q, (k, v) = rand_q(rng, layers[2], 3, 1), rand_kv(rng, layers[2], 1)
    m.append(k, v)
    assert_close(layers[2].forward(q, k, v), m.ref(q), "int8")
    layers[0].close()
    layers[2].close()


def test_caches_on_one_device_from_two_threads(device, rng):
    # the shared scratch is used under the device's lock: concurrent callers stay correct
    layers = _layers(device, 2, dtype="float32")
    data = []
    for c in layers:
        q, (k, v) = rand_q(rng, c, 3, 23), rand_kv(rng, c, 23)
        m = Mirror(c)
        m.append(k, v)
        data.append((q, k, v, m.ref(q)))
    errors = []

    def work(i):
        try:
            c = layers[i]
            q, k, v, ref = data[i]
            for _ in range(6):
                c.reset()
                assert_close(c.forward(q, k, v), ref, "float32")
        except Exception as e:            # reported below: an assert in a thread is not a failure
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in layers:
        c.close()
    assert not errors, errors


def test_padding_of_shared_scratch_is_cleared(fresh, rng):
    # head_dim 32 fills its q rows; head_dim 29 pads each row to the same 32 floats, so both
    # plans get the same shared q/new_k/new_v buffers: the second must not read the first's
    # values as its padding (put_rows zeroes it)
    full = vkattn.KVCache(64, 2, 32, dtype="float32", device=fresh)
    padded = vkattn.KVCache(64, 2, 29, dtype="float32", device=fresh)
    for c in (full, padded):
        q, (k, v) = rand_q(rng, c, 2, 7) * 30, rand_kv(rng, c, 7)
        m = Mirror(c)
        m.append(k, v)
        assert_close(c.forward(q, k, v), m.ref(q), "float32")
    assert full._plans.keys() == padded._plans.keys()
    for key in full._plans:
        assert getattr(full._plans[key], "q", None) is getattr(padded._plans[key], "q", None)
    full.close()
    padded.close()


def test_a_pin_the_driver_refuses_leaves_the_program_standing(device, rng):
    """Keeping a pipeline is an optimisation: where the driver refuses the pin (kp raises), the
    program is built and runs, and nothing is kept for it."""
    import kp
    dev = vkattn.Device(device.index)
    be = dev.backend
    try:
        if not be.shares_pipelines:
            pytest.skip("kp without scripts/kp-0.9.0-features.patch: pipelines are not shared")
        real = be._mgr
        if be._pin_tensor is None:
            be._pin_tensor = real.tensor_t(np.zeros(1, np.uint32), tensor_type=kp.TensorTypes.storage)
        refused = []

        class Refusing:
            def __getattr__(self, name):
                return getattr(real, name)

            def algorithm(self, tensors, *args):
                if all(t is be._pin_tensor for t in tensors):
                    refused.append(len(tensors))
                    raise RuntimeError("vkCreateDescriptorPool: out of pool memory")
                return real.algorithm(tensors, *args)

        kept = dict(be._pins)
        be._mgr = Refusing()
        try:
            c = vkattn.KVCache(64, 3, 24, dtype="float32", device=dev)
            got = _prompt(rng, [c], 7)
            c.close()
        finally:
            be._mgr = real
        assert refused and be._pins == kept
        assert_close(*got[0], "float32")
    finally:
        dev.close()
