"""A writer of the fleet's Redis who keeps writing a lineage key of another type than
the fleet's string, and one who forges a dead holder's lease.

A key of another type is removed and the command run again (``redis_keys.repairing``).
Whoever keeps writing it (``HSET`` in a loop: it creates the key whenever it is absent,
and fails harmlessly on the fleet's strings) puts it back between the removal and the
second command, which then fails with WRONGTYPE as the first did: the reconciler's
whole pass, the sweep of every lineage's dead holders and ``status`` stop at that one
lineage. ``Contested`` wins that race every time, deterministically: after each command
of the client under attack, it writes the key again if it is absent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from support.fleet import PrivateRedis
from support.rig import Rig, dead_holder, planner_rig, plant_holder

from scheduler.status import FleetClient
from worker.fleet import block_markers, holders, leases, markers, redis_keys

# Full tier: a private redis-server.
pytestmark = pytest.mark.full


class Contested(redis.Redis):
    """A client after each of whose commands an attacker writes each of ``keys`` again as
    a hash, if it is absent: the attacker wins every race between two commands."""

    keys: list[str]
    attacker: redis.Redis

    def execute_command(self, *args: Any, **options: Any) -> Any:
        try:
            return super().execute_command(*args, **options)
        finally:
            for key in self.keys:
                if self.attacker.type(key) == b"none":
                    self.attacker.hset(key, "x", "y")


@pytest.fixture
def attacker(private_redis: PrivateRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(private_redis.url)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
def contested(private_redis: PrivateRedis, attacker: redis.Redis) -> Iterator[Contested]:
    client = Contested.from_url(private_redis.url)
    client.keys, client.attacker = [], attacker
    yield client
    client.close()


@pytest.fixture
def rig(tmp_path: Path, private_redis: PrivateRedis, contested: Contested) -> Rig:
    return planner_rig(tmp_path, private_redis, contested)


LINEAGE = "contested"
CALLS: dict[str, tuple[Callable[[str], str], Callable[[redis.Redis], object]]] = {
    "in_flight": (redis_keys.inflight_key, lambda c: markers.in_flight(c, LINEAGE)),
    "lease_held": (redis_keys.lease_key, lambda c: leases.lease_held(c, LINEAGE)),
    "blocked": (redis_keys.blocked_key, lambda c: block_markers.blocked(c, LINEAGE)),
    "cancel_requested": (
        lambda lineage: redis_keys.cancel_key(lineage, "run1"),
        lambda c: markers.cancel_requested(c, LINEAGE, "run1"),
    ),
    "clear_in_flight": (redis_keys.holder_key, lambda c: markers.clear_in_flight(c, LINEAGE, "j")),
    "keep_marker": (redis_keys.inflight_key, lambda c: markers.keep_marker(c, LINEAGE, "j", 60)),
    "mark_in_flight": (
        redis_keys.inflight_key,
        lambda c: markers.mark_in_flight(c, LINEAGE, "j", 60),
    ),
    "extend_in_flight": (
        redis_keys.inflight_key,
        lambda c: markers.extend_in_flight(c, LINEAGE, "j", 60),
    ),
    "acquire": (redis_keys.lease_key, lambda c: leases.Lease(c, LINEAGE, 60).acquire()),
    "renew": (redis_keys.lease_key, lambda c: leases.Lease(c, LINEAGE, 60).renew()),
    "release": (redis_keys.lease_key, lambda c: leases.Lease(c, LINEAGE, 60).release()),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_key_written_again_between_its_removal_and_the_retry_fails_no_command(
    contested: Contested, call: str, caplog: pytest.LogCaptureFixture
) -> None:
    key_of, command = CALLS[call]
    contested.keys = [key_of(LINEAGE)]
    contested.attacker.hset(key_of(LINEAGE), "x", "y")
    with caplog.at_level(logging.WARNING, logger="worker.fleet"):
        command(contested)  # raised WRONGTYPE: the retry met the hash written again
    assert any(repr(key_of(LINEAGE)) in r.getMessage() for r in caplog.records)


def test_a_contested_marker_does_not_stop_the_reconcilers_pass_nor_status(rig: Rig) -> None:
    # The pass raised WRONGTYPE at the contested lineage: no lineage after it was enqueued.
    planted, _ = rig.lineage("planted")
    neighbour, _ = rig.lineage("neighbour")
    rig.run(planted, 2)
    rig.run(neighbour, 2)
    contested = rig.client
    assert isinstance(contested, Contested)
    contested.keys = [redis_keys.blocked_key(planted)]
    contested.attacker.hset(redis_keys.blocked_key(planted), "x", "y")
    assert neighbour in rig.planner.reconcile()
    scheduler = FleetClient(rig.planner.settings)
    scheduler.planner = rig.planner  # type: ignore[misc]
    assert scheduler.status(planted).blocked is None


def test_a_contested_holder_record_does_not_stop_the_sweep_of_other_lineages(
    contested: Contested,
) -> None:
    # release_dead_holders raised at the contested record: a dead holder's job of any
    # lineage scanned after it stayed held until its marker and lease expired.
    dead = dead_holder()
    lineages = [f"swept-{i}" for i in range(20)]
    for lineage in lineages:
        contested.set(redis_keys.inflight_key(lineage), "job1", ex=600)
        plant_holder(contested, lineage, f"job1 {dead}")
        contested.set(redis_keys.lease_key(lineage), f"{dead}/0123", ex=600)
    # Entered in the host's set as a worker enters its own, its record then a hash.
    plant_holder(contested, "aaa-contested", f"job1 {dead}")
    contested.keys = [redis_keys.holder_key("aaa-contested")]
    contested.attacker.delete(contested.keys[0])
    contested.attacker.hset(contested.keys[0], "x", "y")
    released = markers.release_dead_holders(contested)
    assert sorted(lineage for lineage, _ in released) == sorted(lineages)


def test_a_hosts_set_of_holders_of_another_type_fails_no_sweep_and_the_next_claim_mends_it(
    contested: Contested,
) -> None:
    # The host's set of holders is the one key the fleet writes that is not a string:
    # written as another type, every sweep and every claim on the host would fail.
    here = redis_keys.host_holders_key(holders.this_host())
    contested.attacker.set(here, "not a set")
    assert markers.release_dead_holders(contested) == []
    contested.attacker.delete(here)
    contested.attacker.hset(here, "x", "y")
    lineage = "mended"
    markers.claim_running(contested, lineage, "job1", 600)
    dead = dead_holder()
    contested.set(redis_keys.holder_key(lineage), f"job1 {dead}", ex=600)
    contested.set(redis_keys.lease_key(lineage), f"{dead}/0123", ex=600)
    assert markers.release_dead_holders(contested) == [(lineage, "job1")]


def test_a_forged_dead_holders_lease_writes_no_line_of_its_own_into_the_log(
    contested: Contested, caplog: pytest.LogCaptureFixture
) -> None:
    # holder_dead reads five fields split at ':': the start time may hold a newline and
    # whatever follows the fifth field is ignored, so the take-over's warning, which
    # printed the token raw, carried a forged line into the worker's log.
    host, boot, _pid, _started, pidns = holders.holder_name().split(":")
    forged = f"{host}:{boot}:1:x\nCRITICAL forged line:{pidns}:\nCRITICAL another/0123"
    contested.set(redis_keys.lease_key(LINEAGE), forged, ex=600)
    with caplog.at_level(logging.WARNING, logger="worker.fleet"):
        assert leases.Lease(contested, LINEAGE, 60).acquire()
    messages = [r.getMessage() for r in caplog.records]
    assert messages and all(m.isprintable() for m in messages), messages
