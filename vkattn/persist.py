"""Save and load cache contents: a safetensors file per KVCache, PagedKVCache sequence or
vkattn.hf.VkattnCache, holding the rows exactly as the device stores them.

Entry points: :meth:`vkattn.KVCache.save` / :meth:`~vkattn.KVCache.load`,
:meth:`vkattn.PagedKVCache.save_sequence` / :meth:`~vkattn.PagedKVCache.load_sequence`,
:meth:`vkattn.hf.VkattnCache.save` / :meth:`~vkattn.hf.VkattnCache.load`, and
:func:`file_info` (``vkattn.cache_file_info``) to look at a file without a cache.

A sequence file (format ``vkattn.sequence``, version 1) of ``length`` positions holds

    k          (num_kv_heads, length, head_dim)    in the storage dtype: float16, float32 or int8;
                                                   bfloat16 as its bits, uint16 (numpy has no bfloat16)
    v          (num_kv_heads, length, v_head_dim)  likewise
    k_scale    (num_kv_heads, length) float32      int8 only: the scale of each stored K row
    v_scale    (num_kv_heads, length) float32      int8 only
                                                   (fp8_e4m3 / fp8_e5m2: k and v as their bits,
                                                   uint8; the per-kv-head scales in the metadata)
                                                   (q4: k (num_kv_heads, length, 4 * row words) and
                                                   v likewise, uint32: the stored row words, data
                                                   words then the block scales, common.glsl)
    token_ids  (length,) int64                     optional: the token at each position

K as the cache holds it -- rotated when the cache has a ``rope``, quantised for int8 -- so a load
writes the same bits back (scatter_slots.comp), with no rotation or quantisation on the way, and
the round trip is bit-exact. String metadata: ``format``, ``format_version``, ``dtype``,
``num_kv_heads``, ``head_dim``, ``v_head_dim``, ``rope`` (JSON: style, base, rotary_dim; or
``none``), for fp8 ``k_scale`` and ``v_scale`` (JSON lists of the num_kv_heads float32 scales,
exact: a load needs the cache's own, as the stored bytes mean byte * scale), for q4
``q4_layout`` (``Q4_LAYOUT``: a file of the earlier symmetric q4 blocks lacks it and is refused
with CacheFileMismatchError), ``length``, ``source`` (KVCache / PagedKVCache), ``block_size`` (a paged source's;
informational: positions load into any block size or a KVCache), ``vkattn_version`` and
``checksum``: ``sha256:`` over every other metadata entry and every tensor's name, dtype, shape
and bytes, so a damaged byte anywhere is found before anything is written.

A VkattnCache file (format ``vkattn.hf_cache``) holds the same tensors for row ``b`` of layer
``i`` under ``layers.{i}.rows.{b}.`` (``layers.0.rows.1.k``, ...), its metadata the layers'
positions, padding and windows (``layers``, JSON), and optional ``token_ids`` (batch, positions).

Loading checks everything -- the file readable and intact, its settings those of the cache, its
length within the capacity or the free blocks -- before it writes anything: on any error the
cache is unchanged.
"""
from __future__ import annotations

import hashlib
import json
import os
import uuid

import numpy as np

from ._attn import Pipeline, destroy, grid_groups
from ._base import READ_ROWS, slot_buffers, slot_rows
from .compiler import compile_shader
from .errors import CacheFileCorruptError, CacheFileMismatchError
from .formats import FORMATS
from .tuning import WORKGROUP
from ._version import __version__

FORMAT_VERSION = 1
Q4_LAYOUT = "asym16-zp13"   # q4 blocks: 0 .. 15, a 12-bit scale and a 13-bit zero point per 16 values
SEQUENCE = "vkattn.sequence"
HF_CACHE = "vkattn.hf_cache"
# per storage dtype: the file tensors' dtype (bfloat16, which numpy lacks: its bits as uint16) and a
# same-size integer view of one element (vkattn.formats)
_DTYPE = {name: f.file_dtype for name, f in FORMATS.items()}
_BITS = {name: f.bits for name, f in FORMATS.items()}
_INT64_MAX = np.iinfo(np.int64).max

