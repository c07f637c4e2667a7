"""vkattn.hf: generate() over a VkattnCache with attn_implementation="vkattn" against
attn_implementation="eager" on seeded tiny random-weight Llama, Mistral, Qwen2, Gemma-2 and GPT-2
models (no download). Needs the extra (torch, transformers): `make setup-hf`; CI installs it.

Scores are compared per generation step relative to the step's score scale:
max |vkattn - eager| <= rtol * max |eager| over the step's (batch, vocab) logits.
"""
import os

import numpy as np
import pytest
from conftest import HF_SKIP, TRANSFORMERS_MIN

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="the hf extra is not installed (make setup-hf)")
transformers = pytest.importorskip("transformers", minversion=TRANSFORMERS_MIN, reason=HF_SKIP)

import vkattn                                                  # noqa: E402
import vkattn.hf                                               # noqa: E402
from vkattn.hf import VkattnCache                              # noqa: E402

VOCAB, PROMPT, NEW = 211, 11, 48
WINDOW = 8                       # shorter than the prompts: the window is exercised from the prefill on
# initializer_range 0.2 makes greedy decoding of these random models wander over many tokens (0.02 for Gemma-2,
# whose scaled embeddings collapse onto one token otherwise); the top-2 logit gap stays >= ~5e-4 of the scale
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(num_key_value_heads=2, head_dim=16, initializer_range=0.2, **COMMON),
    "mistral": lambda: transformers.MistralConfig(num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                                                  initializer_range=0.2, **COMMON),
    # layer 0 full attention, layer 1 a sliding window
    "qwen2": lambda: transformers.Qwen2Config(num_key_value_heads=2, use_sliding_window=True, sliding_window=WINDOW,
                                              max_window_layers=1, initializer_range=0.2, **COMMON),
    # alternating sliding/full layers, logit softcap that bites, query_pre_attn_scalar != head_dim
    "gemma2": lambda: transformers.Gemma2Config(num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                                                attn_logit_softcapping=0.05, query_pre_attn_scalar=24,
                                                initializer_range=0.02, **COMMON),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                            initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2),
}
ARCHS = list(CONFIGS)
_MODELS = {}


def model_for(arch, dtype=torch.float32):
    key = (arch, dtype)
    if key not in _MODELS:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval().to(dtype)
        model.generation_config.eos_token_id = None          # always NEW tokens
        _MODELS[key] = model
    return _MODELS[key]


def prompts(batch, lengths=None, seed=1):
    """Left-padded prompts (batch, PROMPT) and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    for i, n in enumerate(lengths or [PROMPT] * batch):
        mask[i, :PROMPT - n] = 0
        ids[i, :PROMPT - n] = 0
    return ids, mask


def generate(model, impl, ids, mask=None, cache=None, seed=None, **kw):
    model.set_attn_implementation(impl)
    if seed is not None:
        torch.manual_seed(seed)
    kw = dict(dict(max_new_tokens=NEW, do_sample=False, output_scores=True, return_dict_in_generate=True), **kw)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, past_key_values=cache, **kw)


def rel_err(got, want):
    """Largest per-step error relative to the step's score scale."""
    assert len(got) == len(want)
    return max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(got, want))


def assert_same(vk, eager, rtol=1e-3):
    assert vk.sequences.tolist() == eager.sequences.tolist()
    assert rel_err(vk.scores, eager.scores) <= rtol


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_eager(arch):
    model = model_for(arch)
    ids, _ = prompts(1)
    cache = VkattnCache(model.config, PROMPT + NEW, dtype="float32")
    vk = generate(model, "vkattn", ids, cache=cache)
    assert_same(vk, generate(model, "eager", ids))
    assert cache.get_seq_length() == PROMPT + NEW - 1 and len(set(vk.sequences[0, PROMPT:].tolist())) > 5


