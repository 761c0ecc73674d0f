"""Result archives built in memory with ``tarfile``, member by member, for the decoder's
tests (``test_decoder``, ``test_decoder_git_parity``, ``test_hostile_decoder_parity``);
``LIMITS`` are the decoder limits they decode under."""

from __future__ import annotations

import io
import tarfile

from worker.instrument.decoder import DecodeLimits

LIMITS = DecodeLimits(max_bytes=1024 * 1024, max_files=100)


def regular(name: str, data: bytes = b"", mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    return info, data


def directory(name: str) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, 0o755
    return info, b""


def link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, b""


def body(data: bytes = b'(message "alive")\n') -> tuple[tarfile.TarInfo, bytes]:
    """The organism.el every published tree must hold as a regular file."""
    return regular("organism.el", data)


def build(*members: tuple[tarfile.TarInfo, bytes], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buffer = io.BytesIO()
    # surrogateescape lets a test name carry raw non-UTF-8 bytes ("\udcff" is 0xff).
    with tarfile.open(
        fileobj=buffer, mode="w", format=fmt, encoding="utf-8", errors="surrogateescape"
    ) as archive:
        for info, data in members:
            archive.addfile(info, io.BytesIO(data) if data else None)
    return buffer.getvalue()