__all__ = ["file_info", "FORMAT_VERSION", "SEQUENCE", "HF_CACHE"]


# ---------------------------------------------------------------------- the container

def _safetensors():
    try:
        import safetensors
        import safetensors.numpy
    except ImportError as e:
        raise ImportError(f"saving and loading vkattn caches needs the safetensors package ({e}): "
                          f"pip install safetensors (scripts/setup.sh and scripts/install.sh install it)") from e
    return safetensors


def check_path(path) -> str:
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(f"path: expected a str or os.PathLike file name, got {type(path).__name__}")
    return path


def checksum(meta: dict, tensors: dict) -> str:
    """``sha256:<hex>`` over the metadata (all entries but ``checksum``) and every tensor's name,
    dtype, shape and little-endian bytes, in name order."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted((k, v) for k, v in meta.items() if k != "checksum")).encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(json.dumps([name, t.dtype.name, list(t.shape)]).encode())
        h.update(np.ascontiguousarray(t, dtype=t.dtype.newbyteorder("<")).tobytes())
    return "sha256:" + h.hexdigest()


def write_file(path: str, kind: str, meta: dict, tensors: dict) -> None:
    """Serialise with safetensors and replace ``path`` atomically (a temporary file beside it,
    then a rename): a reader never sees a half-written file."""
    st = _safetensors()
    meta = {k: str(v) for k, v in dict(meta, format=kind, format_version=FORMAT_VERSION,
                                       vkattn_version=__version__).items()}
    meta["checksum"] = checksum(meta, tensors)
    data = st.numpy.save(tensors, metadata=meta)
    tmp = f"{path}.{uuid.uuid4().hex[:12]}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_file(path: str, kinds: tuple) -> tuple:
    """(metadata, tensors) of a vkattn file of one of ``kinds``, its format version and checksum
    verified. OSError (no such file...) as open() raises it; CacheFileCorruptError for a file
    safetensors cannot read or whose checksum fails; CacheFileMismatchError for another format
    or version."""
    st = _safetensors()
    try:
        with st.safe_open(path, framework="np") as f:
            meta = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except OSError:
        raise
    except Exception as e:        # whatever the parser refuses: SafetensorError, bad UTF-8, ...
        raise CacheFileCorruptError(f"{path}: not a readable safetensors file -- truncated or damaged "
                                    f"({type(e).__name__}: {e})") from e
    kind = meta.get("format")
    if kind is None:
        raise CacheFileCorruptError(f"{path}: no vkattn metadata (not written by a vkattn save, or its header "
                                    f"is damaged)")
    if kind not in kinds:
        raise CacheFileMismatchError(f"{path}: holds a {kind!r} file; expected {' or '.join(map(repr, kinds))}",
                                     "format")
    version = meta.get("format_version")
    if version != str(FORMAT_VERSION):
        raise CacheFileMismatchError(f"{path}: format version {version!r}; this vkattn reads version "
                                     f"{FORMAT_VERSION}", "format_version")
    want, got = meta.get("checksum"), checksum(meta, tensors)
    if want != got:
        raise CacheFileCorruptError(f"{path}: checksum mismatch: the file records {want!r}, its contents "
                                    f"hash to {got!r} (the file is damaged)")
    return meta, tensors


def meta_int(meta: dict, key: str, path: str, low: int = 0) -> int:
    """An integer metadata entry (the checksum passed, so a bad one means a foreign writer)."""
    try:
        value = int(meta[key])
    except (KeyError, ValueError):
        raise CacheFileCorruptError(f"{path}: metadata {key!r} missing or not an integer: "
                                    f"{meta.get(key)!r}") from None
    if value < low:
        raise CacheFileCorruptError(f"{path}: metadata {key!r} = {value}, expected >= {low}")
    return value


# ---------------------------------------------------------------------- settings

def rope_setting(c) -> str:
    """The rotary settings of cache ``c`` as the metadata records them."""
    if c.rope is None:
        return "none"
    return json.dumps({"style": c.rope.style, "base": float(c.rope.base), "rotary_dim": int(c._rope_dim)},
                      sort_keys=True)


def format_meta(c) -> dict:
    """What a load compares: storage dtype, head counts and dims, rotary settings."""
    meta = {"dtype": c.dtype, "num_kv_heads": str(c.num_kv_heads), "head_dim": str(c.head_dim),
            "v_head_dim": str(c.v_head_dim), "rope": rope_setting(c)}
    if c._fp8:      # float32 -> Python float is exact, and so is its repr
        meta["k_scale"] = json.dumps([float(x) for x in c._scales[0]])
        meta["v_scale"] = json.dumps([float(x) for x in c._scales[1]])
    if c._q4:       # the block layout (reference.quantize_q4); files of the earlier symmetric q4 lack it
        meta["q4_layout"] = Q4_LAYOUT
    return meta


def check_format(meta: dict, c, path: str) -> None:
    """CacheFileMismatchError naming the first setting in which file and cache differ."""
    for key, want in format_meta(c).items():
        got = meta.get(key)
        if got != want:
            raise CacheFileMismatchError(f"{path}: {key} is {got} in the file but {want} in this "
                                         f"{type(c).__name__}", key)


def check_token_ids(token_ids, shape: tuple):
    """``token_ids`` as a C-contiguous int64 array of ``shape`` (any integer array-like: a list,
    numpy, a CPU torch tensor), or None."""
    if token_ids is None:
        return None
    try:
        t = np.asarray(token_ids)
    except Exception as e:
        raise TypeError(f"token_ids: expected integers, got {type(token_ids).__name__} ({e})") from e
    if t.size and t.dtype.kind not in "iu":      # (an empty list is float64 to numpy: an empty sequence's ids)
        raise TypeError(f"token_ids: expected integers, got dtype {t.dtype}")
    if t.shape != tuple(shape):
        raise ValueError(f"token_ids: expected shape {tuple(shape)} (one id per stored position), got {t.shape}")
    if t.size and (int(t.min()) < 0 or int(t.max()) > _INT64_MAX):
        raise ValueError(f"token_ids: expected ids in [0, 2**63), got values in [{int(t.min())}, {int(t.max())}]")
    return np.ascontiguousarray(t, dtype=np.int64)


# ---------------------------------------------------------------------- rows <-> tensors

def stored_tensors(c, slots: np.ndarray, prefix: str = "") -> dict:
    """The rows of cache ``c`` at ``slots`` as file tensors, their bits as stored: ``k``
    (num_kv_heads, n, head_dim) and ``v`` (num_kv_heads, n, v_head_dim) in the storage dtype,
    int8 also ``k_scale``/``v_scale`` (num_kv_heads, n) float32; names prefixed with ``prefix``."""
    kw, vw, ks, vs = c._read_stored(np.asarray(slots, np.int64))
    bits, dt = _BITS[c.dtype], _DTYPE[c.dtype]
    dk, dv = (c._rk4 * 4, c._rv4 * 4) if c._q4 else (c.head_dim, c.v_head_dim)   # q4: the whole rows
    out = {prefix + "k": np.ascontiguousarray(kw.view(bits)[..., :dk].transpose(1, 0, 2)).view(dt),
           prefix + "v": np.ascontiguousarray(vw.view(bits)[..., :dv].transpose(1, 0, 2)).view(dt)}
    if c._i8:
        out[prefix + "k_scale"] = np.ascontiguousarray(ks.view(np.uint32).T).view(np.float32)
        out[prefix + "v_scale"] = np.ascontiguousarray(vs.view(np.uint32).T).view(np.float32)
    return out


def expected_tensors(c, n: int, prefix: str = "") -> dict:
    """{name: (dtype, shape)} of ``n`` positions of cache ``c``'s format."""
    hkv, dt = c.num_kv_heads, _DTYPE[c.dtype]
    dk, dv = (c._rk4 * 4, c._rv4 * 4) if c._q4 else (c.head_dim, c.v_head_dim)
    want = {prefix + "k": (dt, (hkv, n, dk)), prefix + "v": (dt, (hkv, n, dv))}
    if c._i8:
        want[prefix + "k_scale"] = (np.dtype(np.float32), (hkv, n))
        want[prefix + "v_scale"] = (np.dtype(np.float32), (hkv, n))
    return want


