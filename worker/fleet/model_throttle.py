"""The fleet-wide cap on model calls, shared by every worker through the broker's Redis.

Owns ``RedisThrottle``, the instrument's ``Throttle``
(``worker.instrument.model.throttle``, which defines the caps' limits and paces and the
order waiters are served in) kept in Redis (the caps the settings ask for are
``worker.fleet.assembly.model_cap`` and ``model_caps``). Per cap (a provider's, or a
model's at a provider: ``<name>`` is ``<provider>`` or ``<provider>:model:<model>``),
four keys:

* ``ouroboros:model-cap:<name>:calls``: a sorted set of the calls in progress, each
  scored by when its hold expires (its call's deadline plus a margin), so a worker
  that dies mid-call frees its room when that time comes and nobody waits on it for
  ever; a live worker removes its hold when the call ends, or as soon as the life
  that made it ends (``Admission.release``), whichever is first;
* ``ouroboros:model-cap:<name>:pace``: a hash of the earliest times the next request
  may go by the request pace and by the token pace;
* ``ouroboros:model-cap:<name>:queue``: a sorted set of the waiters, each scored by
  its arrival on Redis's clock (ties by id), so the fleet serves them in that order;
* ``ouroboros:model-cap:<name>:places``: the same waiters, each scored by when its
  place lapses. A waiter renews its place every time it looks (at least every
  ``MAX_SLEEP_SECONDS``); a place not renewed for ``PLACE_SECONDS`` (its worker died,
  or lost Redis) is dropped by the next look, so a dead waiter holds up those behind
  it for that long at most. A waiter that gives up removes its place at once.

One Lua script drops expired holds and lapsed places, renews the caller's places,
and, when the caller heads each queue in turn (its model's first, then its
provider's) and every limit has room, takes the room at once, on Redis's own clock,
so the hosts' clocks never matter. Every key expires when idle. A waiter looks
again when the script says the pace allows (only the head is told: nobody else may
go then), or every ``POLL_SECONDS`` while it waits for a call to end or for those
ahead of it.

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
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import NamedTuple

import redis

from worker.fleet.redis_keys import PREFIX
from worker.instrument.model.throttle import (
    POLL_SECONDS,
    Admission,
    Cap,
    cap_name,
    caps_of,
    no_room,
)

log = logging.getLogger(__name__)

# A hold outlives its call's deadline by this much: the model thread may still be
# reading the vendor's answer when the call is abandoned.
HOLD_MARGIN_SECONDS = 30.0
# The longest a waiter sleeps before looking again, even when told to wait longer.
MAX_SLEEP_SECONDS = 2.0
# How long a waiter's place outlives its last look: several of its longest sleeps, so
# a live waiter on a busy host never loses its place.
PLACE_SECONDS = 5 * MAX_SLEEP_SECONDS

# KEYS: calls, pace, queue, places of each cap, the model's first. ARGV: id, tokens,
# hold ms, place ms, then per cap: concurrent calls, requests and tokens per window,
# window ms. Returns 0 once room is taken in every cap, -1 to wait for a call to end
# or for those ahead, or the milliseconds until the pace lets the head's request go.
_ADMIT = """
if redis.replicate_commands then redis.replicate_commands() end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + tonumber(clock[2]) / 1000
local id, tokens = ARGV[1], tonumber(ARGV[2])
local hold, place = tonumber(ARGV[3]), tonumber(ARGV[4])
local caps = #KEYS / 4
local arrival = now
for c = 0, caps - 1 do
  local k = 4 * c
  local calls, pace, queue, places = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]
  for _, lapsed in ipairs(redis.call('ZRANGEBYSCORE', places, '-inf', now)) do
    redis.call('ZREM', queue, lapsed)
  end
  redis.call('ZREMRANGEBYSCORE', places, '-inf', now)
  -- The caller keeps its arrival in every queue it joins: one order for every cap.
  local mine = redis.call('ZSCORE', queue, id)
  if mine then
    arrival = tonumber(mine)
  else
    redis.call('ZADD', queue, arrival, id)
  end
  redis.call('ZADD', places, now + place, id)
  redis.call('PEXPIRE', queue, place)
  redis.call('PEXPIRE', places, place)
  if redis.call('ZRANGE', queue, 0, 0)[1] ~= id then
    return -1
  end
  redis.call('ZREMRANGEBYSCORE', calls, '-inf', now)
  local limit = tonumber(ARGV[k + 5])
  if limit > 0 and redis.call('ZCARD', calls) >= limit then
    return -1
  end
  local ready = math.max(
    tonumber(redis.call('HGET', pace, 'requests') or 0),
    tonumber(redis.call('HGET', pace, 'tokens') or 0))
  if ready > now then
    return math.max(1, math.ceil(ready - now))
  end
