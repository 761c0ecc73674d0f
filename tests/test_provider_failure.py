"""A provider failure is told apart from an organism's choice, and leaves the organism time.

Stand-in vendors answer 401, 400 for an unknown model, 429 forever, or nothing at all
(a hung server, a closed port): the model socket sums the generation's failures up as
``refused`` or ``unavailable`` (``ModelFailure``), never with the key, and a generation
whose calls all failed carries the "model unavailable" mark in its subject, journal,
observation, index, status and every reader's rows. A hung vendor answers the organism
502 ``model_margin_seconds`` before its wall, so the life ends as the organism chooses,
not as a wall_timeout. What a hostile organism can provoke is no provider failure: a
call that finds no room under the fleet's cap, a call after its deadline, a vendor's 400
beside answered calls; and the cap it filled with slow calls is given back as its life
ends, so other lineages' calls go through. A real LiteLLM proxy refusing a wrong key is in
``test_model_litellm.py``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError
from support.browse import Served, settings_of, write_unavailable_lineage
from support.fleet import Fleet, free_port
from support.vendor import StandIn, running_stand_in

from scheduler.history import parse_subject
from scheduler.reader import open_reader
from worker.fleet import embedded_redis
from worker.fleet.model_throttle import RedisThrottle
from worker.fleet.settings import Settings
from worker.instrument.journal import subject_died, subject_no_change, unavailable_mark
from worker.instrument.model.capabilities import capabilities
from worker.instrument.model.engine import TOO_LATE
from worker.instrument.model.providers import GenerationContext, make_provider
from worker.instrument.model.retry import RetryPolicy
from worker.instrument.model.server import ModelSocket
from worker.instrument.model.throttle import Cap, LocalThrottle, Throttle
from worker.instrument.names import generation_number
from worker.instrument.physics import Physics
from worker.instrument.records import LineageIndex, ModelFailure

KEY = "sk-standin-0123456789abcdef-SECRET"
CONTEXT = GenerationContext(lineage="demo", generation=1, organism_source="(message 1)\n")
# Explicit prices name the provider and model they are for.
PRICES = {
    "model_provider": "openai-compatible",
    "model_name": "chat-model",
    "model_input_usd_per_mtok": 1,
    "model_output_usd_per_mtok": 2,
}
QUICK = RetryPolicy(max_attempts=3, first_backoff_seconds=0.01, max_backoff_seconds=0.05)
UNKNOWN_MODEL = {"error": {"type": "invalid_request_error", "message": f"no model; key {KEY}"}}
CHAT_ANSWER = {
    "choices": [{"finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1},
}


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[StandIn]:
    monkeypatch.setenv("OPENAI_COMPATIBLE_API_KEY", KEY)
    with running_stand_in() as state:
        yield state


def vendor(stand_in: StandIn, case: str) -> str:
    """Make the stand-in fail as ``case`` says; the base URL to reach it at."""
    if case == "401":
        stand_in.status, stand_in.reply = 401, {"error": {"type": "authentication_error"}}
    elif case == "400-unknown-model":
        stand_in.status, stand_in.reply = 400, UNKNOWN_MODEL
    elif case == "429-forever":
        stand_in.status, stand_in.headers = 429, {"retry-after": "0"}
    elif case == "hung":
        stand_in.hang = True
    elif case == "refused-connection":
        return f"http://127.0.0.1:{free_port()}"
    return stand_in.url


def ask(socket_path: Path, prompt: bytes = b"rewrite yourself") -> int:
    """POST /generate as an organism does; the answer's status."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(60)
        client.connect(str(socket_path))
        head = f"POST /generate HTTP/1.1\r\nHost: k\r\nContent-Length: {len(prompt)}\r\n\r\n"
        client.sendall(head.encode() + prompt)
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


