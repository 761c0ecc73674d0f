"""A replay job names a generation of the branch, or the worker replays nothing.

The job comes off the broker, where anyone who reaches Redis can write one: its
commit must be in the repository, on the lineage's branch, and be the generation it
says. Checked here on a real repository (libgit2), in this process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.fleet.assembly import lineage_cache
from worker.fleet.repo_admin import ensure_shared_repo
from worker.fleet.settings import Settings
from worker.instrument.fingerprint import Instrument
from worker.instrument.gitrepo import LineageCache
from worker.instrument.job import ReplayJob
from worker.instrument.lineage import create_lineage
from worker.instrument.physics import Physics
from worker.instrument.replay import replay_problem
from worker.instrument.store import FileStore

LINEAGE = "replayed"
SEED = b';; seed\n(message "alive")\n'
INSTRUMENT = Instrument(fingerprint="e" * 64, version="0.0.0", scripts={}, seed=SEED, sources={})


@pytest.fixture
def cache(tmp_path: Path) -> LineageCache:
    settings = Settings(home=tmp_path / "home")
    ensure_shared_repo(settings.lineage_repo_url)
    cache = lineage_cache(settings)
    create_lineage(
        name=LINEAGE,
        seed=SEED,
        physics=Physics(wall_seconds=60, cpu_seconds=60),
        instrument=INSTRUMENT,
        commit="a" * 40,
        repository="tests",
        ref="tests",
        cache=cache,
        store=FileStore(f"file://{tmp_path / 'store'}", tmp_path / "store"),
    )
    return cache


def job(commit: str, generation: int = 1) -> ReplayJob:
    return ReplayJob(lineage=LINEAGE, generation=generation, commit=commit)


def test_only_the_branchs_commit_of_that_generation_is_replayed(cache: LineageCache) -> None:
    seed = cache.fetch(LINEAGE)
    assert seed is not None
    files = cache.tree(seed)
    first = cache.commit(seed, files, "gen 1: no change\n")
    elsewhere = cache.commit(seed, files, "gen 1: died (exit 3); staged writes discarded\n")
    assert cache.push_cas(LINEAGE, first, seed)
    head = cache.fetch(LINEAGE)
    assert head == first
    assert replay_problem(cache, head, job(first)) is None
    assert replay_problem(cache, head, job(first, 2)) == (
        f"commit {first[:12]} is not generation 2"
    )
    assert replay_problem(cache, head, job(seed)) == f"commit {seed[:12]} is not generation 1"
    assert replay_problem(cache, head, job(elsewhere)) == (
        f"commit {elsewhere[:12]} is not on the branch of {LINEAGE}"
    )
    assert replay_problem(cache, head, job("f" * 40)) == (
        "commit ffffffffffff is not in the repository"
    )
