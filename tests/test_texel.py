"""Uniform texel buffers (the patched kp's set_texel_formats, vkattn.algorithm): a binding a shader
declares as a usamplerBuffer is bound as a view of the array's whole buffer, four words a texel
or one (texel_words), read back exactly; a storage write then a texel read in one graph is ordered
by the graph's barrier; bad requests are ValueErrors before anything is built."""
import numpy as np
import pytest

import vkattn
from vkattn import _kp
from vkattn.compiler import compile_shader

from conftest import require_texel

# out[i] = (word i of a, seen through a's view) ^ word i of b (b's view: one word a texel)
_READ = """#version 450
layout(local_size_x = 8) in;
layout(binding = 0) uniform usamplerBuffer a;      // four words a texel
layout(binding = 1) uniform usamplerBuffer b;      // texel_words {1: 1}: one word a texel
layout(std430, binding = 2) writeonly buffer O { uint o[]; };
layout(push_constant) uniform P { uint n; };
void main() {
    const uint i = gl_GlobalInvocationID.x;
    if (i < n) o[i] = texelFetch(a, int(i / 4u))[i % 4u] ^ texelFetch(b, int(i)).x;
}
"""
# out[i] = texel i of a, all four components (what a view of each format gives)
_WHOLE = """#version 450
layout(local_size_x = 8) in;
layout(binding = 0) uniform usamplerBuffer a;
layout(std430, binding = 1) writeonly buffer O { uvec4 o[]; };
layout(push_constant) uniform P { uint n; };
void main() { const uint i = gl_GlobalInvocationID.x; if (i < n) o[i] = texelFetch(a, int(i)); }
"""
# the same with n a specialisation constant (vkattn's programs take no push constants)
_WHOLE_SPEC = _WHOLE.replace("layout(push_constant) uniform P { uint n; };", "layout(constant_id = 0) const uint n = 1u;")
# y[i] = x[i] * 2 + 1 (storage), the float view: z[i] = texel(y)[...] + 1
_WRITE = """#version 450
layout(local_size_x = 8) in;
layout(std430, binding = 0) readonly buffer X { float x[]; };
layout(std430, binding = 1) writeonly buffer Y { float y[]; };
layout(push_constant) uniform P { uint n; };
void main() { const uint i = gl_GlobalInvocationID.x; if (i < n) y[i] = x[i] * 2.0 + 1.0; }
"""
_FLOAT_READ = """#version 450
layout(local_size_x = 8) in;
layout(binding = 0) uniform samplerBuffer y;
layout(std430, binding = 1) writeonly buffer Z { float z[]; };
layout(push_constant) uniform P { uint n; };
void main() { const uint i = gl_GlobalInvocationID.x; if (i < n) z[i] = texelFetch(y, int(i / 4u))[i % 4u] + 1.0; }
"""


def _spv(tmp_path, name, src):
    (tmp_path / f"{name}.comp").write_text(src)
    return compile_shader(name, {}, src_dir=tmp_path)


@pytest.fixture
def texel_device(device):
    require_texel(device)
    return device


def _words(arr):
    return arr.host_view().reshape(-1).view(np.uint32)


def _run(dev, algo, reads, writes, ups=(), downs=()):
    g = vkattn.Graph(dev)
    try:
        with g.capture():
            if ups:
                g.upload(*ups)
            g.dispatch(algo, reads=reads, writes=writes)
            g.download(*downs)
        g.run()
    finally:
        g.close()


