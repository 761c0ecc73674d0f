"""The ``schedule-lineage`` command line: the group, its lazy command table and ``main``.

Owns argument parsing and presentation (click, rich). Every refusal is one clear
line on stderr with exit status 2 and no traceback; the work itself is done by the
worker's pipeline and the scheduler's modules, never here.

Each command lives in the module of its family (``lineages``, ``status``,
``doctor``, ``browse``, ``archives``, ``repack``, ``broker``, ``replay``, ``table``; what they
share is in ``common``) and that module is imported only when its command runs or its own help
is asked: the group below is click's "lazy loading subcommands" pattern, a name ->
``"module:attr"`` table. The table also holds each command's one-line help, so
``schedule-lineage --help`` lists every command without importing any of them (no
store, broker, pipeline or web stack). This module imports click and the refusal
type, nothing else of weight; no command module imports another.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass

import click

from worker.instrument.errors import Refusal


@dataclass(frozen=True)
class Lazy:
    """Where a command lives (``"module:attr"``) and its help's first paragraph."""

    target: str
    help: str


# The help strings are the first paragraph of each command's docstring, word for word
# (tests/test_structure.py holds them equal): ``--help`` shortens them exactly as click
# shortens a loaded command's.
COMMANDS: dict[str, Lazy] = {
    "init": Lazy(
        "scheduler.cli.lineages:init",
        "Create lineage NAME: branch lineage-NAME with its seed commit and pinned physics.",
    ),
    "fork": Lazy(
        "scheduler.cli.lineages:fork",
        "Create lineage NAME seeded from a generation of another, under this instrument.",
    ),
    "run": Lazy(
        "scheduler.cli.lineages:run",
        "Run N more generations of each lineage NAME (on the fleet, or --local).",
    ),
    "replay": Lazy(
        "scheduler.cli.replay:replay_command",
        "Live generations of NAME again from their observations and judge them (here, or --fleet).",
    ),
    "cancel": Lazy(
        "scheduler.cli.lineages:cancel",
        "Stop NAME's run after the generation in flight (if any) lands.",
    ),
    "move": Lazy(
        "scheduler.cli.lineages:move",
        "Move lineage NAME to another shared repository (home), while no run drives it.",
    ),
    "reconcile": Lazy(
        "scheduler.cli.lineages:reconcile",
        "Re-enqueue every lineage whose run wants more and has nothing in flight.",
    ),
    "status": Lazy(
        "scheduler.cli.status:status",
        "Where each lineage stands: target, done, in flight, last outcome, deaths, spend.",
    ),
    "doctor": Lazy(
        "scheduler.cli.doctor:doctor",
        "Check this host: identity, bwrap, emacs, git, ceiling, broker, repository, store, keys.",
    ),
    "export": Lazy(
        "scheduler.cli.archives:export_command",
        "Write lineage NAME, its observations, run records and metadata to one archive.",
    ),
    "verify": Lazy(
        "scheduler.cli.archives:verify_command",
        "Check an archive alone: sums, nothing missing or extra, observations match commits.",
    ),
    "import": Lazy(
        "scheduler.cli.archives:import_command",
        "Add the lineage of an export archive, verified first, to this fleet (write-once).",
    ),
    "import-bundle": Lazy(
        "scheduler.cli.browse:import_bundle_command",
        "Import the single-branch git BUNDLE as lineage NAME (read-only history, no observations).",
    ),
    "journal": Lazy(
        "scheduler.cli.browse:journal_command",
        "The history of lineage NAME, oldest first: every commit with its journal entry.",
    ),
    "observations": Lazy(
        "scheduler.cli.browse:observations_command",
        "The observed figures of every generation of NAME, or everything about generation GEN.",
    ),
    "repack": Lazy(
        "scheduler.cli.repack:repack",
        "Pack this host's lineage repositories: every cache, and every local shared one.",
    ),
    "stop-redis": Lazy(
        "scheduler.cli.broker:stop_redis",
        "Stop this home's embedded Redis now; its data is kept for its next start.",
    ),
    "table": Lazy(
        "scheduler.cli.table:table",
        "Every observed generation of the lineages named, or of a cohort, as one table file.",
    ),
    "serve": Lazy(
        "scheduler.cli.browse:serve_command",
        "Serve the read-only web UI and JSON API (no authentication: see docs/browsing.md).",
    ),
}


