"""The ``schedule-lineage`` command line.

Owns argument parsing and presentation (click, rich). Every refusal is one clear
line on stderr with exit status 2 and no traceback; the work itself is done by the
worker's pipeline and the scheduler's modules, never here.
"""

from __future__ import annotations

import sys
from decimal import Decimal
from pathlib import Path

import click
from pydantic import ValidationError
from rich.console import Console

from worker.assembly import build_pipeline, lineage_cache, observation_store
from worker.errors import Refusal, StaleJob
from worker.generation import GenerationJob
from worker.instrument import current, instrument_commit, instrument_provenance
from worker.lineage import create_lineage, read_seed
from worker.physics import Physics
from worker.settings import Settings

console = Console()
errors = Console(stderr=True)


def load_settings() -> Settings:
    try:
        return Settings()
    except ValidationError as exc:
        first = exc.errors()[0]
        field = "OUROBOROS_" + str(first["loc"][0]).upper() if first["loc"] else "configuration"
        raise Refusal(f"{field}: {first['msg']}") from None


def physics_from(options: dict[str, object]) -> Physics:
    given = {key: value for key, value in options.items() if value is not None}
    try:
        return Physics(**given)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = first["loc"][0] if first["loc"] else ""
        option = f"--{str(where).replace('_', '-')}: " if where else ""
        raise Refusal(f"{option}{first['msg']}") from None


@click.group()
def cli() -> None:
    """Create lineages of self-modifying Emacs Lisp organisms and run their generations."""


@cli.command()
@click.argument("name")
@click.option("--seed", type=click.Path(path_type=Path), help="Seed organism (default: canonical).")
@click.option("--wall", "wall_seconds", type=int, help="Wall seconds per life [600].")
@click.option("--cpu-seconds", type=int, help="Aggregate CPU seconds per life [120].")
@click.option("--memory-max", "memory_max_bytes", help="Memory ceiling, e.g. 1G [1G].")
@click.option("--memory-swap-max", "memory_swap_max_bytes", help="Swap ceiling [0].")
@click.option("--tasks-max", type=int, help="Task (process/thread) ceiling [64].")
@click.option("--work-bytes", help="Size of /work [256M].")
@click.option("--work-files", type=int, help="Files published from /work [10000].")
@click.option("--tmp-bytes", help="Size of /tmp [64M].")
@click.option("--run-bytes", help="Size of /run [16M].")
@click.option("--max-prompt-bytes", type=int, help="Largest prompt [196608].")
@click.option("--max-output-tokens", type=int, help="Largest reply in tokens [12000].")
@click.option("--model-timeout", "model_timeout_seconds", type=int, help="Model timeout s [600].")
@click.option("--budget-usd", type=Decimal, help="Spending budget per generation [1.00].")
def init(name: str, seed: Path | None, **physics_options: object) -> None:
    """Create lineage NAME: branch lineage-NAME with its seed commit and pinned physics."""
    settings = load_settings()
    physics = physics_from(physics_options)
    instrument = current()
    commit = instrument_commit(settings.instrument_commit)
    repository, ref = instrument_provenance()
    meta = create_lineage(
        name=name,
        seed=read_seed(seed) if seed else instrument.seed,
        physics=physics,
        instrument=instrument,
        commit=commit,
        repository=repository,
        ref=ref,
        repo_url=settings.lineage_repo_url,
        cache=lineage_cache(settings),
        store=observation_store(settings),
    )
    console.print(
        f"created lineage [bold]{meta.name}[/] (branch lineage-{meta.name}) in "
        f"{settings.lineage_repo_url}; instrument {meta.instrument_fingerprint[:12]}"
    )


@cli.command()
@click.argument("names", nargs=-1, required=True)
@click.option("--generations", type=click.IntRange(1, 1_000_000), required=True)
@click.option("--local", is_flag=True, help="Run in this process, without a broker.")
@click.option("--provider", help="Model provider [OUROBOROS_MODEL_PROVIDER].")
@click.option("--model", help="Model name [OUROBOROS_MODEL_NAME].")
@click.option("--ceiling", type=click.Choice(["auto", "systemd", "cgroup2", "cgroup1"]))
def run(
    names: tuple[str, ...],
    generations: int,
    local: bool,
    provider: str | None,
    model: str | None,
    ceiling: str | None,
) -> None:
    """Run N generations of each lineage NAME."""
    settings = load_settings()
    if not local:
        raise Refusal("only --local runs exist in this build; pass --local")
    from worker.broker import make_provider

    provider = provider or settings.model_provider
    model = model or settings.model_name
    make_provider(provider, model, settings)
    pipeline = build_pipeline(settings, ceiling)
    for name in names:
        pipeline.head(name)
    for name in names:
        for _ in range(generations):
            job = GenerationJob(
                lineage=name, expected_commit=pipeline.head(name), provider=provider, model=model
            )
            try:
                report = pipeline.run(job)
            except StaleJob as exc:
                errors.print(f"[yellow]stale[/]: {exc}")
                continue
            pending = "" if report.observation_stored else " (observation pending)"
            console.print(
                f"{name} gen {report.generation}: [bold]{report.outcome}[/] "
                f"{report.commit[:12]} spent ${report.spent_usd}{pending}"
            )


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        errors.print("aborted")
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(2 if exc.exit_code == 2 else exc.exit_code)
    except Refusal as exc:
        errors.print(f"[red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_status)
