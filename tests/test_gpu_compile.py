"""GPU compiler statistics without a GPU: the package's kernels, planned for navi21 as `perf gpu`
plans them, compiled by RADV/ACO through Mesa's null device (vkattn._vkpipeline). Needs RADV
(mesa-vulkan-drivers), no AMD GPU."""
import os
import sys

import pytest

from vkattn import _vkpipeline as vp
from vkattn._attn import StorageFormat, attn_pipeline
from vkattn._base import append_pipeline
from vkattn.compiler import compile_shader
from vkattn.device import PlanningDevice

FAMILY = "navi21"
COPY = [64]                          # copy_rows.comp: workgroup size; 5 bindings
MESA_22_3 = (22, 3)
KEY_STATS = ("VGPRs", "SGPRs", "Spilled VGPRs", "Spilled SGPRs", "Scratch size", "LDS size",
             "Subgroups per SIMD", "Instructions")
# calls of 32 query / 8 kv heads, head_dim 128, capacity 4096: (name, dtype, query rows, new rows)
CALLS = [("decode-f16", "float16", 1, 0), ("step-i8", "int8", 1, 1), ("prefill-f16", "float16", 512, 0),
         ("prefill-f32", "float32", 512, 0)]


def _planned_jobs():
    info = vp.family_device_info(FAMILY)
    if info is None:
        return None
    dev = PlanningDevice(info)
    jobs = []
    for name, dtype, rows, nn in CALLS:
        fmt = StorageFormat(8, 128, dtype=dtype, block_size=4096)
        _, p = attn_pipeline(dev, fmt, 32, rows, nn, 1, 0, 4096, rows == 1)
        jobs.append(vp.Job(name, compile_shader(p.shader, p.defines), list(p.spec), p.bindings))
    p = append_pipeline(dev, StorageFormat(8, 128, dtype="float16", block_size=4096), 512)
    jobs.append(vp.Job("append-f16", compile_shader(p.shader, p.defines), list(p.spec), p.bindings))
    jobs.append(vp.Job("copy", compile_shader("copy_rows"), COPY))    # bindings read from the SPIR-V
    return jobs


@pytest.fixture(scope="module")
def jobs():
    if vp.radeon_icd() is None:
        pytest.skip("RADV is not installed (no radeon_icd*.json; Debian: mesa-vulkan-drivers)")
    with pytest.MonkeyPatch.context() as mp:      # the GPUs' own kernel choice, whatever a
        mp.delenv("VKATTN_KERNEL", raising=False)  # whole-suite VKATTN_KERNEL run forces here
        found = _planned_jobs()
    if found is None:
        pytest.skip(f"the installed RADV gives no null device for {FAMILY}")
    return found


@pytest.fixture(scope="module")
def navi21(jobs):
    run = vp.family_stats([FAMILY], jobs, features=["shaderFloat16", "cooperativeMatrix"])[FAMILY]
    if not run.available:
        pytest.skip(f"the installed RADV gives no null device for {FAMILY}: {run.reason}")
    return run


def _mesa(run) -> tuple:
    v = run.device.driver_version      # RADV: VK_MAKE_VERSION(mesa major, minor, patch)
    return (v >> 22, (v >> 12) & 0x3FF)


def test_null_device_and_feature_support(navi21):
    dev = navi21.device
    assert dev.name.startswith("Null hardware") and "NAVI21" in dev.name
    assert dev.statistics and "VK_KHR_pipeline_executable_properties" in dev.extensions
    assert dev.subgroup_size_range == (32, 64)
    assert set(dev.features) == set(vp.FEATURES)
    assert dev.features["shaderFloat16"] and dev.features["storageBuffer8BitAccess"]
    # features are enabled only where supported; the rest are reported, not errors
    assert "shaderFloat16" in navi21.enabled
    supported = dev.features["cooperativeMatrix"]
    assert ("cooperativeMatrix" in navi21.enabled) == supported
    assert ("cooperativeMatrix" in navi21.not_supported) != supported


def test_every_pipeline_compiles_with_sane_statistics(navi21, jobs):
    assert [r.name for r in navi21.jobs] == [j.name for j in jobs]
    for res in navi21.jobs:
        assert res.ok, (res.name, res.result, res.error)
        assert len(res.executables) == 1
        exe = res.executables[0]
        assert exe.subgroup_size in (32, 64) and exe.name
        assert set(KEY_STATS) <= set(exe.stats), sorted(exe.stats)
        assert 0 < exe["VGPRs"] <= 256 and exe["SGPRs"] > 0
        assert exe["Subgroups per SIMD"] >= 1 and exe["Instructions"] > 0
        assert exe.as_dict()["subgroupSize"] == exe.subgroup_size


