# Shared by setup.sh (the project's .venv) and install.sh (any venv): the Debian packages vkattn
# needs, and kp (Kompute 0.9.0) built from its sdist against them. Source it; it only defines.

# python3-venv and python3-dev: `python3 -m venv` needs ensurepip, and kp's build the Python headers
# (Debian 13's minimal root has neither).
VKATTN_APT_PKGS="mesa-vulkan-drivers libvulkan-dev glslang-tools vulkan-validationlayers libfmt-dev pybind11-dev cmake g++ \
python3-venv python3-dev patch"
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

# vkattn's Python dependencies besides numpy (pyproject.toml's list; setup.sh and install.sh install
# vkattn with --no-deps, so they install these): safetensors, the file format of cache save/load
# (vkattn.persist; PyPI has abi3 wheels, e.g. safetensors 0.8.0 cp310-abi3 manylinux x86-64: no build
# on Debian 12's Python 3.11 or Debian 13's 3.13).
VKATTN_PY_DEPS="safetensors>=0.4"

# PyPI's pybind11 for kp's build where the system's predates numpy 2 support (2.12); Debian 13's.
VKATTN_PYBIND11_PYPI="2.13.6"

# vkattn_pybind11_system: the system pybind11's version (X.Y.Z, from its header), or nothing.
vkattn_pybind11_system() {
  local h=/usr/include/pybind11/detail/common.h
  [ -f "$h" ] || return 0
  awk '/#define PYBIND11_VERSION_(MAJOR|MINOR|PATCH) /{v[$2]=$3}
       END{if (v["PYBIND11_VERSION_MAJOR"] != "") print v["PYBIND11_VERSION_MAJOR"] "." v["PYBIND11_VERSION_MINOR"] "." v["PYBIND11_VERSION_PATCH"]}' "$h"
}

# vkattn_numpy_plan PYTHON: sets VKATTN_NUMPY (the pip requirement for numpy) and VKATTN_PYBIND11
# ("system X.Y.Z" or "pypi X.Y.Z": what kp is built against). numpy 2 wherever kp can be built
# against a pybind11 >= 2.12 (the first with numpy 2 support): the system's if it is that new
# (Debian 13: 2.13), else PyPI's on Python 3.12+ (numpy<2 has no wheel there: pip would build
# numpy from source, minutes). numpy<2 only with an older system pybind11 on Python < 3.12 (Debian
# 12: pybind11 2.10, Python 3.11), where kp is built against it as before. VKATTN_NUMPY_MAJOR=1|2
# forces a choice (2 with an old system pybind11 takes PyPI's).
vkattn_numpy_plan() {
  local py="$1" sys_pb new_sys=0 pyver major
  sys_pb=$(vkattn_pybind11_system)
  if [ -n "$sys_pb" ] && printf '%s\n' 2.12.0 "$sys_pb" | sort -V -C; then new_sys=1; fi
  pyver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  major=${VKATTN_NUMPY_MAJOR:-}
  if [ -z "$major" ]; then
    if [ "$new_sys" = 1 ] || printf '%s\n' 3.12 "$pyver" | sort -V -C; then major=2; else major=1; fi
  fi
  case "$major" in
    1) VKATTN_NUMPY="numpy<2"
       [ -n "$sys_pb" ] && VKATTN_PYBIND11="system $sys_pb" || VKATTN_PYBIND11="pypi $VKATTN_PYBIND11_PYPI" ;;
    2) VKATTN_NUMPY="numpy>=2"
       [ "$new_sys" = 1 ] && VKATTN_PYBIND11="system $sys_pb" || VKATTN_PYBIND11="pypi $VKATTN_PYBIND11_PYPI" ;;
    *) echo "vkattn: VKATTN_NUMPY_MAJOR must be 1 or 2, got '$major'" >&2; return 2 ;;
  esac
}

