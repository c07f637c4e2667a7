"""GPU compiler statistics without a GPU: the package's kernels, planned for navi21 as `perf gpu`
plans them, compiled by RADV/ACO for a family whose GPU is not there (vkattn.tools.vkpipeline): Mesa's
null hardware (RADV_FORCE_FAMILY) up to Mesa 25, AMDGPU's drm-shim on Mesa 26. Needs RADV
(mesa-vulkan-drivers), and on Mesa 26 the shim (mesa-drm-shim); no AMD GPU."""
import os
import sys

import pytest

from vkattn.tools import vkpipeline as vp
from vkattn._attn import StorageFormat, attn_pipeline
from vkattn._base import append_pipeline
from vkattn.compiler import compile_shader
from vkattn.device import PlanningDevice

FAMILY = "navi21"
COPY = [64]                          # copy_rows.comp: workgroup size; 5 bindings
MESA_22_3 = (22, 3)
MESA_26_1 = (26, 1)
KEY_STATS = ("VGPRs", "SGPRs", "Spilled VGPRs", "Spilled SGPRs", "Scratch size", "LDS size",
             "Subgroups per SIMD", "Instructions")
# calls of 32 query / 8 kv heads, head_dim 128, capacity 4096: (name, dtype, query rows, new rows)
CALLS = [("decode-f16", "float16", 1, 0), ("step-i8", "int8", 1, 1), ("prefill-f16", "float16", 512, 0),
         ("prefill-f32", "float32", 512, 0)]


def _planned_jobs(family=FAMILY):
    info = vp.family_device_info(family)
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
    # a per-head device mask of 4097 columns copied into aux (KVCache.forward(mask=DeviceArray))
    jobs.append(vp.Job("mask-copy", compile_shader("mask_copy"), [64, 4097, 32, 0]))
    jobs.append(vp.Job("copy", compile_shader("copy_rows"), COPY))    # bindings read from the SPIR-V
    return jobs


def _need_compiler():
    """The mechanism that reaches RADV's compiler here, or a skip naming why none does."""
    mech = vp.null_mechanism()
    if not mech.available:
        pytest.skip(f"no AMD compiler reachable: {mech.reason}")
    return mech


@pytest.fixture(scope="module")
def jobs():
    _need_compiler()
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
    mech = vp.null_mechanism()
    assert "NAVI21" in dev.name and "RADV" in dev.name
    assert dev.name.startswith("Null hardware") == (mech.kind == vp.FORCE_FAMILY), (dev.name, mech)
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


