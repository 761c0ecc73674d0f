"""The aggregate resource scope: one interface, and the cgroupfs plumbing its drivers share.

Owns the driver-neutral interface (``Figures``, ``Enclosure``, ``Ceiling``), scope
naming, and what the cgroup v1 and v2 drivers have in common: finding this
process's own cgroups from ``/proc/self/mountinfo`` and ``/proc/self/cgroup``, the
shell prologue by which a sandbox process joins its scope before it execs, and the
wait-until-empty sweep used to kill a scope.

Trusts the kernel's cgroupfs and ``/proc``, and physics already validated by
``worker.instrument.physics``. Everything an organism can influence (the processes inside a
scope) is treated as hostile: pids are signalled through pidfds so that a pid
reused by an unrelated host process is never hit.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from contextlib import suppress
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field

from worker.instrument.names import DriverName
from worker.instrument.physics import Physics

# Why the worker ended a life that was still running: its wall time ran out, or its
# result stream outgrew the archive cap. A kill without a cause is the sweep after the
# life's process ended by itself, which kills nothing of the life (at most leftovers).
KillCause = Literal["wall", "overflow"]
# The driver_result word a kill with a cause stands for; "timeout" is systemd's own
# word for a unit its RuntimeMaxSec= ended, so both kinds of driver say the same.
KILL_RESULTS: dict[KillCause, str] = {"wall": "timeout", "overflow": "killed"}
SCOPE_PARENT = "ouroboros"
CFS_PERIOD_USEC = 100_000
# A scope that does not empty within this time after SIGKILL is a host fault, not a slow organism.
KILL_TIMEOUT_SECONDS = 30.0
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,100}$")
# A scope's name ends in its creator's pid and a random tag (see scope_name).
_CREATOR = re.compile(r"-(\d+)-[0-9a-f]{8}\Z")


class CeilingError(RuntimeError):
    """A scope could not be created, joined, read or removed: a host fault, never a death."""


class Figures(BaseModel):
    """What the scope measured over one life, and where each figure was read."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    driver: DriverName
    result: str
    cpu_usage_nsec: int | None = Field(ge=0)
    memory_peak_bytes: int | None = Field(ge=0)
    oom_kills: int = Field(ge=0)
    sources: dict[str, str]


class Enclosure(ABC):
    """One live aggregate resource scope for one sandbox run; closing it removes it."""

    @abstractmethod
    def command(self, argv: list[str]) -> list[str]:
        """The argv to exec so that ``argv`` runs inside the scope from its first instruction."""

    @abstractmethod
    def kill(self, cause: KillCause | None = None) -> None:
        """SIGKILL every process in the scope and return once it is empty.

        ``cause`` says why the worker ends a life that is still running; without one
        this is the sweep after the life ended by itself, and the figures' result
        does not change.
        """

    @abstractmethod
    def figures(self) -> Figures:
        """The scope's figures, read after the process ended."""

    @abstractmethod
    def close(self) -> None:
        """Kill what is left and remove the scope; calling it again does nothing."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class Ceiling(ABC):
    """A way of creating aggregate resource scopes on this host."""

    name: ClassVar[DriverName]

    @abstractmethod
    def unavailable_reason(self) -> str | None:
        """None when this driver can work here, else one short reason why not."""

    @abstractmethod
    def open(self, physics: Physics, label: str) -> Enclosure:
        """Create a scope enforcing ``physics``; raises CeilingError when the host refuses."""

    def placement(self) -> str | None:
        """Where this driver's scopes live on this host, in words (doctor); None: nothing to add."""
        return None


def scope_name(label: str) -> str:
    """A scope name unique on this host: the label for humans, the creator's pid, a random tag.

    Labels are derived from the job, so a duplicated job carries the same one; the tag
    keeps two concurrent duplicates apart, and the pid lets a later worker recognise the
    debris of one that was killed before it could close its scope.
    """
    if not _LABEL.fullmatch(label):
        raise ValueError(f"{label!r} is not a scope label; use letters, digits, '.', '_' or '-'")
    return f"{label}-{os.getpid()}-{secrets.token_hex(4)}"


