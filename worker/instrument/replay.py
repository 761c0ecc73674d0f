"""Replay: a generation lived again from its observation, and judged against it.

Owns the replay of one generation (``replay``): whether its record can be replayed
at all, the life lived again through ``Pipeline.relive`` (the same plan, sandbox,
physics and judgement as the recorded life, on the parent's tree and kernel files,
with a ``ReplayProvider`` answering each model call from the record), and the
comparison that ends in a ``ReplayReport``: ``reproduced``, ``diverged`` (the first
difference named) or ``not replayable`` (the reason). Also owns reading the record
(``recorded``), checking that a replay job names a generation of the branch
(``replay_problem``) and keeping the report under its own key beside the observation
(``keep``), the only write of a replay.

What is compared, in order: the physics (the record's against the lineage's pinned
ones, narrowed by the recorded budget), the model calls (the replay provider's divergences,
then each call's prompt sha256 and status), the outcome, the exit status (not for a
wall or memory kill, whose moment is the host's timing), and the tree the life
leaves, the journal excepted (its entry carries the time), as trees and never as
commit ids. A death's tree is compared too: the rollback is the kernel's and must
come out the same.

Trusts the pipeline it is given and the lineage's repository. Trusts the stored
observation only as a claim to be checked: a response altered in the store fails
its sha256 and is a divergence, never an answer.
"""

from __future__ import annotations

import difflib
import re
import time
from collections.abc import Mapping
from datetime import UTC, datetime

import pygit2
from pydantic import ValidationError

from worker.instrument.errors import Refusal
from worker.instrument.gitrepo import Entry, LineageCache
from worker.instrument.job import GenerationJob, ReplayJob
from worker.instrument.model.catalogue import model_of
from worker.instrument.model.prices import resolve_prices
from worker.instrument.model.replayed import ReplayProvider, reached_vendor
from worker.instrument.names import JOURNAL_PATH, generation_number
from worker.instrument.pipeline import Pipeline, Relived
from worker.instrument.records import (
    REPLAY_DETAIL_CHARS,
    ModelCall,
    Observation,
    ReplayReport,
    ReplayVerdict,
)
from worker.instrument.store import ObservationStore
from worker.instrument.store_keys import generation_key, replay_key

# Deaths whose moment is the host's timing, matched by outcome alone.
TIMED_DEATHS = frozenset({"wall_timeout", "cgroup_oom"})
DIFF_LINES = 20
# A date or a time of day as programs print them, or seconds since 1970 in this century.
_CLOCK = re.compile(
    r"(?<!\d)(?:(?:19|20)\d\d-[01]\d-[0-3]\d|[0-2]\d:[0-5]\d:[0-5]\d|1[5-9]\d{8})(?!\d)"
)


