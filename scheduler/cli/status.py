"""The ``status`` command: where each lineage stands, as a table or JSON.

The table keeps one scope per column: the lineage's totals (generations, deaths,
spend) apart from its current run (generation reached of the run's target, the run's
spend of its budget), with the same figures as the web UI's overview. Below
``NARROW_COLUMNS`` it drops the columns a narrow terminal cannot hold (the last
outcome, the backlog, the genealogy; ``--json`` has them all), and no column is ever
cut to an ellipsis: a long value folds onto the next line instead. A field whose
source did not answer is shown as ``?``, and each such source gets one line on
stderr; the exit status stays 0 whenever the shared repository answered. Every value
is shown as plain text (``scheduler.output.plain``): a blocked marker's reason is
anyone's to write, and its markup must neither style nor link nor crash the table.

Imported only when ``status`` runs or its help is asked (see ``scheduler.cli``).
"""

from __future__ import annotations

from decimal import Decimal
from typing import TYPE_CHECKING

import click

from scheduler.cli.common import emit, load_settings
from scheduler.cohorts import members
from scheduler.status import FleetClient, LineageStatus
from worker.instrument.lineage import check_cohort, check_name

if TYPE_CHECKING:
    from rich.table import Table

# Below this many columns the table drops the columns that do not fit.
NARROW_COLUMNS = 100
UNKNOWN = "?"
# What a source that did not answer leaves unknown.
UNKNOWN_PARTS = {
    "broker": "in flight, blocked and the live workers are",
    "store": "the run, the spend, the deaths, the last outcome and the backlog are",
}


@click.command()
@click.argument("names", nargs=-1)
@click.option("--cohort", metavar="LABEL", help="Show every lineage of cohort LABEL too.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def status(names: tuple[str, ...], cohort: str | None, as_json: bool) -> None:
    """Where each lineage stands: target, done, in flight, last outcome, deaths, spend.

    A lineage whose run wants more but whose instrument queue no live worker serves
    is shown waiting, with the command that would start a worker for it. With the
    broker or the observation store down, what the others know is shown, the rest
    as unknown (? in the table, null in JSON), with one line saying which is down.
    """
    settings = load_settings()
    for name in names:
        check_name(name)
    if cohort:
        check_cohort(cohort)
    fleet = FleetClient(settings, start_broker=False)
    chosen = list(names)
    if cohort:
        chosen += [name for name in members(fleet.metadata, cohort) if name not in names]
    rows = fleet.statuses(chosen or None)
    emit(rows, as_json, lambda: _table(rows))
    down = {source: line for row in rows for source, line in row.unavailable.items()}
    if down:
        from scheduler.output import warn

        for source, line in down.items():
            warn("warning", f"{line}; {UNKNOWN_PARTS[source]} unknown (?)")
    if not as_json:
        from scheduler.output import console, plain

        for row in rows:
            if row.waiting:
                console.print(plain(row.waiting), highlight=False, soft_wrap=True)


def _table(rows: list[LineageStatus]) -> Table:
    """The status table, narrow on a narrow page; rich is imported only when one is printed."""
    from rich.table import Table

    from scheduler.output import console, plain

    narrow = console.width < NARROW_COLUMNS
    # A cohort column only where some lineage has one: otherwise it takes room and says "-".
    cohorts = any(row.cohort for row in rows)
    columns = ["lineage", "gens", "deaths", "spent", "run", "run spent"]
    columns += (
        ["state"]
        if narrow
        else ["in flight", "last", "backlog", "state", *(["cohort"] * cohorts), "genealogy"]
    )
    table = Table(*columns)
    for column in table.columns:
        column.overflow = "fold"
    table.columns[0].no_wrap = not narrow
    for row in rows:
        store = "store" not in row.unavailable
        broker = "broker" not in row.unavailable
        lineage = [
            row.lineage,
            str(row.generation),
            _known(row.deaths, store),
            _known(_usd(row.lineage_spent_usd), store),
        ]
        run = [_run(row, store), _run_spent(row, store)]
        if narrow:
            cells = [*lineage, *run, _state(row, short=True)]
        else:
            cells = [
                *lineage,
                *run,
                _known(("yes" if row.in_flight else "no"), broker),
                (
                    (row.last_outcome or "-")
                    + (" (model unavailable)" if row.last_model_unavailable else "")
                )
                if store
                else UNKNOWN,
                _known(row.observation_backlog, store),
                _state(row, short=False),
                *([row.cohort or "-"] * cohorts),
                row.genealogy.line,
            ]
        # Every cell holds what Redis, the store or git said: shown as written, never markup.
        table.add_row(*(plain(cell) for cell in cells))
    return table


def _state(row: LineageStatus, short: bool) -> str:
    """What the lineage is doing now; ``short`` leaves the details to the lines below."""
    if row.queue is None:
        return "imported (browse only)"
    if row.waiting_for_instrument:
        if short:
            return "waiting for a worker"
        if row.other_instrument_workers:
            return f"waiting for its instrument: {row.queue} unserved (other instruments live)"
        return f"waiting: no live worker serves {row.queue}"
    if row.blocked or row.stopped:
        return str(row.blocked or row.stopped)
    if row.in_flight:
        served = f" (served by {', '.join(row.workers)})" if row.workers and not short else ""
        return f"running{served}"
    # Nothing in flight is "idle" only when neither an unknown run nor an unknown
    # in-flight marker could make it otherwise.
    if "store" in row.unavailable or ("broker" in row.unavailable and row.run_id is not None):
        return UNKNOWN
    if row.stalled:
        return "stalled" if short else row.stalled
    return "idle"


def _run(row: LineageStatus, known: bool) -> str:
    """The current run: the generation reached of its target, as the web UI shows it."""
    if not known:
        return UNKNOWN
    return f"{row.generation}/{row.target}" if row.target else "-"


def _run_spent(row: LineageStatus, known: bool) -> str:
    if not known:
        return UNKNOWN
    if row.run_spent_usd is None:
        return "-"
    budget = f" of ${row.budget_usd}" if row.budget_usd is not None else ""
    return f"{_usd(row.run_spent_usd)}{budget}"


def _usd(amount: Decimal | None) -> str | None:
    return None if amount is None else f"${amount:.4f}"


def _known(value: object, known: bool) -> str:
    return str(value) if known and value is not None else UNKNOWN
