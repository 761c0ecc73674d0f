"""The trusted decoder: from the result tar an organism's sandbox wrote on stdout to the
directory tree the publisher commits.

Owns the publication rules, member by member and for the tree as a whole: which member
types are accepted, how an archive name becomes a path (the ``./`` prefix, the depth
and length bounds, kernel-owned paths), the limits from the physics, and the body rule
below; then hands the accepted tree to ``extract``. The framing is ``tar_reader``'s; the
rules for each name and symlink target (legibility, git's) are ``path_rules``', shared
with ``import-bundle`` and ``fork``.

Trusts nothing in the archive. Every byte of it was written by the organism, which may
be broken or hostile: names, types, sizes, link targets and the framing itself are
checked before anything is written, a symlink is recreated as a symlink and never
followed, and every file is created relative to a directory descriptor the decoder
made itself, so no archive can make it write outside the destination. It trusts its
caller for the destination (absent or empty, written by nobody else meanwhile) and for
the limits, which come from the lineage's pinned physics.

A published tree must hold ``organism.el`` as a regular file at its root: missing, a
symlink, a directory (empty or not) or any other type is refused, naming what it was.
The next life loads that path as its body, and a tree committed without a loadable one
would make every later life die before its first form, for a reason no organism could
undo. The rule is enforced here, with the other publication rules, and nowhere else:
only the decoder still sees an empty directory or a symlink for what it was.

Names and symlink targets must read as what they are (``path_rules``): control
characters, invisible formatting characters, line and paragraph separators, Unicode's
default-ignorable code points and every space but U+0020 are refused, and the reason
names the code point.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from worker.instrument import path_rules
from worker.instrument.extract import PlannedEntry, extract, open_fresh_directory
from worker.instrument.names import KERNEL_OWNED, ORGANISM_PATH
from worker.instrument.physics import Physics
from worker.instrument.tar_reader import ArchiveRefused, TarMember, read_members

# Components in a path. Extraction holds one directory descriptor per level, so the
# depth has to be bounded well below the descriptor limit of a worker process.
_DEPTH_MAX = 128

_MEMBER_KINDS: dict[bytes, Literal["file", "dir", "symlink"]] = {
    b"0": "file",
    b"\x00": "file",  # pre-POSIX regular file
    b"7": "file",  # contiguous file: a regular file everywhere that matters
    b"5": "dir",
    b"2": "symlink",
}
_REFUSED_TYPES = {
    b"1": "a hard link",
    b"3": "a character device",
    b"4": "a block device",
    b"6": "a FIFO",
    b"S": "a GNU sparse file",
    b"g": "a global pax header",
}


class DecodeLimits(BaseModel):
    """How much a published tree may hold."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_bytes: int = Field(ge=0, description="total bytes of regular files")
    max_files: int = Field(ge=0, description="regular files plus symlinks")

    @classmethod
    def from_physics(cls, physics: Physics) -> DecodeLimits:
        return cls(max_bytes=physics.work_bytes, max_files=physics.work_files)


class TreeEntry(BaseModel):
    """One published path. Directories are implied by the paths under them: git stores
    no empty directory, so an empty one in the archive is dropped, not published."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str  # relative, '/'-separated, without the archive's "./" prefix
    kind: Literal["file", "symlink"]
    executable: bool  # the owner-execute bit of a file, as git records it; False for symlinks
    size: int  # bytes of a file; for a symlink, bytes of its target (the blob git stores)
    target: str | None  # a symlink's target, verbatim and never resolved; None for files


class DecoderRejection(Exception):
    """The archive breaks a publication rule; the generation dies as decoder_rejection.

    ``str(exc)`` and ``reason`` are one line naming the offending member and the rule.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def decode_archive(archive: bytes, dest: Path, limits: DecodeLimits) -> list[TreeEntry]:
    """Check ``archive`` against every publication rule, then write it under ``dest``.

    ``dest`` must be absent (it is created) or an empty directory. Only
    regular files, symlinks and the directories that contain them are written: files
    0644 or 0755 by the owner-execute bit, directories 0755, symlinks with their target
    verbatim. Empty directories are dropped, since git cannot store them. Returns the
    published entries sorted by path.

    Raises DecoderRejection when the archive breaks a rule. The whole archive is checked
    before the first write, but callers must not rely on that: after any exception
    ``dest`` may exist and hold partial content, and the caller discards it.
    """
    planned = plan_archive(archive, limits)
    root_fd = open_fresh_directory(dest)
    try:
        extract(archive, planned, root_fd)
    finally:
        os.close(root_fd)
    entries = [
        TreeEntry(
            path="/".join(item.parts),
            kind=item.kind,
            executable=item.executable,
            size=item.size,
            target=item.target,
        )
        for item in planned
    ]
    return sorted(entries, key=lambda entry: entry.path)


# --- the publication rules-------------------------------------------------------------


class _Broken(Exception):
    """A rule one member breaks; plan_archive adds the member's name."""