end
for c = 0, caps - 1 do
  local k = 4 * c
  local calls, pace, queue, places = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]
  local requests, budget = tonumber(ARGV[k + 6]), tonumber(ARGV[k + 7])
  local window = tonumber(ARGV[k + 8])
  local by_requests = tonumber(redis.call('HGET', pace, 'requests') or 0)
  local by_tokens = tonumber(redis.call('HGET', pace, 'tokens') or 0)
  if requests > 0 then
    by_requests = math.max(by_requests, now) + window / requests
  end
  if budget > 0 then
    by_tokens = math.max(by_tokens, now) + tokens * window / budget
  end
  redis.call('HSET', pace, 'requests', by_requests, 'tokens', by_tokens)
  redis.call('PEXPIRE', pace, math.ceil(math.max(by_requests, by_tokens) - now) + 1000)
  redis.call('ZADD', calls, now + hold, id)
  if redis.call('PTTL', calls) < hold then
    redis.call('PEXPIRE', calls, hold)
  end
  redis.call('ZREM', queue, id)
  redis.call('ZREM', places, id)
end
return 0
"""


class CapKeys(NamedTuple):
    """The Redis keys of one cap."""

    calls: str
    pace: str
    queue: str
    places: str


class RedisThrottle:
    """One cap per provider, and one per capped model, for the whole fleet, kept in Redis."""

    def __init__(
        self,
        client: redis.Redis,
        cap: Cap,
        model_caps: Mapping[str, Cap] | None = None,
        prefix: str = PREFIX,
        hold_margin_seconds: float = HOLD_MARGIN_SECONDS,
        place_seconds: float = PLACE_SECONDS,
    ) -> None:
        self.client = client
        self.cap = cap
        self.model_caps = dict(model_caps or {})
        self.prefix = prefix
        self.hold_margin_seconds = hold_margin_seconds
        self.place_seconds = place_seconds
        self._admit = client.register_script(_ADMIT)
        self._jitter = random.Random()

    def keys(self, provider: str, model: str | None = None) -> CapKeys:
        """The keys of a provider's cap, or of a model's cap at that provider."""
        return self._keys(cap_name(provider, model))

    def waiting(self, provider: str, model: str | None = None) -> int:
        """How many calls wait for the provider's cap, or for the model's at it."""
        return int(self.client.zcard(self.keys(provider, model).queue))

    def _keys(self, name: str) -> CapKeys:
        base = f"{self.prefix}:model-cap:{name}"
        return CapKeys(f"{base}:calls", f"{base}:pace", f"{base}:queue", f"{base}:places")

    @contextmanager
    def admit(
        self, provider: str, model: str, tokens: int, deadline: float, stop: threading.Event
    ) -> Iterator[Admission]:
        started = time.monotonic()
        named = caps_of(provider, model, self.cap, self.model_caps)
        if not named:
            yield Admission(0.0)
            return
        caps = [(self._keys(name), cap) for name, cap in named]
        holder = secrets.token_hex(8)
        note = None
        try:
            while (wait := self._try(caps, holder, tokens, deadline)) != 0:
                now = time.monotonic()
                if stop.is_set() or now >= deadline:
                    raise no_room(provider, now - started)
                if wait < 0:
                    # Spread the pollers, so that they do not all look at once.
                    pause = POLL_SECONDS * (0.8 + 0.4 * self._jitter.random())
                else:
                    # Only the head is told a time: nobody races it, so it sleeps no longer.
                    pause = min(wait / 1000, MAX_SLEEP_SECONDS)
                stop.wait(min(pause, deadline - now))
        except redis.RedisError as exc:
            note = f"the fleet's cap could not be reached ({type(exc).__name__}); sent uncapped"
            # Its places, if it took any, lapse by themselves: asking Redis again to
            # give them up would only hold the call back a second time.
            log.warning("model cap for %s: %s", provider, note)
        except BaseException:
            self._leave(caps, holder)
            raise
        if note is not None:
            yield Admission(time.monotonic() - started, note)
            return
        # Removing a member twice is harmless, so an early release needs no bookkeeping.
        release = functools.partial(self._release, [keys.calls for keys, _ in caps], holder)
        try:
            yield Admission(time.monotonic() - started, release=release)
        finally:
            release()

    def _try(
        self, caps: list[tuple[CapKeys, Cap]], holder: str, tokens: int, deadline: float
    ) -> int:
        hold = deadline - time.monotonic() + self.hold_margin_seconds
        limits: list[int] = []
        for _, cap in caps:
            limits += [
                cap.concurrent_calls,
                cap.requests_per_minute,
                cap.tokens_per_minute,
                max(1, int(cap.window_seconds * 1000)),
            ]
        return int(
            self._admit(
                keys=[key for keys, _ in caps for key in keys],
                args=[
                    holder,
                    tokens,
                    max(1, int(hold * 1000)),
                    max(1, int(self.place_seconds * 1000)),
                    *limits,
                ],
            )
        )

    def _leave(self, caps: list[tuple[CapKeys, Cap]], holder: str) -> None:
        """Give up the waiter's places, so those behind it need not wait for them to lapse."""
        try:
            with self.client.pipeline() as pipe:
                for keys, _ in caps:
                    pipe.zrem(keys.queue, holder)
                    pipe.zrem(keys.places, holder)
                pipe.execute()
        except redis.RedisError as exc:
            log.warning("model cap: could not give up a place (%s)", type(exc).__name__)

    def _release(self, calls: list[str], holder: str) -> None:
        try:
            with self.client.pipeline() as pipe:
                for key in calls:
                    pipe.zrem(key, holder)
                pipe.execute()
        except redis.RedisError as exc:
            # The hold expires by itself; until then the cap counts one call too many.
            log.warning("model cap: could not release a call (%s)", type(exc).__name__)
