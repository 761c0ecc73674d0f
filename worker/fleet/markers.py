"""In-flight markers: the one job queued or running per lineage, who keeps it alive, and
the fast-path flag of a cancelled run.

Owns the in-flight marker, set when a job is enqueued (so the reconciler does not
enqueue a second one). Once a worker has fetched a job, the marker lives
``lease_seconds`` from then on, renewed by the worker while it holds the message
(``keep_marker``) and by the lease's heartbeat while the life runs: a worker killed
between fetching a job and starting it is noticed as soon as one that dies mid-life.
Whoever keeps a marker alive (the main process that fetched the job, then the pool
child living it) is named in a holder record beside it, so any process on the same
host can see at once that the holder died and release its marker and lease
(``release_dead_holders``) instead of waiting for them to expire. Each record written
is also entered in its host's set of holders (``redis_keys.host_holders_key``), so a
host's sweep reads its own holders, two commands a sweep, and never walks the
keyspace: the walk cost every host a pass over every host's keys each second, which
grows with the square of the fleet. A holder record written by a worker of an earlier
release (which enters none) is left to expire, as one of another host is.

Trusts nothing it reads back: a holder record whose names are not the fleet's is
removed, never logged raw or planned. Correctness never rests on a marker: losing all
of Redis loses only these hints, and the reconciler rebuilds progress from the
repository and the store.
"""

from __future__ import annotations

import logging
import re
import time
from typing import cast

import redis

from worker.fleet.holders import holder_dead, holder_name, this_host
from worker.fleet.redis_keys import (
    EXPIRE_IF_HELD,
    cancel_key,
    eval_script,
    get_string,
    holder_key,
    host_holders_key,
    inflight_key,
    lease_key,
)
from worker.instrument.names import is_lineage_name

log = logging.getLogger(__name__)
# What a holder record may hold, read back from a Redis anyone on the network may write:
# the worker's own job ids (``lineage.commit12.hex``), Celery's uuids, and holder names.
_JOB_ID = re.compile(r"[A-Za-z0-9._-]{1,200}")


_MARK = (
    "if redis.call('set', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then return 1 end "
    "if redis.call('get', KEYS[1]) == ARGV[1] then "
    "redis.call('expire', KEYS[1], ARGV[2]) return 1 end return 0"
)


def mark_in_flight(client: redis.Redis, lineage: str, job_id: str, ttl_seconds: int) -> bool:
    """Claim the lineage's single in-flight slot for ``job_id``; False if another job has it.

    Repeating it for the same ``job_id`` succeeds again and sets the expiry anew (a
    retried command).
    """
    return bool(eval_script(client, _MARK, [inflight_key(lineage)], job_id, ttl_seconds))


def extend_in_flight(client: redis.Redis, lineage: str, job_id: str, ttl_seconds: int) -> bool:
    """Make ``job_id``'s claim (only if it still stands) expire ``ttl_seconds`` from now.

    Never makes the claim anew: a job fetched, lived and cleared before its sender got
    here is over, and a claim made for it would keep its lineage waiting for nothing.
    """
    return bool(eval_script(client, EXPIRE_IF_HELD, [inflight_key(lineage)], job_id, ttl_seconds))


def _holder_record(job_id: str) -> str:
    # Job ids and holder names hold no space: the first space ends the job id.
    return f"{job_id} {holder_name()}"


# The host's set of holders is the fleet's one key that is not a string: each script on
# it first removes a key of another type there (anyone who reaches Redis can write it),
# which then reads as empty; the holders it named are entered again at their renewal.
_HOST_SET = (
    "local kind = redis.call('type', KEYS[1])['ok'] "
    "if kind ~= 'zset' and kind ~= 'none' then redis.call('del', KEYS[1]) end "
)
# Enter ARGV[2] until ARGV[1] (seconds since the epoch); the set lives as long as its
# longest entry (ARGV[3] seconds), so a host gone for good leaves nothing behind.
_ENTER = _HOST_SET + (
    "redis.call('zadd', KEYS[1], ARGV[1], ARGV[2]) "
    "if redis.call('ttl', KEYS[1]) < tonumber(ARGV[3]) then "
    "redis.call('expire', KEYS[1], ARGV[3]) end return 0"
)
# Drop the entries past their time (ARGV[1]); the first of the rest, up to index ARGV[2].
_ENTERED = _HOST_SET + (
    "redis.call('zremrangebyscore', KEYS[1], '-inf', ARGV[1]) "
    "return redis.call('zrange', KEYS[1], 0, ARGV[2])"
)
# A sweep reads at most this many entries (a host holds a job per pool process and per
# message fetched): a set flooded by someone else is drained, not read whole each second.
_SWEEP_MOST = 4096
# Drop ARGV[1].
_DROP = _HOST_SET + "redis.call('zrem', KEYS[1], ARGV[1]) return 0"
# Drop ARGV[1] unless its holder record (KEYS[2]) is back meanwhile.
_FORGET = _HOST_SET + (
    "if redis.call('exists', KEYS[2]) == 0 then redis.call('zrem', KEYS[1], ARGV[1]) end return 0"
)


def _enter(client: redis.Redis, lineage: str, ttl_seconds: int) -> None:
    """Enter the lineage in this host's set of holders, as long as its record lives."""
    until = time.time() + ttl_seconds
    client.eval(_ENTER, 1, host_holders_key(this_host()), until, lineage, ttl_seconds)


