"""Commands that make and drive lineages: ``init``, ``fork``, ``run``, ``cancel``, ``reconcile``.

Imported only when one of them runs (see ``scheduler.cli``); ``run --local`` builds
the same pipeline the Celery task runs, through ``worker.fleet.assembly``, and says
what each life waits for from the model socket's own log (``_Waits``). The
broker's side (Redis, the planner, the progress display) is imported by the commands
that talk to the fleet, so ``run --local`` never pays for it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
from pydantic import ValidationError
from rich.text import Text

from scheduler.cli.common import USD, load_settings
from scheduler.cohorts import MAX_REPLICATES, members, replicate_names
from scheduler.fork import describe as describe_fork
from scheduler.fork import resolve, seed_of
from scheduler.output import console, plain, warn
from worker.fleet.assembly import Pipelines, observation_store
from worker.fleet.homes import Homes
from worker.fleet.places import require_places
from worker.fleet.repo_admin import ensure_shared_repo
from worker.fleet.settings import Settings
from worker.instrument.errors import Refusal, StaleJob
from worker.instrument.fingerprint import current, instrument_commit, instrument_provenance
from worker.instrument.gitrepo import Entry, GitError
from worker.instrument.job import GenerationJob
from worker.instrument.lineage import (
    LineageMetadata,
    Parentage,
    check_cohort,
    check_name,
    create_lineage,
    read_seed,
    root_metadata,
)
from worker.instrument.model.catalogue import require_known
from worker.instrument.model.engine import waits
from worker.instrument.model.providers import make_provider
from worker.instrument.physics import Physics
from worker.instrument.store import StoreUnavailable

if TYPE_CHECKING:
    import redis

F = TypeVar("F", bound=Callable[..., Any])


def physics_from(options: dict[str, object], base: Physics | None = None) -> Physics:
    """``base`` (the defaults when None) with every option given replacing its field."""
    given = {key: value for key, value in options.items() if value is not None}
    try:
        return Physics(**{**(base.model_dump() if base else {}), **given})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = first["loc"][0] if first["loc"] else ""
        option = f"--{str(where).replace('_', '-')}: " if where else ""
        raise Refusal(f"{option}{first['msg']}") from None


PHYSICS_OPTIONS = [
    click.option("--wall", "wall_seconds", type=int, help="Wall seconds per life [600]."),
    click.option("--cpu-seconds", type=int, help="Aggregate CPU seconds per life [120]."),
    click.option("--memory-max", "memory_max_bytes", help="Memory ceiling, e.g. 1G [1G]."),
    click.option("--memory-swap-max", "memory_swap_max_bytes", help="Swap ceiling [0]."),
    click.option("--tasks-max", type=int, help="Task (process/thread) ceiling [64]."),
    click.option("--work-bytes", help="Size of /work [256M]."),
    click.option("--work-files", type=int, help="Files published from /work [10000]."),
    click.option("--tmp-bytes", help="Size of /tmp [64M]."),
    click.option("--run-bytes", help="Size of /run [16M]."),
    click.option("--max-prompt-bytes", type=int, help="Largest prompt [196608]."),
    click.option("--max-output-tokens", type=int, help="Largest reply in tokens [12000]."),
    click.option(
        "--model-timeout", "model_timeout_seconds", type=int, help="Model timeout s [600]."
    ),
    click.option(
        "--model-margin",
        "model_margin_seconds",
        type=int,
        help="Seconds a model call leaves before the wall [10].",
    ),
    click.option("--budget-usd", type=USD, help="Spending budget per generation [1.00]."),
    click.option(
        "--generation-repo-bytes",
        help="What a generation may add to the shared repository [8M].",
    ),
    click.option(
        "--lineage-repo-bytes", help="What a lineage may add to the shared repository [1G]."
    ),
]


def physics_options(command: F) -> F:
    """The pinned-physics options ``init`` and ``fork`` share, in one place."""
    for option in reversed(PHYSICS_OPTIONS):
        command = option(command)
    return command


HOME_OPTION = click.option(
    "--home",
    metavar="HOME",
    help="The shared repository (OUROBOROS_LINEAGE_REPOS) to make it in [chosen by its name].",
)

COHORT_OPTION = click.option(
    "--cohort",
    metavar="LABEL",
    help="Record the new lineage(s) in cohort LABEL (a-z 0-9 . _ -).",
)


@click.command()
@click.argument("name")
@click.option("--seed", type=click.Path(path_type=Path), help="Seed organism (default: canonical).")
@click.option(
    "--replicates",
    type=click.IntRange(1, MAX_REPLICATES),
    help="Create K lineages NAME-1..NAME-K from one seed and physics, as cohort NAME.",
)
@COHORT_OPTION
@HOME_OPTION
@physics_options
def init(
    name: str,
    seed: Path | None,
    replicates: int | None,
    cohort: str | None,
    home: str | None,
    **physics_options: object,
) -> None:
    """Create lineage NAME: branch lineage-NAME with its seed commit and pinned physics.

    With --replicates K, K lineages NAME-1..NAME-K of the same seed and physics,
    recorded as one cohort (NAME unless --cohort says otherwise); none is created if
    any of the names is taken. Each goes to the home --home names, else to the one its
    name chooses (worker.fleet.homes).
    """
    settings = load_settings()
    physics = physics_from(physics_options)
    check_name(name)
    names = replicate_names(name, replicates) if replicates else [name]
    label = check_cohort(cohort) if cohort else (name if replicates else None)
    body = read_seed(seed) if seed else current().seed
    homes = scheduler_homes(settings)
    if home is not None:
        homes.require(home)
    for made in require_places(settings, write=True, create=True):
        warn("note", made)
    chosen = {each: homes.claim(each, home) for each in names}
    for each in names:
        meta = create(homes, each, body, physics, home=chosen[each], cohort=label)
        console.print(
            Text.assemble(
                "created lineage ",
                (meta.name, "bold"),
                f" (branch lineage-{meta.name}) in {settings.lineage_homes[meta.home_name]}",
                f" (home {meta.home_name})" if len(settings.lineage_homes) > 1 else "",
                f"; instrument {meta.instrument_fingerprint[:12]}",
                f"; cohort {label}" if label else "",
            )
        )


def scheduler_homes(settings: Settings) -> Homes:
    """The scheduler's caches of every home, with the store that names a missing one's."""
    return Homes(settings, "scheduler", observation_store(settings))


def create(
    homes: Homes,
    name: str,
    seed: bytes,
    physics: Physics,
    *,
    home: str,
    files: dict[str, Entry] | None = None,
    parent: Parentage | None = None,
    cohort: str | None = None,
) -> LineageMetadata:
    """A new lineage pinned to the instrument running here (``init`` and ``fork``), in
    ``home``; a fork's ``files`` are already in that home's cache."""
    settings = homes.settings
    repository, ref = instrument_provenance()
    ensure_shared_repo(settings.lineage_homes[home])
    return create_lineage(
        name=name,
        seed=seed,
        physics=physics,
        instrument=current(),
        commit=instrument_commit(settings.instrument_commit),
        repository=repository,
        ref=ref,
        cache=homes.cache(home),
        store=observation_store(settings),
        files=files,
        parent=parent,
        cohort=cohort,
        home=home,
    )


@click.command()
@click.argument("name")
@click.option(
    "--from",
    "source_spec",
    required=True,
    metavar="NAME[@GEN]",
    help="Lineage to fork; @N its generation N (0: the seed), @COMMIT any commit [head].",
)
@COHORT_OPTION
@HOME_OPTION
@physics_options
def fork(
    name: str, source_spec: str, cohort: str | None, home: str | None, **physics_options: object
) -> None:
    """Create lineage NAME seeded from a generation of another, under this instrument.

    NAME goes to the home --home names, else to the one its name chooses, whatever the
    parent's: the seed's objects are copied there from the parent's home.
    """
    settings = load_settings()
    check_name(name)
    if cohort:
        check_cohort(cohort)
    require_places(settings, write=True)
    homes = scheduler_homes(settings)
    cache = homes.home_cache(source_spec.partition("@")[0])
    source = resolve(cache, source_spec)
    physics = physics_from(physics_options, source.physics)
    seed = seed_of(cache, source, physics)
    target = homes.claim(name, home)
    ensure_shared_repo(settings.lineage_homes[target])
    homes.cache(target).adopt(cache, seed.tree)
    meta = create(
        homes,
        name,
        seed.body,
        physics,
        home=target,
        files=seed.files,
        parent=seed.parent,
        cohort=cohort,
    )
    for line in describe_fork(meta, source):
        console.print(line, highlight=False, markup=False)
    if meta.cohort:
        console.print(f"cohort: {meta.cohort}", highlight=False, markup=False)


@click.command()
@click.argument("names", nargs=-1)
@click.option("--cohort", metavar="LABEL", help="Run every lineage of cohort LABEL too.")
@click.option(
    "--generations",
    type=click.IntRange(1, 1_000_000),
    required=True,
    help="How many more generations each lineage should live.",
)
@click.option("--local", is_flag=True, help="Run in this process, without a broker.")
@click.option("--provider", help="Model provider [OUROBOROS_MODEL_PROVIDER].")
@click.option("--model", help="Model name [OUROBOROS_MODEL_NAME].")
@click.option(
    "--budget-usd", type=USD, help="Total budget of the run [per-generation budget times N]."
)
@click.option(
    "--ceiling",
    type=click.Choice(["auto", "systemd", "cgroup2", "cgroup1"]),
    help="Resource ceiling driver for --local [OUROBOROS_CEILING].",
)
@click.option("--follow", is_flag=True, help="Show live progress until the runs stop.")
@click.option("--wait", is_flag=True, help="Wait quietly until the runs stop.")
def run(
    names: tuple[str, ...],
    cohort: str | None,
    generations: int,
    local: bool,
    provider: str | None,
    model: str | None,
    budget_usd: Decimal | None,
    ceiling: str | None,
    follow: bool,
    wait: bool,
) -> None:
    """Run N more generations of each lineage NAME (on the fleet, or --local)."""
    settings = load_settings()
    if cohort:
        names = _with_cohort(settings, names, cohort)
    elif not names:
        raise Refusal("name the lineages to run (NAME...), or a cohort with --cohort LABEL")
    provider = provider or settings.model_provider
    # OUROBOROS_MODEL_NAME names the model of OUROBOROS_MODEL_PROVIDER, no other's.
    model = model or (settings.model_name if provider == settings.model_provider else None)
    require_places(settings, write=local)
    if local:
        run_local(settings, list(names), generations, provider, model, ceiling)
        return
    from scheduler.follow import NoWorker, SourceLost, describe, watch
    from scheduler.status import FleetClient
    from worker.fleet.capabilities import unservable
    from worker.fleet.runs import job_of, queue_of

    require_known(provider)
    fleet = FleetClient(settings)
    planner = fleet.planner
    heads: dict[str, str] = {}
    for name in names:
        check_name(name)
        head = planner.homes.fetch(name)
        if head is None:
            raise Refusal(f"no lineage named {name}; create it with schedule-lineage init")
        heads[name] = head
    metas = {name: planner.homes.metadata(name, head) for name, head in heads.items()}
    for meta in metas.values():
        planner.require_deliverable(meta)
    # Refused before any run is recorded: prices the run cannot be charged at, or live
    # workers of which none can serve the provider (with none live, the run waits).
    planner.run_prices(provider, model)
    for queue in sorted({queue_of(meta) for meta in metas.values()}):
        unserved = unservable(planner.client, queue, provider)
        if unserved:
            raise Refusal(unserved)
    # Whether live workers serve these queues: asked while the runs are recorded and
    # enqueued, and answered as soon as they all are (a second when one is not).
    pool = ThreadPoolExecutor(1, thread_name_prefix="ask-workers")
    asking = pool.submit(fleet.workers, {queue_of(meta) for meta in metas.values()})
    for name, head in heads.items():
        physics = metas[name].physics
        budget = budget_usd if budget_usd is not None else physics.budget_usd * generations
        record = planner.start_run(name, head, generations, provider, model, budget)
        planner.enqueue(name, job_of(record, head, record.budget_usd))
        console.print(
            f"run {record.run_id}: {name} to generation {record.target_generation}, "
            f"budget ${record.budget_usd}, {provider}",
            highlight=False,
        )
    try:
        workers = asking.result()
        pool.shutdown()
        if not (follow or wait):
            for meta in metas.values():
                waiting = fleet.waiting(meta, workers)
                if waiting:
                    warn("note", waiting)
            return
        final = watch(
            fleet,
            list(names),
            console,
            follow,
            settings.worker_wait_seconds,
            workers,
            settings.follow_outage_seconds,
        )
    except (NoWorker, SourceLost) as exc:
        warn("giving up", exc)
        sys.exit(1)
    except KeyboardInterrupt:
        # The runs are recorded and enqueued: only this command stops, never a run.
        listed = " ".join(names)
        warn(
            "stopped following",
            f"the runs go on on the fleet; see schedule-lineage status {listed}; "
            "stop one with schedule-lineage cancel NAME",
        )
        sys.exit(130)
    for status in final:
        console.print(plain(describe(status)), highlight=False)
    if any(status.blocked and not status.stopped for status in final):
        sys.exit(1)


def _with_cohort(settings: Settings, names: tuple[str, ...], label: str) -> tuple[str, ...]:
    """``names`` followed by every lineage of cohort ``label`` not among them."""
    from scheduler.status import FleetClient

    check_cohort(label)
    require_places(settings, write=False)
    cohort = members(FleetClient(settings, start_broker=False).metadata, label)
    return (*names, *(name for name in cohort if name not in names))


def run_local(
    settings: Settings,
    names: list[str],
    generations: int,
    provider: str,
    model: str | None,
    ceiling: str | None,
) -> None:
    """Generations in this process, through the same pipeline the Celery task runs."""
    make_provider(provider, model, settings)
    pipelines = Pipelines(settings, ceiling)
    for name in names:
        pipelines.of(name).head(name)
    shown = _Waits()
    waits.addHandler(shown)
    waits.setLevel(logging.DEBUG)
    waits.propagate = False  # shown here, once, whatever logging a library configured
    for name in names:
        for _ in range(generations):
            pipeline = pipelines.of(name)
            head = pipeline.head(name)
            job = GenerationJob(lineage=name, expected_commit=head, provider=provider, model=model)
            number = pipeline.cache.history(name, head).generations + 1
            wall = root_metadata(pipeline.cache, head, name).physics.wall_seconds
            shown.life = f"{name} gen {number}"
            console.print(
                f"{shown.life}: living from {_clock()} UTC (wall {wall} s)", highlight=False
            )
            try:
                report = pipeline.run(job)
            except StaleJob as exc:
                warn("stale", exc)
                continue
            pending = "" if report.observation_stored else " (observation pending)"
            console.print(
                Text.assemble(
                    f"{name} gen {report.generation}: ",
                    (report.outcome, "bold"),
                    f" {report.commit[:12]} spent ${report.spent_usd}{pending}",
                ),
                highlight=False,
            )


class _Waits(logging.Handler):
    """Prints what the life of ``run --local`` waits for, from the model socket's log.

    Its lines are the instrument's own words (``worker.instrument.model.engine.waits``):
    a model call's attempt as it starts, and a failed attempt with the time of the next.
    """

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.life = ""

    def emit(self, record: logging.LogRecord) -> None:
        console.print(f"{self.life}: {record.getMessage()}", highlight=False, markup=False)


def _clock() -> str:
    return datetime.now(UTC).strftime("%H:%M:%S")


@click.command()
@click.argument("name")
def cancel(name: str) -> None:
    """Stop NAME's run after the generation in flight (if any) lands."""
    from scheduler.status import FleetClient

    settings = load_settings()
    check_name(name)
    require_places(settings, write=False)
    cancelled = FleetClient(settings).planner.cancel(name)
    if cancelled is None:
        raise Refusal(f"lineage {name} has no active run to cancel")
    console.print(f"cancelled run {cancelled.run_id} of {name}")


