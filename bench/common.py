"""Shared machinery of the fleet benchmarks (bench_latency, bench_parallel, bench_history, soak).

Each benchmark runs against an isolated fleet in a temporary directory, driven by the
fleet harness the tests use (``tests/support/fleet.py``: ``Fleet``, ``Worker``,
``PrivateRedis``, ``wait_for``), plus what only a benchmark needs:

* a **snapshot of the source tree** (``worker/``, ``scheduler/``, ``sandbox_scripts/``,
  ``organism.el``) copied at start and put first on ``PYTHONPATH`` (and on this
  process's ``sys.path``), so that the CLI, the worker processes and in-process code
  all run the same bytes and share one instrument fingerprint even while others edit
  the checkout (an edit between ``init`` and the worker's start would otherwise park
  the lineage on a queue no worker serves);
* an ``OUROBOROS_HOME`` of its own (shared bare repository, file observation store,
  state and worker cache), ``OUROBOROS_INSTRUMENT_COMMIT`` fixed, the ``scripted``
  provider;
* a **private redis-server** on a free 127.0.0.1 port (the test suite flushes
  databases 1-15 of the machine's Redis, so sharing it could wipe a benchmark's queue
  mid-run); ``--redis-url redis://127.0.0.1:6379/13`` uses an existing Redis instead
  (the database is flushed first);
* real ``celery -A worker worker`` processes, each in its own process group, stopped
  by their own pid;
* the command line and the reporting (medians, spreads, verdicts) of the benchmarks.

The harness imports nothing of ``worker`` or ``scheduler``. Call
``BenchFleet.activate()`` before importing anything from them in the benchmark process.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

# The fleet harness lives with the tests (they import it from there): one copy for both.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.fleet import (
    BYTECODE_CACHE,
    SMALL_PHYSICS,
    Fleet,
    PrivateRedis,
    Worker,
    helper_name,
    seed_file,
    wait_for,
)

__all__ = [
    "PYTHON",
    "SMALL_PHYSICS",
    "BenchFleet",
    "bench_args",
    "floor_argv",
    "helper_name",
    "machine_note",
    "median",
    "run_floor",
    "spread",
    "verdict",
    "wait_for",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
SOURCE_ITEMS = ("worker", "scheduler", "sandbox_scripts", "organism.el")
PYTHON = sys.executable
# A warm shutdown lets the generation in progress finish first.
WORKER_STOP_GRACE_SECONDS = 60


def snapshot_source(dest: Path) -> Path:
    """Copy the instrument's source into ``dest`` (symlinks resolved); the import root."""
    dest.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo")
    for item in SOURCE_ITEMS:
        src = REPO_ROOT / item
        if src.is_dir():
            shutil.copytree(src, dest / item, ignore=ignore)
        else:
            shutil.copy2(src, dest / item)
    return dest


