"""The systemd driver: one transient ``systemd-run --user`` service per scope.

Owns the unit's properties (``CPUQuota``, ``MemoryMax``, ``MemorySwapMax``, ``TasksMax``,
``RuntimeMaxSec``, ``KillMode=control-group``), how the sandbox's stdio reaches the
worker (``--pipe``: the service inherits the worker's pipes, so the result tar stays a
bounded pipe the worker reads, never a file on the host), and the figures read back
with ``systemctl --user show``.

Trusts the user manager that answers on this host. The service's own environment comes
from that manager, so the command is wrapped in ``env -i`` to hand bwrap only PATH.
``systemd-run --wait`` pins the unit only while it runs: a unit that ended cleanly may
be collected before ``show`` reads it, in which case its figures are recorded as not
reported (a failed unit stays loaded until reset-failed).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from worker.instrument.ceilings.base import Ceiling, CeilingError, Enclosure, Figures, scope_name
from worker.instrument.physics import Physics

# --expand-environment=no first appeared in systemd 254; without it the manager would
# expand "$" in the sandbox's argv.
MIN_VERSION = 254
SHOWN = ("Result", "ExecMainCode", "ExecMainStatus", "CPUUsageNSec", "MemoryPeak", "OOMKills")
_QUERY_TIMEOUT_SECONDS = 30
_UNSET = {"", "[not set]", "infinity", str(2**64 - 1)}


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
        self._closed = False

    def command(self, argv: list[str]) -> list[str]:
        physics = self._physics
        properties = [
            f"CPUQuota={_percent(physics.cpu_quota_percent)}%",
            f"MemoryMax={_systemd_size(physics.memory_max_bytes)}",
            f"MemorySwapMax={_systemd_size(physics.memory_swap_max_bytes)}",
            f"TasksMax={physics.tasks_max}",
            f"RuntimeMaxSec={physics.wall_seconds}",
            "KillMode=control-group",
        ]
        return [
            *self._ceiling.client_prefix(),
            self._ceiling.systemd_run,
            "--user",
            f"--unit={self.unit}",
            "--wait",
            "--pipe",
            "--quiet",
            "--expand-environment=no",
            *(item for p in properties for item in ("-p", p)),
            "--",
            self._ceiling.env,
            "-i",
            "PATH=/usr/bin:/bin",
            *argv,
        ]

    def kill(self) -> None:
        self._ceiling.systemctl("kill", "--signal=SIGKILL", self.unit)

    def figures(self) -> Figures:
        shown = self._ceiling.systemctl("show", self.unit, "-p", ",".join(SHOWN), check=True)
        values = dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)

        def number(key: str) -> int | None:
            value = values.get(key, "")
            return None if value in _UNSET else int(value)

        def source(key: str) -> str:
            value = values.get(key)
            if value is None:
                return f"systemd:{key} not reported by this systemd"
            return f"systemd:{key} not set" if value in _UNSET else f"systemd:{key}"

        return Figures(
            driver="systemd",
            result=values.get("Result") or "unknown",
            cpu_usage_nsec=number("CPUUsageNSec"),
            memory_peak_bytes=number("MemoryPeak"),
            oom_kills=number("OOMKills") or 0,
            sources={
                "result": source("Result"),
                "cpu_usage_nsec": source("CPUUsageNSec"),
                "memory_peak_bytes": source("MemoryPeak"),
                "oom_kills": source("OOMKills"),
            },
        )

    def close(self) -> None:
        if self._closed:
            return
        # Either may find the unit already gone; that is the state close() wants.
        self._ceiling.systemctl("stop", self.unit)
        self._ceiling.systemctl("reset-failed", self.unit)
        self._closed = True


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
            return f"systemd-run is version {found}; --expand-environment=no needs {MIN_VERSION}+"
        return None

    def open(self, physics: Physics, label: str) -> SystemdEnclosure:
        # systemd-run creates the unit when command() runs; nothing exists before that.
        return SystemdEnclosure(self, physics, f"ouroboros-{scope_name(label)}.service")
