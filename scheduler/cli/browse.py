"""Browsing commands of ``schedule-lineage``: import-bundle, journal, observations, serve.

Owns the command-line face of browsing: arguments, rich tables, ``--json`` output
(the same view models the JSON API returns) and starting the web server. All
reading goes through ``scheduler.reader``; importing through
``scheduler.importer``. Organism-made text is printed as plain text with control
characters made visible, so neither rich markup nor terminal escape sequences in
a lineage can act on the reader's terminal.

Imported only when one of these commands runs or its help is asked (see
``scheduler.cli``); the web stack only when ``serve`` runs.

Trusts: the settings (as ``schedule-lineage`` loads them).
"""

from __future__ import annotations

import ipaddress
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from pydantic import TypeAdapter
from rich.table import Table
from rich.text import Text

from scheduler.cli.common import load_settings
from scheduler.importer import import_bundle
from scheduler.legible import escape_for_json
from scheduler.output import console, plain, warn
from scheduler.reader import NotFound, Reader, open_reader, parse_generation
from scheduler.views import GenerationRow, GenerationView, JournalRow, is_death
from worker.fleet.places import require_places
from worker.instrument.errors import Refusal
from worker.instrument.records import Observation
from worker.instrument.store import StoreUnavailable


def _reader() -> Reader:
    return open_reader(load_settings())


def _json(model: Any, value: object) -> None:
    """``value`` as JSON of type ``model``: exactly what the JSON API would answer, C1
    and bidi controls escaped as the API escapes them."""
    click.echo(
        escape_for_json(TypeAdapter(model).dump_json(value, indent=2, by_alias=True).decode())
    )


def _outcome(row: GenerationRow) -> Text:
    """A row's outcome, and the "model unavailable" mark beside it when it carries one."""
    text = Text(row.outcome, style=_outcome_style(row.outcome))
    if row.model_unavailable:
        text.append(" model unavailable", style="bold yellow")
    return text


def _outcome_style(outcome: str) -> str:
    if is_death(outcome):
        return "bold red"
    return {"changed": "green", "no-change": "dim", "seed": "blue", "out-of-loop": "blue"}.get(
        outcome, "yellow"
    )


@contextmanager
def _refusing() -> Iterator[None]:
    """Report "not found" and an unreachable store as one-line refusals."""
    try:
        yield
    except (NotFound, StoreUnavailable) as exc:
        raise Refusal(str(exc)) from None


@click.command("import-bundle")
@click.argument("bundle", type=click.Path(path_type=Path, dir_okay=False))
@click.argument("name")
@click.option(
    "--home",
    metavar="HOME",
    help="The shared repository (OUROBOROS_LINEAGE_REPOS) to add it to [chosen by its name].",
)
def import_bundle_command(bundle: Path, name: str, home: str | None) -> None:
    """Import the single-branch git BUNDLE as lineage NAME (read-only history, no observations)."""
    from worker.fleet.assembly import observation_store
    from worker.fleet.homes import Homes
    from worker.instrument.lineage import check_name

    settings = load_settings()
    require_places(settings, write=True, missing_ok=True)
    homes = Homes(settings, "scheduler", observation_store(settings))
    destination = homes.destination(check_name(name), home)
    repository = homes.urls[destination]
    head = import_bundle(bundle, name, repository, lambda: homes.reserve(name, destination))
    console.print(
        Text.assemble(
            "imported lineage ",
            (name, "bold"),
            f" (branch lineage-{name} at {head[:12]}) into {repository}",
        ),
        highlight=False,
    )


@click.command("journal")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def journal_command(name: str, as_json: bool) -> None:
    """The history of lineage NAME, oldest first: every commit with its journal entry."""
    with _refusing():
        reader = _reader()
        rows = reader.journal(name)
        family = reader.genealogy(name)
    if as_json:
        _json(list[JournalRow], rows)
        return
    console.print(plain(f"genealogy: {family.line}"))
    if family.parent is not None:
        parent = family.parent
        console.print(
            plain(
                f"seeded from {parent.lineage} commit {parent.commit}, instrument "
                f"{(parent.instrument_fingerprint or 'none')[:12]} "
                f"v{parent.instrument_version or '-'}"
            )
        )
    table = Table(title=f"lineage {name}: journal", show_lines=False)
    table.add_column("gen", justify="right", no_wrap=True)
    table.add_column("outcome", no_wrap=True)
    table.add_column("when", no_wrap=True)
    table.add_column("commit", no_wrap=True)
    table.add_column("subject / journal")
    for row in rows:
        commit = row.commit
        text = plain(commit.subject, "italic" if commit.generation is None else "")
        if row.entry and (row.entry.exit_status is not None or row.entry.stderr_lines):
            text.append("\n")
            text.append_text(plain(f"exit {row.entry.exit_status}", "red"))
            for line in row.entry.stderr_lines:
                text.append("\n")
                text.append_text(plain(line, "dim"))
        table.add_row(
            str(commit.generation) if commit.generation is not None else "—",
            Text(commit.kind, style=_outcome_style(commit.kind)),
            commit.committed_at.isoformat(timespec="seconds"),
            commit.sha[:12],
            text,
        )
    console.print(table)


