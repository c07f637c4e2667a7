"""Subgroup width and the no-shuffle path (issue 20, findings 3 and 4): attn.comp's clusters
halve until the probe holds, VKATTN_TILE_CLUSTER forces one, the no-shuffle path fits 16 KiB at
every head dim, pipelines pin their subgroup size where the device and kp can, and where they
cannot the real pipeline's subgroup size is checked and the cluster shrunk."""
import numpy as np
import pytest

import vkattn
from conftest import Mirror, assert_close, rand_kv, rand_q
from vkattn import tuning
from vkattn._attn import StorageFormat
from vkattn.device import Device, PlanningDevice, forced_tile_cluster


@pytest.mark.parametrize("bad", ["3", "0", "64", "x", "-1", "2.0"])
def test_tile_cluster_switch_is_validated(monkeypatch, bad):
    monkeypatch.setenv("VKATTN_TILE_CLUSTER", bad)
    with pytest.raises(ValueError, match="VKATTN_TILE_CLUSTER"):
        forced_tile_cluster()


def test_tile_cluster_switch_above_the_device_is_refused(device, monkeypatch):
    monkeypatch.delenv("VKATTN_TILE_CLUSTER", raising=False)
    real = device.tile_cluster()
    if real >= tuning.TILE_CLUSTER:
        pytest.skip("the device holds the widest cluster")
    monkeypatch.setenv("VKATTN_TILE_CLUSTER", str(2 * real))
    with pytest.raises(ValueError, match="VKATTN_TILE_CLUSTER"):
        device.tile_cluster()
    monkeypatch.setenv("VKATTN_TILE_CLUSTER", "1")
    assert device.tile_cluster() == 1


def test_tile_cluster_halves_until_the_probe_holds(monkeypatch):
    """A probe that fails above 4 gives 4 (it used to drop straight to 1)."""
    monkeypatch.delenv("VKATTN_TILE_CLUSTER", raising=False)
    dev = Device(vkattn.default_device().index)
    try:
        if dev._cluster_wanted() < 8:
            pytest.skip("subgroup narrower than 8")
        tried = []
        monkeypatch.setattr(dev, "_probe", lambda wg, c, **kw: tried.append(c) or c <= 4)
        dev._tile_cluster = None
        assert dev.tile_cluster() == 4
        assert tried == [dev._cluster_wanted() >> i for i in range(len(tried))] and tried[-1] == 4
        monkeypatch.setattr(dev, "_probe", lambda wg, c, **kw: False)
        dev._tile_cluster = None
        assert dev.tile_cluster() == 1
    finally:
        dev.close()


class _Dev:
    """The planner's view of a device whose shuffles hold clusters of ``cluster``."""
    is_software = False
    max_workgroup_size = 1024
    max_workgroup_count = (65535, 65535, 65535)

    def __init__(self, cluster, shared=32768):
        self.cluster, self.max_shared_memory = cluster, shared

    def tile_cluster(self):
        return self.cluster


