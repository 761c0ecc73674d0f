"""What a worker does when a lineage cannot advance: block it, pause it, or clear it.

Owns the rules that turn a failure into a blocked marker (``block_markers.Block``): a refusal
by this worker (a key, a price or the instrument missing here) blocks the lineage for
``RECHECK_SECONDS``, after which the reconcile pass plans it again (a refusal comes
before any life, so trying again costs nothing), unless a worker finds the cause gone
sooner (``worker.fleet.capabilities.recheck``); a generation whose model calls failed at
the provider stops the run (no follow-up is sent): a refusal by the provider (a wrong
key, an unknown model) blocks it until it is fixed, an outage that outlasted every
retry pauses it for ``PAUSE_SECONDS``, twice as long at each such generation in a row
(up to ``MAX_PAUSE_SECONDS``). Each is logged at error level, so a run of them is never
silent. A generation that lands without a provider failure clears a marker whose retry
time had come. New runs and cancellations clear markers too (``worker.fleet.planner``).

Trusts: the job (validated), the report of its own pipeline and the broker.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import UTC, datetime, timedelta

import redis

from worker.fleet import block_markers, holders
from worker.instrument.job import GenerationJob, GenerationReport

log = logging.getLogger(__name__)

# A lineage a worker refused is tried again after this long, should no worker find the
# cause gone sooner (a refusal comes before any life: trying again costs nothing).
RECHECK_SECONDS = 60
# A run whose provider stayed unavailable through every retry of a generation waits
# this long before its next one, twice as long at each such generation in a row.
PAUSE_SECONDS = 60
MAX_PAUSE_SECONDS = 3600


def block(
    client: redis.Redis,
    job: GenerationJob,
    node: str | None,
    queue: str,
    kind: block_markers.BlockKind,
    reason: str,
    retry_in: float | None = RECHECK_SECONDS,
    pauses: int = 0,
) -> block_markers.Block | None:
    """Mark the job's lineage blocked (best effort: the broker may be away)."""
    now = datetime.now(UTC)
    # One printable line, as short as a status line can show.
    reason = " ".join(reason.split())[:1000] or "no reason given"
    record = block_markers.Block(
        kind=kind,
        reason="".join(c if c.isprintable() else "?" for c in reason),
        run_id=job.run_id,
        provider=job.provider,
        queue=queue,
        node=holders.node_name(node),
        since=now,
        retry_at=None if retry_in is None else now + timedelta(seconds=retry_in),
        pauses=pauses,
    )
    try:
        block_markers.block(client, job.lineage, record)
    except redis.RedisError as exc:
        log.warning("%s: could not mark it blocked (%s)", job.lineage, exc)
        return None
    return record


def stop_for_provider(
    client: redis.Redis, job: GenerationJob, report: GenerationReport, node: str | None, queue: str
) -> None:
    """Block the run (the provider refused) or pause it (the provider stayed away), loudly;
    nothing when the report holds no provider failure.

    Called while the job's lease is held: once it is released, a reconcile pass that
    found no marker would plan the next generation of a run the provider just failed.
    """
    failure = report.model_failure
    if failure is None:
        return
    made = failure.failed_calls + failure.answered_calls
    calls = f"{failure.failed_calls} of {made} calls failed"
    if failure.kind == "refused":
        block(client, job, node, queue, "refused", failure.reason, retry_in=None)
        log.error(
            "%s gen %d: the model provider %s refused (%s; %s); the run is blocked until that "
            "is fixed: restart the workers with the fix, start a new run, or cancel it",
            job.lineage,
            report.generation,
            job.provider,
            failure.reason,
            calls,
        )
        return
    previous = None
    with contextlib.suppress(redis.RedisError):
        previous = block_markers.blocked(client, job.lineage)
    pauses = 0
    if previous is not None and previous.kind == "unavailable" and previous.run_id == job.run_id:
        pauses = min(previous.pauses + 1, 16)
    pause = min(PAUSE_SECONDS * 2**pauses, MAX_PAUSE_SECONDS)
    record = block(client, job, node, queue, "unavailable", failure.reason, pause, pauses)
    log.error(
        "%s gen %d: the model provider %s is unavailable (%s; %s); the run is paused for %d s%s",
        job.lineage,
        report.generation,
        job.provider,
        failure.reason,
        calls,
        pause,
        f", until {record.retry_at:%H:%M:%S} UTC" if record and record.retry_at else "",
    )


def clear_if_over(client: redis.Redis, lineage: str) -> None:
    """A generation landed without a provider failure: a block tried again is over."""
    try:
        record = block_markers.blocked(client, lineage)
        if record is not None and record.due():
            block_markers.unblock(client, lineage, record)
    except redis.RedisError as exc:
        log.warning("%s: could not clear its blocked marker (%s)", lineage, exc)
