"""Benchmark: eight lineages in parallel against one alone, on one worker of concurrency 8.

Eight lineages of the canonical seed organism (it calls the model once per life),
small physics (``--wall 60 --cpu-seconds 60 --memory-max 256M``), the ``scripted``
provider answering after 1 s (``OUROBOROS_SCRIPTED_LATENCY_SECONDS=1``), one real
``celery -A worker worker --concurrency=8`` on a private Redis.

Phases alternate on the same warm worker: **solo** (lineage p0 alone) and **eight**
(p0..p7). A phase starts its runs with ``schedule-lineage run ... --generations
100000`` (the click command, in this process), waits until every lineage of the
phase has landed a generation (steady state), counts the observations stored during
a window of ``--window`` seconds, then cancels the runs and waits until nothing is in
flight. Throughput is generations landed (commit pushed and observation stored) per
minute; the ratio is eight over solo, from the summed windows of each side.

Target: >= 6x. Run: ``.venv/bin/python bench/bench_parallel.py [--window 30 --rounds 2]``.
A measurement, not a test: exits 0 whether the target is met or not.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    SMALL_PHYSICS,
    BenchFleet,
    bench_args,
    machine_note,
    median,
    verdict,
    wait_for,
)

TARGET = 6.0
NAMES = [f"p{i}" for i in range(8)]
LATENCY = "1"


def main() -> None:
    parser = bench_args(__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=30.0, help="seconds counted per phase")
    parser.add_argument("--rounds", type=int, default=2, help="solo/eight pairs")
    args = parser.parse_args()

    with BenchFleet("parallel", args.redis_url, args.keep) as fleet:
        fleet.activate()
        import redis

        import scheduler.cli as cli_module

        client = redis.Redis.from_url(fleet.redis_url)

        def cli(*argv: str) -> None:
            with contextlib.redirect_stdout(io.StringIO()):
                cli_module.cli.main(list(argv), standalone_mode=False)

        for name in NAMES:
            cli("init", name, *SMALL_PHYSICS)
        fleet.start_worker("w8", concurrency=8, OUROBOROS_SCRIPTED_LATENCY_SECONDS=LATENCY)

        def counts(names: list[str]) -> dict[str, int]:
            return {name: fleet.observation_count(name) for name in names}

        def quiet(names: list[str]) -> bool:
            keys = [f"ouroboros:{kind}:{n}" for n in names for kind in ("inflight", "lease")]
            return not client.exists(*keys)

        def phase(names: list[str], window: float) -> tuple[int, float, list[float]]:
            before = counts(names)
            cli("run", *names, "--generations", "100000")
            # Steady state: every lineage of the phase has landed one generation here.
            wait_for(
                lambda: all(c > before[n] for n, c in counts(names).items()),
                180,
                "every lineage to land a generation",
                0.02,
            )
            start_counts, started = counts(names), time.monotonic()
            time.sleep(window)
            end_counts, ended = counts(names), time.monotonic()
            for name in names:
                cli("cancel", name)
            wait_for(lambda: quiet(names), 180, "the phase's generations to finish", 0.05)
            time.sleep(0.5)
            lives = []
            for name in names:
                for generation in range(start_counts[name] + 1, end_counts[name] + 1):
                    path = fleet.observation_path(name, generation)
                    lives.append(float(json.loads(path.read_text())["duration_seconds"]))
            landed = sum(end_counts.values()) - sum(start_counts.values())
            return landed, ended - started, lives

        print(machine_note())
        print("warm-up: eight lineages until each has landed one generation ...", flush=True)
        phase(NAMES, 0.0)

        sides: dict[str, list[tuple[int, float, list[float]]]] = {"solo": [], "eight": []}
        print(
            f"{'round':>5} {'side':>6} {'landed':>7} {'seconds':>8} {'gen/min':>8} "
            f"{'life s (median)':>16}"
        )
        for round_ in range(args.rounds):
            order = ["solo", "eight"] if round_ % 2 == 0 else ["eight", "solo"]
            for side in order:
                names = NAMES[:1] if side == "solo" else NAMES
                landed, seconds, lives = phase(names, args.window)
                sides[side].append((landed, seconds, lives))
                print(
                    f"{round_ + 1:>5} {side:>6} {landed:>7} {seconds:>8.1f} "
                    f"{landed / seconds * 60:>8.1f} {median(lives) if lives else 0:>16.2f}",
                    flush=True,
                )

        def rate(side: str) -> float:
            landed = sum(p[0] for p in sides[side])
            seconds = sum(p[1] for p in sides[side])
            return landed / seconds * 60

        solo, eight = rate("solo"), rate("eight")
        subjects = fleet.git("log", "-1", "--format=%s", "lineage-p0").decode().strip()
        print()
        print(f"last commit of p0: {subjects!r}")
        print(f"one lineage alone:   {solo:7.1f} generations/minute")
        print(f"eight lineages:      {eight:7.1f} generations/minute")
        print(f"eight vs one: {verdict(eight / solo, TARGET, higher_is_better=True)}")
        if "Traceback" in fleet.workers[0].text():
            print("note: the worker logged a traceback; see --keep", file=sys.stderr)
    os._exit(0)  # the Celery producer's threads must not hold the exit


if __name__ == "__main__":
    main()
