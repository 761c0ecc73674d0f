#!/usr/bin/env bash
# Entrypoint of the worker container (docker-compose.yml, service `worker`).
#
# The worker needs a cgroup subtree it can write, to put every sandbox under its
# resource ceiling. Docker mounts cgroupfs read-only in any container that is not
# --privileged, and has no option to change that, so this script starts as root
# with CAP_SYS_ADMIN, and before the worker runs:
#   1. remounts this container's own cgroup mounts read-write (the container has
#      a private cgroup namespace, so these mounts show only its own subtree);
#   2. on cgroup v2, moves every process of the namespace root into a leaf and
#      delegates cpu, memory and pids to an empty `ouroboros` child: v2 forbids a
#      cgroup that holds processes from handing controllers to children, and the
#      namespace root is a cgroup like any other on the host;
#   3. hands that subtree to the unprivileged `ouroboros` user (chown, the v2
#      delegation model);
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
# init, the supervisor leaf, since the namespace root is no longer a leaf.)
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
  local root=$cgroup_fs pid controller wanted="" uid gid
  if [ -n "$(cat "$root/ouroboros/cgroup.subtree_control" 2>/dev/null)" ]; then
    # Delegated already: this is a later `docker exec` of this script (health
    # check, doctor); it only needs the worker's environment.
    export OUROBOROS_CGROUP_PARENT="$root/ouroboros"
    return 0
  fi
  uid=$(id -u "$run_as")
  gid=$(id -g "$run_as")
  mkdir -p "$root/supervisor" "$root/worker" "$root/ouroboros" || return 1
  # docker-init and this shell go to a leaf of their own; the loop repeats because
  # a process may fork while we read the list.
  for _ in 1 2 3; do
    while read -r pid; do
      echo "$pid" >"$root/supervisor/cgroup.procs" 2>/dev/null || true
    done <"$root/cgroup.procs"
  done
  for controller in cpu memory pids; do
    if ! grep -qw "$controller" "$root/cgroup.controllers"; then
      log "the $controller controller is not available in this container's cgroup"
      return 1
    fi
    wanted="$wanted +$controller"
  done
  echo "$wanted" >"$root/cgroup.subtree_control" || return 1
  echo "$wanted" >"$root/ouroboros/cgroup.subtree_control" || return 1
  # The worker itself lives in /worker; sandboxes go below /ouroboros. Moving a
  # process between the two needs write access to their common ancestor's
  # cgroup.procs, which is the namespace root: only this container's subtree.
  echo "$$" >"$root/worker/cgroup.procs" || return 1
  chown "$uid:$gid" "$root/cgroup.procs" "$root/worker" "$root/worker/cgroup.procs" || return 1
  chown -R "$uid:$gid" "$root/ouroboros" || return 1
  export OUROBOROS_CGROUP_PARENT="$root/ouroboros"
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
