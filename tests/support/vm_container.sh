#!/bin/bash
# A container runtime in miniature, for the booted guest of tests/test_vm_host.py:
# the compose `worker` service as a cgroup-v2 Docker host runs it (cgroup: private,
# user: root, init: true, the image's entrypoint), made from util-linux alone.
#
#   vm-container start      the container, its worker started through the entrypoint
#   vm-container exec CMD   CMD in it through the entrypoint (docker compose exec),
#                           once the worker has made the namespace root delegate
#   vm-container cli CMD    CMD as the image's user with the same environment,
#                           outside it (the compose `cli` service's container)
#   vm-container init-pid   the guest's pid of its init (docker-init's place)
#   vm-container stop       kill it, remove its cgroup
#
# What runc does and this repeats: the container's first process joins a fresh
# cgroup of its own (/sys/fs/cgroup/vm-container on the guest), and only then
# unshares the cgroup namespace, so that the namespace root holds the container's
# processes and nothing else; new mount, pid and uts namespaces; cgroup2 mounted
# afresh at /sys/fs/cgroup, read-only (Docker's mount without --privileged), so
# that /proc/self/cgroup says 0::/ and the mount's root is the container's cgroup;
# a fresh /proc. Its init stays pid 1 as root, as docker-init does, with the
# entrypoint as its child. The environment is /etc/vm-container.env (the compose
# file's `environment:`), the working directory the image's WORKDIR.
set -euo pipefail

readonly name=vm-container
readonly cgroup=/sys/fs/cgroup/$name
readonly environment=/etc/$name.env
readonly entrypoint=/root/src/deploy/docker/worker-entrypoint.sh
readonly workdir=/var/lib/ouroboros
readonly log=/var/log/$name.log
readonly unshare_pid=/run/$name.unshare
self=$(readlink -f "$0")

with_environment() {
  local settings
  mapfile -t settings < <(grep -v '^#' "$environment")
  cd "$workdir"
  exec env -i "${settings[@]}" "$@"
}

init_pid() {
  local parent child
  read -r parent <"$unshare_pid"
  # The only child of unshare --fork, listed with a trailing space and no newline
  # (so read reports end of file).
  read -r child <"/proc/$parent/task/$parent/children" || true
  echo "$child"
}

case ${1:-} in
start)
  mkdir "$cgroup"
  setsid unshare --mount --pid --fork --uts --propagation private -- "$self" join \
    </dev/null >"$log" 2>&1 &
  echo $! >"$unshare_pid"
  ;;
join)
  # Pid 1 of the new pid namespace, still in the guest's cgroup namespace.
  echo 0 >"$cgroup/cgroup.procs"
  exec unshare --cgroup -- "$self" init
  ;;
init)
  umount /sys/fs/cgroup
  mount -t cgroup2 -o ro,nosuid,nodev,noexec cgroup2 /sys/fs/cgroup
  mount -t proc -o nosuid,nodev,noexec proc /proc
  hostname "$name"
  ("$self" entrypoint celery -A worker worker --loglevel=INFO) &
  # docker-init's part: reap, and end with the worker.
  wait
  ;;
entrypoint)
  shift
  with_environment "$entrypoint" "$@"
  ;;
cli)
  shift
  with_environment runuser -u ouroboros -- env HOME=/var/lib/ouroboros "$@"
  ;;
exec)
  shift
  init=$(init_pid)
  # runc puts an exec'd process in the cgroup of the container's init once the
  # namespace root is no longer a leaf; then into the container's namespaces.
  # (nsenter's own process waits outside the pid namespace, in that cgroup: while
  # it was still the namespace root, the worker could not move it, hence the
  # wait for the delegation.)
  if [ -z "$(cat "$cgroup/cgroup.subtree_control")" ]; then
    echo "$name: the worker has not made its namespace root delegate yet" >&2
    exit 1
  fi
  echo $$ >"/sys/fs/cgroup$(sed -n 's/^0:://p' "/proc/$init/cgroup")/cgroup.procs"
  exec nsenter --target "$init" --mount --pid --uts --cgroup -- "$self" entrypoint "$@"
  ;;
init-pid)
  init_pid
  ;;
stop)
  kill -KILL "$(init_pid)"
  while grep -q '^populated 1' "$cgroup/cgroup.events"; do sleep 1; done
  find "$cgroup" -depth -type d -exec rmdir {} +
  ;;
*)
  echo "usage: $0 start|exec CMD...|cli CMD...|init-pid|stop" >&2
  exit 2
  ;;
esac
