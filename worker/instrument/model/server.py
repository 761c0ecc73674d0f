"""The model syscall: an HTTP server on the generation's Unix socket.

Owns the socket's lifecycle and its connections. One ModelSocket serves one
generation: it binds the socket (only the sandbox's uid may connect), serves it from
one asyncio event loop in one thread, hands each ``POST /generate`` to the
generation's call engine (``engine``), whose attempts at the provider run on at most
``limits.MAX_CONNECTIONS`` daemon threads (``threads``), and at the end closes every
connection, removes the socket and has the engine audit the calls still in flight.

The client is the organism, which may be hostile, so what one generation's socket can
hold is bounded (``limits``), whatever the client does:

- MAX_CONNECTIONS connections at once; one more is answered 503 at once and closed,
  so nothing waits for a free connection;
- a request line and headers of at most MAX_HEAD_BYTES, else 431 and closed;
- REQUEST_SECONDS from connecting to the last byte of the request, else 408 and
  closed (``framing``);
- ANSWER_SECONDS for the client to take its answer, else closed;
- one request per connection; a body is kept only up to max_prompt_bytes.

The ABI and its manifest are ``capabilities``; the HTTP framing, ``framing``; the
retrying, paid call, ``engine``; its record, ``audit``.

Trusts: the provider, physics and context it is given. Trusts nothing from the
socket. A hostile client can make it log debug lines only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from types import TracebackType

import h11

from worker.instrument.model import limits
from worker.instrument.model.capabilities import GENERATE_PATH
from worker.instrument.model.engine import CallEngine
from worker.instrument.model.framing import HEAD_TOO_LONG, Answer, Exchange, response
from worker.instrument.model.ledger import Ledger
from worker.instrument.model.providers import GenerationContext, Provider
from worker.instrument.model.retry import RetryPolicy
from worker.instrument.model.threads import ModelThreads
from worker.instrument.model.throttle import LocalThrottle, Throttle
from worker.instrument.physics import Physics
from worker.instrument.records import ModelCall, ModelFailure

logger = logging.getLogger(__name__)

# Connects not yet accepted. One that finds the backlog full fails with EAGAIN (when
# non-blocking) instead of getting the 503, so it must hold a burst of callers (an
# organism may start tasks_max, 64 by default) while the loop is busy.
LISTEN_BACKLOG = 128
ACCEPT_RETRY_SECONDS = 0.1
BUSY = f"busy: at most {limits.MAX_CONNECTIONS} connections at once; try again when one has ended"


@dataclass
class _Serving:
    """What __exit__ must stop: the listener, its event loop, the loop's thread."""

    listener: socket.socket
    loop: asyncio.AbstractEventLoop
    task: asyncio.Task[None]
    thread: threading.Thread


