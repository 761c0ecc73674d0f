"""Administration of the fleet's git repositories: the shared one made, and any one
brought up to the configuration of a repository made today.

Owns ``ensure_shared_repo`` (``init``, ``fork``, the imports, ``restore`` and the first
start of a fleet make the shared repository through it) and ``harden`` (those and the
daily ``repack``). A worker never calls either: it only opens the shared repository
and makes its own cache (``worker.instrument.gitrepo``), so this module lies outside
the fingerprinted instrument and a change here forks no lineage.

Trusts: the repository's own configuration file and the account that runs it; writes
only a file this account owns.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pygit2

from worker.instrument.errors import Refusal
from worker.instrument.gitrepo import REPO_CONFIG, init_bare
from worker.instrument.repo_urls import local_repository

log = logging.getLogger(__name__)


def ensure_shared_repo(url: str) -> None:
    """Create the shared bare repository if it is a local path that does not exist yet;
    one that exists (made by an earlier version, or by hand) is hardened (``harden``)."""
    path = local_repository(url)
    if path is None:
        return
    if (path / "HEAD").exists():
        harden(path)
        return
    if path.exists() and any(path.iterdir()):
        raise Refusal(
            f"{path} exists but is not a bare git repository; "
            "point OUROBOROS_LINEAGE_REPO elsewhere"
        )
    path.mkdir(parents=True, exist_ok=True)
    init_bare(path)


def harden(path: Path) -> list[str]:
    """Set in the bare repository at ``path`` each setting of ``REPO_CONFIG`` it lacks
    (or holds with another value); the names set.

    Only the repository's own configuration file counts (not the user's or the system's,
    which another account or host does not share), and only its owner writes it: a
    repository of another account (the ``ouroboros`` service's, opened from an operator's
    shell) is left as it is, with a warning naming what it lacks, since a config file
    rewritten by another account would change hands. The worker never calls this on
    the shared repository; the commands that create or import lineages and ``repack`` do.
    """
    file = path / "config"
    config = pygit2.Config(str(file))
    missing = [name for name, value in REPO_CONFIG.items() if not _holds(config, name, value)]
    if not missing:
        return []
    if file.stat().st_uid != os.geteuid():
        log.warning(
            "%s lacks %s and belongs to another account; as its owner run: %s",
            path,
            ", ".join(f"{name}={REPO_CONFIG[name]}" for name in missing),
            " && ".join(
                f"git --git-dir={path} config {name} {REPO_CONFIG[name]}" for name in missing
            ),
        )
        return []
    for name in missing:
        config[name] = REPO_CONFIG[name]
    return missing


def _holds(config: pygit2.Config, name: str, value: str) -> bool:
    """Whether ``config`` sets ``name`` to ``value`` as git reads it ("yes" is "true")."""
    try:
        if value in ("true", "false"):
            return config.get_bool(name) == (value == "true")
        return config.get_int(name) == int(value)
    except (KeyError, ValueError, pygit2.GitError):
        return False
