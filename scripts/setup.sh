#!/usr/bin/env bash
# Idempotent set-up for vkattn on Debian/Ubuntu: system packages, .venv, kp built from its sdist
# against the system headers, and vkattn installed (editable) into the venv.
# Fast the second time: every step checks before it acts.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
APT_PKGS="mesa-vulkan-drivers libvulkan-dev glslang-tools vulkan-validationlayers libfmt-dev pybind11-dev cmake g++"

missing=""
for p in $APT_PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "vkattn setup: missing system packages:$missing" >&2
    echo "install them as root:  sudo apt-get install -y$missing" >&2
    exit 1
  fi
  echo "vkattn setup: installing$missing"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq $missing >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV" || { echo "vkattn setup: '$PY -m venv' failed (Debian: apt-get install python3-venv)" >&2; exit 1; }
fi
VPY="$VENV/bin/python"
stamp="$VENV/.vkattn-setup"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VPY" -c "import kp, numpy, pytest, vkattn" 2>/dev/null; then
  exit 0
fi

"$VPY" -m pip install -q --upgrade pip "setuptools>=70" wheel
"$VPY" -m pip install -q "numpy<2" pytest hypothesis
if ! "$VPY" -c "import kp" 2>/dev/null; then
  echo "vkattn setup: building kp 0.9.0 from its sdist against the system Vulkan/fmt/pybind11 (about 90 s)"
  KOMPUTE_OPT_INSTALL=OFF KOMPUTE_OPT_USE_BUILT_IN_VULKAN_HEADER=OFF KOMPUTE_OPT_USE_BUILT_IN_FMT=OFF \
  KOMPUTE_OPT_USE_BUILT_IN_PYBIND11=OFF KOMPUTE_OPT_DISABLE_VULKAN_VERSION_CHECK=ON \
    "$VPY" -m pip install -q --no-binary kp "kp==0.9.0"
fi
"$VPY" -m pip install -q --no-deps --no-build-isolation -e .
"$VPY" -c "import kp, vkattn" 
echo "$want" > "$stamp"
echo "vkattn setup: ready ($VENV)"
