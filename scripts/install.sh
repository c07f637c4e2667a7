#!/usr/bin/env bash
# Install vkattn into an existing virtual environment -- e.g. the one that already has torch and
# transformers -- with kp built the way `make setup` builds it (scripts/lib.sh):
#
#   bash scripts/install.sh /path/to/venv          (or: make install VENV=/path/to/venv)
#
# Installs the missing Debian packages (as root; otherwise names them), numpy (2 where kp can be
# built against a pybind11 >= 2.12, else <2: scripts/lib.sh vkattn_numpy_plan), safetensors, kp 0.9.0 (built once, then from ~/.cache/vkattn/wheels) and vkattn from this clone.
# torch and transformers are left as they are. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -ne 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: bash scripts/install.sh /path/to/venv" >&2
  exit 2
fi
venv=$1
py="$venv/bin/python"
if [ ! -x "$py" ]; then
  echo "vkattn install: no python at $py; give the directory of an existing virtual environment" \
       "(python3 -m venv DIR makes one)" >&2
  exit 1
fi
# shellcheck source=lib.sh
. scripts/lib.sh
vkattn_system_packages
vkattn_numpy_plan "$py"
old=$("$py" -c "import numpy; print(numpy.__version__)" 2>/dev/null || true)
case "$VKATTN_NUMPY/$old" in
  */|"numpy<2"/1.*|"numpy>=2"/[2-9].*) ;;
  *) echo "vkattn install: numpy $old -> $VKATTN_NUMPY in $venv (kp is built against $VKATTN_PYBIND11 pybind11)" ;;
esac
"$py" -m pip install -q "$VKATTN_NUMPY" $VKATTN_PY_DEPS
vkattn_kp "$py"
"$py" -m pip install -q --no-deps .
"$py" -c "import safetensors, vkattn; vkattn.default_device()"
echo "vkattn install: ready in $venv (with torch and transformers there, 'import vkattn.hf' registers attn_implementation='vkattn')"