def _llama_cpp_waves(mesa, family):
    """llama.cpp's scalar flash attention on the same compiler (perf/gpu.py LLAMA_CPP: issue 16's
    measurement on 22.3, perf/llama_cpp.py's on 26.1): {decode, prefill} waves, head_dim 128."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from perf import gpu as pg
    rec = pg.LLAMA_CPP[mesa]["waves"]
    fam = vp.canonical_family(family)
    return {kind: rec[f"{kind} 128"][fam] for kind in ("decode", "prefill")}


def _check_planned(run, mesa, family, lds_granule):
    # the GPU kernels as planned: no spills, no scratch, at least the occupancy of llama.cpp's
    # scalar flash attention on the same compiler, no shared memory beyond the split-merge flag
    anchor = _llama_cpp_waves(mesa, family)
    want = {"decode-f16": anchor["decode"], "step-i8": anchor["decode"], "prefill-f16": anchor["prefill"],
            "prefill-f32": anchor["prefill"]}
    for name, waves in want.items():
        st = run[name].stats
        assert st["Spilled VGPRs"] == st["Spilled SGPRs"] == st["Scratch size"] == 0, name
        assert st["Subgroups per SIMD"] >= waves, (family, name, st)
        assert st["LDS size"] <= lds_granule, (family, name, st)
    exe = run["decode-f16"].executables[0]
    assert exe.subgroup_size == 64 and exe.wave32_units     # RADV compiles compute as wave64


def test_planned_pipelines_do_not_regress_on_navi21(navi21):
    # Mesa 22.3: llama.cpp decode 18 wave32 slots per SIMD at head_dim 128, prefill 6 (issue 16);
    # Mesa 26.1: 18 and 8 (its LDS granule on gfx10.3 is 1 KiB: the flag takes 1024 bytes)
    mesa = _mesa(navi21)
    if mesa not in (MESA_22_3, MESA_26_1):
        pytest.skip(f"targets set with Mesa 22.3 and 26.1; this is {mesa}")
    _check_planned(navi21, mesa, FAMILY, 512 if mesa == MESA_22_3 else 1024)


@pytest.mark.parametrize("family", ["navi31", "gfx1201"])
def test_planned_pipelines_on_rdna3_and_rdna4_of_mesa26(family):
    """Issue 21's Mesa 26 columns: RDNA3 and RDNA4 through the drm-shim, llama.cpp's occupancy
    on the same compiler as the floor (decode 32 wave32 slots, prefill 8)."""
    mech = _need_compiler()
    if mech.kind != vp.DRM_SHIM or not mech.mesa or mech.mesa[:2] != MESA_26_1:
        pytest.skip(f"targets set with Mesa 26.1 through the drm-shim; this is {mech.describe()}")
    jobs = _planned_jobs(family)
    assert jobs is not None, f"Mesa 26.1's drm-shim knows {family}"
    run = vp.family_stats([family], jobs)[family]
    assert run.available, run.reason
    assert all(r.ok for r in run.jobs), [(r.name, r.error) for r in run.jobs if not r.ok]
    _check_planned(run, MESA_26_1, family, 1024)


def test_reported_waves_follow_the_documented_rule(navi21, jobs):
    # the rule in the module docstring, read from Mesa 22.3's source; Mesa 26 as measured (a wave32
    # pipeline gets as many wave slots as a wave64 one): both checked on every job + a wave32 copy
    mesa = _mesa(navi21)
    if mesa not in (MESA_22_3, MESA_26_1):
        pytest.skip(f"the rule is checked against Mesa 22.3 and 26.1; this is {mesa}")
    copy = jobs[-1]
    wave32 = vp.Job("copy-w32", copy.spirv, COPY, 5, subgroup_size=32)
    extra = vp.family_stats([FAMILY], [wave32])[FAMILY].jobs
    for job, res in zip(jobs + [wave32], navi21.jobs + extra):
        exe = res.executables[0]
        st = exe.stats
        waves, limits = vp.radv_waves_per_simd(FAMILY, st["VGPRs"], st["LDS size"], job.spec[0],
                                               exe.subgroup_size, st["SGPRs"], mesa=mesa)
        assert waves == st["Subgroups per SIMD"], (job.name, limits)
    assert extra[0].executables[0].subgroup_size == 32
    assert extra[0].stats["Subgroups per SIMD"] == (32 if mesa == MESA_22_3 else 16)


def test_failures_and_unknown_families_are_reported_not_raised(jobs):
    _need_compiler()
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
    _need_compiler()
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
    monkeypatch.setenv("AMDGPU_GPU_ID", "navi10")
    monkeypatch.setenv("LD_PRELOAD", "/x/libother.so")
    force = vp.NullMechanism(vp.FORCE_FAMILY, "/x/radeon_icd.json", (22, 3, 6))
    env = vp._child_env("gfx1100", force, {"RADV_DEBUG": "nocache"})
    assert env["RADV_FORCE_FAMILY"] == "gfx1100"
    # RDNA3's two names: 22.3's null winsys knows gfx1100, 25's navi31; the drm-shim code names only
    assert force.spellings("navi31") == ["navi31", "gfx1100"] and force.spellings("GFX1100") == ["gfx1100", "navi31"]
    assert force.spellings("navi21") == ["navi21"]
    assert env["VK_DRIVER_FILES"] == env["VK_ICD_FILENAMES"] == "/x/radeon_icd.json"
    assert "VK_INSTANCE_LAYERS" not in env and env["VK_LOADER_LAYERS_DISABLE"] == "~all~"
    assert "RADV_PERFTEST" not in env and env["RADV_DEBUG"] == "nocache"
    assert "AMDGPU_GPU_ID" not in env and env["LD_PRELOAD"] == "/x/libother.so"
    shim = vp.NullMechanism(vp.DRM_SHIM, "/x/radeon_icd.json", (26, 1, 6), "/x/libamdgpu_noop_drm_shim.so")
    env = vp._child_env("gfx1100", shim, None)
    assert env["AMDGPU_GPU_ID"] == "navi31" and "RADV_FORCE_FAMILY" not in env
    assert shim.spellings("gfx1100") == ["navi31", "gfx1100"]
    assert env["LD_PRELOAD"] == "/x/libamdgpu_noop_drm_shim.so /x/libother.so"    # shim first
    assert vp._child_env("gfx1201", shim, None)["AMDGPU_GPU_ID"] == "gfx1201"
    with pytest.raises(RuntimeError, match="no GPU compiler"):
        vp._child_env("navi21", vp.NullMechanism(None, reason="test"), None)


def _fake_mesa(tmp_path, version, shim: bool):
    """An ICD manifest naming a driver library that carries ``Mesa <version>`` (+ the shim)."""
    libdir = tmp_path / "lib"
    libdir.mkdir()
    (libdir / "libvulkan_radeon.so").write_bytes(b"\x7fELF" + b"\0" * 64 + f"Mesa {version}-1~bpo13+1".encode()
                                                 + b"\0" * 64)
    if shim:
        (libdir / vp.DRM_SHIM_LIBRARY).write_bytes(b"\x7fELF")
    icd = tmp_path / "radeon_icd.json"
    icd.write_text('{"file_format_version": "1.0.1", "ICD": {"library_path": "lib/libvulkan_radeon.so"}}')
    return str(icd)


@pytest.mark.parametrize("version, shim, override, kind", [
    ("22.3.6", False, "", vp.FORCE_FAMILY),
    ("25.0.7", True, "", vp.FORCE_FAMILY),          # both work on 25: the null hardware, as before
    ("25.0.7", True, "drm-shim", vp.DRM_SHIM),
    ("26.1.6", True, "", vp.DRM_SHIM),
    ("26.1.6", False, "", None),                   # 26 without the shim: nothing, and why
    ("26.1.6", False, "force-family", vp.FORCE_FAMILY),
])
def test_mechanism_from_mesa_version_and_shim(tmp_path, monkeypatch, version, shim, override, kind):
    monkeypatch.delenv("VKATTN_DRM_SHIM", raising=False)
    monkeypatch.setenv("LD_LIBRARY_PATH", "/nonexistent")   # no system shim found beside the fake
    monkeypatch.setattr(vp, "_library_dirs", lambda: ["/nonexistent"])
    monkeypatch.setenv("VKATTN_RADV_NULL", override)
    icd = _fake_mesa(tmp_path, version, shim)
    assert vp.mesa_version(vp.radv_library(icd)) == tuple(int(v) for v in version.split("."))
    mech = vp.null_mechanism(icd)
    assert mech.kind == kind and mech.icd == icd
    if kind is None:
        assert not mech.available and "mesa-drm-shim" in mech.reason and "removed" in mech.reason
        assert vp.family_stats(["navi21"], [], mechanism=mech)["navi21"].reason == mech.reason
    if kind == vp.DRM_SHIM:
        assert mech.shim.endswith(vp.DRM_SHIM_LIBRARY) and mech.device_match == "RADV"
        assert vp.default_families(mech) == vp.SHIM_FAMILIES
    if kind == vp.FORCE_FAMILY:
        assert mech.device_match == vp.NULL_DEVICE and vp.default_families(mech) == vp.DEFAULT_FAMILIES


def test_mechanism_errors_and_names(tmp_path, monkeypatch):
    monkeypatch.setenv("VKATTN_RADV_NULL", "shim")
    with pytest.raises(ValueError, match="VKATTN_RADV_NULL"):
        vp.null_mechanism(_fake_mesa(tmp_path, "26.1.6", True))
    monkeypatch.setenv("VKATTN_RADV_NULL", "")
    monkeypatch.setattr(vp, "radeon_icd", lambda: None)
    mech = vp.null_mechanism()
    assert not mech.available and "mesa-vulkan-drivers" in mech.reason
    assert vp.mesa_version(None) is None and vp.mesa_version(str(tmp_path / "missing.so")) is None
    assert vp.canonical_family("NAVI31") == vp.canonical_family("gfx1100") == "gfx1100"
    assert vp.canonical_family("gfx1201") == "gfx1201"


def test_a_private_radv_named_to_the_loader_comes_first(tmp_path, monkeypatch):
    icd = _fake_mesa(tmp_path, "25.0.7", False)          # e.g. scripts/mesa25.sh's prefix
    monkeypatch.setenv("VK_DRIVER_FILES", os.pathsep.join([str(tmp_path / "lvp_icd.json"), icd]))
    assert vp.radeon_icd() == icd
    monkeypatch.setenv("VKATTN_RADV_NULL", "")
    monkeypatch.setattr(vp, "_library_dirs", lambda: ["/nonexistent"])
    assert vp.null_mechanism().mesa == (25, 0, 7)


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


def test_compile_stats_in_one_process(monkeypatch, jobs, tmp_path):
    """compile_stats: one instance/device in one process. RADV reads RADV_FORCE_FAMILY when an
    instance is created, so setting it for the call suffices (family_stats isolates crashes); the
    drm-shim is preloaded when a process starts, so on Mesa 26 a child started with the
    mechanism's variables runs the same call."""
    mech = _need_compiler()
    if mech.kind == vp.FORCE_FAMILY:
        monkeypatch.setenv("RADV_FORCE_FAMILY", FAMILY)
        run = vp.compile_stats([jobs[-1], jobs[-1]], features=["storageBuffer8BitAccess"], ir=True)
        name, enabled, oks = run.device.name, run.enabled, [r.ok for r in run.jobs]
        exe = run.jobs[0].executables[0]
        vgprs, reps = exe["VGPRs"], list(exe.ir)
    else:
        import json
        import subprocess
        (tmp_path / "copy.spv").write_bytes(jobs[-1].spirv)
        code = ("import json, sys; from vkattn.tools import vkpipeline as vp; "
                "j = vp.Job('copy', open(sys.argv[1], 'rb').read(), [64]); "
                "r = vp.compile_stats([j, j], device='RADV', features=['storageBuffer8BitAccess'], ir=True); "
                "e = r.jobs[0].executables[0]; "
                "print(json.dumps([r.device.name, r.enabled, [x.ok for x in r.jobs], e['VGPRs'], list(e.ir)]))")
        env = vp._child_env(FAMILY, mech, None)
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "copy.spv")], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        name, enabled, oks, vgprs, reps = json.loads(out.stdout.strip().splitlines()[-1])
    assert "NAVI21" in name and enabled == ["storageBuffer8BitAccess"]
    assert oks == [True, True]
    assert vgprs > 0 and any("Assembly" in k or "ISA" in k for k in reps)


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


