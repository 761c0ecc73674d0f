"""The scheduler's handle on the fleet, and the status of each lineage it reports.

Owns the status of each lineage (target, done, in flight, last outcome and whether
its model calls all failed, the run's generations so marked, deaths, spend,
observation backlog, what blocks or pauses it and when it is tried again, why a run
that wants more has nothing in flight, which live workers serve the lineage's
instrument queue, with the sentence a waiting user is told when none does (see
``scheduler.liveness``), and its genealogy) and the scheduler's planner, which sends
jobs through a client Celery app (``worker.fleet.app``; the worker's own app is never
loaded here).
Progress is always derived from the shared repository and the observation store;
Redis contributes only in-flight hints.

Each source is asked for its own fields only, so a status degrades instead of
failing: with the broker down, what git and the store know is shown and in flight
and blocked are unknown; with the store down, what git and the broker know is shown
and the run, the spend, the deaths and the backlog are unknown. A source that did
not answer is not asked again in the same pass (``Outages``), and every row of the
pass says which sources those were and why (``LineageStatus.unavailable``, worded by
``scheduler.sources``). Only the shared repository is essential: without it there is
no lineage to show.

Trusts: the shared repository, the observation store, the broker.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from decimal import Decimal
from functools import cached_property
from typing import TYPE_CHECKING, TypeVar

import redis
from pydantic import BaseModel

from scheduler.genealogy import Genealogy, genealogy
from scheduler.liveness import UNREACHABLE, Workers, ask, start_hint, waiting_line
from scheduler.sources import Source, why
from worker.fleet import block_markers, embedded_redis, markers, redis_keys
from worker.fleet.assembly import observation_store
from worker.fleet.homes import Homes
from worker.fleet.orphans import Unacked
from worker.fleet.planner import Planner
from worker.fleet.runs import queue_of, run_progress
from worker.fleet.settings import Settings
from worker.instrument.errors import Refusal
from worker.instrument.gitrepo import GitError
from worker.instrument.job import GenerationJob
from worker.instrument.lineage import LineageMetadata
from worker.instrument.names import DEFAULT_HOME
from worker.instrument.records import DEATHS
from worker.instrument.store import StoreUnavailable

if TYPE_CHECKING:
    from celery import Celery

T = TypeVar("T")
# Which source did not answer in this pass, and the line that says so.
Outages = dict[Source, str]
# What each source fails with when it does not answer.
FAILURES: dict[Source, tuple[type[Exception], ...]] = {
    "broker": (redis.RedisError,),
    "store": (StoreUnavailable,),
    "repository": (GitError,),
}
log = logging.getLogger(__name__)


class LineageStatus(BaseModel):
    """One lineage: the lineage's totals, its current run, and what the broker says now.

    A field of a source named in ``unavailable`` is None: unknown, not "none".
    """

    lineage: str
    # The shared repository (``OUROBOROS_LINEAGE_REPOS``) its branch is in.
    home: str = DEFAULT_HOME
    # The cohort in the lineage's root metadata; None when it is in none.
    cohort: str | None = None
    # The lineage's totals (git: generations; the store: deaths, spend, backlog).
    generation: int
    deaths: int | None
    lineage_spent_usd: Decimal | None
    last_outcome: str | None
    # The last generation's model calls all failed at the provider: its outcome is the
    # organism's, and this mark says the model never answered it.
    last_model_unavailable: bool = False
    observation_backlog: int | None
    # The current (latest) run, from the store.
    run_id: str | None
    target: int | None
    done: int
    run_outcomes: dict[str, int]
    run_spent_usd: Decimal | None
    # The current run's generations marked "model unavailable", whatever their outcome.
    run_model_unavailable: int = 0
    budget_usd: Decimal | None
    stopped: str | None
    # From the broker.
    in_flight: str | None
    # What blocks or pauses the lineage, and what happens next (``block_markers.Block.describe``).
    blocked: str | None
    blocked_kind: str | None = None
    # When the lineage is planned again by itself; None while blocked: only once fixed.
    retry_at: datetime | None = None
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
    # The sources that did not answer for this row ("broker", "store"), each with the
    # line saying so.
    unavailable: Outages = {}


class FleetClient:
    """The scheduler's client of the fleet: the broker, the repository and the store."""

    def __init__(self, settings: Settings, *, start_broker: bool = True) -> None:
        """``start_broker=False`` (a command that only reads): an embedded Redis that is
        not running stays stopped, and is reported as what it means, nothing in flight,
        nothing blocked and no live worker (a worker keeps it running)."""
        self.settings = settings
        if start_broker:
            embedded_redis.ensure(settings)
        self.broker_up = bool(settings.broker_url) or embedded_redis.running(settings)

    @cached_property
    def app(self) -> Celery:
        # Celery is imported with the client, which only sending and asking workers need.
        from worker.fleet.app import client_app

        return client_app(self.settings)

    @cached_property
    def planner(self) -> Planner:
        store = observation_store(self.settings)
        return Planner(
            settings=self.settings,
            store=store,
            homes=Homes(self.settings, "scheduler", store),
            client=redis_keys.redis_client(self.settings),
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
        if not self.broker_up:
            return Workers(reachable=True, workers=[])
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

    def status(
        self, lineage: str, workers: Workers | None = None, outages: Outages | None = None
    ) -> LineageStatus:
        """``lineage``'s status; without ``workers`` (not asked), nothing about liveness.

        ``outages`` is the pass's record of sources that did not answer (a fresh one
        by default): a source in it is not asked, and one that fails now is added.
        """
        outages = {} if outages is None else outages
        planner = self.planner
        head = planner.homes.fetch(lineage)
        if head is None:
            raise Refusal(f"no lineage named {lineage}; see schedule-lineage status for all")
        generation = planner.generation_count(lineage, head)
        found = self._ask("store", outages, lambda: planner.index(lineage).generations)
        run = self._ask("store", outages, lambda: planner.latest_run(lineage))
        index = found or []
        # The index just read serves the run's progress too: one read per lineage.
        progress = run_progress(run, generation, index) if run else None
        queue = queue_of(meta) if (meta := self._metadata(lineage, head)) else None
        in_flight = (
            self._ask("broker", outages, lambda: markers.in_flight(planner.client, lineage))
            if self.broker_up
            else None
        )
        mine = [e for e in index if run and e.run_id == run.run_id]
        block = (
            self._ask("broker", outages, lambda: block_markers.blocked(planner.client, lineage))
            if self.broker_up
            else None
        )
        stalled = (
            "nothing in flight: the next reconcile turn of a live worker (every "
            f"{self.settings.reconcile_interval_seconds:g} s) sends its next job"
            if progress
            and progress.stopped is None
            and "broker" not in outages
            and not (in_flight or block)
            else None
        )
        row = LineageStatus(
            lineage=lineage,
            home=planner.homes.locate(lineage) or DEFAULT_HOME,
            cohort=meta.cohort if meta else None,
            generation=generation,
            deaths=sum(e.outcome in DEATHS for e in index) if found is not None else None,
            lineage_spent_usd=sum((e.spent_usd for e in index), Decimal(0))
            if found is not None
            else None,
            last_outcome=index[-1].outcome if index else None,
            last_model_unavailable=bool(index) and index[-1].model_unavailable,
            # Only fleet lineages are observed; an imported one owes no observations.
            observation_backlog=(max(0, generation - len(index)) if queue else 0)
            if found is not None
            else None,
            run_id=run.run_id if run else None,
            target=run.target_generation if run else None,
            done=progress.done if progress else 0,
            run_outcomes=dict(Counter(e.outcome for e in mine)),
            run_model_unavailable=sum(e.model_unavailable for e in mine),
            run_spent_usd=progress.spent_usd if progress else None,
            budget_usd=run.budget_usd if run else None,
            stopped=progress.stopped if progress else None,
            in_flight=in_flight,
            blocked=block.describe() if block else None,
            blocked_kind=block.kind if block else None,
            retry_at=block.retry_at if block else None,
            stalled=stalled,
            queue=queue,
            instrument_fingerprint=meta.instrument_fingerprint if meta else None,
            workers=None,
            other_instrument_workers=[],
            waiting_for_instrument=False,
            waiting=None,
            genealogy=genealogy(lineage, self.metadata),
            unavailable=outages,
        )
        return self._live(row, meta, workers) if meta and workers else row

    def _ask(self, source: Source, outages: Outages, read: Callable[[], T]) -> T | None:
        """``read()`` from ``source``; None if it is down in this pass or fails now."""
        if source in outages:
            return None
        try:
            return read()
        except FAILURES[source] as exc:
            outages[source] = why(source, self.settings, exc)
            return None

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
        return {name: self._metadata(name, head) for name, head in self.heads.items()}

    @cached_property
    def heads(self) -> dict[str, str]:
        """Every lineage's head; one whose branch cannot be read is left out with a warning."""
        heads = {}
        for name in self.planner.lineages():
            try:
                head = self.planner.homes.fetch(name)
            except GitError as exc:
                log.warning("ignoring lineage %s: %s", name, exc)
                continue
            if head is not None:
                heads[name] = head
        return heads

    def _metadata(self, lineage: str, head: str) -> LineageMetadata | None:
        try:
            return self.planner.homes.metadata(lineage, head)
        except Refusal:
            return None  # an imported lineage: browsable, never run by this fleet

    def statuses(self, names: list[str] | None = None) -> list[LineageStatus]:
        """The status of each lineage (every one by default), in one pass.

        The live workers are asked which queues they serve (a broadcast that waits out
        its whole timeout) only when some lineage has a run still wanting generations:
        for any other, no worker could be missing. A broker already found down is not
        asked again: its workers are unknown.
        """
        outages: Outages = {}
        rows = [self.status(name, outages=outages) for name in (names or self.heads)]
        if not any(_wants_more(row) for row in rows):
            return rows
        workers = UNREACHABLE if "broker" in outages else self.workers()
        return [
            self._live(row, meta, workers) if (meta := self.metadata.get(row.lineage)) else row
            for row in rows
        ]


def _wants_more(row: LineageStatus) -> bool:
    """Whether the lineage has a run that has not stopped."""
    return row.run_id is not None and row.stopped is None
