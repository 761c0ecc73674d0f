"""The scheduler's handle on the fleet, and the status of each lineage it reports.

Owns the status of each lineage (target, done, in flight, last outcome, deaths,
spend, observation backlog, and whether any live worker serves the lineage's
instrument queue) and the scheduler's planner, which sends jobs through a client
Celery app (``worker.fleet.app``; the worker's own app is never loaded here).
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

from worker.fleet import embedded_redis, leases
from worker.fleet.assembly import lineage_cache, observation_store
from worker.fleet.planner import Planner
from worker.fleet.runs import queue_of, run_progress
from worker.fleet.settings import Settings
from worker.instrument.errors import Refusal
from worker.instrument.job import GenerationJob
from worker.instrument.lineage import root_metadata
from worker.instrument.records import DEATHS

if TYPE_CHECKING:
    from celery import Celery

INSPECT_TIMEOUT_SECONDS = 1.5


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
    waiting_for_instrument: bool


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
        )

    def _send(self, job: GenerationJob, job_id: str, queue: str, time_limit: int) -> None:
        # The Celery client is built at the first job sent, not for a command that sends none.
        from worker.fleet.app import sender

        sender(self.app)(job, job_id, queue, time_limit)

    def served_queues(self) -> set[str] | None:
        """Queues some live worker consumes, or None when no worker answered."""
        try:
            replies = self.app.control.inspect(timeout=INSPECT_TIMEOUT_SECONDS).active_queues()
        except Exception:  # an unreachable broker means "unknown", never a crash
            return None
        if not replies:
            return None
        return {queue["name"] for queues in replies.values() for queue in queues}

    def status(self, lineage: str, served: set[str] | None) -> LineageStatus:
        planner = self.planner
        head = planner.cache.fetch(lineage)
        if head is None:
            raise Refusal(f"no lineage named {lineage}; see schedule-lineage status for all")
        generation = planner.generation_count(lineage, head)
        index = planner.index(lineage).generations
        run = planner.latest_run(lineage)
        # The index just read serves the run's progress too: one read per lineage.
        progress = run_progress(run, generation, index) if run else None
        try:
            queue: str | None = queue_of(root_metadata(planner.cache, head, lineage))
        except Refusal:
            queue = None  # an imported lineage: browsable, never run by this fleet
        in_flight = leases.in_flight(planner.client, lineage)
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
            waiting_for_instrument=_waiting(
                queue, progress is not None and progress.stopped is None, served
            ),
        )

    def statuses(self, names: list[str] | None = None) -> list[LineageStatus]:
        """The status of each lineage (every one by default).

        The live workers are asked which queues they serve (a broadcast that waits out
        its whole timeout) only when some lineage has a run still wanting generations:
        for any other, no worker could be missing.
        """
        rows = [self.status(name, None) for name in (names or self.planner.lineages())]
        if not any(row.run_id is not None and row.stopped is None for row in rows):
            return rows
        served = self.served_queues()
        return [
            row.model_copy(
                update={"waiting_for_instrument": _waiting(row.queue, _wants_more(row), served)}
            )
            for row in rows
        ]


def _wants_more(row: LineageStatus) -> bool:
    """Whether the lineage has a run that has not stopped."""
    return row.run_id is not None and row.stopped is None


def _waiting(queue: str | None, wants_more: bool, served: set[str] | None) -> bool:
    """A run wants generations of a queue that no live worker serves (None: unknown)."""
    return bool(wants_more and queue and served is not None and queue not in served)
