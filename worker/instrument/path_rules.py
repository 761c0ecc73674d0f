"""The rules every name in a lineage's tree obeys: legible to a person, and storable by
git exactly as written.

Owns, as public functions so that every way into the shared repository applies the
same rules (the decoder for a life's result, ``import-bundle`` and ``fork`` for trees
made elsewhere): the legibility of a name or symlink target (no control character, no
invisible formatting character, no line or paragraph separator, no default-ignorable
code point, no space but U+0020, no private-use character or noncharacter, no blank
look-alike or look-alike of '/' and '.', and in Unicode's composed form NFC
so that one name has one spelling), git's own name rules (``.git``, ``.gitmodules`` and
``.gitattributes`` as git reads them on NTFS and HFS+, after any backslash too), the
component rules (not empty, ``.`` or ``..``, at most NAME_MAX bytes), and git fsck's
rules for a ``.gitattributes`` blob. Each check returns the one-line reason a name is
refused, naming the character or rule, or None.

Trusts nothing in the names it is given: they come from organisms and bundles. Pure
functions over strings and bytes; imports nothing of the fleet.

Why the legibility rules: a name holding an invisible or look-alike character renders
as another name in the web UI or a terminal (a life published ``journal.md`` followed
by U+034F, holding a forged journal, and the UI listed two ``journal.md``), and a
control character splits a name in git's path-per-line plumbing. Unicode's
Default_Ignorable_Code_Point property is written below as data, not asked of a
library at run time: these rules are physics, fingerprinted with the instrument, and a
library upgrade carrying a newer Unicode database must not change which results a
worker of the same fingerprint accepts. ``tests/test_path_rules.py`` checks the table
against the ``regex`` library's copy of the Unicode database.
"""

from __future__ import annotations

import re
import unicodedata
from bisect import bisect_right

# Bytes in one path component (Linux NAME_MAX): a longer one cannot be created.
NAME_MAX = 255
# Bytes in a path or a symlink target (Linux PATH_MAX less its NUL).
PATH_MAX = 4095

# Names git refuses to record (read-cache.c verify_path with core.protectNTFS, on by
# default everywhere, and core.protectHFS, on by default on macOS). `git update-index`
# silently skips such a path, so a published tree must not hold one: the commit
# would differ from the tree the organism wrote.
#
# is_ntfs_dotgit: ".git" or its 8.3 name "git~1", then only dots and spaces up to the
# end of the component or an NTFS stream separator ':' or a '\'.
_DOTGIT_NTFS = r"(?:\.git|git~1)[. ]*"
NTFS_DOTGIT = re.compile(_DOTGIT_NTFS + r"(?:[:\\].*)?", re.ASCII | re.IGNORECASE | re.DOTALL)
# is_ntfs_dotgitmodules: ".gitmodules", "gitmod~1".."gitmod~4", or a fall-back 8.3
# name of eight characters: a prefix of "gi7eba", "~", a digit 1-9, then digits.
_DOTGITMODULES_NTFS = (
    r"(?:\.gitmodules|gitmod~[1-4]|"
    + "|".join(f"{'gi7eba'[:k]}~[1-9][0-9]{{{6 - k}}}" for k in range(7))
    + r")[. ]*"
)
NTFS_DOTGITMODULES = re.compile(
    _DOTGITMODULES_NTFS + r"(?::.*)?", re.ASCII | re.IGNORECASE | re.DOTALL
)
# The same two shapes just after any backslash of a component, found in one linear scan:
# matching each backslash's remainder separately costs the square of the component, and
# a name of 255 backslashes, repeated in every component of thousands of paths, stalled
# the decoder for minutes.
BACKSLASH_NTFS_DOTGIT = re.compile(r"\\" + _DOTGIT_NTFS + r"(?:[:\\]|\Z)", re.ASCII | re.IGNORECASE)
BACKSLASH_NTFS_DOTGITMODULES = re.compile(
    r"\\" + _DOTGITMODULES_NTFS + r"(?::|\Z)", re.ASCII | re.IGNORECASE
)
# is_ntfs_dotgitattributes: the same shapes for ".gitattributes", "gitatt~1".."gitatt~4"
# and the fall-back 8.3 names with the prefix "gi7d29". git fsck (fsck_tree, then
# fsck_blob) checks the object under such a name, or its HFS+ spelling: a directory
# there (gitattributesBlob), more than ATTR_MAX_FILE_SIZE bytes (gitattributesLarge) or
# a line of ATTR_MAX_LINE_LENGTH bytes or more before the first NUL
# (gitattributesLineLength) is an error. A symlink there is only reported, never refused.
NTFS_DOTGITATTRIBUTES = re.compile(
    r"(?:\.gitattributes|gitatt~[1-4]|"
    + "|".join(f"{'gi7d29'[:k]}~[1-9][0-9]{{{6 - k}}}" for k in range(7))
    + r")[. ]*(?::.*)?",
    re.ASCII | re.IGNORECASE | re.DOTALL,
)
# attr.h ATTR_MAX_FILE_SIZE and ATTR_MAX_LINE_LENGTH, as fsck_blob applies them.
ATTR_MAX_FILE_SIZE = 100 * 1024 * 1024
ATTR_MAX_LINE_LENGTH = 2048

