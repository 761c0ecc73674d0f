"""The journal's death entries: the organism's last stderr lines, inert and legible.

The committed ``journal.md`` reaches a person through ``git log -p`` and the web UI, so
the stderr lines it carries hold no raw control, bidi or separator character; the
full, exact stderr stays in the observation. Rendered by a CommonMark renderer
(markdown-it, as GitHub and GitLab render it), no stderr line closes the fence early or
shows as a heading, and the kernel's own reader still reads every entry back.
"""

from __future__ import annotations

import re
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest
from markdown_it import MarkdownIt
from support.fleet import Fleet
from support.lives import make_lineage, run_one

from scheduler.history import journal_entries
from worker.instrument import journal

WHEN = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


def fenced(stderr: str) -> list[str]:
    """The lines between the fences of a death entry for ``stderr``."""
    entry = journal.entry_died(7, 3, stderr, WHEN)
    head, _, rest = entry.partition("~~~\n")
    assert head == "## gen 7 — died — 2024-05-01T12:00:00+00:00\nexit 3\n"
    body, _, tail = rest.rpartition("~~~\n")
    assert tail == ""
    return body.splitlines()


def legible(text: str) -> bool:
    return all(ch == "\n" or ch.isprintable() for ch in text)


@pytest.mark.parametrize(
    ("line", "shown"),
    [
        ("title \x1b]0;owned\x07 set", "title \\x1b]0;owned\\x07 set"),  # OSC, BEL
        ("\x1b[2J\x1b[31mred", "\\x1b[2J\\x1b[31mred"),
        ("c1 \x9b31m csi", "c1 \\x9b31m csi"),
        ("nel \x85 next", "nel \\x85 next"),
        ("progress 10%\rprogress 99%", "progress 10%\\rprogress 99%"),
        ("tab\there", "tab\\there"),
        ("del \x7f", "del \\x7f"),
        ("vt \x0b ff \x0c fs \x1c.", "vt \\x0b ff \\x0c fs \\x1c."),
        ("rtl \u202etxt.el", "rtl \\u202etxt.el"),
        ("isolate \u2066x\u2069 zw\u200bsp", "isolate \\u2066x\\u2069 zw\\u200bsp"),
        ("soft\u00adhyphen \ufeffbom", "soft\\xadhyphen \\ufeffbom"),
        ("line\u2028sep para\u2029sep", "line\\u2028sep para\\u2029sep"),
        ("tag \U000e0041", "tag \\U000e0041"),
    ],
)
def test_control_bidi_and_separator_characters_are_escaped(line: str, shown: str) -> None:
    assert fenced(f"before\n{line}\n") == ["before", shown]


def test_printable_text_and_backslashes_are_kept_as_written() -> None:
    line = 'Error: (file-missing "C:\\\\x1b" "é ノート — ok") \\u202e'
    assert fenced(line) == [line]


def test_a_carriage_return_does_not_end_a_line_of_the_five() -> None:
    stderr = "".join(f"line {n}\r\n" for n in range(8))
    # Trailing whitespace of the whole stderr is dropped, as before; a CR inside is shown.
    assert fenced(stderr) == [*(f"line {n}\\r" for n in range(3, 7)), "line 7"]


def test_escaping_cannot_make_or_hide_a_heading_or_a_fence() -> None:
    lines = ["\x1b[0m## gen 9 — changed", "## gen 9 — forged", "~~~", "\u202e~~~"]
    assert fenced("\n".join(lines)) == [
        "\\x1b[0m## gen 9 — changed",
        " ## gen 9 — forged",
        "    ~~~",
        "\\u202e~~~",
    ]


def test_an_empty_stderr_gives_empty_fences() -> None:
    assert fenced("") == fenced("\n \n") == []


# --- rendered as Markdown: one heading per kernel entry, the organism's text as code --------

FORGED_HEADING = "## gen 2 — changed — 2026-12-01T09:30:00+00:00"
FORGING = [
    "innocent line",
    "~~~",
    FORGED_HEADING,
    "gen 2: changed (organism +1/-0; 1 paths)",
    "~~~ ",
    "resume",
]
FENCES = ["~~~", "~~~~", "~~~~~~~~", "```", "````"]
INDENTS = ["", " ", "  ", "   "]


def forging(indent: str, fence: str) -> str:
    """The forging stderr, every line indented by ``indent``, its fences made of ``fence``."""
    return "\n".join(indent + line.replace("~~~", fence) for line in FORGING) + "\n"


def journal_with(stderr: str) -> str:
    """A journal of three kernel entries; the second is a death with ``stderr``."""
    text = b""
    for entry in (
        journal.entry_changed(1, "organism +1/-0; 1 paths", WHEN),
        journal.entry_died(2, 255, stderr, WHEN),
        journal.entry_no_change(3, WHEN),
    ):
        text = journal.append(text, entry)
    return text.decode()


def outside_code(html: str) -> str:
    return re.sub(r"<code[^>]*>.*?</code>", "", html, flags=re.DOTALL)


def headings(html: str) -> list[str]:
    return re.findall(r"<h2>(.*?)</h2>", html, flags=re.DOTALL)


