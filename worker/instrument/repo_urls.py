"""What a shared repository's URL says: whether this process opens it itself, and where.

Owns the rule for a repository URL (``OUROBOROS_LINEAGE_REPO``, a home of
``OUROBOROS_LINEAGE_REPOS``): a local path or ``file://`` URL is opened in place; ssh
(``ssh://`` or git's scp-like ``host:path``) and every other scheme go through git. And
``repository_place``: one spelling per repository, so two settings naming one
repository in two ways are seen to be one. Imports nothing heavy: settings use it.

Trusts: the URL it is given (validated by the settings).
"""

from __future__ import annotations

from pathlib import Path


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> Path:
    return Path(url.removeprefix("file://"))


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
    symlinks, ``..`` and trailing slash resolved (whether or not it exists yet); a remote
    one's URL without a trailing slash."""
    path = local_repository(url)
    return url.rstrip("/") if path is None else str(path.expanduser().resolve())
