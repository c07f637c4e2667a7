"""``python -m perf q4study``: which 4-bit K/V layout a real model can live with, before any shader
is written (issue 32 item 3: q4 missed its 5% perplexity target). Candidate layouts are simulated
on the host -- each K (after RoPE) and V row rounded by a numpy function, then torch's SDPA on the
rounded values (perf.quality.host_logits) -- over the same fixed text and model as ``python -m perf
quality`` (SmolLM2-135M-Instruct, float32 weights, `make model`). For each candidate: perplexity
and mean KL(exact || candidate) with K and V rounded, with K only and with V only; the reference is
the same host path on exact K/V. These are studies, not stored formats; the row "q4 (vkattn)" is
vkattn's stored q4 itself (``vkattn.reference.round_to``: asymmetric since session 20), and
"sym32" the symmetric q4 it replaced.

Candidates (blocks of B values along head_dim, per kv head and position; "bytes" per 32 values):
  q4 (vkattn) vkattn's q4: (0..15 - z) times a 12-bit block scale (max - min) / 15 rounded up, z
             a 13-bit integer zero point, blocks of 16 (16 + 8 bytes)
  q4/32      the same definition over blocks of 32 (16 + 4 bytes)
  sym32      the first q4: -7..7 times a float32 block scale amax / 7 (16 + 4 bytes)
  sym16      the same over blocks of 16 (16 + 8 bytes)
  asym32     0..15 times a float16 scale (max - min) / 15, plus a float16 block minimum (Q4_1's
             idea; 16 + 4 bytes: the same row size as q4)
  zp32       (0..15 - z) times a float32 scale, z in 0..15: the range widened to include 0
  had64+...  the row rotated by the orthonormal 64-point Hadamard matrix before rounding and back
             after (scores are unchanged by rotating q and k alike; spreads K's outlier channels
             over the block), then q4 / asym32; had16+q4 the same per 16-value block (q4's own)
  int8       vkattn's int8 (per row), for scale
  fp8_e5m2, fp8_e4m3, had64+fp8_e5m2, had64+fp8_e4m3
             vkattn's fp8 formats (scale 1), plain and rotated: whether a rotation would bring
             e5m2 (2 mantissa bits) within the 1% target (session 29: it narrows the KL, not enough)

Environment: VKATTN_PERF_QUALITY_TOKENS (the first N tokens of the text), VKATTN_PERF_Q4_STUDY
(comma list of candidates; default all). Prints a markdown table; exits 2 without the model.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

from vkattn.reference import dequantize_q4, quantize_q4, round_to

from .common import PerfConfigError, env_int


def _blocks(x, b):
    """(h, n, d) -> ((h, n, nb, b) zero-padded, d)."""
    h, n, d = x.shape
    xp = np.zeros((h, n, -(-d // b) * b), np.float32)
    xp[..., :d] = x
    return xp.reshape(h, n, -1, b), d


def sym(x, b: int = 32, levels: int = 7):
    blocks, d = _blocks(np.asarray(x, np.float32), b)
    scale = np.abs(blocks).max(-1, keepdims=True) / np.float32(levels)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.rint(blocks / safe), -levels, levels)
    return (q * scale).reshape(x.shape[:2] + (-1,))[..., :d]


def asym(x, b: int = 32):
    blocks, d = _blocks(np.asarray(x, np.float32), b)
    lo = blocks.min(-1, keepdims=True).astype(np.float16).astype(np.float32)
    scale = ((blocks.max(-1, keepdims=True) - lo) / np.float32(15)).astype(np.float16).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.rint((blocks - lo) / safe), 0, 15)
    return (q * scale + lo).reshape(x.shape[:2] + (-1,))[..., :d]


def zp(x, b: int = 32):
    """0..15 minus an integer zero point z, times a float32 scale: the range [min(x, 0), max(x, 0)]
    in 15 steps, z = rint(-min / scale) (so 0 is a level and the extremes are within half a step)."""
    blocks, d = _blocks(np.asarray(x, np.float32), b)
    lo = np.minimum(blocks.min(-1, keepdims=True), 0)
    scale = (np.maximum(blocks.max(-1, keepdims=True), 0) - lo) / np.float32(15)
    safe = np.where(scale > 0, scale, np.float32(1))
    z = np.clip(np.rint(-lo / safe), 0, 15)
    q = np.clip(np.rint(blocks / safe) + z, 0, 15)
    return ((q - z) * scale).reshape(x.shape[:2] + (-1,))[..., :d]


def hadamard(n: int):
    """The orthonormal n-point Hadamard matrix (n a power of 2), float32."""
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def rotated(fn, n: int = 64):
    """fn applied to each row rotated by hadamard(n) (per n-value group), rotated back after."""
    hm = hadamard(n)

    def g(x):
        h, t, d = x.shape
        if d % n:
            raise ValueError(f"head_dim {d} is not a multiple of {n}")
        xr = (x.reshape(h, t, d // n, n) @ hm.T).reshape(h, t, d)
        return (fn(xr).reshape(h, t, d // n, n) @ hm).reshape(h, t, d)
    return g


def q4(x):
    """vkattn's stored q4 (vkattn.reference.round_to), defined exactly."""
    return round_to(x, "q4")


