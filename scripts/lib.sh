# Shared by setup.sh (the project's .venv) and install.sh (any venv): the Debian packages vkattn
# needs, and kp (Kompute 0.9.0) built from its sdist against them. Source it; it only defines.

VKATTN_APT_PKGS="mesa-vulkan-drivers libvulkan-dev glslang-tools vulkan-validationlayers libfmt-dev pybind11-dev cmake g++ patch"
# kp's build options: the system Vulkan headers, fmt and pybind11 instead of kp's CMake downloading
# them (plain `pip install kp` fails here on "git clone" of the Vulkan headers).
# KOMPUTE_OPT_DISABLE_VK_DEBUG_LAYERS: without it kp turns on VK_LAYER_KHRONOS_validation in every
# process whenever the layer is installed (it is: the validation run needs it), which costs every
# call; `make test-validation` enables the layer itself through VK_INSTANCE_LAYERS.
VKATTN_KP_FLAGS="KOMPUTE_OPT_INSTALL=OFF KOMPUTE_OPT_USE_BUILT_IN_VULKAN_HEADER=OFF KOMPUTE_OPT_USE_BUILT_IN_FMT=OFF \
KOMPUTE_OPT_USE_BUILT_IN_PYBIND11=OFF KOMPUTE_OPT_DISABLE_VULKAN_VERSION_CHECK=ON KOMPUTE_OPT_DISABLE_VK_DEBUG_LAYERS=ON"
# vkattn's patch to the sdist (optional device features, a required subgroup size per pipeline; its
# header says why); its hash is part of the wheel cache key and of each venv's stamp
VKATTN_KP_PATCH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/kp-0.9.0-features.patch"

# Install the missing Debian packages (as root), or stop naming them.
vkattn_system_packages() {
  local p missing=""
  for p in $VKATTN_APT_PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
  done
  [ -z "$missing" ] && return 0
  if [ "$(id -u)" != 0 ]; then
    echo "vkattn: missing system packages:$missing" >&2
    echo "install them as root:  sudo apt-get install -y$missing" >&2
    return 1
  fi
  echo "vkattn: installing$missing"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
}

# vkattn_kp PYTHON: make kp 0.9.0, built with VKATTN_KP_FLAGS from its sdist with VKATTN_KP_PATCH
# applied, importable by PYTHON (a venv's python). The wheel is built once per Python version,
# flag set and patch into $VKATTN_WHEELS (default ~/.cache/vkattn/wheels) and every venv installs
# that wheel.
vkattn_kp() {
  local py="$1" prefix stamp want key dir tmp path
  prefix=$("$py" -c 'import sys; print(sys.prefix)')
  stamp="$prefix/.vkattn-kp-flags"
  want="$VKATTN_KP_FLAGS patch=$(sha256sum "$VKATTN_KP_PATCH" | cut -c1-16)"
  if "$py" -c "import kp" 2>/dev/null && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  key=$({ echo "$want"; "$py" -c 'import sys, sysconfig; print(sys.version, sysconfig.get_platform())'; } \
        | sha256sum | cut -c1-16)
  dir="${VKATTN_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/vkattn/wheels}/kp-0.9.0-$key"
  if ! ls "$dir"/kp-0.9.0-*.whl >/dev/null 2>&1; then
    echo "vkattn: building kp 0.9.0 from its sdist, patched, against the system Vulkan/fmt/pybind11 (about 90 s, once per Python)"
    mkdir -p "$(dirname "$dir")"
    tmp=$(mktemp -d "$dir.XXXXXX")
    # kp's setup.py garbles -DPYTHON_EXECUTABLE, so CMake looks python3.6 up on PATH first
    # (pybind11's minimum): keep version-manager shims off PATH and the venv's python first.
    # --no-cache-dir: pip's wheel cache ignores these variables and would hand back another build.
    path="$(dirname "$py"):$(printf '%s' "$PATH" | tr ':' '\n' | grep -v '/shims' | paste -sd: -)"
    if ! { "$py" -m pip download -q --no-cache-dir --no-deps --no-binary :all: -d "$tmp/sdist" "kp==0.9.0" &&
           tar xzf "$tmp"/sdist/kp-0.9.0.tar.gz -C "$tmp/sdist" &&
           patch -s -p1 -d "$tmp/sdist/kp-0.9.0" < "$VKATTN_KP_PATCH" &&
           env PATH="$path" $VKATTN_KP_FLAGS "$py" -m pip wheel -q --no-cache-dir --no-deps \
             -w "$tmp" "$tmp/sdist/kp-0.9.0"; }; then
      rm -rf "$tmp"
      return 1
    fi
    rm -rf "$tmp/sdist"
    mv -T "$tmp" "$dir" 2>/dev/null || rm -rf "$tmp"     # another build may have won the race
  fi
  "$py" -m pip install -q --force-reinstall --no-deps "$dir"/kp-0.9.0-*.whl
  echo "$want" > "$stamp"
}
