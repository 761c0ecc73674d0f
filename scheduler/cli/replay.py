"""``schedule-lineage replay``: generations lived again from their observations, here.

Imported only when it runs (see ``scheduler.cli``). Parses which generations
(``NAME@GEN``, ``NAME@A..B`` or ``NAME --all``), builds the pipeline as ``run --local``
does but on a cache of its own (``build_pipeline(cache_role="replay")``), replays each
generation through ``worker.instrument.replay`` and keeps each report as the
generation's latest replay. Nothing else is written: no lease, branch, observation,
run record or spool; no provider is reached.

Exit status: 2 when the request is refused (a bad range, no such lineage, or every
generation asked for recorded under another instrument: one line naming it), 1 when
any generation diverged, else 0 (``not replayable`` is the record's limit, not a
failure of the instrument).
"""

from __future__ import annotations

import re
import sys
from collections import Counter

import click
from rich.text import Text

from scheduler.cli.common import load_settings
from scheduler.output import console, plain
from worker.fleet.assembly import build_pipeline
from worker.fleet.places import require_places
from worker.instrument.errors import Refusal
from worker.instrument.lineage import check_name
from worker.instrument.records import Observation, ReplayReport
from worker.instrument.store_keys import generation_key

_TARGET = re.compile(r"^(?P<name>[^@]+)(?:@(?P<first>\d{1,9})(?:\.\.(?P<last>\d{1,9}))?)?$")
VERDICT_STYLES = {"reproduced": "green", "diverged": "bold red", "not replayable": "yellow"}


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
    "--ceiling",
    type=click.Choice(["auto", "systemd", "cgroup2", "cgroup1"]),
    help="Resource ceiling driver [OUROBOROS_CEILING].",
)
def replay_command(target: str, everything: bool, ceiling: str | None) -> None:
    """Live generations of NAME again from their observations, in this process, and judge them."""
    from worker.instrument.replay import generation_commits, keep, replay

    name, first, last = parse_target(target, everything)
    settings = load_settings()
    require_places(settings, write=True)
    pipeline = build_pipeline(settings, ceiling, cache_role="replay")
    commits = generation_commits(pipeline.cache, pipeline.head(name))
    numbers = sorted(
        n for n in commits if first is None or (last is not None and first <= n <= last)
    )
    if not numbers:
        raise Refusal(f"{target}: lineage {name} has no such generation (it has {len(commits)})")
    records: dict[int, Observation | None] = {}
    for number in numbers:
        raw = pipeline.store.get(generation_key(name, number))
        records[number] = Observation.model_validate_json(raw) if raw is not None else None
    here = pipeline.instrument.fingerprint
    recorded = [o for o in records.values() if o is not None]
    foreign = {o.provenance.instrument_fingerprint for o in recorded} - {here}
    if recorded and all(o.provenance.instrument_fingerprint != here for o in recorded):
        raise Refusal(
            f"{target} was recorded under instrument {', '.join(sorted(foreign))}, not this "
            f"one ({here[:12]}); replay it with the instrument that made the record"
        )
    verdicts: Counter[str] = Counter()
    for number in numbers:
        observation = records[number]
        if observation is None:
            console.print(f"{name} gen {number}: no observation to replay", highlight=False)
            verdicts["not replayable"] += 1
            continue
        console.print(f"{name} gen {number}: replaying ({observation.outcome})", highlight=False)
        report = replay(pipeline, observation, commits[number])
        keep(pipeline.store, report)
        verdicts[report.verdict] += 1
        _show(report)
    console.print(
        f"{name}: {verdicts['reproduced']} reproduced, {verdicts['diverged']} diverged, "
        f"{verdicts['not replayable']} not replayable",
        highlight=False,
    )
    if verdicts["diverged"]:
        sys.exit(1)


def _show(report: ReplayReport) -> None:
    line = Text.assemble(
        f"{report.lineage} gen {report.generation}: ",
        (report.verdict, VERDICT_STYLES[report.verdict]),
        f" ({report.duration_seconds:.1f} s)",
    )
    if report.reason:
        line.append(" — ")
        line.append(plain(report.reason))
    console.print(line, highlight=False)
    if report.likely_cause:
        console.print(plain(f"  likely cause: {report.likely_cause}"), highlight=False)
    if report.verdict == "diverged" and report.detail:
        console.print(plain(report.detail), highlight=False)
