#!/usr/bin/env bash
# Sets up a fresh Debian host for the Ouroboros fleet: system packages it lacks,
# then a virtual environment with the package and its test dependencies.
# Safe to run again: every step checks before it acts.
set -euo pipefail
cd "$(dirname "$0")/.."

# systemd brings systemd-analyze (unit checks; it starts no manager); shellcheck
# checks the deployment scripts; libseccomp2 compiles each life's syscall filter
# (through pyseccomp, in the venv); prometheus brings promtool (the alert rules' checks
# and unit tests) and the server the metrics tests scrape with.
packages=(bubblewrap emacs-nox git curl redis-server tar ca-certificates systemd shellcheck python3 util-linux strace libseccomp2 prometheus)
if [ "${OUROBOROS_SETUP_BROWSER:-1}" = 1 ]; then
  packages+=(chromium)
fi
# The compose test boots the whole fleet in Docker: the engine, and debootstrap
# for base images built here (no image registry is needed; deploy/README.md).
if [ "${OUROBOROS_SETUP_DOCKER:-1}" = 1 ]; then
  packages+=(docker.io debootstrap)
fi
# The VM test boots a Debian guest under QEMU (TCG: no KVM needed) from an image
# scripts/vm-image.sh builds with debootstrap; openssh reaches into the guest and
# serves the shared repository to it; nc carries each forwarded connection.
if [ "${OUROBOROS_SETUP_VM:-1}" = 1 ]; then
  packages+=(qemu-system-x86 qemu-utils debootstrap openssh-client openssh-server e2fsprogs netcat-openbsd)
fi
missing=()
for pkg in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: installing ${missing[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ "${OUROBOROS_SETUP_DOCKER:-1}" = 1 ]; then
  # Compose v2 (bookworm's docker-compose is v1, which rejects docker-compose.yml).
  ./scripts/install-compose-v2.sh
fi

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
echo "setup: ready (.venv)" >&2
