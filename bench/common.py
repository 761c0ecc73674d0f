"""Shared machinery of the fleet benchmarks (bench_latency, bench_parallel, bench_history).

Each benchmark runs against an isolated fleet in a temporary directory:

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
  by their own pid.

Nothing here imports from ``tests/``. Call ``BenchFleet.activate()`` before importing
anything from ``worker`` or ``scheduler`` in the benchmark process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SOURCE_ITEMS = ("worker", "scheduler", "sandbox_scripts", "organism.el")
INSTRUMENT_COMMIT = "a" * 40
# Small physics: enough for a trivial life, and quick cgroup setup.
SMALL_PHYSICS = ["--wall", "60", "--cpu-seconds", "60", "--memory-max", "256M"]
PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


def wait_for(
    predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05
) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


class PrivateRedis:
    """A throw-away redis-server on a free TCP port, no persistence."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        directory.mkdir(parents=True, exist_ok=True)
        self.log = (directory / "redis.log").open("wb")
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(directory),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.url = f"redis://127.0.0.1:{self.port}/0"
        wait_for(self._pings, 20, "the private redis-server")

    def _pings(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError("redis-server exited; see its log")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


class Worker:
    """A real ``celery -A worker worker`` process in its own process group."""

    def __init__(self, fleet: BenchFleet, name: str, concurrency: int = 1, **env: str) -> None:
        self.name = name
        self.log_path = fleet.root / f"worker-{name}.log"
        self.log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [
                PYTHON,
                "-m",
                "celery",
                "-A",
                "worker",
                "worker",
                "--loglevel=INFO",
                "-n",
                f"{name}@%h",
                f"--concurrency={concurrency}",
                "--without-gossip",
                "--without-mingle",
            ],
            env={**fleet.env, **env},
            cwd=fleet.root,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120) -> None:
        def ready() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited:\n{self.text()[-3000:]}")
            return "ready." in self.text()

        wait_for(ready, timeout, f"worker {self.name} to be ready", 0.1)

    def stop(self) -> None:
        """SIGTERM (warm shutdown) to the worker's own process group; SIGKILL if it lingers."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        self.log.close()


class BenchFleet:
    """An isolated fleet home: snapshot source, env, Redis, workers; a context manager."""

    def __init__(
        self,
        prefix: str,
        redis_url: str | None = None,
        keep: bool = False,
        *,
        with_redis: bool = True,
    ) -> None:
        self.root = Path(tempfile.mkdtemp(prefix=f"ouro-bench-{prefix}-"))
        self.keep = keep
        self.source = snapshot_source(self.root / "src")
        self.home = self.root / ".ouroboros"
        self.redis: PrivateRedis | None = None
        if not with_redis:
            # In-process pipeline only: never contacted, but settings want a URL.
            redis_url = redis_url or "redis://127.0.0.1:1/0"
        elif redis_url is None:
            self.redis = PrivateRedis(self.root / "redis")
            redis_url = self.redis.url
        else:
            _flush(redis_url)
        self.redis_url = redis_url
        self.workers: list[Worker] = []
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.root),
            "LANG": "C.UTF-8",
            "PYTHONPATH": str(self.source),
            "PYTHONDONTWRITEBYTECODE": "1",
            "OUROBOROS_HOME": str(self.home),
            "OUROBOROS_INSTRUMENT_COMMIT": INSTRUMENT_COMMIT,
            "OUROBOROS_MODEL_PROVIDER": "scripted",
            "OUROBOROS_BROKER_URL": redis_url,
        }

    # -- the benchmark process itself -------------------------------------------------

    def activate(self, **extra: str) -> None:
        """Make this process import the snapshot and see the fleet's settings."""
        for name in [n for n in os.environ if n.startswith("OUROBOROS_")]:
            del os.environ[name]
        os.environ.update({k: v for k, v in self.env.items() if k not in ("PATH", "HOME")})
        os.environ.update(extra)
        sys.dont_write_bytecode = True
        sys.path.insert(0, str(self.source))
        for name in list(sys.modules):
            if name.split(".")[0] in ("worker", "scheduler", "sandbox_scripts"):
                raise RuntimeError(f"{name} was imported before BenchFleet.activate()")

    # -- paths --------------------------------------------------------------------------

    @property
    def repo(self) -> Path:
        return self.home / "lineages.git"

    @property
    def observations(self) -> Path:
        return self.home / "observations"

    def observation_path(self, lineage: str, generation: int) -> Path:
        return self.observations / "lineages" / lineage / "generations" / f"{generation:06d}.json"

    def observation_count(self, lineage: str) -> int:
        directory = self.observations / "lineages" / lineage / "generations"
        try:
            return sum(1 for name in os.listdir(directory) if name.endswith(".json"))
        except FileNotFoundError:
            return 0

    def head(self, lineage: str) -> str | None:
        """The shared branch head, read straight from the ref file (cheap enough to poll)."""
        ref = self.repo / "refs" / "heads" / f"lineage-{lineage}"
        try:
            return ref.read_text().strip() or None
        except FileNotFoundError:
            pass
        out = subprocess.run(
            [
                "git",
                f"--git-dir={self.repo}",
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
        return subprocess.run(
            ["git", f"--git-dir={self.repo}", *args], input=input, capture_output=True, check=True
        ).stdout

    # -- processes ----------------------------------------------------------------------

    def cli(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """``schedule-lineage ARGS`` as a subprocess (``python -m scheduler``)."""
        result = subprocess.run(
            [PYTHON, "-m", "scheduler", *args],
            env=self.env,
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"schedule-lineage {' '.join(args)} failed ({result.returncode}):\n"
                f"{result.stderr}{result.stdout}"
            )
        return result

    def start_worker(self, name: str, concurrency: int = 1, **env: str) -> Worker:
        worker = Worker(self, name, concurrency, **env)
        self.workers.append(worker)
        worker.wait_ready()
        return worker

    def write_seed(self, name: str, body: str) -> Path:
        path = self.root / name
        path.write_text(";;; bench organism  -*- lexical-binding: t; -*-\n" + body)
        return path

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        if self.redis is not None:
            self.redis.stop()
        if self.keep:
            print(f"(kept {self.root})")
        else:
            shutil.rmtree(self.root, ignore_errors=True)

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
