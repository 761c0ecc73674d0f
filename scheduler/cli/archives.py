"""Publishing commands of ``schedule-lineage``: export, verify and import of lineage archives.

Imported only when one of them runs or its help is asked (see ``scheduler.cli``).
The work is ``scheduler.export``, ``scheduler.verify`` and ``scheduler.restore``;
here are the arguments and the words. ``verify`` prints each problem on a line of
its own (``problem: ...``) on stderr and exits 1; an archive it cannot read at all
is a refusal (exit 2), as is an ``import`` of an archive that does not verify.
``verify --replay`` then imports the archive into a scratch fleet of its own and replays
every generation there (``scheduler.replaying``), exiting 1 if one diverged.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import click

from scheduler.cli.common import load_settings
from scheduler.export import export_lineage
from scheduler.output import console, warn
from scheduler.restore import ArchiveProblems, restore
from scheduler.verify import check
from worker.fleet.assembly import observation_store
from worker.fleet.homes import Homes
from worker.fleet.places import require_places


@click.command("export")
@click.argument("name")
@click.option(
    "--to",
    "target",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Archive to write; never replaced [NAME.ouroboros.tar.gz].",
)
def export_command(name: str, target: Path | None) -> None:
    """Write lineage NAME, its observations, run records and metadata to one archive."""
    settings = load_settings()
    store = observation_store(settings)
    cache = Homes(settings, "scheduler", store).home_cache(name)
    done = export_lineage(name, target, cache, store)
    for note in done.notes:
        warn("note", note)
    m = done.manifest
    console.print(
        f"exported lineage {m.lineage}: {m.generations} generations to head {m.head[:12]}, "
        f"{done.observations} observations ({len(m.unobserved)} unobserved), {done.runs} run "
        f"records and the metadata to {done.path}",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    console.print(
        f"manifest sha256 {done.manifest_sha256} (publish it beside the archive)",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )


@click.command("verify")
@click.argument("archive", type=click.Path(path_type=Path, dir_okay=False))
@click.option(
    "--replay",
    "replaying",
    is_flag=True,
    help="Then replay every generation from the archive alone, under this instrument.",
)
def verify_command(archive: Path, replaying: bool) -> None:
    """Check an archive alone: sums, nothing missing or extra, observations match commits."""
    with tempfile.TemporaryDirectory(prefix="ouroboros-verify-") as scratch:
        checked = check(archive, Path(scratch))
    for problem in checked.problems:
        warn("problem", problem)
    if checked.problems or checked.manifest is None:
        warn("error", f"{archive} does not verify: {len(checked.problems)} problems")
        sys.exit(1)
    m = checked.manifest
    console.print(
        f"verified {archive}: lineage {m.lineage}, {m.generations} generations to head "
        f"{m.head[:12]}, {len(checked.observations)} observations ({len(m.unobserved)} "
        f"declared unobserved), {len(checked.runs)} run records, metadata; every sum holds",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    console.print(
        f"manifest sha256 {checked.manifest_sha256}", highlight=False, markup=False, soft_wrap=True
    )
    if replaying and _replayed_diverged(archive, m.lineage):
        sys.exit(1)


def _replayed_diverged(archive: Path, lineage: str) -> bool:
    """Replay every generation of the archive in a fleet of its own, made in a scratch
    directory and discarded; whether one diverged. Only this host's sandbox settings
    (ceiling, identities, prices) are this fleet's: the lineage, its records and the
    replay reports stay in the scratch fleet."""
    from scheduler.replaying import replay_lineage
    from worker.fleet.assembly import build_pipeline

    settings = load_settings()
    with tempfile.TemporaryDirectory(prefix="ouroboros-verify-replay-") as scratch:
        own = settings.model_copy(
            update={
                "home": Path(scratch),
                "lineage_repo": "",
                "lineage_repos": {},
                "observations": "",
                "state_dir": None,
            }
        )
        store = observation_store(own)
        restore(archive, Homes(own, "scheduler", store), None, store)
        pipeline = build_pipeline(own, cache_role="replay")
        return bool(replay_lineage(pipeline, lineage, (None, None), console)["diverged"])


@click.command("import")
@click.argument("archive", type=click.Path(path_type=Path, dir_okay=False))
@click.option(
    "--home",
    metavar="HOME",
    help="The shared repository (OUROBOROS_LINEAGE_REPOS) to add it to [chosen by its name].",
)
def import_command(archive: Path, home: str | None) -> None:
    """Add the lineage of an export archive, verified first, to this fleet (write-once).

    A lineage already here stays in its home; a new one goes to the home --home names,
    else to the one its name chooses."""
    settings = load_settings()
    require_places(settings, write=True, missing_ok=True)
    store = observation_store(settings)
    homes = Homes(settings, "scheduler", store)
    if home is not None:
        homes.require(home)
    try:
        done = restore(archive, homes, home, store)
    except ArchiveProblems as exc:
        for problem in exc.problems:
            warn("problem", problem)
        raise
    branch = "created" if done.branch_created else "already there"
    console.print(
        f"imported lineage {done.lineage} (branch lineage-{done.lineage} at {done.head[:12]}, "
        f"{branch}) into {done.repository}; {done.written} records written, "
        f"{done.present} already present",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
