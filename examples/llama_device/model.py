"""DeviceLlama: a Llama-architecture decoder whose every op runs on the Vulkan device.

    from examples.llama_device.model import DeviceLlama
    m = DeviceLlama(config, state_dict, weight_dtype="float16")     # weights uploaded once
    tokens = m.generate(prompt_ids, max_new_tokens=64)               # greedy

Per layer: RMSNorm + q/k/v matmul (shaders/linear.comp, one dispatch writing q, k, v in vkattn's
(heads, rows, head_dim) layout), vkattn attention on the layer's persistent KVCache (RoPE applied
to k as it is stored and to q, on the device: ``rope=vkattn.RoPE("neox")``, ``rope_q=True``), o
matmul + residual add, RMSNorm + gate/up matmul + SiLU gate, down matmul + residual add. Then the
final RMSNorm, the logits (tied embeddings where the model ties them) and the greedy argmax
(shaders/argmax.comp), which writes the token id into a device buffer that the next step's
embedding gather (shaders/embed.comp) reads: no host round trip between tokens but the 4-byte
token id the host downloads to return it.

Submissions: a prompt is ONE submission (a vkattn.Graph captured for its length); each generated
token is ONE submission of a decode graph captured once and replayed (``decode_graph.recordings``
stays small, ``decode_graph.submissions`` counts the tokens). Only the example imports vkattn,
never the reverse; it uses vkattn's public DeviceArray / Graph / KVCache and kp algorithms of
its own (a weight or a token id buffer is a DeviceArray whose words the shaders read as float16
pairs or uint32: the layout is bytes, DeviceArray's float32 is only its host view's type).
"""
from __future__ import annotations

import math
import numbers
import pathlib
import time

import numpy as np

import vkattn
from vkattn.compiler import compile_shader

from . import quant

SHADERS = pathlib.Path(__file__).resolve().parent / "shaders"


class ModelInputError(ValueError):
    """A configuration, weight set or prompt the example cannot run (names what and why)."""


def _cfg(config, name, default=None):
    v = config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)
    return default if v is None else v


def _numpy(t) -> np.ndarray:
    if hasattr(t, "detach"):          # a torch tensor
        t = t.detach().to("cpu").float().numpy()
    return np.ascontiguousarray(np.asarray(t, dtype=np.float32))


