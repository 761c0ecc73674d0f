#!/usr/bin/env bash
# Builds, on this docker host and without any image registry, the images that
# deploy/compose/no-registry.yml puts in place of registry images:
#   ouroboros-local/bookworm:minbase       `debootstrap --variant=minbase bookworm`,
#                                          imported (stands for debian:bookworm-slim)
#   ouroboros-local/python:3.11-bookworm   Debian's Python 3.11 (stands for
#                                          python:3.11-slim-bookworm)
#   ouroboros-local/redis:7.0-bookworm     Debian's redis-server (stands for redis:7.2)
#   ouroboros-local/s3-test-standin:moto5  moto's S3 server: a TEST STAND-IN for
#                                          MinIO, with no users and no policies
# deploy/compose/local-images/Dockerfile says how each is made.
#
# Cached, so that a later run on this machine is quick: the debootstrap tree is
# kept as a tarball in $FLEET_LOCAL_CACHE (default /var/cache/ouroboros-fleet),
# and debootstrap is skipped while ouroboros-local/bookworm:minbase exists in the
# engine (or the tarball exists); the other images reuse the engine's build cache.
# --refresh debootstraps again (security updates in the base).
#
# Needs root (debootstrap), docker and Docker Compose v2 (its builder passes the
# build host's CA bundle to pip as a build secret: FLEET_BUILD_CA_BUNDLE, default
# /etc/ssl/certs/ca-certificates.crt).
set -euo pipefail
cd "$(dirname "$0")/../.."

readonly base_image=ouroboros-local/bookworm:minbase
cache=${FLEET_LOCAL_CACHE:-/var/cache/ouroboros-fleet}
mirror=${FLEET_DEBIAN_MIRROR:-http://deb.debian.org/debian}
tarball="$cache/bookworm-minbase-$(dpkg --print-architecture).tar"

log() { printf 'local-images: %s\n' "$*" >&2; }

refresh=0
case "${1:-}" in
  "") ;;
  --refresh) refresh=1 ;;
  *) echo "usage: $0 [--refresh]" >&2
     exit 2 ;;
esac

debootstrap_tarball() {
  local tree
  if ! command -v debootstrap >/dev/null; then
    log "debootstrap is not installed (apt-get install debootstrap)"
    return 1
  fi
  install -d -m 0755 "$cache"
  tree=$(mktemp -d "$cache/bookworm.XXXXXX")
  # shellcheck disable=SC2064 # the path is fixed now, on purpose
  trap "rm -rf '$tree'" EXIT
  log "debootstrap --variant=minbase bookworm from $mirror (about a minute)"
  debootstrap --variant=minbase bookworm "$tree" "$mirror" >"$cache/debootstrap.log" 2>&1 || {
    tail -n 20 "$cache/debootstrap.log" >&2
    return 1
  }
  # What debootstrap copies from this host (docker provides its own), downloaded
  # packages and logs have no place in an image.
  rm -rf "$tree"/var/cache/apt/archives/*.deb "$tree"/var/lib/apt/lists/* \
    "$tree"/var/log/* "$tree/etc/hostname" "$tree/etc/resolv.conf"
  # The suites debian:bookworm-slim uses: main, its point-release updates and security.
  rm -f "$tree/etc/apt/sources.list"
  cat >"$tree/etc/apt/sources.list.d/debian.sources" <<SOURCES
Types: deb
URIs: $mirror
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${FLEET_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
  tar --numeric-owner -C "$tree" -cf "$tarball.partial" .
  mv "$tarball.partial" "$tarball"
  rm -rf "$tree"
  trap - EXIT
}

if [ "$refresh" = 1 ]; then
  rm -f "$tarball"
fi
if [ "$refresh" = 1 ] || ! docker image inspect "$base_image" >/dev/null 2>&1; then
  if [ ! -s "$tarball" ]; then
    debootstrap_tarball
  fi
  log "importing $tarball as $base_image"
  docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' \
    --message "debootstrap --variant=minbase bookworm ($mirror)" \
    "$tarball" "$base_image" >/dev/null
else
  log "$base_image exists; debootstrap skipped"
fi

log "building the python, redis and S3 test stand-in images"
FLEET_BUILD_CA_BUNDLE=${FLEET_BUILD_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt} \
  docker compose --project-directory deploy/compose/local-images \
  -f deploy/compose/local-images/compose.yml build --quiet
log "ready: $(docker image ls --format '{{.Repository}}:{{.Tag}}' 'ouroboros-local/*' | sort | tr '\n' ' ')"
