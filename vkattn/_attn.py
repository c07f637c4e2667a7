"""The attention plan both caches use: one recorded submission for one call shape.

A call attends ``nseq`` sequences whose query rows are packed into ``R`` rows per head
(KVCache: one sequence). Everything that varies per call -- lengths, the sequences' records, the
tile table, block tables, ALiBi slopes, masks -- goes into one uint32 ``aux`` buffer, uploaded
with the queries and new rows (layout: shaders/attn_common.glsl). The shader variant (paged,
window, softcap, ALiBi, mask) is a spec constant, so the default path pays for none of them.
"""
from __future__ import annotations

import functools
import numbers
from array import array
from collections import OrderedDict
from itertools import chain
from operator import add
from dataclasses import dataclass

import numpy as np

from . import reference
from ._kp import HAS_BARRIER
from .array import DeviceArray
from .checks import check_int
from .compiler import compile_shader
from .errors import DeviceLimitError
from .formats import FORMATS
from .reference import bfloat16_to_float32, fp8_to_float32, q4_words_to_float32
from .tuning import MIN_CHUNK, WORKGROUP, attention_config, coopmat_fixed_trips, coopmat_stage_batch, \
    texel_aux, texel_kv, tile_merge_batch, tile_v_early

_LOG2E = 1.4426950408889634
HEADER = 32
SEQ_WORDS = 12
F_PAGED, F_WINDOW, F_SOFTCAP, F_ALIBI, F_MASK = 1, 2, 4, 8, 16
F_ROPE_K, F_ROPE_Q, F_ROPE_NEOX = 32, 64, 128


@dataclass(frozen=True)
class RoPE:
    """Rotary position embedding applied on the device: keys as they are appended (the cache
    stores rotated keys) and, per call with ``rope_q=True``, the queries.

    ``style`` "neox" rotates pairs (i, i + rotary_dim/2), "gptj" pairs (2i, 2i+1); angle
    ``position * base ** (-2i / rotary_dim)``; ``rotary_dim`` (default head_dim) must be a
    multiple of 8, the elements after it are left as they are. numpy: vkattn.reference.rope."""
    style: str = "neox"
    base: float = 10000.0
    rotary_dim: int | None = None

    def __post_init__(self):
        if self.style not in ("neox", "gptj"):
            raise ValueError(f"RoPE style: expected 'neox' or 'gptj', got {self.style!r}")
        if isinstance(self.base, bool) or not isinstance(self.base, numbers.Real):
            raise TypeError(f"RoPE base: expected a number, got {type(self.base).__name__}")
        if not np.isfinite(self.base) or self.base <= 1:
            raise ValueError(f"RoPE base: expected a finite number > 1, got {self.base!r}")
        if self.rotary_dim is not None:
            check_int("rotary_dim", self.rotary_dim, 8)

    def dim(self, head_dim: int) -> int:
        """The rotated elements for ``head_dim``; ValueError unless a multiple of 8 <= head_dim."""
        r = head_dim if self.rotary_dim is None else self.rotary_dim
        if r > head_dim or r % 8:
            raise ValueError(f"rope: rotary_dim must be a multiple of 8 and <= head_dim={head_dim}, got {r}"
                             + (" (head_dim itself; give rotary_dim)" if self.rotary_dim is None else ""))
        return r

    def flags(self, rope_q: bool) -> int:
        return F_ROPE_K | (F_ROPE_Q if rope_q else 0) | (F_ROPE_NEOX if self.style == "neox" else 0)

    def apply(self, x, positions, rotary_dim: int) -> np.ndarray:
        """The numpy reference of what the device does: x (heads, n, head_dim) rotated."""
        return reference.rope(x, positions, base=self.base, rotary_dim=rotary_dim, style=self.style)

    def table(self, positions, rotary_dim: int) -> np.ndarray:
        """(n, rotary_dim) float32 rows: the rotary_dim/2 cosines, then the sines (rope.glsl)."""
        cos, sin = reference.rope_table(np.asarray(positions), rotary_dim, self.base)
        return np.concatenate([cos, sin], axis=1)

    @functools.lru_cache(maxsize=8)
    def rows(self, pos: int, n: int, rotary_dim: int) -> np.ndarray:
        """table() of positions pos .. pos + n, flattened (read-only), the last few kept: the
        caches of a model's layers share one RoPE and each decode step's position."""
        rows = self.table(np.arange(pos, pos + n), rotary_dim).ravel()
        rows.flags.writeable = False
        return rows


@dataclass(frozen=True)
class Variant:
    """Score rules of one call (validated); see docs/variants.md."""
    window: int | None = None
    n_sink: int = 0
    softcap: float | None = None
    alibi: np.ndarray | None = None      # (num_qo_heads,) float32

    def flags(self, masked: bool) -> int:
        return ((F_WINDOW if self.window is not None else 0) | (F_SOFTCAP if self.softcap else 0) |
                (F_ALIBI if self.alibi is not None else 0) | (F_MASK if masked else 0))

    def key(self) -> tuple:
        """The rules as a comparable tuple (the ALiBi slopes by their bytes): what a plan's kept
        aux block was written for (AttnPlan.fill_simple, fill_batch)."""
        return self.window, self.n_sink, self.softcap, None if self.alibi is None else self.alibi.tobytes()


_PLAIN = Variant()          # no score variant: check_variant's for the plain call, fill_batch's default


def check_variant(num_qo_heads: int, window=None, n_sink=0, softcap=None, alibi_slopes=None) -> Variant:
    if window is None and type(n_sink) is int and n_sink == 0 and softcap is None and alibi_slopes is None:
        return _PLAIN               # the common call: nothing to check
    if alibi_slopes is None and type(n_sink) is int and type(window) in _INT_OR_NONE \
            and type(softcap) in _FLOAT_OR_NONE:    # a window or softcap a model's layers pass call after call:
        return _kept_variant(window, n_sink, softcap)       # checked once (a bad one raises every time)
    return _check_variant(num_qo_heads, window, n_sink, softcap, alibi_slopes)


_INT_OR_NONE, _FLOAT_OR_NONE = {int, type(None)}, {float, type(None)}


@functools.lru_cache(maxsize=64)
def _kept_variant(window, n_sink: int, softcap) -> Variant:
    """check_variant of plain-typed rules without ALiBi (which do not depend on the head count)."""
    return _check_variant(0, window, n_sink, softcap, None)


MASK_LIMIT = reference.MASK_LIMIT

# a window or sink count at or past a sequence's keys means the same as that count (every key
# in the window, every key a sink); the kernels hold them as 32-bit words: larger ones are held as this
RULE_MAX = 2 ** 31 - 1
# |ALiBi slope| at most this: slope * distance (< 2**31 keys) * log2(e) stays a float32
ALIBI_MAX = 2.0 ** 32


