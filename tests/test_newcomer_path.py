"""The path a newcomer walks, end to end, on the README's own set-up.

The README's first command (``scripts/demo.sh``, set-up already done), then on the same
home what the README tells a user to start for real work: one ``celery -A worker
worker`` on the embedded Redis, no reconciler, and a real model server (LiteLLM's proxy)
reached with a mistyped key. The run must stop with the provider's reason instead of
writing one false generation after another, say so in ``status``, and finish once the
key is fixed and the worker restarted, with nobody running anything else. And the same
set-up on a TCP Redis carries three lineages to their target through a Redis restart
that loses every key and a vendor outage, unattended.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from support.fleet import SMALL_PHYSICS, Fleet, PrivateRedis, Worker, wait_for
from support.litellm import KEY
from support.lives import assert_linear, generations
from support.vendor import running_stand_in

from worker.fleet import embedded_redis
from worker.fleet.settings import Settings

pytestmark = [pytest.mark.bwrap, pytest.mark.cgroups, pytest.mark.root, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent
WRONG_KEY = "sk-mistyped-0123456789"
GENERATIONS = 3


def status_of(fleet: Fleet, lineage: str) -> dict[str, object]:
    rows = json.loads(fleet.ok("status", lineage, "--json").stdout)
    return rows[0]  # type: ignore[no-any-return]


@pytest.fixture
def newcomer(tmp_path: Path, litellm_url: str) -> Fleet:
    """A home on the embedded default, speaking to LiteLLM as openai-compatible."""
    return Fleet(
        tmp_path,
        OUROBOROS_MODEL_PROVIDER="openai-compatible",
        OUROBOROS_MODEL_NAME="chat-mock",
        OUROBOROS_OPENAI_COMPATIBLE_BASE_URL=f"{litellm_url}/v1",
        OUROBOROS_MODEL_INPUT_USD_PER_MTOK="0",
        OUROBOROS_MODEL_OUTPUT_USD_PER_MTOK="0",
        OUROBOROS_RECONCILE_INTERVAL_SECONDS="2",
    )


def test_the_demo_then_a_mistyped_key_stops_the_run_with_the_reason_and_the_fixed_key_finishes_it(
    newcomer: Fleet,
) -> None:
    demo = subprocess.run(
        [str(ROOT / "scripts" / "demo.sh")],
        env={**newcomer.env, "OUROBOROS_MODEL_PROVIDER": "scripted", "DEMO_GENERATIONS": "2"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "Traceback" not in demo.stderr
    demos = json.loads(newcomer.ok("status", "--json").stdout)
    assert len(demos) == 3
    assert all(row["generation"] == 2 for row in demos), demos
    # ...and replays every generation it made, as the record says it was made.
    for row in demos:
        assert f"{row['lineage']}: 2 reproduced, 0 diverged, 0 not replayable" in demo.stdout
    # The demo stops what it started: no daemon outlives it.
    assert not embedded_redis.running(Settings(home=newcomer.home / ".ouroboros"))

    newcomer.ok("init", "real", *SMALL_PHYSICS)
    wrong = Worker(newcomer, "wrong", OPENAI_COMPATIBLE_API_KEY=WRONG_KEY)
    try:
        wrong.wait_ready()
        newcomer.ok("run", "real", "--generations", str(GENERATIONS))

        blocked = wait_for(
            lambda: (row := status_of(newcomer, "real"))["blocked_kind"] == "refused" and row,
            180,
            "the run blocked by the provider's refusal",
        )
        # One generation lived without its model, marked as such; none after it.
        assert newcomer.subjects("real") == [
            "gen 1: no-change (model unavailable: 1 call failed)",
            "seed",
        ]
        assert "HTTP 4" in str(blocked["blocked"]), blocked
        assert WRONG_KEY not in json.dumps(blocked)
        assert WRONG_KEY not in wrong.text()
        table = newcomer.ok("status", "real", COLUMNS="160").stdout
        assert "model unavailable" in table, table
    finally:
        wrong.stop()
    assert newcomer.subjects("real")[0].startswith("gen 1: ")

    fixed = Worker(newcomer, "fixed", OPENAI_COMPATIBLE_API_KEY=KEY)
    try:
        fixed.wait_ready()
        try:
            wait_for(
                lambda: len(newcomer.subjects("real")) == GENERATIONS + 1,
                300,
                f"the run to reach generation {GENERATIONS} after the key was fixed",
            )
        except AssertionError as stalled:
            # What a stall leaves to read once the home is gone: where the run stood,
            # and what the worker did.
            raise AssertionError(
                f"{stalled}\nstatus: {status_of(newcomer, 'real')}\n"
                f"worker fixed:\n{fixed.text()[-6000:]}"
            ) from None
        final = wait_for(
            lambda: (row := status_of(newcomer, "real"))["in_flight"] is None and row,
            60,
            "nothing in flight",
        )
    finally:
        fixed.stop()
    subjects = newcomer.subjects("real")
    assert [s for s in subjects[:-2] if "model unavailable" in s] == [], subjects
    assert final["blocked"] is None, final
    assert final["generation"] == GENERATIONS
    for generation in range(2, GENERATIONS + 1):
        observation = newcomer.observation("real", generation)
        assert observation["model_failure"] is None
        assert KEY not in json.dumps(observation)
    embedded_redis.stop(Settings(home=newcomer.home / ".ouroboros"))


def chat_reply(content: str) -> dict[str, object]:
    """A Chat Completions reply of a vendor that answers ``content`` in full."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1_767_225_600,
        "model": "chat-model",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": content},
            }
        ],
        "usage": {"prompt_tokens": 100, "completion_tokens": 100, "total_tokens": 200},
    }


