"""The first error Emacs printed in a life's stderr, to lead a death's page with.

Owns recognising Emacs's own error lines: the batch backtrace's head
(``Debugger entered--Lisp error: (void-function foo)``), and, when a life turned the
backtrace off, the plain message Emacs prints for a standard error
(``Symbol's value as variable is void: foo``, ``Wrong type argument: listp, 1``,
``error: ...``). The backtrace's head is preferred wherever it is: an organism may print
lines that look like a plain message before it dies.

Trusts: nothing. Stderr is organism-made: the line found is returned as text, cut to
a readable length, and escaped wherever it is shown, as every other organism text.
"""

from __future__ import annotations

import re

MAX_CHARS = 500
_BACKTRACE = re.compile(r"^Debugger entered--Lisp error: .*$", re.MULTILINE)
# The messages of Emacs's standard error symbols (``error-message`` of each), with the
# straight or curly quote Emacs prints depending on the terminal's charset.
_PLAIN = re.compile(
    r"^(?:error: |Symbol[\u2019']s (?:value as variable|function definition) is void: "
    r"|Wrong (?:type argument|number of arguments): |Args out of range: "
    r"|End of file during parsing|Invalid (?:read syntax|function): "
    r"|Arithmetic error|Lisp nesting exceeds |Memory exhausted"
    r"|Variable binding depth exceeds |Attempt to set a constant symbol: "
    r"|Cannot open load file: |Setting constant: ).*$",
    re.MULTILINE,
)


def first_error(stderr: str) -> str | None:
    """The backtrace's head line, else the first plain error message; None if neither."""
    found = _BACKTRACE.search(stderr) or _PLAIN.search(stderr)
    if found is None:
        return None
    line = found.group().rstrip("\r")
    return line if len(line) <= MAX_CHARS else line[: MAX_CHARS - 1] + "…"
