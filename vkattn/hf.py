"""vkattn inside Hugging Face transformers: the attention implementation ``"vkattn"`` and
:class:`VkattnCache`, a transformers ``Cache`` whose K/V live in vkattn caches on the Vulkan device.

    import vkattn.hf                                  # registers attn_implementation="vkattn"
    model.set_attn_implementation("vkattn")           # or from_pretrained(..., attn_implementation="vkattn")
    cache = vkattn.hf.VkattnCache(model.config, max_cache_len=prompt_len + max_new_tokens)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=max_new_tokens)

Shapes use fixed symbols: ``batch`` (sequences the model runs: prompts x beams x returned
sequences), ``num_qo_heads``, ``num_kv_heads``, ``head_dim``, ``n`` (new tokens of a call),
``positions`` (positions seen so far, padding included).

One step, one submission per layer. A transformers attention module calls
``cache.update(k, v, layer_idx)`` and then the attention function. ``update`` only checks the new
rows (and that they fit) and stages them; the attention function recognises them (the keys it is
given are the staged tensor itself) and runs one vkattn ``forward`` -- the append fused with the
attention -- on that layer's cache. K/V go to the device once and never come back; only the
attention output does. Whatever needs the cache state between an ``update`` and its attention
(another update, crop, reorder) appends the staged rows first.

Storage. Batch 1 uses a :class:`vkattn.KVCache` per layer; larger batches a
:class:`vkattn.PagedKVCache` per layer, one sequence per row, so rows of a left-padded batch have
their own (ragged) lengths: padding is never stored, hence never attended, and a decode step
needs no mask. Beam search's reorder and batch selection fork and drop sequences (full blocks are
shared, not copied). A one-sequence paged pool was measured 10-15% slower per decode step than a
KVCache on lavapipe, hence the two stores.

Prefix cache across generate() calls (``VkattnCache(..., prefix_cache=True)``): every layer keeps
a PagedKVCache whose full blocks are cached under a hash of their token ids (vkattn.paging).
Before a generate(), ``cache.match_prefix(input_ids)`` keeps the longest cached prefix of the new
input_ids in the cache -- from the request before or any earlier one whose blocks are still cached
-- and generate() then computes only the rest: transformers starts from ``get_seq_length()`` and
slices the input_ids it is given. The cache learns which token ids it computed only from
``cache.record_tokens(out.sequences)`` after generate() -- what generate() actually ran, prompt
and reply -- so nothing becomes reusable without it, and ids that disagree with what the cache
matched are refused.

RoPE is applied by the model before ``update``, so the caches hold rotated keys (no vkattn rope).
Score variants come from the call: ``scaling`` (Gemma-2's ``query_pre_attn_scalar``),
``softcap`` and ``sliding_window`` (falling back to the layer type in the config); transformers'
window keeps key j for query p when ``p - j < sliding_window``, which is vkattn's ``window``.
float32 and float16 tensors are handed over as they are (zero-copy views where the layout
allows); other dtypes (bfloat16) are converted to float32 at the boundary, and the output is
returned in the query's dtype.
"""
from __future__ import annotations

import json
import threading

import numpy as np

try:
    import torch
    import transformers
    from transformers import AttentionInterface, AttentionMaskInterface
    from packaging.version import Version
    from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs
except ImportError as e:            # the extra is not installed
    raise ImportError(
        f"vkattn.hf needs torch and transformers 5.x, which are not importable here ({e}). Install them "
        f"into this environment: pip install torch 'transformers>=5.23,<6'  (or: pip install 'vkattn[hf]')"
    ) from e

from . import KVCache, PagedKVCache, persist
from .checks import check_bool, check_int
from .device import Device
from .errors import CacheFileCorruptError, CacheFileMismatchError, CacheFullError
from .formats import DTYPES, dtype_list
from .paging import check_token_ids

TRANSFORMERS_MIN = (5, 23)       # pyproject.toml's hf extra: the cache-layer API this module implements


def _release(version: str) -> tuple:
    """(major, minor) of a version string such as '5.23.0' or '5.24.0.dev0' (packaging: a
    dependency of transformers)."""
    return (Version(version).release + (0,))[:2]


if not TRANSFORMERS_MIN <= _release(transformers.__version__) < (6, 0):
    raise ImportError(f"vkattn.hf needs transformers >= {'.'.join(map(str, TRANSFORMERS_MIN))}, < 6 (its cache "
                      f"layers and attention interface); found {transformers.__version__}: "
                      f"pip install 'transformers>=5.23,<6'")

NAME = "vkattn"
BLOCK_SIZE = 16                  # paged stores: tokens per block
_CACHE_DTYPES = {torch.float16: "float16", torch.float32: "float32", torch.bfloat16: "bfloat16"}
for _name, _fmt in (("float8_e4m3fn", "fp8_e4m3"), ("float8_e5m2", "fp8_e5m2")):    # torch >= 2.1
    if hasattr(torch, _name):
        _CACHE_DTYPES[getattr(torch, _name)] = _fmt
