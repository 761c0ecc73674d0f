"""The replay provider: recorded calls answered in order, by prompt sha256, and only
while the recorded answer still matches its sum; every other call a divergence."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from support.model import PRICES

from worker.instrument.model.providers import GenerationContext, ProviderUnavailable
from worker.instrument.model.replayed import ReplayProvider
from worker.instrument.records import AttemptOutcome, ModelAttempt, ModelCall

CONTEXT = GenerationContext(lineage="replayed", generation=1, organism_source="")
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def recorded(
    index: int,
    prompt: str,
    response: str | None,
    *,
    status: int = 200,
    outcome: AttemptOutcome = "answered",
    usage: bool = True,
) -> ModelCall:
    attempts = [
        ModelAttempt(
            number=1, started_at=NOW, cap_wait_seconds=0, request_seconds=0.1, outcome=outcome
        )
    ]
    return ModelCall(
        index=index,
        started_at=NOW,
        duration_seconds=0.1,
        status=status,
        prompt=prompt,
        response=response,
        prompt_sha256=sha(prompt),
        response_sha256=sha(response) if response is not None else None,
        requested_output_tokens=100,
        input_tokens=7 if usage else 0,
        output_tokens=11 if usage else 0,
        reserved_usd=Decimal("0.01"),
        cost_usd=Decimal("0.001"),
        stop_reason="max_tokens" if status == 200 else None,
        usage_reported=usage,
        attempts=attempts,
    )


def test_calls_are_answered_in_order_with_the_recorded_text_stop_and_usage() -> None:
    provider = ReplayProvider(
        "m", PRICES, [recorded(1, "first", "one"), recorded(2, "second", "two", usage=False)]
    )
    first = provider.generate("first", 100, 5, CONTEXT)
    assert (first.text, first.stop_reason, first.input_tokens, first.output_tokens) == (
        "one",
        "max_tokens",
        7,
        11,
    )
    second = provider.generate("second", 100, 5, CONTEXT)
    assert second.text == "two" and not second.usage_reported
    assert provider.divergences == [] and provider.unanswered == 0


def test_calls_the_socket_answered_itself_are_never_asked_of_the_provider() -> None:
    refused = recorded(1, "too big", None, status=402).model_copy(update={"attempts": []})
    provider = ReplayProvider("m", PRICES, [refused, recorded(2, "asked", "yes")])
    assert provider.generate("asked", 100, 5, CONTEXT).text == "yes"
    assert provider.divergences == []


def test_a_different_prompt_is_a_divergence_named_by_its_index() -> None:
    provider = ReplayProvider("m", PRICES, [recorded(4, "what was asked", "answer")])
    with pytest.raises(ProviderUnavailable):
        provider.generate("something else", 100, 5, CONTEXT)
    assert provider.divergences == ["call 4: the prompt differs from the recorded one"]


def test_a_call_the_record_does_not_hold_is_a_divergence() -> None:
    provider = ReplayProvider("m", PRICES, [recorded(1, "only", "once")])
    provider.generate("only", 100, 5, CONTEXT)
    with pytest.raises(ProviderUnavailable):
        provider.generate("again", 100, 5, CONTEXT)
    assert provider.divergences == [
        "the life made a model call the record does not hold (the record's 1 sent calls "
        "were all made)"
    ]


def test_an_answer_altered_in_the_record_is_never_given() -> None:
    forged = recorded(3, "asked", "the true answer").model_copy(update={"response": "forged"})
    provider = ReplayProvider("m", PRICES, [forged])
    with pytest.raises(ProviderUnavailable):
        provider.generate("asked", 100, 5, CONTEXT)
    assert provider.divergences == [
        "call 3: the recorded response does not match its sha256 (the record was altered)"
    ]


def test_a_call_that_failed_fails_again_at_once_and_is_no_divergence() -> None:
    provider = ReplayProvider(
        "m", PRICES, [recorded(1, "asked", None, status=502, outcome="failed")]
    )
    with pytest.raises(ProviderUnavailable) as failure:
        provider.generate("asked", 100, 5, CONTEXT)
    assert not failure.value.retryable
    assert provider.divergences == []