# Invisible formatting characters and the line and paragraph separators: a name holding
# one does not read as what it is. (Control characters, Cc, get a reason of their own.)
_INVISIBLE_CATEGORIES = frozenset({"Cf", "Zl", "Zp"})
# Letters and symbols that render as nothing and are no default-ignorable (a name of them
# looks empty, or like its neighbour with a space), and look-alikes of the two characters
# a path is read by, '/' and '.' ("a\u2215b" reads as a file b in a folder a).
LOOKALIKES = frozenset(
    {
        "\u2800",  # BRAILLE PATTERN BLANK
        "\U0001d159",  # MUSICAL SYMBOL NULL NOTEHEAD
        "\U0001d15a",  # MUSICAL SYMBOL CLEF-8 (renders blank in common fonts)
        "\u2044",  # FRACTION SLASH
        "\u2215",  # DIVISION SLASH
        "\u29f8",  # BIG SOLIDUS
        "\uff0f",  # FULLWIDTH SOLIDUS
        "\u2024",  # ONE DOT LEADER
        "\ufe52",  # SMALL FULL STOP
        "\uff0e",  # FULLWIDTH FULL STOP
    }
)
# Unicode's Default_Ignorable_Code_Point, from DerivedCoreProperties.txt (Unicode 16.0):
# first and last code point of each range. Most are Cf, refused as such already; the
# rest render as nothing (U+034F COMBINING GRAPHEME JOINER, the Hangul fillers, the
# variation selectors, the Khmer inherent vowels) or are reserved to be ignored.
DEFAULT_IGNORABLE: tuple[tuple[int, int], ...] = (
    (0x00AD, 0x00AD),
    (0x034F, 0x034F),
    (0x061C, 0x061C),
    (0x115F, 0x1160),
    (0x17B4, 0x17B5),
    (0x180B, 0x180F),
    (0x200B, 0x200F),
    (0x202A, 0x202E),
    (0x2060, 0x206F),
    (0x3164, 0x3164),
    (0xFE00, 0xFE0F),
    (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0),
    (0xFFF0, 0xFFF8),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0000, 0xE0FFF),
)
_IGNORABLE_STARTS = tuple(first for first, _ in DEFAULT_IGNORABLE)


def is_default_ignorable(ch: str) -> bool:
    """Whether ``ch`` has Unicode's Default_Ignorable_Code_Point property."""
    index = bisect_right(_IGNORABLE_STARTS, ord(ch)) - 1
    return index >= 0 and ord(ch) <= DEFAULT_IGNORABLE[index][1]


