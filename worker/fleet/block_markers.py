"""Blocked markers: why a lineage cannot advance, which run and provider it concerns, and
when it is tried again.

Owns ``Block`` and its key: never tried again for a provider's refusal (until a new
run, ``cancel`` or a worker's re-check clears it), else at its retry time. The rules
that set and clear one are ``worker.fleet.blocks``'.

Trusts nothing it reads back: a blocked marker that is not a ``Block`` (a naive time in
it included: ``UtcTime``) is removed and said once.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Annotated, Literal

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

from worker.fleet.redis_keys import BLOCKED_PREFIX, blocked_key, eval_script, get_string
from worker.instrument.model.catalogue import PROVIDER_NAMES
from worker.instrument.names import is_lineage_name

log = logging.getLogger(__name__)


def _in_utc(value: datetime) -> datetime:
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError("out of range in UTC") from None


# A time read back from Redis: with its offset (a naive one cannot be compared with the
# fleet's own, and would crash every reader that did), and said in UTC.
UtcTime = Annotated[AwareDatetime, AfterValidator(_in_utc)]


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
    for key in client.scan_iter(f"{BLOCKED_PREFIX}*"):
        lineage = key.decode(errors="replace").removeprefix(BLOCKED_PREFIX)
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
        return get_string(client, blocked_key(lineage)) is not None and bool(
            client.delete(blocked_key(lineage))
        )
    return bool(eval_script(client, _UNBLOCK, [blocked_key(lineage)], record.model_dump_json()))


def _block_at(client: redis.Redis, key: str | bytes) -> Block | None:
    value = get_string(client, key)
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