@click.command()
@click.argument("name")
@click.option("--to", "home", required=True, metavar="HOME", help="The home to move it to.")
def move(name: str, home: str) -> None:
    """Move lineage NAME to another shared repository (home), while no run drives it.

    Its branch is copied to HOME's repository and then deleted from the one it leaves;
    its history, observations and records are untouched. Refused while it has an active
    run or a generation in flight: cancel the run and let that generation land first.
    """
    from scheduler.status import FleetClient

    settings = load_settings()
    check_name(name)
    require_places(settings, write=True)
    fleet = FleetClient(settings, start_broker=False)
    planner = fleet.planner
    planner.homes.require(home)
    run = planner.latest_run(name)
    if run is not None and run.status == "active":
        raise Refusal(
            f"lineage {name} has an active run ({run.run_id}); stop it with "
            f"schedule-lineage cancel {name}, then move it"
        )
    if fleet.broker_up:
        from worker.fleet import markers

        if markers.in_flight(planner.client, name):
            raise Refusal(
                f"lineage {name} has a generation in flight; move it once that lands "
                f"(schedule-lineage status {name})"
            )
    sources, head = planner.homes.move(name, home)
    console.print(
        f"moved lineage {name} (branch lineage-{name} at {head[:12]}) from home "
        f"{' and '.join(sorted(sources))} "
        f"to home {home} ({settings.lineage_homes[home]})",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )


