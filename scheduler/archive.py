"""The lineage archive: its format, writing one, and unpacking one that may be hostile.

Owns the archive ``schedule-lineage export`` writes and ``verify`` and ``import``
read: a gzip-compressed tar of regular files with fixed names and nothing else::

    manifest.json                 schema, lineage, head, generation count, the numbered
                                  generations without an observation, and the sha256
                                  of every other member
    lineage.bundle                the branch lineage-NAME as a git bundle, at ``head``
    metadata.json                 the lineage's metadata object
    generations/000001.json ...   every observation, byte for byte as stored
    runs/<run-id>.json ...        every run record

Reading treats the archive as hostile: a member that is not a regular file (a
symlink, a hard link, a directory, a device), whose name is not one of the names
above (so no absolute path, no ``..``, nothing outside the unpacking directory), a
name given twice, more members or bytes than the bounds below, an extended header
(pax, GNU long name) over 64 KiB, which tarfile would read whole, or anything but a
gzip tar is refused with one line before any of it is used. The archive is read
twice: first to check and sum every member, writing nothing (the manifest is held in
memory), then to write only the members whose sum the manifest lists, so a gzip bomb
is refused having written nothing, and a member that matches its sum stops at the
free-space reserve. Members are written only under names this module computes, in a
private directory, without following links. The manifest is validated with pydantic.
Nothing here runs git: the bundle is only bytes until ``scheduler.verify`` opens it in a
scratch repository.

Trusts: nothing in the archive.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Final, Literal, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from worker.instrument.errors import Refusal
from worker.instrument.fields import LineageName
from worker.instrument.names import COMMIT_PATTERN

T = TypeVar("T")

SCHEMA: Final = "ouroboros-lineage-archive/v1"
MANIFEST = "manifest.json"
BUNDLE = "lineage.bundle"
METADATA = "metadata.json"
GENERATIONS = "generations/"
RUNS = "runs/"
SUFFIX = ".ouroboros.tar.gz"

# Bounds on what one archive may hold. An observation carries at most 1 MiB of stderr
# and 32 MiB of audited model text plus its figures; a run record and the metadata
# are a few hundred bytes.
MAX_MEMBERS = 2_000_100
MAX_JSON_BYTES = 64 * 1024**2
MAX_MANIFEST_BYTES = 256 * 1024**2
MAX_BUNDLE_BYTES = 16 * 1024**3
MAX_TOTAL_BYTES = 64 * 1024**3
_CHUNK = 1024 * 1024
# The bounds above are far larger than the disk under a scratch directory may be. A
# member is written only once the manifest vouches for its sum, and even then writing
# stops, refused, while this much of the scratch filesystem is still free (5% of it, as
# docs/design.md states, and never less than 16 MiB), so no archive fills the disk other
# processes write to.
FREE_SHARE = 0.05
MIN_FREE_BYTES = 16 * 1024**2

# tarfile reads an extended header (pax, GNU long name) whole, before the member it
# describes can be judged; an export's members need a few hundred bytes of one at most.
MAX_EXTENDED_HEADER_BYTES = 64 * 1024
_EXTENDED_HEADERS = frozenset(
    {tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE}
    | {tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK}
)

_GENERATION_MEMBER = re.compile(r"^generations/([0-9]{6,9})\.json$")
_RUN_MEMBER = re.compile(r"^runs/([A-Za-z0-9][A-Za-z0-9_.-]{0,127})\.json$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def generation_member(generation: int) -> str:
    return f"{GENERATIONS}{generation:06d}.json"


def run_member(run_id: str) -> str:
    return f"{RUNS}{run_id}.json"


def is_member_name(name: str) -> bool:
    """Whether ``name`` is one an export writes (and so the only kind read)."""
    return (
        name in (MANIFEST, BUNDLE, METADATA)
        or _GENERATION_MEMBER.fullmatch(name) is not None
        or _RUN_MEMBER.fullmatch(name) is not None
    )


def generation_of(name: str) -> int | None:
    """N for ``generations/00000N.json``; None for every other member."""
    match = _GENERATION_MEMBER.fullmatch(name)
    return int(match.group(1)) if match else None


def _limit(name: str) -> int:
    if name == BUNDLE:
        return MAX_BUNDLE_BYTES
    return MAX_MANIFEST_BYTES if name == MANIFEST else MAX_JSON_BYTES


class Manifest(BaseModel):
    """What the archive says it holds; every member but itself is listed with its sha256."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    schema_name: Literal["ouroboros-lineage-archive/v1"] = Field(SCHEMA, alias="schema")
    lineage: LineageName
    head: str = Field(pattern=COMMIT_PATTERN)
    generations: int = Field(ge=0, le=999_999_999)
    # Numbered generations the exporting store held no observation of (still pending, or
    # lost): declared, so that an observation missing from the archive is told from one
    # that never was.
    unobserved: list[int] = Field(max_length=MAX_MEMBERS)
    exported_at: datetime
    exported_by: str = Field(max_length=200)
    files: dict[str, str] = Field(max_length=MAX_MEMBERS)

    @field_validator("files")
    @classmethod
    def _files(cls, files: dict[str, str]) -> dict[str, str]:
        for name, digest in files.items():
            if name == MANIFEST or not is_member_name(name):
                raise ValueError(f"{name!r} is not a member an archive can list")
            if not _SHA256.fullmatch(digest):
                raise ValueError(f"{name}: {digest!r} is not a sha256")
        return files

    def to_json(self) -> bytes:
        return (self.model_dump_json(by_alias=True, indent=2) + "\n").encode()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_archive(target: Path, manifest: Manifest, members: dict[str, Path]) -> None:
    """Write the archive to ``target``, which must not exist (it is never replaced).

    The manifest comes first; every member is a regular file owned by nobody in
    particular, dated ``exported_at``, so two exports of one state differ only there.
    """
    when = int(manifest.exported_at.timestamp())
    fd, staged_name = tempfile.mkstemp(prefix=".export-", dir=target.parent)
    staged = Path(staged_name)
    try:
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
            _add(tar, MANIFEST, io.BytesIO(manifest.to_json()), len(manifest.to_json()), when)
            for name in sorted(members, key=_order):
                path = members[name]
                with path.open("rb") as handle:
                    _add(tar, name, handle, path.stat().st_size, when)
        with staged.open("rb") as written:
            os.fsync(written.fileno())
        try:
            # link() creates the name only if nothing holds it: an archive is never replaced.
            os.link(staged, target)
        except FileExistsError:
            raise Refusal(f"{target} exists; choose another --to FILE") from None
    finally:
        staged.unlink(missing_ok=True)


