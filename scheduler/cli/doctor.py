"""The ``doctor`` command: what this host has, and whether a sandbox could be built.

Imported only when ``doctor`` runs or its help is asked (see ``scheduler.cli``); it
loads the sandbox identity and ceiling probes, which no other command needs.
"""

from __future__ import annotations

import sys

import click
from rich.table import Table
from rich.text import Text

from scheduler.cli.common import emit, load_settings
from scheduler.doctor import Check, checks
from scheduler.output import plain
from worker.instrument.identity import IdentityPool


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def doctor(as_json: bool) -> None:
    """Check this host: identity, bwrap, emacs, git, ceiling, broker, repository, store, keys.

    Refuses (exit 2) a host where a sandbox could not be built without host root.
    """
    settings = load_settings()
    # A host where a life could run as host root is refused outright, not listed.
    identities = IdentityPool(settings.sandbox_uid_base, settings.sandbox_uid_count)
    identities.probe()
    results = [Check(name="identity", ok=True, detail=identities.describe()), *checks(settings)]
    table = Table("check", "ok", "detail")
    for check in results:
        mark = (
            Text("ok", "green")
            if check.ok
            else (Text("missing", "red") if check.essential else Text("-"))
        )
        table.add_row(check.name, mark, plain(check.detail))
    emit(results, as_json, lambda: table)
    if not all(check.ok for check in results if check.essential):
        sys.exit(1)
