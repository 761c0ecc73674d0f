"""The model socket against a hostile organism: connection cap, header bloat, stalled and
dripping requests, a flood of idle connections; all over real Unix sockets.

The flood runs the model socket in a subprocess of its own, so that the memory and threads
measured are the model socket's alone; pytest -s shows the figures.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import resource
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path

import pytest
from support.model import CONTEXT, PRICES, DoubleProvider, request

from worker.instrument.model import limits as model_socket
from worker.instrument.model.capabilities import capabilities
from worker.instrument.model.limits import (
    ANSWER_SECONDS,
    MAX_CONNECTIONS,
    MAX_HEAD_BYTES,
    REQUEST_SECONDS,
)
from worker.instrument.model.providers import GenerationContext, Provider, ProviderReply
from worker.instrument.model.server import ModelSocket
from worker.instrument.physics import Physics

CALL = b"POST /generate HTTP/1.1\r\nHost: kernel\r\nContent-Length: 2\r\n\r\nhi"
HALF_REQUEST_LINE = b"POST /gener"
FLOOD_IDLE = 1500
FLOOD_BLOATED = 40
FLOOD_SOCKETS = FLOOD_IDLE + FLOOD_BLOATED + 64
WAIT_SECONDS = 10

Serve = Callable[..., ModelSocket]


@pytest.fixture(autouse=True)
def no_traceback_logged(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Whatever a test's clients do, nothing logs a traceback or an error."""
    caplog.set_level(logging.DEBUG)
    yield
    gc.collect()  # asyncio reports a task's unretrieved exception when the task is freed
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    """Start a model socket on tmp_path/model.sock; stopped at teardown."""
    with contextlib.ExitStack() as stack:

        def start(provider: Provider, physics: Physics | None = None) -> ModelSocket:
            model = ModelSocket(tmp_path / "model.sock", provider, physics or Physics(), CONTEXT)
            return stack.enter_context(model)

        yield start


def connect(path: Path, timeout: float = WAIT_SECONDS) -> socket.socket:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Connected blocking: a connect with a timeout fails with EAGAIN while the listen
    # backlog is full instead of waiting, and a flood fills it faster than it drains.
    client.connect(str(path))
    client.settimeout(timeout)
    return client


def read_until_closed(client: socket.socket) -> bytes:
    """Everything the server sent before it closed; TimeoutError if it never closes."""
    answer = b""
    try:
        while chunk := client.recv(65536):
            answer += chunk
    except ConnectionResetError:
        pass  # the server closed with bytes of ours unread: its answer came first
    return answer


def status_of(answer: bytes) -> int | None:
    return int(answer[9:12]) if answer.startswith(b"HTTP/1.1 ") else None


def bloated_head(lines: int) -> bytes:
    """A request head that has not ended after that many header lines of 64 KiB each."""
    line = b"X-Padding: " + b"a" * (64 * 1024 - 13) + b"\r\n"
    return b"POST /generate HTTP/1.1\r\nHost: kernel\r\n" + line * lines


def hold(path: Path, count: int, data: bytes = HALF_REQUEST_LINE) -> list[socket.socket]:
    """count connections that each sent data and then wait."""
    clients = [connect(path) for _ in range(count)]
    for client in clients:
        client.sendall(data)
    return clients


def wait_for(condition: Callable[[], object]) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        assert time.monotonic() < deadline, "waited in vain"
        time.sleep(0.01)


def test_a_connection_beyond_the_cap_is_refused_at_once_and_those_within_it_still_work(
    serve: Serve,
) -> None:
    provider = DoubleProvider()
    model = serve(provider, Physics(budget_usd=Decimal(10)))
    held = hold(model.socket_path, MAX_CONNECTIONS, b"")

    extra = connect(model.socket_path, timeout=REQUEST_SECONDS / 2)
    refusal = read_until_closed(extra)  # before REQUEST_SECONDS: not a held one's deadline

    assert status_of(refusal) == 503
    assert f"at most {MAX_CONNECTIONS} connections at once".encode() in refusal
    for client in held:
        client.sendall(CALL)
    assert [status_of(read_until_closed(client)) for client in held] == [200] * MAX_CONNECTIONS
    assert len(provider.asked) == MAX_CONNECTIONS
    assert request(model)[0] == 200


