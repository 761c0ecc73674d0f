"""What a shared repository's URL says: whether this process opens it itself, and where.

Owns the rule for a repository URL (``OUROBOROS_LINEAGE_REPO``, a home of
``OUROBOROS_LINEAGE_REPOS``): a local path or ``file://`` URL is opened in place; ssh
(``ssh://`` or git's scp-like ``host:path``) and every other scheme go through git. And
``repository_place``: one spelling per repository, so two settings naming one
repository in two ways are seen to be one. Imports nothing heavy: settings use it.

Trusts: the URL it is given (validated by the settings).
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

# git's scp-like ssh syntax: [user@]host:path, a colon before the first slash.
_SCP_LIKE = re.compile(r"(?:(?P<user>[^@/:]+)@)?(?P<host>[^@/:]+):(?P<path>.*)")


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> Path:
    path = url.removeprefix("file://")
    if url.startswith("file://localhost/"):
        # RFC 8089: file://localhost/abs is file:///abs, as git reads it.
        path = path.removeprefix("localhost")
    return Path(path)


def local_repository(url: str) -> Path | None:
    """The shared repository's path if this process opens it itself, else None.

    A local path or ``file://`` URL; never ``host:path`` (git's scp-like ssh syntax:
    a colon before the first slash) or another scheme.
    """
    if url.startswith("file://"):
        return local_path(url)
    if "://" in url or ":" in url.split("/", 1)[0]:
        return None
    return Path(url)


def repository_place(url: str) -> str:
    """Where ``url`` points, spelled one way: a local repository's absolute path with its
    symlinks, ``..`` and trailing slash resolved (whether or not it exists yet); an ssh
    one as ``ssh://[user@]host:port/path`` (``host:path`` and ``ssh://host/path`` alike,
    the host in lower case, port 22 unless given); any other URL without a trailing slash.
    One repository reached both by path and over ssh to this host is not seen as one."""
    path = local_repository(url)
    if path is not None:
        return str(path.expanduser().resolve())
    parts = urlsplit(url)
    if parts.scheme in ("ssh", "git+ssh", "ssh+git") and parts.hostname:
        user, host, port, where = parts.username, parts.hostname, parts.port or 22, parts.path
    elif "://" not in url and (scp := _SCP_LIKE.match(url)):
        # host:path is relative to the user's home, which ssh:// spells /~/path.
        path_part = scp["path"] if scp["path"].startswith("/") else f"/~/{scp['path']}"
        user, host, port, where = scp["user"], scp["host"].lower(), 22, path_part
    else:
        return url.rstrip("/")
    login = f"{user}@" if user else ""
    return f"ssh://{login}{host}:{port}{where.rstrip('/')}"
