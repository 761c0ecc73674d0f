"""The CLI never corrupts the shared repository, never answers with a traceback, leaves
no daemon behind and creates no store by accident (issue 23, findings 5, 6 and 9).

Every command runs as a user runs it (``python -m scheduler`` in a fleet home of its
own, ``lineage_support.Fleet``).
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from support.fleet import (
    SMALL_PHYSICS,
    Fleet,
    Worker,
    free_port,
    http_answers,
    terminate,
    wait_for,
)

# Every test here runs the CLI as a user does: a process each.
pytestmark = [pytest.mark.full]


def refs(fleet: Fleet) -> list[str]:
    """Every file under the repository's refs and every packed ref: what git would read."""
    loose = [p.relative_to(fleet.repo).as_posix() for p in (fleet.repo / "refs").rglob("*")]
    packed = fleet.repo / "packed-refs"
    return sorted(loose + (packed.read_text().splitlines() if packed.exists() else []))


def one_line_refusal(result: subprocess.CompletedProcess[str], status: int = 2) -> str:
    """The single stderr line of a refusal with ``status`` and no traceback."""
    assert result.returncode == status, result.stderr + result.stdout
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """``path`` and everything under it immutable (chattr +i), read-only to root too."""
    subprocess.run(["chattr", "-R", "+i", str(path)], check=True)
    try:
        yield
    finally:
        subprocess.run(["chattr", "-R", "-i", str(path)], check=True)


@pytest.mark.parametrize("name", ["a..b", "a.", "a.lock", "@{x", "a/b", "a b", "A"])
def test_a_name_git_refuses_is_refused_at_once_and_writes_no_ref(tmp_path: Path, name: str) -> None:
    fleet = Fleet(tmp_path)
    fleet.ok("init", "good", *SMALL_PHYSICS)
    before = refs(fleet)

    line = one_line_refusal(fleet.cli("init", name, *SMALL_PHYSICS, timeout=20))

    assert line.startswith(f"error: invalid lineage name {name!r}")
    assert refs(fleet) == before
    fork = fleet.cli("fork", name, "--from", "good", timeout=20)
    assert one_line_refusal(fork).startswith(f"error: invalid lineage name {name!r}")
    assert refs(fleet) == before
    assert fleet.git("for-each-ref", "--format=%(refname)") == "refs/heads/lineage-good\n"


def test_status_and_every_view_skip_a_foreign_broken_ref_with_a_warning(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.ok("init", "good", *SMALL_PHYSICS)
    heads = fleet.repo / "refs" / "heads"
    head = (heads / "lineage-good").read_text()
    # What another tool could leave: a name git refuses, content that is no object id,
    # and an id of an object the repository does not hold.
    (heads / "lineage-a..b").write_text(head)
    (heads / "lineage-garbage").write_text("not a commit\n")
    (heads / "lineage-missing").write_text("12" * 20 + "\n")

    table = fleet.ok("status")
    assert "good" in table.stdout and "missing" not in table.stdout
    for ref in ("lineage-a..b", "lineage-garbage", "lineage-missing"):
        assert f"refs/heads/{ref}" in table.stderr
    assert "Traceback" not in table.stderr
    assert all(line.startswith("warning: ") for line in table.stderr.splitlines())

    rows = json.loads(fleet.ok("status", "--json").stdout)
    assert [row["lineage"] for row in rows] == ["good"]
    journal = fleet.ok("journal", "good")
    assert "seed" in journal.stdout and "refs/heads/lineage-missing" in journal.stderr
    fleet.ok("observations", "good")

    port = free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "scheduler", "serve", "--port", str(port)],
            env=fleet.env,
            cwd=fleet.home,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: http_answers(base, server, log_path, "serve"), 60, "the web UI")
        with urllib.request.urlopen(f"{base}/api/", timeout=30) as answer:
            overview = json.load(answer)
        assert [summary["name"] for summary in overview["lineages"]] == ["good"]
        with urllib.request.urlopen(f"{base}/", timeout=30) as page:
            assert page.status == 200 and b"good" in page.read()
    finally:
        terminate(server)
    assert "refs/heads/lineage-missing" in log_path.read_text()


