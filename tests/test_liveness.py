"""The new user's path: a run with no worker says so within seconds, never hangs silently.

On the embedded default (no broker configured, ``./.ouroboros`` in the working
directory): ``init``, then ``run --wait`` with no worker gives up with one clear
line and exit 1 after ``OUROBOROS_WORKER_WAIT_SECONDS``; ``run --follow`` names the
queue, the instrument and the command that starts a worker, names a worker of
another instrument as such when one appears, says so again when a real worker
appears, and lands. ``status`` (table and JSON) and ``doctor`` are read on the way.
Real Celery workers, the real embedded Redis, the real pipeline.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.browse import Served
from support.fleet import Fleet, Follower, Worker, copy_instrument, free_port, wait_for

from worker.fleet import embedded_redis
from worker.fleet.settings import Settings
from worker.instrument.fingerprint import PACKAGE_ROOT

# Over the default 120 s: lineages wait for real workers to boot, leave and come back.
pytestmark = [pytest.mark.bwrap, pytest.mark.cgroups, pytest.mark.root, pytest.mark.timeout(600)]

# "Within a few seconds": generous for a loaded 2-core machine, never a hang.
SAY_WITHIN_SECONDS = 30


@pytest.fixture
def newcomer(tmp_path: Path) -> Iterator[Fleet]:
    """A fleet on the embedded default: no broker URL, the home found from the working directory."""
    fleet = Fleet(tmp_path)
    del fleet.env["OUROBOROS_HOME"]  # ./.ouroboros in the working directory, as a newcomer has
    yield fleet
    embedded_redis.stop(Settings(home=tmp_path / ".ouroboros"))


def other_instrument(tmp_path: Path) -> Path:
    """A copy of the code whose instrument differs by one comment, so its fingerprint does too."""
    copy = copy_instrument(PACKAGE_ROOT, tmp_path / "other-instrument")
    names = copy / "worker" / "instrument" / "names.py"
    names.write_text(names.read_text() + "# another instrument\n")
    return copy


def test_the_new_user_path_says_what_it_waits_for_and_then_lands(
    newcomer: Fleet, workers: list[Worker], tmp_path: Path
) -> None:
    fleet = newcomer
    created = fleet.ok("init", "ok").stdout
    fleet.ok("init", "patient")
    fingerprint = created.split()[-1]  # the line may wrap anywhere
    queue = f"gen.{fingerprint}"
    home = str(tmp_path / ".ouroboros")

    doctor = {c["name"]: c for c in json.loads(fleet.cli("doctor", "--json").stdout)}
    assert doctor["broker"]["ok"], doctor["broker"]
    assert "embedded broker not running (it starts on demand" in doctor["broker"]["detail"]

    # --wait with no worker: the line within seconds, then a bounded wait and exit 1.
    started = time.monotonic()
    waited = fleet.cli(
        "run",
        "patient",
        "--generations",
        "1",
        "--wait",
        OUROBOROS_WORKER_WAIT_SECONDS="5",
        timeout=120,
    )
    assert waited.returncode == 1, waited.stdout + waited.stderr
    assert time.monotonic() - started < 90
    assert f"patient: waiting: no live worker serves queue {queue}" in waited.stdout
    assert f"OUROBOROS_HOME={home} " in waited.stdout
    assert "-A worker worker" in waited.stdout
    assert "schedule-lineage run patient --generations N --local" in waited.stdout
    assert "giving up:" in waited.stderr and "OUROBOROS_WORKER_WAIT_SECONDS" in waited.stderr
    assert "Traceback" not in waited.stderr

    # A plain run says it too, on stderr, and returns at once. (A second run of a lineage
    # whose job is still queued leaves that job to carry the first run's id: use another.)
    plain = fleet.ok("run", "patient", "--generations", "1")
    assert f"patient: waiting: no live worker serves queue {queue}" in plain.stderr

    table = fleet.ok("status", COLUMNS="400").stdout
    assert f"waiting: no live worker serves {queue}" in table
    assert "-A worker worker" in table
    rows = {row["lineage"]: row for row in json.loads(fleet.ok("status", "--json").stdout)}
    assert (rows["patient"]["workers"], rows["patient"]["waiting_for_instrument"]) == ([], True)
    assert rows["patient"]["waiting"].startswith(
        f"patient: waiting: no live worker serves queue {queue}"
    )
    assert (rows["ok"]["workers"], rows["ok"]["waiting_for_instrument"]) == ([], False)

    served = Served(fleet, tmp_path / "serve.log")
    follower = Follower(fleet, "run", "ok", "--generations", "1", "--follow")
    try:
        follower.said(f"ok: waiting: no live worker serves queue {queue}", SAY_WITHIN_SECONDS)
        # The web process asks the workers in the background: its first answer may follow.
        [wait] = wait_for(lambda: served.get("/api/").json()["waiting"], 30, "the overview")
        assert (wait["queue"], wait["lineages"], wait["elsewhere"]) == (
            queue,
            ["ok", "patient"],
            [],
        )
        assert "-A worker worker" in wait["advice"]
        page = served.get("/").text
        assert "Waiting for a worker" in page and queue in page

        stranger = Worker(fleet, "stranger", PYTHONPATH=str(other_instrument(tmp_path)))
        workers.append(stranger)
        stranger.wait_ready()
        other = follower.said("waiting for its instrument", 60)
        assert f"no live worker serves queue {queue}" in other
        assert "1 live worker serves another instrument (stranger@" in other
        row = json.loads(fleet.ok("status", "ok", "--json").stdout)[0]
        assert row["waiting_for_instrument"] and "stranger@" in row["waiting"]
        assert [w.split("@")[0] for w in row["other_instrument_workers"]] == ["stranger"]
        assert "waiting for its instrument" in fleet.ok("status", "ok", COLUMNS="400").stdout
        elsewhere = wait_for(
            lambda: (waits := served.get("/api/").json()["waiting"]) and waits[0]["elsewhere"],
            30,
            "the overview",
        )
        assert elsewhere[0]["hostname"].startswith("stranger@")
        assert "Live workers serve other instruments instead" in served.get("/").text

        helper = Worker(fleet, "helper")
        workers.append(helper)
        helper.wait_ready()
        follower.said(f"ok: queue {queue} is now served by helper@", 60)
        assert follower.finish(300) == 0, "\n".join(follower.lines)
        assert wait_for(lambda: not served.get("/api/").json()["waiting"], 30, "no more waits")
    finally:
        served.stop()
        if follower.process.poll() is None:
            follower.process.kill()
    print("\n".join(follower.lines))
    assert any(line.startswith("ok: 1 changed") for line in follower.lines), follower.lines
    assert fleet.observation_numbers("ok") == [1]
    row = json.loads(fleet.ok("status", "ok", "--json").stdout)[0]
    assert (row["stopped"], row["waiting_for_instrument"]) == ("target reached", False)
    # Nothing wants generations any more, so status does not pay for asking the workers.
    assert row["workers"] is None
    assert "Traceback" not in stranger.text() + helper.text()


def test_doctor_names_a_broken_broker_in_words(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    brokers = {
        f"redis://127.0.0.1:{free_port()}/0": "refused the connection: nothing listens there",
        "redis://broker.invalid:6379/0": "names a host that does not resolve",
        f"redis+socket://{tmp_path}/absent.sock": (
            "has no socket at that path: nothing listens there"
        ),
    }
    for url, words in brokers.items():
        result = fleet.cli("doctor", "--json", OUROBOROS_BROKER_URL=url)
        assert result.returncode == 1, result.stderr
        [broker] = [c for c in json.loads(result.stdout) if c["name"] == "broker"]
        assert broker == {
            "name": "broker",
            "ok": False,
            "detail": f"{url} {words}",
            "essential": True,
        }
        assert "Error" not in result.stdout + result.stderr
