"""Blocked lineages and stopped runs, fast: what blocks a lineage, what clears it, what a
provider failure does to a run, how status and the web UI show it, and the prices a run
carries.

The planner, the worker's own code after a generation lands (``tasks._after_landing``)
and its advertisement turn (``capabilities.advertise_once``) run in this process
against the machine's real Redis, a real file observation store and a real bare
repository (the rig of ``test_fleet_rules``); ``send`` records each job instead of
talking to Celery. The real Celery worker's side is in ``test_fleet_blocks_workers``.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
import redis
from pydantic import ValidationError
from support.browse import Served
from support.fleet import SMALL_PHYSICS, Fleet, wait_for
from support.rig import Rig, report

from worker.fleet import block_markers, blocks, capabilities, markers, redis_keys
from worker.fleet.runs import queue_of, tampered
from worker.fleet.tasks import _after_landing
from worker.instrument.errors import Refusal
from worker.instrument.job import GenerationJob, ModelFailure
from worker.instrument.model.prices import Prices, builtin_prices

NODE = "w1@test-host"
KEY_VARIABLES = ("ANTHROPIC_API_KEY", "OPENAI_API_KEY", "OPENAI_COMPATIBLE_API_KEY")

# Real Redis and a real store for every rule here.
pytestmark = [pytest.mark.full]


@pytest.fixture(autouse=True)
def no_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """No provider key from the machine: each test says which keys a worker has."""
    for variable in KEY_VARIABLES:
        for name in (variable, f"{variable}_FILE"):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)


def refused_by_worker(rig: Rig, stem: str, provider: str = "openai") -> tuple[str, GenerationJob]:
    """A lineage with a run of ``provider`` whose first job a keyless worker refused."""
    name, _ = rig.lineage(stem)
    rig.planner.start_run(name, rig.head(name), 3, provider, None, Decimal("1.00"))
    job = rig.planner.enqueue(name)
    assert job is not None
    # The refusing worker cleared its job's marker (``leases.holding``) before it blocked.
    marker = markers.in_flight(rig.client, name)
    assert marker is not None
    markers.clear_in_flight(rig.client, name, marker)
    queue = queue_in(rig, name)
    blocks.block(rig.client, job, NODE, queue, "worker", "OPENAI_API_KEY is not set: export it")
    return name, job


def queue_in(rig: Rig, lineage: str) -> str:
    """The queue of the instrument ``lineage`` is pinned to."""
    return queue_of(rig.planner.homes.metadata(lineage, rig.head(lineage)))


def failed(kind: str, answered: int = 0) -> ModelFailure:
    return ModelFailure(
        kind=kind,  # type: ignore[arg-type]
        reason="openai answered HTTP 401 (invalid_api_key)"
        if kind == "refused"
        else "openai answered HTTP 429 (rate_limit_exceeded)",
        failed_calls=2,
        answered_calls=answered,
    )


def after_landing(
    rig: Rig, job: GenerationJob, generation: int, failure: ModelFailure | None
) -> GenerationJob | None:
    """Land ``job``'s generation with a report carrying ``failure``, and run what the
    worker runs then: a provider failure stops the run under the lease, which
    ``leases.holding`` then releases with the marker, and the follow-up comes after;
    the job sent next, if any."""
    sent = len(rig.sent.calls)
    marker = markers.in_flight(rig.client, job.lineage)
    assert marker is not None
    commit = rig.land(job.lineage, generation)
    landed = report(job, generation, commit, "0.01", model_failure=failure, outcome="no-change")
    blocks.stop_for_provider(rig.client, job, landed, NODE, queue_in(rig, job.lineage))
    markers.clear_in_flight(rig.client, job.lineage, marker)
    _after_landing(rig.client, rig.planner, job, landed)
    return rig.sent.jobs[-1] if len(rig.sent.calls) > sent else None


# -- what clears a block ------------------------------------------------------------------


def test_a_lineage_a_worker_refused_is_not_planned_until_its_recheck_time(rig: Rig) -> None:
    name, _ = refused_by_worker(rig, "waits")
    record = block_markers.blocked(rig.client, name)
    assert record is not None and record.kind == "worker" and record.retry_at is not None
    assert record.retry_at - record.since == timedelta(seconds=blocks.RECHECK_SECONDS)

    assert rig.planner.enqueue(name) is None
    assert rig.planner.reconcile() == []
    assert len(rig.sent.calls) == 1


def test_a_new_run_clears_the_block_even_for_another_provider(rig: Rig) -> None:
    name, _ = refused_by_worker(rig, "new-run")

    run = rig.run(name, 2)

    assert block_markers.blocked(rig.client, name) is None
    job = rig.planner.enqueue(name)
    assert job is not None and (job.run_id, job.provider) == (run.run_id, "scripted")


def test_cancel_clears_the_block(rig: Rig) -> None:
    name, _ = refused_by_worker(rig, "cancelled")

    assert rig.planner.cancel(name) is not None

    assert block_markers.blocked(rig.client, name) is None


def test_a_worker_whose_key_appears_clears_the_block_at_its_next_turn_and_enqueues(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, _ = refused_by_worker(rig, "key-appears")
    queue = queue_in(rig, name)
    started = datetime.now(UTC) - timedelta(minutes=5)  # running since before the refusal
    enqueued: list[str] = []

    def turn(served: set[str] | None) -> set[str]:
        return capabilities.advertise_once(
            NODE, queue, rig.planner.settings, rig.client, started, served, enqueued.append
        )

    served = turn(None)
    assert "openai" not in served
    served = turn(served)
    assert block_markers.blocked(rig.client, name) is not None and enqueued == []

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-a-real-key")
    turn(served)

    assert block_markers.blocked(rig.client, name) is None
    assert enqueued == [name]


def test_a_worker_restarted_after_a_provider_refusal_clears_it_and_a_running_one_does_not(
    rig: Rig,
) -> None:
    name, _ = rig.lineage("restarted")
    rig.run(name, 3)
    job = rig.planner.enqueue(name)
    assert job is not None
    after_landing(rig, job, 1, failed("refused"))
    queue = queue_in(rig, name)
    record = block_markers.blocked(rig.client, name)
    assert record is not None
    enqueued: list[str] = []

    before = record.since - timedelta(seconds=1)
    capabilities.advertise_once(
        NODE, queue, rig.planner.settings, rig.client, before, None, enqueued.append
    )
    assert block_markers.blocked(rig.client, name) == record and enqueued == []

    after = record.since + timedelta(seconds=1)
    capabilities.advertise_once(
        NODE, queue, rig.planner.settings, rig.client, after, None, enqueued.append
    )
    assert block_markers.blocked(rig.client, name) is None and enqueued == [name]


def test_a_block_holds_one_printable_line_and_a_node_name_whatever_the_host_and_reason(
    rig: Rig,
) -> None:
    name, _ = rig.lineage("odd-host")
    rig.run(name, 1)
    job = rig.planner.enqueue(name)
    assert job is not None
    reason = "first line\n\x1b[31msecond\tline " + "x" * 2000

    record = blocks.block(rig.client, job, "w 1@host:9", queue_in(rig, name), "worker", reason)

    assert record is not None and block_markers.blocked(rig.client, name) == record
    assert record.node == "w_1@host_9"
    assert record.reason.isprintable() and record.reason.startswith("first line ?[31msecond line")
    assert len(record.reason) == 1000


def test_a_marker_no_worker_wrote_is_removed_and_blocks_nothing(rig: Rig) -> None:
    name, _ = rig.lineage("forged")
    rig.run(name, 1)
    rig.client.set(redis_keys.blocked_key(name), "\x1b[2Jplain reason of an older release")

    assert block_markers.blocked(rig.client, name) is None
    assert rig.planner.enqueue(name) is not None
    assert rig.client.exists(redis_keys.blocked_key(name)) == 0


def test_run_is_told_no_live_worker_serves_a_provider_only_when_some_advertise_and_none_does(
    rig: Rig,
) -> None:
    queue = "gen." + secrets.token_hex(6)
    keyless = rig.name("keyless")
    assert capabilities.unservable(rig.client, queue, "openai") is None  # no worker up

    capabilities.advertise(
        rig.client,
        capabilities.Advert(
            node=keyless, queue=queue, providers=["scripted"], started=datetime.now(UTC)
        ),
    )
    # Anyone may write under the prefix: neither of these is a worker that serves openai.
    rig.client.hset(capabilities.advert_key(rig.name("hash")), "providers", "openai")
    forged = rig.name("forged")
    rig.client.set(capabilities.advert_key(forged), '{"node": "x", "providers": ["openai"]}')

    why = capabilities.unservable(rig.client, queue, "openai")
    assert why is not None and f"no live worker on {queue} can serve provider openai" in why
    assert keyless in why and forged not in why
    assert capabilities.unservable(rig.client, queue, "scripted") is None
    assert capabilities.unservable(rig.client, "gen." + secrets.token_hex(6), "openai") is None


# -- a provider failure stops the run -------------------------------------------------------


def test_a_report_the_provider_refused_blocks_the_run_until_fixed_and_sends_no_follow_up(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    name, _ = rig.lineage("refused")
    rig.run(name, 3)
    job = rig.planner.enqueue(name)
    assert job is not None

    with caplog.at_level(logging.ERROR, logger="worker.fleet"):
        after_landing(rig, job, 1, failed("refused"))

    assert len(rig.sent.calls) == 1
    record = block_markers.blocked(rig.client, name)
    assert record is not None
    assert (record.kind, record.retry_at, record.run_id) == ("refused", None, job.run_id)
    assert record.reason == "openai answered HTTP 401 (invalid_api_key)"
    assert rig.client.ttl(redis_keys.blocked_key(name)) == -1  # kept until fixed, not a timer
    assert rig.planner.enqueue(name) is None and rig.planner.reconcile() == []
    assert len(rig.sent.calls) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("refused" in line and "invalid_api_key" in line for line in errors), errors


def test_a_report_the_provider_never_answered_pauses_the_run_then_it_resumes(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(blocks, "PAUSE_SECONDS", 2)
    name, _ = rig.lineage("paused")
    rig.run(name, 3)
    job = rig.planner.enqueue(name)
    assert job is not None

    with caplog.at_level(logging.ERROR, logger="worker.fleet"):
        after_landing(rig, job, 1, failed("unavailable"))

    record = block_markers.blocked(rig.client, name)
    assert record is not None and record.kind == "unavailable" and record.retry_at is not None
    assert record.retry_at - record.since == timedelta(seconds=2)
    assert rig.planner.enqueue(name) is None
    assert len(rig.sent.calls) == 1
    assert any("paused for 2 s" in r.getMessage() for r in caplog.records), caplog.text

    wait_for(lambda: rig.planner.reconcile() == [name], 30, "the pause to end")
    assert len(rig.sent.calls) == 2 and rig.sent.jobs[1].run_id == job.run_id


def test_pauses_in_a_row_double_and_a_generation_that_lands_clears_the_marker(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blocks, "PAUSE_SECONDS", 1)
    name, _ = rig.lineage("doubling")
    rig.run(name, 5)
    first = rig.planner.enqueue(name)
    assert first is not None
    assert after_landing(rig, first, 1, failed("unavailable")) is None
    wait_for(lambda: rig.planner.reconcile() == [name], 30, "the first pause to end")

    assert after_landing(rig, rig.sent.jobs[-1], 2, failed("unavailable")) is None
    record = block_markers.blocked(rig.client, name)
    assert record is not None and record.pauses == 1
    assert record.retry_at is not None and record.retry_at - record.since == timedelta(seconds=2)
    wait_for(lambda: rig.planner.reconcile() == [name], 30, "the second pause to end")

    follow_up = after_landing(rig, rig.sent.jobs[-1], 3, None)

    assert block_markers.blocked(rig.client, name) is None
    assert follow_up is not None and follow_up.expected_commit == rig.head(name)


def test_a_generation_with_some_calls_answered_still_stops_the_run(rig: Rig) -> None:
    name, _ = rig.lineage("partial")
    rig.run(name, 3)
    job = rig.planner.enqueue(name)
    assert job is not None

    assert after_landing(rig, job, 1, failed("unavailable", answered=3)) is None

    assert block_markers.blocked(rig.client, name) is not None
    assert rig.planner.enqueue(name) is None


# -- prices travel with the run -------------------------------------------------------------


def test_a_run_carries_the_prices_it_was_started_with_into_every_job(rig: Rig) -> None:
    name, _ = rig.lineage("priced")
    run = rig.run(name, 2)
    job = rig.planner.enqueue(name)

    assert run.prices == builtin_prices("scripted", "scripted")
    assert job is not None and job.prices == run.prices
    assert rig.planner.runs(name)[-1].prices == run.prices


def test_explicit_prices_of_the_scheduler_price_only_the_provider_and_model_they_name(
    rig: Rig,
) -> None:
    settings = rig.planner.settings.model_copy(
        update={
            "model_provider": "openai-compatible",
            "model_name": "llama",
            "model_input_usd_per_mtok": 3.0,
            "model_output_usd_per_mtok": 15.0,
        }
    )
    rig.planner.settings = settings

    assert rig.planner.run_prices("openai-compatible", "llama") == Prices(
        input_usd_per_mtok=Decimal(3), output_usd_per_mtok=Decimal(15)
    )
    assert rig.planner.run_prices("scripted", None) == builtin_prices("scripted", "scripted")
    with pytest.raises(Refusal, match="OUROBOROS_MODEL_INPUT_USD_PER_MTOK"):
        rig.planner.run_prices("openai-compatible", "qwen")


def test_a_run_without_prices_is_refused_before_anything_is_recorded(rig: Rig) -> None:
    name, _ = rig.lineage("unpriced")

    with pytest.raises(Refusal, match="OUROBOROS_MODEL_OUTPUT_USD_PER_MTOK"):
        rig.planner.start_run(name, rig.head(name), 2, "openai", "gpt-7-preview", Decimal(1))

    assert rig.planner.runs(name) == []


def test_a_run_record_of_an_older_release_without_prices_still_plans_its_jobs(rig: Rig) -> None:
    name, _ = rig.lineage("older")
    run = rig.run(name, 2)
    rig.planner.save_run(run.model_copy(update={"prices": None}))

    job = rig.planner.enqueue(name)

    assert job is not None and job.prices is None


# -- what status and the web UI show ----------------------------------------------------------


def test_status_and_the_web_ui_show_why_a_lineage_is_blocked_and_when_it_is_retried(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.ok("init", "shown", *SMALL_PHYSICS)
    fleet.ok("run", "shown", "--generations", "2")  # no worker: the run waits
    client = redis.Redis.from_url(fleet.env["OUROBOROS_BROKER_URL"])
    since = datetime.now(UTC)
    record = block_markers.Block(
        kind="unavailable",
        reason="openai answered HTTP 503 <b>down</b>",
        provider="openai",
        queue="gen." + "0" * 12,
        node=NODE,
        since=since,
        retry_at=since + timedelta(minutes=5),
    )
    block_markers.block(client, "shown", record)
    retried = f"{record.retry_at:%Y-%m-%d %H:%M:%S} UTC"

    row = json.loads(fleet.ok("status", "shown", "--json").stdout)[0]
    assert row["blocked"] == (
        f"paused: the openai provider is unavailable: openai answered HTTP 503 <b>down</b>; "
        f"retried at {retried}"
    )
    assert (row["blocked_kind"], row["retry_at"] is not None) == ("unavailable", True)

    served = Served(fleet, tmp_path / "serve.log")
    try:
        # The web process reads the broker in the background: its first answer may
        # come a moment after the first request.
        wait_for(
            lambda: (
                {x["name"]: x for x in served.get("/api/").json()["lineages"]}["shown"]["blocked"]
                == row["blocked"]
            ),
            10,
            "the overview showing the block",
        )
        assert served.get("/api/lineages/shown").json()["summary"]["blocked"] == row["blocked"]
        for page in (served.get("/").text, served.get("/lineages/shown").text):
            assert "HTTP 503 &lt;b&gt;down&lt;/b&gt;; retried at " + retried in page
        assert 'ouroboros_lineage_blocked{lineage="shown"} 1.0' in served.get("/metrics").text
        # Its retry time come, it is being tried again: no longer counted as blocked (from
        # the broker's next probe on).
        block_markers.block(client, "shown", record.model_copy(update={"retry_at": since}))
        wait_for(
            lambda: 'ouroboros_lineage_blocked{lineage="shown"} 0.0' in served.get("/metrics").text,
            10,
            "the retried lineage no longer counted as blocked",
        )
    finally:
        served.stop()


# -- what anyone who writes the fleet's Redis can forge -------------------------------------

NAIVE = "2026-03-01T12:00:00"


def forged_block(queue: str, **times: str) -> str:
    """A blocked marker as a worker writes one, but with ``times`` (since, retry_at) as given."""
    return json.dumps(
        {
            "kind": "worker",
            "reason": "OPENAI_API_KEY is not set",
            "provider": "openai",
            "queue": queue,
            "node": NODE,
            "since": "2026-03-01T12:00:00+00:00",
            **times,
        }
    )


def test_a_job_is_tampered_unless_its_model_prices_target_and_budget_fit_its_run_record(
    rig: Rig,
) -> None:
    name, _ = rig.lineage("tamper")
    run = rig.run(name, 2)
    job = rig.planner.enqueue(name)
    assert job is not None and job.prices is not None and job.run_id == run.run_id
    record = rig.planner.run_record(name, run.run_id)
    assert record == run
    free = Prices(input_usd_per_mtok=Decimal(0), output_usd_per_mtok=Decimal(0))

    assert tampered(job, record) is None
    assert tampered(job.model_copy(update={"prices": free}), record) == (
        f"its prices differ from the record of run {run.run_id}"
    )
    assert tampered(job.model_copy(update={"prices": None}), record) is not None
    assert tampered(job.model_copy(update={"provider": "openai"}), record) == (
        f"its provider differ from the record of run {run.run_id}"
    )
    assert tampered(job.model_copy(update={"model": "claude-opus-4-8"}), record) is not None
    # A forged target or budget would carry the run past what its record allows.
    assert tampered(job.model_copy(update={"target_generation": 99}), record) == (
        f"its target differs from the record of run {run.run_id}"
    )
    more = {"budget_usd": record.budget_usd + Decimal("0.01")}
    assert tampered(job.model_copy(update=more), record) == (
        f"its budget exceeds the record of run {run.run_id}"
    )
    assert tampered(job.model_copy(update={"budget_usd": None}), record) is not None
    less = {"budget_usd": record.budget_usd / 2}
    assert tampered(job.model_copy(update=less), record) is None
    assert tampered(job, None) == f"it names run {run.run_id}, which has no record"
    assert rig.planner.run_record(name, "20260301T000000000000Z-forged") is None
    unrun = job.model_copy(update={"run_id": None})
    assert tampered(unrun, None) == "it names no run, yet carries prices"
    # A job of an older scheduler: no run, no prices, charged at the worker's own.
    assert tampered(unrun.model_copy(update={"prices": None}), None) is None


def test_a_job_with_a_naive_enqueued_at_is_not_a_job(rig: Rig) -> None:
    name, _ = rig.lineage("naive-job")
    rig.run(name, 1)
    job = rig.planner.enqueue(name)
    assert job is not None
    payload = job.model_dump(mode="json")

    with pytest.raises(ValidationError, match="timezone"):
        GenerationJob.model_validate({**payload, "enqueued_at": NAIVE})
    assert GenerationJob.model_validate({**payload, "enqueued_at": NAIVE + "+05:00"})


@pytest.mark.parametrize(
    "times",
    [{"since": NAIVE}, {"retry_at": NAIVE}, {"retry_at": "9999-12-31T23:00:00-05:00"}],
    ids=["naive-since", "naive-retry-at", "beyond-utc"],
)
def test_a_blocked_marker_with_a_time_no_worker_writes_is_removed_once_and_blocks_nothing(
    rig: Rig, caplog: pytest.LogCaptureFixture, times: dict[str, str]
) -> None:
    name, _ = rig.lineage("naive-block")
    rig.run(name, 1)
    rig.client.set(redis_keys.blocked_key(name), forged_block(queue_in(rig, name), **times))

    with caplog.at_level(logging.WARNING, "worker.fleet"):
        assert block_markers.blocks(rig.client).get(name) is None
        assert block_markers.blocked(rig.client, name) is None
        assert rig.planner.enqueue(name) is not None

    assert rig.client.exists(redis_keys.blocked_key(name)) == 0
    removed = [r for r in caplog.records if "removed a blocked marker" in r.getMessage()]
    assert len(removed) == 1


def test_a_marker_at_another_offset_is_read_in_utc(rig: Rig) -> None:
    name, _ = rig.lineage("offset")
    retry_at = "2999-01-01T05:30:00+05:30"
    rig.client.set(
        redis_keys.blocked_key(name), forged_block(queue_in(rig, name), retry_at=retry_at)
    )

    record = block_markers.blocked(rig.client, name)

    assert record is not None and record.retry_at == datetime(2999, 1, 1, tzinfo=UTC)
    assert "retried at 2999-01-01 00:00:00 UTC" in record.describe()


def test_an_advert_with_a_naive_start_is_removed_once_and_the_recheck_goes_on(
    rig: Rig, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, _ = refused_by_worker(rig, "naive-advert")
    queue = queue_in(rig, name)
    forged = capabilities.advert_key(rig.name("naive"))
    advert = {"node": "x", "queue": queue, "providers": ["openai"], "started": NAIVE}
    rig.client.set(forged, json.dumps(advert))
    blocked = block_markers.blocked(rig.client, name)
    assert blocked is not None
    # A second marker, with a naive time, on the same queue.
    other, _ = rig.lineage("naive-beside")
    rig.client.set(redis_keys.blocked_key(other), forged_block(queue, since=NAIVE))

    with caplog.at_level(logging.WARNING, "worker.fleet"):
        assert all(advert.node != "x" for advert in capabilities.adverts(rig.client, queue))
        assert rig.client.exists(forged) == 0
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-a-real-key")
        enqueued: list[str] = []
        capabilities.advertise_once(
            rig.name("w"),
            queue,
            rig.planner.settings,
            rig.client,
            blocked.since,
            set(),
            enqueued.append,
        )

    assert name in enqueued and other not in enqueued
    assert rig.client.exists(redis_keys.blocked_key(other)) == 0
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if "removed an advertisement" in m and forged in m]) == 1
    assert len([m for m in said if "removed a blocked marker" in m and other in m]) == 1


def test_status_the_web_ui_metrics_and_reconcile_answer_past_naive_markers_and_adverts(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.ok("init", "naive", *SMALL_PHYSICS)
    fleet.ok("run", "naive", "--generations", "1")  # no worker: the run waits
    client = redis.Redis.from_url(fleet.env["OUROBOROS_BROKER_URL"])
    queue = json.loads(fleet.ok("status", "naive", "--json").stdout)[0]["queue"]
    advert = {"node": "x", "queue": queue, "providers": ["scripted"], "started": NAIVE}

    def forge() -> None:
        client.set(redis_keys.blocked_key("naive"), forged_block(queue, retry_at=NAIVE))
        client.set(capabilities.advert_key("x"), json.dumps(advert))

    forge()
    row = json.loads(fleet.ok("status", "naive", "--json").stdout)[0]
    assert row["blocked"] is None and row["run_id"] is not None
    forge()
    assert "naive" in fleet.ok("status", COLUMNS="200").stdout
    forge()
    assert fleet.ok("run", "naive", "--generations", "1").returncode == 0
    forge()
    assert fleet.ok("reconcile").returncode == 0
    served = Served(fleet, tmp_path / "serve.log")
    try:
        for path in ("/", "/lineages/naive", "/metrics", "/api/", "/api/lineages/naive"):
            forge()
            answer = served.get(path)
            assert answer.status_code == 200, (path, answer.text)
    finally:
        served.stop()
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


@pytest.mark.parametrize(
    "reason",
    [
        "[link=https://evil.example/]click here[/link]",
        "[reverse]styled[/reverse] :smile:",
        "closing what never opened [/bold]",
    ],
    ids=["link", "style", "unbalanced"],
)
def test_status_shows_a_reason_full_of_markup_as_written_and_exits_0(
    fleet: Fleet, reason: str
) -> None:
    fleet.ok("init", "marked", *SMALL_PHYSICS)
    client = redis.Redis.from_url(fleet.env["OUROBOROS_BROKER_URL"])
    queue = json.loads(fleet.ok("status", "marked", "--json").stdout)[0]["queue"]
    record = json.loads(forged_block(queue))
    client.set(redis_keys.blocked_key("marked"), json.dumps({**record, "reason": reason}))

    for columns in ("400", "80"):  # the wide table, and the narrow one
        shown = fleet.cli("status", COLUMNS=columns, FORCE_COLOR="1")
        assert shown.returncode == 0, shown.stderr
        assert "Traceback" not in shown.stderr
        assert "\x1b]8;" not in shown.stdout  # no hyperlink
        assert "\x1b[7m" not in shown.stdout  # nothing reversed
        # Folded at its spaces, the reason is still there as written.
        assert reason.replace(" ", "") in state_column(shown.stdout), shown.stdout


def state_column(table: str) -> str:
    """The ``state`` column of a status table, its folded lines joined again (no spaces)."""
    lines = re.sub(r"\x1b\[[0-9;]*m", "", table).splitlines()
    header = next(line for line in lines if "┃" in line and "state" in line)
    at = [cell.strip() for cell in header.split("┃")].index("state")
    return "".join(
        line.split("│")[at].replace(" ", "")
        for line in lines
        if line.count("│") == header.count("┃")
    )
