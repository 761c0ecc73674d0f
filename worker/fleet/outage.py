"""Outage notices: one log line when a dependency stops answering, one when it is back.

Owns the state of one process's view of one dependency (the observation store):
whether it is down and since when. Every failure and success is reported to it; it
logs only the transitions, so an outage of any length costs two lines per worker and
per reconciler, not one per run record or per retry.

Trusts: its callers' reports.
"""

from __future__ import annotations

import logging
import threading
import time

from worker.instrument.store import ObservationStore

# A key never written: reading it is the cheapest question the store must answer.
PROBE_KEY = "health/probe"


def probe(store: ObservationStore) -> None:
    """Ask ``store`` one cheap question; raises StoreUnavailable if it cannot answer."""
    store.get(PROBE_KEY)


class Outage:
    """Whether ``what`` is down, as seen by ``who``; logs each start and end once."""

    def __init__(self, what: str, who: str, log: logging.Logger) -> None:
        self.what = what
        self.who = who
        self.log = log
        self.since: float | None = None
        self._lock = threading.Lock()

    def failed(self, reason: object) -> None:
        with self._lock:
            if self.since is not None:
                return
            self.since = time.monotonic()
        self.log.warning("%s: %s is down (%s); carrying on without it", self.who, self.what, reason)

    def answered(self) -> None:
        with self._lock:
            if self.since is None:
                return
            lasted, self.since = time.monotonic() - self.since, None
        self.log.warning("%s: %s is back after %.0f s", self.who, self.what, lasted)
