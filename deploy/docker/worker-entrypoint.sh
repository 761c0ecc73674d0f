#!/usr/bin/env bash
# Entrypoint of the worker container (docker-compose.yml, service `worker`).
#
# The worker needs a cgroup subtree it can write, to put every sandbox under its
# resource ceiling. Docker mounts cgroupfs read-only in any container that is not
# --privileged, and has no option to change that, so this script starts as root
# with CAP_SYS_ADMIN, and before the worker runs:
#   1. remounts this container's own cgroup mounts read-write (the container has
#      a private cgroup namespace, so these mounts show only its own subtree);
#   2. on cgroup v2, hands the namespace root to the unprivileged `ouroboros`
#      user (chown of the directory and of the files that move processes and
#      enable controllers: the v2 delegation model). The worker's cgroup2 driver
#      then moves every process of the root (docker-init, this script's heir)
#      into a leaf `worker` and enables cpu, memory and pids for the sandboxes
#      under `ouroboros`: v2 forbids a cgroup that holds processes from handing
#      controllers to children, and the namespace root is a cgroup like any
#      other on the host (worker/instrument/ceilings/cgroup2.py);
#   3. on cgroup v1, hands the container's own cgroups to that user;
#   4. drops root, every capability (bounding set included) and the ability to
#      regain any (no_new_privs), and execs the worker.
# Nothing privileged survives step 4: bwrap creates its namespaces as an ordinary
# user, which is what seccomp/apparmor=unconfined in docker-compose.yml permit.
#
# If a step fails, the worker still starts and its ceiling preflight refuses with
# the reason (there is no unbounded fallback); `schedule-lineage doctor` says more.
#
# Run again inside the running container (docker compose exec worker
# /usr/local/libexec/ouroboros/worker-entrypoint.sh CMD...), it finds the work
# done and runs CMD exactly as the worker runs: the health check and the doctor
# go through it. (runc puts such processes in the cgroup of the container's
# init, the `worker` leaf, once the namespace root is no longer a leaf.)
set -euo pipefail

readonly run_as=ouroboros
readonly cgroup_fs=/sys/fs/cgroup

log() { printf 'worker-entrypoint: %s\n' "$*" >&2; }

cgroup_mounts() {
  # Mount points of every cgroup (v1) and cgroup2 filesystem this container sees.
  awk '{ for (i = 7; i <= NF; i++) if ($i == "-") {
           if ($(i + 1) == "cgroup" || $(i + 1) == "cgroup2") print $5
           break } }' /proc/self/mountinfo
}

make_writable() {
  local mnt
  while read -r mnt; do
    if [ -w "$mnt" ]; then
      continue
    fi
    # A bind remount changes this mount's flags only; the superblock is the host's.
    if ! mount -o remount,bind,rw "$mnt" 2>/dev/null; then
      log "cannot make $mnt writable (is CAP_SYS_ADMIN granted to the worker service?)"
      return 1
    fi
  done < <(cgroup_mounts)
}

delegate_v2() {
  local root=$cgroup_fs uid gid
  uid=$(id -u "$run_as")
  gid=$(id -g "$run_as")
  # Moving a process between two cgroups needs write access to their common
  # ancestor's cgroup.procs: for the driver's moves, only this container's root.
  chown "$uid:$gid" "$root" "$root/cgroup.procs" "$root/cgroup.subtree_control" \
    "$root/cgroup.threads"
}

delegate_v1() {
  # v1 has no rule against processes in inner cgroups: the worker creates its
  # scopes under its own cgroup in each hierarchy, which it only needs to own.
  local mnt uid gid
  uid=$(id -u "$run_as")
  gid=$(id -g "$run_as")
  while read -r mnt; do
    chown "$uid:$gid" "$mnt" "$mnt/cgroup.procs" "$mnt/tasks" 2>/dev/null || true
  done < <(cgroup_mounts)
}

if [ "$(id -u)" -ne 0 ]; then
  # Started unprivileged (a `user:` override): nothing to prepare, nothing to drop.
  exec "$@"
fi

if make_writable; then
  if [ -f "$cgroup_fs/cgroup.controllers" ]; then
    delegate_v2 || log "cgroup v2 delegation failed; the worker's preflight will say why"
  else
    delegate_v1
  fi
fi

HOME=$(getent passwd "$run_as" | cut -d: -f6)
export HOME USER=$run_as LOGNAME=$run_as
exec setpriv --reuid="$run_as" --regid="$run_as" --init-groups \
  --inh-caps=-all --bounding-set=-all --no-new-privs -- "$@"
