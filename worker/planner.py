"""Planning: which generation each lineage should run next, and enqueueing it.

Owns run records (``runs/<run-id>.json``, written by the scheduler), the progress of
a run (derived from the repository and the lineage index, never stored), the reasons
a run stops (target reached, budget exhausted, cancelled) and the rule that at most
one generation of a lineage is in flight. Both the worker (right after a generation
lands) and the reconciler (after a lost message, a Redis restart or a dead worker)
plan through ``Planner.enqueue``; a duplicate it may cause is harmless.

Trusts: the shared repository, the observation store and the broker.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from decimal import Decimal

import redis
from pydantic import BaseModel, computed_field

from worker import coordination
from worker.errors import Refusal
from worker.generation import GenerationJob, GenerationReport
from worker.gitrepo import BRANCH_PREFIX, LineageCache
from worker.lineage import LineageMetadata, root_metadata
from worker.observation import IndexEntry, LineageIndex, RunRecord, index_key, run_key
from worker.settings import Settings
from worker.store import ObservationStore, StoreUnavailable

# Time for fetch, decode, commit, push and the observation after the life ends.
PUBLICATION_MARGIN_SECONDS = 600

Send = Callable[[GenerationJob, str, str, int], None]


def new_run_id() -> str:
    """Sortable to the microsecond: a run started right after another must sort after it."""
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ") + "-" + secrets.token_hex(3)


def queue_of(meta: LineageMetadata) -> str:
    """The queue of the instrument a lineage is pinned to."""
    return f"gen.{meta.instrument_fingerprint[:12]}"


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
    )


class Planner:
    def __init__(
        self,
        *,
        settings: Settings,
        store: ObservationStore,
        cache: LineageCache,
        client: redis.Redis,
        send: Send,
    ) -> None:
        self.settings = settings
        self.store = store
        self.cache = cache
        self.client = client
        self.send = send

    def lineages(self) -> list[str]:
        """Every lineage branch in the shared repository."""
        out = self.cache.ls_remote("refs/heads/*")
        prefix = f"refs/heads/{BRANCH_PREFIX}"
        return sorted(
            line.split("\t")[1].removeprefix(prefix)
            for line in out.splitlines()
            if line.split("\t")[1].startswith(prefix)
        )

    def runs(self, lineage: str) -> list[RunRecord]:
        keys = self.store.list(f"lineages/{lineage}/runs/")
        records = [RunRecord.model_validate_json(self.store.get(key) or b"{}") for key in keys]
        return sorted(records, key=lambda run: (run.created_at, run.run_id))

    def latest_run(self, lineage: str) -> RunRecord | None:
        runs = self.runs(lineage)
        return runs[-1] if runs else None

    def save_run(self, run: RunRecord) -> None:
        self.store.put(run_key(run.lineage, run.run_id), run.model_dump_json(indent=2).encode())

    def index(self, lineage: str) -> LineageIndex:
        raw = self.store.get(index_key(lineage))
        return LineageIndex.model_validate_json(raw) if raw else LineageIndex(lineage=lineage)

    def generation_count(self, lineage: str, head: str) -> int:
        return self.cache.history(lineage, head).generations

    def progress(self, run: RunRecord, head: str) -> Progress:
        return run_progress(
            run, self.generation_count(run.lineage, head), self.index(run.lineage).generations
        )

    def start_run(
        self,
        lineage: str,
        head: str,
        generations: int,
        provider: str,
        model: str | None,
        budget: Decimal,
    ) -> RunRecord:
        """Record a new run of ``lineage`` from ``head``; it replaces any active run."""
        current = self.generation_count(lineage, head)
        run = RunRecord(
            run_id=new_run_id(),
            lineage=lineage,
            created_at=datetime.now(UTC),
            start_generation=current,
            target_generation=current + generations,
            provider=provider,
            model=model,
            budget_usd=budget,
        )
        previous = self.latest_run(lineage)
        if previous is not None and previous.status == "active":
            # At most one run drives a lineage: the old one ends where the new one starts.
            self.save_run(
                previous.model_copy(update={"status": "cancelled", "cancelled_at": run.created_at})
            )
        self.save_run(run)
        return run

    def cancel(self, lineage: str) -> RunRecord | None:
        run = self.latest_run(lineage)
        if run is None or run.status != "active":
            return None
        coordination.request_cancel(
            self.client, lineage, run.run_id, self.settings.visibility_timeout_seconds
        )
        cancelled = run.model_copy(
            update={"status": "cancelled", "cancelled_at": datetime.now(UTC)}
        )
        self.save_run(cancelled)
        return cancelled

    def plan(self, lineage: str) -> GenerationJob | None:
        """The next job of ``lineage`` from its durable run record (the reconciler's view)."""
        run = self.latest_run(lineage)
        if run is None or run.status != "active":
            return None
        head = self.cache.fetch(lineage)
        if head is None:
            return None
        progress = self.progress(run, head)
        if progress.stopped:
            return None
        return job_of(run, head, progress.remaining_usd)

    def follow_up(self, job: GenerationJob, report: GenerationReport) -> GenerationJob | None:
        """The job after ``job``, from the message alone: a down store does not stop a run."""
        if job.run_id is None or job.target_generation is None or job.budget_usd is None:
            return None
        remaining = job.budget_usd - report.spent_usd
        if report.generation >= job.target_generation or remaining <= 0:
            return None
        if report.run_budget_exhausted:
            return None
        if coordination.cancel_requested(self.client, job.lineage, job.run_id):
            return None
        try:
            run = self.latest_run(job.lineage)
        except StoreUnavailable:
            run = None  # unknown: the Redis cancel flag above is the fast path meanwhile
        else:
            if run is None or run.run_id != job.run_id or run.status != "active":
                return None
        return job.model_copy(
            update={
                "expected_commit": report.commit,
                "budget_usd": remaining,
                "enqueued_at": datetime.now(UTC),
            }
        )

    def require_deliverable(self, meta: LineageMetadata) -> None:
        """Refuse a lineage whose life could outlast the broker's visibility timeout."""
        if hard_time_limit(meta) >= self.settings.visibility_timeout_seconds:
            # The broker would hand the job to a second worker while the first still runs.
            raise Refusal(
                f"lineage {meta.name} lives up to {hard_time_limit(meta)} s with publication, "
                f"not under OUROBOROS_VISIBILITY_TIMEOUT_SECONDS="
                f"{self.settings.visibility_timeout_seconds}; raise that setting on every host"
            )

    def submit(self, job: GenerationJob) -> bool:
        """Claim the lineage's in-flight slot and send ``job`` to its instrument's queue."""
        meta = root_metadata(self.cache, job.expected_commit, job.lineage)
        self.require_deliverable(meta)
        job_id = f"{job.lineage}.{job.expected_commit[:12]}.{secrets.token_hex(4)}"
        if not coordination.mark_in_flight(
            self.client, job.lineage, job_id, self.settings.inflight_ttl_seconds
        ):
            return False
        self.send(job, job_id, queue_of(meta), hard_time_limit(meta))
        return True

    def enqueue(self, lineage: str, job: GenerationJob | None = None) -> GenerationJob | None:
        """Enqueue ``job`` (or the planned next one) unless one is in flight or blocked."""
        if (
            coordination.in_flight(self.client, lineage)
            or coordination.lease_held(self.client, lineage)
            or coordination.blocked(self.client, lineage)
        ):
            return None
        job = job or self.plan(lineage)
        return job if job is not None and self.submit(job) else None

    def reconcile(self) -> list[str]:
        """Enqueue every lineage whose run wants more and has nothing in flight."""
        return [lineage for lineage in self.lineages() if self.enqueue(lineage) is not None]
