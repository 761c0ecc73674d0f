"""Hostile archives against the decoder's git fsck parity rules (5be6b78): what they cost
the decoder, and that the faster checks still say exactly what the old ones said.

An organism controls every byte of the tar, so the checks that mirror fsck_tree and
fsck_blob must stay linear in the archive with a small constant: a worker decodes one
result at a time, and every second it spends on one organism is taken from the rest.
"""

from __future__ import annotations

import random
import re
import tracemalloc
from pathlib import Path

import pytest
from support.tarballs import body, build, regular

from worker.instrument import path_rules
from worker.instrument.decoder import DecodeLimits, DecoderRejection, decode_archive, plan_archive

_ATTR_MAX = 100 * 1024 * 1024


def _lines_refused(content: bytes, longest: int) -> bool:
    """fsck_blob's line rule, written the obvious way (as 5be6b78 had it)."""
    text = content.split(b"\0", 1)[0]
    return any(len(line) >= longest for line in text.split(b"\n"))


def _refused(content: bytes, start: int = 0, padding: bytes = b"") -> bool:
    archive = padding[:start] + content + padding
    return path_rules.gitattributes_problem(archive, start, len(content)) is not None


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"\n" * _ATTR_MAX, id="newlines"),
        pytest.param(b"a\n" * (_ATTR_MAX // 2), id="one-byte-lines"),
        pytest.param((b"*" * 2047 + b"\n") * (_ATTR_MAX // 2048), id="longest-allowed-lines"),
    ],
)
def test_a_gitattributes_at_git_size_limit_is_checked_in_place(content: bytes) -> None:
    """100 MiB of short lines is what git accepts and the physics allow (work_bytes is
    256 MiB by default). Splitting it into lines took 5.7 s and a gigabyte for newlines
    alone, 2.9 s for one-byte lines. Measured by what the check allocates, not by the
    clock: the check reads the archive where it lies."""
    assert len(content) <= _ATTR_MAX
    tracemalloc.start()
    try:
        refused = _refused(content)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not refused
    # The archive the helper builds is one copy of the content; the check adds nothing
    # that grows with it.
    assert peak < len(content) + (1 << 20), f"{peak} bytes allocated for one .gitattributes"


def test_the_line_rule_matches_fsck_blob_on_random_content(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The windowed scan refuses exactly what splitting into lines refuses, at any
    offset in the archive, with NULs, CRs and boundaries around the limit."""
    rng = random.Random(5)
    for longest in (1, 2, 3, 8, 16):
        monkeypatch.setattr(path_rules, "ATTR_MAX_LINE_LENGTH", longest)
        for _ in range(3000):
            content = bytes(
                rng.choice(b"\n\n\nxx\r\0" if rng.random() < 0.5 else b"\nxxxxxxxx")
                for _ in range(rng.randint(0, 5 * longest + 3))
            )
            start = rng.randint(0, 40)
            padding = bytes(rng.choice(b"\nx\0") for _ in range(64))
            assert _refused(content, start, padding) == _lines_refused(content, longest), (
                longest,
                content,
                start,
            )


def test_the_line_rule_reads_the_member_not_its_neighbours(tmp_path: Path) -> None:
    """Data of the next member never counts as part of a last line without a newline."""
    attributes = b"*.el text\n" + b"*" * 2047
    archive = build(body(), regular(".gitattributes", attributes), regular("x", b"*" * 5000))
    limits = DecodeLimits(max_bytes=1 << 20, max_files=10)
    assert {e.path for e in decode_archive(archive, tmp_path / "dest", limits)} == {
        ".gitattributes",
        "organism.el",
        "x",
    }


# --- names of backslashes --------------------------------------------------------------

_OLD_DOTGIT = re.compile(r"(?:\.git|git~1)[. ]*(?:[:\\].*)?", re.ASCII | re.IGNORECASE | re.DOTALL)


def _old_after_backslash(pattern: re.Pattern[str], part: str) -> bool:
    """5be6b78's check: the pattern against the rest after each backslash, one by one."""
    return any(
        pattern.fullmatch(part[index + 1 :]) is not None
        for index, ch in enumerate(part)
        if ch == "\\"
    )


def test_backslash_checks_say_what_the_per_backslash_checks_said() -> None:
    rng = random.Random(7)
    alphabet = "\\\\\\..gGiIt~~1234567890eEbBaAmModulesx :"
    for _ in range(100_000):
        part = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 16)))
        assert (path_rules.BACKSLASH_NTFS_DOTGIT.search(part) is not None) == (
            _old_after_backslash(_OLD_DOTGIT, part)
        ), part
        assert (path_rules.BACKSLASH_NTFS_DOTGITMODULES.search(part) is not None) == (
            _old_after_backslash(path_rules.NTFS_DOTGITMODULES, part)
        ), part


class _Counted:
    """A compiled pattern that counts how often it is applied."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self.pattern = pattern
        self.calls = 0

    def fullmatch(self, text: str) -> re.Match[str] | None:
        self.calls += 1
        return self.pattern.fullmatch(text)

    def search(self, text: str) -> re.Match[str] | None:
        self.calls += 1
        return self.pattern.search(text)


def test_names_of_backslashes_are_checked_in_linear_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every component 255 backslashes, at the path limit, in many members: matching the
    rest after each backslash separately made 1,000 such members cost 6 s (a minute at
    the default work_files of 10,000)."""
    members = 300
    parent = "/".join(["\\" * 255] * 15)
    leaf = "\\" * 250
    archive = build(body(), *(regular(f"{parent}/{leaf}{index:05d}") for index in range(members)))
    limits = DecodeLimits(max_bytes=1 << 20, max_files=members + 1)
    # Counted, not timed: how many times a name pattern is applied per path component,
    # which a check per backslash made grow with the component's length.
    counted = {
        name: _Counted(pattern)
        for name, pattern in vars(path_rules).items()
        if isinstance(pattern, re.Pattern) and "GIT" in name
    }
    for name, pattern in counted.items():
        monkeypatch.setattr(path_rules, name, pattern)
    plan_archive(archive, limits)
    components = members * (parent.count("/") + 2)
    calls = sum(pattern.calls for pattern in counted.values())
    assert calls <= 8 * components, f"{calls} pattern applications for {components} components"


def test_a_dotgit_after_many_backslashes_is_still_refused(tmp_path: Path) -> None:
    archive = build(body(), regular("\\" * 240 + ".GiT ."))
    with pytest.raises(DecoderRejection, match="hasDotgit"):
        decode_archive(archive, tmp_path / "dest", DecodeLimits(max_bytes=1 << 20, max_files=9))
