"""One generation, end to end: the trusted path from a job to a commit plus observation.

Owns the generation contract of DESIGN.md: fetch, validate the lineage root,
number the generation, prepare the private kernel directory, serve the model
syscall, run the life under the resource ceiling, classify the outcome, publish
through the trusted decoder, push with compare-and-swap and record the
observation through the spool. The Celery task and ``schedule-lineage run --local``
both call ``Pipeline.run``; nothing else writes to a lineage.

Trusts: the instrument it was built with, its settings, the shared repository and
the observation store. Trusts nothing the organism produced: the result archive
goes through the decoder, stderr and model traffic are carried as capped data.
"""

from __future__ import annotations

import hashlib
import io
import json
import socket
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from worker import journal
from worker.broker import GenerationContext, ModelBroker, capabilities, make_provider
from worker.broker.providers import PROVIDER_NAMES
from worker.ceilings import Ceiling
from worker.decoder import (
    KERNEL_OWNED,
    DecodeLimits,
    DecoderRejection,
    TreeEntry,
    decode_archive,
)
from worker.errors import Refusal, StaleJob
from worker.gitrepo import Entry, LineageCache
from worker.identity import IdentityPool
from worker.instrument import Instrument
from worker.lineage import (
    JOURNAL_PATH,
    ORGANISM_PATH,
    LineageMetadata,
    check_continuable,
    check_name,
    root_metadata,
)
from worker.observation import (
    IndexEntry,
    LineageIndex,
    Observation,
    Outcome,
    Provenance,
    cap_stderr,
    generation_key,
    index_key,
)
from worker.physics import Physics
from worker.sandbox import (
    SandboxResult,
    kernel_directory,
    resolve_emacs,
    run_sandbox,
    sweep_kernel_dirs,
)
from worker.settings import Settings
from worker.spool import Publication, Spool
from worker.store import ObservationStore, StoreUnavailable

HEX_COMMIT = r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$"
INDEX_ATTEMPTS = 3
# Generations still pending in a spool leave gaps too; each write probes this many.
INDEX_REPAIRS = 8


class GenerationJob(BaseModel):
    """The job message: which lineage, which commit it must extend, which model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lineage: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$")
    expected_commit: str = Field(pattern=HEX_COMMIT)
    provider: Literal[PROVIDER_NAMES] = Field(  # type: ignore[valid-type]
        description="one of the known providers; a hostile name is rejected, not run"
    )
    model: str | None = Field(None, max_length=200)
    run_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]{1,80}$")
    target_generation: int | None = Field(None, ge=1)
    budget_usd: Decimal | None = Field(None, ge=0, description="what the run has left")
    enqueued_at: datetime | None = None


class ObservationConflict(RuntimeError):
    """The write-once key of an observation holds a different generation's record."""


class Verdict(NamedTuple):
    """What a life amounts to: its outcome and the tree to commit (journal still to add)."""

    outcome: Outcome
    rejection: str | None
    entries: dict[str, Entry]
    summary: str
    published_bytes: int
    published_files: int


class GenerationReport(BaseModel):
    """What happened, for the caller (scheduler, CLI): never the source of truth."""

    lineage: str
    generation: int
    outcome: Outcome
    parent: str
    commit: str
    spent_usd: Decimal
    run_budget_exhausted: bool
    observation_stored: bool