# ------------------------------------------------------------------ NVK (NVIDIA's ISA, compiler NAK)

def test_nvk_mechanism_spells_chips_for_nouveaus_shim():
    mech = vp.NullMechanism(vp.NOUVEAU_SHIM, "/x/nouveau_icd.json", (26, 1, 6), "/x/" + vp.NOUVEAU_SHIM_LIBRARY)
    env = mech.env("GA100")
    assert env["NOUVEAU_CHIPSET"] == "170" and env["MESA_LOADER_DRIVER_OVERRIDE"] == "nouveau"
    assert env["LD_PRELOAD"].split()[0] == mech.shim and mech.env("172")["NOUVEAU_CHIPSET"] == "172"
    assert mech.device_match == "NVK" and vp.default_families(mech) == vp.NVK_FAMILIES
    assert "NVK/NAK of Mesa 26.1.6" in mech.describe()
    with pytest.raises(ValueError, match="NVIDIA chip 'ad102'"):
        mech.env("ad102")
    for var in ("NOUVEAU_CHIPSET", "MESA_LOADER_DRIVER_OVERRIDE"):       # not inherited by a child
        assert var in vp._DROPPED_ENV


def test_nvk_compiles_the_kernels_with_no_local_memory_for_them(monkeypatch):
    """Where Mesa 26's NVK and nouveau's drm-shim are installed (Debian 13 with trixie-backports):
    on GA100 the float16 decode (attn.comp, NVIDIA's decode shape) and the cooperative-matrix
    prefill compile with no spill to memory, and the prefill keeps its O accumulators out of local
    memory (COOPMAT_FIXED_TRIPS: NAK put o[], 256 bytes a thread, there before)."""
    mech = vp.nvk_mechanism()
    if not mech.available:
        pytest.skip(f"no NVIDIA compiler reachable: {mech.reason}")
    info = vp.family_device_info("ga100", mechanism=mech)
    if info is None:
        pytest.skip("the installed NVK gives no device for GA100 through nouveau's drm-shim")
    dev = PlanningDevice(info)
    assert info.vendor_id == 0x10DE and dev.coopmat_problem() == "" and dev.coopmat_pin() == (0, True)
    fmt = StorageFormat(8, 128, dtype="float16", block_size=4096)
    monkeypatch.delenv("VKATTN_KERNEL", raising=False)
    monkeypatch.delenv("VKATTN_COOPMAT_FIXED_TRIPS", raising=False)
    dcfg, dp = attn_pipeline(dev, fmt, 32, 1, 1, 1, 0, 4096, True)
    monkeypatch.setenv("VKATTN_KERNEL", "coopmat")
    pcfg, pp = attn_pipeline(dev, fmt, 32, 512, 0, 1, 0, 4096, False)
    assert dcfg.kernel == "tile" and pcfg.kernel == "coopmat" and pp.defines["COOPMAT_FIXED_TRIPS"] == 1
    jobs = [vp.Job("decode", compile_shader(dp.shader, dp.defines), list(dp.spec), dp.bindings),
            vp.Job("prefill", compile_shader(pp.shader, pp.defines), list(pp.spec), pp.bindings,
                   full_subgroups=True)]
    run = vp.family_stats(["ga100"], jobs, features=["shaderFloat16", "cooperativeMatrix", "vulkanMemoryModel",
                                                     "vulkanMemoryModelDeviceScope", "computeFullSubgroups"],
                          mechanism=mech)["ga100"]
    assert run.available, run.reason
    for jr in run.jobs:
        assert jr.ok, (jr.name, jr.result, jr.error)
        st, exe = jr.executables[0].stats, jr.executables[0]
        assert exe.subgroup_size == 32 and 0 < st["Number of GPRs"] <= 255 and st["Max warps/SM"] >= 4, (jr.name, st)
        assert st["Spills to memory"] == 0, (jr.name, st)
    decode, prefill = (jr.executables[0].stats for jr in run.jobs)
    assert decode["SLM size"] == 0 and prefill["SLM size"] < 256, (decode, prefill)