class Difference(Exception):
    """The first difference between the replayed life and its record."""

    def __init__(self, reason: str, detail: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


def replayable(observation: Observation, fingerprint: str) -> str | None:
    """Why the record cannot be replayed by the instrument ``fingerprint``, or None."""
    recorded = observation.provenance.instrument_fingerprint
    if recorded != fingerprint:
        return (
            f"recorded under instrument {recorded}; replay it with that instrument "
            f"(this one is {fingerprint[:12]})"
        )
    for call in observation.model_calls:
        if call.status == 200 and not call.attempts:
            return (
                f"call {call.index}: the record is older than the attempts of its calls, "
                "so which calls reached the model is unknown"
            )
        if call.status == 200 and call.text_omitted and reached_vendor(call):
            return (
                f"call {call.index}: its text was omitted over the audit cap, so its "
                "answer cannot be given again"
            )
    return None


def replay(pipeline: Pipeline, observation: Observation, commit: str) -> ReplayReport:
    """Live ``observation``'s generation again on the parent of ``commit`` (its commit on
    the lineage's branch) and judge it against the record and that commit's tree."""
    started, clock = datetime.now(UTC), time.monotonic()

    def report(
        verdict: ReplayVerdict,
        reason: str | None = None,
        relived: Relived | None = None,
        detail: str | None = None,
    ) -> ReplayReport:
        stderr = relived.life.result.stderr.decode("utf-8", errors="replace") if relived else ""
        return ReplayReport(
            lineage=observation.lineage,
            generation=observation.generation,
            lineage_commit=commit,
            verdict=verdict,
            reason=reason,
            detail=_short(
                detail or (stderr[-REPLAY_DETAIL_CHARS:] if verdict == "diverged" else None)
            ),
            likely_cause=_cause(detail, stderr) if verdict == "diverged" else None,
            recorded_outcome=observation.outcome,
            replayed_outcome=relived.verdict.outcome if relived else None,
            instrument_fingerprint=pipeline.instrument.fingerprint,
            replayed_at=started,
            duration_seconds=time.monotonic() - clock,
        )

    reason = replayable(observation, pipeline.instrument.fingerprint)
    if reason is not None:
        return report("not replayable", reason)
    parents = pipeline.cache.repo[commit].peel(pygit2.Commit).parent_ids
    if not parents:
        return report("not replayable", f"its commit {commit[:12]} has no parent")
    parent = str(parents[0])
    try:
        job = GenerationJob(
            lineage=observation.lineage,
            expected_commit=parent,
            provider=observation.provider,
            model=observation.model,
            # The budget the life lived under, as a run had narrowed it.
            budget_usd=observation.constraints.budget_usd,
        )
    except ValidationError:
        return report(
            "not replayable", f"its provider {observation.provider!r} is none this instrument knows"
        )
    try:
        model = model_of(observation.provider, observation.model)
        prices = resolve_prices(observation.provider, model, pipeline.settings)
    except Refusal as exc:
        return report("not replayable", f"the prices its calls were charged at: {exc}")
    provider = ReplayProvider(model, prices, observation.model_calls)
    relived = pipeline.relive(job, parent, provider)
    try:
        _compare(pipeline, observation, commit, relived, provider)
    except Difference as difference:
        return report("diverged", difference.reason, relived, difference.detail)
    return report("reproduced", None, relived)


def generation_commits(cache: LineageCache, head: str) -> dict[int, str]:
    """The commit of every generation on the branch at ``head``, by number (its subject's)."""
    found: dict[int, str] = {}
    for commit in cache.repo.walk(head, pygit2.enums.SortMode.TOPOLOGICAL):
        number = generation_number(str(commit.message).split("\n", 1)[0])
        if number is not None:
            found.setdefault(number, str(commit.id))
    return found


def replay_problem(cache: LineageCache, head: str, job: ReplayJob) -> str | None:
    """Why ``job`` names no generation of the branch at ``head``, or None: its commit must
    be on the branch and be that generation's (a message is anyone's)."""
    try:
        on_branch = cache.is_ancestor(job.commit, head)
        subject = str(cache.repo[job.commit].peel(pygit2.Commit).message).split("\n", 1)[0]
    except (KeyError, ValueError, pygit2.GitError):
        return f"commit {job.commit[:12]} is not in the repository"
    if not on_branch:
        return f"commit {job.commit[:12]} is not on the branch of {job.lineage}"
    if generation_number(subject) != job.generation:
        return f"commit {job.commit[:12]} is not generation {job.generation}"
    return None


def recorded(store: ObservationStore, lineage: str, generation: int) -> Observation | None:
    """The generation's stored observation; None without one, one that does not read, or
    one of another generation (whose report would land under that one's key)."""
    raw = store.get(generation_key(lineage, generation))
    try:
        observation = Observation.model_validate_json(raw) if raw is not None else None
    except ValidationError:
        return None
    if observation is None or (observation.lineage, observation.generation) != (
        lineage,
        generation,
    ):
        return None
    return observation


def latest(store: ObservationStore, lineage: str, generation: int) -> ReplayReport | None:
    """The generation's latest replay report, if one reads."""
    raw = store.get(replay_key(lineage, generation))
    try:
        return ReplayReport.model_validate_json(raw) if raw is not None else None
    except ValidationError:
        return None


def keep(store: ObservationStore, report: ReplayReport) -> None:
    """Store the report as the generation's latest replay (overwriting the one before)."""
    key = replay_key(report.lineage, report.generation)
    store.put(key, report.model_dump_json(by_alias=True, indent=2).encode())


def _compare(
    pipeline: Pipeline,
    observation: Observation,
    commit: str,
    relived: Relived,
    provider: ReplayProvider,
) -> None:
    """Raise the first ``Difference`` between the replayed life and the record."""
    if relived.plan.physics != observation.constraints:
        raise Difference("physics: the record's constraints are not the lineage's pinned physics")
    if provider.divergences:
        raise Difference(provider.divergences[0])
    recorded_outcome, outcome = observation.outcome, relived.verdict.outcome
    timed = recorded_outcome in TIMED_DEATHS and outcome == recorded_outcome
    _compare_calls(observation.model_calls, relived.life.calls, prefix_only=timed)
    if outcome != recorded_outcome:
        raise Difference(f"outcome: recorded {recorded_outcome}, replayed {outcome}")
    result = relived.life.result
    if not timed and (result.exit_status, result.signal) != (
        observation.exit_status,
        observation.signal,
    ):
        raise Difference(
            f"exit status: recorded {_status(observation.exit_status, observation.signal)}, "
            f"replayed {_status(result.exit_status, result.signal)}"
        )
    recorded = {p: e for p, e in pipeline.cache.tree(commit).items() if p != JOURNAL_PATH}
    _compare_trees(pipeline, recorded, relived.verdict.entries)


def _compare_calls(
    recorded: list[ModelCall], replayed: list[ModelCall], *, prefix_only: bool
) -> None:
    for before, after in zip(recorded, replayed, strict=False):
        if before.prompt_sha256 != after.prompt_sha256:
            raise Difference(f"call {before.index}: the prompt differs from the recorded one")
        if before.status != after.status:
            raise Difference(
                f"call {before.index}: recorded status {before.status}, replayed {after.status}"
            )
    if prefix_only or len(recorded) == len(replayed):
        return
    if len(replayed) < len(recorded):
        raise Difference(
            f"call {recorded[len(replayed)].index}: the record holds it, the replayed life "
            "never made it"
        )
    raise Difference(
        f"call {replayed[len(recorded)].index}: the replayed life made a call the record "
        "does not hold"
    )


def _compare_trees(
    pipeline: Pipeline, recorded: Mapping[str, Entry], replayed: Mapping[str, Entry]
) -> None:
    differing = sorted(
        p for p in recorded.keys() | replayed.keys() if recorded.get(p) != replayed.get(p)
    )
    if not differing:
        return
    path = differing[0]
    before, after = recorded.get(path), replayed.get(path)
    if before is None or after is None:
        side = "only the replayed life wrote it" if before is None else "the replayed life lacks it"
        raise Difference(f"tree: {path}: {side}")
    if before.mode != after.mode:
        raise Difference(f"tree: {path}: recorded mode {before.mode}, replayed {after.mode}")
    blobs = pipeline.cache.cat_blobs([before.sha, after.sha])
    old = blobs[before.sha].decode("utf-8", errors="replace").splitlines()
    new = blobs[after.sha].decode("utf-8", errors="replace").splitlines()
    diff = list(difflib.unified_diff(old, new, "recorded", "replayed", lineterm="", n=1))
    raise Difference(f"tree: {path} differs", "\n".join(diff[:DIFF_LINES]))


def _cause(detail: str | None, stderr: str) -> str | None:
    """What the organism likely read that differs between lives, where it shows."""
    for text, where in ((detail or "", "the diff"), (stderr, "stderr")):
        if _CLOCK.search(text):
            return f"the clock: {where} shows a date or time"
    return None


def _status(exit_status: int | None, signal: int | None) -> str:
    return f"signal {signal}" if exit_status is None else f"exit {exit_status}"


def _short(text: str | None) -> str | None:
    return text[:REPLAY_DETAIL_CHARS] if text else None