@pytest.mark.parametrize("arch", ARCHS)
def test_left_padded_ragged_batch_matches_eager(arch):
    model = model_for(arch)
    ids, mask = prompts(3, [PROMPT, 4, 7])
    cache = VkattnCache(model.config, PROMPT + NEW, batch_size=3, dtype="float32")
    vk = generate(model, "vkattn", ids, mask, cache)
    assert_same(vk, generate(model, "eager", ids, mask))
    # padding is not stored: each row holds its own tokens only
    assert [cache.layers[0]._store.pool.length(s) for s in cache.layers[0]._store.ids] == \
        [PROMPT + NEW - 1, 4 + NEW - 1, 7 + NEW - 1]


@pytest.mark.parametrize("arch", ARCHS)
def test_float16_cache_first_step(arch):
    model = model_for(arch)
    ids, mask = prompts(2, [PROMPT, 6])
    vk = generate(model, "vkattn", ids, mask, VkattnCache(model.config, PROMPT + 1, batch_size=2), max_new_tokens=1)
    assert rel_err(vk.scores, generate(model, "eager", ids, mask, max_new_tokens=1).scores) <= 2e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_cache_first_step(arch):
    # a bfloat16 cache (torch.bfloat16 maps to it) under a float32 model: K/V rounded to 8
    # significant bits, so the first step's scores within 2e-2 of eager's, as a float16 cache's
    model = model_for(arch)
    ids, mask = prompts(2, [PROMPT, 6])
    cache = VkattnCache(model.config, PROMPT + 1, batch_size=2, dtype=torch.bfloat16)
    assert cache.dtype == "bfloat16"
    vk = generate(model, "vkattn", ids, mask, cache, max_new_tokens=1)
    assert rel_err(vk.scores, generate(model, "eager", ids, mask, max_new_tokens=1).scores) <= 2e-2


def test_bfloat16_model_on_a_bfloat16_cache_generates_and_round_trips(tmp_path):
    model = model_for("llama", torch.bfloat16)
    ids, mask = prompts(2, [PROMPT, 3])
    cache = VkattnCache(model.config, PROMPT + 8, batch_size=2, dtype=torch.bfloat16)
    vk = generate(model, "vkattn", ids, mask, cache, max_new_tokens=8)
    eager = generate(model, "eager", ids, mask, max_new_tokens=8)
    assert vk.scores[0].dtype == eager.scores[0].dtype
    assert rel_err(vk.scores[:1], eager.scores[:1]) <= 2e-2
    # the stored rows are bfloat16 values; a save/load round trip keeps them bit for bit
    path = tmp_path / "bf16.safetensors"
    cache.save(path)
    assert vkattn.cache_file_info(path)["dtype"] == "bfloat16"
    other = VkattnCache(model.config, PROMPT + 8, batch_size=2, dtype="bfloat16")
    other.load(path)
    again = tmp_path / "again.safetensors"
    other.save(again)
    from safetensors.numpy import load_file
    first, second = load_file(str(path)), load_file(str(again))
    assert first.keys() == second.keys() and any(name.endswith(".k") for name in first)
    for name, t in first.items():
        assert np.array_equal(t, second[name]), name
        if name.endswith((".k", ".v")):
            assert t.dtype == np.uint16 and t.size          # bfloat16 bits
    with pytest.raises(vkattn.CacheFileMismatchError, match="dtype"):
        VkattnCache(model.config, PROMPT + 8, batch_size=2, dtype="float16").load(path)