def model_socket(
    tmp_path: Path,
    url: str,
    physics: Physics,
    retry: RetryPolicy = QUICK,
    throttle: Throttle | None = None,
    name: str = "model.sock",
) -> ModelSocket:
    settings = Settings(openai_compatible_base_url=url, **PRICES)
    provider = make_provider("openai-compatible", "chat-model", settings)
    return ModelSocket(tmp_path / name, provider, physics, CONTEXT, retry=retry, throttle=throttle)


def send_and_leave(socket_path: Path, prompt: bytes = b"think slowly") -> socket.socket:
    """POST /generate and read nothing, as an organism that exits without its answer does."""
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(str(socket_path))
    head = f"POST /generate HTTP/1.1\r\nHost: k\r\nContent-Length: {len(prompt)}\r\n\r\n"
    client.sendall(head.encode() + prompt)
    return client


def wait_for(condition: Callable[[], bool], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within a generous timeout"
        time.sleep(0.02)


@pytest.mark.parametrize(
    ("case", "kind", "reason"),
    [
        ("401", "refused", "openai-compatible answered HTTP 401 (authentication_error)"),
        (
            "400-unknown-model",
            "refused",
            "openai-compatible answered HTTP 400 (invalid_request_error)",
        ),
        ("429-forever", "unavailable", "openai-compatible answered HTTP 429"),
        ("hung", "unavailable", "no answer in time to leave the organism its margin"),
        ("refused-connection", "unavailable", "openai-compatible unreachable"),
    ],
)
def test_each_provider_failure_is_summed_up_as_refused_or_unavailable_without_the_key(
    tmp_path: Path, stand_in: StandIn, case: str, kind: str, reason: str
) -> None:
    physics = Physics(wall_seconds=6, model_margin_seconds=3)

    with model_socket(tmp_path, vendor(stand_in, case), physics) as model:
        assert ask(model.socket_path) == 502
        failure = model.model_failure

    assert failure is not None
    assert (failure.kind, failure.failed_calls, failure.answered_calls) == (kind, 1, 0)
    assert failure.reason.startswith(reason) and failure.model_unavailable
    assert KEY not in failure.model_dump_json() and "no model" not in failure.reason


def test_a_hung_vendor_answers_the_organism_502_its_margin_before_the_wall(
    tmp_path: Path, stand_in: StandIn
) -> None:
    stand_in.hang = True
    physics = Physics(wall_seconds=20, model_margin_seconds=15)

    with model_socket(tmp_path, stand_in.url, physics) as model:
        started = time.monotonic()
        status = ask(model.socket_path)
        waited = time.monotonic() - started

    # The call's deadline is 5 s after the life began, 15 s before the wall.
    assert status == 502
    assert waited < physics.wall_seconds - physics.model_margin_seconds + 5
    [call] = model.calls
    assert [a.outcome for a in call.attempts] == ["abandoned"]


def test_a_generation_the_model_answered_once_is_not_model_unavailable(
    tmp_path: Path, stand_in: StandIn
) -> None:
    stand_in.reply = CHAT_ANSWER

    with model_socket(tmp_path, stand_in.url, Physics()) as model:
        assert ask(model.socket_path) == 200
        stand_in.status, stand_in.reply = 503, {}
        assert ask(model.socket_path) == 502
        failure = model.model_failure

    assert failure is not None
    assert (failure.kind, failure.failed_calls, failure.answered_calls) == ("unavailable", 1, 1)
    assert not failure.model_unavailable


def test_a_refusal_wins_over_passing_failures_in_the_summary(
    tmp_path: Path, stand_in: StandIn
) -> None:
    stand_in.status, stand_in.headers = 503, {"retry-after": "0"}

    with model_socket(tmp_path, stand_in.url, Physics()) as model:
        assert ask(model.socket_path) == 502
        stand_in.status, stand_in.reply = 403, {"error": {"type": "permission_error"}}
        assert ask(model.socket_path) == 502
        failure = model.model_failure

    assert failure == ModelFailure(
        kind="refused",
        reason="openai-compatible answered HTTP 403 (permission_error)",
        failed_calls=2,
        answered_calls=0,
    )


def test_the_organisms_own_bad_request_and_a_budget_refusal_are_no_provider_failure(
    tmp_path: Path, stand_in: StandIn
) -> None:
    with model_socket(tmp_path, stand_in.url, Physics(budget_usd=Decimal(0))) as model:
        assert ask(model.socket_path, b"\xff") == 400
        assert ask(model.socket_path) == 402
        failure = model.model_failure

    assert failure is None
    assert stand_in.received == []


def test_the_margin_defaults_to_ten_seconds_fits_short_walls_and_is_disclosed() -> None:
    assert Physics().model_margin_seconds == 10
    # A lineage pinned before the margin existed reads back, however short its wall.
    pinned = Physics().model_dump(mode="json")
    del pinned["model_margin_seconds"]
    assert Physics.model_validate({**pinned, "wall_seconds": 6}).model_margin_seconds == 3
    assert Physics.model_validate(pinned) == Physics()
    assert capabilities(Physics())["constraints"]["model_margin_seconds"] == 10
    with pytest.raises(ValidationError, match="model_margin_seconds=20 leaves a model call no"):
        Physics(wall_seconds=20, model_margin_seconds=20)


def test_the_mark_keeps_the_outcome_and_the_generation_number_readable() -> None:
    mark = unavailable_mark(3)
    subject = subject_no_change(7, mark)

    assert subject == "gen 7: no-change (model unavailable: 3 calls failed)"
    assert generation_number(subject) == 7
    assert parse_subject(subject, is_root=False)[:2] == ("no-change", 7)
    assert parse_subject(subject, is_root=False).model_unavailable
    died = parse_subject(subject_died(8, 1, unavailable_mark(1)), is_root=False)
    assert (died.kind, died.exit_status, died.model_unavailable) == ("died", 1, True)
    assert not parse_subject("gen 9: no-change", is_root=False).model_unavailable


def test_an_index_recorded_before_the_mark_reads_as_unmarked() -> None:
    entry = {
        "generation": 1,
        "outcome": "no-change",
        "parent_commit": "a" * 40,
        "lineage_commit": "b" * 40,
        "finished_at": "2026-01-01T00:00:00Z",
        "duration_seconds": 1.0,
        "cpu_usage_nsec": None,
        "memory_peak_bytes": None,
        "model_calls": 1,
        "spent_usd": "0",
        "run_id": None,
    }
    raw = json.dumps({"lineage": "old", "generations": [entry]}).encode()

    [read] = LineageIndex.parse(raw, "old").generations
    assert not read.model_unavailable


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
@pytest.mark.parametrize(
    ("case", "kind"),
    [
        ("401", "refused"),
        ("400-unknown-model", "refused"),
        ("429-forever", "unavailable"),
        ("hung", "unavailable"),
        ("refused-connection", "unavailable"),
    ],
)
def test_a_generation_whose_model_never_answered_is_marked_in_every_view(
    tmp_path: Path, stand_in: StandIn, case: str, kind: str
) -> None:
    fleet = Fleet(
        tmp_path,
        OUROBOROS_MODEL_PROVIDER="openai-compatible",
        OUROBOROS_MODEL_NAME="chat-model",
        OUROBOROS_OPENAI_COMPATIBLE_BASE_URL=vendor(stand_in, case),
        OUROBOROS_MODEL_INPUT_USD_PER_MTOK="1",
        OUROBOROS_MODEL_OUTPUT_USD_PER_MTOK="2",
        OPENAI_COMPATIBLE_API_KEY=KEY,
    )
    # The call's deadline is 16 - 10 = 6 s into the life: a hung vendor, or retries
    # at a closed port, end well before the wall.
    physics = ["--wall", "16", "--cpu-seconds", "16", "--memory-max", "512M"]
    fleet.ok("init", "cut", *physics, "--model-margin", "10")

    fleet.ok("run", "cut", "--generations", "1", "--local")

    # The seed keeps its body after a failed call: its outcome is the organism's own.
    assert fleet.subjects("cut")[0] == "gen 1: no-change (model unavailable: 1 call failed)"
    assert "## gen 1 — no-change (model unavailable: 1 call failed) — " in fleet.show(
        "cut", "journal.md"
    )
    observation = fleet.observation("cut", 1)
    assert observation["outcome"] == "no-change"
    failure = observation["model_failure"]
    assert (failure["kind"], failure["failed_calls"], failure["answered_calls"]) == (kind, 1, 0)
    assert KEY not in json.dumps(observation)
    settings = Settings(home=fleet.home / ".ouroboros")
    try:
        (status,) = json.loads(fleet.ok("status", "cut", "--json").stdout)
        table = fleet.ok("status", "cut", COLUMNS="300").stdout
    finally:
        embedded_redis.stop(settings)
    assert (status["last_outcome"], status["last_model_unavailable"]) == ("no-change", True)
    assert "model unavailable" in table
    reader = open_reader(settings)
    view = reader.lineage("cut")
    assert view.summary.model_unavailable == 1
    assert [row.model_unavailable for row in view.rows if row.commit.generation] == [True]


@pytest.mark.full
def test_the_web_ui_shows_the_mark_beside_the_outcome_and_metrics_count_it(
    tmp_path: Path,
) -> None:
    fleet = Fleet(tmp_path)
    write_unavailable_lineage(settings_of(fleet))
    served = Served(fleet, tmp_path / "serve.log")
    try:
        overview = served.get("/").text
        lineage = served.get("/lineages/down").text
        generation = served.get("/lineages/down/generations/1").text
        api = served.get("/api/lineages/down").json()
        # The store's figures come from a background probe: wait for its first answer.
        wait_for(lambda: "ouroboros_store_up 1.0" in served.get("/metrics").text)
        metrics = served.get("/metrics").text
    finally:
        served.stop()

    badge = '<span class="badge unavailable">model unavailable</span>'
    assert badge in overview and badge in lineage and badge in generation
    assert "openai answered HTTP 401 (invalid_api_key)" in generation
    assert [row["outcome"] for row in api["rows"] if row["commit"]["generation"]] == ["no-change"]
    assert [row["model_unavailable"] for row in api["rows"] if row["commit"]["generation"]] == [
        True
    ]
    assert api["summary"]["model_unavailable"] == 1
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
    }
    lineage_key = (("lineage", "down"),)
    assert samples["ouroboros_lineage_model_unavailable_generations_total", lineage_key] == 1
    assert samples["ouroboros_model_unavailable_generations_total", ()] == 1


