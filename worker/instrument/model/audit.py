"""The audit of a generation's model calls: one record of every call that had a body.

Owns the ``ModelCall`` records the observation will hold, and what of the organism's
text they keep: each record keeps its sizes, hashes, tokens, cost and attempts, and
its prompt and answer while the text audited so far fits ``limits.AUDIT_TEXT_BYTES``
(counted as the observation's JSON will spell it); past that, the text is omitted
and the record says so (``text_omitted``). The text of calls never sent to the model
(refused 400, 402 or too late, which cost the organism nothing) also counts toward
``limits.REFUSED_TEXT_BYTES``, a small cap of their own, so that free calls cannot
fill the observation. Also owns the answer a recorded call
gives its client, which for a 200 is the model's text repaired to UTF-8 exactly as
the record keeps it.

Trusts the call state the engine gives it; the prompt and the model's text are
anyone's and are only measured, hashed and kept within the cap.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time

from worker.instrument.model import limits
from worker.instrument.model.call import Call
from worker.instrument.model.capabilities import STOP_REASON_HEADER
from worker.instrument.model.framing import Answer
from worker.instrument.model.providers import ProviderReply
from worker.instrument.records import ModelCall


class Audit:
    """The records of one generation's calls, safe to add to from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[ModelCall] = []
        self._audited_text = 0
        self._refused_text = 0

    @property
    def calls(self) -> list[ModelCall]:
        """Every audited call so far, in order of arrival."""
        with self._lock:
            return sorted(self._calls, key=lambda call: call.index)

    @property
    def answered(self) -> int:
        """How many calls the model answered."""
        with self._lock:
            return sum(call.status == 200 for call in self._calls)

    def record(
        self,
        call: Call,
        status: int,
        answer: str,
        *,
        error: str | None = None,
        reply: ProviderReply | None = None,
    ) -> Answer:
        """Record the call and pass its answer on; a 200's answer is the model's text."""
        response = None
        headers: tuple[tuple[str, str], ...] = ()
        if status == 200:
            # A vendor's JSON may carry lone surrogates; neither the socket nor the
            # record can hold them, so both get the same repaired text.
            response = answer.encode("utf-8", errors="replace").decode("utf-8")
            answer = response
        elif error is None:
            error = answer
        if reply is not None:
            headers = ((STOP_REASON_HEADER, reply.stop_reason),)
        prompt = call.prompt.decode("utf-8", errors="replace")
        # Counted as the record will be written: JSON spells a control byte in 6.
        text_bytes = _json_bytes(prompt) + (_json_bytes(response) if response else 0)
        refused = not call.attempts
        with self._lock:
            # Past a cap a record keeps sizes, hashes, tokens and cost, never the text.
            keep_text = self._audited_text + text_bytes <= limits.AUDIT_TEXT_BYTES and (
                not refused or self._refused_text + text_bytes <= limits.REFUSED_TEXT_BYTES
            )
            if keep_text:
                self._audited_text += text_bytes
                self._refused_text += text_bytes if refused else 0
        record = ModelCall(
            index=call.index,
            started_at=call.started_at,
            duration_seconds=time.monotonic() - call.clock,
            status=status,
            prompt=prompt if keep_text else "",
            response=response if keep_text else None,
            prompt_bytes=len(call.prompt),
            text_omitted=not keep_text,
            prompt_sha256=hashlib.sha256(call.prompt).hexdigest(),
            response_sha256=(
                hashlib.sha256(response.encode("utf-8")).hexdigest()
                if response is not None
                else None
            ),
            requested_output_tokens=call.requested_output_tokens,
            input_tokens=(reply.input_tokens or 0) if reply else 0,
            output_tokens=(reply.output_tokens or 0) if reply else 0,
            reserved_usd=call.reserved,
            cost_usd=call.charged,
            error=error,
            stop_reason=reply.stop_reason if reply else None,
            usage_reported=reply.usage_reported if reply else True,
            attempts=call.attempts,
        )
        with self._lock:
            self._calls.append(record)
        return Answer(status, answer, headers)


def _json_bytes(text: str) -> int:
    """The size of ``text`` as a JSON string in the observation."""
    return len(json.dumps(text, ensure_ascii=False).encode("utf-8"))
