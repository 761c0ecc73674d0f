"""The CLI's two consoles: results on stdout, refusals and warnings on stderr.

Piped output (CI logs, ``| less``) gets a wider page than rich's 80-column fallback.
"""

from __future__ import annotations

import sys

from rich.console import Console

WIDTH = None if sys.stdout.isatty() else 140
console = Console(width=WIDTH)
errors = Console(stderr=True, width=WIDTH)
