"""``python -m perf quality``: what each K/V cache format costs a real model in quality (issue 32
item 3). A fixed text (perf/quality_text.txt, plain English prose written for this) goes through
SmolLM2-135M-Instruct (float32 weights, `make model`) teacher-forced, with transformers'
attention replaced by vkattn.hf over a ``VkattnCache(dtype=fmt)`` for every format of
vkattn.formats.FORMATS (formats added to that table are measured with no change here). For each:

* perplexity = exp(mean over positions of -log p(token i+1 | tokens 0..i)), and its ratio to the
  float32 cache's perplexity;
* KL(p_float32 || p_format) of the next-token distributions, mean and max over positions, the
  float32 *cache* run being the reference (so a fresh float32 run measures run-to-run determinism);
* seconds of the format's run (the whole text, logits included).

The prompt goes through the cache: the text is fed to ``model(...)`` with the VkattnCache as
``past_key_values`` (one forward of the whole text by default; VKATTN_PERF_QUALITY_CHUNK=n feeds n
tokens per forward), and vkattn's forward stores the new K/V rows in the cache's format before it
attends, reading them back as stored (shaders/attn_fresh.glsl for up to
vkattn.tuning.FUSED_APPEND_MAX_ROWS new rows; for more, an append submission and then an
attention over the cache): every key and value attended is the rounded / quantised one.

The host check (VKATTN_PERF_QUALITY_CHECK, on by default; two more runs per format) verifies
that on the real model. (1) A second vkattn run in which every attention call's output is
compared with float64 attention on the same query and the layer's K/V rounded by
``vkattn.reference.round_to`` (each format's definition), and on the exact K/V: the output must
match the rounded one to float32 summation order and be at least 10x closer to it than to the
exact one (where the format rounds anything). (2) ``host-rounded ppl``: the whole text through
torch attention on round_to K/V, an independent implementation of the same format. For a coarse
format it is a second draw of the rounding noise rather than a copy: float differences of 1e-6
between the runs move some values across a rounding boundary, and the runs drift apart from there
(so it is reported, not checked). A sanity row gives transformers' eager perplexity (no cache)
beside the float32 cache's.

Targets (issue 32): a format of at least 8 bits per value within 1% of float32's perplexity, a
4-bit one within 5% (bits per value = 128 / ``KVFormat.per_word``).

Environment (a bad value is an error):
  VKATTN_PERF_FORMATS          comma list of formats (default: every format in vkattn.formats)
  VKATTN_PERF_QUALITY_TOKENS   the first N tokens of the text (default: all of it)
  VKATTN_PERF_QUALITY_CHUNK    tokens per forward (default 0: the whole text in one forward)
  VKATTN_PERF_QUALITY_CHECK    1 (default) / 0: the host-rounded check
  VKATTN_PERF_QUALITY_GENERATE new tokens of the generate() run with each format (default 32; 0: none):
                               greedy generate() from a chat prompt through vkattn.hf, eager's and
                               the float32 cache's tokens beside (reported, not a target)
  VKATTN_PERF_OUT              where quality.json / quality.csv go (perf/out)

    python -m perf quality

Exits 1 when a format misses its target or fails the host check, 2 when the model is missing.
"""
from __future__ import annotations

import os
import pathlib
import sys
import time

import numpy as np

from .common import PerfConfigError, Row, env_int, write_results

TEXT = pathlib.Path(__file__).resolve().with_name("quality_text.txt")
REFERENCE = "float32"
HOST_ATTN = "vkattn_quality_host_rounded"     # host_rounded_logits' attention implementation name
CHECK_ATTN = "vkattn_quality_checked"        # vkattn_logits(check=...)'s
KL_ROWS = 256                                 # positions per block of the KL sums (bounds memory)


def target(fmt: str) -> float:
    """The largest allowed perplexity ratio to float32 for format ``fmt``: 1.01 for 8 bits per
    value or more, 1.05 below (issue 32's targets)."""
    from vkattn.formats import FORMATS
    bits = 128 // FORMATS[fmt].per_word
    return 1.01 if bits >= 8 else 1.05


