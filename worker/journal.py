"""The fixed wording of commit subjects and journal entries.

Owns the exact text the kernel writes into a lineage: the commit subject of each
generation and the journal entry appended to ``journal.md``. The wording is the
single-host original's (see the seed test) and readers parse it, so it changes only
with a new schema. A death entry carries ``exit R`` and the last five stderr lines
between ``~~~`` fences, nothing more: the full stderr goes to the observation.
"""

from __future__ import annotations

from datetime import datetime

JOURNAL_STDERR_LINES = 5
# Matches the subject of a death commit, in this wording and the original's.
DEATH_SUBJECT = r"^gen [0-9]+: died "


def changed_summary(organism_delta: tuple[int, int] | None, paths: int) -> str:
    """``organism +A/-D; K paths`` or ``organism unchanged; K other paths``."""
    if organism_delta is None:
        return f"organism unchanged; {paths} other paths"
    added, deleted = organism_delta
    return f"organism +{added}/-{deleted}; {paths} paths"


def subject_no_change(generation: int) -> str:
    return f"gen {generation}: no-change"


def subject_changed(generation: int, summary: str) -> str:
    return f"gen {generation}: changed ({summary})"


def subject_died(generation: int, exit_code: int) -> str:
    return f"gen {generation}: died (exit {exit_code}); staged writes discarded"


def _heading(generation: int, words: str, when: datetime) -> str:
    return f"## gen {generation} — {words} — {when.isoformat(timespec='seconds')}\n"


def entry_no_change(generation: int, when: datetime) -> str:
    return _heading(generation, "no-change", when)


def entry_changed(generation: int, summary: str, when: datetime) -> str:
    return _heading(generation, f"changed — {summary}", when)


def entry_died(generation: int, exit_code: int, stderr: str, when: datetime) -> str:
    tail = stderr.rstrip().splitlines()[-JOURNAL_STDERR_LINES:]
    fenced = "".join(f"{_inert(line)}\n" for line in tail)
    return _heading(generation, "died", when) + f"exit {exit_code}\n~~~\n{fenced}~~~\n"


def _inert(line: str) -> str:
    """An organism's stderr line that cannot read as a heading or close the fence.

    Only lines starting like a journal heading (``#``) or a fence (``~~~``) change: one
    leading space, which keeps them legible and the entry the kernel's own.
    """
    return f" {line}" if line.startswith(("#", "~~~")) else line


def append(journal: bytes, entry: str) -> bytes:
    """The journal with one more entry, separated from the last by a blank line."""
    text = journal.decode("utf-8", errors="replace")
    if text and not text.endswith("\n"):
        text += "\n"
    if text:
        text += "\n"
    return (text + entry).encode()
