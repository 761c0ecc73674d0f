"""The package's shape: what reading loads, and a command line that loads on demand.

Browsing (the web app, the CLI's read commands) must not load the instrument's
machinery for running lives (sandbox, decoder, ceilings, model socket, identities,
pipeline) nor the worker's Celery side; ``schedule-lineage --help`` must load none
of the stores, brokers or web stack. Each probe runs in a fresh interpreter, so
what this pytest process has already imported proves nothing either way.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from support.fleet import BYTECODE_CACHE
from support.xdist_schedule import HEAVY_MODULES

from scheduler.cli import COMMANDS, LazyGroup, cli

ROOT = Path(__file__).resolve().parents[1]
CLI_PACKAGE = ROOT / "scheduler" / "cli"

# Modules (and their submodules) that only running a generation needs.
RUNNING_MACHINERY = (
    "worker.instrument.sandbox",
    "worker.instrument.decoder",
    "worker.instrument.tar_reader",
    "worker.instrument.extract",
    "worker.instrument.ceilings",
    "worker.instrument.model.server",
    "worker.instrument.model.engine",
    "worker.instrument.model.framing",
    "worker.instrument.model.audit",
    "worker.instrument.identity",
    "worker.instrument.pipeline",
    "worker.celery",
    "worker.fleet.tasks",
)
# What listing the commands must not pay for.
HEAVY = ("boto3", "redis", "celery", "fastapi", "worker.instrument.store")


def loaded(modules: list[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(
        name for name in modules if any(name == p or name.startswith(p + ".") for p in prefixes)
    )


def probe(tmp_path: Path, code: str) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter; its ``result`` dict plus the modules it loaded."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(ROOT),
        "HOME": str(home),
        "OUROBOROS_HOME": str(home / ".ouroboros"),
        "PYTHONPYCACHEPREFIX": BYTECODE_CACHE,
    }
    script = textwrap.dedent(code) + textwrap.dedent(
        """
        import json as _json, sys as _sys
        result["modules"] = sorted(_sys.modules)
        _sys.__stdout__.write("\\n@@RESULT@@" + _json.dumps(result))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=home,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.rsplit("@@RESULT@@", 1)[1])


CLI_PROBE = """
import contextlib, io, sys
import scheduler.cli

sys.argv = ["schedule-lineage", *{argv!r}]
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        scheduler.cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code
result = {{"code": code, "output": out.getvalue()}}
"""


@pytest.mark.full
def test_the_probe_sees_an_import_of_running_machinery(tmp_path: Path) -> None:
    # The control: were a reader to import the Celery task module, the probes would say so.
    result = probe(tmp_path, "import worker.fleet.tasks\nresult = {}\n")
    assert "worker.fleet.tasks" in loaded(result["modules"], RUNNING_MACHINERY)
    assert "worker.instrument.pipeline" in loaded(result["modules"], RUNNING_MACHINERY)


@pytest.mark.full
def test_the_web_app_loads_no_running_machinery(tmp_path: Path) -> None:
    result = probe(
        tmp_path,
        """
        from fastapi.testclient import TestClient

        from scheduler.reader import open_reader
        from scheduler.web.app import create_app
        from worker.fleet.settings import Settings

        app = create_app(open_reader(Settings()))  # as `schedule-lineage serve` builds it
        app.state.workers = lambda: None  # no broker to ask in a test
        client = TestClient(app)
        result = {
            path: client.get(path).status_code
            for path in ("/api/", "/", "/api/lineages/absent", "/lineages/absent")
        }
        """,
    )
    assert result["/api/"] == result["/"] == 200
    assert result["/api/lineages/absent"] == result["/lineages/absent"] == 404
    assert loaded(result["modules"], RUNNING_MACHINERY) == []


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["journal", "--help"], ["observations", "--help"], ["status", "--help"]],
    ids=" ".join,
)
@pytest.mark.full
def test_read_commands_load_no_running_machinery(tmp_path: Path, argv: list[str]) -> None:
    result = probe(tmp_path, CLI_PROBE.format(argv=argv))
    assert result["code"] == 0, result["output"]
    assert result["output"].startswith("Usage: ")
    assert loaded(result["modules"], RUNNING_MACHINERY) == []


@pytest.mark.full
def test_listing_the_commands_loads_no_store_broker_or_web_stack(tmp_path: Path) -> None:
    result = probe(tmp_path, CLI_PROBE.format(argv=["--help"]))
    assert result["code"] == 0
    listing = result["output"].split("Commands:\n", 1)[1].splitlines()
    assert [line.split()[0] for line in listing] == sorted(COMMANDS)
    for line in listing:
        assert len(line.split()) > 1, f"no help for {line.strip()}"
    assert loaded(result["modules"], HEAVY) == []
    # Nor any command module: listing reads the table.
    assert loaded(result["modules"], ("scheduler.cli",)) == ["scheduler.cli"]


@pytest.mark.full
def test_a_command_module_is_loaded_when_its_command_is(tmp_path: Path) -> None:
    result = probe(tmp_path, CLI_PROBE.format(argv=["journal", "--help"]))
    assert "--json" in result["output"]
    assert loaded(result["modules"], ("scheduler.cli",)) == [
        "scheduler.cli",
        "scheduler.cli.browse",
        "scheduler.cli.common",
    ]


