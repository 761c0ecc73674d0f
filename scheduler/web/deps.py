"""Request-scoped access to what the app was built with, shared by API and pages.

Owns reaching the app's reader, settings and live-workers provider from a request,
the assembly of the overview (lineages from the reader, workers from the provider,
what blocks each lineage from the broker probe's latest answer when there is one, and
the queues running lineages wait on with no live worker), the lineage view with its
block, and the validation of URL parts the reader does not check itself.
"""

from __future__ import annotations

import re
from typing import Literal

from fastapi import Request

from scheduler.liveness import Workers, start_hint
from scheduler.reader import NotFound, Reader
from scheduler.views import LineageSummary, LineageView, Overview, QueueWait
from scheduler.web.broker import BrokerFigures
from scheduler.web.probes import Probe
from worker.fleet.settings import Settings
from worker.instrument.names import queue_name

_SEED_SHA = re.compile(r"^[0-9a-f]{64}$")


def reader_of(request: Request) -> Reader:
    reader: Reader = request.app.state.reader
    return reader


def workers_of(request: Request) -> Workers | None:
    workers: Workers | None = request.app.state.workers()
    return workers


def overview(request: Request) -> Overview:
    request.app.state.broker.refresh()  # asked alongside the workers, not after them
    workers = workers_of(request)
    found = _blocks(request)
    lineages = [
        summary.model_copy(update={"blocked": found.get(summary.name)})
        for summary in reader_of(request).summaries()
    ]
    return Overview(
        lineages=lineages,
        broker=_broker(workers),
        workers=workers.workers if workers else [],
        waiting=_waits(request, lineages, workers) if workers else [],
    )


def lineage_view(request: Request, name: str, page: int, per_page: int) -> LineageView:
    """The lineage's view, with what blocks it."""
    view = reader_of(request).lineage(name, page, per_page)
    blocked = _blocks(request).get(name)
    return view.model_copy(update={"summary": view.summary.model_copy(update={"blocked": blocked})})


def _blocks(request: Request) -> dict[str, str]:
    """What blocks each lineage, in words, from the broker's latest answer (none: unknown)."""
    broker: Probe[BrokerFigures] = request.app.state.broker
    answer = broker.latest()
    return answer.value.blocks if answer is not None and answer.value is not None else {}


def _broker(workers: Workers | None) -> Literal["no broker", "inspected", "unreachable"]:
    if workers is None:
        return "no broker"
    return "inspected" if workers.reachable else "unreachable"


def _waits(request: Request, lineages: list[LineageSummary], workers: Workers) -> list[QueueWait]:
    """Each queue that running lineages need and no live worker serves, with advice."""
    settings: Settings | None = request.app.state.settings
    needing: dict[str, list[LineageSummary]] = {}
    for lineage in lineages:
        if lineage.status == "running" and lineage.instrument_fingerprint:
            queue = queue_name(lineage.instrument_fingerprint)
            if workers.unserved(queue):
                needing.setdefault(queue, []).append(lineage)
    waits = []
    for queue, members in sorted(needing.items()):
        first = members[0]
        meta = reader_of(request).history(first.name).metadata
        advice = start_hint(
            settings,
            first.name,
            str(first.instrument_fingerprint),
            meta.instrument_version if meta else None,
            meta.instrument_commit if meta else None,
        )
        waits.append(
            QueueWait(
                queue=queue,
                lineages=[m.name for m in members],
                elsewhere=workers.elsewhere(queue),
                advice=advice,
            )
        )
    return waits


def chosen_names(values: list[str]) -> list[str]:
    """Lineage names given as ``?lineages=a,b,c``, the parameter repeated, or both."""
    return [name for value in values for name in value.split(",") if name]


def seed_sha(text: str) -> str:
    if not _SEED_SHA.match(text):
        raise NotFound(f"no family {text!r}")
    return text
