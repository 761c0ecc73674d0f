#!/usr/bin/env bash
# Builds (once) the Debian guest that tests/test_vm_host.py boots under QEMU: a
# real systemd host on cgroup v2, on which the fleet is installed with
# deploy/install.sh exactly as on a production sandbox host.
#
#   sudo scripts/vm-image.sh [--systemd bookworm|backports]
#
# Prints the directory of the image on its last line. It holds:
#   rootfs.raw            an ext4 root filesystem (the test boots a copy-on-write
#                         overlay of it, so the image itself is never written)
#   vmlinuz, initrd.img   the guest's kernel, booted directly by QEMU (no bootloader)
#   id_ed25519            the key root@guest accepts (the guest has no password)
#   systemd-version       what `systemd --version` says in the guest
#
# The guest: debootstrap --variant=minbase bookworm from the Debian registry, with
# linux-image-amd64, systemd (252 from bookworm, or 254 from bookworm-backports
# with --systemd backports), dbus-user-session, openssh-server, systemd-networkd
# on DHCP (QEMU's user-mode network), and every package deploy/install.sh would
# install. It has no route to any registry: the test gives it QEMU's user-mode
# network with restrict=on. So the Python packages the fleet needs are built
# while the image is made, by the guest's own Python in the build chroot, into
# /opt/ouroboros-wheels: `pip wheel` of this project's dependencies, and
# setuptools for building the project itself (install.sh builds it from the
# source the test copies in).
#
# Cached under $OUROBOROS_VM_CACHE (default /var/cache/ouroboros-ci/vm), in a
# directory named after a hash of this script, the systemd choice and the
# project's dependency list: a change to any of them builds a new image;
# otherwise this prints the cached one at once. --refresh builds again regardless (security
# updates). Older images of the same flavour are removed once a new one is ready.
#
# Needs root (debootstrap, file ownership in the image), debootstrap, e2fsprogs
# (mkfs.ext4 -d: no loop device or mount is needed), and PyPI and the Debian
# registry reachable (OUROBOROS_VM_CA_BUNDLE: the CA bundle pip trusts).
set -euo pipefail
cd "$(dirname "$0")/.."

flavour=bookworm
refresh=0
while [ $# -gt 0 ]; do
  case "$1" in
    --systemd) flavour=${2:?--systemd needs bookworm or backports}; shift 2 ;;
    --systemd=*) flavour=${1#*=}; shift ;;
    --refresh) refresh=1; shift ;;
    *) echo "usage: $0 [--systemd bookworm|backports] [--refresh]" >&2; exit 2 ;;
  esac
done
case "$flavour" in bookworm | backports) ;; *)
  echo "vm-image: --systemd must be bookworm or backports, not $flavour" >&2; exit 2 ;;
esac

log() { printf 'vm-image: %s\n' "$*" >&2; }
[ "$(id -u)" -eq 0 ] || { log "run as root (debootstrap)"; exit 2; }

