#!/usr/bin/env bash
# Idempotent set-up for vkattn on Debian/Ubuntu: system packages, .venv, kp built from its sdist
# against the system headers (scripts/lib.sh), and vkattn installed (editable) into the venv.
# --hf also installs the hf extra (torch 2.13.0 CPU, transformers 5.23) for vkattn.hf where a CPU
# build of torch is reachable, and otherwise says why not.
# numpy: 2 wherever kp can be built against a pybind11 that supports it (lib.sh: vkattn_numpy_plan).
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

# A venv whose creation failed half-way (e.g. no ensurepip) has a python but no pip: it is never
# trusted. A failed creation removes what it made; a venv without a working pip is made again.
if ! { [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -m pip --version >/dev/null 2>&1; }; then
  [ -e "$VENV" ] && echo "vkattn setup: $VENV is incomplete (no working pip); making it again"
  rm -rf "$VENV"
  if ! "$PY" -m venv "$VENV"; then
    rm -rf "$VENV"
    echo "vkattn setup: '$PY -m venv' failed (Debian: apt-get install python3-venv)" >&2
    exit 1
  fi
fi
VPY="$VENV/bin/python"
vkattn_numpy_plan "$VPY"
stamp="$VENV/.vkattn-setup"
# the stamp is written last, after everything below succeeded, and checked first
want=$({ cat pyproject.toml scripts/setup.sh scripts/lib.sh scripts/kp-0.9.0-features.patch; echo "$VKATTN_NUMPY $VKATTN_PYBIND11"; } | sha256sum | cut -c1-16)
if ! { [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VPY" -c "import kp, numpy, safetensors, pytest, xdist, vkattn" 2>/dev/null; }; then
  rm -f "$stamp"
  echo "vkattn setup: $VKATTN_NUMPY, kp built against $VKATTN_PYBIND11 pybind11"
  "$VPY" -m pip install -q --upgrade pip "setuptools>=70" wheel
  "$VPY" -m pip install -q "$VKATTN_NUMPY" $VKATTN_PY_DEPS pytest "pytest-xdist>=3.2" hypothesis
  vkattn_kp "$VPY"
  "$VPY" -m pip install -q --no-deps --no-build-isolation -e .
  "$VPY" -c "import kp, vkattn"
  echo "$want" > "$stamp"
  echo "vkattn setup: ready ($VENV)"
fi

# The hf extra, pinned to torch's CPU build: a plain `torch` resolves to a CUDA build of GBs. PyPI
# has CPU-only torch wheels for no Linux Python; a CPU build comes from a local wheel folder or
# index in pip's configuration (this project's machines: cp311) or PyTorch's CPU index
# (VKATTN_TORCH_INDEX=URL adds it). Where pip would pick a CUDA build, this says so and installs
# nothing: tests/test_hf.py then skips, naming the missing extra.
if [ "$HF" = 1 ] && ! "$VPY" -c "import sys, torch, transformers
sys.exit(not (torch.__version__.startswith('2.13.0') and transformers.__version__.startswith('5.23.')))" 2>/dev/null; then
  hfreq=("torch==2.13.0" "transformers==5.23.*" "$VKATTN_NUMPY")
  idx=(${VKATTN_TORCH_INDEX:+--extra-index-url "$VKATTN_TORCH_INDEX"})
  report=$(mktemp)
  trap 'rm -f "$report"' EXIT
  if ! "$VPY" -m pip install -q --dry-run --no-deps --ignore-installed "${idx[@]}" --report "$report" "torch==2.13.0" >/dev/null ||
     ! "$VPY" - "$report" <<'PYEOF'
import json, sys
t = [i["metadata"] for i in json.load(open(sys.argv[1]))["install"] if i["metadata"]["name"] == "torch"][0]
cuda = [r for r in t.get("requires_dist", []) if r.lower().startswith(("nvidia-", "cuda-"))]
sys.exit(1 if cuda else 0)
PYEOF
  then
    pyv=$("$VPY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    echo "vkattn setup: hf extra SKIPPED: no CPU build of torch 2.13.0 for Python $pyv is reachable" \
         "(pip would install the CUDA build, GBs with its nvidia-* dependencies). Give PyTorch's CPU" \
         "wheel index as VKATTN_TORCH_INDEX=URL, or install torch yourself; tests/test_hf.py skips without it." >&2
  else
    echo "vkattn setup: installing the hf extra (torch 2.13.0 CPU, transformers 5.23, $VKATTN_NUMPY)"
    "$VPY" -m pip install -q "${idx[@]}" "${hfreq[@]}"
    "$VPY" -c "import vkattn.hf"
    echo "vkattn setup: hf extra ready ($VENV)"
  fi
fi
