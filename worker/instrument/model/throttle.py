"""The cap on calls to a provider: the interface the model socket waits on, and its local form.

Owns the ``Throttle`` protocol that the model socket calls before every attempt at a
vendor, the ``Cap`` it enforces per provider and per model, the order in which waiters
are served, and ``LocalThrottle``, which enforces the caps within one process
(``run --local``, the tests). The fleet's shared form, one cap for every worker
through Redis, is ``worker.fleet.model_throttle``; the fleet passes it in through the
pipeline, so nothing here knows where the fleet keeps its state.

A call satisfies its provider's cap and, when one is set, its model's cap (a model's
cap is per provider too: the same model name at two vendors is two accounts' limits).

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

Waiters are served in arrival order, per cap: each cap keeps a queue, and only its
head may take room. A call with a model cap queues for its model first, and joins its
provider's queue (in its place by arrival) only once it heads its model's queue and
its model has room: a model held back by its own cap never holds up the provider's
other models. Every queue a call joins orders it by the same arrival, so no two
calls can each stand ahead of the other and nobody waits on a cycle.

An attempt waits for room until its call's deadline, never longer: that wait is the
call's, and the socket records it per attempt. The room is held until the block ends,
or until ``Admission.release`` gives it back sooner: the socket does so for every
attempt still running when its life ends, since nobody wants that answer any more and
a hostile organism must not keep the fleet's room after its exit. Trusts its callers'
figures.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Mapping
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

    @property
    def limits(self) -> bool:
        """Whether any limit is on."""
        return bool(self.concurrent_calls or self.requests_per_minute or self.tokens_per_minute)


def cap_name(provider: str, model: str | None = None) -> str:
    """The name a provider's cap, or a model's cap at that provider, is kept under."""
    return provider if model is None else f"{provider}:model:{model}"


def caps_of(
    provider: str, model: str, cap: Cap, model_caps: Mapping[str, Cap]
) -> list[tuple[str, Cap]]:
    """The caps a call must satisfy, each with the name its state is kept under.

    The model's comes first: a call queues for it before it queues for its provider's.
    """
    named = []
    of_model = model_caps.get(model)
    if of_model is not None and of_model.limits:
        named.append((cap_name(provider, model), of_model))
    if cap.limits:
        named.append((provider, cap))
    return named


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
        self, provider: str, model: str, tokens: int, deadline: float, stop: threading.Event
    ) -> AbstractContextManager[Admission]:
        """Wait for room for one request of about ``tokens`` to ``model``, and hold it
        for the block; waiters are served in arrival order.

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
    """Caps kept in this process's memory: right for one process, blind to others."""

    def __init__(self, cap: Cap | None = None, model_caps: Mapping[str, Cap] | None = None) -> None:
        self.cap = cap or Cap()
        self.model_caps = dict(model_caps or {})
        self._changed = threading.Condition()
        self._tickets = itertools.count()
        # Per cap: the tickets waiting, in arrival order, and the calls in progress.
        self._queues: dict[str, list[int]] = {}
        self._running: dict[str, int] = {}
        # Per cap, the earliest time (time.monotonic()) the next request may go by the
        # request pace and by the token pace.
        self._next: dict[str, tuple[float, float]] = {}

    @contextmanager
    def admit(
        self, provider: str, model: str, tokens: int, deadline: float, stop: threading.Event
    ) -> Iterator[Admission]:
        started = time.monotonic()
        named = caps_of(provider, model, self.cap, self.model_caps)
        with self._changed:
            ticket = next(self._tickets)
            try:
                while (wait := self._wait(named, ticket)) > 0:
                    now = time.monotonic()
                    if stop.is_set() or now >= deadline:
                        raise no_room(provider, now - started)
                    self._changed.wait(min(wait, deadline - now, POLL_SECONDS))
            finally:
                # Admitted or not, the ticket leaves every queue; the next head looks.
                self._leave(named, ticket)
            self._take(named, tokens)
        held = [True]

        def release() -> None:
            with self._changed:
                if held:
                    held.clear()
                    for name, _ in named:
                        self._running[name] -= 1
                    self._changed.notify_all()

        try:
            yield Admission(time.monotonic() - started, release=release)
        finally:
            release()

    def waiting(self, provider: str, model: str | None = None) -> int:
        """How many calls wait for the provider's cap, or for the model's at it."""
        with self._changed:
            return len(self._queues.get(cap_name(provider, model), []))

    def _wait(self, named: list[tuple[str, Cap]], ticket: int) -> float:
        """0 when the ticket heads every queue and has room now, else how long to wait
        before looking again."""
        for name, cap in named:
            queue = self._queues.setdefault(name, [])
            if ticket not in queue:
                bisect.insort(queue, ticket)
            if queue[0] != ticket:
                return POLL_SECONDS
            if cap.concurrent_calls and self._running.get(name, 0) >= cap.concurrent_calls:
                return POLL_SECONDS
            wait = max(self._next.get(name, (0.0, 0.0))) - time.monotonic()
            if wait > 0:
                return wait
        return 0.0

    def _leave(self, named: list[tuple[str, Cap]], ticket: int) -> None:
        for name, _ in named:
            queue = self._queues.get(name, [])
            if ticket in queue:
                queue.remove(ticket)
            if not queue:
                self._queues.pop(name, None)
        self._changed.notify_all()

    def _take(self, named: list[tuple[str, Cap]], tokens: int) -> None:
        now = time.monotonic()
        for name, cap in named:
            window = cap.window_seconds
            by_requests, by_tokens = self._next.get(name, (now, now))
            if cap.requests_per_minute:
                by_requests = max(by_requests, now) + window / cap.requests_per_minute
            if cap.tokens_per_minute:
                by_tokens = max(by_tokens, now) + tokens * window / cap.tokens_per_minute
            self._next[name] = (by_requests, by_tokens)
            self._running[name] = self._running.get(name, 0) + 1
