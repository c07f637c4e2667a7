"""``python -m vkattn demo``: a model-shaped prefill + decode loop, then a paged batch of ragged
sequences (chunked prefill, batch decode, a fork), every result verified.

``python -m vkattn generate [--model DIR] ...``: transformers ``generate()`` of a Llama-shaped
model (random weights, or a local model directory; nothing is downloaded) through vkattn and
through eager attention: tokens/s of each and whether the tokens match (needs the hf extra;
``--help`` lists the options).

``python -m vkattn check [--quick] [--json FILE]``: the self-test for this machine's Vulkan device
(every kernel path vkattn picks there against the numpy reference; ``vkattn/check.py``).

``python -m vkattn devices`` lists the Vulkan devices. Shape knobs for the demo (environment):
VKATTN_DEMO_HEADS (32), _KV_HEADS (8), _HEAD_DIM (128), _PROMPT (512), _STEPS (32),
_CAPACITY (4096), _DTYPE (float16).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import numpy as np

from . import KVCache, PagedKVCache, default_device, list_devices
from .check import main as check_main
from .formats import FORMATS
from .reference import TOLERANCE, attention, round_to


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SystemExit(f"{name}={raw!r}: expected a positive integer")
    if value < 1:
        raise SystemExit(f"{name}={raw!r}: expected a positive integer")
    return value


def demo() -> int:
    hq = _env_int("VKATTN_DEMO_HEADS", 32)
    hkv = _env_int("VKATTN_DEMO_KV_HEADS", 8)
    d = _env_int("VKATTN_DEMO_HEAD_DIM", 128)
    prompt = _env_int("VKATTN_DEMO_PROMPT", 512)
    steps = _env_int("VKATTN_DEMO_STEPS", 32)
    cap = _env_int("VKATTN_DEMO_CAPACITY", 4096)
    dtype = os.environ.get("VKATTN_DEMO_DTYPE", "float16")
    if dtype not in FORMATS:
        raise SystemExit(f"VKATTN_DEMO_DTYPE={dtype!r}: expected one of {', '.join(FORMATS)}")
    if hq % hkv:
        raise SystemExit(f"VKATTN_DEMO_HEADS={hq} must be a multiple of VKATTN_DEMO_KV_HEADS={hkv}")
    if prompt + steps > cap:
        raise SystemExit(f"prompt {prompt} + steps {steps} exceed VKATTN_DEMO_CAPACITY={cap}")

    dev = default_device()
    print(f"device   : {dev.name} ({'software Vulkan device' if dev.is_software else dev.info.device_type}),"
          f" subgroup {dev.subgroup_size}, shared memory {dev.max_shared_memory} B")
    print(f"shape    : {hq} q heads / {hkv} kv heads, head_dim {d}, {dtype} cache, capacity {cap}")
    rng = np.random.default_rng(0)
    cache = KVCache(cap, hkv, d, dtype=dtype, device=dev)
    atol, rtol = TOLERANCE[cache.dtype]
    host_k = np.zeros((hkv, 0, d), np.float32)
    host_v = np.zeros((hkv, 0, d), np.float32)

    def check(out, q, label):
        ref = attention(q, host_k, host_v)
        err = float(np.abs(out - ref).max())
        ok = bool(np.all(np.abs(out - ref) <= atol + rtol * np.abs(ref)))
        if not ok:
            print(f"{label}: MISMATCH vs numpy reference, max abs error {err:.3g}")
        return ok, err

    # prefill: the prompt's K/V appended and its queries attended, causal (KVCache.forward)
    q = rng.standard_normal((hq, prompt, d), dtype=np.float32)
    k = rng.standard_normal((hkv, prompt, d), dtype=np.float32)
    v = rng.standard_normal((hkv, prompt, d), dtype=np.float32)
    t0 = time.perf_counter()
    cache.plan(hq, prompt, prompt)                  # plan once: pipelines, buffers, sequences
    cache.plan(hq, 1, 1)
    print(f"plan     : prefill + decode pipelines built in {(time.perf_counter() - t0) * 1e3:.0f} ms")
    t0 = time.perf_counter()
    out = cache.forward(q, k, v)
    t_prefill = time.perf_counter() - t0
    host_k, host_v = round_to(k, dtype), round_to(v, dtype)
    t0 = time.perf_counter()
    ok, err = check(out, q, "prefill")
    t_prefill_ref = time.perf_counter() - t0
    all_ok, worst = ok, err
    print(f"prefill  : {prompt} tokens causal  {t_prefill * 1e3:8.2f} ms  (numpy reference {t_prefill_ref * 1e3:.2f} ms)"
          f"  max|err| {err:.2e}  {'verified' if ok else 'FAILED'}")

    lat, ref_lat = [], []
    for step in range(steps):
        q = rng.standard_normal((hq, 1, d), dtype=np.float32)
        k = rng.standard_normal((hkv, 1, d), dtype=np.float32)
        v = rng.standard_normal((hkv, 1, d), dtype=np.float32)
        t0 = time.perf_counter()
        out = cache.forward(q, k, v)
        lat.append(time.perf_counter() - t0)
        host_k = np.concatenate([host_k, round_to(k, dtype)], axis=1)
        host_v = np.concatenate([host_v, round_to(v, dtype)], axis=1)
        t0 = time.perf_counter()
        ok, err = check(out, q, f"step {step}")
        ref_lat.append(time.perf_counter() - t0)
        all_ok &= ok
        worst = max(worst, err)
    med, ref_med = float(np.median(lat[1:] or lat)), float(np.median(ref_lat[1:] or ref_lat))
    print(f"decode   : {steps} steps, context {prompt + 1}..{prompt + steps}, append+attend per step in one submission")
    print(f"           vkattn {med * 1e3:.3f} ms/step (min {min(lat) * 1e3:.3f})   numpy reference {ref_med * 1e3:.3f} ms/step"
          f"   speed-up x{ref_med / med:.2f}")
    print(f"verified : {steps + 1}/{steps + 1} results within atol {atol} rtol {rtol} of the numpy reference"
          if all_ok else "verified : FAILED")
    print(f"           max abs error {worst:.2e}; cache length {cache.length}/{cache.capacity}, "
          f"{cache.nbytes / 2**20:.1f} MiB on the device, allocated once")
    cache.close()
    return 0 if (all_ok and paged_demo(dev, hq, hkv, d, dtype, rng)) else 1


def paged_demo(dev, hq, hkv, d, dtype, rng) -> bool:
    """Eight sequences of ragged lengths in one PagedKVCache: one chunked-prefill submission, a
    fork, then batch decode steps, each sequence checked against the numpy reference."""
    lens = [37, 300, 5, 180, 511, 64, 129, 250]
    steps = 8
    pool = PagedKVCache(sum(-(-(n + steps + 1) // 16) for n in lens) + 40, 16, hkv, d, dtype=dtype, device=dev)
    atol, rtol = TOLERANCE[pool.dtype]
    sids = [pool.add_sequence() for _ in lens]
    host = {}
    worst, ok_all, checked = 0.0, True, 0

    def run(ids, counts):
        nonlocal worst, ok_all, checked
        total = sum(counts)
        q = rng.standard_normal((hq, total, d), dtype=np.float32)
        k = rng.standard_normal((hkv, total, d), dtype=np.float32)
        v = rng.standard_normal((hkv, total, d), dtype=np.float32)
        t0 = time.perf_counter()
        out = pool.forward(ids, q, k, v, n_new=counts)
        dt = time.perf_counter() - t0
        a = 0
        for sid, n in zip(ids, counts):
            hk, hv = host.get(sid, (np.zeros((hkv, 0, d), np.float32),) * 2)
            hk = np.concatenate([hk, round_to(k[:, a:a + n], dtype)], axis=1)
            hv = np.concatenate([hv, round_to(v[:, a:a + n], dtype)], axis=1)
            host[sid] = (hk, hv)
            ref = attention(q[:, a:a + n], hk, hv)
            err = np.abs(out[:, a:a + n] - ref)
            ok_all &= bool(np.all(err <= atol + rtol * np.abs(ref)))
            worst = max(worst, float(err.max()))
            checked += 1
            a += n
        return dt

    t0 = time.perf_counter()
    pool.plan(sids, hq, lens)                      # the chunked prefill's pipelines, built now
    t_plan = time.perf_counter() - t0
    t_prefill = run(sids, lens)
    child = pool.fork(sids[4])                     # beam: shares sequence 4's full blocks
    host[child] = host[sids[4]]
    sids.append(child)
    t0 = time.perf_counter()
    pool.plan(sids, hq)                            # batch decode: one token per sequence
    t_plan += time.perf_counter() - t0
    lat = [run(sids, [1] * len(sids)) for _ in range(steps)]
    print(f"paged    : {len(lens)} sequences of {min(lens)}..{max(lens)} tokens, pipelines built in "
          f"{t_plan * 1e3:.0f} ms, one chunked-prefill call {t_prefill * 1e3:.1f} ms; fork; {steps} batch decode "
          f"steps of {len(sids)} sequences {float(np.median(lat)) * 1e3:.2f} ms/step")
    print(f"           {checked} sequence results {'verified' if ok_all else 'FAILED'}, max abs error {worst:.2e}; "
          f"{pool.free_blocks}/{pool.num_blocks} blocks free, {pool.bytes_per_token} bytes/token")
    pool.close()
    return ok_all


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model")


def _tokenizer_of(transformers, model_dir):
    """The tokenizer saved with a model directory, or None where it holds no tokenizer files:
    transformers 5's AutoTokenizer then builds an empty one from the model type (GPT-2: a
    vocabulary of 1) instead of raising, which tokenized the prompt to nothing."""
    if not any(os.path.exists(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES):
        return None
    try:
        return transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError):
        return None


def generate(argv) -> int:
    """The generate demo; returns 0 when vkattn's tokens equal eager attention's."""
    p = argparse.ArgumentParser(prog="python -m vkattn generate", description=(
        "transformers generate() through vkattn and through eager attention: tokens/s of each, and whether the "
        "tokens match. Without --model: a random-weight Llama-shaped model (nothing is downloaded)."))
    p.add_argument("--model", metavar="DIR", help="a local model directory (config + weights; a tokenizer if any)")
    p.add_argument("--prompt", default="The Vulkan attention backend", help="prompt text (with --model's tokenizer)")
    p.add_argument("--prompt-len", type=int, default=128, help="random prompt tokens when there is no tokenizer")
    p.add_argument("--tokens", type=int, default=64, help="new tokens to generate (greedy)")
    p.add_argument("--batch", type=int, default=1, help="prompts; above 1 they are left-padded to ragged lengths")
    p.add_argument("--cache-dtype", default="float32", choices=("float32", "float16", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2", "q4"),
                   help="vkattn cache storage (float32: the tokens should match eager exactly)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the random model")
    args = p.parse_args(argv)
    for name in ("prompt_len", "tokens", "batch", "layers"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import torch
        import transformers
        from .hf import VkattnCache
    except ImportError as e:
        print(f"python -m vkattn generate: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    tokenizer = None
    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True,
                                                                 dtype=torch.float32)
        tokenizer = _tokenizer_of(transformers, args.model)
        what = f"{args.model} ({type(model).__name__})"
    else:
        cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=704,
                                       num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                                       head_dim=32, max_position_embeddings=4096, initializer_range=0.1)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        what = f"random-weight Llama-shaped model, {args.layers} layers, 8 q / 2 kv heads, head_dim 32"
    model.eval()
    model.generation_config.eos_token_id = None           # always --tokens new tokens
    model.generation_config.pad_token_id = 0
    ids = None
    if tokenizer is not None:
        ids = tokenizer([args.prompt] * args.batch, return_tensors="pt").input_ids
    if ids is None or ids.shape[1] == 0:                   # no tokenizer, or one that makes nothing of it
        tokenizer = None
        ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt_len))
    mask = torch.ones_like(ids)
    for i in range(1, args.batch):                         # ragged: row i loses i * len / (2 * batch) tokens
        mask[i, :i * ids.shape[1] // (2 * args.batch)] = 0
    steps = args.tokens
    print(f"device   : {default_device().name}")
    print(f"model    : {what}")
    print(f"generate : batch {args.batch}, prompt {ids.shape[1]} tokens, {steps} new tokens (greedy), "
          f"vkattn cache {args.cache_dtype}")

    # one cache for every vkattn run, emptied by reset(): its pipelines are built once (in the warm-up)
    cache = VkattnCache(model.config, ids.shape[1] + steps, batch_size=args.batch, dtype=args.cache_dtype)

    def run(impl, n):
        model.set_attn_implementation(impl)
        cache.reset()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, past_key_values=cache if impl == "vkattn" else None,
                                 max_new_tokens=n, do_sample=False)
        return out[:, ids.shape[1]:], time.perf_counter() - t0

    results = {}
    for impl in ("vkattn", "eager"):
        run(impl, 2)                                       # warm-up: builds vkattn's pipelines
        toks, dt = run(impl, steps)
        results[impl] = toks
        print(f"{impl:9}: {args.batch * steps} tokens in {dt:.2f} s  {args.batch * steps / dt:8.1f} tokens/s "
              f"(prefill included)")
    cache.close()
    same = (results["vkattn"] == results["eager"])
    if bool(same.all()):
        print(f"tokens   : match ({same.numel()}/{same.numel()})")
    else:
        first = int(torch.nonzero(~same)[0, 1])
        print(f"tokens   : DIFFER ({int(same.sum())}/{same.numel()} equal; first difference at new token {first})")
    if tokenizer is not None:
        print(f"text     : {tokenizer.decode(results['vkattn'][0])!r}")
    return 0 if bool(same.all()) else 1


def devices() -> int:
    for d in list_devices():
        print(f"[{d.index}] {d.name}  type={d.device_type} software={d.is_software} subgroup={d.subgroup_size} "
              f"shared={d.max_compute_shared_memory_size} storage_range={d.max_storage_buffer_range} "
              f"max_allocation={d.max_memory_allocation_size} "
              f"max_workgroup_size={min(d.max_compute_workgroup_invocations, d.max_compute_workgroup_size[0])}")
    return 0


COMMANDS = {"demo": "a model-shaped prefill + decode loop and a paged batch, every result verified (the default)",
            "check": "the self-test for this machine's Vulkan device (--help: its options)",
            "generate": "transformers generate() through vkattn and eager (--help: its options)",
            "devices": "list the Vulkan devices and their limits"}


def _usage() -> str:
    return "usage: python -m vkattn [demo|check|generate|devices] [--help]\n\n" + \
        "\n".join(f"  {name:9} {what}" for name, what in COMMANDS.items())


def _no_options(cmd: str, argv: list) -> None:
    """demo and devices take no arguments: --help describes them (exit 0), anything else exits 2."""
    epilog = __doc__.split("Shape knobs for the demo")[1].strip() if cmd == "demo" else None
    p = argparse.ArgumentParser(prog=f"python -m vkattn {cmd}", description=COMMANDS[cmd],
                                epilog=epilog and "Shape knobs for the demo " + epilog)
    p.parse_args(argv)


def main(argv=None) -> int:
    # say so when a pipeline is built for the first time (seconds on lavapipe): nobody should think
    # the demo hangs. The "vkattn" logger gets its own handler: importing kp installs one on the
    # root logger (level WARNING), which would make logging.basicConfig a no-op. Restored on return
    # (main may be called in-process, e.g. by the tests)
    log = logging.getLogger("vkattn")
    saved = log.level, log.propagate
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)
    try:
        return _main(argv)
    finally:
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]


def _main(argv) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cmd = argv[0] if argv else "demo"
    if cmd in ("-h", "--help"):
        print(_usage())
        return 0
    if cmd == "check":
        return check_main(argv[1:])
    if cmd == "generate":
        return generate(argv[1:])
    if cmd in ("demo", "devices"):
        try:
            _no_options(cmd, argv[1:])
        except SystemExit as e:                 # --help: 0; an unknown argument: 2 (argparse said why)
            return int(e.code or 0)
        return demo() if cmd == "demo" else devices()
    print(f"python -m vkattn: unknown command {cmd!r}\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