def _order(name: str) -> tuple[int, str]:
    return ([BUNDLE, METADATA].index(name) if name in (BUNDLE, METADATA) else 2, name)


def _add(tar: tarfile.TarFile, name: str, data: io.IOBase, size: int, when: int) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, when, 0o644
    tar.addfile(info, data)


class _BoundedTarInfo(tarfile.TarInfo):
    """A header that refuses an extended header over the bound before it is read.

    ``tarinfo=`` is tarfile's own extension point; this is ``TarInfo.fromtarfile``
    with the one check added between reading a header block and processing it.
    """

    @classmethod
    def fromtarfile(cls, tar: tarfile.TarFile) -> Self:
        buf = tar.fileobj.read(tarfile.BLOCKSIZE)
        info = cls.frombuf(buf, tar.encoding, tar.errors)
        if info.type in _EXTENDED_HEADERS and info.size > MAX_EXTENDED_HEADER_BYTES:
            raise tarfile.HeaderError(
                f"an extended header of {info.size} bytes, over {MAX_EXTENDED_HEADER_BYTES}"
            )
        info.offset = tar.fileobj.tell() - tarfile.BLOCKSIZE
        # TarInfo._proc_member is the private step tarfile runs here; typeshed omits it.
        return info._proc_member(tar)  # type: ignore[attr-defined, no-any-return]


@dataclass(frozen=True)
class Unpacked:
    """An archive read in two passes: its manifest, the sum of every member, and the
    members written to a private directory (only those whose sum the manifest lists)."""

    directory: Path
    manifest: bytes | None  # held in memory, never written
    sums: dict[str, str]  # member name -> sha256, of every member but the manifest
    members: dict[str, Path]  # member name -> file, for each member its manifest vouches for

    def read(self, name: str) -> bytes | None:
        if name == MANIFEST:
            return self.manifest
        path = self.members.get(name)
        return path.read_bytes() if path is not None else None


@dataclass
class _Survey:
    """What the first pass found: the manifest's bytes, and each member's sum and size."""

    manifest: bytes | None = None
    sums: dict[str, str] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)


def unpack(archive: Path, into: Path) -> Unpacked:
    """``archive`` checked, then the members its manifest vouches for written into
    ``into`` (empty, private); a Refusal if it is hostile.

    Two passes over the archive, so that nothing is written before the manifest's sums
    are checked: the first reads every member without writing any (framing, names,
    types, bounds, and the sha256 of each; the manifest kept in memory), the second
    writes only the members whose sum the manifest lists, hashing them again as they
    are written (an archive changed between the passes is refused). A gzip bomb thus
    costs the reading of it, not the disk; a member that matches its sum and is still
    too large for the scratch filesystem is refused by the free-space reserve.
    """
    survey = _read(archive, lambda tar: _survey(archive, tar))
    vouched = _vouched(survey)
    members: dict[str, Path] = {}
    if vouched:
        _read(archive, lambda tar: _write(archive, tar, into, survey, vouched, members))
    return Unpacked(into, survey.manifest, survey.sums, members)


