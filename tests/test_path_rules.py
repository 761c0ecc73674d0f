"""The name rules every way into the shared repository shares (worker/instrument/path_rules):
the default-ignorable table against Unicode's own property, the spaces, and the rules on a
git tree entry's raw name as import-bundle and fork apply them.

Through real lives and archives in test_decoder; through real bundles in test_import_names.
"""

from __future__ import annotations

import sys
import unicodedata

import pytest
import regex

from worker.instrument.path_rules import (
    is_default_ignorable,
    legibility_problem,
    shown,
    tree_name_problem,
)

LOOK_ALIKES = {
    "\u034f": "U+034F COMBINING GRAPHEME JOINER",
    "\u17b4": "U+17B4 KHMER VOWEL INHERENT AQ",
    "\u115f": "U+115F HANGUL CHOSEONG FILLER",
    "\u1160": "U+1160 HANGUL JUNGSEONG FILLER",
    "\u3164": "U+3164 HANGUL FILLER",
    "\uffa0": "U+FFA0 HALFWIDTH HANGUL FILLER",
    "\u00a0": "U+00A0 NO-BREAK SPACE",
    "\u2007": "U+2007 FIGURE SPACE",
    "\u3000": "U+3000 IDEOGRAPHIC SPACE",
}


def test_the_default_ignorable_table_is_unicodes_property() -> None:
    """The table is data in the fingerprinted instrument; the regex library carries the
    Unicode database's own Default_Ignorable_Code_Point. They must agree on every code
    point."""
    prop = regex.compile(r"\p{Default_Ignorable_Code_Point}")
    differ = [
        f"U+{code:04X}"
        for code in range(sys.maxunicode + 1)
        if is_default_ignorable(chr(code)) != bool(prop.match(chr(code)))
    ]
    assert differ == []


def test_every_default_ignorable_code_point_is_refused_naming_it() -> None:
    prop = regex.compile(r"\p{Default_Ignorable_Code_Point}")
    ignorable = [chr(c) for c in range(sys.maxunicode + 1) if prop.match(chr(c))]
    assert len(ignorable) > 4000
    for char in ignorable:
        problem = legibility_problem(f"a{char}b", "the name")
        assert problem is not None and problem.startswith(f"U+{ord(char):04X} "), char


def test_every_space_but_u0020_is_refused_naming_it() -> None:
    spaces = [chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Zs"]
    assert " " in spaces and len(spaces) > 10
    for char in spaces:
        problem = legibility_problem(f"a{char}b", "the name")
        if char == " ":
            assert problem is None
        else:
            assert problem == f"U+{ord(char):04X} {unicodedata.name(char)} in the name"


@pytest.mark.parametrize(("char", "named"), LOOK_ALIKES.items())
def test_each_look_alike_is_refused_in_a_name_and_a_tree_entry(char: str, named: str) -> None:
    assert legibility_problem(f"journal.md{char}", "the name") == f"{named} in the name"
    assert legibility_problem(f"real{char}.el", "the symlink target") == (
        f"{named} in the symlink target"
    )
    assert tree_name_problem(f"organism.el{char}".encode()) == f"{named} in the name"


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        (b"esc\x1b[31m", "U+001B control character in the name"),
        (b"line\nbreak", "U+000A control character in the name"),
        ("gnp.\u202etxt.el".encode(), "U+202E RIGHT-TO-LEFT OVERRIDE in the name"),
        (b"\xff\xfe", "the name is not valid UTF-8"),
        (b".GIT", "'.GIT' is, or is treated by git as, a .git directory"),
        (b"git~1", "'git~1' is, or is treated by git as, a .git directory"),
        (b".gitmodules", "a .gitmodules (or a name git treats so) cannot be committed"),
        (b"x" * 256, "path component longer than 255 bytes"),
    ],
)
def test_a_tree_entry_name_is_refused_for_what_the_decoder_refuses(
    name: bytes, reason: str
) -> None:
    assert tree_name_problem(name) == reason


@pytest.mark.parametrize("name", ["organism.el", "é.el", "ノート.txt", "a b.txt", "한글.el"])
def test_visible_names_pass(name: str) -> None:
    assert tree_name_problem(name.encode()) is None


def test_a_name_not_in_nfc_is_refused_naming_the_name_it_would_read_as() -> None:
    # "café" decomposed, beside "café" composed: two names that render the same.
    assert tree_name_problem("cafe\u0301.el".encode()) == (
        "the name is not in Unicode's composed form (NFC), so it would read as 'café.el'; "
        "write it composed"
    )


@pytest.mark.parametrize(
    ("char", "named"),
    [
        ("\u2800", "U+2800 BRAILLE PATTERN BLANK"),
        ("\U0001d159", "U+1D159 MUSICAL SYMBOL NULL NOTEHEAD"),
        ("\u2215", "U+2215 DIVISION SLASH"),
        ("\u2044", "U+2044 FRACTION SLASH"),
        ("\uff0e", "U+FF0E FULLWIDTH FULL STOP"),
        ("\u2024", "U+2024 ONE DOT LEADER"),
        ("\ue000", "U+E000 private use character"),
        ("\U0010fffd", "U+10FFFD private use character"),
        ("\ufdd0", "U+FDD0 noncharacter or unassigned"),
        ("\U0010ffff", "U+10FFFF noncharacter or unassigned"),
    ],
)
def test_blank_and_path_look_alikes_private_use_and_noncharacters_are_refused(
    char: str, named: str
) -> None:
    assert tree_name_problem(f"a{char}b.el".encode()) == f"{named} in the name"


@pytest.mark.parametrize("char", ["\u3164", "\u115f", "\u034f", "\ufe00", "\u202e", "\x9b"])
def test_a_refused_name_is_shown_with_what_a_reader_cannot_see_escaped(char: str) -> None:
    shown_name = shown(f"journal.md{char}".encode())
    assert char not in shown_name
    assert shown_name == f"'journal.md\\u{ord(char):04x}'" or shown_name.startswith(
        "'journal.md\\x"
    )
