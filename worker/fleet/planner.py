"""Planning: which generation each lineage should run next, and enqueueing it.

Owns reading and writing run records in the store, the rule that at most one
generation of a lineage is in flight, and sending the next job (through a ``send``
callable, so the rules run without Celery). The pure rules of a run (its progress,
why it stopped, its next job) are ``worker.fleet.runs``. Both the worker (right after a
generation lands) and the reconcile pass (after a lost message, a Redis restart or a
dead worker; every worker takes turns at it, ``reconcile --loop`` and beat may too)
plan through ``Planner.enqueue``; a duplicate it may cause is harmless. The reconcile
pass also frees the claim of a job whose fetcher died before registering it
(``worker.fleet.orphans``). What the reconciler enqueues was lost to a fault, so it is
sent to the front of its queue. A store outage does not stop a reconcile pass: each
lineage whose record cannot be read is skipped, and the outage is logged once when it
starts and once when it ends. A new run and a cancellation clear the lineage's blocked
marker (``block_markers.Block``): whatever blocked the old run is the user's to find again,
not a reason to refuse the new one. A run is started with its model's prices (this
process's settings, else the built-in table), which its every job carries.

Trusts: the shared repository, the observation store and the broker.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal

import redis

from worker.fleet import block_markers, leases, markers, orphans
from worker.fleet.homes import Homes
from worker.fleet.orphans import Unacked
from worker.fleet.outage import Outage, probe
from worker.fleet.runs import (
    Progress,
    RunRecord,
    hard_time_limit,
    job_of,
    new_run_id,
    queue_of,
    run_progress,
)
from worker.fleet.settings import Settings
from worker.instrument.errors import Refusal
from worker.instrument.index import read_index
from worker.instrument.job import GenerationJob, GenerationReport
from worker.instrument.lineage import LineageMetadata
from worker.instrument.model.catalogue import model_of, require_known
from worker.instrument.model.prices import Prices, resolve_prices
from worker.instrument.records import LineageIndex
from worker.instrument.store import ObservationStore, StoreUnavailable
from worker.instrument.store_keys import run_key, runs_prefix

# (job, job id, queue, hard time limit, first: ahead of every job already queued)
Send = Callable[[GenerationJob, str, str, int, bool], None]
log = logging.getLogger(__name__)


class Planner:
    def __init__(
        self,
        *,
        settings: Settings,
        store: ObservationStore,
        homes: Homes,
        client: redis.Redis,
        send: Send,
        unacked: Callable[[], Unacked] | None = None,
    ) -> None:
        """unacked: where the broker keeps delivered messages (``worker.fleet.app.unacked_keys``),
        asked at the first reconcile pass; without it, no pass looks for orphaned jobs."""
        self.settings = settings
        self.store = store
        self.homes = homes
        self.client = client
        self.send = send
        self.unacked = unacked
        self.store_outage = Outage("the observation store", "reconciler", log)

    def lineages(self) -> list[str]:
        """Every lineage branch of every home (``Homes.lineages``)."""
        return list(self.homes.lineages())

    def runs(self, lineage: str) -> list[RunRecord]:
        keys = self.store.list(runs_prefix(lineage))
        records = [RunRecord.model_validate_json(self.store.get(key) or b"{}") for key in keys]
        return sorted(records, key=lambda run: (run.created_at, run.run_id))

    def run_record(self, lineage: str, run_id: str) -> RunRecord | None:
        """The durable record of run ``run_id`` of ``lineage``; None if there is none."""
        data = self.store.get(run_key(lineage, run_id))
        return None if data is None else RunRecord.model_validate_json(data)

    def latest_run(self, lineage: str) -> RunRecord | None:
        runs = self.runs(lineage)
        return runs[-1] if runs else None

    def save_run(self, run: RunRecord) -> None:
        self.store.put(run_key(run.lineage, run.run_id), run.model_dump_json(indent=2).encode())

    def index(self, lineage: str, since: int = 1) -> LineageIndex:
        """The lineage's index from generation ``since`` on (only the segments holding it)."""
        return read_index(self.store, lineage, since)

    def generation_count(self, lineage: str, head: str) -> int:
        return self.homes.home_cache(lineage).history(lineage, head).generations

    def progress(self, run: RunRecord, head: str) -> Progress:
        # Only the run's own generations count: read as much index as the run is long.
        mine = self.index(run.lineage, since=run.start_generation + 1).generations
        return run_progress(run, self.generation_count(run.lineage, head), mine)

    def run_prices(self, provider: str, model: str | None) -> Prices:
        """What a run of ``provider``'s ``model`` costs; Refusal naming the setting to fix."""
        require_known(provider)
        return resolve_prices(provider, model_of(provider, model), self.settings)

    def start_run(
        self,
        lineage: str,
        head: str,
        generations: int,
        provider: str,
        model: str | None,
        budget: Decimal,
    ) -> RunRecord:
        """Record a new run of ``lineage`` from ``head``; it replaces any active run and
        clears the lineage's blocked marker."""
        prices = self.run_prices(provider, model)
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
            prices=prices,
        )
        previous = self.latest_run(lineage)
        if previous is not None and previous.status == "active":
            # At most one run drives a lineage: the old one ends where the new one starts,
            # and a job of it still queued is dropped by the worker that fetches it.
            self.save_run(
                previous.model_copy(update={"status": "cancelled", "cancelled_at": run.created_at})
            )
            markers.request_cancel(
                self.client, lineage, previous.run_id, self.settings.visibility_timeout_seconds
            )
        self.save_run(run)
        block_markers.unblock(self.client, lineage)
        return run

    def cancel(self, lineage: str) -> RunRecord | None:
        """Cancel the lineage's active run (None if it has none); its blocked marker goes."""
        block_markers.unblock(self.client, lineage)
        run = self.latest_run(lineage)
        if run is None or run.status != "active":
            return None
        markers.request_cancel(
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
        head = self.homes.fetch(lineage)
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
        if markers.cancel_requested(self.client, job.lineage, job.run_id):
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

    def submit(self, job: GenerationJob, *, first: bool = False) -> bool:
        """Claim the lineage's in-flight slot and send ``job`` to its instrument's queue.

        first: at the front of the queue, ahead of every job already waiting there.
        """
        meta = self.homes.metadata(job.lineage, job.expected_commit)
        self.require_deliverable(meta)
        job_id = f"{job.lineage}.{job.expected_commit[:12]}.{secrets.token_hex(4)}"
        # Claimed for a lease's time until the job is surely queued: a send that fails
        # (the broker gone between the two) leaves a claim that expires within
        # lease_seconds, not one that keeps the reconciler away for inflight_ttl_seconds.
        if not markers.mark_in_flight(
            self.client, job.lineage, job_id, self.settings.lease_seconds
        ):
            return False
        self.send(job, job_id, queue_of(meta), hard_time_limit(meta), first)
        markers.extend_in_flight(
            self.client, job.lineage, job_id, self.settings.inflight_ttl_seconds
        )
        return True

    def enqueue(
        self, lineage: str, job: GenerationJob | None = None, *, first: bool = False
    ) -> GenerationJob | None:
        """Enqueue ``job`` (or the planned next one) unless one is in flight, or the lineage
        is blocked and not yet due to be tried again."""
        if (
            markers.in_flight(self.client, lineage)
            or leases.lease_held(self.client, lineage)
            or block_markers.blocking(self.client, lineage)
        ):
            return None
        job = job or self.plan(lineage)
        return job if job is not None and self.submit(job, first=first) else None

    def reconcile(self, keep_turn: Callable[[], object] = lambda: None) -> list[str]:
        """Enqueue every lineage whose run wants more and has nothing in flight.

        Each such job was lost to a fault (a dead worker, a lost message, Redis without
        its data, a worker killed holding a job it had not registered yet, whose claim
        is freed first: ``worker.fleet.orphans``): it goes to the front of its queue.
        keep_turn: called before each lineage, to hold the fleet's reconcile turn.
        """
        enqueued: list[str] = []
        failure: StoreUnavailable | None = None
        unacked = self.unacked() if self.unacked else None
        stranded = (
            orphans.delivered_before(
                self.client, unacked, time.time() - self.settings.lease_seconds
            )
            if unacked
            else {}
        )
        for lineage in self.lineages():
            keep_turn()
            if unacked and (
                job_id := orphans.reclaim(
                    self.client, unacked, lineage, stranded, self.settings.lease_seconds
                )
            ):
                log.warning(
                    "%s: job %s was fetched by a worker that died before registering it; "
                    "planning it again",
                    lineage,
                    job_id,
                )
            try:
                if self.enqueue(lineage, first=True) is not None:
                    enqueued.append(lineage)
            except StoreUnavailable as exc:
                failure = exc  # the others may not need the store: go on with them
        if failure is None:
            try:
                probe(self.store)
            except StoreUnavailable as exc:
                failure = exc
        if failure is None:
            self.store_outage.answered()
        else:
            self.store_outage.failed(failure)
        return enqueued