def _read(archive: Path, step: Callable[[tarfile.TarFile], T]) -> T:
    """``step`` over the archive opened as a stream of members; a Refusal if unreadable."""
    try:
        handle = archive.open("rb")
    except OSError as exc:
        raise Refusal(
            f"cannot read {archive}: {exc.strerror}; pass an archive made by export"
        ) from None
    with handle:
        try:
            # Stream mode: members are read once, in order, and no index of them is kept.
            with tarfile.open(fileobj=handle, mode="r|gz", tarinfo=_BoundedTarInfo) as tar:
                return step(tar)
        except (tarfile.TarError, EOFError, OSError, UnicodeDecodeError) as exc:
            raise Refusal(
                f"{archive} is not a readable lineage archive ({type(exc).__name__}: {exc}); "
                "pass an archive made by schedule-lineage export"
            ) from None


def _survey(archive: Path, tar: tarfile.TarFile) -> _Survey:
    """The first pass: every member checked and summed, nothing written."""
    survey = _Survey()
    total = 0
    for member in tar:
        name = _admit(archive, member, survey.sizes)
        digest = hashlib.sha256()
        kept = bytearray() if name == MANIFEST else None
        size = 0
        for chunk in _chunks(tar, member):
            size += len(chunk)
            if size > _limit(name):
                raise Refusal(f"{archive}: member {name} is over {_limit(name)} bytes")
            digest.update(chunk)
            if kept is not None:
                kept += chunk
        survey.sizes[name] = size
        if kept is not None:
            survey.manifest = bytes(kept)
        else:
            survey.sums[name] = digest.hexdigest()
        total += size
        if len(survey.sizes) > MAX_MEMBERS or total > MAX_TOTAL_BYTES:
            raise Refusal(
                f"{archive} holds more than {MAX_MEMBERS} members or "
                f"{MAX_TOTAL_BYTES} bytes; it is not an archive export makes"
            )
    return survey


def _vouched(survey: _Survey) -> set[str]:
    """The members whose sum the manifest lists; none without a valid manifest."""
    if survey.manifest is None:
        return set()
    try:
        listed = Manifest.model_validate_json(survey.manifest).files
    except ValidationError:
        return set()
    return {name for name, digest in survey.sums.items() if listed.get(name) == digest}


def _write(
    archive: Path,
    tar: tarfile.TarFile,
    into: Path,
    survey: _Survey,
    vouched: set[str],
    members: dict[str, Path],
) -> None:
    """The second pass: the vouched members written, each hashed again as it is."""
    for member in tar:
        name = member.name
        if name not in vouched:
            continue
        if name in members:
            raise _changed(archive)
        target = into / name
        target.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        digest = hashlib.sha256()
        written = 0
        with os.fdopen(fd, "wb") as out:
            for chunk in _chunks(tar, member):
                written += len(chunk)
                if written > survey.sizes[name]:
                    raise _changed(archive)
                _keep_free(archive, name, into, out.fileno(), len(chunk))
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != survey.sums[name]:
            raise _changed(archive)
        members[name] = target
    if members.keys() != vouched:
        raise _changed(archive)


def _changed(archive: Path) -> Refusal:
    return Refusal(f"{archive} changed while it was read; pass an archive nothing writes to")


def _admit(archive: Path, member: tarfile.TarInfo, seen: dict[str, int]) -> str:
    """The member's name, once it is a regular file of a name an export writes, given
    once, within its size bound."""
    name = member.name
    if not member.isreg():
        raise Refusal(f"{archive}: member {name!r} is not a regular file; refusing the archive")
    if not is_member_name(name):
        raise Refusal(
            f"{archive}: member {name!r} is not a name an export writes; refusing the archive"
        )
    if name in seen:
        raise Refusal(f"{archive}: member {name!r} appears twice; refusing the archive")
    if member.size > _limit(name):
        raise Refusal(f"{archive}: member {name} has {member.size} bytes, over {_limit(name)}")
    return name


def _chunks(tar: tarfile.TarFile, member: tarfile.TarInfo) -> Iterator[bytes]:
    source = tar.extractfile(member)
    assert source is not None  # a regular file always has data
    while chunk := source.read(_CHUNK):
        yield chunk


def reserve_bytes(filesystem_bytes: int) -> int:
    """What unpacking leaves free on a scratch filesystem of this size."""
    return max(int(filesystem_bytes * FREE_SHARE), MIN_FREE_BYTES)


def _keep_free(archive: Path, name: str, into: Path, fd: int, size: int) -> None:
    """Refuse before writing ``size`` more bytes would eat into the scratch reserve."""
    fs = os.fstatvfs(fd)
    reserve = reserve_bytes(fs.f_blocks * fs.f_frsize)
    free = fs.f_bavail * fs.f_frsize
    if free - size < reserve:
        raise Refusal(
            f"{archive}: unpacking member {name} would leave less than {reserve} bytes "
            f"free on the filesystem of {into} ({free} free); free some room or point TMPDIR "
            "at a larger filesystem"
        )


def digests(paths: Iterable[tuple[str, Path]]) -> dict[str, str]:
    return {name: sha256_file(path) for name, path in paths}
