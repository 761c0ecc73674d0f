"""The observation store as the web process reads it: every call bounded, an outage remembered.

Owns ``GuardedStore``, the read-only wrapper ``create_app`` puts around the reader's
store. Each read runs in a small pool of its own and is waited for at most
``CALL_SECONDS``; a read that fails or overruns marks the store down for
``DOWN_SECONDS``, during which every read fails at once with the reason (a page
answers 503 at once instead of each request paying its own timeout). The first read
after that interval asks the store again, alone: the others keep failing fast until
it answers. A read left running after its caller gave up ends by the store client's
own connect and read timeouts; the pool's size bounds how many can.

Trusts: the wrapped store (it raises ``StoreUnavailable`` for what it cannot read).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

from scheduler.sources import unreachable
from worker.instrument.store import ObservationStore, StoreUnavailable

T = TypeVar("T")
CALL_SECONDS = 0.5
DOWN_SECONDS = 2.0
POOL_SIZE = 4


class GuardedStore(ObservationStore):
    """``inner``'s reads, each bounded in time, failing fast while the store is down."""

    def __init__(
        self,
        inner: ObservationStore,
        *,
        call_seconds: float = CALL_SECONDS,
        down_seconds: float = DOWN_SECONDS,
    ) -> None:
        self.inner = inner
        self.url = inner.url
        self.call_seconds = call_seconds
        self.down_seconds = down_seconds
        self._pool = ThreadPoolExecutor(POOL_SIZE, thread_name_prefix="store-read")
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._reason = ""

    def _get(self, key: str) -> bytes | None:
        return self._bounded(lambda: self.inner.get(key))

    def _list(self, prefix: str) -> list[str]:
        return self._bounded(lambda: self.inner.list(prefix))

    def _put_once(self, key: str, data: bytes) -> bool:
        raise StoreUnavailable("the web process only reads the observation store")

    def _put(self, key: str, data: bytes) -> None:
        raise StoreUnavailable("the web process only reads the observation store")

    def _bounded(self, read: Callable[[], T]) -> T:
        with self._lock:
            now = time.monotonic()
            if now < self._down_until:
                raise StoreUnavailable(f"the observation store {self._reason}")
            if self._reason:
                # Down before: this read asks again, and the others wait for its answer
                # as failing fast.
                self._down_until = now + self.down_seconds
        future = self._pool.submit(read)
        try:
            value = future.result(timeout=self.call_seconds)
        except FutureTimeout:
            future.cancel()  # still queued behind reads that hang: never run it
            self._mark_down(f"did not answer within {self.call_seconds:g} s")
            raise StoreUnavailable(f"the observation store {self._reason}") from None
        except StoreUnavailable as exc:
            self._mark_down(unreachable(exc))
            raise
        with self._lock:
            self._down_until, self._reason = 0.0, ""
        return value

    def _mark_down(self, reason: str) -> None:
        with self._lock:
            self._down_until = time.monotonic() + self.down_seconds
            self._reason = reason
