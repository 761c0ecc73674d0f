"""The call engine: one generation's calls served, tried again, and paid for.

Owns what happens to a ``POST /generate`` once its headers are read: the body read
within max_prompt_bytes, the generation's call limit (``limits.MAX_CALLS``), the
reservation of each call's worst case in the generation's ledger before anything is
sent, the attempts at the provider (each on a model thread, after waiting for room
under the provider's cap from the Throttle it is given), the settlement of each, the
audit record of the call, and the sum of the generation's failures at the provider.

A call is tried again, as ``retry.RetryPolicy`` allows, after a failure the vendor
calls passing, until the call's deadline: model_timeout_seconds from its arrival or
the end of the life's wall time less model_margin_seconds, whichever comes first, so
that a hung vendor leaves the organism time to hear its 502 and act on it before
its wall. Waiting for the cap and between attempts counts against that deadline.
An attempt that failed is charged nothing, unless the vendor may have served it (its
answer was lost after the whole request was sent): then it keeps its reservation, as
any lost answer does, and the next attempt must first reserve its own worst case
within the budget. So no charge ever exceeds the reservation it settles, and the
budget stays a hard ceiling. Each attempt and each wait before another is also
logged, in the instrument's own words, on the ``waits`` logger, so that whoever
watches a life knows what it waits for.

The engine also sums up the generation's failures at the provider
(``CallEngine.model_failure``): how many calls failed there, how many it answered,
and whether any failure was a refusal that waiting will not fix. The fleet stops or
pauses the run on it, so only what the provider did counts, never what the organism
or the fleet's own contention did; a call failed in any of these ways is answered 502
all the same:

- a call that never reached the vendor (no room under the fleet's cap before its
  deadline, or every model thread still held by the generation's abandoned calls)
  is the fleet's contention, not the provider's failure: it does not count, so a
  hostile lineage that fills the cap cannot pause every other run;
- a call that arrives when its deadline has passed is the organism's doing: it is
  answered 502 at once, saying so, sends nothing and does not count;
- a vendor's 400 or 422 (the request is invalid: say, a prompt over the model's
  context window, which the organism can provoke at will) is a refusal only when no
  call of the generation was answered, since a wrong key or model fails every call;
  beside an answered call it does not count at all. 401, 403, 404, a redirect and any
  other 4xx the vendor does not call passing are refusals whatever else happened.

A call counts as failed at the provider by the last of its attempts that reached the
vendor, and with that attempt's reason. When the life ends (``CallEngine.end`` and
``CallEngine.abandon``), every attempt still running gives its room under the fleet's
cap back at once (``Admission.release``), even though its request may still be at
the vendor: the cap must not outlive the life that took it, or an organism could fill
it with slow calls and exit; and every call still in flight is audited as abandoned.

Trusts the provider, physics, context, throttle and retry policy it is given. Trusts
nothing of the request: the body's size, encoding and the granted tokens are checked.
Answers to the organism never name a provider, model, price or credential; the detail
goes to the audit record only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import random
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Literal

from worker.instrument.model import limits
from worker.instrument.model.audit import Audit
from worker.instrument.model.call import Attempt, Call
from worker.instrument.model.framing import (
    Answer,
    Exchange,
    InvalidRequest,
    granted_tokens,
    read_prompt,
)
from worker.instrument.model.ledger import BudgetExhausted, Ledger
from worker.instrument.model.prices import Prices
from worker.instrument.model.providers import (
    GenerationContext,
    Provider,
    ProviderReply,
    ProviderUnavailable,
)
from worker.instrument.model.retry import RetryPolicy
from worker.instrument.model.threads import ModelThreads
from worker.instrument.model.throttle import Admission, NoRoom, Throttle, no_room
from worker.instrument.physics import Physics
from worker.instrument.records import (
    MODEL_FAILURE_REASON_CHARS,
    AttemptOutcome,
    ModelAttempt,
    ModelCall,
    ModelFailure,
)

logger = logging.getLogger(__name__)
# What a life waits for, worded by the instrument alone (never a vendor's or an
# organism's text, so a hostile client cannot fill it): each attempt as it starts
# (debug) and each wait before another (info). ``run --local`` shows both.
waits = logging.getLogger(f"{__name__}.waits")

BUDGET_EXHAUSTED = "budget exhausted: what is left cannot cover this call's worst case"
MODEL_UNAVAILABLE = "model unavailable"
ABANDONED = "the generation ended before the model answered"
CALL_LIMIT = f"call limit: at most {limits.MAX_CALLS} calls per generation; nothing was sent"
TOO_LATE = (
    "too late: the call came after its deadline (model_timeout_seconds from its arrival, "
    "or model_margin_seconds before the end of wall_seconds); nothing was sent"
)
NO_RETRY_BUDGET = "not tried again: what is left of the budget cannot cover another attempt"
# What the cap counts a prompt as: vendors' own limiters estimate 4 bytes to the token.
CAP_BYTES_PER_TOKEN = 4


# What a failed call counts as in ModelSocket.model_failure; "invalid" is a vendor's
# 400 or 422, a refusal only when no call of the generation was answered.
_Blame = Literal["refused", "invalid", "unavailable"]


class _CallFailed(Exception):
    """Every attempt of a call failed; the message is the error its record keeps.

    blame and reason come from the last attempt that reached the vendor; blame is None
    when none did (the fleet's own contention), and the call then counts for nothing.
    """

    def __init__(self, error: str, blame: _Blame | None, reason: str) -> None:
        super().__init__(error)
        self.blame = blame
        self.reason = reason


def _cap_starved(attempt: Attempt, arrived: float, deadline: float) -> bool:
    """Whether the fleet's cap, not the vendor, left a late answer too little time: the
    attempt waited for the cap and reached the vendor with less than half of the call's
    time left. Such a cut is no failure of the vendor's (it would pause the lineage for
    what another lineage's calls did), as a call that found no room at all is not."""
    if attempt.sent is None or attempt.cap_waited <= 0:
        return False
    return deadline - attempt.sent < (deadline - arrived) / 2


def _blame(failure: ProviderUnavailable) -> _Blame:
    if failure.refused:
        return "refused"
    return "invalid" if failure.invalid else "unavailable"


class CallEngine:
    """Serves, retries, pays for and audits the calls of one generation."""

    def __init__(
        self,
        provider: Provider,
        physics: Physics,
        context: GenerationContext,
        throttle: Throttle,
        retry: RetryPolicy,
        model_threads: ModelThreads,
    ) -> None:
        self.provider = provider
        self.physics = physics
        self.context = context
        self.throttle = throttle
        self.retry = retry
        self._jitter = random.Random()
        # Set when the life ends: attempts still waiting for the cap give up at once.
        self._ended = threading.Event()
        self._wall_end = math.inf
        self.ledger = Ledger(
            physics.budget_usd,
            Prices(
                input_usd_per_mtok=provider.input_usd_per_mtok,
                output_usd_per_mtok=provider.output_usd_per_mtok,
            ),
        )
        self.audit = Audit()
        self._lock = threading.Lock()
        self._indices = itertools.count(1)
        self._admitted = 0
        self.calls_over_limit = 0
        self._in_flight: dict[int, Call] = {}
        # Each call that failed at the provider: what it counts as, and why.
        self._failures: list[tuple[_Blame, str]] = []
        # The room under the cap held by attempts running now, given back when the
        # life ends (an attempt the vendor keeps waiting would otherwise hold it on).
        # Keyed by identity: two admissions may be equal.
        self._holds: dict[int, Admission] = {}
        self._model_threads = model_threads

    @property
    def calls(self) -> list[ModelCall]:
        """Every audited call so far, in order of arrival."""
        return self.audit.calls

    @property
    def model_failure(self) -> ModelFailure | None:
        """The generation's failures at the provider so far; None when there were none.

        Refused when any failed call was refused (waiting will not fix it), and then the
        reason is the last refusal's; else unavailable, with the last failure's reason.
        A vendor's 400 or 422 is a refusal when no call was answered, else not counted.
        """
        with self._lock:
            failures = list(self._failures)
        answered = self.audit.answered
        if answered:
            # The vendor serves this key and model: the request itself was at fault.
            failures = [failure for failure in failures if failure[0] != "invalid"]
        if not failures:
            return None
        refusals = [reason for blame, reason in failures if blame != "unavailable"]
        return ModelFailure(
            kind="refused" if refusals else "unavailable",
            reason=_one_line((refusals or [reason for _, reason in failures])[-1]),
            failed_calls=len(failures),
            answered_calls=answered,
        )

    def start(self) -> None:
        """The life starts about now and is killed at its wall time: no call outlives its
        margin before it, so the organism hears its 502 with time left to act on it."""
        self._wall_end = (
            time.monotonic() + self.physics.wall_seconds - self.physics.model_margin_seconds
        )

    def end(self) -> None:
        """The life has ended: every attempt gives its room under the cap back now."""
        self._ended.set()
        # An attempt admitted from now on sees _ended and gives its room back itself.
        with self._lock:
            holds, self._holds = self._holds, {}
        for admission in holds.values():
            admission.release()

    def abandon(self) -> None:
        """Audit every call still in flight, once nothing serves the socket any more.

        A wall timeout often ends a life mid-call. A call still waiting for the model
        is recorded now: charged its reservation if its request had left (the vendor
        may serve it still), else nothing. So the observation written after this holds
        every call and every dollar that may have been spent.
        """
        with self._lock:
            abandoned = list(self._in_flight.values())
            self._in_flight.clear()
        for call in abandoned:
            current, call.current = call.current, None
            if current is not None:
                billed = current.sent is not None
                if not billed and current.admission is None and current.capping is not None:
                    # Still waiting for room under the cap: that wait was the call's too.
                    current.cap_waited = time.monotonic() - current.capping
                cost = call.settle(self.ledger, self._reserved(call) if billed else Decimal(0))
                self._record(call, current, "abandoned", ABANDONED, billed=billed, cost=cost)
            call.settle(self.ledger, Decimal(0))
            self.audit.record(call, 502, MODEL_UNAVAILABLE, error=ABANDONED)
            # A call in flight when the life ended failed at the provider only if an
            # attempt of it had: one the organism merely left behind was never refused,
            # and one that found no room under the cap never reached the vendor.
            tried = [a for a in call.attempts if a.outcome == "failed"]
            if tried:
                with self._lock:
                    self._failures.append(("unavailable", tried[-1].error or MODEL_UNAVAILABLE))

    async def serve_generate(
        self, headers: Sequence[tuple[bytes, bytes]], exchange: Exchange
    ) -> Answer:
        """One POST /generate whose headers are read: the answer to it."""
        started_at = datetime.now(UTC)
        clock = time.monotonic()
        try:
            raw = await read_prompt(headers, exchange, self.physics.max_prompt_bytes)
        except InvalidRequest as exc:
            return Answer(400, str(exc))
        with self._lock:
            if self._admitted >= limits.MAX_CALLS:
                self.calls_over_limit += 1
                return Answer(429, CALL_LIMIT)
            self._admitted += 1
        call = Call(next(self._indices), started_at, clock, raw)
        try:
            prompt = raw.decode("utf-8")
            if not prompt:
                raise InvalidRequest("the prompt is empty")
            tokens = granted_tokens(headers, self.physics.max_output_tokens)
        except UnicodeDecodeError:
            return self.audit.record(call, 400, "the prompt is not valid UTF-8")
        except InvalidRequest as exc:
            return self.audit.record(call, 400, str(exc))
        call.requested_output_tokens = tokens
        if self._deadline(call) <= time.monotonic():
            return self.audit.record(call, 502, TOO_LATE)
        try:
            call.reserve(self.ledger, tokens)
        except BudgetExhausted as exc:
            return self.audit.record(call, 402, BUDGET_EXHAUSTED, error=str(exc))
        with self._lock:
            self._in_flight[call.index] = call
        try:
            reply = await self._generate(call, prompt, tokens)
        except asyncio.CancelledError:
            # The generation ended first and __exit__ audits the call as abandoned; a
            # client still waiting hears what its record will say, if it can at once.
            exchange.answer_at_once(Answer(502, MODEL_UNAVAILABLE))
            raise
        except _CallFailed as exc:
            self._land(call.index)
            if exc.blame is not None:
                with self._lock:
                    self._failures.append((exc.blame, exc.reason))
            logger.warning("model call %d failed: %s", call.index, exc)
            call.settle(self.ledger, Decimal(0))
            return self.audit.record(call, 502, MODEL_UNAVAILABLE, error=str(exc))
        self._land(call.index)
        return self.audit.record(call, 200, reply.text, reply=reply)

    def _land(self, index: int) -> None:
        """The call ended in time: settling it is no longer __exit__'s job."""
        with self._lock:
            del self._in_flight[index]

    def _deadline(self, call: Call) -> float:
        """When the call must be answered by (time.monotonic())."""
        return min(call.clock + self.physics.model_timeout_seconds, self._wall_end)

    @staticmethod
    def _reserved(call: Call) -> Decimal:
        return call.reservation.amount_usd if call.reservation else Decimal(0)

    def _cost(self, call: Call, reply: ProviderReply) -> Decimal:
        """What an answer costs: its reported usage, else (none reported) the worst case."""
        if reply.input_tokens is None or reply.output_tokens is None:
            return self._reserved(call)
        return self.ledger.prices.cost_usd(reply.input_tokens, reply.output_tokens)

    async def _generate(self, call: Call, prompt: str, tokens: int) -> ProviderReply:
        """The provider's reply, tried as often as the retry policy and the deadline allow.

        The deadline is model_timeout_seconds from the call's arrival, or the end of
        the life's wall time less model_margin_seconds if that is sooner. Each attempt
        runs on a model thread (waiting for the cap there, then one request whose every
        read the stall limit bounds) and is abandoned at the deadline. Raises
        _CallFailed for the last failure; every attempt is recorded on the call, and each
        one the vendor may have billed is charged its reservation here.
        """
        timeout = self.physics.model_timeout_seconds
        deadline = self._deadline(call)
        late = (
            f"no answer within {timeout} s"
            if deadline < self._wall_end
            else "no answer in time to leave the organism its margin before the wall"
        )
        estimate = math.ceil(len(call.prompt) / CAP_BYTES_PER_TOKEN) + tokens
        # The last attempt that reached the vendor, and its error: what the call counts as.
        reached: tuple[ProviderUnavailable, str] | None = None
        for number in itertools.count(1):
            attempt = Attempt(number, datetime.now(UTC), time.monotonic())
            call.current = attempt
            waits.debug("model call %d: attempt %d to %s", call.index, number, self.provider.name)
            future = self._model_threads.submit(
                functools.partial(self._attempt, attempt, prompt, tokens, estimate, deadline)
            )
            outcome: AttemptOutcome = "failed"
            starved = False
            try:
                async with asyncio.timeout_at(deadline):
                    reply = await asyncio.wrap_future(future)
            except TimeoutError:
                queued = future.cancel()
                if attempt.sent is not None:
                    outcome, failure = "abandoned", ProviderUnavailable(late, may_have_billed=True)
                    starved = _cap_starved(attempt, call.clock, deadline)
                    if starved:
                        failure = ProviderUnavailable(
                            f"{late}, after {attempt.cap_waited:.1f} s waiting for the fleet's cap",
                            may_have_billed=True,
                        )
                elif queued or attempt.capping is None or not self.provider.capped:
                    # Every model thread is still held by an abandoned call: never sent.
                    outcome, failure = "no_slot", ProviderUnavailable(late)
                else:
                    attempt.cap_waited = time.monotonic() - attempt.capping
                    outcome = "no_slot"
                    failure = ProviderUnavailable(
                        str(no_room(self.provider.name, attempt.cap_waited))
                    )
            except NoRoom as exc:
                attempt.cap_waited = exc.waited_seconds
                outcome, failure = "no_slot", ProviderUnavailable(str(exc))
            except ProviderUnavailable as exc:
                failure = exc
            except Exception as exc:
                logger.error("provider %s failed unexpectedly", self.provider.name, exc_info=exc)
                failure = ProviderUnavailable(
                    f"{self.provider.name} failed: {type(exc).__name__}", may_have_billed=True
                )
            else:
                cost = call.settle(self.ledger, self._cost(call, reply))
                self._record(call, attempt, "answered", None, billed=False, cost=cost, status=200)
                return reply
            wait = self._next_wait(number, failure, deadline)
            cost = Decimal(0)
            if failure.may_have_billed:
                cost = call.settle(self.ledger, self._reserved(call))
            error = str(failure)
            if wait is not None and call.reservation is None:
                try:
                    call.reserve(self.ledger, tokens)
                except BudgetExhausted:
                    wait, error = None, f"{failure}; {NO_RETRY_BUDGET}"
            if outcome != "no_slot" and not starved:
                reached = failure, error
            self._record(
                call,
                attempt,
                outcome,
                error,
                billed=failure.may_have_billed,
                cost=cost,
                status=failure.status,
                retry_after=failure.retry_after,
                backoff=wait,
            )
            if wait is None:
                if reached is None:
                    raise _CallFailed(error, None, error)
                raise _CallFailed(error, _blame(reached[0]), reached[1])
            waits.info(
                "model call %d: attempt %d failed (%s); attempt %d at %s UTC, in %.0f s",
                call.index,
                number,
                f"HTTP {failure.status}" if failure.status else outcome.replace("_", " "),
                number + 1,
                (datetime.now(UTC) + timedelta(seconds=wait)).strftime("%H:%M:%S"),
                wait,
            )
            await asyncio.sleep(wait)
        raise AssertionError("unreachable: attempts end by answering or raising")

    def _attempt(
        self, attempt: Attempt, prompt: str, tokens: int, estimate: int, deadline: float
    ) -> ProviderReply:
        """On a model thread: room under the provider's cap, then one request."""
        attempt.capping = time.monotonic()
        cap = (
            self.throttle.admit(
                self.provider.name, self.provider.model, estimate, deadline, self._ended
            )
            if self.provider.capped
            else contextlib.nullcontext(None)
        )
        with cap as admission:
            attempt.admission = admission
            if admission is not None:
                attempt.cap_waited = admission.waited_seconds
                with self._lock:
                    self._holds[id(admission)] = admission
            try:
                left = deadline - time.monotonic()
                # Once the life has ended nobody wants the answer, and __exit__ may
                # have given the room back before this attempt held it.
                if left <= 0 or self._ended.is_set():
                    raise no_room(self.provider.name, attempt.cap_waited)
                attempt.sent = time.monotonic()
                return self.provider.generate(
                    prompt, tokens, min(self.retry.stall_seconds, left), self.context
                )
            finally:
                if admission is not None:
                    with self._lock:
                        self._holds.pop(id(admission), None)

    def _next_wait(
        self, number: int, failure: ProviderUnavailable, deadline: float
    ) -> float | None:
        """The wait before another attempt, or None when there is to be none."""
        if not failure.retryable or number >= self.retry.max_attempts:
            return None
        wait = self.retry.backoff_seconds(number, failure.retry_after, self._jitter)
        # A wait that ends at the deadline leaves no time to be answered in.
        return wait if time.monotonic() + wait < deadline else None

    def _record(
        self,
        call: Call,
        attempt: Attempt,
        outcome: AttemptOutcome,
        error: str | None,
        *,
        billed: bool,
        cost: Decimal = Decimal(0),
        status: int | None = None,
        retry_after: float | None = None,
        backoff: float | None = None,
    ) -> None:
        """Add the attempt's record to its call."""
        now = time.monotonic()
        call.current = None
        call.attempts.append(
            ModelAttempt(
                number=attempt.number,
                started_at=attempt.started_at,
                cap_wait_seconds=attempt.cap_waited,
                request_seconds=now - attempt.sent if attempt.sent is not None else 0.0,
                outcome=outcome,
                vendor_status=status,
                error=error,
                retry_after_seconds=retry_after,
                backoff_seconds=backoff,
                may_have_billed=billed and attempt.sent is not None,
                cost_usd=cost,
                cap_note=attempt.admission.note if attempt.admission else None,
            )
        )


def _one_line(text: str) -> str:
    """``text`` as one printable line of at most MODEL_FAILURE_REASON_CHARS characters."""
    line = " ".join("".join(ch if ch.isprintable() else " " for ch in text).split())
    if len(line) <= MODEL_FAILURE_REASON_CHARS:
        return line
    return line[: MODEL_FAILURE_REASON_CHARS - 1] + "…"