def landed(fleet: Fleet, lineages: list[str]) -> dict[str, int]:
    return {name: len(generations(fleet, name)) for name in lineages}


def test_three_lineages_reach_twenty_generations_through_a_redis_restart_and_a_vendor_outage(
    tmp_path: Path,
) -> None:
    """The issue's acceptance: one worker, a TCP Redis restarted without its data, a
    vendor answering 503 for a while; nobody runs a reconciler or touches the run."""
    redis_server = PrivateRedis(tmp_path / "redis")
    lineages = ["one", "two", "three"]
    target = 20
    with running_stand_in() as vendor:
        vendor.reply = chat_reply((ROOT / "organism.el").read_text())
        fleet = Fleet(
            tmp_path,
            OUROBOROS_BROKER_URL=redis_server.url,
            OUROBOROS_MODEL_PROVIDER="openai-compatible",
            OUROBOROS_MODEL_NAME="chat-model",
            OUROBOROS_OPENAI_COMPATIBLE_BASE_URL=vendor.url,
            OUROBOROS_MODEL_INPUT_USD_PER_MTOK="1",
            OUROBOROS_MODEL_OUTPUT_USD_PER_MTOK="1",
            OPENAI_COMPATIBLE_API_KEY="sk-vendor-stand-in",
            OUROBOROS_LEASE_SECONDS="6",
            OUROBOROS_RECONCILE_INTERVAL_SECONDS="2",
        )
        for name in lineages:
            fleet.ok("init", name, *SMALL_PHYSICS)
        worker = Worker(fleet, "only", concurrency=2)
        try:
            worker.wait_ready()
            fleet.ok("run", *lineages, "--generations", str(target))

            wait_for(lambda: min(landed(fleet, lineages).values()) >= 4, 300, "4 generations each")
            redis_server.kill()
            time.sleep(20)  # the outage itself: longer than a worker's retries ride out
            redis_server.start()

            wait_for(lambda: min(landed(fleet, lineages).values()) >= 8, 300, "8 generations each")
            vendor.status, good = 503, vendor.reply
            vendor.reply = {"error": {"type": "overloaded", "message": "try later"}}
            wait_for(
                lambda: any(
                    "model unavailable" in s for n in lineages for s in generations(fleet, n)
                ),
                300,
                "a generation the vendor never answered",
            )
            vendor.status, vendor.reply = 200, good

            wait_for(
                lambda: min(landed(fleet, lineages).values()) >= target,
                900,
                f"every lineage at generation {target}",
                1.0,
            )
        finally:
            worker.stop()
            redis_server.stop()
    marked = 0
    for name in lineages:
        assert_linear(fleet, name, target)
        for number, subject in enumerate(reversed(generations(fleet, name)), start=1):
            failure = fleet.observation(name, number)["model_failure"]
            assert (failure is not None) == ("model unavailable" in subject), (name, subject)
            marked += failure is not None
    assert marked >= 1
    assert "Traceback" not in worker.text()
