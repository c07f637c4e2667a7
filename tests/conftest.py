import os
import zlib

import numpy as np
import pytest

import vkattn
from vkattn.reference import TOLERANCE, attention, round_to

# scripts/validation.sh's sync pass around a command (`-- make test`): the Khronos layer logs to
# stdout, which an xdist worker points at /dev/null, so each worker's stdout (file descriptor 1,
# where the layer writes) goes to its own file there, opened for appending, which the script counts
if os.environ.get("VKATTN_LAYER_LOG_DIR") and os.environ.get("PYTEST_XDIST_WORKER"):
    _fd = os.open(os.path.join(os.environ["VKATTN_LAYER_LOG_DIR"],
                               f"{os.environ['PYTEST_XDIST_WORKER']}-{os.getpid()}.log"),
                  os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(_fd, 1)
    os.close(_fd)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpuav: a case of the GPU-assisted validation sweep (tests/test_bounds.py "
                            "GPUAV_SWEEP; scripts/validation.sh runs -m gpuav)")


def pytest_collection_modifyitems(config, items):
    # a module's GPUAV_SWEEP ({test function: [parameter ids]}) marks those cases gpuav; an id that
    # names no collected case is an error, so the sweep cannot silently shrink
    named = {}
    for item in items:
        sweep = getattr(item.module, "GPUAV_SWEEP", None)
        if sweep is None:
            continue
        fn, _, ids = item.name.partition("[")
        named.setdefault(item.module.__name__, (sweep, set()))
        if ids.rstrip("]") in sweep.get(fn, ()):
            item.add_marker(pytest.mark.gpuav)
            named[item.module.__name__][1].add((fn, ids.rstrip("]")))
    for mod, (sweep, found) in named.items():
        missing = [f"{fn}[{i}]" for fn, ids in sweep.items() for i in ids if (fn, i) not in found]
        if missing and not config.getoption("keyword") and not config.getoption("markexpr"):
            raise pytest.UsageError(f"{mod}.GPUAV_SWEEP names cases that do not exist: {missing}")


@pytest.fixture(scope="session")
def device():
    return vkattn.default_device()


@pytest.fixture(autouse=True)
def _kernel_runs_here(request):
    """A test parametrised with kernel="lane" skips, naming why, on a device where vkattn never
    picks attn_lane.comp (it needs one subgroup of at most 16 invocations with shuffles: CPU
    drivers; a GPU's subgroup is 32 or 64); kernel="coopmat" where attn_coopmat.comp cannot run
    (Device.coopmat_problem: no VK_KHR_cooperative_matrix, or a glslang without it). attn.comp
    ("tile") runs everywhere."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("kernel") == "lane":
        skip_without_lane(request.getfixturevalue("device"))
    if callspec is not None and callspec.params.get("kernel") == "coopmat":
        skip_or_fail_coopmat(request.getfixturevalue("device").coopmat_problem())


def skip_without_lane(dev) -> None:
    """A skip naming why where vkattn never picks attn_lane.comp (a GPU's subgroup of 32 or 64)."""
    if not dev.lane_subgroup():
        pytest.skip(f"attn_lane.comp needs a subgroup of at most 16 with shuffles; {dev.name} has "
                    f"{dev.subgroup_size}")


def require_texel(dev) -> None:
    """Skip where a known driver fault keeps vkattn off texel buffers (_driverfix.texel_fault:
    llvmpipe of Mesa 25+ at a width other than its CPU's own, Mesa's shader cache on), fail where
    they are missing otherwise (the patched kp binds them on every Vulkan device with a
    maxTexelBufferElements limit)."""
    if dev.texel_buffers:
        return
    from vkattn import _driverfix
    if _driverfix.texel_fault(dev.info.name, dev.info.driver_name, dev.info.driver_info):
        pytest.skip(f"{dev.name}, {dev.info.driver_info}: not this CPU's own llvmpipe width, with Mesa's "
                    f"shader cache on, which mixes the widths' texel pipelines (_driverfix.texel_fault), so "
                    f"vkattn binds no texel buffer (MESA_SHADER_CACHE_DISABLE=true runs them)")
    pytest.fail(f"{dev.name}: no texel buffers (kp built without scripts/kp-0.9.0-features.patch?)")


def skip_or_fail_coopmat(problem: str) -> None:
    """A coopmat test where attn_coopmat.comp cannot run: a skip naming why -- or, with
    VKATTN_REQUIRE_COOPMAT=1 (CI on Mesa 26, whose lavapipe has cooperative matrices), a failure:
    a self-test that fails there must not turn the kernel's whole suite into skips."""
    if problem:
        if os.environ.get("VKATTN_REQUIRE_COOPMAT", "0") not in ("", "0"):
            pytest.fail(f"VKATTN_REQUIRE_COOPMAT: attn_coopmat.comp cannot run here: {problem}")
        pytest.skip(f"attn_coopmat.comp cannot run here: {problem}")


@pytest.fixture
def steady_hits(monkeypatch) -> list:
    """A list that gets, per step vkattn.paged._Steady ran (a steady batch decode step), the
    blocks that step took."""
    from vkattn import paged
    hits, real = [], paged._Steady.step

    def spy(self, cache, *a):
        free = cache._pool.free_blocks
        got = real(self, cache, *a)
        if got is not None:
            hits.append(free - cache._pool.free_blocks)
        return got
    monkeypatch.setattr(paged._Steady, "step", spy)
    return hits


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def assert_close(got, ref, dtype):
    """Parity against the numpy reference at the stated per-dtype tolerance."""
    atol, rtol = TOLERANCE[dtype]
    assert got.shape == ref.shape and got.dtype == np.float32
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, atol=atol, rtol=rtol)


class Mirror:
    """Host copy of what a cache must hold: every appended row, rounded like the cache rounds."""

    def __init__(self, cache):
        self.dtype = cache.dtype
        self.k = np.zeros((cache.num_kv_heads, 0, cache.head_dim), np.float32)
        self.v = np.zeros((cache.num_kv_heads, 0, cache.v_head_dim), np.float32)

    def append(self, k, v):
        self.k = np.concatenate([self.k, round_to(k, self.dtype)], axis=1)
        self.v = np.concatenate([self.v, round_to(v, self.dtype)], axis=1)

    def truncate(self, n):
        self.k, self.v = self.k[:, :n], self.v[:, :n]

    def ref(self, q, causal=True, scale=None):
        return attention(q, self.k, self.v, causal=causal, scale=scale)


def rand_kv(rng, cache, n, dtype=np.float32):
    k = rng.standard_normal((cache.num_kv_heads, n, cache.head_dim)).astype(dtype)
    v = rng.standard_normal((cache.num_kv_heads, n, cache.v_head_dim)).astype(dtype)
    return k, v


def rand_q(rng, cache, group, s, dtype=np.float32):
    return rng.standard_normal((cache.num_kv_heads * group, s, cache.head_dim)).astype(dtype)


def snapshot(cache):
    k, v = cache.read()
    return cache.length, k.copy(), v.copy()


def assert_unchanged(cache, snap):
    n, k, v = snap
    assert cache.length == n
    k2, v2 = cache.read()
    assert np.array_equal(k, k2) and np.array_equal(v, v2)


# log-sum-exp tolerance of the variant tests (all kernels)
LSE_TOL = dict(atol=2e-5, rtol=2e-4)
# the oldest transformers vkattn.hf supports (pyproject.toml's hf extra, vkattn.hf.TRANSFORMERS_MIN):
# an older one skips the tests that need it, naming the version, instead of failing inside transformers
TRANSFORMERS_MIN = "5.23"
HF_SKIP = f"the hf extra is not installed, or its transformers is older than {TRANSFORMERS_MIN} (make setup-hf)"


def variant_args(name, rng, hq, s, total):
    return {
        "window": dict(window=7),
        "window_sinks": dict(window=23, n_sink=4),
        "softcap": dict(softcap=2.5),
        "alibi": dict(alibi_slopes=(2.0 ** -np.arange(1, hq + 1)).astype(np.float32)),
        "mask": dict(mask=np.where(rng.random((s, total)) < 0.2, -np.inf,
                                   rng.standard_normal((s, total))).astype(np.float32)),
        "mask_heads": dict(mask=rng.standard_normal((hq, s, total)).astype(np.float32)),
        "all": dict(window=40, n_sink=3, softcap=5.0,
                    alibi_slopes=np.linspace(0.01, 0.3, hq).astype(np.float32),
                    mask=rng.standard_normal((s, total)).astype(np.float32)),
    }[name]


def append_chunk_decode(rng, cache, group: int, past: int):
    """A quantising format's paths in one sequence: ``past`` rows through append.comp (none: the
    chunk is a prefill), an 11-row chunk through the fused append, a split-K decode step, then an
    attend-only call (5 rows, not causal) over what is stored. Returns (ks, vs) as read back, the
    exact rows (kf, vf), and [(q, out, n_keys), ...] of the chunk and the decode step; the attend
    call is checked here against the reference on the stored values."""
    k0, v0 = rand_kv(rng, cache, max(past, 1))
    if past:
        cache.append(k0, v0)
    else:
        k0, v0 = k0[:, :0], v0[:, :0]
    k1, v1 = rand_kv(rng, cache, 11)
    q1 = rand_q(rng, cache, group, 11)
    out1 = cache.forward(q1, k1, v1)
    k2, v2 = rand_kv(rng, cache, 1)
    q2 = rand_q(rng, cache, group, 1)
    out2 = cache.forward(q2, k2, v2)
    ks, vs = cache.read()
    kf, vf = np.concatenate([k0, k1, k2], axis=1), np.concatenate([v0, v1, v2], axis=1)
    q3 = rand_q(rng, cache, group, 5)
    assert_close(cache.attend(q3, causal=False), attention(q3, ks, vs, causal=False), cache.dtype)
    return ks, vs, kf, vf, [(q1, out1, past + 11), (q2, out2, past + 12)]

