"""Server-rendered line charts: geometry for an inline SVG, no script, no CDN.

Owns the plot's frame and scales (shared with ``overlays``), turning one ``Series``
(already bucketed by the reader to a few hundred points) into plot coordinates, axis
labels, a hover target per point and a marker per death (each a link to its
generation's page, titled and lettered with the kind of death), and a lineage's strip
of outcomes. The template draws them; every value here is a number computed from
trusted figures, and labels are our own text or an outcome from the fixed vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pydantic import BaseModel

from scheduler.views import GridCell, Series

WIDTH = 640
HEIGHT = 180
LEFT = 64
RIGHT = 12
TOP = 20
BOTTOM = 28
PLOT_WIDTH = WIDTH - LEFT - RIGHT
PLOT_HEIGHT = HEIGHT - TOP - BOTTOM


class Dot(BaseModel):
    """A point to hover: where it is drawn and what its title says."""

    x: float
    y: float
    generation: int
    label: str


class Mark(BaseModel):
    """A death's vertical marker."""

    x: float
    generation: int
    outcome: str


class Square(BaseModel):
    """One generation (or bucket of them) in a lineage's strip of outcomes."""

    x: float
    width: float
    generation: int
    outcome: str


class Frame(BaseModel):
    """A plot's frame: the generations its axis spans, its top label and its geometry
    (the same for every chart, overlays included)."""

    first_generation: int
    last_generation: int
    top_label: str
    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    right_edge: int = WIDTH - RIGHT
    top: int = TOP
    baseline: int = HEIGHT - BOTTOM


class Chart(Frame):
    key: str
    title: str
    unit: str
    bucket: int
    points: str
    dots: list[Dot]
    deaths: list[Mark]


def chart(series: Series) -> Chart | None:
    """Plot coordinates for one series; None when it has no point to draw."""
    if not series.points:
        return None
    generations = [p.generation for p in series.points] + [d.generation for d in series.deaths]
    first, last = min(generations), max(generations)
    peak = max(point.value for point in series.points) or 1.0
    x, y = scales(first, last, peak)
    dots = [
        Dot(
            x=x(p.generation),
            y=y(p.value),
            generation=p.generation,
            label=label(p.value, series.unit),
        )
        for p in series.points
    ]
    coordinates = " ".join(f"{dot.x:.1f},{dot.y:.1f}" for dot in dots)
    deaths = [
        Mark(x=x(d.generation), generation=d.generation, outcome=d.outcome) for d in series.deaths
    ]
    return Chart(
        key=series.key,
        title=series.title,
        unit=series.unit,
        bucket=series.bucket,
        points=coordinates,
        first_generation=first,
        last_generation=last,
        top_label=label(peak, series.unit),
        dots=dots,
        deaths=deaths,
    )


def scales(
    first: int, last: int, peak: float
) -> tuple[Callable[[int], float], Callable[[float], float]]:
    """Where generation ``first``..``last`` and value 0..``peak`` fall on the plot."""
    span = max(1, last - first)

    def x(generation: int) -> float:
        return round(LEFT + (generation - first) / span * PLOT_WIDTH, 1)

    def y(value: float) -> float:
        return round(TOP + PLOT_HEIGHT - value / peak * PLOT_HEIGHT, 1)

    return x, y


def strip(cells: Sequence[GridCell]) -> list[Square]:
    """A lineage's outcomes side by side across the plot's width, in generation order."""
    if not cells:
        return []
    width = PLOT_WIDTH / len(cells)
    return [
        Square(
            x=round(LEFT + i * width, 2),
            width=round(width, 2),
            generation=c.generation,
            outcome=c.outcome,
        )
        for i, c in enumerate(cells)
    ]


def label(value: float, unit: str) -> str:
    """A value as its hover title and axis label say it."""
    if unit == "USD":
        return f"${value:.4f}"
    if unit == "%":
        return f"{value:.0f}%"
    return f"{value:.3g} {unit}"
