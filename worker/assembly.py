"""Assembly: turn settings into the live parts of this process.

Owns building the observation store, the local lineage cache and the generation
pipeline from a ``Settings`` (used by the CLI, the Celery worker and the tests), so
every entry point wires the same parts the same way.
"""

from __future__ import annotations

from worker.ceilings import select_ceiling
from worker.generation import Pipeline
from worker.gitrepo import LineageCache
from worker.instrument import current, instrument_commit
from worker.settings import Settings
from worker.store import ObservationStore, open_store


def lineage_cache(settings: Settings, role: str = "worker") -> LineageCache:
    """The local cache of the shared repository; each role keeps its own on a host."""
    return LineageCache(
        settings.state_path / "cache" / role / "lineages.git", settings.lineage_repo_url
    )


def observation_store(settings: Settings) -> ObservationStore:
    return open_store(settings.observations_url, settings)


def build_pipeline(settings: Settings, ceiling: str | None = None) -> Pipeline:
    """A ready pipeline; the ceiling preflight runs here, before any generation."""
    instrument = current()
    return Pipeline(
        settings=settings,
        instrument=instrument,
        instrument_commit=instrument_commit(settings.instrument_commit),
        ceiling=select_ceiling(ceiling or settings.ceiling, settings.cgroup_parent),
        store=observation_store(settings),
        cache=lineage_cache(settings),
    )
