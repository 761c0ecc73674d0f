"""Helpers for the browsing tests: the legacy sample imported, a hostile lineage, a served UI.

The web UI is tested as users meet it: ``schedule-lineage serve`` runs as a
subprocess in a ``Fleet`` home and is spoken to over real HTTP. The legacy sample
is recorded by ``legacy_lineage`` into the test's own directory and imported as a
real bundle, so nothing outside the repository is read. The hostile
lineage is written with the worker's own git and store code (no sandbox needed),
so organism-made text of every kind (file names, diffs, subjects, journal lines,
stderr, prompts, responses) can carry markup aimed at the browser.
"""

from __future__ import annotations

import hashlib
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import httpx

from support.fleet import Fleet, free_port, wait_for
from support.legacy_lineage import write_legacy_bundle
from worker.fleet.assembly import lineage_cache, observation_store
from worker.fleet.repo_admin import ensure_shared_repo
from worker.fleet.runs import RunRecord
from worker.fleet.settings import Settings
from worker.instrument import journal
from worker.instrument.fingerprint import Instrument
from worker.instrument.gitrepo import Entry, LineageCache
from worker.instrument.lineage import create_lineage
from worker.instrument.names import JOURNAL_PATH, ORGANISM_PATH
from worker.instrument.physics import Physics
from worker.instrument.records import (
    IndexEntry,
    LineageIndex,
    ModelAttempt,
    ModelCall,
    ModelFailure,
    Observation,
    Provenance,
)
from worker.instrument.store import ObservationStore
from worker.instrument.store_keys import generation_key, index_key, run_key

# Markup an unescaped page would run or render: a script, an event handler, a tag.
PAYLOAD = "<script>alert('xss')</script><img src=x onerror=alert(1)><b>bold</b>"
PAYLOAD_ESCAPED = (
    "&lt;script&gt;alert(&#39;xss&#39;)&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;"
)
SERVE_START_SECONDS = 30


def settings_of(fleet: Fleet) -> Settings:
    return Settings(home=fleet.home / ".ouroboros")


def sample_bundle(directory: Path) -> Path:
    """The legacy sample lineage as a git bundle in ``directory``, recorded on first use."""
    bundle = directory / "sample-lineage.bundle"
    # Several imports (twins, refusals) in one directory read the same recording.
    if not bundle.exists():
        write_legacy_bundle(bundle)
    return bundle


def import_fixture(fleet: Fleet, name: str = "sample") -> None:
    fleet.ok("import-bundle", str(sample_bundle(fleet.home)), name)


def create_test_lineage(
    settings: Settings, name: str, seed: bytes, cohort: str | None = None
) -> tuple[LineageCache, ObservationStore]:
    """Lineage ``name`` seeded with ``seed`` under a test instrument, in ``cohort`` if given;
    the cache and the store it was written with."""
    ensure_shared_repo(settings.lineage_repo_url)
    cache, store = lineage_cache(settings), observation_store(settings)
    instrument = Instrument(
        fingerprint="e" * 64, version="0.1.0", scripts={}, seed=seed, sources={}
    )
    create_lineage(
        name=name,
        seed=seed,
        physics=Physics(),
        instrument=instrument,
        commit="a" * 40,
        repository="tests",
        ref="tests",
        cache=cache,
        store=store,
        cohort=cohort,
    )
    return cache, store


