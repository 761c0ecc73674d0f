"""The fleet under single faults, each forced at its exact instant, with real workers.

One test per fault the chaos soak (``bench/soak.py``) injects at random: a worker
killed between fetching a job and starting it (within the lease, and released at once
by the worker restarted on its host), a whole worker killed mid-life (released the
same way), a pool child killed mid-life, a Redis restart with and without its data,
and garbage on every queue a worker consumes, published the way a real client reaches
the queue, every shape to one worker that must serve on through all of them (the store
outage is in ``tests/test_fleet.py``). Each checks the recovery
comes within ``OUROBOROS_LEASE_SECONDS`` plus one reconcile interval (with generous
margins: never a timing assertion), and the durable records after it. Also: the
queues' bindings as ``inspect`` reports them, and Flower, run as the compose file runs
it, listing the fleet's workers and tasks through its HTTP API.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import redis
from support.fleet import (
    SMALL_PHYSICS,
    Fleet,
    PrivateRedis,
    Worker,
    free_port,
    seed_file,
    task_envelope,
    wait_for,
)
from support.lives import SLOW, WRITES_STATE, assert_linear, background, generations, start

# Over the default 120 s: each fault is a worker, the broker or the store killed
# mid-life, and the recovery waits out leases and restarts with real lives.
pytestmark = [pytest.mark.bwrap, pytest.mark.cgroups, pytest.mark.root, pytest.mark.timeout(600)]

LEASE = 6
RECONCILE = 1
# Beyond lease + one reconcile interval: a worker's start-up, a life and its publication
# on a loaded 2-core machine. The broken behaviours wait an hour or forever.
MARGIN = 90


def queue_of(fleet: Fleet, lineage: str) -> str:
    meta = json.loads(fleet.show(lineage, ".ouroboros-lineage.json"))
    return "gen." + meta["instrument_fingerprint"][:12]


def test_worker_killed_between_fetch_and_claim_is_recovered_within_the_lease(
    fleet: Fleet, workers: list[Worker]
) -> None:
    fleet.ok("init", "fetched", "--seed", str(seed_file(fleet.home, WRITES_STATE)), *SMALL_PHYSICS)
    victim = start(fleet, workers, "victim")
    # A stopped pool child cannot claim the job the main process fetches for it.
    for child in victim.pool_children():
        os.kill(child, signal.SIGSTOP)
    client = redis.Redis.from_url(fleet.env["OUROBOROS_BROKER_URL"])
    fleet.ok("run", "fetched", "--generations", "1")
    wait_for(lambda: client.hlen("unacked") == 1, 60, "the worker to fetch the job")
    marker = "ouroboros:inflight:fetched"
    wait_for(lambda: 0 < client.ttl(marker) <= LEASE, 10, "the fetched job's marker to be leased")
    assert not client.exists("ouroboros:lease:fetched")
    victim.kill()
    killed = time.monotonic()
    start(fleet, workers, "heir")
    reconciler = background(fleet, "reconcile", "--loop")
    try:
        wait_for(lambda: generations(fleet, "fetched"), LEASE + RECONCILE + MARGIN, "generation 1")
        wait_for(lambda: fleet.observation_numbers("fetched") == [1], 60, "its observation")
    finally:
        reconciler.kill()
        reconciler.wait()
    assert time.monotonic() - killed < LEASE + RECONCILE + MARGIN
    assert_linear(fleet, "fetched", 1)


def patient_fleet(tmp_path: Path, redis_url: str) -> Fleet:
    """A fleet whose leases and markers outlive any test: only a release can recover it."""
    return Fleet(
        tmp_path,
        OUROBOROS_BROKER_URL=redis_url,
        OUROBOROS_LEASE_SECONDS="600",
        OUROBOROS_SPOOL_RETRY_SECONDS="1",
        OUROBOROS_RECONCILE_INTERVAL_SECONDS=str(RECONCILE),
    )


def heir_releases(fleet: Fleet, workers: list[Worker], lineage: str, timeout: float) -> None:
    """A worker restarted on the dead one's host, and no reconciler process: ``lineage``
    lands its generation 1 far within the 600 s marker and lease, because the heir saw
    its predecessor dead, released its job and enqueued the lineage's next one itself."""
    heir = start(fleet, workers, "heir")
    wait_for(lambda: generations(fleet, lineage), timeout, "generation 1")
    wait_for(lambda: fleet.observation_numbers(lineage) == [1], 60, "its observation")
    assert_linear(fleet, lineage, 1)
    assert f"released job {lineage}." in heir.text()
    # Re-enqueued by the heir itself: right after the release, or by its reconcile turn
    # when that pass came between the release and the recovery.
    assert (
        f"{lineage}: re-enqueued after its holder died" in heir.text()
        or f"reconcile turn: re-enqueued {lineage}" in heir.text()
    )


