"""perf gpu's pieces beyond vkattn's own pipelines: the report files per Mesa, the llama.cpp anchor's
tuning rules (perf/llama_cpp.py), and the cooperative-matrix prefill section -- its block
accounting and model, and the hook that compiles vkattn's attn_coopmat.comp once it exists (the
study kernel perf/coopmat_tile.comp until then) where RADV offers VK_KHR_cooperative_matrix (Mesa
26's navi31 / gfx1201 through the drm-shim; no family of Mesa 22.3)."""
import os
import shutil
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from perf import gpu as pg            # noqa: E402
from perf import llama_cpp as ll      # noqa: E402
from vkattn.tools import vkpipeline as vp  # noqa: E402

XTX = next(g for g in pg.REFERENCE_GPUS if g.name == "Radeon RX 7900 XTX")


def test_report_files_per_mesa():
    assert pg.report_stem([22, 3, 6]) == "gpu_report"          # the committed Debian 12 report
    assert pg.report_stem(None) == "gpu_report"
    assert pg.report_stem([26, 1, 6]) == "gpu_report_mesa26"
    assert pg.report_stem((25, 0, 7)) == "gpu_report_mesa25"


def _brute_blocks(q_len, tile_rows, step_keys, group=1):
    """16x16 blocks touched, counted one (row block, key block) pair at a time; ``group`` heads'
    rows stacked into one workgroup's matrix rows."""
    seen = 0
    for t0 in range(0, q_len, tile_rows):
        kend = min(q_len, t0 + tile_rows)
        steps = -(-kend // step_keys)
        for r in range(0, group * tile_rows, 16):
            for k in range(0, steps * step_keys, 16):
                seen += 1
    return seen


@pytest.mark.parametrize("tile_rows, step_keys, group", [(16, 16, 1), (16, 64, 1), (64, 16, 1), (32, 32, 1),
                                                         (8, 32, 4), (4, 32, 2)])
def test_causal_blocks(tile_rows, step_keys, group):
    assert pg.causal_blocks(512, tile_rows, step_keys, group) == _brute_blocks(512, tile_rows, step_keys, group)


def test_coopmat_model_adds_matrix_and_valu_time():
    st = {"wmma": 16, "loop_valu": 200, "valu_cond": 50, "valu_total": 260, "subgroup_size": 32}
    k = pg.CoopKernel("x", None, tile_rows=16, step_keys=16, waves=1, blocks_per_pass=1)
    t = pg.coopmat_model(st, k, XTX, unique_bytes=0)
    blocks = 32 * _brute_blocks(512, 16, 16)
    assert t["blocks"] == blocks and t["wmma_per_block"] == 16 and t["valu_per_block"] == 200
    assert t["branch_valu_per_block"] == 50
    flops = blocks * 16 * 2 * 16 ** 3
    assert t["matrix_us"] == pytest.approx(flops / (XTX.f16_matrix_tflops * 1e6))
    waves = 32 * 32                               # 32 row tiles x 32 heads, one wave each
    wave64_instr = (blocks * 200 + waves * 60) * 0.5
    assert t["valu_us"] == pytest.approx(wave64_instr / (XTX.cus * XTX.clock_ghz * 1e3))
    assert t["model_us"] == pytest.approx(t["matrix_us"] + t["valu_us"]) and t["bound"] == "issue"
    mem = pg.coopmat_model(st, k, XTX, unique_bytes=10 ** 9)
    assert mem["bound"] == "mem" and mem["model_us"] == pytest.approx(1e9 / (XTX.bandwidth_gbs * 1e3))
    # blocks per pass from the WMMA count where the kernel does not say (2 x 128 / 16 per block)
    derived = pg.coopmat_model({**st, "wmma": 32}, pg.CoopKernel("y", None, blocks_per_pass=None), XTX, 0)
    assert derived["wmma_per_block"] == 16 and derived["valu_per_block"] == 100
    # no matrix rate (RX 6800 XT), or no WMMA in the loop: no model
    assert pg.coopmat_model(st, k, next(g for g in pg.REFERENCE_GPUS if g.family == "navi21"), 0) is None
    assert pg.coopmat_model({**st, "wmma": 0}, k, XTX, 0) is None


RDNA3 = ll.FaDevice(gcn=False, uma=False, subgroup_size=64, shared_memory=65536, fp16=True, dot2=True,
                    coopmat=True, size_control=True, full_subgroups=True)
GCN5 = ll.FaDevice(gcn=True, uma=False, subgroup_size=64, shared_memory=65536, fp16=True, dot2=False,
                   coopmat=False, size_control=False, full_subgroups=True)


def test_llama_cpp_scalar_tiles_follow_its_host_rules():
    decode, prefill = ll.configs(RDNA3, "scalar")
    # decode: 4 grouped query heads become 4 rows; 4 rows on RDNA with head_dim 128 -> row_split 4,
    # wave64, 4 subgroups, Br 4, Bc 32; the mask flag only (one row: no mask optimisation)
    assert (decode.rows, decode.keys, decode.flags) == (4, 4096, 2)
    assert decode.spec == [256, 4, 32, 128, 128, 0, 8, 4, 64, 0, 2, 0, 1, 1, 2, 2]
    assert ("DOT2_F16", "1") in decode.defines and not decode.optimise     # dot2 builds skip -O
    # prefill 512 from empty: row_split 1, Br 4 (under 1024 keys), the RDNA occupancy limiter
    # (30 KiB of unused shared memory), mask optimisation on (512 x 512 mask, 16 x Bc <= 512)
    assert prefill.spec == [256, 4, 32, 128, 128, 0, 8, 1, 64, 0, 3, 1920, 1, 1, 2, 2]
    g_decode, g_prefill = ll.configs(GCN5, "scalar")
    assert g_decode.spec[:9] == [256, 4, 32, 128, 128, 0, 8, 4, 64] and g_decode.optimise
    assert g_prefill.spec[1] == 8 and g_prefill.flags == 2 and g_prefill.spec[11] == 0   # GCN: no limiter
    polaris = ll.FaDevice(**{**GCN5.__dict__, "fp16": False})
    assert ("FLOAT_TYPE", "float") in ll.configs(polaris, "scalar")[0].defines           # the _fp32 build
    with pytest.raises(ll.LlamaCppError, match="cooperative"):
        ll.configs(GCN5, "cm1")


def test_llama_cpp_cm1_tile_and_bad_sources(tmp_path, monkeypatch):
    decode, prefill = ll.configs(RDNA3, "cm1")
    assert decode.spec[:9] == [256, 16, 64, 128, 128, 0, 8, 4, 64] and ("COOPMAT", "1") in decode.defines
    assert prefill.flags == 2 and decode.rows == 4       # 512 keys < 16 x Bc: no mask optimisation
    monkeypatch.delenv("VKATTN_LLAMA_CPP_SHADERS", raising=False)
    with pytest.raises(ll.LlamaCppError, match="VKATTN_LLAMA_CPP_SHADERS"):
        ll.shader_dir()
    with pytest.raises(ll.LlamaCppError, match="flash_attn.comp"):
        ll.shader_dir(tmp_path)


def _coop_family():
    mech = vp.null_mechanism()
    if not mech.available:
        pytest.skip(f"no AMD compiler reachable: {mech.reason}")
    for fam in ("navi31", "gfx1201"):
        head = vp.family_stats([fam], [], features=["cooperativeMatrix"])[fam]
        if head.available and head.device.features.get("cooperativeMatrix"):
            return fam
    pytest.skip(f"no family offers VK_KHR_cooperative_matrix on {mech.describe()} (Mesa 26's RADV does)")


def _report(fam):
    gpus = {g.name: {"model_us": 150.0} for g in pg.REFERENCE_GPUS if pg.same_chip(g.family, fam)}
    return {"calls": [{"shape": pg.COOPMAT_SHAPE, "dtype": "float16", "call": f"prefill {pg.PREFILL}",
                       "per_family": {fam: {"unique_bytes": 24 << 20, "times": gpus}}}], "llama_cpp": {}}


def test_coopmat_section_compiles_the_study_kernel():
    fam = _coop_family()
    study = pg.coopmat_study([fam], _report(fam))
    rows = study[fam]["kernels"]
    from vkattn.compiler import shader_dir
    study_kernel = not (shader_dir() / "attn_coopmat.comp").is_file()
    # vkattn's kernel: a pipeline per storage format it takes (float16 first), each compiled
    assert len(rows) == (1 if study_kernel else len(pg.COOPMAT_DTYPES))
    if not study_kernel:
        assert [r["label"].rsplit(" ", 1)[-1] for r in rows[1:]] == [f"({d})" for d in pg.COOPMAT_DTYPES[1:]]
    for row in rows:
        assert "error" not in row, row
        assert row["label"].startswith("study kernel" if study_kernel else "vkattn attn_coopmat"), row["label"]
        st = row["stats"]
        assert st["wmma"] > 0 and st["loop_valu"] > 0 and st["VGPRs"] > 0 and st["Spilled VGPRs"] == 0
        (model,) = [t for t in row["model"].values()]
        assert model["wmma_per_block"] > 0 and model["bound"] in ("issue", "mem") and model["model_us"] > 0
        if study_kernel:                  # one 16x16 block per pass of its key loop
            assert st["wmma"] == 16 and model["wmma_per_block"] == 16
        assert list(row["scalar_model_us"].values()) == [150.0]
    text = "\n".join(pg.coopmat_markdown({"coopmat": study}))
    assert "Cooperative matrices" in text and fam in text


def test_coopmat_hook_takes_vkattn_kernel_when_it_exists(tmp_path, monkeypatch):
    """With shaders/attn_coopmat.comp present the section compiles what the planner plans for it
    (VKATTN_KERNEL=coopmat); a planner that cannot plan it is reported and the study kernel stands
    in. Simulated: a shader tree with attn_coopmat.comp (the study kernel's source) and a planner
    returning its pipeline."""
    fam = _coop_family()
    from vkattn import compiler
    src = tmp_path / "shaders"
    shutil.copytree(str(compiler.shader_dir()), src)
    shutil.copy(pg.STUDY_KERNEL, src / "attn_coopmat.comp")
    monkeypatch.setattr(compiler, "shader_dir", lambda: src)
    monkeypatch.delenv("VKATTN_KERNEL", raising=False)
    seen = {}

    def planner(dev, call):
        seen["kernel"] = os.environ.get("VKATTN_KERNEL")
        pipe = SimpleNamespace(shader="attn_coopmat", defines={}, spec=(32,), bindings=5)
        # the study kernel's tile in the planner's terms: one subgroup of 32, 16 rows x 16 keys
        cfg = SimpleNamespace(kernel="coopmat", bq=4, br=16, bc=16, sg=32, mnk=(16, 16, 16))
        attn = pg.Dispatch("attn", pipe, cfg)
        return pg.Planned(call, [attn], 1, 0, 0, 0.0)

    monkeypatch.setattr(pg, "plan_call", planner)
    rows = pg.coopmat_study([fam], _report(fam))[fam]["kernels"]
    assert len(rows) == len(pg.COOPMAT_DTYPES)        # the planner's pipeline for each format
    row = rows[0]
    assert seen["kernel"] == "coopmat" and "VKATTN_KERNEL" not in os.environ
    assert row["label"].startswith("vkattn attn_coopmat"), row
    assert "error" not in row and row["stats"]["wmma"] == 16 and row["stats"]["subgroup_size"] == 32
    (model,) = [t for t in row["model"].values()]
    # 4 rows of each of the 4 grouped heads per workgroup: 8 KV heads x the blocks of that tiling
    assert model["blocks"] == 8 * _brute_blocks(512, 4, 16, 4) and model["wmma_per_block"] == 16

    def refuses(dev, call):
        raise ValueError("VKATTN_KERNEL='coopmat': expected 'tile' or 'lane'")

    monkeypatch.setattr(pg, "plan_call", refuses)
    (row,) = pg.coopmat_study([fam], _report(fam))[fam]["kernels"]
    assert row["label"].startswith("study kernel") and "could not be planned" in row["note"]
