"""Coordination markers in Redis: leases with their heartbeat, in-flight and blocked markers.

Owns the Redis keys that save wasted work: a per-lineage lease held while a
generation runs (so a duplicated message does not run the same life twice), an
in-flight marker set when a job is enqueued (so the reconciler does not enqueue a
second one) and a blocked marker (``Block``): why a lineage cannot advance, which run
and provider it concerns, and when it is tried again (never, for a provider's refusal:
until a new run, ``cancel`` or a worker's re-check clears it).

The fleet's reconcile turn (``Turn``) is a key of the same kind: every worker asks
for it every reconcile interval, and the one that gets it runs the pass.

A lease names its holder (host, boot, pid, the process's start time and its pid
namespace), so the redelivered copy of a job whose pool child was killed takes over the dead
holder's lease at once instead of waiting for it to expire; a holder on another host
(or in another pid namespace of this one) is only ever outlived by its lease's expiry.
Once a worker has fetched a job, the job's marker lives ``lease_seconds`` from then
on, renewed by the worker while it holds the message (``keep_marker``) and by the
lease's heartbeat while the life runs: a worker killed between fetching a job and
starting it is noticed as soon as one that dies mid-life.
Whoever keeps a marker alive (the main process that fetched the job, then the pool
child living it) is named in a holder record beside it, so any process on the same
host can see at once that the holder died and release its marker and lease
(``release_dead_holders``) instead of waiting for them to expire.

Trusts nothing it reads back: anyone who reaches Redis may write these keys, so a
holder record whose names are not the fleet's is removed, never logged raw or planned,
and a key of another Redis type than the string the fleet writes there (which makes
every command on it fail with WRONGTYPE) is removed and the command run again, as if
the key had been absent (``_repairing``), and a blocked marker that is not a ``Block``
(a naive time in it included: ``UtcTime``) is removed and said once. Each key's name
is spelled once, in the ``*_key`` functions below.

Correctness never rests on these: the compare-and-swap push and the write-once
observation make a lost lease or marker harmless. Losing all of Redis loses only
these hints; the reconciler rebuilds progress from the repository and the store.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Literal, TypeVar, cast

import redis
from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from redis.typing import EncodableT

from worker.fleet.settings import Settings
from worker.instrument.model.catalogue import PROVIDER_NAMES
from worker.instrument.names import is_lineage_name

PREFIX = "ouroboros"
log = logging.getLogger("ouroboros.worker")
# A worker's commands wait out a broker restart (about 12 s of retries): a life that
# lands while Redis restarts still releases its lease and sends its follow-up, instead
# of leaving its lineage to the lease's expiry and the reconciler's next pass.
OUTLAST_RESTART = Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=15)
# What a holder record may hold, read back from a Redis anyone on the network may write:
# the worker's own job ids (``lineage.commit12.hex``), Celery's uuids, and holder names.
_JOB_ID = re.compile(r"[A-Za-z0-9._-]{1,200}")
# A pid is at most pid_max (2**22): seven digits.
_PID = re.compile(r"[0-9]{1,7}")
_HOLDERS = f"{PREFIX}:holder:"
_BLOCKED = f"{PREFIX}:blocked:"
_T = TypeVar("_T")


def _in_utc(value: datetime) -> datetime:
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError("out of range in UTC") from None


# A time read back from Redis: with its offset (a naive one cannot be compared with the
# fleet's own, and would crash every reader that did), and said in UTC.
UtcTime = Annotated[AwareDatetime, AfterValidator(_in_utc)]


def lease_key(lineage: str) -> str:
    """The lineage's lease: the token of the process living its generation."""
    return f"{PREFIX}:lease:{lineage}"


def inflight_key(lineage: str) -> str:
    """The lineage's in-flight marker: the id of its one job queued or running."""
    return f"{PREFIX}:inflight:{lineage}"


