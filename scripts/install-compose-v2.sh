#!/usr/bin/env bash
# Installs Docker Compose v2 on a Debian 12 host, for the compose test and for
# operators without Docker's own apt repository.
#
# Bookworm's docker-compose package is Compose v1 (1.29), which rejects
# docker-compose.yml (top-level `name`, `cgroup`). Trixie's docker-compose is v2
# (2.26), a Go binary whose only dependency (libc6 >= 2.34) bookworm satisfies.
# This script fetches that one .deb with a private apt configuration (its own
# source list, package lists and archive directory under the cache), so the
# host's apt never sees trixie and no other package can come from it; then
# installs it with dpkg, where apt can see and remove it like any package.
#
# The .deb stays in the cache directory, so a later run on this machine needs
# no network. Does nothing when `docker compose version` is already v2 >= 2.16.
set -euo pipefail

cache=${OUROBOROS_CI_CACHE:-/var/cache/ouroboros-ci}
mirror=${OUROBOROS_DEBIAN_MIRROR:-http://deb.debian.org/debian}
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"

compose_version() {
  docker compose version --short 2>/dev/null || true
}

new_enough() { # version
  local major minor
  IFS=. read -r major minor _ <<<"${1#v}"
  [ -n "$major" ] && [ -n "$minor" ] &&
    { [ "$major" -gt 2 ] || { [ "$major" -eq 2 ] && [ "$minor" -ge 16 ]; }; }
}

if new_enough "$(compose_version)"; then
  exit 0
fi

apt_dir="$cache/apt-trixie"
$sudo install -d "$cache" "$apt_dir" "$apt_dir/lists/partial" "$apt_dir/archives/partial" "$apt_dir/parts"
deb=$(find "$cache" -maxdepth 1 -name 'docker-compose_2.*_amd64.deb' | sort -V | tail -n 1)
if [ -z "$deb" ]; then
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main" |
    $sudo tee "$apt_dir/sources.list" >/dev/null
  private=(
    -o "Dir::Etc::SourceList=$apt_dir/sources.list"
    -o "Dir::Etc::SourceParts=$apt_dir/parts"
    -o "Dir::State::Lists=$apt_dir/lists"
    -o "Dir::Cache::Archives=$apt_dir/archives"
    -o "Dir::Cache::pkgcache="
    -o "Dir::Cache::srcpkgcache="
    # The download lands in the cache directory, which the _apt user cannot write.
    -o "APT::Sandbox::User=root"
  )
  echo "install-compose-v2: fetching docker-compose from Debian trixie" >&2
  $sudo apt-get -qq "${private[@]}" update
  (cd "$cache" && $sudo apt-get -qq "${private[@]}" download docker-compose)
  deb=$(find "$cache" -maxdepth 1 -name 'docker-compose_2.*_amd64.deb' | sort -V | tail -n 1)
  if [ -z "$deb" ]; then
    echo "install-compose-v2: trixie offers no docker-compose 2.x" >&2
    exit 1
  fi
fi
$sudo dpkg -i "$deb" >/dev/null

installed=$(compose_version)
if ! new_enough "$installed"; then
  echo "install-compose-v2: \`docker compose version\` says '${installed:-nothing}' after installing $deb" >&2
  exit 1
fi
echo "install-compose-v2: Docker Compose $installed" >&2
