"""The hand-over of a job from its sender to the life that lives it, killed at each step.

The pre-receipt kill, the one that left a lineage claimed for an hour: a kombu consumer
takes the message off the queue and dies in the callback where Celery would run its
``task_received`` handler (the message in kombu's ``unacked`` hash, no holder record
yet). Repeated 20 times in a row against the planner's reconcile pass on a private
Redis, each freed after the lease and not before.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest
import redis
from lineage_support import PrivateRedis, wait_for
from test_fleet_rules import Rig

from worker.fleet import leases
from worker.fleet.app import client_app, sender, unacked_keys
from worker.fleet.assembly import lineage_cache, observation_store
from worker.fleet.planner import Planner
from worker.fleet.runs import queue_of
from worker.fleet.settings import Settings

pytestmark = [pytest.mark.bwrap, pytest.mark.cgroups, pytest.mark.root, pytest.mark.timeout(900)]

RECONCILE = 1

# A consumer of one queue through kombu's own Redis transport, as a worker's main process
# consumes it (prefetch 1, acknowledged late): it takes one message and is SIGKILLed in
# the callback, where Celery would run task_received. kombu has already moved the message
# into its unacked hash; nothing else has been written.
GRABBER = """
import os, signal, sys
from kombu import Connection, Consumer, Exchange, Queue
from worker.fleet.settings import Settings

name = sys.argv[1]
queue = Queue(name, Exchange(name, type="direct"), routing_key=name)

def taken(body, message):
    print(message.headers["id"], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

with Connection(Settings().broker) as connection:
    with Consumer(connection, [queue], callbacks=[taken], accept=["json"], prefetch_count=1):
        while True:
            connection.drain_events(timeout=120)
"""


def grab(env: dict[str, str], cwd: Path, queue: str) -> str:
    """A kombu consumer takes the next message of ``queue`` and is killed holding it;
    the task id it took."""
    done = subprocess.run(
        [sys.executable, "-c", GRABBER, queue],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    return done.stdout.strip()


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path / "redis")
    yield server
    server.stop()


def test_a_job_whose_fetcher_died_before_registering_it_is_planned_again_after_the_lease(
    tmp_path: Path, broker: PrivateRedis
) -> None:
    """Twenty pre-receipt kills in a row, each freed by the reconcile pass within the lease
    and one interval, never before the lease, each leaving one job queued."""
    lease = 3
    settings = Settings(
        home=tmp_path / "home",
        broker_url=broker.url,
        lease_seconds=lease,
        visibility_timeout_seconds=7200,
        inflight_ttl_seconds=3600,
    )
    app = client_app(settings)
    client = redis.Redis.from_url(broker.url)
    planner = Planner(
        settings=settings,
        store=observation_store(settings),
        cache=lineage_cache(settings, "scheduler"),
        client=client,
        send=sender(app),
        unacked=lambda: unacked_keys(app),
    )
    rig = Rig(planner=planner, sent=None, client=client, name=lambda stem: stem)  # type: ignore[arg-type]
    lineage, meta = rig.lineage("grabbed")
    planner.start_run(lineage, rig.head(lineage), 1, "scripted", None, Decimal("1"))
    assert planner.enqueue(lineage) is not None
    queue = queue_of(meta)
    env = {**os.environ, "OUROBOROS_BROKER_URL": broker.url, "OUROBOROS_HOME": str(tmp_path)}
    unacked = unacked_keys(app)
    assert (unacked.hash, unacked.index) == ("unacked", "unacked_index")
    for _ in range(20):
        job_id = grab(env, tmp_path, queue)
        killed = time.monotonic()
        assert leases.in_flight(client, lineage) == job_id
        assert client.hlen(unacked.hash) == 1
        # A live fetcher registers its job within a moment: within the lease, it is left be.
        assert planner.reconcile() == []
        assert leases.in_flight(client, lineage) == job_id

        def planned_again() -> bool:
            time.sleep(RECONCILE)
            return planner.reconcile() == [lineage]

        wait_for(planned_again, lease + RECONCILE + 5, "the lineage to be planned again", 0)
        assert time.monotonic() - killed < lease + RECONCILE + 2
        assert leases.in_flight(client, lineage) not in (None, job_id)
        assert client.hlen(unacked.hash) == 0
        assert client.zcard(unacked.index) == 0
        queued = [key for key in client.keys(f"{queue}*") if client.type(key) == b"list"]
        assert sum(client.llen(key) for key in queued) == 1


def test_an_unacked_job_whose_holder_registered_it_is_never_taken_from_it(
    tmp_path: Path, broker: PrivateRedis
) -> None:
    settings = Settings(home=tmp_path / "home", broker_url=broker.url, lease_seconds=3)
    app = client_app(settings)
    client = redis.Redis.from_url(broker.url)
    planner = Planner(
        settings=settings,
        store=observation_store(settings),
        cache=lineage_cache(settings, "scheduler"),
        client=client,
        send=sender(app),
        unacked=lambda: unacked_keys(app),
    )
    rig = Rig(planner=planner, sent=None, client=client, name=lambda stem: stem)  # type: ignore[arg-type]
    lineage, meta = rig.lineage("held")
    planner.start_run(lineage, rig.head(lineage), 1, "scripted", None, Decimal("1"))
    planner.enqueue(lineage)
    env = {**os.environ, "OUROBOROS_BROKER_URL": broker.url, "OUROBOROS_HOME": str(tmp_path)}
    job_id = grab(env, tmp_path, queue_of(meta))
    # As a live worker's task_received leaves it: the holder record names the job.
    leases.keep_marker(client, lineage, job_id, 600)
    # And garbage beside it, as anyone who reaches Redis may write into unacked.
    client.hset("unacked", "forged", b"not json")
    client.zadd("unacked_index", {"forged": 0})
    time.sleep(4)
    assert planner.reconcile() == []
    assert leases.in_flight(client, lineage) == job_id
    assert client.hlen("unacked") == 2
