"""The trusted decoder: from the result tar an organism's sandbox wrote on stdout to the
directory tree the publisher commits.

Owns the reading of that tar, the rules a published tree obeys, and the extraction of
an accepted tree into a fresh destination directory.

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

Names and symlink targets must read as what they are. Control characters (C0, DEL, C1),
invisible formatting characters (Unicode category Cf: the bidi overrides and isolates,
zero-width characters, the soft hyphen, the byte-order mark...) and the line and
paragraph separators are refused, and the reason names the code point: such a name
renders spoofed in the web UI or a terminal, or splits in git's path-per-line plumbing.

The tar reader is written here rather than taken from ``tarfile`` on purpose. On this
interpreter (3.11.7) ``tarfile`` parses pax headers with backtracking regular
expressions whose cost is quadratic in the header (CVE-2024-6232: a few MiB of crafted
header stall a worker for hours), it ends the archive silently at the first damaged
header after the first member (a corrupted result would publish as a smaller tree),
and it ignores whatever follows a lone zero block. The reader below takes the ustar,
GNU and pax framing that GNU tar and Python write (GNU long names and pax path, linkpath
and size records included), is linear in the archive, and rejects every other shape
with a reason.
"""

from __future__ import annotations

import contextlib
import os
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from worker.instrument.names import KERNEL_OWNED, ORGANISM_PATH
from worker.instrument.physics import Physics

_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
_POSIX_MAGIC = b"ustar\x0000"
_GNU_MAGIC = b"ustar  \x00"
# Bytes in one path component (Linux NAME_MAX): a longer one cannot be created.
_NAME_MAX = 255
# Bytes in a path or a symlink target (Linux PATH_MAX less its NUL).
_PATH_MAX = 4095
# Components in a path. Extraction holds one directory descriptor per level, so the
# depth has to be bounded well below the descriptor limit of a worker process.
_DEPTH_MAX = 128
# A pax or GNU long-name header carries at most a path and a link target; anything
# much larger is not a tar writer at work.
_EXTENDED_MAX = 64 * 1024
_WRITE_CHUNK = 1024 * 1024

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
_HIGH_BYTES = bytes(range(128, 256))
_OCTAL = re.compile(rb"[0-7]+")
_DECIMAL = re.compile(rb"[0-9]{1,19}")

# Names git refuses to record (read-cache.c verify_path with core.protectNTFS, on by
# default everywhere, and core.protectHFS, on by default on macOS). `git update-index`
# silently skips such a path, so the decoder must refuse it rather than let the
# published commit differ from the tree the organism wrote.
#
# is_ntfs_dotgit: ".git" or its 8.3 name "git~1", then only dots and spaces up to the
# end of the component or an NTFS stream separator ':' or a '\'.
_DOTGIT_NTFS = r"(?:\.git|git~1)[. ]*"
_NTFS_DOTGIT = re.compile(_DOTGIT_NTFS + r"(?:[:\\].*)?", re.ASCII | re.IGNORECASE | re.DOTALL)
# is_ntfs_dotgitmodules: ".gitmodules", "gitmod~1".."gitmod~4", or a fall-back 8.3
# name of eight characters: a prefix of "gi7eba", "~", a digit 1-9, then digits.
_DOTGITMODULES_NTFS = (
    r"(?:\.gitmodules|gitmod~[1-4]|"
    + "|".join(f"{'gi7eba'[:k]}~[1-9][0-9]{{{6 - k}}}" for k in range(7))
    + r")[. ]*"
)
_NTFS_DOTGITMODULES = re.compile(
    _DOTGITMODULES_NTFS + r"(?::.*)?", re.ASCII | re.IGNORECASE | re.DOTALL
)
# The same two shapes just after any backslash of a component, found in one linear scan:
# matching each backslash's remainder separately costs the square of the component, and
# a name of 255 backslashes, repeated in every component of thousands of paths, stalled
# the decoder for minutes.
_BACKSLASH_NTFS_DOTGIT = re.compile(
    r"\\" + _DOTGIT_NTFS + r"(?:[:\\]|\Z)", re.ASCII | re.IGNORECASE
)
_BACKSLASH_NTFS_DOTGITMODULES = re.compile(
    r"\\" + _DOTGITMODULES_NTFS + r"(?::|\Z)", re.ASCII | re.IGNORECASE
)
# is_ntfs_dotgitattributes: the same shapes for ".gitattributes", "gitatt~1".."gitatt~4"
# and the fall-back 8.3 names with the prefix "gi7d29". git fsck (fsck_tree, then
# fsck_blob) checks the object under such a name, or its HFS+ spelling: a directory
# there (gitattributesBlob), more than ATTR_MAX_FILE_SIZE bytes (gitattributesLarge) or
# a line of ATTR_MAX_LINE_LENGTH bytes or more before the first NUL
# (gitattributesLineLength) is an error. A symlink there is only reported, never refused.
_NTFS_DOTGITATTRIBUTES = re.compile(
    r"(?:\.gitattributes|gitatt~[1-4]|"
    + "|".join(f"{'gi7d29'[:k]}~[1-9][0-9]{{{6 - k}}}" for k in range(7))
    + r")[. ]*(?::.*)?",
    re.ASCII | re.IGNORECASE | re.DOTALL,
)
# attr.h ATTR_MAX_FILE_SIZE and ATTR_MAX_LINE_LENGTH, as fsck_blob applies them.
_ATTR_MAX_FILE_SIZE = 100 * 1024 * 1024
_ATTR_MAX_LINE_LENGTH = 2048
# Invisible formatting characters and the line and paragraph separators: a name holding
# one does not read as what it is. (Control characters, Cc, get a reason of their own.)
_INVISIBLE_CATEGORIES = frozenset({"Cf", "Zl", "Zp"})


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