mirror=${OUROBOROS_VM_DEBIAN_MIRROR:-http://deb.debian.org/debian}
cache=${OUROBOROS_VM_CACHE:-/var/cache/ouroboros-ci/vm}
# pip in the build chroot trusts what the host trusts (a proxy that re-signs TLS).
ca_bundle=${OUROBOROS_VM_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
# deploy/install.sh's own list, plus what a booted host needs to be reached and
# to run the fleet's embedded broker.
packages=(linux-image-amd64 systemd systemd-sysv udev dbus dbus-user-session libpam-systemd
  openssh-server openssh-client iproute2 procps kmod e2fsprogs
  bubblewrap emacs-nox git python3-venv ca-certificates redis-server)
# The dependency list, not the whole pyproject.toml: a change to the project's own
# settings (its tests, its lint) needs no new image.
dependencies=$(python3 -c 'import sys, tomllib; print(*tomllib.load(sys.stdin.buffer)["project"]["dependencies"], sep="\n")' <pyproject.toml)
key=$(cat "$0" <(echo "$dependencies") <(echo "$flavour") | sha256sum | cut -c1-16)
image="$cache/$flavour-$key"

if [ "$refresh" -eq 0 ] && [ -f "$image/ready" ]; then
  log "cached: $image"
  echo "$image"
  exit 0
fi

install -d -m 0755 "$cache"
work=$(mktemp -d "$cache/build.XXXXXX")
# debootstrap and the chroot below mount /proc (and /sys) inside the tree: those
# go first, and rm never crosses into a file system left mounted.
cleanup() {
  awk -v w="$work/" 'index($2, w) == 1 { print $2 }' /proc/mounts | sort -r |
    while read -r mounted; do umount -l "$mounted"; done
  rm -rf --one-file-system "$work"
}
trap cleanup EXIT
tree="$work/tree"
started=$(date +%s)

log "debootstrap bookworm from $mirror (several minutes)"
debootstrap --variant=minbase --include="$(IFS=,; echo "${packages[*]}")" \
  bookworm "$tree" "$mirror" >"$work/debootstrap.log" 2>&1 || {
  tail -n 30 "$work/debootstrap.log" >&2
  exit 1
}
cat >"$tree/etc/apt/sources.list" <<SOURCES
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb $mirror bookworm-backports main
SOURCES
if [ "$flavour" = backports ]; then
  log "systemd from bookworm-backports"
  mount -t proc proc "$tree/proc"
  chroot "$tree" apt-get update -qq >>"$work/debootstrap.log" 2>&1
  DEBIAN_FRONTEND=noninteractive chroot "$tree" apt-get install -y -qq --no-install-recommends \
    -t bookworm-backports systemd systemd-sysv udev libpam-systemd libsystemd-shared \
    dbus-user-session >>"$work/debootstrap.log" 2>&1 || {
    tail -n 30 "$work/debootstrap.log" >&2
    exit 1
  }
  umount "$tree/proc"
fi

# Resolved and built by the guest's own pip and Python (3.11.2 in bookworm): a
# dependency's markers may differ from the host's Python (redis needs async-timeout
# before 3.11.3). The project's own wheel is not among them: the test installs the
# source it is testing.
log "wheels of the project's dependencies, by the guest's Python"
install -d -m 0755 "$tree/opt/ouroboros-wheels"
cp pyproject.toml "$tree/tmp/pyproject.toml"
cp "$ca_bundle" "$tree/tmp/ca-bundle.pem"
cat >"$tree/tmp/requirements.py" <<'PY'
import tomllib

with open("/tmp/pyproject.toml", "rb") as project:
    print("\n".join(tomllib.load(project)["project"]["dependencies"]))
PY
mount -t proc proc "$tree/proc"
# A clean environment: the host's own pip and CA settings name host paths.
env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root chroot "$tree" /bin/sh -euc '
  python3 /tmp/requirements.py >/tmp/requirements.txt
  python3 -m venv /tmp/wheel-builder
  /tmp/wheel-builder/bin/pip wheel -q --disable-pip-version-check --cert /tmp/ca-bundle.pem \
    -w /opt/ouroboros-wheels -r /tmp/requirements.txt setuptools
' >"$work/pip.log" 2>&1 || {
  tail -n 20 "$work/pip.log" >&2
  exit 1
}
umount "$tree/proc"
rm -rf "$tree/tmp/wheel-builder" "$tree"/tmp/requirements.* "$tree"/tmp/pyproject.toml \
  "$tree/tmp/ca-bundle.pem"

log "configuring the guest"
echo ouroboros-guest >"$tree/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 ouroboros-guest\n' >"$tree/etc/hosts"
echo '/dev/vda / ext4 rw,discard,errors=remount-ro 0 1' >"$tree/etc/fstab"
cat >"$tree/etc/systemd/network/10-dhcp.network" <<'NET'
[Match]
Name=en* eth*

[Network]
DHCP=ipv4
NET
ln -sf /lib/systemd/system/systemd-networkd.service \
  "$tree/etc/systemd/system/multi-user.target.wants/systemd-networkd.service"
# The guest reaches no name server; ssh must not wait for a reverse lookup.
printf 'UseDNS no\nPasswordAuthentication no\nPermitRootLogin prohibit-password\n' \
  >"$tree/etc/ssh/sshd_config.d/ouroboros-vm.conf"
ssh-keygen -q -t ed25519 -N '' -C ouroboros-vm-test -f "$work/id_ed25519"
install -d -m 0700 "$tree/root/.ssh"
install -m 0600 "$work/id_ed25519.pub" "$tree/root/.ssh/authorized_keys"
# The fleet's guest redis is the embedded one the worker starts; no system Redis.
rm -f "$tree/etc/systemd/system/multi-user.target.wants/redis-server.service"
# Nothing in the guest waits for a network it cannot have.
rm -f "$tree/etc/systemd/system/network-online.target.wants/"*
chroot "$tree" systemctl --version | head -n 1 >"$work/systemd-version"
rm -rf "$tree"/var/cache/apt/archives/*.deb "$tree"/var/lib/apt/lists/* "$tree"/var/log/*.log

log "root filesystem image"
for kernel in "$tree"/boot/vmlinuz-*; do
  cp "$kernel" "$work/vmlinuz"
  cp "$tree/boot/initrd.img-${kernel##*/vmlinuz-}" "$work/initrd.img"
done
mkfs.ext4 -q -L ouroboros-root -d "$tree" "$work/rootfs.raw" 6G
rm -rf --one-file-system "$tree"

mv "$work" "$image.partial"
trap - EXIT
touch "$image.partial/ready"
for old in "$cache/$flavour"-*; do
  [ "$old" = "$image" ] || [ "$old" = "$image.partial" ] || rm -rf "$old"
done
rm -rf "$image"
mv "$image.partial" "$image"
log "built $image in $(($(date +%s) - started)) s ($(cat "$image/systemd-version"))"
echo "$image"