def redis_pid(fleet: Fleet) -> int | None:
    """The pid of the home's embedded redis-server while it runs, else None."""
    pid_file = fleet.home / ".ouroboros" / "redis" / "redis.pid"
    with contextlib.suppress(FileNotFoundError, ValueError):
        pid = int(pid_file.read_text())
        if Path(f"/proc/{pid}").exists():
            return pid
    return None


def idle_watches(fleet: Fleet) -> list[int]:
    """The pids of the idle watches of this home's embedded Redis."""
    socket_path = str(fleet.home / ".ouroboros" / "redis" / "redis.sock")
    found = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"worker.fleet.embedded_redis" in argv and socket_path.encode() in argv:
                found.append(int(proc.name))
    return found


def embedded_keys(fleet: Fleet) -> set[bytes]:
    """Every key of the running embedded Redis, over a connection closed at once."""
    with redis.Redis(
        unix_socket_path=str(fleet.home / ".ouroboros" / "redis" / "redis.sock")
    ) as client:
        return set(client.keys())


def test_a_read_only_command_does_not_start_the_embedded_redis(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.ok("init", "quiet", *SMALL_PHYSICS)
    assert redis_pid(fleet) is None

    for command in (
        ["status"],
        ["status", "--json"],
        ["journal", "quiet"],
        ["observations", "quiet"],
    ):
        fleet.ok(*command)
        assert redis_pid(fleet) is None, command
    assert not (fleet.home / ".ouroboros" / "redis" / "redis.sock").exists()


def test_the_embedded_redis_stops_by_itself_once_idle_keeping_its_data(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, OUROBOROS_EMBEDDED_REDIS_IDLE_SECONDS="2")
    fleet.ok("init", "idler", *SMALL_PHYSICS)
    fleet.ok("run", "idler", "--generations", "3")
    first = redis_pid(fleet)
    assert first is not None and idle_watches(fleet)
    held = embedded_keys(fleet)
    assert any(key.startswith(b"gen.") for key in held)  # the queued job

    wait_for(lambda: redis_pid(fleet) is None, 60, "the idle embedded Redis to stop")
    wait_for(lambda: not idle_watches(fleet), 30, "its idle watch to exit")
    # The next command that needs the broker starts it again, with everything it held.
    fleet.ok("cancel", "idler")
    assert redis_pid(fleet) not in (None, first)
    assert held <= embedded_keys(fleet)
    fleet.ok("stop-redis")


def test_stop_redis_stops_the_embedded_redis_and_refuses_while_clients_are_connected(
    tmp_path: Path,
) -> None:
    fleet = Fleet(tmp_path)
    fleet.ok("init", "stopped", *SMALL_PHYSICS)
    assert "is not running" in fleet.ok("stop-redis").stdout
    fleet.ok("run", "stopped", "--generations", "1")
    assert redis_pid(fleet) is not None

    client = redis.Redis(unix_socket_path=str(fleet.home / ".ouroboros" / "redis" / "redis.sock"))
    client.ping()
    try:
        line = one_line_refusal(fleet.cli("stop-redis"))
        assert "1 connected clients" in line and "--force" in line
        assert redis_pid(fleet) is not None
    finally:
        client.close()
    assert "stopped the embedded Redis" in fleet.ok("stop-redis").stdout
    assert redis_pid(fleet) is None
    wait_for(lambda: not idle_watches(fleet), 30, "its idle watch to exit")

    line = one_line_refusal(fleet.cli("stop-redis", OUROBOROS_BROKER_URL="redis://127.0.0.1:1/0"))
    assert "OUROBOROS_BROKER_URL is set" in line


def test_a_read_only_repository_or_store_is_one_line_from_every_writing_command_and_doctor(
    tmp_path: Path,
) -> None:
    fleet = Fleet(tmp_path)
    fleet.ok("init", "kept", *SMALL_PHYSICS)
    bundle = tmp_path / "kept.bundle"
    fleet.git("bundle", "create", str(bundle), "lineage-kept")
    before = refs(fleet)

    with read_only(fleet.repo):
        for command in (
            ["init", "new", *SMALL_PHYSICS],
            ["fork", "child", "--from", "kept"],
            ["run", "kept", "--generations", "1", "--local"],
            ["import-bundle", str(bundle), "copy"],
        ):
            line = one_line_refusal(fleet.cli(*command, timeout=60))
            assert f"shared lineage repository {fleet.repo} is not writable" in line, command
        doctor = fleet.cli("doctor", "--json")
        checks = {c["name"]: c for c in json.loads(doctor.stdout)}

    assert doctor.returncode == 1 and "Traceback" not in doctor.stderr
    assert not checks["repository"]["ok"]
    assert "not writable" in checks["repository"]["detail"]
    assert checks["store"]["ok"] and "writable" in checks["store"]["detail"]
    assert refs(fleet) == before

    with read_only(fleet.observations):
        for command in (
            ["run", "kept", "--generations", "1", "--local"],
            ["fork", "child", "--from", "kept"],
        ):
            line = one_line_refusal(fleet.cli(*command, timeout=60))
            assert f"observation store {fleet.observations} is not writable" in line, command
        doctor = fleet.cli("doctor", "--json")
    store = {c["name"]: c for c in json.loads(doctor.stdout)}["store"]
    assert not store["ok"] and "not writable" in store["detail"]
    assert refs(fleet) == before


def test_an_unusable_state_directory_is_one_line(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.ok("init", "stateful", *SMALL_PHYSICS)
    not_a_directory = tmp_path / "a-file"
    not_a_directory.write_text("")
    for command in (["status"], ["run", "stateful", "--generations", "1", "--local"]):
        line = one_line_refusal(fleet.cli(*command, OUROBOROS_STATE_DIR=str(not_a_directory)))
        assert f"state directory {not_a_directory}" in line and "OUROBOROS_STATE_DIR" in line


def test_serve_on_a_busy_port_says_so_in_one_line_and_never_that_it_serves(
    tmp_path: Path,
) -> None:
    fleet = Fleet(tmp_path)
    fleet.ok("init", "shown", *SMALL_PHYSICS)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = fleet.cli("serve", "--port", str(port), timeout=60)
    line = one_line_refusal(result, status=1)
    assert f"cannot serve on 127.0.0.1 port {port}" in line and "--port" in line
    assert "serving" not in result.stdout


def test_a_mistyped_place_is_refused_and_nothing_is_created(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.ok("init", "real", *SMALL_PHYSICS)

    typo_home = tmp_path / "typo" / ".ouroboros"
    line = one_line_refusal(fleet.cli("init", "lost", OUROBOROS_HOME=str(typo_home)))
    assert "parent directory" in line and "OUROBOROS_HOME" in line
    typo_repo = tmp_path / "lineage.git"
    line = one_line_refusal(
        fleet.cli("run", "real", "--generations", "1", OUROBOROS_LINEAGE_REPO=str(typo_repo))
    )
    assert f"no shared lineage repository at {typo_repo}" in line
    typo_store = tmp_path / "observation"
    for command in (
        ["run", "real", "--generations", "1", "--local"],
        ["fork", "other", "--from", "real"],
    ):
        result = fleet.cli(*command, OUROBOROS_OBSERVATIONS=typo_store.as_uri())
        assert f"no observation store at {typo_store}" in one_line_refusal(result)
    assert not (tmp_path / "typo").exists()
    assert not typo_repo.exists() and not typo_store.exists()
    assert fleet.subjects("real") == ["seed"]

    # A new fleet elsewhere: init creates its repository and store, and says so.
    elsewhere = tmp_path / "second"
    elsewhere.mkdir()
    made = fleet.ok("init", "fresh", *SMALL_PHYSICS, OUROBOROS_HOME=str(elsewhere / "home"))
    assert f"created a new shared lineage repository at {elsewhere}/home/lineages.git" in (
        made.stderr
    )
    assert f"created a new observation store at {elsewhere}/home/observations" in made.stderr


def test_a_worker_with_a_mistyped_store_beside_an_existing_fleet_refuses_to_start(
    tmp_path: Path,
) -> None:
    fleet = Fleet(tmp_path)
    fleet.ok("init", "observed", *SMALL_PHYSICS)
    typo_store = tmp_path / "observation"
    worker = Worker(fleet, "typo", OUROBOROS_OBSERVATIONS=typo_store.as_uri())
    try:
        assert worker.process.wait(timeout=120) != 0
    finally:
        worker.stop()
    assert f"error: there is no observation store at {typo_store}" in worker.text()
    assert "OUROBOROS_OBSERVATIONS" in worker.text()
    assert not typo_store.exists()
    fleet.ok("stop-redis")
