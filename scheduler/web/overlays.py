"""Overlaid curves as an inline SVG: several lineages' lines on one plot, and their median.

Owns turning an ``Overlay`` (curves already thinned alike by ``scheduler.curves``)
into one polyline per curve, each in a tone of its own, the median drawn apart (thick,
dark, dashed), a hover target per point titled with its lineage, generation and value,
and each point's generation page (a curve drawn from a fork point links its own
numbering back, ``offset``). The frame and scales are the line charts' (``charts``).

Trusts: the overlay's numbers. Lineage names are organism-independent but
user-chosen: the template escapes them as every other text.
"""

from __future__ import annotations

from pydantic import BaseModel

from scheduler.views import Overlay, SeriesPoint
from scheduler.web.charts import Frame, label, scales

# Tones a curve is drawn in, in turn; more curves than tones reuse them.
TONES = 8


class Point(BaseModel):
    x: float
    y: float
    title: str
    # The generation page the point leads to (None: a cohort's share, no one lineage's).
    href: str | None


class Line(BaseModel):
    label: str
    tone: int
    points: str
    dots: list[Point]


class OverlayChart(Frame):
    key: str
    title: str
    unit: str
    axis: str
    bucket: int
    lines: list[Line]
    median: Line | None


def plot(overlay: Overlay) -> OverlayChart | None:
    """Coordinates of every curve and the median; None when nothing has a point."""
    every = [p for c in overlay.curves for p in c.points] + (overlay.median or [])
    if not every:
        return None
    first = min(p.generation for p in every)
    last = max(p.generation for p in every)
    peak = max(p.value for p in every) or 1.0
    x, y = scales(first, last, peak)

    def line(
        name: str, tone: int, points: list[SeriesPoint], lineage: str | None, offset: int
    ) -> Line:
        dots = [
            Point(
                x=x(p.generation),
                y=y(p.value),
                title=f"{name} gen {p.generation + offset}: {label(p.value, overlay.unit)}",
                href=f"/lineages/{lineage}/generations/{p.generation + offset}"
                if lineage
                else None,
            )
            for p in points
        ]
        return Line(
            label=name,
            tone=tone,
            points=" ".join(f"{d.x:.1f},{d.y:.1f}" for d in dots),
            dots=dots,
        )

    return OverlayChart(
        key=overlay.key,
        title=overlay.title,
        unit=overlay.unit,
        axis=overlay.axis,
        bucket=overlay.bucket,
        lines=[
            line(c.label, i % TONES, c.points, c.lineage, c.offset)
            for i, c in enumerate(overlay.curves)
            if c.points
        ],
        median=line("median", 0, overlay.median, None, 0) if overlay.median else None,
        first_generation=first,
        last_generation=last,
        top_label=label(peak, overlay.unit),
    )
