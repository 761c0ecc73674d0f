"""Benchmark: end-to-end latency of one generation of a trivial organism, against the floor.

The organism prints "hi" and writes one file (so every generation is a real
``changed`` commit). Measured, interleaved, median of N each:

* **floor** - the same organism run directly: ``bwrap`` (the worker's own isolation
  flags: cleared env, all namespaces, no capabilities, read-only /usr, tmpfs /work)
  + ``emacs-nox -Q --batch -l /work/organism.el``, timed around the process.
* **fleet** - ``schedule-lineage run NAME --generations 1`` invoked in this process
  (the real click command: run record, planner, in-flight marker, Celery message to
  a private Redis) with a warm ``celery -A worker worker --concurrency=1`` already
  running, until the generation's commit is on the shared bare repository *and* its
  observation object is stored (polled every 2 ms).
* **cli** - the whole command: ``schedule-lineage run NAME --generations 1`` as a
  subprocess (interpreter start, imports, run record, job sent) until landed.

Targets: the fleet's part, from the job sent (enqueued) to landed, <= 2x floor; the
whole command (cli) <= 3x floor; the in-process command until landed is printed too.
Also prints where the fleet's time goes, from the observation's own clocks (same
host): enqueue -> life starts, the life (kernel dir, model socket, cgroup scope,
bwrap, staging tar in and out), life ends -> landed.

Run: ``.venv/bin/python bench/bench_latency.py [--samples 12]`` from the repo root.
A measurement, not a test: exits 0 whether the target is met or not.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    PYTHON,
    SMALL_PHYSICS,
    BenchFleet,
    bench_args,
    floor_argv,
    machine_note,
    median,
    run_floor,
    spread,
    verdict,
)

FLEET_TARGET = 2.0
COMMAND_TARGET = 3.0
LINEAGE = "hello"
ORGANISM = (
    '(message "hi")\n(with-temp-file "/work/hello.txt" (insert (format "%S\\n" (random t))))\n'
)
POLL_SECONDS = 0.002
LANDING_TIMEOUT = 120.0


class Landing:
    """Waits for the next generation of LINEAGE to be committed and observed."""

    def __init__(self, fleet: BenchFleet) -> None:
        self.fleet = fleet
        self.parent = fleet.head(LINEAGE)
        self.generation = fleet.observation_count(LINEAGE) + 1
        self.path = fleet.observation_path(LINEAGE, self.generation)

    def wait(self, started: float) -> float:
        while True:
            if self.path.exists() and self.fleet.head(LINEAGE) != self.parent:
                return time.monotonic()
            if time.monotonic() - started > LANDING_TIMEOUT:
                diagnose(self.fleet)
                raise TimeoutError(f"generation {self.generation} did not land")
            time.sleep(POLL_SECONDS)

    def observation(self) -> dict[str, object]:
        return json.loads(self.path.read_text())


def diagnose(fleet: BenchFleet) -> None:
    """What the fleet looked like when a generation failed to land (stderr)."""
    import redis

    client = redis.Redis.from_url(fleet.redis_url)
    keys = {k.decode(): client.type(k).decode() for k in client.keys("*")}
    print(f"redis keys: {keys}", file=sys.stderr)
    print(
        f"head {fleet.head(LINEAGE)}; observations {fleet.observation_count(LINEAGE)}",
        file=sys.stderr,
    )
    for worker in fleet.workers:
        print(f"--- worker {worker.name} log tail ---\n{worker.text()[-4000:]}", file=sys.stderr)


def wait_idle(fleet: BenchFleet, client: object) -> None:
    """Until the worker has finished the task's tail (markers cleared), then a breath."""
    deadline = time.monotonic() + 60
    while client.exists(f"ouroboros:inflight:{LINEAGE}", f"ouroboros:lease:{LINEAGE}"):  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            raise TimeoutError("the worker did not go idle")
        time.sleep(0.01)
    time.sleep(0.3)


