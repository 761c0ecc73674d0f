"""Replaying a lineage's generations and telling of each: what ``replay``,
``replay --fleet`` and ``verify --replay`` share.

Owns choosing the generations (by number on the branch, within a range), refusing a
request whose every record is of another instrument, and replaying them: here, each
in turn through ``worker.instrument.replay`` with a pipeline the command built
(``build_pipeline(cache_role="replay")``), or on the fleet, one replay task per
generation on the lineage's instrument's queue (``worker.fleet.app.send_replay``), its
progress read from the reports as they land. Each generation gets a line as its
report lands, a terminal a bar of how many have, and the request a summary. Nothing
but the reports is written: no lease, run record or marker on the fleet either.

Trusts the pipeline, the store and the broker; an observation that does not read is
a generation that cannot be replayed, never an error.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import UTC, datetime
from typing import NamedTuple

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from scheduler.output import plain
from worker.fleet.assembly import observation_store
from worker.fleet.homes import Homes
from worker.fleet.settings import Settings
from worker.instrument.errors import Refusal
from worker.instrument.gitrepo import LineageCache
from worker.instrument.job import ReplayJob
from worker.instrument.lineage import check_name, root_metadata
from worker.instrument.pipeline import Pipeline
from worker.instrument.records import Observation, ReplayReport
from worker.instrument.replay import generation_commits, keep, latest, recorded, replay
from worker.instrument.store import ObservationStore

POLL_SECONDS = 0.5
# Pending replays whose reports one poll reads (the lowest numbers).
POLL_WINDOW = 64
STALL_MARGIN_SECONDS = 60
VERDICT_STYLES = {"reproduced": "green", "diverged": "bold red", "not replayable": "yellow"}


class Chosen(NamedTuple):
    """The generations a request names: each one's commit on the branch and its record."""

    numbers: list[int]
    commits: dict[int, str]
    records: dict[int, Observation | None]


def choose(
    cache: LineageCache,
    store: ObservationStore,
    head: str,
    name: str,
    span: tuple[int | None, int | None],
    fingerprint: str,
) -> Chosen:
    """Generations ``span`` (first, last; None, None: every one) of ``name`` at ``head``, or
    a Refusal: none such, or every record made under an instrument other than
    ``fingerprint``."""
    first, last = span
    commits = generation_commits(cache, head)
    numbers = sorted(
        n for n in commits if first is None or (last is not None and first <= n <= last)
    )
    asked = name if first is None else f"{name}@{first}" + (f"..{last}" if last != first else "")
    if not numbers:
        raise Refusal(f"{asked}: lineage {name} has no such generation (it has {len(commits)})")
    records = {number: recorded(store, name, number) for number in numbers}
    readable = [o for o in records.values() if o is not None]
    foreign = {o.provenance.instrument_fingerprint for o in readable} - {fingerprint}
    if readable and all(o.provenance.instrument_fingerprint != fingerprint for o in readable):
        raise Refusal(
            f"{asked} was recorded under instrument {', '.join(sorted(foreign))}, not this "
            f"one ({fingerprint[:12]}); replay it with the instrument that made the record"
        )
    return Chosen(numbers, commits, records)


def replay_lineage(
    pipeline: Pipeline, name: str, span: tuple[int | None, int | None], out: Console
) -> Counter[str]:
    """Replay generations ``span`` of ``name`` here, one after another; the verdicts."""
    head = pipeline.head(name)
    chosen = choose(
        pipeline.cache, pipeline.store, head, name, span, pipeline.instrument.fingerprint
    )
    verdicts: Counter[str] = Counter()
    with _progress(name, len(chosen.numbers), out) as landed:
        for number in chosen.numbers:
            observation = chosen.records[number]
            if observation is None:
                _unreadable(name, number, verdicts, out)
                landed()
                continue
            out.print(f"{name} gen {number}: replaying ({observation.outcome})", highlight=False)
            report = replay(pipeline, observation, chosen.commits[number])
            keep(pipeline.store, report)
            verdicts[report.verdict] += 1
            _show(report, out)
            landed()
    _summary(name, verdicts, out)
    return verdicts