def test_a_job_fetched_by_a_killed_worker_is_released_by_the_worker_restarted_on_its_host(
    tmp_path: Path, redis_url: str, workers: list[Worker]
) -> None:
    fleet = patient_fleet(tmp_path, redis_url)
    fleet.ok("init", "fetched", "--seed", str(seed_file(fleet.home, WRITES_STATE)), *SMALL_PHYSICS)
    victim = start(fleet, workers, "victim")
    for child in victim.pool_children():
        os.kill(child, signal.SIGSTOP)
    client = redis.Redis.from_url(redis_url)
    fleet.ok("run", "fetched", "--generations", "1")
    holder = "ouroboros:holder:fetched"
    record = wait_for(lambda: client.get(holder), 60, "the fetcher to hold the job's marker")
    assert f":{victim.process.pid}:" in record.decode()
    victim.kill()
    heir_releases(fleet, workers, "fetched", 120)


def test_a_life_whose_whole_worker_was_killed_is_released_by_the_worker_restarted_on_its_host(
    tmp_path: Path, redis_url: str, workers: list[Worker]
) -> None:
    fleet = patient_fleet(tmp_path, redis_url)
    seed = seed_file(fleet.home, SLOW.format(seconds=30) + WRITES_STATE)
    fleet.ok("init", "felled", "--seed", str(seed), *SMALL_PHYSICS)
    victim = start(fleet, workers, "victim")
    client = redis.Redis.from_url(redis_url)
    fleet.ok("run", "felled", "--generations", "1")
    token = wait_for(lambda: client.get("ouroboros:lease:felled"), 60, "the life to start")
    (child,) = victim.pool_children()
    assert f":{child}:" in token.decode()
    # Main process and pool child at once: no redelivery can come, only the 600 s lease.
    victim.kill()
    heir_releases(fleet, workers, "felled", 180)


def test_a_killed_pool_child_is_recovered_by_its_own_worker(
    tmp_path: Path, redis_url: str, workers: list[Worker]
) -> None:
    # A long lease and no reconciler: only the worker whose child died can land it.
    fleet = Fleet(tmp_path, OUROBOROS_BROKER_URL=redis_url, OUROBOROS_LEASE_SECONDS="600")
    seed = seed_file(fleet.home, SLOW.format(seconds=3) + WRITES_STATE)
    fleet.ok("init", "orphan", "--seed", str(seed), *SMALL_PHYSICS)
    worker = start(fleet, workers, "w1")
    client = redis.Redis.from_url(redis_url)
    fleet.ok("run", "orphan", "--generations", "1")
    holder = wait_for(lambda: client.get("ouroboros:lease:orphan"), 60, "the life to start")
    (child,) = worker.pool_children()
    assert f":{child}:" in holder.decode()
    os.kill(child, signal.SIGKILL)
    wait_for(lambda: generations(fleet, "orphan"), 180, "generation 1 to land")
    wait_for(lambda: fleet.observation_numbers("orphan") == [1], 60, "its observation")
    assert_linear(fleet, "orphan", 1)
    # Two ways back, whichever comes first: the worker's sweep releases the dead child's
    # lease and enqueues the lineage's next job (the requeued message then finds the
    # lineage moved on), or the message Celery requeues takes the dead holder's lease
    # over (and the sweep finds a living holder). Either way one life lands.
    log = worker.text()
    if "released job orphan." in log:
        wait_for(lambda: "'stale'" in worker.text(), 60, "the other copy to find it stale")
    else:
        assert "took over the lease of a dead holder" in log


