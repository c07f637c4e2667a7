"""Device selection, limits, the shader compiler and the recording hazard checker."""
import hashlib
import os

import numpy as np
import pytest

import vkattn
from vkattn import compiler, tuning
from vkattn.device import Device


def test_device_limits(device):
    assert isinstance(device.name, str) and device.name
    assert device.subgroup_size >= 1
    assert device.max_shared_memory >= 16384
    assert device.max_storage_buffer_range >= 1 << 20
    assert device.max_workgroup_size >= 64
    assert isinstance(device.is_software, bool)
    assert vkattn.default_device() is vkattn.default_device()
    assert [d.index for d in vkattn.list_devices()] == list(range(len(vkattn.list_devices())))


def test_device_selection(monkeypatch):
    first = vkattn.list_devices()[0]
    monkeypatch.setenv("VKATTN_DEVICE", first.name[:6].upper())
    dev = Device()
    assert dev.index == first.index
    dev.close()
    monkeypatch.setenv("VKATTN_DEVICE", "no-such-gpu-xyz")
    with pytest.raises(ValueError, match="matches no Vulkan device"):
        Device()
    with pytest.raises(ValueError, match="index"):
        Device(len(vkattn.list_devices()))
    monkeypatch.setenv("VKATTN_DEVICE", str(len(vkattn.list_devices())))     # an index past the devices
    with pytest.raises(ValueError, match=r"VKATTN_DEVICE='\d+' matches no Vulkan device \(0: "):
        Device()
    monkeypatch.setenv("VKATTN_DEVICE", " 0 ")
    dev = Device()
    assert dev.index == 0
    dev.close()


def test_closed_device_closes_its_caches(rng):
    dev = Device(vkattn.default_device().index)
    c = vkattn.KVCache(8, 1, 8, device=dev)
    dev.close()
    with pytest.raises(vkattn.CacheClosedError, match="device"):
        c.attend(np.ones((1, 1, 8), np.float32))


def test_a_graph_closes_quietly_after_its_device(rng):
    """A Graph whose device was closed: close() is harmless (a cache's is), so a ``with`` body's
    own error is the one raised (close raised CacheClosedError over it)."""
    dev = Device(vkattn.default_device().index)
    c = vkattn.KVCache(8, 1, 8, device=dev)
    g = vkattn.Graph(dev)
    q, k, v, out = (vkattn.to_device(np.ones((1, 1, 8), np.float32), dev) for _ in range(4))
    with g.capture():
        c.forward(q, k, v, out=out)
    g.submit().wait()
    assert c.length == 1
    dev.close()
    g.close()
    g.close()
    with pytest.raises(KeyError, match="the body's own"):
        with vkattn.Graph(Device(vkattn.default_device().index)) as g2:
            g2.device.close()
            raise KeyError("the body's own error")


def test_compile_error_names_shader(tmp_path):
    (tmp_path / "broken.comp").write_text("#version 450\nvoid main() { undefined_thing = 1; }\n")
    with pytest.raises(vkattn.ShaderCompileError, match="broken") as e:
        compiler.compile_shader("broken", {}, src_dir=tmp_path)
    assert "undefined_thing" in str(e.value)
    with pytest.raises(vkattn.ShaderCompileError, match="no shader named"):
        compiler.compile_shader("missing")


