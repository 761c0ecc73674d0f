"""The fixed wording of commit subjects and journal entries.

Owns the exact text the kernel writes into a lineage: the commit subject of each
generation and the journal entry appended to ``journal.md``. The wording is the
single-host original's (see the seed test) and readers parse it, so it changes only
with a new schema. A generation whose model calls all failed at the provider keeps its
own outcome's words and carries a fixed mark after them (``unavailable_mark``): in its
subject (``gen 7: no-change (model unavailable: 3 calls failed)``) and in its journal
heading. A death entry carries ``exit R`` and the last five stderr lines
between ``~~~`` fences, nothing more: the full stderr goes to the observation.

Those lines are the organism's, so they are made inert (neither the kernel's readers
nor a CommonMark renderer can read one as a heading or as the end of the fence) and
legible: the committed journal reaches a person through ``git log -p`` and the web UI,
so it carries no byte a terminal would act on and no character that would hide or
reorder text. Control characters (C0 but the newline that ends a line, DEL, C1),
invisible formatting characters (Unicode Cf: bidi overrides and isolates, zero-width
characters, the soft hyphen...) and the line and paragraph separators are written as
Python escapes: ``\\r``, ``\\x1b``, ``\\x9b``, ``\\u202e``. A backslash the organism
wrote stays as it is, so the journal stays readable to the organism that reads it back;
whether ``\\x1b`` there was an ESC or those four characters is told by the observation,
which keeps the exact stderr.
"""

from __future__ import annotations

import re
import unicodedata
from datetime import datetime

JOURNAL_STDERR_LINES = 5
# Characters of one stderr line the journal keeps (the observation keeps them all): the
# journal is committed whole with every generation, so what a death adds stays small.
JOURNAL_LINE_CHARS = 500
# Matches the subject of a death commit, in this wording and the original's.
DEATH_SUBJECT = r"^gen [0-9]+: died "
# Matches the "model unavailable" mark at the end of a subject or a heading's words.
UNAVAILABLE_MARK = r" \(model unavailable: [0-9]+ calls? failed\)$"
# What a terminal acts on or hides rather than shows (see the module docstring).
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})
# A line CommonMark could read as the end of a ``~~~`` fence: up to three spaces, ``~~~``.
_CLOSES_FENCE = re.compile(r" {0,3}~~~")


def changed_summary(organism_delta: tuple[int, int] | None, paths: int) -> str:
    """``organism +A/-D; K paths`` or ``organism unchanged; K other paths``."""
    if organism_delta is None:
        return f"organism unchanged; {paths} other paths"
    added, deleted = organism_delta
    return f"organism +{added}/-{deleted}; {paths} paths"


def unavailable_mark(failed_calls: int) -> str:
    """The mark of a generation whose every model call failed at the provider."""
    calls = "call" if failed_calls == 1 else "calls"
    return f" (model unavailable: {failed_calls} {calls} failed)"


def subject_no_change(generation: int, mark: str = "") -> str:
    return f"gen {generation}: no-change{mark}"


def subject_changed(generation: int, summary: str, mark: str = "") -> str:
    return f"gen {generation}: changed ({summary}){mark}"


def subject_died(generation: int, exit_code: int, mark: str = "") -> str:
    return f"gen {generation}: died (exit {exit_code}); staged writes discarded{mark}"


def _heading(generation: int, words: str, when: datetime) -> str:
    return f"## gen {generation} — {words} — {when.isoformat(timespec='seconds')}\n"


def entry_no_change(generation: int, when: datetime, mark: str = "") -> str:
    return _heading(generation, f"no-change{mark}", when)


def entry_changed(generation: int, summary: str, when: datetime, mark: str = "") -> str:
    return _heading(generation, f"changed — {summary}{mark}", when)


def entry_died(
    generation: int,
    exit_code: int,
    stderr: str,
    when: datetime,
    mark: str = "",
    *,
    reason: str | None = None,
) -> str:
    """A death's entry: its exit status, the kernel's reason when it has one, and the
    last lines of stderr."""
    text = stderr.rstrip()
    # Lines end at a newline only: a CR or another break inside a line is shown, escaped.
    tail = text.split("\n")[-JOURNAL_STDERR_LINES:] if text else []
    fenced = "".join(f"{_inert(_legible(_shortened(line)))}\n" for line in tail)
    why = f"{_inert(_legible(reason))}\n" if reason else ""
    return _heading(generation, f"died{mark}", when) + f"exit {exit_code}\n{why}~~~\n{fenced}~~~\n"


def _shortened(line: str) -> str:
    """At most JOURNAL_LINE_CHARS of the line, saying how much was left out."""
    if len(line) <= JOURNAL_LINE_CHARS:
        return line
    left_out = len(line) - JOURNAL_LINE_CHARS
    return f"{line[:JOURNAL_LINE_CHARS]} [{left_out} more characters in the observation]"


def _legible(line: str) -> str:
    """The line with every control, invisible or separator character escaped."""
    if line.isprintable():
        return line  # the common case; every escaped character is unprintable
    return "".join(
        ch.encode("unicode_escape").decode("ascii")
        if unicodedata.category(ch) in _ESCAPED_CATEGORIES
        else ch
        for ch in line
    )


def _inert(line: str) -> str:
    """An organism's stderr line that cannot read as a heading or close the fence.

    The fence is always the kernel's ``~~~`` at the start of a line, so the kernel's
    readers (and an organism reading its journal) find an entry's fences and headings
    at the start of a line only. A CommonMark renderer (GitHub, GitLab, markdown-it)
    also closes a ``~~~`` fence at a line of three or more ``~`` indented by up to three
    spaces, and nothing else inside the fence can start a block. So:

    - a line that could close the fence (``~~~`` after up to three spaces) is indented
      by four more spaces: CommonMark never reads a line indented four spaces or more as
      a fence, and no line of the five is ever ``~~~`` at the start of a line;
    - a line starting like a journal heading (``#``) gets one leading space, for the
      kernel's readers (inside the fence it is text to a renderer anyway).

    Backtick fences cannot close a ``~~~`` fence and are left as they are. Tabs never
    reach here: they are escaped as ``\\t`` first.
    """
    if _CLOSES_FENCE.match(line):
        return f"    {line}"
    return f" {line}" if line.startswith("#") else line


def append(journal: bytes, entry: str) -> bytes:
    """The journal with one more entry, separated from the last by a blank line.

    Bytes of the old journal that are not UTF-8 come out as U+FFFD. The journal grows
    with every generation, so it is joined as bytes: it is only decoded to check it.
    """
    try:
        journal.decode("utf-8")
    except UnicodeDecodeError:
        journal = journal.decode("utf-8", errors="replace").encode()
    separator = b"" if not journal else b"\n" if journal.endswith(b"\n") else b"\n\n"
    return b"".join((journal, separator, entry.encode()))