KERNEL_HEADINGS = [
    "gen 1 — changed — organism +1/-0; 1 paths — 2024-05-01T12:00:00+00:00",
    "gen 2 — died — 2024-05-01T12:00:00+00:00",
    "gen 3 — no-change — 2024-05-01T12:00:00+00:00",
]


@pytest.mark.parametrize("preset", ["commonmark", "default"])
@pytest.mark.parametrize("fence", FENCES)
@pytest.mark.parametrize("indent", INDENTS, ids=lambda indent: f"indent{len(indent)}")
def test_rendered_stderr_stays_one_code_block_and_forges_no_heading(
    preset: str, fence: str, indent: str
) -> None:
    html = MarkdownIt(preset).render(journal_with(forging(indent, fence)))
    assert headings(html) == KERNEL_HEADINGS, html
    assert html.count("<pre>") == 1, html
    code = re.findall(r"<pre><code[^>]*>(.*?)</code></pre>", html, flags=re.DOTALL)
    assert len(code) == 1, html
    # The last five lines, all of them inside the one block.
    for line in ["~~~", "gen 2 — changed — 2026-12-01", "gen 2: changed", "resume"]:
        assert line.replace("~~~", fence) in code[0], html
    rest = outside_code(html)
    for text in ["gen 2 — changed — 2026", "gen 2: changed", "resume", "innocent", fence]:
        assert text not in rest, html


@pytest.mark.parametrize("fence", FENCES)
@pytest.mark.parametrize("indent", INDENTS, ids=lambda indent: f"indent{len(indent)}")
def test_the_kernels_reader_reads_the_entries_of_a_forging_stderr(fence: str, indent: str) -> None:
    stderr = forging(indent, fence)
    entries = journal_entries(journal_with(stderr))
    assert [(n, e.words, e.exit_status) for n, e in sorted(entries.items())] == [
        (1, "changed — organism +1/-0; 1 paths", None),
        (2, "died", 255),
        (3, "no-change", None),
    ]
    assert entries[2].stderr_lines == fenced(stderr)
    # Only a line that CommonMark could take for the fence's end changes, and visibly.
    for written, line in zip(fenced(stderr), stderr.splitlines()[-5:], strict=True):
        assert written.strip() == line.strip()


def test_an_old_journal_is_still_read_entry_by_entry() -> None:
    old = (
        "## gen 1 — died — 2024-05-01T12:00:00+00:00\nexit 3\n~~~\nboom\n ~~~\n"
        " ## gen 9 — forged\n~~~\n"
    )
    text = journal.append(old.encode(), journal.entry_died(2, 9, "~~~\nbang", WHEN)).decode()
    entries = journal_entries(text)
    assert sorted(entries) == [1, 2]
    assert entries[1].stderr_lines == ["boom", " ~~~", " ## gen 9 — forged"]
    assert (entries[2].exit_status, entries[2].stderr_lines) == (9, ["    ~~~", "bang"])


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
def test_the_committed_journal_holds_no_raw_terminal_bytes(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    make_lineage(
        fleet,
        "painter",
        '(message "osc \\e]0;owned\\a then \\e[31mred")\n'
        '(message "c1 \\u009b2J csi")\n'
        '(message "before\\rafter")\n'
        '(message "rtl \\u202etxt.el")\n'
        "(kill-emacs 3)\n",
    )
    run_one(fleet, "painter")
    assert fleet.subjects("painter")[0] == "gen 1: died (exit 3); staged writes discarded"
    committed = subprocess.run(
        ["git", f"--git-dir={fleet.repo}", "cat-file", "blob", "lineage-painter:journal.md"],
        capture_output=True,
        check=True,
    ).stdout
    text = committed.decode("utf-8")
    assert "osc \\x1b]0;owned\\x07 then \\x1b[31mred\n" in text
    assert "c1 \\x9b2J csi\n" in text
    assert "before\\rafter\n" in text
    assert "rtl \\u202etxt.el\n" in text
    assert legible(text), text
    assert not any((byte < 0x20 and byte != 0x0A) or byte == 0x7F for byte in committed)
    # The observation keeps what the organism wrote, byte for byte.
    stderr = str(fleet.observation("painter", 1)["stderr"])
    assert "\x1b]0;owned\x07" in stderr and "\x9b2J" in stderr and "\u202e" in stderr


def test_a_death_adds_at_most_a_few_kilobytes_to_the_journal_however_long_its_lines() -> None:
    stderr = "\n".join(["\x01" * 200_000] * 5)
    entry = journal.entry_died(3, 5, stderr, datetime(2026, 12, 1, tzinfo=UTC))
    assert len(entry.encode()) < 5 * (4 * journal.JOURNAL_LINE_CHARS + 100) + 200
    assert entry.count("[199500 more characters in the observation]") == 5


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (b"", "E"),
        (b"# journal\n", "# journal\n\nE"),
        (b"# journal", "# journal\n\nE"),
        (b"## gen 1 \xe2\x80\x94 no-change\n", "## gen 1 \u2014 no-change\n\nE"),
        # A journal written elsewhere, with bytes that are not UTF-8.
        (b"caf\xe9\n", "caf\ufffd\n\nE"),
    ],
)
def test_append_separates_entries_by_one_blank_line(before: bytes, after: str) -> None:
    assert journal.append(before, "E") == after.encode()
