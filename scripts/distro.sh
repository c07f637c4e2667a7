#!/usr/bin/env bash
# A second tested platform: run a command on a clean clone of this checkout's HEAD inside a Debian
# root made with debootstrap (as root, on a Debian/Ubuntu host):
#
#   scripts/distro.sh trixie -- make test                      # Debian 13: Python 3.13, Mesa 25.0.7
#   scripts/distro.sh trixie --mesa backports -- make test     # the same with trixie-backports' Mesa
#   scripts/distro.sh trixie --mesa backports --out perf/out -- make gpu-report
#
# The archive is the mirror of the host's own apt configuration (a user's mirror or proxy is
# respected); the host's CA certificates and pip configuration (files, PIP_* variables, and the
# local wheel folders / indexes it names, read-only) are carried in. Inside, the README's commands
# run as a new user's would: scripts/setup.sh installs the Debian packages, builds .venv and kp.
# Every run starts from a fresh copy of the minimal root and a fresh `git clone`, so nothing one
# run leaves behind is trusted by the next. Cached between runs on this machine, under
# $VKATTN_DISTRO_CACHE (default ~/.cache/vkattn/distro), is only what a fresh machine makes by
# itself: the debootstrapped root as a tarball, apt's downloaded .debs, pip's cache, the kp wheel
# and Mesa's shader cache (as the host's own persists in ~/.cache: the pipelines lavapipe compiled,
# keyed by Mesa's build and the pipeline, so a changed shader or driver compiles afresh; since
# session 22: `.ci/run`'s Debian 13 command took 1401 s with it empty, 674 s with it filled --
# Mesa 26's lavapipe keeps its compiled code there, Mesa 25's does not). VKATTN_DISTRO_COLD=1
# leaves Mesa's shader cache out (every pipeline compiled, as on a new machine: the cold CI time in
# docs/platforms.md).
# Whatever happens, what was mounted is unmounted before the root is deleted.
#
# Options: --mesa backports  (install mesa-vulkan-drivers and mesa-drm-shim from SUITE-backports
# first); --mesa later (SUITE-backports in apt's sources but nothing from it installed: the command
# runs on the stock Mesa and can move to the backported one part-way, one root and one set-up for
# both, as .ci/run does: `apt-get install -t "$VKATTN_DISTRO_BACKPORTS" mesa-vulkan-drivers
# mesa-drm-shim`, VKATTN_DISTRO_BACKPORTS naming the suite); --out DIR (a host directory, bind-mounted into the root, that the command's results are
# written to: VKATTN_PERF_OUT points there, so `make gpu-report` leaves gpu_report_mesa26.* in it);
# --keep (leave the root in place and print its path; unmount all the same).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
usage() { echo "usage: scripts/distro.sh SUITE [--mesa backports|later] [--out DIR] [--keep] -- COMMAND [ARGS...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
suite=$1; shift
case "$suite" in [a-z]*) ;; *) usage ;; esac
mesa=stock keep=0 out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --mesa) case "${2:-}" in backports|later) mesa=$2 ;; *) usage ;; esac; shift 2 ;;
    --out) [ -n "${2:-}" ] || usage; mkdir -p "$2"; out=$(cd "$2" && pwd); shift 2 ;;
    --keep) keep=1; shift ;;
    --) shift; break ;;
    *) usage ;;
  esac
done
[ $# -gt 0 ] || usage
[ "$(id -u)" = 0 ] || { echo "distro: debootstrap, mount and chroot need root" >&2; exit 1; }
say() { echo "distro[$suite/$mesa]: $*" >&2; }

# The host's Debian mirror: the first URI of a deb822 stanza or one-line entry whose suites are not
# security ones.
host_mirror() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk 'BEGIN{RS=""; FS="\n"}
         { uri=""; sec=0; deb=0
           for (i = 1; i <= NF; i++) {
             if ($i ~ /^Types:.*(^|[ \t])deb([ \t]|$)/) deb=1
             if ($i ~ /^URIs:/) { split($i, w, /[ \t]+/); uri=w[2] }
             if ($i ~ /^Suites:/ && $i ~ /-security/) sec=1 }
           if (deb && uri != "" && !sec) { print uri; exit } }' "$f"
  done
  { cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true; } |
    awk '$1 == "deb" && $0 !~ /-security/ { for (i = 2; i <= NF; i++) if ($i !~ /^\[/ && $i !~ /\]$/) { print $i; exit } }'
}
mirror=$(host_mirror | head -1 || true)
[ -n "$mirror" ] || { say "no Debian mirror found in the host's apt configuration"; exit 1; }