def holder_key(lineage: str) -> str:
    """The record of the process keeping the lineage's in-flight marker alive."""
    return f"{_HOLDERS}{lineage}"


def blocked_key(lineage: str) -> str:
    """Why the lineage cannot advance here, while it is blocked."""
    return f"{_BLOCKED}{lineage}"


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


def _repairing(
    client: redis.Redis,
    keys: Sequence[str | bytes],
    command: Callable[[], _T],
    script: str,
    *args: EncodableT,
) -> _T:
    """``command`` (which touches only ``keys``); if it met a key of the wrong type,
    ``script`` (on ``keys`` and ``args``, doing what ``command`` does) instead, in one
    atomic call after each of ``keys`` that is not a string is removed, each reported.

    Every key of this module holds a string; one of another type was written by
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


def _get(client: redis.Redis, key: str | bytes) -> bytes | None:
    """The string at ``key``; None if there is none (a key of another type is removed)."""
    # The fleet's clients never decode responses: a string comes back as bytes.
    return cast("bytes | None", _repairing(client, [key], lambda: client.get(key), _GET))


def _eval(
    client: redis.Redis, script: str, keys: Sequence[str | bytes], *args: EncodableT
) -> object:
    """``script`` on ``keys``, repaired and run again if one of them is of the wrong type."""
    return _repairing(
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


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot, None if it is gone.

    A zombie is gone: a worker killed with its pool stays one until something reaps it,
    which in a container whose init reaps lazily (or never) may take a long while.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its end.
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown-boot"


def _pid_namespace() -> str:
    """This process's pid namespace: two containers may share a hostname and a kernel."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "unknown-pidns"


def holder_name(pid: int | None = None) -> str:
    """This process as a lease holder: host, boot, pid, start time (a reused pid differs)
    and pid namespace.

    The namespace comes last: a worker of an earlier release on the same host reads
    the first four fields only, and so still finds this holder alive.
    """
    pid = pid or os.getpid()
    return f"{socket.gethostname()}:{_boot_id()}:{pid}:{_start_time(pid)}:{_pid_namespace()}"


def node_name(hostname: str | None) -> str:
    """A Celery node name as the records here hold one: what no pattern of theirs takes is
    replaced (a host may be named anything)."""
    return re.sub(r"[^A-Za-z0-9@._-]", "_", hostname or "unknown")[:200]


def holder_dead(token: str) -> bool:
    """True if ``token``'s holder ran on this host, since this boot, in this pid namespace,
    and is gone. A holder this process cannot see (another pid namespace) is not dead."""
    host, boot, pid, started, pidns = [*token.rsplit("/", 1)[0].split(":"), *[""] * 5][:5]
    if (host, boot, pidns) != (socket.gethostname(), _boot_id(), _pid_namespace()):
        return False
    if not _PID.fullmatch(pid):
        return False
    return _start_time(int(pid)) != started


