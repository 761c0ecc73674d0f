#!/usr/bin/env bash
# Makes sure a Docker engine answers, for the compose test (tests/test_compose.py).
#
# CI machines of this kind have no init system that would start docker.io's
# service, so when `docker info` gets no answer this starts a plain `dockerd` in
# the background (overlay2, the default bridge and iptables all work there), with
# its log in /var/log/ouroboros-ci-dockerd.log, and waits until it answers. An
# engine that already answers is used as it is. The engine is left running when
# the tests end (the tests remove their containers, networks and volumes).
set -euo pipefail

log=${OUROBOROS_DOCKERD_LOG:-/var/log/ouroboros-ci-dockerd.log}
wait_seconds=${OUROBOROS_DOCKERD_WAIT:-90}

if docker info >/dev/null 2>&1; then
  exit 0
fi
if ! command -v dockerd >/dev/null; then
  echo "start-dockerd: dockerd is not installed (scripts/setup.sh installs docker.io)" >&2
  exit 1
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "start-dockerd: no Docker engine answers, and starting one needs root" >&2
  exit 1
fi

echo "start-dockerd: starting dockerd (log: $log)" >&2
# setsid: the engine must outlive this script and the test session's process group.
setsid dockerd >>"$log" 2>&1 </dev/null &
pid=$!
for _ in $(seq "$wait_seconds"); do
  if docker info >/dev/null 2>&1; then
    exit 0
  fi
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "start-dockerd: dockerd exited; the end of its log:" >&2
    tail -n 20 "$log" >&2
    exit 1
  fi
  sleep 1
done
echo "start-dockerd: dockerd (pid $pid) did not answer within ${wait_seconds} s; the end of its log:" >&2
tail -n 20 "$log" >&2
exit 1
