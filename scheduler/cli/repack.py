"""The ``repack`` command: the scheduled gc of this host's lineage repositories.

A generation writes loose objects and never starts a gc or maintenance
(``worker.instrument.gitrepo``); this is the other half, run by a timer
(deploy/README.md, "Repacking"): ``git gc`` on every lineage cache under this
host's state directory, and on the shared repository when it is a local path here.
``git gc`` packs the loose objects and refs and prunes only unreachable objects older
than its two-week default, so the objects of a generation in flight, written moments
before its push, are never touched. Each repository this account owns also gets the
configuration of one made today (``harden``: no automatic gc; pushes only forward,
no deletions), so one made by an earlier version catches up
within a day.
"""

from __future__ import annotations

from pathlib import Path

import click

from scheduler.cli.common import load_settings
from scheduler.output import console
from worker.fleet.repo_admin import harden
from worker.instrument.gitrepo import run_git
from worker.instrument.repo_urls import local_repository


def _loose(repo: Path) -> int:
    """How many loose objects ``repo`` holds (``git count-objects``)."""
    out = run_git(repo, "count-objects", "-v").stdout.decode()
    return int(dict(line.split(": ", 1) for line in out.splitlines())["count"])


@click.command()
def repack() -> None:
    """Pack this host's lineage repositories: every cache, and every local shared one."""
    settings = load_settings()
    caches = settings.state_path / "cache"
    # A role's cache of the default home, and of each other home (worker.fleet.assembly).
    repos = sorted([*caches.glob("*/lineages.git"), *caches.glob("*/homes/*.git")])
    for url in settings.lineage_homes.values():
        shared = local_repository(url)
        if shared is not None and (shared / "HEAD").exists():
            repos.append(shared)
    for repo in repos:
        hardened = harden(repo)
        if hardened:
            console.print(f"{repo}: set {', '.join(hardened)}", highlight=False)
        before = _loose(repo)
        run_git(repo, "gc", "--quiet")
        console.print(f"{repo}: {before} loose objects packed", highlight=False)
    if not repos:
        console.print("no lineage repository on this host", highlight=False)
