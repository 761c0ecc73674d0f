"""What several ``schedule-lineage`` command modules share.

Owns the dollar parameter type and printing rows as a rich table or as JSON (rich is
imported only for a table); hands on ``load_settings`` (``worker.fleet.settings``:
the settings, or a one-line refusal). Imported only by command modules, so only when
a command runs; it imports no command module.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING

import click
from pydantic import BaseModel

# Re-exported: every command loads its settings from here.
from worker.fleet.settings import load_settings as load_settings

if TYPE_CHECKING:
    from rich.table import Table


# ParamType is generic in the newest click only; subscripting it would break the older
# ones pyproject.toml allows.
class Money(click.ParamType):  # type: ignore[type-arg]
    """A finite, non-negative amount of US dollars, as a Decimal."""

    name = "usd"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> Decimal:
        if isinstance(value, Decimal):
            return value
        try:
            amount = Decimal(str(value).strip())
        except InvalidOperation:
            self.fail(f"{value!r} is not an amount of dollars, e.g. 1.50", param, ctx)
        if not amount.is_finite() or amount < 0:
            self.fail(f"{value!r} must be a finite amount of dollars, 0 or more", param, ctx)
        return amount


USD = Money()


def emit(rows: Sequence[BaseModel], as_json: bool, table: Callable[[], Table]) -> None:
    """``rows`` as JSON, or the table ``table()`` builds from them."""
    if as_json:
        click.echo(json.dumps([row.model_dump(mode="json") for row in rows], indent=2))
    else:
        # rich (a tenth of a second to import) only for a table: scripts ask for JSON.
        from scheduler.output import console

        console.print(table())
