"""SPIR-V checks: vkattn.spirv reads the cooperative-matrix types of a module and refuses one whose
matrix use the compiler dropped (glslang 13.1-15.0 with two matrices in one declaration); the
compiler wrapper checks every module it builds; the audit lists every shader variant."""
import struct

import pytest

from vkattn import compiler, spirv
from vkattn.errors import ShaderCompileError
from vkattn.tools import spirv_audit


def _module(uses) -> bytes:
    """A minimal module: a constant per use value and one OpTypeCooperativeMatrixKHR per use."""
    words = [spirv.MAGIC, 0x00010300, 0, 100, 0]
    ids = iter(range(1, 100))
    f16, u32, scope, rows = next(ids), next(ids), next(ids), next(ids)
    words += [(3 << 16) | 22, f16, 16]                    # OpTypeFloat 16
    words += [(4 << 16) | 21, u32, 32, 0]                 # OpTypeInt 32 0
    words += [(4 << 16) | spirv.OP_CONSTANT, u32, scope, 3]
    words += [(4 << 16) | spirv.OP_CONSTANT, u32, rows, 16]
    for use in uses:
        cid, tid = next(ids), next(ids)
        words += [(4 << 16) | spirv.OP_CONSTANT, u32, cid, use]
        words += [(7 << 16) | spirv.OP_TYPE_COOPMAT_KHR, tid, f16, scope, rows, rows, cid]
    return struct.pack(f"<{len(words)}I", *words)


def test_matrix_uses_are_read():
    assert spirv.matrix_uses(_module([0, 1, 2])) == ["A", "B", "Accumulator"]
    assert spirv.matrix_problem(_module([0, 1, 2])) == ""
    assert spirv.matrix_problem(_module([])) == ""


def test_a_dropped_use_is_refused():
    bad = _module([0, 2, 1, 0xFFFFFFFF])          # what glslang 13.1 makes of `MAT_A ph, pl;`
    assert spirv.matrix_uses(bad)[-1] == "invalid (0xffffffff)"
    problem = spirv.matrix_problem(bad)
    assert "1 of its 4 cooperative-matrix types have no valid use" in problem and "13.1-15.0" in problem


def test_big_endian_and_garbage():
    le = _module([0])
    be = struct.pack(f">{len(le) // 4}I", *struct.unpack(f"<{len(le) // 4}I", le))
    assert spirv.matrix_uses(be) == ["A"]
    with pytest.raises(ValueError, match="magic"):
        spirv.words(b"\0" * 20)
    assert "not a SPIR-V module" in spirv.matrix_problem(b"\1\2\3")


def test_the_compiler_refuses_a_module_with_a_dropped_use(monkeypatch, tmp_path):
    monkeypatch.setattr(compiler, "_run_glslang", lambda name, src, defines, exe=None: _module([0, 0xFFFFFFFF]))
    monkeypatch.setenv("VKATTN_CACHE_DIR", str(tmp_path))
    with pytest.raises(ShaderCompileError, match="no valid use"):
        compiler.compile_shader("append", {"KV_F16": 7})


def test_every_built_module_is_logged_for_the_audit(monkeypatch, tmp_path):
    log = tmp_path / "shaders.log"
    monkeypatch.setenv("VKATTN_SHADER_LOG", str(log))
    monkeypatch.setenv("VKATTN_CACHE_DIR", str(tmp_path / "cache"))     # the test's own modules stay here
    compiler._memo.clear()
    compiler.compile_shader("copy_rows")
    compiler.compile_shader("append", {"KV_F16": 1, "KV_I8": 0})
    got = spirv_audit.read_log(log)
    assert ("copy_rows", {}) in got and ("append", {"KV_F16": 1, "KV_I8": 0}) in got
    listed = {spirv_audit._key(n, d) for n, d in spirv_audit.planned_variants()}
    assert all(spirv_audit._key(n, d) in listed for n, d in got)
    # a caller's own shader, compiled from its own folder, is not the package's: not logged
    (tmp_path / "mine.comp").write_text("#version 450\nlayout(local_size_x = 1) in;\nvoid main() {}\n")
    compiler.compile_shader("mine", src_dir=tmp_path)
    assert "mine" not in {n for n, _ in spirv_audit.read_log(log)}
    # nor is a copy of the package's tree that a test points shader_dir() at (a test of the GPU
    # report compiled a study kernel as "attn_coopmat" {} there; the audit then built the package's
    # attn_coopmat with no defines and failed CI)
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "copy_rows.comp").write_text((tmp_path / "mine.comp").read_text())
    monkeypatch.setattr(compiler, "shader_dir", lambda: copy)
    compiler._memo.clear()
    compiler.compile_shader("copy_rows", {"EDITED": 1})
    assert ("copy_rows", {"EDITED": 1}) not in spirv_audit.read_log(log)
    compiler._memo.clear()


def test_validation_switch_rejects_what_spirv_val_rejects(monkeypatch, tmp_path):
    fake = tmp_path / "spirv-val"
    fake.write_text("#!/bin/sh\necho 'error: line 7: Cooperative matrix type must be A Type' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("VKATTN_SPIRV_VAL", str(fake))
    compiler._memo.clear()
    with pytest.raises(ShaderCompileError, match="fails spirv-val: --target-env vulkan1.1: error: line 7"):
        compiler.compile_shader("copy_rows")
    compiler._memo.clear()


def test_planned_variants_cover_every_shader_the_runtime_builds():
    names = {n for n, _ in spirv_audit.planned_variants()}
    shipped = {p.name[:-5] for p in compiler.shader_dir().iterdir() if p.name.endswith(".comp")}
    assert shipped - names == set()
    assert ("attn_coopmat", {"KV_F16": 1, "KV_I8": 0, "COOPMAT_UNROLL": 1, "COOPMAT_FIXED_TRIPS": 1,
                             "COOPMAT_STAGE_BATCH": 1}) in spirv_audit.planned_variants()
    # masks and block tables through a texel view of aux (tuning.texel_aux), with either K/V path
    for kv in ({}, {"KV_TEXEL": 1}):
        assert ("attn_lane", dict({"KV_F16": 1, "KV_I8": 0, "HALF_NATIVE": 1, "AUX_TEXEL": 1}, **kv)) \
            in spirv_audit.planned_variants()