class _Dims:
    def __init__(self, config):
        self.vocab = int(_cfg(config, "vocab_size"))
        self.hidden = int(_cfg(config, "hidden_size"))
        self.inter = int(_cfg(config, "intermediate_size"))
        self.layers = int(_cfg(config, "num_hidden_layers"))
        self.heads = int(_cfg(config, "num_attention_heads"))
        self.kv_heads = int(_cfg(config, "num_key_value_heads", self.heads))
        self.head_dim = int(_cfg(config, "head_dim", self.hidden // self.heads))
        self.eps = float(_cfg(config, "rms_norm_eps", 1e-6))
        rp = _cfg(config, "rope_parameters", None) or {}
        self.rope_theta = float(rp.get("rope_theta", _cfg(config, "rope_theta", 10000.0)))
        rope_type = rp.get("rope_type", "default")
        scaling = _cfg(config, "rope_scaling", None)
        self.tied = bool(_cfg(config, "tie_word_embeddings", False))
        act = _cfg(config, "hidden_act", "silu")
        problems = []
        if rope_type != "default" or (scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default")):
            problems.append(f"rope type {rope_type!r} / scaling {scaling!r} (only plain RoPE)")
        if act != "silu":
            problems.append(f"hidden_act {act!r} (only silu)")
        if _cfg(config, "attention_bias", False) or _cfg(config, "mlp_bias", False):
            problems.append("attention or MLP biases")
        if self.heads % self.kv_heads:
            problems.append(f"{self.heads} query heads over {self.kv_heads} kv heads")
        for name in ("hidden", "inter"):
            if getattr(self, name) % 8:
                problems.append(f"{name} size {getattr(self, name)} is not a multiple of 8")
        if self.head_dim % 8:
            problems.append(f"head_dim {self.head_dim} is not a multiple of 8")
        if problems:
            raise ModelInputError("DeviceLlama cannot run this config: " + "; ".join(problems))
        self.nq, self.nkv = self.heads * self.head_dim, self.kv_heads * self.head_dim


class _Acts:
    """The activations of a T-token step (DeviceArrays)."""

    def __init__(self, d: _Dims, t: int, dev):
        e = lambda *s: vkattn.empty(s, dev)
        self.t = t
        self.x = e(t, d.hidden)                          # the residual stream
        self.q, self.att = e(d.heads, t, d.head_dim), e(d.heads, t, d.head_dim)
        self.k, self.v = e(d.kv_heads, t, d.head_dim), e(d.kv_heads, t, d.head_dim)
        self.h = e(t, d.inter)                           # silu(gate) * up
        self.logits = e(d.vocab)

    def close(self):
        for a in (self.x, self.q, self.att, self.k, self.v, self.h, self.logits):
            a.close()


class _Prompt:
    """A recorded prompt kept by DeviceLlama: its graph, (length, return_logits), the algorithms
    the graph dispatches, its activations and its token-id buffer."""
    __slots__ = ("graph", "key", "algos", "acts", "idbuf")

    def __init__(self, graph, key, algos, acts, idbuf):
        self.graph, self.key, self.algos, self.acts, self.idbuf = graph, key, algos, acts, idbuf


class DeviceLlama:
    """A Llama-architecture model (transformers' LlamaConfig fields; a config object or dict) on
    a Vulkan device.

    weights: a state dict with Hugging Face's names (``model.layers.0.self_attn.q_proj.weight``
    ...; torch tensors or numpy). weight_dtype: "float32", "float16" (every weight, norms
    included, rounded to float16 once: matmuls read half the bytes; arithmetic stays float32), or
    "q4_1" (the layers' matrices in GGUF's Q4_1 blocks, the embedding / lm_head in Q8_0, norms
    float32: quant.py; a sixth of float32's bytes): ``blocks`` maps weight names to such blocks
    as the GGUF holds them (weights.load_blocks(): then the device's weights are the blocks the
    gguf package dequantises, bit for bit; shaders/weights.glsl factors d and m out of the sums,
    so its products differ from a dot over the dequantised float32 values by roundings only),
    other weights are quantised here (round to nearest).
    :meth:`reference_state_dict` gives the float32 weights the device computes with.
    cache_dtype: the KVCaches' storage ("float32", "float16", "int8"). capacity: positions per
    cache (prompt + generated tokens). Tuning of the matmul kernel (shaders/linear.comp):
    ``wg`` invocations per workgroup, ``lanes`` invocations per output row, ``rows`` output rows
    per group of lanes (None: :data:`LAYOUTS`' for the device, CPU drivers or GPUs);
    ``prompt_rows`` and ``prompt_tile`` the rows and tokens per group of lanes in the prompt's
    matmuls (None: :data:`PROMPT_LAYOUTS`' for the device and weight_dtype); ``prompt_tile`` may
    be a tuple of token counts, of which each prompt takes the one that pads its length least
    (the larger on a tie: :meth:`prompt_tile_for`); ``xshare`` x and the
    norm gains shared by subgroup shuffles where the device allows (Device.lane_subgroup():
    lavapipe): the subgroup's lanes load a piece between them (storage loads), or fetch the tile's
    pieces between them, several per fetch (texel loads: SmolLM2's float16 prompt 11% faster,
    perf/RESULTS.md session 32). ``texel``: the weights, x and the norm gains read as uniform texel buffers
    (vkattn.algorithm; linear.comp W_TEXEL / X_TEXEL); None: on CPU drivers where the device can
    (lavapipe gathers a texel fetch with vector instructions and loops over the lanes for a storage
    load: SmolLM2's float32 decode went from 0.62x to 1.03x eager's tokens per second), storage
    buffers on GPUs (not timed there). ``interleave``: each group of (subgroup x ``rows``) weight
    rows stored in the order the decode's lanes read them (quant.interleave; weights.glsl
    W_LANES / W_RPL); None: on CPU drivers with one lane a row, row-major elsewhere.
    ``timestamps``: the prompts' graphs time each command on the device (:meth:`prompt_timings`;
    the decode's: ``decode_graph(timestamps=True)``).
    Errors: ModelInputError (a ValueError) for a config, weight set, setting or prompt it cannot run.
    """

    WEIGHT_DTYPES = ("float32", "float16", "q4_1")
    # (wg, lanes, rows) of linear.comp. CPU drivers: one lane per 8 rows, one SIMD vector (8
    # lanes on lavapipe at 256 bits; the probed lane subgroup where it is wider) a workgroup:
    # lavapipe runs a workgroup's invocations as SIMD lanes over a
    # loop (a storage word costs a per-lane load, so each x piece serves a lane's rows) and hands
    # whole workgroups to its threads -- SmolLM2's decode matmuls (576-1536 rows) now run 9-24
    # workgroups where 256 rows a workgroup gave them 3-6, split 2:1 between two threads on the
    # smallest; its prompt's lanes each read one decode lane's rows of an interleaved group
    # (perf/RESULTS.md session 33: decode 1.05-1.28x and the prompt 1.1-1.3x the tokens per
    # second of (16, 1, 16)). GPUs: 16 lanes per row reading
    # its consecutive 16-byte pieces (a 256-byte run a step for float16), 8 rows per workgroup of
    # 128, so that SmolLM2's smallest matmuls (576 rows) run 72 workgroups and its logits 6144: the
    # CPU layout gave them 2-3 and 192 (the H100's 19 ms of device time per float16 token, session
    # 21, 14 GB/s; this layout is not timed on a GPU yet)
    LAYOUTS = {"cpu": (8, 1, 8), "gpu": (128, 16, 1)}
    # (rows, tokens) per group of lanes in the prompt's matmuls, by weight_dtype (tokens: one
    # count, or the counts a prompt picks from, prompt_tile_for). CPU drivers, measured on
    # lavapipe: with float weights 8 rows x 8 tokens (the tile's loops unrolled, linear.comp
    # TILE_LOOP) took 0.73-0.81x the matmuls' device time of 16 x 8 (perf/RESULTS.md session
    # 26); 8 x 16, with linear.comp's token-by-token order, 0.88-0.92x the time of 8 x 8 a token
    # computed (session 37, AVX2; 8 x 12 the same as 16, 4 x 16 and 16 x 8 slower), so where 16
    # pads a prompt no more than 8 does (37 tokens: 40 rows at 8, 48 at 16; 45: 48 either way)
    # it takes 16; q4_1 8 x 4, its loops unrolled too (session 33: 0.75x the time of 16 x 4
    # rolled, alternated; 16 x 8 unrolled spills; session 37, a code word at a time: 8 x 8
    # unrolled no faster than 8 x 4). GPUs: the decode's rows, 8 tokens for float weights, 2 for
    # q4_1, whose 32-value blocks hold 4x the x values a token: at 8 its prompt pipelines took
    # 256 VGPRs and spilled 53-106 of them on every AMD family, 1882 spilled in all (session 43,
    # `python -m perf modelgpu`, Mesa 22.3's RADV); at 2, 104-148 VGPRs and 18 spilled, in one
    # pipeline on one family (gate/up on gfx1100); float weights at 8: 80-120, none (not timed on
    # a GPU)
    PROMPT_LAYOUTS = {"cpu": {"float32": (8, (8, 16)), "float16": (8, (8, 16)), "q4_1": (8, 4)},
                      "gpu": {"float32": (1, 8), "float16": (1, 8), "q4_1": (1, 2)}}

    @classmethod
    def layout_for(cls, kind: str, lane_subgroup: int) -> tuple:
        """The default (wg, lanes, rows) of linear.comp on a device of ``kind`` ("cpu": a CPU
        driver, "gpu") whose probed lane subgroup is ``lane_subgroup`` (Device.lane_subgroup(), 0
        where unusable): LAYOUTS[kind], a CPU driver's workgroup widened to one SIMD vector where
        the subgroup is wider than 8 -- llvmpipe at 512 bits runs 16 lanes a vector, and a
        workgroup of 8 left half of each empty (session 43, an AVX-512 Xeon: SmolLM2's float16
        token 78.6 -> 38.0 ms with 16, against 35.4 at 256 bits)."""
        lay = tuple(cls.LAYOUTS[kind])
        if kind == "cpu" and lane_subgroup > lay[0]:
            lay = (lane_subgroup,) + lay[1:]
        return lay

    @staticmethod
    def xshare_for(subgroup: int, wg: int, lanes: int, texel: bool) -> int:
        """linear.comp's XSHARE -- x pieces shared by shuffles within a subgroup -- for a layout
        (0: none): one lane per row and the subgroup (``subgroup``: 0 for none) dividing the
        workgroup; with storage loads it must divide 8 too (the smallest piece, split between
        the lanes), while texel fetches take any count of vec4s."""
        ok = subgroup and lanes == 1 and wg % subgroup == 0 and (texel or 8 % subgroup == 0)
        return subgroup if ok else 0

    def __init__(self, config, weights, weight_dtype: str = "float32", cache_dtype: str = "float32",
                 capacity: int = 512, device=None, wg: int | None = None, lanes: int | None = None,
                 rows: int | None = None, prompt_tile: int | None = None, blocks: dict | None = None,
                 xshare: bool = True, prompt_rows: int | None = None, texel: bool | None = None,
                 interleave: bool | None = None, timestamps: bool = False):
        device = device or vkattn.default_device()
        kind = "cpu" if device.is_software else "gpu"
        lane_sg = device.lane_subgroup()                      # probed: one subgroup, working shuffles
        lay = self.layout_for(kind, lane_sg)
        wg, lanes, rows = (lay[0] if wg is None else wg), (lay[1] if lanes is None else lanes), \
            (lay[2] if rows is None else rows)
        if weight_dtype not in self.WEIGHT_DTYPES:
            raise ModelInputError(f"weight_dtype: expected one of {self.WEIGHT_DTYPES}, got {weight_dtype!r}")
        play = self.PROMPT_LAYOUTS[kind][weight_dtype]
        prompt_rows = play[0] if prompt_rows is None else prompt_rows
        prompt_tile = play[1] if prompt_tile is None else prompt_tile
        if not (isinstance(wg, int) and isinstance(lanes, int) and wg > 0 and lanes > 0 and wg & (wg - 1) == 0
                and lanes & (lanes - 1) == 0 and lanes <= wg and wg <= 256):
            raise ModelInputError(f"wg / lanes: powers of two with lanes <= wg <= 256, got {wg} / {lanes}")
        tiles = prompt_tile if isinstance(prompt_tile, tuple) else (prompt_tile,)
        if not tiles or any(isinstance(v, bool) or not (isinstance(v, int) and 1 <= v <= 32) for v in tiles):
            raise ModelInputError(f"prompt_tile: an int in 1..32 or a non-empty tuple of them, got {prompt_tile!r}")
        for name, v in (("rows", rows), ("prompt_rows", prompt_rows)):
            if isinstance(v, bool) or not (isinstance(v, int) and 1 <= v <= 32):
                raise ModelInputError(f"{name}: an int in 1..32, got {v!r}")
        self.d = d = _Dims(config)
        self.device = device
        self.weight_dtype, self.cache_dtype = weight_dtype, cache_dtype
        if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral) or capacity < 1:
            raise ModelInputError(f"capacity: an int >= 1, got {capacity!r}")
        self.capacity = int(capacity)
        self._wg, self._lanes, self._rows, self._tiles = wg, lanes, rows, tuple(sorted(set(tiles)))
        self._prompt_rows = prompt_rows
        self._f16 = weight_dtype == "float16"
        sg = lane_sg if xshare else 0
        # the weights stored in the order the decode's lanes read them (weights.glsl W_LANES /
        # W_RPL, quant.interleave): on CPU drivers, where a lane is a SIMD lane with `rows`
        # rows of its own and the CPU's prefetchers follow a few streams, not lanes * rows rows
        can = bool(lane_sg and lanes == 1 and wg % lane_sg == 0)
        if interleave and not can:
            raise ModelInputError("interleave: needs one lane a row and a probed subgroup that divides wg "
                                  f"(lanes={lanes}, wg={wg}, Device.lane_subgroup()={lane_sg})")
        self._wgroup = (lane_sg, rows) if can and (device.is_software if interleave is None else interleave) else None
        # the weights read as uniform texel buffers (weights.glsl W_TEXEL): on CPU drivers, where
        # a texel fetch is a vector gather and a storage load a per-lane loop (None: there, where
        # the device can; GPUs keep storage buffers, not timed there)
        self._texel = bool(device.is_software and device.texel_buffers) if texel is None else bool(texel)
        self._xshare = self.xshare_for(sg, wg, lanes, self._texel)
        if self._texel and not device.texel_buffers:
            raise ModelInputError("texel: this device or kp cannot bind texel buffers (Device.texel_buffers)")
        self._blocks = dict(blocks or {})
        self._ref = {}
        self._spv = {}
        self._load(weights)
        rope = vkattn.RoPE(style="neox", base=d.rope_theta)
        self.caches = [vkattn.KVCache(self.capacity, d.kv_heads, d.head_dim, dtype=cache_dtype,
                                      device=self.device, rope=rope) for _ in range(d.layers)]
        self.tok = vkattn.empty((1,), self.device)        # the token id (uint32 bits) between steps
        self._dec = _Acts(d, 1, self.device)
        self._dec_algos = None
        self._graphs = {}                                  # return_logits -> the decode graph
        self.prompt_submissions = 0
        self._prompts = {}                                 # prompt tile -> the last such prompt's _Prompt
        self._timestamps, self._last_tile = bool(timestamps), None

    # ------------------------------------------------------------------ weights
    def _load(self, sd):
        d = self.d
        sd = dict(sd)
        self._rows_of = {}

        def get(name, shape):
            if name not in sd:
                raise ModelInputError(f"weights: {name!r} is missing")
            w = _numpy(sd[name])
            if w.shape != shape:
                raise ModelInputError(f"weights: {name!r} has shape {w.shape}, expected {shape}")
            self._rows_of[name] = shape[0]
            if not np.isfinite(w).all():
                raise ModelInputError(f"weights: {name!r} holds non-finite values")
            return w

        def mat(w, name, kind="q4_1"):   # a DeviceArray holding w's words in the weight format
            fmt = self.weight_dtype if self.weight_dtype != "q4_1" else kind
            self._fmt[name] = fmt
            if fmt in quant.FORMATS:
                if w.shape[1] % quant.BLOCK:
                    raise ModelInputError(f"weights: {name!r}: rows of {w.shape[1]} are not a multiple of "
                                          f"{quant.BLOCK} ({fmt} blocks)")
                if name in self._blocks:
                    bk, raw = self._blocks[name]
                    if bk != fmt:
                        raise ModelInputError(f"blocks: {name!r} is {bk}, the model holds it as {fmt}")
                    words = quant.from_gguf(fmt, raw, w.shape[1])
                else:
                    words = quant.quantize(fmt, w)
                self._ref[name] = quant.dequantize(fmt, words, w.shape[1])
                texels, params = quant.DATA[fmt] // 4, -(-w.shape[1] // quant.BLOCK // 4)
            elif self._f16:
                if np.abs(w).max(initial=0) > 65504:
                    raise ModelInputError("weights: values past float16's range (use weight_dtype='float32')")
                words = np.ascontiguousarray(w.astype(np.float16)).view(np.uint32)
                self._ref[name] = w.astype(np.float16).astype(np.float32)
                texels, params = 1, 0
            else:
                words = np.ascontiguousarray(w).view(np.uint32)
                self._ref[name] = w
                texels, params = 2, 0
            if self._wgroup is not None:       # weights.glsl W_LANES / W_RPL
                words = quant.interleave(words, texels, params, *self._wgroup)
            words = words.reshape(-1)
            a = vkattn.empty((words.size,), self.device)
            a.host_view().reshape(-1).view(np.uint32)[:words.size] = words
            self._fmt_of[a] = fmt
            pending.append(a)
            return a

        def vec(w, name):  # norm gains: float32 (rounded to float16 first in the float16 setting)
            if self._f16:
                w = w.astype(np.float16).astype(np.float32)
            self._ref[name] = w
            a = vkattn.empty((w.size,), self.device)
            a.host_view()[:] = w
            pending.append(a)
            return a

        def cat(names, parts):   # several matrices in one: rows concatenated (each row's blocks stay whole)
            w = np.concatenate(parts)
            if self.weight_dtype == "q4_1" and all(n in self._blocks for n in names):
                self._blocks["+".join(names)] = (self._blocks[names[0]][0],
                                                 np.concatenate([self._blocks[n][1] for n in names]))
            return "+".join(names), w

        pending, self._fmt, self._fmt_of = [], {}, {}
        H, I = d.hidden, d.inter
        e = "model.embed_tokens.weight"
        self.embed = mat(get(e, (d.vocab, H)), e, "q8_0")
        if d.tied:
            self.lm_head = self.embed
        else:
            self.lm_head = mat(get("lm_head.weight", (d.vocab, H)), "lm_head.weight", "q8_0")
        self.norm = vec(get("model.norm.weight", (H,)), "model.norm.weight")
        self.layers = []
        for i in range(d.layers):
            p = f"model.layers.{i}."
            qkv = cat([p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"],
                      [get(p + "self_attn.q_proj.weight", (d.nq, H)), get(p + "self_attn.k_proj.weight", (d.nkv, H)),
                       get(p + "self_attn.v_proj.weight", (d.nkv, H))])
            gu = cat([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                     [get(p + "mlp.gate_proj.weight", (I, H)), get(p + "mlp.up_proj.weight", (I, H))])
            self.layers.append(dict(
                ln1=vec(get(p + "input_layernorm.weight", (H,)), p + "input_layernorm.weight"),
                ln2=vec(get(p + "post_attention_layernorm.weight", (H,)), p + "post_attention_layernorm.weight"),
                qkv=mat(qkv[1], qkv[0]),
                o=mat(get(p + "self_attn.o_proj.weight", (H, d.nq)), p + "self_attn.o_proj.weight"),
                gu=mat(gu[1], gu[0]),
                down=mat(get(p + "mlp.down_proj.weight", (H, I)), p + "mlp.down_proj.weight")))
        self._weights = pending
        g = vkattn.Graph(self.device)                       # one upload of everything, waited for
        with g.capture():
            g.upload(*pending)
        g.run()
        g.close()
        self.weight_bytes = sum(a.nbytes for a in pending)

    def reference_state_dict(self) -> dict:
        """The float32 weights the device computes with, under Hugging Face's names (numpy): for
        float32 the given ones, for float16 their float16 roundings, for q4_1 the blocks'
        dequantised values (an eager model holding these is the reference)."""
        out = {}
        for name, w in self._ref.items():
            names = name.split("+")
            rows = np.cumsum([0] + [self._rows_of[n] for n in names])
            for n, a, b in zip(names, rows[:-1], rows[1:]):
                out[n] = w[a:b]
        return out

    # ------------------------------------------------------------------ kernels
    _FORMAT_DEFINE = {"float16": "W_F16", "q4_1": "W_Q4_1", "q8_0": "W_Q8_0"}

    def _spirv(self, name, fmt=None, **defines):
        if fmt in self._FORMAT_DEFINE:
            defines[self._FORMAT_DEFINE[fmt]] = 1
        if fmt is not None and self._texel:
            defines["W_TEXEL"] = 1
        if fmt is not None and self._wgroup is not None:
            defines["W_LANES"], defines["W_RPL"] = self._wgroup
        key = (name, tuple(sorted(defines.items())))
        if key not in self._spv:
            self._spv[key] = compile_shader(name, defines, src_dir=SHADERS)
        return self._spv[key]

    def prompt_tile_for(self, t: int) -> int:
        """The tokens per tile of the matmuls of a step of ``t`` tokens: 1 for one token (the
        decode's layout), else of the ``prompt_tile`` counts the one whose tiles cover the fewest
        token rows (ceil(t / tile) * tile), the larger on a tie (fewer, larger tiles: fewer
        weight loads a token)."""
        if t == 1:
            return 1
        return min(self._tiles, key=lambda tt: (-(-t // tt) * tt, -tt))

    def _linear(self, w, x, y, *, n, k, t, tx=None, t0=0, in_hd=None, out_hd=None, norm=None,
                acc=False, glu=False, qkv=None):
        """An algorithm of linear.comp (its header says what it computes)."""
        tile, rpl = self.prompt_tile_for(t), (self._rows if t == 1 else self._prompt_rows)
        defines = dict(WG=self._wg, LANES=self._lanes, RPL=rpl, TT=tile)
        if self._texel:
            defines["X_TEXEL"] = 1
        if self._xshare:
            defines["XSHARE"] = self._xshare
        arrays = [w, x, y]
        if norm is not None:
            defines["NORM"] = 1
            arrays.append(norm)
        if acc:
            defines["ACC"] = 1
        if glu:
            defines["GLU"] = 1
        rows = n
        if qkv is not None:
            defines["QKV"] = 1
            arrays += list(qkv)
            rows = self.d.nq + 2 * self.d.nkv
        rpw = self._wg // self._lanes * rpl
        eps = int(np.float32(self.d.eps).view(np.uint32))
        spec = [k, n, in_hd or k, out_hd or n, eps, self.d.nq, self.d.nkv]
        # the weight (binding 0) read as a texel buffer under W_TEXEL: four words a texel in every
        # format (quant.py aligns the block formats' rows to 16 bytes)
        return vkattn.algorithm(arrays, self._spirv("linear", self._fmt_of[w], **defines),
                                (math.ceil(t / tile), math.ceil(rows / rpw)), spec, push=[t, t0, tx or t])

    def _step(self, g, a: _Acts, ids, return_logits: bool, algos: list | None = None):
        """Record one step of a.t tokens (ids: the DeviceArray of their ids) into graph g; returns
        the algorithms (kept alive with the graph), appended to ``algos`` as they are built where
        given (the caller destroys them on an error)."""
        d, t, algos = self.d, a.t, ([] if algos is None else algos)

        def disp(algo, reads, writes, name):
            algos.append(algo)
            g.dispatch(algo, reads=reads, writes=writes, name=name)

        unit = 32 if self._fmt_of[self.embed] in quant.FORMATS else 8
        disp(vkattn.algorithm([self.embed, ids, a.x], self._spirv("embed", self._fmt_of[self.embed]),
                              (math.ceil(d.hidden / unit / 64), t), [d.hidden, d.vocab]), [ids], [a.x], "embed")
        for i, L in enumerate(self.layers):
            disp(self._linear(L["qkv"], a.x, a.q, n=d.nq, k=d.hidden, t=t, out_hd=d.head_dim, norm=L["ln1"],
                              qkv=(a.k, a.v)), [a.x], [a.q, a.k, a.v], f"qkv{i}")
            self.caches[i].forward(a.q, a.k, a.v, out=a.att, rope_q=True)
            disp(self._linear(L["o"], a.att, a.x, n=d.hidden, k=d.nq, t=t, in_hd=d.head_dim, acc=True),
                 [a.att], [a.x], f"o{i}")
            disp(self._linear(L["gu"], a.x, a.h, n=d.inter, k=d.hidden, t=t, norm=L["ln2"], glu=True),
                 [a.x], [a.h], f"gate_up{i}")
            disp(self._linear(L["down"], a.h, a.x, n=d.hidden, k=d.inter, t=t, acc=True), [a.h], [a.x], f"down{i}")
        disp(self._linear(self.lm_head, a.x, a.logits, n=d.vocab, k=d.hidden, t=1, tx=t, t0=t - 1, norm=self.norm),
             [a.x], [a.logits], "logits")
        disp(vkattn.algorithm([a.logits, self.tok], self._spirv("argmax"), (1,), [d.vocab]), [a.logits], [self.tok],
             "argmax")
        g.download(self.tok)
        if return_logits:
            g.download(a.logits)
        return algos

    def decode_graph(self, return_logits: bool = False, timestamps: bool = False) -> vkattn.Graph:
        """The decode step's graph (captured on first use, then replayed): each run() appends
        the token in ``tok`` to every cache and writes the next one there. ``timestamps``: a graph
        that times each command on the device (``last_timings()``, where the device can)."""
        key = (return_logits, timestamps)
        if key not in self._graphs:
            g = vkattn.Graph(self.device, timestamps=timestamps)
            algos = []
            try:
                with g.capture():
                    self._step(g, self._dec, self.tok, return_logits, algos)
            except BaseException:           # nothing half-captured left behind
                g.close()
                for a in algos:
                    a.destroy()
                raise
            g._algos = algos
            self._graphs[key] = g
        return self._graphs[key]

    def prompt_timings(self) -> list:
        """Device time of each command of the last generate()'s prompt, ``[(op, ms), ...]`` in
        recording order (vkattn.Graph.last_timings): ops are named by their kernels and layers
        ("qkv3", "attn_lane", "gate_up3", "barrier ..."). Empty unless the model was made with
        ``timestamps=True`` on a device that has timestamp queries, or before a prompt ran."""
        p = self._prompts.get(self._last_tile)
        return [] if p is None else p.graph.last_timings()

    # ------------------------------------------------------------------ generation
    def _token(self) -> int:
        return int(self.tok.host_view().reshape(-1).view(np.uint32)[0])

    def generate(self, prompt_ids, max_new_tokens: int, return_logits: bool = False, eos_token_id=None):
        """Greedy decoding: the caches are reset, the prompt runs as one submission (a prompt as
        long as the last one of its tile (:meth:`prompt_tile_for`) as a replay of that one's
        graph: nothing recorded), each further token as one replay of the decode graph. Returns
        the new token ids (a list), and with ``return_logits`` also their logits ((n, vocab)
        float32: row i gave token i). Stops after ``eos_token_id`` where one is given.
        ``last_times``: (seconds of the prompt's submission, seconds of the decode steps) of
        this call."""
        d = self.d
        ids = np.asarray(prompt_ids)
        if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
            raise ModelInputError(f"prompt_ids: expected a non-empty 1-D array of ints, got "
                                  f"{ids.dtype} of shape {ids.shape}")
        if ids.min() < 0 or ids.max() >= d.vocab:
            raise ModelInputError(f"prompt_ids: token ids must be in [0, {d.vocab}), got {ids.min()}..{ids.max()}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ModelInputError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
        if ids.size + max_new_tokens - 1 > self.capacity:
            raise ModelInputError(f"prompt of {ids.size} tokens + {max_new_tokens} new ones needs "
                                  f"{ids.size + max_new_tokens - 1} positions; the caches hold {self.capacity}")
        for c in self.caches:
            c.reset()
        t0 = time.perf_counter()
        s = int(ids.size)
        key = (s, bool(return_logits))
        tile = self.prompt_tile_for(s)
        if tile not in self._prompts or self._prompts[tile].key != key:
            self._record_prompt(s, return_logits, tile)
        # the prompt's graph, recorded for this length or replayed from the last prompt of its
        # tile (the caches count from their length, 0 again): its ids uploaded at the submission
        p = self._prompts[tile]
        try:
            p.idbuf.host_view().reshape(-1).view(np.uint32)[:s] = ids.astype(np.uint32)
            p.graph.run()
        except BaseException:
            self._release_prompt(tile)
            raise
        acts = p.acts
        self.prompt_submissions += 1
        self._last_tile = tile
        out = [self._token()]
        logits = [acts.logits.host_view().copy()] if return_logits else None
        t1 = time.perf_counter()
        dg = self.decode_graph(return_logits)
        while len(out) < max_new_tokens and not (eos_token_id is not None and out[-1] == eos_token_id):
            dg.run()
            out.append(self._token())
            if return_logits:
                logits.append(self._dec.logits.host_view().copy())
        self.last_times = (t1 - t0, time.perf_counter() - t1)
        return (out, np.stack(logits)) if return_logits else out

    def _record_prompt(self, s: int, return_logits: bool, tile: int):
        """Record a prompt graph of ``s`` tokens (its activations, id buffer and algorithms new),
        whose matmuls take ``tile`` tokens a tile, and keep it in place of the last prompt's of
        that tile."""
        acts, idbuf = _Acts(self.d, s, self.device), vkattn.empty((s,), self.device)
        g = vkattn.Graph(self.device, timestamps=self._timestamps)
        algos = []
        try:
            with g.capture():
                g.upload(idbuf)
                algos = self._step(g, acts, idbuf, return_logits)
        except BaseException:
            g.close()
            for a in algos:
                a.destroy()
            acts.close()
            idbuf.close()
            raise
        # the previous prompt's algorithms go only now that this prompt's exist: they held the
        # prompt pipelines (kp shares a VkPipeline among algorithms of the same SPIR-V and spec
        # constants and frees it with the last holder; lavapipe re-JITs a freed one). One prompt
        # is kept per tile, so that prompts whose lengths take different tiles do not free each
        # other's pipelines
        self._release_prompt(tile)
        self._prompts[tile] = _Prompt(g, (s, bool(return_logits)), algos, acts, idbuf)

    def _release_prompt(self, tile: int):
        """Destroy the graph, algorithms and activations of the last prompt of ``tile`` (kept
        until the next prompt of that tile exists, so that their pipelines stay built, and
        replayed by a prompt of the same length)."""
        p = self._prompts.pop(tile, None)
        if p is None:
            return
        p.graph.close()
        for a in p.algos:
            a.destroy()
        p.acts.close()
        p.idbuf.close()

    def close(self):
        for tile in list(self._prompts):
            self._release_prompt(tile)
        for g in self._graphs.values():
            g.close()
            for a in g._algos:
                a.destroy()
        self._graphs = {}
        for c in self.caches:
            c.close()
        self._dec.close()
        self.tok.close()
        for a in self._weights:
            a.close()
