"""Choosing the aggregate resource scope a worker runs every sandbox under.

Owns the driver order for ``auto`` (systemd, then cgroup2, then cgroup1), the preflight
(a probe scope opened, run, read and removed before any generation) and the refusal
when no driver works. There is no unbounded fallback: a worker without a working
scope runs nothing.

Trusts each driver's own ``unavailable_reason`` and probe; a driver that says it is
available but fails the probe is treated as unavailable with the probe's error.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from worker.instrument.ceilings.base import Ceiling, CeilingError, Enclosure, Figures
from worker.instrument.ceilings.cgroup1 import Cgroup1Ceiling
from worker.instrument.ceilings.cgroup2 import Cgroup2Ceiling
from worker.instrument.ceilings.systemd import SystemdCeiling
from worker.instrument.errors import Refusal
from worker.instrument.physics import Physics

__all__ = ["Ceiling", "CeilingError", "Enclosure", "Figures", "select_ceiling"]

DRIVERS: dict[str, type[Ceiling]] = {
    "systemd": SystemdCeiling,
    "cgroup2": Cgroup2Ceiling,
    "cgroup1": Cgroup1Ceiling,
}
_PROBE_TIMEOUT_SECONDS = 60
_ADVICE = (
    "run the worker where a systemd user manager answers (systemd 252+), or as root with"
    " writable cgroupfs (v2 delegating cpu, memory and pids, or v1 cpu, cpuacct, memory and"
    " pids), or choose a working driver with --ceiling systemd|cgroup2|cgroup1"
)


def select_ceiling(name: str = "auto", cgroup_parent: Path | None = None) -> Ceiling:
    """The first driver (``auto``) or the named one that passes the preflight; else Refusal.

    ``cgroup_parent`` is a prepared v2 cgroup (controllers enabled, no processes) to put
    scopes under, for hosts where the worker's own cgroup cannot delegate: systemd
    services (a v2 cgroup may not both hold processes and delegate). A container's
    own cgroup namespace needs none: the cgroup2 driver prepares its root itself.
    """
    if name != "auto" and name not in DRIVERS:
        raise Refusal(f"unknown ceiling {name!r}; choose auto, {', '.join(DRIVERS)}")
    candidates = list(DRIVERS) if name == "auto" else [name]
    reasons: list[str] = []
    for candidate in candidates:
        ceiling = Cgroup2Ceiling(cgroup_parent) if candidate == "cgroup2" else DRIVERS[candidate]()
        reason = ceiling.unavailable_reason() or _probe(ceiling)
        if reason is None:
            return ceiling
        reasons.append(f"{candidate}: {' '.join(reason.split())}")
    raise Refusal(
        f"the aggregate resource scope cannot be set up ({'; '.join(reasons)}); {_ADVICE};"
        " there is no unbounded fallback"
    )


def _probe(ceiling: Ceiling) -> str | None:
    """Open a scope, run /bin/true inside it, read its figures, remove it; None if all worked."""
    try:
        with ceiling.open(Physics(), f"probe-{os.getpid()}") as enclosure:
            done = subprocess.run(
                enclosure.command(["/bin/true"]),
                capture_output=True,
                text=True,
                timeout=_PROBE_TIMEOUT_SECONDS,
                env={"PATH": "/usr/bin:/bin"},
            )
            if done.returncode != 0:
                return f"probe scope exited {done.returncode}: {done.stderr[:300] or 'no message'}"
            enclosure.figures()
    except (CeilingError, OSError, subprocess.SubprocessError) as exc:
        return f"probe scope failed: {exc}"
    return None