def legibility_problem(text: str, what: str) -> str | None:
    """Why ``text`` (``what`` it is, for the reason) does not read as what it is, or None.

    Refused: control characters (C0, DEL, C1), invisible formatting characters
    (category Cf: bidi overrides and isolates, zero-width characters, the soft hyphen,
    the byte-order mark...), line and paragraph separators, default-ignorable code
    points, and every space other than U+0020 (category Zs: no-break, figure,
    ideographic...). The reason names the code point.
    """
    if text.isascii() and text.isprintable():
        return None  # the common case; every refused character is unprintable or not ASCII
    for ch in text:
        if _illegible(ch):
            return f"U+{ord(ch):04X} {unicodedata.name(ch, _unnamed(ch))} in {what}"
    if not unicodedata.is_normalized("NFC", text):
        return (
            f"{what} is not in Unicode's composed form (NFC), so it would read as "
            f"{shown(unicodedata.normalize('NFC', text).encode())}; write it composed"
        )
    return None


def _illegible(ch: str) -> bool:
    category = unicodedata.category(ch)
    return (
        category == "Cc"
        or category in _INVISIBLE_CATEGORIES
        or (category == "Zs" and ch != " ")
        or category == "Co"  # private use: no reader knows what it shows
        or _is_noncharacter(ch)
        or ch in LOOKALIKES
        or is_default_ignorable(ch)
    )


def _is_noncharacter(ch: str) -> bool:
    """Unicode's 66 noncharacters (U+FDD0..U+FDEF and the last two of every plane)."""
    code = ord(ch)
    return 0xFDD0 <= code <= 0xFDEF or code & 0xFFFE == 0xFFFE


def _unnamed(ch: str) -> str:
    category = unicodedata.category(ch)
    if category == "Cc":
        return "control character"
    return "private use character" if category == "Co" else "noncharacter or unassigned"


def shown(raw: bytes) -> str:
    """A name for a one-line message: quoted, every character a reader could not see
    (what ``legibility_problem`` refuses) escaped, and cut when huge."""
    try:
        quoted = repr(raw.decode("utf-8"))
    except UnicodeDecodeError:
        quoted = repr(raw)
    visible = "".join(f"\\u{ord(ch):04x}" if _illegible(ch) else ch for ch in quoted)
    return visible if len(visible) <= 160 else visible[:150] + "...(cut)"


def component_problem(part: str) -> str | None:
    """Why one path component cannot be in a lineage's tree, or None.

    The component rules, legibility, and git's .git and .gitmodules in every spelling
    git reads as one. Paths and their depth are the caller's: a tree entry's name is one
    component, an archive member's name is split by the decoder.
    """
    if part == "":
        return "empty path component (a doubled or trailing slash)"
    if part in (".", ".."):
        return f"{part!r} path component"
    if len(part.encode()) > NAME_MAX:
        return f"path component longer than {NAME_MAX} bytes"
    if (problem := legibility_problem(part, "the name")) is not None:
        return problem
    if is_whole_dotgit(part):
        return f"{part!r} is, or is treated by git as, a .git directory"
    if BACKSLASH_NTFS_DOTGIT.search(part) is not None:
        return (
            f"{part!r} holds a .git after a backslash, a separator on Windows: "
            "git fsck refuses it (hasDotgit)"
        )
    return None


def gitmodules_problem(part: str) -> str | None:
    """Why ``part`` (a file or directory name) cannot be committed as a .gitmodules, or None.

    git fsck refuses submodule URLs an organism could write there, and a mirror or
    shared repository that checks objects would then refuse the lineage's pushes.
    """
    if is_gitmodules(part):
        return "a .gitmodules (or a name git treats so) cannot be committed"
    return None


def tree_name_problem(name: bytes) -> str | None:
    """Why one entry name of a git tree (raw bytes, as git stores it) is refused, or None."""
    try:
        part = name.decode("utf-8")
    except UnicodeDecodeError:
        return "the name is not valid UTF-8"
    return component_problem(part) or gitmodules_problem(part)