def main() -> None:
    parser = bench_args(__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=12, help="samples per side (>= 10)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured generations first")
    parser.add_argument("--no-cli", action="store_true", help="skip the subprocess CLI column")
    args = parser.parse_args()

    with BenchFleet("latency", args.redis_url, args.keep) as fleet:
        fleet.activate()
        import redis

        import scheduler.cli as cli_module
        import worker.instrument.gitrepo as gitrepo

        # Count the git commands `schedule-lineage run` itself runs (the scheduler side).
        git_calls: collections.Counter[str] = collections.Counter()
        run_git = gitrepo.run_git

        def counting_run_git(git_dir: object, *argv: str, **kwargs: object) -> object:
            git_calls[argv[0]] += 1
            return run_git(git_dir, *argv, **kwargs)

        gitrepo.run_git = counting_run_git

        # The click command's own output goes nowhere; the commit and observation speak.
        client = redis.Redis.from_url(fleet.redis_url)
        seed = fleet.write_seed("hello.el", ORGANISM)
        fleet.cli("init", LINEAGE, "--seed", str(seed), *SMALL_PHYSICS)
        fleet.start_worker("w1", concurrency=1)
        argv = floor_argv(seed)

        def fleet_inprocess() -> tuple[float, dict[str, object], float, float]:
            landing = Landing(fleet)
            git_calls.clear()
            wall0 = time.time()
            started = time.monotonic()
            with contextlib.redirect_stdout(io.StringIO()):
                cli_module.cli.main(["run", LINEAGE, "--generations", "1"], standalone_mode=False)
            sent = time.monotonic() - started
            landed = landing.wait(started)
            observation = landing.observation()
            wait_idle(fleet, client)
            return landed - started, observation, wall0, sent

        def fleet_subprocess() -> float:
            landing = Landing(fleet)
            started = time.monotonic()
            process = subprocess.Popen(
                [PYTHON, "-m", "scheduler", "run", LINEAGE, "--generations", "1"],
                env=fleet.env,
                cwd=fleet.root,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            landed = landing.wait(started)
            _, err = process.communicate(timeout=60)
            if process.returncode != 0:
                raise RuntimeError(f"schedule-lineage run failed: {err.decode()[-500:]}")
            wait_idle(fleet, client)
            return landed - started

        for _ in range(args.warmup):
            fleet_inprocess()
            run_floor(argv)

        floors: list[float] = []
        fleets: list[float] = []
        clis: list[float] = []
        phases: list[tuple[float, float, float, float, float]] = []
        print(machine_note())
        print(f"{'#':>3} {'floor ms':>9} {'fleet ms':>9} {'ratio':>6} {'cli ms':>8}   order")
        for i in range(args.samples):
            order = ["floor", "fleet", "cli"] if i % 2 == 0 else ["cli", "fleet", "floor"]
            if args.no_cli:
                order.remove("cli")
            for side in order:
                if side == "floor":
                    floors.append(run_floor(argv))
                elif side == "fleet":
                    elapsed, obs, wall0, sent = fleet_inprocess()
                    fleets.append(elapsed)
                    begun = datetime.fromisoformat(str(obs["started_at"])).timestamp()
                    ended = datetime.fromisoformat(str(obs["finished_at"])).timestamp()
                    phases.append(
                        (
                            sent,
                            begun - wall0 - sent,
                            ended - begun,
                            float(obs["duration_seconds"]),  # type: ignore[arg-type]
                            wall0 + elapsed - ended,
                        )
                    )
                else:
                    clis.append(fleet_subprocess())
            cli_text = f"{clis[-1] * 1000:8.1f}" if clis else "       -"
            print(
                f"{i + 1:>3} {floors[-1] * 1000:9.1f} {fleets[-1] * 1000:9.1f} "
                f"{fleets[-1] / floors[-1]:6.2f} {cli_text}   {' > '.join(order)}",
                flush=True,
            )

        subjects = fleet.git("log", "--format=%s", f"lineage-{LINEAGE}").decode().splitlines()
        print()
        print(f"last commit: {subjects[0]!r}; {len(subjects) - 1} generations landed in all")
        print(f"floor (bwrap + emacs)                      {spread(floors)}")
        print(f"fleet (run -> commit + observation stored) {spread(fleets)}")
        if clis:
            print(f"cli subprocess (info: + interpreter start) {spread(clis)}")
        print("where the fleet's time goes (medians, from the observation's clocks):")
        rows = [
            "schedule-lineage run, in process, until the job is sent",
            "job sent -> life starts (broker, lease, fetch, validate, number)",
            "life (kernel dir, model socket, scope, bwrap, staging, emacs)",
            "  of which the sandbox process (scope + bwrap + stage.sh)",
            "life ends -> landed (decode, commit, push, observation, index)",
        ]
        for column, row in enumerate(rows):
            print(f"  {row:<66} {median(p[column] for p in phases) * 1000:7.1f} ms")
        calls = ", ".join(f"{name} x{n}" for name, n in git_calls.most_common())
        print(
            f"git commands run by one in-process `schedule-lineage run`: "
            f"{sum(git_calls.values())} ({calls})"
        )
        enqueued = [elapsed - p[0] for elapsed, p in zip(fleets, phases, strict=True)]
        print(f"job enqueued -> landed (warm worker)         {spread(enqueued)}")
        print(
            f"in-process command -> landed: {median(fleets) / median(floors):.2f}x the floor "
            "(information)"
        )
        ratio = median(enqueued) / median(floors)
        print(f"fleet latency vs floor: {verdict(ratio, FLEET_TARGET, higher_is_better=False)}")
        if clis:
            ratio = median(clis) / median(floors)
            print(
                f"whole command vs floor: {verdict(ratio, COMMAND_TARGET, higher_is_better=False)}"
            )
        worker_log = fleet.workers[0].text()
        if "Traceback" in worker_log:
            print("note: the worker logged a traceback; see --keep", file=sys.stderr)
    os._exit(0)  # the Celery producer's threads must not hold the exit


if __name__ == "__main__":
    main()
