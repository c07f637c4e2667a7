"""The perf scripts' environment parsing: defaults, comma lists, and a clear error on a bad value."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from perf.common import PerfConfigError, Shape, env_int_list  # noqa: E402


def test_defaults_and_lists(monkeypatch):
    for k in list(os.environ):
        if k.startswith("VKATTN_PERF_"):
            monkeypatch.delenv(k)
    shape = Shape.from_env()
    assert (shape.heads, shape.kv_heads, shape.head_dim, shape.v_head_dim, shape.dtype) == (32, 8, 128, 128, "float16")
    monkeypatch.setenv("VKATTN_PERF_CONTEXT", "512,4096,33")
    assert env_int_list("VKATTN_PERF_CONTEXT", [1]) == [512, 4096, 33]


@pytest.mark.parametrize("name,value,msg", [
    ("VKATTN_PERF_HEADS", "x", "expected an integer"),
    ("VKATTN_PERF_HEAD_DIM", "0", "expected an integer >= 1"),
    ("VKATTN_PERF_KV_HEADS", "3", "must be a multiple"),
    ("VKATTN_PERF_DTYPE", "bf16", "expected one of float16, float32"),
    ("VKATTN_PERF_ITERS", "-2", "expected an integer"),
])
def test_bad_values_are_errors(monkeypatch, name, value, msg):
    monkeypatch.setenv(name, value)
    with pytest.raises(PerfConfigError, match=msg):
        Shape.from_env()


def test_capacity_mult_and_torch_device_are_checked(monkeypatch):
    """VKATTN_PERF_CAPACITY_MULT 0 or -5 ran as 1, and empty failed (empty means the default for
    every other variable); VKATTN_PERF_TORCH_DEVICE took any string to torch (a traceback)."""
    from perf.common import torch_device
    from perf.decode import capacities
    shape = Shape.from_env()
    for bad in ("0", "-5", "x"):
        monkeypatch.setenv("VKATTN_PERF_CAPACITY_MULT", bad)
        with pytest.raises(PerfConfigError, match="VKATTN_PERF_CAPACITY_MULT"):
            capacities(shape, 64)
    monkeypatch.setenv("VKATTN_PERF_CAPACITY_MULT", "")
    assert capacities(shape, 64) == [64, 512]
    monkeypatch.setenv("VKATTN_PERF_CAPACITY_MULT", "1")
    assert capacities(shape, 64) == [64]
    for value, want in (("", "cpu"), (" cuda ", "cuda"), ("cpu", "cpu")):
        monkeypatch.setenv("VKATTN_PERF_TORCH_DEVICE", value)
        assert torch_device() == want
    monkeypatch.setenv("VKATTN_PERF_TORCH_DEVICE", "gpu")
    with pytest.raises(PerfConfigError, match="VKATTN_PERF_TORCH_DEVICE='gpu': expected cpu or cuda"):
        torch_device()


def test_a_case_filter_that_runs_nothing_exits_2(monkeypatch, tmp_path, capsys):
    """No case selected is not a pass (it exited 0 with no rows, and wrote an empty results file)."""
    from perf.__main__ import main
    monkeypatch.setenv("VKATTN_PERF_OUT", str(tmp_path))
    monkeypatch.setenv("VKATTN_PERF_CASE", "decoed")
    assert main(["decode"]) == 2
    assert "no case of decode ran" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_bad_context_list(monkeypatch):
    monkeypatch.setenv("VKATTN_PERF_CONTEXT", "512,,x")
    with pytest.raises(PerfConfigError, match="comma list"):
        env_int_list("VKATTN_PERF_CONTEXT", [1])


def test_perf_model_random_reports_wall_device_and_host_per_token(capsys):
    """`python -m perf model --random` (the GPU machine's host time per token, issue 30): one
    layer of SmolLM2's shape with random weights runs, each token one graph replay, and the
    figures add up (host = wall - device where the device has timestamp queries)."""
    import json

    import vkattn
    from perf import model
    assert model.main(["--random", "--layers", "1", "--new", "3", "--weights", "float16", "--prompt", "9",
                       "--ops"]) == 0
    text = capsys.readouterr().out
    assert "| float16 |" in text and "host ms per token" in text and "9-token prompt" in text
    out = json.loads((model.pathlib.Path(model.__file__).resolve().parent / "out" / "model_random.json").read_text())
    (r,) = out["rows"]
    assert r["layers"] == 1 and r["prompt_tokens"] == 9 and len(r["wall_runs"]) == 3 and r["wall_ms"] > 0
    if vkattn.default_device().info.timestamp_compute_and_graphics:
        assert r["device_ms"] > 0 and abs(r["host_ms"] - (r["wall_ms"] - r["device_ms"])) < 1e-9
        # --ops: each op kind of the prompt and of a token, the layer's kernels among them
        for part in ("prompt", "decode"):
            ops = r["ops"][part]
            assert {"qkv", "o", "gate_up", "down", "logits", "embed", "argmax", "barriers"} <= set(ops), ops
            assert any(k.startswith("attn") for k in ops) and min(ops.values()) >= 0
        assert "| all |" in text
    else:
        assert r["ops"] == {"prompt": {}, "decode": {}} and "no per-op times" in text
    assert model.main(["--random", "--layers", "0"]) == 2
    assert model.main(["--random", "--prompt", "0"]) == 2
    # the kinds: layer numbers dropped, barriers together
    assert model.op_kinds([("gate_up12", 1.0), ("gate_up3", 2.0), ("barrier a,b", 0.5), ("host barrier x", 0.25),
                           ("upload ids", 0.125), ("attn_lane", 0.5)]) == \
        {"gate_up": 3.0, "barriers": 0.75, "upload": 0.125, "attn_lane": 0.5}
    assert model.median_ops([{"o": 1.0, "qkv": 2.0}, {"o": 3.0}, {"o": 2.0, "qkv": 4.0}]) == {"o": 2.0, "qkv": 2.0}


def test_perf_overhead_takes_device_time_from_one_more_layer(monkeypatch, capsys):
    """`python -m perf overhead`'s device path (issue 30's lavapipe ratio): the interleaved rounds
    time each case alike and reset after each call, and the rows carry a device time taken from
    what one more layer adds to a replayed graph, with its (wall - device) / bare."""
    import math

    import vkattn
    from perf import overhead
    calls, resets = [], []
    got = overhead.interleaved_ms({"a": (lambda: calls.append("a"), lambda: resets.append("a")),
                                   "b": (lambda: calls.append("b"), None)}, rounds=2, per=3)
    assert set(got) == {"a", "b"} and all(v >= 0 for v in got.values())
    assert calls == ["a"] * 5 + ["b"] * 5 + ["a"] * 5 + ["b"] * 5 and resets == ["a"] * 10
    monkeypatch.setenv("VKATTN_PERF_OVERHEAD_LAYERS", "3")
    shape = Shape(heads=4, kv_heads=2, head_dim=32, v_head_dim=32, dtype="float16", qlen=1, capacity=None,
                  iters=1, warmup=1)
    rows = overhead.device_path(shape, vkattn.default_device())
    assert [r.case for r in rows] == ["decode forward L=16, numpy", "decode forward L=16, device arrays",
                                      "decode step of 3 layers L=16, one graph submission"]
    assert all(r.verified for r in rows)
    for r in rows[:2]:
        e = r.extra
        assert math.isfinite(e["device_marginal_ms"]) and e["graph_ms"] > 0 and e["graph_one_ms"] > 0
        assert abs(e["host_marginal_ms"] - (e["interleaved_wall_ms"] - e["device_marginal_ms"])) < 1e-12
        assert abs(e["x_bare_marginal"] - e["host_marginal_ms"] / e["bare_interleaved_ms"]) < 1e-12
    assert "interleaved: wall" in capsys.readouterr().out


def test_perf_ablate_edits_the_shipped_kernels(monkeypatch, tmp_path):
    """`python -m perf ablate` (a GPU session's step): every variant's edits apply to today's
    attn_coopmat.comp and attn.comp -- a shader change that breaks one fails here, not on a lent
    GPU -- and each variant but the whole kernel changes its source; an edit that matches nothing
    is a ValueError, and so is a bad size list."""
    from perf import ablate
    for target, (shader, _, variants) in ablate.TARGETS.items():
        trees = ablate.shader_trees(tmp_path, target)
        whole = trees["whole"].joinpath(shader).read_text()
        assert [n for n, _ in variants] == list(trees)
        for name, folder in trees.items():
            text = folder.joinpath(shader).read_text()
            assert (text == whole) == (name == "whole"), (target, name)
            assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in trees["whole"].iterdir())
    hi = (tmp_path / "prefill" / "hi-only" / "attn_coopmat.comp").read_text()
    assert "coopMatMulAdd(ql" not in hi and "coopMatMulAdd(qh[d]" in hi
    with pytest.raises(ValueError, match="matches nothing"):
        ablate.ablated_source("void main() {}", [(r"no such line", "")])
    monkeypatch.setenv("VKATTN_ABLATE_PAST", "0,-1")
    with pytest.raises(PerfConfigError, match="VKATTN_ABLATE_PAST"):
        ablate._ints("VKATTN_ABLATE_PAST", "0", 0)
    assert ablate.main(["prefill", "nonsense"]) == 2


def test_perf_gpubench_runs_end_to_end_with_the_kernels_own_time(tmp_path):
    """`make gpu-bench`'s script, on lavapipe (VKATTN_GPU_BENCH_ALLOW_SOFTWARE=1) with staging
    copies (VKATTN_HOST_MEMORY=staging: a submission holds uploads and downloads, as on a discrete
    GPU): every row checked against the reference, each decode row's kernel time -- its
    dispatches alone, what torch's CUDA events around SDPA compare with -- below its whole
    submission's device time, and printed with it."""
    import json
    import subprocess
    env = dict(os.environ, VKATTN_GPU_BENCH_ALLOW_SOFTWARE="1", VKATTN_HOST_MEMORY="staging",
               VKATTN_PERF_CASE="L=64 cap=64", VKATTN_PERF_CONTEXT="64", VKATTN_PERF_ITERS="2",
               VKATTN_PERF_WARMUP="1", VKATTN_PERF_OUT=str(tmp_path))
    env.pop("VKATTN_PERF_TORCH_DEVICE", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "perf", "gpubench"], cwd=root, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads((tmp_path / "gpu_bench.json").read_text())["rows"]
    dec = [row for row in rows if row["kernel"] == "decode"]
    assert dec and all(row["verified"] for row in rows)
    for row in dec:
        kern = row["extra"]["kernel_ms"]
        assert 0 < kern < row["device_ms"], row
        assert f"{row['case']}: {kern:.3f} of {row['device_ms']:.3f} ms" in r.stdout


def test_perf_subgroup_checks_every_operation_against_numpy(device, monkeypatch):
    """perf subgroup: each operation's per-lane results equal the numpy simulation (the check can
    fail: one mode's result is not another's), and every mode reports a time."""
    from perf import subgroup_ops
    for k in list(os.environ):
        if k.startswith("VKATTN_PERF_"):
            monkeypatch.delenv(k)
    monkeypatch.setattr(subgroup_ops, "ITERS", 64)
    rows = subgroup_ops.run(Shape.from_env(), device)
    if device.subgroup_size < 4:
        assert rows == []
        return
    assert [r.case.split(": ")[1].rsplit(" x", 1)[0] for r in rows] == list(subgroup_ops.MODES)
    assert all(r.verified for r in rows) and all(r.value > 0 for r in rows)
    wg = device.subgroup_size
    assert not np.array_equal(subgroup_ops.simulate(1, wg, 64), subgroup_ops.simulate(2, wg, 64))
    assert not np.array_equal(subgroup_ops.simulate(3, wg, 64), subgroup_ops.simulate(5, wg, 64))


def test_peak_probe_matches_numpy(monkeypatch, device):
    """perf peak's multiply-add shader sums what its numpy model sums (so its GFLOP/s time real
    work), for one and three chains, each row timed beside the CPU matmuls."""
    from perf import peak
    monkeypatch.setattr(peak, "ITERS", 64)
    monkeypatch.setattr(peak, "GROUPS", 4)
    monkeypatch.setattr(peak, "ROUNDS", 1)
    monkeypatch.setattr(peak, "MATMULS", {"qkv": (64, 96)})
    monkeypatch.setenv("VKATTN_PERF_ITERS", "2")
    monkeypatch.setenv("VKATTN_PERF_CASE", "peak multiply-add, ")
    rows = peak.run(Shape.from_env(), device)
    assert [r.extra["chains"] for r in rows] == [1, 2, 3, 4, 6]
    assert all(r.verified and r.value > 0 and r.extra["numpy qkv GFLOP/s"] > 0 for r in rows)
    b = np.arange(12, dtype=np.float32).reshape(3, 4)
    wg = device.lane_subgroup() or device.subgroup_size
    assert rows[0].shape.startswith(f"4 x {wg} invocations")
    assert not np.array_equal(peak._expected(np.full((3, 4), 0.5, np.float32), b, 4 * wg, 3),
                              peak._expected(np.full((3, 4), 0.5, np.float32), b + 1, 4 * wg, 3))


def test_a_shape_past_the_device_limits_is_a_setting_error(monkeypatch, tmp_path, capsys):
    """VKATTN_PERF_BLOCK_SIZE past what the device can hold: exit 2 naming the limit (it was a
    DeviceLimitError traceback, exit 1: the code of a failed check)."""
    from perf.__main__ import main
    monkeypatch.setenv("VKATTN_PERF_OUT", str(tmp_path))
    monkeypatch.setenv("VKATTN_PERF_BLOCK_SIZE", "100000000")
    monkeypatch.setenv("VKATTN_PERF_BATCH", "2")
    assert main(["batch"]) == 2
    assert "past this device's limits" in capsys.readouterr().err