@pytest.mark.parametrize(
    ("appendonly", "restarts"),
    [(True, 1), (False, 1), (True, 2)],
    ids=["aof", "data-lost", "twice"],
)
def test_a_life_in_flight_when_redis_restarts_lands_once(
    tmp_path: Path, workers: list[Worker], appendonly: bool, restarts: int
) -> None:
    server = PrivateRedis(tmp_path / "redis", appendonly=appendonly)
    # No reconciler and a lease that outlives the test: the life that lands while Redis
    # is away must release its lease and send its follow-up itself, once Redis is back.
    fleet = Fleet(
        tmp_path,
        OUROBOROS_BROKER_URL=server.url,
        OUROBOROS_LEASE_SECONDS="600",
        OUROBOROS_SPOOL_RETRY_SECONDS="1",
    )
    try:
        seed = seed_file(fleet.home, SLOW.format(seconds=8) + WRITES_STATE)
        fleet.ok("init", "blip", "--seed", str(seed), *SMALL_PHYSICS)
        worker = start(fleet, workers, "w1")
        client = redis.Redis.from_url(server.url)
        fleet.ok("run", "blip", "--generations", "2")
        wait_for(lambda: client.exists("ouroboros:lease:blip"), 60, "the life to start")
        for restart in range(1, restarts + 1):
            server.kill()
            if restart < restarts:
                time.sleep(2)  # the worker sees the broker gone before it returns
            else:
                # Generation 1 lands while Redis is away (its push needs no Redis); the
                # lease's release and the follow-up after it must wait for Redis's return.
                wait_for(lambda: generations(fleet, "blip"), 60, "generation 1 to land")
                time.sleep(1)
            server.start()
            # A second loss comes while the worker holds the job it fetched before the first.
            wait_for(
                lambda n=restart: worker.text().count("Connected to redis") > n,
                60,
                "the worker to reconnect",
            )
        wait_for(lambda: len(generations(fleet, "blip")) == 2, 180, "both generations")
        wait_for(lambda: fleet.observation_numbers("blip") == [1, 2], 60, "their observations")
        assert_linear(fleet, "blip", 2)
        assert fleet.observation("blip", 1)["provenance"]["attempt"] == 1
        log = worker.text()
        assert "SystemExit" not in log and "Traceback" not in log, log
        assert "In Celery 5.1" not in log
        assert "could not release the lease" not in log and "cannot plan now" not in log, log
        assert worker.process.poll() is None
    finally:
        for worker in workers:
            worker.stop()
        server.stop()


PICKLED = """
import sys
from kombu import Connection, Producer
from worker.fleet.app import GENERATION_TASK
from worker.fleet.settings import Settings
with Connection(Settings().broker) as connection:
    Producer(connection).publish(
        [[], {"payload": {}}, {}], serializer="pickle", routing_key=sys.argv[1], exchange="",
        headers={"task": GENERATION_TASK, "id": "pickled"},
    )
"""

UNKNOWN_TASK = """
import sys
from worker.fleet.app import client_app
from worker.fleet.settings import Settings
client_app(Settings()).send_task("os.system", args=["id"], queue=sys.argv[1], task_id="unknown")
"""

# shape -> (how a client publishes it, what the worker's log line says)
GARBAGE = {
    "not-json": ("lpush", b"this is not JSON {", "not JSON"),
    "no-delivery-tag": (
        "lpush",
        json.dumps(
            {
                k: v
                for k, v in task_envelope("ouroboros.generation", [[], {}, {}]).items()
                if k != "properties"
            }
        ).encode(),
        "not a kombu message envelope (properties: Field required)",
    ),
    "oversized": (
        "lpush",
        json.dumps(
            task_envelope("ouroboros.generation", [[], {"payload": "x" * 300_000}, {}])
        ).encode(),
        "over the 262144-byte limit",
    ),
    "pickle": ("script", PICKLED, "content type 'application/x-python-serialize' refused"),
    "unknown-task": ("script", UNKNOWN_TASK, "unknown task 'os.system'"),
    "control-not-json": ("lpush-control", b"\x80\x04garbage", "not JSON"),
}


class Sturdy(NamedTuple):
    fleet: Fleet
    worker: Worker


@pytest.fixture(scope="module")
def sturdy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sturdy]:
    """One fleet and one worker for every shape of garbage: each shape must leave the
    worker serving, so the next shape meets the worker the previous ones left."""
    home = tmp_path_factory.mktemp("garbage")
    server = PrivateRedis(home / "redis")
    fleet = Fleet(
        home,
        OUROBOROS_BROKER_URL=server.url,
        OUROBOROS_LEASE_SECONDS=str(LEASE),
        OUROBOROS_SPOOL_RETRY_SECONDS="1",
        OUROBOROS_RECONCILE_INTERVAL_SECONDS=str(RECONCILE),
    )
    worker = Worker(fleet, "w1")
    try:
        worker.wait_ready()
        yield Sturdy(fleet, worker)
    finally:
        worker.stop()
        server.stop()


