"""One generation, end to end: the trusted path from a job to a commit plus observation.

Owns the generation contract (docs/design.md), one named phase each: plan (fetch,
validate the lineage root, number the generation), live (prepare the private
kernel directory, serve the model socket, run the life under the resource
ceiling), judge (classify the outcome, decode the result or roll back), commit
(journal entry in fixed words), observe (the trusted record) and publish (spool,
compare-and-swap push, write-once observation). The Celery task and
``schedule-lineage run --local`` both call ``Pipeline.run``; nothing else writes to a
lineage. ``Pipeline.relive``, the replay's entry, plans, lives and judges a generation
again and writes nothing. Its length (over 500 lines) is that one job's: the phases
share one ``Plan``, and much of it is the reasons for the rollback and the judging,
kept beside the code they explain. The host's facts
and the sandbox are given to it (``worker.instrument.host``), so it probes nothing.

Trusts: the instrument it was built with, its settings, the shared repository and
the observation store. Trusts nothing the organism produced: the result archive
goes through the decoder, stderr and model traffic are carried as capped data.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import NamedTuple

from worker.instrument import growth, index, journal, syscall_filter
from worker.instrument.decoder import DecodeLimits, DecoderRejection, TreeEntry, decode_archive
from worker.instrument.errors import Refusal, StaleJob
from worker.instrument.fingerprint import Instrument
from worker.instrument.gitrepo import Entry, LineageCache
from worker.instrument.host import HostFacts, Sandbox
from worker.instrument.job import GenerationJob, GenerationReport
from worker.instrument.lineage import LineageMetadata, check_continuable, check_name, root_metadata
from worker.instrument.model.capabilities import capabilities
from worker.instrument.model.prices import Prices
from worker.instrument.model.providers import GenerationContext, Provider, make_provider
from worker.instrument.model.retry import RetryPolicy
from worker.instrument.model.server import ModelSocket
from worker.instrument.model.throttle import LocalThrottle, Throttle
from worker.instrument.names import JOURNAL_PATH, KERNEL_OWNED, ORGANISM_PATH
from worker.instrument.observation_bound import bounded
from worker.instrument.physics import Physics
from worker.instrument.records import (
    ModelCall,
    ModelFailure,
    Observation,
    Outcome,
    Provenance,
    cap_stderr,
)
from worker.instrument.sandbox import SandboxResult, kernel_directory
from worker.instrument.settings import InstrumentSettings
from worker.instrument.spool import Publication, Spool
from worker.instrument.store import ObservationStore, StoreUnavailable
from worker.instrument.store_keys import generation_key

# What names the provider of a job: ``make_provider``, or a stand-in's in a test.
ProviderFactory = Callable[[str, str | None, InstrumentSettings, Prices | None], Provider]
# Two: ``run --local`` of several lineages runs each in turn, and a worker's process
# rarely meets the same lineage twice in a row; each kept journal costs its size.
JOURNALS_KEPT = 2


class ObservationConflict(RuntimeError):
    """The write-once key of an observation holds a different generation's record."""


class Plan(NamedTuple):
    """A validated job: the generation it will be and everything its life starts from."""

    job: GenerationJob
    parent: str
    meta: LineageMetadata
    generation: int
    physics: Physics
    narrowed: bool
    tree: Mapping[str, Entry]
    blobs: Mapping[str, bytes]
    provider: Provider


class Life(NamedTuple):
    """What one life did, as the worker saw it and as the model socket audited it."""

    result: SandboxResult
    calls: list[ModelCall]
    calls_over_limit: int
    spent_usd: Decimal
    started: datetime
    finished: datetime
    model_failure: ModelFailure | None


class Verdict(NamedTuple):
    """What a life amounts to: its outcome and the tree to commit (journal still to add)."""

    outcome: Outcome
    rejection: str | None
    entries: dict[str, Entry]
    summary: str
    published_bytes: int
    published_files: int
    # What the organism's tree added to the shared repository, and the lineage's total
    # after it (``growth``).
    repo_bytes: int = 0
    lineage_repo_bytes: int = 0


class Relived(NamedTuple):
    """A life lived again (``Pipeline.relive``): its plan, the life and its judgement."""

    plan: Plan
    life: Life
    verdict: Verdict


