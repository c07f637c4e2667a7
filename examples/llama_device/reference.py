"""The reference the example is checked against: transformers' LlamaForCausalLM (eager
attention, float32, CPU), greedy, one forward per token on its own KV cache, with the logits of
every step and the prompt / decode times."""
from __future__ import annotations

import time

import numpy as np


def eager_model(config, state_dict, round_float16: bool = False):
    """transformers' eager LlamaForCausalLM in float32 holding ``state_dict`` (rounded to float16
    and back first with ``round_float16``: the weights DeviceLlama(weight_dtype="float16") uses)."""
    import torch
    from transformers import LlamaForCausalLM
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).eval()
    sd = {k: (v.half().float() if round_float16 else v.float()) for k, v in state_dict.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise ValueError(f"state dict does not fit: missing {missing}, unexpected {unexpected}")
    if "lm_head.weight" in missing:
        if not config.tie_word_embeddings:
            raise ValueError("lm_head.weight missing for an untied model")
        model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr() \
        or not config.tie_word_embeddings
    return model.to(torch.float32)


def eager_generate(model, prompt_ids, max_new_tokens: int):
    """Greedy tokens, their logits ((n, vocab) float32) and (prompt seconds, decode seconds)."""
    import torch
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    toks, logits, times = [], [], []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            t0 = time.perf_counter()
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            row = out.logits[0, -1].float().numpy()
            t = int(np.argmax(row))
            times.append(time.perf_counter() - t0)
            toks.append(t)
            logits.append(row.copy())
            ids = torch.tensor([[t]], dtype=torch.long)
    return toks, np.stack(logits), (times[0], sum(times[1:]))