def formats_from_env() -> list:
    """VKATTN_PERF_FORMATS as a list of format names (default: every format of vkattn.formats)."""
    from vkattn.formats import DTYPES
    raw = os.environ.get("VKATTN_PERF_FORMATS", "").strip()
    if not raw:
        return list(DTYPES)
    names = [p.strip() for p in raw.split(",") if p.strip()]
    bad = [n for n in names if n not in DTYPES]
    if bad or not names:
        raise PerfConfigError(f"VKATTN_PERF_FORMATS={raw!r}: expected a comma list of {', '.join(DTYPES)}")
    return names


# ------------------------------------------------------------------ next-token logits
def _next_token_logits(model, ids, chunk: int, **kw):
    """Teacher-forced logits: ids (T,) int64 torch tensor -> (T - 1, vocab) float32, row i the
    model's scores for token i + 1 after tokens 0..i. ``chunk`` tokens per forward (0: one
    forward), the ``kw`` (past_key_values) passed to every forward."""
    import torch
    T = int(ids.shape[0])
    step = chunk or T
    out = []
    with torch.no_grad():
        for a in range(0, T, step):
            logits = model(input_ids=ids[None, a:a + step], use_cache="past_key_values" in kw, **kw).logits
            out.append(logits[0].float())
    return torch.cat(out)[:-1]


def vkattn_logits(model, ids, fmt: str, chunk: int = 0, device=None, check: dict | None = None):
    """(T - 1, vocab) float32 next-token logits of ``ids`` (T,) with vkattn.hf attention over a
    fresh ``VkattnCache(dtype=fmt)`` of T positions: the text goes through the cache, so every
    K/V row attended is the stored (rounded / quantised) one. The cache is closed after.

    check: a dict to fill with the stored-format check (slower: a host attention per layer and
    forward): every attention call's output is compared with float64 attention on the same
    query and the layer's K/V so far, once rounded by ``vkattn.reference.round_to`` (what the
    cache stores) and once exact; ``err_stored`` / ``err_exact`` are the largest absolute
    differences over layers and positions, ``scale`` the largest |output|."""
    import vkattn.hf
    name = vkattn.hf.NAME
    if check is not None:
        name = _register_checked_attention(fmt, check)
    model.set_attn_implementation(name)
    cache = vkattn.hf.VkattnCache(model.config, max_cache_len=int(ids.shape[0]), dtype=fmt, device=device)
    try:
        return _next_token_logits(model, ids, chunk, past_key_values=cache)
    finally:
        cache.close()
        model.set_attn_implementation("eager")


def eager_logits(model, ids):
    """(T - 1, vocab) float32 next-token logits of ``ids`` (T,) with transformers' eager attention,
    one forward, no cache (the sanity reference)."""
    model.set_attn_implementation("eager")
    return _next_token_logits(model, ids, 0)


def _register_checked_attention(fmt: str, check: dict) -> str:
    """Register (again) the attention implementation CHECK_ATTN: vkattn.hf's attention, then the
    host references described in vkattn_logits, results accumulated into ``check``. Returns its name."""
    import torch
    from transformers import AttentionInterface, AttentionMaskInterface

    import vkattn.hf
    from vkattn.reference import round_to

    check.update(err_stored=0.0, err_exact=0.0, scale=0.0, calls=0)
    seen = {}                                # layer index -> (K, V) so far, (kv_heads, positions, head_dim)

    def reference(q, k, v, scale):
        """float64 causal attention, bottom-right aligned: q (hq, s, d), k/v (hkv, n, d) -> (s, hq, dv)."""
        g = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        s, n = q.shape[1], k.shape[1]
        scores = (q @ k.transpose(1, 2)) * scale
        keep = torch.arange(n)[None, :] <= torch.arange(s)[:, None] + (n - s)
        scores = scores.masked_fill(~keep, float("-inf"))
        return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)

    def checked(module, query, key, value, attention_mask, **kw):
        out, w = vkattn.hf.vkattn_attention(module, query, key, value, attention_mask, **kw)
        if query.shape[0] != 1 or attention_mask is not None:
            raise ValueError("the stored-format check takes one unpadded sequence")
        i = module.layer_idx
        k, v = key[0].detach().float(), value[0].detach().float()
        if i in seen:
            k, v = torch.cat([seen[i][0], k], 1), torch.cat([seen[i][1], v], 1)
        seen[i] = (k, v)
        scale = kw.get("scaling") or query.shape[-1] ** -0.5
        q = query[0].detach().double()
        got = out[0].double()
        stored = reference(q, *(torch.from_numpy(round_to(x.numpy(), fmt)).double() for x in (k, v)), scale)
        exact = reference(q, k.double(), v.double(), scale)
        check["err_stored"] = max(check["err_stored"], float((got - stored).abs().max()))
        check["err_exact"] = max(check["err_exact"], float((got - exact).abs().max()))
        check["scale"] = max(check["scale"], float(got.abs().max()))
        check["calls"] += 1
        return out, w

    AttentionInterface.register(CHECK_ATTN, checked)
    AttentionMaskInterface.register(CHECK_ATTN, AttentionMaskInterface._global_mapping[vkattn.hf.NAME])
    return CHECK_ATTN