def test_perf_nvk_reports_every_case_or_says_why(monkeypatch):
    """`python -m perf nvk`: without NVK a report that names why (and no table); with it (Debian
    13, Mesa 26), every case of GA100 compiled with NAK's statistics."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from perf import nvk
    gone = nvk.build(["ga100"], mechanism=vp.NullMechanism(None, reason="no shim here"))
    assert gone["unavailable"] == "no shim here" and "Not available here: no shim here" in nvk.markdown(gone)
    mech = vp.nvk_mechanism()
    if not mech.available:
        pytest.skip(f"no NVIDIA compiler reachable: {mech.reason}")
    for var in ("VKATTN_KERNEL", "VKATTN_TILE_DECODE", "VKATTN_TILE_MERGE_BATCH", "VKATTN_TILE_V_EARLY",
                "VKATTN_COOPMAT_FIXED_TRIPS", "VKATTN_COOPMAT_STAGE_BATCH"):
        monkeypatch.delenv(var, raising=False)
    report = nvk.build(["ga100"], mechanism=mech)
    rows = report["chips"]["ga100"]["rows"]
    assert {r["case"] for r in rows} == {label for label, _, _ in nvk.cases()}
    for r in rows:
        assert "error" not in r and r["Number of GPRs"] > 0 and r["Spills to memory"] == 0, r
    before = next(r for r in rows if "the kernel before session 24" in r["case"] and r["role"] == "attn")
    now = next(r for r in rows if r["case"] == "prefill 512 over 0 float16, coopmat" and r["role"] == "attn")
    assert now["SLM size"] < before["SLM size"]          # O out of local memory
    assert "| GA100 " not in nvk.markdown(report) and "## GA100" in nvk.markdown(report)
