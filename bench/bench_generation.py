"""Benchmark: what a generation of `run --local` costs beyond its life, and what it spawns.

The organism of ``bench_latency`` (prints "hi", writes one file, so every generation is
a real ``changed`` commit). Measured side by side, rounds alternating which side goes
first, median of the rounds:

* **floor** - N lives of the same organism run directly, one after another: the
  worker's hardened ``bwrap`` flags + ``emacs -Q --batch`` + ``tar`` of /work to stdout
  (what the staging runner hands the worker), no git, no store; time per life.
* **local** - ``schedule-lineage run NAME --local --generations N`` as a subprocess
  (interpreter start, imports, pipeline set-up and N generations: fetch, kernel dir,
  cgroup ceiling, sandbox, decoder, commit, compare-and-swap push, observation and
  index written), amortised: time per generation.

Then one more ``run --local`` under ``strace -f`` (execve and the clones, one file per
process) counts the processes it spawned outside the sandbox (a ``bwrap`` and all its
descendants are the life): git and every other helper, per generation, by name.

With ``--profile``, one more ``run --local`` under ``cProfile`` prints where the run's own
process's main thread spends its time: waiting (for the thread that lives the life,
which cProfile does not see, and for children) apart, then the functions of most own time.

Targets: local <= 1.5x floor; <= 3 helper processes per generation, none of them
``git gc`` or ``git maintenance``.

Run: ``.venv/bin/python bench/bench_generation.py [--generations 20 --rounds 5]`` from the
repository root. A measurement, not a test: exits 0 whether the targets are met or not.
"""

from __future__ import annotations

import collections
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    PYTHON,
    SMALL_PHYSICS,
    BenchFleet,
    bench_args,
    floor_argv,
    helper_name,
    machine_note,
    median,
    run_floor,
    spread,
    verdict,
)

TARGET = 1.5
PROCESS_TARGET = 3
LINEAGE = "hello"
ORGANISM = (
    '(message "hi")\n(with-temp-file "/work/hello.txt" (insert (format "%S\\n" (random t))))\n'
)
FORBIDDEN = ("gc", "maintenance", "repack", "prune")
# Where the run's main thread waits: for the thread that lives the life (a lock), for
# the sandbox and other children. cProfile sees the main thread only.
WAITS = ("acquire", "poll", "select", "waitpid", "method 'read'", "_wait", "communicate")


def run_local(fleet: BenchFleet, generations: int, interpreter: list[str] | None = None) -> float:
    """``run --local`` of ``generations`` generations; wall seconds."""
    started = time.monotonic()
    done = subprocess.run(
        [
            *(interpreter or [PYTHON]),
            "-m",
            "scheduler",
            "run",
            LINEAGE,
            "--local",
            "--generations",
            str(generations),
        ],
        env=fleet.env,
        cwd=fleet.root,
        capture_output=True,
        text=True,
    )
    elapsed = time.monotonic() - started
    if done.returncode != 0 or done.stdout.count(": changed") != generations:
        raise RuntimeError(f"run --local failed ({done.returncode}): {done.stdout[-800:]}")
    return elapsed


def profile(fleet: BenchFleet, generations: int) -> None:
    """One ``run --local`` under cProfile: own time per function, per generation."""
    out = fleet.root / "run-local.prof"
    wall = run_local(fleet, generations, [PYTHON, "-m", "cProfile", "-o", str(out)])
    stats = pstats.Stats(str(out))
    rows = sorted(
        (
            (own, f"{Path(file).name}:{line} {name}")
            for (file, line, name), (_, _, own, _, _) in stats.stats.items()
        ),
        reverse=True,
    )
    waiting = sum(own for own, where in rows if any(w in where for w in WAITS))
    worked = stats.total_tt - waiting
    print()
    print(
        f"profile of one run --local ({generations} generations, {wall * 1000 / generations:.1f} "
        f"ms each under cProfile): its main thread waited {waiting * 1000 / generations:.1f} ms "
        f"(the life's thread, children), worked {worked * 1000 / generations:.1f} ms a generation"
    )
    for own, where in [row for row in rows if not any(w in row[1] for w in WAITS)][:15]:
        print(f"  {own * 1000 / generations:7.2f} ms  {where}")


def main() -> None:
    parser = bench_args(__doc__.splitlines()[0])
    parser.add_argument("--generations", type=int, default=20, help="generations per sample")
    parser.add_argument("--rounds", type=int, default=5, help="samples per side")
    parser.add_argument("--profile", action="store_true", help="profile one more run --local")
    args = parser.parse_args()

    with BenchFleet("generation", keep=args.keep, with_redis=False) as fleet:
        fleet.activate()
        seed = fleet.write_seed("hello.el", ORGANISM)
        fleet.cli("init", LINEAGE, "--seed", str(seed), *SMALL_PHYSICS)
        argv = floor_argv(seed, tar=True)
        run_local(fleet, 2)
        run_floor(argv)

        floors: list[float] = []
        locals_: list[float] = []
        print(machine_note())
        print(f"{'#':>3} {'floor ms':>9} {'local ms':>9} {'ratio':>6}   order (per life)")
        for i in range(args.rounds):
            order = ["floor", "local"] if i % 2 == 0 else ["local", "floor"]
            for side in order:
                if side == "floor":
                    floors.append(
                        sum(run_floor(argv) for _ in range(args.generations)) / args.generations
                    )
                else:
                    locals_.append(run_local(fleet, args.generations) / args.generations)
            print(
                f"{i + 1:>3} {floors[-1] * 1000:9.1f} {locals_[-1] * 1000:9.1f} "
                f"{locals_[-1] / floors[-1]:6.2f}   {' > '.join(order)}",
                flush=True,
            )

        spawned = fleet.fleet.traced(
            "run", LINEAGE, "--local", "--generations", str(args.generations)
        )
        tally = collections.Counter(helper_name(p) for p in spawned)
        forbidden = sum(n for name, n in tally.items() if name.split(" ")[-1] in FORBIDDEN)
        per_generation = len(spawned) / args.generations

        print()
        print(f"floor (bwrap + emacs + tar), per life        {spread(floors)}")
        print(f"run --local, per generation (amortised)      {spread(locals_)}")
        ratio = median(locals_) / median(floors)
        print(f"per-generation overhead vs floor: {verdict(ratio, TARGET, higher_is_better=False)}")
        print(
            f"helper processes over {args.generations} traced generations: {len(spawned)} "
            f"({', '.join(f'{name} x{n}' for name, n in tally.most_common())})"
        )
        ok = per_generation <= PROCESS_TARGET and forbidden == 0
        print(
            f"helper processes per generation: {per_generation:.2f}, gc/maintenance: {forbidden}   "
            f"target <= {PROCESS_TARGET}, none gc/maintenance   {'PASS' if ok else 'MISS'}"
        )
        if args.profile:
            profile(fleet, args.generations)
    os._exit(0)


if __name__ == "__main__":
    main()