def cfs_quota_usec(physics: Physics) -> int:
    """The CFS quota per CFS_PERIOD_USEC that grants physics.cpu_quota_percent of one core."""
    # The kernel refuses quotas under 1 ms.
    return max(1000, round(CFS_PERIOD_USEC * physics.cpu_quota_percent / 100))


# --- cgroupfs plumbing shared by the cgroup1 and cgroup2 drivers ---------------------------

# Runs as /bin/sh with the scope directories, "--", then the real argv. The shell writes its
# own pid into every scope before exec, so the sandbox is inside from its first instruction
# and no preexec_fn is needed in the threaded worker. If it cannot join it exits 125 without
# running anything, and the scope then shows no CPU time at all (see joined_cpu_nsec).
_JOIN = (
    'while [ "$1" != -- ]; do echo $$ > "$1/cgroup.procs" || exit 125; shift; done; '
    'shift; exec "$@"'
)


def join_command(directories: Iterable[Path], argv: list[str]) -> list[str]:
    """argv that joins every cgroup directory, then execs ``argv``."""
    return ["/bin/sh", "-c", _JOIN, "ouroboros-join", *map(str, directories), "--", *argv]


def own_cgroup_dirs(
    mountinfo: Path = Path("/proc/self/mountinfo"),
    cgroup: Path = Path("/proc/self/cgroup"),
) -> dict[str, Path]:
    """Where this process's own cgroups are: controller name (``""`` for v2) -> directory.

    A hierarchy counts only if it is mounted with the process's cgroup inside the mount's
    root (a container may see a sub-tree of the host's hierarchy).
    """
    mounts: dict[str, tuple[str, Path]] = {}
    for line in mountinfo.read_text().splitlines():
        fields, _, tail = line.partition(" - ")
        root, point = fields.split()[3:5]
        fstype, _source, options = tail.split()[:3]
        if fstype == "cgroup2":
            mounts.setdefault("", (_unescape(root), Path(_unescape(point))))
        elif fstype == "cgroup":
            for option in options.split(","):
                mounts.setdefault(option, (_unescape(root), Path(_unescape(point))))
    found: dict[str, Path] = {}
    for line in cgroup.read_text().splitlines():
        _hierarchy, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            if controller not in mounts:
                continue
            mount_root, mount_point = mounts[controller]
            relative = os.path.relpath(path, mount_root)
            if relative == ".." or relative.startswith("../"):
                continue
            found[controller] = Path(os.path.normpath(mount_point / relative))
    return found


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def create_scope_dir(
    parent: Path, name: str, prepare: Callable[[Path], None] = lambda _base: None
) -> Path:
    """Create ``parent/ouroboros/name``; ``prepare`` readies ``parent/ouroboros`` first.

    A concurrent close() may remove an empty ``ouroboros`` between our mkdir calls,
    within ``mkdir(exist_ok=True)`` itself, or while ``prepare`` writes to it, so a
    vanished parent is recreated a few times before giving up. Another life may also
    remove it and make it anew between ``prepare`` and our scope's mkdir: the scope then
    lies in a parent whose controllers its maker has not enabled yet (in cgroup v2 the
    scope has no ``cpu.max`` to write, and the write fails with EACCES). So ``prepare``
    runs again once the scope exists, when the parent cannot go away under it.
    """
    base = parent / SCOPE_PARENT
    for _attempt in range(5):
        try:
            base.mkdir(exist_ok=True)
            remove_debris(base)
            prepare(base)
            scope = base / name
            scope.mkdir()
        except FileNotFoundError:
            continue
        except CeilingError:
            if base.exists():
                raise
            continue
        except FileExistsError as exc:
            # mkdir(exist_ok=True) saw ``ouroboros`` exist, then not: removed in between.
            if base.exists():
                raise CeilingError(f"cannot create cgroup {base / name}: {exc}") from exc
            continue
        except OSError as exc:
            raise CeilingError(f"cannot create cgroup {base / name}: {exc}") from exc
        try:
            prepare(base)
        except BaseException:
            remove_scope_dir(scope)
            raise
        return scope
    raise CeilingError(f"cannot create cgroup {base / name}: its parent keeps vanishing")