@pytest.mark.parametrize("cluster", [1, 2, 4, 8, 32])
def test_tile_fits_16k_and_bounds_registers_at_every_head_dim(cluster):
    """Every attn.comp tile up to head_dim 256 uses at most 16 KiB of shared memory and holds at
    most TILE_MAX_UNITS (shuffles) or 4 (shared-memory sums) float vec4 of a row per thread, for
    any shuffle cluster: at cluster 1, head_dim 128 used to need 33,284 bytes and 256 over 64 KiB."""
    dev = _Dev(cluster)
    for d in (5, 37, 64, 96, 128, 192, 256):
        for dtype in ("float16", "float32", "int8", "bfloat16"):
            fmt = StorageFormat(1, d, None, dtype)
            uv = 2 if fmt._ch == 4 else fmt._ch
            units = max(fmt._dk4, fmt._dv4) * fmt._ch // uv
            for group in (1, 2, 4, 8, 32):
                for s in (1, 7, 16, 512):
                    cfg = tuning.tile_config(dev, group, s, fmt._dk4, fmt._dv4, fmt._ch, 4096, 1)
                    assert cfg.shared_bytes(group, fmt._dv4, fmt._ch) <= 16384, (d, dtype, group, s, cfg)
                    per_thread = -(-units // cfg.ds) * uv
                    assert per_thread <= (tuning.TILE_MAX_UNITS if cfg.shuffle else 4), (d, dtype, group, s, cfg)
                    if cfg.shuffle:
                        assert cfg.ds <= max(cluster, 1) or cfg.ds == 1


@pytest.mark.parametrize("dtype", ["float16", "float32", "int8", "bfloat16"])
@pytest.mark.parametrize("cluster", ["1", "2"])
def test_no_shuffle_path_parity_head_dim_256(device, rng, monkeypatch, dtype, cluster):
    """attn.comp with its clusters summing through shared memory (the no-shuffle path), head dims
    256 and 192/128: decode (split-K), a chunk and a fused forward, against the reference."""
    monkeypatch.setenv("VKATTN_KERNEL", "tile")
    monkeypatch.setenv("VKATTN_TILE_CLUSTER", cluster)
    for hkv, g, d, dv in ((1, 4, 256, 256), (2, 2, 192, 128)):
        cache = vkattn.KVCache(300, hkv, d, dv, dtype=dtype, device=device)
        mirror = Mirror(cache)
        if dtype == "int8":
            mirror = None
        k, v = rand_kv(rng, cache, 150)
        cache.append(k, v)
        for s in (1, 9):
            q = rand_q(rng, cache, g, s)
            kk, vv = cache.read()
            ref = vkattn.reference.attention(q, kk[:, :cache.length], vv[:, :cache.length])
            assert_close(cache.attend(q), ref, dtype)
        k1, v1 = rand_kv(rng, cache, 3)
        q1 = rand_q(rng, cache, g, 3)
        got = cache.forward(q1, k1, v1)
        kk, vv = cache.read()
        if mirror is not None:
            mirror.append(k, v)
            mirror.append(k1, v1)
            np.testing.assert_array_equal(kk, mirror.k)
        assert_close(got, vkattn.reference.attention(q1, kk, vv), dtype)
        cache.close()


def _tile_plan(cache, hq, s):
    plans = [p for p in cache._plans.values() if getattr(p, "cfg", None) is not None and p.cfg.kernel == "tile"]
    assert plans
    return plans[-1]


@pytest.mark.parametrize("pin", ["1", "0"])
def test_pipelines_pin_their_subgroup_where_the_device_can(device, rng, monkeypatch, pin):
    """With kp patched (scripts/kp-0.9.0-features.patch) and a device offering subgroupSizeControl
    for compute (lavapipe 22.3 does: 8..8, or 4..4), attn.comp pipelines whose clusters shuffle get
    a required subgroup size >= their cluster with full subgroups where the workgroup is a multiple;
    otherwise (plain kp, VKATTN_PIN_SUBGROUP=0) none, and the real pipeline's width is checked."""
    monkeypatch.setenv("VKATTN_KERNEL", "tile")
    monkeypatch.setenv("VKATTN_PIN_SUBGROUP", pin)
    monkeypatch.delenv("VKATTN_TILE_CLUSTER", raising=False)
    info, be = device.info, device.backend
    can = (pin == "1" and be.can_pin and "subgroupSizeControl" in be.features
           and info.required_subgroup_size_stages & 0x20 and info.subgroup_size_control)
    cache = vkattn.KVCache(200, 2, 128, dtype="float16", device=device)
    k, v = rand_kv(rng, cache, 60)
    cache.append(k, v)
    q = rand_q(rng, cache, 4, 1)
    kk, vv = cache.read()
    assert_close(cache.attend(q), vkattn.reference.attention(q, kk, vv), "float16")
    plan = _tile_plan(cache, 8, 1)
    if plan.cfg.ds == 1 or not plan.cfg.shuffle:
        pytest.skip("no shuffle cluster on this device")
    size, full = plan.subgroup
    if can:
        assert size >= plan.cfg.ds and info.min_subgroup_size <= size <= info.max_subgroup_size
        assert full == ("computeFullSubgroups" in be.features and plan.cfg.wg % size == 0)
        assert not plan._check_width
    else:
        assert (size, full) == (0, False) and plan._check_width
    cache.close()


def test_a_pipeline_narrower_than_its_cluster_is_caught_and_replanned(rng, monkeypatch):
    """Finding 3: the cluster is sized by a probe of a trivial shader, the attention pipeline may
    run narrower. Forced onto a cluster twice the real subgroup (on lavapipe: 16 on 8 lanes, which
    gave NaN), the plan reads the pipeline's gl_SubgroupSize after the run, shrinks the device's
    cluster, builds again and returns the right result."""
    monkeypatch.setenv("VKATTN_KERNEL", "tile")
    monkeypatch.delenv("VKATTN_TILE_CLUSTER", raising=False)
    dev = Device(vkattn.default_device().index)
    try:
        real = dev.tile_cluster()
        if real < 2 or 2 * real > tuning.TILE_CLUSTER:
            pytest.skip("needs a shuffle cluster below TILE_CLUSTER")
        dev._tile_cluster = 2 * real              # what a probe of another pipeline might claim
        cache = vkattn.KVCache(300, 1, 256, dtype="float32", device=dev)
        k, v = rand_kv(rng, cache, 200)
        cache.append(k, v)
        q = rand_q(rng, cache, 2, 1)
        got = cache.attend(q)
        kk, vv = cache.read()
        assert_close(got, vkattn.reference.attention(q, kk, vv), "float32")
        assert dev.tile_cluster() == real
        cache.close()
    finally:
        dev.close()


def test_program_refuses_a_pin_the_backend_cannot_give(device):
    from vkattn.compiler import compile_shader
    be = device.backend
    out = be.buffer(66, np.uint32, name="probe")
    try:
        if be.can_pin and "subgroupSizeControl" in be.features:
            prog = be.program(compile_shader("subgroup_probe"), [out], (1, 1, 1), [64, 1], writes=(0,),
                              name="probe", subgroup=(device.subgroup_size, True))
            prog.destroy()
        else:
            with pytest.raises(ValueError, match="subgroup"):
                be.program(compile_shader("subgroup_probe"), [out], (1, 1, 1), [64, 1], writes=(0,),
                           name="probe", subgroup=(device.subgroup_size, False))
    finally:
        out.destroy()


def test_planning_device_honours_the_switch(monkeypatch, device):
    monkeypatch.setenv("VKATTN_TILE_CLUSTER", "1")
    assert PlanningDevice(device.info).tile_cluster() == 1