def check_tensors(tensors: dict, want: dict, path: str, optional: dict | None = None) -> None:
    """CacheFileCorruptError unless ``tensors`` holds exactly ``want`` (plus any of ``optional``),
    each with its dtype and shape."""
    optional = optional or {}
    for name, (dtype, shape) in {**want, **optional}.items():
        t = tensors.get(name)
        if t is None:
            if name in want:
                raise CacheFileCorruptError(f"{path}: tensor {name!r} is missing")
            continue
        if t.dtype != dtype or t.shape != tuple(shape):
            raise CacheFileCorruptError(f"{path}: tensor {name!r} is {t.dtype} {t.shape}; its metadata says "
                                        f"{np.dtype(dtype)} {tuple(shape)}")
    extra = sorted(set(tensors) - set(want) - set(optional))
    if extra:
        raise CacheFileCorruptError(f"{path}: unexpected tensors {extra[:4]}")


def write_stored(c, slots: np.ndarray, tensors: dict, prefix: str = "") -> None:
    """Write checked file tensors (``stored_tensors``' layout) into cache ``c`` at ``slots``
    (distinct), as bits: scatter_slots.comp, READ_ROWS positions per submission."""
    n, hkv = len(slots), c.num_kv_heads
    if not n:
        return
    bits = _BITS[c.dtype]
    kw = np.zeros((n, hkv, c._rk4 * 4), np.uint32)     # rows padded with zeros, as append leaves them
    vw = np.zeros((n, hkv, c._rv4 * 4), np.uint32)
    dk, dv = (c._rk4 * 4, c._rv4 * 4) if c._q4 else (c.head_dim, c.v_head_dim)
    kw.view(bits)[..., :dk] = tensors[prefix + "k"].view(bits).transpose(1, 0, 2)
    vw.view(bits)[..., :dv] = tensors[prefix + "v"].view(bits).transpose(1, 0, 2)
    ks = vs = None
    if c._i8:
        ks = np.ascontiguousarray(tensors[prefix + "k_scale"].view(np.uint32).T)
        vs = np.ascontiguousarray(tensors[prefix + "v_scale"].view(np.uint32).T)
    # a one-off plan sized for min(n, READ_ROWS) positions: loading a many-layer model holds one
    # upload buffer at a time, not one per layer
    plan, last = _ScatterPlan(c, min(n, READ_ROWS)), c._last_rec
    slots = np.asarray(slots, np.int64)
    try:
        for a in range(0, n, READ_ROWS):
            part = slice(a, a + READ_ROWS)
            plan.run(slots[part], kw[part], vw[part], None if ks is None else ks[part],
                     None if vs is None else vs[part])
    finally:
        plan.destroy()
        c._last_rec = last


