"""The observation store: write-once and overwritable objects under relative keys.

Owns the store interface, its local directory backend behind ``file:///abs/path``
(the S3-compatible bucket behind ``s3://bucket/optional/prefix`` is
``worker.instrument.s3store``, imported only when named), the parsing of
``OUROBOROS_OBSERVATIONS``, key validation, and the mapping of every backend failure
to ``StoreUnavailable``. The key layout itself belongs to ``worker.instrument.records``.

Trusts: the settings it is given (endpoint, region, addressing style), the standard
AWS credential chain (read by boto3, never stored, logged or put in a message), and
the store itself to honour an atomic create: ``os.link`` failing with EEXIST on a
local filesystem, ``PutObject`` with ``If-None-Match: *`` answering 412 on S3, MinIO,
Ceph RGW and moto. Keys come from trusted code; they are validated anyway so that a
bug can never address an object outside the store's prefix.
"""

from __future__ import annotations

import os
import re
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from worker.instrument.errors import Refusal

if TYPE_CHECKING:
    from worker.instrument.s3store import S3Config

ACCEPTED_FORMS = "file:///absolute/path or s3://bucket[/prefix]"

# Names starting with a dot are reserved: the file store stages its writes under them
# in the object's own directory, so a key must never be able to name one.
_STAGING_PREFIX = ".staging-"
_FORBIDDEN_KEY_CHARS = re.compile(r"[\\\x00-\x1f\x7f]")
_USERINFO = re.compile(r"//[^/@]*@")
_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


class StoreUnavailable(Exception):
    """The store could not be reached, or answered with an error other than "exists"."""


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key; otherwise raise ValueError."""
    _check_components(key, key.split("/"), "key")
    return key


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is a safe listing prefix ("" lists everything)."""
    if prefix:
        parts = prefix.split("/")
        # A prefix may end in "/" or in part of a name; only whole components it
        # names before that must be proper ones.
        if parts[-1]:
            _check_components(prefix, parts, "prefix")
        else:
            _check_components(prefix, parts[:-1], "prefix")
    return prefix


def _check_components(text: str, parts: list[str], what: str) -> None:
    if _FORBIDDEN_KEY_CHARS.search(text):
        raise ValueError(f"invalid store {what} {text!r}: backslash or control character")
    if text.startswith("/"):
        raise ValueError(f"invalid store {what} {text!r}: must be relative")
    for part in parts:
        if not part:
            raise ValueError(f"invalid store {what} {text!r}: empty path component")
        if part.startswith("."):
            raise ValueError(f"invalid store {what} {text!r}: component {part!r} starts with '.'")


