"""One checker for every array argument (and every 0/1 environment switch): typed errors that name it."""
from __future__ import annotations

import numbers
import os
import warnings

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
FP16_MAX = 65504.0


def check_array(name: str, x, shape: tuple, finite: bool = True, fp16_range: bool = False,
                max_abs: tuple | None = None, rotary: tuple | None = None) -> np.ndarray:
    """Validate ``x`` and return it as a C-contiguous float32 array.

    ``shape`` holds an int (that exact size) or ``None`` (any size >= 1) per axis. Raises TypeError for a non-numpy or non-float input, ValueError for a wrong
    rank, a wrong size, a non-finite value (if ``finite``) or, with ``fp16_range``, a value a
    float16 cache cannot hold; with ``max_abs`` = (limit, storage dtype name), a value above the
    limit in magnitude, which that cache would store as Inf (a cache's ``_max_abs``); with
    ``rotary`` = (rotary_dim, style) -- keys a cache's RoPE rotates before storing them -- a pair
    of values whose rotation can reach past that limit (float32's largest value where the
    format has none): a rotated value is as large as its pair's length, up to sqrt(2) times its
    larger value.
    """
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected dtype float32 or float16, got {x.dtype}")
    check_shape(name, x.shape, shape)
    x = np.ascontiguousarray(x, dtype=np.float32)
    limits = ([FP16_MAX] if fp16_range else []) + ([max_abs[0]] if max_abs is not None else [])
    if finite and plainly_finite(x, limit=min(limits) if limits else None):
        return x                        # shown by one dot product; the rest get the exact checks
    if finite and not np.isfinite(x).all():
        raise ValueError(f"{name}: contains NaN or Inf")
    if not x.size or not (fp16_range or max_abs is not None or rotary is not None):
        return x
    top = float(np.abs(x).max())
    if fp16_range and top > FP16_MAX:
        raise ValueError(f"{name}: values exceed the float16 range (|x| > {FP16_MAX}) of this float16 cache")
    if max_abs is not None and top > max_abs[0]:
        limit, dtype = max_abs
        raise ValueError(f"{name}: values exceed the {dtype} range (|x| > {limit:.8g}) of this {dtype} cache")
    if rotary is not None:
        limits = [max_abs or (FLT_MAX, "float32")] + ([(FP16_MAX, "float16")] if fp16_range else [])
        check_rotated(name, x, top, rotary, *min(limits))       # (limit, dtype): the smaller limit
    return x


FLT_MAX = float(np.finfo(np.float32).max)


def check_rotated(name: str, x: np.ndarray, top: float, rotary: tuple, limit: float, dtype: str) -> None:
    """check_array's test of keys a RoPE rotates (``top``: their largest |value|): every rotated
    pair's length (float64) at most the storage's limit, less 2**-20 of it (the float32
    rotation's rounding: cos and sin rounded, two products and a sum, within 2**-22 of the
    length); no pair is measured where ``top`` times sqrt(2) is within that. Only reached where
    plainly_finite did not pass the array (then every value is below 1.9e19, and so is every
    rotated one). ``limit``: the largest |value| the storage (``dtype``) takes."""
    bound = limit * (1 - 2.0 ** -20)
    if top * 1.4142136 <= bound:        # (sqrt(2) rounded up)
        return
    rd, style = rotary
    h = rd // 2
    y = x.astype(np.float64)
    a, b = (y[..., :h], y[..., h:rd]) if style == "neox" else (y[..., 0:rd:2], y[..., 1:rd:2])
    top = float(np.hypot(a, b).max())
    if top > bound:
        raise ValueError(f"{name}: the cache's rope rotates pairs of values; a pair of length {top:.8g} can reach "
                         f"past the {dtype} range ({limit:.8g}) of this cache, which would store Inf")


# plainly_finite's dot overflowing to Inf is its signal, not a fault: numpy's warning for it is
# silenced for this module only (a filter costs nothing per call; np.errstate costs ~5 us a call)
warnings.filterwarnings("ignore", message="overflow encountered in v?dot", category=RuntimeWarning,
                        module=r"vkattn\.checks$")


def plainly_finite(x: np.ndarray, fp16_range: bool = False, limit: float | None = None) -> bool:
    """A one-pass sufficient test (one BLAS dot; no temporary array where x is C-contiguous) that a
    float32 array is finite and, with ``fp16_range`` or a ``limit``, every |value| within float16's
    range or that limit: its sum of squares is finite (NaN and Inf propagate; so does an overflow
    of huge finite values) and at most limit^2 * 0.99 (each square is at most the sum, and the
    sum of non-negative terms rounds no lower than its largest; 1% covers the square's own
    rounding). False means "not shown": the exact checks of check_array decide then."""
    if fp16_range:
        limit = FP16_MAX if limit is None else min(limit, FP16_MAX)
    ssq = float(np.vdot(x, x))        # flattens a C-contiguous array in place (others: a copy)
    return ssq < float("inf") if limit is None else ssq <= limit * limit * 0.99


def env_flag(name: str, default: bool) -> bool:
    """A 0/1 variable (surrounding blanks ignored), ``default`` where unset or empty; ValueError
    naming it for anything else (every VKATTN_* switch is read through here: "false", "off" or
    "no" turned some on before)."""
    env = os.environ.get(name, "").strip()
    if env not in ("", "0", "1"):
        raise ValueError(f"{name}={env!r}: expected 0 or 1")
    return default if env == "" else env == "1"


def check_shape(name: str, got: tuple, shape: tuple) -> None:
    """ValueError unless ``got`` has the dims of ``shape`` (an int: that size; None: any >= 1)."""
    if len(got) != len(shape):
        raise ValueError(f"{name}: expected {len(shape)} dims {_fmt(shape)}, got shape {got}")
    for i, (want, n) in enumerate(zip(shape, got)):
        if (want is None and n < 1) or (want is not None and n != want):
            raise ValueError(f"{name}: expected shape {_fmt(shape)}, got {got} (axis {i})")


def check_int(name: str, value, low: int, high: int | None = None) -> int:
    if type(value) is int and value >= low and (high is None or value <= high):
        return value                    # the common case, without the ABC checks below
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    value = int(value)
    if value < low or (high is not None and value > high):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name}: expected an int {rng}, got {value}")
    return value


def check_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return bool(value)


# the largest scale the kernels take: they multiply scores by scale * log2(e), a float32
SCALE_MAX = float(np.finfo(np.float32).max) / 1.4426950408889634


def check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / float(np.sqrt(head_dim))
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")
    scale = float(scale)
    if not np.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a finite float > 0, got {scale}")
    if scale > SCALE_MAX:
        raise ValueError(f"scale: expected at most {SCALE_MAX:.6g} (the kernels multiply scores by scale * "
                         f"log2(e), a float32), got {scale:g}")
    return scale


def _fmt(shape) -> str:
    return "(" + ", ".join("n" if s is None else str(s) for s in shape) + ")"
