"""Benchmark: what replaying a lineage costs against the lives that made its record.

A lineage of the canonical seed (a model call and a new body every generation, the
``scripted`` provider) lives N generations through ``run --local``; then
``schedule-lineage replay NAME --all`` replays it, several rounds. Side by side, per
generation:

* **lives** - the lineage's own recorded life time: the mean ``duration_seconds`` of
  its observations (the sandbox, from start to exit);
* **run** - ``run --local``'s wall time per generation (what made the record: lives
  plus planning, commit, push, observation);
* **replay** - ``replay --all``'s wall time per generation (the median round),
  each generation lived again and judged, its report written.

Target: replay <= 1.5x run (a replay is a generation without its publication, plus
the comparison); every round must say ``N reproduced``.

It also prints, from the reports' own durations, a generation's replay early in the
history against one late in it (the first tenth against the last), so that a cost that
grows with the history shows at 1,000 generations.

Run: ``.venv/bin/python bench/bench_replay.py [--generations 20 --rounds 3]`` from the
repository root. A measurement, not a test: exits 0 whether the target is met or not.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SMALL_PHYSICS, BenchFleet, bench_args, machine_note, median, spread, verdict

TARGET = 1.5
LINEAGE = "replayed"


def timed(fleet: BenchFleet, *args: str, timeout: float) -> tuple[float, str]:
    started = time.monotonic()
    done = fleet.cli(*args, timeout=timeout)
    elapsed = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stdout[-800:]}")
    return elapsed, done.stdout


def main() -> None:
    parser = bench_args(__doc__.splitlines()[0])
    parser.add_argument("--generations", type=int, default=20, help="generations to replay")
    parser.add_argument("--rounds", type=int, default=3, help="replays of the whole lineage")
    args = parser.parse_args()
    n = args.generations

    with BenchFleet("replay", keep=args.keep, with_redis=False) as fleet:
        fleet.activate()
        fleet.cli("init", LINEAGE, *SMALL_PHYSICS)
        # Generous: a generation takes well under a second even on a loaded machine.
        timeout = 60 + 5 * n
        run_seconds, _ = timed(
            fleet, "run", LINEAGE, "--local", "--generations", str(n), timeout=timeout
        )
        lives = [
            json.loads(fleet.observation_path(LINEAGE, g).read_text())["duration_seconds"]
            for g in range(1, n + 1)
        ]
        life, run = sum(lives) / n, run_seconds / n
        print(machine_note())
        print(f"{n} generations; lives {life * 1000:.0f} ms, run --local {run * 1000:.0f} ms each")
        print(f"{'#':>3} {'replay ms':>10} {'/lives':>7} {'/run':>6}   summary")
        replays: list[float] = []
        for i in range(args.rounds):
            seconds, out = timed(fleet, "replay", LINEAGE, "--all", timeout=timeout)
            summary = out.strip().splitlines()[-1]
            if f"{n} reproduced" not in summary:
                raise RuntimeError(f"round {i + 1} did not reproduce every generation: {summary}")
            replays.append(seconds / n)
            print(
                f"{i + 1:>3} {replays[-1] * 1000:10.0f} {replays[-1] / life:7.2f} "
                f"{replays[-1] / run:6.2f}   {summary}",
                flush=True,
            )
        # Whether a generation's replay costs more late in a long history than early:
        # each report's own duration (its life and judgement), first tenth against last.
        reports = [
            json.loads(
                (fleet.observations / f"lineages/{LINEAGE}/replays/{g:06d}.json").read_text()
            )["duration_seconds"]
            for g in range(1, n + 1)
        ]
        tenth = max(1, n // 10)
        early, late = median(reports[:tenth]), median(reports[-tenth:])
        print(
            f"one replay (its report's duration): generations 1-{tenth} median "
            f"{early * 1000:.0f} ms, {n - tenth + 1}-{n} median {late * 1000:.0f} ms "
            f"({late / early:.2f}x)"
        )
        per = median(replays)
        print(f"replay per generation: median {per * 1000:.0f} ms {spread(replays)}")
        print(f"replay / lives: {per / life:.2f}x; replay / run --local: {per / run:.2f}x")
        print(verdict(per / run, TARGET, higher_is_better=False))


if __name__ == "__main__":
    main()
