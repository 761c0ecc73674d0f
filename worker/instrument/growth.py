"""What a generation adds to the shared repository, counted against its footprint budgets.

Owns the count: a generation's growth is the objects of its published tree that the
repository does not hold yet (each distinct blob once: the files' contents and the
symlinks' targets), each counted as the most it can take on disk as a loose object,
the way git first writes it: zlib's ``compressBound`` of the object (its
``blob SIZE\\0`` header and its bytes), rounded up to a whole BLOCK_BYTES block of
the file system. So incompressible data counts about its size and many small files
count a block each, as they take; compressible text counts more than it takes, a
margin on the safe side. The organism's objects are counted before any is written,
so a generation over budget stores none of them.

A lineage's total is carried in the kernel's own commits: every generation's commit
ends with a ``Repository-Bytes:`` trailer giving the lineage's total after it, and
the next generation reads its parent's (or, past commits without one, such as the
seed, the last one on its first-parent line; none, 0). The kernel's own objects (the
journal blob, the trees and the commit) are not counted: their size is bounded by the
physics' work_files and the journal's fixed words; deploy/README.md adds them to the
disk a fleet needs.

Trusts the repository and the commits on a lineage's branch (the kernel's, or an
operator's); the sizes it counts are the decoded tree's, already checked by the
decoder.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pygit2

if TYPE_CHECKING:
    from worker.instrument.decoder import TreeEntry

BLOCK_BYTES = 4096
TRAILER = "Repository-Bytes"
_TRAILER_LINE = re.compile(rf"^{TRAILER}: ([0-9]{{1,20}})$", re.MULTILINE)


def object_bytes(size: int) -> int:
    """The most a blob of ``size`` bytes takes on disk as a loose object."""
    raw = len(f"blob {size}\0") + size
    # zlib's compressBound: deflate never makes anything longer than this.
    bound = raw + (raw >> 12) + (raw >> 14) + (raw >> 25) + 13
    return -(-bound // BLOCK_BYTES) * BLOCK_BYTES


def tree_blobs(decoded: Iterable[TreeEntry], root: Path) -> Iterator[tuple[str, int]]:
    """The blobs (sha, size) of a tree decoded under ``root``, hashed, never written."""
    for entry in decoded:
        if entry.kind == "file":
            yield str(pygit2.hashfile(str(root / entry.path))), entry.size
        elif entry.kind == "symlink" and entry.target is not None:
            target = entry.target.encode()
            yield str(pygit2.hash(target)), len(target)


def new_bytes(repo: pygit2.Repository, blobs: Iterable[tuple[str, int]]) -> int:
    """The growth of blobs (sha, size) the repository lacks, each distinct one counted once."""
    sizes = dict(blobs)
    return sum(object_bytes(size) for sha, size in sizes.items() if sha not in repo)


def recorded_total(repo: pygit2.Repository, commit: str) -> int:
    """The lineage total recorded at ``commit`` or, failing that, on its first parents."""
    current: pygit2.Commit | None = repo[commit].peel(pygit2.Commit)
    while current is not None:
        found = _TRAILER_LINE.findall(current.raw_message.decode("utf-8", errors="replace"))
        if found:
            return int(found[-1])
        current = repo[current.parent_ids[0]].peel(pygit2.Commit) if current.parent_ids else None
    return 0


def trailer(total: int) -> str:
    """The trailer that records a lineage's total in a generation's commit message."""
    return f"{TRAILER}: {total}"
