"""The cgroup v1 driver: a child cgroup in each of the cpu, cpuacct, memory and pids hierarchies.

Owns the v1 files: ``cpu.cfs_quota_us``/``cpu.cfs_period_us``, ``memory.limit_in_bytes``
(and ``memory.memsw.limit_in_bytes``, memory plus swap, where the kernel accounts swap),
``pids.max``; figures from ``cpuacct.usage``, ``memory.max_usage_in_bytes`` and the
``oom_kill`` line of ``memory.oom_control``. Scopes live at
``<hierarchy>/<this process's cgroup>/ouroboros/<scope>``.

Trusts the hierarchies this process finds itself in (``/proc/self/cgroup``) and that it
may create children there (root, or a delegated tree). v1 has no cgroup.kill, so a
scope is killed by SIGKILLing its listed pids until it is empty.
"""

from __future__ import annotations

import os
from pathlib import Path

from worker.instrument.ceilings.base import (
    CFS_PERIOD_USEC,
    Ceiling,
    CeilingError,
    Enclosure,
    Figures,
    KillCause,
    cfs_quota_usec,
    cgroupfs_result,
    create_scope_dir,
    empty_scope,
    join_command,
    joined_cpu_nsec,
    own_cgroup_dirs,
    read_int,
    read_keyed,
    remove_scope_dir,
    scope_name,
    sigkill_members,
    write_value,
)
from worker.instrument.physics import Physics

PROC_SWAPS = Path("/proc/swaps")

CONTROLLERS = ("cpu", "cpuacct", "memory", "pids")


class Cgroup1Enclosure(Enclosure):
    """One scope: a directory per hierarchy (shared when controllers are co-mounted)."""

    def __init__(self, directories: dict[str, Path]) -> None:
        self.directories = directories
        self._cause: KillCause | None = None
        self._closed = False

    @property
    def _distinct(self) -> list[Path]:
        return sorted(set(self.directories.values()))

    def command(self, argv: list[str]) -> list[str]:
        return join_command(self._distinct, argv)

    def kill(self, cause: KillCause | None = None) -> None:
        # The first cause stands: the sweep that follows a wall-time kill does not undo it.
        self._cause = self._cause or cause
        procs = [directory / "cgroup.procs" for directory in self._distinct]
        empty_scope(procs, sigkill_members(procs))

    def figures(self) -> Figures:
        memory, cpuacct = self.directories["memory"], self.directories["cpuacct"]
        oom_kills = read_keyed(memory / "memory.oom_control", "oom_kill")
        return Figures(
            driver="cgroup1",
            result=cgroupfs_result(oom_kills, self._cause),
            cpu_usage_nsec=joined_cpu_nsec(read_int(cpuacct / "cpuacct.usage"), cpuacct),
            memory_peak_bytes=read_int(memory / "memory.max_usage_in_bytes"),
            oom_kills=oom_kills,
            sources={
                "result": "cgroup1:memory.oom_control oom_kill, and why the worker killed it",
                "cpu_usage_nsec": "cgroup1:cpuacct.usage",
                "memory_peak_bytes": "cgroup1:memory.max_usage_in_bytes",
                "oom_kills": "cgroup1:memory.oom_control oom_kill",
            },
        )

    def close(self) -> None:
        if self._closed:
            return
        self.kill()
        for directory in self._distinct:
            remove_scope_dir(directory)
        self._closed = True


class Cgroup1Ceiling(Ceiling):
    """Scopes under this process's own v1 cgroups (or under ``parents`` when given)."""

    name = "cgroup1"

    def __init__(self, parents: dict[str, Path] | None = None) -> None:
        self._parents = parents

    def _own(self) -> dict[str, Path]:
        if self._parents is not None:
            return self._parents
        found = own_cgroup_dirs()
        return {c: found[c] for c in CONTROLLERS if c in found}

    def unavailable_reason(self) -> str | None:
        try:
            own = self._own()
        except OSError as exc:
            return f"cannot read this process's cgroups: {exc}"
        return _unusable(own)

    def open(self, physics: Physics, label: str) -> Cgroup1Enclosure:
        name = scope_name(label)
        # /proc/self/mountinfo is read once per life, for the check and the scope: on a
        # host with many mounts, reading it is most of the CPU a scope costs the worker.
        try:
            own = self._own()
        except OSError as exc:
            raise CeilingError(f"cannot read this process's cgroups: {exc}") from None
        reason = _unusable(own)
        if reason is not None:
            raise CeilingError(reason)
        directories: dict[str, Path] = {}
        enclosure = Cgroup1Enclosure(directories)
        try:
            # Co-mounted controllers (cpu,cpuacct on most distributions) share one directory.
            for parent in sorted(set(own.values())):
                directory = create_scope_dir(parent, name)
                directories.update({c: directory for c, p in own.items() if p == parent})
            _limit(directories, physics)
        except BaseException:
            enclosure.close()
            raise
        return enclosure


def _unusable(own: dict[str, Path]) -> str | None:
    """Why no scope can be made under ``own`` (controller -> directory), or None."""
    missing = [c for c in CONTROLLERS if c not in own]
    if missing:
        return f"no cgroup v1 hierarchy mounted for {' '.join(missing)}"
    unwritable = [str(own[c]) for c in CONTROLLERS if not os.access(own[c], os.W_OK)]
    if unwritable:
        return f"cannot create cgroups in {', '.join(unwritable)}"
    try:
        read_keyed(own["memory"] / "memory.oom_control", "oom_kill")
    except CeilingError:
        return "memory.oom_control has no oom_kill counter (needs Linux 4.13+)"
    return None


def swap_active() -> bool:
    """Whether the host has any swap device or file in use."""
    return len(PROC_SWAPS.read_text().splitlines()) > 1


def _limit(directories: dict[str, Path], physics: Physics) -> None:
    cpu, memory, pids = directories["cpu"], directories["memory"], directories["pids"]
    write_value(cpu / "cpu.cfs_period_us", CFS_PERIOD_USEC)
    write_value(cpu / "cpu.cfs_quota_us", cfs_quota_usec(physics))
    # memsw must never be below the memory limit, so the memory limit is written first.
    write_value(memory / "memory.limit_in_bytes", physics.memory_max_bytes)
    memsw = memory / "memory.memsw.limit_in_bytes"
    if memsw.exists():
        write_value(memsw, physics.memory_max_bytes + physics.memory_swap_max_bytes)
    elif swap_active():
        # Without swap accounting the life could swap without bound: no silent fallback.
        raise CeilingError(
            "swap is on but memory.memsw.* is absent, so the swap ceiling cannot be "
            "enforced; boot with swapaccount=1 or turn swap off"
        )
    write_value(pids / "pids.max", physics.tasks_max)
