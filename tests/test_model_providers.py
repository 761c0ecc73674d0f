"""Providers: request and response translation against local stand-ins of each vendor API,
the choice of provider with its refusals, keys and prices, and the scripted stand-in.

The stand-ins serve replies built with the vendors' own SDK types (``anthropic``,
``openai``), so the parsers are checked against the shapes the vendors document:
thinking blocks, several text blocks, refusals, replies cut at the token limit and
reasoning that spent the whole budget. ``test_model_litellm.py`` speaks to a real
server nobody here wrote.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from anthropic.types import Message as AnthropicMessage
from anthropic.types import TextBlock, ThinkingBlock
from anthropic.types import Usage as AnthropicUsage
from openai.types.chat import ChatCompletion, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice
from openai.types.completion_usage import CompletionUsage
from openai.types.responses import (
    ResponseOutputRefusal,
    ResponseReasoningItem,
)
from support.vendor import (
    Received,
    StandIn,
    message,
    openai_response,
    output_text,
    running_stand_in,
)

from worker.fleet.settings import Settings
from worker.instrument.errors import Refusal
from worker.instrument.model.prices import builtin_prices
from worker.instrument.model.providers import (
    AnthropicProvider,
    GenerationContext,
    ProviderUnavailable,
    ScriptedProvider,
    make_provider,
    scripted_body,
)
from worker.instrument.model.server import ModelSocket
from worker.instrument.physics import Physics

KEY = "sk-test-0123456789abcdef-SECRET"
CONTEXT = GenerationContext(lineage="demo", generation=3, organism_source='(message "hi")\n')
KEY_VARIABLES = ("ANTHROPIC_API_KEY", "OPENAI_API_KEY", "OPENAI_COMPATIBLE_API_KEY")


@pytest.fixture(autouse=True)
def no_ambient_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys, key files, credential directories and price settings of this host stay out."""
    for variable in KEY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
        monkeypatch.delenv(f"{variable}_FILE", raising=False)
    for variable in (
        "CREDENTIALS_DIRECTORY",
        "OUROBOROS_CONFIG",
        "OUROBOROS_MODEL_INPUT_USD_PER_MTOK",
        "OUROBOROS_MODEL_OUTPUT_USD_PER_MTOK",
        "OUROBOROS_OPENAI_COMPATIBLE_BASE_URL",
    ):
        monkeypatch.delenv(variable, raising=False)


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    with running_stand_in() as state:
        yield state


def settings(**values: Any) -> Settings:
    return Settings(**values)


def assert_key_only_in(received: Received, header: str, expected_value: str) -> None:
    assert received.headers[header] == expected_value
    assert KEY not in received.path
    assert KEY.encode() not in received.body
    for name, value in received.headers.items():
        if name.lower() != header.lower():
            assert KEY not in value, name


# --- replies in the vendors' own types (their SDKs' models) ---------------------------------


def thinking(text: str) -> ThinkingBlock:
    return ThinkingBlock(type="thinking", thinking=text, signature="sig")


def anthropic_message(
    content: list[Any], stop_reason: Any, *, usage: tuple[int, int]
) -> dict[str, Any]:
    return AnthropicMessage(
        id="msg_1",
        type="message",
        role="assistant",
        model="claude-sonnet-4-6",
        content=content,
        stop_reason=stop_reason,
        stop_sequence=None,
        usage=AnthropicUsage(input_tokens=usage[0], output_tokens=usage[1]),
    ).model_dump(mode="json")


def refusal(text: str) -> ResponseOutputRefusal:
    return ResponseOutputRefusal(type="refusal", refusal=text)


def reasoning() -> ResponseReasoningItem:
    return ResponseReasoningItem(id="rs_1", type="reasoning", summary=[])


def chat_completion(
    content: str | None,
    finish_reason: Any,
    *,
    usage: tuple[int, int] | None,
    refusal: str | None = None,
) -> dict[str, Any]:
    completion = ChatCompletion(
        id="chatcmpl-1",
        object="chat.completion",
        created=1_767_225_600,
        model="m",
        choices=[
            Choice(
                index=0,
                finish_reason=finish_reason,
                message=ChatCompletionMessage(role="assistant", content=content, refusal=refusal),
            )
        ],
    )
    if usage is not None:
        completion.usage = CompletionUsage(
            prompt_tokens=usage[0], completion_tokens=usage[1], total_tokens=sum(usage)
        )
    # Unset fields stay out, as the API leaves out usage when it has none to report.
    return completion.model_dump(mode="json", exclude_unset=True)


