"""Helpers for tests that create lineages and run generations through the real CLI.

Each test gets its own ``OUROBOROS_HOME`` (shared bare repository, file observation
store, state) and drives ``python -m scheduler`` as a subprocess with a clean
environment, exactly as a user would.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

INSTRUMENT_COMMIT = "a" * 40

# Enough to make an organism's life observable in a second or two of CPU.
SMALL_PHYSICS = ["--wall", "60", "--cpu-seconds", "60", "--memory-max", "512M"]


class Fleet:
    """One isolated fleet home and the CLI bound to it."""

    def __init__(self, home: Path, **extra_env: str) -> None:
        self.home = home
        self.env = {
            "PATH": os.environ["PATH"],
            "HOME": str(home),
            "OUROBOROS_HOME": str(home / ".ouroboros"),
            "OUROBOROS_INSTRUMENT_COMMIT": INSTRUMENT_COMMIT,
            "OUROBOROS_MODEL_PROVIDER": "scripted",
            **extra_env,
        }

    @property
    def repo(self) -> Path:
        return self.home / ".ouroboros" / "lineages.git"

    @property
    def observations(self) -> Path:
        return self.home / ".ouroboros" / "observations"

    def cli(self, *args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "scheduler", *args],
            env={**self.env, **env},
            # Not the checkout: ``python -m`` puts the working directory first on sys.path.
            cwd=self.home,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def ok(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        result = self.cli(*args, **env)
        assert result.returncode == 0, result.stderr + result.stdout
        return result

    def git(self, *args: str) -> str:
        return subprocess.run(
            ["git", f"--git-dir={self.repo}", *args],
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    def subjects(self, lineage: str) -> list[str]:
        return self.git("log", "--format=%s", f"lineage-{lineage}").splitlines()

    def show(self, lineage: str, path: str, rev: str = "") -> str:
        return self.git("show", f"lineage-{lineage}{rev}:{path}")

    def files(self, lineage: str) -> list[str]:
        return self.git("ls-tree", "-r", "--name-only", f"lineage-{lineage}").splitlines()

    def observation(self, lineage: str, generation: int) -> dict[str, object]:
        path = self.observations / "lineages" / lineage / "generations" / f"{generation:06d}.json"
        return json.loads(path.read_text())

    def observation_numbers(self, lineage: str) -> list[int]:
        directory = self.observations / "lineages" / lineage / "generations"
        return sorted(int(p.stem) for p in directory.glob("*.json")) if directory.exists() else []


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at the moment of the call."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def seed_file(directory: Path, body: str, name: str = "seed.el") -> Path:
    path = directory / name
    path.write_text(";;; test organism  -*- lexical-binding: t; -*-\n" + body)
    return path


class Worker:
    """A real ``celery -A worker worker`` process in its own process group."""

    def __init__(self, fleet: Fleet, name: str, *extra_args: str, **env: str) -> None:
        self.name = name
        self.log_path = fleet.home / f"worker-{name}.log"
        self.log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "worker",
                "worker",
                "--loglevel=INFO",
                "-n",
                f"{name}@%h",
                "--concurrency=1",
                "--without-gossip",
                "--without-mingle",
                *extra_args,
            ],
            # As every launcher does (units, image, demo): the worker package's own
            # __init__ is compiled before its first line can switch bytecode off.
            env={**fleet.env, "PYTHONDONTWRITEBYTECODE": "1", **env},
            cwd=fleet.home,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while "ready." not in self.text():
            assert self.process.poll() is None, self.text()
            assert time.monotonic() < deadline, self.text()
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL the whole worker: main process, pool children, sandboxes."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
