"""The upkeep a worker's main process runs in threads of its own, beside serving jobs.

Owns the loops ``WorkerApp.preflight`` starts: ``watch_markers`` (every
``SWEEP_SECONDS``, the jobs whose holder died on this host are released and
re-enqueued at once, at the front of their queue; every third of ``lease_seconds``,
the markers of the jobs this process has fetched are renewed), ``take_turns`` (the
fleet's reconcile pass, one worker at a time through ``leases.Turn``) and
``drain_forever`` (the spool retried, the store probed). Each one outlives any
failure of a pass: it logs it and tries again at its next tick.

Trusts: its settings, its planner and pipeline, and the broker; a marker or holder
record read back is judged by ``worker.fleet.markers``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import redis
from celery.worker import state as worker_state
from kombu.exceptions import OperationalError

from worker.fleet import leases, markers
from worker.fleet.assembly import Pipelines
from worker.fleet.outage import Outage, probe
from worker.fleet.planner import Planner
from worker.fleet.settings import Settings
from worker.instrument.errors import Refusal
from worker.instrument.gitrepo import GitError
from worker.instrument.store import StoreUnavailable

# How often a worker looks for jobs whose holder died on its host: a few cheap Redis
# calls, against a lineage otherwise stalled until its marker and lease expire.
SWEEP_SECONDS = 1.0

log = logging.getLogger(__name__)


def keep_marker(client: redis.Redis, lineage: str, job_id: str, ttl_seconds: int) -> None:
    """Renew the marker of a job this process holds; a broker away is logged, not raised."""
    try:
        markers.keep_marker(client, lineage, job_id, ttl_seconds)
    except redis.RedisError as exc:
        log.warning("%s: could not renew the marker of %s (%s)", lineage, job_id, exc)


def watch_markers(
    fetched: dict[str, str],
    client: Callable[[], redis.Redis],
    recover: Callable[[str], object],
    ttl_seconds: int,
) -> None:
    """Release and re-enqueue the jobs of dead holders on this host; renew the markers
    of those fetched here.

    The marker of every job this process still holds is renewed every third of
    ``ttl_seconds``; a finished one is forgotten.
    """
    renewed = time.monotonic()
    while True:
        time.sleep(SWEEP_SECONDS)
        released: list[tuple[str, str]] = []
        # The broker away: nothing to release now, and the renewals below log it.
        with contextlib.suppress(redis.RedisError):
            released = markers.release_dead_holders(client())
        for lineage, _job_id in released:
            recover(lineage)
        if time.monotonic() - renewed < ttl_seconds / 3:
            continue
        renewed = time.monotonic()
        held = {request.id for request in list(worker_state.reserved_requests)}
        for job_id, lineage in list(fetched.items()):
            if job_id in held:
                keep_marker(client(), lineage, job_id, ttl_seconds)
            else:
                fetched.pop(job_id, None)


def recover(
    planner: Callable[[], Planner], lineage: str, why: str = "after its holder died"
) -> None:
    """Enqueue a released (or unblocked) lineage's next job now, at the front of its queue.

    The reconciler would, at its next pass; a duplicate of the dead holder's message,
    should the broker return it later, is harmlessly stale or busy.
    """
    try:
        if planner().enqueue(lineage, first=True) is not None:
            log.info("%s: re-enqueued %s", lineage, why)
    except (StoreUnavailable, redis.RedisError, OperationalError, GitError, Refusal) as exc:
        log.warning("%s: cannot re-enqueue now (%s); the next reconcile turn will", lineage, exc)
    except Exception:  # in a pool thread whose future nobody reads: say it, or it is lost
        log.exception("%s: re-enqueueing failed; the next reconcile turn will", lineage)


def take_turns(
    client: Callable[[], redis.Redis],
    reconcile: Callable[[Callable[[], object]], list[str]],
    interval: float,
) -> None:
    """Every ``interval``, ask for the fleet's reconcile turn, and pass when given it.

    Every worker asks, one gets it: the fleet reconciles itself with no other process
    started, and a worker's follow-up lost to a broker outage of any length is planned
    again by whichever worker's turn comes first once Redis is back.
    """
    broker = Outage("the broker", "reconcile turn", log)
    turn: leases.Turn | None = None
    while True:
        time.sleep(interval)
        try:
            turn = turn or leases.Turn(client(), interval)
            enqueued = reconcile(turn.keep) if turn.take() else []
        except (redis.RedisError, OperationalError) as exc:
            broker.failed(exc)
            continue
        except (StoreUnavailable, GitError, Refusal) as exc:
            log.warning("reconcile turn: cannot pass now (%s); the next turn will", exc)
            continue
        except Exception:  # a thread nobody joins: say it, and keep taking turns
            log.exception("reconcile turn failed; the next turn will")
            continue
        broker.answered()
        if enqueued:
            log.info("reconcile turn: re-enqueued %s", ", ".join(enqueued))


def drain_forever(pipeline: Callable[[], Pipelines], settings: Settings) -> None:
    """Finish every home's spool's pending publications every ``spool_retry_seconds``, probing the
    store each time (its outages are logged once when they start and once when they end)."""
    store = Outage("the observation store", "worker", log)
    while True:
        time.sleep(settings.spool_retry_seconds)
        try:
            pipeline().drain()
            probe(pipeline().first.store)
        except StoreUnavailable as exc:
            store.failed(exc)
            continue
        except Exception:  # keep retrying: the spool is the only copy until it lands
            log.exception("spool drain failed; retrying in %ss", settings.spool_retry_seconds)
            continue
        store.answered()
