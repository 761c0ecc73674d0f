"""The CLI's two consoles: results on stdout, refusals and warnings on stderr.

Neither console reads markup or emoji codes in what it prints: the text the CLI shows
comes from Redis (which anyone who reaches it may write), the store, git and the
organisms, and a ``[link=...]`` or ``[/bold]`` in it must show as written, not become
a hidden hyperlink or crash the command. Style is given as ``rich.text.Text`` styles
instead, and ``plain`` also makes control characters visible, so no terminal escape
sequence reaches the reader's terminal either.

Piped output (CI logs, ``| less``) gets a wider page than rich's 80-column fallback,
unless ``COLUMNS`` says how wide the page is.
"""

from __future__ import annotations

import os
import re
import sys

from rich.console import Console
from rich.text import Text

WIDTH = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 140
console = Console(width=WIDTH, markup=False, emoji=False)
errors = Console(stderr=True, width=WIDTH, markup=False, emoji=False)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def plain(text: object, style: str = "") -> Text:
    """``text`` as inert terminal output: no markup, control characters made visible."""
    shown = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", "" if text is None else str(text))
    return Text(shown, style=style)


def warn(label: str, text: object) -> None:
    """One line on stderr; ``text`` (often user or organism input) is never markup."""
    errors.print(
        Text.assemble((f"{label}:", "red"), " ", plain(text)), highlight=False, soft_wrap=True
    )
