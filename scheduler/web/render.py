"""The Jinja2 environment of the web UI: autoescaping everywhere, display filters.

Owns how values look on a page (sizes, seconds, money, commits, diff line classes,
outcome badges and a cohort grid's letters, marked controls) and the guarantee that
every template escapes what it prints: autoescape is on for every template regardless
of its file name, and the one filter here that returns markup, ``marked``, escapes the
text itself first and adds only its own fixed marker element, so organism-made text is
always inert.

``marked`` shows each C1 or bidi control (``legible``) in a diff or path as a visible
marker titled with the code point and its name, as code hosts do: raw, a bidi override
in ``organism.el`` would make the diff a researcher reviews read otherwise than the code
runs ("Trojan Source"). Everything else a page prints (stderr, prompts and responses,
the lethal body, journal text, reasons) passes ``_visible``, the environment's
``finalize``: each such control, and every other character a reader cannot see (C0
controls but tab, newline and carriage return; DEL; Unicode's invisible format
characters: zero-width space, joiners, the byte-order mark...), becomes the text
``<U+XXXX>``, escaped, which is inert in an attribute as well as in text.
"""

from __future__ import annotations

import re
from datetime import datetime
from decimal import Decimal

from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup, escape
from starlette.templating import Jinja2Templates

from scheduler.legible import INVISIBLE, UNSAFE, describe
from scheduler.views import is_death
from scheduler.web.charts import chart, strip
from scheduler.web.overlays import plot


def _mib(value: int | None) -> str:
    return "—" if value is None else f"{value / 2**20:.1f} MiB"


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f} s"


def _cpu(nsec: int | None) -> str:
    return "—" if nsec is None else f"{nsec / 1e9:.2f} s"


def _usd(value: Decimal | None) -> str:
    return "—" if value is None else f"${value:.4f}"


def _short(sha: str | None) -> str:
    return (sha or "")[:12]


def _when(value: datetime | None) -> str:
    return "—" if value is None else value.isoformat(timespec="seconds")


def _diff_class(line: str) -> str:
    if line.startswith(("+++", "---", "diff --git", "index ")):
        return "meta"
    if line.startswith("@@"):
        return "hunk"
    if line.startswith("+"):
        return "add"
    if line.startswith("-"):
        return "del"
    return "ctx"


_MARKER = Markup('<span class="control" title="{title}">&lt;{code}&gt;</span>')
_PIECES = re.compile(f"({UNSAFE.pattern})")


def _marked(text: str) -> Markup:
    """``text`` escaped, each C1 or bidi control replaced by a marker naming it."""
    return Markup("").join(
        _MARKER.format(title=describe(piece), code=f"U+{ord(piece):04X}")
        if index % 2
        else escape(piece)
        for index, piece in enumerate(_PIECES.split(text))
    )


def _visible(value: object) -> object:
    """What every expression prints: text escaped, each C1 or bidi control as ``<U+XXXX>``.

    Markup (what ``marked`` and the charts made) is already escaped; a control left in
    it can only be organism text, and is replaced the same way.
    """
    if not isinstance(value, str):
        return value
    escaped = value if isinstance(value, Markup) else escape(value)
    return Markup(INVISIBLE.sub(lambda m: f"&lt;U+{ord(m.group()):04X}&gt;", escaped))


def _badge(outcome: str) -> str:
    """The CSS class of an outcome badge (a fixed vocabulary, never organism text)."""
    if is_death(outcome):
        return "death"
    if outcome in ("changed", "no-change", "seed", "out-of-loop"):
        return outcome
    return "other"


# The letter of each outcome in a cohort's grid (every Outcome has one; tests hold it so).
GRID_MARKS: dict[str, str] = {
    "changed": "c",
    "no-change": "\u00b7",
    "process_exit": "x",
    "signal": "s",
    "wall_timeout": "t",
    "cgroup_oom": "m",
    "decoder_rejection": "r",
    "footprint_exceeded": "f",
}


def _grid_mark(outcome: str) -> str:
    return GRID_MARKS.get(outcome, "?")


def environment() -> Environment:
    env = Environment(
        loader=PackageLoader("scheduler.web", "templates"),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        finalize=_visible,
    )
    env.filters.update(
        mib=_mib,
        seconds=_seconds,
        cpu=_cpu,
        usd=_usd,
        short=_short,
        when=_when,
        diffclass=_diff_class,
        badge=_badge,
        grid_mark=_grid_mark,
        marked=_marked,
    )
    env.globals["grid_marks"] = GRID_MARKS
    env.tests["death"] = is_death
    env.globals["chart"] = chart
    env.globals["plot"] = plot
    env.globals["strip"] = strip
    return env


templates = Jinja2Templates(env=environment())