_HOST_DTYPES = (torch.float32, torch.float16)      # handed to vkattn as they are
_PENDING = threading.local()     # .layer: the layer whose update() staged rows for the next attention call

__all__ = ["VkattnCache", "VkattnLayer", "vkattn_attention", "NAME"]


class VkattnCache(Cache):
    """A transformers ``Cache`` for ``generate(past_key_values=...)`` whose K/V live on a Vulkan
    device, one vkattn cache per model layer, each allocated once for ``max_cache_len`` positions
    of ``batch_size`` sequences.

    config: the model's config (its text config gives layers, kv heads, head_dim, layer types).
    max_cache_len: positions per sequence, padding included -- at least the padded prompt length
    plus ``max_new_tokens``; a call that would pass it raises :class:`vkattn.CacheFullError`
    before anything is written. batch_size: the most sequences the model runs at once (prompts x
    ``num_beams`` or ``num_return_sequences``); an empty cache also takes fewer. dtype: storage,
    "float16" (default), "float32", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2" or "q4" (or torch.float16
    / torch.float32 / torch.bfloat16 / torch.float8_e4m3fn / torch.float8_e5m2), whatever the
    model's dtype. k_scale, v_scale: fp8 only, the scales of every layer (a number or
    (num_kv_heads,) numbers, default 1.0; vkattn.KVCache). device: a :class:`vkattn.Device` (default:
    vkattn's default device).

    Works with the attention implementation ``"vkattn"`` only (``import vkattn.hf`` registers
    it). ``update`` returns the new rows unchanged: the cached K/V are never materialised on
    the host. ``reset()`` empties the cache for the next ``generate()`` and keeps its Vulkan
    pipelines, which a new cache builds again on first use (per layer). ``close()`` frees the
    device memory.

    prefix_cache: reuse K/V across generate() calls (a chat that resends its history computes
    only the new turn): every layer's store is a PagedKVCache (batch 1 too) whose full blocks are
    cached by token ids; before each generate() call :meth:`match_prefix` with its input_ids, and
    after it :meth:`record_tokens` with the sequences it returned (the blocks it computed become
    reusable then). A cache serves one model: equal token ids must mean equal K/V.
    prefix_cache_len: extra positions of pool room (beyond ``batch_size`` x ``max_cache_len``)
    that keep blocks of earlier requests cached while the current one runs; without it, what the
    current request does not use stays cached, evicted least recently used first.
    """

    def __init__(self, config, max_cache_len: int, batch_size: int = 1, dtype="float16",
                 device: Device | None = None, prefix_cache: bool = False, prefix_cache_len: int = 0, *,
                 k_scale=None, v_scale=None):
        if not isinstance(config, transformers.PretrainedConfig):
            raise TypeError(f"config: expected a transformers PretrainedConfig (model.config), got "
                            f"{type(config).__name__}")
        max_cache_len = check_int("max_cache_len", max_cache_len, 1)
        batch_size = check_int("batch_size", batch_size, 1)
        self.prefix_cache = check_bool("prefix_cache", prefix_cache)
        prefix_cache_len = check_int("prefix_cache_len", prefix_cache_len, 0)
        if prefix_cache_len and not self.prefix_cache:
            raise ValueError(f"prefix_cache_len: room for cached blocks needs prefix_cache=True, got "
                             f"prefix_cache_len={prefix_cache_len} with prefix_cache=False")
        if isinstance(dtype, torch.dtype):
            dtype = _CACHE_DTYPES.get(dtype, str(dtype))
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise TypeError(f"dtype: expected {dtype_list()} (torch.float16 / torch.float32 / torch.bfloat16 / "
                            f"torch.float8_e4m3fn / torch.float8_e5m2), "
                            f"got {dtype!r}; bfloat16 models work with any of them (converted at the boundary)")
        text = config.get_text_config(decoder=True)
        hq = text.num_attention_heads
        self.num_kv_heads = getattr(text, "num_key_value_heads", None) or hq
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // hq
        self.max_cache_len, self.max_batch_size, self.dtype = max_cache_len, batch_size, dtype
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
        bad = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
        if bad:
            raise ValueError(f"config: layer types {bad} are not supported by vkattn.hf (full and sliding-window "
                             f"attention layers are)")
        layers = []
        try:
            for kw in layer_kwargs:
                if batch_size == 1 and not self.prefix_cache:
                    store = _SingleStore(batch_size, max_cache_len, self.num_kv_heads, self.head_dim, dtype, device,
                                         scales=(k_scale, v_scale))
                else:
                    store = _PagedStore(batch_size, max_cache_len, self.num_kv_heads, self.head_dim, dtype, device,
                                        extra_blocks=-(-prefix_cache_len // BLOCK_SIZE), scales=(k_scale, v_scale))
                layers.append(VkattnLayer(self, store, kw.get("sliding_window")))
        except BaseException:
            for layer in layers:
                layer.close()
            raise
        super().__init__(layers=layers)
        self._mask_memo = (None, 0, None)       # (2-D mask, positions, its leading pads): one scan per forward
        # rows reordered, selected or repeated since match_prefix / reset / load (beam search,
        # num_return_sequences): a row then holds another row's past, and record_tokens cannot
        # say which ids its positions hold
        self._rows_moved = False

    @property
    def nbytes(self) -> int:
        """Device bytes held by every layer's K/V, fixed at construction."""
        return sum(layer._store.nbytes for layer in self.layers)

    def close(self) -> None:
        """Free every layer's device memory; the cache cannot be used afterwards."""
        for layer in self.layers:
            layer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def save(self, path, token_ids=None) -> None:
        """Write every layer to the file ``path`` (safetensors, one file for all layers; layout in
        vkattn.persist): each row's K/V exactly as stored, each layer's positions, padding and
        window, the storage settings and a checksum. ``token_ids``: optional (batch, positions)
        integers, the tokens of the positions seen, padding included (after ``generate``:
        ``out.sequences[:, :cache.get_seq_length()]``), returned by :meth:`load`. Rows an
        ``update`` staged whose attention never ran are appended first; nothing else changes."""
        path = persist.check_path(path)
        for layer in self.layers:
            layer._flush()
        first = self.layers[0]
        ids = persist.check_token_ids(token_ids, (first.batch_size, first._seen))
        tensors, layers = {}, []
        for i, layer in enumerate(self.layers):
            for b, (kv, slots) in enumerate(layer._store.row_slots()):
                tensors.update(persist.stored_tensors(kv, slots, f"layers.{i}.rows.{b}."))
            layers.append({"seen": layer._seen, "pad": layer._pad.tolist(), "window": layer.window})
        if ids is not None:
            tensors["token_ids"] = ids
        meta = dict(persist.format_meta(first._store.kv), layers=json.dumps(layers), batch=first.batch_size,
                    max_cache_len=self.max_cache_len)
        persist.write_file(path, persist.HF_CACHE, meta, tensors)

    def load(self, path):
        """Replace every layer's contents with a file :meth:`save` wrote (this device or another;
        the other cache built from a model config with the same layers, kv heads, head_dim and
        windows, and the same storage dtype), bit for bit as stored: ``generate`` then goes on
        from the saved positions as the saved cache would. The file must be intact
        (vkattn.CacheFileCorruptError), match (vkattn.CacheFileMismatchError, naming the
        setting) and fit: positions <= max_cache_len and rows <= batch_size (CacheFullError).
        Every check runs before anything is written: on any error the cache is unchanged.
        Returns the token ids saved with it, (batch, positions) int64, or None; with
        ``prefix_cache`` the cache records them (as :meth:`record_tokens`), so a later
        :meth:`match_prefix` reuses the loaded positions."""
        path = persist.check_path(path)
        meta, tensors = persist.read_file(path, (persist.HF_CACHE,))
        persist.check_format(meta, self.layers[0]._store.kv, path)
        batch = persist.meta_int(meta, "batch", path, 1)
        layers = _layer_specs(meta, batch, path)
        if len(layers) != len(self.layers):
            raise CacheFileMismatchError(f"{path}: {len(layers)} layers in the file, {len(self.layers)} in this cache",
                                         "num_layers")
        if batch > self.max_batch_size:
            raise CacheFullError(f"{path}: holds {batch} rows; this cache was built with batch_size="
                                 f"{self.max_batch_size}; nothing was written")
        want = {}
        for i, ((seen, pad, window), layer) in enumerate(zip(layers, self.layers)):
            if window != layer.window:
                raise CacheFileMismatchError(f"{path}: layer {i} has sliding window {window} in the file, "
                                             f"{layer.window} in this cache", "window")
            if seen > self.max_cache_len:
                raise CacheFullError(f"{path}: layer {i} holds {seen} positions, more than max_cache_len="
                                     f"{self.max_cache_len}; nothing was written")
            for b in range(batch):
                want.update(persist.expected_tensors(layer._store.kv, seen - pad[b], f"layers.{i}.rows.{b}."))
        persist.check_tensors(tensors, want, path, {"token_ids": (np.dtype(np.int64), (batch, layers[0][0]))})
        ids = tensors.get("token_ids")
        learn = self.prefix_cache and ids is not None and ids.shape[1] > 0
        if learn:
            self._check_ids("token_ids", ids)       # what record_tokens takes, before anything is written
        try:
            for i, ((seen, pad, _), layer) in enumerate(zip(layers, self.layers)):
                layer._restore(seen, pad, tensors, f"layers.{i}.rows.")
        except BaseException:           # a device failure part-way: an empty cache, not a mixed one
            self.reset()
            raise
        self._mask_memo = (None, 0, None)
        self._rows_moved = False
        if learn:
            self.record_tokens(ids)
        return ids

    def __repr__(self) -> str:
        return (f"VkattnCache(layers={len(self.layers)}, max_cache_len={self.max_cache_len}, batch_size="
                f"{self.max_batch_size}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self.dtype!r}, seq_length={self.get_seq_length()})")

    # -------------------------------------------------------------- prefix cache
    def match_prefix(self, input_ids) -> int:
        """Before a generate() call with ``input_ids`` (batch, n) -- a torch or numpy integer array,
        or one row of ids -- keep the longest prefix of them that the cache holds K/V of, and
        return its length: generate() then computes only the other ``n - length`` positions
        (transformers starts from ``get_seq_length()``). Whole blocks of BLOCK_SIZE tokens, the
        same count for every row (the least any row has), at most ``n - 1``: the last position is
        always computed, for its logits. Blocks come from the previous request or any earlier one
        whose blocks are still cached. Rows are the rows generate() runs: no padding, no
        expansion for num_beams / num_return_sequences. Needs ``prefix_cache=True``.

        Raises ValueError (bad ids, too many rows, no prefix cache) or CacheFullError (n >
        max_cache_len) before anything changes."""
        rows = self._check_ids("input_ids", input_ids)
        if not self.prefix_cache:
            raise ValueError("prefix_cache: match_prefix needs a cache built with VkattnCache(..., prefix_cache=True)")
        if len(rows) > self.max_batch_size:
            raise ValueError(f"input_ids: {len(rows)} rows, but the cache was built with batch_size={self.max_batch_size}")
        if len(rows[0]) > self.max_cache_len:
            raise CacheFullError(f"input_ids: {len(rows[0])} positions > max_cache_len={self.max_cache_len}; nothing "
                                 f"was changed")
        for layer in self.layers:
            layer._flush()
        kept = min(min(layer._store.rematch(rows)) for layer in self.layers)
        for layer in self.layers:
            layer._store.truncate([kept] * len(rows))
            layer._staged = None
            layer._seen = kept
            layer._pad = np.zeros(len(rows), np.int64)
        self._mask_memo = (None, 0, None)
        self._rows_moved = False
        return kept

    def record_tokens(self, sequences) -> None:
        """After generate(): the token ids of the positions the cache holds, e.g. ``out.sequences``
        (batch, positions >= get_seq_length(); ids past the cache's positions -- the last
        generated token -- are ignored; a row's leading padding is skipped). The full blocks they
        complete become cacheable: the next :meth:`match_prefix` can reuse the prompt and the
        reply. Ids the cache already knows (the prefix match_prefix kept) must agree: ValueError
        naming the row and position, before anything changes."""
        rows = self._check_ids("sequences", sequences)
        if not self.prefix_cache:
            raise ValueError("prefix_cache: record_tokens needs a cache built with VkattnCache(..., prefix_cache=True)")
        if self._rows_moved:
            raise ValueError("sequences: generate() reordered, selected or repeated the cache's rows (beam search, "
                             "num_beams / num_return_sequences > 1): a row's positions hold another row's past, so "
                             "the ids of out.sequences do not name them and nothing is recorded. The prefix cache "
                             "learns from greedy or sampled generate() calls of one sequence per row")
        for layer in self.layers:
            layer._flush()
        seen = self.layers[0]._seen
        if len(rows) != self.layers[0].batch_size or len(rows[0]) < seen:
            raise ValueError(f"sequences: expected ({self.layers[0].batch_size}, >= {seen}) ids (rows and positions "
                             f"the cache holds), got ({len(rows)}, {len(rows[0])})")
        plans = []
        for layer in self.layers:
            store = layer._store
            for b, sid in enumerate(store.ids):
                ids = rows[b][int(layer._pad[b]):layer._seen]
                known = store.pool.token_ids(sid)
                if ids[:len(known)] != known:
                    at = next(i for i, (x, y) in enumerate(zip(ids, known)) if x != y)
                    raise ValueError(f"sequences[{b}, {at + int(layer._pad[b])}]: the cache computed token id {known[at]} "
                                     f"there, got {ids[at]}")
                plans.append((store.pool, sid, ids))
        for pool, sid, ids in plans:
            pool.set_token_ids(sid, ids)

    @staticmethod
    def _check_ids(name, ids) -> list:
        """(batch, n) token ids (torch, numpy or nested lists; one 1-D row allowed) as lists of int, n >= 1."""
        if torch.is_tensor(ids):
            ids = ids.detach().cpu().numpy()
        arr = np.asarray(ids) if not isinstance(ids, np.ndarray) else ids
        if arr.ndim == 1:
            arr = arr[None]
        if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
            raise ValueError(f"{name}: expected token ids of shape (batch, n) with batch, n >= 1, got shape {arr.shape}")
        return [check_token_ids(f"{name}[{b}]", row) for b, row in enumerate(arr)]

    def _rollback(self, positions: int) -> None:
        """After a failed call: every layer that took the step back to ``positions``."""
        for layer in self.layers:
            if layer._seen > positions:
                layer._truncate(positions)

    def _leading_pads(self, mask, rows: int, positions: int) -> np.ndarray:
        """Leading padding positions of each row of a 2-D ``attention_mask`` (batch, positions),
        checked to be left padding; memoised for the mask object every layer of a forward gets."""
        memo, memo_positions, lead = self._mask_memo
        if memo is mask and memo_positions == positions:
            return lead
        if not (torch.is_tensor(mask) and mask.ndim == 2 and mask.dtype == torch.bool):
            raise ValueError(f"attention_mask: vkattn takes a 2-D padding mask (batch, positions); got "
                             f"{_describe(mask)} (a 4-D or custom mask cannot be honoured by a ragged cache)")
        if tuple(mask.shape) != (rows, positions):
            raise ValueError(f"attention_mask: expected shape ({rows}, {positions}) (batch, positions seen "
                             f"including this call), got {tuple(mask.shape)}")
        keep = mask.detach().cpu().numpy()
        lead = positions - keep.sum(axis=1)
        left = np.arange(positions)[None, :] >= lead[:, None]
        if not np.array_equal(keep, left):
            row = int(np.flatnonzero((keep != left).any(axis=1))[0])
            raise ValueError(f"attention_mask: row {row} masks a position after an unmasked one; vkattn.hf "
                             f"takes left padding only (padding is not stored)")
        self._mask_memo = (mask, positions, lead)
        return lead


class VkattnLayer(CacheLayerMixin):
    """One model layer of a :class:`VkattnCache`: a vkattn store plus the host bookkeeping --
    positions seen (padding included) and each row's leading padding, which is not stored, so
    row b holds ``positions - pad[b]`` tokens."""

    is_compileable = False
    is_croppable = True

    def __init__(self, owner: VkattnCache, store, sliding_window: int | None):
        super().__init__()
        self._owner, self._store = owner, store
        self.window = sliding_window
        self.is_sliding = sliding_window is not None
        self.max_cache_len = owner.max_cache_len
        self._seen = 0
        self._pad = np.zeros(store.rows, np.int64)
        self._staged = None                 # (k, v) of an update() whose attention has not run
        self._full_counts = {}              # (batch, n) -> np.full(batch, n), read-only (attend)
        self.is_initialized = True

    # -------------------------------------------------------------- transformers' layer API
    @property
    def batch_size(self) -> int:
        return len(self._pad)

    def lazy_initialization(self, key_states, value_states) -> None:
        """Nothing to do: the device memory was allocated with the cache."""

    def update(self, key_states, value_states, *args, **kwargs):
        """Check and stage ``n`` new positions: key_states (batch, num_kv_heads, n, head_dim),
        value_states alike. Returns them unchanged; the attention function appends them. Raises
        CacheFullError past ``max_cache_len`` and ValueError for a wrong shape or batch, before
        anything changes."""
        self._flush()
        try:
            b, n = self._check_update(key_states, value_states)
        except BaseException:
            self._owner._rollback(self._seen)       # layers that already took this step
            raise
        if b != self.batch_size:                    # an empty cache, checked above
            self._store.reset(b)
            self._pad = np.zeros(b, np.int64)
        self._staged = (key_states, value_states)
        self._seen += n
        _PENDING.layer = self
        return key_states, value_states

    def _check_update(self, key_states, value_states) -> tuple:
        """(batch, n) of an update, checked; an empty cache takes a smaller batch than it was built for."""
        o = self._owner
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            if not torch.is_tensor(x) or x.ndim != 4 or x.shape[1] != o.num_kv_heads or x.shape[3] != o.head_dim:
                raise ValueError(f"{name}: expected (batch, {o.num_kv_heads}, n, {o.head_dim}) from the config, got "
                                 f"{_describe(x)}")
        if key_states.shape[:3] != value_states.shape[:3]:
            raise ValueError(f"value_states: expected the batch and positions of key_states "
                             f"{tuple(key_states.shape[:3])}, got {tuple(value_states.shape[:3])}")
        b, n = key_states.shape[0], key_states.shape[2]
        if b != self.batch_size:
            if b > o.max_batch_size:
                raise ValueError(f"batch_size: this cache holds {self.batch_size} sequences (built with batch_size="
                                 f"{o.max_batch_size}); the model runs {b}. Build it with batch_size = prompts x "
                                 f"num_beams (or num_return_sequences)")
            if self._seen:
                raise ValueError(f"batch_size: this cache holds {self.batch_size} sequences of {self._seen} positions "
                                 f"and the model runs {b}: a cache that holds positions (a prefix match_prefix "
                                 f"kept, an earlier generate()) takes only its own rows -- match_prefix with the "
                                 f"rows generate() runs, or reset() first")
        if self._seen + n > self.max_cache_len:
            raise CacheFullError(f"VkattnCache: {self._seen} positions + {n} new = {self._seen + n} > max_cache_len="
                                 f"{self.max_cache_len}; nothing was written. Build the cache with max_cache_len >= "
                                 f"padded prompt length + max_new_tokens")
        return b, n

    def get_mask_sizes(self, query_length: int) -> tuple:
        return self._seen + query_length, 0

    def get_seq_length(self) -> int:
        """Positions seen, padding included (the staged ones too, as transformers' layers count)."""
        return self._seen

    def get_max_length(self) -> int:
        return self.max_cache_len

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` positions (speculative / assisted decoding);
        ``crop(0)`` does nothing. A positive value is refused, as transformers' own layers do."""
        tokens_to_remove = check_int("tokens_to_remove", tokens_to_remove, -(1 << 62))
        if tokens_to_remove > 0:
            raise ValueError(f"tokens_to_remove: crop takes a negative count of positions to remove, got "
                             f"{tokens_to_remove}")
        self._flush()
        if tokens_to_remove:
            self._truncate(max(0, self._seen + tokens_to_remove))

    def reorder_cache(self, beam_idx) -> None:
        """Row i becomes old row ``beam_idx[i]`` (beam search)."""
        self._select(beam_idx)

    def batch_select_indices(self, indices) -> None:
        """Keep only rows ``indices`` (int indices or a boolean mask over the rows)."""
        if torch.is_tensor(indices) and indices.dtype == torch.bool:
            indices = torch.nonzero(indices).flatten()
        self._select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row ``repeats`` times, in place (row i -> rows i*repeats ..)."""
        self._select(np.repeat(np.arange(self.batch_size), check_int("repeats", repeats, 1)))

    def reset(self) -> None:
        self._owner._rows_moved = False
        self._staged = None
        self._seen = 0
        self._store.reset(self._owner.max_batch_size)
        self._pad = np.zeros(self._store.rows, np.int64)

    def offload(self) -> None:
        """Nothing to do: the K/V stay on the Vulkan device."""

    def prefetch(self) -> None:
        """Nothing to do: the K/V stay on the Vulkan device."""

    def close(self) -> None:
        self._staged = None
        self._store.close()

    # -------------------------------------------------------------- attention
    def attend(self, query, attention_mask, scaling, sliding_window, softcap, dropout, is_causal):
        """Append the staged rows and attend ``query`` (batch, num_qo_heads, n, head_dim) over this
        layer's cache: one vkattn forward. Returns (batch, n, num_qo_heads, head_dim) in the
        query's dtype; query rows at padding positions get zeros. On any error this layer and
        every layer that already took the step are rolled back."""
        k, v = self._staged
        n = k.shape[2]
        past = self._seen - n
        try:
            if dropout:
                raise ValueError(f"dropout: vkattn attention has no dropout (inference only), got {dropout}")
            if not is_causal:
                raise ValueError("is_causal: vkattn.hf attends causally; this module asks for bidirectional attention")
            if not torch.is_tensor(query) or query.ndim != 4 or query.shape[0] != k.shape[0] or query.shape[2] != n:
                raise ValueError(f"query: expected (batch={k.shape[0]}, num_qo_heads, n={n}, head_dim), got "
                                 f"{_describe(query)}")
            pad = self._pad
            if attention_mask is not None:
                lead = self._owner._leading_pads(attention_mask, self.batch_size, self._seen)
                bad = np.flatnonzero(np.minimum(lead, past) != pad)
                if bad.size:
                    raise ValueError(f"attention_mask: row {int(bad[0])} masks {int(lead[bad[0]])} leading positions of "
                                     f"{past} seen, but the cache holds {int(pad[bad[0]])} as padding")
                pad = lead
                counts = n - (pad - self._pad)
                full = bool((counts == n).all())
            else:
                # no mask: every row's n positions are real. The counts array is kept per (batch,
                # n): numpy calls on tiny arrays cost about 10 us each between torch's ops (perf
                # hf, session 26), and a decode call made five of them
                counts, full = self._full_counts.get((self.batch_size, n)), True
                if counts is None:
                    if len(self._full_counts) >= 16:      # prompts of many lengths: stay bounded
                        self._full_counts.clear()
                    counts = self._full_counts[(self.batch_size, n)] = np.full(self.batch_size, n, np.int64)
                    counts.flags.writeable = False
            window = sliding_window if sliding_window is not None else self.window
            if n > 0 if full else counts.any():
                out = self._store.forward(counts, _pack(query, counts, full), _pack(k, counts, full),
                                          _pack(v, counts, full), scale=scaling, window=window, softcap=softcap)
            else:                           # every new position is padding: nothing to store
                out = np.zeros((query.shape[1], 0, v.shape[3]), np.float32)
            out = _unpack(out, counts, query, full)
        except BaseException:
            self._staged = None
            self._seen = past
            self._owner._rollback(past)
            raise
        self._staged = None
        self._pad = pad
        return out

    # -------------------------------------------------------------- internals
    def _flush(self) -> None:
        """Append rows an update() staged whose attention never ran (every row's tokens counted
        as real: no mask came with them)."""
        if self._staged is None:
            return
        k, v = self._staged
        self._staged = None
        counts = np.full(self.batch_size, k.shape[2])
        try:
            self._store.append(counts, _pack(k, counts, True), _pack(v, counts, True))
        except BaseException:
            self._seen -= k.shape[2]
            raise

    def _restore(self, seen: int, pad: list, tensors: dict, prefix: str) -> None:
        """Replace this layer's contents: ``seen`` positions, row b the file tensors
        ``{prefix}{b}.*`` after ``pad[b]`` padding positions (checked by VkattnCache.load)."""
        self._staged = None
        pad = np.asarray(pad, np.int64)
        self._store.restore(seen - pad, tensors, prefix)
        self._seen, self._pad = seen, pad

    def _truncate(self, positions: int) -> None:
        self._staged = None
        self._pad = np.minimum(self._pad, positions)
        self._store.truncate(positions - self._pad)
        self._seen = positions

    def _select(self, rows) -> None:
        rows = np.asarray(rows.detach().cpu() if torch.is_tensor(rows) else rows)
        if rows.ndim != 1 or rows.size == 0 or rows.dtype.kind not in "iu":
            raise ValueError(f"rows: expected a non-empty 1-D sequence of row indices, got {rows!r}")
        if rows.min() < 0 or rows.max() >= self.batch_size:
            raise ValueError(f"rows: indices must lie in [0, {self.batch_size}), got {rows.tolist()}")
        if rows.size > self._owner.max_batch_size:
            raise ValueError(f"batch_size: the cache was built for {self._owner.max_batch_size} sequences; "
                             f"{rows.size} asked for")
        self._flush()
        if rows.size == self.batch_size and (rows == np.arange(rows.size)).all():
            return
        self._store.select(rows.tolist())
        self._pad = self._pad[rows]
        self._owner._rows_moved = True


def vkattn_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                     softcap=None, **kwargs):
    """The attention function registered as ``"vkattn"``: query (batch, num_qo_heads, n,
    head_dim), key/value the rows :meth:`VkattnLayer.update` just staged; attends over the layer's
    vkattn cache and returns ``(attn_output (batch, n, num_qo_heads, head_dim), None)``.
    ``attention_mask`` is what the registered mask function gives: None (no padding) or the 2-D
    padding mask (batch, positions)."""
    layer = getattr(_PENDING, "layer", None)
    _PENDING.layer = None
    if layer is None or layer._staged is None or layer._staged[0] is not key:
        raise TypeError("attn_implementation='vkattn' attends over a vkattn.hf.VkattnCache: pass past_key_values="
                        "vkattn.hf.VkattnCache(model.config, max_cache_len=...) (and use_cache=True)")
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = layer.attend(query, attention_mask, scaling, sliding_window, softcap, dropout, bool(is_causal))
    return out, None


def _padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, use_vmap=False, **kwargs):
    """The mask function registered as ``"vkattn"``: causality and windows are the kernel's, so
    the only mask is padding -- the 2-D bool mask (batch, positions), or None when nothing is
    padded. Custom mask functions (``or_mask_function``/``and_mask_function``) are refused."""
    if use_vmap:
        raise ValueError("attention_mask: custom mask functions (or_mask_function / and_mask_function) are not "
                         "supported by vkattn.hf")
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask


class _SingleStore:
    """Batch 1: one KVCache."""

    def __init__(self, batch_size, capacity, num_kv_heads, head_dim, dtype, device, scales=(None, None)):
        self.cache = self.kv = KVCache(capacity, num_kv_heads, head_dim, dtype=dtype, device=device,
                                       k_scale=scales[0], v_scale=scales[1])
        self.rows = 1
        self.nbytes = self.cache.nbytes

    def row_slots(self):
        """[(vkattn cache, slots of the row's positions)] per row (save)."""
        return [(self.cache, np.arange(self.cache.length))]

    def restore(self, lengths, tensors, prefix):
        """Row 0 becomes the file tensors ``{prefix}0.*`` of ``lengths[0]`` positions (load)."""
        if len(lengths) != 1:
            raise ValueError(f"batch_size: the cache was built with batch_size=1; {len(lengths)} rows asked for")
        self.cache._restore(int(lengths[0]), tensors, f"{prefix}0.")

    def forward(self, counts, q, k, v, **variant):
        return self.cache.forward(q, k, v, **variant)

    def append(self, counts, k, v):
        self.cache.append(k, v)

    def truncate(self, lengths):
        self.cache.truncate(int(lengths[0]))

    def select(self, rows):
        raise ValueError(f"batch_size: the cache was built with batch_size=1; rows {rows} asked for")

    def reset(self, rows):
        self.cache.reset()

    def close(self):
        self.cache.close()


class _PagedStore:
    """Batch > 1: one PagedKVCache, a sequence per row, sized so every row can reach
    ``capacity`` and a reorder can fork every row before the old ones are dropped (one spare
    block per row for a copied partial block)."""

    def __init__(self, batch_size, capacity, num_kv_heads, head_dim, dtype, device, extra_blocks=0,
                 scales=(None, None)):
        blocks = batch_size * (-(-capacity // BLOCK_SIZE) + 1) + extra_blocks
        self.pool = self.kv = PagedKVCache(blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype, device=device,
                                           k_scale=scales[0], v_scale=scales[1])
        self.ids = [self.pool.add_sequence() for _ in range(batch_size)]
        self.nbytes = self.pool.nbytes

    def row_slots(self):
        """[(vkattn cache, slots of the row's positions)] per row (save)."""
        return [(self.pool, self.pool._pool.slots(sid, 0, self.pool.length(sid))) for sid in self.ids]

    def restore(self, lengths, tensors, prefix):
        """Row b becomes a new sequence of the file tensors ``{prefix}{b}.*``, ``lengths[b]``
        positions (load)."""
        for sid in self.ids:
            self.pool.remove_sequence(sid)
        self.ids = []
        for b, n in enumerate(lengths):
            self.ids.append(self.pool._restore_sequence(int(n), tensors, f"{prefix}{b}."))

    @property
    def rows(self):
        return len(self.ids)

    def forward(self, counts, q, k, v, **variant):
        live = [i for i, c in enumerate(counts) if c]
        return self.pool.forward([self.ids[i] for i in live], q, k, v, n_new=[int(counts[i]) for i in live], **variant)

    def append(self, counts, k, v):
        self.pool.append(self.ids, k, v, n_new=[int(c) for c in counts])

    def rematch(self, rows):
        """Prefix cache: drop the rows' sequences (their full blocks stay cached) and start one per
        row of token ids with its longest cached prefix; returns each row's cached length."""
        for sid in self.ids:
            self.pool.remove_sequence(sid)
        self.ids = [self.pool.add_sequence(token_ids=row) for row in rows]
        return [self.pool.length(sid) for sid in self.ids]

    def truncate(self, lengths):
        for sid, n in zip(self.ids, lengths):
            if self.pool.length(sid) != n:
                self.pool.truncate(sid, int(n))

    def select(self, rows):
        """Row i becomes old row ``rows[i]``: an old row kept at its own index stays, the others
        are forks (sharing full blocks); old rows no longer used are dropped."""
        old, new = self.ids, [None] * len(rows)
        kept = set()
        for i, r in enumerate(rows):
            if r == i:
                new[i] = old[r]
                kept.add(r)
        for i, r in enumerate(rows):
            if new[i] is None:
                new[i] = self.pool.fork(old[r])
        for j, sid in enumerate(old):
            if j not in kept:
                self.pool.remove_sequence(sid)
        self.ids = new

    def reset(self, rows):
        for sid in self.ids:
            self.pool.remove_sequence(sid)
        self.ids = [self.pool.add_sequence() for _ in range(rows)]

    def close(self):
        self.pool.close()


def _layer_specs(meta: dict, batch: int, path: str) -> list:
    """[(seen, pad list, window)] per layer from a VkattnCache file's metadata, each checked
    (0 <= pad[b] <= seen, ``batch`` pads); CacheFileCorruptError for a malformed entry."""
    try:
        specs = json.loads(meta["layers"])
        out = []
        for spec in specs:
            seen, pad, window = spec["seen"], list(spec["pad"]), spec["window"]
            ints = [seen, *pad] + ([] if window is None else [window])
            if any(isinstance(x, bool) or not isinstance(x, int) for x in ints) or len(pad) != batch \
                    or not all(0 <= p <= seen for p in pad) or (window is not None and window < 1):
                raise ValueError(spec)
            out.append((seen, pad, window))
    except (KeyError, TypeError, ValueError) as e:
        raise CacheFileCorruptError(f"{path}: malformed layer metadata ({type(e).__name__}: {e})") from None
    if not out:
        raise CacheFileCorruptError(f"{path}: no layers in the file")
    return out


def _pack(x, counts, full: bool = False) -> np.ndarray:
    """(batch, heads, n, d) torch -> (heads, sum(counts), d) numpy: row b's last counts[b]
    positions, rows one after another (``full``: the caller knows every count is n). Batch 1
    without padding is a view."""
    b, h, n, d = x.shape
    x = x.detach()
    if full or (counts == n).all():
        x = x[0] if b == 1 else x.transpose(0, 1).reshape(h, b * n, d)
    else:
        x = torch.cat([x[i, :, n - c:] for i, c in enumerate(counts) if c], dim=1)
    if x.device.type != "cpu":
        x = x.cpu()
    if x.dtype not in _HOST_DTYPES:
        x = x.float()
    return x.numpy()


def _unpack(out: np.ndarray, counts, query, full: bool = False):
    """vkattn's (num_qo_heads, sum(counts), head_dim) float32 -> (batch, n, num_qo_heads, head_dim)
    in the query's dtype and device; padding rows are zeros (``full``: every count is n). Without
    padding a view."""
    b, hq, n, _ = query.shape
    t = torch.from_numpy(out)
    if full or (counts == n).all():
        # one decode row: (hq, 1, d) is already (1, 1, hq, d) in memory
        res = t.view(1, 1, hq, -1) if b == 1 and n == 1 else t.view(hq, b, n, -1).permute(1, 2, 0, 3)
    else:
        res = torch.zeros((b, n, hq, out.shape[2]), dtype=torch.float32)
        a = 0
        for i, c in enumerate(counts):
            if c:
                res[i, n - c:] = t[:, a:a + c].transpose(0, 1)
                a += c
    if query.dtype is torch.float32 and query.device.type == "cpu":
        return res
    return res.to(device=query.device, dtype=query.dtype)


def _describe(x) -> str:
    if torch.is_tensor(x):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"


AttentionInterface.register(NAME, vkattn_attention)
AttentionMaskInterface.register(NAME, _padding_mask)
