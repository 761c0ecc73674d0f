"""Benchmark: what the syscall filter costs a life, with and without it side by side.

Each sample is N lives lived exactly as the pipeline lives them (kernel directory,
ceiling scope, the root worker's uid drop, a fresh session keyring, bwrap, the staging
runner, Emacs, the result tar), once with the filter (``--seccomp``, as every
generation) and once without, rounds alternating which side goes first; time per life,
median of the rounds, and the ratio filtered / unfiltered. Two organisms:

* **hello** - the ``bench_latency`` organism: prints "hi" and writes one file; what
  the filter adds to bwrap's start and an ordinary generation.
* **busy** - the same, after 200 ``call-process`` runs of /bin/true: thousands of
  system calls (fork, exec, the dynamic loader's opens and mmaps) through the filter.

Also the filter's one-off compilation by libseccomp (cached for the worker process).

Target: filtered <= 1.05x unfiltered per life for both organisms.

Run as root: ``.venv/bin/python bench/bench_syscall_filter.py [--lives 10 --rounds 5]``
from the repository root. A measurement, not a test: exits 0 whether the target is met
or not.
"""

from __future__ import annotations

import argparse
import io
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_note, median, spread, verdict

from worker.fleet.settings import Settings
from worker.instrument import syscall_filter
from worker.instrument.ceilings import select_ceiling
from worker.instrument.identity import IdentityPool
from worker.instrument.physics import Physics
from worker.instrument.sandbox import kernel_directory, resolve_emacs, run_sandbox

TARGET = 1.05
STAGE = Path(__file__).resolve().parents[1] / "sandbox_scripts" / "stage.sh"
HELLO = '(message "hi")\n(with-temp-file "/work/hello.txt" (insert (format "%S\\n" (random t))))\n'
BUSY = '(dotimes (_ 200) (call-process "/bin/true"))\n' + HELLO
ORGANISMS = {"hello": HELLO, "busy": BUSY}
PHYSICS = Physics(wall_seconds=60, cpu_seconds=60, memory_max_bytes="256M", work_bytes="8M")


def kernel_files(organism: str) -> dict[str, bytes]:
    """A kernel directory's files as the pipeline writes them, for ``organism``."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        data = organism.encode()
        info = tarfile.TarInfo("organism.el")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return {
        "base.tar": buffer.getvalue(),
        "journal.md": b"# journal\n",
        "lineage.json": b"{}\n",
        "capabilities.json": b"{}\n",
        "stage.sh": STAGE.read_bytes(),
    }


def live(files: dict[str, bytes], filtered: bool) -> float:
    """One life as the pipeline lives it; wall seconds. It must end well."""
    settings = Settings()
    pool = IdentityPool(settings.sandbox_uid_base, settings.sandbox_uid_count)
    ceiling, emacs = select_ceiling("auto"), resolve_emacs()
    started = time.monotonic()
    with pool.hold() as identity, kernel_directory(files, identity) as kernel:
        result = run_sandbox(kernel, PHYSICS, ceiling, "bench-filter", emacs, identity, filtered)
    elapsed = time.monotonic() - started
    if result.death() is not None:
        raise RuntimeError(f"a life died ({result.death()}): {result.stderr[-500:]!r}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lives", type=int, default=10, help="lives per sample")
    parser.add_argument("--rounds", type=int, default=5, help="samples per side")
    args = parser.parse_args()

    started = time.monotonic()
    syscall_filter.compiled()
    compile_ms = (time.monotonic() - started) * 1000
    print(machine_note())
    print(f"filter compiled by libseccomp once per worker process: {compile_ms:.1f} ms")
    for name, organism in ORGANISMS.items():
        files = kernel_files(organism)
        live(files, True)
        live(files, False)
        sides: dict[bool, list[float]] = {True: [], False: []}
        print(f"\n{name}: {'#':>3} {'filtered ms':>12} {'unfiltered ms':>14} {'ratio':>6}")
        for i in range(args.rounds):
            order = [True, False] if i % 2 == 0 else [False, True]
            for filtered in order:
                total = sum(live(files, filtered) for _ in range(args.lives))
                sides[filtered].append(total / args.lives)
            print(
                f"{name}: {i + 1:>3} {sides[True][-1] * 1000:12.1f} "
                f"{sides[False][-1] * 1000:14.1f} {sides[True][-1] / sides[False][-1]:6.2f}",
                flush=True,
            )
        print(f"{name}: filtered, per life     {spread(sides[True])}")
        print(f"{name}: unfiltered, per life   {spread(sides[False])}")
        ratio = median(sides[True]) / median(sides[False])
        print(f"{name}: filter's cost: {verdict(ratio, TARGET, higher_is_better=False)}")


if __name__ == "__main__":
    main()
