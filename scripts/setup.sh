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
# kp's build options. KOMPUTE_OPT_DISABLE_VK_DEBUG_LAYERS: without it kp turns on
# VK_LAYER_KHRONOS_validation in every process whenever the layer is installed (it is: the
# validation run needs it), which costs every call; `make test-validation` enables the layer
# itself through VK_INSTANCE_LAYERS.
KP_FLAGS="KOMPUTE_OPT_INSTALL=OFF KOMPUTE_OPT_USE_BUILT_IN_VULKAN_HEADER=OFF KOMPUTE_OPT_USE_BUILT_IN_FMT=OFF \
KOMPUTE_OPT_USE_BUILT_IN_PYBIND11=OFF KOMPUTE_OPT_DISABLE_VULKAN_VERSION_CHECK=ON KOMPUTE_OPT_DISABLE_VK_DEBUG_LAYERS=ON"
kp_stamp="$VENV/.vkattn-kp-flags"
if ! "$VPY" -c "import kp" 2>/dev/null || [ "$(cat "$kp_stamp" 2>/dev/null)" != "$KP_FLAGS" ]; then
  echo "vkattn setup: building kp 0.9.0 from its sdist against the system Vulkan/fmt/pybind11 (about 90 s)"
  # --no-cache-dir: pip's wheel cache ignores these variables and would hand back an older build
  # kp's setup.py garbles -DPYTHON_EXECUTABLE, so CMake looks python3.6 up on PATH first (pybind11's
  # minimum): keep version-manager shims off PATH and the venv's python first
  kp_path="$(cd "$VENV/bin" && pwd):$(printf '%s' "$PATH" | tr ':' '\n' | grep -v '/shims' | paste -sd: -)"
  env PATH="$kp_path" $KP_FLAGS "$VPY" -m pip install -q --no-cache-dir --force-reinstall --no-deps --no-binary kp "kp==0.9.0"
  echo "$KP_FLAGS" > "$kp_stamp"
fi
"$VPY" -m pip install -q --no-deps --no-build-isolation -e .
"$VPY" -c "import kp, vkattn" 
echo "$want" > "$stamp"
echo "vkattn setup: ready ($VENV)"
