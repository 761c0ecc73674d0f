"""``schedule-lineage replay``: generations lived again from their observations.

Imported only when it runs (see ``scheduler.cli``). Parses which generations
(``NAME@GEN``, ``NAME@A..B`` or ``NAME --all``), builds the pipeline as ``run --local``
does but on caches of its own (``Pipelines(cache_role="replay")``, one per home), and replays
them (``scheduler.replaying``), each report kept as the generation's latest replay;
with ``--fleet`` the workers of the lineage's instrument replay them instead.
Nothing else is written: no lease, branch, observation, run record or spool; no
provider is reached.

Exit status: 2 when the request is refused (a bad range, no such lineage, every
generation asked for recorded under another instrument, or on the fleet no live
worker serving its queue: one line), 1 when any generation diverged (or, on the
fleet, never reported), else 0 (``not replayable`` is the record's limit, not a
failure of the instrument).
"""

from __future__ import annotations

import re
import sys

import click

from scheduler.cli.common import load_settings
from scheduler.output import console
from worker.fleet.assembly import Pipelines
from worker.fleet.places import require_places
from worker.instrument.errors import Refusal
from worker.instrument.lineage import check_name

_TARGET = re.compile(r"^(?P<name>[^@]+)(?:@(?P<first>\d{1,9})(?:\.\.(?P<last>\d{1,9}))?)?$")


def parse_target(target: str, everything: bool) -> tuple[str, int | None, int | None]:
    """NAME, and the first and last generation asked for (None, None: every one)."""
    match = _TARGET.match(target)
    if match is None:
        raise Refusal(f"{target!r}: give NAME@GEN, NAME@A..B or NAME --all")
    name = check_name(match["name"])
    first, last = match["first"], match["last"] or match["first"]
    if first is None and not everything:
        raise Refusal(f"which generations of {name}? give {name}@GEN, {name}@A..B or --all")
    if first is not None and everything:
        raise Refusal(f"{target}: --all replays every generation; give a range or --all")
    if first is None:
        return name, None, None
    low, high = int(first), int(last)
    if low < 1 or high < low:
        raise Refusal(f"{target}: a range runs from generation 1 or later up to A..B with B >= A")
    return name, low, high


@click.command("replay")
@click.argument("target")
@click.option("--all", "everything", is_flag=True, help="Replay every generation of NAME.")
@click.option(
    "--fleet",
    "on_fleet",
    is_flag=True,
    help="Replay on the fleet's workers, one task per generation, instead of here.",
)
@click.option(
    "--ceiling",
    type=click.Choice(["auto", "systemd", "cgroup2", "cgroup1"]),
    help="Resource ceiling driver, here [OUROBOROS_CEILING].",
)
def replay_command(target: str, everything: bool, on_fleet: bool, ceiling: str | None) -> None:
    """Live generations of NAME again from their observations and judge them (here, or --fleet)."""
    from scheduler.replaying import replay_lineage, replay_on_fleet

    name, first, last = parse_target(target, everything)
    settings = load_settings()
    require_places(settings, write=True)
    if on_fleet:
        verdicts = replay_on_fleet(settings, name, (first, last), console)
    else:
        pipelines = Pipelines(settings, ceiling, cache_role="replay")
        verdicts = replay_lineage(pipelines.of(name), name, (first, last), console)
    if verdicts["diverged"] or verdicts["unreported"]:
        sys.exit(1)
