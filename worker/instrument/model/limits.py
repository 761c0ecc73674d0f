"""What one generation's model socket may be made to hold, whatever its client does.

Owns the bounds the socket enforces and the manifest discloses: connections at once,
the size of a request's head, the time to send a request and to take an answer, the
calls of one generation and the text of them the audit keeps. The modules that
enforce a bound read it here at the moment they enforce it (``limits.NAME``, not a
copy taken at import), so that a test may lower one for the length of a test.

Trusts nothing: these are constants.
"""

from __future__ import annotations

MAX_CONNECTIONS = 8
MAX_HEAD_BYTES = 16 * 1024
REQUEST_SECONDS = 10
ANSWER_SECONDS = 10
# What one life may make the worker keep: its calls are audited in the worker's memory
# and written whole into the observation, outside the sandbox's memory ceiling.
MAX_CALLS = 1000
AUDIT_TEXT_BYTES = 32 * 1024 * 1024
# Of that, what calls never sent to the model (refused 400, 402, too late) may keep: the
# organism can make such calls at no cost, as fast as it likes, with the largest prompt.
REFUSED_TEXT_BYTES = 1024 * 1024
