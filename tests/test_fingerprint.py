"""The trust boundary is a folder: what changes the instrument fingerprint, and what must not.

The fingerprint is computed in a fresh interpreter over a copy of the package, so
each test can edit files freely: a plumbing default (a lease) leaves it alone, an
edit anywhere under ``worker/instrument/`` (a comment, a new file) changes it, and
the instrument's modules never import the plumbing.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from support.fleet import BYTECODE_CACHE, copy_instrument

from worker.instrument.fingerprint import PACKAGE_ROOT

FINGERPRINT = "from worker.instrument.fingerprint import current; print(current().fingerprint)"


def fingerprint(root: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-c", FINGERPRINT],
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(root),
            "PYTHONPYCACHEPREFIX": BYTECODE_CACHE,
        },
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.full
def test_a_plumbing_setting_change_leaves_the_fingerprint_alone(tmp_path: Path) -> None:
    copy = copy_instrument(PACKAGE_ROOT, tmp_path / "copy")
    before = fingerprint(copy)
    settings = copy / "worker" / "fleet" / "settings.py"
    text = settings.read_text()
    assert "lease_seconds: int = Field(60," in text
    settings.write_text(
        text.replace("lease_seconds: int = Field(60,", "lease_seconds: int = Field(61,")
    )
    (copy / "worker" / "fleet" / "planner.py").open("a").write("\n# a queueing fix\n")
    assert fingerprint(copy) == before


@pytest.mark.full
def test_an_edit_anywhere_in_the_instrument_folder_changes_the_fingerprint(
    tmp_path: Path,
) -> None:
    copy = copy_instrument(PACKAGE_ROOT, tmp_path / "copy")
    before = fingerprint(copy)
    with (copy / "worker" / "instrument" / "names.py").open("a") as names:
        names.write("\n# a comment is bytes too\n")
    commented = fingerprint(copy)
    assert commented != before
    # A module nobody imports still counts: it is fingerprinted by being in the folder.
    (copy / "worker" / "instrument" / "ceilings" / "newcomer.py").write_text('"""New."""\n')
    assert fingerprint(copy) not in (before, commented)


def test_the_instrument_never_imports_the_fleet() -> None:
    offenders = []
    for path in sorted((PACKAGE_ROOT / "worker" / "instrument").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [
                f"{path.relative_to(PACKAGE_ROOT)}: {name}"
                for name in names
                if name == "worker.fleet" or name.startswith(("worker.fleet.", "scheduler"))
            ]
    assert not offenders, offenders
