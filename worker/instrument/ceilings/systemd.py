"""The systemd driver: one transient ``systemd-run --user`` service per scope.

Owns the unit's properties (``CPUQuota``, ``MemoryMax``, ``MemorySwapMax``, ``TasksMax``,
``RuntimeMaxSec``, ``KillMode=control-group``), how the sandbox's argv reaches the unit
unexpanded, how the sandbox's stdio reaches the worker (``--pipe``: the service
inherits the worker's pipes, so the result tar stays a bounded pipe the worker reads,
never a file on the host), and the figures read back: the manager's own properties
(``systemctl --user show``) where it has them, else the unit's own cgroup files.

Works with systemd 252 and later (Debian 12 and RHEL 9 ship 252). Two things differ
across those versions, and neither is left to the version number:

* ``systemd-run --expand-environment=no`` exists only from 254. The manager expands
  ``$NAME`` and ``${NAME}`` in a unit's command line, so every ``$`` of the argv is
  written ``$$``, the unit syntax's literal dollar, on every version. Nothing else of
  the argv is interpreted: systemd-run sends it to the manager as a list of strings
  (specifiers are expanded only in unit files, never in a transient unit's argv), and
  the one word it looks at, the executable, is the absolute path of ``env``.
* ``MemoryPeak`` and ``OOMKills`` are unit properties only in newer managers (neither
  is in 252 or 254), and a unit's cgroup is removed as soon as it stops. So an
  ``ExecStopPost=`` collector, run by the manager in the unit's own cgroup after its
  processes ended (by themselves, by the OOM killer or by a kill), copies
  ``memory.peak``, ``memory.events`` and ``cpu.stat`` of that cgroup, with the result
  the manager hands it (``$SERVICE_RESULT``), into a private file of the worker. A
  figure the manager reports is taken from the manager; any other from that file;
  ``sources`` says which, per figure.

Trusts the user manager that answers on this host, and the collector it runs as the
worker's own uid outside the sandbox (the organism never sees the file or its
directory). The service's own environment comes from that manager, so the command is
wrapped in ``env -i`` to hand bwrap only PATH.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from worker.instrument.ceilings.base import (
    KILL_RESULTS,
    Ceiling,
    CeilingError,
    Enclosure,
    Figures,
    KillCause,
    scope_name,
)
from worker.instrument.physics import Physics

# The oldest manager this driver supports (Debian 12, RHEL 9): it needs neither
# --expand-environment (254) nor the MemoryPeak/OOMKills properties (255+). So far it
# has run against the stand-ins in tests/support/standins/ only, not a booted manager.
MIN_VERSION = 252
SHOWN = ("Result", "CPUUsageNSec", "MemoryPeak", "OOMKills")
_QUERY_TIMEOUT_SECONDS = 30
_UNSET = {"", "[not set]", "infinity", str(2**64 - 1)}
# Runs as the ExecStopPost= of every unit, in the unit's cgroup, after its processes
# ended; $1 is the file to write. Its own few milliseconds of CPU are in cpu.stat,
# which the manager's CPUUsageNSec (preferred when reported) leaves out.
COLLECTOR = """\
PATH=/usr/bin:/bin
cgroup=$(sed -n 's/^0:://p' /proc/self/cgroup)
{
  echo "cgroup $cgroup"
  echo "service_result ${SERVICE_RESULT:-}"
  for file in memory.peak memory.events cpu.stat; do
    if [ -r "/sys/fs/cgroup$cgroup/$file" ]; then
      sed "s|^|$file |" "/sys/fs/cgroup$cgroup/$file"
    fi
  done
} >"$1.part" && mv "$1.part" "$1"
"""
# A path the unit's -p ExecStopPost= line carries verbatim (no quoting, $ or %).
_PLAIN_PATH = re.compile(r"^/[A-Za-z0-9_./-]+$")


def unit_argv(argv: list[str]) -> list[str]:
    """``argv`` written so that the manager's command-line expansion gives it back verbatim.

    The manager replaces ``$NAME`` and ``${NAME}`` (and splits an unbraced ``$NAME``
    that stands alone into words); ``$$`` is its literal ``$``.
    """
    return [word.replace("$", "$$") for word in argv]


def _systemd_size(value: int) -> str:
    """Bytes in systemd's notation, exact: 1073741824 -> 1G, 0 -> 0."""
    for suffix, unit in (("T", 1024**4), ("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if value and value % unit == 0:
            return f"{value // unit}{suffix}"
    return str(value)


def _percent(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".")


class SystemdEnclosure(Enclosure):
    def __init__(self, ceiling: SystemdCeiling, physics: Physics, unit: str) -> None:
        self._ceiling = ceiling
        self._physics = physics
        self.unit = unit
        self._cause: KillCause | None = None
        self._closed = False
        # Private to the worker's uid: the collector writes the unit's figures here.
        self.figures_dir = Path(tempfile.mkdtemp(prefix="ouroboros-unit-"))
        self._collector = self.figures_dir / "collect.sh"
        self._collector.write_text(COLLECTOR)
        self.figures_file = self.figures_dir / "figures"
        if not _PLAIN_PATH.match(str(self.figures_dir)):
            self._remove_figures_dir()
            raise CeilingError(f"{self.figures_dir} cannot be written on a unit's command line")

    def command(self, argv: list[str]) -> list[str]:
        physics = self._physics
        properties = [
            f"CPUQuota={_percent(physics.cpu_quota_percent)}%",
            f"MemoryMax={_systemd_size(physics.memory_max_bytes)}",
            f"MemorySwapMax={_systemd_size(physics.memory_swap_max_bytes)}",
            f"TasksMax={physics.tasks_max}",
            f"RuntimeMaxSec={physics.wall_seconds}",
            "KillMode=control-group",
            # The unit's process is the manager's child, not the worker's: the manager
            # gives it the fresh session keyring (worker.instrument.keyring) the worker
            # gives its own children; a user manager's default would share its own.
            "KeyringMode=private",
            # The manager's own stop (RuntimeMaxSec, or the main process killed below)
            # ends whatever the life left in the cgroup at once: a hostile organism
            # cannot hold its unit up by ignoring SIGTERM.
            "KillSignal=SIGKILL",
            f"ExecStopPost=/bin/sh {self._collector} {self.figures_file}",
        ]
        return [
            *self._ceiling.client_prefix(),
            self._ceiling.systemd_run,
            "--user",
            f"--unit={self.unit}",
            "--wait",
            "--pipe",
            "--quiet",
            *(item for p in properties for item in ("-p", p)),
            "--",
            *unit_argv([self._ceiling.env, "-i", "PATH=/usr/bin:/bin", *argv]),
        ]

    def kill(self, cause: KillCause | None = None) -> None:
        if self._cause is not None:
            # The first cause stands, and the main process already had its SIGKILL.
            return
        self._cause = cause
        # Only the main process: the manager then stops the unit, SIGKILLs the rest of
        # its cgroup (KillSignal=) and runs the ExecStopPost= collector. A SIGKILL to the
        # whole unit would also land on that collector whenever the manager's own
        # RuntimeMaxSec (the same wall time) had fired first, and the life would have
        # no peak memory or OOM count (seen on systemd 254 with five lives at once).
        self._ceiling.systemctl("kill", "--kill-whom=main", "--signal=SIGKILL", self.unit)

    def figures(self) -> Figures:
        shown = self._ceiling.systemctl("show", self.unit, "-p", ",".join(SHOWN), check=True)
        manager = dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)
        collected = self._collected()
        cgroup = collected.pop("cgroup", "")
        sources: dict[str, str] = {}

        def figure(name: str, prop: str, file_key: str, scale: int = 1) -> int | None:
            value = manager.get(prop)
            if value is not None and value not in _UNSET:
                sources[name] = f"systemd:{prop}"
                return int(value)
            if file_key in collected:
                sources[name] = f"cgroup2:{file_key} of the unit's cgroup {cgroup}"
                try:
                    return int(collected[file_key]) * scale
                except ValueError as exc:
                    raise CeilingError(f"{self.figures_file}: {file_key} is not a number") from exc
            reported = "not set" if value is not None else "not reported by this systemd"
            sources[name] = f"systemd:{prop} {reported}, and no cgroup2:{file_key}"
            return None

        cpu = figure("cpu_usage_nsec", "CPUUsageNSec", "cpu.stat usage_usec", 1000)
        peak = figure("memory_peak_bytes", "MemoryPeak", "memory.peak")
        oom_kills = figure("oom_kills", "OOMKills", "memory.events oom_kill")
        result = collected.get("service_result") or manager.get("Result") or "unknown"
        sources["result"] = (
            "systemd:$SERVICE_RESULT at ExecStopPost"
            if collected.get("service_result")
            else "systemd:Result"
        )
        # An OOM kill wins, as in cgroupfs_result: the kill it caused may have ended the life.
        if self._cause and result != "oom-kill" and not oom_kills:
            result = KILL_RESULTS[self._cause]
            sources["result"] = "the worker's kill (wall time or result overflow)"
        return Figures(
            driver="systemd",
            result=result,
            cpu_usage_nsec=cpu,
            memory_peak_bytes=peak,
            oom_kills=oom_kills or 0,
            sources=sources,
        )

    def _collected(self) -> dict[str, str]:
        """The collector's file as ``{"memory.events oom_kill": "1", ...}``; empty if none.

        A unit that never started (the manager refused it) has no collector run.
        """
        try:
            text = self.figures_file.read_text()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise CeilingError(f"cannot read {self.figures_file}: {exc}") from exc
        found: dict[str, str] = {}
        for line in text.splitlines():
            match line.split():
                case ["cgroup" | "service_result" as key, *rest]:
                    found[key] = " ".join(rest)
                case ["memory.peak", value]:
                    found["memory.peak"] = value
                case [file, key, value]:
                    found[f"{file} {key}"] = value
        cgroup = found.get("cgroup", "")
        if cgroup and not cgroup.endswith(f"/{self.unit}"):
            raise CeilingError(f"the collector of {self.unit} ran in another cgroup, {cgroup}")
        return found

    def close(self) -> None:
        if self._closed:
            return
        # Either may find the unit already gone; that is the state close() wants.
        self._ceiling.systemctl("stop", self.unit)
        self._ceiling.systemctl("reset-failed", self.unit)
        self._remove_figures_dir()
        self._closed = True

    def _remove_figures_dir(self) -> None:
        shutil.rmtree(self.figures_dir, ignore_errors=True)


class SystemdCeiling(Ceiling):
    """Transient user services, driven by the systemd-run and systemctl found on PATH."""

    name = "systemd"

    def __init__(self) -> None:
        self.systemd_run = shutil.which("systemd-run") or ""
        self._systemctl = shutil.which("systemctl") or ""
        self.env = shutil.which("env", path="/usr/bin:/bin") or "/usr/bin/env"

    def client_prefix(self) -> list[str]:
        """``env NAME=value...`` giving the client the user bus, and nothing else, to talk to.

        The sandbox is started with an environment holding only PATH, which is not enough
        for ``systemd-run --user`` to find the user manager.
        """
        runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}"
        bus = os.environ.get("DBUS_SESSION_BUS_ADDRESS")
        return [
            self.env,
            f"XDG_RUNTIME_DIR={runtime}",
            *([f"DBUS_SESSION_BUS_ADDRESS={bus}"] if bus else []),
        ]

    def systemctl(self, *args: str, check: bool = False) -> str:
        command = [*self.client_prefix(), self._systemctl, "--user", "--no-pager", *args]
        try:
            done = subprocess.run(
                command,
                capture_output=True,
                text=True,
                timeout=_QUERY_TIMEOUT_SECONDS,
                env={"PATH": "/usr/bin:/bin"},
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise CeilingError(f"systemctl --user {' '.join(args)}: {exc}") from exc
        if check and done.returncode != 0:
            raise CeilingError(
                f"systemctl --user {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}"
            )
        return done.stdout

    def unavailable_reason(self) -> str | None:
        if not self.systemd_run or not self._systemctl:
            return "systemd-run or systemctl is not on PATH"
        try:
            self.systemctl("show", "--property=Version", check=True)
            version = subprocess.run(
                [self.systemd_run, "--version"],
                capture_output=True,
                text=True,
                timeout=_QUERY_TIMEOUT_SECONDS,
                check=True,
            ).stdout
        except (CeilingError, OSError, subprocess.SubprocessError) as exc:
            return f"no systemd user manager answers ({exc})"
        match = re.match(r"systemd (\d+)", version)
        if not match or int(match.group(1)) < MIN_VERSION:
            found = match.group(1) if match else "unknown"
            return f"systemd-run is version {found}; this driver needs {MIN_VERSION}+"
        return None

    def open(self, physics: Physics, label: str) -> SystemdEnclosure:
        # systemd-run creates the unit when command() runs; nothing exists before that.
        return SystemdEnclosure(self, physics, f"ouroboros-{scope_name(label)}.service")
