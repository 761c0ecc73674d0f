"""Runs: what a researcher asked of a lineage, and how far it got, as pure data and rules.

Owns the run record (``runs/<run-id>.json``, written only by the scheduler), the one
rule for a run's progress and the reason it stopped (derived from the repository and
the lineage index, never stored), the job that advances a run, the rule that a job's
model and prices are its run record's (``tampered``: a job message is anyone's to write
who reaches Redis), and the queue and time limit of a lineage's jobs. The planner
(write side) and the readers (status, the web UI) both use these rules, so they agree;
nothing here touches a broker, a store or a sandbox.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Literal

from pydantic import BaseModel, ConfigDict, computed_field

from worker.instrument.job import GenerationJob
from worker.instrument.lineage import LineageMetadata
from worker.instrument.model.prices import Prices
from worker.instrument.names import queue_name
from worker.instrument.records import IndexEntry

RunStatus = Literal["active", "cancelled"]


class RunRecord(BaseModel):
    """A run: advance one lineage to a target generation within a total budget.

    Written only by the scheduler (creation, cancellation); progress and the reason a
    run stopped are derived from the lineage index, so no two writers ever race.
    """

    model_config = ConfigDict(extra="forbid")

    run_id: str
    lineage: str
    created_at: datetime
    start_generation: int
    target_generation: int
    provider: str
    model: str | None
    budget_usd: Decimal
    status: RunStatus = "active"
    cancelled_at: datetime | None = None
    # What the run's model costs, fixed when it started (the scheduler's settings or the
    # built-in table) and sent with every job: each worker charges it alike. None in the
    # records of older releases: each worker then charges its own prices.
    prices: Prices | None = None


# Time for fetch, decode, commit, push and the observation after the life ends.
PUBLICATION_MARGIN_SECONDS = 600


def new_run_id() -> str:
    """Sortable to the microsecond: a run started right after another must sort after it."""
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ") + "-" + secrets.token_hex(3)


def queue_of(meta: LineageMetadata) -> str:
    """The queue of the instrument a lineage is pinned to."""
    return queue_name(meta.instrument_fingerprint)


def hard_time_limit(meta: LineageMetadata) -> int:
    return meta.physics.wall_seconds + PUBLICATION_MARGIN_SECONDS


class Progress(BaseModel):
    """How far a run got (derived from the repository and the index, never stored)."""

    run: RunRecord
    generation: int
    done: int
    spent_usd: Decimal
    stopped: str | None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def wanted(self) -> int:
        return self.run.target_generation - self.run.start_generation

    @property
    def remaining_usd(self) -> Decimal:
        return max(Decimal(0), self.run.budget_usd - self.spent_usd)


def run_progress(run: RunRecord, generation: int, entries: Iterable[IndexEntry]) -> Progress:
    """The one rule for a run's progress and why it stopped, for the planner and for readers."""
    mine = [e for e in entries if e.run_id == run.run_id]
    spent = sum((e.spent_usd for e in mine), Decimal(0))
    stopped = None
    if run.status == "cancelled":
        stopped = "cancelled"
    elif generation >= run.target_generation:
        stopped = "target reached"
    elif spent >= run.budget_usd or any(e.run_budget_exhausted for e in mine):
        stopped = "budget exhausted"
    return Progress(
        run=run,
        generation=generation,
        done=generation - run.start_generation,
        spent_usd=spent,
        stopped=stopped,
    )


def job_of(run: RunRecord, head: str, remaining_usd: Decimal) -> GenerationJob:
    """The job that advances ``run`` from ``head`` with what its budget has left."""
    return GenerationJob(
        lineage=run.lineage,
        expected_commit=head,
        provider=run.provider,
        model=run.model,
        run_id=run.run_id,
        target_generation=run.target_generation,
        budget_usd=remaining_usd,
        enqueued_at=datetime.now(UTC),
        prices=run.prices,
    )


# What a job must agree on with its run's record: the model it calls and the prices it
# is charged at. Fixed when the run starts; a cancellation changes neither.
RUN_TERMS = ("provider", "model", "prices")


def tampered(job: GenerationJob, run: RunRecord | None) -> str | None:
    """Why ``job`` is no job its run's scheduler sent (``run``: the durable record of the
    run it names, None if there is none); None when it may be.

    A job of no run (an older scheduler's) is charged at the worker's own prices, so it
    may carry none of its own.
    """
    if job.run_id is None:
        return "it names no run, yet carries prices" if job.prices is not None else None
    if run is None:
        return f"it names run {job.run_id}, which has no record"
    for term in RUN_TERMS:
        if getattr(job, term) != getattr(run, term):
            return f"its {term} differ from the record of run {job.run_id}"
    # What a run may still spend and how far it goes are the record's to bound: a message
    # that claims more would carry the run past its target or its budget.
    if job.target_generation != run.target_generation:
        return f"its target differs from the record of run {job.run_id}"
    if job.budget_usd is None or job.budget_usd > run.budget_usd:
        return f"its budget exceeds the record of run {job.run_id}"
    return None
