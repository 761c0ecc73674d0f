"""The result tar's framing: from an organism's archive to its members, one by one.

Owns reading the ustar, GNU and pax framing that GNU tar and Python write (GNU long
names and pax path, linkpath and size records included): each member's type, name,
link name, mode, size and where its data lies, with long names and pax overrides
applied. It judges framing only; what a member may be or be named is the decoder's
(``decoder``, ``path_rules``).

Trusts nothing in the archive: every byte was written by the organism. The reader is
linear in the archive and refuses, with a reason naming the byte offset, every shape
it does not take.

Written here rather than taken from ``tarfile`` on purpose. On this interpreter
(3.11.7) ``tarfile`` parses pax headers with backtracking regular expressions whose
cost is quadratic in the header (CVE-2024-6232: a few MiB of crafted header stall a
worker for hours), it ends the archive silently at the first damaged header after the
first member (a corrupted result would publish as a smaller tree), and it ignores
whatever follows a lone zero block.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
_POSIX_MAGIC = b"ustar\x0000"
_GNU_MAGIC = b"ustar  \x00"
# A pax or GNU long-name header carries at most a path and a link target; anything
# much larger is not a tar writer at work.
_EXTENDED_MAX = 64 * 1024
_HIGH_BYTES = bytes(range(128, 256))
_OCTAL = re.compile(rb"[0-7]+")
_DECIMAL = re.compile(rb"[0-9]{1,19}")


class ArchiveRefused(Exception):
    """The archive's framing is corrupt or of a shape the reader does not take.

    ``str(exc)`` is one line naming the byte offset and what is wrong there.
    """


@dataclass(frozen=True)
class TarMember:
    """One member as framed in the archive, long names and pax overrides applied."""

    typeflag: bytes
    name: bytes
    linkname: bytes
    mode: int
    size: int
    data: int  # offset of its data in the archive


def read_members(archive: bytes) -> Iterator[TarMember]:
    """Yield the members of a ustar, GNU or pax archive; reject any other framing."""
    offset = 0
    pending: dict[str, bytes] = {}  # pax and GNU long-name overrides for the next member
    pending_at = 0
    while True:
        block = archive[offset : offset + _BLOCK]
        if len(block) < _BLOCK:
            raise ArchiveRefused(
                f"corrupt archive: truncated at byte {offset}, before the end-of-archive marker"
            )
        if block == _ZERO_BLOCK:
            if pending:
                raise ArchiveRefused(
                    f"corrupt archive: extended header at byte {pending_at} "
                    "is followed by no member"
                )
            _check_end(archive, offset)
            return
        typeflag, name, linkname, mode, size = _parse_block(block, offset)
        if typeflag in (b"x", b"L", b"K"):
            if size > _EXTENDED_MAX:
                raise ArchiveRefused(
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
        yield TarMember(
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
        raise ArchiveRefused(
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
            raise ArchiveRefused(f"corrupt archive: header at byte {offset} fails its checksum")
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
        raise ArchiveRefused(
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
            raise ArchiveRefused(f"corrupt archive: malformed pax header at byte {offset}")
        end = position + int(length)
        keyword, equals, value = payload[space + 1 : end - 1].partition(b"=")
        if end > len(payload) or payload[end - 1 : end] != b"\n" or not equals or not keyword:
            raise ArchiveRefused(f"corrupt archive: malformed pax header at byte {offset}")
        if keyword.startswith(b"GNU.sparse."):
            raise ArchiveRefused(
                f"pax header at byte {offset}: sparse files are not accepted; "
                "only directories, regular files and symlinks are"
            )
        if keyword in (b"path", b"linkpath", b"size"):
            records[keyword.decode()] = value
        position = end
    return records


def _pax_size(value: bytes, offset: int) -> int:
    if not _DECIMAL.fullmatch(value):
        raise ArchiveRefused(f"corrupt archive: unreadable pax size for the member at {offset}")
    return int(value)


def _data_start(archive: bytes, offset: int, size: int) -> int:
    """Where the data of the header at ``offset`` starts, once it is known to be whole."""
    start = offset + _BLOCK
    if start + size > len(archive):
        raise ArchiveRefused(
            f"corrupt archive: truncated inside the data of the member at byte {offset}"
        )
    return start


def _check_end(archive: bytes, offset: int) -> None:
    """An archive ends with two zero blocks, then nothing but zero padding."""
    if len(archive) - offset < 2 * _BLOCK:
        raise ArchiveRefused(
            f"corrupt archive: truncated at byte {offset}, inside the end-of-archive marker"
        )
    if archive.count(0, offset) != len(archive) - offset:
        raise ArchiveRefused(
            f"corrupt archive: data follows the end-of-archive marker at byte {offset}"
        )


def _cstring(field: bytes) -> bytes:
    return field.split(b"\0", 1)[0]


def _padded(size: int) -> int:
    return -(-size // _BLOCK) * _BLOCK