class Lease:
    """An expiring per-lineage lock; release only removes the holder's own lease."""

    _RELEASE = (
        "if redis.call('get', KEYS[1]) == ARGV[1] then "
        "return redis.call('del', KEYS[1]) end return 0"
    )

    def __init__(self, client: redis.Redis, lineage: str, ttl_seconds: int) -> None:
        self.client = client
        self.key = lease_key(lineage)
        self.ttl = ttl_seconds
        self.token = f"{holder_name()}/{secrets.token_hex(8)}"

    _RENEW = (
        "if redis.call('get', KEYS[1]) == ARGV[1] then "
        "return redis.call('expire', KEYS[1], ARGV[2]) end return 0"
    )

    # Repeated after its reply was lost, the take-over finds the lease already its own.
    _TAKE_OVER = (
        "local current = redis.call('get', KEYS[1]) "
        "if current == ARGV[2] then return 1 end "
        "if current == ARGV[1] then "
        "return redis.call('set', KEYS[1], ARGV[2], 'EX', ARGV[3]) end return 0"
    )

    def acquire(self) -> bool:
        """Take the lease if it is free, or if its holder died on this very host."""
        # A key of another type fails no SET NX (it is taken for a holder), but the read
        # below removes it: the lease is then free, and taken if it is still free.
        if self.client.set(self.key, self.token, nx=True, ex=self.ttl):
            return True
        current = _get(self.client, self.key)
        if current is None:
            return bool(self.client.set(self.key, self.token, nx=True, ex=self.ttl))
        if current == self.token.encode():
            return True  # a retried SET whose first reply was lost had taken it
        if not holder_dead(current.decode(errors="replace")):
            return False
        if not _eval(self.client, self._TAKE_OVER, [self.key], current, self.token, self.ttl):
            return False
        # The token is anyone's (its start time, and all after its fifth field, are not
        # read by holder_dead): never logged raw.
        log.warning(
            "%s: took over the lease of a dead holder (%r)",
            self.key.rsplit(":", 1)[1],
            current.decode(errors="replace").rsplit("/", 1)[0],
        )
        return True

    def renew(self) -> bool:
        return bool(_eval(self.client, self._RENEW, [self.key], self.token, self.ttl))

    def release(self) -> None:
        _eval(self.client, self._RELEASE, [self.key], self.token)


class Turn:
    """The fleet's reconcile turn: one pass at a time across every worker, one per interval.

    Taken for ``seconds`` and never released: the next turn, by whichever worker asks
    first, comes once it expires. The pass extends it while it runs (``keep``), so a
    slow pass is never joined by a second one; a worker killed mid-pass leaves it to
    expire within ``seconds``.
    """

    _KEEP = (
        "if redis.call('get', KEYS[1]) == ARGV[1] then "
        "return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
    )

    def __init__(self, client: redis.Redis, seconds: float) -> None:
        self.client = client
        self.key = turn_key()
        self.ms = max(1, round(seconds * 1000))
        self.token = f"{holder_name()}/{secrets.token_hex(8)}"

    def take(self) -> bool:
        if self.client.set(self.key, self.token, nx=True, px=self.ms):
            return True
        # A key of another type would keep every worker from its turn for good: the
        # read removes it, and the turn is then free.
        if _get(self.client, self.key) is None:
            return bool(self.client.set(self.key, self.token, nx=True, px=self.ms))
        return False

    def keep(self) -> None:
        _eval(self.client, self._KEEP, [self.key], self.token, self.ms)


class LeaseBusy(Exception):
    """Another worker holds the lineage's lease: this job must not run its life now."""


@contextmanager
def holding(client: redis.Redis, lineage: str, job_id: str, ttl_seconds: int) -> Iterator[Lease]:
    """Hold the lineage's lease and running marker for ``job_id`` while the block runs.

    A heartbeat thread renews both every third of ``ttl_seconds``, so a worker that
    dies is noticed within ``ttl_seconds``; on leaving, the heartbeat stops and both
    are released (only if still ours). Raises LeaseBusy, running nothing, when another
    holder has the lease.
    """
    lease = Lease(client, lineage, ttl_seconds)
    if not lease.acquire():
        raise LeaseBusy(f"{lineage}: another worker holds the lease")
    claim_running(client, lineage, job_id, ttl_seconds)
    done = threading.Event()
    heart = threading.Thread(
        target=_heartbeat, args=(lease, lineage, job_id, done), name=f"lease-{lineage}", daemon=True
    )
    heart.start()
    try:
        yield lease
    finally:
        done.set()
        heart.join()
        try:
            clear_in_flight(client, lineage, job_id)
            lease.release()
        except redis.RedisError as exc:
            # The broker is away: both expire within ttl_seconds on their own.
            log.warning("%s: could not release the lease of %s (%s)", lineage, job_id, exc)