class ModelSocket:
    """Serves the model syscall of one generation on a Unix socket (a context manager)."""

    def __init__(
        self,
        socket_path: Path,
        provider: Provider,
        physics: Physics,
        context: GenerationContext,
        *,
        owner: tuple[int, int] | None = None,
        throttle: Throttle | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        """owner, (uid, gid), is who the socket is handed to when the sandbox runs as
        a user of its own; without it the socket stays the worker's. throttle is the
        cap every attempt at a capped provider waits for (none by default); retry, how
        a call is tried again."""
        self.socket_path = Path(socket_path)
        self.provider = provider
        self.physics = physics
        self.context = context
        self.owner = owner
        self.throttle: Throttle = throttle or LocalThrottle()
        self.retry = retry or RetryPolicy()
        self._model_threads = ModelThreads(
            limits.MAX_CONNECTIONS, f"model-call-{context.lineage}-{context.generation}"
        )
        self.engine = CallEngine(
            provider, physics, context, self.throttle, self.retry, self._model_threads
        )
        self._serving: _Serving | None = None

    @property
    def calls(self) -> list[ModelCall]:
        """Every audited call so far, in order of arrival."""
        return self.engine.calls

    @property
    def calls_over_limit(self) -> int:
        """Calls refused 429 past the generation's call limit."""
        return self.engine.calls_over_limit

    @property
    def ledger(self) -> Ledger:
        return self.engine.ledger

    @property
    def spent_usd(self) -> Decimal:
        return self.engine.ledger.spent_usd

    @property
    def model_failure(self) -> ModelFailure | None:
        """The generation's failures at the provider so far (``CallEngine.model_failure``)."""
        return self.engine.model_failure

    def __enter__(self) -> ModelSocket:
        # A socket left by a killed worker would make bind fail; anything else is kept.
        if self.socket_path.is_socket():
            self.socket_path.unlink()
        listener = _listen(self.socket_path, self.owner)
        self.engine.start()
        loop = asyncio.new_event_loop()
        task = loop.create_task(self._serve(listener))
        thread = threading.Thread(
            target=_run_until_cancelled,
            args=(loop, task),
            name=f"model-socket-{self.context.lineage}-{self.context.generation}",
            daemon=True,
        )
        self._serving = _Serving(listener, loop, task, thread)
        thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.engine.end()
        if self._serving is not None:
            serving, self._serving = self._serving, None
            serving.loop.call_soon_threadsafe(serving.task.cancel)
            serving.thread.join()
            serving.listener.close()
            serving.loop.close()
        self._model_threads.close()
        self.socket_path.unlink(missing_ok=True)
        self.engine.abandon()

    async def _serve(self, listener: socket.socket) -> None:
        """Accept until cancelled, then close every connection."""
        loop = asyncio.get_running_loop()
        conversations: set[asyncio.Task[None]] = set()
        try:
            while True:
                # Not loop.sock_accept: on 3.11 a connect arriving as it is cancelled
                # makes it set a result on the cancelled future, an error with traceback.
                readable = loop.create_future()
                loop.add_reader(listener, _set_once, readable)
                try:
                    await readable
                finally:
                    loop.remove_reader(listener)
                try:
                    self._admit(listener, conversations)
                except OSError as exc:
                    # Out of descriptors, say: the listener is still good, so wait, not end.
                    logger.warning("model socket: accept failed: %s", exc)
                    await asyncio.sleep(ACCEPT_RETRY_SECONDS)
        finally:
            for task in conversations:
                task.cancel()
            await asyncio.gather(*conversations, return_exceptions=True)

    def _admit(self, listener: socket.socket, conversations: set[asyncio.Task[None]]) -> None:
        """Take the connections waiting: a conversation each, or the 503 beyond the cap.

        At most a backlog's worth at a time, as asyncio's own servers do, so that a
        flood of connects does not starve the conversations admitted.
        """
        loop = asyncio.get_running_loop()
        for _ in range(LISTEN_BACKLOG):
            try:
                client, _ = listener.accept()
            except BlockingIOError:
                return
            client.setblocking(False)
            if len(conversations) >= limits.MAX_CONNECTIONS:
                _refuse(client)
                continue
            task = loop.create_task(self._converse(client))
            conversations.add(task)
            task.add_done_callback(conversations.discard)

    async def _converse(self, client: socket.socket) -> None:
        """One connection: one request, one answer, then closed, whatever the client does."""
        with client:
            exchange = Exchange(client)
            try:
                try:
                    answer = await self._route(exchange)
                    await exchange.drain()
                except h11.RemoteProtocolError as exc:
                    logger.debug("model socket: malformed request: %s", exc)
                    if exc.error_status_hint == 431:
                        answer = Answer(431, HEAD_TOO_LONG)
                    else:
                        answer = Answer(400, f"malformed HTTP/1.1 request: {exc}")
                except TimeoutError:
                    seconds = limits.REQUEST_SECONDS
                    text = f"the request did not arrive within {seconds} s of connecting"
                    logger.debug("model socket: %s", text)
                    answer = Answer(408, text)
                await exchange.answer(answer)
            # Debug lines only: a hostile client must not be able to fill the worker's log.
            # A call it made is audited whatever became of its connection.
            except TimeoutError:
                logger.debug(
                    "model socket client took no answer within %d s", limits.ANSWER_SECONDS
                )
            except OSError as exc:
                logger.debug("model socket client left before the answer: %s", exc)

    async def _route(self, exchange: Exchange) -> Answer:
        """The answer to the connection's request."""
        request = await exchange.request()
        if request.target != GENERATE_PATH.encode():
            return Answer(404, f"unknown operation; the only one is POST {GENERATE_PATH}")
        if request.method != b"POST":
            return Answer(405, f"{GENERATE_PATH} takes POST only", (("Allow", "POST"),))
        return await self.engine.serve_generate(request.headers, exchange)


def _listen(path: Path, owner: tuple[int, int] | None) -> socket.socket:
    """A listening socket at path that only the sandbox's uid may connect to."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
    except OSError:
        listener.close()
        raise
    try:
        # Only the worker's own uid, which bwrap maps to itself inside the sandbox, or
        # the sandbox's own uid may connect: any other local user could spend the
        # budget and forge audit records. Both are set before anyone can connect.
        os.chmod(path, 0o600)
        if owner is not None:
            os.chown(path, *owner)
        listener.listen(LISTEN_BACKLOG)
    except OSError:
        listener.close()
        path.unlink()
        raise
    listener.setblocking(False)
    return listener


def _run_until_cancelled(loop: asyncio.AbstractEventLoop, serving: asyncio.Task[None]) -> None:
    # _serve ends only when __exit__ cancels it.
    with contextlib.suppress(asyncio.CancelledError):
        loop.run_until_complete(serving)


def _set_once(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _refuse(client: socket.socket) -> None:
    """Answer 503 and close, reading nothing: a fresh socket takes a short answer at once."""
    with client, contextlib.suppress(OSError):
        client.send(_REFUSAL)
    logger.debug("model socket: refused a connection beyond %d", limits.MAX_CONNECTIONS)


_REFUSAL = response(h11.Connection(h11.SERVER), Answer(503, BUSY))
