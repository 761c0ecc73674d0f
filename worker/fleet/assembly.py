"""Assembly: turn settings into the live parts of this process.

Owns building the observation store, the local lineage cache and the generation
pipeline from a ``Settings`` (used by the CLI, the Celery worker and the tests), so
every entry point wires the same parts the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.fleet.settings import Settings
from worker.instrument.fingerprint import current, instrument_commit
from worker.instrument.gitrepo import LineageCache
from worker.instrument.spool import Spool
from worker.instrument.store import ObservationStore, open_store

if TYPE_CHECKING:
    from worker.instrument.pipeline import Pipeline


def lineage_cache(settings: Settings, role: str = "worker") -> LineageCache:
    """The local cache of the shared repository; each role keeps its own on a host."""
    return LineageCache(
        settings.state_path / "cache" / role / "lineages.git", settings.lineage_repo_url
    )


def observation_store(settings: Settings) -> ObservationStore:
    return open_store(settings.observations_url, settings)


def build_pipeline(settings: Settings, ceiling: str | None = None) -> Pipeline:
    """A ready pipeline; the ceiling preflight runs here, before any generation."""
    # Imported here: readers build stores and caches from this module without loading
    # the sandbox, ceilings or model socket.
    from worker.instrument.ceilings import select_ceiling
    from worker.instrument.pipeline import Pipeline

    instrument = current()
    return Pipeline(
        settings=settings,
        instrument=instrument,
        instrument_commit=instrument_commit(settings.instrument_commit),
        ceiling=select_ceiling(ceiling or settings.ceiling, settings.cgroup_parent),
        store=observation_store(settings),
        cache=lineage_cache(settings),
        spool=Spool(settings.state_path / "spool"),
    )