def plan_archive(archive: bytes, limits: DecodeLimits) -> list[PlannedEntry]:
    """Every member checked against every rule; the files and symlinks to write.

    Raises DecoderRejection, naming the member and the rule, for the first one broken.
    """
    # What each path is: declared by a member, or a directory implied by a deeper one.
    kinds: dict[tuple[str, ...], str] = {(): "dir"}
    declared: set[tuple[str, ...]] = set()
    planned: list[PlannedEntry] = []
    total_bytes = 0
    for header in _members(archive):
        try:
            item = _admit(header, kinds, declared)
            if item is None:
                continue
            if len(planned) == limits.max_files:
                raise _Broken(
                    f"more than {limits.max_files} files and symlinks (the work_files limit)"
                )
            if item.kind == "file":
                total_bytes += item.size
                if total_bytes > limits.max_bytes:
                    raise _Broken(
                        f"files total more than {limits.max_bytes} bytes (the work_bytes limit)"
                    )
                if path_rules.is_gitattributes(item.parts[-1]):
                    _check(path_rules.gitattributes_problem(archive, item.data, item.size))
        except _Broken as broken:
            raise DecoderRejection(f"member {path_rules.shown(header.name)}: {broken}") from None
        planned.append(item)
    _check_body(planned, kinds)
    return planned


def _check_body(planned: list[PlannedEntry], kinds: dict[tuple[str, ...], str]) -> None:
    """organism.el, which the next life loads, must be a regular file at the root."""
    body = next((item for item in planned if item.parts == (ORGANISM_PATH,)), None)
    if body is None:
        # Only a directory (declared, or implied by a deeper member) is neither planned
        # nor absent: every other type was refused member by member.
        what = "a directory" if (ORGANISM_PATH,) in kinds else "missing"
    elif body.target is None:
        return
    else:
        what = f"a symlink to {path_rules.shown(body.target.encode())}"
    raise DecoderRejection(
        f"{ORGANISM_PATH} is {what}: a result must hold the body the next life loads "
        "as a regular file"
    )


def _admit(
    header: TarMember, kinds: dict[tuple[str, ...], str], declared: set[tuple[str, ...]]
) -> PlannedEntry | None:
    """Check one member and record its path; None for a directory (nothing to write)."""
    kind = _MEMBER_KINDS.get(header.typeflag)
    if kind is None:
        what = _REFUSED_TYPES.get(header.typeflag, f"member type {header.typeflag!r}")
        raise _Broken(f"{what} is not accepted; only directories, regular files and symlinks are")
    if kind != "file" and header.size:
        raise _Broken(f"a {kind} carrying {header.size} data bytes is malformed")
    parts = _path_parts(_utf8(header.name, "the name"), kind)
    for depth in range(1, len(parts)):
        above = kinds.setdefault(parts[:depth], "dir")
        if above != "dir":
            raise _Broken(
                f"lies under {'/'.join(parts[:depth])!r}, which is a {above}; "
                f"nothing is written through a {above}"
            )
    if parts in declared:
        raise _Broken("duplicate member")
    if kinds.get(parts, kind) != kind:
        raise _Broken("earlier members lie under it as a directory")
    kinds[parts] = kind
    declared.add(parts)
    if kind == "dir":
        return None  # an empty one is dropped; one holding a member is checked with it
    attributes = next((part for part in parts[:-1] if path_rules.is_gitattributes(part)), None)
    if attributes is not None:
        raise _Broken(
            f"lies under a directory {attributes!r}, a name git reads as .gitattributes: "
            "git fsck refuses a .gitattributes that is not a file (gitattributesBlob)"
        )
    for part in parts:
        _check(path_rules.gitmodules_problem(part))
    if kind == "file":
        return PlannedEntry(
            parts=parts,
            kind="file",
            executable=bool(header.mode & 0o100),
            size=header.size,
            data=header.data,
            target=None,
        )
    _check(path_rules.target_problem(header.linkname))
    target = header.linkname.decode()
    return PlannedEntry(
        parts=parts,
        kind="symlink",
        executable=False,
        size=len(target.encode()),
        data=header.data,
        target=target,
    )


def _path_parts(name: str, kind: str) -> tuple[str, ...]:
    """The components of ``name`` below the archive root, once it obeys every path rule."""
    if not name:
        raise _Broken("empty name")
    if "\0" in name:
        raise _Broken("NUL in the name")
    # Git's path-per-line interfaces would split a name at a newline (and drop a trailing
    # CR), so such a name could make the kernel read a host path.
    _check(path_rules.legibility_problem(name, "the name"))
    if name.startswith("/"):
        raise _Broken("absolute path")
    if len(name.encode()) > path_rules.PATH_MAX:
        raise _Broken(f"path longer than {path_rules.PATH_MAX} bytes")
    parts = name.split("/")
    if kind == "dir" and len(parts) > 1 and parts[-1] == "":
        parts.pop()  # ustar writes directory names with a trailing slash
    if parts[0] == ".":
        parts.pop(0)  # "./x" from `tar -C dir .`; "." or "./" alone is the root itself
    if not parts and kind != "dir":
        raise _Broken("only a directory may name the archive root")
    for part in parts:
        _check(path_rules.component_problem(part))
    if len(parts) > _DEPTH_MAX:
        raise _Broken(f"more than {_DEPTH_MAX} path components")
    if parts and parts[0] in KERNEL_OWNED:
        raise _Broken(f"{parts[0]!r} is kernel-owned; the kernel writes it, never the organism")
    return tuple(parts)


def _check(problem: str | None) -> None:
    if problem is not None:
        raise _Broken(problem)


def _members(archive: bytes) -> Iterator[TarMember]:
    """The archive's members, a framing refusal as a DecoderRejection."""
    try:
        yield from read_members(archive)
    except ArchiveRefused as refused:
        raise DecoderRejection(str(refused)) from None


def _utf8(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _Broken(f"{what} is not valid UTF-8") from None