class LazyGroup(click.Group):
    """A group whose commands are imported from a table when first needed.

    ``list_commands`` and ``get_command`` are the documented lazy-loading overrides;
    ``format_commands`` lists the table's help without importing anything; and
    ``commands`` is a view of every name (eagerly added or in the table) that loads a
    command only when one is looked up, so code that reads ``group.commands`` and
    click's "did you mean" suggestions still see them all.
    """

    def __init__(self, *args: object, lazy: dict[str, Lazy], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.lazy = dict(lazy)
        self.loaded: dict[str, click.Command] = dict(self.commands)
        self.commands = _CommandView(self)

    def names(self) -> list[str]:
        return sorted({*self.loaded, *self.lazy})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return self.names()

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return self.load(cmd_name)

    def load(self, name: str) -> click.Command | None:
        if name in self.loaded:
            return self.loaded[name]
        if name not in self.lazy:
            return None
        module_name, attr = self.lazy[name].target.split(":")
        command = getattr(importlib.import_module(module_name), attr)
        if not isinstance(command, click.Command) or command.name != name:
            raise TypeError(f"{self.lazy[name].target} is not the click command {name!r}")
        self.loaded[name] = command
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # What click.Group.format_commands does, but an unloaded command is listed
        # through a stand-in holding only its help, so listing imports nothing.
        commands = []
        for name in self.list_commands(ctx):
            command = self.loaded.get(name) or click.Command(name, help=self.lazy[name].help)
            if not command.hidden:
                commands.append((name, command))
        if commands:
            limit = formatter.width - 6 - max(len(name) for name, _ in commands)
            rows = [(name, command.get_short_help_str(limit)) for name, command in commands]
            with formatter.section("Commands"):
                formatter.write_dl(rows)


class _CommandView(MutableMapping[str, click.Command]):
    """``LazyGroup.commands``: every name at no cost; a command loaded when looked up."""

    def __init__(self, group: LazyGroup) -> None:
        self.group = group

    def __getitem__(self, name: str) -> click.Command:
        command = self.group.load(name)
        if command is None:
            raise KeyError(name)
        return command

    def __setitem__(self, name: str, command: click.Command) -> None:
        self.group.loaded[name] = command  # click.Group.add_command

    def __delitem__(self, name: str) -> None:
        if name not in self:
            raise KeyError(name)
        self.group.loaded.pop(name, None)
        self.group.lazy.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self.group.names())

    def __len__(self) -> int:
        return len(self.group.names())

    def __contains__(self, name: object) -> bool:
        return name in self.group.loaded or name in self.group.lazy


def _print_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from worker.instrument.fingerprint import package_version

    click.echo(f"schedule-lineage {package_version()}")
    ctx.exit()


@click.group(cls=LazyGroup, lazy=COMMANDS)
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Show the version and exit.",
)
def cli() -> None:
    """Create lineages of self-modifying Emacs Lisp organisms and run their generations."""


def _unanswered(exc: BaseException) -> bool:
    """Whether ``exc`` is infrastructure that did not answer: git, the store, Redis.

    Tested through ``sys.modules`` so ``main`` imports none of them: an exception
    of one of these types can only exist if its module was imported.
    """
    kinds = [
        getattr(sys.modules[module], name)
        for module, name in (
            ("worker.instrument.gitrepo", "GitError"),
            ("worker.instrument.store", "StoreUnavailable"),
            ("redis", "RedisError"),
        )
        if module in sys.modules
    ]
    return isinstance(exc, tuple(kinds))


class _Warnings(logging.Handler):
    """A logged warning (a foreign ref skipped, a repository to harden) as one line on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        from scheduler.output import warn

        warn(record.levelname.lower(), record.getMessage())


def main() -> None:
    logging.basicConfig(level=logging.WARNING, handlers=[_Warnings()])
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        from scheduler.output import errors

        errors.print("aborted")
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(2 if exc.exit_code == 2 else exc.exit_code)
    except Refusal as exc:
        from scheduler.output import warn

        warn("error", exc)
        sys.exit(exc.exit_status)
    except Exception as exc:
        if not _unanswered(exc):
            raise
        from scheduler.output import warn

        # Infrastructure that did not answer: say which, without a traceback.
        warn("error", exc)
        sys.exit(1)