def test_a_header_bloated_request_is_answered_431_and_closed_without_being_read_in_full(
    serve: Serve,
) -> None:
    model = serve(DoubleProvider())
    client = connect(model.socket_path)
    sent: list[BaseException] = []

    def send_bloat() -> None:
        try:
            client.sendall(bloated_head(16))
        except OSError as exc:
            sent.append(exc)

    sender = threading.Thread(target=send_bloat)
    sender.start()
    answer = read_until_closed(client)
    sender.join(WAIT_SECONDS)
    client.close()

    assert status_of(answer) == 431
    assert answer.endswith(
        f"the request line and headers are over {MAX_HEAD_BYTES} bytes\n".encode()
    )
    # A mebibyte does not fit the socket's buffers: the rest of it was never read.
    assert len(sent) == 1 and isinstance(sent[0], BrokenPipeError | ConnectionResetError)
    assert model.calls == []
    assert request(model)[0] == 200


def drip(client: socket.socket, data: bytes) -> None:
    """Send data a byte at a time, 50 ms apart, until it is sent or the server hangs up."""
    try:
        for byte in data:
            client.send(bytes([byte]))
            time.sleep(0.05)
    except OSError:
        pass


@pytest.mark.parametrize("behaviour", ["stalls after half a request line", "drips bytes"])
def test_a_client_too_slow_to_send_its_request_is_answered_408_and_dropped_at_the_deadline(
    serve: Serve, monkeypatch: pytest.MonkeyPatch, behaviour: str
) -> None:
    # One second instead of REQUEST_SECONDS, so that the test is quick; the deadline
    # covers the whole request, so a client sending a byte now and then gains nothing.
    monkeypatch.setattr(model_socket, "REQUEST_SECONDS", 1)
    provider = DoubleProvider()
    model = serve(provider)
    client = connect(model.socket_path)
    if behaviour == "drips bytes":
        threading.Thread(target=drip, args=(client, CALL), daemon=True).start()
    else:
        client.sendall(HALF_REQUEST_LINE)

    answer = read_until_closed(client)
    client.close()

    assert status_of(answer) == 408
    assert answer.endswith(b"the request did not arrive within 1 s of connecting\n")
    assert provider.asked == []
    assert request(model)[0] == 200


def test_a_legitimate_call_succeeds_while_the_organism_holds_the_other_connections_open(
    serve: Serve,
) -> None:
    model = serve(DoubleProvider())
    held = hold(model.socket_path, MAX_CONNECTIONS - 1)

    status, text, _ = request(model)

    assert (status, text) == (200, "the answer ✓")
    for client in held:
        client.close()


def test_a_second_request_on_the_same_connection_is_never_read(serve: Serve) -> None:
    provider = DoubleProvider()
    model = serve(provider)
    client = connect(model.socket_path)

    client.sendall(CALL + CALL)
    answer = read_until_closed(client)
    client.close()

    assert answer.count(b"HTTP/1.1 ") == 1
    assert b"\r\nConnection: close\r\n" in answer
    assert len(provider.asked) == 1


def test_leaving_the_model_socket_closes_every_connection_at_once_and_answers_a_waiting_call_502(
    tmp_path: Path,
) -> None:
    provider = DoubleProvider(delay_seconds=2)
    with ModelSocket(tmp_path / "model.sock", provider, Physics(), CONTEXT) as model:
        waiting = connect(model.socket_path)
        waiting.sendall(CALL)
        idle = hold(model.socket_path, MAX_CONNECTIONS - 1)
        wait_for(lambda: provider.asked)
        started = time.monotonic()
    took = time.monotonic() - started

    assert took < 1
    assert status_of(read_until_closed(waiting)) == 502
    assert [read_until_closed(client) for client in idle] == [b""] * len(idle)
    [call] = model.calls
    assert call.error == "the generation ended before the model answered"
    assert call.cost_usd == call.reserved_usd > 0


class StuckProvider(Provider):
    """A model that answers only once released."""

    name = "stuck"

    def __init__(self) -> None:
        super().__init__("stuck-model", PRICES)
        self.release = threading.Event()
        self.asked: list[str] = []

    def generate(
        self, prompt: str, max_output_tokens: int, timeout: float, context: GenerationContext
    ) -> ProviderReply:
        self.asked.append(prompt)
        self.release.wait(WAIT_SECONDS)
        return ProviderReply(text="late", stop_reason="complete", input_tokens=1, output_tokens=1)


