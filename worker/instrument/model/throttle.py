"""The cap on calls to a provider: the interface the model socket waits on, and its local form.

Owns the ``Throttle`` protocol that the model socket calls before every attempt at a
vendor, the ``Cap`` it enforces per provider, and ``LocalThrottle``, which enforces a
cap within one process (``run --local``, the tests). The fleet's shared form, one
cap for every worker through Redis, is ``worker.fleet.model_throttle``; the fleet
passes it in through the pipeline, so nothing here knows where the fleet keeps its
state.

A cap has three limits, each off at 0:

* calls in progress at once;
* requests per minute, as a pace: one request every minute / rate, never a burst.
  Vendors meter with token buckets and may enforce a per-minute limit over shorter
  intervals (60 per minute as 1 per second), so a minute's worth at once would be
  refused even when the minute's total is not; paced, no rolling minute and no
  shorter interval sees more than its share;
* estimated tokens per minute, as a pace too: each request holds back the next one
  for its own tokens' share of the minute (prompt bytes / 4 plus the output granted,
  as vendors' limiters estimate), so a large request is never starved, only followed
  by a longer gap.

An attempt waits for room until its call's deadline, never longer: that wait is the
call's, and the socket records it per attempt. The room is held until the block ends,
or until ``Admission.release`` gives it back sooner: the socket does so for every
attempt still running when its life ends, since nobody wants that answer any more and
a hostile organism must not keep the fleet's room after its exit. Trusts its callers'
figures.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Protocol

WINDOW_SECONDS = 60.0
# How often a waiter looks again when it cannot know when room will come (a call in
# progress ends whenever the vendor answers).
POLL_SECONDS = 0.25


@dataclass(frozen=True)
class Cap:
    """What one provider may be sent across the fleet; 0 switches a limit off."""

    concurrent_calls: int = 0
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    # The "minute" of the two paces (shorter only in tests).
    window_seconds: float = WINDOW_SECONDS


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Admission:
    """Room under the cap for one request: how long it took, and any note on the cap.

    release gives the room back before the block ends; it may be called from any
    thread, any number of times, and the block's end after it does nothing more.
    """

    waited_seconds: float
    note: str | None = None
    release: Callable[[], None] = field(default=_nothing, compare=False, repr=False)


class NoRoom(Exception):
    """The cap had no room for the request before its deadline, or the life ended."""

    def __init__(self, reason: str, waited_seconds: float) -> None:
        super().__init__(reason)
        self.waited_seconds = waited_seconds


class Throttle(Protocol):
    """Room under the cap of a provider, held for one request."""

    def admit(
        self, provider: str, tokens: int, deadline: float, stop: threading.Event
    ) -> AbstractContextManager[Admission]:
        """Wait for room for one request of about ``tokens``, and hold it for the block.

        ``deadline`` is a ``time.monotonic()`` time. Raises NoRoom at the deadline, or
        as soon as ``stop`` is set (the life has ended: nobody wants the answer).
        """
        ...


def no_room(provider: str, waited: float) -> NoRoom:
    return NoRoom(
        f"no room under the fleet's cap for {provider} before the call's deadline "
        f"(waited {waited:.1f} s); nothing was sent",
        waited,
    )


class LocalThrottle:
    """A cap kept in this process's memory: right for one process, blind to others."""

    def __init__(self, cap: Cap | None = None) -> None:
        self.cap = cap or Cap()
        self._changed = threading.Condition()
        self._running: dict[str, int] = {}
        # Per provider, the earliest time (time.monotonic()) the next request may go
        # by the request pace and by the token pace.
        self._next: dict[str, tuple[float, float]] = {}

    @contextmanager
    def admit(
        self, provider: str, tokens: int, deadline: float, stop: threading.Event
    ) -> Iterator[Admission]:
        started = time.monotonic()
        with self._changed:
            while (wait := self._wait(provider)) > 0:
                now = time.monotonic()
                if stop.is_set() or now >= deadline:
                    raise no_room(provider, now - started)
                self._changed.wait(min(wait, deadline - now, POLL_SECONDS))
            self._take(provider, tokens)
        held = [True]

        def release() -> None:
            with self._changed:
                if held:
                    held.clear()
                    self._running[provider] -= 1
                    self._changed.notify_all()

        try:
            yield Admission(time.monotonic() - started, release=release)
        finally:
            release()

    def _wait(self, provider: str) -> float:
        """0 when there is room now, else how long to wait before looking again."""
        if (
            self.cap.concurrent_calls
            and self._running.get(provider, 0) >= self.cap.concurrent_calls
        ):
            return POLL_SECONDS
        return max(self._next.get(provider, (0.0, 0.0))) - time.monotonic()

    def _take(self, provider: str, tokens: int) -> None:
        cap, now = self.cap, time.monotonic()
        by_requests, by_tokens = self._next.get(provider, (now, now))
        if cap.requests_per_minute:
            by_requests = max(by_requests, now) + cap.window_seconds / cap.requests_per_minute
        if cap.tokens_per_minute:
            by_tokens = max(by_tokens, now) + tokens * cap.window_seconds / cap.tokens_per_minute
        self._next[provider] = (by_requests, by_tokens)
        self._running[provider] = self._running.get(provider, 0) + 1
