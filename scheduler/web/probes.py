"""A dependency's latest answer, asked in the background at most once per interval.

Owns the web process's bounded reads of what it does not control (the broker, the
live workers' broadcast, the observation store's figures for ``/metrics``): a
``Probe`` asks its source in a thread of its own, never two at once, and at most
once per ``interval``; a request reads the latest answer. A request waits for a
probe only when there is no recent answer at all, and then for at most ``budget``,
so however the source behaves (refusing, hanging, slow) a request answers within
the budget, and concurrent requests share one probe instead of queueing behind one
each. An answer older than ``max_age`` is no answer: the caller reports the source
as unknown, never what it said long ago.

Trusts: the ``ask`` it is given to return or raise; any exception it raises is the
source not answering.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from scheduler.sources import unreachable

T = TypeVar("T")
INTERVAL_SECONDS = 2.0
BUDGET_SECONDS = 0.25
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Answer(Generic[T]):
    """What a source said (``value``), or why it said nothing (``error``), and when."""

    value: T | None
    error: str | None
    at: float

    @property
    def ok(self) -> bool:
        return self.error is None


class Probe(Generic[T]):
    """``ask``'s latest answer, refreshed in the background once per ``interval``."""

    def __init__(
        self,
        name: str,
        ask: Callable[[], T],
        *,
        interval: float = INTERVAL_SECONDS,
        budget: float = BUDGET_SECONDS,
        max_age: float | None = None,
    ) -> None:
        self.name = name
        self.ask = ask
        self.interval = interval
        self.budget = budget
        # A slow but answering source keeps its last answer while the next is asked (the
        # workers' broadcast alone takes a second, more on a busy host).
        self.max_age = max_age if max_age is not None else 5 * interval
        self.asked = 0  # how many times the source was asked (one per interval at most)
        self._lock = threading.Lock()
        self._answer: Answer[T] | None = None
        self._done = threading.Event()
        self._asking = False

    def refresh(self) -> None:
        """Start a probe if the answer is due and none is under way."""
        with self._lock:
            answer = self._answer
            if self._asking or (
                answer is not None and time.monotonic() - answer.at < self.interval
            ):
                return
            self._asking = True
            self._done.clear()
        threading.Thread(target=self._probe, name=f"probe-{self.name}", daemon=True).start()

    def latest(self, until: float | None = None) -> Answer[T] | None:
        """The newest answer not older than ``max_age``; None if there is none.

        Starts a probe when the answer is due; waits for it only when there is no
        recent answer to give meanwhile, at most ``budget`` or until ``until`` (a
        ``time.monotonic()`` deadline several probes share).
        """
        self.refresh()
        answer = self._recent()
        if answer is None:
            deadline = until if until is not None else time.monotonic() + self.budget
            self._done.wait(max(0.0, deadline - time.monotonic()))
            answer = self._recent()
        return answer

    def _recent(self) -> Answer[T] | None:
        with self._lock:
            answer = self._answer
        return (
            answer if answer is not None and time.monotonic() - answer.at < self.max_age else None
        )

    def _probe(self) -> None:
        try:
            answer: Answer[T] = Answer(self.ask(), None, time.monotonic())
        except Exception as exc:  # any failure of the source is "it did not answer"
            log.debug("%s did not answer", self.name, exc_info=True)
            answer = Answer(None, unreachable(exc), time.monotonic())
        with self._lock:
            self.asked += 1
            self._answer = answer
            self._asking = False
            self._done.set()
