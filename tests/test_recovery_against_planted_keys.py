"""The recovery path against planted keys: what a writer of the broker's Redis, or a slow
sender, can make a worker's recovery machinery do.

Each test stages the keys an attacker (anyone who can reach the fleet's Redis) or a
fault leaves, on a private redis-server (``PrivateRedis``), and runs the worker's own
code on them: ``markers.release_dead_holders``, the main process's watch loop
(``worker.fleet.upkeep.watch_markers``), the planner's ``submit`` and ``reconcile``, and
the scheduler's ``status``. The planner runs on the real repository and file store of
``test_fleet_rules``'s rig. The keys of another Redis type than the fleet writes are
also planted before a real worker (``support.fleet.Worker``) lives the lineage.
"""

from __future__ import annotations

import contextlib
import logging
import re
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from support.fleet import (
    SMALL_PHYSICS,
    Fleet,
    PrivateRedis,
    Worker,
    seed_file,
    wait_for,
)
from support.lives import WRITES_STATE, assert_linear, generations, start
from support.rig import Rig, dead_holder, planner_rig, plant_holder, report

from scheduler.status import FleetClient
from worker.fleet import holders, leases, markers, redis_keys
from worker.fleet.upkeep import watch_markers

# Full tier: a private redis-server and real workers.
pytestmark = pytest.mark.full

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def client(private_redis: PrivateRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(private_redis.url)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def _name(stem: str) -> str:
    return f"{stem}-{secrets.token_hex(6)}"


@pytest.fixture
def rig(tmp_path: Path, private_redis: PrivateRedis, client: redis.Redis) -> Rig:
    return planner_rig(tmp_path, private_redis, client)


def _orphan(client: redis.Redis, lineage: str, job_id: str, holder: str) -> None:
    """The marker, holder record and lease a killed pool child leaves behind."""
    client.set(redis_keys.inflight_key(lineage), job_id, ex=600)
    plant_holder(client, lineage, f"{job_id} {holder}")
    client.set(redis_keys.lease_key(lineage), f"{holder}/0123", ex=600)


def _forged_holder(pid: str) -> str:
    """A holder of this host naming ``pid``: host, boot and the rest, as every lease
    token in Redis discloses them to a reader of Redis."""
    host, boot, _pid, _started, *rest = holders.holder_name().split(":")
    return ":".join([host, boot, pid, "1", *rest])


class Stopped(Exception):
    """Raised into the watch loop, which lets through all but the broker's errors."""


class Sweeper:
    """The worker main process's watch loop, on ``client``, recording what it recovers.

    The loop never returns: ``stop`` ends its thread at its next sweep, so that it
    touches no later test's keys.
    """

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.stopped = threading.Event()
        self.recovered: list[str] = []
        self.thread = threading.Thread(target=self.watch, name="hostile-markers", daemon=True)
        self.thread.start()

    def watch(self) -> None:
        with contextlib.suppress(Stopped):
            watch_markers({}, self.current, self.recovered.append, 600)

    def current(self) -> redis.Redis:
        if self.stopped.is_set():
            raise Stopped
        return self.client

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the watch loop outlived its test"


@pytest.fixture
def sweeper(client: redis.Redis) -> Iterator[Sweeper]:
    running = Sweeper(client)
    yield running
    running.stop()


# -- the main process's watch thread ----------------------------------------------------------


@pytest.mark.parametrize(
    "pid",
    [
        "\u00b2",  # str.isdigit() says yes, int() says no
        "9" * 5000,  # digits, past Python's 4,300-digit limit for int()
    ],
    ids=["superscript-two", "5000-digits"],
)
def test_a_forged_holder_record_does_not_kill_the_watch_thread(
    client: redis.Redis, sweeper: Sweeper, pid: str
) -> None:
    # The sweep dies on the forged record: from then on this worker renews no marker of
    # the jobs it prefetched and releases no dead holder on its host.
    plant_holder(client, "forged", f"job-x {_forged_holder(pid)}")
    real = _name("real")
    time.sleep(2.5)
    _orphan(client, real, "job-1", dead_holder())
    wait_for(lambda: real in sweeper.recovered, 15, "the genuine dead holder's release")
    assert sweeper.thread.is_alive()


def test_a_holder_key_of_another_type_does_not_stop_the_sweep(
    client: redis.Redis, sweeper: Sweeper
) -> None:
    # One key of the wrong type makes every sweep raise WRONGTYPE, which the watch loop
    # swallows: every dead holder on the host is then released without a re-enqueue
    # (or not released at all, depending on the scan's order), silently, for good.
    plant_holder(client, "forged", "job-x")
    client.delete(redis_keys.holder_key("forged"))
    client.hset(redis_keys.holder_key("forged"), "a", "b")
    real = _name("real")
    _orphan(client, real, "job-1", dead_holder())
    wait_for(lambda: real in sweeper.recovered, 15, "the genuine dead holder's release")


def test_a_hostile_lineage_name_in_a_holder_key_is_neither_logged_raw_nor_recovered(
    client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # The lineage comes from the key's name, unchecked: a newline forges log lines, an
    # escape sequence reaches the operator's terminal, and the name goes on to the
    # planner (whose store refuses it with a ValueError that the recovery thread's
    # future swallows, unlogged).
    hostile = "x\n[2026-01-01 00:00:00,000: CRITICAL/MainProcess] forged\x1b[2J"
    dead = dead_holder()
    plant_holder(client, hostile, f"job-1 {dead}")
    with caplog.at_level(logging.WARNING, logger="worker.fleet"):
        released = markers.release_dead_holders(client)
    assert all(lineage != hostile for lineage, _ in released)
    for record in caplog.records:
        assert "\n" not in record.getMessage() and "\x1b" not in record.getMessage()
    here = redis_keys.host_holders_key(holders.this_host())
    assert client.zscore(here, hostile) is None


def test_the_sweep_reads_its_hosts_own_holders_and_never_walks_the_keyspace(
    client: redis.Redis,
) -> None:
    # Each host walked the whole keyspace every second, reading every host's holder
    # records: a cost that grew with the square of the fleet (bench/bench_holder_sweep.py).
    far = "another-host:" + dead_holder().split(":", 1)[1]
    with client.pipeline(transaction=False) as pipe:
        for n in range(2000):
            pipe.set(redis_keys.holder_key(f"far-{n}"), f"job-1 {far}", ex=600)
        pipe.execute()
    real = _name("real")
    _orphan(client, real, "job-1", dead_holder())
    client.config_resetstat()
    assert markers.release_dead_holders(client) == [(real, "job-1")]
    stats = client.info("commandstats")
    assert "cmdstat_scan" not in stats and "cmdstat_keys" not in stats, stats
    # Read the set, read its records, release, forget: a handful, whatever the keyspace.
    assert sum(int(each["calls"]) for each in stats.values()) < 30, stats


# -- holders this host cannot see ----------------------------------------------------------------


def test_a_live_holder_in_another_pid_namespace_of_this_host_keeps_its_lease(
    client: redis.Redis, private_redis: PrivateRedis
) -> None:
    # Two workers with one hostname and one kernel but two pid namespaces (containers on
    # the host's network or UTS namespace; a systemd unit with PrivatePIDs=): each reads
    # the other's holders as dead, takes over or releases the lease of a life that still
    # runs, and the lineage's job is sent again: two lives of one generation at once.
    lineage = _name("elsewhere")
    holder = (
        "import sys, time, redis\n"
        "from worker.fleet import leases\n"
        "client = redis.Redis.from_url(sys.argv[1])\n"
        "with leases.holding(client, sys.argv[2], 'job-1', 600):\n"
        "    print('holding', flush=True)\n"
        "    time.sleep(120)\n"
    )
    process = subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc",
         sys.executable, "-c", holder, private_redis.url, lineage],
        cwd=REPO,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == b"holding\n"
        token = client.get(redis_keys.lease_key(lineage))
        assert token is not None and token.decode().startswith(socket.gethostname() + ":")
        markers.release_dead_holders(client)
        assert client.get(redis_keys.lease_key(lineage)) == token
        assert not leases.Lease(client, lineage, 600).acquire()
    finally:
        process.kill()
        process.wait()


# -- commands repeated or delayed ----------------------------------------------------------------


def test_the_take_over_of_a_dead_holders_lease_is_safe_to_repeat(client: redis.Redis) -> None:
    # A worker's client repeats a command whose reply was lost. Repeated, the take-over
    # script answers 0: acquire() says LeaseBusy to a job that holds the lease, which then
    # stays held, by nobody running, for lease_seconds.
    lineage = _name("retaken")
    dead = f"{dead_holder()}/0123"
    lease = leases.Lease(client, lineage, 600)
    client.set(lease.key, dead, ex=600)
    assert client.eval(lease._TAKE_OVER, 1, lease.key, dead, lease.token, lease.ttl)
    assert client.eval(lease._TAKE_OVER, 1, lease.key, dead, lease.token, lease.ttl)


def test_a_job_that_ends_before_its_sender_extends_its_claim_leaves_the_lineage_free(
    rig: Rig,
) -> None:
    # submit() claims the slot for a lease, sends, then claims it again for the in-flight
    # TTL with the same claim-or-extend script. If the job is fetched and ends (a stale or
    # duplicate job ends in milliseconds) before that second command lands (a sender
    # descheduled on a busy host, or its reply lost and the command retried), the claim
    # is made anew for a job that is over: nothing is in flight, yet the reconciler and
    # every follow-up stay away for inflight_ttl_seconds (an hour by default).
    lineage, _ = rig.lineage("quick")
    rig.run(lineage, 3)
    sent: Callable[..., None] = rig.planner.send

    def send_then_a_worker_lives_it(*call: object) -> None:
        sent(*call)
        job_id = str(call[1])
        with leases.holding(rig.client, lineage, job_id, 30):
            pass  # fetched, found stale: the holding's exit clears the marker

    rig.planner.send = send_then_a_worker_lives_it
    assert rig.planner.enqueue(lineage) is not None
    assert markers.in_flight(rig.client, lineage) is None
    rig.planner.send = sent
    assert rig.planner.enqueue(lineage) is not None


# -- keys of another Redis type -----------------------------------------------------------------
#
# Every key of a lineage holds a string. Anyone who reaches Redis can put a list, a hash
# or a set under one of their names instead: then every GET and every script on it
# failed with WRONGTYPE, for good (nothing the fleet writes expires it), and the
# reconciler's whole pass, ``status`` and the worker's task with it.

PLANTS: dict[str, Callable[[redis.Redis, str], object]] = {
    "list": lambda client, key: client.rpush(key, "x"),
    "hash": lambda client, key: client.hset(key, "a", "b"),
    "set": lambda client, key: client.sadd(key, "x"),
}


# The lineage's keys that ``run`` reads before it enqueues the run's first job.
MARKERS: dict[str, Callable[[str], str]] = {
    "inflight": redis_keys.inflight_key,
    "lease": redis_keys.lease_key,
    "blocked": redis_keys.blocked_key,
}


@pytest.fixture(params=sorted(PLANTS))
def plant(request: pytest.FixtureRequest) -> Callable[[redis.Redis, str], None]:
    """Put a key of one type the fleet never writes (each in turn) in place of a key."""

    def planted(client: redis.Redis, key: str) -> None:
        client.delete(key)
        PLANTS[request.param](client, key)

    return planted


def removed_and_named(client: redis.Redis, key: str, caplog: pytest.LogCaptureFixture) -> None:
    """``key`` is no longer of another type than a string, and a warning named it by repr."""
    assert client.type(key) in (b"none", b"string")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(repr(key) in message for message in warnings), warnings


@pytest.mark.parametrize(
    "key_of",
    [redis_keys.inflight_key, redis_keys.lease_key, redis_keys.blocked_key],
    ids=["inflight", "lease", "blocked"],
)
def test_a_marker_of_another_type_neither_stops_the_reconciler_nor_keeps_its_lineage_waiting(
    rig: Rig,
    plant: Callable[[redis.Redis, str], None],
    key_of: Callable[[str], str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # WRONGTYPE from the in-flight or blocked marker raised out of the whole pass, so no
    # lineage at all was re-enqueued; a lease of another type read as held, for good.
    planted, _ = rig.lineage("planted")
    neighbour, _ = rig.lineage("neighbour")
    rig.run(planted, 2)
    rig.run(neighbour, 2)
    plant(rig.client, key_of(planted))
    with caplog.at_level(logging.WARNING, logger="worker.fleet"):
        assert sorted(rig.planner.reconcile()) == sorted([planted, neighbour])
    removed_and_named(rig.client, key_of(planted), caplog)
    sent = {job.lineage: job_id for job, job_id, *_ in rig.sent.calls}
    assert markers.in_flight(rig.client, planted) == sent[planted]
    assert rig.planner.reconcile() == []  # and now the lineage has its job in flight


@pytest.mark.parametrize(
    "key_of", [redis_keys.inflight_key, redis_keys.blocked_key], ids=["inflight", "blocked"]
)
def test_status_reads_a_marker_of_another_type_as_absent(
    rig: Rig,
    plant: Callable[[redis.Redis, str], None],
    key_of: Callable[[str], str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    lineage, _ = rig.lineage("shown")
    rig.run(lineage, 2)
    plant(rig.client, key_of(lineage))
    with caplog.at_level(logging.WARNING, logger="worker.fleet"):
        row = FleetClient(rig.planner.settings).status(lineage)
    assert (row.in_flight, row.blocked) == (None, None)
    assert row.target == 2
    removed_and_named(rig.client, key_of(lineage), caplog)


def test_a_lease_of_another_type_is_taken_and_released_by_the_job_that_lives_the_lineage(
    client: redis.Redis,
    plant: Callable[[redis.Redis, str], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    lineage = _name("leased")
    plant(client, redis_keys.lease_key(lineage))
    lived = False
    with (
        caplog.at_level(logging.WARNING, logger="worker.fleet"),
        leases.holding(client, lineage, "job-1", 30) as lease,
    ):
        lived = True
        assert client.get(lease.key) == lease.token.encode()
        assert markers.in_flight(client, lineage) == "job-1"
    assert lived
    assert not leases.lease_held(client, lineage)
    assert markers.in_flight(client, lineage) is None
    removed_and_named(client, redis_keys.lease_key(lineage), caplog)


@pytest.mark.parametrize(
    "key_of", [redis_keys.inflight_key, redis_keys.holder_key], ids=["inflight", "holder"]
)
def test_a_marker_or_holder_record_of_another_type_does_not_fail_clearing_the_marker(
    client: redis.Redis,
    plant: Callable[[redis.Redis, str], None],
    key_of: Callable[[str], str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The worker clears its job's marker as it drops a cancelled job and as a life ends.
    lineage = _name("cleared")
    client.set(redis_keys.inflight_key(lineage), "job-1", ex=600)
    client.set(redis_keys.holder_key(lineage), f"job-1 {holders.holder_name()}", ex=600)
    plant(client, key_of(lineage))
    with caplog.at_level(logging.WARNING, logger="worker.fleet"):
        markers.clear_in_flight(client, lineage, "job-1")
    assert not client.exists(redis_keys.inflight_key(lineage), redis_keys.holder_key(lineage))
    removed_and_named(client, key_of(lineage), caplog)


def test_a_fetched_jobs_marker_of_another_type_is_removed_not_kept(
    client: redis.Redis,
    plant: Callable[[redis.Redis, str], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The worker's main process keeps the marker of each job it fetched; the job's own
    # marker is gone, so there is none of it to keep, and the lineage is free again.
    lineage = _name("kept")
    plant(client, redis_keys.inflight_key(lineage))
    with caplog.at_level(logging.WARNING, logger="worker.fleet"):
        assert not markers.keep_marker(client, lineage, "job-1", 600)
    assert markers.in_flight(client, lineage) is None
    removed_and_named(client, redis_keys.inflight_key(lineage), caplog)


@pytest.mark.parametrize(
    "key_of", [redis_keys.inflight_key, redis_keys.lease_key], ids=["inflight", "lease"]
)
def test_a_dead_holders_job_is_released_whole_beside_a_marker_or_lease_of_another_type(
    client: redis.Redis,
    plant: Callable[[redis.Redis, str], None],
    key_of: Callable[[str], str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The release script removed the holder record, then failed on the other key: the
    # job was never reported released (nobody re-enqueued it), and its lease stayed.
    lineage = _name("orphan")
    _orphan(client, lineage, "job-1", dead_holder())
    plant(client, key_of(lineage))
    with caplog.at_level(logging.WARNING, logger="worker.fleet"):
        assert (lineage, "job-1") in markers.release_dead_holders(client)
    for key in (redis_keys.inflight_key, redis_keys.holder_key, redis_keys.lease_key):
        assert not client.exists(key(lineage))
    removed_and_named(client, key_of(lineage), caplog)


def test_a_cancel_flag_of_another_type_does_not_end_the_run(
    rig: Rig, plant: Callable[[redis.Redis, str], None], caplog: pytest.LogCaptureFixture
) -> None:
    # It read as a cancellation: the run's follow-ups were never sent, and the worker
    # dropped every job of the run unrun (then sent the next, and dropped it, again).
    job, commit = rig.first_generation("flagged", 3)
    assert job.run_id is not None
    key = redis_keys.cancel_key(job.lineage, job.run_id)
    plant(rig.client, key)
    with caplog.at_level(logging.WARNING, logger="worker.fleet"):
        assert not markers.cancel_requested(rig.client, job.lineage, job.run_id)
        follow = rig.planner.follow_up(job, report(job, 1, commit, "0.10"))
    assert follow is not None and follow.expected_commit == commit
    removed_and_named(rig.client, key, caplog)


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
# Over the default 120 s: a real worker boots and lives the lineage's generations.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", [*MARKERS, "cancel"])
def test_a_real_worker_lands_each_generation_once_beside_a_key_of_another_type(
    tmp_path: Path,
    private_redis: PrivateRedis,
    client: redis.Redis,
    workers: list[Worker],
    kind: str,
) -> None:
    # The markers are planted before ``run`` enqueues the run's first job, the cancel
    # flag (named after the run) before the worker fetches it.
    fleet = Fleet(
        tmp_path,
        OUROBOROS_BROKER_URL=private_redis.url,
        OUROBOROS_LEASE_SECONDS="6",
        OUROBOROS_SPOOL_RETRY_SECONDS="1",
    )
    lineage = "planted"
    fleet.ok("init", lineage, "--seed", str(seed_file(fleet.home, WRITES_STATE)), *SMALL_PHYSICS)
    if kind in MARKERS:
        key = MARKERS[kind](lineage)
        client.hset(key, "a", "b")
    ran = fleet.ok("run", lineage, "--generations", "2")
    if kind == "cancel":
        run_id = re.search(r"run (\S+): ", ran.stdout)
        assert run_id is not None, ran.stdout
        key = redis_keys.cancel_key(lineage, run_id.group(1))
        client.hset(key, "a", "b")
    worker = start(fleet, workers, "w1")
    wait_for(lambda: len(generations(fleet, lineage)) == 2, 240, "both generations")
    wait_for(lambda: fleet.observation_numbers(lineage) == [1, 2], 60, "their observations")
    assert_linear(fleet, lineage, 2)
    # Who met the key says so: the scheduler's ``run`` for a marker, the worker for the flag.
    said = worker.text() if kind == "cancel" else ran.stderr
    assert f"removed a key of a type the fleet never writes: {key!r}" in said, said
    assert "Traceback" not in worker.text()