@click.command("observations")
@click.argument("name")
@click.argument("generation", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def observations_command(name: str, generation: str | None, as_json: bool) -> None:
    """The observed figures of every generation of NAME, or everything about generation GEN."""
    reader = _reader()
    if generation is not None:
        with _refusing():
            view = reader.generation(name, parse_generation(generation))
        if as_json:
            _json(GenerationView, view)
        else:
            _print_generation(view)
        return
    with _refusing():
        rows = reader.observed_rows(name)
    if as_json:
        _json(list[GenerationRow], rows)
        return
    table = Table(title=f"lineage {name}: observations")
    for column in ("gen", "outcome", "duration s", "cpu s", "peak MiB", "calls", "cost USD"):
        table.add_column(column, justify="left" if column == "outcome" else "right")
    table.add_column("commit")
    for row in rows:
        f = row.figures
        figures = (
            [
                f"{f.duration_seconds:.2f}",
                f"{f.cpu_usage_nsec / 1e9:.2f}" if f.cpu_usage_nsec is not None else "—",
                f"{f.memory_peak_bytes / 2**20:.1f}" if f.memory_peak_bytes is not None else "—",
                str(f.model_calls),
                f"{f.spent_usd:.6f}",
            ]
            if f
            else ["—"] * 5
        )
        table.add_row(
            str(row.commit.generation),
            _outcome(row),
            *figures,
            row.commit.sha[:12],
        )
    if not any(row.figures for row in rows):
        table.caption = "no observation objects: outcomes are the commit subjects'"
    console.print(table)


def _print_generation(view: GenerationView) -> None:
    row, o = view.row, view.observation
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="dim")
    facts.add_column()
    facts.add_row("generation", f"{row.commit.generation} of {view.lineage}")
    facts.add_row("outcome", _outcome(row))
    facts.add_row("commit", f"{row.commit.sha} (parent {view.parent or '—'})")
    facts.add_row("subject", plain(row.commit.subject))
    if o is not None:
        for label, value in _observation_facts(o):
            facts.add_row(label, plain(value))
        if o.model_failure is not None:
            failure = o.model_failure
            facts.add_row(
                "provider failure",
                plain(
                    f"{failure.kind}: {failure.failed_calls} calls failed, "
                    f"{failure.answered_calls} answered; {failure.reason}"
                ),
            )
    else:
        facts.add_row("observation", "none recorded (imported lineage, or still pending)")
    if view.replay is not None:
        replay = view.replay
        said = f": {replay.reason}" if replay.reason else ""
        cause = f"; likely cause {replay.likely_cause}" if replay.likely_cause else ""
        when = replay.replayed_at.isoformat(timespec="seconds")
        facts.add_row("replay", plain(f"{replay.verdict} {when}{said}{cause}"))
    console.print(facts)
    if view.journal:
        console.rule("journal entry")
        console.print(plain(view.journal.text))
    if o is not None and o.model_calls:
        calls = Table(title="model calls")
        for column in (
            "#",
            "status",
            "stopped",
            "tries",
            "in tok",
            "out tok",
            "cost USD",
            "seconds",
            "prompt bytes",
        ):
            calls.add_column(column, justify="right")
        for call in o.model_calls:
            calls.add_row(
                str(call.index),
                str(call.status),
                call.stop_reason or "",
                str(len(call.attempts)),
                str(call.input_tokens),
                str(call.output_tokens),
                f"{call.cost_usd:.6f}",
                f"{call.duration_seconds:.2f}",
                str(len(call.prompt.encode())),
            )
        console.print(calls)
    if o is not None and o.stderr:
        console.rule("stderr")
        console.print(plain(o.stderr))


def _observation_facts(o: Observation) -> list[tuple[str, str]]:
    data = o.model_dump(
        include={
            "duration_seconds",
            "exit_status",
            "signal",
            "driver_result",
            "rejection_reason",
            "cpu_usage_nsec",
            "memory_peak_bytes",
            "oom_kills",
            "published_files",
            "published_bytes",
            "provider",
            "model",
            "spent_usd",
            "run_id",
        }
    )
    provenance = o.model_dump(include={"provenance"})["provenance"]
    return [(k, str(v)) for k, v in data.items()] + [
        (f"provenance.{k}", str(v)) for k, v in provenance.items()
    ]


@click.command("serve")
@click.option("--host", help="Address to bind [OUROBOROS_WEB_HOST, 127.0.0.1].")
@click.option("--port", type=click.IntRange(1, 65535), help="Port [OUROBOROS_WEB_PORT, 8765].")
def serve_command(host: str | None, port: int | None) -> None:
    """Serve the read-only web UI and JSON API (no authentication: see docs/browsing.md)."""
    import uvicorn

    from scheduler.web.app import create_app

    settings = load_settings()
    host = host or settings.web_host
    port = port or settings.web_port
    app = create_app(open_reader(settings), settings=settings)
    if not _loopback(host):
        console.print(
            Text.assemble(
                ("warning:", "yellow"),
                f" binding {host}: the browser has no authentication; put it "
                "behind an authenticating reverse proxy (docs/browsing.md)",
            ),
            highlight=False,
        )
    # Bound here, before saying so: a busy port is one line and exit 1, never "serving"
    # followed by uvicorn's own failure.
    try:
        listener = _bound(host, port)
    except OSError as exc:
        warn(
            "error",
            f"cannot serve on {host} port {port}: {exc.strerror or exc}; stop what listens "
            "there, or pick another with --port (OUROBOROS_WEB_PORT) or --host",
        )
        sys.exit(1)
    console.print(f"serving http://{host}:{port}/ (read-only)", highlight=False)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[listener])


def _bound(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port``, as uvicorn would have made it."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(2048)
    except OSError:
        listener.close()
        raise
    return listener


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
