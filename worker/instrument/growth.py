"""What a generation adds to the shared repository, counted against its footprint budgets.

Owns the count: a generation's growth is the objects of its published tree that the
repository does not hold yet (each distinct object once: the files' contents, the
symlinks' targets, and every directory below the root as a tree object, hashed as git
would write it), each counted as the most it can take on disk as a loose object,
the way git first writes it: zlib's ``compressBound`` of the object (its
``blob SIZE\\0`` header and its bytes), rounded up to a whole BLOCK_BYTES block of
the file system. So incompressible data counts about its size and many small files
count a block each, as they take; compressible text counts more than it takes, a
margin on the safe side. The organism's objects are counted before any is written,
so a generation over budget stores none of them.

Trees count because one file at the end of a chain of unique directories makes a
tree per directory: a hostile review put 250 MB of tree objects into the repository
while blobs alone counted 4 KiB. The root tree is the kernel's (it holds the journal,
new every generation) and is not counted, like the journal and the commit.

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

import hashlib
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


def _blob(entry: TreeEntry, root: Path) -> tuple[str, int]:
    if entry.kind == "symlink":
        target = (entry.target or "").encode()
        return str(pygit2.hash(target)), len(target)
    return str(pygit2.hashfile(str(root / entry.path))), entry.size


def tree_objects(decoded: list[TreeEntry], root: Path) -> Iterator[tuple[str, int]]:
    """Every object (sha, size) of a tree decoded under ``root`` but its root tree: the
    blobs, then each directory's tree, deepest first, hashed as git writes them."""
    folders: dict[str, dict[bytes, tuple[bytes, bytes]]] = {}
    for entry in decoded:
        sha, size = _blob(entry, root)
        yield sha, size
        mode = (
            b"120000" if entry.kind == "symlink" else b"100755" if entry.executable else b"100644"
        )
        *parents, name = entry.path.split("/")
        folders.setdefault("/".join(parents), {})[name.encode()] = (mode, bytes.fromhex(sha))
        for depth in range(len(parents)):
            folders.setdefault("/".join(parents[:depth]), {})
            folders.setdefault("/".join(parents[: depth + 1]), {})
    for folder in sorted(folders, key=lambda f: -f.count("/") if f else 1):
        if not folder:
            continue
        body = _tree_body(folders[folder])
        sha = hashlib.sha1(b"tree %d\0" % len(body) + body).hexdigest()
        *parents, name = folder.split("/")
        folders["/".join(parents)][name.encode()] = (b"40000", bytes.fromhex(sha))
        yield sha, len(body)


def _tree_body(entries: dict[bytes, tuple[bytes, bytes]]) -> bytes:
    """A tree object's content: its entries in git's order (a directory sorts as if its
    name ended in '/')."""
    order = sorted(entries, key=lambda n: n + b"/" if entries[n][0] == b"40000" else n)
    return b"".join(entries[n][0] + b" " + n + b"\0" + entries[n][1] for n in order)


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