class Pipeline:
    """The per-process generation machinery; build once, run many jobs.

    It probes nothing and starts no process of its own: the host's facts and the
    sandbox come in (``worker.instrument.host``), found and built where the pipeline is
    (``worker.fleet.assembly.build_pipeline``).
    """

    def __init__(
        self,
        *,
        settings: InstrumentSettings,
        instrument: Instrument,
        instrument_commit: str,
        host: HostFacts,
        sandbox: Sandbox,
        store: ObservationStore,
        cache: LineageCache,
        spool: Spool,
        throttle: Throttle | None = None,
        providers: ProviderFactory = make_provider,
    ) -> None:
        """throttle is the cap on calls to each provider that every life's model socket
        waits for: the fleet's shared one, or by default none. providers makes a job's
        provider from its name, model and prices."""
        self.settings = settings
        self.instrument = instrument
        self.instrument_commit = instrument_commit
        self.host = host
        self.sandbox = sandbox
        self.providers = providers
        self.store = store
        self.cache = cache
        self.spool = spool
        self.throttle: Throttle = throttle or LocalThrottle()
        self.retry = RetryPolicy(stall_seconds=settings.model_stall_seconds)
        # The journal this process last committed for each of its last few lineages, by
        # blob: a lineage's next generation here reads it from memory instead of
        # inflating and re-hashing the whole journal (5 ms at 10,000 generations).
        self._journals: OrderedDict[str, tuple[str, bytes]] = OrderedDict()

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
        plan = self._plan(job)
        life = self._live(plan)
        with tempfile.TemporaryDirectory(prefix="ouroboros-publish-") as scratch:
            verdict = self._judge(life.result, plan, Path(scratch))
        commit = self._commit(plan, life, verdict)
        observation = self._observation(plan, life, verdict, commit, task_id, attempt)
        stored = self._publish(plan, commit, observation)
        return GenerationReport(
            lineage=job.lineage,
            generation=plan.generation,
            outcome=verdict.outcome,
            parent=plan.parent,
            commit=commit,
            spent_usd=life.spent_usd,
            run_budget_exhausted=observation.run_budget_exhausted,
            observation_stored=stored,
            model_failure=life.model_failure,
        )

    def _plan(self, job: GenerationJob) -> Plan:
        """Fetch, refuse a stale job or foreign physics, and number the generation."""
        parent = self.head(job.lineage)
        if parent != job.expected_commit:
            raise StaleJob(
                f"{job.lineage} is at {parent[:12]}, not {job.expected_commit[:12]}; re-plan"
            )
        meta = root_metadata(self.cache, parent, job.lineage)
        check_continuable(meta, self.instrument, self.instrument_commit)
        provider = self.providers(job.provider, job.model, self.settings, job.prices)
        return self._plan_on(job, parent, meta, provider)

    def relive(self, job: GenerationJob, parent: str, provider: Provider) -> Relived:
        """Live the generation after ``parent`` again and judge it, committing nothing.

        The replay's entry (``worker.instrument.replay``): the same plan, life and
        judgement as ``run``, on any commit of the lineage and with the provider given,
        but no commit, observation, spool or push. The caller checks the instrument.
        """
        check_name(job.lineage)
        self.cache.forget_unwritten()
        meta = root_metadata(self.cache, parent, job.lineage)
        plan = self._plan_on(job, parent, meta, provider)
        life = self._live(plan)
        with tempfile.TemporaryDirectory(prefix="ouroboros-replay-") as scratch:
            verdict = self._judge(life.result, plan, Path(scratch))
        return Relived(plan, life, verdict)

    def _plan_on(
        self, job: GenerationJob, parent: str, meta: LineageMetadata, provider: Provider
    ) -> Plan:
        """The plan of the generation after ``parent``: its number, tree and physics."""
        generation = 1 + self.cache.history(job.lineage, parent).generations
        tree = self.cache.tree(parent)
        blobs: dict[str, bytes] = {}
        kept = self._journals.get(job.lineage)
        if kept and JOURNAL_PATH in tree and tree[JOURNAL_PATH].sha == kept[0]:
            blobs[kept[0]] = kept[1]
        blobs |= self.cache.cat_blobs(e.sha for e in tree.values() if e.sha not in blobs)
        physics = meta.physics
        narrowed = job.budget_usd is not None and job.budget_usd < physics.budget_usd
        if narrowed:
            # A run's remaining budget narrows, never widens, the pinned per-generation one.
            physics = physics.model_copy(update={"budget_usd": job.budget_usd})
        return Plan(job, parent, meta, generation, physics, narrowed, tree, blobs, provider)

    def _live(self, plan: Plan) -> Life:
        """Prepare the kernel directory, serve the model socket, and live the life in it."""
        tree, blobs = plan.tree, plan.blobs
        source = blobs.get(tree[ORGANISM_PATH].sha, b"") if ORGANISM_PATH in tree else b""
        context = GenerationContext(
            lineage=plan.job.lineage,
            generation=plan.generation,
            organism_source=source.decode("utf-8", errors="replace"),
        )
        digest = hashlib.sha256(plan.parent.encode()).hexdigest()[:8]
        label = f"{plan.job.lineage}-{plan.generation}-{digest}"
        started = datetime.now(UTC)
        with (
            self.host.identities.hold() as identity,
            kernel_directory(self._kernel_files(plan), identity) as kernel,
        ):
            owner = (identity.uid, identity.gid) if identity.drop else None
            with ModelSocket(
                kernel / "model.sock",
                plan.provider,
                plan.physics,
                context,
                owner=owner,
                throttle=self.throttle,
                retry=self.retry,
            ) as model:
                result = self.sandbox.live(kernel, plan.physics, label, identity)
            return Life(
                result,
                model.calls,
                model.calls_over_limit,
                model.spent_usd,
                started,
                datetime.now(UTC),
                model.model_failure,
            )

    def _commit(self, plan: Plan, life: Life, verdict: Verdict) -> str:
        """The generation's commit: the verdict's tree plus its journal entry, in fixed words.

        "Model unavailable" is a mark beside the outcome, not an outcome of its own: the
        outcome is what the organism did with the life it had (it may still have changed
        itself, or died, without a model), the mark says the model never answered it.
        Both are true at once, the contract's outcomes and every reader of them stay as
        they are, and a reader that knows no mark still reads a sound subject.
        """
        generation, finished, tree = plan.generation, life.finished, plan.tree
        failure = life.model_failure
        mark = (
            journal.unavailable_mark(failure.failed_calls)
            if failure is not None and failure.model_unavailable
            else ""
        )
        if verdict.outcome == "changed":
            subject = journal.subject_changed(generation, verdict.summary, mark)
            entry = journal.entry_changed(generation, verdict.summary, finished, mark)
        elif verdict.outcome == "no-change":
            subject = journal.subject_no_change(generation, mark)
            entry = journal.entry_no_change(generation, finished, mark)
        else:
            exit_code = _shell_status(life.result)
            subject = journal.subject_died(generation, exit_code, mark)
            # The journal wants the last lines the organism wrote, which a cut record lacks.
            _, truncated = cap_stderr(life.result.stderr)
            last = life.result.stderr_tail if truncated else life.result.stderr
            # Only this death's reason is the kernel's own words, not the organism's.
            reason = verdict.rejection if verdict.outcome == "footprint_exceeded" else None
            entry = journal.entry_died(
                generation,
                exit_code,
                last.decode("utf-8", errors="replace"),
                finished,
                mark,
                reason=reason,
            )
        journal_sha = tree[JOURNAL_PATH].sha if JOURNAL_PATH in tree else None
        before = plan.blobs.get(journal_sha, b"") if journal_sha else b""
        text = journal.append(before, entry)
        sha = self.cache.hash_bytes(text)
        self._journals[plan.job.lineage] = (sha, text)
        self._journals.move_to_end(plan.job.lineage)
        if len(self._journals) > JOURNALS_KEPT:
            self._journals.popitem(last=False)
        entries = dict(verdict.entries)
        entries[JOURNAL_PATH] = Entry("100644", sha)
        trailer = growth.trailer(verdict.lineage_repo_bytes)
        return self.cache.commit(plan.parent, entries, f"{subject}\n\n{trailer}")

    def _observation(
        self,
        plan: Plan,
        life: Life,
        verdict: Verdict,
        commit: str,
        task_id: str | None,
        attempt: int,
    ) -> Observation:
        """The trusted record of the generation: everything the worker saw and spent,
        within ``observation_bound.OBSERVATION_MAX_BYTES``."""
        result, job = life.result, plan.job
        stderr_text, truncated = cap_stderr(result.stderr)
        queue_wait = (life.started - job.enqueued_at).total_seconds() if job.enqueued_at else None
        observation = Observation(
            lineage=job.lineage,
            generation=plan.generation,
            parent_commit=plan.parent,
            lineage_commit=commit,
            started_at=life.started,
            finished_at=life.finished,
            duration_seconds=result.duration_seconds,
            outcome=verdict.outcome,
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
            repo_bytes=verdict.repo_bytes,
            lineage_repo_bytes=verdict.lineage_repo_bytes,
            provider=plan.provider.name,
            model=plan.provider.model,
            constraints=plan.physics,
            model_calls=life.calls,
            model_calls_over_limit=life.calls_over_limit,
            spent_usd=life.spent_usd,
            # The run, not the pinned physics, ran out: nothing more can be bought for it.
            run_budget_exhausted=plan.narrowed and any(c.status == 402 for c in life.calls),
            stderr=stderr_text,
            stderr_truncated=truncated,
            run_id=job.run_id,
            model_failure=life.model_failure,
            provenance=Provenance(
                worker_host=self.host.name,
                fleet_version=self.instrument.version,
                instrument_fingerprint=self.instrument.fingerprint,
                ceiling_driver=self.host.ceiling_driver,
                bwrap_version=self.host.bwrap_version,
                emacs_version=self.host.emacs_version,
                syscall_filter=syscall_filter.DIGEST,
                task_id=task_id,
                attempt=attempt,
                queue_wait_seconds=queue_wait,
            ),
        )
        return bounded(observation)

    def _publish(self, plan: Plan, commit: str, observation: Observation) -> bool:
        """Spool the publication, then push and record it; whether the observation landed."""
        publication = Publication(
            lineage=plan.job.lineage,
            generation=plan.generation,
            parent=plan.parent,
            commit=commit,
            stage="push",
            observation_key=generation_key(plan.job.lineage, plan.generation),
            observation=observation.model_dump_json(by_alias=True, indent=2),
        )
        self.spool.save(publication)
        return self._finish(publication)

    def drain(self, lineage: str | None = None) -> int:
        """Finish every pending publication (of one lineage); how many remain pending."""
        self.spool.sweep_orphans()
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
            index.add(self.store, observation)
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

    def _judge(self, result: SandboxResult, plan: Plan, scratch: Path) -> Verdict:
        """What the life amounts to: a death, or the organism's tree through the decoder.

        A tree the decoder accepts must also unpack into the next life's /work, or every
        life after it would die before its first form. The decoder counts bytes, a tmpfs
        whole pages, and a file the organism wrote sparse unpacks dense, so a result whose
        ``Footprint`` does not fit the physics is a ``decoder_rejection`` as well. A tree
        whose new objects would take the generation or the lineage over its footprint
        budget on the shared repository (``growth``) dies ``footprint_exceeded``. Every
        death is rolled back (``_rolled_back``).
        """
        physics = plan.physics
        before = growth.recorded_total(self.cache.repo, plan.parent)
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
                outcome = self._fitted(plan, decoded, scratch / "tree", before)
                if isinstance(outcome, Verdict):
                    return outcome
                death, rejection = outcome
        # The stage's status for a tree it cannot unpack (an organism may choose it too).
        unpack_failed = death == "process_exit" and result.exit_status == 70
        rolled_back = self._rolled_back(plan, unpack_failed)
        return Verdict(death, rejection, rolled_back, "", 0, 0, 0, before)

    def _fitted(
        self, plan: Plan, decoded: list[TreeEntry], root: Path, before: int
    ) -> Verdict | tuple[Outcome, str]:
        """The decoded tree's verdict, or the death it dies if it does not fit the physics.

        The footprint budgets are checked before any of its objects is written, so a tree
        over either adds nothing to the shared repository.
        """
        physics = plan.physics
        added = growth.new_bytes(self.cache.repo, growth.tree_objects(decoded, root))
        if added > physics.generation_repo_bytes:
            return "footprint_exceeded", (
                f"the tree would add {added} bytes to the shared repository, more than "
                f"the generation_repo_bytes budget {physics.generation_repo_bytes}"
            )
        if before + added > physics.lineage_repo_bytes:
            return "footprint_exceeded", (
                f"the tree would bring what the lineage added to the shared repository to "
                f"{before + added} bytes, more than the lineage_repo_bytes budget "
                f"{physics.lineage_repo_bytes}"
            )
        verdict = self._published(decoded, root, plan.tree)._replace(
            repo_bytes=added, lineage_repo_bytes=before + added
        )
        room = self.cache.footprint(
            {p: e for p, e in verdict.entries.items() if p not in KERNEL_OWNED}
        ).room
        if room <= physics.work_bytes:
            return verdict
        return "decoder_rejection", (
            f"the tree would take {room} bytes of /work once unpacked (every file in "
            "whole pages, a sparse file dense), more than the work_bytes limit "
            f"{physics.work_bytes}"
        )

    def _rolled_back(self, plan: Plan, unpack_failed: bool) -> dict[str, Entry]:
        """The tree a death leaves: organism.el one body back, nothing the dead life wrote,
        and a tree the next life can unpack.

        The body is the one organism.el had before the last change to it that was not
        itself a rollback (``LineageCache.last_body``), so a death right after a rollback
        never resurrects the body that died before. It is always written as a regular
        100644 file, whatever the parent holds at organism.el: a symlink, a directory (its
        files go), an executable or nothing, as lineages recorded before the decoder
        refused such results may. Keeping the parent's mode would store the body as a
        symlink's target. ``last_body`` gives the last body that was a regular file, else
        the seed's, so a death never leaves a lineage whose every life dies for want of a
        loadable body.

        The tree around it is the first of these that fits the pinned physics
        (``Footprint.fits``: at most ``work_files`` files and symlinks, at most
        ``work_bytes`` bytes of files, and at most ``work_bytes`` of tmpfs with every file
        rounded up to whole pages and a page per directory and symlink as margin):

        1. the parent's files with the body put back (the ordinary case);
        2. the files of the tree that body last lived in (``Body.lived_in``, the tree a
           life started from before it replaced the body), with the body;
        3. the seed's tree, the root commit's files and body: the last resort, taken as
           it is.

        So a body that the parent's other files leave no room for (a 40 MB body put back
        beside a 40 MB file in a 64 MB /work) comes back with the files it lived with,
        not with files it cannot be unpacked beside. A life that exits 70 is one whose
        stage could not unpack the tree it was given (or an organism that chose that
        status: the kernel cannot tell them apart), so then a tree with exactly the files
        it was given is passed over too: a tree that cannot be unpacked, whatever the
        reason, costs at most three deaths before the seed's tree, never every life
        after it. The kernel's own files are the parent's: its ``.ouroboros-lineage.json``
        and its journal, to which the commit adds this death's entry.
        """
        tree, physics = plan.tree, plan.physics
        kernel = {p: e for p, e in tree.items() if p in KERNEL_OWNED and p != JOURNAL_PATH}
        given = {p: e for p, e in tree.items() if p not in KERNEL_OWNED}
        body = self.cache.last_body(plan.parent, ORGANISM_PATH, journal.DEATH_SUBJECT)
        if body is None:
            # Only a root without a regular organism.el, which init never makes.
            return {**given, **kernel}

        def with_body(files: Mapping[str, Entry], sha: str) -> dict[str, Entry]:
            kept = {
                p: e
                for p, e in files.items()
                if p not in KERNEL_OWNED and p.partition("/")[0] != ORGANISM_PATH
            }
            return {**kept, ORGANISM_PATH: Entry("100644", sha)}

        sha, lived_in = body.sha, body.lived_in

        def candidates() -> Iterator[dict[str, Entry]]:
            yield with_body(given, sha)
            yield with_body(self.cache.tree(lived_in), sha)

        for files in candidates():
            if unpack_failed and files == given:
                continue
            if self.cache.footprint(files).fits(physics.work_bytes, physics.work_files):
                return {**files, **kernel}
        seed_tree = self.cache.tree(self.cache.root_of(plan.parent))
        seed = seed_tree.get(ORGANISM_PATH)
        regular = seed.sha if seed is not None and seed.mode in ("100644", "100755") else None
        return {**with_body(seed_tree, regular or sha), **kernel}

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

    def _kernel_files(self, plan: Plan) -> dict[str, bytes]:
        """What the life finds in /kernel, besides the model socket and the staging shell."""
        meta, tree, blobs = plan.meta, plan.tree, plan.blobs
        journal_sha = tree[JOURNAL_PATH].sha if JOURNAL_PATH in tree else None
        lineage = {
            "name": meta.name,
            "generation": plan.generation,
            "parent_commit": plan.parent,
            "created_at": meta.created_at.isoformat(),
            "seed_sha256": meta.seed_sha256,
        }
        return {
            "base.tar": _base_tar(tree, blobs),
            "journal.md": blobs.get(journal_sha, b"") if journal_sha else b"",
            "lineage.json": json.dumps(lineage, indent=2).encode(),
            "capabilities.json": json.dumps(
                capabilities(plan.physics), indent=2, default=str
            ).encode(),
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
