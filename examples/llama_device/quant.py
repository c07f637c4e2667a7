"""Block-quantised weights for linear.comp / embed.comp (W_Q4_1, W_Q8_0): the two formats of the
GGUF the example loads, in a 16-byte-aligned layout of our own. Blocks of 32 consecutive weights
of a row (K a multiple of 32); a row holds its blocks' code words first, then one parameter word
per block, then zero words up to a multiple of 4 (``row_words``):

- q4_1: 4 code words a block, word i holding weights 8i .. 8i+7, weight 8i+e in bits 4e..4e+3;
  parameter word = float16 d (low half) | float16 m (high half). Weight = d * code + m (float32,
  as the gguf package dequantises).
- q8_0: 8 code words a block, word i holding weights 4i .. 4i+3, weight 4i+e in byte e;
  parameter word = float16 d (low half, high half 0). Weight = d * code.

So a block's codes are one (q4_1) or two (q8_0) 16-byte texels and its parameter one component
of a texel that 4 blocks share: a CPU driver's texel fetch costs the same for one word as for
four (llvmpipe: a call, a load per lane and a transpose), and a q4_1 block reads in 2 fetches
(5 with the 5-word blocks before session 32). ``interleave`` reorders rows of any format for
the CPU decode's lanes (weights.glsl W_LANES).

From GGUF's own blocks (``from_gguf``: its q4_1 byte j holds weight j in the low nibble and weight
j+16 in the high one) the device holds exactly the weights the gguf package dequantises; from
float32 weights (``quantize``) they are rounded to the format first (round-to-nearest codes)."""
from __future__ import annotations

import numpy as np

BLOCK = 32
DATA = {"q4_1": 4, "q8_0": 8}      # code words a block
FORMATS = tuple(DATA)


def row_words(kind, cols):
    """Words of one row of ``cols`` weights: the code words, a parameter word per block, the
    padding to a multiple of 4."""
    nb = cols // BLOCK
    return nb * DATA[kind] + -(-nb // 4) * 4


def _f16_word(lo, hi=None):
    lo = np.asarray(lo, np.float16).view(np.uint16).astype(np.uint32)
    hi = np.zeros_like(lo) if hi is None else np.asarray(hi, np.float16).view(np.uint16).astype(np.uint32)
    return lo | (hi << 16)


def _pack(kind, d, m, codes):
    """codes (rows, nb, 32) ints -> words (rows, row_words(kind, nb * 32)) uint32."""
    rows, nb, _ = codes.shape
    if kind == "q4_1":
        nib = codes.astype(np.uint32).reshape(rows, nb, 4, 8) << (4 * np.arange(8, dtype=np.uint32))
        body = np.bitwise_or.reduce(nib, axis=-1)                     # (rows, nb, 4)
        head = _f16_word(d, m)
    else:
        byt = (codes.astype(np.int32) & 0xFF).astype(np.uint32).reshape(rows, nb, 8, 4) << (8 * np.arange(4, dtype=np.uint32))
        body = np.bitwise_or.reduce(byt, axis=-1)                     # (rows, nb, 8)
        head = _f16_word(d)
    pad = np.zeros((rows, row_words(kind, nb * BLOCK) - nb * (DATA[kind] + 1)), np.uint32)
    return np.concatenate([body.reshape(rows, -1), head.reshape(rows, nb), pad], axis=-1)


def dequantize(kind, words, cols):
    """The float32 weights (rows, cols) the device computes with: numpy of the shaders' dequant."""
    rows = words.shape[0]
    nb, dw = cols // BLOCK, DATA[kind]
    words = words.reshape(rows, row_words(kind, cols))
    body, head = words[:, :nb * dw].reshape(rows, nb, dw), words[:, nb * dw:nb * (dw + 1)]
    d = (head & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32)[..., None]
    if kind == "q4_1":
        m = (head >> 16).astype(np.uint16).view(np.float16).astype(np.float32)[..., None]
        codes = (body[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
        return ((d * codes.reshape(rows, nb, 32).astype(np.float32)) + m).reshape(rows, cols)
    codes = ((body[..., None] >> (8 * np.arange(4, dtype=np.uint32))) & 0xFF).astype(np.uint8).view(np.int8)
    return (codes.reshape(rows, nb, 32).astype(np.float32) * d).reshape(rows, cols)


def quantize(kind, w):
    """float32 (rows, cols) -> words, round-to-nearest codes (q4_1: d = (max - min) / 15, m = min;
    q8_0: d = max|w| / 127), d and m rounded to float16."""
    w = np.asarray(w, np.float32)
    rows, cols = w.shape
    if cols % BLOCK:
        raise ValueError(f"{kind}: the row length {cols} is not a multiple of {BLOCK}")
    b = w.reshape(rows, cols // BLOCK, BLOCK)
    if kind == "q4_1":
        lo, hi = b.min(-1), b.max(-1)
        d = ((hi - lo) / 15).astype(np.float16)
        m = lo.astype(np.float16)
        df = d.astype(np.float32)[..., None]
        codes = np.clip(np.rint((b - m.astype(np.float32)[..., None]) / np.where(df == 0, 1, df)), 0, 15)
        return _pack(kind, d, m, codes)
    d = (np.abs(b).max(-1) / 127).astype(np.float16)
    df = d.astype(np.float32)[..., None]
    codes = np.clip(np.rint(b / np.where(df == 0, 1, df)), -127, 127)
    return _pack(kind, d, None, codes)


def from_gguf(kind, raw, cols):
    """GGUF's blocks (rows, nb * bytes per block) uint8 -> our words (rows, row_words(kind, cols))."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    rows, nb = raw.shape[0], cols // BLOCK
    if kind == "q4_1":
        r = raw.reshape(rows, nb, 20)
        d, m, qs = r[..., 0:2].copy().view(np.float16)[..., 0], r[..., 2:4].copy().view(np.float16)[..., 0], r[..., 4:]
        codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1)         # weights 0..15, then 16..31
        return _pack(kind, d, m, codes)
    r = raw.reshape(rows, nb, 34)
    d, codes = r[..., 0:2].copy().view(np.float16)[..., 0], r[..., 2:].view(np.int8)
    return _pack(kind, d, None, codes)


def interleave(words, texels: int, params: int, lanes: int, rpl: int):
    """Row-major words (rows, row's words) uint32 of any format -> the grouped order weights.glsl
    reads with W_LANES = lanes, W_RPL = rpl (flat uint32): rows padded with zero rows to a
    multiple of lanes * rpl; per group of lanes * rpl rows, each piece's ``texels`` 16-byte texels
    of every row in (row within a lane, lane) order, piece after piece, then the rows' ``params``
    parameter texels in the same order (block formats: a row's words are its pieces' codes, then
    its parameter texels)."""
    words = np.asarray(words, np.uint32)
    rows, per_row = words.shape
    g = lanes * rpl
    ng = -(-rows // g)
    pieces = (per_row // 4 - params) // texels
    w = np.zeros((ng * g, per_row), np.uint32)
    w[:rows] = words
    parts = [w[:, :pieces * texels * 4].reshape(ng, lanes, rpl, pieces, texels * 4).transpose(0, 3, 2, 1, 4)]
    if params:
        parts.append(w[:, pieces * texels * 4:].reshape(ng, lanes, rpl, params, 4).transpose(0, 3, 2, 1, 4))
    return np.concatenate([p.reshape(ng, -1) for p in parts], axis=1).reshape(-1)