# --- what a hostile organism can provoke is no provider failure -------------------------------


def test_a_hostile_lifes_slow_calls_give_the_fleet_cap_back_when_it_ends_so_a_victims_call_succeeds(
    tmp_path: Path, stand_in: StandIn, redis_url: str
) -> None:
    stand_in.hang = True
    cap, prefix = Cap(concurrent_calls=8), f"ouroboros-test-{uuid.uuid4().hex[:12]}"
    client = redis.Redis.from_url(redis_url)
    hostile_cap = RedisThrottle(client, cap, prefix=prefix)
    calls = hostile_cap.keys("openai-compatible").calls

    with model_socket(tmp_path, stand_in.url, Physics(), throttle=hostile_cap) as hostile:
        clients = [send_and_leave(hostile.socket_path) for _ in range(8)]
        wait_for(lambda: len(stand_in.received) == 8)
        assert client.zcard(calls) == 8
    # The organism exited with its 8 calls still at the vendor: their room is back.
    assert client.zcard(calls) == 0
    for leaver in clients:
        leaver.close()

    victim_cap = RedisThrottle(redis.Redis.from_url(redis_url), cap, prefix=prefix)
    with running_stand_in() as answering:
        answering.reply = CHAT_ANSWER
        physics = Physics(wall_seconds=20, model_margin_seconds=10)
        with model_socket(
            tmp_path, answering.url, physics, throttle=victim_cap, name="v.sock"
        ) as victim:
            assert ask(victim.socket_path) == 200
            assert victim.model_failure is None