@dataclass(frozen=True)
class _Header:
    """One member as framed in the archive, long names and pax overrides applied."""

    typeflag: bytes
    name: bytes
    linkname: bytes
    mode: int
    size: int
    data: int  # offset of its data in the archive


@dataclass(frozen=True)
class _Planned:
    parts: tuple[str, ...]
    kind: Literal["file", "symlink"]
    executable: bool
    size: int
    data: int
    target: str | None


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
    planned = _plan(archive, limits)
    root_fd = _open_fresh_directory(dest)
    try:
        _extract(archive, planned, root_fd)
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


# --- the tar reader --------------------------------------------------------------------


def _read_headers(archive: bytes) -> Iterator[_Header]:
    """Yield the members of a ustar, GNU or pax archive; reject any other framing."""
    offset = 0
    pending: dict[str, bytes] = {}  # pax and GNU long-name overrides for the next member
    pending_at = 0
    while True:
        block = archive[offset : offset + _BLOCK]
        if len(block) < _BLOCK:
            raise DecoderRejection(
                f"corrupt archive: truncated at byte {offset}, before the end-of-archive marker"
            )
        if block == _ZERO_BLOCK:
            if pending:
                raise DecoderRejection(
                    f"corrupt archive: extended header at byte {pending_at} "
                    "is followed by no member"
                )
            _check_end(archive, offset)
            return
        typeflag, name, linkname, mode, size = _parse_block(block, offset)
        if typeflag in (b"x", b"L", b"K"):
            if size > _EXTENDED_MAX:
                raise DecoderRejection(
                    f"corrupt archive: extended header at byte {offset} holds {size} bytes "
                    f"(at most {_EXTENDED_MAX})"
                )
            start = _data_start(archive, offset, size)
            payload = archive[start : start + size]
            if not pending:
                pending_at = offset
            if typeflag == b"x":
                pending.update(_parse_pax(payload, offset))
            else:
                # GNU long names are NUL-terminated inside their data.
                pending["path" if typeflag == b"L" else "linkpath"] = payload.split(b"\0")[0]
            offset += _BLOCK + _padded(size)
            continue
        if "size" in pending:
            size = _pax_size(pending["size"], offset)
        data = _data_start(archive, offset, size)
        yield _Header(
            typeflag=typeflag,
            name=pending.get("path", name),
            linkname=pending.get("linkpath", linkname),
            mode=mode,
            size=size,
            data=data,
        )
        pending = {}
        offset += _BLOCK + _padded(size)


