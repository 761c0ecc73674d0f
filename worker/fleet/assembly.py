"""Assembly: turn settings into the live parts of this process.

Owns building the observation store, the local lineage cache and the generation
pipeline from a ``Settings`` (used by the CLI, the Celery worker and the tests), so
every entry point wires the same parts the same way. The pipeline's cap on model
calls is the fleet's, shared through Redis, when the caller says the fleet is there
(the Celery worker); else the same cap, kept in this process (``run --local``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.fleet.places import state_dir
from worker.fleet.settings import Settings
from worker.instrument.fingerprint import current, instrument_commit
from worker.instrument.gitrepo import LineageCache
from worker.instrument.model.throttle import Cap, LocalThrottle
from worker.instrument.spool import Spool
from worker.instrument.store import ObservationStore, open_store

if TYPE_CHECKING:
    from worker.instrument.model.throttle import Throttle
    from worker.instrument.pipeline import Pipeline


def lineage_cache(settings: Settings, role: str = "worker") -> LineageCache:
    """The local cache of the shared repository; each role keeps its own on a host.

    Replay's writes no object: what a replayed life made is hashed and judged, never
    stored (a hostile review saw replays of a life writing random data add its blobs to
    the shared repository on every replay).
    """
    return LineageCache(
        state_dir(settings) / "cache" / role / "lineages.git",
        settings.lineage_repo_url,
        writes_objects=role != "replay",
    )


def observation_store(settings: Settings) -> ObservationStore:
    return open_store(settings.observations_url, settings)


def model_cap(settings: Settings) -> Cap:
    """The cap on each provider that the settings ask for."""
    return Cap(
        concurrent_calls=settings.model_max_concurrent_calls,
        requests_per_minute=settings.model_requests_per_minute,
        tokens_per_minute=settings.model_tokens_per_minute,
    )


def model_caps(settings: Settings) -> dict[str, Cap]:
    """The cap on each model, at each provider, that the settings ask for."""
    return {
        model: Cap(
            concurrent_calls=limits.max_concurrent_calls,
            requests_per_minute=limits.requests_per_minute,
            tokens_per_minute=limits.tokens_per_minute,
        )
        for model, limits in settings.model_cap_per_model.items()
    }


def model_throttle(settings: Settings, *, shared: bool) -> Throttle:
    """The caps on model calls: the fleet's in Redis when shared, else this process's own."""
    if shared:
        # Redis only for the fleet's cap: ``run --local`` needs no broker client at all.
        from worker.fleet.model_throttle import RedisThrottle
        from worker.fleet.redis_keys import redis_client

        return RedisThrottle(redis_client(settings), model_cap(settings), model_caps(settings))
    return LocalThrottle(model_cap(settings), model_caps(settings))


def build_pipeline(
    settings: Settings,
    ceiling: str | None = None,
    *,
    shared_cap: bool = False,
    cache_role: str = "worker",
) -> Pipeline:
    """A ready pipeline; the ceiling preflight and the host's probes run here, before
    any generation.

    shared_cap: the model cap is the fleet's, in the broker's Redis (a worker of the
    fleet), rather than this process's own (``run --local``, which needs no broker).
    cache_role: whose local cache of the shared repository it reads and writes objects
    to (``replay`` keeps its own, so a replay adds nothing to a worker's).
    """
    # Imported here: readers build stores and caches from this module without loading
    # the sandbox, ceilings or model socket.
    from worker.instrument.ceilings import select_ceiling
    from worker.instrument.host import BwrapSandbox, probe_host
    from worker.instrument.pipeline import Pipeline

    instrument = current()
    commit = instrument_commit(settings.instrument_commit)
    driver = select_ceiling(ceiling or settings.ceiling, settings.cgroup_parent)
    store, cache = observation_store(settings), lineage_cache(settings, cache_role)
    spool = Spool(state_dir(settings) / "spool")
    throttle = model_throttle(settings, shared=shared_cap)
    # The host last, as the pipeline itself once probed it: a refusal about the store
    # or the ceiling still comes first.
    host = probe_host(settings, driver)
    return Pipeline(
        settings=settings,
        instrument=instrument,
        instrument_commit=commit,
        host=host,
        sandbox=BwrapSandbox(driver, host.emacs),
        store=store,
        cache=cache,
        spool=spool,
        throttle=throttle,
    )
