"""The model syscall over a real Unix socket: statuses, ledger, audit, manifest, and an
Emacs Lisp client speaking the ABI as an organism does."""

from __future__ import annotations

import hashlib
import json
import random
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from decimal import Decimal
from pathlib import Path

import pytest
from support.model import CONTEXT, PRICES, DoubleProvider, request

from worker.fleet.settings import Settings
from worker.instrument import syscall_filter
from worker.instrument.model.capabilities import capabilities
from worker.instrument.model.ledger import FRAMING_TOKENS
from worker.instrument.model.limits import MAX_CONNECTIONS
from worker.instrument.model.prices import BUILTIN_PRICES
from worker.instrument.model.providers import (
    Provider,
    ProviderUnavailable,
    make_provider,
)
from worker.instrument.model.retry import RetryPolicy
from worker.instrument.model.server import ModelSocket
from worker.instrument.model.throttle import Cap, LocalThrottle, Throttle
from worker.instrument.physics import Physics
from worker.instrument.records import STOP_REASONS, StopReason


def raw_request(model: ModelSocket, head: bytes, body: bytes = b"") -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(10)
        client.connect(str(model.socket_path))
        client.sendall(head + body)
        client.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
        return answer


Serve = Callable[..., ModelSocket]


# Retries as the socket makes them, with waits short enough for a test.
QUICK_RETRY = RetryPolicy(first_backoff_seconds=0.01, max_backoff_seconds=0.05)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    """Start a model socket on tmp_path/model.sock; stopped at teardown."""
    with ExitStack() as stack:

        def start(
            provider: Provider,
            physics: Physics | None = None,
            throttle: Throttle | None = None,
            retry: RetryPolicy = QUICK_RETRY,
        ) -> ModelSocket:
            model = ModelSocket(
                tmp_path / "model.sock",
                provider,
                physics or Physics(),
                CONTEXT,
                throttle=throttle,
                retry=retry,
            )
            return stack.enter_context(model)

        yield start


def test_generate_answers_the_model_text_as_utf8_plain_text(serve: Serve) -> None:
    provider = DoubleProvider()
    model = serve(provider, Physics(max_output_tokens=500, model_timeout_seconds=7))

    status, text, response = request(
        model, "prompt ✓".encode(), {"X-Ouroboros-Max-Output-Tokens": "321"}
    )

    assert (status, text) == (200, "the answer ✓")
    assert response.getheader("Content-Type") == "text/plain; charset=utf-8"
    [(prompt, tokens, timeout, context)] = provider.asked
    assert (prompt, tokens, context) == ("prompt ✓", 321, CONTEXT)
    # Each read of the attempt may wait for what is left of the call's 7 s, no longer.
    assert 6 < timeout <= 7


def test_absent_token_header_grants_the_physics_maximum(serve: Serve) -> None:
    provider = DoubleProvider()
    model = serve(provider, Physics(max_output_tokens=444))

    status, _, _ = request(model)

    assert status == 200
    assert provider.asked[0][1] == 444
    assert model.calls[0].requested_output_tokens == 444


def test_successful_call_is_charged_its_usage_and_audited_in_full(serve: Serve) -> None:
    model = serve(DoubleProvider(usage=(100, 20)), Physics(max_output_tokens=50))
    prompt = "prompt ✓".encode()

    request(model, prompt, {"X-Ouroboros-Max-Output-Tokens": "30"})

    reserved = PRICES.cost_usd(len(prompt) + FRAMING_TOKENS, 30)
    cost = PRICES.cost_usd(100, 20)
    [call] = model.calls
    assert call.index == 1
    assert call.status == 200
    assert call.prompt == "prompt ✓"
    assert call.prompt_sha256 == hashlib.sha256(prompt).hexdigest()
    assert call.response == "the answer ✓"
    assert call.response_sha256 == hashlib.sha256("the answer ✓".encode()).hexdigest()
    assert (call.requested_output_tokens, call.input_tokens, call.output_tokens) == (30, 100, 20)
    assert (call.reserved_usd, call.cost_usd) == (reserved, cost)
    assert call.error is None
    assert call.duration_seconds >= 0
    assert call.started_at.tzinfo is not None
    assert model.spent_usd == cost


def test_reported_usage_beyond_the_reservation_is_charged_only_the_reservation(
    serve: Serve,
) -> None:
    model = serve(DoubleProvider(usage=(10_000_000, 10_000_000)), Physics(budget_usd=50))

    request(model, b"p", {"X-Ouroboros-Max-Output-Tokens": "10"})

    [call] = model.calls
    assert call.cost_usd == call.reserved_usd == PRICES.cost_usd(1 + FRAMING_TOKENS, 10)
    assert model.spent_usd == call.reserved_usd


