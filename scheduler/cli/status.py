"""The ``status`` command: where each lineage stands, as a table or JSON.

Imported only when ``status`` runs or its help is asked (see ``scheduler.cli``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from scheduler.cli.common import emit, load_settings
from scheduler.status import Fleet, LineageStatus
from worker.instrument.lineage import check_name

if TYPE_CHECKING:
    from rich.table import Table


@click.command()
@click.argument("names", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def status(names: tuple[str, ...], as_json: bool) -> None:
    """Where each lineage stands: target, done, in flight, last outcome, deaths, spend.

    A lineage whose run wants more but whose instrument queue no live worker serves
    is shown waiting, with the command that would start a worker for it.
    """
    settings = load_settings()
    for name in names:
        check_name(name)
    rows = Fleet(settings).statuses(list(names) or None)
    emit(rows, as_json, lambda: _table(rows))
    if not as_json:
        from scheduler.output import console

        for row in rows:
            if row.waiting:
                console.print(row.waiting, highlight=False, soft_wrap=True)


def _table(rows: list[LineageStatus]) -> Table:
    """The status table; rich is imported only when one is printed."""
    from rich.table import Table

    table = Table(
        "lineage", "gen/target", "in flight", "last", "deaths", "spent", "backlog", "state"
    )
    table.add_column("genealogy")
    table.columns[0].no_wrap = True
    for row in rows:
        state = (
            row.blocked or row.stopped or ("running" if row.in_flight else row.stalled or "idle")
        )
        if row.queue is None:
            state = "imported (browse only)"
        if row.waiting_for_instrument:
            state = f"waiting: no live worker serves {row.queue}"
            if row.other_instrument_workers:
                state = f"waiting for its instrument: {row.queue} unserved (other instruments live)"
        elif row.workers and row.in_flight:
            state += f" (served by {', '.join(row.workers)})"
        table.add_row(
            row.lineage,
            f"{row.generation}/{row.target}" if row.target else str(row.generation),
            "yes" if row.in_flight else "no",
            row.last_outcome or "-",
            str(row.deaths),
            f"${row.spent_usd:.4f}"
            + (f" of ${row.budget_usd}" if row.budget_usd is not None else ""),
            str(row.observation_backlog),
            state,
            row.genealogy.line,
        )
    return table
