"""Benchmark: browsing a lineage of 10,000 generations over real HTTP.

Builds, in a temporary directory, a synthetic fleet lineage of 10,000 generations
(the git history through ``git fast-import``, with the kernel's own commit and
journal wording and some out-of-loop commits; the index object, one observation
object per generation and a run record in a file store), serves it with uvicorn
on 127.0.0.1 and times the first page and late pages of the lineage view and the
overview, against the 300 ms target. It also counts the store reads each view
makes, to show that the overview and lineage pages read the index object and
never the observation objects.

Run: ``.venv/bin/python bench/bench_browse.py [--generations N]``. Not a test: it
prints figures and exits 1 only if a view misses the target or reads observations.
"""

from __future__ import annotations

import argparse
import hashlib
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import httpx
import uvicorn

from scheduler.reader import Reader
from scheduler.web.app import create_app
from worker.fleet.runs import RunRecord
from worker.fleet.settings import Settings
from worker.instrument import journal
from worker.instrument.index import segment_of
from worker.instrument.lineage import LineageMetadata
from worker.instrument.names import JOURNAL_PATH, METADATA_PATH, ORGANISM_PATH
from worker.instrument.physics import Physics
from worker.instrument.records import IndexEntry, LineageIndex, ModelCall, Observation, Provenance
from worker.instrument.store import FileStore, ObservationStore, open_store
from worker.instrument.store_keys import generation_key, index_segment_key, metadata_key, run_key

TARGET_SECONDS = 0.300
NAME = "big"
REPEATS = 15
START = datetime(2026, 1, 1, tzinfo=UTC)
FINGERPRINT = "f" * 64


class CountingStore(ObservationStore):
    """A file store that counts every read, by kind of key."""

    def __init__(self, inner: FileStore) -> None:
        self.inner = inner
        self.url = inner.url
        self.reads: Counter[str] = Counter()

    def _kind(self, key: str) -> str:
        parts = key.split("/")
        return parts[2] if len(parts) > 3 else parts[-1]

    def _get(self, key: str) -> bytes | None:
        self.reads[self._kind(key)] += 1
        return self.inner._get(key)

    def _list(self, prefix: str) -> list[str]:
        self.reads[f"list {self._kind(prefix + 'x')}"] += 1
        return self.inner._list(prefix)

    def _put(self, key: str, data: bytes) -> None:
        raise PermissionError("the benchmark's reader must not write")

    def _put_once(self, key: str, data: bytes) -> bool:
        raise PermissionError("the benchmark's reader must not write")


def outcome_of(generation: int) -> str:
    if generation % 7 == 0:
        return "died"
    return "no-change" if generation % 3 == 0 else "changed"


def bench_metadata(name: str, cohort: str | None = None) -> LineageMetadata:
    """The root metadata of a synthetic lineage (this bench's and bench_cohorts')."""
    return LineageMetadata(
        name=name,
        created_at=START,
        instrument_fingerprint=FINGERPRINT,
        instrument_version="0.1.0",
        instrument_commit="a" * 40,
        instrument_repository="bench",
        instrument_ref="bench",
        seed_sha256=hashlib.sha256(b"(seed)\n").hexdigest(),
        physics=Physics(),
        cohort=cohort,
    )


def build_history(repo: Path, generations: int) -> dict[int, tuple[str, str]]:
    """The lineage branch through fast-import; generation -> (parent, commit)."""
    subprocess.run(["git", "init", "--bare", "--quiet", str(repo)], check=True)
    meta = bench_metadata(NAME)
    marks = repo / "marks"
    importer = subprocess.Popen(
        ["git", f"--git-dir={repo}", "fast-import", "--quiet", f"--export-marks={marks}"],
        stdin=subprocess.PIPE,
    )
    assert importer.stdin is not None
    # Streamed, not built in memory: the journal grows with every generation, so the
    # stream carries the sum of all its versions (gigabytes at 10,000 generations).
    stream = importer.stdin
    body = [f";; line {i}\n" for i in range(200)]
    log = b""
    mark = 0
    gen_marks: dict[int, int] = {}

    def commit(subject: str, when: datetime, files: dict[str, bytes]) -> int:
        nonlocal mark
        mark += 1
        message = subject.encode()
        parts = [
            f"commit refs/heads/lineage-{NAME}\nmark :{mark}\n".encode(),
            f"committer ouroboros <o@localhost> {int(when.timestamp())} +0000\n".encode(),
            f"data {len(message)}\n".encode() + message + b"\n",
        ]
        if mark > 1:
            parts.append(f"from :{mark - 1}\n".encode())
        for path, data in files.items():
            parts.append(f"M 100644 inline {path}\ndata {len(data)}\n".encode() + data + b"\n")
        stream.write(b"".join(parts))
        return mark

    commit(
        "seed",
        START,
        {
            ORGANISM_PATH: "".join(body).encode(),
            JOURNAL_PATH: b"",
            METADATA_PATH: meta.to_json(),
        },
    )
    for generation in range(1, generations + 1):
        when = START + timedelta(minutes=generation)
        outcome = outcome_of(generation)
        files: dict[str, bytes] = {}
        if outcome == "died":
            subject = journal.subject_died(generation, 255)
            stderr = "".join(f"  frame {generation}.{i}()\n" for i in range(8))
            entry = journal.entry_died(generation, 255, stderr, when)
        elif outcome == "no-change":
            subject = journal.subject_no_change(generation)
            entry = journal.entry_no_change(generation, when)
        else:
            body[generation % len(body)] = f";; changed by generation {generation}\n"
            files[ORGANISM_PATH] = "".join(body).encode()
            summary = journal.changed_summary((1, 1), 1)
            subject = journal.subject_changed(generation, summary)
            entry = journal.entry_changed(generation, summary, when)
        log = journal.append(log, entry)
        files[JOURNAL_PATH] = log
        gen_marks[generation] = commit(subject, when, files)
        if generation % 500 == 0:
            commit(f"external edit: note {generation}", when, {"NOTES": str(generation).encode()})
    stream.close()
    if importer.wait() != 0:
        raise SystemExit("git fast-import failed")
    sha = {int(m[1:]): s for m, s in (line.split() for line in marks.read_text().splitlines())}
    return {g: (sha[m - 1], sha[m]) for g, m in gen_marks.items()}


