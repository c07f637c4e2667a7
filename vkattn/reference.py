"""CPU numpy reference: the definition every device result is checked against."""
from __future__ import annotations

import numpy as np


def attention(q, k, v, causal: bool = True, scale: float | None = None) -> np.ndarray:
    """Scaled dot-product attention over a whole cache, in float32.

    q: (num_qo_heads, s, head_dim); k: (num_kv_heads, L, head_dim); v: (num_kv_heads, L, v_head_dim)
    with num_qo_heads a multiple of num_kv_heads (q head i reads kv head i // group) and s <= L.
    Query row r sits at position L - s + r; with ``causal`` it sees keys 0 .. L - s + r.
    ``scale`` defaults to 1/sqrt(head_dim). A row that sees no key gives zeros.
    Returns (num_qo_heads, s, v_head_dim) float32.
    """
    q = np.asarray(q, dtype=np.float32)
    k = np.asarray(k, dtype=np.float32)
    v = np.asarray(v, dtype=np.float32)
    hq, s, d = q.shape
    hkv, n, _ = k.shape
    if scale is None:
        scale = 1.0 / np.sqrt(d)
    group = hq // hkv
    kk = np.repeat(k, group, axis=0)
    vv = np.repeat(v, group, axis=0)
    logits = np.matmul(q, kk.transpose(0, 2, 1)) * np.float32(scale)
    if causal:
        rows = np.arange(s)[:, None] + (n - s)
        logits = np.where(np.arange(n)[None, :] <= rows, logits, -np.inf)
    m = logits.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(logits - m)
    denom = p.sum(axis=-1, keepdims=True)
    out = np.matmul(p, vv) / np.where(denom > 0, denom, 1.0)
    return out.astype(np.float32)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """x as the cache stores it (float16 rounding for a float16 cache), as float32."""
    x = np.asarray(x, dtype=np.float32)
    return x.astype(np.float16).astype(np.float32) if dtype == "float16" else x


# Parity tolerances (|got - ref| <= atol + rtol * |ref|) for device results against ``attention``
# on the values the cache holds. K/V are compared after storage rounding, so both dtypes differ
# only by accumulation order and exp2 vs exp.
TOLERANCE = {"float32": (2e-5, 2e-4), "float16": (2e-5, 2e-4)}
