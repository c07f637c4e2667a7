"""PNG plot of decode latency vs context length (vkattn at two capacities and the forward decode
step, numpy, torch)."""
from __future__ import annotations

from pathlib import Path


def plot_decode(rows: list, path: Path, device_name: str):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install '.[bench]')")
        return None
    dec = [r for r in rows if r.kernel == "decode"]
    if not dec:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    caps = sorted({r.extra["capacity"] // r.extra["L"] for r in dec})
    for mult in caps:
        pts = sorted((r.extra["L"], r.vkattn_ms) for r in dec if r.extra["capacity"] // r.extra["L"] == mult)
        label = "vkattn (capacity = L)" if mult == 1 else f"vkattn (capacity = {mult} x L)"
        ax.plot(*zip(*pts), marker="o", label=label)
    base = [r for r in dec if r.extra["capacity"] == r.extra["L"]] or dec
    ax.plot(*zip(*sorted((r.extra["L"], r.numpy_ms) for r in base)), marker="s", ls="--", label="numpy reference")
    step = sorted((r.extra["L"], r.vkattn_ms) for r in rows if r.kernel == "decode step")
    if step:
        ax.plot(*zip(*step), marker="x", label="vkattn decode step (forward: store 1 token + attend)")
    if all(r.torch_ms is not None for r in base):
        ax.plot(*zip(*sorted((r.extra["L"], r.torch_ms) for r in base)), marker="^", ls=":", label="torch CPU SDPA")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length L (tokens)")
    ax.set_ylabel("decode latency per call (ms, median)")
    ax.set_title(f"decode, {dec[0].shape}\n{device_name}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