def _parse_block(block: bytes, offset: int) -> tuple[bytes, bytes, bytes, int, int]:
    """The type, name, link name, mode and size of one header block."""
    magic = block[257:265]
    if magic not in (_POSIX_MAGIC, _GNU_MAGIC):
        raise DecoderRejection(
            f"corrupt archive: block at byte {offset} is not a ustar, GNU or pax header"
        )
    stored = _number(block[148:156], "checksum", offset)
    # The checksum is the byte sum with its own field read as eight spaces.
    covered = block[:148] + block[156:]
    unsigned = sum(covered) + 8 * 0x20
    if stored != unsigned:
        # Some old writers summed signed bytes, and every reader accepts that too.
        high = len(covered) - len(covered.translate(None, _HIGH_BYTES))
        if stored != unsigned - 256 * high:
            raise DecoderRejection(f"corrupt archive: header at byte {offset} fails its checksum")
    name = _cstring(block[0:100])
    prefix = _cstring(block[345:500]) if magic == _POSIX_MAGIC else b""
    if prefix:
        name = prefix + b"/" + name
    return (
        block[156:157],
        name,
        _cstring(block[157:257]),
        _number(block[100:108], "mode", offset),
        _number(block[124:136], "size", offset),
    )


def _number(field: bytes, what: str, offset: int) -> int:
    if field[0] == 0x80:
        # GNU base-256, used for values too large for the octal digits.
        return int.from_bytes(field[1:], "big")
    digits = _cstring(field).strip(b" ")
    if not digits:
        return 0
    if not _OCTAL.fullmatch(digits):
        raise DecoderRejection(
            f"corrupt archive: header at byte {offset} has an unreadable {what} field"
        )
    return int(digits, 8)


def _parse_pax(payload: bytes, offset: int) -> dict[str, bytes]:
    """The path, linkpath and size records of a pax header ("<len> <key>=<value>\\n")."""
    records: dict[str, bytes] = {}
    position = 0
    while position < len(payload):
        space = payload.find(b" ", position, position + 20)
        length = payload[position:space] if space > position else b""
        if not _DECIMAL.fullmatch(length):
            raise DecoderRejection(f"corrupt archive: malformed pax header at byte {offset}")
        end = position + int(length)
        keyword, equals, value = payload[space + 1 : end - 1].partition(b"=")
        if end > len(payload) or payload[end - 1 : end] != b"\n" or not equals or not keyword:
            raise DecoderRejection(f"corrupt archive: malformed pax header at byte {offset}")
        if keyword.startswith(b"GNU.sparse."):
            raise DecoderRejection(
                f"pax header at byte {offset}: sparse files are not accepted; "
                "only directories, regular files and symlinks are"
            )
        if keyword in (b"path", b"linkpath", b"size"):
            records[keyword.decode()] = value
        position = end
    return records


def _pax_size(value: bytes, offset: int) -> int:
    if not _DECIMAL.fullmatch(value):
        raise DecoderRejection(f"corrupt archive: unreadable pax size for the member at {offset}")
    return int(value)


def _data_start(archive: bytes, offset: int, size: int) -> int:
    """Where the data of the header at ``offset`` starts, once it is known to be whole."""
    start = offset + _BLOCK
    if start + size > len(archive):
        raise DecoderRejection(
            f"corrupt archive: truncated inside the data of the member at byte {offset}"
        )
    return start


def _check_end(archive: bytes, offset: int) -> None:
    """An archive ends with two zero blocks, then nothing but zero padding."""
    if len(archive) - offset < 2 * _BLOCK:
        raise DecoderRejection(
            f"corrupt archive: truncated at byte {offset}, inside the end-of-archive marker"
        )
    if archive.count(0, offset) != len(archive) - offset:
        raise DecoderRejection(
            f"corrupt archive: data follows the end-of-archive marker at byte {offset}"
        )


def _cstring(field: bytes) -> bytes:
    return field.split(b"\0", 1)[0]


