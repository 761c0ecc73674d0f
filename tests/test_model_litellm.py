"""The providers against a real server nobody here wrote: LiteLLM's proxy, offline.

The session starts ``litellm --config <tmp> --port <free>`` on 127.0.0.1 with models
whose ``mock_response`` answers without any vendor: the proxy serves the Anthropic
Messages API (``/v1/messages``), the OpenAI Responses API (``/v1/responses``) and
Chat Completions (``/v1/chat/completions``), and the error shapes its mocks produce
(429 in the OpenAI and the Anthropic shape, 500, a reply cut at the limit without
usage, a filtered one). Its cost map is the local copy and its telemetry is off, so
nothing leaves the machine. What LiteLLM cannot produce (a 429 with retry-after,
529, resets, stalls) is served by the local stand-in of ``support.vendor``.

The proxy's master key is the provider key here: the tests check it never reaches a
log, an error, an audit record or an answer to the organism.
"""

from __future__ import annotations

import json
import logging
import socket
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from support.fleet import SMALL_PHYSICS, Fleet
from support.litellm import KEY

from worker.fleet.settings import Settings
from worker.instrument.model.ledger import FRAMING_TOKENS
from worker.instrument.model.prices import Prices
from worker.instrument.model.providers import GenerationContext, ProviderUnavailable, make_provider
from worker.instrument.model.retry import RetryPolicy
from worker.instrument.model.server import ModelSocket
from worker.instrument.physics import Physics

# Full tier: LiteLLM's proxy runs as a process of its own.
pytestmark = pytest.mark.full

KEY_VARIABLES = ("ANTHROPIC_API_KEY", "OPENAI_API_KEY", "OPENAI_COMPATIBLE_API_KEY")
CONTEXT = GenerationContext(lineage="peer", generation=1, organism_source='(message "hi")\n')
PRICES = {"model_input_usd_per_mtok": 3, "model_output_usd_per_mtok": 15}


