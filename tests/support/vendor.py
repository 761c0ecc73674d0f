"""A vendor API stand-in on 127.0.0.1 for the provider, socket and pipeline tests.

It records each request and answers as told: a status and a JSON reply with headers,
after a delay, a redirect, a reset connection, or nothing at all (a hung vendor, held
until the stand-in stops); and the Responses API's reply types it answers with.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from openai.types.responses import (
    Response,
    ResponseOutputMessage,
    ResponseOutputRefusal,
    ResponseOutputText,
    ResponseUsage,
)
from openai.types.responses.response import IncompleteDetails
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails


@dataclass
class Received:
    path: str
    headers: Message
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class StandIn:
    """A vendor API on 127.0.0.1: records each request, answers as told."""

    url: str = ""
    status: int = 200
    reply: object = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    delay_seconds: float = 0.0
    location: str | None = None
    # Reset the connection (RST) once the request is read, answering nothing.
    reset: bool = False
    # Read the request and answer nothing, holding the connection open until stopped.
    hang: bool = False
    received: list[Received] = field(default_factory=list)
    stopped: threading.Event = field(default_factory=threading.Event)

    def only_request(self) -> Received:
        assert len(self.received) == 1
        return self.received[0]


@contextmanager
def running_stand_in() -> Iterator[StandIn]:
    """A stand-in serving until the block ends."""
    state = StandIn()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            state.received.append(Received(self.path, self.headers, body))
            if state.hang:
                state.stopped.wait()
                return
            if state.reset:
                linger = struct.pack("ii", 1, 0)
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
                self.connection.close()
                self.close_connection = True
                return
            time.sleep(state.delay_seconds)
            if state.location is not None:
                self.send_response(302)
                self.send_header("Location", state.location)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            raw = (
                state.reply if isinstance(state.reply, bytes) else json.dumps(state.reply).encode()
            )
            try:
                self.send_response(state.status)
                for name, value in state.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)
            except OSError:
                pass  # the client gave up first, as the timeout test intends

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield state
    finally:
        state.stopped.set()
        server.shutdown()
        server.server_close()
        thread.join()


# Replies in the Responses API's own types, for a stand-in to answer with.
def output_text(text: str) -> ResponseOutputText:
    return ResponseOutputText(type="output_text", text=text, annotations=[])


def message(*parts: ResponseOutputText | ResponseOutputRefusal) -> ResponseOutputMessage:
    return ResponseOutputMessage(
        id="msg_1", type="message", role="assistant", status="completed", content=list(parts)
    )


def openai_response(
    output: list[Any], status: Any, *, usage: tuple[int, int], incomplete: Any = None
) -> dict[str, Any]:
    return Response(
        id="resp_1",
        created_at=1_767_225_600.0,
        model="gpt-5.6",
        object="response",
        output=output,
        parallel_tool_calls=False,
        tool_choice="auto",
        tools=[],
        status=status,
        incomplete_details=IncompleteDetails(reason=incomplete) if status == "incomplete" else None,
        usage=ResponseUsage(
            input_tokens=usage[0],
            input_tokens_details=InputTokensDetails(cached_tokens=0, cache_write_tokens=0),
            output_tokens=usage[1],
            output_tokens_details=OutputTokensDetails(reasoning_tokens=usage[1]),
            total_tokens=sum(usage),
        ),
    ).model_dump(mode="json")
