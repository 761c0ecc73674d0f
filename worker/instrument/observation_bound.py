"""The most an observation may take, and what is dropped first to keep it there.

Owns OBSERVATION_MAX_BYTES, the size of an observation as it is stored (its JSON,
indented), and ``bounded``, which cuts an observation over it. What is dropped, in
order, until it fits:

1. the text (prompt and answer) of model calls, newest first: each call keeps its
   sizes, sha256 sums, tokens, cost and attempts, and says ``text_omitted``;
2. error text beyond ERROR_CHARS characters, in every call and attempt (a vendor's
   error may quote the request);
3. stderr, all but its first ERROR_CHARS characters (the journal keeps its last lines).

Everything else is counted and bounded where it is made: at most ``limits.MAX_CALLS``
calls of at most ``RetryPolicy.max_attempts`` attempts, and fixed fields. So after
step 3 an observation is some megabytes at most, far under the limit; one that is
still over it is refused with ValueError rather than stored whole.

Trusts the observation's model to describe every field; the text in it is anyone's.
"""

from __future__ import annotations

from worker.instrument.records import STDERR_CUT_MARK, ModelAttempt, ModelCall, Observation

OBSERVATION_MAX_BYTES = 48 * 1024**2
ERROR_CHARS = 1024


def size(observation: Observation) -> int:
    """The observation's size as it is stored."""
    return len(observation.model_dump_json(by_alias=True, indent=2).encode("utf-8"))


def bounded(observation: Observation, limit: int = OBSERVATION_MAX_BYTES) -> Observation:
    """``observation`` if it fits ``limit``, else cut as the module says."""
    excess = size(observation) - limit
    if excess <= 0:
        return observation
    calls = list(observation.model_calls)
    for index in reversed(range(len(calls))):
        call = calls[index]
        if call.text_omitted:
            continue
        excess -= _text_bytes(call)
        calls[index] = call.model_copy(
            update={"prompt": "", "response": None, "text_omitted": True}
        )
        if excess <= 0:
            break
    observation = observation.model_copy(update={"model_calls": calls})
    if size(observation) <= limit:
        return observation
    observation = observation.model_copy(update={"model_calls": [_clipped(c) for c in calls]})
    if size(observation) <= limit:
        return observation
    observation = observation.model_copy(
        update={
            "stderr": observation.stderr[:ERROR_CHARS] + STDERR_CUT_MARK,
            "stderr_truncated": True,
        }
    )
    if size(observation) > limit:
        raise ValueError(
            f"observation of {observation.lineage} generation {observation.generation} is "
            f"{size(observation)} bytes with every text cut, over {limit}"
        )
    return observation


def _text_bytes(call: ModelCall) -> int:
    """About what omitting a call's text saves (the final size is measured, not this)."""
    return len(call.prompt.encode("utf-8")) + len((call.response or "").encode("utf-8"))


def _clip(text: str | None) -> str | None:
    if text is None or len(text) <= ERROR_CHARS:
        return text
    return text[:ERROR_CHARS] + "…"


def _clipped(call: ModelCall) -> ModelCall:
    attempts: list[ModelAttempt] = [
        a.model_copy(update={"error": _clip(a.error)}) for a in call.attempts
    ]
    return call.model_copy(update={"error": _clip(call.error), "attempts": attempts})
