"""Queue liveness: which live workers serve which instrument queue, and what a waiting user is told.

Owns asking the broker which queues the live workers consume (Celery's control
broadcast ``active_queues``, which each worker's own consumer answers, so a worker
that stopped consuming stops answering), the answer as data (``Workers`` of
``LiveWorker``), and the wording ``run``, ``status`` and the web UI share when a
lineage's queue ``gen.<fingerprint12>`` has no live worker: the queue, the
instrument it needs, the exact command that starts a worker for it on this host
(or ``run --local``), and which live workers serve other instruments instead.

An unreachable broker is "unknown" (``Workers.reachable`` false), never "no worker":
nothing here claims a queue is unserved unless the broker answered and no worker
named it. The broadcast waits its whole timeout for replies (it cannot know how
many workers there are), so every caller pays about ``INSPECT_TIMEOUT_SECONDS``.

Trusts: a client Celery app (``worker.fleet.app.client_app``: it loads no
instrument) and the shape of the broker's replies only after checking.
"""

from __future__ import annotations

import shlex
import shutil
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel

from worker.fleet.settings import Settings
from worker.instrument.fingerprint import current

if TYPE_CHECKING:
    # Only the callers that ask the broker build an app; status at rest never does.
    from celery import Celery

INSPECT_TIMEOUT_SECONDS = 1.0
GENERATION_QUEUE_PREFIX = "gen."


class LiveWorker(BaseModel):
    """A worker that answered, and the queues it consumes."""

    hostname: str
    queues: list[str]


class Workers(BaseModel):
    """The live workers that answered the broker, or ``reachable=False`` if it did not."""

    reachable: bool
    workers: list[LiveWorker]

    def serving(self, queue: str) -> list[str]:
        """Hostnames of the live workers that consume ``queue``."""
        return [w.hostname for w in self.workers if queue in w.queues]

    def elsewhere(self, queue: str) -> list[LiveWorker]:
        """Live workers that serve other instruments' queues and not ``queue``."""
        return [
            w
            for w in self.workers
            if queue not in w.queues and any(_generation_queue(q) for q in w.queues)
        ]

    def unserved(self, queue: str) -> bool:
        """Whether the broker answered and no live worker consumes ``queue``."""
        return self.reachable and not self.serving(queue)

    def per_queue(self) -> dict[str, int]:
        """How many live workers consume each queue some worker consumes."""
        counts: dict[str, int] = {}
        for worker in self.workers:
            for queue in worker.queues:
                counts[queue] = counts.get(queue, 0) + 1
        return counts


UNREACHABLE = Workers(reachable=False, workers=[])


class _Enough(Exception):
    """Raised from a reply callback to stop waiting: the caller has the answer it needs."""


def ask(
    app: Celery, timeout: float = INSPECT_TIMEOUT_SECONDS, until_served: set[str] | None = None
) -> Workers:
    """The live workers and their queues, asked through ``app``'s broker.

    The broadcast waits its whole timeout, unless ``until_served`` names queues: then
    it stops at the first moment every one of them has a live worker (the answer
    then lists only the workers that replied by then). It runs in a daemon thread
    joined with a deadline: a broker that accepts the connection and then never
    answers costs the caller a bounded wait.
    """
    found: list[LiveWorker] = []
    answered: list[bool] = []

    def reply(body: object) -> None:
        if not isinstance(body, dict):
            return  # a reply of another shape is no evidence of any worker
        for hostname, queues in body.items():
            listed = queues if isinstance(queues, list) else []
            names = [str(q["name"]) for q in listed if isinstance(q, dict) and "name" in q]
            found.append(LiveWorker(hostname=str(hostname), queues=sorted(names)))
        if until_served and until_served <= {q for w in found for q in w.queues}:
            raise _Enough

    def inspect() -> None:
        try:
            with app.connection_for_read() as connection:
                # The stubs type timeout as int; kombu takes seconds as a float.
                connection.ensure_connection(
                    max_retries=1,
                    interval_start=0,
                    interval_step=0,
                    timeout=timeout,  # type: ignore[arg-type]
                )
                app.control.inspect(
                    timeout=timeout, connection=connection, callback=reply
                ).active_queues()
        except _Enough:
            pass
        except Exception:  # any failure to ask is "unknown", never "no worker"
            return
        answered.append(True)

    thread = threading.Thread(target=inspect, name="inspect-workers", daemon=True)
    thread.start()
    thread.join(timeout * 2 + 0.5)
    if not answered:
        return UNREACHABLE
    return Workers(reachable=True, workers=sorted(found, key=lambda w: w.hostname))


def start_command(settings: Settings | None) -> str:
    """The command that starts a worker on this host with these settings (if known).

    The embedded default's home is relative to the working directory, so it is
    spelled out absolute; ``celery`` is named by its full path unless the one on
    PATH is this interpreter's.
    """
    prefix = ""
    if settings is not None and not settings.broker_url:
        prefix = f"OUROBOROS_HOME={shlex.quote(str(settings.home_dir))} "
    celery = Path(sys.executable).parent / "celery"
    on_path = shutil.which("celery")
    program = "celery" if on_path and Path(on_path) == celery else shlex.quote(str(celery))
    return f"{prefix}{program} -A worker worker"


def start_hint(
    settings: Settings | None,
    lineage: str,
    fingerprint: str,
    version: str | None = None,
    commit: str | None = None,
) -> str:
    """How to get a worker for ``fingerprint``'s queue: here if this checkout is it, else where."""
    command = start_command(settings)
    if current().fingerprint == fingerprint:
        return (
            f"start one: {command} (or run without the fleet: "
            f"schedule-lineage run {lineage} --generations N --local)"
        )
    made = f" (version {version}, commit {commit[:12]})" if version and commit else ""
    return (
        f"it needs instrument {fingerprint[:12]}{made}, but this checkout is instrument "
        f"{current().fingerprint[:12]}: start {command} on a host whose checkout is that instrument"
    )


def waiting_line(lineage: str, queue: str, workers: Workers, hint: str) -> str:
    """The sentence for a lineage whose queue no live worker serves."""
    others = workers.elsewhere(queue)
    if not others:
        return f"{lineage}: waiting: no live worker serves queue {queue}; {hint}"
    listed = "; ".join(
        f"{w.hostname} serves {', '.join(q for q in w.queues if _generation_queue(q))}"
        for w in others
    )
    many = len(others) > 1
    counted = f"{len(others)} live worker{'s serve' if many else ' serves'}"
    return (
        f"{lineage}: waiting for its instrument: no live worker serves queue {queue}; "
        f"{counted} another instrument ({listed}); {hint}"
    )


def served_line(lineage: str, queue: str, hostnames: list[str]) -> str:
    """The sentence for a lineage whose queue a live worker now serves."""
    return f"{lineage}: queue {queue} is now served by {', '.join(hostnames)}"


def _generation_queue(queue: str) -> bool:
    return queue.startswith(GENERATION_QUEUE_PREFIX)