class _ScatterPlan:
    """scatter_slots.comp: up to ``rows`` positions of stored K and V words (and int8 scales)
    into the cache rows of their slots (the slot numbering of _base._SlotReadPlan)."""

    def __init__(self, c, rows: int = READ_ROWS):
        """``rows``: positions per run, at most READ_ROWS (the grid is READ_ROWS' either way)."""
        be = c.device.backend
        self.c = c
        self.ik, self.iv, self.params, self.iks, self.ivs = slot_buffers(c, rows, "load")
        pipe = scatter_pipeline(c.device, c)
        self.prog = be.program(compile_shader(pipe.shader, pipe.defines),
                               [c._k, c._v, self.ik, self.iv, self.params, c._ks, c._vs, self.iks, self.ivs],
                               pipe.groups, pipe.spec, writes=(0, 1, 5, 6), name=pipe.name)
        self.rec = (be.recording().upload(self.ik, self.iv, self.params, self.iks, self.ivs)
                    .dispatch(self.prog).build(c.timestamps))

    def run(self, slots, kw, vw, ks, vs) -> None:
        """kw (n, num_kv_heads, _rk4 * 4) uint32, vw likewise, ks/vs (n, num_kv_heads) uint32
        scale bits (int8) or None; n <= rows."""
        c, hkv, n = self.c, self.c.num_kv_heads, len(slots)
        p = self.params.view()
        p[0] = n * hkv
        p[1:1 + n * hkv] = slot_rows(c, slots).ravel()
        self.ik.view()[:kw.size] = kw.ravel()
        self.iv.view()[:vw.size] = vw.ravel()
        if c._i8:
            self.iks.view().view(np.uint32)[:ks.size] = ks.ravel()
            self.ivs.view().view(np.uint32)[:vs.size] = vs.ravel()
        self.rec.run()
        c._last_rec = self.rec

    def destroy(self) -> None:
        destroy(self.rec, self.prog, self.ik, self.iv, self.params, self.iks, self.ivs)


