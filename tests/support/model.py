"""The model socket's test doubles: ``DoubleProvider`` (a provider that records what it
was asked and answers or fails as told), ``request`` (one HTTP call over the socket's
Unix path), ``CONTEXT`` and ``PRICES``; for ``test_model_server`` and
``test_model_socket_bounds``."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path

from worker.instrument.model.prices import Prices
from worker.instrument.model.providers import GenerationContext, Provider, ProviderReply
from worker.instrument.model.server import ModelSocket
from worker.instrument.records import StopReason

CONTEXT = GenerationContext(lineage="demo", generation=2, organism_source="(setq organism-ok t)\n")
PRICES = Prices(input_usd_per_mtok=Decimal(2), output_usd_per_mtok=Decimal(10))


class DoubleProvider(Provider):
    """A provider that records what it was asked and answers or fails as told.

    ``failures`` are raised by the first calls, one each, before it answers (or raises
    ``error``) as usual: a vendor that fails a few times, then recovers.
    """

    name = "double"

    def __init__(
        self,
        text: str = "the answer ✓",
        usage: tuple[int, int] | None = (100, 20),
        error: Exception | None = None,
        delay_seconds: float = 0.0,
        stop_reason: StopReason = "complete",
        failures: Sequence[Exception] = (),
    ) -> None:
        super().__init__("double-model", PRICES)
        self.text, self.usage, self.error, self.delay_seconds = text, usage, error, delay_seconds
        self.stop_reason = stop_reason
        self.failures = list(failures)
        self.asked: list[tuple[str, int, float, GenerationContext]] = []
        self.answered = threading.Event()

    def generate(
        self, prompt: str, max_output_tokens: int, timeout: float, context: GenerationContext
    ) -> ProviderReply:
        self.asked.append((prompt, max_output_tokens, timeout, context))
        time.sleep(self.delay_seconds)
        self.answered.set()
        if self.failures:
            raise self.failures.pop(0)
        if self.error is not None:
            raise self.error
        return ProviderReply(
            text=self.text,
            stop_reason=self.stop_reason,
            input_tokens=self.usage[0] if self.usage else None,
            output_tokens=self.usage[1] if self.usage else None,
        )


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("kernel", timeout=10)
        self.socket_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(str(self.socket_path))


def request(
    model: ModelSocket,
    body: bytes = b"hello model",
    headers: dict[str, str | bytes] | None = None,
    method: str = "POST",
    path: str = "/generate",
) -> tuple[int, str, http.client.HTTPResponse]:
    connection = UnixHTTPConnection(model.socket_path)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read().decode("utf-8"), response
    finally:
        connection.close()