@pytest.mark.parametrize(
    "value", ["0", "-5", "abc", "1.5", "", "601", "99999999999999", "٣".encode()]
)
def test_invalid_token_header_is_400_and_the_model_is_not_called(
    serve: Serve, value: str | bytes
) -> None:
    provider = DoubleProvider()
    model = serve(provider, Physics(max_output_tokens=600))

    status, text, _ = request(model, b"p", {"X-Ouroboros-Max-Output-Tokens": value})

    assert status == 400
    assert "X-Ouroboros-Max-Output-Tokens must be one integer from 1 to 600" in text
    assert provider.asked == []
    [call] = model.calls
    assert (call.status, call.prompt, call.requested_output_tokens) == (400, "p", None)
    assert call.cost_usd == call.reserved_usd == 0
    assert model.spent_usd == 0


def test_repeated_token_header_is_400(serve: Serve) -> None:
    model = serve(DoubleProvider())
    head = (
        b"POST /generate HTTP/1.1\r\nHost: kernel\r\nContent-Length: 1\r\n"
        b"X-Ouroboros-Max-Output-Tokens: 5\r\nX-Ouroboros-Max-Output-Tokens: 6\r\n\r\n"
    )

    answer = raw_request(model, head, b"p")

    assert answer.startswith(b"HTTP/1.1 400 ")


def test_non_utf8_prompt_is_400_and_audited_with_the_raw_bytes_hash(serve: Serve) -> None:
    provider = DoubleProvider()
    model = serve(provider)
    body = b"caf\xe9 \xff"

    status, text, _ = request(model, body)

    assert (status, text) == (400, "the prompt is not valid UTF-8\n")
    assert provider.asked == []
    [call] = model.calls
    assert call.prompt_sha256 == hashlib.sha256(body).hexdigest()
    assert call.prompt == body.decode("utf-8", errors="replace")
    assert call.error == "the prompt is not valid UTF-8"


def test_empty_prompt_is_400(serve: Serve) -> None:
    provider = DoubleProvider()
    model = serve(provider)

    status, text, _ = request(model, b"")

    assert (status, text) == (400, "the prompt is empty\n")
    assert provider.asked == []


def test_prompt_over_the_limit_is_400_without_keeping_it(serve: Serve) -> None:
    provider = DoubleProvider()
    model = serve(provider, Physics(max_prompt_bytes=64))

    at_limit, _, _ = request(model, b"x" * 64)
    status, text, _ = request(model, b"x" * 65)

    assert at_limit == 200
    assert (status, text) == (400, "the prompt is over max_prompt_bytes (64 bytes)\n")
    assert len(provider.asked) == 1
    assert [call.status for call in model.calls] == [200]


def test_content_length_is_not_trusted_beyond_the_limit(serve: Serve) -> None:
    model = serve(DoubleProvider(), Physics(max_prompt_bytes=64))
    head = b"POST /generate HTTP/1.1\r\nHost: kernel\r\nContent-Length: 99999999999\r\n\r\n"

    started = time.monotonic()
    answer = raw_request(model, head, b"short")

    assert answer.startswith(b"HTTP/1.1 400 ")
    assert answer.endswith(b"the prompt is over max_prompt_bytes (64 bytes)\n")
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    "head",
    [
        b"POST /generate HTTP/1.1\r\nHost: kernel\r\n\r\n",
        b"POST /generate HTTP/1.1\r\nHost: kernel\r\nContent-Length: 0x10\r\n\r\n",
        b"POST /generate HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n",
        b"POST /generate HTTP/1.1\r\nHost: k\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n",
        b"POST /generate HTTP/1.1\r\nHost: kernel\r\nTransfer-Encoding: chunked\r\n\r\n",
    ],
)
def test_missing_or_ambiguous_content_length_is_400(serve: Serve, head: bytes) -> None:
    provider = DoubleProvider()
    model = serve(provider)

    answer = raw_request(model, head, b"2\r\nhi\r\n0\r\n\r\n")

    assert answer.startswith(b"HTTP/1.1 400 ")
    assert provider.asked == []
    assert model.calls == []


def test_http11_request_without_host_is_400_naming_the_header(serve: Serve) -> None:
    provider = DoubleProvider()
    model = serve(provider)

    answer = raw_request(model, b"POST /generate HTTP/1.1\r\nContent-Length: 1\r\n\r\n", b"p")

    assert answer.startswith(b"HTTP/1.1 400 ")
    assert b"Host" in answer.split(b"\r\n\r\n", 1)[1]
    assert provider.asked == []
    assert model.calls == []


