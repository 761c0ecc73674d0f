"""The fleet: real Celery worker processes on real Redis advancing lineages exactly once.

Every test runs real ``celery -A worker worker`` processes against Redis on
127.0.0.1:6379 (a private database each) or a private redis-server it can kill,
the real pipeline (bwrap, Emacs, cgroups, git) and a file or moto-S3 observation
store, and checks the durable records: commits on the shared repository and
observation objects.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
import redis
from support.fleet import (
    SMALL_PHYSICS,
    Fleet,
    Switch,
    Worker,
    copy_instrument,
    free_port,
    seed_file,
    wait_for,
)
from support.lives import SLOW, WRITES_STATE, assert_linear, background, generations, start

from worker.instrument.fingerprint import PACKAGE_ROOT, package_version

# Over the default 120 s: real workers and real lives wait out leases (6 s) and
# redeliveries, and one test waits up to 180 s for a redelivered generation to land.
pytestmark = [pytest.mark.bwrap, pytest.mark.cgroups, pytest.mark.root, pytest.mark.timeout(600)]


def test_two_workers_advance_four_lineages_exactly_once(
    fleet: Fleet, workers: list[Worker]
) -> None:
    names = ["one", "two", "three", "four"]
    for name in names:
        seed = seed_file(fleet.home, SLOW.format(seconds=0.3) + WRITES_STATE, f"{name}.el")
        fleet.ok("init", name, "--seed", str(seed), *SMALL_PHYSICS)
    start(fleet, workers, "w1")
    start(fleet, workers, "w2")
    fleet.ok("run", *names, "--generations", "3", "--wait")
    for name in names:
        assert_linear(fleet, name, 3)
    assert sum(len(generations(fleet, name)) for name in names) == 12
    status = json.loads(fleet.ok("status", "--json").stdout)
    assert {row["lineage"]: row["stopped"] for row in status} == dict.fromkeys(
        names, "target reached"
    )
    assert all(row["observation_backlog"] == 0 for row in status)
    for worker in workers:
        assert "Traceback" not in worker.text()


def test_the_parent_freezes_its_objects_before_the_pool_forks(
    fleet: Fleet, workers: list[Worker]
) -> None:
    # The pool children share the parent's heap only if the freeze comes before the fork.
    worker = start(fleet, workers, "w1")
    log = worker.text()
    frozen = re.search(r"(\d+) objects frozen before the pool forks", log)
    assert frozen is not None, log
    assert int(frozen.group(1)) > 10_000
    assert frozen.start() < log.index("ready.")


def test_sigkill_mid_generation_lands_that_generation_exactly_once(
    fleet: Fleet, workers: list[Worker]
) -> None:
    seed = seed_file(fleet.home, SLOW.format(seconds=4) + WRITES_STATE)
    fleet.ok("init", "survivor", "--seed", str(seed), *SMALL_PHYSICS)
    victim = start(fleet, workers, "victim", OUROBOROS_VISIBILITY_TIMEOUT_SECONDS="15")
    fleet.ok("run", "survivor", "--generations", "1")
    client = redis.Redis.from_url(fleet.env["OUROBOROS_BROKER_URL"])
    wait_for(lambda: client.exists("ouroboros:lease:survivor"), 60, "the generation to start")
    time.sleep(1.5)
    victim.kill()
    assert generations(fleet, "survivor") == []
    start(fleet, workers, "heir", OUROBOROS_VISIBILITY_TIMEOUT_SECONDS="15")
    reconciler = background(fleet, "reconcile", "--loop")
    try:
        wait_for(lambda: len(generations(fleet, "survivor")) == 1, 180, "generation 1 to land")
        wait_for(lambda: fleet.observation_numbers("survivor") == [1], 60, "its observation")
        # Let the killed worker's redelivered message and the reconciler have their go.
        time.sleep(20)
    finally:
        reconciler.kill()
        reconciler.wait()
    assert_linear(fleet, "survivor", 1)


def test_store_outage_does_not_stop_the_lineage_and_observations_land_later(
    tmp_path: Path, redis_url: str, s3_endpoint: str, workers: list[Worker]
) -> None:
    bucket = f"outage-{int(time.time() * 1000)}"
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    switch = Switch(int(s3_endpoint.rsplit(":", 1)[1]))
    fleet = Fleet(
        tmp_path,
        OUROBOROS_BROKER_URL=redis_url,
        OUROBOROS_OBSERVATIONS=f"s3://{bucket}/fleet",
        OUROBOROS_S3_ENDPOINT_URL=f"http://127.0.0.1:{switch.port}",
        OUROBOROS_S3_REGION="us-east-1",
        OUROBOROS_LEASE_SECONDS="6",
        OUROBOROS_SPOOL_RETRY_SECONDS="1",
        OUROBOROS_RECONCILE_INTERVAL_SECONDS="1",
        AWS_ACCESS_KEY_ID="ouroboros-test-key-id",
        AWS_SECRET_ACCESS_KEY="ouroboros-test-secret",
    )

    def stored() -> list[str]:
        listing = s3.list_objects_v2(Bucket=bucket, Prefix="fleet/lineages/patient/generations/")
        return sorted(item["Key"] for item in listing.get("Contents", []))

    seed = seed_file(fleet.home, SLOW.format(seconds=2) + WRITES_STATE)
    fleet.ok("init", "patient", "--seed", str(seed), *SMALL_PHYSICS)
    worker = start(fleet, workers, "w1")
    reconciler_log = tmp_path / "reconciler.log"
    reconciler = background(fleet, "reconcile", "--loop", log=reconciler_log)
    fleet.ok("run", "patient", "--generations", "3")
    switch.down()
    try:
        # The run's state travels in the job: it advances while the store is down.
        wait_for(lambda: len(generations(fleet, "patient")) == 3, 180, "three commits")
        assert len(stored()) < 3
        time.sleep(5)  # several reconcile passes and store probes during the outage
    finally:
        switch.up()
    try:
        wait_for(lambda: len(stored()) == 3, 120, "the pending observations to land")
        wait_for(lambda: "is back" in worker.text(), 30, "the worker to see the store back")
        wait_for(lambda: "is back" in reconciler_log.read_text(), 30, "the reconciler too")
    finally:
        reconciler.kill()
        reconciler.wait()
        switch.down()
    assert [key.rsplit("/", 1)[1] for key in stored()] == [
        "000001.json",
        "000002.json",
        "000003.json",
    ]
    # One line when the outage starts and one when it ends, from each, however long it was.
    for who, text in (("worker", worker.text()), ("reconciler", reconciler_log.read_text())):
        assert text.count(f"{who}: the observation store is down") == 1, text
        assert text.count(f"{who}: the observation store is back after") == 1, text


def test_hand_commit_during_a_generation_discards_the_stale_result(
    fleet: Fleet, workers: list[Worker]
) -> None:
    from support.lives import push_hand_commit

    seed = seed_file(fleet.home, SLOW.format(seconds=3) + WRITES_STATE)
    fleet.ok("init", "edited", "--seed", str(seed), *SMALL_PHYSICS)
    start(fleet, workers, "w1")
    fleet.ok("run", "edited", "--generations", "2")
    client = redis.Redis.from_url(fleet.env["OUROBOROS_BROKER_URL"])
    wait_for(lambda: client.exists("ouroboros:lease:edited"), 60, "the generation to start")
    push_hand_commit(fleet, "edited", {"notes.txt": "by hand\n"}, "external edit: notes")
    hand = fleet.git("rev-parse", "lineage-edited").strip()
    wait_for(lambda: len(generations(fleet, "edited")) == 2, 180, "two generations")
    wait_for(lambda: fleet.observation_numbers("edited") == [1, 2], 60, "both observations")
    subjects = fleet.subjects("edited")
    assert [s.split(":")[0] for s in subjects] == ["gen 2", "gen 1", "external edit", "seed"]
    assert fleet.observation("edited", 1)["parent_commit"] == hand
    assert fleet.observation_numbers("edited") == [1, 2]
    assert "notes.txt" in fleet.files("edited")


SEND_TWICE = """
import sys
from worker.fleet.app import client_app, sender
from worker.instrument.job import GenerationJob
from worker.fleet.runs import queue_of
from worker.fleet.assembly import lineage_cache
from worker.fleet.settings import Settings
from worker.instrument.lineage import root_metadata
cache = lineage_cache(Settings())
send_job = sender(client_app(Settings()))
head = cache.fetch(sys.argv[1])
queue = queue_of(root_metadata(cache, head, sys.argv[1]))
job = GenerationJob(lineage=sys.argv[1], expected_commit=head, provider="scripted")
for task_id in ("twin-a", "twin-b"):
    send_job(job, task_id, queue, 600)