def claim_running(client: redis.Redis, lineage: str, job_id: str, ttl_seconds: int) -> None:
    """Mark ``job_id`` as the lineage's running job, for as long as its heartbeat lasts."""
    # SET replaces a key of any type: no WRONGTYPE to meet here.
    with client.pipeline() as pipe:
        pipe.set(inflight_key(lineage), job_id, ex=ttl_seconds)
        pipe.set(holder_key(lineage), _holder_record(job_id), ex=ttl_seconds)
        pipe.execute()
    _enter(client, lineage, ttl_seconds)


_KEEP = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then "
    "redis.call('expire', KEYS[1], ARGV[3]) "
    "return redis.call('set', KEYS[2], ARGV[2], 'EX', ARGV[3]) end return 0"
)


def keep_marker(client: redis.Redis, lineage: str, job_id: str, ttl_seconds: int) -> bool:
    """Make ``job_id``'s marker (if it is still the lineage's) expire ``ttl_seconds`` from now.

    This process becomes its holder: should it die, ``release_dead_holders`` frees the marker.
    """
    keys = [inflight_key(lineage), holder_key(lineage)]
    if not eval_script(client, _KEEP, keys, job_id, _holder_record(job_id), ttl_seconds):
        return False
    _enter(client, lineage, ttl_seconds)
    return True


def in_flight(client: redis.Redis, lineage: str) -> str | None:
    value = get_string(client, inflight_key(lineage))
    return value.decode() if value else None


def holder_record(client: redis.Redis, lineage: str) -> str | None:
    """The lineage's holder record: ``<job id> <holder name>``, as anyone may have written it."""
    value = get_string(client, holder_key(lineage))
    return value.decode(errors="replace") if value else None


# Both read before either goes (see ``repairing``).
_CLEAR = (
    "local marker = redis.call('get', KEYS[1]) "
    "local holder = redis.call('get', KEYS[2]) "
    "if marker == ARGV[1] then redis.call('del', KEYS[1]) end "
    "if holder and string.find(holder, ARGV[1] .. ' ', 1, true) == 1 then "
    "redis.call('del', KEYS[2]) end return 0"
)


def clear_in_flight(client: redis.Redis, lineage: str, job_id: str) -> None:
    eval_script(client, _CLEAR, [inflight_key(lineage), holder_key(lineage)], job_id)


# Only if the holder record is still the dead one: its marker, and the lease if the
# dead process holds it, go with it. All three are read before any goes (see ``repairing``).
_RELEASE_DEAD = (
    "if redis.call('get', KEYS[1]) ~= ARGV[1] then return 0 end "
    "local marker = redis.call('get', KEYS[2]) "
    "local lease = redis.call('get', KEYS[3]) "
    "redis.call('del', KEYS[1]) "
    "if marker == ARGV[2] then redis.call('del', KEYS[2]) end "
    "if lease and string.find(lease, ARGV[3], 1, true) == 1 then redis.call('del', KEYS[3]) end "
    "return 1"
)


def release_dead_holders(client: redis.Redis) -> list[tuple[str, str]]:
    """Free the marker (and lease) of every job whose holder died on this host.

    A worker killed after fetching a job, or a pool child killed mid-life, leaves both
    alive until they expire (``lease_seconds``); on its own host its death is certain at
    once (``holder_dead``), and the caller re-enqueues the lineage (the worker's sweep
    does so at once, else the reconciler's next pass).
    Returns (lineage, job id) of each job released. Only the holders this host entered
    are read: one on another host is left to expire, as only its own host can tell it
    is gone.
    """
    here = host_holders_key(this_host())
    # The fleet's clients never decode responses: members and records come back as bytes.
    entered = cast("list[bytes]", client.eval(_ENTERED, 1, here, time.time(), _SWEEP_MOST - 1))
    if not entered:
        return []
    lineages = [member.decode(errors="replace") for member in entered]
    record_keys = [holder_key(lineage) for lineage in lineages]
    # MGET reads a key of another type as absent, where GET would fail the sweep.
    records = cast("list[bytes | None]", client.mget(record_keys))
    released = []
    for member, lineage, key, record in zip(entered, lineages, record_keys, records, strict=True):
        if not is_lineage_name(lineage):
            # Entered by someone else (anyone who reaches Redis can): its name must reach
            # neither a log line raw nor the planner. Gone, it is reported once.
            client.eval(_DROP, 1, here, member)
            log.warning("removed a holder no worker entered: %r", member)
            continue
        if record is None:
            client.eval(_FORGET, 2, here, key, member)
            continue
        job_id, _, holder = record.decode(errors="replace").partition(" ")
        if not (_JOB_ID.fullmatch(job_id) and holder.isprintable()):
            client.delete(key)
            log.warning("removed a holder record that no worker wrote: %r", key)
            continue
        if not holder_dead(holder):
            continue
        keys = [key, inflight_key(lineage), lease_key(lineage)]
        if eval_script(client, _RELEASE_DEAD, keys, record, job_id, f"{holder}/"):
            log.warning(
                "%s: released job %s, whose holder (%s) died on this host", lineage, job_id, holder
            )
            released.append((lineage, job_id))
        client.eval(_FORGET, 2, here, key, member)
    return released


def request_cancel(client: redis.Redis, lineage: str, run_id: str, ttl_seconds: int) -> None:
    """Fast path of a cancellation; the durable record is the run object in the store."""
    client.set(cancel_key(lineage, run_id), "1", ex=ttl_seconds)


def cancel_requested(client: redis.Redis, lineage: str, run_id: str) -> bool:
    # Read, not EXISTS: a key of another type is no cancellation, and would have every
    # job of the run dropped unrun (and the run's next job sent, and dropped, again).
    return get_string(client, cancel_key(lineage, run_id)) is not None
