"""Leases: a per-lineage lock held while a generation runs, with its heartbeat, and the
fleet's reconcile turn.

Owns the lease (``Lease``, ``holding``): held while a generation runs, so a duplicated
message does not run the same life twice. It names its holder
(``worker.fleet.holders``), so the redelivered copy of a job whose pool child was
killed takes over the dead holder's lease at once instead of waiting for it to expire.
While the life runs, the lease's heartbeat renews both the lease and the job's
in-flight marker (``worker.fleet.markers``), so a worker that dies mid-life is noticed
within ``lease_seconds``. The fleet's reconcile turn (``Turn``) is a key of the same
kind: every worker asks for it every reconcile interval, and the one that gets it runs
the pass.

Trusts nothing it reads back (``worker.fleet.redis_keys`` repairs a key of the wrong
type). Correctness never rests on a lease: the compare-and-swap push and the
write-once observation make a lost one harmless.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from worker.fleet.holders import holder_dead, holder_name
from worker.fleet.markers import claim_running, clear_in_flight
from worker.fleet.redis_keys import EXPIRE_IF_HELD, eval_script, get_string, lease_key, turn_key

log = logging.getLogger(__name__)


class Lease:
    """An expiring per-lineage lock; release only removes the holder's own lease."""

    _RELEASE = (
        "if redis.call('get', KEYS[1]) == ARGV[1] then "
        "return redis.call('del', KEYS[1]) end return 0"
    )

    def __init__(self, client: redis.Redis, lineage: str, ttl_seconds: int) -> None:
        self.client = client
        self.key = lease_key(lineage)
        self.ttl = ttl_seconds
        self.token = f"{holder_name()}/{secrets.token_hex(8)}"

    # Repeated after its reply was lost, the take-over finds the lease already its own.
    _TAKE_OVER = (
        "local current = redis.call('get', KEYS[1]) "
        "if current == ARGV[2] then return 1 end "
        "if current == ARGV[1] then "
        "return redis.call('set', KEYS[1], ARGV[2], 'EX', ARGV[3]) end return 0"
    )

    def acquire(self) -> bool:
        """Take the lease if it is free, or if its holder died on this very host."""
        # A key of another type fails no SET NX (it is taken for a holder), but the read
        # below removes it: the lease is then free, and taken if it is still free.
        if self.client.set(self.key, self.token, nx=True, ex=self.ttl):
            return True
        current = get_string(self.client, self.key)
        if current is None:
            return bool(self.client.set(self.key, self.token, nx=True, ex=self.ttl))
        if current == self.token.encode():
            return True  # a retried SET whose first reply was lost had taken it
        if not holder_dead(current.decode(errors="replace")):
            return False
        if not eval_script(self.client, self._TAKE_OVER, [self.key], current, self.token, self.ttl):
            return False
        # The token is anyone's (its start time, and all after its fifth field, are not
        # read by holder_dead): never logged raw.
        log.warning(
            "%s: took over the lease of a dead holder (%r)",
            self.key.rsplit(":", 1)[1],
            current.decode(errors="replace").rsplit("/", 1)[0],
        )
        return True

    def renew(self) -> bool:
        return bool(eval_script(self.client, EXPIRE_IF_HELD, [self.key], self.token, self.ttl))

    def release(self) -> None:
        eval_script(self.client, self._RELEASE, [self.key], self.token)


class Turn:
    """The fleet's reconcile turn: one pass at a time across every worker, one per interval.

    Taken for ``seconds`` and never released: the next turn, by whichever worker asks
    first, comes once it expires. The pass extends it while it runs (``keep``), so a
    slow pass is never joined by a second one; a worker killed mid-pass leaves it to
    expire within ``seconds``.
    """

    _KEEP = (
        "if redis.call('get', KEYS[1]) == ARGV[1] then "
        "return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
    )

    def __init__(self, client: redis.Redis, seconds: float) -> None:
        self.client = client
        self.key = turn_key()
        self.ms = max(1, round(seconds * 1000))
        self.token = f"{holder_name()}/{secrets.token_hex(8)}"

    def take(self) -> bool:
        if self.client.set(self.key, self.token, nx=True, px=self.ms):
            return True
        # A key of another type would keep every worker from its turn for good: the
        # read removes it, and the turn is then free.
        if get_string(self.client, self.key) is None:
            return bool(self.client.set(self.key, self.token, nx=True, px=self.ms))
        return False

    def keep(self) -> None:
        eval_script(self.client, self._KEEP, [self.key], self.token, self.ms)


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
        try:
            clear_in_flight(client, lineage, job_id)
            lease.release()
        except redis.RedisError as exc:
            # The broker is away: both expire within ttl_seconds on their own.
            log.warning("%s: could not release the lease of %s (%s)", lineage, job_id, exc)


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
        except redis.RedisError as exc:  # a broker hiccup: correctness never rests on the lease
            log.warning("%s: lease renewal failed (%s)", lineage, exc)


def lease_held(client: redis.Redis, lineage: str) -> bool:
    # Read, not EXISTS: a key of another type holds no lease, and would keep the
    # reconciler away from the lineage for good.
    return get_string(client, lease_key(lineage)) is not None
