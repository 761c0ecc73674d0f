"""The scheduler's handle on the fleet, and the status of each lineage it reports.

Owns the status of each lineage (target, done, in flight, last outcome, deaths,
spend, observation backlog, why a run that wants more has nothing in flight, which
live workers serve the lineage's instrument queue, with the sentence a waiting user is
told when none does (see ``scheduler.liveness``), and its genealogy) and the
scheduler's planner, which sends jobs through a client Celery app (``worker.fleet.app``;
the worker's own app is never loaded here).
Progress is always derived from the shared repository and the observation store;
Redis contributes only in-flight hints.

Trusts: the shared repository, the observation store, the broker.
"""

from __future__ import annotations

from collections import Counter
from decimal import Decimal
from functools import cached_property
from typing import TYPE_CHECKING

from pydantic import BaseModel

from scheduler.genealogy import Genealogy, genealogy
from scheduler.liveness import Workers, ask, start_hint, waiting_line
from worker.fleet import embedded_redis, leases
from worker.fleet.assembly import lineage_cache, observation_store
from worker.fleet.orphans import Unacked
from worker.fleet.planner import Planner
from worker.fleet.runs import queue_of, run_progress
from worker.fleet.settings import Settings
from worker.instrument.errors import Refusal
from worker.instrument.job import GenerationJob
from worker.instrument.lineage import LineageMetadata, root_metadata
from worker.instrument.records import DEATHS

if TYPE_CHECKING:
    from celery import Celery


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
    # Why a run that wants more has nothing in flight, and what brings it back; None otherwise.
    stalled: str | None
    queue: str | None
    instrument_fingerprint: str | None
    # Hostnames of the live workers consuming ``queue``; None when they were not asked (no
    # run wants generations) or the broker did not answer.
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
        # Celery is imported with the client, which only sending and asking workers need.
        from worker.fleet.app import client_app

        return client_app(self.settings)

    @cached_property
    def planner(self) -> Planner:
        return Planner(
            settings=self.settings,
            store=observation_store(self.settings),
            cache=lineage_cache(self.settings, "scheduler"),
            client=leases.redis_client(self.settings),
            send=self._send,
            unacked=self._unacked,
        )

    def _unacked(self) -> Unacked:
        from worker.fleet.app import unacked_keys

        return unacked_keys(self.app)

    def _send(
        self, job: GenerationJob, job_id: str, queue: str, time_limit: int, first: bool
    ) -> None:
        # The Celery client is built at the first job sent, not for a command that sends none.
        from worker.fleet.app import sender

        sender(self.app)(job, job_id, queue, time_limit, first)

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

    def status(self, lineage: str, workers: Workers | None = None) -> LineageStatus:
        """``lineage``'s status; without ``workers`` (not asked), nothing about liveness."""
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
        blocked = leases.blocked(planner.client, lineage)
        stalled = (
            "nothing in flight: the next reconcile turn of a live worker (every "
            f"{self.settings.reconcile_interval_seconds:g} s) sends its next job"
            if progress and progress.stopped is None and not (in_flight or blocked)
            else None
        )
        row = LineageStatus(
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
            blocked=blocked,
            stalled=stalled,
            queue=queue,
            instrument_fingerprint=meta.instrument_fingerprint if meta else None,
            workers=None,
            other_instrument_workers=[],
            waiting_for_instrument=False,
            waiting=None,
            genealogy=genealogy(lineage, self.metadata),
        )
        return self._live(row, meta, workers) if meta and workers else row

    def _live(self, row: LineageStatus, meta: LineageMetadata, workers: Workers) -> LineageStatus:
        """``row`` with which live workers serve its queue, and what a waiting user is told."""
        queue = queue_of(meta)
        waiting = self.waiting(meta, workers) if _wants_more(row) else None
        return row.model_copy(
            update={
                "workers": workers.serving(queue) if workers.reachable else None,
                "other_instrument_workers": [w.hostname for w in workers.elsewhere(queue)],
                "waiting_for_instrument": waiting is not None,
                "waiting": waiting,
            }
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
        """The status of each lineage (every one by default).

        The live workers are asked which queues they serve (a broadcast that waits out
        its whole timeout) only when some lineage has a run still wanting generations:
        for any other, no worker could be missing.
        """
        rows = [self.status(name) for name in (names or self.planner.lineages())]
        if not any(_wants_more(row) for row in rows):
            return rows
        workers = self.workers()
        return [
            self._live(row, meta, workers) if (meta := self.metadata.get(row.lineage)) else row
            for row in rows
        ]


def _wants_more(row: LineageStatus) -> bool:
    """Whether the lineage has a run that has not stopped."""
    return row.run_id is not None and row.stopped is None
