"""The replay provider: a generation's model calls answered from its own record.

Owns ``ReplayProvider``, which ``worker.instrument.replay`` gives a relived life in
place of the vendor, and the divergences it notes. Only the calls the record says
reached the vendor (an attempt was sent) come here: the socket answers the others
(an invalid request, the call limit, the budget, a call past its deadline) itself,
as it did in the recorded life. They are answered in order: the first call here gets
the first recorded call that reached the vendor, and so on. Each must carry the
recorded prompt (by sha256); an answered one is given the recorded text, how it
stopped and its usage; a failed one fails again, at once; an abandoned one waits
out its deadline, as the original did. A call the record does not hold, a prompt
that differs, or a recorded answer whose text no longer matches its sha256 is a
divergence named by the call's index, and that call fails (502 to the organism).

Reaches no vendor, reads no key, spends nothing: the ledger's charges are the
recorded usage at the prices given, so the budget refuses the same calls it refused.

Trusts the record it is given only as far as its sha256 sums: a response altered in
the store is a divergence, never an answer.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence

from worker.instrument.model.prices import Prices
from worker.instrument.model.providers import (
    GenerationContext,
    Provider,
    ProviderReply,
    ProviderUnavailable,
)
from worker.instrument.records import ModelCall


def reached_vendor(call: ModelCall) -> bool:
    """Whether the recorded call was sent to the vendor (any attempt but a missed slot)."""
    return any(attempt.outcome != "no_slot" for attempt in call.attempts)


class ReplayProvider(Provider):
    """Answers each call from the next recorded call that reached the vendor."""

    name = "replay"
    capped = False

    def __init__(self, model: str, prices: Prices, calls: Sequence[ModelCall]) -> None:
        super().__init__(model, prices)
        self._recorded = [call for call in calls if reached_vendor(call)]
        self._lock = threading.Lock()
        self._next = 0
        self.divergences: list[str] = []

    def generate(
        self, prompt: str, max_output_tokens: int, timeout: float, context: GenerationContext
    ) -> ProviderReply:
        with self._lock:
            position = self._next
            self._next += 1
        if position >= len(self._recorded):
            raise self._diverged(
                f"the life made a model call the record does not hold (the record's "
                f"{len(self._recorded)} sent calls were all made)"
            )
        call = self._recorded[position]
        if hashlib.sha256(prompt.encode("utf-8")).hexdigest() != call.prompt_sha256:
            raise self._diverged(f"call {call.index}: the prompt differs from the recorded one")
        if call.status == 200:
            response = call.response or ""
            if hashlib.sha256(response.encode("utf-8")).hexdigest() != call.response_sha256:
                raise self._diverged(
                    f"call {call.index}: the recorded response does not match its sha256 "
                    "(the record was altered)"
                )
            usage = call.usage_reported
            return ProviderReply(
                text=response,
                stop_reason=call.stop_reason or "complete",
                input_tokens=call.input_tokens if usage else None,
                output_tokens=call.output_tokens if usage else None,
            )
        if call.attempts and call.attempts[-1].outcome == "abandoned":
            # The life ended while this call was at the vendor: so it does again.
            time.sleep(timeout)
        raise ProviderUnavailable(f"replay: call {call.index} failed in the recorded life")

    @property
    def unanswered(self) -> int:
        """How many recorded calls that reached the vendor the replayed life never made."""
        with self._lock:
            return max(0, len(self._recorded) - self._next)

    def _diverged(self, reason: str) -> ProviderUnavailable:
        with self._lock:
            self.divergences.append(reason)
        return ProviderUnavailable(f"replay: {reason}")