def test_planned_pipelines_do_not_regress_on_navi21(navi21):
    # the GPU kernels as planned for RDNA2: no spills, no scratch, and at least the occupancy of
    # llama.cpp's scalar flash attention on the same compiler (decode 18 wave32 slots per SIMD at
    # head_dim 128, prefill 6; issue 16), with no shared memory beyond the split-merge flag
    if _mesa(navi21) != MESA_22_3:
        pytest.skip(f"targets set with Mesa 22.3; this is {_mesa(navi21)}")
    want = {"decode-f16": 18, "step-i8": 18, "prefill-f16": 6, "prefill-f32": 6}
    for name, waves in want.items():
        st = navi21[name].stats
        assert st["Spilled VGPRs"] == st["Spilled SGPRs"] == st["Scratch size"] == 0, name
        assert st["Subgroups per SIMD"] >= waves, (name, st)
        assert st["LDS size"] <= 512, (name, st)
    exe = navi21["decode-f16"].executables[0]
    assert exe.subgroup_size == 64 and exe.wave32_units     # RADV 22.3 compiles compute as wave64


def test_reported_waves_follow_the_documented_rule(navi21, jobs):
    if _mesa(navi21) != MESA_22_3:
        pytest.skip("the rule in the module docstring is read from Mesa 22.3's source")
    for job, res in zip(jobs, navi21.jobs):
        exe = res.executables[0]
        st = exe.stats
        waves, limits = vp.radv_waves_per_simd(FAMILY, st["VGPRs"], st["LDS size"], job.spec[0],
                                               exe.subgroup_size, st["SGPRs"])
        assert waves == st["Subgroups per SIMD"], (job.name, limits)


def test_failures_and_unknown_families_are_reported_not_raised(jobs):
    if vp.radeon_icd() is None:
        pytest.skip("RADV is not installed")
    good = jobs[-1]
    bad = [vp.Job("truncated", good.spirv[:64], COPY, 5),                   # the driver crashes
           vp.Job("wave16", good.spirv, COPY, 5, subgroup_size=16)]        # not offered: refused
    out = vp.family_stats([FAMILY, "nosuchgpu"], bad + [good])
    run = out[FAMILY]
    if not run.available:
        pytest.skip(f"no null device for {FAMILY}: {run.reason}")
    assert [r.name for r in run.jobs] == ["truncated", "wave16", "copy"]
    assert not run.jobs[0].ok and run.jobs[0].error
    assert not run.jobs[1].ok and "subgroup size 16" in run.jobs[1].error
    assert run.jobs[2].ok and run.jobs[2].stats["VGPRs"] > 0   # compiled in a fresh process
    assert not out["nosuchgpu"].available and out["nosuchgpu"].reason


def test_cswave32_and_required_subgroup_size(jobs):
    if vp.radeon_icd() is None:
        pytest.skip("RADV is not installed")
    copy = jobs[-1]
    wave32 = vp.Job("copy-w32", copy.spirv, COPY, 5, subgroup_size=32)
    run = vp.family_stats([FAMILY], [copy], env={"RADV_PERFTEST": "cswave32"})[FAMILY]
    run_required = vp.family_stats([FAMILY], [wave32])[FAMILY]
    if not run.available:
        pytest.skip(f"no null device for {FAMILY}: {run.reason}")
    assert run.jobs[0].executables[0].subgroup_size == 32
    assert run_required.jobs[0].executables[0].subgroup_size == 32
    assert "subgroupSizeControl" in run_required.enabled


def test_child_environment(monkeypatch):
    monkeypatch.setenv("VK_INSTANCE_LAYERS", "VK_LAYER_KHRONOS_validation")
    monkeypatch.setenv("RADV_PERFTEST", "cswave32")
    monkeypatch.setenv("RADV_DEBUG", "llvm")
    env = vp._child_env("vega10", "/x/radeon_icd.json", {"RADV_DEBUG": "nocache"})
    assert env["RADV_FORCE_FAMILY"] == "vega10"
    assert env["VK_DRIVER_FILES"] == env["VK_ICD_FILENAMES"] == "/x/radeon_icd.json"
    assert "VK_INSTANCE_LAYERS" not in env and env["VK_LOADER_LAYERS_DISABLE"] == "~all~"
    assert "RADV_PERFTEST" not in env and env["RADV_DEBUG"] == "nocache"


def test_spirv_bindings(jobs):
    assert vp.spirv_bindings(jobs[0].spirv) == 13
    assert vp.spirv_bindings(jobs[-1].spirv) == 5
    with pytest.raises(ValueError):
        vp.spirv_bindings(b"\0" * 20)


def test_occupancy_rule_by_generation():
    # the float16 decode's measured budget: 56 VGPRs (60 on gfx1100), 12 KiB LDS, workgroup 64
    assert vp.radv_waves_per_simd("vega10", 56, 12288, 64, 64, 48) == (
        2, {"slots": 10, "sgprs": 16, "vgprs": 4, "lds": 2})
    assert vp.radv_waves_per_simd("navi21", 56, 12288)[0] == 6          # wave32 units: 3 wave64
    assert vp.radv_waves_per_simd("gfx1100", 60, 12288)[1]["vgprs"] == 12
    assert vp.radv_waves_per_simd("navi21", 64, 0, 64, 32)[0] == 16      # VGPR-bound wave32
    assert vp.radv_waves_per_simd("polaris10", 24)[1]["slots"] == 8