def test_a_call_that_finds_no_room_under_the_fleet_cap_is_answered_502_but_is_no_provider_failure(
    tmp_path: Path, stand_in: StandIn
) -> None:
    stand_in.reply = CHAT_ANSWER
    throttle = LocalThrottle(Cap(concurrent_calls=1))
    physics = Physics(wall_seconds=6, model_margin_seconds=3)
    busy = threading.Event()

    # Another lineage's call holds the fleet's only room for as long as this one may wait.
    with (
        throttle.admit("openai-compatible", "chat-model", 1, time.monotonic() + 60, busy),
        model_socket(tmp_path, stand_in.url, physics, throttle=throttle) as model,
    ):
        assert ask(model.socket_path) == 502
        failure = model.model_failure

    assert failure is None
    [call] = model.calls
    assert [a.outcome for a in call.attempts] == ["no_slot"]
    assert stand_in.received == []


def test_a_call_after_its_deadline_is_answered_502_at_once_saying_so_and_is_no_provider_failure(
    tmp_path: Path, stand_in: StandIn
) -> None:
    stand_in.reply = CHAT_ANSWER
    # The call deadline is the wall less the margin: 1 s after the life begins.
    physics = Physics(wall_seconds=2, model_margin_seconds=1)

    with model_socket(tmp_path, stand_in.url, physics) as model:
        began = time.monotonic()
        wait_for(lambda: time.monotonic() > began + 1.2)
        asked = time.monotonic()
        assert ask(model.socket_path) == 502
        answered_in = time.monotonic() - asked
        failure = model.model_failure

    assert failure is None and answered_in < 1
    [call] = model.calls
    assert (call.status, call.error, call.attempts) == (502, TOO_LATE, [])
    assert "after its deadline" in TOO_LATE and "cap" not in TOO_LATE
    assert call.reserved_usd == call.cost_usd == 0
    assert stand_in.received == []