# --- anthropic ---------------------------------------------------------------------------


def test_anthropic_sends_a_messages_request_and_joins_the_text_blocks(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    stand_in.reply = anthropic_message(
        [
            thinking("hmm"),
            TextBlock(type="text", text="(next "),
            TextBlock(type="text", text="body)"),
        ],
        "end_turn",
        usage=(11, 7),
    )
    provider = make_provider(
        "anthropic", "claude-sonnet-4-6", settings(anthropic_base_url=stand_in.url)
    )

    reply = provider.generate("my prompt ✓", 321, 5, CONTEXT)

    assert (reply.text, reply.input_tokens, reply.output_tokens) == ("(next body)", 11, 7)
    assert reply.stop_reason == "complete"
    request = stand_in.only_request()
    assert request.path == "/v1/messages"
    assert request.headers["anthropic-version"] == "2023-06-01"
    assert request.headers["content-type"] == "application/json"
    assert request.json() == {
        "model": "claude-sonnet-4-6",
        "max_tokens": 321,
        "messages": [{"role": "user", "content": "my prompt ✓"}],
    }
    assert_key_only_in(request, "x-api-key", KEY)
    assert "Authorization" not in request.headers


def test_anthropic_refusal_without_text_blocks_is_an_empty_refused_answer(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    stand_in.reply = anthropic_message([], "refusal", usage=(5, 0))
    provider = make_provider("anthropic", None, settings(anthropic_base_url=stand_in.url))

    reply = provider.generate("p", 10, 5, CONTEXT)

    assert (reply.text, reply.input_tokens, reply.output_tokens) == ("", 5, 0)
    assert reply.stop_reason == "refused"
    assert stand_in.only_request().json()["model"] == "claude-opus-4-8"


@pytest.mark.parametrize(
    ("blocks", "vendor_stop", "text", "stop"),
    [
        (["(a ", "b)"], "end_turn", "(a b)", "complete"),
        (["(a ", "b)"], "stop_sequence", "(a b)", "complete"),
        (["(defun cut-he"], "max_tokens", "(defun cut-he", "max_tokens"),
        ([], "max_tokens", "", "incomplete"),
        (["part"], "pause_turn", "part", "incomplete"),
        (["part"], "model_context_window_exceeded", "part", "incomplete"),
        (["I will not"], "refusal", "I will not", "refused"),
        (["x"], None, "x", "incomplete"),
    ],
)
def test_anthropic_stop_reason_says_whether_the_answer_is_whole(
    stand_in: StandIn,
    monkeypatch: pytest.MonkeyPatch,
    blocks: list[str],
    vendor_stop: str | None,
    text: str,
    stop: str,
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    # Thinking first, as an extended-thinking model answers: the working is not the answer.
    content = [thinking("let me see"), *(TextBlock(type="text", text=b) for b in blocks)]
    stand_in.reply = anthropic_message(content, vendor_stop, usage=(9, 4))
    provider = make_provider("anthropic", None, settings(anthropic_base_url=stand_in.url))

    reply = provider.generate("p", 4, 5, CONTEXT)

    assert (reply.text, reply.stop_reason) == (text, stop)


def test_vendor_http_error_names_status_and_type_but_neither_key_nor_vendor_prose(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    stand_in.status = 401
    stand_in.reply = {
        "type": "error",
        "error": {"type": "authentication_error", "message": f"invalid x-api-key {KEY[:12]}***"},
    }
    provider = make_provider("anthropic", None, settings(anthropic_base_url=stand_in.url))

    with pytest.raises(ProviderUnavailable) as failure:
        provider.generate("p", 10, 5, CONTEXT)

    assert str(failure.value) == "anthropic answered HTTP 401 (authentication_error)"
    assert failure.value.may_have_billed is False
    assert failure.value.__cause__ is None and failure.value.__suppress_context__


@pytest.mark.full
def test_refused_connection_is_unavailable_and_cannot_have_billed(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    provider = make_provider("anthropic", None, settings(anthropic_base_url="http://127.0.0.1:9"))

    with pytest.raises(ProviderUnavailable, match="anthropic unreachable") as failure:
        provider.generate("p", 10, 5, CONTEXT)

    assert failure.value.may_have_billed is False


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        (b"<html>gateway</html>", "reply is not JSON"),
        ({"usage": {"input_tokens": 1, "output_tokens": 1}}, "lacks the expected fields"),
        ({"content": "x", "usage": {"input_tokens": 1, "output_tokens": 1}}, "at content"),
    ],
)
def test_malformed_success_reply_is_unavailable_and_may_have_billed(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, reply: object, reason: str
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    stand_in.reply = reply
    provider = make_provider("anthropic", None, settings(anthropic_base_url=stand_in.url))

    with pytest.raises(ProviderUnavailable, match=reason) as failure:
        provider.generate("p", 10, 5, CONTEXT)

    assert failure.value.may_have_billed is True


def test_vendor_silent_past_the_timeout_is_unavailable_and_may_have_billed(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    stand_in.delay_seconds = 1.5
    provider = make_provider("anthropic", None, settings(anthropic_base_url=stand_in.url))

    started = time.monotonic()
    with pytest.raises(ProviderUnavailable) as failure:
        provider.generate("p", 10, 0.3, CONTEXT)

    assert time.monotonic() - started < 1.4
    assert str(failure.value) == "anthropic stalled: nothing for 0.3 s after the request was sent"
    assert failure.value.may_have_billed is True
    assert failure.value.retryable is True


# --- openai ------------------------------------------------------------------------------


def test_openai_sends_a_responses_request_and_joins_the_output_text(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    stand_in.reply = openai_response(
        [reasoning(), message(output_text("hello "), refusal("no"), output_text("world"))],
        "completed",
        usage=(20, 30),
    )
    provider = make_provider("openai", "gpt-5.6", settings(openai_base_url=stand_in.url + "/"))

    reply = provider.generate("prompt", 1234, 5, CONTEXT)

    assert (reply.text, reply.input_tokens, reply.output_tokens) == ("hello world", 20, 30)
    assert reply.stop_reason == "complete"
    request = stand_in.only_request()
    assert request.path == "/v1/responses"
    assert request.headers["content-type"] == "application/json"
    # store false: the vendor would otherwise keep the prompt and answer for 30 days.
    assert request.json() == {
        "model": "gpt-5.6",
        "input": "prompt",
        "max_output_tokens": 1234,
        "store": False,
    }
    assert_key_only_in(request, "Authorization", f"Bearer {KEY}")


@pytest.mark.parametrize(
    ("output", "status", "reason", "text", "stop"),
    [
        (lambda: [message(output_text("done"))], "completed", None, "done", "complete"),
        (
            lambda: [reasoning(), message(output_text("(defun cut"))],
            "incomplete",
            "max_output_tokens",
            "(defun cut",
            "max_tokens",
        ),
        # A reasoning model that spent its whole budget thinking: no answer at all.
        (lambda: [reasoning()], "incomplete", "max_output_tokens", "", "incomplete"),
        (lambda: [message(refusal("I can't help"))], "completed", None, "", "refused"),
        (lambda: [message(output_text("par"))], "incomplete", "content_filter", "par", "refused"),
        (lambda: [message(output_text("x"))], "incomplete", None, "x", "incomplete"),
        (lambda: [], "failed", None, "", "incomplete"),
    ],
)
def test_openai_status_and_incomplete_details_say_whether_the_answer_is_whole(
    stand_in: StandIn,
    monkeypatch: pytest.MonkeyPatch,
    output: Any,
    status: str,
    reason: str | None,
    text: str,
    stop: str,
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    stand_in.reply = openai_response(output(), status, usage=(20, 30), incomplete=reason)
    provider = make_provider("openai", None, settings(openai_base_url=stand_in.url))

    reply = provider.generate("p", 30, 5, CONTEXT)

    assert (reply.text, reply.stop_reason) == (text, stop)
    assert (reply.input_tokens, reply.output_tokens) == (20, 30)


def test_openai_error_body_quoting_the_key_never_reaches_the_message(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    stand_in.status = 429
    stand_in.reply = {
        "error": {"message": f"Rate limit for key {KEY}", "type": "rate_limit_exceeded"}
    }
    provider = make_provider("openai", None, settings(openai_base_url=stand_in.url))

    with pytest.raises(ProviderUnavailable) as failure:
        provider.generate("p", 10, 5, CONTEXT)

    assert str(failure.value) == "openai answered HTTP 429 (rate_limit_exceeded)"
    assert KEY not in repr(failure.value)


# --- openai-compatible ------------------------------------------------------------------


def compatible_settings(stand_in: StandIn, model: str = "m", **values: Any) -> Settings:
    """A free local server's settings: its explicit prices name it and ``model``."""
    return settings(
        openai_compatible_base_url=f"{stand_in.url}/v1",
        model_provider="openai-compatible",
        model_name=model,
        model_input_usd_per_mtok=0,
        model_output_usd_per_mtok=0,
        **values,
    )


def test_openai_compatible_sends_chat_completions_without_a_key_when_none_is_set(
    stand_in: StandIn,
) -> None:
    stand_in.reply = chat_completion("local answer", "stop", usage=(9, 4))
    provider = make_provider(
        "openai-compatible", "qwen3-32b", compatible_settings(stand_in, "qwen3-32b")
    )

    reply = provider.generate("local prompt", 77, 5, CONTEXT)

    assert (reply.text, reply.input_tokens, reply.output_tokens) == ("local answer", 9, 4)
    assert reply.stop_reason == "complete"
    assert provider.input_usd_per_mtok == provider.output_usd_per_mtok == 0
    request = stand_in.only_request()
    assert request.path == "/v1/chat/completions"
    assert "Authorization" not in request.headers
    # max_completion_tokens: max_tokens is deprecated, and OpenAI's reasoning models refuse it.
    assert request.json() == {
        "model": "qwen3-32b",
        "messages": [{"role": "user", "content": "local prompt"}],
        "max_completion_tokens": 77,
    }


def test_openai_compatible_sends_max_tokens_to_a_server_that_knows_only_that(
    stand_in: StandIn,
) -> None:
    stand_in.reply = chat_completion("ok", "stop", usage=(1, 1))
    config = compatible_settings(stand_in, openai_compatible_max_tokens_field="max_tokens")
    provider = make_provider("openai-compatible", "m", config)

    provider.generate("p", 77, 5, CONTEXT)

    body = stand_in.only_request().json()
    assert body["max_tokens"] == 77
    assert "max_completion_tokens" not in body


@pytest.mark.parametrize(
    ("content", "refused", "finish", "stop"),
    [
        ("all of it", None, "stop", "complete"),
        ("(defun cut", None, "length", "max_tokens"),
        (None, None, "length", "incomplete"),
        ("", None, "content_filter", "refused"),
        (None, "I can't help with that", "stop", "refused"),
        ("calling", None, "tool_calls", "incomplete"),
    ],
)
def test_openai_compatible_finish_reason_says_whether_the_answer_is_whole(
    stand_in: StandIn, content: str | None, refused: str | None, finish: str, stop: str
) -> None:
    stand_in.reply = chat_completion(content, finish, usage=(3, 2), refusal=refused)
    provider = make_provider("openai-compatible", "m", compatible_settings(stand_in))

    reply = provider.generate("p", 5, 5, CONTEXT)

    assert (reply.text, reply.stop_reason) == (content or "", stop)


def test_openai_compatible_reply_without_usage_is_kept_with_its_usage_unknown(
    stand_in: StandIn,
) -> None:
    stand_in.reply = chat_completion("kept", "stop", usage=None)
    assert "usage" not in stand_in.reply
    provider = make_provider("openai-compatible", "m", compatible_settings(stand_in))

    reply = provider.generate("p", 5, 5, CONTEXT)

    assert (reply.text, reply.stop_reason) == ("kept", "complete")
    assert (reply.input_tokens, reply.output_tokens, reply.usage_reported) == (None, None, False)


def test_openai_compatible_sends_its_optional_key_as_a_bearer_token(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_COMPATIBLE_API_KEY", KEY)
    stand_in.reply = chat_completion(None, "stop", usage=(1, 0))
    provider = make_provider("openai-compatible", "m", compatible_settings(stand_in))

    reply = provider.generate("p", 5, 5, CONTEXT)

    assert reply.text == ""
    assert_key_only_in(stand_in.only_request(), "Authorization", f"Bearer {KEY}")


def test_a_redirect_is_never_followed_with_the_key(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_COMPATIBLE_API_KEY", KEY)
    # Following it would send the Authorization header to wherever Location points.
    stand_in.location = f"{stand_in.url}/elsewhere"
    provider = make_provider("openai-compatible", "m", compatible_settings(stand_in))

    with pytest.raises(ProviderUnavailable, match="302") as failure:
        provider.generate("p", 5, 5, CONTEXT)

    assert [r.path for r in stand_in.received] == ["/v1/chat/completions"]
    # The base URL is not the API's: waiting will not fix it.
    assert failure.value.refused


def test_openai_compatible_needs_base_url_model_and_explicit_prices(stand_in: StandIn) -> None:
    with pytest.raises(Refusal, match="OUROBOROS_OPENAI_COMPATIBLE_BASE_URL"):
        make_provider(
            "openai-compatible",
            "m",
            settings(
                model_provider="openai-compatible",
                model_name="m",
                model_input_usd_per_mtok=0,
                model_output_usd_per_mtok=0,
            ),
        )
    with pytest.raises(Refusal, match=r"OUROBOROS_MODEL_NAME or --model"):
        make_provider("openai-compatible", None, compatible_settings(stand_in))
    with pytest.raises(Refusal) as no_prices:
        make_provider(
            "openai-compatible",
            "gpt-5.6",
            settings(openai_compatible_base_url=f"{stand_in.url}/v1"),
        )
    assert "OUROBOROS_MODEL_INPUT_USD_PER_MTOK" in str(no_prices.value)
    assert "OUROBOROS_MODEL_OUTPUT_USD_PER_MTOK" in str(no_prices.value)


# --- one base-URL rule ----------------------------------------------------------------------

ENDPOINTS = {
    "anthropic": "/v1/messages",
    "openai": "/v1/responses",
    "openai-compatible": "/v1/chat/completions",
}


@pytest.mark.parametrize("name", sorted(ENDPOINTS))
@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
def test_every_provider_takes_its_base_url_with_or_without_v1(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, name: str, suffix: str
) -> None:
    for variable in KEY_VARIABLES:
        monkeypatch.setenv(variable, KEY)
    stand_in.reply = {
        "anthropic": anthropic_message([], "end_turn", usage=(1, 1)),
        "openai": openai_response([], "completed", usage=(1, 1)),
        "openai-compatible": chat_completion("", "stop", usage=(1, 1)),
    }[name]
    field_name = name.replace("-", "_") + "_base_url"
    config = settings(
        **{field_name: stand_in.url + suffix},
        model_provider=name,
        model_name="m",
        model_input_usd_per_mtok=0,
        model_output_usd_per_mtok=0,
    )
    provider = make_provider(name, "m", config)

    provider.generate("p", 5, 5, CONTEXT)

    assert stand_in.only_request().path == ENDPOINTS[name]


def test_a_base_url_with_a_path_prefix_keeps_it(stand_in: StandIn) -> None:
    stand_in.reply = chat_completion("", "stop", usage=(1, 1))
    config = settings(
        openai_compatible_base_url=f"{stand_in.url}/gateway/openai/v1",
        model_provider="openai-compatible",
        model_name="m",
        model_input_usd_per_mtok=0,
        model_output_usd_per_mtok=0,
    )

    make_provider("openai-compatible", "m", config).generate("p", 5, 5, CONTEXT)

    assert stand_in.only_request().path == "/gateway/openai/v1/chat/completions"


# --- failures worth another attempt ----------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "retryable"),
    [
        (408, True),
        (409, True),
        (429, True),
        (500, True),
        (502, True),
        (503, True),
        (529, True),
        (400, False),
        (401, False),
        (403, False),
        (404, False),
        (422, False),
    ],
)
def test_vendor_http_errors_say_whether_the_request_may_succeed_later(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, status: int, retryable: bool
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    stand_in.status = status
    stand_in.reply = {"type": "error", "error": {"type": "some_error", "message": "no"}}
    provider = make_provider("anthropic", None, settings(anthropic_base_url=stand_in.url))

    with pytest.raises(ProviderUnavailable) as failure:
        provider.generate("p", 10, 5, CONTEXT)

    assert (failure.value.status, failure.value.retryable) == (status, retryable)
    # A 4xx the vendor does not call passing is a refusal: waiting will not fix it;
    # except an invalid request, which the socket judges by the generation's other calls.
    invalid = status in (400, 422)
    assert failure.value.invalid == invalid
    assert failure.value.refused == (not retryable and not invalid)
    assert failure.value.may_have_billed is False
    assert failure.value.retry_after is None


@pytest.mark.parametrize(
    ("headers", "retry_after"),
    [
        ({"retry-after": "7"}, 7.0),
        ({"retry-after": "0.5"}, 0.5),
        ({"retry-after-ms": "250"}, 0.25),
        ({"retry-after-ms": "250", "retry-after": "7"}, 0.25),
        ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, 0.0),
        ({"retry-after": "soon"}, None),
        ({"retry-after": "-3"}, None),
    ],
)
def test_a_429_carries_the_wait_the_vendor_asked_for(
    stand_in: StandIn,
    monkeypatch: pytest.MonkeyPatch,
    headers: dict[str, str],
    retry_after: float | None,
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    stand_in.status, stand_in.headers = 429, headers
    stand_in.reply = {"error": {"type": "rate_limit_exceeded", "message": "slow down"}}
    provider = make_provider("openai", None, settings(openai_base_url=stand_in.url))

    with pytest.raises(ProviderUnavailable) as failure:
        provider.generate("p", 10, 5, CONTEXT)

    assert failure.value.retryable
    assert failure.value.retry_after == retry_after


@pytest.mark.parametrize(
    ("advice", "status", "retryable"), [("false", 429, False), ("true", 400, True)]
)
def test_the_vendors_should_retry_header_overrides_the_status(
    stand_in: StandIn,
    monkeypatch: pytest.MonkeyPatch,
    advice: str,
    status: int,
    retryable: bool,
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    stand_in.status, stand_in.headers = status, {"x-should-retry": advice}
    provider = make_provider("anthropic", None, settings(anthropic_base_url=stand_in.url))

    with pytest.raises(ProviderUnavailable) as failure:
        provider.generate("p", 10, 5, CONTEXT)

    assert failure.value.retryable is retryable


def test_a_reset_connection_is_worth_another_attempt_and_may_have_billed(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    stand_in.reset = True
    provider = make_provider("anthropic", None, settings(anthropic_base_url=stand_in.url))

    with pytest.raises(ProviderUnavailable, match="connection lost") as failure:
        provider.generate("p", 10, 5, CONTEXT)

    assert failure.value.retryable and failure.value.may_have_billed
    assert KEY not in str(failure.value)


@pytest.mark.full
def test_a_refused_connection_is_worth_another_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    provider = make_provider("anthropic", None, settings(anthropic_base_url="http://127.0.0.1:9"))

    with pytest.raises(ProviderUnavailable) as failure:
        provider.generate("p", 10, 5, CONTEXT)

    assert failure.value.retryable and not failure.value.may_have_billed


@pytest.mark.parametrize(
    "reply", [b"<html>gateway</html>", {"content": "x", "usage": {"input_tokens": 1}}]
)
def test_a_malformed_success_reply_is_not_tried_again(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, reply: object
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    stand_in.reply = reply
    provider = make_provider("anthropic", None, settings(anthropic_base_url=stand_in.url))

    with pytest.raises(ProviderUnavailable) as failure:
        provider.generate("p", 10, 5, CONTEXT)

    assert not failure.value.retryable


# --- choosing a provider -----------------------------------------------------------------


def test_unknown_provider_is_refused_naming_the_setting_and_the_known_ones() -> None:
    with pytest.raises(Refusal) as refused:
        make_provider("unknown", None, settings())

    message = str(refused.value)
    assert "OUROBOROS_MODEL_PROVIDER" in message and "--provider" in message
    for known in ("anthropic", "openai", "openai-compatible", "scripted"):
        assert known in message


@pytest.mark.parametrize(
    ("provider", "variable"), [("anthropic", "ANTHROPIC_API_KEY"), ("openai", "OPENAI_API_KEY")]
)
def test_missing_key_is_refused_naming_the_variable(provider: str, variable: str) -> None:
    with pytest.raises(Refusal, match=variable) as refused:
        make_provider(provider, None, settings())

    assert f"{variable}_FILE" in str(refused.value)


def test_model_without_builtin_prices_is_refused_naming_the_price_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)

    with pytest.raises(Refusal) as refused:
        make_provider("openai", "gpt-7-preview", settings())

    assert "OUROBOROS_MODEL_INPUT_USD_PER_MTOK" in str(refused.value)
    assert "OUROBOROS_MODEL_OUTPUT_USD_PER_MTOK" in str(refused.value)


def test_explicit_prices_serve_an_unrecognised_model_and_override_builtin_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)

    custom = make_provider(
        "openai",
        "gpt-7-preview",
        settings(
            model_provider="openai",
            model_name="gpt-7-preview",
            model_input_usd_per_mtok=0.1,
            model_output_usd_per_mtok=0.3,
        ),
    )
    # With no model named, the explicit prices are those of the provider's default model.
    half = make_provider(
        "openai", "gpt-5.6", settings(model_provider="openai", model_input_usd_per_mtok=4)
    )

    assert (custom.input_usd_per_mtok, custom.output_usd_per_mtok) == (
        Decimal("0.1"),
        Decimal("0.3"),
    )
    assert (half.input_usd_per_mtok, half.output_usd_per_mtok) == (Decimal("4.0"), Decimal("30.00"))


def test_explicit_prices_reprice_only_the_provider_and_model_they_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    local = settings(
        model_provider="openai-compatible",
        model_name="llama",
        openai_compatible_base_url="http://127.0.0.1:1/v1",
        model_input_usd_per_mtok=3,
        model_output_usd_per_mtok=15,
    )

    named = make_provider("openai-compatible", "llama", local)
    scripted = make_provider("scripted", None, local)
    other_model = make_provider("openai", "gpt-5.6", local)

    assert (named.input_usd_per_mtok, named.output_usd_per_mtok) == (Decimal(3), Decimal(15))
    # The scripted stand-in's table prices are 1 and 5, GPT-5.6's 5 and 30.
    assert (scripted.input_usd_per_mtok, scripted.output_usd_per_mtok) == (1, 5)
    assert (other_model.input_usd_per_mtok, other_model.output_usd_per_mtok) == (5, 30)
    with pytest.raises(Refusal) as unpriced:
        make_provider("openai-compatible", "qwen", local)
    assert "OUROBOROS_MODEL_NAME=qwen" in str(unpriced.value)


def test_negative_explicit_price_is_refused() -> None:
    with pytest.raises(Refusal, match="not negative"):
        make_provider("scripted", None, settings(model_input_usd_per_mtok=-1))


def test_builtin_prices_recognise_current_models_and_their_dated_snapshots() -> None:
    assert builtin_prices("openai", "gpt-5.6") is not None
    assert builtin_prices("anthropic", "claude-haiku-4-5-20251001") == builtin_prices(
        "anthropic", "claude-haiku-4-5"
    )
    assert builtin_prices("anthropic", "gpt-5.6") is None
    assert builtin_prices("openai-compatible", "gpt-5.6") is None


def test_base_url_must_be_http(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    with pytest.raises(Refusal, match="OUROBOROS_ANTHROPIC_BASE_URL"):
        make_provider("anthropic", None, settings(anthropic_base_url="file:///etc"))


# --- keys --------------------------------------------------------------------------------


def test_key_is_read_from_the_file_named_by_the_file_variable(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    secret = tmp_path / "anthropic.key"
    secret.write_text(KEY + "\n")
    monkeypatch.setenv("ANTHROPIC_API_KEY_FILE", str(secret))
    stand_in.reply = {"content": [], "usage": {"input_tokens": 1, "output_tokens": 1}}

    provider = make_provider("anthropic", None, settings(anthropic_base_url=stand_in.url))
    provider.generate("p", 1, 5, CONTEXT)

    assert stand_in.only_request().headers["x-api-key"] == KEY


def test_key_is_read_from_the_systemd_credentials_directory(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "OPENAI_API_KEY").write_text(KEY)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    stand_in.reply = {"output": [], "usage": {"input_tokens": 1, "output_tokens": 1}}

    provider = make_provider("openai", None, settings(openai_base_url=stand_in.url))
    provider.generate("p", 1, 5, CONTEXT)

    assert stand_in.only_request().headers["Authorization"] == f"Bearer {KEY}"


def test_environment_key_wins_over_key_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "other").write_text("sk-from-file")
    monkeypatch.setenv("ANTHROPIC_API_KEY_FILE", str(tmp_path / "other"))
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)

    assert AnthropicProvider.credential.read() == KEY


def test_unusable_key_file_is_refused_without_quoting_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    secret = tmp_path / "bad.key"
    secret.write_text(f"{KEY}\nsecond line\n")
    monkeypatch.setenv("OPENAI_API_KEY_FILE", str(secret))
    with pytest.raises(Refusal, match="OPENAI_API_KEY_FILE") as bad:
        make_provider("openai", None, settings())
    assert KEY not in str(bad.value)

    monkeypatch.setenv("OPENAI_API_KEY_FILE", str(tmp_path / "missing.key"))
    with pytest.raises(Refusal, match="cannot be read"):
        make_provider("openai", None, settings())


def test_key_removed_after_start_fails_the_call_naming_only_the_variable(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    provider = make_provider("anthropic", None, settings(anthropic_base_url=stand_in.url))
    monkeypatch.delenv("ANTHROPIC_API_KEY")

    with pytest.raises(ProviderUnavailable, match="ANTHROPIC_API_KEY is not set") as failure:
        provider.generate("p", 1, 5, CONTEXT)
    assert stand_in.received == []
    assert failure.value.refused  # until the key is back, every call fails alike


def test_key_reaches_neither_log_nor_audit_record_nor_organism(
    stand_in: StandIn,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    stand_in.status = 401
    stand_in.reply = {"error": {"message": f"Incorrect API key provided: {KEY}", "type": "x"}}
    provider = make_provider("openai", None, settings(openai_base_url=stand_in.url))
    caplog.set_level(logging.DEBUG)

    with ModelSocket(tmp_path / "model.sock", provider, Physics(), CONTEXT) as model:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(model.socket_path))
        client.sendall(b"POST /generate HTTP/1.1\r\nHost: kernel\r\nContent-Length: 1\r\n\r\np")
        answer = client.makefile("rb").read()
        client.close()

    assert answer.startswith(b"HTTP/1.1 502 ")
    assert KEY.encode() not in answer
    assert KEY not in caplog.text
    assert "openai answered HTTP 401" in caplog.text
    assert KEY not in model.calls[0].model_dump_json()


def test_provider_objects_never_show_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in KEY_VARIABLES:
        monkeypatch.setenv(variable, KEY)
    config = settings(
        openai_compatible_base_url="http://127.0.0.1:1/v1",
        model_provider="openai-compatible",
        model_name="m",
        model_input_usd_per_mtok=0,
        model_output_usd_per_mtok=0,
    )
    for name in ("anthropic", "openai", "openai-compatible"):
        provider = make_provider(name, "m" if name == "openai-compatible" else None, config)
        assert KEY not in repr(provider)
        assert KEY not in repr(vars(provider))
        assert KEY not in repr(vars(type(provider)))


# --- scripted ----------------------------------------------------------------------------


def test_scripted_needs_no_key_and_has_fictitious_nominal_prices() -> None:
    provider = make_provider("scripted", None, settings())

    assert isinstance(provider, ScriptedProvider)
    assert provider.model == "scripted"
    assert provider.input_usd_per_mtok > 0 and provider.output_usd_per_mtok > 0


def test_scripted_answers_the_committed_source_with_the_generation_marked() -> None:
    provider = make_provider("scripted", None, settings())

    reply = provider.generate("ignored prompt of 24 byte", 1000, 5, CONTEXT)
    again = provider.generate("ignored prompt of 24 byte", 1000, 5, CONTEXT)

    assert reply == again
    assert reply.text == '(message "hi")\n;; scripted stand-in edit: generation 3\n'
    assert reply.input_tokens == 7  # ceil(25 bytes / 4)
    assert reply.output_tokens == -(-len(reply.text.encode()) // 4)


def test_scripted_edit_replaces_its_marker_so_the_body_changes_but_does_not_grow() -> None:
    first = scripted_body(CONTEXT)
    second = scripted_body(CONTEXT.model_copy(update={"organism_source": first, "generation": 4}))

    assert second == first.replace("generation 3", "generation 4")
    assert scripted_body(CONTEXT.model_copy(update={"organism_source": "(a)"})).startswith(
        "(a)\n;; "
    )


def test_scripted_answer_is_cut_at_the_granted_tokens() -> None:
    provider = make_provider("scripted", None, settings())
    long_context = CONTEXT.model_copy(update={"organism_source": "é" * 100})

    reply = provider.generate("p", 3, 5, long_context)

    assert reply.text == "é" * 6
    assert reply.output_tokens == 3


def test_scripted_latency_past_the_timeout_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUROBOROS_SCRIPTED_LATENCY_SECONDS", "5")
    provider = make_provider("scripted", None, settings())

    with pytest.raises(ProviderUnavailable, match=r"no answer within 0\.2 s"):
        provider.generate("p", 3, 0.2, CONTEXT)


@pytest.mark.parametrize("value", ["-1", "601", "soon"])
def test_a_bad_scripted_latency_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("OUROBOROS_SCRIPTED_LATENCY_SECONDS", value)
    with pytest.raises(Refusal, match=r"^OUROBOROS_SCRIPTED_LATENCY_SECONDS: .*0 to 600"):
        make_provider("scripted", None, settings())


def test_the_scripted_latency_is_no_instrument_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUROBOROS_SCRIPTED_LATENCY_SECONDS", "3")
    assert "scripted_latency_seconds" not in settings().model_dump()
    assert make_provider("scripted", None, settings()).latency_seconds == 3


@pytest.mark.full
def test_scripted_body_stays_loadable_emacs_lisp(tmp_path: Path) -> None:
    source = '(defvar organism-seen "a ) paren in a string")\n(setq organism-loaded t)'
    body = tmp_path / "organism.el"
    body.write_text(source)
    for generation in (1, 2):
        body.write_text(
            scripted_body(
                GenerationContext(
                    lineage="demo", generation=generation, organism_source=body.read_text()
                )
            )
        )

    loaded = subprocess.run(
        ["emacs", "-Q", "--batch", "-l", str(body), "--eval", "(princ organism-loaded)"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )

    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout == "t"
    assert body.read_text().count("scripted stand-in edit") == 1
