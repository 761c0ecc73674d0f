"""The fleet's rules, fast: run progress, planning, reconciling and the lease, without workers.

No Celery worker, bwrap, cgroup or root: the planner runs in this process against
the machine's real Redis (127.0.0.1:6379, database 0, which the slow suite never
flushes), a real file observation store and a real bare repository whose lineages
are made by the project's own ``create_lineage`` and whose generations are commits
pushed by its own ``LineageCache``. ``send`` is a fake that records each job.

The Redis keys of ``worker.fleet.leases`` have a fixed prefix, so every test uses
lineage names of its own and deletes their keys afterwards.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
import redis
from support.fleet import MACHINE_REDIS, PrivateRedis
from support.rig import (
    HEAD,
    INSTRUMENT,
    PHYSICS,
    WHEN,
    Rig,
    dead_holder,
    entry,
    plant_holder,
    report,
)

from scheduler.cli.lineages import until_next_pass
from worker.fleet import block_markers, holders, leases, markers, redis_keys
from worker.fleet.runs import RunRecord, hard_time_limit, job_of, queue_of, run_progress
from worker.fleet.settings import Settings

REDIS_URL = f"{MACHINE_REDIS}/0"


# -- Redis, names and the fake send --------------------------------------------------------


def run_record(**changes: object) -> RunRecord:
    values: dict[str, object] = {
        "run_id": "20260301T000000000000Z-abcdef",
        "lineage": "rules",
        "created_at": WHEN,
        "start_generation": 2,
        "target_generation": 5,
        "provider": "scripted",
        "model": None,
        "budget_usd": Decimal("1.00"),
    }
    return RunRecord.model_validate({**values, **changes})


# -- run_progress and job_of: pure rules ----------------------------------------------------


def test_a_run_short_of_its_target_and_budget_has_not_stopped() -> None:
    run = run_record()
    progress = run_progress(run, 3, [entry(3, run.run_id, "0.25")])
    assert progress.stopped is None
    assert (progress.done, progress.wanted) == (1, 3)
    assert progress.spent_usd == Decimal("0.25")
    assert progress.remaining_usd == Decimal("0.75")


def test_a_run_at_its_target_generation_stopped_because_the_target_was_reached() -> None:
    run = run_record()
    assert run_progress(run, 5, []).stopped == "target reached"
    assert run_progress(run, 6, []).stopped == "target reached"


def test_a_run_that_spent_its_budget_stopped_because_the_budget_is_exhausted() -> None:
    run = run_record()
    entries = [entry(3, run.run_id, "0.60"), entry(4, run.run_id, "0.40")]
    progress = run_progress(run, 4, entries)
    assert progress.stopped == "budget exhausted"
    assert progress.remaining_usd == 0


def test_a_refused_call_under_the_run_budget_exhausts_the_run_whatever_it_spent() -> None:
    run = run_record()
    entries = [entry(3, run.run_id, "0.01", exhausted=True)]
    assert run_progress(run, 3, entries).stopped == "budget exhausted"


def test_a_cancelled_run_stopped_because_it_was_cancelled_before_any_other_reason() -> None:
    run = run_record(status="cancelled", cancelled_at=WHEN)
    assert run_progress(run, 3, []).stopped == "cancelled"
    assert run_progress(run, 5, [entry(3, run.run_id, "5.00")]).stopped == "cancelled"


def test_entries_of_other_runs_count_neither_spending_nor_exhaustion() -> None:
    run = run_record()
    others = [
        entry(1, "an-earlier-run", "0.90"),
        entry(2, "an-earlier-run", "0.90", exhausted=True),
        entry(3, None, "5.00"),
    ]
    progress = run_progress(run, 3, [*others, entry(3, run.run_id, "0.10")])
    assert progress.stopped is None
    assert progress.spent_usd == Decimal("0.10")


def test_the_job_of_a_run_carries_its_target_and_what_its_budget_has_left() -> None:
    run = run_record(model="tiny")
    job = job_of(run, HEAD, Decimal("0.35"))
    assert job.lineage == run.lineage
    assert job.expected_commit == HEAD
    assert (job.provider, job.model) == ("scripted", "tiny")
    assert job.run_id == run.run_id
    assert job.target_generation == 5
    assert job.budget_usd == Decimal("0.35")
    assert job.enqueued_at is not None


# -- Planner.enqueue ------------------------------------------------------------------------


@pytest.mark.full
def test_enqueue_sends_exactly_one_job_for_a_lineage_whose_run_wants_more(rig: Rig) -> None:
    name, _ = rig.lineage("wants")
    run = rig.run(name, 3, "0.50")
    job = rig.planner.enqueue(name)
    assert job is not None
    assert rig.sent.jobs == [job]
    assert job.lineage == name
    assert job.expected_commit == rig.head(name)
    assert (job.run_id, job.target_generation, job.budget_usd) == (run.run_id, 3, Decimal("0.50"))
    _, job_id, _, _ = rig.sent.calls[0]
    assert markers.in_flight(rig.client, name) == job_id


@pytest.mark.full
def test_a_second_enqueue_while_the_in_flight_marker_exists_sends_nothing(rig: Rig) -> None:
    name, _ = rig.lineage("twice")
    rig.run(name, 3)
    assert rig.planner.enqueue(name) is not None
    assert rig.planner.enqueue(name) is None
    assert rig.planner.reconcile() == []
    assert len(rig.sent.calls) == 1


@pytest.mark.full
def test_enqueue_sends_the_job_to_the_lineage_instrument_queue_with_its_hard_time_limit(
    rig: Rig,
) -> None:
    name, meta = rig.lineage("queued")
    rig.run(name, 1)
    rig.planner.enqueue(name)
    [(_, job_id, queue, time_limit)] = rig.sent.calls
    assert queue == queue_of(meta) == f"gen.{INSTRUMENT.fingerprint[:12]}"
    assert time_limit == hard_time_limit(meta) == PHYSICS.wall_seconds + 600
    assert job_id.startswith(f"{name}.{rig.head(name)[:12]}.")


@pytest.mark.full
def test_enqueue_sends_nothing_for_a_lineage_without_a_run(rig: Rig) -> None:
    name, _ = rig.lineage("idle")
    assert rig.planner.enqueue(name) is None
    assert rig.sent.calls == []
    assert markers.in_flight(rig.client, name) is None


@pytest.mark.full
def test_enqueue_sends_nothing_for_a_run_that_reached_its_target(rig: Rig) -> None:
    name, _ = rig.lineage("finished")
    run = rig.run(name, 1)
    rig.land(name, 1)
    rig.observe(name, 1, run.run_id, "0.10")
    assert rig.planner.enqueue(name) is None
    assert rig.sent.calls == []


@pytest.mark.full
def test_enqueue_sends_nothing_for_a_run_that_exhausted_its_budget(rig: Rig) -> None:
    name, _ = rig.lineage("spent")
    run = rig.run(name, 5, "0.20")
    rig.land(name, 1)
    rig.observe(name, 1, run.run_id, "0.20")
    assert rig.planner.enqueue(name) is None
    assert rig.sent.calls == []


@pytest.mark.full
def test_enqueue_sends_nothing_for_a_cancelled_run(rig: Rig) -> None:
    name, _ = rig.lineage("cancelled")
    run = rig.run(name, 3)
    cancelled = rig.planner.cancel(name)
    assert cancelled is not None and cancelled.status == "cancelled"
    assert markers.cancel_requested(rig.client, name, run.run_id)
    assert rig.planner.enqueue(name) is None
    assert rig.sent.calls == []


@pytest.mark.full
def test_enqueue_sends_nothing_for_a_blocked_lineage(rig: Rig) -> None:
    name, _ = rig.lineage("blocked")
    rig.run(name, 3)
    since = datetime.now(UTC)
    record = block_markers.Block(
        kind="worker",
        reason="no worker serves this instrument",
        provider="scripted",
        queue="gen." + "0" * 12,
        node="w1@host",
        since=since,
        retry_at=since + timedelta(seconds=60),
    )
    block_markers.block(rig.client, name, record)
    assert rig.planner.enqueue(name) is None
    assert rig.sent.calls == []


@pytest.mark.full
def test_a_new_run_replaces_the_active_one_and_enqueue_follows_the_new_run(rig: Rig) -> None:
    name, _ = rig.lineage("replaced")
    first = rig.run(name, 3)
    second = rig.run(name, 1, "0.05")
    assert [run.status for run in rig.planner.runs(name)] == ["cancelled", "active"]
    job = rig.planner.enqueue(name)
    assert job is not None and job.run_id == second.run_id != first.run_id
    assert (job.target_generation, job.budget_usd) == (1, Decimal("0.05"))


# -- Planner.follow_up ----------------------------------------------------------------------


@pytest.mark.full
def test_follow_up_after_a_report_is_the_next_job_when_the_run_wants_more(rig: Rig) -> None:
    job, commit = rig.first_generation("onward", 3, "1.00")
    follow = rig.planner.follow_up(job, report(job, 1, commit, "0.30"))
    assert follow is not None
    assert follow.expected_commit == commit
    assert follow.budget_usd == Decimal("0.70")
    assert (follow.lineage, follow.run_id, follow.target_generation) == (
        job.lineage,
        job.run_id,
        job.target_generation,
    )
    assert (follow.provider, follow.model) == (job.provider, job.model)
    assert rig.sent.jobs == [job]  # follow_up plans; it sends nothing itself


@pytest.mark.full
def test_follow_up_is_none_when_the_report_reaches_the_target(rig: Rig) -> None:
    job, commit = rig.first_generation("arrived", 1)
    assert rig.planner.follow_up(job, report(job, 1, commit, "0.10")) is None


@pytest.mark.full
def test_follow_up_is_none_when_the_report_spends_the_rest_of_the_budget(rig: Rig) -> None:
    job, commit = rig.first_generation("broke", 3, "0.25")
    assert rig.planner.follow_up(job, report(job, 1, commit, "0.25")) is None


@pytest.mark.full
def test_follow_up_is_none_when_the_report_says_the_run_budget_is_exhausted(rig: Rig) -> None:
    job, commit = rig.first_generation("refused", 3, "1.00")
    exhausted = report(job, 1, commit, "0.01", run_budget_exhausted=True)
    assert rig.planner.follow_up(job, exhausted) is None


@pytest.mark.full
def test_follow_up_is_none_once_the_run_was_cancelled(rig: Rig) -> None:
    job, commit = rig.first_generation("halted", 3)
    rig.planner.cancel(job.lineage)
    assert rig.planner.follow_up(job, report(job, 1, commit, "0.10")) is None


# -- Planner.reconcile ----------------------------------------------------------------------


@pytest.mark.full
def test_reconcile_re_enqueues_a_lineage_whose_run_wants_more_with_no_marker_nor_lease(
    rig: Rig,
) -> None:
    wanting, _ = rig.lineage("wanting")
    idle, _ = rig.lineage("idle")
    run = rig.run(wanting, 2)
    assert rig.planner.reconcile() == [wanting]
    [job] = rig.sent.jobs
    assert (job.lineage, job.run_id) == (wanting, run.run_id)
    assert markers.in_flight(rig.client, idle) is None


@pytest.mark.full
def test_reconcile_re_enqueues_a_run_whose_message_and_marker_were_lost(rig: Rig) -> None:
    name, _ = rig.lineage("lost")
    rig.run(name, 2)
    assert rig.planner.enqueue(name) is not None
    # As after a Redis that lost its data: the queued message and its marker are gone.
    rig.client.delete(f"{redis_keys.PREFIX}:inflight:{name}")
    assert rig.planner.reconcile() == [name]
    assert len(rig.sent.calls) == 2


@pytest.mark.full
def test_what_reconcile_recovers_goes_first_and_a_planned_job_waits_its_turn(rig: Rig) -> None:
    name, _ = rig.lineage("front")
    rig.run(name, 2)
    assert rig.planner.enqueue(name) is not None
    rig.client.delete(f"{redis_keys.PREFIX}:inflight:{name}")  # its message was lost
    assert rig.planner.reconcile() == [name]
    assert rig.sent.first == [False, True]


@pytest.mark.full
def test_reconcile_skips_a_lineage_whose_lease_is_held(rig: Rig) -> None:
    name, _ = rig.lineage("leased")
    rig.run(name, 2)
    lease = leases.Lease(rig.client, name, 60)
    assert lease.acquire()
    assert rig.planner.reconcile() == []
    assert rig.sent.calls == []
    lease.release()
    assert rig.planner.reconcile() == [name]


@pytest.mark.full
def test_reconcile_skips_a_lineage_with_an_in_flight_marker(rig: Rig) -> None:
    name, _ = rig.lineage("marked")
    rig.run(name, 2)
    assert markers.mark_in_flight(rig.client, name, "someone-else", 60)
    assert rig.planner.reconcile() == []
    assert rig.sent.calls == []
    assert markers.in_flight(rig.client, name) == "someone-else"


# -- leases.holding ---------------------------------------------------------------------------


@pytest.mark.full
def test_a_second_holder_of_a_held_lease_gets_lease_busy(
    client: redis.Redis, unique: Callable[[str], str]
) -> None:
    name = unique("busy")
    ran = False
    with leases.holding(client, name, "first", 30):
        with pytest.raises(leases.LeaseBusy), leases.holding(client, name, "second", 30):
            ran = True
        assert markers.in_flight(client, name) == "first"
        assert leases.lease_held(client, name)
    assert not ran


@pytest.mark.full
def test_the_heartbeat_keeps_the_lease_and_running_marker_alive_past_their_ttl(
    client: redis.Redis, unique: Callable[[str], str]
) -> None:
    name = unique("heartbeat")
    ttl = 3
    with leases.holding(client, name, "long-life", ttl) as lease:
        time.sleep(ttl * 1.5)  # past the ttl: only renewals can have kept them
        assert client.get(lease.key) == lease.token.encode()
        assert markers.in_flight(client, name) == "long-life"
        assert 0 < client.ttl(lease.key) <= ttl


@pytest.mark.full
def test_leaving_releases_the_lease_and_the_running_marker(
    client: redis.Redis, unique: Callable[[str], str]
) -> None:
    name = unique("leave")
    with leases.holding(client, name, "job-1", 30):
        assert leases.lease_held(client, name)
        assert markers.in_flight(client, name) == "job-1"
    assert not leases.lease_held(client, name)
    assert markers.in_flight(client, name) is None
    assert not any(t.name == f"lease-{name}" for t in threading.enumerate())


@pytest.mark.full
def test_leaving_by_an_exception_releases_the_lease_and_the_running_marker(
    client: redis.Redis, unique: Callable[[str], str]
) -> None:
    name = unique("raise")
    with pytest.raises(RuntimeError), leases.holding(client, name, "job-1", 30):
        raise RuntimeError("the life failed")
    assert not leases.lease_held(client, name)
    assert markers.in_flight(client, name) is None
    with leases.holding(client, name, "job-2", 30):
        assert markers.in_flight(client, name) == "job-2"


@pytest.mark.full
def test_a_release_never_removes_another_holders_lease(
    client: redis.Redis, unique: Callable[[str], str]
) -> None:
    name = unique("theirs")
    mine = leases.Lease(client, name, 30)
    assert mine.acquire()
    client.delete(mine.key)  # as if it expired while its holder stalled
    theirs = leases.Lease(client, name, 30)
    assert theirs.acquire()
    mine.release()
    assert client.get(theirs.key) == theirs.token.encode()
    assert not mine.renew()
    assert client.get(theirs.key) == theirs.token.encode()


@pytest.mark.full
def test_leaving_after_losing_the_lease_leaves_the_new_holders_lease_and_marker(
    client: redis.Redis, unique: Callable[[str], str]
) -> None:
    name = unique("lost")
    with leases.holding(client, name, "stalled", 30) as mine:
        # Both expired while this holder stalled, and another worker took the lineage.
        client.delete(mine.key, f"{redis_keys.PREFIX}:inflight:{name}")
        theirs = leases.Lease(client, name, 30)
        assert theirs.acquire()
        markers.claim_running(client, name, "heir", 30)
    assert client.get(theirs.key) == theirs.token.encode()
    assert markers.in_flight(client, name) == "heir"


# -- markers.release_dead_holders --------------------------------------------------------------


@pytest.mark.full
def test_a_job_whose_holder_died_on_this_host_is_released_with_its_lease(
    client: redis.Redis, unique: Callable[[str], str]
) -> None:
    name = unique("orphaned")
    dead = dead_holder()
    # As a pool child killed mid-life leaves them: its marker, its record, its lease.
    client.set(f"{redis_keys.PREFIX}:inflight:{name}", "job-1", ex=600)
    plant_holder(client, name, f"job-1 {dead}")
    client.set(f"{redis_keys.PREFIX}:lease:{name}", f"{dead}/0123", ex=600)
    assert (name, "job-1") in markers.release_dead_holders(client)
    assert markers.in_flight(client, name) is None
    assert not leases.lease_held(client, name)
    assert not client.exists(f"{redis_keys.PREFIX}:holder:{name}")


@pytest.mark.full
def test_a_holder_that_is_a_zombie_is_dead() -> None:
    # A killed worker's pool children are zombies until some init reaps them.
    child = subprocess.Popen(["sleep", "0.2"])
    try:
        token = f"{holders.holder_name(child.pid)}/0123"
        assert not holders.holder_dead(token)
        stat = Path(f"/proc/{child.pid}/stat")
        wait_until = time.monotonic() + 60
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < wait_until, "the child never became a zombie"
            time.sleep(0.05)
        assert holders.holder_dead(token)
    finally:
        child.wait()


@pytest.mark.full
def test_a_fetched_job_is_released_once_its_fetcher_is_dead_and_not_before(
    client: redis.Redis, unique: Callable[[str], str]
) -> None:
    name = unique("fetched")
    assert markers.mark_in_flight(client, name, "job-1", 3600)
    assert markers.keep_marker(client, name, "job-1", 600)  # this process fetched it
    assert (name, "job-1") not in markers.release_dead_holders(client)
    assert markers.in_flight(client, name) == "job-1"
    plant_holder(client, name, f"job-1 {dead_holder()}")
    assert (name, "job-1") in markers.release_dead_holders(client)
    assert markers.in_flight(client, name) is None


@pytest.mark.full
def test_a_holder_on_another_host_or_of_another_job_is_left_alone(
    client: redis.Redis, unique: Callable[[str], str]
) -> None:
    elsewhere, newer = unique("elsewhere"), unique("newer")
    far = "another-host:" + dead_holder().split(":", 1)[1]
    client.set(f"{redis_keys.PREFIX}:inflight:{elsewhere}", "job-1", ex=600)
    plant_holder(client, elsewhere, f"job-1 {far}")
    # The dead holder's job ended and a live one took the lineage: only the record goes.
    dead = dead_holder()
    client.set(f"{redis_keys.PREFIX}:inflight:{newer}", "job-2", ex=600)
    plant_holder(client, newer, f"job-1 {dead}")
    mine = leases.Lease(client, newer, 600)
    assert mine.acquire()
    released = markers.release_dead_holders(client)
    assert (elsewhere, "job-1") not in released
    assert markers.in_flight(client, elsewhere) == "job-1"
    assert (newer, "job-1") in released
    assert markers.in_flight(client, newer) == "job-2"
    assert client.get(mine.key) == mine.token.encode()


@pytest.mark.full
def test_leaving_removes_the_holder_record_with_the_marker(
    client: redis.Redis, unique: Callable[[str], str]
) -> None:
    name = unique("record")
    with leases.holding(client, name, "job-1", 30):
        record = client.get(f"{redis_keys.PREFIX}:holder:{name}")
        assert record == f"job-1 {holders.holder_name()}".encode()
    assert not client.exists(f"{redis_keys.PREFIX}:holder:{name}")


# -- commands a worker may repeat through a broker restart ----------------------------------


@pytest.mark.full
def test_a_repeated_claim_of_the_in_flight_slot_by_the_same_job_succeeds_and_no_other_does(
    client: redis.Redis, unique: Callable[[str], str]
) -> None:
    # A worker's client repeats a command whose reply a broker restart lost: the claim
    # it had made must read as made, not as another job's.
    name = unique("claimed")
    assert markers.mark_in_flight(client, name, "job-1", 60)
    assert markers.mark_in_flight(client, name, "job-1", 600)
    assert 60 < client.ttl(f"{redis_keys.PREFIX}:inflight:{name}") <= 600
    assert not markers.mark_in_flight(client, name, "job-2", 600)
    assert markers.in_flight(client, name) == "job-1"


@pytest.mark.full
def test_a_lease_whose_taking_reply_was_lost_is_held_by_its_taker(
    client: redis.Redis, unique: Callable[[str], str]
) -> None:
    name = unique("retaken")
    lease = leases.Lease(client, name, 30)
    client.set(lease.key, lease.token, ex=30)  # the first SET landed; its reply did not
    assert lease.acquire()
    assert not leases.Lease(client, name, 30).acquire()


@pytest.mark.full
def test_a_job_is_claimed_for_a_lease_until_it_is_sent_then_for_the_in_flight_ttl(
    rig: Rig,
) -> None:
    name, _ = rig.lineage("sending")
    rig.run(name, 3)
    marker = f"{redis_keys.PREFIX}:inflight:{name}"
    seen: list[int] = []

    def failing_send(*_: object) -> None:
        seen.append(rig.client.ttl(marker))
        raise redis.ConnectionError("the broker went away mid-send")

    rig.planner.send = failing_send
    with pytest.raises(redis.ConnectionError):
        rig.planner.enqueue(name)
    lease = rig.planner.settings.lease_seconds
    # A send that fails leaves a claim that expires within a lease, not in an hour.
    assert 0 < seen[0] <= lease
    assert 0 < rig.client.ttl(marker) <= lease
    rig.client.delete(marker)
    rig.planner.send = rig.sent
    assert rig.planner.enqueue(name) is not None
    assert lease < rig.client.ttl(marker) <= rig.planner.settings.inflight_ttl_seconds


@pytest.mark.full
def test_a_workers_redis_client_waits_out_a_broker_restart(tmp_path: Path) -> None:
    server = PrivateRedis(tmp_path / "redis", appendonly=False)
    try:
        settings = Settings(home=tmp_path / "home", broker_url=server.url)
        patient = redis_keys.redis_client(settings, outlast_restart=True)
        hasty = redis_keys.redis_client(settings)
        patient.set("k", "1")
        server.kill()
        with pytest.raises(redis.ConnectionError):
            hasty.get("k")
        threading.Timer(1.5, server.start).start()
        patient.set("k", "2")  # retried until the broker is back
        assert hasty.get("k") == b"2"
    finally:
        server.stop()


@pytest.mark.full
def test_the_reconcile_loop_passes_at_once_when_the_broker_is_back_from_a_restart(
    tmp_path: Path,
) -> None:
    server = PrivateRedis(tmp_path / "redis", appendonly=False)
    try:
        client = redis.Redis.from_url(server.url)
        returned = threading.Event()
        waiting = threading.Thread(target=lambda: (until_next_pass(client, 600), returned.set()))
        waiting.start()
        server.kill()
        time.sleep(1)
        assert not returned.is_set()
        server.start()
        # Its data may be gone with every queued job: the next pass comes now, not in 600 s.
        assert returned.wait(60)
        waiting.join()
    finally:
        server.stop()
