"""The scheduler's handle on the fleet, and the status of each lineage it reports.

Owns the status of each lineage (target, done, in flight, last outcome, deaths,
spend, observation backlog, which live workers serve the lineage's instrument
queue, with the sentence a waiting user is told when none does (see
``scheduler.liveness``), and its genealogy) and the scheduler's planner, which sends
jobs through a client Celery app (``worker.fleet.app``; the worker's own app is never
loaded here).
Progress is always derived from the shared repository and the observation store;
Redis contributes only in-flight hints.

Trusts: the shared repository, the observation store, the broker.
"""

from __future__ import annotations

from collections import Counter
from decimal import Decimal
from functools import cached_property

from celery import Celery
from pydantic import BaseModel

from scheduler.genealogy import Genealogy, genealogy
from scheduler.liveness import Workers, ask, start_hint, waiting_line
from worker.fleet import embedded_redis, leases
from worker.fleet.app import client_app, sender
from worker.fleet.assembly import lineage_cache, observation_store
from worker.fleet.planner import Planner
from worker.fleet.runs import queue_of, run_progress
from worker.fleet.settings import Settings
from worker.instrument.errors import Refusal
from worker.instrument.lineage import LineageMetadata, root_metadata
from worker.instrument.records import DEATHS


class LineageStatus(BaseModel):
    lineage: str
    generation: int
    run_id: str | None
    target: int | None
    done: int
    in_flight: str | None
    last_outcome: str | None
    run_outcomes: dict[str, int]
    deaths: int
    spent_usd: Decimal
    budget_usd: Decimal | None
    observation_backlog: int
    stopped: str | None
    blocked: str | None
    queue: str | None
    instrument_fingerprint: str | None
    # Hostnames of the live workers consuming ``queue``; None when the broker did not answer.
    workers: list[str] | None
    # Hostnames of live workers serving other instruments' queues and not ``queue``.
    other_instrument_workers: list[str]
    waiting_for_instrument: bool
    # Why the run does not advance and how to make it, when no live worker serves ``queue``.
    waiting: str | None
    genealogy: Genealogy


class Fleet:
    """The scheduler's handle on the broker, the repository and the store."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        embedded_redis.ensure(settings)

    @cached_property
    def app(self) -> Celery:
        return client_app(self.settings)

    @cached_property
    def planner(self) -> Planner:
        return Planner(
            settings=self.settings,
            store=observation_store(self.settings),
            cache=lineage_cache(self.settings, "scheduler"),
            client=leases.redis_client(self.settings),
            send=sender(self.app),
        )

    def workers(self, until_served: set[str] | None = None) -> Workers:
        """The live workers and the queues they serve, as the broker reports them now.

        With ``until_served``, the answer comes as soon as all those queues are served.
        """
        return ask(self.app, until_served=until_served)

    def waiting(self, meta: LineageMetadata, workers: Workers) -> str | None:
        """What a user is told while no live worker serves ``meta``'s queue; else None."""
        queue = queue_of(meta)
        if not workers.unserved(queue):
            return None
        hint = start_hint(
            self.settings,
            meta.name,
            meta.instrument_fingerprint,
            meta.instrument_version,
            meta.instrument_commit,
        )
        return waiting_line(meta.name, queue, workers, hint)

    def status(self, lineage: str, workers: Workers) -> LineageStatus:
        planner = self.planner
        head = planner.cache.fetch(lineage)
        if head is None:
            raise Refusal(f"no lineage named {lineage}; see schedule-lineage status for all")
        generation = planner.generation_count(lineage, head)
        index = planner.index(lineage).generations
        run = planner.latest_run(lineage)
        # The index just read serves the run's progress too: one read per lineage.
        progress = run_progress(run, generation, index) if run else None
        queue = queue_of(meta) if (meta := self._metadata(lineage, head)) else None
        in_flight = leases.in_flight(planner.client, lineage)
        wants_more = progress is not None and progress.stopped is None
        waiting = self.waiting(meta, workers) if meta and wants_more else None
        return LineageStatus(
            lineage=lineage,
            generation=generation,
            run_id=run.run_id if run else None,
            target=run.target_generation if run else None,
            done=progress.done if progress else 0,
            in_flight=in_flight,
            last_outcome=index[-1].outcome if index else None,
            run_outcomes=dict(Counter(e.outcome for e in index if run and e.run_id == run.run_id)),
            deaths=sum(e.outcome in DEATHS for e in index),
            spent_usd=progress.spent_usd if progress else Decimal(0),
            budget_usd=run.budget_usd if run else None,
            # Only fleet lineages are observed; an imported one owes no observations.
            observation_backlog=max(0, generation - len(index)) if queue else 0,
            stopped=progress.stopped if progress else None,
            blocked=leases.blocked(planner.client, lineage),
            queue=queue,
            instrument_fingerprint=meta.instrument_fingerprint if meta else None,
            workers=workers.serving(queue) if queue and workers.reachable else None,
            other_instrument_workers=[w.hostname for w in workers.elsewhere(queue)]
            if queue
            else [],
            waiting_for_instrument=waiting is not None,
            waiting=waiting,
            genealogy=genealogy(lineage, self.metadata),
        )

    @cached_property
    def metadata(self) -> dict[str, LineageMetadata | None]:
        """Every lineage's root metadata, read once per command, for genealogy."""
        cache = self.planner.cache
        return {
            name: self._metadata(name, head)
            for name in self.planner.lineages()
            if (head := cache.fetch(name)) is not None
        }

    def _metadata(self, lineage: str, head: str) -> LineageMetadata | None:
        try:
            return root_metadata(self.planner.cache, head, lineage)
        except Refusal:
            return None  # an imported lineage: browsable, never run by this fleet

    def statuses(self, names: list[str] | None = None) -> list[LineageStatus]:
        workers = self.workers()
        return [self.status(name, workers) for name in (names or self.planner.lineages())]
