"""``python -m perf modelgpu``: the whole-model example's pipelines in the layout it takes on a GPU,
captured from a real DeviceLlama and compiled by RADV for navi21 without a GPU (Mesa 22.3's
RADV_FORCE_FAMILY, or Mesa 26's drm-shim): every pipeline builds, none spills a register -- a
q4_1 prompt tile of 8 tokens spilled 53-106 VGPRs a pipeline (session 43) and is caught here."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from perf import modelgpu  # noqa: E402
from vkattn.tools import vkpipeline as vp  # noqa: E402

FAMILY = "navi21"


def _spilled(rows) -> int:
    return sum(int(r.get("Spilled VGPRs") or 0) + int(r.get("Spilled SGPRs") or 0) for r in rows)


@pytest.fixture(scope="module")
def compiler():
    mech = vp.null_mechanism()
    if not mech.available:
        pytest.skip(f"no AMD compiler reachable: {mech.reason}")
    return mech


@pytest.mark.parametrize("weight_dtype, mb", [("float16", 269.1), ("q4_1", 99.8)])
def test_the_examples_gpu_pipelines_build_and_spill_nothing(device, compiler, weight_dtype, mb, monkeypatch):
    monkeypatch.delenv("VKATTN_MODELGPU_PROMPT", raising=False)
    pipes, wbytes = modelgpu.capture(weight_dtype, device)
    assert {p["name"].split("[")[0] for p in pipes} == {"embed", "linear", "argmax"}
    linear = [p for p in pipes if p["name"].startswith("linear[")]
    # the decode's five matmuls (q/k/v, o, gate/up, down, logits) and the prompt's four, 16 lanes a row
    assert len(linear) == 9 and all("LANES=16" in p["name"] and "WG=128" in p["name"] for p in linear)
    tile = 2 if weight_dtype == "q4_1" else 8
    assert sum(f"TT={tile}," in p["name"] for p in linear) == 4
    assert wbytes / 1e6 == pytest.approx(mb, abs=0.1)          # SmolLM2's 30 layers and tied head
    res = modelgpu.compile_all(pipes, [FAMILY])[FAMILY]
    if isinstance(res, dict):
        pytest.skip(f"the installed RADV gives no null device for {FAMILY}: {res['unavailable']}")
    assert len(res) == len(pipes) and not [r for r in res if "error" in r], res
    assert _spilled(res) == 0, [(p["name"], r.get("Spilled VGPRs")) for p, r in zip(pipes, res)]
    assert all(r["VGPRs"] > 0 and r["Subgroups per SIMD"] >= 1 for r in res)


def test_a_q4_1_prompt_tile_of_8_tokens_spills(device, compiler, monkeypatch):
    """The layout the GPU default had before session 43: the check above would have failed."""
    monkeypatch.setenv("VKATTN_MODELGPU_PROMPT", "1,8")
    pipes, _ = modelgpu.capture("q4_1", device)
    prompt = [p for p in pipes if "TT=8," in p["name"]]
    assert len(prompt) == 4
    res = modelgpu.compile_all(prompt, [FAMILY])[FAMILY]
    if isinstance(res, dict):
        pytest.skip(f"the installed RADV gives no null device for {FAMILY}: {res['unavailable']}")
    assert _spilled(res) > 0
    monkeypatch.setenv("VKATTN_MODELGPU_PROMPT", "1,x")
    with pytest.raises(ValueError, match="VKATTN_MODELGPU_PROMPT"):
        modelgpu.prompt_layout("q4_1")


def test_what_it_cannot_do_exits_2_naming_why(monkeypatch, capsys):
    """No compiler for --nvk (NVK absent: Debian 12) or an unknown weight format: exit 2 and a
    line that says why, before any model is built."""
    monkeypatch.setenv("VKATTN_MODELGPU_WEIGHTS", "float16,q5")
    assert modelgpu.main([]) == 2
    assert "unknown ['q5']" in capsys.readouterr().err
    monkeypatch.setenv("VKATTN_MODELGPU_WEIGHTS", "float16")
    monkeypatch.setattr(vp, "nvk_mechanism", lambda: vp.NullMechanism(None, reason="NVK is not installed (a test)"))
    assert modelgpu.main(["--nvk"]) == 2
    assert "no GPU compiler here: NVK is not installed (a test)" in capsys.readouterr().err
