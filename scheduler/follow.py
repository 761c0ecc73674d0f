"""Live progress of runs for ``schedule-lineage run --follow`` and ``--wait``.

Owns the polling loop that watches runs until each stops (target reached, budget
exhausted or cancelled) and the rich progress display: one bar per lineage with its
outcome counts and spend.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from scheduler.status import Fleet, LineageStatus

POLL_SECONDS = 1.0
WORKER_CHECK_SECONDS = 15.0


def describe(status: LineageStatus) -> str:
    counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(status.run_outcomes.items()))
    state = status.stopped or status.blocked or ("running" if status.in_flight else "queued")
    return f"{status.lineage}: {counts or 'no generations yet'}; ${status.spent_usd} spent; {state}"


def watch(fleet: Fleet, names: list[str], console: Console, show: bool) -> list[LineageStatus]:
    """Poll until every named lineage's run has stopped or is blocked; the final statuses."""
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not show,
    )
    served = fleet.served_queues()
    checked = time.monotonic()
    warned: set[str] = set()
    with progress:
        tasks = {}
        while True:
            statuses = [fleet.status(name, served) for name in names]
            for status in statuses:
                if status.lineage not in tasks:
                    # The run's length: its target less the generation it started from.
                    wanted = (status.target or 0) - (status.generation - status.done)
                    tasks[status.lineage] = progress.add_task(describe(status), total=wanted)
                progress.update(
                    tasks[status.lineage], completed=status.done, description=describe(status)
                )
                if status.waiting_for_instrument and status.lineage not in warned:
                    warned.add(status.lineage)
                    console.print(
                        f"[yellow]{status.lineage}: no live worker serves {status.queue}; "
                        "start one with the lineage's instrument (celery -A worker worker)[/]"
                    )
            # A blocked lineage cannot advance until an operator acts: waiting is pointless.
            if all(status.stopped or status.blocked for status in statuses):
                return statuses
            time.sleep(POLL_SECONDS)
            if time.monotonic() - checked > WORKER_CHECK_SECONDS:
                served, checked = fleet.served_queues(), time.monotonic()