def target_problem(target: bytes) -> str | None:
    """Why a symlink target (raw bytes, as an archive or git stores it) is refused, or
    None. A target is stored verbatim, absolute or climbing; it only has to be storable
    and legible: git log -p and the web UI show it as text, to a person."""
    try:
        text = target.decode("utf-8")
    except UnicodeDecodeError:
        return "the symlink target is not valid UTF-8"
    if not text:
        return "empty symlink target"
    if "\0" in text:
        return "NUL in the symlink target"
    if (problem := legibility_problem(text, "the symlink target")) is not None:
        return problem
    if len(target) > PATH_MAX:
        return f"symlink target longer than {PATH_MAX} bytes"
    return None


def is_dotgit(part: str) -> bool:
    """.git as git reads it (is_hfs_dotgit, is_ntfs_dotgit), also after any backslash:
    git fsck (fsck_tree) checks what follows each '\\', a separator on Windows."""
    return is_whole_dotgit(part) or BACKSLASH_NTFS_DOTGIT.search(part) is not None


def is_whole_dotgit(part: str) -> bool:
    """The component itself is .git as git reads it (is_hfs_dotgit, is_ntfs_dotgit)."""
    return _hfs_folded(part) == ".git" or NTFS_DOTGIT.fullmatch(part) is not None


def is_gitmodules(part: str) -> bool:
    """git's own spellings of ".gitmodules" (is_hfs_dotgitmodules, is_ntfs_dotgitmodules),
    and the NTFS ones after any backslash of the component."""
    return (
        _hfs_folded(part) == ".gitmodules"
        or NTFS_DOTGITMODULES.fullmatch(part) is not None
        or BACKSLASH_NTFS_DOTGITMODULES.search(part) is not None
    )


def is_gitattributes(part: str) -> bool:
    """A component git fsck reads as .gitattributes (is_hfs_dotgitattributes,
    is_ntfs_dotgitattributes). fsck_tree checks no backslash segment for this one."""
    return (
        _hfs_folded(part) == ".gitattributes" or NTFS_DOTGITATTRIBUTES.fullmatch(part) is not None
    )


def gitattributes_problem(buffer: bytes, start: int, size: int) -> str | None:
    """fsck_blob's rules for a .gitattributes file (the ``size`` bytes of ``buffer`` at
    ``start``): the size, then each line up to the first NUL (git scans the blob as a C
    string, with strchrnul for each '\\n'). The reason it is refused, or None.

    Linear in the file with few Python steps: a line of ATTR_MAX_LINE_LENGTH bytes or
    more covers one of the offsets ``start + k * ATTR_MAX_LINE_LENGTH``, so only the
    bytes around each of those are searched. (Splitting the file into lines took
    seconds and a gigabyte for 100 MiB of newlines.)
    """
    if size > ATTR_MAX_FILE_SIZE:
        return (
            f"a .gitattributes (or a name git reads so) of more than {ATTR_MAX_FILE_SIZE} "
            "bytes: git fsck refuses it (gitattributesLarge)"
        )
    end = buffer.find(b"\0", start, start + size)
    if end < 0:
        end = start + size
    longest = ATTR_MAX_LINE_LENGTH
    for mark in range(start, end, longest):
        before = buffer.rfind(b"\n", max(start, mark - longest), mark)
        after = buffer.find(b"\n", mark, min(end, mark + longest))
        line_start = before + 1 if before >= 0 else max(start, mark - longest)
        line_end = after if after >= 0 else min(end, mark + longest)
        if line_end - line_start >= longest:
            return (
                f"a .gitattributes (or a name git reads so) with a line of "
                f"{ATTR_MAX_LINE_LENGTH} bytes or more: git fsck refuses it "
                "(gitattributesLineLength)"
            )
    return None


def _hfs_folded(part: str) -> str:
    """The name as HFS+ compares it, as far as git's needles (plain ASCII) need.

    HFS+ also ignores some zero-width and bidi code points (git's next_hfs_char), but
    they are all Cf, so a name holding one is refused for its legibility first.
    """
    return part.lower() if part.isascii() else part
