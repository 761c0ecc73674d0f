"""The fleet-wide cap on model calls, shared by every worker through the broker's Redis.

Owns ``RedisThrottle``, the instrument's ``Throttle``
(``worker.instrument.model.throttle``, which defines the cap's limits and paces)
kept in Redis (the cap the settings ask for is ``worker.fleet.assembly.model_cap``).
Per provider, two keys:

* ``ouroboros:model-cap:<provider>:calls``: a sorted set of the calls in progress,
  each scored by when its hold expires (its call's deadline plus a margin), so a
  worker that dies mid-call frees its room when that time comes and nobody waits
  on it for ever; a live worker removes its hold when the call ends, or as soon as
  the life that made it ends (``Admission.release``), whichever is first;
* ``ouroboros:model-cap:<provider>:pace``: a hash of the earliest times the next
  request may go by the request pace and by the token pace.

One Lua script drops expired holds, checks every limit and takes room at once, on
Redis's own clock, so the hosts' clocks never matter. Both keys expire when idle.
A waiter looks again when the script says the pace allows, or every
``POLL_SECONDS`` while it waits for a call to end.

Correctness never rests on Redis: when it cannot be reached the attempt goes ahead
uncapped and its record says so. The cap only spares the vendor a stampede; the
socket's retries still handle the 429s that get through.

Trusts: its Redis and its settings.
"""

from __future__ import annotations

import functools
import logging
import random
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from worker.fleet.redis_keys import PREFIX
from worker.instrument.model.throttle import POLL_SECONDS, Admission, Cap, no_room

log = logging.getLogger(__name__)

# A hold outlives its call's deadline by this much: the model thread may still be
# reading the vendor's answer when the call is abandoned.
HOLD_MARGIN_SECONDS = 30.0
# The longest a waiter sleeps before looking again, even when told to wait longer.
MAX_SLEEP_SECONDS = 2.0

# KEYS: calls, pace. ARGV: id, tokens, hold ms, concurrent calls, requests and tokens
# per window, window ms. Returns 0 once room is taken, -1 to wait for a call to end,
# or the milliseconds until the pace lets the next request go.
_ADMIT = """
if redis.replicate_commands then redis.replicate_commands() end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + tonumber(clock[2]) / 1000
local id, tokens, hold = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local calls, requests, budget = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local window = tonumber(ARGV[7])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if calls > 0 and redis.call('ZCARD', KEYS[1]) >= calls then
  return -1
end
local by_requests = tonumber(redis.call('HGET', KEYS[2], 'requests') or 0)
local by_tokens = tonumber(redis.call('HGET', KEYS[2], 'tokens') or 0)
local ready = math.max(by_requests, by_tokens)
if ready > now then
  return math.max(1, math.ceil(ready - now))
end
if requests > 0 then
  by_requests = math.max(by_requests, now) + window / requests
end
if budget > 0 then
  by_tokens = math.max(by_tokens, now) + tokens * window / budget
end
redis.call('HSET', KEYS[2], 'requests', by_requests, 'tokens', by_tokens)
redis.call('PEXPIRE', KEYS[2], math.ceil(math.max(by_requests, by_tokens) - now) + 1000)
redis.call('ZADD', KEYS[1], now + hold, id)
if redis.call('PTTL', KEYS[1]) < hold then
  redis.call('PEXPIRE', KEYS[1], hold)
end
return 0
"""


class RedisThrottle:
    """One cap per provider for the whole fleet, kept in Redis."""

    def __init__(
        self,
        client: redis.Redis,
        cap: Cap,
        prefix: str = PREFIX,
        hold_margin_seconds: float = HOLD_MARGIN_SECONDS,
    ) -> None:
        self.client = client
        self.cap = cap
        self.prefix = prefix
        self.hold_margin_seconds = hold_margin_seconds
        self._admit = client.register_script(_ADMIT)
        self._jitter = random.Random()

    def keys(self, provider: str) -> tuple[str, str]:
        base = f"{self.prefix}:model-cap:{provider}"
        return f"{base}:calls", f"{base}:pace"

    @contextmanager
    def admit(
        self, provider: str, tokens: int, deadline: float, stop: threading.Event
    ) -> Iterator[Admission]:
        started = time.monotonic()
        if not (
            self.cap.concurrent_calls or self.cap.requests_per_minute or self.cap.tokens_per_minute
        ):
            yield Admission(0.0)
            return
        keys, holder = self.keys(provider), secrets.token_hex(8)
        note = None
        try:
            while (wait := self._try(keys, holder, tokens, deadline)) != 0:
                now = time.monotonic()
                if stop.is_set() or now >= deadline:
                    raise no_room(provider, now - started)
                pause = POLL_SECONDS if wait < 0 else min(wait / 1000, MAX_SLEEP_SECONDS)
                # Spread the waiters, so that those told the same time do not all race.
                pause *= 0.8 + 0.4 * self._jitter.random()
                stop.wait(min(pause, deadline - now))
        except redis.RedisError as exc:
            note = f"the fleet's cap could not be reached ({type(exc).__name__}); sent uncapped"
            log.warning("model cap for %s: %s", provider, note)
        if note is not None:
            yield Admission(time.monotonic() - started, note)
            return
        # Removing a member twice is harmless, so an early release needs no bookkeeping.
        release = functools.partial(self._release, keys[0], holder)
        try:
            yield Admission(time.monotonic() - started, release=release)
        finally:
            release()

    def _try(self, keys: tuple[str, str], holder: str, tokens: int, deadline: float) -> int:
        hold = deadline - time.monotonic() + self.hold_margin_seconds
        cap = self.cap
        return int(
            self._admit(
                keys=list(keys),
                args=[
                    holder,
                    tokens,
                    max(1, int(hold * 1000)),
                    cap.concurrent_calls,
                    cap.requests_per_minute,
                    cap.tokens_per_minute,
                    max(1, int(cap.window_seconds * 1000)),
                ],
            )
        )

    def _release(self, calls: str, holder: str) -> None:
        try:
            self.client.zrem(calls, holder)
        except redis.RedisError as exc:
            # The hold expires by itself; until then the cap counts one call too many.
            log.warning("model cap: could not release a call (%s)", type(exc).__name__)