def test_body_shorter_than_its_content_length_is_400(serve: Serve) -> None:
    model = serve(DoubleProvider())

    head = b"POST /generate HTTP/1.1\r\nHost: kernel\r\nContent-Length: 10\r\n\r\n"

    answer = raw_request(model, head, b"abc")

    assert answer.startswith(b"HTTP/1.1 400 ")
    assert answer.endswith(b"the body ended before Content-Length bytes arrived\n")


def test_unknown_path_is_404_and_wrong_method_is_405(serve: Serve) -> None:
    model = serve(DoubleProvider())

    not_found, _, _ = request(model, path="/v1/messages")
    wrong_method, _, response = request(model, method="GET", body=b"")

    assert not_found == 404
    assert wrong_method == 405
    assert response.getheader("Allow") == "POST"
    assert model.calls == []


def test_call_that_cannot_fit_the_budget_is_402_and_never_reaches_the_model(
    serve: Serve,
) -> None:
    provider = DoubleProvider()
    model = serve(provider, Physics(budget_usd=Decimal("0.000100")))

    status, text, _ = request(model, b"p", {"X-Ouroboros-Max-Output-Tokens": "1"})

    assert status == 402
    assert text.startswith("budget exhausted")
    assert provider.asked == []
    [call] = model.calls
    assert call.status == 402
    assert call.reserved_usd == call.cost_usd == 0
    assert "exceeds the remaining USD 0.000100" in (call.error or "")
    assert model.spent_usd == 0


def test_budget_spent_by_earlier_calls_makes_a_later_one_402(serve: Serve) -> None:
    # Worst cases: 100 output tokens USD 0.009194, 1 token USD 0.008204. The first call
    # is charged USD 0.009, leaving 0.0085: room for the small call, not the large one.
    model = serve(DoubleProvider(usage=(4000, 100)), Physics(budget_usd=Decimal("0.0175")))

    first, _, _ = request(model, b"p", {"X-Ouroboros-Max-Output-Tokens": "100"})
    second, _, _ = request(model, b"p", {"X-Ouroboros-Max-Output-Tokens": "100"})
    smaller, _, _ = request(model, b"p", {"X-Ouroboros-Max-Output-Tokens": "1"})

    assert (first, second, smaller) == (200, 402, 200)
    assert model.spent_usd == sum((c.cost_usd for c in model.calls), Decimal(0))
    assert model.spent_usd <= model.physics.budget_usd


def test_model_refusal_is_502_and_fully_refunded(serve: Serve) -> None:
    model = serve(DoubleProvider(error=ProviderUnavailable("double answered HTTP 529")))

    status, text, _ = request(model)

    assert (status, text) == (502, "model unavailable\n")
    [call] = model.calls
    assert call.status == 502
    assert call.reserved_usd > 0
    assert call.cost_usd == 0
    assert call.response is None
    assert call.error == "double answered HTTP 529"
    assert model.spent_usd == 0


def test_answer_lost_after_the_model_got_the_request_is_502_and_keeps_the_reservation(
    serve: Serve,
) -> None:
    failure = ProviderUnavailable("double connection lost", may_have_billed=True)
    model = serve(DoubleProvider(error=failure))

    status, _, _ = request(model)

    [call] = model.calls
    assert status == 502
    assert call.cost_usd == call.reserved_usd > 0
    assert model.spent_usd == call.reserved_usd


def test_model_silent_past_the_request_timeout_is_502(serve: Serve) -> None:
    model = serve(DoubleProvider(delay_seconds=3), Physics(model_timeout_seconds=1))

    started = time.monotonic()
    status, text, _ = request(model)

    assert (status, text) == (502, "model unavailable\n")
    assert time.monotonic() - started < 2.5
    [call] = model.calls
    assert call.error == "no answer within 1 s"
    assert call.cost_usd == call.reserved_usd


def test_call_still_waiting_when_the_generation_ends_is_recorded_and_keeps_its_reservation(
    tmp_path: Path,
) -> None:
    provider = DoubleProvider(delay_seconds=1)
    model = ModelSocket(tmp_path / "model.sock", provider, Physics(), CONTEXT)
    statuses: list[int] = []
    with model:
        caller = threading.Thread(target=lambda: statuses.append(request(model)[0]))
        caller.start()
        while not provider.asked:
            time.sleep(0.01)
        started = time.monotonic()
    assert time.monotonic() - started < 0.5  # exit does not wait for the model

    [call] = model.calls
    assert call.status == 502
    assert call.error == "the generation ended before the model answered"
    assert call.cost_usd == call.reserved_usd > 0
    assert model.spent_usd == call.reserved_usd
    provider.answered.wait(5)
    caller.join(5)
    assert statuses == [502]
    assert len(model.calls) == 1
    assert model.spent_usd == call.reserved_usd