def q4_32(x):
    """vkattn's q4 definition over blocks of 32 (its first asymmetric layout)."""
    return dequantize_q4(*quantize_q4(x, 32), 32)


def candidates():
    return {
        "q4 (vkattn)": q4,
        "q4/32": q4_32,
        "sym32": sym,
        "sym16": lambda x: sym(x, 16),
        "asym32": asym,
        "zp32": zp,
        "had64+q4": rotated(q4),
        "had16+q4": rotated(q4, 16),
        "had64+asym32": rotated(asym),
        "int8": lambda x: round_to(x, "int8"),
        "fp8_e5m2": lambda x: round_to(x, "fp8_e5m2"),
        "had64+fp8_e5m2": rotated(lambda x: round_to(x, "fp8_e5m2")),
        "fp8_e4m3": lambda x: round_to(x, "fp8_e4m3"),
        "had64+fp8_e4m3": rotated(lambda x: round_to(x, "fp8_e4m3")),
    }


def main(argv=None) -> int:
    if argv:
        print(f"perf q4study takes no arguments (settings come from VKATTN_PERF_*), got {argv}", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cands = candidates()
    try:
        tokens = env_int("VKATTN_PERF_QUALITY_TOKENS", None, minimum=2)
        names = [n.strip() for n in os.environ.get("VKATTN_PERF_Q4_STUDY", "").split(",") if n.strip()] or list(cands)
        bad = [n for n in names if n not in cands]
        if bad:
            raise PerfConfigError(f"VKATTN_PERF_Q4_STUDY: unknown candidate(s) {bad}; choose from {list(cands)}")
    except PerfConfigError as e:
        print(f"perf q4study: {e}", file=sys.stderr)
        return 2
    from . import quality
    try:
        model, tok = quality.load_model()
    except RuntimeError as e:
        print(f"perf q4study: {e}; make model installs it", file=sys.stderr)
        return 2
    import torch

    from .model import cpu_name
    ids = quality.text_ids(tok, tokens)
    base = quality.host_logits(model, ids)
    ppl0 = quality.perplexity(base, ids)
    cfg = model.config
    print(f"SmolLM2-135M-Instruct (float32 weights), {quality.TEXT.name}: {int(ids.shape[0])} tokens; head_dim "
          f"{getattr(cfg, 'head_dim', cfg.hidden_size // cfg.num_attention_heads)}, {cfg.num_key_value_heads} kv heads; "
          f"CPU: {cpu_name()}; torch {torch.__version__}")
    print(f"exact K/V (host SDPA): perplexity {ppl0:.4f}\n")
    print("| candidate | K and V: ppl ratio | mean KL | K only: ppl ratio | mean KL | V only: ppl ratio | mean KL |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    t0 = time.perf_counter()
    for name in names:
        fn = cands[name]
        cells = []
        for k_fn, v_fn in ((fn, fn), (fn, None), (None, fn)):
            lg = quality.host_logits(model, ids, k_fn, v_fn)
            cells.append(f"{quality.perplexity(lg, ids) / ppl0:.5f} | {float(quality.kl_rows(base, lg).mean()):.4f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