@pytest.mark.parametrize("arch", ARCHS)
def test_crop_then_continue(arch):
    """generate, crop the last 5 positions (a rejected speculation), continue from the cache:
    the same as eager generating the continuation from scratch."""
    model = model_for(arch)
    ids, _ = prompts(1)
    cache = VkattnCache(model.config, PROMPT + 40, dtype="float32")
    first = generate(model, "vkattn", ids, cache=cache, max_new_tokens=20)
    assert cache.get_seq_length() == PROMPT + 19
    cache.crop(-5)
    assert [layer.get_seq_length() for layer in cache.layers] == [PROMPT + 14] * 2
    resume = first.sequences[:, :PROMPT + 15]
    vk = generate(model, "vkattn", resume, cache=cache, max_new_tokens=20)
    assert_same(vk, generate(model, "eager", resume, max_new_tokens=20))


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_prompt_lookup_decoding_crops_and_matches_greedy(arch, monkeypatch):
    """Assisted decoding (prompt lookup) verifies several candidate tokens per forward and crops
    the rejected ones: the tokens equal plain greedy eager decoding."""
    model = model_for(arch)
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])
    crops = []
    real_crop = vkattn.hf.VkattnLayer.crop
    monkeypatch.setattr(vkattn.hf.VkattnLayer, "crop", lambda self, n: (crops.append(n), real_crop(self, n))[1])
    cache = VkattnCache(model.config, 64, dtype="float32")
    vk = generate(model, "vkattn", ids, cache=cache, max_new_tokens=30, prompt_lookup_num_tokens=3,
                  output_scores=False)
    assert any(n < 0 for n in crops), "no candidate was rejected: the test did not exercise crop"
    assert vk.sequences.tolist() == generate(model, "eager", ids, max_new_tokens=30).sequences.tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_beam_search_matches_eager(arch):
    model = model_for(arch)
    ids, mask = prompts(2, [PROMPT, 5])
    kw = dict(num_beams=2, max_new_tokens=24)
    vk = generate(model, "vkattn", ids, mask, VkattnCache(model.config, PROMPT + 24, batch_size=4, dtype="float32"), **kw)
    eager = generate(model, "eager", ids, mask, **kw)
    assert vk.sequences.tolist() == eager.sequences.tolist()
    np.testing.assert_allclose(vk.sequences_scores.numpy(), eager.sequences_scores.numpy(), rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sampling_with_a_seed_matches_eager(arch):
    model = model_for(arch)
    ids, mask = prompts(2, [9, PROMPT])
    kw = dict(do_sample=True, seed=1234, num_return_sequences=2, output_scores=False)
    vk = generate(model, "vkattn", ids, mask, VkattnCache(model.config, PROMPT + NEW, batch_size=4, dtype="float32"), **kw)
    assert vk.sequences.tolist() == generate(model, "eager", ids, mask, **kw).sequences.tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models(dtype):
    model = model_for("llama", dtype)
    ids, mask = prompts(2, [PROMPT, 3])
    vk = generate(model, "vkattn", ids, mask, VkattnCache(model.config, PROMPT + 8, batch_size=2), max_new_tokens=8)
    eager = generate(model, "eager", ids, mask, max_new_tokens=8)
    assert vk.scores[0].dtype == eager.scores[0].dtype
    assert rel_err(vk.scores[:1], eager.scores[:1]) <= 2e-2


def test_batch_repeat_reorder_select_and_crop_match_a_dynamic_cache():
    """The batch operations transformers has on a Cache, on a left-padded batch, each followed by a
    decode step whose logits must equal eager attention over a DynamicCache given the same calls."""
    model = model_for("llama")
    ids, mask = prompts(3, [PROMPT, 4, 7])
    caches = {"vkattn": VkattnCache(model.config, 40, batch_size=6, dtype="float32"),
              "eager": transformers.DynamicCache(config=model.config)}
    g = torch.Generator().manual_seed(5)

    def step(tokens):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -tokens.shape[1]:]
        logits = {}
        for impl, cache in caches.items():
            model.set_attn_implementation(impl)
            with torch.no_grad():
                logits[impl] = model(tokens, attention_mask=mask, position_ids=pos, past_key_values=cache).logits[:, -1]
        assert rel_err([logits["vkattn"]], [logits["eager"]]) <= 1e-4
        assert caches["vkattn"].get_seq_length() == caches["eager"].get_seq_length() == mask.shape[1]

    def decode():
        nonlocal mask
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        step(torch.randint(3, VOCAB, (mask.shape[0], 1), generator=g))

    step(ids)                                                 # an empty cache takes 3 of its 6 rows
    for cache in caches.values():
        cache.batch_repeat_interleave(2)
    mask = mask.repeat_interleave(2, dim=0)
    decode()
    beams = torch.tensor([5, 0, 0, 3, 2, 1])
    for cache in caches.values():
        cache.reorder_cache(beams)
    mask = mask[beams]
    decode()
    keep = torch.tensor([False, True, False, False, True, True])
    for cache in caches.values():
        cache.batch_select_indices(keep)
    mask = mask[keep]
    decode()
    for cache in caches.values():
        cache.crop(-2)
    mask = mask[:, :-2]
    decode()
    assert [caches["vkattn"].layers[0]._store.pool.length(s) for s in caches["vkattn"].layers[0]._store.ids] == \
        [int(n) for n in mask.sum(1)]
    with pytest.raises(ValueError, match="batch_size: the cache was built for 6"):
        caches["vkattn"].batch_repeat_interleave(3)


