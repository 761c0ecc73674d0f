"""The model syscall: an HTTP server on the generation's Unix socket, and its manifest.

Owns the provider-neutral ABI (``POST /generate``, raw UTF-8 prompt in, raw UTF-8
text out with ``X-Ouroboros-Stop-Reason`` saying how the model stopped; 400 invalid
request, 402 budget exhausted, 502 model unavailable), the capability manifest that
discloses it with the effective constraints and limits, the retrying of a call, and
the audit record of every call and every attempt in it. One ModelSocket serves one
generation: it binds the socket, serves it from one asyncio event loop in one thread
(HTTP/1.1 framing by h11, which does no I/O), runs attempts at the provider on at
most MAX_CONNECTIONS daemon threads (each first waits for room under the provider's
cap, from the Throttle it is given), reserves and settles each call in the
generation's ledger, and at the end closes every connection and removes the socket.

A call is tried again, as ``retry.RetryPolicy`` allows, after a failure the vendor
calls passing, until the call's deadline: model_timeout_seconds from its arrival or
the end of the life's wall time less model_margin_seconds, whichever comes first, so
that a hung vendor leaves the organism time to hear its 502 and act on it before
its wall. Waiting for the cap and between attempts counts against that deadline.
An attempt that failed is charged nothing, unless the vendor may have served it (its
answer was lost after the whole request was sent): then it keeps its reservation, as
any lost answer does, and the next attempt must first reserve its own worst case
within the budget. So no charge ever exceeds the reservation it settles, and the
budget stays a hard ceiling. Each attempt and each wait before another is also
logged, in the instrument's own words, on the ``waits`` logger, so that whoever
watches a life knows what it waits for.

The socket also sums up the generation's failures at the provider
(``ModelSocket.model_failure``): how many calls failed there, how many it answered,
and whether any failure was a refusal that waiting will not fix. The fleet stops or
pauses the run on it, so only what the provider did counts, never what the organism
or the fleet's own contention did; a call failed in any of these ways is answered 502
all the same:

- a call that never reached the vendor (no room under the fleet's cap before its
  deadline, or every model thread still held by the generation's abandoned calls)
  is the fleet's contention, not the provider's failure: it does not count, so a
  hostile lineage that fills the cap cannot pause every other run;
- a call that arrives when its deadline has passed is the organism's doing: it is
  answered 502 at once, saying so, sends nothing and does not count;
- a vendor's 400 or 422 (the request is invalid: say, a prompt over the model's
  context window, which the organism can provoke at will) is a refusal only when no
  call of the generation was answered, since a wrong key or model fails every call;
  beside an answered call it does not count at all. 401, 403, 404, a redirect and any
  other 4xx the vendor does not call passing are refusals whatever else happened.

A call counts as failed at the provider by the last of its attempts that reached the
vendor, and with that attempt's reason. When the life ends, every attempt still
running gives its room under the fleet's cap back at once (``Admission.release``),
even though its request may still be at the vendor: the cap must not outlive the
life that took it, or an organism could fill it with slow calls and exit.

The client is the organism, which may be hostile, so what one generation's socket can
hold is bounded, whatever the client does:

- MAX_CONNECTIONS connections at once; one more is answered 503 at once and closed,
  so nothing waits for a free connection;
- a request line and headers of at most MAX_HEAD_BYTES, else 431 and closed;
- REQUEST_SECONDS from connecting to the last byte of the request, else 408 and
  closed (a deadline for the whole request, not per read, so dripping bytes does not
  extend it);
- ANSWER_SECONDS for the client to take its answer, else closed;
- one request per connection; a body is kept only up to max_prompt_bytes.

Trusts: the provider, physics and context it is given. Trusts nothing from the
socket: sizes, headers and encodings are checked. Answers to the organism never name
a provider, model, price or credential; the detail goes to the audit record only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import itertools
import json
import logging
import math
import os
import queue
import random
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from http import HTTPStatus
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import h11

from worker.instrument import syscall_filter
from worker.instrument.model.ledger import BudgetExhausted, Ledger, Reservation
from worker.instrument.model.prices import Prices
from worker.instrument.model.providers import (
    GenerationContext,
    Provider,
    ProviderReply,
    ProviderUnavailable,
)
from worker.instrument.model.retry import RetryPolicy
from worker.instrument.model.throttle import (
    Admission,
    LocalThrottle,
    NoRoom,
    Throttle,
    no_room,
)
from worker.instrument.physics import Physics
from worker.instrument.records import (
    MODEL_FAILURE_REASON_CHARS,
    AttemptOutcome,
    ModelAttempt,
    ModelCall,
    ModelFailure,
)

logger = logging.getLogger(__name__)
# What a life waits for, worded by the instrument alone (never a vendor's or an
# organism's text, so a hostile client cannot fill it): each attempt as it starts
# (debug) and each wait before another (info). ``run --local`` shows both.
waits = logging.getLogger(f"{__name__}.waits")

CAPABILITIES_SCHEMA = "ouroboros-capabilities/v1"
SANDBOX_SOCKET = "/kernel/model.sock"
SANDBOX_JOURNAL = "/kernel/journal.md"
GENERATE_PATH = "/generate"
MAX_TOKENS_HEADER = "X-Ouroboros-Max-Output-Tokens"
STOP_REASON_HEADER = "X-Ouroboros-Stop-Reason"
_DECIMAL_INTEGER = re.compile(rb"[0-9]{1,12}")
DISCARD_CAP_BYTES = 16 * 1024 * 1024

MAX_CONNECTIONS = 8
MAX_HEAD_BYTES = 16 * 1024
REQUEST_SECONDS = 10
ANSWER_SECONDS = 10
# What one life may make the worker keep: its calls are audited in the worker's memory
# and written whole into the observation, outside the sandbox's memory ceiling.
MAX_CALLS = 1000
AUDIT_TEXT_BYTES = 32 * 1024 * 1024
# Connects not yet accepted. One that finds the backlog full fails with EAGAIN (when
# non-blocking) instead of getting the 503, so it must hold a burst of callers (an
# organism may start tasks_max, 64 by default) while the loop is busy.
LISTEN_BACKLOG = 128
RECEIVE_BYTES = 64 * 1024
ACCEPT_RETRY_SECONDS = 0.1

BUDGET_EXHAUSTED = "budget exhausted: what is left cannot cover this call's worst case"
MODEL_UNAVAILABLE = "model unavailable"
ABANDONED = "the generation ended before the model answered"
BUSY = f"busy: at most {MAX_CONNECTIONS} connections at once; try again when one has ended"
HEAD_TOO_LONG = f"the request line and headers are over {MAX_HEAD_BYTES} bytes"
CALL_LIMIT = f"call limit: at most {MAX_CALLS} calls per generation; nothing was sent"
TOO_LATE = (
    "too late: the call came after its deadline (model_timeout_seconds from its arrival, "
    "or model_margin_seconds before the end of wall_seconds); nothing was sent"
)
NO_RETRY_BUDGET = "not tried again: what is left of the budget cannot cover another attempt"
# What the cap counts a prompt as: vendors' own limiters estimate 4 bytes to the token.
CAP_BYTES_PER_TOKEN = 4


def capabilities(physics: Physics) -> dict[str, Any]:
    """The manifest for /kernel/capabilities.json: the ABI and the constraints, nothing else.

    Inert data in provider-neutral terms; never a provider, model, price, URL or key.
    """
    return {
        "schema": CAPABILITIES_SCHEMA,
        "operations": {
            "generate": {
                "transport": "HTTP/1.1 over a Unix stream socket; one request per connection",
                "socket": SANDBOX_SOCKET,
                "method": "POST",
                "path": GENERATE_PATH,
                "request": {
                    "body": "the prompt as raw UTF-8, 1 to max_prompt_bytes bytes",
                    "headers": {
                        "Host": "required by HTTP/1.1: any value",
                        "Content-Length": "required: the body's size in bytes",
                        MAX_TOKENS_HEADER: (
                            "optional: an integer from 1 to max_output_tokens; "
                            "max_output_tokens when absent"
                        ),
                    },
                },
                "responses": {
                    "200": (
                        "the model's answer as raw UTF-8 (text/plain; charset=utf-8), "
                        f"with the header {STOP_REASON_HEADER}"
                    ),
                    "400": "invalid request; the body says what is wrong",
                    "402": "budget exhausted; nothing was sent to the model",
                    "429": "call limit of the generation reached; nothing was sent",
                    "502": (
                        "model unavailable: every attempt failed, or no answer within "
                        "model_timeout_seconds or before model_margin_seconds from the "
                        "end of wall_seconds, or the call came after that deadline"
                    ),
                },
                "response_headers": {
                    STOP_REASON_HEADER: {
                        "on": "every 200",
                        "values": {
                            "complete": "the model finished its answer",
                            "max_tokens": (
                                "the answer was cut at the granted output tokens; the body "
                                "is the text up to the cut"
                            ),
                            "refused": "the model declined to answer; the body may be empty",
                            "incomplete": (
                                "the model stopped short for another reason, or spent every "
                                "granted token before writing any answer (reasoning)"
                            ),
                        },
                        "advice": "only a complete answer is whole",
                    },
                },
                "retries": (
                    "a call the model could not answer for a passing reason (rate limit, "
                    "overload, server error, lost connection, stall) is tried again after "
                    "a backoff, as long as model_timeout_seconds and the life's wall time "
                    "less model_margin_seconds allow; the fleet also caps the calls made to "
                    "the model at once and per minute, and waiting for that cap counts "
                    "against the same time"
                ),
                "limits": {
                    "connections": {
                        "max": MAX_CONNECTIONS,
                        "beyond": "503 at once, then closed; nothing waits for a free one",
                    },
                    "request_head_bytes": {
                        "max": MAX_HEAD_BYTES,
                        "beyond": "431, then closed; counts the request line and headers",
                    },
                    "request_seconds": {
                        "max": REQUEST_SECONDS,
                        "beyond": "408, then closed; from connecting to the body's last byte",
                    },
                    "answer_seconds": {
                        "max": ANSWER_SECONDS,
                        "beyond": "closed unanswered; the call is audited and charged still",
                    },
                    "requests_per_connection": {
                        "max": 1,
                        "beyond": "never read: every answer carries Connection: close",
                    },
                    "calls_per_generation": {
                        "max": MAX_CALLS,
                        "beyond": "429 and nothing sent to the model; only counted",
                    },
                    "audited_text_bytes": {
                        "max": AUDIT_TEXT_BYTES,
                        "beyond": "later prompts and answers audited by size and sha256 only",
                    },
                },
                "spending": (
                    "each call first reserves its worst case from budget_usd: every prompt "
                    "byte plus 4096 tokens as input and every granted output token as "
                    "output. An answered call is then charged its reported usage (its "
                    "whole reservation when the model reports none), a failed attempt "
                    "nothing, and an attempt whose answer was lost after the model "
                    "received it its whole reservation; a call tries again after such a "
                    "loss only if the budget can cover another worst case"
                ),
            },
            "journal": {"path": SANDBOX_JOURNAL, "access": "read-only"},
        },
        "constraints": {
            **physics.model_dump(mode="json"),
            "cpu_quota_percent": physics.cpu_quota_percent,
            "archive_cap_bytes": physics.archive_cap_bytes,
            "network": "none",
            "syscall_filter": {
                "digest": syscall_filter.DIGEST,
                "refused": "EPERM (clone3: ENOSYS, so that libc falls back to clone)",
            },
        },
    }


class _InvalidRequest(Exception):
    """A request the ABI does not allow; the message is the 400 answer."""


# What a failed call counts as in ModelSocket.model_failure; "invalid" is a vendor's
# 400 or 422, a refusal only when no call of the generation was answered.
_Blame = Literal["refused", "invalid", "unavailable"]


class _CallFailed(Exception):
    """Every attempt of a call failed; the message is the error its record keeps.

    blame and reason come from the last attempt that reached the vendor; blame is None
    when none did (the fleet's own contention), and the call then counts for nothing.
    """

    def __init__(self, error: str, blame: _Blame | None, reason: str) -> None:
        super().__init__(error)
        self.blame = blame
        self.reason = reason


def _blame(failure: ProviderUnavailable) -> _Blame:
    if failure.refused:
        return "refused"
    return "invalid" if failure.invalid else "unavailable"


@dataclass(frozen=True)
class _Answer:
    """What the socket answers one request: status, text and any extra headers."""

    status: int
    text: str
    headers: tuple[tuple[str, str], ...] = ()


@dataclass
class _Attempt:
    """The attempt in progress; the model thread fills in what it learns."""

    number: int
    started_at: datetime
    clock: float
    admission: Admission | None = None
    # When the thread began to wait for the cap (time.monotonic()), if it did.
    capping: float | None = None
    cap_waited: float = 0.0
    # When the request left for the vendor (time.monotonic()); None while it has not.
    sent: float | None = None


@dataclass
class _Call:
    """A request that got as far as having a body, until it is audited.

    Mutated by the event loop only, and read by __exit__ once the loop has stopped.
    """

    index: int
    started_at: datetime
    clock: float
    prompt: bytes
    requested_output_tokens: int | None = None
    # The open reservation the next attempt runs on, if any.
    reservation: Reservation | None = None
    reserved: Decimal = Decimal(0)
    charged: Decimal = Decimal(0)
    attempts: list[ModelAttempt] = field(default_factory=list)
    current: _Attempt | None = None

    def reserve(self, ledger: Ledger, tokens: int) -> None:
        """Hold a worst case for the next attempt; BudgetExhausted holds nothing."""
        self.reservation = ledger.reserve(len(self.prompt), tokens)
        self.reserved += self.reservation.amount_usd

    def settle(self, ledger: Ledger, cost: Decimal) -> Decimal:
        """Close the open reservation at min(cost, reserved); the charge."""
        if self.reservation is None:
            return Decimal(0)
        charge = ledger.settle(self.reservation, cost)
        self.reservation = None
        self.charged += charge
        return charge


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
        self._jitter = random.Random()
        # Set when the life ends: attempts still waiting for the cap give up at once.
        self._ended = threading.Event()
        self._wall_end = math.inf
        self.ledger = Ledger(
            physics.budget_usd,
            Prices(
                input_usd_per_mtok=provider.input_usd_per_mtok,
                output_usd_per_mtok=provider.output_usd_per_mtok,
            ),
        )
        self._lock = threading.Lock()
        self._indices = itertools.count(1)
        self._calls: list[ModelCall] = []
        self._admitted = 0
        self._audited_text = 0
        self.calls_over_limit = 0
        self._in_flight: dict[int, _Call] = {}
        # Each call that failed at the provider: what it counts as, and why.
        self._failures: list[tuple[_Blame, str]] = []
        # The room under the cap held by attempts running now, given back when the
        # life ends (an attempt the vendor keeps waiting would otherwise hold it on).
        # Keyed by identity: two admissions may be equal.
        self._holds: dict[int, Admission] = {}
        self._model_threads = _ModelThreads(
            MAX_CONNECTIONS, f"model-call-{context.lineage}-{context.generation}"
        )
        self._serving: _Serving | None = None

    @property
    def calls(self) -> list[ModelCall]:
        """Every audited call so far, in order of arrival."""
        with self._lock:
            return sorted(self._calls, key=lambda call: call.index)

    @property
    def spent_usd(self) -> Decimal:
        return self.ledger.spent_usd

    @property
    def model_failure(self) -> ModelFailure | None:
        """The generation's failures at the provider so far; None when there were none.

        Refused when any failed call was refused (waiting will not fix it), and then the
        reason is the last refusal's; else unavailable, with the last failure's reason.
        A vendor's 400 or 422 is a refusal when no call was answered, else not counted.
        """
        with self._lock:
            failures = list(self._failures)
            answered = sum(call.status == 200 for call in self._calls)
        if answered:
            # The vendor serves this key and model: the request itself was at fault.
            failures = [failure for failure in failures if failure[0] != "invalid"]
        if not failures:
            return None
        refusals = [reason for blame, reason in failures if blame != "unavailable"]
        return ModelFailure(
            kind="refused" if refusals else "unavailable",
            reason=_one_line((refusals or [reason for _, reason in failures])[-1]),
            failed_calls=len(failures),
            answered_calls=answered,
        )

    def __enter__(self) -> ModelSocket:
        # A socket left by a killed worker would make bind fail; anything else is kept.
        if self.socket_path.is_socket():
            self.socket_path.unlink()
        listener = _listen(self.socket_path, self.owner)
        # The life starts about now and is killed at its wall time: no call outlives its
        # margin before it, so the organism hears its 502 with time left to act on it.
        self._wall_end = (
            time.monotonic() + self.physics.wall_seconds - self.physics.model_margin_seconds
        )
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
        self._ended.set()
        # An attempt admitted from now on sees _ended and gives its room back itself.
        with self._lock:
            holds, self._holds = self._holds, {}
        for admission in holds.values():
            admission.release()
        if self._serving is not None:
            serving, self._serving = self._serving, None
            serving.loop.call_soon_threadsafe(serving.task.cancel)
            serving.thread.join()
            serving.listener.close()
            serving.loop.close()
        self._model_threads.close()
        self.socket_path.unlink(missing_ok=True)
        # The life is over (a wall timeout often ends it mid-call). A call still waiting
        # for the model is recorded now: charged its reservation if its request had left
        # (the vendor may serve it still), else nothing. So the observation written
        # after this holds every call and every dollar that may have been spent.
        with self._lock:
            abandoned = list(self._in_flight.values())
            self._in_flight.clear()
        for call in abandoned:
            current, call.current = call.current, None
            if current is not None:
                billed = current.sent is not None
                cost = call.settle(self.ledger, self._reserved(call) if billed else Decimal(0))
                self._record(call, current, "abandoned", ABANDONED, billed=billed, cost=cost)
            call.settle(self.ledger, Decimal(0))
            self._audit(call, 502, MODEL_UNAVAILABLE, error=ABANDONED)
            # A call in flight when the life ended failed at the provider only if an
            # attempt of it had: one the organism merely left behind was never refused,
            # and one that found no room under the cap never reached the vendor.
            tried = [a for a in call.attempts if a.outcome == "failed"]
            if tried:
                with self._lock:
                    self._failures.append(("unavailable", tried[-1].error or MODEL_UNAVAILABLE))

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
            if len(conversations) >= MAX_CONNECTIONS:
                _refuse(client)
                continue
            task = loop.create_task(self._converse(client))
            conversations.add(task)
            task.add_done_callback(conversations.discard)

    async def _converse(self, client: socket.socket) -> None:
        """One connection: one request, one answer, then closed, whatever the client does."""
        with client:
            exchange = _Exchange(client)
            try:
                try:
                    answer = await self._route(exchange)
                    await exchange.drain()
                except h11.RemoteProtocolError as exc:
                    logger.debug("model socket: malformed request: %s", exc)
                    if exc.error_status_hint == 431:
                        answer = _Answer(431, HEAD_TOO_LONG)
                    else:
                        answer = _Answer(400, f"malformed HTTP/1.1 request: {exc}")
                except TimeoutError:
                    text = f"the request did not arrive within {REQUEST_SECONDS} s of connecting"
                    logger.debug("model socket: %s", text)
                    answer = _Answer(408, text)
                await exchange.answer(answer)
            # Debug lines only: a hostile client must not be able to fill the worker's log.
            # A call it made is audited whatever became of its connection.
            except TimeoutError:
                logger.debug("model socket client took no answer within %d s", ANSWER_SECONDS)
            except OSError as exc:
                logger.debug("model socket client left before the answer: %s", exc)

    async def _route(self, exchange: _Exchange) -> _Answer:
        """The answer to the connection's request."""
        request = await exchange.request()
        if request.target != GENERATE_PATH.encode():
            return _Answer(404, f"unknown operation; the only one is POST {GENERATE_PATH}")
        if request.method != b"POST":
            return _Answer(405, f"{GENERATE_PATH} takes POST only", (("Allow", "POST"),))
        return await self.serve_generate(request.headers, exchange)

    async def serve_generate(
        self, headers: Sequence[tuple[bytes, bytes]], exchange: _Exchange
    ) -> _Answer:
        """One POST /generate whose headers are read: the answer to it."""
        started_at = datetime.now(UTC)
        clock = time.monotonic()
        try:
            raw = await _read_prompt(headers, exchange, self.physics.max_prompt_bytes)
        except _InvalidRequest as exc:
            return _Answer(400, str(exc))
        with self._lock:
            if self._admitted >= MAX_CALLS:
                self.calls_over_limit += 1
                return _Answer(429, CALL_LIMIT)
            self._admitted += 1
        call = _Call(next(self._indices), started_at, clock, raw)
        try:
            prompt = raw.decode("utf-8")
            if not prompt:
                raise _InvalidRequest("the prompt is empty")
            tokens = _granted_tokens(headers, self.physics.max_output_tokens)
        except UnicodeDecodeError:
            return self._audit(call, 400, "the prompt is not valid UTF-8")
        except _InvalidRequest as exc:
            return self._audit(call, 400, str(exc))
        call.requested_output_tokens = tokens
        if self._deadline(call) <= time.monotonic():
            return self._audit(call, 502, TOO_LATE)
        try:
            call.reserve(self.ledger, tokens)
        except BudgetExhausted as exc:
            return self._audit(call, 402, BUDGET_EXHAUSTED, error=str(exc))
        with self._lock:
            self._in_flight[call.index] = call
        try:
            reply = await self._generate(call, prompt, tokens)
        except asyncio.CancelledError:
            # The generation ended first and __exit__ audits the call as abandoned; a
            # client still waiting hears what its record will say, if it can at once.
            exchange.answer_at_once(_Answer(502, MODEL_UNAVAILABLE))
            raise
        except _CallFailed as exc:
            self._land(call.index)
            if exc.blame is not None:
                with self._lock:
                    self._failures.append((exc.blame, exc.reason))
            logger.warning("model call %d failed: %s", call.index, exc)
            call.settle(self.ledger, Decimal(0))
            return self._audit(call, 502, MODEL_UNAVAILABLE, error=str(exc))
        self._land(call.index)
        return self._audit(call, 200, reply.text, reply=reply)

    def _land(self, index: int) -> None:
        """The call ended in time: settling it is no longer __exit__'s job."""
        with self._lock:
            del self._in_flight[index]

    def _deadline(self, call: _Call) -> float:
        """When the call must be answered by (time.monotonic())."""
        return min(call.clock + self.physics.model_timeout_seconds, self._wall_end)

    @staticmethod
    def _reserved(call: _Call) -> Decimal:
        return call.reservation.amount_usd if call.reservation else Decimal(0)

    def _cost(self, call: _Call, reply: ProviderReply) -> Decimal:
        """What an answer costs: its reported usage, else (none reported) the worst case."""
        if reply.input_tokens is None or reply.output_tokens is None:
            return self._reserved(call)
        return self.ledger.prices.cost_usd(reply.input_tokens, reply.output_tokens)

    async def _generate(self, call: _Call, prompt: str, tokens: int) -> ProviderReply:
        """The provider's reply, tried as often as the retry policy and the deadline allow.

        The deadline is model_timeout_seconds from the call's arrival, or the end of
        the life's wall time less model_margin_seconds if that is sooner. Each attempt
        runs on a model thread (waiting for the cap there, then one request whose every
        read the stall limit bounds) and is abandoned at the deadline. Raises
        _CallFailed for the last failure; every attempt is recorded on the call, and each
        one the vendor may have billed is charged its reservation here.
        """
        timeout = self.physics.model_timeout_seconds
        deadline = self._deadline(call)
        late = (
            f"no answer within {timeout} s"
            if deadline < self._wall_end
            else "no answer in time to leave the organism its margin before the wall"
        )
        estimate = math.ceil(len(call.prompt) / CAP_BYTES_PER_TOKEN) + tokens
        # The last attempt that reached the vendor, and its error: what the call counts as.
        reached: tuple[ProviderUnavailable, str] | None = None
        for number in itertools.count(1):
            attempt = _Attempt(number, datetime.now(UTC), time.monotonic())
            call.current = attempt
            waits.debug("model call %d: attempt %d to %s", call.index, number, self.provider.name)
            future = self._model_threads.submit(
                functools.partial(self._attempt, attempt, prompt, tokens, estimate, deadline)
            )
            outcome: AttemptOutcome = "failed"
            try:
                async with asyncio.timeout_at(deadline):
                    reply = await asyncio.wrap_future(future)
            except TimeoutError:
                queued = future.cancel()
                if attempt.sent is not None:
                    outcome, failure = "abandoned", ProviderUnavailable(late, may_have_billed=True)
                elif queued or attempt.capping is None or not self.provider.capped:
                    # Every model thread is still held by an abandoned call: never sent.
                    outcome, failure = "no_slot", ProviderUnavailable(late)
                else:
                    attempt.cap_waited = time.monotonic() - attempt.capping
                    outcome = "no_slot"
                    failure = ProviderUnavailable(
                        str(no_room(self.provider.name, attempt.cap_waited))
                    )
            except NoRoom as exc:
                attempt.cap_waited = exc.waited_seconds
                outcome, failure = "no_slot", ProviderUnavailable(str(exc))
            except ProviderUnavailable as exc:
                failure = exc
            except Exception as exc:
                logger.error("provider %s failed unexpectedly", self.provider.name, exc_info=exc)
                failure = ProviderUnavailable(
                    f"{self.provider.name} failed: {type(exc).__name__}", may_have_billed=True
                )
            else:
                cost = call.settle(self.ledger, self._cost(call, reply))
                self._record(call, attempt, "answered", None, billed=False, cost=cost, status=200)
                return reply
            wait = self._next_wait(number, failure, deadline)
            cost = Decimal(0)
            if failure.may_have_billed:
                cost = call.settle(self.ledger, self._reserved(call))
            error = str(failure)
            if wait is not None and call.reservation is None:
                try:
                    call.reserve(self.ledger, tokens)
                except BudgetExhausted:
                    wait, error = None, f"{failure}; {NO_RETRY_BUDGET}"
            if outcome != "no_slot":
                reached = failure, error
            self._record(
                call,
                attempt,
                outcome,
                error,
                billed=failure.may_have_billed,
                cost=cost,
                status=failure.status,
                retry_after=failure.retry_after,
                backoff=wait,
            )
            if wait is None:
                if reached is None:
                    raise _CallFailed(error, None, error)
                raise _CallFailed(error, _blame(reached[0]), reached[1])
            waits.info(
                "model call %d: attempt %d failed (%s); attempt %d at %s UTC, in %.0f s",
                call.index,
                number,
                f"HTTP {failure.status}" if failure.status else outcome.replace("_", " "),
                number + 1,
                (datetime.now(UTC) + timedelta(seconds=wait)).strftime("%H:%M:%S"),
                wait,
            )
            await asyncio.sleep(wait)
        raise AssertionError("unreachable: attempts end by answering or raising")

    def _attempt(
        self, attempt: _Attempt, prompt: str, tokens: int, estimate: int, deadline: float
    ) -> ProviderReply:
        """On a model thread: room under the provider's cap, then one request."""
        attempt.capping = time.monotonic()
        cap = (
            self.throttle.admit(self.provider.name, estimate, deadline, self._ended)
            if self.provider.capped
            else contextlib.nullcontext(None)
        )
        with cap as admission:
            attempt.admission = admission
            if admission is not None:
                attempt.cap_waited = admission.waited_seconds
                with self._lock:
                    self._holds[id(admission)] = admission
            try:
                left = deadline - time.monotonic()
                # Once the life has ended nobody wants the answer, and __exit__ may
                # have given the room back before this attempt held it.
                if left <= 0 or self._ended.is_set():
                    raise no_room(self.provider.name, attempt.cap_waited)
                attempt.sent = time.monotonic()
                return self.provider.generate(
                    prompt, tokens, min(self.retry.stall_seconds, left), self.context
                )
            finally:
                if admission is not None:
                    with self._lock:
                        self._holds.pop(id(admission), None)

    def _next_wait(
        self, number: int, failure: ProviderUnavailable, deadline: float
    ) -> float | None:
        """The wait before another attempt, or None when there is to be none."""
        if not failure.retryable or number >= self.retry.max_attempts:
            return None
        wait = self.retry.backoff_seconds(number, failure.retry_after, self._jitter)
        # A wait that ends at the deadline leaves no time to be answered in.
        return wait if time.monotonic() + wait < deadline else None

    def _record(
        self,
        call: _Call,
        attempt: _Attempt,
        outcome: AttemptOutcome,
        error: str | None,
        *,
        billed: bool,
        cost: Decimal = Decimal(0),
        status: int | None = None,
        retry_after: float | None = None,
        backoff: float | None = None,
    ) -> None:
        """Add the attempt's record to its call."""
        now = time.monotonic()
        call.current = None
        call.attempts.append(
            ModelAttempt(
                number=attempt.number,
                started_at=attempt.started_at,
                cap_wait_seconds=attempt.cap_waited,
                request_seconds=now - attempt.sent if attempt.sent is not None else 0.0,
                outcome=outcome,
                vendor_status=status,
                error=error,
                retry_after_seconds=retry_after,
                backoff_seconds=backoff,
                may_have_billed=billed and attempt.sent is not None,
                cost_usd=cost,
                cap_note=attempt.admission.note if attempt.admission else None,
            )
        )

    def _audit(
        self,
        call: _Call,
        status: int,
        answer: str,
        *,
        error: str | None = None,
        reply: ProviderReply | None = None,
    ) -> _Answer:
        """Record the call and pass its answer on; a 200's answer is the model's text."""
        response = None
        headers: tuple[tuple[str, str], ...] = ()
        if status == 200:
            # A vendor's JSON may carry lone surrogates; neither the socket nor the
            # record can hold them, so both get the same repaired text.
            response = answer.encode("utf-8", errors="replace").decode("utf-8")
            answer = response
        elif error is None:
            error = answer
        if reply is not None:
            headers = ((STOP_REASON_HEADER, reply.stop_reason),)
        prompt = call.prompt.decode("utf-8", errors="replace")
        # Counted as the record will be written: JSON spells a control byte in 6.
        text_bytes = _json_bytes(prompt) + (_json_bytes(response) if response else 0)
        with self._lock:
            # Past the cap a record keeps sizes, hashes, tokens and cost, never the text.
            keep_text = self._audited_text + text_bytes <= AUDIT_TEXT_BYTES
            if keep_text:
                self._audited_text += text_bytes
        record = ModelCall(
            index=call.index,
            started_at=call.started_at,
            duration_seconds=time.monotonic() - call.clock,
            status=status,
            prompt=prompt if keep_text else "",
            response=response if keep_text else None,
            prompt_bytes=len(call.prompt),
            text_omitted=not keep_text,
            prompt_sha256=hashlib.sha256(call.prompt).hexdigest(),
            response_sha256=(
                hashlib.sha256(response.encode("utf-8")).hexdigest()
                if response is not None
                else None
            ),
            requested_output_tokens=call.requested_output_tokens,
            input_tokens=(reply.input_tokens or 0) if reply else 0,
            output_tokens=(reply.output_tokens or 0) if reply else 0,
            reserved_usd=call.reserved,
            cost_usd=call.charged,
            error=error,
            stop_reason=reply.stop_reason if reply else None,
            usage_reported=reply.usage_reported if reply else True,
            attempts=call.attempts,
        )
        with self._lock:
            self._calls.append(record)
        return _Answer(status, answer, headers)


def _one_line(text: str) -> str:
    """``text`` as one printable line of at most MODEL_FAILURE_REASON_CHARS characters."""
    line = " ".join("".join(ch if ch.isprintable() else " " for ch in text).split())
    if len(line) <= MODEL_FAILURE_REASON_CHARS:
        return line
    return line[: MODEL_FAILURE_REASON_CHARS - 1] + "…"


def _json_bytes(text: str) -> int:
    """The size of ``text`` as a JSON string in the observation."""
    return len(json.dumps(text, ensure_ascii=False).encode("utf-8"))


class _Exchange:
    """One connection's request and answer, framed by h11 and bounded in size and time."""

    def __init__(self, client: socket.socket) -> None:
        self.client = client
        self.http = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + REQUEST_SECONDS
        self.received = 0
        self.head_only = False

    async def request(self) -> h11.Request:
        """The request line and headers; RemoteProtocolError if malformed or too long."""
        while (event := self.http.next_event()) is h11.NEED_DATA:
            # Read no further than the limit, so that a head over it is never complete.
            if self.received >= MAX_HEAD_BYTES:
                raise h11.RemoteProtocolError(HEAD_TOO_LONG, error_status_hint=431)
            await self._receive(MAX_HEAD_BYTES - self.received)
        if not isinstance(event, h11.Request):
            raise ConnectionAbortedError("the client closed before sending a request")
        self.head_only = event.method == b"HEAD"
        return event

    async def body_chunk(self) -> bytes | None:
        """The next piece of the body, None at its end; RemoteProtocolError if cut short."""
        while (event := self.http.next_event()) is h11.NEED_DATA:
            await self._receive(RECEIVE_BYTES)
        return bytes(event.data) if isinstance(event, h11.Data) else None

    async def drain(self) -> None:
        """Read and drop what is left of a body answered unread (404, 405, too large...).

        Closing on a client that is mid-send breaks its pipe before it reads our answer.
        Nothing read here is kept; past DISCARD_CAP_BYTES, the end of the body or the
        request deadline, the answer goes out and the connection is closed.
        """
        if self.http.their_state is not h11.SEND_BODY:
            return
        left = DISCARD_CAP_BYTES
        with contextlib.suppress(h11.RemoteProtocolError, TimeoutError):
            while left > 0 and (chunk := await self.body_chunk()) is not None:
                left -= len(chunk)

    async def answer(self, answer: _Answer) -> None:
        data = _response(self.http, answer, head_only=self.head_only)
        async with asyncio.timeout(ANSWER_SECONDS):
            await self.loop.sock_sendall(self.client, data)

    def answer_at_once(self, answer: _Answer) -> None:
        """Answer if the socket takes it without waiting, or not at all."""
        with contextlib.suppress(OSError):
            self.client.send(_response(self.http, answer, head_only=self.head_only))

    async def _receive(self, size: int) -> None:
        async with asyncio.timeout_at(self.deadline):
            data = await self.loop.sock_recv(self.client, size)
        self.received += len(data)
        self.http.receive_data(data)


class _ModelThreads:
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
    logger.debug("model socket: refused a connection beyond %d", MAX_CONNECTIONS)


def _response(http: h11.Connection, answer: _Answer, *, head_only: bool = False) -> bytes:
    """The bytes of one whole answer; every answer closes its connection."""
    status = answer.status
    body = answer.text.encode("utf-8") if status == 200 else f"{answer.text}\n".encode()
    headers = [
        ("Content-Type", "text/plain; charset=utf-8"),
        ("Content-Length", str(len(body))),
        ("Connection", "close"),
        *answer.headers,
    ]
    events: list[h11.Event] = [
        h11.Response(status_code=status, headers=headers, reason=HTTPStatus(status).phrase)
    ]
    if not head_only:
        events.append(h11.Data(data=body))
    events.append(h11.EndOfMessage())
    return b"".join(http.send(event) or b"" for event in events)


_REFUSAL = _response(h11.Connection(h11.SERVER), _Answer(503, BUSY))


async def _read_prompt(
    headers: Sequence[tuple[bytes, bytes]], exchange: _Exchange, max_prompt_bytes: int
) -> bytes:
    """The request body, read only once its declared size is known to be within limits."""
    if _values(headers, b"transfer-encoding"):
        raise _InvalidRequest("send the prompt with Content-Length, not Transfer-Encoding")
    # h11 has checked any Content-Length: digits only, and repeats all equal.
    lengths = _values(headers, b"content-length")
    if not lengths:
        raise _InvalidRequest("Content-Length is required: the prompt's size in bytes")
    length = int(lengths[0])
    if length > max_prompt_bytes:
        raise _InvalidRequest(f"the prompt is over max_prompt_bytes ({max_prompt_bytes} bytes)")
    raw = bytearray()
    try:
        while (chunk := await exchange.body_chunk()) is not None:
            raw += chunk
    except h11.RemoteProtocolError:
        raise _InvalidRequest("the body ended before Content-Length bytes arrived") from None
    return bytes(raw)


def _values(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    """Every value of one header (h11 gives names in lower case)."""
    return [value for key, value in headers if key == name]


def _granted_tokens(headers: Sequence[tuple[bytes, bytes]], max_output_tokens: int) -> int:
    values = _values(headers, MAX_TOKENS_HEADER.lower().encode())
    if not values:
        return max_output_tokens
    value = values[0].strip()
    # The digit check comes first: int() would also take "+5", "1_0" and non-ASCII digits.
    if (
        len(values) == 1
        and _DECIMAL_INTEGER.fullmatch(value)
        and 1 <= int(value) <= max_output_tokens
    ):
        return int(value)
    raise _InvalidRequest(f"{MAX_TOKENS_HEADER} must be one integer from 1 to {max_output_tokens}")
