"""The real ``Pipeline`` with a stand-in life: planning, judging, committing, rollback and
publication in milliseconds, in this process.

The pipeline is built as ``build_pipeline`` builds it, but with the host's facts given
(no probe) and a ``Sandbox`` that lives each life here: it reads the tree it was given
from the kernel directory's ``base.tar``, may ask the model socket, and ends as the test
says (a result archive, or a death with the figures the ceiling would report). The
repository (libgit2), the file store, the spool and the model socket are the real ones.
Real lives, on bwrap, Emacs and cgroups, stay the proof in test_pipeline.py.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import pytest
from support.endings import ended, published
from support.model import PRICES, UnixHTTPConnection

from worker.fleet.assembly import lineage_cache
from worker.fleet.repo_admin import ensure_shared_repo
from worker.fleet.settings import Settings
from worker.instrument import journal
from worker.instrument.errors import StaleJob
from worker.instrument.fingerprint import Instrument
from worker.instrument.gitrepo import LineageCache
from worker.instrument.host import HostFacts
from worker.instrument.identity import SandboxIdentity
from worker.instrument.job import GenerationJob, GenerationReport
from worker.instrument.lineage import create_lineage
from worker.instrument.model.prices import Prices
from worker.instrument.model.providers import (
    GenerationContext,
    Provider,
    ProviderReply,
    ProviderUnavailable,
    make_provider,
)
from worker.instrument.names import JOURNAL_PATH, ORGANISM_PATH
from worker.instrument.physics import Physics
from worker.instrument.pipeline import ObservationConflict, Pipeline
from worker.instrument.records import Observation
from worker.instrument.sandbox import SandboxResult
from worker.instrument.settings import InstrumentSettings
from worker.instrument.spool import Publication, Spool
from worker.instrument.store import FileStore, ObservationStore, StoreUnavailable
from worker.instrument.store_keys import generation_key

SEED = b';; seed\n(message "alive")\n'
INSTRUMENT = Instrument(fingerprint="e" * 64, version="0.0.0", scripts={}, seed=SEED, sources={})
COMMIT = "a" * 40
PHYSICS = Physics(wall_seconds=60, cpu_seconds=60)
LINEAGE = "seam"
HOST = "stand-in-host"
Files = dict[str, bytes]


class OwnIdentity:
    """Every life as this process itself, as an unprivileged worker runs them."""

    @contextmanager
    def hold(self) -> Iterator[SandboxIdentity]:
        yield SandboxIdentity(os.getuid(), os.getgid(), drop=False)


def given_tree(kernel: Path) -> Files:
    """The tree the life was given, as its stage would unpack it into /work."""
    with tarfile.open(kernel / "base.tar") as tar:
        return {
            m.name: tar.extractfile(m).read()  # type: ignore[union-attr]
            for m in tar.getmembers()
            if m.isfile()
        }


def ask_model(kernel: Path, prompt: str) -> tuple[int, str]:
    """One call on the life's model socket, as an organism makes it."""
    connection = UnixHTTPConnection(kernel / "model.sock")
    try:
        connection.request("POST", "/generate", body=prompt.encode())
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


Act = Callable[[Path, Files], SandboxResult]


@dataclass
class StandInLife:
    """The ``Sandbox`` of these tests: each life does what the next act says."""

    acts: list[Act] = field(default_factory=list)
    given: list[Files] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)

    def live(
        self, kernel: Path, physics: Physics, label: str, identity: SandboxIdentity
    ) -> SandboxResult:
        files = given_tree(kernel)
        self.given.append(files)
        self.labels.append(label)
        return self.acts.pop(0)(kernel, files)


class SwitchedStore(FileStore):
    """A file store that can be taken away, as an S3 endpoint goes down."""

    down = False

    def put_once(self, key: str, data: bytes) -> bool:
        if self.down:
            raise StoreUnavailable("the stand-in store is down")
        return super().put_once(key, data)


