"""Live workers for the web UI, from the broker, only when it answers quickly.

Owns the optional provider the overview and ``/metrics`` call: which workers are
alive and which queues they serve (a generation queue is ``gen.<fingerprint12>``,
one per instrument), asked through ``scheduler.liveness.ask``. Browsing must never
hang on the broker or fail because of it: the provider answers None when no Celery
app can be built (settings that do not validate; shown as "no broker"), reports an
unreachable broker as such, reports no workers without asking when the embedded
broker is not running (every worker starts it, so none can be live), and
remembers its answer for a few seconds so that a dead broker costs one timeout
per interval, not one per page view.

Trusts: a client Celery app (``worker.fleet.app.client_app``: it loads no worker
instrument, so the web UI runs where no sandbox could).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from scheduler.liveness import Workers, ask
from worker.fleet import embedded_redis
from worker.fleet.app import client_app
from worker.fleet.settings import Settings

WorkersProvider = Callable[[], Workers | None]
REMEMBER_SECONDS = 5.0


def live_workers() -> Workers | None:
    """The live workers; None if there is no Celery app to ask."""
    try:
        settings = Settings()
    except ValueError:  # settings that do not validate: no broker to ask
        return None
    if not settings.broker_url and not embedded_redis.running(settings):
        return Workers(reachable=True, workers=[])
    return ask(client_app(settings))


def remembered(provider: WorkersProvider, seconds: float = REMEMBER_SECONDS) -> WorkersProvider:
    """``provider`` with its last answer kept for ``seconds``."""
    lock = threading.Lock()
    last: list[tuple[float, Workers | None]] = []

    def cached() -> Workers | None:
        with lock:
            if last and time.monotonic() - last[0][0] < seconds:
                return last[0][1]
            answer = provider()
            last[:] = [(time.monotonic(), answer)]
            return answer

    return cached
