#!/usr/bin/env bash
# Runs the test suite the way CI does: lint and type checks, then pytest against real
# Redis, a real moto S3 server, real bwrap, Emacs, git and cgroups, and the compose
# fleet on a real Docker engine (started here when none answers).
#
# --fast runs the fast tier only: every test that needs no process, service or
# sandbox, in this process (tests/support/tiers.py refuses the rest); no Redis or
# Docker engine is started for it. Other arguments go to pytest.
#
# The full tier runs on two pytest-xdist processes (most of its tests wait on workers,
# leases and services, not on a core), each with a redis-server of its own
# (tests/support/xdist_redis.py); the VM and compose modules are one unit of work
# (tests/support/xdist_schedule.py), so one process runs them while the other runs the
# rest. `-n 0` after it runs serially.
set -euo pipefail
cd "$(dirname "$0")/.."

fast=()
parallel=(-n 2)
args=()
for arg in "$@"; do
  if [ "$arg" = --fast ]; then fast=(--fast); parallel=(); else args+=("$arg"); fi
done

if [ "${#fast[@]}" -eq 0 ]; then
  if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
    mkdir -p /tmp/ouroboros-ci-redis
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
      --dir /tmp/ouroboros-ci-redis --logfile /tmp/ouroboros-ci-redis/redis.log
    for _ in $(seq 50); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 0.1; done
  fi

  # Without an engine the rest of the suite still runs; the compose test then fails
  # and says why.
  ./scripts/start-dockerd.sh || echo "test.sh: no Docker engine answers; the compose test will fail" >&2
fi

.venv/bin/ruff check .
.venv/bin/ruff format --check .
# mypy --strict over worker/ and scheduler/ (configured in pyproject.toml).
.venv/bin/mypy
exec .venv/bin/python -m pytest "${fast[@]}" "${parallel[@]}" "${args[@]}"
