"""The llvmpipe workaround of vkattn._driverfix: which drivers it covers and when it stays away."""
import json
import os

import pytest

from vkattn import _driverfix


@pytest.mark.parametrize("name, info, hit", [
    ("llvmpipe", "Mesa 25.0.7-2+deb13u1 (LLVM 19.1.7)", True),
    ("llvmpipe", "Mesa 25.2.0 (LLVM 20.1.0)", True),
    ("llvmpipe", "Mesa 22.3.6 (LLVM 15.0.6)", False),
    ("llvmpipe", "Mesa 26.1.6-1~bpo13+1 (LLVM 19.1.7)", False),
    ("radv", "Mesa 25.0.7", False),
    ("llvmpipe", "", False),
])
def test_affected(name, info, hit):
    assert _driverfix.affected(name, info) is hit


def test_user_settings_and_opt_out_win(monkeypatch):
    monkeypatch.setattr(_driverfix, "_probe", lambda: pytest.fail("probed although the user decided"))
    monkeypatch.setattr(_driverfix, "_avx512", lambda: True)
    for var, val in [("LP_NATIVE_VECTOR_WIDTH", "128"), ("GALLIUM_OVERRIDE_CPU_CAPS", "avx"),
                     ("VKATTN_DRIVER_WORKAROUNDS", "0")]:
        with monkeypatch.context() as m:
            m.setenv(var, val)
            assert _driverfix.apply() == {}


