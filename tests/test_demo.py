"""The README's main job (`make demo`) at a small shape: it runs and verifies everything it prints."""
from vkattn.__main__ import main


def test_demo_runs_and_verifies(monkeypatch, capsys):
    for name, value in dict(HEADS=4, KV_HEADS=2, HEAD_DIM=16, PROMPT=40, STEPS=3, CAPACITY=64).items():
        monkeypatch.setenv(f"VKATTN_DEMO_{name}", str(value))
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "verified : 4/4 results" in out
    assert "80 sequence results verified" in out
    import logging
    assert not logging.getLogger("vkattn").handlers      # main() leaves logging as it found it


def test_first_build_is_announced_once(monkeypatch, tmp_path, caplog):
    """A pipeline new to this device and driver is named once at INFO (lavapipe compiles it on its
    first dispatch, seconds for the big kernels); building it again says nothing."""
    import logging

    import numpy as np

    import vkattn
    from vkattn import compiler

    monkeypatch.setenv("VKATTN_CACHE_DIR", str(tmp_path))    # a machine that has seen nothing
    monkeypatch.setattr(compiler, "_seen", {})
    caplog.set_level(logging.INFO, logger="vkattn")
    rng = np.random.default_rng(0)
    q = rng.standard_normal((4, 1, 16), dtype=np.float32)
    k = rng.standard_normal((2, 3, 16), dtype=np.float32)
    for _ in range(2):
        with vkattn.KVCache(11, 2, 16, dtype="float32") as cache:
            cache.append(k, k)
            cache.attend(q)
    lines = [r.getMessage() for r in caplog.records if "for the first time" in r.getMessage()]
    names = [line.split()[3] for line in lines]
    assert "append" in names and any(n.startswith("attn") for n in names), lines
    assert len(names) == len(set(lines)), lines        # each pipeline once, not per cache
    assert all("the driver caches it afterwards" in line for line in lines)
    registry = list(tmp_path.glob("pipelines-*.txt"))
    assert len(registry) == 1 and len(registry[0].read_text().splitlines()) == len(lines)


def test_demo_cli_logs_first_builds(tmp_path):
    """python -m vkattn shows the first-build line even though importing kp configures the root
    logger (logging.basicConfig alone would print nothing)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, VKATTN_CACHE_DIR=str(tmp_path), VKATTN_DEMO_HEADS="2", VKATTN_DEMO_KV_HEADS="1",
               VKATTN_DEMO_HEAD_DIM="8", VKATTN_DEMO_PROMPT="9", VKATTN_DEMO_STEPS="2", VKATTN_DEMO_CAPACITY="16")
    run = subprocess.run([sys.executable, "-m", "vkattn", "demo"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    assert "pipeline (spec" in run.stderr and "for the first time" in run.stderr, run.stderr


def test_the_command_line_reads_its_arguments(monkeypatch, capsys):
    """--help describes (exit 0) and runs nothing; an unknown command or argument exits 2 naming
    it (demo and devices ignored their arguments: `demo --help` ran the demo); a bad
    VKATTN_DEMO_DTYPE stops with the variable's name, not a traceback from inside."""
    import pytest
    import vkattn.__main__ as cli
    monkeypatch.setattr(cli, "demo", lambda: pytest.fail("the demo ran"))
    monkeypatch.setattr(cli, "devices", lambda: pytest.fail("devices ran"))
    assert main(["--help"]) == 0
    assert "usage: python -m vkattn [demo|check|generate|devices]" in capsys.readouterr().out
    assert main(["demo", "--help"]) == 0
    assert "VKATTN_DEMO_HEADS" in capsys.readouterr().out
    assert main(["devices", "--help"]) == 0
    assert main(["devices", "--x"]) == 2 and "unrecognized arguments: --x" in capsys.readouterr().err
    assert main(["demo", "extra"]) == 2
    assert main(["bogus"]) == 2 and "unknown command 'bogus'" in capsys.readouterr().err
    monkeypatch.undo()
    monkeypatch.setenv("VKATTN_DEMO_DTYPE", "bogus")
    with pytest.raises(SystemExit, match="VKATTN_DEMO_DTYPE='bogus': expected one of float32"):
        cli.demo()
