"""Live progress of runs for ``schedule-lineage run --follow`` and ``--wait``.

Owns the polling loop that watches runs until each stops (target reached, budget
exhausted or cancelled), the rich progress display (one bar per lineage with its
outcome counts and spend), and what the loop says about workers: when a lineage's
queue has no live worker it says so at once (queue, instrument, the command that
starts one), says again when a worker appears, and gives up (``NoWorker``) once a
lineage has waited ``OUROBOROS_WORKER_WAIT_SECONDS`` with none, so a wait is never
a silent hang. The run itself is untouched by giving up: it stays queued.

A broker, store or repository that stops answering is a blip the workers ride out,
so the loop does too: it says once which source it lost (``scheduler.sources``),
keeps the last progress it knew, says when the source answers again and goes on; it
gives up (``SourceLost``) only after ``OUROBOROS_FOLLOW_OUTAGE_SECONDS`` without it.
Stopping to follow never stops a run: the caller says so, and how to cancel one.
"""

from __future__ import annotations

import contextlib
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from scheduler.liveness import UNREACHABLE, Workers, served_line
from scheduler.output import plain
from scheduler.sources import NOUNS, Source, why
from scheduler.status import FAILURES, FleetClient, LineageStatus, Outages

POLL_SECONDS = 1.0
# How often the broker is asked which queues live workers serve (each ask takes ~1 s).
WORKER_CHECK_SECONDS = 2.0


class NoWorker(Exception):
    """A watched lineage waited the configured time with no live worker for its queue."""

    def __init__(self, status: LineageStatus, waited: float) -> None:
        super().__init__(
            f"no live worker served queue {status.queue} of {status.lineage} for {waited:.0f} s "
            "(OUROBOROS_WORKER_WAIT_SECONDS); the run stays queued and proceeds when a worker "
            f"for its instrument starts (see schedule-lineage status {status.lineage})"
        )
        self.status = status


class SourceLost(Exception):
    """A source did not answer for the whole of the configured time."""

    def __init__(self, line: str, waited: float, names: list[str]) -> None:
        super().__init__(
            f"{line}, for {waited:.0f} s (OUROBOROS_FOLLOW_OUTAGE_SECONDS); "
            f"the runs go on on the fleet: see schedule-lineage status {' '.join(names)}"
        )


def describe(status: LineageStatus) -> str:
    counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(status.run_outcomes.items()))
    if status.run_model_unavailable:
        counts += f" ({status.run_model_unavailable} model unavailable)"
    state = status.stopped or status.blocked
    if state is None and status.waiting_for_instrument:
        state = f"waiting for a worker on {status.queue}"
    state = state or ("running" if status.in_flight else "queued")
    spent = f"${status.run_spent_usd}" if status.run_spent_usd is not None else "$0"
    return f"{status.lineage}: {counts or 'no generations yet'}; {spent} spent; {state}"


