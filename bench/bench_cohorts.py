"""Benchmark: the overview and a cohort page of a fleet of 1,000 lineages x 100 generations.

Builds, in a temporary directory, 1,000 synthetic fleet lineages of 100 generations
each in cohorts of 8 replicates (every history in one ``git fast-import`` stream, with
the kernel's commit wording and root metadata naming the cohort; each lineage's index
segment in a file store), serves them with uvicorn on 127.0.0.1 and times, warm, the
overview (``/``: its first page of 50), the overview sorted by spend, filtered by a kind
of death, filtered to one cohort (``/?cohort=``), a cohort's page (``/cohorts/LABEL``:
its outcome grid, shares and overlaid size and spend curves with their median) and the
same page for eight lineages chosen by name (``/cohorts?lineages=``), against the 1 s
target. Each
generation commits only its own journal entry (not the whole journal, as the fleet
does): no view timed here reads a journal, and the stream stays small.

Run: ``.venv/bin/python bench/bench_cohorts.py [--lineages N --generations G]``. Not a
test: it prints figures, PASS or MISS, and exits 0 either way.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import httpx
from bench_browse import START, bench_metadata, serve, timed

from scheduler.reader import Reader
from scheduler.web.app import create_app
from worker.fleet.settings import Settings
from worker.instrument import journal
from worker.instrument.names import JOURNAL_PATH, METADATA_PATH, ORGANISM_PATH
from worker.instrument.records import IndexEntry, LineageIndex
from worker.instrument.store import open_store
from worker.instrument.store_keys import index_segment_key, metadata_key

TARGET_SECONDS = 1.0
REPLICATES = 8
REPEATS = 7
OUTCOMES = ("changed", "changed", "no-change", "changed", "process_exit", "changed", "wall_timeout")


def outcome_of(lineage: int, generation: int) -> str:
    return OUTCOMES[(lineage * 31 + generation * 7) % len(OUTCOMES)]


def build(repo: Path, store: Path, lineages: int, generations: int) -> None:
    """Every lineage's history through one fast-import stream, then its index segment."""
    subprocess.run(["git", "init", "--bare", "--quiet", str(repo)], check=True)
    marks = repo / "marks"
    importer = subprocess.Popen(
        ["git", f"--git-dir={repo}", "fast-import", "--quiet", f"--export-marks={marks}"],
        stdin=subprocess.PIPE,
    )
    assert importer.stdin is not None
    mark = 0
    generation_marks: dict[tuple[str, int], tuple[int, int]] = {}
    for number in range(lineages):
        name = f"c{number // REPLICATES}-{number % REPLICATES + 1}"
        meta = bench_metadata(name, cohort=f"c{number // REPLICATES}")
        body = [f";; line {i}\n" for i in range(40)]
        files = {
            ORGANISM_PATH: "".join(body).encode(),
            JOURNAL_PATH: b"",
            METADATA_PATH: meta.to_json(),
        }
        subject, first = "seed", True
        for generation in range(generations + 1):
            when = START + timedelta(minutes=generation)
            if generation:
                outcome = outcome_of(number, generation)
                if outcome == "changed":
                    body[generation % len(body)] = f";; gen {generation}\n"
                    files = {ORGANISM_PATH: "".join(body).encode()}
                    summary = journal.changed_summary((1, 1), 1)
                    subject = journal.subject_changed(generation, summary)
                    entry = journal.entry_changed(generation, summary, when)
                elif outcome == "no-change":
                    files, subject = {}, journal.subject_no_change(generation)
                    entry = journal.entry_no_change(generation, when)
                else:
                    files, subject = {}, journal.subject_died(generation, 255)
                    entry = journal.entry_died(generation, 255, "boom\n", when)
                files[JOURNAL_PATH] = entry.encode()
            mark += 1
            message = subject.encode()
            parts = [
                f"commit refs/heads/lineage-{name}\nmark :{mark}\n".encode(),
                f"committer ouroboros <o@localhost> {int(when.timestamp())} +0000\n".encode(),
                f"data {len(message)}\n".encode() + message + b"\n",
            ]
            if not first:
                parts.append(f"from :{mark - 1}\n".encode())
            for path, data in files.items():
                parts.append(f"M 100644 inline {path}\ndata {len(data)}\n".encode() + data + b"\n")
            importer.stdin.write(b"".join(parts))
            if generation:
                generation_marks[(name, generation)] = (mark - 1, mark)
            first = False
    importer.stdin.close()
    if importer.wait() != 0:
        raise SystemExit("git fast-import failed")
    sha = {int(m[1:]): s for m, s in (line.split() for line in marks.read_text().splitlines())}
    entries: dict[str, list[IndexEntry]] = {}
    for (name, generation), (parent, commit) in generation_marks.items():
        number = int(name[1:].split("-")[0]) * REPLICATES + int(name.split("-")[1]) - 1
        outcome = outcome_of(number, generation)
        entries.setdefault(name, []).append(
            IndexEntry(
                generation=generation,
                outcome=outcome,  # type: ignore[arg-type]
                parent_commit=sha[parent],
                lineage_commit=sha[commit],
                finished_at=START + timedelta(minutes=generation),
                duration_seconds=5.0,
                cpu_usage_nsec=10**9,
                memory_peak_bytes=2**26,
                model_calls=1,
                spent_usd=Decimal("0.004"),
                run_id=None,
                published_files=2,
                tokens=900,
            )
        )
    for name, indexed in entries.items():
        for key, data in (
            (metadata_key(name), b"{}"),
            (
                index_segment_key(name, 0),
                LineageIndex(lineage=name, generations=indexed).model_dump_json().encode(),
            ),
        ):
            path = store / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lineages", type=int, default=1000)
    parser.add_argument("--generations", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-cohorts-") as scratch:
        root = Path(scratch)
        repo, store_base = root / "lineages.git", root / "observations"
        began = time.perf_counter()
        build(repo, store_base, args.lineages, args.generations)
        print(
            f"built {args.lineages} lineages x {args.generations} generations "
            f"in {time.perf_counter() - began:.1f} s"
        )
        settings = Settings(home=root)
        reader = Reader(open_store(settings.observations_url, settings), repo)
        started = time.perf_counter()
        reader.summaries()
        print(
            f"cold overview in process (every history read): {time.perf_counter() - started:.2f} s"
        )
        server, base = serve(create_app(reader, workers=lambda: None))
        label = f"c{args.lineages // REPLICATES // 2}"
        chosen = ",".join(f"c{n}-{n % REPLICATES + 1}" for n in range(REPLICATES))
        views = {
            "overview /": "/",
            "overview sorted by spend": "/?sort=spend&order=desc",
            "overview died of timeout": "/?sort=updated&death=wall_timeout&page=3",
            f"overview ?cohort={label}": f"/?cohort={label}",
            f"cohort page {label}": f"/cohorts/{label}",
            "8 chosen lineages": f"/cohorts?lineages={chosen}",
        }
        with httpx.Client(base_url=base, timeout=120) as client:
            for path in views.values():
                timed(client, path)  # warm
            print(f"over HTTP, warm, {REPEATS} requests each, target {TARGET_SECONDS:.1f} s:")
            for label, path in views.items():
                samples = sorted(timed(client, path) for _ in range(REPEATS))
                median = statistics.median(samples)
                verdict = "PASS" if median <= TARGET_SECONDS else "MISS"
                print(
                    f"{label:26} median {median * 1000:7.1f} ms  max {samples[-1] * 1000:7.1f} ms  "
                    f"ratio {median / TARGET_SECONDS:.2f}  {verdict}"
                )
        server.should_exit = True
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