class BenchFleet:
    """A harness ``Fleet`` on a snapshot of the source, with its Redis and workers."""

    def __init__(
        self,
        prefix: str,
        redis_url: str | None = None,
        keep: bool = False,
        *,
        with_redis: bool = True,
        redis_appendonly: bool = False,
        redis_password: str | None = None,
    ) -> None:
        self.root = Path(tempfile.mkdtemp(prefix=f"ouro-bench-{prefix}-"))
        self.keep = keep
        self.source = snapshot_source(self.root / "src")
        self.redis: PrivateRedis | None = None
        if not with_redis:
            # In-process pipeline only: never contacted, but settings want a URL.
            redis_url = redis_url or "redis://127.0.0.1:1/0"
        elif redis_url is None:
            self.redis = PrivateRedis(
                self.root / "redis", appendonly=redis_appendonly, password=redis_password
            )
            redis_url = self.redis.url
        else:
            _flush(redis_url)
        self.redis_url = redis_url
        self.workers: list[Worker] = []
        self.fleet = Fleet(
            self.root,
            LANG="C.UTF-8",
            PYTHONPATH=str(self.source),
            OUROBOROS_BROKER_URL=redis_url,
        )
        self.env = self.fleet.env

    # -- the benchmark process itself -------------------------------------------------

    def activate(self, **extra: str) -> None:
        """Make this process import the snapshot and see the fleet's settings."""
        for name in [n for n in os.environ if n.startswith("OUROBOROS_")]:
            del os.environ[name]
        os.environ.update({k: v for k, v in self.env.items() if k not in ("PATH", "HOME")})
        os.environ.update(extra)
        sys.path.insert(0, str(self.source))
        for name in list(sys.modules):
            if name.split(".")[0] in ("worker", "scheduler", "sandbox_scripts"):
                raise RuntimeError(f"{name} was imported before BenchFleet.activate()")

    # -- paths --------------------------------------------------------------------------

    @property
    def repo(self) -> Path:
        return self.fleet.repo

    @property
    def observations(self) -> Path:
        return self.fleet.observations

    def observation_path(self, lineage: str, generation: int) -> Path:
        return self.fleet.observation_path(lineage, generation)

    def observation_count(self, lineage: str) -> int:
        """How many observations are stored (one directory read: cheap enough to poll)."""
        directory = self.observations / "lineages" / lineage / "generations"
        try:
            return sum(1 for name in os.listdir(directory) if name.endswith(".json"))
        except FileNotFoundError:
            return 0

    def head(self, lineage: str, repo: Path | None = None) -> str | None:
        """The shared branch head, read straight from the ref file (cheap enough to poll);
        in ``repo`` (a home's repository) if given, else in the default one."""
        repo = repo or self.repo
        ref = repo / "refs" / "heads" / f"lineage-{lineage}"
        try:
            return ref.read_text().strip() or None
        except FileNotFoundError:
            pass
        out = subprocess.run(
            [
                "git",
                f"--git-dir={repo}",
                "rev-parse",
                "--verify",
                "--quiet",
                f"refs/heads/lineage-{lineage}",
            ],
            capture_output=True,
            text=True,
        ).stdout.strip()
        return out or None

    def git(self, *args: str, input: bytes | None = None) -> bytes:
        return self.fleet.git_bytes(*args, input=input)

    # -- processes ----------------------------------------------------------------------

    def cli(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """``schedule-lineage ARGS`` as a subprocess, which must succeed."""
        return self.fleet.ok(*args, timeout=timeout)

    def start_worker(
        self, name: str, concurrency: int = 1, *, as_deployed: bool = False, **env: str
    ) -> Worker:
        worker = Worker(self.fleet, name, concurrency=concurrency, as_deployed=as_deployed, **env)
        self.workers.append(worker)
        worker.wait_ready()
        return worker

    def write_seed(self, name: str, body: str) -> Path:
        return seed_file(self.root, body, name)

    def close(self) -> None:
        for worker in self.workers:
            worker.stop(WORKER_STOP_GRACE_SECONDS)
        if self.redis is not None:
            self.redis.stop()
        if self.keep:
            print(f"(kept {self.root})")
        else:
            shutil.rmtree(self.root, ignore_errors=True)
        # A benchmark ends in os._exit, which skips the harness's own removal at exit.
        shutil.rmtree(BYTECODE_CACHE, ignore_errors=True)

    def __enter__(self) -> BenchFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _flush(url: str) -> None:
    import redis  # the project's dependency, not the project

    redis.Redis.from_url(url).flushdb()


def bench_args(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--redis-url",
        help="use this Redis database (flushed first) instead of a private redis-server",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary fleet home")
    return parser


# -- the floor: the organism in the sandbox and nothing else ---------------------------


def floor_argv(seed: Path, *, tar: bool = False) -> list[str]:
    """bwrap + emacs with the worker's isolation flags, no kernel, no staging, no scope.

    With ``tar`` the life's /work is also written out as a tar to stdout after the
    organism exits 0, as the staging runner does for the worker.
    """
    from worker.instrument.sandbox import SANDBOX_PATH, USR_SYMLINKS, resolve_emacs

    emacs = [str(resolve_emacs()), "-Q", "--batch", "-l", "/work/organism.el"]
    program = (
        ["/bin/sh", "-c", '"$@" && exec tar -cf - -C /work .', "floor", *emacs] if tar else emacs
    )
    return [
        "bwrap",
        "--clearenv",
        *("--setenv", "HOME", "/work", "--setenv", "PATH", SANDBOX_PATH),
        "--unshare-all",
        "--unshare-net",
        "--unshare-user",
        "--disable-userns",
        *("--hostname", "ouroboros"),
        "--new-session",
        "--die-with-parent",
        *("--cap-drop", "ALL"),
        *("--ro-bind", "/usr", "/usr"),
        *(item for link, target in USR_SYMLINKS.items() for item in ("--symlink", target, link)),
        *("--proc", "/proc", "--dev", "/dev"),
        *("--size", str(256 << 20), "--tmpfs", "/work"),
        *("--size", str(64 << 20), "--tmpfs", "/tmp"),
        *("--ro-bind", str(seed), "/work/organism.el"),
        *("--remount-ro", "/"),
        *("--chdir", "/work"),
        "--",
        *program,
    ]


def run_floor(argv: list[str]) -> float:
    """One floor life, timed around the process; it must print "hi" and exit 0."""
    started = time.monotonic()
    result = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True)
    elapsed = time.monotonic() - started
    if result.returncode != 0 or b"hi" not in result.stderr:
        raise RuntimeError(f"floor run failed ({result.returncode}): {result.stderr[-500:]!r}")
    return elapsed


# -- reporting ---------------------------------------------------------------------------


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def spread(values: list[float], scale: float = 1000.0, unit: str = "ms") -> str:
    """``median (min-max)`` of values, scaled for display."""
    ordered = sorted(values)
    return (
        f"{statistics.median(ordered) * scale:8.1f} {unit}"
        f"  (min {ordered[0] * scale:.1f}, max {ordered[-1] * scale:.1f})"
    )


def verdict(ratio: float, target: float, higher_is_better: bool) -> str:
    ok = ratio >= target if higher_is_better else ratio <= target
    sign = ">=" if higher_is_better else "<="
    return f"ratio {ratio:.2f}x   target {sign} {target:g}x   {'PASS' if ok else 'MISS'}"


def machine_note() -> str:
    load = os.getloadavg()
    return f"host: {os.cpu_count()} cpus, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
