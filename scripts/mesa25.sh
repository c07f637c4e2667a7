#!/usr/bin/env bash
# Opt-in: run a command on Mesa 25's lavapipe (and RADV) from Debian 12's bookworm-backports,
# without touching the system's Mesa. The first run downloads mesa-vulkan-drivers and the libdrm it
# needs from bookworm-backports with a private apt configuration and unpacks them into
# $MESA25_DIR (default .mesa25/ in the checkout, git-ignored); nothing is installed with dpkg and
# the system's apt sources are not changed. Then the command runs with the Vulkan loader pointed at
# those drivers only.
#
#   scripts/mesa25.sh .venv/bin/python -m vkattn devices
#   scripts/mesa25.sh .venv/bin/python -m perf decode
#   scripts/mesa25.sh --radv navi31 .venv/bin/python vkattn/tools/vkpipeline.py --support
#
# Why: to compare. Mesa 25's lavapipe reads storage buffers faster in a probe (0.38 against 0.47 ns
# per word), yet ran every vkattn perf case slower on the project's machine (perf/RESULTS.md,
# session 9): use the stock 22.3 for speed. Debian 12 ships 22.3; CI and the default set-up stay on
# it.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
dir="${MESA25_DIR:-$here/.mesa25}"
icd=lvp
if [ "${1:-}" = "--radv" ]; then
  export RADV_FORCE_FAMILY="${2:?--radv needs a family, e.g. navi31}"
  icd=radeon
  shift 2
fi
[ $# -gt 0 ] || { echo "usage: scripts/mesa25.sh [--radv FAMILY] COMMAND [ARGS...]" >&2; exit 2; }

if [ ! -f "$dir/.ready" ]; then
  echo "mesa25: fetching Mesa 25 from bookworm-backports into $dir (once, about 30 MB)" >&2
  rm -rf "$dir" && mkdir -p "$dir/apt/lists/partial" "$dir/apt/cache/archives/partial" "$dir/root"
  echo "deb http://deb.debian.org/debian bookworm-backports main" > "$dir/apt/sources.list"
  opts=(-o Dir::Etc::sourcelist="$dir/apt/sources.list" -o Dir::Etc::sourceparts=/dev/null
        -o Dir::State::Lists="$dir/apt/lists" -o Dir::Cache="$dir/apt/cache" -o Debug::NoLocking=1
        -o APT::Sandbox::User="$(id -un)")
  apt-get "${opts[@]}" update -qq >&2
  (cd "$dir/apt/cache/archives" && apt-get "${opts[@]}" download -qq \
      mesa-vulkan-drivers/bookworm-backports libdrm2/bookworm-backports libdrm-amdgpu1/bookworm-backports >&2)
  for deb in "$dir"/apt/cache/archives/*.deb; do dpkg-deb -x "$deb" "$dir/root"; done
  for f in "$dir"/root/usr/share/vulkan/icd.d/*.json; do       # absolute paths into the prefix
    sed -i "s|\"library_path\": \"[^\"]*/\?\(libvulkan_[a-z_]*\.so\)\"|\"library_path\": \"$dir/root/usr/lib/x86_64-linux-gnu/\1\"|" "$f"
  done
  touch "$dir/.ready"
fi
json="$(ls "$dir"/root/usr/share/vulkan/icd.d/${icd}_icd*.json | head -1)"
export VK_DRIVER_FILES="$json" VK_ICD_FILENAMES="$json"
export LD_LIBRARY_PATH="$dir/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$@"