def host_rounded_logits(model, ids, fmt: str):
    """(T - 1, vocab) float32 next-token logits of ``ids`` (T,) with torch's
    scaled_dot_product_attention on K/V rounded on the host to ``fmt`` by
    ``vkattn.reference.round_to`` (keys after RoPE, as a cache holds them; int8 per position and
    kv head). One forward, no cache: the format's perplexity by an independent implementation.
    It differs from vkattn's run by more than summation order where the format quantises
    coarsely: float differences of 1e-6 between the two runs' K/V move some values across a
    rounding boundary (one int8 step), so the two are two draws of the same rounding noise."""
    from vkattn.reference import round_to
    return host_logits(model, ids, lambda x: round_to(x, fmt), lambda x: round_to(x, fmt))


def host_logits(model, ids, k_round=None, v_round=None):
    """(T - 1, vocab) float32 next-token logits of ``ids`` (T,) with torch's
    scaled_dot_product_attention on K (after RoPE) and V passed through ``k_round`` / ``v_round``
    (numpy (kv_heads, n, head_dim) float32 -> the same; None: unchanged), one forward, no cache."""
    import torch
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def rounded(x, fn):
        """(batch, kv_heads, n, head_dim) -> the same, each (kv head, position) row as ``fn`` gives it."""
        if fn is None:
            return x
        return torch.stack([torch.from_numpy(np.asarray(fn(x[b].detach().float().numpy()), np.float32))
                            for b in range(x.shape[0])]).to(x.dtype)

    def host_rounded_attention(module, query, key, value, attention_mask, **kw):
        return sdpa_attention_forward(module, query, rounded(key, k_round), rounded(value, v_round),
                                      attention_mask, **kw)

    AttentionInterface.register(HOST_ATTN, host_rounded_attention)
    AttentionMaskInterface.register(HOST_ATTN, sdpa_mask)
    model.set_attn_implementation(HOST_ATTN)
    try:
        return _next_token_logits(model, ids, 0)
    finally:
        model.set_attn_implementation("eager")


# ------------------------------------------------------------------ the measures
def _log_softmax64(logits):
    """(rows, vocab) float32 logits -> float64 log-probabilities."""
    import torch
    return torch.log_softmax(logits.double(), dim=-1)


def nll(logits, ids):
    """Negative log-likelihood of each next token: logits (T - 1, vocab), ids (T,) -> (T - 1,)
    float64 (log-softmax in float64)."""
    import torch
    lse = torch.cat([torch.logsumexp(logits[a:a + KL_ROWS].double(), dim=-1)
                     for a in range(0, logits.shape[0], KL_ROWS)])
    return lse - logits.gather(1, ids[1:, None])[:, 0].double()


def kl_rows(ref_logits, logits):
    """KL(p_ref || p) of each position, (T - 1,) float64, from two (T - 1, vocab) logit arrays:
    sum over the vocabulary of p_ref * (log p_ref - log p), log-softmax in float64, KL_ROWS rows
    at a time. Equal inputs give exactly 0."""
    import torch
    out = []
    for a in range(0, ref_logits.shape[0], KL_ROWS):
        r, g = _log_softmax64(ref_logits[a:a + KL_ROWS]), _log_softmax64(logits[a:a + KL_ROWS])
        out.append((r.exp() * (r - g)).sum(dim=1))
    return torch.cat(out)