def watch(
    fleet: FleetClient,
    names: list[str],
    console: Console,
    show: bool,
    give_up_after: float,
    workers: Workers | None = None,
    outage_limit: float = 600.0,
) -> list[LineageStatus]:
    """Poll until every named lineage's run has stopped or is blocked (not merely paused);
    the final statuses.

    ``workers`` is a fresh answer the caller already has (else the broker is asked).
    Raises NoWorker when a lineage has waited ``give_up_after`` seconds with no live
    worker serving its queue, and SourceLost when a source has not answered for
    ``outage_limit`` seconds.
    """
    progress = Progress(
        # A description holds what blocks the lineage, which anyone may write: no markup.
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )
    workers = workers if workers is not None else fleet.workers()
    checked = time.monotonic()
    unserved_since: dict[str, float] = {}
    said: dict[str, str] = {}
    lost: dict[Source, tuple[float, str]] = {}
    # Quiet (--wait): the display is never started, so it prints nothing, not even its end.
    with progress if show else contextlib.nullcontext():
        tasks = {}
        while True:
            outages: Outages = {}
            statuses = _statuses(fleet, names, workers, outages)
            if statuses and any(
                s.lineage in unserved_since and not (s.waiting or s.workers) for s in statuses
            ):
                # It stopped waiting since the workers were last asked (its generation may
                # even have landed already): ask now, so the line names who serves it.
                workers, checked = fleet.workers(), time.monotonic()
                statuses = _statuses(fleet, names, workers, outages)
            now = time.monotonic()
            _outages(outages, lost, now, progress.console, outage_limit, names)
            if statuses is None or "store" in outages:
                # Progress is the repository's and the store's: keep the last one shown.
                time.sleep(POLL_SECONDS)
                continue
            for status in statuses:
                if status.lineage not in tasks:
                    # The run's length: its target less the generation it started from.
                    wanted = (status.target or 0) - (status.generation - status.done)
                    tasks[status.lineage] = progress.add_task(describe(status), total=wanted)
                progress.update(
                    tasks[status.lineage], completed=status.done, description=describe(status)
                )
                _announce(status, said, unserved_since, now, progress.console)
            # A blocked lineage cannot advance until an operator acts: waiting is pointless.
            # A paused one resumes by itself.
            if all(status.stopped or _needs_operator(status) for status in statuses):
                return statuses
            for status in statuses:
                since = unserved_since.get(status.lineage)
                if since is not None and now - since >= give_up_after:
                    raise NoWorker(status, now - since)
            time.sleep(POLL_SECONDS)
            if "broker" in outages:
                # Which workers are live is unknown, never "none": nothing is said to wait.
                workers = UNREACHABLE
            elif time.monotonic() - checked > WORKER_CHECK_SECONDS:
                workers, checked = fleet.workers(), time.monotonic()


def _statuses(
    fleet: FleetClient, names: list[str], workers: Workers, outages: Outages
) -> list[LineageStatus] | None:
    """Every named lineage's status in one pass; None while the repository does not answer."""
    try:
        return [fleet.status(name, workers, outages) for name in names]
    except FAILURES["repository"] as exc:
        outages["repository"] = why("repository", fleet.settings, exc)
        return None


def _outages(
    outages: Outages,
    lost: dict[Source, tuple[float, str]],
    now: float,
    console: Console,
    limit: float,
    names: list[str],
) -> None:
    """Say when a source stops answering and when it answers again; give up after ``limit``."""
    for source, line in outages.items():
        if source not in lost:
            lost[source] = (now, line)
            console.print(
                plain(
                    f"lost {line}; the runs go on on the fleet; following again "
                    f"when it answers (giving up after {limit:.0f} s)",
                    "yellow",
                ),
                highlight=False,
                soft_wrap=True,
            )
        elif now - lost[source][0] >= limit:
            raise SourceLost(line, now - lost[source][0], names)
    for source in [source for source in lost if source not in outages]:
        since, _ = lost.pop(source)
        console.print(
            plain(
                f"the {NOUNS[source]} answers again after {now - since:.0f} s; following",
                "green",
            ),
            highlight=False,
            soft_wrap=True,
        )


def _needs_operator(status: LineageStatus) -> bool:
    return status.blocked is not None and status.blocked_kind != "unavailable"


def _announce(
    status: LineageStatus,
    said: dict[str, str],
    unserved_since: dict[str, float],
    now: float,
    console: Console,
) -> None:
    """Say when a lineage starts waiting for a worker (or why changes), and when one appears."""
    if status.waiting:
        unserved_since.setdefault(status.lineage, now)
        if said.get(status.lineage) != status.waiting:
            said[status.lineage] = status.waiting
            console.print(plain(status.waiting, "yellow"), highlight=False, soft_wrap=True)
    elif status.lineage in unserved_since:
        del unserved_since[status.lineage]
        said.pop(status.lineage, None)
        if status.workers:
            line = served_line(status.lineage, str(status.queue), status.workers)
            console.print(plain(line, "green"), highlight=False, soft_wrap=True)