def test_provider_bug_is_502_not_a_dead_socket(serve: Serve) -> None:
    model = serve(DoubleProvider(error=KeyError("usage")))

    status, _, _ = request(model)
    again, _, _ = request(model)

    assert (status, again) == (502, 502)
    assert model.calls[0].error == "double failed: KeyError"


def test_answers_to_the_organism_never_name_provider_model_or_cost(serve: Serve) -> None:
    model = serve(DoubleProvider(error=ProviderUnavailable("double-model at http://x failed")))

    texts = [
        request(model)[1],
        request(model, b"\xff")[1],
        request(model, headers={"X-Ouroboros-Max-Output-Tokens": "0"})[1],
    ]

    for text in texts:
        assert "double" not in text and "http" not in text and "USD" not in text


def test_lone_surrogates_from_a_vendor_are_repaired_for_socket_and_record(serve: Serve) -> None:
    model = serve(DoubleProvider(text="ok \ud800 end"))

    status, text, _ = request(model)

    assert (status, text) == (200, "ok ? end")
    assert model.calls[0].response == "ok ? end"
    model.calls[0].model_dump_json()


def test_concurrent_calls_are_each_audited_once_and_charged_exactly(serve: Serve) -> None:
    model = serve(DoubleProvider(delay_seconds=0.05), Physics(budget_usd=Decimal("0.4")))
    statuses: list[int] = []

    def call(number: int) -> None:
        statuses.append(request(model, f"prompt {number}".encode())[0])

    # As many callers as the socket serves at once; one more would get the 503 refusal.
    threads = [threading.Thread(target=call, args=(n,)) for n in range(MAX_CONNECTIONS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    calls = model.calls
    assert sorted(statuses) == sorted(c.status for c in calls)
    assert [c.index for c in calls] == list(range(1, MAX_CONNECTIONS + 1))
    assert {c.prompt for c in calls} == {f"prompt {n}" for n in range(MAX_CONNECTIONS)}
    # USD 0.4 holds 3 worst cases of 0.128 at a time: overlapping calls beyond that get 402.
    assert set(statuses) <= {200, 402}
    assert statuses.count(200) >= 3
    assert model.spent_usd == sum((c.cost_usd for c in calls), Decimal(0))
    assert model.spent_usd <= Decimal("0.4")


def test_socket_is_private_to_the_worker_uid_and_removed_at_exit(tmp_path: Path) -> None:
    path = tmp_path / "model.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()

    with ModelSocket(path, DoubleProvider(), Physics(), CONTEXT) as model:
        assert stat.S_ISSOCK(path.stat().st_mode)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert request(model)[0] == 200

    assert not path.exists()


@pytest.mark.root
def test_socket_handed_to_the_sandbox_uid_stays_private_to_it(tmp_path: Path) -> None:
    path = tmp_path / "model.sock"

    with ModelSocket(path, DoubleProvider(), Physics(), CONTEXT, owner=(65534, 65533)) as model:
        status = path.stat()
        assert (status.st_uid, status.st_gid) == (65534, 65533)
        assert stat.S_IMODE(status.st_mode) == 0o600
        assert request(model)[0] == 200

    assert not path.exists()


def test_scripted_provider_through_the_socket_answers_the_marked_source(serve: Serve) -> None:
    model = serve(make_provider("scripted", None, Settings()))

    status, text, _ = request(model, b"rewrite yourself")

    assert status == 200
    assert text == "(setq organism-ok t)\n;; scripted stand-in edit: generation 2\n"
    assert model.spent_usd == model.calls[0].cost_usd > 0


def test_capabilities_disclose_the_abi_and_physics_but_no_provider_model_price_or_key() -> None:
    physics = Physics(max_prompt_bytes=1234, max_output_tokens=567, budget_usd=Decimal("0.25"))

    manifest = capabilities(physics)
    text = json.dumps(manifest)

    generate = manifest["operations"]["generate"]
    assert (generate["socket"], generate["method"], generate["path"]) == (
        "/kernel/model.sock",
        "POST",
        "/generate",
    )
    assert "X-Ouroboros-Max-Output-Tokens" in generate["request"]["headers"]
    assert set(generate["responses"]) == {"200", "400", "402", "429", "502"}
    assert manifest["constraints"]["max_prompt_bytes"] == 1234
    assert manifest["constraints"]["max_output_tokens"] == 567
    assert manifest["constraints"]["budget_usd"] == "0.25"
    assert manifest["constraints"]["syscall_filter"]["digest"] == syscall_filter.DIGEST
    forbidden = {"anthropic", "openai", "scripted", "claude", "gpt", "http://", "https://"}
    forbidden |= {"api_key", "usd_per_mtok", "double-model"}
    forbidden |= {model for table in BUILTIN_PRICES.values() for model in table}
    for word in forbidden:
        assert word not in text.lower(), word


# --- how the model stopped ---------------------------------------------------------------


@pytest.mark.parametrize("stop", STOP_REASONS)
def test_every_answer_says_how_the_model_stopped_in_a_header_and_in_the_record(
    serve: Serve, stop: StopReason
) -> None:
    model = serve(DoubleProvider(stop_reason=stop))

    status, text, response = request(model)

    assert (status, text) == (200, "the answer ✓")
    assert response.getheader("X-Ouroboros-Stop-Reason") == stop
    assert model.calls[0].stop_reason == stop


def test_a_failed_call_has_no_stop_reason(serve: Serve) -> None:
    model = serve(DoubleProvider(error=ProviderUnavailable("double answered HTTP 400")))

    status, _, response = request(model)

    assert status == 502
    assert response.getheader("X-Ouroboros-Stop-Reason") is None
    assert model.calls[0].stop_reason is None


def test_capabilities_document_the_stop_reason_header_and_each_value() -> None:
    generate = capabilities(Physics())["operations"]["generate"]

    header = generate["response_headers"]["X-Ouroboros-Stop-Reason"]

    assert "X-Ouroboros-Stop-Reason" in generate["responses"]["200"]
    assert tuple(header["values"]) == STOP_REASONS
    assert "complete" in header["advice"]
    assert "tried again" in generate["retries"]


# --- retries -----------------------------------------------------------------------------


def passing(
    status: int | None = None, *, retry_after: float | None = None, billed: bool = False
) -> ProviderUnavailable:
    """A failure the vendor calls passing: an HTTP status, else a lost connection."""
    reason = f"double answered HTTP {status}" if status else "double connection lost"
    return ProviderUnavailable(
        reason, may_have_billed=billed, retryable=True, retry_after=retry_after, status=status
    )


@pytest.mark.parametrize(
    "failure",
    [
        passing(429, retry_after=0.05),
        passing(429),
        passing(408),
        passing(409),
        passing(500),
        passing(503),
        passing(529),
        passing(),
        passing(billed=True),
    ],
    ids=["429-retry-after", "429", "408", "409", "500", "503", "529", "refused", "reset"],
)
def test_a_passing_failure_is_tried_again_and_the_organism_gets_the_answer(
    serve: Serve, failure: ProviderUnavailable
) -> None:
    provider = DoubleProvider(failures=[failure])
    model = serve(provider)

    status, text, _ = request(model)

    assert (status, text) == (200, "the answer ✓")
    assert len(provider.asked) == 2
    [call] = model.calls
    first, second = call.attempts
    assert (first.number, first.outcome, first.error) == (1, "failed", str(failure))
    assert first.vendor_status == failure.status
    assert first.backoff_seconds is not None and first.backoff_seconds > 0
    assert first.may_have_billed == failure.may_have_billed
    assert (second.number, second.outcome, second.backoff_seconds) == (2, "answered", None)
    assert second.vendor_status == 200
    assert call.error is None and call.stop_reason == "complete"


def test_backoff_doubles_up_to_its_cap_drawn_from_the_upper_half_unless_the_vendor_asks() -> None:
    policy = RetryPolicy(first_backoff_seconds=1, max_backoff_seconds=30)
    rng = random.Random(7)

    for attempt, ceiling in [(1, 1), (2, 2), (3, 4), (5, 16), (6, 30), (9, 30)]:
        waits = [policy.backoff_seconds(attempt, None, rng) for _ in range(50)]
        assert all(ceiling / 2 <= wait <= ceiling for wait in waits)
        assert len(set(waits)) > 1
    assert policy.backoff_seconds(3, 0.25, rng) == 0.25


def test_the_wait_before_the_next_attempt_is_what_the_vendor_asked_for(serve: Serve) -> None:
    model = serve(DoubleProvider(failures=[passing(429, retry_after=0.3)]))

    started = time.monotonic()
    status, _, _ = request(model)

    assert status == 200
    assert time.monotonic() - started >= 0.3
    first = model.calls[0].attempts[0]
    assert first.retry_after_seconds == first.backoff_seconds == 0.3


def test_a_failure_that_is_not_passing_is_not_tried_again(serve: Serve) -> None:
    provider = DoubleProvider(error=ProviderUnavailable("double answered HTTP 401", status=401))
    model = serve(provider)

    assert request(model)[0] == 502

    assert len(provider.asked) == 1
    [attempt] = model.calls[0].attempts
    assert (attempt.vendor_status, attempt.backoff_seconds) == (401, None)


def test_attempts_stop_at_the_policy_maximum_and_failed_ones_cost_nothing(serve: Serve) -> None:
    provider = DoubleProvider(error=passing(529))
    model = serve(provider, retry=RetryPolicy(max_attempts=3, first_backoff_seconds=0.01))

    status, text, _ = request(model, b"p", {"X-Ouroboros-Max-Output-Tokens": "30"})

    assert (status, text) == (502, "model unavailable\n")
    assert len(provider.asked) == 3
    [call] = model.calls
    assert [a.vendor_status for a in call.attempts] == [529, 529, 529]
    assert [a.backoff_seconds is None for a in call.attempts] == [False, False, True]
    assert call.error == "double answered HTTP 529"
    # One reservation held across the attempts, refunded whole at the end.
    assert call.reserved_usd == PRICES.cost_usd(1 + FRAMING_TOKENS, 30)
    assert call.cost_usd == model.spent_usd == 0
    assert all(a.cost_usd == 0 for a in call.attempts)


def test_a_vendor_asking_for_a_wait_past_the_deadline_ends_the_call_at_once(
    serve: Serve,
) -> None:
    provider = DoubleProvider(error=passing(429, retry_after=30))
    model = serve(provider, Physics(model_timeout_seconds=10))

    started = time.monotonic()
    status, _, _ = request(model)

    assert status == 502
    assert time.monotonic() - started < 5
    assert len(provider.asked) == 1
    assert model.calls[0].attempts[0].backoff_seconds is None


def test_retries_never_run_past_the_call_deadline(serve: Serve) -> None:
    provider = DoubleProvider(error=passing(503), delay_seconds=0.3)
    model = serve(provider, Physics(model_timeout_seconds=1))

    started = time.monotonic()
    status, _, _ = request(model)

    assert status == 502
    assert time.monotonic() - started < 2.5
    [call] = model.calls
    assert 2 <= len(call.attempts) <= 4
    assert call.attempts[-1].backoff_seconds is None


def test_an_attempt_the_vendor_may_have_billed_keeps_its_reservation_and_the_retry_reserves_anew(
    serve: Serve,
) -> None:
    provider = DoubleProvider(failures=[passing(billed=True)], usage=(100, 20))
    model = serve(provider, Physics(max_output_tokens=50))

    status, _, _ = request(model, b"p", {"X-Ouroboros-Max-Output-Tokens": "30"})

    worst, used = PRICES.cost_usd(1 + FRAMING_TOKENS, 30), PRICES.cost_usd(100, 20)
    assert status == 200
    [call] = model.calls
    assert [a.cost_usd for a in call.attempts] == [worst, used]
    assert call.attempts[0].may_have_billed
    assert call.reserved_usd == 2 * worst
    assert call.cost_usd == worst + used == model.spent_usd


def test_no_retry_after_a_possibly_billed_attempt_when_the_budget_cannot_cover_another(
    serve: Serve,
) -> None:
    worst = PRICES.cost_usd(1 + FRAMING_TOKENS, 30)
    provider = DoubleProvider(failures=[passing(billed=True)])
    model = serve(provider, Physics(budget_usd=worst * 3 / 2))

    status, _, _ = request(model, b"p", {"X-Ouroboros-Max-Output-Tokens": "30"})

    assert status == 502
    assert len(provider.asked) == 1
    [call] = model.calls
    assert call.cost_usd == call.reserved_usd == worst == model.spent_usd
    assert "cannot cover another attempt" in (call.error or "")
    assert call.attempts[0].backoff_seconds is None


def test_an_answer_without_usage_is_kept_and_charged_its_whole_reservation(serve: Serve) -> None:
    model = serve(DoubleProvider(usage=None))

    status, text, _ = request(model, b"p", {"X-Ouroboros-Max-Output-Tokens": "30"})

    assert (status, text) == (200, "the answer ✓")
    [call] = model.calls
    assert call.usage_reported is False
    assert (call.input_tokens, call.output_tokens) == (0, 0)
    assert call.cost_usd == call.reserved_usd == PRICES.cost_usd(1 + FRAMING_TOKENS, 30)
    assert model.spent_usd == call.cost_usd


# --- the cap on calls to a provider ---------------------------------------------------------


def test_waiting_for_the_cap_is_recorded_on_the_attempt(serve: Serve) -> None:
    provider = DoubleProvider(delay_seconds=0.5)
    model = serve(provider, throttle=LocalThrottle(Cap(concurrent_calls=1)))

    callers = [threading.Thread(target=request, args=(model,)) for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()

    assert [c.status for c in model.calls] == [200, 200]
    waits = sorted(c.attempts[0].cap_wait_seconds for c in model.calls)
    assert waits[0] < 0.3 <= waits[1]


def test_a_call_that_finds_no_room_under_the_cap_before_its_deadline_is_502_and_free(
    serve: Serve,
) -> None:
    provider = DoubleProvider()
    model = serve(
        provider,
        Physics(model_timeout_seconds=1),
        throttle=LocalThrottle(Cap(requests_per_minute=1)),
    )

    first, _, _ = request(model)
    second, text, _ = request(model)

    assert (first, second, text) == (200, 502, "model unavailable\n")
    assert len(provider.asked) == 1
    call = model.calls[1]
    [attempt] = call.attempts
    assert attempt.outcome == "no_slot"
    assert attempt.cap_wait_seconds >= 0.5
    assert attempt.request_seconds == 0
    assert "no room under the fleet's cap" in (call.error or "")
    assert call.cost_usd == 0


def test_the_offline_stand_in_is_never_capped(serve: Serve) -> None:
    model = serve(
        make_provider("scripted", None, Settings()),
        Physics(model_timeout_seconds=1),
        throttle=LocalThrottle(Cap(requests_per_minute=1)),
    )

    assert [request(model)[0] for _ in range(3)] == [200, 200, 200]


def test_a_call_waiting_for_the_cap_when_the_life_ends_is_recorded_and_refunded(
    tmp_path: Path,
) -> None:
    model = ModelSocket(
        tmp_path / "model.sock",
        DoubleProvider(),
        Physics(),
        CONTEXT,
        throttle=LocalThrottle(Cap(requests_per_minute=1)),
    )
    with model:
        assert request(model)[0] == 200
        caller = threading.Thread(target=request, args=(model,))
        caller.start()
        time.sleep(0.5)
    caller.join(10)

    [_, waiting] = model.calls
    assert waiting.status == 502
    assert waiting.error == "the generation ended before the model answered"
    assert waiting.cost_usd == 0
    [attempt] = waiting.attempts
    assert (attempt.outcome, attempt.may_have_billed) == ("abandoned", False)
    # It waited for the cap from its arrival until the life ended, and says so.
    assert attempt.cap_wait_seconds >= 0.4


def test_a_call_the_cap_left_too_little_time_is_no_failure_of_the_vendor(
    tmp_path: Path,
) -> None:
    """One call at a time, each answered in 1.5 s, within a call's 2 s: the second call
    waits for the cap until the first is answered and reaches the vendor with about 0.5 s
    left, too little. Its cut is recorded (may have billed), but it is not the vendor's
    failure: another lineage's calls must not pause this one as "unavailable". A call the
    vendor itself left unanswered for its whole time still is."""
    model = ModelSocket(
        tmp_path / "model.sock",
        DoubleProvider(delay_seconds=1.5),
        Physics(model_timeout_seconds=2),
        CONTEXT,
        throttle=LocalThrottle(Cap(concurrent_calls=1)),
    )
    with model:
        first = threading.Thread(target=request, args=(model,))
        first.start()
        time.sleep(0.3)
        status, _, _ = request(model)
        first.join(10)

    assert status == 502
    [answered, starved] = model.calls
    assert answered.status == 200
    [attempt] = starved.attempts
    assert (attempt.outcome, attempt.may_have_billed) == ("abandoned", True)
    assert attempt.cap_wait_seconds >= 0.9
    assert "waiting for the fleet's cap" in str(attempt.error)
    assert model.model_failure is None

    alone = ModelSocket(
        tmp_path / "alone.sock",
        DoubleProvider(delay_seconds=3),
        Physics(model_timeout_seconds=2),
        CONTEXT,
        throttle=LocalThrottle(Cap(concurrent_calls=1)),
    )
    with alone:
        assert request(alone)[0] == 502
    failure = alone.model_failure
    assert failure is not None and failure.kind == "unavailable"


# --- the organism's side of the ABI, in Emacs Lisp ---------------------------------------

ELISP_CLIENT = r"""
(define-error 'organism-model-error "Model syscall failed")

(defvar organism-model-socket "/kernel/model.sock"
  "The kernel's model socket, as /kernel/capabilities.json names it.")

(defun organism--generate (prompt max-tokens)
  "Ask the kernel's model to answer PROMPT in at most MAX-TOKENS tokens.
Return the answer as a string.  On any status but 200 signal
`organism-model-error' with data (STATUS REASON)."
  (let ((body (encode-coding-string prompt 'utf-8 t))
        (buffer (generate-new-buffer " *organism-model*"))
        (process nil))
    (unwind-protect
        (progn
          (with-current-buffer buffer (set-buffer-multibyte nil))
          ;; :sentinel #'ignore, or Emacs appends "Process ... connection broken
          ;; by remote peer" to the answer when the kernel closes the socket.
          (setq process (make-network-process
                         :name "organism-model" :family 'local
                         :service organism-model-socket
                         :buffer buffer :coding 'binary :noquery t
                         :sentinel #'ignore))
          (process-send-string
           process
           (format (concat "POST /generate HTTP/1.1\r\nHost: kernel\r\n"
                           "Content-Type: text/plain; charset=utf-8\r\n"
                           "Content-Length: %d\r\n"
                           "X-Ouroboros-Max-Output-Tokens: %d\r\n"
                           "Connection: close\r\n\r\n")
                   (length body) max-tokens))
          (process-send-string process body)
          (while (process-live-p process)
            (accept-process-output process 1))
          (with-current-buffer buffer
            (goto-char (point-min))
            (unless (looking-at "HTTP/1\\.[01] \\([0-9][0-9][0-9]\\)")
              (signal 'organism-model-error (list 0 "malformed answer")))
            (let ((status (string-to-number (match-string 1))))
              (unless (search-forward "\r\n\r\n" nil t)
                (signal 'organism-model-error (list status "malformed answer")))
              (let ((text (decode-coding-string
                           (buffer-substring-no-properties (point) (point-max))
                           'utf-8 t)))
                (if (= status 200)
                    text
                  (signal 'organism-model-error
                          (list status (string-trim-right text))))))))
      (when process (delete-process process))
      (kill-buffer buffer))))
"""


def run_elisp_client(
    model: ModelSocket, tmp_path: Path, prompt_form: str, max_tokens: int
) -> tuple[str, str]:
    """Load the client in emacs -Q --batch, call it, return (answer file text, stdout)."""
    client = tmp_path / "client.el"
    client.write_text(ELISP_CLIENT, encoding="utf-8")
    answer = tmp_path / "answer.txt"
    program = f"""
      (progn
        (setq organism-model-socket {json.dumps(str(model.socket_path))})
        (condition-case err
            (let ((coding-system-for-write 'utf-8))
              (write-region (organism--generate {prompt_form} {max_tokens})
                            nil {json.dumps(str(answer))}))
          (organism-model-error (princ (format "%S" (cdr err))))))
    """
    done = subprocess.run(
        ["emacs", "-Q", "--batch", "-l", str(client), "--eval", program],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return (answer.read_text(encoding="utf-8") if answer.exists() else ""), done.stdout


@pytest.mark.full
def test_emacs_lisp_organism_gets_the_model_answer_through_the_socket(
    serve: Serve, tmp_path: Path
) -> None:
    provider = DoubleProvider(text='(setq next-body "é ✓")\n')
    model = serve(provider)

    answer, printed = run_elisp_client(model, tmp_path, '"réécris-toi ✓"', 77)

    assert printed == ""
    assert answer == '(setq next-body "é ✓")\n'
    assert provider.asked[0][:2] == ("réécris-toi ✓", 77)


@pytest.mark.full
def test_emacs_lisp_organism_sees_error_status_and_reason(serve: Serve, tmp_path: Path) -> None:
    model = serve(DoubleProvider(), Physics(max_prompt_bytes=1000, budget_usd=Decimal(0)))

    _, budget = run_elisp_client(model, tmp_path, '"hi"', 5)
    _, too_big = run_elisp_client(model, tmp_path, "(make-string 300000 ?é)", 5)

    assert budget.startswith('(402 "budget exhausted')
    assert too_big == '(400 "the prompt is over max_prompt_bytes (1000 bytes)")'
