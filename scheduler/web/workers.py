"""Live workers for the web UI, from the broker, never waited on for long.

Owns the optional provider the overview and ``/metrics`` call: which workers are
alive and which queues they serve (a generation queue is ``gen.<fingerprint12>``,
one per instrument), asked through ``scheduler.liveness.ask``. Browsing must never
hang on the broker or fail because of it: the provider answers None when no Celery
app can be built (settings that do not validate; shown as "no broker"), reports an
unreachable broker as such, reports no workers without asking when the embedded
broker is not running (every worker starts it, so none can be live). The web
app asks it through a ``Probe`` (``probed``): in the background, once per interval
at most, so the broadcast's own wait (about a second) and a dead broker's timeout
are never a page view's or a scrape's; until the probe has answered, the workers
are unknown (unreachable), never "none".

Trusts: a client Celery app (``worker.fleet.app.client_app``: it loads no worker
instrument, so the web UI runs where no sandbox could).
"""

from __future__ import annotations

from collections.abc import Callable

from scheduler.liveness import UNREACHABLE, Workers, ask
from scheduler.web.probes import Answer, Probe
from worker.fleet import embedded_redis
from worker.fleet.app import client_app
from worker.fleet.settings import Settings

WorkersProvider = Callable[[], Workers | None]


def live_workers() -> Workers | None:
    """The live workers; None if there is no Celery app to ask."""
    try:
        settings = Settings()
    except ValueError:  # settings that do not validate: no broker to ask
        return None
    if not settings.broker_url and not embedded_redis.running(settings):
        return Workers(reachable=True, workers=[])
    return ask(client_app(settings))


def probed(probe: Probe[Workers | None]) -> WorkersProvider:
    """The provider that reads ``probe``'s latest answer: unreachable when it has none."""

    def latest() -> Workers | None:
        return known(probe.latest())

    return latest


def known(answer: Answer[Workers | None] | None) -> Workers | None:
    """The workers an answer names; unreachable when the probe has no answer or failed."""
    return answer.value if answer is not None and answer.ok else UNREACHABLE