@pytest.mark.parametrize("how", ["module", "script"])
@pytest.mark.full
def test_version(how: str) -> None:
    from worker.instrument.fingerprint import package_version

    if how == "module":
        argv = [sys.executable, "-m", "scheduler"]
    else:
        script = Path(sys.executable).with_name("schedule-lineage")
        assert script.exists(), "schedule-lineage is not installed next to this interpreter"
        argv = [str(script)]
    done = subprocess.run(
        [*argv, "--version"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout, done.stderr) == (
        0,
        f"schedule-lineage {package_version()}\n",
        "",
    )


# --- the lazy table ----------------------------------------------------------------


def test_every_table_entry_is_its_command_with_the_same_help() -> None:
    for name, lazy in COMMANDS.items():
        command = LazyGroup(lazy=COMMANDS).get_command(click.Context(cli), name)
        assert command is not None and command.name == name
        assert lazy.target.startswith("scheduler.cli.")
        stand_in = click.Command(name, help=lazy.help)
        for limit in range(0, 160):
            assert stand_in.get_short_help_str(limit) == command.get_short_help_str(limit), name


@pytest.mark.parametrize("width", [40, 60, 80, 100, 200])
def test_the_lazy_listing_is_what_click_would_list(width: int) -> None:
    lazy = LazyGroup(name="schedule-lineage", lazy=COMMANDS, help=cli.help, params=cli.params)
    lazy_help = CliRunner().invoke(lazy, ["--help"], terminal_width=width).output
    assert lazy.loaded == {}
    eager = click.Group(
        name="schedule-lineage",
        commands=[lazy.commands[name] for name in COMMANDS],
        help=cli.help,
        params=cli.params,
    )
    assert lazy_help == CliRunner().invoke(eager, ["--help"], terminal_width=width).output


def test_the_group_knows_every_name_without_loading_any() -> None:
    group = LazyGroup(name="schedule-lineage", lazy=COMMANDS)
    assert sorted(group.commands) == sorted(COMMANDS) and len(group.commands) == len(COMMANDS)
    assert "status" in group.commands and "absent" not in group.commands
    typo = CliRunner().invoke(group, ["statu"])
    assert typo.exit_code == 2 and "Did you mean 'status'?" in typo.output
    assert group.loaded == {}
    assert group.commands.get("absent") is None
    assert group.commands.get("status") is group.get_command(click.Context(group), "status")
    assert list(group.loaded) == ["status"]


def test_no_cli_module_imports_a_command_module() -> None:
    """Command modules share only ``common``; the group names them only in its table."""
    modules = {path.stem for path in CLI_PACKAGE.glob("*.py")}
    command_modules = modules - {"__init__", "common"}
    targets = {lazy.target.split(":")[0].rsplit(".", 1)[1] for lazy in COMMANDS.values()}
    assert targets == command_modules
    for path in CLI_PACKAGE.glob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
                imported.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
        within = {name.removeprefix("scheduler.cli.") for name in imported}
        assert not within & command_modules, f"{path.name} imports {within & command_modules}"
        if path.stem in ("__init__", "common"):
            assert not {n for n in imported if n.startswith("scheduler.cli")}, path.name


def imported_test_modules(source: str) -> set[str]:
    """The test modules (``test_*``, at the top or under ``tests``) that ``source`` imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    found = set()
    for parts in (name.split(".") for name in names):
        if parts[0].startswith("test_"):
            found.add(parts[0])
        elif parts[0] == "tests" and len(parts) > 1 and parts[1].startswith("test_"):
            found.add(f"tests.{parts[1]}")
    return found


def test_the_test_import_check_sees_every_form_of_importing_a_test_module() -> None:
    source = (
        "from test_a import x\nimport tests.test_b\nfrom tests import test_c\n"
        "import support.fleet\nfrom support.sandbox import test_like_name\n"
    )
    assert imported_test_modules(source) == {"test_a", "tests.test_b", "tests.test_c"}


def test_no_test_module_imports_another() -> None:
    """Shared helpers and fixtures live in tests/support/, where bench/ finds them too."""
    for path in sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]):
        found = imported_test_modules(path.read_text())
        where = path.relative_to(ROOT)
        assert not found, f"{where} imports {sorted(found)}: move what it shares to tests/support/"


def test_every_module_holding_the_heavy_lock_is_in_the_heavy_unit() -> None:
    """Two processes each holding a heavy module would wait on the lock, not run side by
    side: the modules that take it are one unit of work (support.xdist_schedule)."""
    holding = set()
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        arguments = {
            arg.arg
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef)
            for arg in node.args.args
        }
        if "machine_to_itself" in arguments:
            holding.add(str(path.relative_to(ROOT)))
    assert holding == HEAVY_MODULES


def test_main_maps_failures_to_exit_statuses(monkeypatch: pytest.MonkeyPatch) -> None:
    import redis

    import scheduler.cli as cli_module
    from worker.instrument.errors import Refusal
    from worker.instrument.gitrepo import GitError
    from worker.instrument.store import StoreUnavailable

    def failing(exc: BaseException) -> None:
        def main(**_: object) -> None:
            raise exc

        monkeypatch.setattr(cli_module.cli, "main", main)

    for exc, status in (
        (Refusal("no"), 2),
        (GitError("unreachable"), 1),
        (StoreUnavailable("unreachable"), 1),
        (redis.ConnectionError("unreachable"), 1),
        (click.exceptions.Abort(), 130),
        (click.UsageError("bad"), 2),
    ):
        failing(exc)
        with pytest.raises(SystemExit) as exited:
            cli_module.main()
        assert exited.value.code == status, exc
    failing(KeyError("a bug"))
    with pytest.raises(KeyError):  # a bug keeps its traceback
        cli_module.main()