class ObservationStore(ABC):
    """Objects under relative keys. Public methods validate keys, then delegate."""

    url: str

    def put_once(self, key: str, data: bytes) -> bool:
        """Write ``data`` at ``key`` unless something is there already.

        True if this call wrote the object; False if the key already existed, in which
        case nothing was changed. On S3, a write whose response was lost and which the
        client retried reports False although the object is this call's own.
        """
        return self._put_once(check_key(key), data)

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` at ``key``, replacing any previous object atomically."""
        self._put(check_key(key), data)

    def get(self, key: str) -> bytes | None:
        """The object at ``key``, or None when there is none."""
        return self._get(check_key(key))

    @abstractmethod
    def _put_once(self, key: str, data: bytes) -> bool: ...

    @abstractmethod
    def _put(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def _get(self, key: str) -> bytes | None: ...

    @abstractmethod
    def _list(self, prefix: str) -> list[str]: ...

    # Defined last: inside the class body the name ``list`` is this method from here on.
    def list(self, prefix: str) -> list[str]:
        """Every key starting with ``prefix`` (plain string prefix, as S3 lists), sorted."""
        return sorted(self._list(check_prefix(prefix)))


class FileStore(ObservationStore):
    """A directory tree: one file per key, written so readers never see a partial object."""

    def __init__(self, url: str, base: Path) -> None:
        self.url = url
        self.base = base

    def _put_once(self, key: str, data: bytes) -> bool:
        final = self.base / key
        try:
            staged = self._stage(final, data)
            try:
                # link() is the atomic create-if-absent: the object appears complete
                # or not at all, and EEXIST means someone else's object is there.
                os.link(staged, final)
            except FileExistsError:
                return False
            finally:
                os.unlink(staged)
            _fsync_dir(final.parent)
            return True
        except OSError as exc:
            raise self._unavailable(exc) from exc

    def _put(self, key: str, data: bytes) -> None:
        final = self.base / key
        try:
            staged = self._stage(final, data)
            try:
                os.replace(staged, final)
            except BaseException:
                os.unlink(staged)
                raise
            _fsync_dir(final.parent)
        except OSError as exc:
            raise self._unavailable(exc) from exc

    def _get(self, key: str) -> bytes | None:
        try:
            return (self.base / key).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            # A directory or a path through a file is no object, as on S3.
            return None
        except OSError as exc:
            raise self._unavailable(exc) from exc

    def _list(self, prefix: str) -> list[str]:
        # Walk only the deepest directory the prefix names whole, then filter by the
        # string prefix, so "lineages/a" also finds "lineages/ab/..." as S3 would.
        start = self.base / prefix.rpartition("/")[0]
        keys = []
        try:
            if not start.is_dir():
                return []  # nothing written there yet (or ever)
            for dirpath, dirnames, filenames in os.walk(start, onerror=_raise):
                dirnames[:] = [name for name in dirnames if not name.startswith(".")]
                relative = Path(dirpath).relative_to(self.base)
                for name in filenames:
                    if name.startswith("."):
                        continue
                    key = (relative / name).as_posix()
                    if key.startswith(prefix):
                        keys.append(key)
        except OSError as exc:
            raise self._unavailable(exc) from exc
        return keys

    def _stage(self, final: Path, data: bytes) -> Path:
        """Write ``data`` durably to a fresh staging file beside ``final``."""
        _make_dirs(final.parent)
        # Same directory as the object, hence the same filesystem: link() and
        # replace() need that to be atomic.
        staged = final.with_name(f"{_STAGING_PREFIX}{final.name}-{uuid.uuid4().hex}")
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
        except BaseException:
            os.unlink(staged)
            raise
        return staged

    def _unavailable(self, exc: OSError) -> StoreUnavailable:
        return StoreUnavailable(
            f"observation store {self.url} failed: {exc.strerror or exc} ({exc.filename})"
        )


def _make_dirs(path: Path) -> None:
    """Create ``path`` and missing parents, syncing each new entry into its parent."""
    if path.is_dir():
        return
    _make_dirs(path.parent)
    try:
        os.mkdir(path)
    except FileExistsError:
        return  # a concurrent writer made it
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _raise(exc: OSError) -> None:
    raise exc


def redact_url(url: str) -> str:
    """``url`` without any user:password part, for messages."""
    return _USERINFO.sub("//***@", url)


def open_store(url: str, settings: S3Config) -> ObservationStore:
    """The store ``url`` names; Refusal if it is not one of the accepted forms."""
    try:
        parts = urlsplit(url)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("file", "s3"):
        raise _refusal(url, "is not an observation store URL")
    if parts.query or parts.fragment:
        raise _refusal(url, "has a query or fragment")
    if parts.scheme == "file":
        # Path.as_uri() percent-encodes, so the path is unquoted before use.
        path = unquote(parts.path)
        if parts.netloc not in ("", "localhost") or not path.startswith("/"):
            raise _refusal(url, "does not name an absolute local path")
        return FileStore(url, Path(path))
    if "@" in parts.netloc:
        raise _refusal(url, "carries credentials; give them in the AWS_* variables")
    if not _BUCKET_NAME.fullmatch(parts.netloc):
        raise _refusal(url, "does not name a valid bucket")
    prefix = parts.path.strip("/")
    try:
        if prefix:
            check_key(prefix)
    except ValueError:
        raise _refusal(url, "has an invalid key prefix") from None
    # boto3 is imported with the S3 backend only: a file store never pays for it.
    from worker.instrument.s3store import S3Store

    return S3Store(url, parts.netloc, prefix, settings)


def _refusal(url: str, reason: str) -> Refusal:
    return Refusal(f"OUROBOROS_OBSERVATIONS={redact_url(url)!r} {reason}; use {ACCEPTED_FORMS}")
