#!/usr/bin/env bash
# ExecStart= wrapper of the worker user units (installed as
# /opt/ouroboros/libexec/cgroup-delegate): turns the cgroup that Delegate=yes
# hands to the service into one the cgroup2 ceiling driver can use, then execs
# the command.
#
# Why: cgroup v2 lets a cgroup hand controllers to children only while it holds
# no process itself, and the worker starts inside its service's cgroup. So the
# worker moves to a leaf `main`, cpu, memory and pids are enabled for an empty
# sibling `sandboxes`, and OUROBOROS_CGROUP_PARENT points the driver there.
# (systemd 254+ does the first half with DelegateSubgroup=; Debian 12 and
# RHEL 9 have 252, so it is done here. `auto` picks the systemd driver where a
# user manager answers; OUROBOROS_CEILING=cgroup2 uses this subtree instead.)
#
# Without a writable delegated cgroup v2 it changes nothing: the worker's
# ceiling preflight then names what is missing.
set -euo pipefail

controllers="cpu memory pids"

if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
  own=$(awk -F: '$1 == "0" { print $3 }' /proc/self/cgroup)
  cg=/sys/fs/cgroup${own%/main}
  if [ -n "$own" ] && [ -w "$cg/cgroup.subtree_control" ]; then
    offered=$(cat "$cg/cgroup.controllers")
    wanted=""
    for c in $controllers; do
      case " $offered " in
        *" $c "*) wanted="$wanted +$c" ;;
        *) echo "cgroup-delegate: $cg does not offer $c; is it delegated (Delegate=yes)?" >&2 ;;
      esac
    done
    mkdir -p "$cg/main" "$cg/sandboxes"
    echo "$$" >"$cg/main/cgroup.procs"
    if [ -n "$wanted" ]; then
      echo "$wanted" >"$cg/cgroup.subtree_control"
      echo "$wanted" >"$cg/sandboxes/cgroup.subtree_control"
    fi
    export OUROBOROS_CGROUP_PARENT="$cg/sandboxes"
  fi
fi

exec "$@"
