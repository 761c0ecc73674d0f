"""Orphaned jobs: a message a worker took off its queue and died holding before it said so.

Owns the rule that recognises them and the removal that frees their lineage. kombu's
Redis transport moves a message it delivers from its queue into the ``unacked`` hash
(with its delivery time in the ``unacked_index`` sorted set), and only then does Celery
run the worker's ``task_received`` handler, which writes the job's holder record and
cuts its in-flight marker from ``inflight_ttl_seconds`` to the lease. A worker killed in
between leaves a marker that keeps every reconciler away for up to an hour and a message
that only the visibility timeout (two hours) would return.

Such a job is orphaned when its lineage's marker names it, no holder record names it,
and its message has sat in ``unacked`` for longer than ``lease_seconds``: a live worker
writes the holder record within a moment of the delivery. Its ``unacked`` entry and the
marker go together in one script, then the reconcile pass that found it plans the
lineage again from its durable run record, at the front of its queue. Were the fetcher
alive after all, its copy is a duplicate of the same generation: the lease lets one run
at a time and the stale-job check and the compare-and-swap push refuse the second.

The key names are kombu's, as the transport is configured (``Unacked``, read by
``worker.fleet.app.unacked_keys``), never guessed here.

Trusts nothing it reads in ``unacked``: anyone who reaches Redis may write there, so an
entry that is not a kombu message naming a task id is skipped, and only a job id that
is the lineage's own marker is ever acted on.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import cast

import redis

from worker.fleet import markers, redis_keys

log = logging.getLogger(__name__)
# How many delivered messages one pass reads: at most one job per lineage is in flight.
SCAN_LIMIT = 10_000


@dataclass(frozen=True)
class Unacked:
    """Where kombu's Redis transport keeps delivered messages until they are acknowledged."""

    hash: str
    index: str


def delivered_before(client: redis.Redis, unacked: Unacked, deadline: float) -> dict[str, str]:
    """Task id -> delivery tag of each message delivered before ``deadline`` (a Unix time)
    and not acknowledged since."""
    try:
        tags = cast(
            list[bytes],
            client.zrangebyscore(unacked.index, "-inf", deadline, start=0, num=SCAN_LIMIT),
        )
        entries = cast(list[bytes | None], client.hmget(unacked.hash, tags) if tags else [])
    except redis.ResponseError as exc:
        # Keys of another type, written by someone else: kombu fails on them too. The
        # pass goes on without orphans rather than not at all.
        log.warning("cannot read the broker's unacked messages (%s)", exc)
        return {}
    found: dict[str, str] = {}
    for tag, raw in zip(tags, entries, strict=True):
        task_id = _task_id(raw)
        if task_id is not None:
            found[task_id] = tag.decode(errors="replace")
    return found


def _task_id(raw: bytes | None) -> str | None:
    """The task id in an ``unacked`` entry (``[message, exchange, routing key]``), if any."""
    try:
        message = json.loads(raw or b"")[0]
        task_id = message["headers"]["id"]
    except (ValueError, TypeError, KeyError, IndexError):
        return None
    return task_id if isinstance(task_id, str) else None


# All read before anything goes; nothing goes unless every condition still holds.
_RECLAIM = (
    "if redis.call('get', KEYS[1]) ~= ARGV[1] then return 0 end "
    "local holder = redis.call('get', KEYS[2]) "
    "if holder and string.find(holder, ARGV[1] .. ' ', 1, true) == 1 then return 0 end "
    "local since = redis.call('zscore', KEYS[4], ARGV[2]) "
    "if not since or tonumber(since) > tonumber(ARGV[3]) then return 0 end "
    "redis.call('hdel', KEYS[3], ARGV[2]) "
    "redis.call('zrem', KEYS[4], ARGV[2]) "
    "redis.call('del', KEYS[1]) "
    "return 1"
)


def reclaim(
    client: redis.Redis,
    unacked: Unacked,
    lineage: str,
    stranded: dict[str, str],
    lease_seconds: int,
) -> str | None:
    """Free ``lineage`` if its in-flight job is orphaned; the job id freed, else None.

    stranded: ``delivered_before`` up to ``lease_seconds`` ago.
    """
    # Read through the module that owns the markers: a key of another type is repaired.
    job_id = markers.in_flight(client, lineage)
    if job_id is None or job_id not in stranded:
        return None
    record = markers.holder_record(client, lineage)
    if record is not None and record.startswith(f"{job_id} "):
        return None
    keys = [
        redis_keys.inflight_key(lineage),
        redis_keys.holder_key(lineage),
        unacked.hash,
        unacked.index,
    ]
    deadline = time.time() - lease_seconds
    if not client.eval(_RECLAIM, len(keys), *keys, job_id, stranded[job_id], deadline):
        return None
    return job_id
