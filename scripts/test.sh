#!/usr/bin/env bash
# Runs the whole test suite the way CI does: lint, then pytest against real
# Redis, a real moto S3 server, real bwrap, Emacs, git and cgroups, and the
# compose fleet on a real Docker engine (started here when none answers).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  mkdir -p /tmp/ouroboros-ci-redis
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir /tmp/ouroboros-ci-redis --logfile /tmp/ouroboros-ci-redis/redis.log
  for _ in $(seq 50); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 0.1; done
fi

# Without an engine the rest of the suite still runs; the compose test then fails
# and says why.
./scripts/start-dockerd.sh || echo "test.sh: no Docker engine answers; the compose test will fail" >&2

.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