@pytest.mark.parametrize("batch", [1, 3])
def test_a_decode_step_is_one_submission_per_layer(batch, monkeypatch):
    """update() and the attention of a decode step make one vkattn submission per layer (the
    append fused into the attention); nothing is read back but the attention output."""
    model = model_for("gemma2")
    model.set_attn_implementation("vkattn")
    ids, mask = prompts(batch, [PROMPT, 5, 9][:batch])
    cache = VkattnCache(model.config, 32, batch_size=batch, dtype="float32")
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
        runs = []
        real_run = vkattn._kp.Recording.run
        monkeypatch.setattr(vkattn._kp.Recording, "run", lambda rec: (runs.append(rec), real_run(rec))[1])
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        model(ids[:, -1:], attention_mask=mask, past_key_values=cache)
    assert len(runs) == len(cache.layers) == 2
    assert all(type(layer._store).__name__ == ("_SingleStore" if batch == 1 else "_PagedStore") for layer in cache.layers)


def test_staged_rows_are_appended_when_the_attention_does_not_come():
    """update() only stages; a second update, crop or reorder appends what was staged first."""
    model = model_for("llama")
    cache = VkattnCache(model.config, 16, dtype="float32")
    g = torch.Generator().manual_seed(2)
    k1, v1, k2, v2 = (torch.randn(1, 2, n, 16, generator=g) for n in (3, 3, 2, 2))
    assert cache.update(k1, v1, 0)[0] is k1                  # the new rows, unchanged
    cache.update(k2, v2, 0)
    assert cache.get_seq_length(0) == 5 and cache.layers[0]._store.cache.length == 3
    cache.crop(0)
    k, v = cache.layers[0]._store.cache.read()
    np.testing.assert_array_equal(k[None], torch.cat([k1, k2], dim=2).numpy())
    np.testing.assert_array_equal(v[None], torch.cat([v1, v2], dim=2).numpy())
    with pytest.raises(TypeError, match="pass past_key_values"):          # keys that were not staged
        vkattn.hf.vkattn_attention(model.model.layers[0].self_attn, torch.zeros(1, 4, 1, 16), k1, v1, None)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.layers[0]._store.cache.length == 0


def read_all(cache):
    return [(layer.get_seq_length(), layer._store.cache.length, *map(np.copy, layer._store.cache.read()))
            for layer in cache.layers]


def same_state(a, b):
    return all(x[:2] == y[:2] and np.array_equal(x[2], y[2]) and np.array_equal(x[3], y[3]) for x, y in zip(a, b))


def test_over_capacity_raises_before_anything_is_written():
    model = model_for("llama")
    model.set_attn_implementation("vkattn")
    ids, _ = prompts(1)
    cache = VkattnCache(model.config, PROMPT + 4, dtype="float32")
    with pytest.raises(vkattn.CacheFullError, match=r"0 positions \+ 15 new = 15 > max_cache_len=14"):
        generate(model, "vkattn", ids[:, :5].repeat(1, 3), cache=VkattnCache(model.config, 14))
    with torch.no_grad():
        model(ids, past_key_values=cache)
        before = read_all(cache)
        with pytest.raises(vkattn.CacheFullError, match="max_cache_len=15; nothing was written"):
            model(ids[:, :5], past_key_values=cache)
    assert same_state(read_all(cache), before)
    with pytest.raises(vkattn.CacheFullError):               # through generate: fails at the step that overflows
        generate(model, "vkattn", ids, cache=VkattnCache(model.config, PROMPT + 3), max_new_tokens=10)