def test_spirv_disk_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VKATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiler, "_memo", {})
    calls = []
    real = compiler._run_glslang
    monkeypatch.setattr(compiler, "_run_glslang", lambda *a: calls.append(a) or real(*a))
    a = compiler.compile_shader("copy_rows")
    assert a[:4] == b"\x03\x02\x23\x07" and len(calls) == 1
    assert len(list(tmp_path.glob("copy_rows-*.spv"))) == 1
    monkeypatch.setattr(compiler, "_memo", {})
    assert compiler.compile_shader("copy_rows") == a and len(calls) == 1     # from disk
    compiler.compile_shader("append", {"KV_F16": 0})
    compiler.compile_shader("append", {"KV_F16": 1})
    assert len(calls) == 3                                                # defines are in the key
    # a damaged or unreadable file is a miss, compiled again and written anew (it was used as it
    # was, in every later process: a crash, or wrong results from a module that still parsed)
    path = next(tmp_path.glob("copy_rows-*.spv"))
    good = path.read_bytes()
    assert good[:-32] == a and (path.stat().st_mode & 0o777) == 0o644    # readable by a shared cache's users
    flipped = bytearray(good)
    flipped[100] ^= 0x10
    for damage in (b"", good[:len(good) // 2], good[:-32], bytes(flipped), b"\x00" * 64, None):
        if damage is None:
            path.unlink()
            path.mkdir()                                                  # unreadable as a file
        else:
            path.write_bytes(damage)
        monkeypatch.setattr(compiler, "_memo", {})
        n = len(calls)
        assert compiler.compile_shader("copy_rows") == a and len(calls) == n + 1
        if damage is None:
            path.rmdir()
        else:
            assert path.read_bytes() == good                              # written anew
    # a list of seen pipelines that is not text: an empty one (it raised UnicodeDecodeError)
    (tmp_path / f"pipelines-{hashlib.sha256(b'dev').hexdigest()[:16]}.txt").write_bytes(b"\xff\xfe\x80 not text")
    monkeypatch.setattr(compiler, "_seen", {})
    assert compiler.first_build("dev", a, (1, 2)) is True and compiler.first_build("dev", a, (1, 2)) is False


def test_a_module_built_is_found_by_its_sources_stamps(tmp_path, monkeypatch):
    """The package's shaders: a second request neither reads nor hashes a source (compiler._stamp:
    names, mtimes, sizes), and an edit of the same size with a new mtime is read again and gives
    the new module. Modelled on a folder of this test's own standing in for the package's."""
    monkeypatch.setenv("VKATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("VKATTN_SHADER_LOG", raising=False)     # not the package's modules: not for the audit
    pkg = tmp_path / "shaders"
    pkg.mkdir()
    src = pkg / "probe.comp"
    body = ("#version 450\nlayout(local_size_x = 1) in;\n"
            "layout(std430, binding = 0) buffer B { float b[]; };\nvoid main() { b[0] = %s; }\n")
    src.write_text(body % "1.0")
    monkeypatch.setattr(compiler, "_package_shaders", lambda: pkg)
    monkeypatch.setattr(compiler, "shader_dir", lambda: pkg)
    monkeypatch.setattr(compiler, "_memo", {})
    monkeypatch.setattr(compiler, "_fast", {})
    one = compiler.compile_shader("probe")
    reads = []
    real_read = type(src).read_bytes
    monkeypatch.setattr(type(src), "read_bytes", lambda self: reads.append(self.name) or real_read(self))
    assert compiler.compile_shader("probe") == one and reads == []          # stamps only
    st = src.stat()
    src.write_text(body % "2.0")                                            # the same size
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    two = compiler.compile_shader("probe")
    assert "probe.comp" in reads and two != one
    # a folder that is not the package's is read and hashed every time
    other = tmp_path / "other"
    other.mkdir()
    (other / "probe.comp").write_text(body % "3.0")
    reads.clear()
    compiler.compile_shader("probe", src_dir=other)
    compiler.compile_shader("probe", src_dir=other)
    assert reads.count("probe.comp") == 2


def gather_program(be, src, dst, params, name):
    """gather_slots.comp as a plain word copy: dst[i] = src[params[1 + i]] (uvec4 words), K and V
    views of the same buffers, no scales."""
    dummies = [be.buffer(1, np.float32, name=f"{name}_unused{i}") for i in range(4)]
    prog = be.program(compiler.compile_shader("gather_slots"), [src, src, dst, dst, params] + dummies, (1, 1, 1),
                      [64, 1, 1], writes=(2, 3, 7, 8), name=name)
    return prog, dummies


def test_recording_rejects_unordered_dispatches(device):
    be = device.backend
    src, mid, out = (be.buffer(64, np.uint32, name=n) for n in ("src", "mid", "out"))
    params = be.buffer(17, np.uint32, name="params")
    writer, d1 = gather_program(be, src, mid, params, "writer")
    reader, d2 = gather_program(be, mid, out, params, "reader")
    with pytest.raises(vkattn.SyncHazardError, match="written by an earlier dispatch"):
        be.recording().dispatch(writer).dispatch(reader)          # read-after-write
    with pytest.raises(vkattn.SyncHazardError, match="an earlier dispatch used"):
        be.recording().dispatch(reader).dispatch(writer)          # write-after-read
    with pytest.raises(vkattn.SyncHazardError, match="upload"):
        be.recording().dispatch(writer).upload(src)               # upload over a buffer in use
    # a download of the intermediate buffer orders the pair: accepted, and it computes
    src.view()[:] = np.arange(64)
    params.view()[:] = [16] + list(range(15, -1, -1))             # 16 words, reversed
    rec = be.recording().upload(src, params).dispatch(writer).download(mid).dispatch(reader).download(out).build()
    rec.run()
    words = np.arange(64).reshape(16, 4)
    np.testing.assert_array_equal(mid.view().reshape(16, 4), words[::-1])
    np.testing.assert_array_equal(out.view().reshape(16, 4), words)
    rec.destroy()
    for o in [writer, reader, src, mid, out, params] + d1 + d2:
        o.destroy()


def test_lane_subgroup_probe(device, monkeypatch):
    # attn_lane.comp needs one workgroup = one subgroup with working shuffles; probed, not assumed.
    # The default choice is checked, so a VKATTN_KERNEL override (a whole-suite tile run) is cleared
    monkeypatch.delenv("VKATTN_KERNEL", raising=False)
    sg = device.lane_subgroup()
    assert sg in (0, device.subgroup_size)
    if device.is_software and sg:
        assert tuning.kernel_for(device) == "lane"


def test_program_checks_the_binding_count(device):
    # a shader declaring more buffers than bound would crash inside kp: a clear error instead
    be = device.backend
    bufs = [be.buffer(4, np.float32) for _ in range(4)]
    with pytest.raises(ValueError, match="declares 5 buffer bindings, 4 given"):
        be.program(compiler.compile_shader("copy_rows"), bufs, (1, 1, 1), [64], name="copy_rows")
    for b in bufs:
        b.destroy()


def test_tile_shuffles_need_subgroup_votes(device, monkeypatch):
    # attn.comp's shuffle path also calls subgroupAny (GL_KHR_shader_subgroup_vote): a device that
    # reports shuffles but not votes gets the no-shuffle kernel (cluster 1, TILE_SHUFFLE=0, shared-memory sums)
    import dataclasses
    monkeypatch.setenv("VKATTN_KERNEL", "tile")

    from vkattn._attn import StorageFormat, attn_pipeline
    from vkattn.device import PlanningDevice
    ops = device.info.subgroup_supported_operations | tuning.SUBGROUP_SHUFFLE | tuning.SUBGROUP_VOTE
    with_votes = PlanningDevice(dataclasses.replace(device.info, subgroup_supported_operations=ops))
    no_votes = PlanningDevice(dataclasses.replace(device.info, subgroup_supported_operations=ops & ~tuning.SUBGROUP_VOTE))
    assert with_votes.tile_cluster() == min(tuning.TILE_CLUSTER, device.subgroup_size) > 1
    assert no_votes.tile_cluster() == 1
    fmt = StorageFormat(2, 64, dtype="float16", block_size=256)
    for dev, shuffle in ((with_votes, 1), (no_votes, 0)):
        cfg, pipe = attn_pipeline(dev, fmt, 4, 1, 0, 1, 0, 256, True)
        # without shuffles a key row may still be split over cfg.ds invocations: they sum through
        # shared memory (tile_config), so only the shuffle flag follows the votes
        assert pipe.defines["TILE_SHUFFLE"] == shuffle and cfg.shuffle == bool(shuffle)


def test_cache_files_are_replaced_whole_or_not_at_all(tmp_path):
    """vkattn._files.replace_file, which the SPIR-V, verdict and driver caches write through: the
    file whole, readable by all; where it cannot be written (a folder in its place) False and no
    temporary file left behind (they piled up in the cache folder before)."""
    import os
    from vkattn._files import replace_file
    path = tmp_path / "sub" / "a.json"
    assert replace_file(path, b"one") and path.read_bytes() == b"one"
    assert replace_file(path, b"two") and path.read_bytes() == b"two"
    assert os.stat(path).st_mode & 0o777 == 0o644
    (tmp_path / "sub" / "b.json").mkdir()
    assert not replace_file(tmp_path / "sub" / "b.json", b"x")
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["a.json", "b.json"]
