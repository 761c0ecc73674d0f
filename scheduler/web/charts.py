"""Server-rendered line charts: geometry for an inline SVG, no script, no CDN.

Owns turning one ``Series`` (already bucketed by the reader to a few hundred
points) into plot coordinates, axis labels, a hover target per point and a marker per
death (each a link to its generation's page, titled with the kind of death). The
template draws them; every value here is a number computed from trusted figures, and
labels are our own text or an outcome from the fixed vocabulary.
"""

from __future__ import annotations

from pydantic import BaseModel

from scheduler.views import Series

WIDTH = 640
HEIGHT = 180
LEFT = 64
RIGHT = 12
TOP = 12
BOTTOM = 28


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


class Chart(BaseModel):
    key: str
    title: str
    unit: str
    bucket: int
    points: str
    first_generation: int
    last_generation: int
    top_label: str
    dots: list[Dot]
    deaths: list[Mark]
    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    right_edge: int = WIDTH - RIGHT
    top: int = TOP
    baseline: int = HEIGHT - BOTTOM


def chart(series: Series) -> Chart | None:
    """Plot coordinates for one series; None when it has no point to draw."""
    if not series.points:
        return None
    generations = [p.generation for p in series.points] + [d.generation for d in series.deaths]
    first, last = min(generations), max(generations)
    peak = max(point.value for point in series.points) or 1.0
    span = max(1, last - first)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(generation: int) -> float:
        return round(LEFT + (generation - first) / span * plot_w, 1)

    dots = [
        Dot(
            x=x(p.generation),
            y=round(TOP + plot_h - p.value / peak * plot_h, 1),
            generation=p.generation,
            label=_label(p.value, series.unit),
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
        top_label=_label(peak, series.unit),
        dots=dots,
        deaths=deaths,
    )


def _label(value: float, unit: str) -> str:
    if unit == "USD":
        return f"${value:.4f}"
    return f"{value:.3g} {unit}"