def test_an_oversized_prompt_among_answered_calls_is_no_provider_failure(
    tmp_path: Path, stand_in: StandIn
) -> None:
    too_long = {"error": {"type": "invalid_request_error", "message": "context length exceeded"}}

    with model_socket(tmp_path, stand_in.url, Physics()) as model:
        stand_in.status, stand_in.reply = 400, too_long
        assert ask(model.socket_path, b"x" * 1000) == 502
        stand_in.status, stand_in.reply = 200, CHAT_ANSWER
        assert ask(model.socket_path) == 200
        stand_in.status, stand_in.reply = 422, too_long
        assert ask(model.socket_path, b"x" * 1000) == 502
        failure = model.model_failure

    # The vendor evidently serves this key and model: the organism's request was at fault.
    assert failure is None
    assert len(stand_in.received) == 3


def test_an_invalid_request_in_a_generation_nothing_answered_is_still_refused(
    tmp_path: Path, stand_in: StandIn
) -> None:
    stand_in.status, stand_in.reply = 422, UNKNOWN_MODEL

    with model_socket(tmp_path, stand_in.url, Physics()) as model:
        assert ask(model.socket_path) == 502
        assert ask(model.socket_path) == 502
        failure = model.model_failure

    assert failure == ModelFailure(
        kind="refused",
        reason="openai-compatible answered HTTP 422 (invalid_request_error)",
        failed_calls=2,
        answered_calls=0,
    )


def test_a_401_is_refused_alone_and_beside_answered_calls(
    tmp_path: Path, stand_in: StandIn
) -> None:
    with model_socket(tmp_path, vendor(stand_in, "401"), Physics()) as model:
        assert ask(model.socket_path) == 502
        alone = model.model_failure
        stand_in.status, stand_in.reply = 200, CHAT_ANSWER
        assert ask(model.socket_path) == 200
        beside = model.model_failure

    assert alone is not None and beside is not None
    assert (alone.kind, alone.failed_calls, alone.answered_calls) == ("refused", 1, 0)
    assert (beside.kind, beside.failed_calls, beside.answered_calls) == ("refused", 1, 1)
