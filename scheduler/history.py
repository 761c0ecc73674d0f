"""Reading the kernel's wording back: commit subjects and journal entries.

Owns the parsing of what ``worker.instrument.journal`` writes (and what the single-host
original wrote before it): which commits are generations and their numbers, their
outcome as the subject states it (and its "model unavailable" mark), and the journal
entry of one generation with a death's exit status and fenced stderr lines. Generation
numbers come only from ``gen N:`` subjects, never from positions, because out-of-loop
commits (seed, external edits, hand commits) sit between generations.

Trusts nothing it parses: subjects and journal text are lineage content, so every
function here is total (unparseable text is reported as such, never raised).
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

from pydantic import BaseModel

from worker.instrument.journal import JOURNAL_STDERR_LINES, UNAVAILABLE_MARK
from worker.instrument.names import generation_number

CommitKind = Literal["changed", "no-change", "died", "generation", "seed", "out-of-loop"]

# Current wording: "gen N: changed (organism +A/-D; K paths)", "gen N: no-change",
# "gen N: died (exit R); staged writes discarded". Legacy: "gen N: changed +A/-B",
# "gen N: died (exit R); reverted". "generation" is a numbered subject whose rest
# neither wording explains: still a generation, outcome unknown. Any current subject may
# end in the "model unavailable" mark: "gen N: no-change (model unavailable: 3 calls
# failed)"; older lineages have none.
_CHANGED = re.compile(r"^changed(?: \((?P<current>[^)]*)\)| (?P<legacy>\+\d+/-\d+))$")
_DIED = re.compile(r"^died \(exit (-?\d{1,6})\);")
_HEADING = re.compile(r"^## gen ([1-9][0-9]{0,8}) — (.*?)(?: — (\S+))?$")
_UNAVAILABLE = re.compile(UNAVAILABLE_MARK)
_FENCE = "~~~"
_EXIT_LINE = re.compile(r"^exit (-?\d{1,6})$")


class SubjectMeaning(NamedTuple):
    """What a commit subject says about its commit (a tuple: parsed 10,000 at a time)."""

    kind: CommitKind
    generation: int | None = None
    exit_status: int | None = None
    summary: str | None = None
    # The subject carries the mark of a generation whose model calls all failed.
    model_unavailable: bool = False


class JournalEntry(BaseModel):
    """One generation's entry in ``journal.md``."""

    generation: int
    words: str
    time: str | None
    text: str
    exit_status: int | None
    stderr_lines: list[str]


def parse_subject(subject: str, *, is_root: bool) -> SubjectMeaning:
    """The meaning of one commit subject; only ``gen N:`` subjects carry a number."""
    generation = generation_number(subject)
    if generation is None:
        return SubjectMeaning(kind="seed" if is_root else "out-of-loop")
    marked = subject.split(": ", 1)[1]
    rest = _UNAVAILABLE.sub("", marked)
    unavailable = rest != marked
    if rest == "no-change":
        return SubjectMeaning("no-change", generation, model_unavailable=unavailable)
    changed = _CHANGED.match(rest)
    if changed:
        summary = changed.group("current") or f"organism {changed.group('legacy')}"
        return SubjectMeaning("changed", generation, None, summary, unavailable)
    died = _DIED.match(rest)
    if died:
        return SubjectMeaning("died", generation, int(died.group(1)), None, unavailable)
    return SubjectMeaning("generation", generation, summary=marked[:200])


def journal_entries(journal: str) -> dict[int, JournalEntry]:
    """Every generation entry of a journal, by number (a later entry wins a duplicate)."""
    entries: dict[int, JournalEntry] = {}
    for block in _blocks(journal):
        entry = _entry(block)
        if entry is not None:
            entries[entry.generation] = entry
    return entries


def journal_entry(journal: str, generation: int) -> JournalEntry | None:
    """The entry of one generation; entries are appended, so only the tail is parsed."""
    start = journal.rfind(f"\n## gen {generation} — ")
    if start < 0:
        if not journal.startswith(f"## gen {generation} — "):
            return None
        start = -1
    block = journal[start + 1 :]
    following = block.find("\n## ", 1)
    return _entry(block if following < 0 else block[: following + 1])


def _blocks(journal: str) -> list[str]:
    blocks: list[str] = []
    fenced = False
    for line in journal.splitlines(keepends=True):
        # Inside a ~~~ fence every line is the organism's stderr, never a heading.
        if (line.startswith("## ") and not fenced) or not blocks:
            blocks.append(line)
        else:
            blocks[-1] += line
        if line.rstrip("\n") == "~~~":
            fenced = not fenced
    return blocks


def _entry(block: str) -> JournalEntry | None:
    lines = block.splitlines()
    if not lines:
        return None
    heading = _HEADING.match(lines[0])
    if heading is None:
        return None
    body = lines[1:]
    exit_status = None
    for line in body:
        found = _EXIT_LINE.match(line)
        if found:
            exit_status = int(found.group(1))
            break
    return JournalEntry(
        generation=int(heading.group(1)),
        words=heading.group(2),
        time=heading.group(3),
        text=block.strip("\n"),
        exit_status=exit_status,
        stderr_lines=_fenced(body),
    )


def _fenced(body: list[str]) -> list[str]:
    """The lines between the first pair of ``~~~`` fences (a death's stderr tail)."""
    try:
        opening = body.index(_FENCE)
        closing = body.index(_FENCE, opening + 1)
    except ValueError:
        return []
    # The kernel writes at most five; more means the entry was not the kernel's.
    return body[opening + 1 : closing][-JOURNAL_STDERR_LINES:]
