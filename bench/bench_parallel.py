"""Benchmark: host capacity: N lineages in parallel against one alone, on one worker.

N lineages (``--lineages``, default 8) of the canonical seed organism (it calls the
model once per life), small physics (``--wall 60 --cpu-seconds 60 --memory-max
512M``), the ``scripted`` provider answering after ``--latency`` seconds (default 1),
one real ``celery -A worker worker --concurrency=N`` on a private Redis.

Phases alternate on the same warm worker: **solo** (lineage p0 alone) and **all**
(p0..pN-1). A phase starts its runs with ``schedule-lineage run ... --generations
100000`` (the click command, in this process), waits until every lineage of the
phase has landed a generation (steady state), counts the observations stored during
a window of ``--window`` seconds, then cancels the runs and waits until nothing is in
flight. Throughput is generations landed (commit pushed and observation stored) per
minute; the ratio is all over solo, from the summed windows of each side.

During the all-lineages windows the worker host's own memory is sampled every
second: the proportional set size (PSS, shared pages split between their users) of
the worker's process tree, every process but the sandboxes (a ``bwrap`` and its
descendants), plus the broker; its maximum is reported with its target.

Targets: 8 lineages, 1 s latency: >= 6x. The host capacity target: 64 lineages, 10 s
latency, on a 2-core host: >= 50x, with the host's own memory <= 2 GiB.

Run: ``.venv/bin/python bench/bench_parallel.py [--window 30 --rounds 2]``, or
``--lineages 64 --latency 10 --window 120 --rounds 1`` for the capacity target.
A measurement, not a test: exits 0 whether the target is met or not.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import threading
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

# Lineages -> throughput target (ratio to one alone); memory target in bytes.
TARGETS = {8: 6.0, 64: 50.0}
MEMORY_TARGET = 2 << 30


def tree(root: int) -> list[int]:
    """``root`` and its descendants, except sandboxes (a bwrap and what it runs)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, pending = [], [root]
    while pending:
        pid = pending.pop()
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm == "bwrap":
            continue
        found.append(pid)
        pending.extend(children.get(pid, []))
    return found


def pss(pids: list[int]) -> int:
    """Summed proportional set size of ``pids``, in bytes (gone ones count nothing)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


class MemorySampler:
    """The host's own memory (worker tree without sandboxes, plus the broker), sampled."""

    def __init__(self, roots: list[int]) -> None:
        self.roots = roots
        self.samples: list[int] = []
        self.active = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            self.active.wait()
            self.samples.append(pss([pid for root in self.roots for pid in tree(root)]))
            time.sleep(1.0)


def main() -> None:
    parser = bench_args(__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=30.0, help="seconds counted per phase")
    parser.add_argument("--rounds", type=int, default=2, help="solo/all pairs")
    parser.add_argument("--lineages", type=int, default=8, help="lineages in the all phase")
    parser.add_argument("--latency", type=float, default=1.0, help="model latency, seconds")
    args = parser.parse_args()
    names_all = [f"p{i}" for i in range(args.lineages)]
    target = TARGETS.get(args.lineages, 0.75 * args.lineages)

    with BenchFleet("parallel", args.redis_url, args.keep) as fleet:
        fleet.activate()
        import redis

        import scheduler.cli as cli_module

        client = redis.Redis.from_url(fleet.redis_url)

        def cli(*argv: str) -> None:
            with contextlib.redirect_stdout(io.StringIO()):
                cli_module.cli.main(list(argv), standalone_mode=False)

        for name in names_all:
            cli("init", name, *SMALL_PHYSICS)
        worker = fleet.start_worker(
            "wN",
            concurrency=args.lineages,
            OUROBOROS_SCRIPTED_LATENCY_SECONDS=str(args.latency),
        )
        broker = [fleet.redis.process.pid] if fleet.redis is not None else []
        sampler = MemorySampler([worker.process.pid, *broker])

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
            if len(names) > 1:
                sampler.active.set()
            time.sleep(window)
            sampler.active.clear()
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
        print(
            f"warm-up: {args.lineages} lineages (model latency {args.latency:g} s) until each "
            "has landed one generation ...",
            flush=True,
        )
        phase(names_all, 0.0)

        sides: dict[str, list[tuple[int, float, list[float]]]] = {"solo": [], "all": []}
        print(
            f"{'round':>5} {'side':>6} {'landed':>7} {'seconds':>8} {'gen/min':>8} "
            f"{'life s (median)':>16}"
        )
        for round_ in range(args.rounds):
            order = ["solo", "all"] if round_ % 2 == 0 else ["all", "solo"]
            for side in order:
                names = names_all[:1] if side == "solo" else names_all
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

        solo, together = rate("solo"), rate("all")
        subjects = fleet.git("log", "-1", "--format=%s", "lineage-p0").decode().strip()
        print()
        print(f"last commit of p0: {subjects!r}")
        print(f"one lineage alone:   {solo:7.1f} generations/minute")
        print(f"{args.lineages} lineages: {together:7.1f} generations/minute")
        print(f"{args.lineages} vs one: {verdict(together / solo, target, higher_is_better=True)}")
        if sampler.samples:
            peak = max(sampler.samples)
            print(
                f"host memory without sandboxes (PSS of worker tree + broker), {args.lineages} "
                f"lineages: median {median(sampler.samples) / 2**20:.0f} MiB, max "
                f"{peak / 2**20:.0f} MiB over {len(sampler.samples)} samples; target <= "
                f"{MEMORY_TARGET / 2**30:g} GiB   {'PASS' if peak <= MEMORY_TARGET else 'MISS'}"
            )
        if "Traceback" in fleet.workers[0].text():
            print("note: the worker logged a traceback; see --keep", file=sys.stderr)
    os._exit(0)  # the Celery producer's threads must not hold the exit


if __name__ == "__main__":
    main()