def test_a_failing_layer_rolls_back_the_layers_before_it(monkeypatch):
    model = model_for("llama")
    model.set_attn_implementation("vkattn")
    ids, _ = prompts(1)
    cache = VkattnCache(model.config, 32, dtype="float32")
    with torch.no_grad():
        model(ids, past_key_values=cache)
        before = read_all(cache)
        monkeypatch.setattr(cache.layers[1]._store, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            model(ids[:, :2], past_key_values=cache)
    assert same_state(read_all(cache), before)


def test_errors_name_the_argument():
    model = model_for("llama")
    ids, mask = prompts(2, [PROMPT, 5])
    with pytest.raises(ValueError, match="batch_size: this cache holds 1"):
        generate(model, "vkattn", ids, mask, VkattnCache(model.config, 64))
    with pytest.raises(TypeError, match="pass past_key_values=vkattn.hf.VkattnCache"):
        generate(model, "vkattn", ids[:1])
    with pytest.raises(TypeError, match="config: expected a transformers"):
        VkattnCache({"num_hidden_layers": 2}, 64)
    with pytest.raises(TypeError, match="dtype: .*bfloat16 models work"):
        VkattnCache(model.config, 64, dtype=torch.float64)
    with pytest.raises(TypeError, match="dtype: expected 'float32', 'float16', 'int8', 'bfloat16', 'fp8_e4m3', 'fp8_e5m2' or 'q4'"):
        VkattnCache(model.config, 64, dtype="bf16")
    with pytest.raises(ValueError, match="max_cache_len"):
        VkattnCache(model.config, 0)
    with pytest.raises(ValueError, match=r"key_states: expected \(batch, 4, n, 16\) from the config"):
        generate(model, "vkattn", ids[:1], cache=VkattnCache(model_for("gpt2").config, 64))
    right = mask.flip(1)                                     # right padding
    with pytest.raises(ValueError, match="left padding only"):
        generate(model, "vkattn", ids, right, VkattnCache(model.config, 64, batch_size=2))


def test_an_older_transformers_is_refused_at_import_naming_the_version():
    """transformers 5.17 imports but lacks the cache-layer API vkattn.hf implements: the import
    fails with the version found and the one needed, not later inside generate()."""
    import subprocess
    import sys
    code = ("import transformers\ntransformers.__version__ = '5.17.0'\nimport vkattn.hf")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 1
    assert "ImportError: vkattn.hf needs transformers >= 5.23, < 6" in r.stderr and "found 5.17.0" in r.stderr
    assert vkattn.hf._release("5.23.0.dev0") == (5, 23) and vkattn.hf._release("6") == (6, 0)


def test_registered_under_from_pretrained(tmp_path):
    model_for("gpt2").save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="vkattn")
    assert model.config._attn_implementation == "vkattn"
    ids, _ = prompts(1)
    out = model.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=VkattnCache(model.config, 16))
    assert out.shape == (1, PROMPT + 4)


def test_generate_demo_random_model(capsys):
    from vkattn.__main__ import main
    assert main(["generate", "--tokens", "6", "--prompt-len", "9", "--layers", "1", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "tokens   : match (12/12)" in out and out.count("tokens/s") == 2


def test_generate_demo_local_model_directory(tmp_path, capsys):
    """--model DIR: weights and a tokenizer from a local directory (a word-level tokenizer made here)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from vkattn.__main__ import main
    model_for("llama").save_pretrained(tmp_path)
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--prompt", "w5 w17 w99 w5 w17", "--tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out and "prompt 5 tokens" in out and "tokens   : match (5/5)" in out
    assert "text     : 'w" in out


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_generate_demo_model_directory_without_a_tokenizer(tmp_path, capsys, family):
    """--model DIR holding weights and no tokenizer files: --prompt-len random ids, as the help
    says (transformers 5 builds an empty tokenizer from a GPT-2 config instead of raising: the
    prompt came out 0 ids long and generate() failed)."""
    from vkattn.__main__ import main
    model_for(family).save_pretrained(tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--prompt-len", "7", "--tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "prompt 7 tokens" in out and "tokens   : match (3/3)" in out