@pytest.fixture(autouse=True)
def keys(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in KEY_VARIABLES:
        monkeypatch.setenv(variable, KEY)
        monkeypatch.delenv(f"{variable}_FILE", raising=False)
    for variable in ("CREDENTIALS_DIRECTORY", "OUROBOROS_CONFIG"):
        monkeypatch.delenv(variable, raising=False)


def peer_settings(litellm_url: str, provider: str, model: str, **values: Any) -> Settings:
    """Every provider pointed at the proxy; the explicit prices are those of ``model``."""
    return Settings(
        anthropic_base_url=litellm_url,
        openai_base_url=f"{litellm_url}/v1",
        openai_compatible_base_url=litellm_url,
        model_provider=provider,
        model_name=model,
        **PRICES,
        **values,
    )


def ask(socket_path: Path, prompt: bytes = b"rewrite yourself", tokens: int = 100) -> bytes:
    """POST /generate as an organism does; the whole raw answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(60)
        client.connect(str(socket_path))
        head = (
            "POST /generate HTTP/1.1\r\nHost: kernel\r\n"
            f"Content-Length: {len(prompt)}\r\n"
            f"X-Ouroboros-Max-Output-Tokens: {tokens}\r\n\r\n"
        )
        client.sendall(head.encode() + prompt)
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
        return answer


@pytest.mark.parametrize(
    ("provider", "model", "text"),
    [
        ("anthropic", "claude-mock", "(anthropic answer)"),
        ("openai", "gpt-mock", "(responses answer)"),
        ("openai-compatible", "chat-mock", "(chat answer)"),
    ],
)
def test_each_provider_is_answered_by_the_real_peer_with_exact_tokens_and_cost(
    litellm_url: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    provider: str,
    model: str,
    text: str,
) -> None:
    caplog.set_level(logging.DEBUG)
    chosen = make_provider(provider, model, peer_settings(litellm_url, provider, model))

    with ModelSocket(tmp_path / "model.sock", chosen, Physics(), CONTEXT) as model:
        answer = ask(model.socket_path)

    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"X-Ouroboros-Stop-Reason: complete" in head
    assert body.decode() == text
    [call] = model.calls
    assert (call.stop_reason, call.usage_reported) == ("complete", True)
    assert call.input_tokens > 0 and call.output_tokens > 0
    prices = Prices(input_usd_per_mtok=Decimal(3), output_usd_per_mtok=Decimal(15))
    assert call.cost_usd == prices.cost_usd(call.input_tokens, call.output_tokens)
    assert model.spent_usd == call.cost_usd <= call.reserved_usd
    assert KEY not in caplog.text and KEY.encode() not in answer
    assert KEY not in call.model_dump_json()


def test_a_chat_reply_cut_without_usage_says_max_tokens_and_is_charged_its_reservation(
    litellm_url: str, tmp_path: Path
) -> None:
    chosen = make_provider(
        "openai-compatible", "chat-cut", peer_settings(litellm_url, "openai-compatible", "chat-cut")
    )

    with ModelSocket(tmp_path / "model.sock", chosen, Physics(), CONTEXT) as model:
        answer = ask(model.socket_path, b"p", tokens=30)

    head, body = answer.split(b"\r\n\r\n", 1)
    assert b"X-Ouroboros-Stop-Reason: max_tokens" in head
    assert body == b"(defun cut"
    [call] = model.calls
    assert (call.stop_reason, call.usage_reported) == ("max_tokens", False)
    worst = Prices(input_usd_per_mtok=Decimal(3), output_usd_per_mtok=Decimal(15)).cost_usd(
        1 + FRAMING_TOKENS, 30
    )
    assert call.cost_usd == call.reserved_usd == worst


def test_a_filtered_chat_reply_says_refused(litellm_url: str) -> None:
    chosen = make_provider(
        "openai-compatible",
        "chat-filtered",
        peer_settings(litellm_url, "openai-compatible", "chat-filtered"),
    )

    reply = chosen.generate("p", 10, 30, CONTEXT)

    assert (reply.text, reply.stop_reason) == ("", "refused")


@pytest.mark.parametrize(
    ("provider", "model", "status", "kind"),
    [
        ("openai-compatible", "chat-rate-limited", 429, "throttling_error"),
        ("anthropic", "claude-rate-limited", 429, "rate_limit_error"),
        ("openai-compatible", "chat-broken", 500, "internal_server_error"),
    ],
)
def test_the_peers_passing_errors_are_tried_again_then_answered_502_and_cost_nothing(
    litellm_url: str, tmp_path: Path, provider: str, model: str, status: int, kind: str
) -> None:
    chosen = make_provider(provider, model, peer_settings(litellm_url, provider, model))
    retry = RetryPolicy(max_attempts=3, first_backoff_seconds=0.05)

    with ModelSocket(tmp_path / "model.sock", chosen, Physics(), CONTEXT, retry=retry) as model:
        answer = ask(model.socket_path)

    assert answer.startswith(b"HTTP/1.1 502 ")
    [call] = model.calls
    assert [a.vendor_status for a in call.attempts] == [status] * 3
    assert call.error == f"{provider} answered HTTP {status} ({kind})"
    assert call.cost_usd == model.spent_usd == 0
    assert KEY not in call.model_dump_json()


def test_a_wrong_key_is_refused_by_the_peer_not_tried_again_and_never_quoted(
    litellm_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-wrong-key-0123456789")
    chosen = make_provider("openai", "gpt-mock", peer_settings(litellm_url, "openai", "gpt-mock"))

    with pytest.raises(ProviderUnavailable) as failure:
        chosen.generate("p", 10, 30, CONTEXT)

    assert failure.value.status is not None and 400 <= failure.value.status < 500
    assert not failure.value.retryable
    assert "sk-wrong" not in str(failure.value)


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
def test_the_canonical_seed_keeps_its_body_when_the_peer_cuts_the_answer(
    litellm_url: str, tmp_path: Path
) -> None:
    fleet = Fleet(
        tmp_path,
        OUROBOROS_MODEL_PROVIDER="openai-compatible",
        OUROBOROS_MODEL_NAME="chat-cut",
        OUROBOROS_OPENAI_COMPATIBLE_BASE_URL=f"{litellm_url}/v1",
        OUROBOROS_MODEL_INPUT_USD_PER_MTOK="0",
        OUROBOROS_MODEL_OUTPUT_USD_PER_MTOK="0",
        OPENAI_COMPATIBLE_API_KEY=KEY,
    )
    fleet.ok("init", "peer", *SMALL_PHYSICS)
    seed = fleet.show("peer", "organism.el")

    fleet.ok("run", "peer", "--generations", "2", "--local")

    assert fleet.subjects("peer") == ["gen 2: no-change", "gen 1: no-change", "seed"]
    assert fleet.show("peer", "organism.el") == seed
    observation = fleet.observation("peer", 2)
    [call] = observation["model_calls"]
    assert (call["stop_reason"], call["usage_reported"]) == ("max_tokens", False)
    assert KEY not in json.dumps(observation)


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
def test_a_wrong_key_marks_the_generation_model_unavailable_with_a_refusal(
    litellm_url: str, tmp_path: Path
) -> None:
    fleet = Fleet(
        tmp_path,
        OUROBOROS_MODEL_PROVIDER="openai-compatible",
        OUROBOROS_MODEL_NAME="chat-mock",
        OUROBOROS_OPENAI_COMPATIBLE_BASE_URL=f"{litellm_url}/v1",
        OUROBOROS_MODEL_INPUT_USD_PER_MTOK="0",
        OUROBOROS_MODEL_OUTPUT_USD_PER_MTOK="0",
        OPENAI_COMPATIBLE_API_KEY="sk-wrong-key-0123456789",
    )
    fleet.ok("init", "peer", *SMALL_PHYSICS)

    fleet.ok("run", "peer", "--generations", "1", "--local")

    assert fleet.subjects("peer")[0] == "gen 1: no-change (model unavailable: 1 call failed)"
    failure = fleet.observation("peer", 1)["model_failure"]
    assert (failure["kind"], failure["failed_calls"], failure["answered_calls"]) == (
        "refused",
        1,
        0,
    )
    # A proxy without a key database answers a key it does not know 400 (no_db_connection).
    assert failure["reason"].startswith("openai-compatible answered HTTP 4")
    assert "sk-wrong" not in failure["reason"]
