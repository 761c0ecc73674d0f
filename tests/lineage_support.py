"""Helpers for tests that create lineages and run generations through the real CLI.

Each test gets its own ``OUROBOROS_HOME`` (shared bare repository, file observation
store, state) and drives ``python -m scheduler`` as a subprocess with a clean
environment, exactly as a user would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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

    def cli(
        self, *args: str, timeout: float = 600, **env: str
    ) -> subprocess.CompletedProcess[str]:
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


def seed_file(directory: Path, body: str, name: str = "seed.el") -> Path:
    path = directory / name
    path.write_text(";;; test organism  -*- lexical-binding: t; -*-\n" + body)
    return path