def replay_on_fleet(
    settings: Settings, name: str, span: tuple[int | None, int | None], out: Console
) -> Counter[str]:
    """Replay generations ``span`` of ``name`` as tasks on its instrument's queue, shown as
    their reports land; the verdicts. Refused while no live worker serves the queue."""
    from scheduler.status import FleetClient
    from worker.fleet.app import send_replay
    from worker.fleet.runs import hard_time_limit, queue_of

    fleet = FleetClient(settings)
    store = observation_store(settings)
    cache = Homes(settings, "scheduler", store).home_cache(check_name(name))
    head = cache.fetch(name)
    if head is None:
        raise Refusal(f"no lineage named {name}; create it with schedule-lineage init")
    meta = root_metadata(cache, head, name)
    chosen = choose(cache, store, head, name, span, meta.instrument_fingerprint)
    queue = queue_of(meta)
    waiting = fleet.waiting(meta, fleet.workers({queue}))
    if waiting:
        raise Refusal(waiting)
    started = datetime.now(UTC)
    verdicts: Counter[str] = Counter()
    pending: set[int] = set()
    for number in chosen.numbers:
        if chosen.records[number] is None:
            _unreadable(name, number, verdicts, out)
            continue
        job = ReplayJob(lineage=name, generation=number, commit=chosen.commits[number])
        send_replay(fleet.app, job, queue, hard_time_limit(meta))
        pending.add(number)
    out.print(f"{name}: {len(pending)} replays sent to {queue}", highlight=False)
    # A replay lives one life: when none has landed for longer than a life may take
    # with its publication margin, the workers are not replaying these.
    stall = hard_time_limit(meta) + STALL_MARGIN_SECONDS
    landed_at = time.monotonic()
    with _progress(name, len(pending), out) as landed:
        while pending:
            # The queue hands tasks out in the order sent, so the lowest pending land
            # first: reading only a window of them keeps a poll of thousands of pending
            # replays to a few store reads, and the window slides as they land.
            for number in sorted(pending)[:POLL_WINDOW]:
                report = latest(store, name, number)
                if report is None or report.replayed_at < started:
                    continue
                if report.lineage_commit != chosen.commits[number]:
                    continue
                pending.discard(number)
                landed_at = time.monotonic()
                verdicts[report.verdict] += 1
                _show(report, out)
                landed()
            if pending and time.monotonic() - landed_at > stall:
                out.print(
                    f"{name}: {len(pending)} replays reported nothing for {stall} s; "
                    "see the workers' logs",
                    highlight=False,
                )
                verdicts["unreported"] += len(pending)
                break
            time.sleep(POLL_SECONDS)
    _summary(name, verdicts, out)
    return verdicts


@contextmanager
def _progress(name: str, total: int, out: Console) -> Iterator[Callable[[], None]]:
    """A bar of the generations replayed so far, below the lines of their verdicts, gone
    when the replay ends; on a console that is no terminal it shows nothing, and the
    lines and the summary carry everything. Yields what to call as each one lands."""
    bar = Progress(
        TextColumn(f"replaying {name}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=out,
        transient=True,
    )
    with bar if out.is_terminal else nullcontext():
        task = bar.add_task("replayed", total=total)
        yield lambda: bar.advance(task)


def _unreadable(name: str, number: int, verdicts: Counter[str], out: Console) -> None:
    out.print(f"{name} gen {number}: not replayable — no observation of it reads")
    verdicts["not replayable"] += 1


def _summary(name: str, verdicts: Counter[str], out: Console) -> None:
    unreported = f", {verdicts['unreported']} unreported" if verdicts["unreported"] else ""
    out.print(
        f"{name}: {verdicts['reproduced']} reproduced, {verdicts['diverged']} diverged, "
        f"{verdicts['not replayable']} not replayable{unreported}",
        highlight=False,
    )


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
