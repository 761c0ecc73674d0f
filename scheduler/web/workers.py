"""Live workers, from Celery's inspect API, only when a broker answers quickly.

Owns the optional provider the overview calls: which workers are alive and which
queues they serve (a generation queue is ``gen.<fingerprint12>``, one per
instrument). Browsing must never hang on the broker or fail because of it, so the
provider runs the inspection in a daemon thread with a short deadline, answers []
on any error or timeout, answers None when no Celery app can be built (settings
that do not validate; shown as "no broker"), and remembers its answer for a few
seconds so that a dead broker costs one timeout per interval, not one per page view.

Trusts: a client Celery app (``worker.fleet.app.client_app``: it loads no worker
instrument, so the web UI runs where no sandbox could) and the shape of its replies
only after checking.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from scheduler.views import LiveWorker
from worker.fleet.app import client_app
from worker.fleet.settings import Settings

WorkersProvider = Callable[[], list[LiveWorker] | None]
INSPECT_TIMEOUT_SECONDS = 1.0
REMEMBER_SECONDS = 10.0


def live_workers(timeout: float = INSPECT_TIMEOUT_SECONDS) -> list[LiveWorker] | None:
    """Workers that answered within ``timeout``; None if there is no Celery app."""
    try:
        app = client_app(Settings())
    except ValueError:  # settings that do not validate: no broker to ask
        return None
    found: list[LiveWorker] = []

    def inspect() -> None:
        try:
            with app.connection_for_read() as connection:
                connection.ensure_connection(
                    max_retries=1, interval_start=0, interval_step=0, timeout=timeout
                )
                replies = app.control.inspect(
                    timeout=timeout, connection=connection
                ).active_queues()
            for hostname, queues in (replies or {}).items():
                names = sorted(str(q.get("name", "?")) for q in queues if isinstance(q, dict))
                found.append(LiveWorker(hostname=str(hostname), queues=names))
        except Exception:
            found.clear()  # a broken reply is no evidence of any worker

    thread = threading.Thread(target=inspect, name="inspect-workers", daemon=True)
    thread.start()
    thread.join(timeout * 2 + 0.5)
    return [] if thread.is_alive() else sorted(found, key=lambda w: w.hostname)


def remembered(provider: WorkersProvider, seconds: float = REMEMBER_SECONDS) -> WorkersProvider:
    """``provider`` with its last answer kept for ``seconds``."""
    lock = threading.Lock()
    last: list[tuple[float, list[LiveWorker] | None]] = []

    def cached() -> list[LiveWorker] | None:
        with lock:
            if last and time.monotonic() - last[0][0] < seconds:
                return last[0][1]
            answer = provider()
            last[:] = [(time.monotonic(), answer)]
            return answer

    return cached