def perplexity(logits, ids) -> float:
    """exp(mean NLL) of the next tokens: logits (T - 1, vocab), ids (T,)."""
    return float(nll(logits, ids).mean().exp())


def quality(model, ids, formats, chunk: int = 0, device=None, host_check: bool = False) -> dict:
    """Measure every format of ``formats`` on the token ids ``ids`` (T,) int64 torch tensor with
    ``model`` (a transformers causal LM, float32).

    Returns {"eager": {...}, "reference": {...}, "formats": [{...} per format]}: each entry has
    ``ppl``, ``nll`` (mean), ``seconds`` and ``positions`` (T - 1); the reference (a float32
    cache, run first) also ``kl_mean``/``kl_max`` of KL(p_eager || p_float32 cache); each format
    ``ratio`` (to the reference's perplexity), ``kl_mean``/``kl_max`` (KL(p_float32 cache ||
    p_format) over positions), ``target`` and ``ok`` (finite, ratio within the target). With
    ``host_check`` also ``host_ppl`` (host_rounded_logits' perplexity), ``err_stored``,
    ``err_exact``, ``out_scale`` (vkattn_logits' check, a second vkattn run) and ``reads_stored``
    (see reads_stored)."""
    import torch
    if not torch.is_tensor(ids) or ids.ndim != 1 or ids.shape[0] < 2:
        raise ValueError(f"ids: expected a (T,) torch tensor of token ids with T >= 2, got "
                         f"{tuple(ids.shape) if torch.is_tensor(ids) else type(ids).__name__}")
    ids = ids.to(torch.int64)
    positions = int(ids.shape[0]) - 1
    t0 = time.perf_counter()
    eager = eager_logits(model, ids)
    res = {"eager": dict(ppl=perplexity(eager, ids), nll=float(nll(eager, ids).mean()),
                         seconds=time.perf_counter() - t0, positions=positions)}
    t0 = time.perf_counter()
    ref = vkattn_logits(model, ids, REFERENCE, chunk, device)
    seconds = time.perf_counter() - t0
    kl = kl_rows(eager, ref)
    res["reference"] = dict(ppl=perplexity(ref, ids), nll=float(nll(ref, ids).mean()), seconds=seconds,
                            positions=positions, kl_mean=float(kl.mean()), kl_max=float(kl.max()))
    del eager
    res["formats"] = []
    for fmt in formats:
        t0 = time.perf_counter()
        logits = vkattn_logits(model, ids, fmt, chunk, device)
        seconds = time.perf_counter() - t0
        kl = kl_rows(ref, logits)
        row = dict(format=fmt, ppl=perplexity(logits, ids), nll=float(nll(logits, ids).mean()), seconds=seconds,
                   positions=positions, kl_mean=float(kl.mean()), kl_max=float(kl.max()), target=target(fmt))
        row["ratio"] = row["ppl"] / res["reference"]["ppl"]
        row["ok"] = bool(np.isfinite(row["ppl"]) and np.isfinite(row["kl_mean"]) and row["ratio"] <= row["target"])
        del logits
        if host_check:
            row["host_ppl"] = perplexity(host_rounded_logits(model, ids, fmt), ids)
            check = {}
            vkattn_logits(model, ids, fmt, chunk, device, check=check)
            row.update(err_stored=check["err_stored"], err_exact=check["err_exact"], out_scale=check["scale"],
                       checked_calls=check["calls"])
            row["reads_stored"] = reads_stored(row)
        res["formats"].append(row)
    return res


PROMPT = "Explain in two sentences why a key/value cache speeds up text generation."


def chat_prompt_ids(tok):
    """PROMPT as one user turn of the tokenizer's chat template: (1, n) int64 torch tensor."""
    import torch
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                  return_tensors="pt")
    return ids if torch.is_tensor(ids) else ids["input_ids"]


