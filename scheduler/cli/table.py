"""The ``table`` command: every observed generation of some lineages as one file.

Owns choosing the lineages (named, a cohort's, or every one), refusing what it cannot
do in one line (exit 2), and the progress bar on stderr while ``scheduler.table`` reads
the store one observation at a time. Imported only when ``table`` runs or its help is
asked (see ``scheduler.cli``).

Trusts: the settings (as ``schedule-lineage`` loads them).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from scheduler.cli.common import load_settings
from scheduler.cohorts import members
from scheduler.output import console, errors
from scheduler.reader import NotFound, open_reader
from scheduler.table import FORMATS, Format, Value, observed, rows, write
from worker.instrument.errors import Refusal
from worker.instrument.lineage import check_cohort, check_name
from worker.instrument.store import StoreUnavailable


@click.command()
@click.argument("names", nargs=-1)
@click.option("--cohort", metavar="LABEL", help="Every lineage of cohort LABEL.")
@click.option(
    "--format", "fmt", type=click.Choice(FORMATS), required=True, help="The file's format."
)
@click.option(
    "--to",
    "destination",
    type=click.Path(path_type=Path, dir_okay=False),
    required=True,
    help="The file to write (never replaced).",
)
def table(names: tuple[str, ...], cohort: str | None, fmt: Format, destination: Path) -> None:
    """Every observed generation of the lineages named, or of a cohort, as one table file.

    One row per generation with every scalar field of its observation (the columns
    and their types are listed in docs/browsing.md); every lineage when none is named.
    """
    if names and cohort:
        raise Refusal("name lineages or a cohort (--cohort LABEL), not both")
    for name in names:
        check_name(name)
    if cohort:
        check_cohort(cohort)
    reader = open_reader(load_settings())
    try:
        metas = reader.metadata()
        if cohort:
            chosen = members(metas, cohort)
        else:
            for name in names:
                reader.history(name)
            chosen = list(names) or sorted(metas)
        with Progress(
            TextColumn("reading observations"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=errors,
            transient=True,
        ) as progress:
            task = progress.add_task("rows", total=observed(reader, chosen))

            def counted(source: Iterable[list[Value]]) -> Iterator[list[Value]]:
                for row in source:
                    progress.advance(task)
                    yield row

            written = write(counted(rows(reader, chosen)), fmt, destination)
    except (NotFound, StoreUnavailable) as exc:
        raise Refusal(str(exc)) from None
    console.print(
        f"wrote {written} generations of {len(chosen)} lineages to {destination}",
        highlight=False,
        markup=False,
    )