@dataclass
class Seam:
    pipeline: Pipeline
    life: StandInLife
    cache: LineageCache
    store: ObservationStore
    spool: Spool

    def run(self, *acts: Act) -> list[GenerationReport]:
        """One generation per act, each on top of the lineage's head."""
        self.life.acts.extend(acts)
        return [
            self.pipeline.run(
                GenerationJob(lineage=LINEAGE, expected_commit=self.head(), provider="scripted")
            )
            for _ in acts
        ]

    def head(self) -> str:
        head = self.cache.fetch(LINEAGE)
        assert head is not None
        return head

    def files(self, commit: str) -> Files:
        tree = self.cache.tree(commit)
        blobs = self.cache.cat_blobs(e.sha for e in tree.values())
        return {path: blobs[e.sha] for path, e in tree.items()}

    def subject(self, commit: str) -> str:
        return str(self.cache.repo[commit].message).splitlines()[0]

    def observation(self, generation: int) -> Observation:
        data = self.store.get(generation_key(LINEAGE, generation))
        assert data is not None, f"no observation of generation {generation}"
        return Observation.model_validate_json(data)


def build(tmp_path: Path, providers: Callable[..., Provider] = make_provider) -> Seam:
    settings = Settings(home=tmp_path / "home")
    ensure_shared_repo(settings.lineage_repo_url)
    cache = lineage_cache(settings)
    store = SwitchedStore(f"file://{tmp_path / 'store'}", tmp_path / "store")
    create_lineage(
        name=LINEAGE,
        seed=SEED,
        physics=PHYSICS,
        instrument=INSTRUMENT,
        commit=COMMIT,
        repository="tests",
        ref="tests",
        cache=cache,
        store=store,
    )
    life = StandInLife()
    spool = Spool(tmp_path / "spool")
    host = HostFacts(
        name=HOST,
        emacs=Path("/usr/bin/emacs"),
        emacs_version="GNU Emacs (stand-in)",
        bwrap_version="bubblewrap (stand-in)",
        ceiling_driver="cgroup2",
        identities=OwnIdentity(),
    )
    pipeline = Pipeline(
        settings=settings,
        instrument=INSTRUMENT,
        instrument_commit=COMMIT,
        host=host,
        sandbox=life,
        store=store,
        cache=cache,
        spool=spool,
        providers=providers,
    )
    return Seam(pipeline, life, cache, store, spool)


@pytest.fixture
def seam(tmp_path: Path) -> Seam:
    return build(tmp_path)


def rewrite_body(kernel: Path, given: Files) -> SandboxResult:
    """A life that asks the model for its next body and writes it, with a note beside."""
    status, body = ask_model(kernel, "your next body, please")
    assert status == 200, body
    return published({**given, ORGANISM_PATH: body.encode(), "notes.txt": b"gen one\n"})


def unchanged(kernel: Path, given: Files) -> SandboxResult:
    return published(given)


def test_a_changed_generation_is_committed_journaled_and_observed(seam: Seam) -> None:
    seed_commit = seam.head()
    [report] = seam.run(rewrite_body)
    assert report.outcome == "changed" and report.generation == 1
    assert report.parent == seed_commit and report.commit == seam.head()
    assert report.observation_stored and report.model_failure is None
    # The life was given the seed's tree, and nothing the kernel owns.
    assert seam.life.given == [{ORGANISM_PATH: SEED}]
    files = seam.files(report.commit)
    assert files["notes.txt"] == b"gen one\n"
    assert files[ORGANISM_PATH] != SEED and b"scripted stand-in edit" in files[ORGANISM_PATH]
    assert seam.subject(report.commit).startswith("gen 1: changed (organism +")
    assert files[JOURNAL_PATH].decode().startswith("## gen 1 — changed — organism +")
    observation = seam.observation(1)
    assert observation.outcome == "changed"
    assert observation.parent_commit == seed_commit
    assert observation.lineage_commit == report.commit
    assert observation.published_files == 2
    assert [call.status for call in observation.model_calls] == [200]
    # The host's facts come from where the pipeline was built, not from a probe of its own.
    provenance = observation.provenance
    assert provenance.worker_host == HOST
    assert provenance.ceiling_driver == "cgroup2"
    assert provenance.bwrap_version == "bubblewrap (stand-in)"
    assert provenance.emacs_version == "GNU Emacs (stand-in)"
    assert provenance.instrument_fingerprint == INSTRUMENT.fingerprint
    assert seam.spool.pending() == []


