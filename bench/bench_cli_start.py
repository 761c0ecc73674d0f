"""Benchmark: how soon the CLI answers, against ``python -c 'import click'``.

Three commands, each a fresh interpreter, interleaved (the order rotates every
round), median of N each:

* **click** - ``python -c 'import click'``: the floor of any click program;
* **help** - ``schedule-lineage --help`` (``python -m scheduler --help``);
* **status** - ``schedule-lineage status --json`` on the embedded default: no broker
  configured, so the command finds (and, the first time, starts) the embedded Redis
  under ``OUROBOROS_HOME``; one lineage without a run, as a fleet at rest shows it;
* **libraries** - ``python -c 'import click, pydantic_settings, redis, pygit2'``: the
  libraries ``status`` cannot answer without (settings, the broker, the repository),
  imported and nothing else; the least ``status`` can take, printed as its own ratio.

Targets: help <= 3x click; status <= 6x click.

Run: ``.venv/bin/python bench/bench_cli_start.py [--samples 15]`` from the repository
root. A measurement, not a test: exits 0 whether the targets are met or not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PYTHON, SMALL_PHYSICS, BenchFleet, bench_args, machine_note, median, spread

TARGETS = {"help": 3.0, "status": 6.0}


def main() -> None:
    parser = bench_args(__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=15, help="samples per command")
    args = parser.parse_args()

    with BenchFleet("cli", keep=args.keep, with_redis=False) as fleet:
        # The embedded default: no broker URL at all.
        env = {k: v for k, v in fleet.env.items() if k != "OUROBOROS_BROKER_URL"}
        fleet.cli("init", "resting", *SMALL_PHYSICS)
        commands = {
            "click": [PYTHON, "-c", "import click"],
            "help": [PYTHON, "-m", "scheduler", "--help"],
            "status": [PYTHON, "-m", "scheduler", "status", "--json"],
            "libraries": [PYTHON, "-c", "import click, pydantic_settings, redis, pygit2"],
        }

        def timed(name: str) -> float:
            started = time.monotonic()
            done = subprocess.run(commands[name], env=env, cwd=fleet.root, capture_output=True)
            elapsed = time.monotonic() - started
            if done.returncode != 0:
                raise RuntimeError(f"{name} failed: {done.stderr.decode()[-500:]}")
            if name == "status":
                (row,) = json.loads(done.stdout)
                assert row["lineage"] == "resting"
            return elapsed

        timed("status")  # starts the embedded Redis: a one-off, not measured
        samples: dict[str, list[float]] = {name: [] for name in commands}
        names = list(commands)
        print(machine_note())
        for i in range(args.samples):
            order = names[i % len(names) :] + names[: i % len(names)]
            for name in order:
                samples[name].append(timed(name))
        for name in names:
            print(f"{name:<9} {spread(samples[name])}")
        floor = median(samples["click"])
        for name, target in TARGETS.items():
            ratio = median(samples[name]) / floor
            print(
                f"{name} vs import click: ratio {ratio:.2f}x   target <= {target:g}x   "
                f"{'PASS' if ratio <= target else 'MISS'}"
            )
        print(
            f"status's libraries alone vs import click: ratio "
            f"{median(samples['libraries']) / floor:.2f}x (the least status can take); "
            f"status's own modules and work: "
            f"{(median(samples['status']) - median(samples['libraries'])) * 1000:.1f} ms"
        )
        subprocess.run(
            [
                PYTHON,
                "-c",
                "from worker.fleet import embedded_redis; from worker.fleet.settings "
                "import Settings; embedded_redis.stop(Settings())",
            ],
            env=env,
            cwd=fleet.root,
            check=True,
        )
    os._exit(0)


if __name__ == "__main__":
    main()
