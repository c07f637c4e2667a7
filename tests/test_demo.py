"""The README's main job (`make demo`) at a small shape: it runs and verifies everything it prints."""
from vkattn.__main__ import main


def test_demo_runs_and_verifies(monkeypatch, capsys):
    for name, value in dict(HEADS=4, KV_HEADS=2, HEAD_DIM=16, PROMPT=40, STEPS=3, CAPACITY=64).items():
        monkeypatch.setenv(f"VKATTN_DEMO_{name}", str(value))
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "verified : 4/4 results" in out
    assert "80 sequence results verified" in out