class Pipeline:
    """The per-process generation machinery; build once, run many jobs."""

    def __init__(
        self,
        *,
        settings: Settings,
        instrument: Instrument,
        instrument_commit: str,
        ceiling: Ceiling,
        store: ObservationStore,
        cache: LineageCache,
    ) -> None:
        self.settings = settings
        self.instrument = instrument
        self.instrument_commit = instrument_commit
        self.ceiling = ceiling
        self.store = store
        self.cache = cache
        self.spool = Spool(settings.state_path / "spool")
        self.emacs = resolve_emacs()
        self.identities = IdentityPool(settings.sandbox_uid_base, settings.sandbox_uid_count)
        self.identities.probe()
        self.host = socket.gethostname()
        self.bwrap_version = _first_line(["bwrap", "--version"])
        sweep_kernel_dirs()
        self.emacs_version = _first_line([str(self.emacs), "--version"])

    def head(self, lineage: str) -> str:
        """The lineage's current head on the shared repository (fetching it)."""
        check_name(lineage)
        head = self.cache.fetch(lineage)
        if head is None:
            raise Refusal(f"no lineage named {lineage}; create it with schedule-lineage init")
        return head

    def run(
        self,
        job: GenerationJob,
        *,
        task_id: str | None = None,
        attempt: int = 1,
    ) -> GenerationReport:
        """Run one generation of ``job.lineage`` on top of ``job.expected_commit``."""
        self.drain(job.lineage)
        parent = self.head(job.lineage)
        if parent != job.expected_commit:
            raise StaleJob(
                f"{job.lineage} is at {parent[:12]}, not {job.expected_commit[:12]}; re-plan"
            )
        meta = root_metadata(self.cache, parent, job.lineage)
        check_continuable(meta, self.instrument, self.instrument_commit)
        generation = 1 + self.cache.history(job.lineage, parent).generations
        provider = make_provider(job.provider, job.model, self.settings)
        tree = self.cache.tree(parent)
        blobs = self.cache.cat_blobs(entry.sha for entry in tree.values())
        physics = meta.physics
        narrowed = job.budget_usd is not None and job.budget_usd < physics.budget_usd
        if narrowed:
            # A run's remaining budget narrows, never widens, the pinned per-generation one.
            physics = physics.model_copy(update={"budget_usd": job.budget_usd})
        source = blobs.get(tree[ORGANISM_PATH].sha, b"") if ORGANISM_PATH in tree else b""
        context = GenerationContext(
            lineage=job.lineage,
            generation=generation,
            organism_source=source.decode("utf-8", errors="replace"),
        )
        started = datetime.now(UTC)
        label = f"{job.lineage}-{generation}-{hashlib.sha256(parent.encode()).hexdigest()[:8]}"
        with (
            self.identities.hold() as identity,
            kernel_directory(
                self._kernel_files(meta, physics, generation, parent, tree, blobs), identity
            ) as kernel,
        ):
            owner = (identity.uid, identity.gid) if identity.drop else None
            with ModelBroker(
                kernel / "model.sock", provider, physics, context, owner=owner
            ) as broker:
                result = run_sandbox(kernel, physics, self.ceiling, label, self.emacs, identity)
            calls, spent = list(broker.calls), broker.spent_usd
        # The run, not the pinned physics, ran out: nothing more can be bought for it.
        run_exhausted = narrowed and any(call.status == 402 for call in calls)
        finished = datetime.now(UTC)
        with tempfile.TemporaryDirectory(prefix="ouro-publish-") as scratch:
            verdict = self._judge(result, physics, Path(scratch), parent, tree)
        outcome, summary, entries = verdict.outcome, verdict.summary, verdict.entries
        exit_code = _shell_status(result)
        journal_bytes = blobs.get(tree[JOURNAL_PATH].sha, b"") if JOURNAL_PATH in tree else b""
        stderr_text, truncated = cap_stderr(result.stderr)
        if outcome == "changed":
            subject = journal.subject_changed(generation, summary)
            entry = journal.entry_changed(generation, summary, finished)
        elif outcome == "no-change":
            subject = journal.subject_no_change(generation)
            entry = journal.entry_no_change(generation, finished)
        else:
            subject = journal.subject_died(generation, exit_code)
            # The journal wants the last lines the organism wrote, which a cut record lacks.
            last = result.stderr_tail if truncated else result.stderr
            entry = journal.entry_died(
                generation, exit_code, last.decode("utf-8", errors="replace"), finished
            )
        entries[JOURNAL_PATH] = Entry(
            "100644", self.cache.hash_bytes(journal.append(journal_bytes, entry))
        )
        commit = self.cache.commit(parent, entries, subject)
        observation = Observation(
            lineage=job.lineage,
            generation=generation,
            parent_commit=parent,
            lineage_commit=commit,
            started_at=started,
            finished_at=finished,
            duration_seconds=result.duration_seconds,
            outcome=outcome,
            rejection_reason=verdict.rejection,
            exit_status=result.exit_status,
            signal=result.signal,
            driver_result=result.figures.result,
            cpu_usage_nsec=result.figures.cpu_usage_nsec,
            memory_peak_bytes=result.figures.memory_peak_bytes,
            oom_kills=result.figures.oom_kills,
            figure_sources=result.figures.sources,
            archive_bytes=result.archive_bytes,
            published_bytes=verdict.published_bytes,
            published_files=verdict.published_files,
            provider=provider.name,
            model=provider.model,
            constraints=physics,
            model_calls=calls,
            spent_usd=spent,
            run_budget_exhausted=run_exhausted,
            stderr=stderr_text,
            stderr_truncated=truncated,
            run_id=job.run_id,
            provenance=Provenance(
                worker_host=self.host,
                fleet_version=self.instrument.version,
                instrument_fingerprint=self.instrument.fingerprint,
                ceiling_driver=self.ceiling.name,
                bwrap_version=self.bwrap_version,
                emacs_version=self.emacs_version,
                task_id=task_id,
                attempt=attempt,
                queue_wait_seconds=(
                    (started - job.enqueued_at).total_seconds() if job.enqueued_at else None
                ),
            ),
        )
        publication = Publication(
            lineage=job.lineage,
            generation=generation,
            parent=parent,
            commit=commit,
            stage="push",
            observation_key=generation_key(job.lineage, generation),
            observation=observation.model_dump_json(by_alias=True, indent=2),
        )
        self.spool.save(publication)
        stored = self._finish(publication)
        return GenerationReport(
            lineage=job.lineage,
            generation=generation,
            outcome=outcome,
            parent=parent,
            commit=commit,
            spent_usd=spent,
            run_budget_exhausted=run_exhausted,
            observation_stored=stored,
        )

    def drain(self, lineage: str | None = None) -> int:
        """Finish every pending publication (of one lineage); how many remain pending."""
        pending = self.spool.pending(lineage)
        for done, publication in enumerate(pending):
            try:
                if not self._finish(publication):
                    # The store is down: the rest would wait on it too, so stop here.
                    return len(pending) - done
            except StaleJob:
                continue
        return 0

    def _finish(self, publication: Publication) -> bool:
        """Push (compare-and-swap) then store the observation; True once both landed."""
        if publication.stage == "push":
            landed = self.cache.push_cas(
                publication.lineage, publication.commit, publication.parent
            ) or self.cache.branch_contains(publication.lineage, publication.commit)
            if not landed:
                # Lost the race: this result is speculative and is never published.
                self.spool.remove(publication)
                raise StaleJob(
                    f"{publication.lineage} moved while generation "
                    f"{publication.generation} ran; its result is discarded"
                )
            publication = publication.model_copy(update={"stage": "observe"})
            self.spool.save(publication)
        observation = Observation.model_validate_json(publication.observation)
        try:
            if not self.store.put_once(
                publication.observation_key, publication.observation.encode()
            ):
                self._check_existing(publication.observation_key, observation)
            self._index(observation)
        except StoreUnavailable:
            return False
        self.spool.remove(publication)
        return True

    def _check_existing(self, key: str, observation: Observation) -> None:
        """A key already written must hold this very generation, or nothing is lost quietly."""
        existing = Observation.model_validate_json(self.store.get(key) or b"{}")
        if existing.lineage_commit != observation.lineage_commit:
            # The spool keeps this observation until an operator resolves the clash.
            raise ObservationConflict(
                f"{key} already records commit {existing.lineage_commit[:12]}, not "
                f"{observation.lineage_commit[:12]}; the store holds another lineage's "
                "records under this name"
            )

    def _index(self, observation: Observation) -> None:
        """Add the observation's summary to the lineage's index object.

        Two publishers of one lineage (a spool drain beside a live generation) may
        rewrite the index at once and one may lose the other's entry. So the write is
        read back until it holds this entry, and every write first fills gaps below
        this generation from the write-once observation objects: an entry lost once
        is restored by the next publication.
        """
        key = index_key(observation.lineage)
        entry = IndexEntry.of(observation)
        for _ in range(INDEX_ATTEMPTS):
            index = self._read_index(key, observation.lineage)
            for missing in self._gaps(index, observation.generation):
                index = index.with_entry(missing)
            self.store.put(key, index.with_entry(entry).model_dump_json().encode())
            if entry in self._read_index(key, observation.lineage).generations:
                return

    def _read_index(self, key: str, lineage: str) -> LineageIndex:
        raw = self.store.get(key)
        return LineageIndex.model_validate_json(raw) if raw else LineageIndex(lineage=lineage)

    def _gaps(self, index: LineageIndex, below: int) -> Iterator[IndexEntry]:
        """Entries of stored observations that the index lacks (a bounded number per call)."""
        known = {e.generation for e in index.generations}
        absent = [n for n in range(below - 1, 0, -1) if n not in known][:INDEX_REPAIRS]
        for generation in absent:
            raw = self.store.get(generation_key(index.lineage, generation))
            if raw is not None:
                yield IndexEntry.of(Observation.model_validate_json(raw))

    def _judge(
        self,
        result: SandboxResult,
        physics: Physics,
        scratch: Path,
        parent: str,
        tree: Mapping[str, Entry],
    ) -> Verdict:
        """What the life amounts to: a death, or the organism's tree through the decoder."""
        death = result.death()
        rejection = "result archive exceeds the cap" if death == "decoder_rejection" else None
        if death is None:
            if result.archive is None:
                raise RuntimeError("sandbox reported success without an archive")
            try:
                decoded = decode_archive(
                    result.archive, scratch / "tree", DecodeLimits.from_physics(physics)
                )
            except DecoderRejection as exc:
                death, rejection = "decoder_rejection", str(exc)
            else:
                return self._published(decoded, scratch / "tree", tree)
        return Verdict(death, rejection, self._rolled_back(parent, tree), "", 0, 0)

    def _rolled_back(self, parent: str, tree: Mapping[str, Entry]) -> dict[str, Entry]:
        """The parent's tree with organism.el one body back: nothing the dead life wrote.

        The body is always written as a regular 100644 file, whatever the parent holds at
        organism.el: a symlink, a directory (its files go), an executable or nothing, as
        lineages recorded before the decoder refused such results may. Keeping the
        parent's mode would store the body as a symlink's target. ``body_before`` gives
        the last body that was a regular file, else the seed's, so a death never leaves
        a lineage whose every life dies for want of a loadable body.
        """
        entries = {p: e for p, e in tree.items() if p != JOURNAL_PATH}
        previous = self.cache.body_before(parent, ORGANISM_PATH, journal.DEATH_SUBJECT)
        # None only for a root without a regular organism.el, which init never makes.
        if previous is not None:
            entries = {p: e for p, e in entries.items() if p.partition("/")[0] != ORGANISM_PATH}
            entries[ORGANISM_PATH] = Entry("100644", self.cache.hash_bytes(previous))
        return entries

    def _published(
        self, decoded: list[TreeEntry], root: Path, tree: Mapping[str, Entry]
    ) -> Verdict:
        """The organism's decoded tree plus the kernel's own files, compared with the parent."""
        files = [e for e in decoded if e.kind == "file"]
        shas = self.cache.hash_files([root / e.path for e in files])
        made: dict[str, Entry] = {
            e.path: Entry("100755" if e.executable else "100644", sha)
            for e, sha in zip(files, shas, strict=True)
        }
        for e in decoded:
            if e.kind == "symlink" and e.target is not None:
                made[e.path] = Entry("120000", self.cache.hash_bytes(e.target.encode()))
        before = {p: e for p, e in tree.items() if p not in KERNEL_OWNED}
        changed = sorted(p for p in before.keys() | made.keys() if before.get(p) != made.get(p))
        kernel_kept = {p: e for p, e in tree.items() if p in KERNEL_OWNED and p != JOURNAL_PATH}
        entries = {**made, **kernel_kept}
        sizes = (sum(e.size for e in files), len(decoded))
        if not changed:
            return Verdict("no-change", None, entries, "", *sizes)
        delta = None
        if ORGANISM_PATH in changed:
            old, new = before.get(ORGANISM_PATH), made.get(ORGANISM_PATH)
            delta = self.cache.numstat(old.sha if old else None, new.sha if new else None)
        return Verdict(
            "changed", None, entries, journal.changed_summary(delta, len(changed)), *sizes
        )

    def _kernel_files(
        self,
        meta: LineageMetadata,
        physics: Physics,
        generation: int,
        parent: str,
        tree: Mapping[str, Entry],
        blobs: Mapping[str, bytes],
    ) -> dict[str, bytes]:
        """What the life finds in /kernel, besides the model socket and the staging shell."""
        journal_sha = tree[JOURNAL_PATH].sha if JOURNAL_PATH in tree else None
        lineage = {
            "name": meta.name,
            "generation": generation,
            "parent_commit": parent,
            "created_at": meta.created_at.isoformat(),
            "seed_sha256": meta.seed_sha256,
        }
        return {
            "base.tar": _base_tar(tree, blobs),
            "journal.md": blobs.get(journal_sha, b"") if journal_sha else b"",
            "lineage.json": json.dumps(lineage, indent=2).encode(),
            "capabilities.json": json.dumps(capabilities(physics), indent=2, default=str).encode(),
            **self.instrument.scripts,
        }


def _base_tar(tree: Mapping[str, Entry], blobs: Mapping[str, bytes]) -> bytes:
    """The committed tree minus kernel-owned files, as a tar built here (no git attributes)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for path, entry in sorted(tree.items()):
            if path in KERNEL_OWNED:
                continue
            info = tarfile.TarInfo(path)
            data = blobs[entry.sha]
            if entry.mode == "120000":
                info.type = tarfile.SYMTYPE
                info.linkname = data.decode("utf-8", errors="surrogateescape")
            elif entry.mode in ("100644", "100755"):
                info.size = len(data)
                info.mode = 0o755 if entry.mode == "100755" else 0o644
            else:
                continue
            archive.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buffer.getvalue()


def _shell_status(result: SandboxResult) -> int:
    """Exit status as a shell reports it: 128+N for a death by signal N."""
    if result.exit_status is not None:
        return result.exit_status
    return 128 + (result.signal or 9)


def _first_line(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout
    except OSError:
        return "unknown"
    return out.splitlines()[0].strip() if out else "unknown"