def write_hostile_lineage(settings: Settings, name: str = "xss", payload: str = PAYLOAD) -> None:
    """A fleet lineage whose every organism-made field carries ``payload``.

    gen 1 changed (hostile file name and diff), an out-of-loop commit with a hostile
    subject, gen 2 died with hostile stderr lines; both observed with hostile
    stderr, prompts, responses and errors.
    """
    cache, store = create_test_lineage(settings, name, f";; seed {payload}\n".encode())
    head = cache.fetch(name)
    assert head is not None
    tree = cache.tree(head)
    when = datetime(2026, 3, 1, tzinfo=UTC)

    def blob(content: str | bytes) -> Entry:
        data = content.encode() if isinstance(content, str) else content
        return Entry("100644", cache.hash_bytes(data))

    def land(entries: dict[str, Entry], subject: str) -> str:
        nonlocal head
        assert head is not None
        commit = cache.commit(head, entries, subject)
        assert cache.push_cas(name, commit, head)
        head = commit
        return commit

    summary = journal.changed_summary((2, 1), 2)
    log = journal.append(b"", journal.entry_changed(1, summary, when))
    gen1_parent = head
    tree.update(
        {
            ORGANISM_PATH: blob(f';; body\n(message "{payload}")\n'),
            f"{payload}.el": blob(f"{payload}\n"),
            JOURNAL_PATH: blob(log),
        }
    )
    gen1 = land(dict(tree), journal.subject_changed(1, summary))
    land(dict(tree, **{"notes.txt": blob(payload)}), f"external edit: {payload}")
    gen2_parent = head
    # A terminal escape too: the CLI must not let it act on the reader's terminal.
    stderr = (
        f'first line\n{payload}\nDebugger entered--Lisp error: (error "{payload}")\n'
        f'\x1b[2J(error "{payload}")\n'
    )
    log = journal.append(log, journal.entry_died(2, 255, stderr, when))
    tree[JOURNAL_PATH] = blob(log)
    gen2 = land(dict(tree), journal.subject_died(2, 255))
    observations = [
        sample_observation(name, 1, gen1_parent, gen1, "changed", when, ""),
        sample_observation(name, 2, gen2_parent, gen2, "process_exit", when, stderr),
    ]
    for observation in observations:
        store.put_once(
            generation_key(name, observation.generation),
            observation.model_dump_json(by_alias=True).encode(),
        )
    index = LineageIndex(lineage=name, generations=[IndexEntry.of(o) for o in observations])
    store.put(index_key(name), index.model_dump_json().encode())


def write_unavailable_lineage(settings: Settings, name: str = "down") -> None:
    """A fleet lineage whose one generation is a no-change the model never answered: its
    two calls refused by the provider, the subject and the journal marked."""
    cache, store = create_test_lineage(settings, name, b";; seed\n")
    parent = cache.fetch(name)
    assert parent is not None
    when = datetime(2026, 3, 1, tzinfo=UTC)
    mark = journal.unavailable_mark(2)
    log = journal.append(b"", journal.entry_no_change(1, when, mark))
    tree = dict(cache.tree(parent), **{JOURNAL_PATH: Entry("100644", cache.hash_bytes(log))})
    commit = cache.commit(parent, tree, journal.subject_no_change(1, mark))
    assert cache.push_cas(name, commit, parent)
    failure = ModelFailure(
        kind="refused",
        reason="openai answered HTTP 401 (invalid_api_key)",
        failed_calls=2,
        answered_calls=0,
    )
    observation = sample_observation(name, 1, parent, commit, "no-change", when, "")
    observation = observation.model_copy(update={"model_failure": failure})
    store.put_once(generation_key(name, 1), observation.model_dump_json(by_alias=True).encode())
    index = LineageIndex(lineage=name, generations=[IndexEntry.of(observation)])
    store.put(index_key(name), index.model_dump_json().encode())