def scatter_pipeline(dev, c) -> Pipeline:
    """scatter_slots.comp of _ScatterPlan for the storage format ``c``: one pipeline per format,
    the grid of gather_slots.comp."""
    groups = grid_groups(READ_ROWS * c.num_kv_heads * max(c._rk4, c._rv4), dev)
    return Pipeline("scatter_slots", "scatter_slots", {"KV_I8": int(c._i8)}, (WORKGROUP, c._rk4, c._rv4),
                    (groups, 1, 1), 9)


# ---------------------------------------------------------------------- one sequence

def save_sequence(c, slots: np.ndarray, path, token_ids=None, **extra) -> None:
    """Write the positions of cache ``c`` at ``slots`` (in position order) to ``path``."""
    path = check_path(path)
    n = len(slots)
    ids = check_token_ids(token_ids, (n,))
    tensors = stored_tensors(c, slots)
    if ids is not None:
        tensors["token_ids"] = ids
    write_file(path, SEQUENCE, dict(format_meta(c), length=n, source=type(c).__name__, **extra), tensors)


def read_sequence(c, path, with_root: bool = False) -> tuple:
    """(length, tensors, token_ids or None) of a sequence file, checked against cache ``c``'s
    format: everything a load needs to know before it writes; ``with_root``: and the prefix
    cache's root hash the file was saved under (32 bytes: a PagedKVCache sequence's, its salt's;
    None where the file has none -- a KVCache's, or a file from before session 45)."""
    path = check_path(path)
    meta, tensors = read_file(path, (SEQUENCE,))
    check_format(meta, c, path)
    n = meta_int(meta, "length", path)
    check_tensors(tensors, expected_tensors(c, n), path, {"token_ids": (np.dtype(np.int64), (n,))})
    if not with_root:
        return n, tensors, tensors.get("token_ids")
    root = meta.get("salt_root")
    if root is not None:
        try:
            root = bytes.fromhex(root)
        except ValueError:
            root = b""
        if len(root) != 32:
            raise CacheFileCorruptError(f"{path}: salt_root is not a 32-byte hash")
    return n, tensors, tensors.get("token_ids"), root


def file_info(path) -> dict:
    """What a vkattn cache file holds, read and checksum-verified without a cache: its metadata
    (numbers as ints, ``rope`` as a dict or None, ``layers`` of a VkattnCache file as a list) and
    ``token_ids`` (an int64 array, or None). Raises as a load does for a damaged file."""
    path = check_path(path)
    meta, tensors = read_file(path, (SEQUENCE, HF_CACHE))
    info = {}
    for key, value in meta.items():
        if key in ("rope", "layers"):
            value = None if value == "none" else json.loads(value)
        elif value.lstrip("-").isdigit():
            value = int(value)
        info[key] = value
    info["token_ids"] = tensors.get("token_ids")
    return info
