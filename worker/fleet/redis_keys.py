"""The fleet's Redis: its client, the name of every key the fleet writes, and the repair
of a key someone else wrote with the wrong type.

Owns ``redis_client`` (the broker's Redis, optionally retrying through a restart), the
``*_key`` functions (each key's name is spelled once, here) and ``repairing``: a key of
another Redis type than the string the fleet writes there (which makes every command
on it fail with WRONGTYPE) is removed and the command run again, as if the key had been
absent. ``get_string`` and ``eval_script`` are the reads and scripts that repair so.
The keys' meaning belongs to their users: leases (``worker.fleet.leases``), in-flight
markers (``worker.fleet.markers``) and blocked markers (``worker.fleet.block_markers``).

Trusts nothing it reads back: anyone who reaches Redis may write these keys.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from redis.typing import EncodableT

from worker.fleet.settings import Settings

PREFIX = "ouroboros"
log = logging.getLogger(__name__)
# A worker's commands wait out a broker restart (about 12 s of retries): a life that
# lands while Redis restarts still releases its lease and sends its follow-up, instead
# of leaving its lineage to the lease's expiry and the reconciler's next pass.
OUTLAST_RESTART = Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=15)
BLOCKED_PREFIX = f"{PREFIX}:blocked:"
# Extends the key's expiry (ARGV[2] seconds) only while it still holds ARGV[1]: a
# lease's renewal, and an in-flight claim's.
EXPIRE_IF_HELD = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then "
    "return redis.call('expire', KEYS[1], ARGV[2]) end return 0"
)
_T = TypeVar("_T")


def lease_key(lineage: str) -> str:
    """The lineage's lease: the token of the process living its generation."""
    return f"{PREFIX}:lease:{lineage}"


def inflight_key(lineage: str) -> str:
    """The lineage's in-flight marker: the id of its one job queued or running."""
    return f"{PREFIX}:inflight:{lineage}"


def holder_key(lineage: str) -> str:
    """The record of the process keeping the lineage's in-flight marker alive."""
    return f"{PREFIX}:holder:{lineage}"


def host_holders_key(host: str) -> str:
    """The lineages whose holder record names a process of ``host`` (``holders.this_host``),
    each scored by when that record expires: what the host's sweep for dead holders
    reads instead of the whole keyspace. The one key of the fleet that is not a string
    (a sorted set): ``worker.fleet.markers`` repairs it itself."""
    return f"{PREFIX}:holders-on:{host}"


def blocked_key(lineage: str) -> str:
    """Why the lineage cannot advance here, while it is blocked."""
    return f"{BLOCKED_PREFIX}{lineage}"


def turn_key() -> str:
    """The fleet's reconcile turn: the token of the worker whose pass it is."""
    return f"{PREFIX}:reconcile-turn"


def cancel_key(lineage: str, run_id: str) -> str:
    """The fast-path flag of a cancelled run of the lineage."""
    return f"{PREFIX}:cancel:{lineage}:{run_id}"


# Run before a command's script, in the same atomic call: each of its keys that holds
# another type than string is removed (and named in the reply), so that neither a string
# the fleet wrote meanwhile (a marker, a lease) goes, nor a key of another type written
# again between a removal and the command (by anyone who keeps writing it) fails it anew.
_REMOVE_WRONG_TYPE = (
    "local removed = {} "
    "for _, key in ipairs(KEYS) do "
    "local kind = redis.call('type', key)['ok'] "
    "if kind ~= 'string' and kind ~= 'none' then "
    "redis.call('del', key) removed[#removed + 1] = key end end "
)
_GET = "return redis.call('get', KEYS[1])"


def repairing(
    client: redis.Redis,
    keys: Sequence[str | bytes],
    command: Callable[[], _T],
    script: str,
    *args: EncodableT,
) -> _T:
    """``command`` (which touches only ``keys``); if it met a key of the wrong type,
    ``script`` (on ``keys`` and ``args``, doing what ``command`` does) instead, in one
    atomic call after each of ``keys`` that is not a string is removed, each reported.

    Every key the fleet writes holds a string; one of another type was written by
    someone else (anyone who reaches Redis can), and left there it would make every
    command on it fail for good. Removed, it reads as absent: it could hold no job id
    or token of the fleet, so no job's marker and no holder's lease is lost with it.
    Removal and command are one script, so a writer who puts the key back between two
    commands cannot fail the second one too. Each script here reads all its keys before
    it writes any (a failing script keeps the writes it made), so the failed run
    changed nothing and the second is whole.
    """
    try:
        return command()
    except redis.ResponseError as exc:
        if not str(exc).startswith("WRONGTYPE"):
            raise
    repaired = f"{_REMOVE_WRONG_TYPE}local function run() {script} end return {{removed, run()}}"
    reply = client.eval(repaired, len(keys), *keys, *args)
    removed = set(reply[0])
    for key in keys:
        if (key.encode() if isinstance(key, str) else key) in removed:
            # Its name is anyone's: never logged raw.
            log.warning("removed a key of a type the fleet never writes: %r", key)
    # The script's reply stands for command()'s: Redis drops a trailing nil from the table.
    return cast(_T, reply[1] if len(reply) > 1 else None)


def get_string(client: redis.Redis, key: str | bytes) -> bytes | None:
    """The string at ``key``; None if there is none (a key of another type is removed)."""
    # The fleet's clients never decode responses: a string comes back as bytes.
    return cast("bytes | None", repairing(client, [key], lambda: client.get(key), _GET))


def eval_script(
    client: redis.Redis, script: str, keys: Sequence[str | bytes], *args: EncodableT
) -> object:
    """``script`` on ``keys``, repaired and run again if one of them is of the wrong type."""
    return repairing(
        client, keys, lambda: client.eval(script, len(keys), *keys, *args), script, *args
    )


def redis_client(
    settings: Settings, *, outlast_restart: bool = False, timeout: float | None = None
) -> redis.Redis:
    """A client for the broker's Redis (kombu's ``redis+socket://`` is redis-py's ``unix://``).

    outlast_restart: retry each command through a broker restart (the worker's
    clients). Every command sent through such a client must be safe to repeat: a
    command whose reply was lost may have been applied.
    timeout: the connect and socket timeouts, for a reader that must answer soon
    (the web process); by default 5 s to connect and 10 s per command.
    """
    url = settings.broker
    if url.startswith("redis+socket://"):
        url = "unix://" + url.removeprefix("redis+socket://")
    retry = (
        {"retry": OUTLAST_RESTART, "retry_on_error": [redis.exceptions.BusyLoadingError]}
        if outlast_restart
        else {}
    )
    return redis.Redis.from_url(
        url, socket_timeout=timeout or 10, socket_connect_timeout=timeout or 5, **retry
    )