def _heartbeat(lease: Lease, lineage: str, job_id: str, done: threading.Event) -> None:
    """Keep the lease and the running marker alive until ``done``."""
    while not done.wait(lease.ttl / 3):
        try:
            # A holder that lost its lease must not overwrite the new holder's marker.
            if lease.renew():
                claim_running(lease.client, lineage, job_id, lease.ttl)
            else:
                log.warning(
                    "%s: the lease of %s was lost; not renewing its marker", lineage, job_id
                )
        except redis.RedisError as exc:  # a broker hiccup: correctness never rests on the lease
            log.warning("%s: lease renewal failed (%s)", lineage, exc)


def lease_held(client: redis.Redis, lineage: str) -> bool:
    # Read, not EXISTS: a key of another type holds no lease, and would keep the
    # reconciler away from the lineage for good.
    return _get(client, lease_key(lineage)) is not None


_MARK = (
    "if redis.call('set', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then return 1 end "
    "if redis.call('get', KEYS[1]) == ARGV[1] then "
    "redis.call('expire', KEYS[1], ARGV[2]) return 1 end return 0"
)


def mark_in_flight(client: redis.Redis, lineage: str, job_id: str, ttl_seconds: int) -> bool:
    """Claim the lineage's single in-flight slot for ``job_id``; False if another job has it.

    Repeating it for the same ``job_id`` succeeds again and sets the expiry anew (a
    retried command).
    """
    return bool(_eval(client, _MARK, [inflight_key(lineage)], job_id, ttl_seconds))


def extend_in_flight(client: redis.Redis, lineage: str, job_id: str, ttl_seconds: int) -> bool:
    """Make ``job_id``'s claim (only if it still stands) expire ``ttl_seconds`` from now.

    Never makes the claim anew: a job fetched, lived and cleared before its sender got
    here is over, and a claim made for it would keep its lineage waiting for nothing.
    """
    return bool(_eval(client, Lease._RENEW, [inflight_key(lineage)], job_id, ttl_seconds))


def _holder_record(job_id: str) -> str:
    # Job ids and holder names hold no space: the first space ends the job id.
    return f"{job_id} {holder_name()}"


def claim_running(client: redis.Redis, lineage: str, job_id: str, ttl_seconds: int) -> None:
    """Mark ``job_id`` as the lineage's running job, for as long as its heartbeat lasts."""
    # SET replaces a key of any type: no WRONGTYPE to meet here.
    with client.pipeline() as pipe:
        pipe.set(inflight_key(lineage), job_id, ex=ttl_seconds)
        pipe.set(holder_key(lineage), _holder_record(job_id), ex=ttl_seconds)
        pipe.execute()


_KEEP = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then "
    "redis.call('expire', KEYS[1], ARGV[3]) "
    "return redis.call('set', KEYS[2], ARGV[2], 'EX', ARGV[3]) end return 0"
)


def keep_marker(client: redis.Redis, lineage: str, job_id: str, ttl_seconds: int) -> bool:
    """Make ``job_id``'s marker (if it is still the lineage's) expire ``ttl_seconds`` from now.

    This process becomes its holder: should it die, ``release_dead_holders`` frees the marker.
    """
    keys = [inflight_key(lineage), holder_key(lineage)]
    return bool(_eval(client, _KEEP, keys, job_id, _holder_record(job_id), ttl_seconds))


def in_flight(client: redis.Redis, lineage: str) -> str | None:
    value = _get(client, inflight_key(lineage))
    return value.decode() if value else None


def holder_record(client: redis.Redis, lineage: str) -> str | None:
    """The lineage's holder record: ``<job id> <holder name>``, as anyone may have written it."""
    value = _get(client, holder_key(lineage))
    return value.decode(errors="replace") if value else None


# Both read before either goes (see _repairing).
_CLEAR = (
    "local marker = redis.call('get', KEYS[1]) "
    "local holder = redis.call('get', KEYS[2]) "
    "if marker == ARGV[1] then redis.call('del', KEYS[1]) end "
    "if holder and string.find(holder, ARGV[1] .. ' ', 1, true) == 1 then "
    "redis.call('del', KEYS[2]) end return 0"
)


