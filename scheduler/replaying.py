"""Replaying a lineage's generations and telling of each: what ``replay`` and
``verify --replay`` share.

Owns choosing the generations (by number on the branch, within a range), refusing a
request whose every record is of another instrument, replaying each generation
through ``worker.instrument.replay`` with its report kept as the generation's latest
replay, one line per generation as it ends, and the summary. The pipeline it is given
is built by the command (``build_pipeline(cache_role="replay")``); nothing else is
written.

Trusts the pipeline and its store; an observation that does not read is a generation
that cannot be replayed, never an error.
"""

from __future__ import annotations

from collections import Counter

from pydantic import ValidationError
from rich.console import Console
from rich.text import Text

from scheduler.output import plain
from worker.instrument.errors import Refusal
from worker.instrument.pipeline import Pipeline
from worker.instrument.records import Observation, ReplayReport
from worker.instrument.replay import generation_commits, keep, replay
from worker.instrument.store import ObservationStore
from worker.instrument.store_keys import generation_key

VERDICT_STYLES = {"reproduced": "green", "diverged": "bold red", "not replayable": "yellow"}


def replay_lineage(
    pipeline: Pipeline, name: str, first: int | None, last: int | None, out: Console
) -> Counter[str]:
    """Replay generations ``first`` to ``last`` of ``name`` (None: every one); the verdicts."""
    commits = generation_commits(pipeline.cache, pipeline.head(name))
    numbers = sorted(
        n for n in commits if first is None or (last is not None and first <= n <= last)
    )
    asked = name if first is None else f"{name}@{first}" + (f"..{last}" if last != first else "")
    if not numbers:
        raise Refusal(f"{asked}: lineage {name} has no such generation (it has {len(commits)})")
    records = {number: _observation(pipeline.store, name, number) for number in numbers}
    here = pipeline.instrument.fingerprint
    recorded = [o for o in records.values() if o is not None]
    foreign = {o.provenance.instrument_fingerprint for o in recorded} - {here}
    if recorded and all(o.provenance.instrument_fingerprint != here for o in recorded):
        raise Refusal(
            f"{asked} was recorded under instrument {', '.join(sorted(foreign))}, not this "
            f"one ({here[:12]}); replay it with the instrument that made the record"
        )
    verdicts: Counter[str] = Counter()
    for number in numbers:
        observation = records[number]
        if observation is None:
            out.print(f"{name} gen {number}: not replayable — no observation of it reads")
            verdicts["not replayable"] += 1
            continue
        out.print(f"{name} gen {number}: replaying ({observation.outcome})", highlight=False)
        report = replay(pipeline, observation, commits[number])
        keep(pipeline.store, report)
        verdicts[report.verdict] += 1
        _show(report, out)
    out.print(
        f"{name}: {verdicts['reproduced']} reproduced, {verdicts['diverged']} diverged, "
        f"{verdicts['not replayable']} not replayable",
        highlight=False,
    )
    return verdicts


def _observation(store: ObservationStore, name: str, number: int) -> Observation | None:
    """The generation's stored observation; None without one, one that does not read, or
    one of another generation (whose report would land under that one's key)."""
    raw = store.get(generation_key(name, number))
    try:
        observation = Observation.model_validate_json(raw) if raw is not None else None
    except ValidationError:
        return None
    if observation is None or (observation.lineage, observation.generation) != (name, number):
        return None
    return observation


def _show(report: ReplayReport, out: Console) -> None:
    line = Text.assemble(
        f"{report.lineage} gen {report.generation}: ",
        (report.verdict, VERDICT_STYLES[report.verdict]),
        f" ({report.duration_seconds:.1f} s)",
    )
    if report.reason:
        line.append(" — ")
        line.append(plain(report.reason))
    out.print(line, highlight=False)
    if report.likely_cause:
        out.print(plain(f"  likely cause: {report.likely_cause}"), highlight=False)
    if report.verdict == "diverged" and report.detail:
        out.print(plain(report.detail), highlight=False)