def test_calls_abandoned_at_their_deadline_hold_at_most_the_cap_in_threads_and_a_call_that_got_none_is_refunded(  # noqa: E501
    tmp_path: Path,
) -> None:
    provider = StuckProvider()
    physics = Physics(model_timeout_seconds=1, budget_usd=Decimal(10))
    # A context of its own names this model socket's threads apart from other tests'.
    context = GenerationContext(lineage="stuck", generation=1, organism_source="")
    with ModelSocket(tmp_path / "model.sock", provider, physics, context) as model:
        stuck = hold(model.socket_path, MAX_CONNECTIONS, CALL)
        abandoned = [status_of(read_until_closed(client)) for client in stuck]
        queued, _, _ = request(model)  # every model thread still waits on an abandoned call
        threads = [t for t in threading.enumerate() if t.name.startswith("model-call-stuck-1-")]
        provider.release.set()
        answered, _, _ = request(model)

    assert abandoned == [502] * MAX_CONNECTIONS
    assert all(c.cost_usd == c.reserved_usd > 0 for c in model.calls[:MAX_CONNECTIONS])
    assert len(threads) == MAX_CONNECTIONS
    assert queued == 502
    never_sent = model.calls[MAX_CONNECTIONS]
    assert (never_sent.error, never_sent.cost_usd) == ("no answer within 1 s", 0)
    assert never_sent.reserved_usd > 0
    assert answered == 200
    assert len(provider.asked) == MAX_CONNECTIONS + 1
    assert model.spent_usd == sum((c.cost_usd for c in model.calls), Decimal(0))


def test_garbage_hang_ups_and_unread_answers_leave_no_traceback_and_the_socket_serving(
    serve: Serve,
) -> None:
    provider = DoubleProvider(delay_seconds=0.2)
    model = serve(provider)
    path = model.socket_path
    garbage = {
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)): 400,
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n": 404,
        b"GET /generate HTTP/1.1\r\nHost: k\r\nBad\x00Name: x\r\n\r\n": 400,
        b"POST /generate HTTP/1.1\r\nHost: k\r\nTransfer-Encoding: gzip\r\n\r\n": 400,
        b"\r\n\r\n\r\n": 400,
    }

    answers = {}
    for data in garbage:
        with connect(path) as client:
            client.sendall(data)
            client.shutdown(socket.SHUT_WR)
            answers[data] = status_of(read_until_closed(client))
    connect(path).close()
    with connect(path) as client:  # leaves in the middle of its body
        client.sendall(CALL[:-1])
    with connect(path) as client:  # leaves while the model thinks
        client.sendall(CALL)
    wait_for(lambda: model.calls)

    assert answers == garbage
    assert request(model)[0] == 200
    assert [c.status for c in model.calls] == [200, 200]


def test_the_manifest_discloses_every_limit_the_socket_enforces() -> None:
    limits = capabilities(Physics())["operations"]["generate"]["limits"]

    assert {name: limit["max"] for name, limit in limits.items()} == {
        "connections": MAX_CONNECTIONS,
        "request_head_bytes": MAX_HEAD_BYTES,
        "request_seconds": REQUEST_SECONDS,
        "answer_seconds": ANSWER_SECONDS,
        "requests_per_connection": 1,
        "calls_per_generation": model_socket.MAX_CALLS,
        "audited_text_bytes": model_socket.AUDIT_TEXT_BYTES,
        "refused_text_bytes": model_socket.REFUSED_TEXT_BYTES,
    }
    assert all(limit["beyond"] for limit in limits.values())


def test_calls_past_the_generations_call_limit_are_refused_429_counted_and_never_sent(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_socket, "MAX_CALLS", 3)
    provider = DoubleProvider()
    model = serve(provider)
    statuses = [request(model)[0] for _ in range(5)]
    assert statuses == [200, 200, 200, 429, 429]
    assert len(model.calls) == 3 and model.calls_over_limit == 2
    assert len(provider.asked) == 3