def clear_in_flight(client: redis.Redis, lineage: str, job_id: str) -> None:
    _eval(client, _CLEAR, [inflight_key(lineage), holder_key(lineage)], job_id)


# Only if the holder record is still the dead one: its marker, and the lease if the
# dead process holds it, go with it. All three are read before any goes (see _repairing).
_RELEASE_DEAD = (
    "if redis.call('get', KEYS[1]) ~= ARGV[1] then return 0 end "
    "local marker = redis.call('get', KEYS[2]) "
    "local lease = redis.call('get', KEYS[3]) "
    "redis.call('del', KEYS[1]) "
    "if marker == ARGV[2] then redis.call('del', KEYS[2]) end "
    "if lease and string.find(lease, ARGV[3], 1, true) == 1 then redis.call('del', KEYS[3]) end "
    "return 1"
)


def release_dead_holders(client: redis.Redis) -> list[tuple[str, str]]:
    """Free the marker (and lease) of every job whose holder died on this host.

    A worker killed after fetching a job, or a pool child killed mid-life, leaves both
    alive until they expire (``lease_seconds``); on its own host its death is certain at
    once (``holder_dead``), and the caller re-enqueues the lineage (the worker's sweep
    does so at once, else the reconciler's next pass).
    Returns (lineage, job id) of each job released. A holder on another host is left to
    expire: only its own host can tell it is gone.
    """
    released = []
    for key in client.scan_iter(f"{_HOLDERS}*"):
        record = _get(client, key)
        if record is None:
            continue
        job_id, _, holder = record.decode(errors="replace").partition(" ")
        lineage = key.decode(errors="replace").removeprefix(_HOLDERS)
        if not (is_lineage_name(lineage) and _JOB_ID.fullmatch(job_id) and holder.isprintable()):
            # Written by someone else (anyone who reaches Redis can): its names must reach
            # neither a log line raw nor the planner. Gone, it is reported once.
            client.delete(key)
            log.warning("removed a holder record that no worker wrote: %r", key)
            continue
        if not holder_dead(holder):
            continue
        keys = [key, inflight_key(lineage), lease_key(lineage)]
        if _eval(client, _RELEASE_DEAD, keys, record, job_id, f"{holder}/"):
            log.warning(
                "%s: released job %s, whose holder (%s) died on this host", lineage, job_id, holder
            )
            released.append((lineage, job_id))
    return released


def request_cancel(client: redis.Redis, lineage: str, run_id: str, ttl_seconds: int) -> None:
    """Fast path of a cancellation; the durable record is the run object in the store."""
    client.set(cancel_key(lineage, run_id), "1", ex=ttl_seconds)


def cancel_requested(client: redis.Redis, lineage: str, run_id: str) -> bool:
    # Read, not EXISTS: a key of another type is no cancellation, and would have every
    # job of the run dropped unrun (and the run's next job sent, and dropped, again).
    return _get(client, cancel_key(lineage, run_id)) is not None


# What blocks a lineage: a worker refused its job (a key, a price or the instrument
# missing there), the provider refused the generation's calls (401, 403, 404, an unknown
# model), or the provider stayed unavailable through every retry (the run is paused).
BlockKind = Literal["worker", "refused", "unavailable"]
# A marker that is tried again is kept this long past its retry time, so the next pause
# of the same run finds how many came before it, and status says it is being retried.
_KEPT_AFTER_RETRY_SECONDS = 24 * 3600


