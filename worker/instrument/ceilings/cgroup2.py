"""The cgroup v2 driver: one child cgroup of the unified hierarchy per scope.

Owns the v2 files: ``cpu.max``, ``memory.max``, ``memory.swap.max`` (where the kernel
accounts swap), ``pids.max``; figures from ``cpu.stat`` (``usage_usec``), ``memory.peak``
and ``memory.events`` (``oom_kill``); ``cgroup.kill`` to end a scope. Scopes live at
``<base>/ouroboros/<scope>``, with cpu, memory and pids enabled in
``cgroup.subtree_control`` on the way down. Also owns where ``<base>`` is:

* a prepared parent (``OUROBOROS_CGROUP_PARENT``: controllers enabled, no processes),
  as ``deploy/systemd/cgroup-delegate.sh`` makes for a ``Delegate=yes`` service;
* in a container's own cgroup namespace (``cgroup: private``, the default on a v2
  Docker or Podman host), the namespace root: the process is in ``/`` (or in its
  ``worker`` leaf, below). v2 forbids a cgroup that holds processes to hand
  controllers to children, and a namespace root is no exception (only the host's
  real root is), so before enabling them the driver moves every process of the
  root into the leaf ``<root>/worker``, as container runtimes do for a nested
  runtime. Later processes of the container (the worker's pool, ``docker exec``,
  which runc then puts beside the container's init) start in that leaf and find
  the same base. Everything in a private namespace is the container's own, so
  moving it all touches nothing else on the host;
* otherwise this process's own cgroup, which works only where that cgroup already
  delegates (the host's real root, or a cgroup with processes in children only).

Trusts the unified hierarchy this process finds itself in. Where the cgroup cannot
delegate, opening a scope fails and the preflight names the reason.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import NamedTuple

from worker.instrument.ceilings.base import (
    CFS_PERIOD_USEC,
    SCOPE_PARENT,
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
    members,
    own_cgroup_dirs,
    read_int,
    read_keyed,
    remove_scope_dir,
    scope_name,
    write_value,
)
from worker.instrument.physics import Physics

CONTROLLERS = ("cpu", "memory", "pids")
# The leaf that takes the processes of a container's namespace root (module docstring).
NAMESPACE_LEAF = "worker"
# How long processes arriving in the namespace root may keep it from delegating.
HAND_DOWN_TIMEOUT_SECONDS = 30.0


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


class Base(NamedTuple):
    """Where scopes go: below ``directory``, which is a container's namespace root or not."""

    directory: Path
    namespace_root: bool


class Cgroup2Ceiling(Ceiling):
    """Scopes below ``parent`` when given, else below the base the module docstring names."""

    name = "cgroup2"

    def __init__(self, parent: Path | None = None, proc_self: Path = Path("/proc/self")) -> None:
        self._parent = parent
        self._proc_self = proc_self

    def base(self) -> Base | None:
        """Where this process's scopes go; None when no cgroup2 hierarchy shows its cgroup."""
        if self._parent is not None:
            return Base(self._parent, namespace_root=False)
        cgroup = self._proc_self / "cgroup"
        own = own_cgroup_dirs(self._proc_self / "mountinfo", cgroup).get("")
        if own is None:
            return None
        path = _v2_path(cgroup)
        root = {"/": own, f"/{NAMESPACE_LEAF}": own.parent}.get(path or "")
        # Only the host's real root lacks cgroup.type; it may hold processes and delegate.
        if root is not None and (root / "cgroup.type").exists():
            return Base(root, namespace_root=True)
        return Base(own, namespace_root=False)

    def placement(self) -> str | None:
        base = self.base()
        if base is None:
            return None
        scopes = f"scopes under {base.directory / SCOPE_PARENT}"
        if base.namespace_root:
            return (
                f"the root of this container's cgroup namespace, {base.directory}: its"
                f" processes in {base.directory / NAMESPACE_LEAF}, {scopes}"
            )
        return scopes

    def unavailable_reason(self) -> str | None:
        try:
            base = self.base()
        except OSError as exc:
            return f"cannot read this process's cgroups: {exc}"
        if base is None:
            return "no cgroup2 hierarchy is mounted over this process's cgroup"
        own = base.directory
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
        base = self.base()
        if base is None:
            raise CeilingError("no cgroup2 hierarchy is mounted over this process's cgroup")
        name = scope_name(label)
        if base.namespace_root:
            _hand_down(base.directory)
        else:
            _delegate(base.directory)
        enclosure = Cgroup2Enclosure(create_scope_dir(base.directory, name, _delegate))
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


def _v2_path(cgroup: Path) -> str | None:
    """This process's cgroup in the unified hierarchy, as its cgroup namespace shows it."""
    for line in cgroup.read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def _hand_down(root: Path) -> None:
    """Move every process of the namespace ``root`` into its leaf, then enable the controllers.

    A process may arrive in the root between the two (a ``docker exec`` while the root
    is still a leaf), and the kernel then refuses the controllers: both are repeated
    until they hold together.
    """
    deadline = time.monotonic() + HAND_DOWN_TIMEOUT_SECONDS
    while True:
        _vacate(root, deadline)
        try:
            _delegate(root)
            return
        except CeilingError:
            if time.monotonic() > deadline or not members([root / "cgroup.procs"]):
                raise


def _vacate(root: Path, deadline: float) -> None:
    """Move the processes listed in ``root`` into ``root/worker`` until it lists none."""
    leaf = root / NAMESPACE_LEAF
    try:
        leaf.mkdir(exist_ok=True)
    except OSError as exc:
        raise CeilingError(f"cannot create cgroup {leaf}: {exc}") from exc
    while pids := members([root / "cgroup.procs"]):
        if 0 in pids:
            # The kernel lists a process of another pid namespace as 0, and a write of 0
            # would move the writer instead.
            raise CeilingError(
                f"{root} holds processes outside this pid namespace, which cannot be moved"
                " from here; give the container its own pid namespace"
            )
        if time.monotonic() > deadline:
            raise CeilingError(f"processes {sorted(pids)} keep arriving in {root}")
        for pid in pids:
            try:
                (leaf / "cgroup.procs").write_text(f"{pid}\n")
            except ProcessLookupError:
                continue  # it ended meanwhile
            except OSError as exc:
                raise CeilingError(
                    f"cannot move process {pid} from {root}, the root of this container's"
                    f" cgroup namespace, to {leaf}: {exc} (run the worker as root in the"
                    " container, or hand the root to its user as"
                    " deploy/docker/worker-entrypoint.sh does)"
                ) from exc


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