def generate_all(model, ids, formats, new_tokens: int, device=None) -> dict:
    """Greedy ``model.generate`` of ``new_tokens`` tokens after the prompt ``ids`` ((1, n) int64
    torch tensor) with transformers' eager attention, and through vkattn.hf with a
    ``VkattnCache(dtype=fmt)`` for the float32 reference and every format of ``formats``: the
    end-to-end path a user takes (the prompt through the cache, then one decode step per token).
    Returns {"prompt_tokens": n, "eager": [new ids], "runs": [{"format", "tokens" (new ids),
    "equal_eager" / "equal_float32" (how many leading new tokens equal eager's / the float32
    cache's), "seconds"}], the float32 run first}."""
    import torch

    import vkattn.hf
    if not torch.is_tensor(ids) or ids.ndim != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids: expected a (1, n) torch tensor, got "
                         f"{tuple(ids.shape) if torch.is_tensor(ids) else type(ids).__name__}")
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              attention_mask=torch.ones_like(ids))
    n = int(ids.shape[1])

    def lead(a, b):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        return k

    model.set_attn_implementation("eager")
    with torch.no_grad():
        eager = model.generate(ids, **kw)[0, n:].tolist()
    runs = []
    model.set_attn_implementation(vkattn.hf.NAME)
    try:
        for fmt in [REFERENCE] + [f for f in formats if f != REFERENCE]:
            cache = vkattn.hf.VkattnCache(model.config, max_cache_len=n + new_tokens, dtype=fmt, device=device)
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    out = model.generate(ids, past_key_values=cache, **kw)[0, n:].tolist()
            finally:
                cache.close()
            runs.append(dict(format=fmt, tokens=out, seconds=time.perf_counter() - t0, equal_eager=lead(out, eager)))
    finally:
        model.set_attn_implementation("eager")
    for r in runs:
        r["equal_float32"] = lead(r["tokens"], runs[0]["tokens"])
    return {"prompt_tokens": n, "eager": eager, "runs": runs}


def reads_stored(row: dict) -> bool:
    """The check's verdict: every attention output within 1e-5 of the output scale of attention
    on the round_to values (float32 summation order is all that differs), and -- for a format
    that rounds anything (err_exact above that tolerance) -- at least 10 times closer to it than
    to attention on the exact values."""
    tol = 1e-5 * max(row["out_scale"], 1.0)
    return bool(row["err_stored"] <= tol and (row["err_exact"] <= tol or row["err_stored"] * 10 <= row["err_exact"]))