cache="${VKATTN_DISTRO_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vkattn/distro}"
mkdir -p "$cache"
if ! command -v debootstrap >/dev/null; then
  say "installing debootstrap"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi

root="" mounts=() building=0
cleanup() {
  local rc=$? m i
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
    m=${mounts[i]}
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || say "could not unmount $m"
  done
  mounts=()
  if [ -n "$root" ] && [ -d "$root" ]; then
    if grep -q " $root[/ ]" /proc/mounts; then
      say "something is still mounted under $root: left in place, not deleted"
    elif [ "$keep" = 1 ] && [ "$building" = 0 ]; then
      say "root kept at $root"
    else
      rm -rf --one-file-system "$root"
    fi
  fi
  return $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM
bind() {   # bind SRC DEST [ro]
  mkdir -p "$2"
  mount --bind "$1" "$2"; mounts+=("$2")
  [ "${3:-}" != ro ] || mount -o remount,bind,ro "$2"
}
enter() {  # mount what a chroot needs (unmounted again by cleanup)
  mount -t proc proc "$root/proc"; mounts+=("$root/proc")
  bind /sys "$root/sys" ro
  bind /dev "$root/dev"
  bind /dev/pts "$root/dev/pts"
}
in_root() { chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}" \
              PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"; }

# 1. the minimal root (debootstrap --variant=minbase plus git and make), once per suite and mirror
base="$cache/$suite-minbase-$(printf '%s\n' "$suite" "$mirror" v1 | sha256sum | cut -c1-12).tar"
if [ ! -f "$base" ]; then
  say "debootstrap --variant=minbase $suite from $mirror (once)"
  building=1 root=$(mktemp -d "$cache/base-root.XXXXXX")
  debootstrap --variant=minbase --include=git,make "$suite" "$root" "$mirror" >/dev/null ||
    { say "debootstrap failed (log: $root/debootstrap/debootstrap.log)"; cat "$root/debootstrap/debootstrap.log" >&2 || true; exit 1; }
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*_*
  tar -C "$root" -cf "$base.tmp" . && mv "$base.tmp" "$base"
  rm -rf --one-file-system "$root"; root="" building=0
fi

# 2. a fresh root for this run
root=$(mktemp -d /var/tmp/vkattn-distro.XXXXXX)
chmod 755 "$root"
tar -C "$root" -xf "$base"
enter
mkdir -p "$cache/apt-$suite" "$cache/pip-$suite" "$cache/wheels-$suite"
bind "$cache/apt-$suite" "$root/var/cache/apt/archives"
bind "$cache/pip-$suite" "$root/root/.cache/pip"
bind "$cache/wheels-$suite" "$root/root/.cache/vkattn/wheels"
if [ "${VKATTN_DISTRO_COLD:-0}" = 0 ]; then
  mkdir -p "$cache/mesa-$suite"
  bind "$cache/mesa-$suite" "$root/root/.cache/mesa_shader_cache"
fi
cp -L /etc/resolv.conf "$root/etc/resolv.conf"
printf 'deb %s %s main\ndeb %s %s-updates main\n' "$mirror" "$suite" "$mirror" "$suite" > "$root/etc/apt/sources.list"
# the host's apt proxy settings, if any
apt-config dump 2>/dev/null | grep -iE '^Acquire::[a-z]+::Proxy' > "$root/etc/apt/apt.conf.d/80vkattn-host-proxy" || true
# keep the .debs (the cache is bind-mounted); the cache is root's, so apt downloads as root
printf 'APT::Keep-Downloaded-Packages "true";\nAPT::Sandbox::User "root";\n' > "$root/etc/apt/apt.conf.d/81vkattn"

