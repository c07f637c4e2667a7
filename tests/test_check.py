"""``python -m vkattn check`` (vkattn/check.py): passes on this device, and really fails -- exit 1,
the case named, the JSON report saying FAIL -- when a result or a stored bit is wrong."""
import json

import numpy as np
import pytest
from conftest import skip_or_fail_coopmat

import vkattn
from vkattn import check, tuning
from vkattn.reference import quantize_int8


def test_check_quick_passes_here(device, tmp_path, capsys):
    path = tmp_path / "report.json"
    assert check.main(["--quick", "--repeats", "3", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "verdict  : PASS" in out
    rep = json.loads(path.read_text())
    assert rep["verdict"] == "PASS" and rep["failed"] == 0
    kernels = {c["kernel"].rstrip("*") for c in rep["cases"]}
    assert "tile" in kernels and ("lane" in kernels) == bool(device.lane_subgroup())
    # attn_coopmat.comp: checked wherever it runs, starred where vkattn picks it for prefill
    assert ("coopmat" in kernels) == (device.coopmat_problem() == "")
    assert rep["prefill_kernel"] == ("coopmat" if tuning.coopmat_wanted(device) else rep["default_kernel"])
    assert f"prefill  : {tuning.coopmat_choice(device)}" in out
    starred = {c["kernel"] for c in rep["cases"] if c["kernel"].endswith("*")}
    assert starred == {rep["default_kernel"] + "*", rep["prefill_kernel"] + "*"}
    assert {c["dtype"] for c in rep["cases"]} == {"float32", "float16", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2", "q4"}
    assert any(c["dtype"] == "bfloat16" and c["name"].startswith("storage bit-exact") for c in rep["cases"])
    assert all(c["checked"] > 0 for c in rep["cases"])
    assert rep["device"]["name"] == device.name and rep["default_kernel"] in ("tile", "lane")


def test_check_fails_on_a_wrong_result_and_a_wrong_bit(device, tmp_path, monkeypatch, capsys):
    real = vkattn.KVCache.read

    def flipped_read(self):                # one stored bit wrong, as a driver that rounds differently would
        k, v = real(self)
        if k.size:
            k = k.copy()
            k.reshape(-1)[k.size // 2] = np.nextafter(k.reshape(-1)[k.size // 2], np.float32(np.inf))
        return k, v

    real_attend = vkattn.KVCache.attend

    def skewed_attend(self, q, *a, **kw):  # results off by 1e-3: beyond every tolerance
        r = real_attend(self, q, *a, **kw)
        return (r[0] + 1e-3, *r[1:]) if isinstance(r, tuple) else r + np.float32(1e-3)

    monkeypatch.setattr(vkattn.KVCache, "read", flipped_read)
    monkeypatch.setattr(vkattn.KVCache, "attend", skewed_attend)
    path = tmp_path / "report.json"
    assert check.main(["--quick", "--repeats", "2", "--json", str(path)]) == 1
    out = capsys.readouterr().out
    assert "verdict  : FAIL" in out
    rep = json.loads(path.read_text())
    assert rep["verdict"] == "FAIL"
    failed = {c["name"] for c in rep["cases"] if not c["ok"]}
    assert any(n.startswith("storage bit-exact") for n in failed)
    assert any(n.startswith("split-K stress") for n in failed)
    assert any("differ from the reference's bits" in c["detail"] for c in rep["cases"] if not c["ok"])


def test_adversarial_rows_catch_other_roundings():
    # the storage case's inputs would expose a round-toward-zero float16 conversion and an int8
    # quantiser that multiplies by a rounded reciprocal (what GPU compilers emit for x / scale)
    rng = np.random.default_rng(0)
    x = check.adversarial_rows(rng, 2, 67, 72, "float16")
    rne = x.astype(np.float16)
    over = np.abs(rne.astype(np.float32)) > np.abs(x)
    rtz = np.where(over, rne.view(np.uint16) - 1, rne.view(np.uint16)).astype(np.uint16)
    assert (rtz != rne.view(np.uint16)).mean() > 0.2
    x = check.adversarial_rows(rng, 2, 67, 72, "int8")
    q, scale = quantize_int8(x)
    recip = np.float32(1) / np.where(scale > 0, scale, np.float32(1))
    q_rcp = np.clip(np.rint(x * recip[..., None]), -127, 127)
    assert (q_rcp != q).mean() > 0.01
    assert (scale == 0).any() and (scale[scale > 0] < 1e-30).any()     # zero rows and tiny rows


def test_check_refuses_bad_arguments(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit):
        check.main(["--repeats", "1"])
    # a report path it cannot write: refused before any case runs (it failed after all of them)
    monkeypatch.setattr(check, "run_check", lambda *a, **k: pytest.fail("cases ran"))
    (tmp_path / "file").write_text("")
    for bad in (tmp_path, tmp_path / "file" / "report.json"):
        with pytest.raises(SystemExit) as e:
            check.main(["--quick", "--json", str(bad)])
        assert e.value.code == 2
        assert f"--json {bad}: cannot write the report there" in capsys.readouterr().err


def test_check_fails_when_the_forced_coopmat_kernel_cannot_run(device, tmp_path, monkeypatch, capsys):
    """VKATTN_KERNEL=coopmat on a device whose cooperative matrices vkattn cannot use: the check
    runs the kernel's cases, each fails naming why, and the verdict fails (it passed on the
    other kernels' cases alone before)."""
    problem = device.coopmat_problem()
    if not problem:
        pytest.skip("attn_coopmat.comp runs on this device (its forced pass: the test below)")
    monkeypatch.setenv("VKATTN_KERNEL", "coopmat")
    path = tmp_path / "report.json"
    assert check.main(["--quick", "--repeats", "3", "--json", str(path)]) == 1
    rep = json.loads(path.read_text())
    mine = [c for c in rep["cases"] if c["kernel"].startswith("coopmat")]
    assert mine and not any(c["ok"] for c in mine) and rep["failed"] == len(mine)
    assert all("VKATTN_KERNEL=coopmat" in c["detail"] for c in mine)
    assert all(c["ok"] for c in rep["cases"] if not c["kernel"].startswith("coopmat"))


def test_check_covers_the_coopmat_kernel_when_it_is_forced(device, tmp_path, monkeypatch, capsys):
    skip_or_fail_coopmat(device.coopmat_problem())
    monkeypatch.setenv("VKATTN_KERNEL", "coopmat")
    path = tmp_path / "report.json"
    assert check.main(["--quick", "--repeats", "3", "--json", str(path)]) == 0
    assert "prefill  : attn_coopmat.comp for prefill and chunks (forced: VKATTN_KERNEL=coopmat)" in capsys.readouterr().out
    rep = json.loads(path.read_text())
    assert rep["prefill_kernel"] == "coopmat" and rep["failed"] == 0
    assert "coopmat*" in {c["kernel"] for c in rep["cases"]}
    # its pass runs the formats its matrices hold, no case of a format that would fall back
    from vkattn.formats import FORMATS
    assert {c["dtype"] for c in rep["cases"] if c["kernel"].startswith("coopmat") and "variant" not in c["name"]
            and "rope" not in c["name"]} == {d for d, f in FORMATS.items() if f.matrices}