class Block(BaseModel):
    """Why a lineage cannot advance now, for which run and provider, and until when."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: BlockKind
    reason: str = Field(min_length=1, max_length=1000)
    run_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]{1,80}$")
    provider: Literal[PROVIDER_NAMES]  # type: ignore[valid-type]
    queue: str = Field(pattern=r"^gen\.[0-9a-f]{12}$")
    # The worker that set it (its Celery node name).
    node: str = Field(pattern=r"^[A-Za-z0-9@._-]{1,200}$")
    since: UtcTime
    # When the lineage is planned again by itself; None: only once the cause is fixed.
    retry_at: UtcTime | None = None
    # How many pauses of this run came one after another (each one twice as long).
    pauses: int = Field(0, ge=0, le=64)

    @field_validator("reason")
    @classmethod
    def _one_printable_line(cls, value: str) -> str:
        # Read back from a Redis anyone may write, and shown on terminals and pages.
        if not value.isprintable():
            raise ValueError("not one printable line")
        return value

    def due(self, now: datetime | None = None) -> bool:
        """Whether its retry time has come (never, for one that waits for a fix)."""
        return self.retry_at is not None and self.retry_at <= (now or datetime.now(UTC))

    def describe(self) -> str:
        """What blocks the lineage, and when or how it is tried again, in one line."""
        if self.retry_at is None:
            when = ""
        elif self.due():
            when = "; being retried now"
        else:
            when = f"; retried at {self.retry_at:%Y-%m-%d %H:%M:%S} UTC"
        if self.kind == "refused":
            return (
                f"blocked: the {self.provider} provider refused: {self.reason}; fix it and "
                "restart the workers, start a new run, or cancel the run"
            )
        if self.kind == "unavailable":
            return f"paused: the {self.provider} provider is unavailable: {self.reason}{when}"
        return f"blocked: worker {self.node} refused: {self.reason}{when}"


def block(client: redis.Redis, lineage: str, record: Block) -> None:
    """Mark ``lineage`` blocked; kept until a fix clears it, or a day past its retry time."""
    value = record.model_dump_json()
    if record.retry_at is None:
        client.set(blocked_key(lineage), value)
        return
    left = (record.retry_at - datetime.now(UTC)).total_seconds()
    client.set(blocked_key(lineage), value, ex=max(1, int(left)) + _KEPT_AFTER_RETRY_SECONDS)


def blocked(client: redis.Redis, lineage: str) -> Block | None:
    """The lineage's blocked marker, if there is one (one no worker wrote is removed)."""
    return _block_at(client, blocked_key(lineage))


def blocking(client: redis.Redis, lineage: str) -> Block | None:
    """The lineage's blocked marker while it still holds the lineage back (not yet due)."""
    record = blocked(client, lineage)
    return None if record is None or record.due() else record


def blocks(client: redis.Redis) -> dict[str, Block]:
    """Every lineage's blocked marker."""
    found = {}
    for key in client.scan_iter(f"{_BLOCKED}*"):
        lineage = key.decode(errors="replace").removeprefix(_BLOCKED)
        if not is_lineage_name(lineage):
            client.delete(key)
            log.warning("removed a blocked marker that no worker wrote: %r", key)
            continue
        record = _block_at(client, key)
        if record is not None:
            found[lineage] = record
    return found


_UNBLOCK = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
)


def unblock(client: redis.Redis, lineage: str, record: Block | None = None) -> bool:
    """Clear the lineage's blocked marker (only if it is still ``record``, when given)."""
    if record is None:
        # Read first: a key of another type is removed (and said) like any other here.
        return _get(client, blocked_key(lineage)) is not None and bool(
            client.delete(blocked_key(lineage))
        )
    return bool(_eval(client, _UNBLOCK, [blocked_key(lineage)], record.model_dump_json()))


def _block_at(client: redis.Redis, key: str | bytes) -> Block | None:
    value = _get(client, key)
    if value is None:
        return None
    try:
        return Block.model_validate_json(value)
    except ValidationError:
        # Written by someone else, or by an older release (a bare reason): never shown
        # raw, and gone at once rather than blocking the lineage for good.
        client.delete(key)
        log.warning("removed a blocked marker that is not a worker's: %r", key)
        return None