@click.command()
@click.option(
    "--loop", is_flag=True, help="Keep reconciling every OUROBOROS_RECONCILE_INTERVAL_SECONDS."
)
def reconcile(loop: bool) -> None:
    """Re-enqueue every lineage whose run wants more and has nothing in flight."""
    import redis
    from kombu.exceptions import OperationalError

    from scheduler.status import FleetClient

    settings = load_settings()
    fleet = FleetClient(settings)
    if not loop:
        enqueued = fleet.planner.reconcile()
        console.print(f"reconcile: enqueued {', '.join(enqueued) or 'nothing'}")
        return
    while True:
        try:
            enqueued = fleet.planner.reconcile()
        except (redis.RedisError, OperationalError, StoreUnavailable, GitError, Refusal) as exc:
            # A lost broker or store is exactly what the loop exists to outlive.
            warn("reconcile", f"{exc}; retrying")
        else:
            if enqueued:
                console.print(f"reconcile: enqueued {', '.join(enqueued)}", highlight=False)
        until_next_pass(fleet.planner.client, settings.reconcile_interval_seconds)


# How often the loop asks the broker whether it restarted, between two passes.
RESTART_CHECK_SECONDS = 0.5


def until_next_pass(client: redis.Redis, interval: float) -> None:
    """Wait ``interval`` seconds, or only until the broker is back from a restart.

    A Redis that restarted (its run id changed, or it did not answer and now does) may
    have lost every queued job and in-flight marker: the lineages they stood for wait
    for the next pass, so it comes at once.
    """
    import redis

    def run_id() -> str | None:
        try:
            return str(client.info("server")["run_id"])
        except redis.RedisError:
            return None

    deadline = time.monotonic() + interval
    seen = run_id()
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(RESTART_CHECK_SECONDS, left))
        now = run_id()
        if now is not None and now != seen:
            return
