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
    # GQA without copying K/V: the group's query heads become extra rows of one matmul per kv head
    qg = q.reshape(hkv, group * s, d) * np.float32(scale)
    logits = np.matmul(qg, k.transpose(0, 2, 1)).reshape(hkv, group, s, n)
    if causal and s > 1:   # with one row every key is visible
        visible = np.arange(n)[None, :] <= np.arange(s)[:, None] + (n - s)
        logits = np.where(visible, logits, -np.inf)
    m = logits.max(axis=-1, keepdims=True)
    p = np.exp(logits - np.where(np.isfinite(m), m, 0.0))
    denom = p.sum(axis=-1, keepdims=True)
    p /= np.where(denom > 0, denom, 1.0)
    out = np.matmul(p.reshape(hkv, group * s, n), v)
    return out.reshape(hq, s, v.shape[2]).astype(np.float32, copy=False)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """x as the cache stores it (float16 rounding for a float16 cache), as float32."""
    x = np.asarray(x, dtype=np.float32)
    return x.astype(np.float16).astype(np.float32) if dtype == "float16" else x


# Parity tolerances (|got - ref| <= atol + rtol * |ref|) for device results against ``attention``
# on the values the cache holds. K/V are compared after storage rounding, so both dtypes differ
# only by accumulation order and exp2 vs exp.
TOLERANCE = {"float32": (2e-5, 2e-4), "float16": (2e-5, 2e-4)}