def _check_variant(num_qo_heads: int, window, n_sink, softcap, alibi_slopes) -> Variant:
    if window is not None:
        window = min(check_int("window", window, 1), RULE_MAX)
    n_sink = min(check_int("n_sink", n_sink, 0), RULE_MAX)
    if n_sink and window is None:
        raise ValueError(f"n_sink: attention sinks need a window; got n_sink={n_sink} with window=None")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
            raise TypeError(f"softcap: expected a float or None, got {type(softcap).__name__}")
        softcap = float(softcap)
        if not 1e-30 <= softcap <= 1e30:    # NaN too; keeps softcap*log2(e) a normal float (softcap_score)
            raise ValueError(f"softcap: expected a float in [1e-30, 1e30], got {softcap}")
    alibi = None
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, np.ndarray):
            raise TypeError(f"alibi_slopes: expected a numpy.ndarray, got {type(alibi_slopes).__name__}")
        if alibi_slopes.shape != (num_qo_heads,):
            raise ValueError(f"alibi_slopes: expected shape ({num_qo_heads},), got {alibi_slopes.shape}")
        if alibi_slopes.dtype.kind != "f":
            raise TypeError(f"alibi_slopes: expected a float array, got {alibi_slopes.dtype}")
        alibi = np.asarray(alibi_slopes, np.float32)
        big = float(np.abs(alibi).max())    # one reduction for both tests (NaN fails the comparison)
        if not big <= ALIBI_MAX:
            if not np.isfinite(alibi).all():
                raise ValueError("alibi_slopes: contains NaN or Inf")
            raise ValueError(f"alibi_slopes: expected |slope| <= 2**32 (slope x distance x log2(e) must stay a "
                             f"float32), got {big:g}")
    return Variant(window, n_sink, softcap, alibi)


