"""The chaos soak, short: ``bench/soak.py`` on a small fleet, every fault kind, invariants only.

Its three lineages are spread over three shared repositories (``--homes 3``), one each:
each branch must be in its home and no other, as well as every invariant below.

The soak starts its own fleet (private Redis with AOF, moto behind a switchable proxy,
real workers, ``reconcile --loop``), alternates a fault-free and a chaos round, and
exits 1 if any invariant fails: a generation lost or doubled, an extra or mismatched
observation, an index or ``status`` disagreeing with git, a spool entry, a process
or cgroup left behind. Its timing targets are printed, never asserted here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.soak,
    pytest.mark.bwrap,
    pytest.mark.cgroups,
    pytest.mark.root,
    # A chaos soak of a private fleet: minutes of lives, kills and restarts by design.
    pytest.mark.timeout(1800),
]

SOAK = Path(__file__).resolve().parent.parent / "bench" / "soak.py"
SHORT = [
    "--lineages", "3",
    "--generations", "16",
    "--rounds", "2",
    "--workers", "2",
    "--concurrency", "1",
    "--every", "0.5:1.5",
    "--outage", "5",
    "--lease", "6",
    "--reconcile", "1",
    "--homes", "3",
]  # fmt: skip


def test_a_short_soak_keeps_every_invariant() -> None:
    result = subprocess.run(
        [sys.executable, str(SOAK), *SHORT], capture_output=True, text=True, timeout=1700
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    assert "invariants: all hold" in result.stdout, report
    assert "chaos" in result.stdout
    assert "homes: default 1, h1 1, h2 1" in result.stdout, report
