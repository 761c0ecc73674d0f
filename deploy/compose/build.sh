#!/usr/bin/env bash
# Builds the fleet's images from this checkout and tells them which commit they
# hold (an installed wheel is not a git checkout; `schedule-lineage init` records
# the commit in every new lineage). Refuses uncommitted changes to tracked files:
# a lineage must name the exact code it ran under.
#
# The image it replaces is kept under the first 12 hex of its own commit, so a
# drain worker can keep serving the lineages pinned to the previous instrument
# during a rolling upgrade (deploy/README.md, "Rolling upgrades").
# Arguments are passed to `docker compose build`.
set -euo pipefail
cd "$(dirname "$0")/../.."

if ! commit=$(git rev-parse --verify --quiet HEAD); then
  echo "build.sh: $(pwd) is not a git checkout with a commit" >&2
  exit 2
fi
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "build.sh: uncommitted changes to tracked files; commit them first" >&2
  exit 2
fi

tag=${FLEET_IMAGE_TAG:-}
if [ -z "$tag" ] && [ -f .env ]; then
  tag=$(sed -n 's/^FLEET_IMAGE_TAG=//p' .env | tail -n 1)
fi
tag=${tag:-local}

previous=$(docker image inspect --format '{{ index .Config.Labels "org.opencontainers.image.revision" }}' \
  "ouroboros-fleet:$tag" 2>/dev/null || true)
if [ -n "$previous" ] && [ "$previous" != "$commit" ]; then
  docker tag "ouroboros-fleet:$tag" "ouroboros-fleet:${previous:0:12}"
  echo "build.sh: previous image kept as ouroboros-fleet:${previous:0:12}; to keep serving its lineages:"
  echo "  FLEET_DRAIN_TAG=${previous:0:12} docker compose --profile drain up -d worker-drain"
fi

OUROBOROS_INSTRUMENT_COMMIT=$commit FLEET_IMAGE_TAG=$tag docker compose build "$@"
