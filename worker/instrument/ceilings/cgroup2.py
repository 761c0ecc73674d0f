"""The cgroup v2 driver: one child cgroup of the unified hierarchy per scope.

Owns the v2 files: ``cpu.max``, ``memory.max``, ``memory.swap.max`` (where the kernel
accounts swap), ``pids.max``; figures from ``cpu.stat`` (``usage_usec``), ``memory.peak``
and ``memory.events`` (``oom_kill``); ``cgroup.kill`` to end a scope. Scopes live at
``<this process's cgroup>/ouroboros/<scope>``, with cpu, memory and pids enabled in
``cgroup.subtree_control`` on the way down.

Trusts the unified hierarchy this process finds itself in. v2 forbids handing
controllers to children of a cgroup that holds processes (except the root), so this
driver works when the worker's own cgroup is the root of its namespace or already
delegates cpu, memory and pids; otherwise opening a scope fails and the preflight
names the reason.
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
    write_value,
)
from worker.instrument.physics import Physics

CONTROLLERS = ("cpu", "memory", "pids")


class Cgroup2Enclosure(Enclosure):
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._cause: KillCause | None = None
        self._closed = False

    def command(self, argv: list[str]) -> list[str]:
        return join_command([self.directory], argv)

    def kill(self, cause: KillCause | None = None) -> None:
        # The first cause stands: the sweep that follows a wall-time kill does not undo it.
        self._cause = self._cause or cause
        # cgroup.kill (Linux 5.14+) kills the whole scope atomically, including processes
        # forked while it runs; the loop only waits for the scope to report empty.
        empty_scope(
            [self.directory / "cgroup.procs"],
            lambda _pids: write_value(self.directory / "cgroup.kill", 1),
        )

    def figures(self) -> Figures:
        oom_kills = read_keyed(self.directory / "memory.events", "oom_kill")
        peak = self.directory / "memory.peak"
        has_peak = peak.exists()
        return Figures(
            driver="cgroup2",
            result=cgroupfs_result(oom_kills, self._cause),
            cpu_usage_nsec=joined_cpu_nsec(
                read_keyed(self.directory / "cpu.stat", "usage_usec") * 1000, self.directory
            ),
            memory_peak_bytes=read_int(peak) if has_peak else None,
            oom_kills=oom_kills,
            sources={
                "result": "cgroup2:memory.events oom_kill, and why the worker killed it",
                "cpu_usage_nsec": "cgroup2:cpu.stat usage_usec",
                "memory_peak_bytes": (
                    "cgroup2:memory.peak"
                    if has_peak
                    else "cgroup2:memory.peak absent (Linux <5.19)"
                ),
                "oom_kills": "cgroup2:memory.events oom_kill",
            },
        )

    def close(self) -> None:
        if self._closed:
            return
        self.kill()
        remove_scope_dir(self.directory)
        self._closed = True


class Cgroup2Ceiling(Ceiling):
    """Scopes below this process's own v2 cgroup (or below ``parent`` when given)."""

    name = "cgroup2"

    def __init__(self, parent: Path | None = None) -> None:
        self._parent = parent

    def _own(self) -> Path | None:
        return self._parent if self._parent is not None else own_cgroup_dirs().get("")

    def unavailable_reason(self) -> str | None:
        try:
            own = self._own()
        except OSError as exc:
            return f"cannot read this process's cgroups: {exc}"
        if own is None:
            return "no cgroup2 hierarchy is mounted over this process's cgroup"
        try:
            offered = (own / "cgroup.controllers").read_text().split()
        except OSError as exc:
            return f"cannot read {own / 'cgroup.controllers'}: {exc}"
        missing = [c for c in CONTROLLERS if c not in offered]
        if missing:
            return (
                f"{own} offers controllers [{' '.join(offered)}], not {' '.join(missing)}"
                " (bound to cgroup v1, or not delegated to this process)"
            )
        if not os.access(own, os.W_OK):
            return f"cannot create cgroups in {own}"
        return None

    def open(self, physics: Physics, label: str) -> Cgroup2Enclosure:
        own = self._own()
        if own is None:
            raise CeilingError("no cgroup2 hierarchy is mounted over this process's cgroup")
        name = scope_name(label)
        _delegate(own)
        enclosure = Cgroup2Enclosure(create_scope_dir(own, name, _delegate))
        try:
            directory = enclosure.directory
            write_value(directory / "cpu.max", f"{cfs_quota_usec(physics)} {CFS_PERIOD_USEC}")
            write_value(directory / "memory.max", physics.memory_max_bytes)
            swap = directory / "memory.swap.max"
            if swap.exists():
                write_value(swap, physics.memory_swap_max_bytes)
            write_value(directory / "pids.max", physics.tasks_max)
        except BaseException:
            enclosure.close()
            raise
        return enclosure


def _delegate(directory: Path) -> None:
    """Enable cpu, memory and pids for the children of ``directory`` (if not yet enabled)."""
    control = directory / "cgroup.subtree_control"
    try:
        enabled = control.read_text().split() if control.exists() else []
    except OSError as exc:
        raise CeilingError(f"cannot read {control}: {exc}") from exc
    wanted = [c for c in CONTROLLERS if c not in enabled]
    if wanted:
        try:
            write_value(control, " ".join(f"+{c}" for c in wanted))
        except CeilingError as exc:
            raise CeilingError(
                f"{exc} (a cgroup that holds processes cannot delegate controllers in cgroup v2;"
                " run the worker where its cgroup delegates cpu, memory and pids)"
            ) from exc
