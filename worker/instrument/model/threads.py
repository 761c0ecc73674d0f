"""The threads a generation's calls to the provider run on.

Owns ``ModelThreads``: at most `size` daemon threads, started as calls arrive, each
running one blocking provider call at a time, so the event loop that serves the
socket never blocks on a vendor.

Trusts the calls it is given to end in time; it never waits for one at close.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from worker.instrument.model.providers import ProviderReply


class ModelThreads:
    """Runs provider calls on at most `size` daemon threads, started as calls arrive.

    Not a ThreadPoolExecutor: Python joins its threads at exit, so a call abandoned at
    its deadline to a vendor that keeps dripping bytes would hold up the worker's exit.
    """

    def __init__(self, size: int, name: str) -> None:
        self._size = size
        self._name = name
        self._started = 0
        self._queue: queue.SimpleQueue[
            tuple[Future[ProviderReply], Callable[[], ProviderReply]] | None
        ] = queue.SimpleQueue()

    def submit(self, call: Callable[[], ProviderReply]) -> Future[ProviderReply]:
        """Queue a call (from the event loop's thread only)."""
        future: Future[ProviderReply] = Future()
        self._queue.put((future, call))
        if self._started < self._size:
            self._started += 1
            threading.Thread(
                target=self._work, name=f"{self._name}-{self._started}", daemon=True
            ).start()
        return future

    def close(self) -> None:
        """Cancel the calls not started; each thread ends when its call, if any, returns."""
        with contextlib.suppress(queue.Empty):
            while item := self._queue.get_nowait():
                item[0].cancel()
        for _ in range(self._started):
            self._queue.put(None)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, call = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as exc:
                future.set_exception(exc)
