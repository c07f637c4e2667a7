"""Run SmolLM2-135M-Instruct on the Vulkan device and check it against transformers' eager model.

    python -m examples.llama_device                    # float32 and float16 weights, 3 prompts x 64 tokens
    python -m examples.llama_device --weights q4_1     # the GGUF's blocks on the device (fastest)
    python -m examples.llama_device --weights float16 --new 16 --prompts 1

For each weight setting: greedy tokens of each prompt on the device (DeviceLlama) and in eager
(float32; for float16 weights, eager holds the same float16-rounded weights; q4_1 runs the GGUF's
own Q4_1 / Q8_0 blocks, whose dequantised values are eager's float32 weights), whether they are
equal, the largest logit difference over every step, and tokens per second of both (prompt and
decode separately; the prompt figures of the first run of a prompt length include lavapipe's
pipeline compilation). Needs `make model` (scripts/model.sh). Exit status 1 if tokens differ.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

PROMPTS = ["What is the capital of France?",
           "Write a short poem about the sea.",
           "Explain in two sentences why the sky is blue."]


def prompt_ids(tok, text):
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def compare(cfg, sd, tok, weight_dtype, prompts, new, warm=False, log=print, **model_kw):
    """Device against eager for each prompt; returns a list of dicts (one per prompt)."""
    from .model import DeviceLlama
    from .reference import eager_generate, eager_model
    from .weights import load_blocks
    if weight_dtype == "q4_1":
        model_kw["blocks"] = load_blocks()
    dm = DeviceLlama(cfg, sd, weight_dtype=weight_dtype, capacity=max(len(p) for p in prompts) + new, **model_kw)
    if weight_dtype == "q4_1":        # the GGUF's own blocks: exactly the float32 weights eager holds
        ref = dm.reference_state_dict()
        same = all(np.array_equal(ref[k], sd[k].numpy()) for k in ref) and set(ref) == set(sd)
        log(f"[q4_1] the device's dequantised weights equal the float32 state dict: {same}")
        eager = eager_model(cfg, sd)
    else:
        eager = eager_model(cfg, sd, round_float16=weight_dtype == "float16")
    rows = []
    try:
        for ids in prompts:
            if warm:                     # pipelines of this prompt length compiled, caches of torch warm
                dm.generate(ids, 2)
                eager_generate(eager, ids, 2)
            got, got_logits = dm.generate(ids, new, return_logits=True)
            dev_t = dm.last_times
            want, want_logits, eager_t = eager_generate(eager, ids, new)
            same = got == want
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
            n = len(got) if first is None else first + 1      # logits compared up to the first divergence
            diff = float(np.abs(got_logits[:n] - want_logits[:n]).max())
            rows.append(dict(weights=weight_dtype, prompt_len=len(ids), new=new, equal=same, first_diff=first,
                             max_logit_diff=diff, logit_scale=float(np.abs(want_logits).max()),
                             dev_prompt_tps=len(ids) / dev_t[0], dev_decode_tps=(new - 1) / dev_t[1],
                             eager_prompt_tps=len(ids) / eager_t[0], eager_decode_tps=(new - 1) / eager_t[1],
                             text=tok.decode(got), submissions=dm.decode_graph(True).submissions,
                             recordings=dm.decode_graph(True).recordings))
            r = rows[-1]
            log(f"[{weight_dtype}] prompt {len(ids)} tokens: tokens equal {same} (first difference "
                f"{first}), max |logit diff| {diff:.2e} (logits up to {r['logit_scale']:.1f}); device "
                f"{r['dev_prompt_tps']:.2f} / {r['dev_decode_tps']:.2f} tok/s, eager {r['eager_prompt_tps']:.2f} / "
                f"{r['eager_decode_tps']:.2f} tok/s (prompt / decode)\n    {r['text']!r}")
    finally:
        dm.close()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m examples.llama_device", description=__doc__.split("\n")[1])
    ap.add_argument("--weights", nargs="+", default=["float32", "float16"], choices=["float32", "float16", "q4_1"])
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt (64)")
    ap.add_argument("--prompts", type=int, default=3, choices=[1, 2, 3])
    args = ap.parse_args(argv)
    from .weights import available, load
    why = available()
    if why:
        print(f"the model is not installed: {why}", file=sys.stderr)
        return 2
    cfg, sd, tok = load()
    prompts = [prompt_ids(tok, p) for p in PROMPTS[:args.prompts]]
    rows = []
    for wd in args.weights:
        rows += compare(cfg, sd, tok, wd, prompts, args.new, log=lambda s: print(s, flush=True))
    ok = all(r["equal"] for r in rows)
    print("all tokens equal" if ok else "TOKENS DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