def test_the_next_generation_is_numbered_after_the_last_and_given_its_tree(seam: Seam) -> None:
    first, second = seam.run(rewrite_body, unchanged)
    assert (first.generation, second.generation) == (1, 2)
    assert second.parent == first.commit
    assert seam.life.given[1] == {
        p: d for p, d in seam.files(first.commit).items() if p in (ORGANISM_PATH, "notes.txt")
    }
    assert seam.life.labels[1].startswith(f"{LINEAGE}-2-")


def test_a_no_change_generation_commits_only_its_journal_entry(seam: Seam) -> None:
    seed_commit = seam.head()
    [report] = seam.run(unchanged)
    assert report.outcome == "no-change"
    assert seam.subject(report.commit) == journal.subject_no_change(1)
    before, after = seam.files(seed_commit), seam.files(report.commit)
    assert {p for p in after if after[p] != before.get(p)} == {JOURNAL_PATH}
    assert seam.observation(1).outcome == "no-change"


DEATHS = {
    "wall": (ended(None, 9, wall_timeout=True, result="timeout"), "wall_timeout", 137),
    "memory": (ended(None, 9, result="oom-kill", oom_kills=1), "cgroup_oom", 137),
    "nonzero-exit": (ended(3, stderr=b"boom\n"), "process_exit", 3),
    "unpack-failure": (
        ended(70, stderr=b"stage: cannot unpack /kernel/base.tar\n"),
        "process_exit",
        70,
    ),
}


@pytest.mark.parametrize("kind", list(DEATHS))
def test_a_death_rolls_the_body_back_and_publishes_nothing_of_the_dead_life(
    seam: Seam, kind: str
) -> None:
    """After a changed generation, a death of each kind puts the seed's body back beside
    the parent's other files, and says how the life ended."""
    result, outcome, code = DEATHS[kind]
    changed, dead = seam.run(rewrite_body, lambda kernel, given: result)
    assert dead.outcome == outcome
    files = seam.files(dead.commit)
    assert files[ORGANISM_PATH] == SEED
    assert files["notes.txt"] == b"gen one\n"
    assert seam.subject(dead.commit) == journal.subject_died(2, code)
    observation = seam.observation(2)
    assert observation.outcome == outcome
    assert observation.parent_commit == changed.commit
    assert (observation.exit_status, observation.signal) == (result.exit_status, result.signal)
    assert observation.published_files == 0
    if result.stderr:
        assert result.stderr.decode().strip() in files[JOURNAL_PATH].decode()


@pytest.mark.parametrize(("exit_status", "notes_kept"), [(70, False), (3, True)])
def test_a_tree_that_cannot_be_unpacked_is_never_given_again(
    seam: Seam, exit_status: int, notes_kept: bool
) -> None:
    """A death after a rollback already holds the rolled-back body: for a life whose stage
    could not unpack its tree (exit 70) that same tree is passed over, and the body comes
    back with the files it lived in (the seed's); any other death keeps the tree."""
    ending = ended(exit_status)
    _, rolled_back, again = seam.run(rewrite_body, lambda k, g: ended(3), lambda k, g: ending)
    given = seam.life.given[2]
    assert given == {ORGANISM_PATH: SEED, "notes.txt": b"gen one\n"}
    files = seam.files(again.commit)
    assert files[ORGANISM_PATH] == SEED
    assert ("notes.txt" in files) is notes_kept
    assert seam.files(rolled_back.commit)["notes.txt"] == b"gen one\n"


def test_a_result_holding_a_kernel_owned_path_dies_as_a_decoder_rejection(seam: Seam) -> None:
    forged = {".ouroboros-lineage.json": b"{}", ORGANISM_PATH: b"(forged)\n"}
    [report] = seam.run(lambda kernel, given: published({**given, **forged}))
    assert report.outcome == "decoder_rejection"
    assert seam.files(report.commit)[ORGANISM_PATH] == SEED
    assert seam.observation(1).rejection_reason


