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
from worker.instrument.errors import Refusal
from worker.instrument.fingerprint import current, instrument_commit
from worker.instrument.gitrepo import LineageCache
from worker.instrument.model.throttle import Cap, LocalThrottle
from worker.instrument.names import DEFAULT_HOME
from worker.instrument.spool import Spool
from worker.instrument.store import ObservationStore, open_store

if TYPE_CHECKING:
    from worker.fleet.homes import Homes
    from worker.instrument.job import GenerationJob, GenerationReport
    from worker.instrument.model.throttle import Throttle
    from worker.instrument.pipeline import Pipeline


def lineage_cache(
    settings: Settings, role: str = "worker", home: str = DEFAULT_HOME
) -> LineageCache:
    """The local cache of one home's shared repository; each role keeps its own on a host.

    The default home's cache keeps the path it had before homes existed, so a host's
    caches stay warm. Replay's writes no object: what a replayed life made is hashed and
    judged, never stored (a hostile review saw replays of a life writing random data
    add its blobs to the shared repository on every replay).
    """
    place = "lineages.git" if home == DEFAULT_HOME else f"homes/{home}.git"
    return LineageCache(
        state_dir(settings) / "cache" / role / place,
        settings.lineage_homes[home],
        writes_objects=role != "replay",
    )


def home_spool(settings: Settings, home: str = DEFAULT_HOME) -> Spool:
    """Where the pipeline of ``home`` keeps its pending publications: one spool per home,
    so a publication is only ever pushed to its own lineage's home."""
    place = "spool" if home == DEFAULT_HOME else f"spools/{home}"
    return Spool(state_dir(settings) / place)


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
    spool = home_spool(settings)
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


class Pipelines:
    """One pipeline per home, built on first use from the first one's parts (the host's
    probes, sandbox, store and model cap are the host's, whatever the home): each has
    its home's cache and spool, so a generation is published to its lineage's home only.
    """

    def __init__(
        self,
        settings: Settings,
        ceiling: str | None = None,
        *,
        shared_cap: bool = False,
        cache_role: str = "worker",
    ) -> None:
        """The arguments are ``build_pipeline``'s."""
        from worker.fleet.homes import Homes

        self.settings = settings
        self.first = build_pipeline(settings, ceiling, shared_cap=shared_cap, cache_role=cache_role)
        self.homes: Homes = Homes(settings, cache_role, self.first.store)
        self._built: dict[str, Pipeline] = {DEFAULT_HOME: self.first}

    def home(self, home: str) -> Pipeline:
        """The pipeline whose cache and spool are ``home``'s."""
        from worker.instrument.pipeline import Pipeline

        if home not in self._built:
            base = self.first
            self._built[home] = Pipeline(
                settings=base.settings,
                instrument=base.instrument,
                instrument_commit=base.instrument_commit,
                host=base.host,
                sandbox=base.sandbox,
                store=base.store,
                cache=self.homes.cache(home),
                spool=home_spool(self.settings, home),
                throttle=base.throttle,
                providers=base.providers,
            )
        return self._built[home]

    def of(self, lineage: str) -> Pipeline:
        """The pipeline of the home ``lineage`` lives in (its rule's choice if none holds
        it and the store never saw it: that pipeline then refuses it as missing, as a fleet
        of one home does)."""
        found = self.homes.locate(lineage)
        if found is None and self.homes.recorded_home(lineage) is not None:
            # Made once (the store has its root), held by no home here: it lives in a home
            # this host lacks, not in none ("create it with init" would be wrong advice).
            raise Refusal(
                f"lineage {lineage} is in none of this host's homes "
                f"({', '.join(self.homes.urls)}) though the observation store has its records; "
                "every host must configure the fleet's homes (OUROBOROS_LINEAGE_REPOS)"
            )
        return self.home(found if found is not None else self.homes.choose(lineage))

    def run(
        self, job: GenerationJob, *, task_id: str | None = None, attempt: int = 1
    ) -> GenerationReport:
        """``Pipeline.run`` in the lineage's home; once more in its new home when the
        branch left the one this process remembered (moved while its run was stopped)."""
        try:
            return self.of(job.lineage).run(job, task_id=task_id, attempt=attempt)
        except Refusal:
            if not self.homes.moved(job.lineage):
                raise
        return self.of(job.lineage).run(job, task_id=task_id, attempt=attempt)

    def drain(self) -> int:
        """Finish every home's pending publications; how many remain pending."""
        return sum(pipeline.drain() for pipeline in self._each_home())

    def _each_home(self) -> list[Pipeline]:
        return [self.home(home) for home in self.settings.lineage_homes]
