"""The CLI watches well: ``status`` degrades, keeps one scope per column and fits 80
columns; ``run --follow`` rides out a Redis restart and Ctrl-C leaves the run going;
``run --local`` says what a life waits for.

Real parts throughout: the CLI as a subprocess, a private redis-server killed and
restarted, moto's S3 server behind a switch that refuses connections, real workers
and real lives.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from support.fleet import (
    SMALL_PHYSICS,
    Fleet,
    Follower,
    PrivateRedis,
    Switch,
    Worker,
    seed_file,
    wait_for,
)

from scheduler.reader import open_reader
from worker.fleet.settings import Settings

pytestmark = [pytest.mark.timeout(600)]

SLOW_SEED = (
    "(sleep-for 2)\n" + '(with-temp-file "/work/state.el" (insert (format "%S" (random))))\n'
)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path / "redis", appendonly=True)
    yield server
    server.stop()


def status_rows(fleet: Fleet) -> dict[str, dict[str, object]]:
    result = fleet.ok("status", "--json")
    return {row["lineage"]: row for row in json.loads(result.stdout)}


def one_line_warning(stderr: str, *words: str) -> None:
    """Exactly one warning line, naming every word, with no client text or traceback."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("warning: "), stderr
    for word in words:
        assert word in lines[0], stderr
    assert "Error 111" not in stderr and "Traceback" not in stderr


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
def test_status_shows_what_git_and_the_store_know_with_the_broker_down(
    tmp_path: Path, private_redis: PrivateRedis
) -> None:
    fleet = Fleet(tmp_path, OUROBOROS_BROKER_URL=private_redis.url)
    fleet.ok("init", "alpha", *SMALL_PHYSICS)
    fleet.ok("run", "alpha", "--generations", "1", "--local")
    fleet.ok("run", "alpha", "--generations", "2")  # queued: no worker
    before = status_rows(fleet)["alpha"]
    assert before["in_flight"] is not None and before["unavailable"] == {}

    private_redis.kill()
    result = fleet.cli("status", COLUMNS="200")
    assert result.returncode == 0, result.stderr
    one_line_warning(
        result.stderr, "broker", f"OUROBOROS_BROKER_URL={private_redis.url}", "refused"
    )
    [line] = [line for line in result.stdout.splitlines() if "alpha" in line]
    cells = [cell.strip() for cell in line.strip("│ ").split("│")]
    # lineage, gens, deaths, spent | run, run spent | in flight, last, backlog, state, genealogy
    assert cells[:3] == ["alpha", "1", "0"] and cells[3].startswith("$0.0")
    assert cells[4] == "1/3" and cells[5].endswith("of $2.00")
    assert (cells[6], cells[7], cells[8], cells[9]) == ("?", "changed", "0", "?")

    degraded = json.loads(fleet.ok("status", "--json").stdout)[0]
    assert set(degraded["unavailable"]) == {"broker"}
    assert (degraded["in_flight"], degraded["blocked"], degraded["workers"]) == (None, None, None)
    for field in ("generation", "target", "deaths", "lineage_spent_usd", "run_id"):
        assert degraded[field] == before[field], field


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
def test_status_shows_what_git_and_the_broker_know_with_the_store_down(
    tmp_path: Path,
    redis_url: str,
    s3_endpoint: str,
    s3_bucket: str,
    aws_test_credentials: tuple[str, str],
) -> None:
    switch = Switch(int(s3_endpoint.rsplit(":", 1)[1]))
    key_id, secret = aws_test_credentials
    fleet = Fleet(
        tmp_path,
        OUROBOROS_BROKER_URL=redis_url,
        OUROBOROS_OBSERVATIONS=f"s3://{s3_bucket}/prefix",
        OUROBOROS_S3_ENDPOINT_URL=f"http://127.0.0.1:{switch.port}",
        OUROBOROS_S3_REGION="us-east-1",
        AWS_ACCESS_KEY_ID=key_id,
        AWS_SECRET_ACCESS_KEY=secret,
        AWS_CONFIG_FILE="/dev/null",
        AWS_SHARED_CREDENTIALS_FILE="/dev/null",
    )
    fleet.ok("init", "alpha", *SMALL_PHYSICS)
    fleet.ok("run", "alpha", "--generations", "1", "--local")
    fleet.ok("run", "alpha", "--generations", "2")  # queued: no worker, so in flight
    try:
        switch.down()
        result = fleet.cli("status", COLUMNS="200")
    finally:
        switch.up()
    switch.down()
    try:
        as_json = fleet.cli("status", "--json")
    finally:
        switch.up()
    assert result.returncode == 0 and as_json.returncode == 0, result.stderr + as_json.stderr
    one_line_warning(result.stderr, "observation store", "OUROBOROS_OBSERVATIONS=s3://", "refused")
    [line] = [line for line in result.stdout.splitlines() if "alpha" in line]
    cells = [cell.strip() for cell in line.strip("│ ").split("│")]
    assert cells[:6] == ["alpha", "1", "?", "?", "?", "?"]
    assert (cells[6], cells[7], cells[8], cells[9]) == ("yes", "?", "?", "running")

    row = json.loads(as_json.stdout)[0]
    assert set(row["unavailable"]) == {"store"}
    assert (row["generation"], row["queue"] is not None, row["in_flight"] is not None) == (
        1,
        True,
        True,
    )
    assert (row["run_id"], row["deaths"], row["lineage_spent_usd"]) == (None, None, None)
    # Back: every figure again, and no warning.
    healthy = fleet.ok("status", "--json")
    assert json.loads(healthy.stdout)[0]["target"] == 3 and healthy.stderr == ""


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
def test_status_fits_80_columns_and_keeps_the_web_uis_figures_in_their_scopes(
    tmp_path: Path, redis_url: str
) -> None:
    fleet = Fleet(tmp_path, OUROBOROS_BROKER_URL=redis_url)
    long_name = "a-lineage-with-a-rather-long-name"
    for name in ("alpha", long_name):
        fleet.ok("init", name, *SMALL_PHYSICS)
    fleet.ok("run", "alpha", "--generations", "2", "--local")
    fleet.ok("run", "alpha", "--generations", "3")  # a run of its own, started at 2
    fleet.ok("fork", "child", "--from", "alpha@1")

    narrow = fleet.ok("status", COLUMNS="80").stdout
    assert "…" not in narrow and "..." not in narrow
    # The table fits; the waiting line below it is left whole for the terminal to wrap,
    # so that the command it names can be copied.
    table = [line for line in narrow.splitlines() if line[:1] in "┏┃┡│└"]
    assert len(table) >= 7 and max(len(line) for line in table) <= 80, narrow
    assert "alpha" in narrow and "2/5" in narrow and "waiting for a" in narrow
    # A name too long for its column folds onto the next lines, whole.
    first_cells = [line.split("│")[1].strip() for line in narrow.splitlines() if "│" in line]
    assert long_name in "".join(first_cells), narrow
    wide = fleet.ok("status", COLUMNS="200").stdout
    assert "…" not in wide and "genealogy" in wide and "forked from alpha@1" in wide

    rows = status_rows(fleet)
    settings = Settings(home=tmp_path / ".ouroboros")
    overview = {summary.name: summary for summary in open_reader(settings).summaries()}
    for name, row in rows.items():
        web = overview[name]
        assert row["generation"] == web.generations
        assert row["deaths"] == web.outcomes.get("died", 0)
        assert Decimal(str(row["lineage_spent_usd"])) == (web.spent_usd or Decimal(0))
        if web.run is None:
            assert row["target"] is None and row["run_spent_usd"] is None
        else:
            assert (row["generation"], row["target"]) == (
                web.run.generation,
                web.run.run.target_generation,
            )
            assert Decimal(str(row["run_spent_usd"])) == web.run.spent_usd
    # The lineage's spend is its two generations'; the new run has spent nothing yet.
    assert Decimal(str(rows["alpha"]["lineage_spent_usd"])) > 0
    assert Decimal(str(rows["alpha"]["run_spent_usd"])) == 0


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
def test_run_follow_rides_out_a_redis_restart_and_says_so(
    tmp_path: Path, private_redis: PrivateRedis, workers: list[Worker]
) -> None:
    fleet = Fleet(
        tmp_path,
        OUROBOROS_BROKER_URL=private_redis.url,
        OUROBOROS_LEASE_SECONDS="6",
        OUROBOROS_SPOOL_RETRY_SECONDS="1",
        OUROBOROS_RECONCILE_INTERVAL_SECONDS="1",
    )
    seed = seed_file(tmp_path, SLOW_SEED)
    fleet.ok("init", "alpha", "--seed", str(seed), *SMALL_PHYSICS)
    worker = Worker(fleet, "w1")
    workers.append(worker)
    worker.wait_ready()
    reconciler = subprocess.Popen(
        [sys.executable, "-m", "scheduler", "reconcile", "--loop"],
        env=fleet.env,
        cwd=fleet.home,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    follower = Follower(fleet, "run", "alpha", "--generations", "3", "--follow")
    try:
        follower.said("run ", 60)
        wait_for(lambda: fleet.observation_numbers("alpha"), 120, "a first generation")
        private_redis.kill()
        lost = follower.said("lost the broker", 60)
        assert f"OUROBOROS_BROKER_URL={private_redis.url}" in lost
        assert "the runs go on" in lost and "giving up after 600 s" in lost
        private_redis.start()
        follower.said("the broker answers again after", 60)
        assert follower.finish(300) == 0, "\n".join(follower.lines)
    finally:
        reconciler.terminate()
        reconciler.wait(30)
        if follower.process.poll() is None:
            follower.process.kill()
    output = "\n".join(follower.lines)
    assert "alpha: 3 changed" in output, output
    assert "Traceback" not in output and "Error 111" not in output
    assert fleet.observation_numbers("alpha") == [1, 2, 3]


def test_run_follow_gives_up_on_a_lost_broker_only_after_the_stated_time(
    tmp_path: Path, private_redis: PrivateRedis
) -> None:
    fleet = Fleet(
        tmp_path,
        OUROBOROS_BROKER_URL=private_redis.url,
        OUROBOROS_FOLLOW_OUTAGE_SECONDS="3",
    )
    fleet.ok("init", "alpha", *SMALL_PHYSICS)
    follower = Follower(fleet, "run", "alpha", "--generations", "2", "--follow")
    try:
        follower.said("waiting: no live worker serves queue", 60)
        private_redis.kill()
        follower.said("lost the broker", 60)
        code = follower.finish(120)
    finally:
        if follower.process.poll() is None:
            follower.process.kill()
    output = "\n".join(follower.lines)
    assert code == 1, output
    [gave_up] = [line for line in follower.lines if line.startswith("giving up:")]
    assert "OUROBOROS_FOLLOW_OUTAGE_SECONDS" in gave_up and "the runs go on" in gave_up
    assert "Traceback" not in output and "Error 111" not in output


def test_ctrl_c_on_run_follow_leaves_the_run_going_and_says_how_to_cancel_it(
    tmp_path: Path, redis_url: str
) -> None:
    fleet = Fleet(tmp_path, OUROBOROS_BROKER_URL=redis_url)
    fleet.ok("init", "alpha", *SMALL_PHYSICS)
    follower = Follower(fleet, "run", "alpha", "--generations", "2", "--follow")
    try:
        follower.said("waiting: no live worker serves queue", 60)
        follower.process.send_signal(signal.SIGINT)
        code = follower.finish(60)
    finally:
        if follower.process.poll() is None:
            follower.process.kill()
    output = "\n".join(follower.lines)
    assert code == 130, output
    assert "stopped following: the runs go on on the fleet" in output
    assert "schedule-lineage cancel NAME" in output and "schedule-lineage status alpha" in output
    assert "aborted" not in output and "Traceback" not in output
    row = status_rows(fleet)["alpha"]
    assert (row["target"], row["stopped"], row["in_flight"] is not None) == (2, None, True)


class RateLimited(BaseHTTPRequestHandler):
    """A Chat Completions stand-in that refuses the first request with 429, then answers."""

    requests = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        RateLimited.requests += 1
        if RateLimited.requests == 1:
            body = json.dumps({"error": {"message": "slow down", "type": "rate_limit"}})
            self._send(429, body.encode(), {"Retry-After": "2"})
            return
        answer = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1_767_225_600,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": '(message "hello")'},
                }
            ],
            "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13},
        }
        self._send(200, json.dumps(answer).encode(), {})

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
def test_run_local_says_what_the_life_waits_for(tmp_path: Path) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), RateLimited)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        fleet = Fleet(
            tmp_path,
            OUROBOROS_MODEL_PROVIDER="openai-compatible",
            OUROBOROS_MODEL_NAME="m",
            OUROBOROS_OPENAI_COMPATIBLE_BASE_URL=f"http://127.0.0.1:{server.server_port}/v1",
            OUROBOROS_MODEL_INPUT_USD_PER_MTOK="0",
            OUROBOROS_MODEL_OUTPUT_USD_PER_MTOK="0",
        )
        fleet.ok("init", "alpha", *SMALL_PHYSICS)
        result = fleet.ok("run", "alpha", "--generations", "1", "--local")
    finally:
        server.shutdown()
    lines = result.stdout.splitlines()
    assert re.fullmatch(r"alpha gen 1: living from \d\d:\d\d:\d\d UTC \(wall 60 s\)", lines[0])
    assert "alpha gen 1: model call 1: attempt 1 to openai-compatible" in lines
    [retry] = [line for line in lines if "failed" in line]
    assert re.fullmatch(
        r"alpha gen 1: model call 1: attempt 1 failed \(HTTP 429\); "
        r"attempt 2 at \d\d:\d\d:\d\d UTC, in 2 s",
        retry,
    ), retry
    assert "alpha gen 1: model call 1: attempt 2 to openai-compatible" in lines
    assert lines.index(retry) < lines.index(
        "alpha gen 1: model call 1: attempt 2 to openai-compatible"
    )
    assert lines[-1].startswith("alpha gen 1: "), lines
    assert RateLimited.requests >= 2
