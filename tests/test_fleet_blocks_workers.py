"""Blocked lineages and run prices with real Celery workers: what a user meets.

Real ``celery -A worker worker`` processes on a private database of the machine's
Redis, the real pipeline (bwrap, Emacs, cgroups, git) and a file observation store;
the CLI as a subprocess; hostile job messages written straight into Redis, as anyone
who reaches it can. The rules themselves are tested fast in ``test_fleet_blocks``.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable, Iterator
from decimal import Decimal

import pytest
import redis
from support.fleet import SMALL_PHYSICS, Fleet, Worker, task_envelope, wait_for
from support.lives import assert_linear, generations, start
from support.vendor import StandIn, message, openai_response, output_text, running_stand_in

from worker.fleet import block_markers, blocks, capabilities, markers
from worker.fleet.app import GENERATION_TASK
from worker.instrument.model.prices import builtin_prices

pytestmark = [pytest.mark.bwrap, pytest.mark.cgroups, pytest.mark.root, pytest.mark.timeout(600)]


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    """A vendor API on 127.0.0.1."""
    with running_stand_in() as state:
        yield state


def status_of(fleet: Fleet, lineage: str) -> dict[str, object]:
    rows = json.loads(fleet.ok("status", lineage, "--json").stdout)
    return rows[0]  # type: ignore[no-any-return]


def advertised(fleet: Fleet) -> list[str]:
    client = redis.Redis.from_url(fleet.env["OUROBOROS_BROKER_URL"])
    return [key.decode() for key in client.scan_iter(capabilities.advert_key("*"))]


def test_a_keyless_worker_blocks_a_run_status_says_why_and_a_new_run_clears_it(
    fleet: Fleet, workers: list[Worker]
) -> None:
    fleet.ok("init", "newcomer", *SMALL_PHYSICS)
    # No worker is up: the run is recorded, and waits for one (it may bring the key).
    fleet.ok("run", "newcomer", "--generations", "2", "--provider", "openai")
    worker = start(fleet, workers, "w1")

    blocked = wait_for(
        lambda: (row := status_of(fleet, "newcomer"))["blocked"] and row, 120, "the refusal"
    )
    assert blocked["blocked_kind"] == "worker" and blocked["retry_at"] is not None
    assert "OPENAI_API_KEY is not set" in str(blocked["blocked"])
    assert "newcomer cannot advance here: OPENAI_API_KEY is not set" in worker.text()

    # Live workers serve the queue and none has the key: refused at once, nothing recorded.
    wait_for(lambda: advertised(fleet), 60, "the worker's advertisement")
    refused = fleet.cli("run", "newcomer", "--generations", "1", "--provider", "openai")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
    assert "no live worker on gen." in refused.stderr and "provider openai" in refused.stderr
    assert status_of(fleet, "newcomer")["run_id"] == blocked["run_id"]

    # A run of a provider the worker serves is not refused with the old reason.
    fleet.ok("run", "newcomer", "--generations", "2", "--wait", timeout=300)

    assert_linear(fleet, "newcomer", 2)
    final = status_of(fleet, "newcomer")
    assert final["blocked"] is None and final["stopped"] == "target reached"
    assert "Traceback" not in worker.text()


def test_a_worker_whose_key_file_appears_clears_its_block_and_the_run_goes_on(
    fleet: Fleet, workers: list[Worker], stand_in: StandIn
) -> None:
    stand_in.reply = openai_response(
        [message(output_text('(message "hello from the stand-in")'))], "completed", usage=(40, 9)
    )
    key_file = fleet.home / "openai.key"
    fleet.ok("init", "fixed", *SMALL_PHYSICS)
    fleet.ok("run", "fixed", "--generations", "1", "--provider", "openai")
    worker = start(
        fleet,
        workers,
        "w1",
        OPENAI_API_KEY_FILE=str(key_file),
        OUROBOROS_OPENAI_BASE_URL=stand_in.url,
    )
    wait_for(lambda: status_of(fleet, "fixed")["blocked"], 120, "the worker's refusal")
    assert stand_in.received == []

    key_file.write_text("sk-test-not-a-real-key\n")

    # The worker's next advertisement turn (every 10 s) finds the key and clears the
    # block, well before the block's own retry time (60 s); then the generation lands.
    wait_for(
        lambda: "can serve openai now; cleared its block" in worker.text(),
        blocks.RECHECK_SECONDS - 10,
        "the worker's re-check",
    )
    wait_for(lambda: generations(fleet, "fixed"), 240, "the generation after the fix")
    assert [r.path for r in stand_in.received] == ["/v1/responses"]
    wait_for(lambda: status_of(fleet, "fixed")["stopped"] == "target reached", 60, "the run's end")
    assert status_of(fleet, "fixed")["blocked"] is None
    assert "sk-test-not-a-real-key" not in worker.text()


def test_two_workers_with_different_price_settings_charge_a_lineage_alike(
    fleet: Fleet, workers: list[Worker]
) -> None:
    fleet.ok("init", "priced", *SMALL_PHYSICS)
    unpriced = fleet.cli(
        "run", "priced", "--generations", "1", "--provider", "openai-compatible", "--model", "x"
    )
    assert unpriced.returncode == 2, unpriced.stdout + unpriced.stderr
    assert "OUROBOROS_MODEL_INPUT_USD_PER_MTOK" in unpriced.stderr
    assert unpriced.stderr.count("\n") == 1

    # The first worker's own prices for the scripted model are a hundred times the table's.
    dear = start(
        fleet,
        workers,
        "dear",
        OUROBOROS_MODEL_INPUT_USD_PER_MTOK="100",
        OUROBOROS_MODEL_OUTPUT_USD_PER_MTOK="500",
    )
    fleet.ok("run", "priced", "--generations", "1", "--wait", timeout=300)
    dear.stop()
    workers.remove(dear)
    start(fleet, workers, "plain")
    fleet.ok("run", "priced", "--generations", "1", "--wait", timeout=300)

    assert_linear(fleet, "priced", 2)
    table = builtin_prices("scripted", "scripted")
    assert table is not None
    for generation in (1, 2):
        observation = fleet.observation("priced", generation)
        calls = observation["model_calls"]
        assert isinstance(calls, list) and calls, observation
        for call in calls:
            expected = table.cost_usd(call["input_tokens"], call["output_tokens"])
            assert Decimal(str(call["cost_usd"])) == expected, (generation, call)
        assert Decimal(str(observation["spent_usd"])) == sum(
            (Decimal(str(call["cost_usd"])) for call in calls), Decimal(0)
        )


FREE = {"input_usd_per_mtok": "0", "output_usd_per_mtok": "0"}


def rewrite_queued(client: redis.Redis, change: Callable[[dict[str, object]], object]) -> str:
    """Rewrite the payload of the one job waiting on a generation queue; its task id."""
    (queue,) = [key for key in client.scan_iter("gen.*") if client.type(key) == b"list"]
    (raw,) = client.lrange(queue, 0, -1)
    envelope = json.loads(raw)
    args, kwargs, embed = json.loads(base64.b64decode(envelope["body"]))
    kwargs["payload"] = change(kwargs["payload"])
    envelope["body"] = base64.b64encode(json.dumps([args, kwargs, embed]).encode()).decode()
    with client.pipeline() as pipe:  # MULTI: no worker is up, but nothing sees it half done
        pipe.delete(queue)
        pipe.rpush(queue, json.dumps(envelope))
        pipe.execute()
    return str(envelope["headers"]["id"])


def test_a_job_rewritten_to_cost_nothing_is_rejected_and_its_run_lands_at_its_records_prices(
    fleet: Fleet, workers: list[Worker]
) -> None:
    fleet.ok("init", "cheated", *SMALL_PHYSICS)
    fleet.ok("run", "cheated", "--generations", "1")  # queued: no worker is up yet
    client = redis.Redis.from_url(fleet.env["OUROBOROS_BROKER_URL"])
    task_id = rewrite_queued(client, lambda payload: {**payload, "prices": FREE})

    worker = start(fleet, workers, "w1")
    wait_for(lambda: fleet.observation_numbers("cheated") == [1], 240, "the run's generation")

    assert (
        f"cheated: rejected job {task_id} as tampered (its prices differ from the record of run "
        in worker.text()
    )
    assert_linear(fleet, "cheated", 1)
    observation = fleet.observation("cheated", 1)
    table = builtin_prices("scripted", "scripted")
    assert table is not None
    calls = observation["model_calls"]
    assert isinstance(calls, list) and calls, observation
    for call in calls:
        assert Decimal(str(call["cost_usd"])) == table.cost_usd(
            call["input_tokens"], call["output_tokens"]
        )
    assert Decimal(str(observation["spent_usd"])) > 0
    assert "Traceback" not in worker.text()


def test_a_job_rewritten_past_its_runs_target_and_budget_is_rejected_and_the_run_ends_at_its_target(
    fleet: Fleet, workers: list[Worker]
) -> None:
    fleet.ok("init", "stretched", *SMALL_PHYSICS)
    fleet.ok("run", "stretched", "--generations", "1")  # queued: no worker is up yet
    client = redis.Redis.from_url(fleet.env["OUROBOROS_BROKER_URL"])
    further = {"target_generation": 4, "budget_usd": "1000"}
    task_id = rewrite_queued(client, lambda payload: {**payload, **further})

    worker = start(fleet, workers, "w1")
    wait_for(lambda: fleet.observation_numbers("stretched") == [1], 240, "the run's generation")
    wait_for(lambda: status_of(fleet, "stretched")["in_flight"] is None, 60, "nothing in flight")

    assert f"stretched: rejected job {task_id} as tampered (its target differs" in worker.text()
    assert_linear(fleet, "stretched", 1)
    assert status_of(fleet, "stretched")["stopped"] == "target reached"
    assert "Traceback" not in worker.text()


def test_a_queued_job_of_a_cancelled_run_is_dropped_after_its_cancel_flag_expired(
    fleet: Fleet, workers: list[Worker]
) -> None:
    fleet.ok("init", "ended", *SMALL_PHYSICS)
    fleet.ok("run", "ended", "--generations", "1")  # queued: no worker is up yet
    fleet.ok("cancel", "ended")
    client = redis.Redis.from_url(fleet.env["OUROBOROS_BROKER_URL"])
    # The flag is a hint that expires; the run record is what says the run ended.
    for key in client.scan_iter("ouroboros:cancel:ended:*"):
        client.delete(key)

    worker = start(fleet, workers, "w1")
    wait_for(lambda: " ended; not running " in worker.text(), 240, "the job dropped")

    assert generations(fleet, "ended") == []
    assert fleet.observation_numbers("ended") == []
    assert "Traceback" not in worker.text()


def test_forged_jobs_naming_no_run_with_prices_or_a_naive_time_are_rejected_before_a_life(
    fleet: Fleet, workers: list[Worker]
) -> None:
    fleet.ok("init", "forged", *SMALL_PHYSICS)
    queue = status_of(fleet, "forged")["queue"]
    head = fleet.git("rev-parse", "lineage-forged").strip()
    worker = start(fleet, workers, "w1")
    client = redis.Redis.from_url(fleet.env["OUROBOROS_BROKER_URL"])
    job = {"lineage": "forged", "expected_commit": head, "provider": "scripted"}
    hostile = {
        "it names no run, yet carries prices": {**job, "prices": FREE},
        "enqueued_at: Input should have timezone info": {
            **job,
            "run_id": "20260301T000000000000Z-abcdef",
            "enqueued_at": "2026-03-01T12:00:00",
        },
    }

    for said, payload in hostile.items():
        client.lpush(
            str(queue), json.dumps(task_envelope(GENERATION_TASK, [[], {"payload": payload}, {}]))
        )
        wait_for(lambda said=said: said in worker.text(), 60, f"the rejection: {said}")

    log = worker.text()
    assert "forged: rejected job hostile as tampered (it names no run, yet carries prices)" in log
    assert "rejected malformed job hostile: enqueued_at: Input should have timezone info" in log
    assert generations(fleet, "forged") == []
    assert fleet.observation_numbers("forged") == []
    assert worker.process.poll() is None and "Traceback" not in log


def test_a_job_whose_run_record_cannot_be_read_is_not_run_and_blocks_its_lineage_for_a_recheck(
    fleet: Fleet, workers: list[Worker]
) -> None:
    fleet.ok("init", "unread", *SMALL_PHYSICS)
    fleet.ok("run", "unread", "--generations", "1")  # queued: no worker is up yet
    record = next((fleet.observations / "lineages" / "unread" / "runs").glob("*.json"))
    run_id = record.stem
    # The store fails to read that one object (ELOOP), as a store that is away would.
    record.unlink()
    os.symlink(record.name, record)

    worker = start(fleet, workers, "w1")
    client = redis.Redis.from_url(fleet.env["OUROBOROS_BROKER_URL"])
    blocked = wait_for(lambda: block_markers.blocked(client, "unread"), 120, "the lineage's block")

    assert blocked.kind == "worker" and blocked.run_id == run_id
    assert blocked.reason.startswith(f"the prices of run {run_id} cannot be checked now: ")
    assert blocked.retry_at is not None
    assert (blocked.retry_at - blocked.since).total_seconds() == blocks.RECHECK_SECONDS
    assert "unread: not running " in worker.text()
    assert generations(fleet, "unread") == [] and markers.in_flight(client, "unread") is None