def _padded(size: int) -> int:
    return -(-size // _BLOCK) * _BLOCK


# --- the publication rules -------------------------------------------------------------


class _Broken(Exception):
    """A rule one member breaks; _plan adds the member's name."""


def _plan(archive: bytes, limits: DecodeLimits) -> list[_Planned]:
    """Every member checked against every rule; the files and symlinks to write."""
    # What each path is: declared by a member, or a directory implied by a deeper one.
    kinds: dict[tuple[str, ...], str] = {(): "dir"}
    declared: set[tuple[str, ...]] = set()
    planned: list[_Planned] = []
    total_bytes = 0
    for header in _read_headers(archive):
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
                if _is_gitattributes(item.parts[-1]):
                    _check_gitattributes(archive, item.data, item.size)
        except _Broken as broken:
            raise DecoderRejection(f"member {_show(header.name)}: {broken}") from None
        planned.append(item)
    _check_body(planned, kinds)
    return planned


def _check_body(planned: list[_Planned], kinds: dict[tuple[str, ...], str]) -> None:
    """organism.el, which the next life loads, must be a regular file at the root."""
    body = next((item for item in planned if item.parts == (ORGANISM_PATH,)), None)
    if body is None:
        # Only a directory (declared, or implied by a deeper member) is neither planned
        # nor absent: every other type was refused member by member.
        what = "a directory" if (ORGANISM_PATH,) in kinds else "missing"
    elif body.target is None:
        return
    else:
        what = f"a symlink to {_show(body.target.encode())}"
    raise DecoderRejection(
        f"{ORGANISM_PATH} is {what}: a result must hold the body the next life loads "
        "as a regular file"
    )


def _admit(
    header: _Header, kinds: dict[tuple[str, ...], str], declared: set[tuple[str, ...]]
) -> _Planned | None:
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
    attributes = next((part for part in parts[:-1] if _is_gitattributes(part)), None)
    if attributes is not None:
        raise _Broken(
            f"lies under a directory {attributes!r}, a name git reads as .gitattributes: "
            "git fsck refuses a .gitattributes that is not a file (gitattributesBlob)"
        )
    if _is_gitmodules(parts):
        # git fsck refuses submodule URLs an organism could write there, and a mirror or
        # shared repository that checks objects would then refuse the lineage's pushes.
        raise _Broken("a .gitmodules (or a name git treats so) cannot be committed")
    if kind == "file":
        return _Planned(
            parts=parts,
            kind="file",
            executable=bool(header.mode & 0o100),
            size=header.size,
            data=header.data,
            target=None,
        )
    target = _utf8(header.linkname, "the symlink target")
    _check_target(target)
    return _Planned(
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
    _check_legible(name, "the name")
    if name.startswith("/"):
        raise _Broken("absolute path")
    if len(name.encode()) > _PATH_MAX:
        raise _Broken(f"path longer than {_PATH_MAX} bytes")
    parts = name.split("/")
    if kind == "dir" and len(parts) > 1 and parts[-1] == "":
        parts.pop()  # ustar writes directory names with a trailing slash
    if parts[0] == ".":
        parts.pop(0)  # "./x" from `tar -C dir .`; "." or "./" alone is the root itself
    if not parts and kind != "dir":
        raise _Broken("only a directory may name the archive root")
    for part in parts:
        if part == "":
            raise _Broken("empty path component (a doubled or trailing slash)")
        if part in (".", ".."):
            raise _Broken(f"{part!r} path component")
        if len(part.encode()) > _NAME_MAX:
            raise _Broken(f"path component longer than {_NAME_MAX} bytes")
        if _is_dotgit(part):
            if _is_whole_dotgit(part):
                raise _Broken(f"{part!r} is, or is treated by git as, a .git directory")
            raise _Broken(
                f"{part!r} holds a .git after a backslash, a separator on Windows: "
                "git fsck refuses it (hasDotgit)"
            )
    if len(parts) > _DEPTH_MAX:
        raise _Broken(f"more than {_DEPTH_MAX} path components")
    if parts and parts[0] in KERNEL_OWNED:
        raise _Broken(f"{parts[0]!r} is kernel-owned; the kernel writes it, never the organism")
    return tuple(parts)


def _check_target(target: str) -> None:
    """A target is stored verbatim, absolute or climbing; it only has to be storable."""
    if not target:
        raise _Broken("empty symlink target")
    if "\0" in target:
        raise _Broken("NUL in the symlink target")
    # git log -p and the web UI show a target as text, to a person.
    _check_legible(target, "the symlink target")
    if len(target.encode()) > _PATH_MAX:
        raise _Broken(f"symlink target longer than {_PATH_MAX} bytes")


def _check_legible(text: str, what: str) -> None:
    """Refuse a control, invisible formatting or separator character, naming it."""
    if text.isprintable():
        return  # the common case; every refused character is unprintable
    for ch in text:
        category = unicodedata.category(ch)
        if category == "Cc":
            raise _Broken(f"control character in {what}")
        if category in _INVISIBLE_CATEGORIES:
            raise _Broken(f"U+{ord(ch):04X} {unicodedata.name(ch)} in {what}")


def _is_dotgit(part: str) -> bool:
    """.git as git reads it (is_hfs_dotgit, is_ntfs_dotgit), also after any backslash:
    git fsck (fsck_tree) checks what follows each '\\', a separator on Windows."""
    return _is_whole_dotgit(part) or _BACKSLASH_NTFS_DOTGIT.search(part) is not None


def _is_whole_dotgit(part: str) -> bool:
    """The component itself is .git as git reads it (is_hfs_dotgit, is_ntfs_dotgit)."""
    return _hfs_folded(part) == ".git" or _NTFS_DOTGIT.fullmatch(part) is not None


def _is_gitmodules(parts: tuple[str, ...]) -> bool:
    """git's own spellings of ".gitmodules" (is_hfs_dotgitmodules, is_ntfs_dotgitmodules)
    as any component, file or directory, and the NTFS ones after any backslash of one."""
    return any(
        _hfs_folded(part) == ".gitmodules"
        or _NTFS_DOTGITMODULES.fullmatch(part) is not None
        or _BACKSLASH_NTFS_DOTGITMODULES.search(part) is not None
        for part in parts
    )


def _is_gitattributes(part: str) -> bool:
    """A component git fsck reads as .gitattributes (is_hfs_dotgitattributes,
    is_ntfs_dotgitattributes). fsck_tree checks no backslash segment for this one."""
    return (
        _hfs_folded(part) == ".gitattributes" or _NTFS_DOTGITATTRIBUTES.fullmatch(part) is not None
    )


def _check_gitattributes(archive: bytes, start: int, size: int) -> None:
    """fsck_blob's rules for a .gitattributes file (the ``size`` bytes at ``start``):
    the size, then each line up to the first NUL (git scans the blob as a C string,
    with strchrnul for each '\\n').

    Linear in the file with few Python steps: a line of ATTR_MAX_LINE_LENGTH bytes or
    more covers one of the offsets ``start + k * ATTR_MAX_LINE_LENGTH``, so only the
    bytes around each of those are searched. (Splitting the file into lines took
    seconds and a gigabyte for 100 MiB of newlines.)
    """
    if size > _ATTR_MAX_FILE_SIZE:
        raise _Broken(
            f"a .gitattributes (or a name git reads so) of more than {_ATTR_MAX_FILE_SIZE} "
            "bytes: git fsck refuses it (gitattributesLarge)"
        )
    end = archive.find(b"\0", start, start + size)
    if end < 0:
        end = start + size
    longest = _ATTR_MAX_LINE_LENGTH
    for mark in range(start, end, longest):
        before = archive.rfind(b"\n", max(start, mark - longest), mark)
        after = archive.find(b"\n", mark, min(end, mark + longest))
        line_start = before + 1 if before >= 0 else max(start, mark - longest)
        line_end = after if after >= 0 else min(end, mark + longest)
        if line_end - line_start >= longest:
            raise _Broken(
                f"a .gitattributes (or a name git reads so) with a line of "
                f"{_ATTR_MAX_LINE_LENGTH} bytes or more: git fsck refuses it "
                "(gitattributesLineLength)"
            )


def _hfs_folded(part: str) -> str:
    """The name as HFS+ compares it, as far as git's needles (plain ASCII) need.

    HFS+ also ignores some zero-width and bidi code points (git's next_hfs_char), but
    they are all Cf, so a name holding one never gets here: _check_legible refused it.
    """
    return part.lower() if part.isascii() else part


def _utf8(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _Broken(f"{what} is not valid UTF-8") from None


def _show(raw: bytes) -> str:
    """A member name for a one-line message: quoted, escaped, and cut when huge."""
    try:
        shown = repr(raw.decode("utf-8"))
    except UnicodeDecodeError:
        shown = repr(raw)
    return shown if len(shown) <= 160 else shown[:150] + "...(cut)"


# --- extraction ------------------------------------------------------------------------


def _open_fresh_directory(dest: Path) -> int:
    with contextlib.suppress(FileExistsError):
        os.mkdir(dest, 0o755)  # an existing dest must be an empty directory, checked below
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    if os.listdir(fd):
        os.close(fd)
        raise ValueError(f"{dest} is not empty; the decoder writes only into a fresh directory")
    return fd


def _extract(archive: bytes, planned: list[_Planned], root_fd: int) -> None:
    """Write the planned entries, each relative to a descriptor of its parent directory.

    Entries go in component order, so everything under one directory is contiguous:
    each directory is created once, fresh, by this function, and is left for good when
    the walk moves past it. Nothing that existed before is ever entered or opened.
    """
    chain: list[tuple[str, int]] = []  # the open directories from dest to the current one
    try:
        with memoryview(archive) as view:
            for item in sorted(planned, key=lambda planned_item: planned_item.parts):
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


def _write_file(parent_fd: int, item: _Planned, content: memoryview) -> None:
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