def sample_observation(
    name: str,
    generation: int,
    parent: str,
    commit: str,
    outcome: str,
    when: datetime,
    stderr: str,
) -> Observation:
    prompt = f"Rewrite yourself. {PAYLOAD}"
    return Observation(
        lineage=name,
        generation=generation,
        parent_commit=parent,
        lineage_commit=commit,
        started_at=when - timedelta(seconds=3),
        finished_at=when,
        duration_seconds=2.5 + generation,
        outcome=outcome,  # type: ignore[arg-type]
        exit_status=255 if outcome == "process_exit" else 0,
        driver_result="exited",
        cpu_usage_nsec=generation * 10**9,
        memory_peak_bytes=generation * 50 * 2**20,
        oom_kills=0,
        figure_sources={"cpu_usage_nsec": f"test {PAYLOAD}"},
        archive_bytes=10240,
        published_bytes=100,
        published_files=3,
        provider="scripted",
        model="scripted",
        constraints=Physics(),
        model_calls=[
            ModelCall(
                index=1,
                started_at=when - timedelta(seconds=2),
                duration_seconds=0.5,
                status=200,
                prompt=prompt,
                response=f'(message "{PAYLOAD}")',
                prompt_sha256=hashlib.sha256(prompt.encode()).hexdigest(),
                response_sha256=None,
                requested_output_tokens=100,
                input_tokens=40,
                output_tokens=12,
                reserved_usd=Decimal("0.01"),
                cost_usd=Decimal("0.0012"),
                error=PAYLOAD,
                stop_reason="max_tokens",
                attempts=[
                    ModelAttempt(
                        number=1,
                        started_at=when - timedelta(seconds=2),
                        cap_wait_seconds=0.25,
                        request_seconds=0.1,
                        outcome="failed",
                        vendor_status=429,
                        error=PAYLOAD,
                        retry_after_seconds=0.1,
                        backoff_seconds=0.1,
                    ),
                    ModelAttempt(
                        number=2,
                        started_at=when - timedelta(seconds=1.8),
                        cap_wait_seconds=0.0,
                        request_seconds=0.2,
                        outcome="answered",
                        vendor_status=200,
                        cost_usd=Decimal("0.0012"),
                    ),
                ],
            )
        ],
        spent_usd=Decimal("0.0012"),
        stderr=stderr,
        stderr_truncated=False,
        provenance=Provenance(
            worker_host=PAYLOAD,
            fleet_version="0.1.0",
            instrument_fingerprint="e" * 64,
            ceiling_driver="cgroup1",
            bwrap_version="bwrap",
            emacs_version="emacs",
        ),
    )


class Served:
    """``schedule-lineage serve`` running for a fleet home, spoken to over HTTP."""

    def __init__(self, fleet: Fleet, log: Path) -> None:
        self.fleet = fleet
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "scheduler", "serve", "--port", str(self.port)],
            env=fleet.env,
            cwd=fleet.home,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.client = httpx.Client(base_url=self.url, timeout=30, follow_redirects=False)
        deadline = time.monotonic() + SERVE_START_SECONDS
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"serve exited {self.process.returncode}: {log.read_text()}")
            try:
                self.client.get("/openapi.json")
                return
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def get(self, path: str) -> httpx.Response:
        return self.client.get(path)

    def wait_for_workers(self) -> None:
        """Wait until the overview shows the broker's answer on live workers: the web
        process asks in the background, so its first answer may follow the first request."""
        wait_for(
            lambda: self.get("/api/").json()["broker"] == "inspected",
            30,
            "the web process's answer on live workers",
        )

    def raw(self, request_target: str) -> int:
        """Status of a request sent byte for byte (no client-side path normalisation)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as sock:
            sock.sendall(
                f"GET {request_target} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                "Connection: close\r\n\r\n".encode()
            )
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        return int(reply.split(b" ", 2)[1])

    def stop(self) -> None:
        self.client.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


def write_hostile_run(settings: Settings, lineage: str = "xss") -> None:
    """A run record of ``lineage`` in the store, from generation 0 to 5."""
    run = RunRecord(
        run_id="20260301T000000-abcdef",
        lineage=lineage,
        created_at=datetime(2026, 3, 1, tzinfo=UTC),
        start_generation=0,
        target_generation=5,
        provider="scripted",
        model=None,
        budget_usd=Decimal("1"),
    )
    observation_store(settings).put(run_key(lineage, run.run_id), run.model_dump_json().encode())


def serve_session_sample(home: Path) -> Served:
    """The session's served sample: the legacy sample and its twin (one family), and the
    hostile lineage with a run record."""
    fleet = Fleet(home)
    import_fixture(fleet)
    import_fixture(fleet, "sample-twin")
    settings = settings_of(fleet)
    write_hostile_lineage(settings)
    write_hostile_run(settings)
    return Served(fleet, home / "serve.log")


def serve_sample_and_hostile(home: Path, *forks: tuple[str, str]) -> Served:
    """A web UI over the imported legacy sample and a lineage full of hostile text,
    and a lineage forked for each (NAME, NAME[@GEN]) in ``forks``."""
    fleet = Fleet(home)
    import_fixture(fleet)
    write_hostile_lineage(settings_of(fleet))
    for name, source in forks:
        fleet.ok("fork", name, "--from", source)
    return Served(fleet, home / "serve.log")
