"""Lineages lived through the real CLI and real workers, as the pipeline and fleet tests
live them: ``make_lineage`` and ``run_one`` (``init``, then one generation of
``run --local``), ``push_hand_commit`` (a commit from outside the fleet), ``start`` (a
worker, waited for), ``background`` (a CLI command left running), and the checks of
a lineage's history (``generations``, ``assert_linear``); ``SLOW`` and
``WRITES_STATE`` are organism bodies.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from support.fleet import SMALL_PHYSICS, Fleet, Worker, seed_file

SLOW = "(sleep-for {seconds})\n"
WRITES_STATE = '(with-temp-file "/work/state.el" (insert (format "%S" (random))))\n'


def start(fleet: Fleet, workers: list[Worker], name: str, *extra_args: str, **env: str) -> Worker:
    worker = Worker(fleet, name, *extra_args, **env)
    workers.append(worker)
    worker.wait_ready()
    return worker


def background(fleet: Fleet, *args: str, log: Path | None = None) -> subprocess.Popen[bytes]:
    """``schedule-lineage ARGS`` in the background, its output in ``log`` (or nowhere)."""
    with (log or Path(os.devnull)).open("wb") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "scheduler", *args],
            env=fleet.env,
            cwd=fleet.home,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def generations(fleet: Fleet, lineage: str) -> list[str]:
    return [s for s in fleet.subjects(lineage) if s.startswith("gen ")]


def assert_linear(fleet: Fleet, lineage: str, count: int) -> None:
    subjects = generations(fleet, lineage)
    assert [s.split(":")[0] for s in subjects] == [f"gen {n}" for n in range(count, 0, -1)]
    assert fleet.git("rev-list", "--merges", f"lineage-{lineage}").strip() == ""
    assert fleet.observation_numbers(lineage) == list(range(1, count + 1))


def make_lineage(fleet: Fleet, name: str, body: str | None = None, *extra: str) -> None:
    seed = ["--seed", str(seed_file(fleet.home, body, f"{name}.el"))] if body else []
    fleet.ok("init", name, *seed, *SMALL_PHYSICS, *extra)


def run_one(fleet: Fleet, name: str, **env: str) -> subprocess.CompletedProcess[str]:
    return fleet.ok("run", name, "--generations", "1", "--local", **env)


def push_hand_commit(fleet: Fleet, lineage: str, files: dict[str, str], subject: str) -> None:
    """Commit ``files`` on top of the lineage branch from outside the fleet."""
    work = fleet.home / f"hand-{lineage}"
    if work.exists():
        shutil.rmtree(work)
    subprocess.run(
        ["git", "clone", "-q", "-b", f"lineage-{lineage}", str(fleet.repo), str(work)], check=True
    )
    for path, text in files.items():
        (work / path).write_text(text)
    git = ["git", "-C", str(work), "-c", "user.name=human", "-c", "user.email=h@example.invalid"]
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", subject], check=True)
    subprocess.run([*git, "push", "-q", "origin", f"lineage-{lineage}"], check=True)
