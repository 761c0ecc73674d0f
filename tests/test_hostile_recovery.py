"""Hostile review of the recovery path: what a writer of the broker's Redis, or a slow
sender, can make a worker's recovery machinery do.

Each test stages the keys an attacker (anyone who can reach the fleet's Redis) or a
fault leaves, on a private redis-server (``PrivateRedis``), and runs the worker's own
code on them: ``leases.release_dead_holders``, the main process's watch loop
(``worker.fleet.tasks._watch_markers``) and the planner's ``submit``. The planner runs
on the real repository and file store of ``test_fleet_rules``'s rig.
"""

from __future__ import annotations

import logging
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
from lineage_support import PrivateRedis, free_port, wait_for
from test_fleet_rules import Rig, Sent, _dead_holder

from worker.fleet import leases
from worker.fleet.assembly import lineage_cache, observation_store
from worker.fleet.planner import Planner
from worker.fleet.settings import Settings
from worker.fleet.tasks import _watch_markers

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedis]:
    private = PrivateRedis(tmp_path_factory.mktemp("hostile-redis"))
    yield private
    private.stop()


@pytest.fixture
def client(server: PrivateRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(server.url)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def _name(stem: str) -> str:
    return f"{stem}-{secrets.token_hex(6)}"


@pytest.fixture
def rig(tmp_path: Path, server: PrivateRedis, client: redis.Redis) -> Rig:
    settings = Settings(
        home=tmp_path / "home",
        broker_url=server.url,
        visibility_timeout_seconds=7200,
        inflight_ttl_seconds=3600,
    )
    planner = Planner(
        settings=settings,
        store=observation_store(settings),
        cache=lineage_cache(settings, "scheduler"),
        client=client,
        send=Sent(),
    )
    return Rig(planner=planner, sent=planner.send, client=client, name=_name)  # type: ignore[arg-type]


def _orphan(client: redis.Redis, lineage: str, job_id: str, holder: str) -> None:
    """The marker, holder record and lease a killed pool child leaves behind."""
    client.set(f"{leases.PREFIX}:inflight:{lineage}", job_id, ex=600)
    client.set(f"{leases.PREFIX}:holder:{lineage}", f"{job_id} {holder}", ex=600)
    client.set(f"{leases.PREFIX}:lease:{lineage}", f"{holder}/0123", ex=600)


def _forged_holder(pid: str) -> str:
    """A holder of this host naming ``pid``: host, boot and the rest, as every lease
    token in Redis discloses them to a reader of Redis."""
    host, boot, _pid, _started, *rest = leases.holder_name().split(":")
    return ":".join([host, boot, pid, "1", *rest])


class Sweeper:
    """The worker main process's watch loop, on ``client``, recording what it recovers.

    The loop never returns: ``stop`` points it at a port nobody listens on, where every
    sweep fails at once, so that it touches no later test's keys.
    """

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.recovered: list[str] = []
        self.thread = threading.Thread(
            target=_watch_markers,
            args=({}, lambda: self.client, self.recovered.append, 600),
            name="hostile-markers",
            daemon=True,
        )
        self.thread.start()

    def stop(self) -> None:
        self.client = redis.Redis(port=free_port(), socket_connect_timeout=1)


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
    client.set(f"{leases.PREFIX}:holder:forged", f"job-x {_forged_holder(pid)}", ex=600)
    real = _name("real")
    time.sleep(2.5)
    _orphan(client, real, "job-1", _dead_holder())
    wait_for(lambda: real in sweeper.recovered, 15, "the genuine dead holder's release")
    assert sweeper.thread.is_alive()


def test_a_holder_key_of_another_type_does_not_stop_the_sweep(
    client: redis.Redis, sweeper: Sweeper
) -> None:
    # One key of the wrong type makes every sweep raise WRONGTYPE, which the watch loop
    # swallows: every dead holder on the host is then released without a re-enqueue
    # (or not released at all, depending on the scan's order), silently, for good.
    client.hset(f"{leases.PREFIX}:holder:forged", "a", "b")
    real = _name("real")
    _orphan(client, real, "job-1", _dead_holder())
    wait_for(lambda: real in sweeper.recovered, 15, "the genuine dead holder's release")


def test_a_hostile_lineage_name_in_a_holder_key_is_neither_logged_raw_nor_recovered(
    client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # The lineage comes from the key's name, unchecked: a newline forges log lines, an
    # escape sequence reaches the operator's terminal, and the name goes on to the
    # planner (whose store refuses it with a ValueError that the recovery thread's
    # future swallows, unlogged).
    hostile = "x\n[2026-01-01 00:00:00,000: CRITICAL/MainProcess] forged\x1b[2J"
    dead = _dead_holder()
    client.set(f"{leases.PREFIX}:holder:{hostile}", f"job-1 {dead}", ex=600)
    with caplog.at_level(logging.WARNING, logger="ouroboros.worker"):
        released = leases.release_dead_holders(client)
    assert all(lineage != hostile for lineage, _ in released)
    for record in caplog.records:
        assert "\n" not in record.getMessage() and "\x1b" not in record.getMessage()


# -- holders this host cannot see ----------------------------------------------------------------


def test_a_live_holder_in_another_pid_namespace_of_this_host_keeps_its_lease(
    client: redis.Redis, server: PrivateRedis
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
         sys.executable, "-c", holder, server.url, lineage],
        cwd=REPO,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == b"holding\n"
        token = client.get(f"{leases.PREFIX}:lease:{lineage}")
        assert token is not None and token.decode().startswith(socket.gethostname() + ":")
        leases.release_dead_holders(client)
        assert client.get(f"{leases.PREFIX}:lease:{lineage}") == token
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
    dead = f"{_dead_holder()}/0123"
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
    assert leases.in_flight(rig.client, lineage) is None
    rig.planner.send = sent
    assert rig.planner.enqueue(lineage) is not None
