"""Which commit the instrument's source is: asked of git, or written into a built package.

Owns the two questions asked of git about a folder (is it the top of a checkout, at
which commit, with uncommitted tracked changes or not) and the small file a build
writes into the ``worker`` package (``BUILD_FILE``), so that an installed wheel knows
the commit it was built from. Only a folder that is the top of its own checkout
counts: a package installed in a virtualenv that happens to live inside some other
repository is not that repository's commit.

Standard library only: ``setup.py`` loads this file by its path at build time, when
none of the package's dependencies is installed. Deciding what to refuse is the
caller's (``fingerprint.instrument_commit`` at run time, ``setup.py`` at build time).

Trusts: git, and the folder or the file it is given.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import NamedTuple

# In the ``worker`` package, not in ``worker/instrument/``: data, not a module, so it
# is outside the fingerprint, and a wheel's fingerprint is its checkout's.
BUILD_FILE = "build-commit.json"


class SourceCommit(NamedTuple):
    """A commit and whether the tree it was read from had uncommitted tracked changes."""

    commit: str
    dirty: bool

    def encode(self) -> str:
        return json.dumps({"commit": self.commit, "dirty": self.dirty}) + "\n"

    @classmethod
    def decode(cls, text: str) -> SourceCommit:
        """The record ``encode`` wrote; ValueError naming what is wrong otherwise."""
        try:
            record = json.loads(text)
            commit, dirty = record["commit"], record["dirty"]
        except (ValueError, TypeError, KeyError) as error:
            raise ValueError(f"not a build commit record ({error})") from None
        if not isinstance(commit, str) or not isinstance(dirty, bool):
            raise ValueError("not a build commit record (commit must be text, dirty a boolean)")
        return cls(commit, dirty)


def read_checkout(root: Path) -> SourceCommit | None:
    """HEAD of the git checkout whose top folder is ``root``; None when it is not one."""
    git = ["git", "-C", str(root)]
    head = subprocess.run(
        [*git, "rev-parse", "--show-toplevel", "HEAD"], capture_output=True, text=True
    )
    lines = head.stdout.splitlines()
    if head.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != root.resolve():
        return None
    status = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        check=True,
    )
    return SourceCommit(lines[1], bool(status.stdout.strip()))