"""


def test_the_same_job_delivered_twice_makes_one_commit(fleet: Fleet, workers: list[Worker]) -> None:
    seed = seed_file(fleet.home, SLOW.format(seconds=1) + WRITES_STATE)
    fleet.ok("init", "twin", "--seed", str(seed), *SMALL_PHYSICS)
    first = start(fleet, workers, "w1")
    second = start(fleet, workers, "w2")
    subprocess.run(
        [sys.executable, "-c", SEND_TWICE, "twin"], env=fleet.env, cwd=fleet.home, check=True
    )

    def both_done() -> bool:
        logs = first.text() + second.text()
        return all(f"[{task}] succeeded" in logs for task in ("twin-a", "twin-b"))

    wait_for(both_done, 120, "both deliveries to finish")
    assert_linear(fleet, "twin", 1)


def test_redis_restarted_with_data_lost_mid_run_recovers_every_run(
    tmp_path: Path, workers: list[Worker]
) -> None:
    port = free_port()
    data = tmp_path / "redis-data"
    data.mkdir()

    def redis_server() -> subprocess.Popen[bytes]:
        server = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(data),
            ],
            stdout=subprocess.DEVNULL,
        )
        client = redis.Redis(port=port)
        wait_for(lambda: _pings(client), 30, "redis to start")
        return server

    server = redis_server()
    fleet = Fleet(
        tmp_path,
        OUROBOROS_BROKER_URL=f"redis://127.0.0.1:{port}/0",
        OUROBOROS_LEASE_SECONDS="6",
        OUROBOROS_INFLIGHT_TTL_SECONDS="20",
        OUROBOROS_SPOOL_RETRY_SECONDS="1",
        OUROBOROS_RECONCILE_INTERVAL_SECONDS="1",
    )
    names = ["left", "right"]
    for name in names:
        seed = seed_file(fleet.home, SLOW.format(seconds=1) + WRITES_STATE, f"{name}.el")
        fleet.ok("init", name, "--seed", str(seed), *SMALL_PHYSICS)
    start(fleet, workers, "w1")
    start(fleet, workers, "w2")
    reconciler = background(fleet, "reconcile", "--loop")
    try:
        fleet.ok("run", *names, "--generations", "4")
        wait_for(
            lambda: all(len(generations(fleet, n)) >= 1 for n in names), 120, "first generations"
        )
        server.kill()
        server.wait()
        server = redis_server()
        wait_for(
            lambda: all(len(generations(fleet, n)) == 4 for n in names), 300, "every run to finish"
        )
        time.sleep(3)
    finally:
        reconciler.kill()
        reconciler.wait()
        for worker in workers:
            worker.stop()
        server.kill()
        server.wait()
    for name in names:
        assert_linear(fleet, name, 4)


def test_beat_reconciles_a_run_whose_queue_was_lost(fleet: Fleet, workers: list[Worker]) -> None:
    seed = seed_file(fleet.home, WRITES_STATE)
    fleet.ok("init", "beaten", "--seed", str(seed), *SMALL_PHYSICS)
    fleet.ok("run", "beaten", "--generations", "2")
    # The queued job and its in-flight marker vanish, as with a Redis that lost its data.
    redis.Redis.from_url(fleet.env["OUROBOROS_BROKER_URL"]).flushdb()
    beat_schedule = fleet.home / "beat-schedule"
    start(fleet, workers, "w1", "--beat", f"--schedule={beat_schedule}")
    wait_for(lambda: len(generations(fleet, "beaten")) == 2, 120, "beat to restore the run")
    assert_linear(fleet, "beaten", 2)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


MALFORMED = """
import sys
from kombu import Connection, Producer
from worker.fleet.app import GENERATION_TASK, client_app
from worker.fleet.settings import Settings
app = client_app(Settings())
queue = sys.argv[1]
hostile = [
    {"lineage": "../../etc", "expected_commit": "0" * 40, "provider": "scripted"},
    {"lineage": "ok", "expected_commit": "not-hex", "provider": "scripted", "extra": 1},
    "a string, not a job",
]
for number, payload in enumerate(hostile):
    app.send_task(GENERATION_TASK, kwargs={"payload": payload}, queue=queue,
                  task_id=f"hostile-{number}")