def build_store(base: Path, commits: dict[int, tuple[str, str]]) -> None:
    """Metadata, one observation per generation, the index object and a run record."""

    def write(key: str, data: bytes) -> None:
        # Straight to the file store's layout: the benchmark's setup needs no fsync.
        path = base / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    write(metadata_key(NAME), b"{}")
    entries = []
    physics = Physics()
    for generation, (parent, sha) in sorted(commits.items()):
        finished = START + timedelta(minutes=generation)
        outcome = "process_exit" if outcome_of(generation) == "died" else outcome_of(generation)
        cost = Decimal("0.004") + Decimal(generation % 13) / 1000
        prompt = f"You are generation {generation}. " + "x" * 900
        observation = Observation(
            lineage=NAME,
            generation=generation,
            parent_commit=parent,
            lineage_commit=sha,
            started_at=finished - timedelta(seconds=20),
            finished_at=finished,
            duration_seconds=5 + generation % 17,
            outcome=outcome,  # type: ignore[arg-type]
            exit_status=255 if outcome == "process_exit" else 0,
            driver_result="exited",
            cpu_usage_nsec=(2 + generation % 5) * 10**9,
            memory_peak_bytes=(40 + generation % 23) * 2**20,
            oom_kills=0,
            figure_sources={"cpu_usage_nsec": "bench"},
            archive_bytes=10240,
            published_bytes=4096,
            published_files=2,
            provider="scripted",
            model="scripted",
            constraints=physics,
            model_calls=[
                ModelCall(
                    index=1,
                    started_at=finished - timedelta(seconds=10),
                    duration_seconds=1.5,
                    status=200,
                    prompt=prompt,
                    response="(ok)",
                    prompt_sha256=hashlib.sha256(prompt.encode()).hexdigest(),
                    response_sha256=hashlib.sha256(b"(ok)").hexdigest(),
                    requested_output_tokens=1000,
                    input_tokens=300,
                    output_tokens=20,
                    reserved_usd=Decimal("0.05"),
                    cost_usd=cost,
                )
            ],
            spent_usd=cost,
            stderr="",
            stderr_truncated=False,
            provenance=Provenance(
                worker_host="bench",
                fleet_version="0.1.0",
                instrument_fingerprint=FINGERPRINT,
                ceiling_driver="cgroup1",
                bwrap_version="bwrap 0.8.0",
                emacs_version="GNU Emacs 28.2",
            ),
            run_id="bench-run",
        )
        write(generation_key(NAME, generation), observation.model_dump_json(by_alias=True).encode())
        entries.append(IndexEntry.of(observation))
    # The index in segments, as publication writes it (worker.instrument.index).
    for segment in sorted({segment_of(e.generation) for e in entries}):
        part = [e for e in entries if segment_of(e.generation) == segment]
        write(
            index_segment_key(NAME, segment),
            LineageIndex(lineage=NAME, generations=part).model_dump_json().encode(),
        )
    run = RunRecord(
        run_id="bench-run",
        lineage=NAME,
        created_at=START,
        start_generation=0,
        target_generation=len(commits) + 100,
        provider="scripted",
        model=None,
        budget_usd=Decimal(1000),
    )
    write(run_key(NAME, run.run_id), run.model_dump_json().encode())


def serve(app: object) -> tuple[uvicorn.Server, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline:
            raise SystemExit("uvicorn did not start")
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}"


def timed(client: httpx.Client, path: str) -> float:
    started = time.perf_counter()
    response = client.get(path)
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise SystemExit(f"GET {path}: {response.status_code}")
    return elapsed


