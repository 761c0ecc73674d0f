"""The model syscall: an HTTP server on the generation's Unix socket, and its manifest.

Owns the provider-neutral ABI (``POST /generate``, raw UTF-8 prompt in, raw UTF-8
text out; 400 invalid request, 402 budget exhausted, 502 model unavailable), the
capability manifest that discloses it with the effective constraints, and the audit
record of every call. One ModelBroker serves one generation: it binds the socket,
answers from daemon threads, reserves and settles each call in the generation's
ledger, and removes the socket when the generation ends.

Trusts: the provider, physics and context it is given. Trusts nothing from the
socket: the client is the organism, so sizes, headers and encodings are checked and
at most max_prompt_bytes of body are ever kept. Answers to the organism never name a
provider, model, price or credential; the detail goes to the audit record only.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from email.message import Message
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from socketserver import ThreadingUnixStreamServer
from types import TracebackType
from typing import Any, BinaryIO

from worker.broker.ledger import BudgetExhausted, Ledger, Reservation
from worker.broker.prices import Prices
from worker.broker.providers import (
    GenerationContext,
    Provider,
    ProviderReply,
    ProviderUnavailable,
)
from worker.observation import ModelCall
from worker.physics import Physics

logger = logging.getLogger(__name__)

CAPABILITIES_SCHEMA = "ouroboros-capabilities/v1"
SANDBOX_SOCKET = "/kernel/model.sock"
SANDBOX_JOURNAL = "/kernel/journal.md"
GENERATE_PATH = "/generate"
MAX_TOKENS_HEADER = "X-Ouroboros-Max-Output-Tokens"
_DECIMAL_INTEGER = re.compile(r"[0-9]{1,12}")
DISCARD_CAP_BYTES = 16 * 1024 * 1024

BUDGET_EXHAUSTED = "budget exhausted: what is left cannot cover this call's worst case"
MODEL_UNAVAILABLE = "model unavailable"
ABANDONED = "the generation ended before the model answered"


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
                        "Content-Length": "required: the body's size in bytes",
                        MAX_TOKENS_HEADER: (
                            "optional: an integer from 1 to max_output_tokens; "
                            "max_output_tokens when absent"
                        ),
                    },
                },
                "responses": {
                    "200": "the model's answer as raw UTF-8 (text/plain; charset=utf-8)",
                    "400": "invalid request; the body says what is wrong",
                    "402": "budget exhausted; nothing was sent to the model",
                    "502": "model unavailable, or no answer within model_timeout_seconds",
                },
                "spending": (
                    "each call first reserves its worst case from budget_usd: every prompt "
                    "byte plus 4096 tokens as input and every granted output token as "
                    "output. An answered call is then charged its reported usage, a call "
                    "the model refused nothing, and a call whose answer was lost after "
                    "the model received it its whole reservation"
                ),
            },
            "journal": {"path": SANDBOX_JOURNAL, "access": "read-only"},
        },
        "constraints": {
            **physics.model_dump(mode="json"),
            "cpu_quota_percent": physics.cpu_quota_percent,
            "archive_cap_bytes": physics.archive_cap_bytes,
            "network": "none",
        },
    }


class _InvalidRequest(Exception):
    """A request the ABI does not allow; the message is the 400 answer."""


@dataclass
class _Call:
    """A request that got as far as having a body, until it is audited."""

    index: int
    started_at: datetime
    clock: float
    prompt: bytes
    requested_output_tokens: int | None = None


class ModelBroker:
    """Serves the model syscall of one generation on a Unix socket (a context manager)."""

    def __init__(
        self,
        socket_path: Path,
        provider: Provider,
        physics: Physics,
        context: GenerationContext,
    ) -> None:
        self.socket_path = Path(socket_path)
        self.provider = provider
        self.physics = physics
        self.context = context
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
        self._in_flight: dict[int, tuple[_Call, Reservation]] = {}
        self._server: _UnixHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def calls(self) -> list[ModelCall]:
        """Every audited call so far, in order of arrival."""
        with self._lock:
            return sorted(self._calls, key=lambda call: call.index)

    @property
    def spent_usd(self) -> Decimal:
        return self.ledger.spent_usd

    def __enter__(self) -> ModelBroker:
        # A socket left by a killed worker would make bind fail; anything else is kept.
        if self.socket_path.is_socket():
            self.socket_path.unlink()
        server = _UnixHTTPServer(str(self.socket_path), _Handler)
        server.broker = self
        # Only the worker's own uid, which bwrap maps to itself inside the sandbox, may
        # connect: any other local user could spend the budget and forge audit records.
        os.chmod(self.socket_path, 0o600)
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            # shutdown() waits for the next poll: keep that wait short for every generation.
            kwargs={"poll_interval": 0.005},
            name=f"model-broker-{self.context.lineage}-{self.context.generation}",
            daemon=True,
        )
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.socket_path.unlink(missing_ok=True)
        # The life is over (a wall timeout often ends it mid-call). A call still waiting
        # for the model is recorded now, charged its reservation, so the observation
        # written after this holds every call and every dollar that may have been spent.
        with self._lock:
            abandoned = list(self._in_flight.values())
            self._in_flight.clear()
        for call, reservation in abandoned:
            self._fail(call, reservation, ABANDONED, keep_reservation=True)

    def serve_generate(self, headers: Message, body: BinaryIO) -> tuple[int, str]:
        """One POST /generate: its status and the text to answer with."""
        started_at = datetime.now(UTC)
        clock = time.monotonic()
        try:
            raw = _read_prompt(headers, body, self.physics.max_prompt_bytes)
        except _InvalidRequest as exc:
            return 400, str(exc)
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
        try:
            reservation = self.ledger.reserve(len(raw), tokens)
        except BudgetExhausted as exc:
            return self._audit(call, 402, BUDGET_EXHAUSTED, error=str(exc))
        with self._lock:
            self._in_flight[call.index] = (call, reservation)
        try:
            reply = self._generate(prompt, tokens)
        except ProviderUnavailable as exc:
            if not self._land(call.index):
                return 502, MODEL_UNAVAILABLE
            logger.warning("model call %d failed: %s", call.index, exc)
            return self._fail(call, reservation, str(exc), keep_reservation=exc.may_have_billed)
        if not self._land(call.index):
            return 502, MODEL_UNAVAILABLE
        cost = self.ledger.settle_usage(reservation, reply.input_tokens, reply.output_tokens)
        return self._audit(
            call, 200, reply.text, reply=reply, reserved=reservation.amount_usd, cost=cost
        )

    def _land(self, index: int) -> bool:
        """Whether this call is still ours to settle (False once __exit__ settled it)."""
        with self._lock:
            return self._in_flight.pop(index, None) is not None

    def _fail(
        self, call: _Call, reservation: Reservation, error: str, *, keep_reservation: bool
    ) -> tuple[int, str]:
        # Refund what the vendor cannot have billed; keep the whole reservation when it
        # may have served a request whose answer we lost, so the ceiling stays hard.
        charge = reservation.amount_usd if keep_reservation else Decimal(0)
        cost = self.ledger.settle(reservation, charge)
        return self._audit(
            call, 502, MODEL_UNAVAILABLE, error=error, reserved=reservation.amount_usd, cost=cost
        )

    def _generate(self, prompt: str, max_output_tokens: int) -> ProviderReply:
        """The provider's reply within model_timeout_seconds overall.

        The provider's own socket timeout bounds each read, not the whole exchange, so
        the call runs in a daemon thread that is abandoned at the deadline.
        """
        timeout = self.physics.model_timeout_seconds
        outcome: list[ProviderReply | Exception] = []
        done = threading.Event()

        def call() -> None:
            try:
                outcome.append(
                    self.provider.generate(prompt, max_output_tokens, timeout, self.context)
                )
            except Exception as exc:
                outcome.append(exc)
            finally:
                done.set()

        threading.Thread(target=call, name="model-call", daemon=True).start()
        if not done.wait(timeout):
            raise ProviderUnavailable(f"no answer within {timeout} s", may_have_billed=True)
        result = outcome[0]
        if isinstance(result, ProviderUnavailable):
            raise result
        if isinstance(result, Exception):
            logger.error("provider %s failed unexpectedly", self.provider.name, exc_info=result)
            raise ProviderUnavailable(
                f"{self.provider.name} failed: {type(result).__name__}", may_have_billed=True
            )
        return result

    def _audit(
        self,
        call: _Call,
        status: int,
        answer: str,
        *,
        error: str | None = None,
        reply: ProviderReply | None = None,
        reserved: Decimal = Decimal(0),
        cost: Decimal = Decimal(0),
    ) -> tuple[int, str]:
        """Record the call and pass its answer on; a 200's answer is the model's text."""
        response = None
        if status == 200:
            # A vendor's JSON may carry lone surrogates; neither the socket nor the
            # record can hold them, so both get the same repaired text.
            response = answer.encode("utf-8", errors="replace").decode("utf-8")
            answer = response
        elif error is None:
            error = answer
        record = ModelCall(
            index=call.index,
            started_at=call.started_at,
            duration_seconds=time.monotonic() - call.clock,
            status=status,
            prompt=call.prompt.decode("utf-8", errors="replace"),
            response=response,
            prompt_sha256=hashlib.sha256(call.prompt).hexdigest(),
            response_sha256=(
                hashlib.sha256(response.encode("utf-8")).hexdigest()
                if response is not None
                else None
            ),
            requested_output_tokens=call.requested_output_tokens,
            input_tokens=reply.input_tokens if reply else 0,
            output_tokens=reply.output_tokens if reply else 0,
            reserved_usd=reserved,
            cost_usd=cost,
            error=error,
        )
        with self._lock:
            self._calls.append(record)
        return status, answer


def _read_prompt(headers: Message, body: BinaryIO, max_prompt_bytes: int) -> bytes:
    """The request body, read only once its declared size is known to be within limits."""
    if headers.get("Transfer-Encoding") is not None:
        raise _InvalidRequest("send the prompt with Content-Length, not Transfer-Encoding")
    lengths = headers.get_all("Content-Length") or []
    if len(lengths) != 1 or not _DECIMAL_INTEGER.fullmatch(lengths[0].strip()):
        raise _InvalidRequest("Content-Length is required once: the prompt's size in bytes")
    length = int(lengths[0])
    if length > max_prompt_bytes:
        _discard(body, min(length, DISCARD_CAP_BYTES))
        raise _InvalidRequest(f"the prompt is over max_prompt_bytes ({max_prompt_bytes} bytes)")
    try:
        raw = body.read(length)
    except OSError:
        raw = b""
    if len(raw) < length:
        raise _InvalidRequest("the body ended before Content-Length bytes arrived")
    return raw


def _discard(body: BinaryIO, size: int) -> None:
    """Read and drop an oversized body so that the client, still sending, can read the 400.

    Closing on a client that is mid-send breaks its pipe before it reads our answer.
    Nothing read here is kept; past DISCARD_CAP_BYTES the connection is just closed.
    """
    try:
        while size > 0 and (chunk := body.read(min(size, 65536))):
            size -= len(chunk)
    except OSError:
        pass


def _granted_tokens(headers: Message, max_output_tokens: int) -> int:
    values = headers.get_all(MAX_TOKENS_HEADER) or []
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


class _UnixHTTPServer(ThreadingUnixStreamServer):
    # Handler threads must never keep a finished generation (or the worker) alive.
    daemon_threads = True
    block_on_close = False
    # socketserver's default backlog of 5 makes a sixth simultaneous connect fail with
    # EAGAIN; an organism may run as many callers as tasks_max allows.
    request_queue_size = 128
    broker: ModelBroker


class _Handler(BaseHTTPRequestHandler):
    server: _UnixHTTPServer
    server_version = "ouroboros-kernel"
    sys_version = ""

    def setup(self) -> None:
        # A client that stops sending must not hold a thread for longer than a call may take.
        self.timeout = self.server.broker.physics.model_timeout_seconds
        super().setup()

    def do_POST(self) -> None:
        if self.path != GENERATE_PATH:
            self._answer(404, f"unknown operation; the only one is POST {GENERATE_PATH}")
            return
        self._answer(*self.server.broker.serve_generate(self.headers, self.rfile))

    def _wrong_method(self) -> None:
        if self.path == GENERATE_PATH:
            self._answer(405, f"{GENERATE_PATH} takes POST only", allow="POST")
        else:
            self._answer(404, f"unknown operation; the only one is POST {GENERATE_PATH}")

    do_GET = do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _wrong_method

    def _answer(self, status: int, text: str, allow: str | None = None) -> None:
        body = text.encode("utf-8") if status == 200 else f"{text}\n".encode()
        self.close_connection = True
        try:
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            if allow:
                self.send_header("Allow", allow)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
        except OSError as exc:
            # The organism hung up; its call is already audited.
            logger.info("model socket client left before the answer: %s", exc)

    def log_message(self, format: str, *args: Any) -> None:
        # The default writes to stderr and reads client_address[0], which an AF_UNIX peer lacks.
        logger.debug("model socket: " + format, *args)
