"""A vendor API stand-in on 127.0.0.1 for the provider, socket and pipeline tests.

It records each request and answers as told: a status and a JSON reply with headers,
after a delay, a redirect, a reset connection, or nothing at all (a hung vendor, held
until the stand-in stops).
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
