"""``python -m perf hf``: transformers ``generate()`` per generated token with attn_implementation
"vkattn" (a VkattnCache), "eager" and "sdpa" (a DynamicCache), at the contexts of
VKATTN_PERF_CONTEXT (default 512,2048), for a Llama-3.2-1B-shaped model (random weights) cut to
VKATTN_PERF_HF_LAYERS (2) layers, VKATTN_PERF_HF_BATCH (1) sequences at once (above 1 vkattn keeps
a PagedKVCache per layer); how much of a decode step is attention (the cache update plus the
attention function, every layer); and vkattn's fixed cost per attention call (the same call at a
16-token context) beside a bare Kompute round trip. Needs the hf extra (make setup-hf).

A decode step is the interval between two calls of a logits processor (one forward plus greedy
selection); the first VKATTN_PERF_WARMUP (at least 1: it builds vkattn's decode pipelines) are
dropped and VKATTN_PERF_ITERS are timed (medians). The vkattn cache stores VKATTN_PERF_DTYPE.
Verified: vkattn's first-step scores are within 1e-3 (float32 cache) or 2e-2 (float16) of
eager's, relative to the score scale.

Table columns for these rows: "vkattn ms" is vkattn, "numpy ms" transformers' eager attention and
"torch ms" its sdpa (per generated token; per attention call for the fixed-cost row).
"""
from __future__ import annotations

import os
import time

import numpy as np

from .common import Row, Shape, env_int, env_int_list, selected
from .overhead import bare_round_trip_ms

IMPLS = ("vkattn", "eager", "sdpa")
FIXED_CONTEXT = 16
# Llama-3.2-1B (config.json of meta-llama/Llama-3.2-1B), layers cut
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
                tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
                rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, original_max_position_embeddings=8192))


def run(shape: Shape, device) -> list:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import torch
        import transformers
        from vkattn.hf import VkattnCache
    except ImportError as e:
        print(f"skip hf: {e}")
        return []
    contexts = env_int_list("VKATTN_PERF_CONTEXT", [512, 2048])
    layers = env_int("VKATTN_PERF_HF_LAYERS", 2)
    batch = env_int("VKATTN_PERF_HF_BATCH", 1)
    tag = "" if batch == 1 else f" B={batch}"
    names = [f"hf generate L={L}{tag}" for L in contexts] + [f"hf attention call L={FIXED_CONTEXT}{tag} (fixed cost)"]
    if not any(selected(n) for n in names):
        return []
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(num_hidden_layers=layers, **LLAMA_1B)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    bench = _Bench(model, torch, transformers, VkattnCache, shape, batch)
    desc = (f"Llama-3.2-1B-shaped, {layers} layers, hq=32 hkv=8 d=64, vocab 128256, float32 model, "
            f"vkattn cache {shape.dtype}, batch {batch}")
    rows = []
    for L, name in zip(contexts + [FIXED_CONTEXT], names):
        if not selected(name):
            continue
        res = {impl: bench.measure(impl, L) for impl in IMPLS}
        vk, ea, sd = (res[i] for i in IMPLS)
        rtol = 1e-3 if shape.dtype == "float32" else 2e-2
        first = res["eager"].pop("first_scores")
        err = float((vk.pop("first_scores") - first).abs().max() / first.abs().max())
        sd.pop("first_scores")
        ok = err <= rtol
        extra = {"L": L, "layers": layers, "rtol": rtol, "first_step_rel_err": err}
        for impl in IMPLS:
            extra.update({f"{impl}_{k}": v for k, v in res[impl].items()})
        if L == FIXED_CONTEXT:
            bare = bare_round_trip_ms(device, 200, 20)["median_ms"]
            extra["bare_round_trip_ms"] = bare
            rows.append(Row(case=name, kernel="hf fixed", shape=desc, vkattn_ms=vk["call_ms"],
                            vkattn_min_ms=vk["call_min_ms"], numpy_ms=ea["call_ms"],
                            speedup_vs_numpy=ea["call_ms"] / vk["call_ms"], metric="x bare",
                            value=vk["call_ms"] / bare, verified=ok, torch_ms=sd["call_ms"], extra=extra))
        else:
            rows.append(Row(case=name, kernel="hf", shape=desc, vkattn_ms=vk["step_ms"], vkattn_min_ms=vk["step_min_ms"],
                            numpy_ms=ea["step_ms"], speedup_vs_numpy=ea["step_ms"] / vk["step_ms"],
                            metric="% attention", value=100 * vk["attn_share"], verified=ok, torch_ms=sd["step_ms"],
                            extra=extra))
    return rows