# ------------------------------------------------------------------ the script
def load_model():
    """(SmolLM2-135M-Instruct float32 model with eager attention, its tokenizer), or a RuntimeError
    saying why it is not installed."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    from examples.llama_device import weights
    why = weights.available()
    if why:
        raise RuntimeError(f"SmolLM2 is not installed ({why})")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d = weights.prepare(verbose=True)
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(str(d))


def text_ids(tok, tokens: int | None = None):
    """The fixed text's token ids, (T,) int64 torch tensor: perf/quality_text.txt as the tokenizer
    splits it (no special tokens), cut to its first ``tokens`` when given."""
    import torch
    ids = tok(TEXT.read_text(), add_special_tokens=False)["input_ids"]
    return torch.tensor(ids[:tokens] if tokens else ids, dtype=torch.int64)


def main(argv=None) -> int:
    if argv:
        print(f"perf quality takes no arguments (settings come from VKATTN_PERF_*; see perf/quality.py), got "
              f"{argv}", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        formats = formats_from_env()
        tokens = env_int("VKATTN_PERF_QUALITY_TOKENS", None, minimum=2)
        chunk = env_int("VKATTN_PERF_QUALITY_CHUNK", 0, minimum=0)
        check = env_int("VKATTN_PERF_QUALITY_CHECK", 1, minimum=0)
        gen = env_int("VKATTN_PERF_QUALITY_GENERATE", 32, minimum=0)
    except PerfConfigError as e:
        print(f"perf quality: {e}", file=sys.stderr)
        return 2
    try:
        model, tok = load_model()
    except RuntimeError as e:
        print(f"perf quality: {e}; make model installs it", file=sys.stderr)
        return 2
    import torch

    import vkattn
    from .model import cpu_name
    ids = text_ids(tok, tokens)
    dev = vkattn.default_device()
    t0 = time.perf_counter()
    res = quality(model, ids, formats, chunk, dev, host_check=bool(check))
    total = time.perf_counter() - t0
    ref, eager = res["reference"], res["eager"]
    feed = f"{chunk} tokens per forward" if chunk else "one forward"
    print(f"SmolLM2-135M-Instruct (float32 weights), {TEXT.name}: {int(ids.shape[0])} tokens, "
          f"{ref['positions']} predictions, {feed}")
    print(f"device: {dev.name}; CPU: {cpu_name()}; torch {torch.__version__} on {torch.get_num_threads()} threads")
    host = (" | host-rounded ppl | max \\|out - stored-K/V attention\\| | max \\|out - exact-K/V attention\\| "
            "| reads stored") if check else ""
    dash = " | ---: | ---: | ---: | --- |" if check else " |"
    none = " | - | - | - | - |" if check else " |"
    print(f"| K/V cache | perplexity | ratio to float32 | target | mean KL(float32 ‖ format) | max KL "
          f"| seconds{host} |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---:" + dash)
    print(f"| eager, no cache (sanity) | {eager['ppl']:.4f} | {eager['ppl'] / ref['ppl']:.5f} | - "
          f"| {ref['kl_mean']:.2e} (eager ‖ float32 cache) | {ref['kl_max']:.2e} | {eager['seconds']:.1f}{none}")
    print(f"| float32 cache (reference) | {ref['ppl']:.4f} | 1 | - | 0 | 0 | {ref['seconds']:.1f}{none}")
    for r in res["formats"]:
        met = "ok" if r["ok"] else "MISSED"
        extra = (f" | {r['host_ppl']:.4f} | {r['err_stored']:.1e} | {r['err_exact']:.1e} "
                 f"| {'yes' if r['reads_stored'] else 'NO'} |") if check else " |"
        print(f"| {r['format']} | {r['ppl']:.4f} | {r['ratio']:.5f} | {100 * (r['target'] - 1):.0f}% {met} "
              f"| {r['kl_mean']:.2e} | {r['kl_max']:.2e} | {r['seconds']:.1f}{extra}")
    generated = None
    if gen:
        generated = generate_all(model, chat_prompt_ids(tok), formats, gen, dev)
        for r in generated["runs"]:
            r["text"] = tok.decode(r["tokens"], skip_special_tokens=True)
        print(f"\ngenerate(): greedy, {gen} new tokens after a {generated['prompt_tokens']}-token chat prompt "
              f"({PROMPT!r}); leading new tokens equal to transformers eager's and to the float32 cache's")
        print("| K/V cache | equal eager | equal float32 cache | seconds | text |")
        print("| --- | ---: | ---: | ---: | --- |")
        for r in generated["runs"]:
            text = r["text"].replace("\n", " ").replace("|", "\\|")
            print(f"| {r['format']} | {r['equal_eager']} of {gen} | {r['equal_float32']} of {gen} "
                  f"| {r['seconds']:.1f} | {text[:90]} |")
        total = time.perf_counter() - t0
    print(f"\ntotal {total:.0f} s")
    rows = [Row(case=f"quality {r['format']}", kernel="quality", shape=f"SmolLM2-135M T={int(ids.shape[0])} {feed}",
                vkattn_ms=r["seconds"] * 1e3, vkattn_min_ms=r["seconds"] * 1e3, numpy_ms=eager["seconds"] * 1e3,
                speedup_vs_numpy=eager["seconds"] / r["seconds"], metric="ppl", value=r["ppl"],
                verified=r["ok"] and r.get("reads_stored", True), extra=r)
            for r in res["formats"]]
    out = write_results(rows, dev.name, stem="quality",
                        extra=dict(cpu=cpu_name(), text=TEXT.name, tokens=int(ids.shape[0]), chunk=chunk,
                                   eager=eager, reference=ref, seconds=total, generate=generated))
    print(f"results: {out}/quality.json, {out}/quality.csv")
    return 0 if all(r.verified for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