def check_mask(mask, num_qo_heads: int, s: int, total: int, device, name: str = "mask"):
    """An additive mask (s, total) or (num_qo_heads, s, total): numpy (-inf or finite entries at
    most MASK_LIMIT = 2**127 -- entries below -MASK_LIMIT count as -inf, as in
    vkattn.reference.attention, as the kernels' mask_at reads them; returned as contiguous float32) or a vkattn.DeviceArray on ``device`` of shape (s, C) or
    (num_qo_heads, s, C) with C >= total -- its first ``total`` columns are the mask, so one array
    as wide as a cache's capacity serves every step of a replayed graph -- returned as it is (its
    values are not read: shaders/mask_copy.comp copies them on the device)."""
    if isinstance(mask, DeviceArray):
        mask._check_open()
        if mask.device is not device:
            raise ValueError(f"{name}: this DeviceArray lives on {mask.device.name!r}, the cache on {device.name!r}")
        shape = mask.shape
        if len(shape) not in (2, 3) or shape[-2] != s or (len(shape) == 3 and shape[0] != num_qo_heads) \
                or shape[-1] < total:
            raise ValueError(f"{name}: expected a DeviceArray of shape ({s}, C) or ({num_qo_heads}, {s}, C) with "
                             f"C >= {total} keys, got {shape}")
        return mask
    if not isinstance(mask, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray or a vkattn.DeviceArray, got {type(mask).__name__}")
    if mask.dtype.kind != "f":
        raise TypeError(f"{name}: expected a float array, got {mask.dtype}")
    if mask.shape not in ((s, total), (num_qo_heads, s, total)):
        raise ValueError(f"{name}: expected shape ({s}, {total}) or ({num_qo_heads}, {s}, {total}), "
                         f"got {mask.shape}")
    mask = as_f32(mask)
    if np.isnan(mask).any() or (mask == np.inf).any():
        raise ValueError(f"{name}: entries must be finite or -inf (NaN or +inf found)")
    if mask.size and mask.max() > MASK_LIMIT:
        raise ValueError(f"{name}: finite entries must be at most 2**127 = {MASK_LIMIT:.4g} (the kernels scale "
                         f"them by log2(e)); got {float(mask.max()):g}")
    return mask


def fast_mask(mask, num_qo_heads: int, s: int, total: int):
    """check_mask's result for a numpy mask that passes it, in fewer steps (a fast path's: one
    maximum over the values, NaN and +inf both failing ``< inf``); None for anything else -- a
    DeviceArray, a bad type, shape or value -- where check_mask decides and raises."""
    if type(mask) is not np.ndarray or mask.dtype.kind != "f" or (mask.shape != (s, total)
                                                                   and mask.shape != (num_qo_heads, s, total)):
        return None
    mask = as_f32(mask)
    return mask if mask.max() <= MASK_LIMIT else None


def as_f32(x: np.ndarray) -> np.ndarray:
    """x as a C-contiguous float32 array (itself where it is one), values past float32's range
    becoming infinities without a warning (the caller's check refuses them)."""
    if x.dtype == np.float32:
        return np.ascontiguousarray(x)
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(x, np.float32)


def check_mask_width(mask, total: int, name: str = "mask") -> None:
    """A checked mask against the keys its sequence attends now, which grow as a captured graph
    is replayed (vkattn.graph): a numpy mask holds exactly the keys of the call it came with, a
    DeviceArray at least them; ValueError otherwise."""
    width = mask.shape[-1]
    if isinstance(mask, DeviceArray):
        if width < total:
            raise ValueError(f"{name}: a DeviceArray of {width} columns, but the call attends {total} keys "
                             f"(give a mask as wide as the cache's capacity to replay a graph as it grows)")
    elif width != total:
        raise ValueError(f"{name}: a numpy mask covers the {width} keys of the call it came with; this replay "
                         f"attends {total} (capture a DeviceArray mask as wide as the cache's capacity: its first "
                         f"{total} columns are read)")


def mask_words(mask, total: int) -> int:
    """The aux words a checked mask of a sequence of ``total`` keys takes (check_mask)."""
    if isinstance(mask, DeviceArray):
        return (mask.shape[0] if len(mask.shape) == 3 else 1) * mask.shape[-2] * total
    return mask.size


def host_mask(mask, total: int):
    """A checked mask as numpy (s, total) or (num_qo_heads, s, total): a DeviceArray read back
    (verify mode, the reference's input)."""
    return mask.numpy()[..., :total] if isinstance(mask, DeviceArray) else mask


@dataclass
class SeqCall:
    """One sequence of a call: ``past`` cached keys, ``n_new`` keys appended now (rows
    ``new_start`` .. of nk/nv), ``q_len`` query rows (packed at ``q_start``), its block table.
    ``key_lo``: the first key attended (cascade: the keys before it are a shared prefix attended
    by a dispatch of its own, vkattn.cascade)."""
    past: int
    n_new: int
    q_start: int
    q_len: int
    new_start: int = 0
    table: np.ndarray | None = None
    mask: "np.ndarray | DeviceArray | None" = None     # a DeviceArray: copied into aux on the device
    rope_row: int = 0           # its first row in the rotary table, holding position rope_pos
    rope_pos: int = 0
    key_lo: int = 0


@dataclass(frozen=True)
class Pipeline:
    """One compute pipeline as vkattn builds it: shader, defines, specialisation constants (in
    constant_id order), workgroup grid, number of storage-buffer bindings. What a plan compiles,
    and what ``perf gpu`` compiles on other devices' compilers."""
    name: str
    shader: str
    defines: dict
    spec: tuple
    groups: tuple
    bindings: int


ATTN_BINDINGS = 13      # kc vc nk nv q aux out part ml lse rope ks vs (attn.comp, attn_lane.comp, attn_coopmat.comp)


def attn_pipeline(dev, fmt, hq: int, rows: int, nn: int, nseq: int, flags: int, key_bound: int,
                  decode: bool, rope_dim: int = 0, splits: int | None = None, aux_words: int | None = None):
    """(AttnConfig, Pipeline) of the attention dispatch for ``hq`` heads, ``rows`` packed query
    rows, ``nn`` new rows (fused append: a per-call value, not a specialisation), ``nseq`` sequences, on ``dev`` (a Device, or anything with
    its planning attributes) for the storage format ``fmt`` (a cache: _dk4, _dv4, _ch,
    v_head_dim, num_kv_heads, _defines, _matrices). The kernel is tuning.attention_config's:
    attn.comp, attn_lane.comp, or for prefill and chunks on a device with cooperative matrices
    and a format they hold (float16, int8, fp8) attn_coopmat.comp (a PlanningDevice plans it from the
    DeviceInfo's listed shapes and features)."""
    hkv = fmt.num_kv_heads
    group = hq // hkv
    cfg = attention_config(dev, group, 1 if decode else rows, fmt._dk4, fmt._dv4, fmt._ch, key_bound, hkv, splits,
                           matrices=fmt._matrices, nseq=nseq if decode else 1)
    tiles_max = max(1, min(nseq * cfg.qtiles(rows), cfg.qtiles(rows) + nseq - 1))   # sum of ceil(q_len/bq)
    grid = (cfg.splits, tiles_max, hkv)
    if grid[0] > dev.max_workgroup_count[0]:
        raise DeviceLimitError(f"{grid[0]} key splits need as many workgroups in x; the device allows "
                               f"{dev.max_workgroup_count[0]}")
    if grid[1] > dev.max_workgroup_count[1]:
        raise DeviceLimitError(f"q: {rows} rows need {grid[1]} workgroups in y; the device allows "
                               f"{dev.max_workgroup_count[1]}")
    spec = cfg.spec(group, fmt._dk4, fmt._dv4, fmt.v_head_dim, flags, rope_dim)
    bindings = ATTN_BINDINGS
    if cfg.kernel == "lane":
        shader, defines = "attn_lane", dict(fmt._defines)
        if texel_kv(dev, cfg.kernel, nn, fmt):
            defines["KV_TEXEL"] = 1
        # aux also as a texel view (binding 13) where the key loop gathers from it: an AttnPlan's
        # (aux_words known; the split counters follow them)
        counters = hkv * grid[1] if cfg.splits > 1 else 0
        if aux_words is not None and texel_aux(dev, cfg.kernel, bool(flags & (F_MASK | F_PAGED)),
                                               aux_words + counters):
            defines["AUX_TEXEL"] = 1
            bindings += 1
        if (defines.get("KV_F16") or defines.get("KV_FP8")) and dev.half_native():   # its exact half conversion
            defines["HALF_NATIVE"] = 1
    elif cfg.kernel == "coopmat":
        shader, defines = "attn_coopmat", dict(fmt._defines, COOPMAT_UNROLL=int(cfg.unroll),
                                               COOPMAT_FIXED_TRIPS=int(coopmat_fixed_trips()),
                                               COOPMAT_STAGE_BATCH=int(coopmat_stage_batch()))
    else:
        shader, defines = "attn", dict(fmt._defines, TILE_SHUFFLE=int(cfg.ds > 1 and cfg.shuffle))
        merge_batch = tile_merge_batch()
        if merge_batch is not None:               # the shader's default unless VKATTN_TILE_MERGE_BATCH
            defines["TILE_MERGE_BATCH"] = merge_batch
        if tile_v_early():                        # .. or VKATTN_TILE_V_EARLY
            defines["TILE_V_EARLY"] = 1
    return cfg, Pipeline(shader, shader, defines, tuple(spec), grid, bindings)


class AttnPlan:
    """attn.comp / attn_lane.comp for ``hq`` heads, up to ``rows`` packed query rows and ``nn`` new
    rows per head (a call's own counts, at most these, go to the kernel in the aux header: the
    caches build plans for row buckets, tuning.row_bucket), ``nseq`` sequences, variant ``flags``
    and an aux buffer of ``aux_words``. One recorded
    sequence: upload -> attn -> download of out and lse. With split-K the last workgroup of each
    tile merges the splits on the device (a counter per tile after the aux words, zeroed by the
    upload), so nothing crosses to the host before the output. ``store`` is the cache: device,
    k/v buffers, layout. ``splits``: key splits instead of the configuration's own choice;
    ``scratch``: a prefix for the names of its shared scratch buffers, so that two plans of one
    recording never share one (vkattn.cascade's shared pass)."""

    def __init__(self, store, hq: int, rows: int, nn: int, nseq: int, flags: int, aux_words: int,
                 key_bound: int, decode: bool, rope_dim: int = 0, splits: int | None = None, scratch: str = ""):
        self._args = (store, hq, rows, nn, nseq, flags, aux_words, key_bound, decode, rope_dim, splits, scratch)
        c = store
        be, hkv = c.device.backend, c.num_kv_heads
        self.c, self.hq, self.rows, self.nn, self.flags = c, hq, rows, nn, flags
        aux_words = -(-aux_words // 4) * 4         # whole texels: a texel view of it reaches every word
        cfg, pipe = attn_pipeline(c.device, c, hq, rows, nn, nseq, flags, key_bound, decode, rope_dim, splits,
                                  aux_words)
        pv4 = c._dv4 * c._ch * 4
        nrows = hq * rows
        # every scratch buffer within the device's per-buffer limit: the split-K partials (splits x
        # rows x heads x dv floats: 512 sequences of 64 heads d128 over 256 splits are 4 GiB, one
        # byte past a GPU's 2**32 - 1) by fewer splits, q and out by refusing the call's size
        limit = c.device.max_buffer_bytes
        for name, nbytes in (("q", nrows * c._dk4 * c._ch * 16), ("out", nrows * c.v_head_dim * 4)):
            if nbytes > limit:
                raise DeviceLimitError(f"{name}: {rows} query rows of {hq} heads need a {nbytes}-byte buffer; "
                                       f"{c.device.name} allows {limit} bytes per buffer: pass fewer rows per call "
                                       f"(a prefill in chunks, a smaller batch)")
        per_split = nrows * pv4 * 4
        if cfg.splits > 1 and cfg.splits * per_split > limit:
            cfg, pipe = attn_pipeline(c.device, c, hq, rows, nn, nseq, flags, key_bound, decode, rope_dim,
                                      max(1, limit // per_split), aux_words)
            if cfg.splits > 1 and cfg.splits * per_split > limit:
                raise DeviceLimitError(f"partials: {cfg.splits} key splits of {rows} query rows of {hq} heads need "
                                       f"{cfg.splits * per_split} bytes; {c.device.name} allows {limit} per buffer: "
                                       f"pass fewer rows per call")
        self.cfg = cfg
        # scratch shared with every plan of the same sizes on this device (all layers of a model):
        # each call fills, dispatches and copies out under the device's lock (Backend.shared_buffer)
        def buf(size, dtype, host_visible=True, name=""):
            return be.shared_buffer(size, dtype, host_visible, scratch + name)
        self.q = buf(hq * rows * c._dk4 * c._ch * 4, np.float32, name="q")
        self.nk = buf(hkv * max(nn, 1) * c._dk4 * c._ch * 4, np.float32, name="new_k")
        self.nv = buf(hkv * max(nn, 1) * c._dv4 * c._ch * 4, np.float32, name="new_v")
        split = cfg.splits > 1
        self._counters = aux_words                  # split-K: one counter per (kv head, tile)
        self.aux = be.buffer(aux_words + (hkv * pipe.groups[1] if split else 0), np.uint32, name="aux")
        self.out = buf(nrows * c.v_head_dim, np.float32, name="out")
        self.lse = buf(nrows + 1, np.float32, name="lse")   # + attn.comp's subgroup size word
        self.rope_dim = rope_dim
        # the plan's own (not shared): host-filled per call, so the calls of several caches
        # recorded into one submission (vkattn.graph) each keep theirs
        self.rope = be.buffer(max(rows, nn, 1) * max(rope_dim, 4), np.float32, name="rope_table")
        # split-K partials live on the device only: the kernel merges them itself
        self.part = buf(cfg.splits * nrows * pv4 if split else 1, np.float32, host_visible=False, name="partials")
        self.ml = buf(cfg.splits * nrows * 2 if split else 2, np.float32, host_visible=False, name="max_sum")
        inputs = [self.q, self.aux] + ([self.nk, self.nv] if nn else []) + ([self.rope] if rope_dim else [])
        self.inputs = inputs                        # what a call uploads (a recording of several plans too)
        self._pipe = pipe
        bindings = self._bindings()
        # the subgroup width the kernel's shuffles assume (attn.comp clusters of cfg.ds, attn_lane.comp
        # one subgroup of cfg.wg): pinned where the device can (a required subgroup size, full
        # subgroups), else checked on the real pipeline after each run (see run)
        shuffles = pipe.defines.get("TILE_SHUFFLE", 0) if cfg.kernel == "tile" else 1
        need = cfg.ds if cfg.kernel == "tile" else cfg.wg
        pin = c.device.subgroup_pin(cfg.wg, need) if shuffles else (0, False)
        if cfg.kernel == "lane" and pin[0] != cfg.wg:
            pin = (0, False)
        if cfg.kernel == "coopmat":     # its matrices are sized for cfg.sg: pinned, or the device's only size
            pin = c.device.coopmat_pin()
        self.subgroup = pin
        self._check_width = bool(shuffles) and cfg.kernel in ("tile", "coopmat") and (
            not pin[0] or cfg.kernel == "coopmat")
        self._pipe, self._spirv = pipe, compile_shader(pipe.shader, pipe.defines)
        # the pools (and int8 scales) are written only by a fused append
        self._writes = (0, 1, 5, 6, 7, 8, 9, 11, 12) if nn else (5, 6, 7, 8, 9)
        self.attn = be.program(self._spirv, bindings, pipe.groups, pipe.spec, writes=self._writes,
                               name=pipe.shader, subgroup=pin)
        self.rec = be.recording().upload(*inputs).dispatch(self.attn).download(self.out, self.lse).build(c.timestamps)
        self._rec_out = None            # the same without lse's download (out_only)
        self._header = np.zeros(HEADER, np.uint32)
        self._tiles = {}
        self._dst = {}                  # _put_input's views: (input, shape) -> view of its host copy
        self._dst3 = None               # _put_inputs' last three: ((q, k, v shapes), their views)
        self._binds = OrderedDict()     # device arrays in place of the plan's own buffers: see bound()
        self._chains = OrderedDict()    # an append's program -> this plan's recording after it: see _chained()
        self._mask_progs = OrderedDict()    # device masks' copies into aux: see mask_programs()
        self._masked = OrderedDict()        # (attention program, copies) -> recording: see _with_masks()

    def warm(self) -> None:
        """Run the recorded sequence once with no tiles (every workgroup returns at once), so the
        driver builds the pipeline now -- lavapipe compiles it to machine code on its first dispatch
        -- and the first real call does not wait for it. Nothing is written to the cache."""
        aux = self.aux.view()
        saved = int(aux[14])
        aux[14] = 0
        self.rec.run()
        aux[14] = saved

    @staticmethod
    def aux_need(nseq: int, tiles: int, hq: int, table_words: int, mask_words: int) -> int:
        return HEADER + SEQ_WORDS * nseq + 2 * tiles + hq + table_words + mask_words

    def out_only(self):
        """The plan's recording that copies back only out (a call that did not ask for lse, on a
        plan that reads no subgroup width back); built on first use."""
        if self._rec_out is None:
            c = self.c
            self._rec_out = c.device.backend.recording().upload(*self.inputs).dispatch(self.attn) \
                .download(self.out).build(c.timestamps)
        return self._rec_out

    def _bindings(self, q=None, nk=None, nv=None, out=None, lse=None) -> list:
        """The dispatch's buffers in binding order (ATTN_BINDINGS; AUX_TEXEL: aux once more), the
        given ones in place of the plan's own."""
        c = self.c
        return [c._k, c._v, nk or self.nk, nv or self.nv, q or self.q, self.aux, out or self.out, self.part,
                self.ml, lse or self.lse, self.rope, c._ks, c._vs] + [self.aux] * (self._pipe.bindings - ATTN_BINDINGS)

    def bound(self, q=None, nk=None, nv=None, out=None, lse=None) -> tuple:
        """(program, recording) of this plan with the given buffers (vkattn._kp.Buffer of device
        arrays; None: the plan's own) bound in place of q, the new K/V rows, out and lse. The
        recording uploads what the host fills (aux, rotary table, the plan's own inputs) and
        downloads only the plan's own outputs. Built once per set of buffers and kept (a few per
        plan, least recently used dropped): a caller that reuses its arrays binds once."""
        key = (q, nk, nv, out, lse)
        hit = self._binds.get(key)
        if hit is not None:
            for b in key:                   # every buffer still allocated (a loop: no generator a call)
                if b is not None and b._t is None:
                    break
            else:
                self._binds.move_to_end(key)
                return hit
        if hit is not None:
            self._drop_bind(key)
        be = self.c.device.backend
        prog = be.program(self._spirv, self._bindings(q, nk, nv, out, lse), self._pipe.groups, self._pipe.spec,
                          writes=self._writes, name=self._pipe.shader, subgroup=self.subgroup)
        up = [b for b in self.inputs if b not in (self.q, self.nk, self.nv)] + \
             [own for own, user in ((self.q, q), (self.nk, nk), (self.nv, nv)) if own in self.inputs and user is None]
        down = self._downloads(out, lse)
        rec = be.recording().upload(*up).dispatch(prog)
        if down:
            rec.download(*down)
        hit = self._binds[key] = (prog, rec.build(self.c.timestamps), up)
        while len(self._binds) > 4:
            self._drop_bind(next(iter(self._binds)))
        return hit

    def _downloads(self, out, lse) -> list:
        """What a recording bound to ``out`` / ``lse`` (buffers, or None: the plan's own) copies
        back: the plan's own outputs, and a bound lse where the run reads the subgroup width
        from it."""
        return [b for b in ((self.out if out is None else None), (self.lse if lse is None else lse if self._check_width
                                                                    else None)) if b is not None]

    def mask_programs(self, seqs: list) -> list:
        """mask_copy.comp programs, one per sequence of ``seqs`` whose mask is a DeviceArray (in
        record order), to run between the upload of aux and the attention dispatch: each copies
        its mask's first past + n_new columns into the aux words fill() left for it (fill checked
        the widths). Kept per (array, record, shape), the last eight -- or as many as this call
        has (a batch of nine device masks destroyed its first program while building its ninth,
        then dispatched it: a segmentation fault)."""
        keep = max(8, sum(isinstance(sq.mask, DeviceArray) for sq in seqs))
        progs = []
        for i, sq in enumerate(seqs):
            m = sq.mask
            if not isinstance(m, DeviceArray):
                continue
            buf = m.buffer
            progs.append(kept(self._mask_progs, (buf, i, m.shape), keep, lambda: buf._t is not None,
                              lambda: mask_program(self.c.device, buf, self.aux, m.shape, i)))
        return progs

    def _with_masks(self, copies: list, prog, up: list, down: list):
        """The recording upload(up) -> the mask copies -> ``prog`` -> download(down), a barrier
        before the attention reads what the copies wrote; kept per (prog, copies), the last four."""
        def build():
            rec = self.c.device.backend.recording().upload(*up)
            for c in copies:
                rec.dispatch(c, barriers=True)
            rec.dispatch(prog, barriers=True)
            if down:
                rec.download(*down)
            return rec.build(self.c.timestamps)
        return kept(self._masked, (prog, tuple(copies)), 4,
                    lambda: prog._algo is not None and all(c._algo is not None for c in copies), build)

    def after(self, first, rec):
        """The recording to run for ``rec`` (one of this plan's) behind ``first``, an append
        staged by vkattn._base._SlotWritePlan.stage (program, uploads, its own recording): the
        plan's own recording with the append recorded ahead of it, a barrier between, in one
        submission (:meth:`_chained`), where ``rec`` is that recording and the kp has barriers;
        else the append runs alone now and ``rec`` is returned."""
        if rec is self.rec and HAS_BARRIER:
            return self._chained(first[0], first[1])
        first[2].run()
        return rec

    def _chained(self, prog, uploads):
        """This plan's own recording (numpy in, out and lse copied back) with the dispatch of
        ``prog`` and its ``uploads`` ahead of it, a barrier between (the patched kp): an append
        and its attention in one submission. Kept per program, the last two (an append plan's
        own program, or one bound to device arrays)."""
        c = self.c
        return kept(self._chains, prog, 2, lambda: prog._algo is not None,
                    lambda: c.device.backend.recording().upload(*uploads, *self.inputs).dispatch(prog)
                    .dispatch(self.attn, barriers=True).download(self.out, self.lse).build(c.timestamps))

    def _drop_bind(self, key) -> None:
        prog, rec, _ = self._binds.pop(key)
        destroy(rec, prog)

    def run(self, q, k, v, seqs: list, causal: bool, scale: float, variant: Variant, rope: RoPE | None = None,
            out=None, lse=None, first=None):
        """q (hq, rows, head_dim) packed; k/v (num_kv_heads, n, d) packed new rows or None: numpy
        arrays, or vkattn.DeviceArray (read in place). ``out`` / ``lse``: DeviceArrays to write
        into (None: the plan's own, copied to the host). ``first``: an append staged to run
        before the attention (vkattn._base._SlotWritePlan.stage's triple; :meth:`after`).
        Returns out (hq, rows, v_head_dim) and lse (hq, rows) float32 numpy arrays, None for
        those written to buffers."""
        devq = q.buffer if isinstance(q, DeviceArray) else None
        devk = k.buffer if isinstance(k, DeviceArray) else None
        devv = v.buffer if isinstance(v, DeviceArray) else None
        out = out.buffer if isinstance(out, DeviceArray) else out
        lse = lse.buffer if isinstance(lse, DeviceArray) else lse
        rows = self.fill(q, k, v, seqs, causal, scale, variant, rope)
        own = devq is None and devk is None and devv is None and out is None and lse is None
        copies = self.mask_programs(seqs) if self.flags & F_MASK else []
        if copies:              # device masks: copied into aux between the upload and the attention
            prog, _, up = (self.attn, None, self.inputs) if own else self.bound(devq, devk, devv, out, lse)
            rec = self._with_masks(copies, prog, up, [self.out, self.lse] if own else self._downloads(out, lse))
        else:
            rec = self.rec if own else self.bound(devq, devk, devv, out, lse)[1]
        if first is not None:
            rec = self.after(first, rec)
        rec.run()
        self.c._last_rec = rec
        if not own:
            width = self.narrow_subgroup(rows, lse)
            if width or (self._check_width and self.cfg.kernel == "coopmat" and self._ran_width(rows, lse) != self.cfg.sg):
                raise RuntimeError(f"the {self.cfg.kernel} pipeline ran with subgroups of "
                                   f"{self._ran_width(rows, lse)} where it needs {self.cfg.sg or self.cfg.ds}: "
                                   f"run this call once with numpy arrays to let vkattn adapt the plan")
            host_out = None if out is not None else self.out.view()[:self.hq * rows * self.c.v_head_dim].reshape(
                self.hq, rows, self.c.v_head_dim).copy()
            host_lse = None if lse is not None else self.lse.view()[:self.hq * rows].reshape(self.hq, rows).copy()
            return host_out, host_lse
        if self._check_width and self.cfg.kernel == "coopmat":
            width = int(self.lse.view()[self.hq * rows:].view(np.uint32)[0])
            if width != self.cfg.sg:
                # pinned, yet another subgroup size: the kernel ran no matrix (it checks). Not
                # picked on this device again; this call is planned and run again without it
                # (VKATTN_KERNEL=coopmat: the ValueError naming this)
                self.c.device.coopmat_failed(f"the driver ran a cooperative-matrix pipeline pinned to subgroups "
                                             f"of {self.cfg.sg} with subgroups of {width}")
                self.destroy()
                self.__init__(*self._args)
                return self.run(q, k, v, seqs, causal, scale, variant, rope)   # the append ran: not again
        width = self.narrow_subgroup(rows)
        if width:
            # the pipeline's real subgroup size is narrower than the cluster: its shuffles read
            # outside the subgroup and the result is void. The device's clusters shrink to fit,
            # this plan is built again and the call runs again (the fused append stores the same
            # rows again)
            self.c.device.lower_tile_cluster(width)
            self.destroy()
            self.__init__(*self._args)
            return self.run(q, k, v, seqs, causal, scale, variant, rope)
        return self.result(rows)

    def _ran_width(self, rows: int, lse=None) -> int:
        """The subgroup size the last run's pipeline ran with (the word after lse's rows)."""
        return int((lse or self.lse).view()[self.hq * rows:].view(np.uint32)[0])

    def narrow_subgroup(self, rows: int, lse=None) -> int:
        """After a run of ``rows`` rows: the subgroup size the pipeline really ran with (attn.comp
        writes it after lse) where it could not be pinned and is narrower than the cluster the
        shuffles assume, else 0."""
        if not self._check_width or self.cfg.kernel != "tile":
            return 0
        width = self._ran_width(rows, lse)
        return width if width < self.cfg.ds else 0

    def result(self, rows: int) -> tuple:
        """out (hq, rows, v_head_dim) and lse (hq, rows) float32 of the last run, copied."""
        c = self.c
        out = self.out.view()[:self.hq * rows * c.v_head_dim].reshape(self.hq, rows, c.v_head_dim).copy()
        return out, self.lse.view()[:self.hq * rows].reshape(self.hq, rows).copy()

    @staticmethod
    def _rows(x) -> int:
        """Rows per head of a (heads, rows, dim) numpy array or DeviceArray."""
        return x.shape[1]

    _simple = None                  # the key (counts, scale, flags, variant) of the aux block fill_simple left
    _batch_head = None              # fill_batch's last key (counts, scale, variant, rows, causal, ..), its offsets
    batch_words = None              # fill_batch's last per-sequence words (layout, records, tables, rotary rows)
    _decode_cols = None             # decode_columns': ((records' offset, B), views of record words 0, 4, 5, 6, 10)
    fills = 0                       # how many times fill, fill_simple or fill_batch wrote the aux (vkattn.paged's
                                    # steady memo: no other call's words there since its own)

    def fill_simple(self, q, k, v, past: int, scale: float, rope: RoPE | None = None,
                    variant: Variant = _PLAIN, causal: bool = True, mask: np.ndarray | None = None) -> None:
        """fill() of the most common call -- one sequence of ``past`` cached keys, q (hq, s, d)
        and new rows k, v as C-contiguous float32 numpy arrays (or None: no new rows in the
        dispatch, those appended first counted in ``past``), rotated by the cache's ``rope`` or
        not, ``mask`` None or a checked numpy one (fast_mask, check_mask: float32, C-contiguous,
        as wide as the keys): the aux block of the last such call of the same counts, flags and
        variant is kept, and only the four words that follow the length are written, the
        rotary table's rows of the new positions and the mask's words (vkattn.cache's fast
        path; a graph's replay, whose q, k, v are DeviceArrays)."""
        s, n = q.shape[1], 0 if k is None else k.shape[1]
        rows = max(s, n)
        key = (s, n, scale, rope, causal, variant.key(), None if mask is None else mask.ndim)
        self.fills += 1
        if self._simple != key:
            seq = SeqCall(past=past, n_new=n, q_start=0, q_len=s, mask=mask, rope_pos=past + n - rows)
            self.fill(q, k, v, [seq], causal, scale, variant, rope)
            self._simple = key
            return
        self._copy_inputs(q, k, v)       # a DeviceArray is read where it lies (AttnPlan.bound)
        kstart, chunk = split_keys(past + n, s, variant.window, self.cfg.splits, 0)
        aux = self.aux.view()
        at = HEADER                      # the one sequence record: past, n_new, .., chunk, bt, kstart, mask
        aux[at] = past
        aux[at + 4] = chunk
        aux[at + 6] = kstart
        aux[at + 10] = pos = past + n - rows
        if mask is not None:             # where fill() put it: after the tiles and the ALiBi slopes
            moff = int(aux[at + 7])
            aux.view(np.float32)[moff:moff + mask.size] = mask.reshape(-1)
        if self.rope_dim:                # fill()'s table rows: positions pos .. pos + rows, from row 0
            d = self.rope_dim
            self.rope.view()[:rows * d] = rope.rows(pos, rows, d)

    def fill(self, q, k, v, seqs: list, causal: bool, scale: float, variant: Variant,
             rope: RoPE | None = None) -> int:
        """Write a call's inputs into the host copies of q, nk/nv, aux and the rotary table (what
        ``inputs`` uploads); returns its rows per head."""
        self._batch_head = None
        self.fills += 1
        rows, nn = self._put_inputs(q, k, v)
        aux = self.aux.view()
        f = aux.view(np.float32)
        h = self._header
        seq_off, tile_off, free = self._put_head(tuple(s.q_len for s in seqs), causal, scale, variant, rows, nn)
        recs = np.zeros((len(seqs), SEQ_WORDS), np.uint32)
        for i, s in enumerate(seqs):
            kstart, chunk = split_keys(s.past + s.n_new, s.q_len, variant.window, self.cfg.splits, s.key_lo)
            bt = 0
            if s.table is not None:
                bt = free
                aux[free:free + len(s.table)] = s.table
                free += len(s.table)
            moff = 0
            if s.mask is not None:
                check_mask_width(s.mask, s.past + s.n_new, "mask" if len(seqs) == 1 else f"mask[{i}]")
                moff = free
                if isinstance(s.mask, DeviceArray):  # its words are written by mask_copy.comp (mask_programs)
                    free += mask_words(s.mask, s.past + s.n_new)
                    if free > self._counters:       # the plan was sized for fewer (a caller's bug, not the user's)
                        raise RuntimeError(f"aux: {free} words needed, the plan holds {self._counters}")
                else:
                    f[free:free + s.mask.size] = s.mask.ravel()
                    free += s.mask.size
                h[16] = int(s.mask.ndim == 3)       # per q head (callers give all 2-D or all 3-D)
            recs[i, :11] = (s.past, s.n_new, s.q_start, s.q_len, chunk, bt, kstart, moff, s.new_start,
                            s.rope_row, s.rope_pos)
            if self.rope_dim:
                n = max(s.q_len, s.n_new)
                tab = rope.table(np.arange(s.rope_pos, s.rope_pos + n), self.rope_dim)
                self.rope.view()[s.rope_row * self.rope_dim:(s.rope_row + n) * self.rope_dim] = tab.ravel()
        aux[:HEADER] = h
        aux[seq_off:tile_off] = recs.ravel()
        return rows

    def fill_batch(self, q, k, v, past: list, counts: list, tables: list, scale: float,
                   rope: RoPE | None = None, variant: Variant = _PLAIN, words=None, causal: bool = True,
                   masks: list | None = None, prior=None) -> int:
        """fill() of a paged batch's common call, the same words in fewer steps: sequence i has
        ``past[i]`` cached keys and brings ``counts[i]`` new rows (fused: the dispatch stores them;
        or, with k and v None, appended first: the dispatch finds them in the cache) and as many
        query rows, packed after sequence i-1's; its block table ``tables[i]`` (a list of ints);
        no shared prefix; causal or not, any score variant, ``masks`` None or one checked numpy
        mask per sequence (fast_mask: all 2-D or all per head), written after the block tables;
        the keys rotated by the cache's ``rope``. No SeqCall objects, one record list, one rotary
        table for all rows.

        The per-sequence words it writes (records, block tables, rotary rows) are kept in
        ``batch_words``; ``words``: another plan's ``batch_words`` from a call with the same
        ``past``, ``counts`` and ``tables`` (the caller's to know: vkattn.paged's step memo, a
        model's next layer), copied instead of computed where that plan laid out the same
        configuration (its words name the offsets, split count, window and rotary table);
        ``prior``: the ``batch_words`` of a call with the same ``counts`` and ``tables`` but other
        lengths (vkattn.paged's next step of the same sequences): its block-table words are
        taken where it laid out the same configuration, the records and rotary rows computed."""
        self.fills += 1
        rows, nn = self._put_inputs(q, k, v)
        aux = self.aux.view()
        per_head = None if masks is None else masks[0].ndim == 3
        key = (tuple(counts), scale, variant.key(), rows, nn, causal, per_head)
        if self._batch_head is not None and self._batch_head[0] == key:
            seq_off, tile_off, free = self._batch_head[1]       # header, tiles, slopes in aux as they were
        else:
            seq_off, tile_off, free = self._put_head(key[0], causal, scale, variant, rows, nn)
            self._header[16] = int(bool(per_head))
            aux[:HEADER] = self._header
            self._batch_head = key, (seq_off, tile_off, free)
        splits, window = self.cfg.splits, variant.window
        layout = (free, splits, window, self.rope_dim, rope if self.rope_dim else None, nn == 0)
        if words is None or words[0] != layout:
            tabs = prior[2] if prior is not None and prior[0] == layout else None
            words = (layout,) + self._batch_words(past, counts, tables, splits, window, free, rope, nn == 0, tabs)
        _, recs, tabs, rtab = words
        aux[seq_off:tile_off] = recs
        aux[free:free + tabs.size] = tabs
        if masks is not None:               # after the tables; each record's mask word points at its own
            f, at = aux.view(np.float32), free + tabs.size
            if at + sum(m.size for m in masks) > self._counters:     # the plan was sized for fewer (a caller's bug)
                raise RuntimeError(f"aux: {at + sum(m.size for m in masks)} words needed, the plan holds "
                                   f"{self._counters}")
            for i, m in enumerate(masks):
                aux[seq_off + SEQ_WORDS * i + 7] = at
                f[at:at + m.size] = m.reshape(-1)
                at += m.size
        if rtab is not None:
            self.rope.view()[:rtab.size] = rtab
        self.batch_words = words
        return rows

    def decode_columns(self, n: int) -> tuple:
        """Views of the aux's first ``n`` records' words 0, 4, 5, 6 and 10 (cached keys, chunk,
        block-table offset, first key, rotary position), as fill_batch laid them out (its
        header: ``_batch_head``); kept for the next call."""
        where = self._batch_head[1][0], n
        cols = self._decode_cols
        if cols is None or cols[0] != where:
            recs = self.aux.view()[where[0]:where[0] + SEQ_WORDS * n].reshape(n, SEQ_WORDS)
            cols = self._decode_cols = where, tuple(recs[:, j] for j in (0, 4, 5, 6, 10))
        return cols[1]

    def fill_decode_step(self, q, k, v, past: list, ends: list, rope: RoPE | None = None, tables=None,
                         words=None, window: int | None = None) -> None:
        """fill_batch of the next step of a batch decode this plan's aux still holds (the
        caller's to know: vkattn.paged's steady memo, which checks ``_batch_head`` and
        ``batch_words`` are the ones its call left): the same sequences, one new row each fused
        into the dispatch, the same scale, variant (``window`` its window) and causality. Only each
        record's length words (0: cached keys; 10: the row's rotary position), its chunk (4) and
        first key (6) -- split_keys of ``past + 1`` keys, as _batch_words computes them -- and the
        rotary rows change, and with ``tables`` or ``words`` the block tables; each is written
        whole, whatever the aux held. past: (B,) list of each sequence's length before its new
        row; ends: past + 1; tables: None (as the aux holds them) or (the tables' words in batch
        order, free words after each allowed, each table's offset: record word 5), the caller
        having checked they fit below the counters; words: None or [(aux index, value)], single
        table words (a block appended where a table has a free word after it). The record
        columns are written through views kept for the next step (decode_columns)."""
        self._put_inputs(q, k, v)
        c0, c4, c5, c6, c10 = self.decode_columns(len(past))
        c0[:] = past
        c10[:] = c0                         # (from the column: half the time of another list's conversion)
        # split_keys(e, 1, window, splits) of each sequence's e keys, inlined as _batch_words has it (a
        # call a sequence cost 9 us at B=16): first key max(0, e - window), span min(e, window) >= 1
        spans = ends
        if window is not None:
            c6[:] = [e - window if e > window else 0 for e in ends]
            spans = [e if e < window else window for e in ends]
        splits = self.cfg.splits
        c4[:] = spans if splits == 1 else decode_chunks(spans, splits)
        if tables is not None:
            flat, offsets = tables
            free = offsets[0]
            self.aux.view()[free:free + len(flat)] = np.frombuffer(flat, np.uint32)
            c5[:] = offsets
        if words is not None:
            aux = self.aux.view()
            for i, b in words:
                aux[i] = b
        if self.rope_dim:
            t = rope.table(past, self.rope_dim).ravel()
            self.rope.view()[:t.size] = t

    def _batch_words(self, past, counts, tables, splits, window, free, rope, first: bool = False,
                     tabs=None) -> tuple:
        """fill_batch's per-sequence words: (records, block tables) as uint32 arrays and the
        rotary rows (float32, flattened; None without rotation). ``first``: the new rows were
        appended first (each record's past counts them, its n_new is 0). ``tabs``: the block
        tables' words, known (an earlier call's with these tables): not built again."""
        recs, start, bt = array("I"), 0, free
        put = recs.extend
        # split_keys with key_lo 0 (p + n >= 1) without a window: every key from 0, decode_chunks' chunk
        chunks = decode_chunks(list(map(add, past, counts)), splits) if window is None else None
        for i, (p, n, t) in enumerate(zip(past, counts, tables)):
            if window is None:
                kstart, chunk = 0, chunks[i]
            else:
                kstart, chunk = split_keys(p + n, n, window, splits)
            put((p + n, 0, start, n, chunk, bt, kstart, 0, start, start, p, 0) if first else
                (p, n, start, n, chunk, bt, kstart, 0, start, start, p, 0))
            start += n
            bt += len(t)
        rtab = None
        if self.rope_dim:                   # rows 0 .. rows - 1: the positions p .. p + n - 1 of each
            positions = past if start == len(past) else [i for p, n in zip(past, counts) for i in range(p, p + n)]
            rtab = rope.table(positions, self.rope_dim).ravel()
        if tabs is None:
            tabs = np.frombuffer(array("I", chain.from_iterable(tables)), np.uint32)
        return np.frombuffer(recs, np.uint32), tabs, rtab

    def _put_inputs(self, q, k, v) -> tuple:
        """fill()'s numpy q, k, v into the plan's host copies (device arrays are read where they
        lie); (rows of q, rows of k: 0 without). The aux block is the caller's to write: the
        simple call's memo of it is dropped."""
        self._simple = None
        return self._copy_inputs(q, k, v)

    def _copy_inputs(self, q, k, v) -> tuple:
        """_put_inputs' copies (fill_simple's too, which keeps its memo). Three numpy arrays of
        the shapes of the last such call, whose rows were unpadded: three assignments through
        the views that call kept (``_dst3``; a decode loop's every call: 1.5 us instead of 3.3
        at B=1)."""
        numpy = type(q) is np.ndarray and type(k) is np.ndarray and type(v) is np.ndarray
        if numpy:
            shapes = (q.shape, k.shape, v.shape)
            kept = self._dst3
            if kept is not None and kept[0] == shapes:
                kept[1][...] = q
                kept[2][...] = k
                kept[3][...] = v
                return shapes[0][1], shapes[1][1]
        for i, x in enumerate((q, k, v)):
            if isinstance(x, np.ndarray):
                self._put_input(i, x)
        if numpy:                           # the views _put_input kept, where every one has one
            views = [self._dst.get((i, x.shape)) for i, x in enumerate((q, k, v))]
            self._dst3 = None if any(x is None for x in views) else (shapes, *views)
        return self._rows(q), (0 if k is None else self._rows(k))   # this call's counts (<= the plan's)

    def _put_input(self, i: int, x: np.ndarray) -> None:
        """Input ``i`` (0 q, 1 new K rows, 2 new V rows; (h, n, d) float32) into its host copy:
        where its rows are unpadded, through a view of the copy with x's shape, kept for the next
        call of that shape (one assignment); padded rows through put_rows."""
        view = self._dst.get((i, x.shape))
        if view is None:
            c = self.c
            buf, width = ((self.q, c._dk4), (self.nk, c._dk4), (self.nv, c._dv4))[i]
            width *= c._ch * 4
            if x.shape[2] != width:
                put_rows(buf, x, width)
                return
            if len(self._dst) >= 12:
                self._dst.clear()
                self._dst3 = None
            view = self._dst[(i, x.shape)] = buf.view()[:x.size].reshape(x.shape)
        view[...] = x

    def _put_head(self, q_lens: tuple, causal: bool, scale: float, variant: Variant, rows: int, nn: int) -> tuple:
        """The header words (in ``_header``: fill writes them to aux last, after a mask's flag)
        and the (sequence, query tile) list of a call whose sequences have ``q_lens`` query rows;
        returns (first record word, first tile word, first free word: the block tables and masks)."""
        c, cfg = self.c, self.cfg
        aux = self.aux.view()
        tiles = self._tiles.get(q_lens)
        if tiles is None:                 # (sequence, query tile) per workgroup row, memoised
            tiles = np.asarray([(i, t) for i, n in enumerate(q_lens) for t in range(cfg.qtiles(n))],
                               np.uint32).ravel()
            if len(self._tiles) > 64:
                self._tiles.clear()
            self._tiles[q_lens] = tiles
        seq_off = HEADER
        tile_off = seq_off + SEQ_WORDS * len(q_lens)
        ntiles = len(tiles) // 2
        alibi_off = tile_off + 2 * ntiles
        free = alibi_off + (self.hq if variant.alibi is not None else 0)
        self._header[:18] = (len(q_lens), int(causal), _f32_bits(scale * _LOG2E), 0, c._head_stride,
                             c._block_stride, c._block_size, variant.window or 0, variant.n_sink,
                             _f32_bits((variant.softcap or 0.0) * _LOG2E), rows, max(nn, 1), seq_off,
                             tile_off, ntiles, alibi_off, 0, self._counters)
        aux[tile_off:alibi_off] = tiles
        if variant.alibi is not None:
            aux.view(np.float32)[alibi_off:free] = variant.alibi * np.float32(_LOG2E)
        return seq_off, tile_off, free

    def destroy(self) -> None:
        for key in list(self._binds):
            self._drop_bind(key)
        self._simple, self._batch_head, self._decode_cols = None, None, None
        self._dst, self._dst3 = {}, None    # no view of a freed buffer kept
        destroy(*self._chains.values(), *self._masked.values(), *self._mask_progs.values())
        self._chains.clear()
        self._masked.clear()
        self._mask_progs.clear()
        destroy(self.rec, self._rec_out, self.attn, self.q, self.nk, self.nv, self.aux, self.out, self.lse, self.part,
                self.ml, self.rope)


def kept(memo: OrderedDict, key, keep: int, alive, build):
    """``memo[key]`` where it is there and ``alive()`` (a program or recording whose buffers and
    pipelines still exist), else ``build()`` kept there (a dead one destroyed); the ``keep`` most
    recently used are kept, the others destroyed."""
    hit = memo.get(key)
    if hit is not None and alive():
        memo.move_to_end(key)
        return hit
    if hit is not None:
        destroy(memo.pop(key))
    hit = memo[key] = build()
    while len(memo) > keep:
        destroy(memo.pop(next(iter(memo))))
    return hit


def mask_program(dev, src, aux, shape: tuple, seq: int):
    """mask_copy.comp: the DeviceArray buffer ``src`` of ``shape`` ((s, C) or (heads, s, C)) into
    ``aux`` for sequence record ``seq``: a grid-stride loop over at most 256 workgroups (8 on a
    CPU driver, whose every workgroup is a call of its own)."""
    heads = shape[0] if len(shape) == 3 else 1
    groups = min(grid_groups(heads * shape[-2] * shape[-1], dev), 8 if dev.backend.software else 256)
    pipe = Pipeline("mask_copy", "mask_copy", {}, (WORKGROUP, shape[-1], heads, seq), (groups, 1, 1), 2)
    return dev.backend.program(compile_shader(pipe.shader, pipe.defines), [src, aux], pipe.groups, pipe.spec,
                               writes=(1,), name="mask_copy")


def decode_chunks(spans: list, splits: int) -> list:
    """split_keys' chunk of each span (keys a sequence's splits cover, >= 1): max(ceil(n /
    splits), min(MIN_CHUNK, n)), by cases -- n up to MIN_CHUNK, MIN_CHUNK up to MIN_CHUNK *
    splits, ceil(n / splits) past that -- without a max() call a span (a steady batch decode
    step's; at B=16 the max() form cost 4.4 us, this 1.5)."""
    most = MIN_CHUNK * splits
    return [n if n <= MIN_CHUNK else MIN_CHUNK if n <= most else -(-n // splits) for n in spans]


def split_keys(total: int, q_len: int, window: int | None, splits: int, key_lo: int = 0) -> tuple:
    """(kstart, chunk): the first key the splits of a sequence of ``total`` keys cover (from
    ``key_lo``, past any row's window) and the keys per split (at least MIN_CHUNK, or all of them
    when fewer)."""
    kstart = key_lo if window is None else max(key_lo, total - q_len + 1 - window)
    span = max(total - kstart, 1)
    return kstart, max(-(-span // splits), min(MIN_CHUNK, span))


def set_storage(c) -> None:
    """Storage format of a cache's dtype (vkattn.formats.FORMATS): float vec4 per 16-byte storage
    word (``_ch``), words per K/V row (``_dk4``/``_dv4``), the shader defines, the largest |x|
    accepted from numpy (``_max_abs``: (limit, dtype) or None) and whether attn_coopmat.comp may
    take it (``_matrices``). float32: 4 per word; float16 and bfloat16: 8 (two per uint32); int8:
    16 (four per uint32) plus one float32 scale per row (common.glsl); fp8: 16 (four per uint32),
    ``_fp8`` set, a float32 scale per kv head for K and for V (the cache's ``_scales``); q4: 32
    (one block) per data word, ``_q4`` set, ``_rk4``/``_rv4`` the stored words per row (data and
    parameter words; ``_dk4``/``_dv4`` count the data words, as the kernels' value layout)."""
    fmt = FORMATS[c.dtype]
    c._fmt = fmt
    c._f16, c._i8, c._bf16 = c.dtype == "float16", c.dtype == "int8", c.dtype == "bfloat16"
    c._fp8 = fmt.head_scale
    c._ch = fmt.ch
    c._dk4 = -(-c.head_dim // fmt.per_word)
    c._dv4 = -(-c.v_head_dim // fmt.per_word)
    c._q4 = fmt.block_scale
    c._rk4, c._rv4 = fmt.row_words(c._dk4), fmt.row_words(c._dv4)   # stored words per row
    c._defines = dict(fmt.defines)
    c._matrices = fmt.matrices
    c._max_abs = None if fmt.max_abs is None else (fmt.max_abs, fmt.name)
    rope = getattr(c, "rope", None)     # keys its RoPE rotates: their pairs are checked (checks.check_rotated)
    c._rotary = None if rope is None or fmt.rotation_room else (rope.dim(c.head_dim), rope.style)


class StorageFormat:
    """What set_storage derives for a cache -- head dims, dtype, rope, block size -- without a
    device or buffers: the format ``perf gpu`` plans pipelines for. ``block_size``: a
    KVCache's capacity, a PagedKVCache's block size (a spec constant of append and gather)."""

    def __init__(self, num_kv_heads: int, head_dim: int, v_head_dim: int | None = None,
                 dtype: str = "float16", block_size: int = 1, rope: RoPE | None = None):
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.dtype, self.rope, self._block_size = dtype, rope, block_size
        self._rope_dim = rope.dim(head_dim) if rope else 0
        set_storage(self)


def token_bytes(c) -> int:
    return c.num_kv_heads * (16 * (c._rk4 + c._rv4) + (8 if c._i8 else 0))


def unpack_rows(c, words: np.ndarray, scales, d: int) -> np.ndarray:
    """Stored words (..., d4*4) uint32 -> float32 (..., d) values as the kernels see them.
    q4: words (..., rows words * 4) hold the block parameter words themselves. ``scales``: int8 (...) per row; fp8 the (num_kv_heads,) scales of K or V, words (n,
    num_kv_heads, d4*4); otherwise unused."""
    if c._fp8:
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            return fp8_to_float32(words.view(np.uint8)[..., :d], c.dtype) * scales[:, None]
    if c._i8:
        return words.view(np.int8)[..., :d].astype(np.float32) * scales[..., None]
    if c._q4:
        return q4_words_to_float32(words, d)
    if c._bf16:
        return bfloat16_to_float32(words.view(np.uint16)[..., :d])
    vals = words.view(np.float16) if c._f16 else words.view(np.float32)
    return vals[..., :d].astype(np.float32)


def _f32_bits(x: float) -> int:
    return int(np.float32(x).view(np.uint32))


def grid_groups(invocations: int, device) -> int:
    """Workgroups of WORKGROUP threads along x for a grid-stride loop over ``invocations``
    (at least 1, at most the device's x limit; the shader loops over the rest)."""
    return max(1, min(-(-invocations // WORKGROUP), device.max_workgroup_count[0]))


def aux_bucket(words: int) -> int:
    """Aux buffer size for ``words``: a power of two, so growing masks or tables rebuild rarely."""
    return max(256, 1 << (int(words) - 1).bit_length())


def put_rows(buf, x: np.ndarray, padded: int) -> None:
    """Write x (h, n, d) float32 into buf viewed as (h, n, padded), zeros in the padding (the
    buffer may be shared scratch that another layout wrote before)."""
    h, n, d = x.shape
    rows = buf.view()[: h * n * padded].reshape(h, n, padded)
    rows[:, :, :d] = x
    if d < padded:
        rows[:, :, d:] = 0


def destroy(*objs) -> None:
    for o in objs:
        if o is not None:
            o.destroy()