# The default exchange routes by queue name: this reaches the queue as a send_task does.
with Connection(app.conf.broker_url) as connection:
    Producer(connection).publish(
        [[], {"payload": {}}, {}], serializer="pickle", routing_key=queue, exchange="",
        headers={"task": GENERATION_TASK, "id": "pickled"},
    )
"""


def test_malformed_messages_are_rejected_and_the_worker_keeps_serving(
    fleet: Fleet, workers: list[Worker]
) -> None:
    seed = seed_file(fleet.home, WRITES_STATE)
    fleet.ok("init", "sturdy", "--seed", str(seed), *SMALL_PHYSICS)
    worker = start(fleet, workers, "w1")
    queue = (
        "gen."
        + json.loads(fleet.show("sturdy", ".ouroboros-lineage.json"))["instrument_fingerprint"][:12]
    )
    subprocess.run(
        [sys.executable, "-c", MALFORMED, queue], env=fleet.env, cwd=fleet.home, check=True
    )
    wait_for(lambda: worker.text().count("rejected malformed job") >= 3, 60, "three rejections")
    pickled = f"dropped a message on queue {queue}: content type 'application/x-python-serialize'"
    wait_for(lambda: pickled in worker.text(), 60, "the pickled message to be dropped")
    fleet.ok("run", "sturdy", "--generations", "1", "--wait")
    assert worker.process.poll() is None
    assert_linear(fleet, "sturdy", 1)
    log = worker.text()
    assert "expected_commit" in log and "lineage" in log
    assert "Traceback" not in log


def test_a_version_mismatch_is_refused_at_start(fleet: Fleet) -> None:
    worker = Worker(fleet, "old", OUROBOROS_FLEET_VERSION="9.9.9")
    try:
        assert worker.process.wait(timeout=60) == 2
    finally:
        worker.stop()
    text = worker.text()
    assert "9.9.9" in text
    assert package_version() in text
    assert "Traceback" not in text


def test_budget_exhaustion_stops_a_run_and_status_says_why(
    fleet: Fleet, workers: list[Worker]
) -> None:
    fleet.ok("init", "thrifty", *SMALL_PHYSICS)
    start(fleet, workers, "w1")
    fleet.ok("run", "thrifty", "--generations", "50", "--budget-usd", "0.012", "--wait")
    rows = json.loads(fleet.ok("status", "thrifty", "--json").stdout)
    assert rows[0]["stopped"] == "budget exhausted"
    assert 1 <= rows[0]["done"] < 50
    assert float(rows[0]["run_spent_usd"]) <= 0.012


def test_cancel_stops_a_run_after_the_generation_in_flight(
    fleet: Fleet, workers: list[Worker]
) -> None:
    seed = seed_file(fleet.home, SLOW.format(seconds=1) + WRITES_STATE)
    fleet.ok("init", "halted", "--seed", str(seed), *SMALL_PHYSICS)
    start(fleet, workers, "w1")
    fleet.ok("run", "halted", "--generations", "50")
    wait_for(lambda: len(generations(fleet, "halted")) >= 1, 60, "a first generation")
    fleet.ok("cancel", "halted")

    def settled() -> bool:
        (row,) = json.loads(fleet.ok("status", "halted", "--json").stdout)
        return row["stopped"] == "cancelled" and row["in_flight"] is None

    # The generation in flight lands (or its job is dropped) and nothing holds the lineage.
    wait_for(settled, 60, "the cancelled run to have nothing in flight")
    done = len(generations(fleet, "halted"))
    # Longer than a 1 s life and its publication: a job sent after all would have landed.
    time.sleep(4)
    assert len(generations(fleet, "halted")) == done < 50
    assert settled()


def test_a_run_started_over_a_queued_one_replaces_it(fleet: Fleet, workers: list[Worker]) -> None:
    fleet.ok("init", "again", *SMALL_PHYSICS)
    fleet.ok("run", "again", "--generations", "1")  # no worker yet: its job waits queued
    fleet.ok("run", "again", "--generations", "1")
    start(fleet, workers, "w1")

    def landed() -> dict[str, object] | None:
        row = json.loads(fleet.ok("status", "again", "--json").stdout)[0]
        # Its observation lands just after its commit: wait for both.
        return row if row["stopped"] and row["run_outcomes"] else None

    row = wait_for(landed, 180, "the second run to land its generation")
    # The generation is the new run's, paid from its budget, not the replaced run's.
    assert (row["generation"], row["done"], row["stopped"]) == (1, 1, "target reached"), row
    assert row["run_outcomes"] == {"changed": 1} and float(row["run_spent_usd"]) > 0, row
    assert_linear(fleet, "again", 1)


IMMUTABLE_CHECK = """
import os, sys
from pathlib import Path
import worker
from worker.instrument.fingerprint import current, load_plumbing
instrument = current()
load_plumbing()
root = Path(worker.__file__).parent
on_disk = [
    ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
    for folder in ("instrument", "fleet")
    for path in (root / folder).rglob("*.py")
]
missing = [name for name in on_disk if name not in sys.modules]
assert len(on_disk) > 30 and not missing, missing
assert sys.pycache_prefix == os.environ["PYTHONPYCACHEPREFIX"]
assert set(instrument.scripts) == {"stage.sh"} and instrument.seed.startswith(b";;;")
print(instrument.fingerprint)
"""


def test_worker_loads_every_module_eagerly_and_keeps_no_bytecode_by_its_sources(
    tmp_path: Path,
) -> None:
    copy = copy_instrument(PACKAGE_ROOT, tmp_path / "instrument")
    result = subprocess.run(
        [sys.executable, "-c", IMMUTABLE_CHECK],
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(copy),
            "PYTHONPYCACHEPREFIX": str(tmp_path / "cache"),
        },
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.strip()) == 64
    assert not list(copy.rglob("__pycache__"))


def test_running_worker_is_immune_to_its_files_being_overwritten(
    fleet: Fleet, workers: list[Worker], tmp_path: Path
) -> None:
    copy = copy_instrument(PACKAGE_ROOT, tmp_path / "instrument")
    fleet.ok("init", "steady", *SMALL_PHYSICS)
    start(fleet, workers, "w1", PYTHONPATH=str(copy))
    fleet.ok("run", "steady", "--generations", "1", "--wait")
    for path in [*copy.rglob("*.py"), copy / "sandbox_scripts" / "stage.sh", copy / "organism.el"]:
        path.write_text("INVALID SYNTAX !!!\n unexpected EOF def broken(:\n")
    fleet.ok("run", "steady", "--generations", "1", "--wait")
    assert_linear(fleet, "steady", 2)
    first, second = fleet.observation("steady", 1), fleet.observation("steady", 2)
    assert second["outcome"] == "changed"
    assert (
        first["provenance"]["instrument_fingerprint"]
        == second["provenance"]["instrument_fingerprint"]
    )
    assert not list(copy.rglob("__pycache__"))


def test_a_life_longer_than_the_visibility_timeout_is_refused_before_any_run(
    fleet: Fleet,
) -> None:
    fleet.ok("init", "lengthy", *SMALL_PHYSICS)
    result = fleet.cli(
        "run", "lengthy", "--generations", "1", OUROBOROS_VISIBILITY_TIMEOUT_SECONDS="600"
    )
    assert result.returncode == 2
    assert "OUROBOROS_VISIBILITY_TIMEOUT_SECONDS=600" in result.stderr
    assert not (fleet.observations / "lineages/lengthy/runs").exists()


def test_status_lists_an_imported_legacy_lineage_beside_fleet_lineages(fleet: Fleet) -> None:
    from support.browse import import_fixture

    fleet.ok("init", "native", *SMALL_PHYSICS)
    import_fixture(fleet)
    rows = {row["lineage"]: row for row in json.loads(fleet.ok("status", "--json").stdout)}
    assert rows["sample"]["queue"] is None
    assert rows["sample"]["generation"] == 5
    assert rows["sample"]["observation_backlog"] == 0
    assert rows["native"]["queue"].startswith("gen.")
    missing = fleet.cli("status", "absent")
    assert missing.returncode == 2 and "no lineage named absent" in missing.stderr