def remove_debris(base: Path) -> None:
    """rmdir the scopes of workers that died without closing them.

    A scope is debris when its creator's pid is not alive and nothing runs in it (bwrap
    dies with its parent, the worker). Workers that share a cgroup share a pid namespace,
    so a live creator is always visible; a reused pid only makes us leave debris longer.
    """
    for scope in base.iterdir():
        creator = _CREATOR.search(scope.name)
        if not creator or not scope.is_dir() or Path(f"/proc/{creator.group(1)}").exists():
            continue
        if not members([scope / "cgroup.procs"]):
            with suppress(OSError):  # another worker may be removing it too
                scope.rmdir()


def remove_scope_dir(directory: Path) -> None:
    """rmdir the scope, then its ``ouroboros`` parent if no other scope lives there."""
    try:
        directory.rmdir()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise CeilingError(f"cannot remove cgroup {directory}: {exc}") from exc
    with suppress(OSError):  # busy while sibling scopes exist: theirs to remove
        directory.parent.rmdir()


def members(procs_files: Iterable[Path]) -> set[int]:
    """Pids listed in the given cgroup.procs files (a removed cgroup lists none)."""
    found: set[int] = set()
    for path in procs_files:
        with suppress(FileNotFoundError):
            found.update(int(pid) for pid in path.read_text().split())
    return found


def empty_scope(procs_files: list[Path], strike: Callable[[set[int]], None]) -> None:
    """Call ``strike`` with the scope's pids until it lists none."""
    deadline = time.monotonic() + KILL_TIMEOUT_SECONDS
    while pids := members(procs_files):
        if time.monotonic() > deadline:
            raise CeilingError(f"scope {procs_files[0].parent} still holds pids {sorted(pids)}")
        strike(pids)
        time.sleep(0.01)


def sigkill_members(procs_files: list[Path]) -> Callable[[set[int]], None]:
    """A strike for empty_scope that SIGKILLs listed pids through pidfds.

    A pidfd pins the process it was opened for; re-reading the membership after opening
    proves that this very process is in the scope, so a pid that exited and was reused
    by a host process meanwhile is never signalled.
    """

    def strike(pids: set[int]) -> None:
        handles: dict[int, int] = {}
        try:
            for pid in pids:
                with suppress(ProcessLookupError):
                    handles[pid] = os.pidfd_open(pid)
            confirmed = members(procs_files)
            for pid, handle in handles.items():
                if pid in confirmed:
                    with suppress(ProcessLookupError):
                        signal.pidfd_send_signal(handle, signal.SIGKILL)
        finally:
            for handle in handles.values():
                os.close(handle)

    return strike


def joined_cpu_nsec(cpu_nsec: int, scope: Path) -> int:
    """The scope's CPU time, which is zero only if the process never joined it.

    A failure to join is a host fault: it must not be recorded as the organism's death.
    """
    if cpu_nsec == 0:
        raise CeilingError(f"no process ever ran in {scope}: the sandbox could not join it")
    return cpu_nsec


def cgroupfs_result(oom_kills: int, cause: KillCause | None) -> str:
    """The cgroup drivers' word for how a scope's life ended (they never see the exit status).

    ``oom-kill``: the memory ceiling killed a process of it (this wins: the kill it
    caused may have ended the life in any way); ``timeout``: the worker ended it at
    its wall time; ``killed``: the worker ended it for overflowing its result stream;
    ``exited``: its process ended by itself, whatever its status (the sweep that
    follows, which may find the exiting process still listed, is not a kill).
    """
    if oom_kills:
        return "oom-kill"
    return KILL_RESULTS[cause] if cause else "exited"


def read_int(path: Path) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError) as exc:
        raise CeilingError(f"cannot read a figure from {path}: {exc}") from exc


def read_keyed(path: Path, key: str) -> int:
    """The value of ``key`` in a flat-keyed cgroup file such as memory.events or cpu.stat."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError) as exc:
        raise CeilingError(f"cannot read {key} from {path}: {exc}") from exc
    raise CeilingError(f"{path} has no {key} line")


def write_value(path: Path, value: str | int) -> None:
    try:
        path.write_text(f"{value}\n")
    except OSError as exc:
        raise CeilingError(f"cannot write {value!r} to {path}: {exc}") from exc