@pytest.mark.parametrize("shape", list(GARBAGE))
def test_garbage_on_a_queue_is_dropped_with_one_line_and_the_worker_serves_on(
    sturdy: Sturdy, shape: str
) -> None:
    fleet, worker, lineage = sturdy.fleet, sturdy.worker, f"sturdy-{shape}"
    seed = seed_file(fleet.home, SLOW.format(seconds=2) + WRITES_STATE, f"{lineage}.el")
    fleet.ok("init", lineage, "--seed", str(seed), *SMALL_PHYSICS)
    queue = queue_of(fleet, lineage)
    how, what, why = GARBAGE[shape]
    client = redis.Redis.from_url(fleet.env["OUROBOROS_BROKER_URL"])
    # What the worker logs from here on is this shape's: the earlier ones were all logged.
    before = len(worker.text())

    def since() -> str:
        return worker.text()[before:]

    fleet.ok("run", lineage, "--generations", "2")
    # The garbage arrives while a life is in flight on this very worker.
    wait_for(lambda: client.exists(f"ouroboros:lease:{lineage}"), 60, "the first life to start")
    if how == "script":
        subprocess.run(
            [sys.executable, "-c", what, queue], env=fleet.env, cwd=fleet.home, check=True
        )
    else:
        client.lpush(queue if how == "lpush" else "ouroboros.control", what)
    target = queue if how != "lpush-control" else "ouroboros.control"
    line = f"dropped a message on queue {target}: "
    wait_for(lambda: line in since(), 60, "the drop to be logged")
    wait_for(lambda: len(generations(fleet, lineage)) == 2, 120, "both generations")
    wait_for(lambda: fleet.observation_numbers(lineage) == [1, 2], 60, "their observations")
    assert worker.process.poll() is None
    assert_linear(fleet, lineage, 2)
    (dropped,) = [entry for entry in since().splitlines() if line in entry]
    assert why in dropped
    # The whole log: no shape, this one or an earlier one, left a trace of a failure.
    log = worker.text()
    assert "Traceback" not in log and "Unrecoverable" not in log
    assert "Connection to broker lost" not in log


@pytest.fixture
def flower(fleet: Fleet) -> Iterator[tuple[str, str]]:
    """Flower as docker-compose.yml runs it: ``celery -A worker flower``, auth from FLOWER_*."""
    port = free_port()
    auth = "fleet-admin:correct-horse-battery"
    log = (fleet.home / "flower.log").open("wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "worker",
            "flower",
            f"--port={port}",
            "--address=127.0.0.1",
        ],
        env={**fleet.env, "FLOWER_BASIC_AUTH": auth},
        cwd=fleet.home,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _status(f"{url}/healthcheck", auth) == 200, 60, "flower to answer")
        yield url, auth
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
        log.close()


def _status(url: str, auth: str | None) -> int:
    try:
        return _get(url, auth)[0]
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _get(url: str, auth: str | None) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    with urllib.request.urlopen(request, timeout=30) as answer:
        return answer.status, answer.read()


def test_flower_lists_the_fleets_workers_queues_and_tasks(
    fleet: Fleet, workers: list[Worker], flower: tuple[str, str]
) -> None:
    url, auth = flower
    fleet.ok("init", "watched", "--seed", str(seed_file(fleet.home, WRITES_STATE)), *SMALL_PHYSICS)
    start(fleet, workers, "w1")
    queue = queue_of(fleet, "watched")
    assert _status(f"{url}/api/workers", None) == 401
    fleet.ok("run", "watched", "--generations", "2", "--wait")

    def listed() -> dict:
        found = json.loads(_get(f"{url}/api/workers?refresh=1", auth)[1])
        return {name: info for name, info in found.items() if name.startswith("w1@")}

    (info,) = wait_for(listed, 60, "flower to list the worker").values()
    bindings = {q["name"]: q["exchange"]["name"] for q in info["active_queues"]}
    assert bindings == {queue: queue, "ouroboros.control": "ouroboros.control"}

    def generation_tasks() -> list[dict]:
        tasks = json.loads(_get(f"{url}/api/tasks", auth)[1]).values()
        return [t for t in tasks if t["name"] == "ouroboros.generation" and t["state"] == "SUCCESS"]

    done = wait_for(lambda: len(generation_tasks()) >= 2 and generation_tasks(), 60, "the tasks")
    assert all("changed" in task["result"] for task in done)
    assert all(task["worker"].startswith("w1@") for task in done)
