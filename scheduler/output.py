"""The CLI's two consoles: results on stdout, refusals and warnings on stderr.

Piped output (CI logs, ``| less``) gets a wider page than rich's 80-column fallback,
unless ``COLUMNS`` says how wide the page is.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.markup import escape

WIDTH = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 140
console = Console(width=WIDTH)
errors = Console(stderr=True, width=WIDTH)


def warn(label: str, text: object) -> None:
    """One line on stderr; ``text`` (often user or organism input) is never markup."""
    errors.print(f"[red]{label}:[/] {escape(str(text))}", highlight=False, soft_wrap=True)