# CA certificates: the host's bundle, named by every variable pip, requests and OpenSSL read
ca="${PIP_CERT:-${REQUESTS_CA_BUNDLE:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}}"
env_in=()
if [ -f "$ca" ]; then
  cp -L "$ca" "$root/etc/vkattn-host-ca.crt"
  env_in+=(PIP_CERT=/etc/vkattn-host-ca.crt REQUESTS_CA_BUNDLE=/etc/vkattn-host-ca.crt SSL_CERT_FILE=/etc/vkattn-host-ca.crt)
fi
# pip configuration: its files, PIP_* variables, and the local paths they name (read-only)
pipconf=()
for f in /etc/pip.conf /etc/xdg/pip "$HOME/.config/pip" "$HOME/.pip"; do
  [ -e "$f" ] || continue
  dest="$root${f/#$HOME//root}"
  mkdir -p "$(dirname "$dest")"; cp -rL "$f" "$dest"
  [ -d "$f" ] && pipconf+=("$f"/*.conf) || pipconf+=("$f")
done
while IFS= read -r v; do
  case "$v" in PIP_CERT=*) ;; *) env_in+=("$v") ;; esac
done < <(env | grep -E '^PIP_[A-Z_]+=' || true)
for p in $( { cat "${pipconf[@]}" 2>/dev/null; env | grep -E '^PIP_' ; } |
            grep -oE '(file://)?/[^ ",=]+' | sed 's|^file://||' | sort -u); do
  case "$p" in /etc/*|"$HOME"/*) continue ;; esac     # config files themselves: copied above
  [ -e "$p" ] || continue
  [ -d "$p" ] || p=$(dirname "$p")
  [ "$(basename "$p")" != simple ] || p=$(dirname "$p")       # a local index links to ../files
  grep -q " $root$p " /proc/mounts || bind "$p" "$root$p" ro
done

# 3. Mesa from backports, before the README's set-up installs the stock one
if [ "$mesa" != stock ]; then
  echo "deb $mirror $suite-backports main" >> "$root/etc/apt/sources.list"
fi
say "apt-get update"
in_root apt-get update -qq
if [ "$mesa" = backports ]; then
  say "installing mesa-vulkan-drivers and mesa-drm-shim from $suite-backports"
  in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -t "$suite-backports" \
    mesa-vulkan-drivers mesa-drm-shim >/dev/null
fi

# 4. a clean clone of HEAD, then the command
[ -z "$(git -C "$here" status --porcelain --untracked-files=no)" ] ||
  say "note: uncommitted changes in $here are not in the clone (HEAD only)"
head=$(git -C "$here" rev-parse HEAD)
git clone -q --no-hardlinks "$here" "$root/root/vkattn"
git -C "$root/root/vkattn" checkout -q --detach "$head"
pass=()
while IFS= read -r v; do pass+=("$v"); done < <(env | grep -E '^(VKATTN_[A-Z0-9_]*|PYTEST_ADDOPTS|LP_[A-Z_]*|GALLIUM_[A-Z_]*)=' || true)
[ "$mesa" != later ] || pass+=(VKATTN_DISTRO_BACKPORTS="$suite-backports" DEBIAN_FRONTEND=noninteractive)
if [ -n "$out" ]; then            # results out of the root: the command writes there
  bind "$out" "$root/root/vkattn-out"
  pass+=(VKATTN_PERF_OUT=/root/vkattn-out)
fi
say "running in a clean clone of ${head:0:12}: $*"
set +e
in_root "${env_in[@]}" "${pass[@]}" bash -c 'cd /root/vkattn && exec "$@"' vkattn "$@"
rc=$?
set -e
say "exit status $rc"
exit $rc