def test_compile_stats_in_this_process(monkeypatch, jobs):
    """compile_stats: one instance/device in this process; RADV reads RADV_FORCE_FAMILY when an
    instance is created, so setting it for the call suffices (family_stats isolates crashes)."""
    if vp.radeon_icd() is None:
        pytest.skip("RADV is not installed")
    monkeypatch.setenv("RADV_FORCE_FAMILY", FAMILY)
    run = vp.compile_stats([jobs[-1], jobs[-1]], features=["storageBuffer8BitAccess"], ir=True)
    assert "NAVI21" in run.device.name and run.enabled == ["storageBuffer8BitAccess"]
    assert [r.ok for r in run.jobs] == [True, True]
    exe = run.jobs[0].executables[0]
    assert exe["VGPRs"] > 0 and exe.ir and any("Assembly" in k or "ISA" in k for k in exe.ir)


def test_compile_stats_on_a_device_without_statistics(jobs):
    """Any Vulkan device works; one without VK_KHR_pipeline_executable_properties (lavapipe in
    Mesa 22.3) compiles the pipeline and says there are no statistics."""
    try:
        run = vp.compile_stats([jobs[-1]], device="llvmpipe")
    except vp.VulkanUnavailableError as exc:
        pytest.skip(f"no lavapipe: {exc}")
    res = run.jobs[0]
    assert res.result == "VK_SUCCESS"
    assert res.ok == run.device.statistics and (res.ok or "no statistics" in res.error)


def _old_helpers(tmp_path):
    """A copy of the shader tree whose storage helpers round as GLSL's built-ins do (today's main
    before the exact helpers): packHalf2x16, amax / 127, roundEven(x / scale)."""
    import re
    import shutil

    from vkattn.compiler import shader_dir
    src = tmp_path / "shaders"
    shutil.copytree(str(shader_dir()), src)
    common = (src / "common.glsl").read_text()
    pack = re.search(r"const uvec4 a = float_to_halves\(x\[0\]\).*?;\n.*?;\n", common, re.S).group(0)
    common = common.replace(pack, "return uvec4(packHalf2x16(x[0].xy), packHalf2x16(x[0].zw), "
                                  "packHalf2x16(x[1].xy), packHalf2x16(x[1].zw));\n")
    common = common.replace("float quant_scale(float amax) {", "float quant_scale(float amax) { return amax / 127.0; }\n"
                                                                "float quant_scale_exact(float amax) {")
    common = common.replace("vec4 quantise_prep(vec4 x, uvec3 p) {",
                            "vec4 quantise_prep(vec4 x, uvec3 p) { return clamp(roundEven(x / uintBitsToFloat(p.x)), "
                            "-127.0, 127.0); }\nvec4 quantise_prep_exact(vec4 x, uvec3 p) {")
    common = common.replace("vec4 quantise(vec4 x, float scale) { return quantise_prep(x, quant_prep(scale)); }",
                            "vec4 quantise(vec4 x, float scale) { return clamp(roundEven(x / scale), -127.0, 127.0); }")
    (src / "common.glsl").write_text(common)
    return src


def test_numerics_audit_flags_nothing_and_would_flag_builtin_rounding(jobs, tmp_path):
    """perf gpu's numerics audit on navi21: the exact storage helpers (numerics_probe.comp) and the
    planned append/attention pipelines hold no round-toward-zero conversion, no mode-rounded
    float->half conversion and (helpers, append) no reciprocal or division; the same audit on
    helpers written with GLSL's built-ins flags them (v_cvt_pkrtz_f16_f32, v_rcp_f32)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from perf import gpu as pg
    info = vp.family_device_info(FAMILY)
    if info is None:
        pytest.skip(f"the installed RADV gives no null device for {FAMILY}")
    dev = PlanningDevice(info)
    pipes = {}
    for name, dtype, rows, nn in CALLS:
        fmt = StorageFormat(8, 128, dtype=dtype, block_size=4096)
        pipes[name] = attn_pipeline(dev, fmt, 32, rows, nn, 1, 0, 4096, rows == 1)[1]
    for dtype in ("float16", "int8"):
        pipes["append-" + dtype] = append_pipeline(dev, StorageFormat(8, 128, dtype=dtype, block_size=4096), 512)
    now = pg.numerics_audit(FAMILY, pipes)
    assert "error" not in now and not now.get("failed"), now
    assert set(now["probes"]) == {w for w, _ in pg.NUMERICS_PROBES} and set(now["pipelines"]) == set(pipes)
    assert now["flagged"] == 0, now
    old = pg.numerics_audit(FAMILY, pipes, src_dir=_old_helpers(tmp_path))
    assert old["probes"]["float16 encode"].get("round toward zero", 0) > 0, old
    assert old["probes"]["int8 scale + quantise"].get("reciprocal / division", 0) > 0, old
    assert old["pipelines"]["append-float16"].get("round toward zero", 0) > 0, old
    assert old["pipelines"]["decode-f16"].get("round toward zero", 0) > 0, old     # the fused store
    assert old["pipelines"]["append-int8"].get("reciprocal / division", 0) > 0, old