@pytest.mark.parametrize("n", [37, 256])
def test_texel_views_read_every_word(texel_device, tmp_path, rng, n):
    dev = texel_device
    spv = _spv(tmp_path, "texel_read", _READ)
    a, b, o = vkattn.empty((n,), dev), vkattn.empty((n,), dev), vkattn.empty((n,), dev)
    wa = rng.integers(0, 2**32, n, dtype=np.uint32)
    wb = rng.integers(0, 2**32, n, dtype=np.uint32)
    _words(a)[:n], _words(b)[:n] = wa, wb
    algo = vkattn.algorithm([a, b, o], spv, (-(-n // 8),), push=[n], texel_words={1: 1})
    try:
        _run(dev, algo, [a, b], [o], ups=(a, b), downs=(o,))
        assert np.array_equal(_words(o)[:n], wa ^ wb)
    finally:
        algo.destroy()
        for x in (a, b, o):
            x.close()


def test_one_word_and_four_word_views_of_one_module(texel_device, tmp_path, rng):
    """The same SPIR-V bound with either view: four words (x, y, z, w) or one (x, 0, 0, 1), both
    alive at once (the shared pipeline's key holds the formats)."""
    dev = texel_device
    spv = _spv(tmp_path, "texel_whole", _WHOLE)
    n = 12
    a = vkattn.empty((4 * n,), dev)
    w = rng.integers(0, 2**32, 4 * n, dtype=np.uint32)
    _words(a)[:4 * n] = w
    o4, o1 = vkattn.empty((4 * n,), dev), vkattn.empty((4 * n,), dev)
    al4 = vkattn.algorithm([a, o4], spv, (-(-n // 8),), push=[n])
    al1 = vkattn.algorithm([a, o1], spv, (-(-n // 8),), push=[n], texel_words={0: 1})
    try:
        _run(dev, al4, [a], [o4], ups=(a,), downs=(o4,))
        _run(dev, al1, [a], [o1], downs=(o1,))
        assert np.array_equal(_words(o4)[:4 * n], w)
        one = np.zeros((n, 4), np.uint32)
        one[:, 0], one[:, 3] = w[:n], 1
        assert np.array_equal(_words(o1)[:4 * n].reshape(n, 4), one)
    finally:
        al4.destroy()
        al1.destroy()
        for x in (a, o4, o1):
            x.close()


def test_a_storage_write_then_a_texel_read_in_one_graph(texel_device, tmp_path, rng):
    """The graph puts a barrier between a dispatch that writes y and one that reads it as a texel
    buffer (make test-validation runs this under synchronization validation)."""
    dev = texel_device
    n = 40
    x, y, z = vkattn.empty((n,), dev), vkattn.empty((n,), dev), vkattn.empty((n,), dev)
    xv = rng.standard_normal(n).astype(np.float32)
    x.host_view().reshape(-1)[:n] = xv
    w = vkattn.algorithm([x, y], _spv(tmp_path, "texel_w", _WRITE), (n // 8,), push=[n])
    r = vkattn.algorithm([y, z], _spv(tmp_path, "texel_r", _FLOAT_READ), (n // 8,), push=[n])
    g = vkattn.Graph(dev)
    try:
        with g.capture():
            g.upload(x)
            g.dispatch(w, reads=[x], writes=[y])
            g.dispatch(r, reads=[y], writes=[z])
            g.download(z)
        g.run()
        assert any(op.startswith("barrier") for op in g.ops), g.ops
        assert np.array_equal(z.host_view().reshape(-1)[:n], (xv * np.float32(2) + np.float32(1)) + np.float32(1))
    finally:
        g.close()
        w.destroy()
        r.destroy()
        for a in (x, y, z):
            a.close()


def test_texel_requests_that_cannot_be_made(texel_device, tmp_path, monkeypatch):
    dev = texel_device
    spv = _spv(tmp_path, "texel_read", _READ)
    a, b, o = vkattn.empty((64,), dev), vkattn.empty((64,), dev), vkattn.empty((64,), dev)
    try:
        with pytest.raises(ValueError, match="does not read"):             # binding 2 is a storage buffer
            vkattn.algorithm([a, b, o], spv, (8,), push=[64], texel_words={2: 1})
        with pytest.raises(ValueError, match="1 or 4"):
            vkattn.algorithm([a, b, o], spv, (8,), push=[64], texel_words={1: 2})
        with pytest.raises(ValueError, match="DeviceArrays"):
            vkattn.algorithm([a, np.zeros(4), o], spv, (8,), push=[64])
        be = dev.backend
        monkeypatch.setattr(be, "max_texels", 16)       # a's 68 words are 17 four-word texels
        with pytest.raises(ValueError, match="maxTexelBufferElements"):
            vkattn.algorithm([a, b, o], spv, (8,), push=[64], texel_words={1: 1})
        monkeypatch.setattr(be, "max_texels", 1 << 27)
        monkeypatch.setattr(be, "texel_buffers", False)  # a plain kp
        with pytest.raises(ValueError, match="texel buffers"):
            vkattn.algorithm([a, b, o], spv, (8,), push=[64], texel_words={1: 1})
    finally:
        for x in (a, b, o):
            x.close()


def test_reflection_finds_the_texel_bindings(tmp_path):
    count, texel = _kp._reflect_bindings(_spv(tmp_path, "texel_read", _READ))
    assert count == 3 and texel == {0: 107, 1: 107}                 # R32G32B32A32_UINT
    count, texel = _kp._reflect_bindings(_spv(tmp_path, "texel_r", _FLOAT_READ))
    assert count == 2 and texel == {0: 109}                         # R32G32B32A32_SFLOAT
    count, texel = _kp._reflect_bindings(compile_shader("gather_slots"))
    assert texel == {} and count == 9                               # storage buffers only


def test_a_program_with_a_texel_binding_keeps_its_pipeline(texel_device, tmp_path, rng):
    """vkattn's own Program path: the texel formats reach the pipeline that keep_pipeline pins, so
    a second program of the same module builds nothing and still reads right."""
    be = texel_device.backend
    spv = _spv(tmp_path, "texel_whole_spec", _WHOLE_SPEC)
    src, out = be.buffer(32, np.uint32, name="src"), be.buffer(32, np.uint32, name="out")
    w = rng.integers(0, 2**32, 32, dtype=np.uint32)
    try:
        for round_ in range(2):
            prog = be.program(spv, [src, out], (1, 1, 1), [8], writes=(1,), name="texel")
            count = be.pipeline_count()
            src.view()[:] = w
            rec = be.recording().upload(src).dispatch(prog).download(out).build()
            rec.run()
            assert np.array_equal(out.view(), w), round_
            rec.destroy()
            prog.destroy()
            assert be.pipeline_count() == count        # kept after its program went
    finally:
        src.destroy()
        out.destroy()
