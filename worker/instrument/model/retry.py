"""Retrying a model call: which vendor failures pass, how long to wait, when to give up.

Owns the retry policy of the model socket and the reading of a vendor's own advice.
A failure is worth another attempt when the vendor calls it passing: 408, 409, 429,
any 5xx (529 "overloaded" included), a connection that could not be made or was
lost, and a stall (no byte for ``stall_seconds``). ``x-should-retry``, which the
Anthropic and OpenAI APIs send, overrides the status either way. The wait before the
next attempt is what the vendor asked for (``retry-after-ms``, else ``retry-after``
in seconds or as an HTTP date), else an exponential backoff with jitter, so lineages
that failed together do not come back together. Attempts stop at ``max_attempts``,
and never run past the call's deadline: a vendor asking for a wait longer than what
is left ends the call at once rather than holding the organism to its deadline.

Pure: it reads headers and numbers and holds no state. Trusts nothing it parses: a
header that is not a sane number or date is ignored.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

RETRY_STATUSES = frozenset({408, 409, 429})
# A retry-after beyond a day is not advice this socket can follow; it is ignored.
MAX_RETRY_AFTER_SECONDS = 24 * 3600.0


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently one model call is tried."""

    max_attempts: int = 8
    first_backoff_seconds: float = 1.0
    max_backoff_seconds: float = 30.0
    # An attempt that receives no byte for this long is abandoned as stalled.
    stall_seconds: float = 300.0

    def backoff_seconds(
        self, failed_attempt: int, retry_after: float | None, rng: random.Random
    ) -> float:
        """The wait after attempt number ``failed_attempt``: the vendor's, else backoff.

        The backoff doubles from first_backoff_seconds up to max_backoff_seconds and is
        drawn from its upper half, so that it still grows while spreading the callers.
        """
        if retry_after is not None:
            return retry_after
        ceiling = min(
            self.max_backoff_seconds, self.first_backoff_seconds * 2.0 ** (failed_attempt - 1)
        )
        return ceiling * (0.5 + rng.random() / 2)


def retryable_status(status: int) -> bool:
    """Whether an HTTP status from a vendor says the same request may succeed later."""
    return status in RETRY_STATUSES or status >= 500


def should_retry(status: int, headers: Mapping[str, str]) -> bool:
    """The status's verdict, unless the vendor's ``x-should-retry`` says otherwise."""
    advice = (headers.get("x-should-retry") or "").strip().lower()
    if advice == "true":
        return True
    if advice == "false":
        return False
    return retryable_status(status)


def retry_after_seconds(headers: Mapping[str, str], now: datetime | None = None) -> float | None:
    """The wait a vendor asked for, in seconds, or None when it asked for none we can use.

    ``retry-after-ms`` (OpenAI) wins over ``retry-after`` (RFC 9110: seconds, or an
    HTTP date); a negative, non-finite or absurd value is ignored.
    """
    milliseconds = _number(headers.get("retry-after-ms"))
    if milliseconds is not None:
        return _sane(milliseconds / 1000)
    value = (headers.get("retry-after") or "").strip()
    if not value:
        return None
    seconds = _number(value)
    if seconds is not None:
        return _sane(seconds)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    wait = (when - (now or datetime.now(UTC))).total_seconds()
    return min(max(wait, 0.0), MAX_RETRY_AFTER_SECONDS)


def _number(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        number = float(value.strip())
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _sane(seconds: float) -> float | None:
    return seconds if 0 <= seconds <= MAX_RETRY_AFTER_SECONDS else None
