"""The code points no reader output carries raw: C1 controls and bidi controls.

Owns the set, and the two escaped forms the read side writes instead: ``\\x9b`` /
``\\u202e`` on a terminal, and ``\\u009b`` / ``\\u202e`` inside JSON (which allows any
character in a string escaped so, and puts these nowhere outside a string). A C1 control
is a terminal command (U+009B is CSI, which xterm acts on); a bidi control reorders
what follows it on screen (the "Trojan Source" display, where code reads otherwise
than it runs). Organisms write both into file names, file contents, stderr and model
text, and lineages recorded before the decoder refused them in names keep them.

Trusts nothing in the text it is given. Pure functions; imports nothing of the fleet.
"""

from __future__ import annotations

import re
import unicodedata

# Unicode's Bidi_Control property (PropList.txt), and C1.
BIDI_CONTROLS = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
# What ``escape_*`` rewrite, and what the web UI marks.
UNSAFE = re.compile(f"[\x80-\x9f{BIDI_CONTROLS}]")
# What a web page shows by its code point (``<U+200B>``): UNSAFE, and every other
# character a reader cannot see: C0 but tab, newline and carriage return, DEL, and
# Unicode's invisible format characters (zero-width space, joiners, the byte-order mark).
INVISIBLE = re.compile(
    "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f"
    "\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb]"
)


def escape_for_terminal(text: str) -> str:
    """``text`` with each C1 or bidi control written as its escape (``\\x9b``, ``\\u202e``)."""
    return UNSAFE.sub(_terminal_escape, text)


def escape_for_json(text: str) -> str:
    """JSON text with each C1 or bidi control written as a ``\\uXXXX`` escape: the same
    JSON value, every such character inert."""
    return UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def describe(ch: str) -> str:
    """``U+202E RIGHT-TO-LEFT OVERRIDE``: a code point by number and name."""
    return f"U+{ord(ch):04X} {unicodedata.name(ch, 'control')}"


def _terminal_escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"