def land_generation(repo: Path, store_base: Path, generation: int) -> None:
    """One more no-change generation on the branch and in the index, as publication does."""
    git = ["git", f"--git-dir={repo}"]
    ref = f"refs/heads/lineage-{NAME}"
    head = subprocess.run([*git, "rev-parse", ref], capture_output=True, text=True, check=True)
    parent = head.stdout.strip()
    commit = subprocess.run(
        [
            *git,
            "commit-tree",
            f"{parent}^{{tree}}",
            "-p",
            parent,
            "-m",
            journal.subject_no_change(generation),
        ],
        capture_output=True,
        text=True,
        check=True,
        env={
            "GIT_AUTHOR_NAME": "o",
            "GIT_AUTHOR_EMAIL": "o@localhost",
            "GIT_COMMITTER_NAME": "o",
            "GIT_COMMITTER_EMAIL": "o@localhost",
        },
    ).stdout.strip()
    subprocess.run([*git, "update-ref", ref, commit, parent], check=True)
    path = store_base / index_segment_key(NAME, segment_of(generation))
    previous = store_base / index_segment_key(NAME, segment_of(generation - 1))
    last = LineageIndex.model_validate_json(previous.read_bytes()).generations[-1]
    index = (
        LineageIndex.model_validate_json(path.read_bytes())
        if path.exists()
        else LineageIndex(lineage=NAME)
    )
    entry = last.model_copy(
        update={
            "generation": generation,
            "outcome": "no-change",
            "parent_commit": parent,
            "lineage_commit": commit,
        }
    )
    path.write_bytes(index.with_entry(entry).model_dump_json().encode())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generations", type=int, default=10_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-browse-") as scratch:
        root = Path(scratch)
        repo, store_base = root / "lineages.git", root / "observations"
        began = time.perf_counter()
        commits = build_history(repo, args.generations)
        built_git = time.perf_counter() - began
        build_store(store_base, commits)
        built = time.perf_counter() - began
        settings = Settings(home=root)
        inner = open_store(settings.observations_url, settings)
        assert isinstance(inner, FileStore)
        store = CountingStore(inner)
        pages = -(-(args.generations + 1 + args.generations // 500) // 50)
        late = max(1, pages * 3 // 4)
        print(f"built {args.generations} generations in {built:.1f} s (git {built_git:.1f} s)")
        print(f"lineage view: {pages} pages of 50 commits; late page = {late}")
        failed = False
        # Cold: a fresh reader, nothing cached, the whole history read from git.
        for label, view in (
            ("lineage first page", lambda r: r.lineage(NAME)),
            (f"lineage page {late}", lambda r: r.lineage(NAME, late)),
            ("overview", lambda r: r.summaries()),
        ):
            started = time.perf_counter()
            view(Reader(store, repo))
            cold = time.perf_counter() - started
            failed |= cold > TARGET_SECONDS
            print(
                f"cold, in process (no cache): {label:22} {cold * 1000:6.1f} ms  "
                f"ratio {cold / TARGET_SECONDS:.2f}"
            )
        server, base = serve(create_app(Reader(store, repo), workers=lambda: None))
        with httpx.Client(base_url=base, timeout=30) as client:
            timed(client, "/")  # the app warms its reader at start; make sure it has
            views = {
                "overview /": "/",
                "lineage first page": f"/lineages/{NAME}",
                f"lineage page {late}": f"/lineages/{NAME}?page={late}",
                f"lineage last page {pages}": f"/lineages/{NAME}?page={pages}",
                "api first page": f"/api/lineages/{NAME}",
                f"api page {late}": f"/api/lineages/{NAME}?page={late}",
                "generation page": f"/lineages/{NAME}/generations/{args.generations // 2}",
            }
            print(f"over HTTP, {REPEATS} requests each:")
            print(f"{'view':28} {'median':>9} {'p95':>9} {'max':>9}  ratio to 300 ms (median)")
            for label, path in views.items():
                store.reads.clear()
                samples = sorted(timed(client, path) for _ in range(REPEATS))
                median = statistics.median(samples)
                p95 = samples[int(0.95 * (len(samples) - 1))]
                per_view = {k: v // REPEATS for k, v in store.reads.items()}
                print(
                    f"{label:28} {median * 1000:7.1f}ms {p95 * 1000:7.1f}ms "
                    f"{samples[-1] * 1000:7.1f}ms  {median / TARGET_SECONDS:.2f}  "
                    f"store reads per view: {per_view}"
                )
                timed_view = not label.startswith("generation")
                if timed_view and samples[-1] > TARGET_SECONDS:
                    failed = True
                if timed_view and store.reads.get("generations", 0):
                    print(f"  !! {label} read observation objects")
                    failed = True
            land_generation(repo, store_base, args.generations + 1)
            after = timed(client, f"/lineages/{NAME}")
            failed |= after > TARGET_SECONDS
            print(
                f"after a new generation lands (history extended, index re-read): "
                f"first page {after * 1000:.1f} ms, ratio {after / TARGET_SECONDS:.2f}"
            )
        server.should_exit = True
    print(
        "result:", "FAIL" if failed else "ok (every timed view under 300 ms; no observation read)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