def test_an_observation_waits_in_the_spool_while_the_store_is_down(seam: Seam) -> None:
    store = seam.store
    assert isinstance(store, SwitchedStore)
    store.down = True
    [report] = seam.run(unchanged)
    # The commit is pushed: the lineage moved, the record waits.
    assert not report.observation_stored and seam.head() == report.commit
    assert store.get(generation_key(LINEAGE, 1)) is None
    [pending] = seam.spool.pending(LINEAGE)
    assert (pending.stage, pending.commit) == ("observe", report.commit)
    assert seam.pipeline.drain() == 1
    store.down = False
    assert seam.pipeline.drain() == 0
    assert seam.observation(1).lineage_commit == report.commit
    assert seam.spool.pending() == []


def test_the_observation_is_written_once_and_a_clash_is_kept_for_an_operator(
    seam: Seam,
) -> None:
    """A publication finished again (a crash between storing its observation and leaving
    the spool) finds its own record and leaves it as it is; a key that records another
    commit stops the publication, which the spool keeps."""
    [first] = seam.run(unchanged)
    key = generation_key(LINEAGE, 1)
    written = seam.store.get(key)
    assert written is not None and seam.spool.pending() == []
    seam.spool.save(
        Publication(
            lineage=LINEAGE,
            generation=1,
            parent=first.parent,
            commit=first.commit,
            stage="observe",
            observation_key=key,
            observation=written.decode(),
        )
    )
    assert seam.pipeline.drain() == 0
    assert seam.store.get(key) == written and seam.spool.pending() == []

    recorded = Observation.model_validate_json(written)
    forged = recorded.model_copy(update={"lineage_commit": "f" * 40})
    forged_bytes = forged.model_dump_json(by_alias=True).encode()
    seam.store.put(generation_key(LINEAGE, 2), forged_bytes)
    with pytest.raises(ObservationConflict, match="already records commit ffffffffffff"):
        seam.run(unchanged)
    [kept] = seam.spool.pending(LINEAGE)
    assert (kept.generation, kept.stage, kept.commit) == (2, "observe", seam.head())
    assert seam.store.get(generation_key(LINEAGE, 2)) == forged_bytes


def test_a_job_planned_on_an_old_head_is_stale_and_no_life_is_lived(seam: Seam) -> None:
    seed_commit = seam.head()
    seam.run(unchanged)
    seam.life.acts.append(unchanged)
    with pytest.raises(StaleJob, match="re-plan"):
        seam.pipeline.run(
            GenerationJob(lineage=LINEAGE, expected_commit=seed_commit, provider="scripted")
        )
    assert len(seam.life.given) == 1


class VendorDown(Provider):
    """A provider whose every call fails as a vendor that is down answers (503)."""

    name = "scripted"
    capped = False

    def generate(
        self, prompt: str, max_output_tokens: int, timeout: float, context: GenerationContext
    ) -> ProviderReply:
        raise ProviderUnavailable("stand-in: the vendor is down", status=503)


def vendor_down(
    name: str, model: str | None, settings: InstrumentSettings, prices: Prices | None
) -> Provider:
    return VendorDown(model or "stand-in", prices or PRICES)


def test_a_generation_whose_model_never_answered_is_marked_unavailable(tmp_path: Path) -> None:
    seam = build(tmp_path, vendor_down)

    def asks_in_vain(kernel: Path, given: Files) -> SandboxResult:
        status, _ = ask_model(kernel, "your next body, please")
        assert status != 200
        return published(given)

    [report] = seam.run(asks_in_vain)
    assert report.outcome == "no-change"
    failure = report.model_failure
    assert failure is not None and failure.model_unavailable
    assert failure.answered_calls == 0 and failure.failed_calls == 1
    assert seam.subject(report.commit) == journal.subject_no_change(1, journal.unavailable_mark(1))
    observation = seam.observation(1)
    assert observation.model_failure == failure
    assert observation.spent_usd == Decimal(0)
