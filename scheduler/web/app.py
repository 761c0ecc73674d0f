"""The web application: FastAPI app factory, error mapping and response headers.

Owns assembling the browsing app from a ``Reader``, a live-workers provider and
the settings (for ``/metrics``, ``scheduler.web.metrics``, and for advice), the
bounds on everything it does not control (the reader's store wrapped in a
``GuardedStore``; the broker and the live workers read through ``Probe``s, in the
background, so no request waits on them for long and the web process never starts
the embedded broker),
the mapping of "no such lineage or generation" (including malformed names and
numbers) to 404 and of an unreachable store to 503, JSON answers with C1 and bidi
controls escaped (``legible``), and the headers every response carries: a
Content-Security-Policy that allows no script at all (the UI needs none,
so even markup that escaped escaping could not run), no framing, no sniffing, no
referrer. The interactive docs pages are off because they load from a CDN; the
OpenAPI schema is served at /openapi.json.

Trusts: the reader and the provider it is given.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from scheduler.legible import escape_for_json
from scheduler.reader import NotFound, Reader
from scheduler.web import api, downloads, metrics, pages
from scheduler.web.broker import BrokerReader
from scheduler.web.probes import INTERVAL_SECONDS, Probe
from scheduler.web.render import templates
from scheduler.web.store_guard import GuardedStore
from scheduler.web.workers import WorkersProvider, live_workers, probed
from worker.fleet.settings import Settings
from worker.instrument.fingerprint import package_version
from worker.instrument.store import StoreUnavailable

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; "
        "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


class InertJSONResponse(JSONResponse):
    """JSON with every C1 and bidi control escaped (``\\u202e``): the same values, but
    none that acts on a terminal or reorders a page when the answer is shown raw."""

    def render(self, content: object) -> bytes:
        return escape_for_json(super().render(content).decode()).encode()


def create_app(
    reader: Reader, workers: WorkersProvider | None = None, settings: Settings | None = None
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Read every lineage's history once at start, in the background, so that the
        # first visitor does not pay for it; later heads are read incrementally.
        threading.Thread(target=_warm, args=(reader,), name="warm-reader", daemon=True).start()
        # And ask the broker and the live workers now, so that the first visitor finds
        # their answers (a request waits for a probe only briefly).
        workers_probe.refresh()
        app.state.broker.refresh()
        yield

    app = FastAPI(
        lifespan=lifespan,
        title="Ouroboros fleet browser",
        version=package_version(),
        description="Read-only views of lineages, generations and observations.",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        default_response_class=InertJSONResponse,
    )
    interval = settings.web_probe_seconds if settings is not None else INTERVAL_SECONDS
    if not isinstance(reader.store, GuardedStore):
        reader.store = GuardedStore(reader.store, down_seconds=interval)
    app.state.reader = reader
    workers_probe = Probe("workers", workers or live_workers, interval=interval)
    app.state.workers = probed(workers_probe)
    # For advice (the command that starts a worker) and the broker's metrics; may be None.
    app.state.settings = settings
    app.state.broker = Probe("broker", BrokerReader(settings, reader).read, interval=interval)
    app.state.metrics = metrics.registry_for(reader, workers_probe, app.state.broker, interval)
    app.include_router(api.router)
    app.include_router(metrics.router)
    app.include_router(pages.router)
    app.include_router(downloads.router)

    @app.middleware("http")
    async def security_headers(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        response = await call_next(request)
        response.headers.update(SECURITY_HEADERS)
        return response

    @app.exception_handler(NotFound)
    async def not_found(request: Request, exc: NotFound) -> Response:
        return _error(request, 404, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # Starlette's headers travel on (a 405's Allow names the methods the path takes).
        return _error(request, exc.status_code, str(exc.detail), exc.headers)

    @app.exception_handler(StoreUnavailable)
    async def store_down(request: Request, exc: StoreUnavailable) -> Response:
        return _error(request, 503, str(exc))

    return app


def _warm(reader: Reader) -> None:
    try:
        reader.summaries()
    except Exception:  # only an optimisation: the first request reports any real failure
        return


def _error(
    request: Request, status: int, message: str, headers: Mapping[str, str] | None = None
) -> Response:
    if request.url.path.startswith("/api/"):
        return JSONResponse({"detail": message}, status_code=status, headers=headers)
    return templates.TemplateResponse(
        request,
        "error.html",
        {"status": status, "message": message},
        status_code=status,
        headers=headers,
    )