# vkattn_kp PYTHON: make kp 0.9.0, built from its sdist with VKATTN_KP_PATCH applied, with
# VKATTN_KP_FLAGS against $VKATTN_PYBIND11 (call vkattn_numpy_plan first), importable by PYTHON
# (a venv's python). The wheel is built once per
# Python version, flag set and pybind11 into $VKATTN_WHEELS (default ~/.cache/vkattn/wheels),
# and every venv installs that wheel. The build's make runs on the machine's cores (at most 9:
# kp's setup.py appends the variable's characters to `make -j`).
vkattn_kp() {
  local py="$1" prefix stamp key dir tmp path jobs want pbdir
  want="$VKATTN_KP_FLAGS pybind11=${VKATTN_PYBIND11:?call vkattn_numpy_plan first} patch=$(sha256sum "$VKATTN_KP_PATCH" | cut -c1-16)"
  prefix=$("$py" -c 'import sys; print(sys.prefix)')
  stamp="$prefix/.vkattn-kp-flags"
  if "$py" -c "import kp" 2>/dev/null && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  key=$({ echo "$want"; "$py" -c 'import sys, sysconfig; print(sys.version, sysconfig.get_platform())'; } \
        | sha256sum | cut -c1-16)
  dir="${VKATTN_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/vkattn/wheels}/kp-0.9.0-$key"
  if ! ls "$dir"/kp-0.9.0-*.whl >/dev/null 2>&1; then
    jobs=$(nproc 2>/dev/null || echo 2); [ "$jobs" -gt 9 ] && jobs=9
    echo "vkattn: building kp 0.9.0 from its sdist, patched, against the system Vulkan/fmt and ${VKATTN_PYBIND11% *}" \
         "pybind11 ${VKATTN_PYBIND11#* } (make -j$jobs; about 90 s, once per Python)"
    mkdir -p "$(dirname "$dir")"
    tmp=$(mktemp -d "$dir.XXXXXX")
    # kp's setup.py garbles -DPYTHON_EXECUTABLE, so CMake looks python3.6 up on PATH first
    # (pybind11's minimum): keep version-manager shims off PATH and the venv's python first.
    # --no-cache-dir: pip's wheel cache ignores these variables and would hand back another build.
    # (absolute: CMake runs in its build folder, where a relative .venv/bin finds nothing and the
    # system python3 configures the build instead)
    path="$(cd "$(dirname "$py")" && pwd):$(printf '%s' "$PATH" | tr ':' '\n' | grep -v '/shims' | paste -sd: -)"
    pbdir=""
    if [ "${VKATTN_PYBIND11% *}" = pypi ]; then    # headers + CMake config only, beside the build
      "$py" -m pip install -q --no-deps --target "$tmp/pybind11" "pybind11==${VKATTN_PYBIND11#* }" || { rm -rf "$tmp"; return 1; }
      pbdir="$tmp/pybind11/pybind11"
    fi
    if ! { "$py" -m pip download -q --no-cache-dir --no-deps --no-binary :all: -d "$tmp/sdist" "kp==0.9.0" &&
           tar xzf "$tmp"/sdist/kp-0.9.0.tar.gz -C "$tmp/sdist" &&
           patch -s -p1 -d "$tmp/sdist/kp-0.9.0" < "$VKATTN_KP_PATCH" &&
           env PATH="$path" $VKATTN_KP_FLAGS KOMPUTE_PYTHON_NUM_PARALLEL_THREADS="$jobs" \
             ${pbdir:+pybind11_ROOT="$pbdir" CMAKE_PREFIX_PATH="$pbdir${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"} \
             "$py" -m pip wheel -q --no-cache-dir --no-deps -w "$tmp/wheel" "$tmp/sdist/kp-0.9.0"; }; then
      rm -rf "$tmp"
      return 1
    fi
    rm -rf "$tmp/pybind11" "$tmp/sdist"
    mv "$tmp/wheel"/kp-0.9.0-*.whl "$tmp/" && rmdir "$tmp/wheel"
    mv -T "$tmp" "$dir" 2>/dev/null || rm -rf "$tmp"     # another build may have won the race
  fi
  "$py" -m pip install -q --force-reinstall --no-deps "$dir"/kp-0.9.0-*.whl
  echo "$want" > "$stamp"
}
