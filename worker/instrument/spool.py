"""The publication spool: durable checkpoints between a finished life and its records.

Owns the local directory of pending publications. Before a commit is pushed, its
publication (lineage, parent, commit, observation) is written here atomically
(temp file, fsync, rename, fsync of the directory); each later step rewrites the
entry's stage; the entry is removed only when the commit is on the shared branch
(or provably never will be) and the observation is stored. A worker restarted after
a crash at any point, or an object store that was down, finishes the work from
here: no committed generation or observation is lost, and a result whose push lost
the compare-and-swap is discarded, never published. The temp file of a save killed
mid-write is swept by the next drain once it is a minute old.

Trusts: the local filesystem it owns (``<state>/spool``).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

Stage = Literal["push", "observe"]
# A save takes milliseconds; a temp file this old was left by a process killed mid-save.
# Removing it cannot lose a generation: a save comes before the push, and a writer that
# somehow still held it would fail its rename and publish nothing.
ORPHAN_SECONDS = 60.0
TEMP_PREFIX = ".pending-"


class Publication(BaseModel):
    """One generation's pending records, exactly as they will be published."""

    model_config = ConfigDict(extra="forbid")

    lineage: str
    generation: int
    parent: str
    commit: str
    stage: Stage
    observation_key: str
    observation: str  # the observation's JSON, byte-for-byte what will be stored


class Spool:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, publication: Publication) -> Path:
        return (
            self.root
            / f"{publication.lineage}.{publication.generation:06d}.{publication.commit}.json"
        )

    def save(self, publication: Publication) -> None:
        target = self._path(publication)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=TEMP_PREFIX)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(publication.model_dump_json().encode())
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._sync_dir()

    def remove(self, publication: Publication) -> None:
        self._path(publication).unlink(missing_ok=True)
        self._sync_dir()

    def pending(self, lineage: str | None = None) -> list[Publication]:
        """Entries in generation order, optionally of one lineage."""
        pattern = f"{lineage}.*.json" if lineage else "*.json"
        entries = []
        for path in sorted(self.root.glob(pattern)):
            if path.name.startswith("."):
                continue
            try:
                entries.append(Publication.model_validate_json(path.read_bytes()))
            except FileNotFoundError:
                continue  # finished by another process of this worker meanwhile
        return [entry for entry in entries if lineage is None or entry.lineage == lineage]

    def sweep_orphans(self, now: float | None = None) -> int:
        """Remove the temp files of saves killed mid-write; how many were removed."""
        cutoff = (time.time() if now is None else now) - ORPHAN_SECONDS
        removed = 0
        for path in self.root.glob(f"{TEMP_PREFIX}*"):
            with contextlib.suppress(FileNotFoundError):
                found = path.lstat()
                # A save leaves a file; a directory here is not one (unlink would raise
                # at every drain, and no publication of this host would land again).
                if found.st_mtime < cutoff and not stat.S_ISDIR(found.st_mode):
                    path.unlink()
                    removed += 1
        return removed

    def _sync_dir(self) -> None:
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
