"""HTTP/1.1 framing of the model socket: one request read and one answer written.

Owns a connection's exchange (``Exchange``): the request line and headers read up to
``limits.MAX_HEAD_BYTES``, the body read only once its declared size is within
max_prompt_bytes, the whole request within ``limits.REQUEST_SECONDS`` of connecting
(a deadline for the whole request, not per read, so dripping bytes does not extend
it), what is left of a body answered unread drained up to DISCARD_CAP_BYTES, and the
answer (``Answer``), which always closes its connection, given
``limits.ANSWER_SECONDS`` to be taken. h11 frames the bytes and does no I/O; the
reads and writes are the event loop's.

Trusts nothing from the socket: sizes, headers and encodings are checked, and a
request the ABI does not allow raises ``InvalidRequest`` with the 400 answer's text.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from http import HTTPStatus

import h11

from worker.instrument.model import limits
from worker.instrument.model.capabilities import MAX_TOKENS_HEADER

_DECIMAL_INTEGER = re.compile(rb"[0-9]{1,12}")
DISCARD_CAP_BYTES = 16 * 1024 * 1024
RECEIVE_BYTES = 64 * 1024
HEAD_TOO_LONG = f"the request line and headers are over {limits.MAX_HEAD_BYTES} bytes"


class InvalidRequest(Exception):
    """A request the ABI does not allow; the message is the 400 answer."""


@dataclass(frozen=True)
class Answer:
    """What the socket answers one request: status, text and any extra headers."""

    status: int
    text: str
    headers: tuple[tuple[str, str], ...] = ()


class Exchange:
    """One connection's request and answer, framed by h11 and bounded in size and time."""

    def __init__(self, client: socket.socket) -> None:
        self.client = client
        self.http = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.MAX_HEAD_BYTES)
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + limits.REQUEST_SECONDS
        self.received = 0
        self.head_only = False

    async def request(self) -> h11.Request:
        """The request line and headers; RemoteProtocolError if malformed or too long."""
        while (event := self.http.next_event()) is h11.NEED_DATA:
            # Read no further than the limit, so that a head over it is never complete.
            if self.received >= limits.MAX_HEAD_BYTES:
                raise h11.RemoteProtocolError(HEAD_TOO_LONG, error_status_hint=431)
            await self._receive(limits.MAX_HEAD_BYTES - self.received)
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

    async def answer(self, answer: Answer) -> None:
        data = response(self.http, answer, head_only=self.head_only)
        async with asyncio.timeout(limits.ANSWER_SECONDS):
            await self.loop.sock_sendall(self.client, data)

    def answer_at_once(self, answer: Answer) -> None:
        """Answer if the socket takes it without waiting, or not at all."""
        with contextlib.suppress(OSError):
            self.client.send(response(self.http, answer, head_only=self.head_only))

    async def _receive(self, size: int) -> None:
        async with asyncio.timeout_at(self.deadline):
            data = await self.loop.sock_recv(self.client, size)
        self.received += len(data)
        self.http.receive_data(data)


def response(http: h11.Connection, answer: Answer, *, head_only: bool = False) -> bytes:
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


async def read_prompt(
    headers: Sequence[tuple[bytes, bytes]], exchange: Exchange, max_prompt_bytes: int
) -> bytes:
    """The request body, read only once its declared size is known to be within limits."""
    if _values(headers, b"transfer-encoding"):
        raise InvalidRequest("send the prompt with Content-Length, not Transfer-Encoding")
    # h11 has checked any Content-Length: digits only, and repeats all equal.
    lengths = _values(headers, b"content-length")
    if not lengths:
        raise InvalidRequest("Content-Length is required: the prompt's size in bytes")
    length = int(lengths[0])
    if length > max_prompt_bytes:
        raise InvalidRequest(f"the prompt is over max_prompt_bytes ({max_prompt_bytes} bytes)")
    raw = bytearray()
    try:
        while (chunk := await exchange.body_chunk()) is not None:
            raw += chunk
    except h11.RemoteProtocolError:
        raise InvalidRequest("the body ended before Content-Length bytes arrived") from None
    return bytes(raw)


def _values(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    """Every value of one header (h11 gives names in lower case)."""
    return [value for key, value in headers if key == name]


def granted_tokens(headers: Sequence[tuple[bytes, bytes]], max_output_tokens: int) -> int:
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
    raise InvalidRequest(f"{MAX_TOKENS_HEADER} must be one integer from 1 to {max_output_tokens}")
