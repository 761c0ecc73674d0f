"""Curves over generations: thinning to a chart's points, running totals, the median of
several lineages and the share of lineages that lived or changed at each generation.

Owns the arithmetic behind the lineage page's series and the overlays of a cohort, of a
chosen set of lineages and of a fork beside its parent. Pure functions of figures
already read (no store, no repository), so each is tested on its own.

Trusts: its inputs, numbers and outcomes from the fixed vocabulary.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence

from scheduler.views import Curve, GridCell, Overlay, Series, SeriesPoint, is_death

CHART_POINTS = 300
# Squares in a lineage's strip of outcomes before generations share one.
STRIP_CELLS = 600
Values = Sequence[tuple[int, float | None]]


def bucket_for(length: int) -> int:
    """How many generations one point stands for, so that ``length`` fit CHART_POINTS."""
    return max(1, -(-length // CHART_POINTS))


def thinned(values: Values, bucket: int) -> list[SeriesPoint]:
    """Each run of ``bucket`` (generation, value) pairs as one point: its maximum, at its
    first generation; a run with no value gives none."""
    points = []
    for start in range(0, len(values), bucket):
        chunk = values[start : start + bucket]
        known = [value for _, value in chunk if value is not None]
        if known:
            points.append(SeriesPoint(generation=chunk[0][0], value=max(known)))
    return points


def bucketed(key: str, title: str, unit: str, values: Values) -> Series:
    """One series of (generation, value) pairs, each bucket's maximum, at most CHART_POINTS."""
    bucket = bucket_for(len(values))
    return Series(key=key, title=title, unit=unit, bucket=bucket, points=thinned(values, bucket))


def cumulative(values: Iterable[tuple[int, float]]) -> list[tuple[int, float]]:
    """The running total of ``values`` at each of their generations."""
    total, running = 0.0, []
    for generation, value in values:
        total += value
        running.append((generation, total))
    return running


def since(values: Iterable[tuple[int, float]], offset: int) -> list[tuple[int, float]]:
    """``values`` after generation ``offset``, renumbered to count from it (offset + 1 is 1)."""
    return [(generation - offset, value) for generation, value in values if generation > offset]


def median(curves: Iterable[Sequence[tuple[int, float]]]) -> list[tuple[int, float]]:
    """At each generation, the median value of the curves that have one there."""
    at: dict[int, list[float]] = {}
    for curve in curves:
        for generation, value in curve:
            at.setdefault(generation, []).append(value)
    return [(generation, statistics.median(at[generation])) for generation in sorted(at)]


def shares(outcomes: Iterable[Mapping[int, str]]) -> tuple[list[tuple[int, float]], ...]:
    """Per generation, the percentage of lineages reaching it whose generation lived (did
    not die) and whose generation changed the organism: (lived, changed)."""
    reached: dict[int, list[str]] = {}
    for lineage in outcomes:
        for generation, outcome in lineage.items():
            reached.setdefault(generation, []).append(outcome)
    lived, changed = [], []
    for generation in sorted(reached):
        found = reached[generation]
        lived.append((generation, 100 * sum(not is_death(o) for o in found) / len(found)))
        changed.append((generation, 100 * sum(o == "changed" for o in found) / len(found)))
    return lived, changed


def overlay(
    key: str,
    title: str,
    unit: str,
    curves: Sequence[tuple[Curve, Sequence[tuple[int, float]]]],
    *,
    with_median: bool,
    axis: str = "generation",
) -> Overlay:
    """Curves (each a curve to fill and its full values) thinned alike, so that their
    points and the median's (computed before thinning) fall at the same generations."""
    bucket = bucket_for(max((len(values) for _, values in curves), default=0))
    middle = median(values for _, values in curves) if with_median else None
    return Overlay(
        key=key,
        title=title,
        unit=unit,
        axis=axis,
        bucket=bucket,
        curves=[curve.model_copy(update={"points": thinned(v, bucket)}) for curve, v in curves],
        median=thinned(middle, bucket) if middle is not None else None,
    )


def strip(cells: Sequence[GridCell]) -> list[GridCell]:
    """A lineage's outcomes in at most STRIP_CELLS squares: a square standing for several
    generations shows the first death among them, else the first change, else the first."""
    bucket = max(1, -(-len(cells) // STRIP_CELLS))
    shown = []
    for start in range(0, len(cells), bucket):
        chunk = cells[start : start + bucket]
        deaths = [c for c in chunk if is_death(c.outcome)]
        changes = [c for c in chunk if c.outcome == "changed"]
        shown.append((deaths or changes or chunk)[0])
    return shown
