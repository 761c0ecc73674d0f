"""The CLI's two consoles: results on stdout, refusals and warnings on stderr.

Neither console reads markup or emoji codes in what it prints: the text the CLI shows
comes from Redis (which anyone who reaches it may write), the store, git and the
organisms, and a ``[link=...]`` or ``[/bold]`` in it must show as written, not become
a hidden hyperlink or crash the command. Style is given as ``rich.text.Text`` styles
instead, and ``plain`` also makes control characters visible, so no terminal escape
sequence reaches the reader's terminal either. Whatever else reaches a console (a table
cell, a log line) passes through ``_Inert``, which writes every C1 and bidi control as
its escape (``legible``): rich itself writes only 7-bit escape sequences, so the
reader's terminal never receives one of those raw.

Piped output (CI logs, ``| less``) gets a wider page than rich's 80-column fallback,
unless ``COLUMNS`` says how wide the page is.
"""

from __future__ import annotations

import os
import re
import sys
from typing import TextIO, cast

from rich.console import Console
from rich.text import Text

from scheduler.legible import escape_for_terminal


class _Inert:
    """``sys.stdout`` or ``sys.stderr`` as it is at each write (a test runner swaps
    them), with every C1 and bidi control escaped on the way."""

    def __init__(self, stream: str) -> None:
        self._stream = stream

    def _target(self) -> TextIO:
        target: TextIO = getattr(sys, self._stream)
        return target

    def write(self, text: str) -> int:
        self._target().write(escape_for_terminal(text))
        return len(text)

    def flush(self) -> None:
        self._target().flush()

    def isatty(self) -> bool:
        return self._target().isatty()

    def fileno(self) -> int:
        return self._target().fileno()

    @property
    def encoding(self) -> str:
        return self._target().encoding


WIDTH = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 140
# cast: rich types its file as IO[str]; it calls only what _Inert has.
console = Console(file=cast(TextIO, _Inert("stdout")), width=WIDTH, markup=False, emoji=False)
errors = Console(file=cast(TextIO, _Inert("stderr")), width=WIDTH, markup=False, emoji=False)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def plain(text: object, style: str = "") -> Text:
    """``text`` as inert terminal output: no markup, control and bidi characters made
    visible (``\\x1b``, ``\\u202e``)."""
    shown = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", "" if text is None else str(text))
    return Text(escape_for_terminal(shown), style=style)


def warn(label: str, text: object) -> None:
    """One line on stderr; ``text`` (often user or organism input) is never markup."""
    errors.print(
        Text.assemble((f"{label}:", "red"), " ", plain(text)), highlight=False, soft_wrap=True
    )
