"""Benchmark: generation 10 against generation 10,000 of a lineage (cost must not grow).

Two lineages are created with the real ``schedule-lineage init`` (seed commit with
``.ouroboros-lineage.json``), same organism, same small physics. The organism writes
one file, so every generation is ``gen N: changed (organism unchanged; 1 other
paths)``; it does not read the journal, so that its own life does not depend on the
history (``--organism-reads-journal`` makes it read ``/kernel/journal.md`` first).
Their histories are then grown synthetically with ``git fast-import`` into the
shared bare repository: 9 and 9,999 generation commits with the kernel's exact
subjects and a ``state.el`` that changes every time; the head commit carries the
whole journal, one kernel-worded entry per generation (about 900 KiB at generation
10,000; the commits before it carry only their own entry, which keeps the build
quick and changes nothing a generation reads: it reads the head's tree), plus the
lineage index in segments of 256 entries, as publication writes it. The next
generation is then generation 10 of one and generation 10,000 of the other.

The objects are laid out as the product leaves them after that many real
generations: loose, in the shared repository and in the worker's cache (a generation
writes loose objects in-process and never starts a gc; packing is scheduled). The
cache is warm (it holds the history, as a worker that has been serving the lineage
does).

Timed: ``Pipeline.run`` in this process (``worker.fleet.assembly.build_pipeline(Settings())``),
interleaved short/long, median of N each, in three settings:

* **warm, loose** (the steady state; the ratio that counts against the target);
* **cold fetch** (a fresh worker cache per sample: a worker that never saw the lineage);
* **warm, packed** (after ``git repack -a -d`` of the shared repository and the cache,
  what an operator's ``git gc`` would give).

Every git step, the sandbox, the index update and the observation write are timed
inside each run; the table of medians shows which step grows with history. The bytes
each generation writes to the observation store (observation, index segment) are
counted too: they must be bounded by one full index segment, whatever the depth.

Targets: deep <= 1.1x shallow (warm, loose); store bytes per generation within the
bound.

Run: ``.venv/bin/python bench/bench_history.py [--depth 10000 --samples 15]``.
A measurement, not a test: exits 0 whether the target is met or not.
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    SMALL_PHYSICS,
    BenchFleet,
    bench_args,
    machine_note,
    median,
    spread,
    verdict,
)

TARGET = 1.1
SHORT, LONG = "short", "long"
ORGANISM = '(with-temp-file "/work/state.el" (insert (format "%S\\n" (random t))))\n'
READS_JOURNAL = (
    '(with-temp-buffer (insert-file-contents "/kernel/journal.md")\n'
    '  (message "journal: %d bytes" (buffer-size)))\n'
)
SUMMARY = "organism unchanged; 1 other paths"
IDENTITY = "ouroboros <ouroboros@localhost>"
SANDBOX = "sandbox (scope+bwrap+emacs)"


class Steps:
    """Wall time per step of the runs, collected through thin wrappers."""

    def __init__(self) -> None:
        self.current: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def reset(self) -> tuple[collections.Counter[str], collections.Counter[str]]:
        taken = self.current, self.calls
        self.current, self.calls = collections.Counter(), collections.Counter()
        return taken

    def wrap(self, label: Callable[..., str], fn: Callable[..., object]) -> Callable[..., object]:
        def timed(*args: object, **kwargs: object) -> object:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                name = label(*args, **kwargs)
                self.current[name] += time.perf_counter() - started
                self.calls[name] += 1

        return timed


def git_label(_git_dir: object, *args: str, **_: object) -> str:
    first = args[0]
    if first in ("cat-file", "hash-object"):
        return f"git {first} {args[1]}"
    if first == "log":
        return (
            "git log (subjects: numbering)" if args[1] == "--format=%s" else "git log (last_body)"
        )
    if first == "rev-list":
        return "git rev-list --max-parents=0 (root)"
    return f"git {first}"


def instrument(steps: Steps) -> None:
    """Time every git command and the big non-git steps of Pipeline.run (where they exist)."""
    import worker.instrument.gitrepo as gitrepo
    import worker.instrument.pipeline as generation

    def patch(owner: object, attr: str, label: str | Callable[..., str]) -> None:
        original = getattr(owner, attr, None)
        if original is None:
            return  # the product moved on; the step is simply not broken out
        name = label if callable(label) else (lambda *a, **k: label)
        setattr(owner, attr, steps.wrap(name, original))

    patch(gitrepo, "run_git", git_label)
    for method in (
        "fetch",
        "tree",
        "cat_blobs",
        "history",
        "footprint",
        "hash_files",
        "hash_bytes",
        "numstat",
        "commit",
        "push_cas",
    ):
        patch(gitrepo.LineageCache, method, f"git {method} (in-process)")
    patch(generation, "run_sandbox", SANDBOX)
    patch(generation, "_base_tar", "base.tar")
    patch(generation, "decode_archive", "decode")
    patch(generation.journal, "append", "journal append")
    patch(generation.index, "add", "index segment read+rewrite")
    patch(generation.Pipeline, "drain", "spool drain")
    patch(getattr(generation, "Spool", None), "save", "spool save (fsync)")
    patch(getattr(generation, "ModelSocket", None), "__enter__", "model socket start")
    patch(getattr(generation, "ModelSocket", None), "__exit__", "model socket stop")


def grow(fleet: BenchFleet, lineage: str, generations: int, store: object) -> str:
    """Append ``generations`` synthetic generation commits to the lineage; the pack file."""
    from worker.instrument import index, journal
    from worker.instrument.records import IndexEntry, LineageIndex
    from worker.instrument.store_keys import index_segment_key

    seed = fleet.head(lineage)
    assert seed
    ts = int(time.time()) - 3 * (generations + 1)
    lines = [b"feature done\n"]
    # All state.el blobs first: fast-import deltas each blob against the previous one,
    # so the journals then form one delta chain (a fast build, a small pack).
    for n in range(1, generations + 1):
        data = f"{(n * 2654435761) % 2**61}\n".encode()
        lines.append(b"blob\nmark :%d\ndata %d\n%s\n" % (n, len(data), data))
    entries_text: list[str] = []
    marks_offset = 1_000_000
    for n in range(1, generations + 1):
        when = datetime.fromtimestamp(ts + 3 * n, UTC)
        entries_text.append(journal.entry_changed(n, SUMMARY, when))
        body = ("\n".join(entries_text) if n == generations else entries_text[-1]).encode()
        message = journal.subject_changed(n, SUMMARY).encode() + b"\n"
        lines.append(
            b"commit refs/heads/lineage-%s\nmark :%d\n" % (lineage.encode(), marks_offset + n)
            + b"author %s %d +0000\ncommitter %s %d +0000\n"
            % (IDENTITY.encode(), ts + 3 * n, IDENTITY.encode(), ts + 3 * n)
            + b"data %d\n%s" % (len(message), message)
            + (b"from %s\n" % seed.encode() if n == 1 else b"")
            + b"M 100644 :%d state.el\n" % n
            + b"M 100644 inline journal.md\ndata %d\n%s\n" % (len(body), body)
        )
    lines.append(b"done\n")
    marks = fleet.root / f"marks-{lineage}"
    before = set((fleet.repo / "objects" / "pack").glob("*.pack"))
    subprocess.run(
        [
            "git",
            "-c",
            "fastimport.unpackLimit=0",
            f"--git-dir={fleet.repo}",
            "fast-import",
            "--quiet",
            f"--export-marks={marks}",
        ],
        input=b"".join(lines),
        check=True,
    )
    (pack,) = set((fleet.repo / "objects" / "pack").glob("*.pack")) - before
    shas = {}
    for line in marks.read_text().splitlines():
        mark, sha = line.split()
        shas[int(mark[1:])] = sha
    entries, parent = [], seed
    for n in range(1, generations + 1):
        commit = shas[marks_offset + n]
        entries.append(
            IndexEntry(
                generation=n,
                outcome="changed",
                parent_commit=parent,
                lineage_commit=commit,
                finished_at=datetime.fromtimestamp(ts + 3 * n, UTC),
                duration_seconds=0.21,
                cpu_usage_nsec=150_000_000,
                memory_peak_bytes=40_000_000,
                model_calls=0,
                spent_usd=Decimal(0),
                run_id=None,
            )
        )
        parent = commit
    segments: dict[int, list[IndexEntry]] = collections.defaultdict(list)
    for item in entries:
        segments[index.segment_of(item.generation)].append(item)
    for segment, part in segments.items():
        data = LineageIndex(lineage=lineage, generations=part).model_dump_json().encode()
        store.put(index_segment_key(lineage, segment), data)  # type: ignore[attr-defined]
    return str(pack)


def explode(pack: Path, *git_dirs: Path) -> None:
    """Turn a pack into loose objects in each repository, as small pushes leave them."""
    holding = pack.parent.parent.parent.parent / f"held-{pack.name}"
    pack.rename(holding)
    pack.with_suffix(".idx").unlink()
    for git_dir in git_dirs:
        with holding.open("rb") as stream:
            subprocess.run(
                ["git", f"--git-dir={git_dir}", "unpack-objects", "-q"], stdin=stream, check=True
            )
    holding.unlink()


def loose_count(git_dir: Path) -> str:
    out = subprocess.run(
        ["git", f"--git-dir={git_dir}", "count-objects", "-v"], capture_output=True, text=True
    ).stdout
    fields = dict(line.split(": ") for line in out.splitlines())
    return (
        f"{fields['count']} loose objects ({int(fields['size']) / 1024:.1f} MiB), "
        f"{fields['in-pack']} packed ({int(fields['size-pack']) / 1024:.1f} MiB)"
    )


def main() -> None:
    parser = bench_args(__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=10000, help="the deep generation number")
    parser.add_argument("--shallow", type=int, default=10, help="the shallow generation number")
    parser.add_argument("--samples", type=int, default=15, help="warm samples per side (>= 7)")
    parser.add_argument("--cold-samples", type=int, default=3, help="cold-fetch samples per side")
    parser.add_argument("--packed-samples", type=int, default=9, help="packed samples per side")
    parser.add_argument("--organism-reads-journal", action="store_true")
    args = parser.parse_args()

    with BenchFleet("history", args.redis_url, args.keep, with_redis=False) as fleet:
        fleet.activate()
        import contextlib
        import io

        import scheduler.cli as cli_module
        from worker.fleet.assembly import build_pipeline, lineage_cache, observation_store
        from worker.fleet.settings import Settings
        from worker.instrument.gitrepo import LineageCache
        from worker.instrument.pipeline import GenerationJob
        from worker.instrument.records import LineageIndex
        from worker.instrument.store_keys import generation_key

        body = (READS_JOURNAL if args.organism_reads_journal else "") + ORGANISM
        seed = fleet.write_seed("history.el", body)
        for name in (SHORT, LONG):
            with contextlib.redirect_stdout(io.StringIO()):
                cli_module.cli.main(
                    ["init", name, "--seed", str(seed), *SMALL_PHYSICS], standalone_mode=False
                )
        settings = Settings()
        store = observation_store(settings)
        cache = lineage_cache(settings)  # the worker's cache, as build_pipeline makes it
        cache_dir = cache.git_dir
        for name in (SHORT, LONG):
            cache.fetch(name)  # the seed commits, as a worker's first fetch brings them

        print(machine_note())
        built = time.monotonic()
        packs = [
            Path(grow(fleet, SHORT, args.shallow - 1, store)),
            Path(grow(fleet, LONG, args.depth - 1, store)),
        ]
        for pack in packs:
            explode(pack, fleet.repo, cache_dir)
        for name in (SHORT, LONG):
            head = fleet.head(name)
            subprocess.run(
                [
                    "git",
                    f"--git-dir={cache_dir}",
                    "update-ref",
                    f"refs/remotes/shared/lineage-{name}",
                    str(head),
                ],
                check=True,
            )
        journal_kb = len(fleet.git("cat-file", "blob", f"lineage-{LONG}:journal.md")) / 1024
        print(
            f"built {args.shallow - 1} + {args.depth - 1} synthetic generations in "
            f"{time.monotonic() - built:.1f} s; deep journal {journal_kb:.0f} KiB; "
            f"shared repo: {loose_count(fleet.repo)}; cache: {loose_count(cache_dir)}"
        )

        steps = Steps()
        instrument(steps)
        pipeline = build_pipeline(settings)
        expected = {SHORT: args.shallow, LONG: args.depth}
        stored_bytes = [0]

        def counting(method: str) -> None:
            original = getattr(pipeline.store, method)

            def wrapped(key: str, data: bytes, *rest: object) -> object:
                stored_bytes[0] += len(data)
                return original(key, data, *rest)

            setattr(pipeline.store, method, wrapped)

        counting("put")
        counting("put_once")

        def one(
            name: str,
        ) -> tuple[float, collections.Counter[str], collections.Counter[str], int]:
            job = GenerationJob(
                lineage=name, expected_commit=str(fleet.head(name)), provider="scripted"
            )
            steps.reset()
            stored_bytes[0] = 0
            started = time.perf_counter()
            report = pipeline.run(job)
            elapsed = time.perf_counter() - started
            taken, calls = steps.reset()
            if report.outcome != "changed" or not report.observation_stored:
                raise RuntimeError(f"unexpected report {report}")
            if report.generation != expected[name]:
                raise RuntimeError(f"{name}: generation {report.generation}, not {expected[name]}")
            expected[name] += 1
            return elapsed, taken, calls, stored_bytes[0]

        def measure(
            title: str, samples: int, before: Callable[[str], None] | None = None
        ) -> dict[str, list[tuple[float, collections.Counter[str], collections.Counter[str], int]]]:
            results: dict[str, list] = {SHORT: [], LONG: []}
            print(f"\n== {title}: {samples} samples per side, interleaved ==")
            print(f"{'#':>3} {'gen':>5} {'ms':>8}   {'gen':>5} {'ms':>8}   ratio")
            for i in range(samples):
                order = [SHORT, LONG] if i % 2 == 0 else [LONG, SHORT]
                for name in order:
                    if before:
                        before(name)
                    results[name].append(one(name))
                s, d = results[SHORT][-1][0], results[LONG][-1][0]
                print(
                    f"{i + 1:>3} {expected[SHORT] - 1:>5} {s * 1000:8.1f}   "
                    f"{expected[LONG] - 1:>5} {d * 1000:8.1f}   {d / s:5.2f}",
                    flush=True,
                )
            shallow = [r[0] for r in results[SHORT]]
            deep = [r[0] for r in results[LONG]]
            print(f"generation ~{args.shallow:<5} {spread(shallow)}")
            print(f"generation ~{args.depth:<5} {spread(deep)}")
            print(f"{title}: {verdict(median(deep) / median(shallow), TARGET, False)}")
            pairs = [d / s for s, d in zip(shallow, deep, strict=True)]
            print(f"  median of the paired (same round) ratios: {median(pairs):.2f}x")
            # The life's wall time is quantised by the sandbox's polling wait (0-50 ms per
            # life, see the final notes): the instrument alone, without the life, is steadier.
            bare = {k: [r[0] - r[1][SANDBOX] for r in v] for k, v in results.items()}
            print(
                f"  without the sandbox process: {median(bare[SHORT]) * 1000:.1f} ms vs "
                f"{median(bare[LONG]) * 1000:.1f} ms, "
                f"ratio {median(bare[LONG]) / median(bare[SHORT]):.2f}x"
            )
            return results

        def breakdown(results: dict[str, list]) -> None:
            names = sorted(
                {k for r in results[LONG] + results[SHORT] for k in r[1]},
                key=lambda k: -median(r[1][k] for r in results[LONG]),
            )
            print(
                f"  {'step (median ms per run; calls)':<44} {'gen ~' + str(args.shallow):>12} "
                f"{'gen ~' + str(args.depth):>12} {'growth':>8}"
            )
            total_s = median(r[0] for r in results[SHORT])
            total_d = median(r[0] for r in results[LONG])
            for key in names:
                s = median(r[1][key] for r in results[SHORT]) * 1000
                d = median(r[1][key] for r in results[LONG]) * 1000
                calls = median(r[2][key] for r in results[LONG])
                print(f"  {key + f' ({calls:g})':<44} {s:12.1f} {d:12.1f} {d - s:+8.1f}")
            accounted = lambda side: median(r[0] - sum(r[1].values()) for r in results[side])  # noqa: E731
            print(
                f"  {'other (Python in Pipeline.run)':<44} {accounted(SHORT) * 1000:12.1f} "
                f"{accounted(LONG) * 1000:12.1f} "
                f"{(accounted(LONG) - accounted(SHORT)) * 1000:+8.1f}"
            )
            print(
                f"  {'total':<44} {total_s * 1000:12.1f} {total_d * 1000:12.1f} "
                f"{(total_d - total_s) * 1000:+8.1f}"
            )

        # Warm-up: page in the repositories, emacs, the first scope.
        for _ in range(3):
            one(SHORT)
            one(LONG)
        warm = measure("warm cache, loose objects (steady state)", args.samples)
        print("where the time goes (warm, loose):")
        breakdown(warm)

        cold_root = fleet.root / "cold"

        def fresh_cache(name: str) -> None:
            shutil.rmtree(cold_root, ignore_errors=True)
            pipeline.cache = LineageCache(cold_root / "lineages.git", settings.lineage_repo_url)

        if args.cold_samples:
            warm_cache = pipeline.cache
            cold = measure(
                "cold fetch (fresh worker cache per sample; a one-off cost, not the target)",
                args.cold_samples,
                fresh_cache,
            )
            print("where the time goes (cold fetch):")
            breakdown(cold)
            pipeline.cache = warm_cache
            # The warm cache missed the cold runs' commits: let it catch up unmeasured.
            one(SHORT)
            one(LONG)

        if args.packed_samples:
            for git_dir in (fleet.repo, cache_dir):
                subprocess.run(
                    ["git", f"--git-dir={git_dir}", "repack", "-a", "-d", "-q"], check=True
                )
            print(
                f"\nrepacked: shared repo {loose_count(fleet.repo)}; cache {loose_count(cache_dir)}"
            )
            one(SHORT)
            one(LONG)
            packed = measure("warm cache, packed (after git repack -a -d)", args.packed_samples)
            print("where the time goes (warm, packed):")
            breakdown(packed)

        from worker.instrument.index import SEGMENT_ENTRIES
        from worker.instrument.store_keys import index_segment_key

        print()
        # A full segment: as many entries as the deep lineage's last one, scaled up.
        last = store.get(index_segment_key(LONG, (expected[LONG] - 2) // SEGMENT_ENTRIES))
        per_entry = len(last) / len(LineageIndex.model_validate_json(last).generations)
        observation_bytes = max(
            len(store.get(generation_key(LONG, n)) or b"")
            for n in range(args.depth, expected[LONG])
        )
        bound = SEGMENT_ENTRIES * per_entry + observation_bytes
        for name, generation in ((SHORT, args.shallow), (LONG, args.depth)):
            written = [r[3] for r in warm[name]]
            print(
                f"store bytes written per generation at ~{generation}: median "
                f"{median(written) / 1024:.1f} KiB, max {max(written) / 1024:.1f} KiB"
            )
        deep_max = max(r[3] for r in warm[LONG])
        print(
            f"store bytes per generation: deep max {deep_max / 1024:.1f} KiB, bound (one full "
            f"segment of {SEGMENT_ENTRIES} + the observation) {bound / 1024:.1f} KiB; a whole-"
            f"history index would be {args.depth * per_entry / 1024:.0f} KiB   "
            f"{'PASS' if deep_max <= bound else 'MISS'}"
        )
        ratio = median(r[0] for r in warm[LONG]) / median(r[0] for r in warm[SHORT])
        print(
            f"generation {args.depth} vs generation {args.shallow} (warm, loose, steady state): "
            f"{verdict(ratio, TARGET, higher_is_better=False)}"
        )
    os._exit(0)


if __name__ == "__main__":
    main()
