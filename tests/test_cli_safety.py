"""The CLI never corrupts the shared repository, never answers with a traceback, leaves
no daemon behind and creates no store by accident (issue 23, findings 5, 6 and 9).

Every command runs as a user runs it (``python -m scheduler`` in a fleet home of its
own, ``lineage_support.Fleet``).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from lineage_support import SMALL_PHYSICS, Fleet


def refs(fleet: Fleet) -> list[str]:
    """Every file under the repository's refs and every packed ref: what git would read."""
    loose = [p.relative_to(fleet.repo).as_posix() for p in (fleet.repo / "refs").rglob("*")]
    packed = fleet.repo / "packed-refs"
    return sorted(loose + (packed.read_text().splitlines() if packed.exists() else []))


def one_line_refusal(result: subprocess.CompletedProcess[str], status: int = 2) -> str:
    """The single stderr line of a refusal with ``status`` and no traceback."""
    assert result.returncode == status, result.stderr + result.stdout
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """``path`` and everything under it immutable (chattr +i), read-only to root too."""
    subprocess.run(["chattr", "-R", "+i", str(path)], check=True)
    try:
        yield
    finally:
        subprocess.run(["chattr", "-R", "-i", str(path)], check=True)


@pytest.mark.parametrize("name", ["a..b", "a.", "a.lock", "@{x", "a/b", "a b", "A"])
def test_a_name_git_refuses_is_refused_at_once_and_writes_no_ref(tmp_path: Path, name: str) -> None:
    fleet = Fleet(tmp_path)
    fleet.ok("init", "good", *SMALL_PHYSICS)
    before = refs(fleet)

    line = one_line_refusal(fleet.cli("init", name, *SMALL_PHYSICS, timeout=20))

    assert line.startswith(f"error: invalid lineage name {name!r}")
    assert refs(fleet) == before
    fork = fleet.cli("fork", name, "--from", "good", timeout=20)
    assert one_line_refusal(fork).startswith(f"error: invalid lineage name {name!r}")
    assert refs(fleet) == before
    assert fleet.git("for-each-ref", "--format=%(refname)") == "refs/heads/lineage-good\n"


def test_status_and_every_view_skip_a_foreign_broken_ref_with_a_warning(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.ok("init", "good", *SMALL_PHYSICS)
    heads = fleet.repo / "refs" / "heads"
    head = (heads / "lineage-good").read_text()
    # What another tool could leave: a name git refuses, content that is no object id,
    # and an id of an object the repository does not hold.
    (heads / "lineage-a..b").write_text(head)
    (heads / "lineage-garbage").write_text("not a commit\n")
    (heads / "lineage-missing").write_text("12" * 20 + "\n")

    table = fleet.ok("status")
    assert "good" in table.stdout and "missing" not in table.stdout
    for ref in ("lineage-a..b", "lineage-garbage", "lineage-missing"):
        assert f"refs/heads/{ref}" in table.stderr
    assert "Traceback" not in table.stderr
    assert all(line.startswith("warning: ") for line in table.stderr.splitlines())

    rows = json.loads(fleet.ok("status", "--json").stdout)
    assert [row["lineage"] for row in rows] == ["good"]
    journal = fleet.ok("journal", "good")
    assert "seed" in journal.stdout and "refs/heads/lineage-missing" in journal.stderr
    fleet.ok("observations", "good")
