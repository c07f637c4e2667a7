#!/usr/bin/env bash
# Idempotent set-up for vkattn on Debian/Ubuntu: system packages, .venv, kp built from its sdist
# against the system headers (scripts/lib.sh), and vkattn installed (editable) into the venv.
# --hf also installs the hf extra (torch 2.13.0 CPU, transformers 5.23) for vkattn.hf.
# Fast the second time: every step checks before it acts.
set -euo pipefail
cd "$(dirname "$0")/.."
HF=0
for arg in "$@"; do
  case "$arg" in
    --hf) HF=1 ;;
    *) echo "usage: scripts/setup.sh [--hf]" >&2; exit 2 ;;
  esac
done
# shellcheck source=lib.sh
. scripts/lib.sh

PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
vkattn_system_packages

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV" || { echo "vkattn setup: '$PY -m venv' failed (Debian: apt-get install python3-venv)" >&2; exit 1; }
fi
VPY="$VENV/bin/python"
stamp="$VENV/.vkattn-setup"
want=$(cat pyproject.toml scripts/setup.sh scripts/lib.sh | sha256sum | cut -c1-16)
if ! { [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VPY" -c "import kp, numpy, pytest, xdist, vkattn" 2>/dev/null; }; then
  "$VPY" -m pip install -q --upgrade pip "setuptools>=70" wheel
  "$VPY" -m pip install -q "numpy<2" pytest pytest-xdist hypothesis
  vkattn_kp "$VPY"
  "$VPY" -m pip install -q --no-deps --no-build-isolation -e .
  "$VPY" -c "import kp, vkattn"
  echo "$want" > "$stamp"
  echo "vkattn setup: ready ($VENV)"
fi

# the hf extra, pinned: a plain `torch` would resolve to a CUDA build of GBs; numpy stays < 2 (kp)
if [ "$HF" = 1 ] && ! "$VPY" -c "import sys, torch, transformers
sys.exit(not (torch.__version__.startswith('2.13.0') and transformers.__version__.startswith('5.23.')))" 2>/dev/null; then
  echo "vkattn setup: installing the hf extra (torch 2.13.0 CPU, transformers 5.23)"
  "$VPY" -m pip install -q "torch==2.13.0" "transformers==5.23.*" "numpy<2"
  "$VPY" -c "import vkattn.hf"
  echo "vkattn setup: hf extra ready ($VENV)"
fi