def _isolated(monkeypatch, tmp_path, driver: str) -> list:
    """apply() on a pretend AVX-512 machine with one lavapipe library, its cache in ``tmp_path``,
    the probe reporting llvmpipe of ``driver``; the probe's calls, for the caller to count."""
    for var in ("LP_NATIVE_VECTOR_WIDTH", "GALLIUM_OVERRIDE_CPU_CAPS", "VKATTN_DRIVER_WORKAROUNDS"):
        # setenv first, so that monkeypatch records the variable's state before the test (delenv
        # of an unset one records nothing): apply() sets GALLIUM_OVERRIDE_CPU_CAPS, and the undo
        # of the later delenv calls put "avx" back for the rest of the process, whose llvmpipe
        # then ran with other CPU caps than the shader cache's code (a texel test's segmentation
        # fault on Mesa 26, session 42)
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    monkeypatch.setenv("VKATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_driverfix, "_avx512", lambda: True)
    monkeypatch.setattr(_driverfix, "_lavapipe_libraries", lambda: ["/x/libvulkan_lvp.so:1:2"])
    monkeypatch.setattr(_driverfix, "applied", {})
    calls = []
    monkeypatch.setattr(_driverfix, "_probe", lambda: calls.append(1) or [("llvmpipe", driver)])
    return calls


def test_probe_result_is_remembered(monkeypatch, tmp_path):
    calls = _isolated(monkeypatch, tmp_path, "Mesa 25.0.7 (LLVM 19.1.7)")
    assert _driverfix.apply() == _driverfix.FIX
    assert os.environ["GALLIUM_OVERRIDE_CPU_CAPS"] == "avx"
    monkeypatch.delenv("GALLIUM_OVERRIDE_CPU_CAPS")
    assert _driverfix.apply() == _driverfix.FIX and calls == [1]      # second time from the cache file
    monkeypatch.delenv("GALLIUM_OVERRIDE_CPU_CAPS")
    monkeypatch.setattr(_driverfix, "applied", {})
    monkeypatch.setattr(_driverfix, "_lavapipe_libraries", lambda: ["/x/libvulkan_lvp.so:1:3"])   # upgraded
    monkeypatch.setattr(_driverfix, "_probe", lambda: [("llvmpipe", "Mesa 26.1.6 (LLVM 19.1.7)")])
    assert _driverfix.apply() == {} and "GALLIUM_OVERRIDE_CPU_CAPS" not in os.environ


def test_a_remembered_entry_of_the_wrong_type_is_probed_again(monkeypatch, tmp_path):
    """An entry for this machine's lavapipe that is not a dict (a damaged driverfix.json) is
    probed again and written anew, not read (AttributeError inside `import vkattn`)."""
    calls = _isolated(monkeypatch, tmp_path, "Mesa 26.1.6 (LLVM 19.1.7)")
    for bad in (5, None, ["x"], "affected"):
        (tmp_path / "driverfix.json").write_text(json.dumps({"/x/libvulkan_lvp.so:1:2": bad}))
        assert _driverfix.apply() == {}
    assert len(calls) == 4
    assert json.loads((tmp_path / "driverfix.json").read_text())["/x/libvulkan_lvp.so:1:2"]["affected"] is False

M26 = "Mesa 26.1.6-1~bpo13+1 (LLVM 19.1.7)"
M25 = "Mesa 25.0.7-2+deb13u1 (LLVM 19.1.7)"
M22 = "Mesa 22.3.6 (LLVM 15.0.6)"


@pytest.mark.parametrize("name, driver, info, cpu, env, hit", [
    # a width other than the CPU's own, the shader cache on: measured crash (256-bit code at 128)
    ("llvmpipe (LLVM 19.1.7, 128 bits)", "llvmpipe", M26, "avx2", {}, True),
    ("llvmpipe (LLVM 19.1.7, 128 bits)", "llvmpipe", M25, "avx", {}, True),
    ("llvmpipe (LLVM 19.1.7, 256 bits)", "llvmpipe", M26, "sse4_1", {}, True),
    # the CPU's own width, or the cache off: measured to run every texel test
    ("llvmpipe (LLVM 19.1.7, 256 bits)", "llvmpipe", M26, "avx2", {}, False),
    ("llvmpipe (LLVM 19.1.7, 128 bits)", "llvmpipe", M26, "sse4_1", {}, False),
    ("llvmpipe (LLVM 19.1.7, 128 bits)", "llvmpipe", M26, "avx2", {"MESA_SHADER_CACHE_DISABLE": "true"}, False),
    ("llvmpipe (LLVM 19.1.7, 128 bits)", "llvmpipe", M25, "avx", {"MESA_SHADER_CACHE_DISABLE": "1"}, False),
    ("llvmpipe (LLVM 19.1.7, 128 bits)", "llvmpipe", M26, "avx2", {"MESA_SHADER_CACHE_DISABLE": "false"}, True),
    # Mesa 22.3 caches no machine code; GPUs
    ("llvmpipe (LLVM 15.0.6, 128 bits)", "llvmpipe", M22, "avx2", {}, False),
    ("llvmpipe (LLVM 15.0.6, 256 bits)", "llvmpipe", M22, "avx2", {}, False),
    ("AMD Radeon RX 7900 XTX (RADV NAVI31)", "radv", "Mesa 26.1.6", "avx2", {}, False),
    ("NVIDIA H100 80GB HBM3", "NVIDIA", "580.159.04", "avx2", {}, False),
])
def test_texel_fault(monkeypatch, name, driver, info, cpu, env, hit):
    """Which drivers vkattn keeps off texel buffers: llvmpipe of Mesa 25+ at a vector width other
    than its CPU's own with Mesa's shader cache on (a segmentation fault or garbage: the cache
    does not tell the widths apart)."""
    flags = {"avx2": {"sse4_1", "avx", "avx2", "fma"}, "avx": {"sse4_1", "avx"}, "sse4_1": {"sse2", "sse4_1"}}[cpu]
    monkeypatch.setattr(_driverfix, "_cpu_flags", lambda: set(flags))
    monkeypatch.delenv("MESA_SHADER_CACHE_DISABLE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert _driverfix.texel_fault(name, driver, info) is hit


def test_cpu_flags_read_here():
    """The flags come from /proc/cpuinfo on Linux (x86 "flags", ARM "Features"); the natural
    width follows AVX."""
    flags = _driverfix._cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo")
    assert flags, "no flags line"
    assert _driverfix._natural_width() == (256 if "avx" in flags else 128)
    assert _driverfix._avx512() == ("avx512f" in flags)


@pytest.mark.parametrize("name, driver, hit", [
    ("llvmpipe (LLVM 19.1.7, 256 bits)", "llvmpipe", False),
    ("llvmpipe (LLVM 19.1.7, 128 bits)", "llvmpipe", True),
    ("llvmpipe (LLVM 19.1.7, 512 bits)", "llvmpipe", True),
    ("llvmpipe (LLVM 15.0.6, 512 bits)", "llvmpipe", True),
    ("llvmpipe", "llvmpipe", False),                    # no width in the name: nothing known
    ("AMD Radeon RX 7900 XTX (RADV NAVI31)", "radv", False),
    ("NVIDIA H100 80GB HBM3", "NVIDIA", False),
])
def test_coopmat_fault(name, driver, hit):
    """Which devices vkattn builds no cooperative-matrix pipeline on: llvmpipe away from 256 bits,
    where Mesa 26.1.6's compiler killed the process on a minimal 8x8x8 multiply-add."""
    why = _driverfix.coopmat_fault(name, driver)
    assert bool(why) is hit
    if hit:
        assert name in why and "256 bits" in why


def test_coopmat_fault_keeps_the_device_off_its_matrices(device, monkeypatch):
    """On this device: where the fault applies and the matrices are offered (lavapipe of Mesa 26
    at 512 bits: .ci/run runs this file so in the Debian 13 root on an AVX-512 CPU),
    coopmat_problem names it without building a pipeline -- the self-test would kill the process
    -- so VKATTN_KERNEL=coopmat is a ValueError naming it and the check's line for the prefill
    kernel says why; elsewhere the fault says nothing."""
    from vkattn import tuning
    info = device.info
    why = _driverfix.coopmat_fault(info.name, info.driver_name)
    if not why:
        pytest.skip(f"{info.name}: no known cooperative-matrix fault")
    if not info.cooperative_matrix:
        pytest.skip(f"{info.name} offers no cooperative matrices (Mesa before 26; lavapipe 26 at 128 bits): "
                    f"nothing to keep off")
    monkeypatch.setattr(device, "_coopmat_self_test", lambda: pytest.fail("the self-test ran on a faulty driver"))
    assert device.coopmat_problem() == why
    monkeypatch.setenv("VKATTN_KERNEL", "coopmat")
    with pytest.raises(ValueError, match="256 bits"):
        tuning.coopmat_wanted(device)
    assert "256 bits" in tuning.coopmat_choice(device)