def test_past_the_audited_text_cap_calls_keep_sizes_hashes_and_cost_but_not_their_text(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Room for the first call's prompt and answer, not for the second's.
    monkeypatch.setattr(model_socket, "AUDIT_TEXT_BYTES", 100)
    model = serve(DoubleProvider())
    prompt = b"p" * 60
    assert request(model, prompt)[0] == 200
    assert request(model, prompt)[0] == 200
    first, second = model.calls
    assert (first.text_omitted, first.prompt) == (False, prompt.decode())
    assert (second.text_omitted, second.prompt, second.response) == (True, "", None)
    assert second.prompt_bytes == len(prompt) and second.prompt_sha256 == first.prompt_sha256
    assert second.response_sha256 == first.response_sha256
    assert second.cost_usd == first.cost_usd > 0


def test_the_audited_text_cap_counts_text_as_the_observation_spells_it(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 60 control bytes are 360 bytes of JSON: over a 100-byte cap from the first call.
    monkeypatch.setattr(model_socket, "AUDIT_TEXT_BYTES", 100)
    model = serve(DoubleProvider())
    assert request(model, b"\x01" * 60)[0] == 200
    (call,) = model.calls
    assert call.text_omitted and call.prompt_bytes == 60


# --- a flood, against a model socket in a process of its own -----------------------------

MODEL_SOCKET_PROCESS = r"""
import sys, time
from decimal import Decimal
from pathlib import Path

from worker.instrument.model.providers import GenerationContext, Provider, ProviderReply
from worker.instrument.model.server import ModelSocket
from worker.instrument.model.prices import Prices
from worker.instrument.physics import Physics


class Echo(Provider):
    name = "echo"

    def generate(self, prompt, max_output_tokens, timeout, context):
        return ProviderReply(text=prompt, stop_reason="complete", input_tokens=1, output_tokens=1)


prices = Prices(input_usd_per_mtok=Decimal(1), output_usd_per_mtok=Decimal(1))
context = GenerationContext(lineage="flooded", generation=1, organism_source="")
with ModelSocket(Path(sys.argv[1]), Echo("echo", prices), Physics(), context):
    print("serving", flush=True)
    sys.stdin.readline()
    started = time.monotonic()
print(f"exited in {time.monotonic() - started:.6f} s", flush=True)
"""


def proc_status(pid: int) -> dict[str, int]:
    """Threads, VmRSS and VmHWM (in KiB) of a live process."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("Threads", "VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


def send_bloat(path: Path, head: bytes, into: list[socket.socket]) -> None:
    """Connect, and send head whole or until the server hangs up or stops reading."""
    client = connect(path)
    into.append(client)
    with contextlib.suppress(OSError):
        client.sendall(head)


@pytest.mark.full
def test_a_flood_of_idle_and_header_bloated_connections_costs_few_threads_little_memory_and_no_delay_at_exit(  # noqa: E501
    tmp_path: Path,
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < FLOOD_SOCKETS:
        assert hard >= FLOOD_SOCKETS, f"needs {FLOOD_SOCKETS} open files, the hard limit is {hard}"
        resource.setrlimit(resource.RLIMIT_NOFILE, (FLOOD_SOCKETS, hard))
    path = tmp_path / "model.sock"
    served = subprocess.Popen(
        [sys.executable, "-c", MODEL_SOCKET_PROCESS, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    bloated: list[socket.socket] = []
    idle: list[socket.socket] = []
    peak_threads = 0
    sampling = threading.Event()

    def sample() -> None:
        nonlocal peak_threads
        while not sampling.wait(0.005):
            peak_threads = max(peak_threads, proc_status(served.pid)["Threads"])

    sampler = threading.Thread(target=sample)
    try:
        assert served.stdout is not None and served.stdin is not None
        assert served.stdout.readline() == "serving\n"
        before = proc_status(served.pid)
        sampler.start()
        # 98 header lines of 64 KiB: what the old server read whole, 40 times over.
        bloat = bloated_head(98)
        senders = [
            threading.Thread(target=send_bloat, args=(path, bloat, bloated))
            for _ in range(FLOOD_BLOATED)
        ]
        for sender in senders:
            sender.start()
        idle = [connect(path) for _ in range(FLOOD_IDLE)]
        for sender in senders:
            sender.join()
        time.sleep(0.5)
        after = proc_status(served.pid)
        sampling.set()
        sampler.join()

        served.stdin.write("exit\n")
        served.stdin.flush()
        exited = served.stdout.readline()
        assert served.wait(WAIT_SECONDS) == 0
    finally:
        sampling.set()
        if sampler.is_alive():
            sampler.join()
        if served.poll() is None:
            served.kill()
            served.wait()
    clients = bloated + idle
    answers = [read_until_closed(client) for client in clients]  # TimeoutError if one is open
    for client in clients:
        client.close()

    growth_mb = (after["VmHWM"] - before["VmRSS"]) / 1024
    exit_seconds = float(exited.split()[2])
    tally = Counter(status_of(answer) for answer in answers)
    print(
        f"\nflood of {FLOOD_IDLE} idle + {FLOOD_BLOATED} header-bloated connections: "
        f"model socket threads {before['Threads']} before, at most {peak_threads} during; "
        f"RSS {before['VmRSS'] / 1024:.1f} MB before, peak {after['VmHWM'] / 1024:.1f} MB "
        f"(growth {growth_mb:.1f} MB); exit took {exit_seconds * 1000:.1f} ms; "
        f"answers by status (None: closed unanswered) {dict(tally)}"
    )
    assert peak_threads <= MAX_CONNECTIONS + 4
    assert growth_mb < 64
    assert exit_seconds < 3
    assert len(answers) == FLOOD_IDLE + FLOOD_BLOATED
    assert {status_of(answer) for answer in answers[:FLOOD_BLOATED]} <= {431, 503}
    assert set(tally) <= {503, 431, 408, None}
    # Closed unanswered at exit: only the connections admitted, still sending a request.
    assert tally[None] <= MAX_CONNECTIONS
