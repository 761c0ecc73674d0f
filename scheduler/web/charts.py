"""Server-rendered line charts: geometry for an inline SVG, no script, no CDN.

Owns turning one ``Series`` (already bucketed by the reader to a few hundred
points) into plot coordinates and axis labels. The template draws them; every
value here is a number computed from trusted figures, and labels are our own text.
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


class Chart(BaseModel):
    key: str
    title: str
    unit: str
    bucket: int
    points: str
    first_generation: int
    last_generation: int
    top_label: str
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
    first, last = series.points[0].generation, series.points[-1].generation
    peak = max(point.value for point in series.points) or 1.0
    span = max(1, last - first)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    coordinates = " ".join(
        f"{LEFT + (p.generation - first) / span * plot_w:.1f},"
        f"{TOP + plot_h - p.value / peak * plot_h:.1f}"
        for p in series.points
    )
    return Chart(
        key=series.key,
        title=series.title,
        unit=series.unit,
        bucket=series.bucket,
        points=coordinates,
        first_generation=first,
        last_generation=last,
        top_label=_label(peak, series.unit),
    )


def _label(value: float, unit: str) -> str:
    if unit == "USD":
        return f"${value:.4f}"
    return f"{value:.3g} {unit}"