def notes(rows) -> None:
    """What the table does not show: each implementation's attention share, the fixed cost."""
    for r in rows:
        x = r.extra
        if r.kernel == "hf":
            share = ", ".join(f"{i} {x[f'{i}_attn_ms']:.2f} ms ({100 * x[f'{i}_attn_share']:.1f}%)" for i in IMPLS)
            print(f"  {r.case}: per token vkattn {r.vkattn_ms:.1f} ms, eager {r.numpy_ms:.1f} ms, sdpa "
                  f"{r.torch_ms:.1f} ms; attention (update + attention, {x['layers']} layers) of a step: {share}")
        if r.kernel == "hf fixed":
            fwd = x["vkattn_vkattn_forward_ms"]
            print(f"  {r.case}: vkattn {r.vkattn_ms:.3f} ms per attention call (update + attention) "
                  f"= {r.value:.1f} x a bare Kompute round trip ({x['bare_round_trip_ms']:.3f} ms); of it "
                  f"the vkattn cache's forward {fwd:.3f} ms, the rest (update, tensor conversion and packing) {r.vkattn_ms - fwd:.3f} ms; "
                  f"eager {r.numpy_ms:.3f} ms, sdpa {r.torch_ms:.3f} ms")


class _Bench:
    """generate() of one model with the step, cache-update and attention-call times recorded."""

    def __init__(self, model, torch, transformers, cache_cls, shape: Shape, batch: int = 1):
        self.model, self.torch, self.tf, self.cache_cls, self.shape = model, torch, transformers, cache_cls, shape
        self.batch = batch

    def measure(self, impl: str, L: int) -> dict:
        torch, tf, model = self.torch, self.tf, self.model
        warm, iters = max(self.shape.warmup, 1), self.shape.iters
        n_new = warm + iters + 1
        ids = torch.randint(3, model.config.vocab_size, (self.batch, L), generator=torch.Generator().manual_seed(L))
        if impl == "vkattn":
            cache = self.cache_cls(model.config, L + n_new, batch_size=self.batch, dtype=self.shape.dtype)
        else:
            cache = tf.DynamicCache(config=model.config)
        timed = {"update": [], "attention": [], "store": []}
        # decode calls only: one new row (update's key states and the attention's query: axis 2;
        # the vkattn store's call: every row's count 1)
        decode = {"update": lambda a: a[0].shape[2] == 1, "attention": lambda a: a[1].shape[2] == 1,
                  "store": lambda a: all(int(c) == 1 for c in a[0])}

        def timer(fn, key):
            def wrapped(*a, **kw):
                t0 = time.perf_counter()
                out = fn(*a, **kw)
                t1 = time.perf_counter()
                if decode[key](a):
                    timed[key].append(t1 - t0)
                return out
            return wrapped

        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.llama import modeling_llama
        fn = modeling_llama.eager_attention_forward if impl == "eager" else ALL_ATTENTION_FUNCTIONS[impl]
        ALL_ATTENTION_FUNCTIONS[impl] = timer(fn, "attention")             # this instance only; removed below
        cache.update = timer(cache.update, "update")
        for layer in cache.layers if impl == "vkattn" else ():           # the vkattn call inside the attention
            layer._store.forward = timer(layer._store.forward, "store")
        stamps = []

        class Stamp(tf.LogitsProcessor):
            def __call__(self, input_ids, scores):
                stamps.append(time.perf_counter())
                return scores

        model.set_attn_implementation(impl)
        try:
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=n_new, do_sample=False, past_key_values=cache,
                                     logits_processor=tf.LogitsProcessorList([Stamp()]), output_scores=True,
                                     return_dict_in_generate=True)
        finally:
            del ALL_ATTENTION_FUNCTIONS[impl]
            if impl == "vkattn":
                cache.close()
        steps = np.diff(stamps)[warm:]
        layers = model.config.num_hidden_layers
        upd, att, store = (np.asarray(timed[k][warm * layers:]) for k in ("update", "attention", "store"))
        call = upd + att
        step_ms = float(np.median(steps)) * 1e3
        attn_ms = float(np.median(call)) * 1e3 * layers
        return {"step_ms": step_ms, "step_min_ms": float(np.min(steps)) * 1e3, "prefill_ms": (stamps[0] - t0) * 1e3,
                "call_ms": float(np.median(call)) * 1e3, "call_min_ms": float(np.min(call)) * 1e3,
                "update_ms": float(np.median(upd)) * 1e3, "attn_ms": attn_ms,
                "vkattn_forward_ms": float(np.median(store)) * 1e3 if store.size else None, "attn_share": attn_ms / step_ms,
                "tokens": out.sequences[0, L:].tolist(), "first_scores": out.scores[0].float()}
