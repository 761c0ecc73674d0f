"""Writing an accepted tree: the decoder's planned entries, from the archive's bytes into
a fresh directory.

Owns the one way a result reaches the disk: every file is created relative to a
directory descriptor this module made itself, fresh, so nothing that existed before is
ever entered or opened and no archive can make it write outside the destination; a
symlink is recreated as a symlink and never followed; modes are 0644 or 0755 by the
owner-execute bit, directories 0755, whatever the worker's umask.

Trusts its caller (the decoder) to have checked every entry against the publication
rules, and for the destination: absent or empty, written by nobody else meanwhile.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

_WRITE_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class PlannedEntry:
    """One checked file or symlink to write: its path components and where its data lies."""

    parts: tuple[str, ...]
    kind: Literal["file", "symlink"]
    executable: bool
    size: int
    data: int  # offset of a file's data in the archive
    target: str | None


def open_fresh_directory(dest: Path) -> int:
    with contextlib.suppress(FileExistsError):
        os.mkdir(dest, 0o755)  # an existing dest must be an empty directory, checked below
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    if os.listdir(fd):
        os.close(fd)
        raise ValueError(f"{dest} is not empty; the decoder writes only into a fresh directory")
    return fd


def extract(archive: bytes, planned: list[PlannedEntry], root_fd: int) -> None:
    """Write the planned entries, each relative to a descriptor of its parent directory.

    Entries go in component order, so everything under one directory is contiguous:
    each directory is created once, fresh, by this function, and is left for good when
    the walk moves past it. Nothing that existed before is ever entered or opened.
    """
    chain: list[tuple[str, int]] = []  # the open directories from dest to the current one
    try:
        with memoryview(archive) as view:
            for item in sorted(planned, key=lambda entry: entry.parts):
                parents = item.parts[:-1]
                shared = 0
                while (
                    shared < min(len(chain), len(parents)) and chain[shared][0] == parents[shared]
                ):
                    shared += 1
                while len(chain) > shared:
                    os.close(chain.pop()[1])
                for name in parents[shared:]:
                    chain.append((name, _make_directory(chain[-1][1] if chain else root_fd, name)))
                parent_fd = chain[-1][1] if chain else root_fd
                if item.target is not None:
                    # symlink(2) never follows the new link and fails if the name exists.
                    os.symlink(item.target, item.parts[-1], dir_fd=parent_fd)
                else:
                    _write_file(parent_fd, item, view[item.data : item.data + item.size])
    finally:
        for _, fd in chain:
            os.close(fd)


def _make_directory(parent_fd: int, name: str) -> int:
    os.mkdir(name, 0o700, dir_fd=parent_fd)
    # O_NOFOLLOW: even if something swapped the new directory for a symlink, the walk
    # would fail here rather than continue outside dest.
    fd = os.open(
        name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd
    )
    os.fchmod(fd, 0o755)
    return fd


def _write_file(parent_fd: int, item: PlannedEntry, content: memoryview) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(item.parts[-1], flags, 0o600, dir_fd=parent_fd)
    try:
        while content:
            written = os.write(fd, content[:_WRITE_CHUNK])
            content = content[written:]
        # fchmod, not the open mode: the result must not depend on the worker's umask.
        os.fchmod(fd, 0o755 if item.executable else 0o644)
    finally:
        os.close(fd)
