"""Coordination markers in Redis: leases with their heartbeat, in-flight and blocked markers.

Owns the Redis keys that save wasted work: a per-lineage lease held while a
generation runs (so a duplicated message does not run the same life twice), an
in-flight marker set when a job is enqueued (so the reconciler does not enqueue a
second one) and a blocked marker with the reason a lineage cannot advance here.
Correctness never rests on these: the compare-and-swap push and the write-once
observation make a lost lease or marker harmless. Losing all of Redis loses only
these hints; the reconciler rebuilds progress from the repository and the store.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from worker.fleet.settings import Settings

PREFIX = "ouroboros"
log = logging.getLogger("ouroboros.worker")


def redis_client(settings: Settings) -> redis.Redis:
    """A client for the broker's Redis (kombu's ``redis+socket://`` is redis-py's ``unix://``)."""
    url = settings.broker
    if url.startswith("redis+socket://"):
        url = "unix://" + url.removeprefix("redis+socket://")
    return redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)


class Lease:
    """An expiring per-lineage lock; release only removes the holder's own lease."""

    _RELEASE = (
        "if redis.call('get', KEYS[1]) == ARGV[1] then "
        "return redis.call('del', KEYS[1]) end return 0"
    )

    def __init__(self, client: redis.Redis, lineage: str, ttl_seconds: int) -> None:
        self.client = client
        self.key = f"{PREFIX}:lease:{lineage}"
        self.ttl = ttl_seconds
        self.token = secrets.token_hex(16)

    _RENEW = (
        "if redis.call('get', KEYS[1]) == ARGV[1] then "
        "return redis.call('expire', KEYS[1], ARGV[2]) end return 0"
    )

    def acquire(self) -> bool:
        return bool(self.client.set(self.key, self.token, nx=True, ex=self.ttl))

    def renew(self) -> bool:
        return bool(self.client.eval(self._RENEW, 1, self.key, self.token, self.ttl))

    def release(self) -> None:
        self.client.eval(self._RELEASE, 1, self.key, self.token)


class LeaseBusy(Exception):
    """Another worker holds the lineage's lease: this job must not run its life now."""


@contextmanager
def holding(client: redis.Redis, lineage: str, job_id: str, ttl_seconds: int) -> Iterator[Lease]:
    """Hold the lineage's lease and running marker for ``job_id`` while the block runs.

    A heartbeat thread renews both every third of ``ttl_seconds``, so a worker that
    dies is noticed within ``ttl_seconds``; on leaving, the heartbeat stops and both
    are released (only if still ours). Raises LeaseBusy, running nothing, when another
    holder has the lease.
    """
    lease = Lease(client, lineage, ttl_seconds)
    if not lease.acquire():
        raise LeaseBusy(f"{lineage}: another worker holds the lease")
    claim_running(client, lineage, job_id, ttl_seconds)
    done = threading.Event()
    heart = threading.Thread(
        target=_heartbeat, args=(lease, lineage, job_id, done), name=f"lease-{lineage}", daemon=True
    )
    heart.start()
    try:
        yield lease
    finally:
        done.set()
        heart.join()
        clear_in_flight(client, lineage, job_id)
        lease.release()


def _heartbeat(lease: Lease, lineage: str, job_id: str, done: threading.Event) -> None:
    """Keep the lease and the running marker alive until ``done``."""
    while not done.wait(lease.ttl / 3):
        try:
            # A holder that lost its lease must not overwrite the new holder's marker.
            if lease.renew():
                claim_running(lease.client, lineage, job_id, lease.ttl)
            else:
                log.warning(
                    "%s: the lease of %s was lost; not renewing its marker", lineage, job_id
                )
        except redis.RedisError:  # a broker hiccup: correctness never rests on the lease
            log.warning("%s: lease renewal failed", lineage, exc_info=True)


def lease_held(client: redis.Redis, lineage: str) -> bool:
    return bool(client.exists(f"{PREFIX}:lease:{lineage}"))


def mark_in_flight(client: redis.Redis, lineage: str, job_id: str, ttl_seconds: int) -> bool:
    """Claim the lineage's single in-flight slot for ``job_id``; False if already taken."""
    return bool(client.set(f"{PREFIX}:inflight:{lineage}", job_id, nx=True, ex=ttl_seconds))


def claim_running(client: redis.Redis, lineage: str, job_id: str, ttl_seconds: int) -> None:
    """Mark ``job_id`` as the lineage's running job, for as long as its heartbeat lasts."""
    client.set(f"{PREFIX}:inflight:{lineage}", job_id, ex=ttl_seconds)


def in_flight(client: redis.Redis, lineage: str) -> str | None:
    value = client.get(f"{PREFIX}:inflight:{lineage}")
    return value.decode() if value else None


def clear_in_flight(client: redis.Redis, lineage: str, job_id: str) -> None:
    client.eval(Lease._RELEASE, 1, f"{PREFIX}:inflight:{lineage}", job_id)


def request_cancel(client: redis.Redis, lineage: str, run_id: str, ttl_seconds: int) -> None:
    """Fast path of a cancellation; the durable record is the run object in the store."""
    client.set(f"{PREFIX}:cancel:{lineage}:{run_id}", "1", ex=ttl_seconds)


def cancel_requested(client: redis.Redis, lineage: str, run_id: str) -> bool:
    return bool(client.exists(f"{PREFIX}:cancel:{lineage}:{run_id}"))


def block(client: redis.Redis, lineage: str, reason: str, ttl_seconds: int) -> None:
    client.set(f"{PREFIX}:blocked:{lineage}", reason, ex=ttl_seconds)


def blocked(client: redis.Redis, lineage: str) -> str | None:
    value = client.get(f"{PREFIX}:blocked:{lineage}")
    return value.decode() if value else None
