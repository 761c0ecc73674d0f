"""What each live worker can serve, advertised in Redis, and the re-check of blocked lineages.

Owns the advertisement of a worker (``Advert``: its Celery node name, the instrument
queue it consumes, the model providers it can serve now and when it started), kept
under ``ouroboros:worker:<node>`` with an expiry that the living worker renews, so a
dead worker's advertisement is gone within ``ADVERT_SECONDS``; the check ``run`` makes
with it before it records a run (``unservable``); and a worker's re-check of the
lineages blocked on its queue (``recheck``), which clears a marker as soon as this
worker finds its cause gone instead of leaving the lineage to wait out a timer.

A provider is served when the checks a job meets before its life pass here: the
provider's key present and usable (never read into the advertisement: only the
provider's name goes there), its base URL valid. Prices are not a worker's to know:
a run carries its own (``worker.fleet.runs.RunRecord.prices``).

Trusts nothing it reads back: anyone who reaches Redis may write these keys, so an
advertisement that is not one a worker writes (a naive start time included) is
removed and said once, never shown raw.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Literal

import redis
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from worker.fleet import block_markers, holders, redis_keys
from worker.instrument.errors import Refusal
from worker.instrument.model.catalogue import DEFAULT_MODELS, PROVIDER_NAMES
from worker.instrument.model.prices import Prices
from worker.instrument.settings import InstrumentSettings

# An advertisement outlives its worker by at most this long; renewed every third of it.
ADVERT_SECONDS = 30
_ADVERTS = f"{redis_keys.PREFIX}:worker:"
# The checks a job meets before its life, asked without a price: a run brings its own.
_ANY_PRICE = Prices(input_usd_per_mtok=Decimal(0), output_usd_per_mtok=Decimal(0))
log = logging.getLogger(__name__)


def advert_key(node: str) -> str:
    """The advertisement of the worker whose Celery node name is ``node``."""
    return f"{_ADVERTS}{node}"


class Advert(BaseModel):
    """A live worker: the queue it consumes and the providers it can serve now."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node: str = Field(pattern=r"^[A-Za-z0-9@._-]{1,200}$")
    queue: str = Field(pattern=r"^gen\.[0-9a-f]{12}$")
    providers: list[Literal[PROVIDER_NAMES]]  # type: ignore[valid-type]
    started: block_markers.UtcTime


def servable(settings: InstrumentSettings) -> list[str]:
    """The providers whose jobs this worker's settings and keys let it run now."""
    from worker.instrument.model.providers import make_provider

    served = []
    for name in PROVIDER_NAMES:
        try:
            # The model's name does not decide whether a provider can be reached here.
            make_provider(name, DEFAULT_MODELS.get(name, "any"), settings, _ANY_PRICE)
        except Refusal:
            continue
        served.append(name)
    return served


def advertise(client: redis.Redis, advert: Advert) -> None:
    client.set(advert_key(advert.node), advert.model_dump_json(), ex=ADVERT_SECONDS)


def withdraw(client: redis.Redis, node: str) -> None:
    client.delete(advert_key(node))


def adverts(client: redis.Redis, queue: str) -> list[Advert]:
    """The advertisements of the live workers consuming ``queue``."""
    found = []
    for key in client.scan_iter(f"{_ADVERTS}*"):
        try:
            value = client.get(key)
        except redis.ResponseError:
            continue  # another type: nothing to learn from it
        if value is None:
            continue  # expired meanwhile
        try:
            advert = Advert.model_validate_json(value)
        except ValidationError:
            # Not a worker's (a naive start time included): gone, and said once, rather
            # than read again at every turn of every reader.
            client.delete(key)
            log.warning("removed an advertisement that no worker wrote: %r", key)
            continue
        if advert.queue == queue and key.decode(errors="replace") == advert_key(advert.node):
            found.append(advert)
    return found


def unservable(client: redis.Redis, queue: str, provider: str) -> str | None:
    """Why no live worker on ``queue`` can serve ``provider``; None when one can, or when no
    worker advertises there at all (the run then waits for one, as ``status`` says)."""
    live = adverts(client, queue)
    if not live or any(provider in advert.providers for advert in live):
        return None
    nodes = ", ".join(sorted(advert.node for advert in live))
    return (
        f"no live worker on {queue} can serve provider {provider} (live: {nodes}; a worker "
        f"serves a provider whose key it has and whose base URL is valid): give a worker "
        f"its key or URL and restart it, or choose another --provider"
    )


def recheck(
    client: redis.Redis,
    advert: Advert,
    newly_served: set[str],
    enqueue: Callable[[str], object],
) -> list[str]:
    """Clear the blocked markers on this worker's queue whose cause this worker finds gone;
    each lineage cleared is enqueued at once (``enqueue``). The lineages cleared.

    A worker's refusal (a key missing there) is gone once this worker serves the
    provider it did not serve before, or started after the refusal. A provider's
    refusal (a wrong key, an unknown model) can only be known gone by trying: a worker
    started after it, serving the provider, tries once (a restart is how a key in the
    environment is changed). A pause is left to its retry time.
    """
    cleared = []
    for lineage, record in block_markers.blocks(client).items():
        if record.queue != advert.queue or record.provider not in advert.providers:
            continue
        restarted = advert.started > record.since
        if record.kind == "unavailable" or not (restarted or record.provider in newly_served):
            continue
        if record.kind == "refused" and not restarted:
            continue
        if block_markers.unblock(client, lineage, record):
            log.info(
                "%s: %s can serve %s now; cleared its block (%s)",
                lineage,
                advert.node,
                record.provider,
                record.reason,
            )
            enqueue(lineage)
            cleared.append(lineage)
    return cleared


def advertise_forever(
    node: str,
    queue: str,
    settings: InstrumentSettings,
    client: Callable[[], redis.Redis],
    enqueue: Callable[[str], object],
) -> None:
    """Keep this worker's advertisement alive and re-check the lineages blocked on its queue."""
    started = datetime.now(UTC)
    node = holders.node_name(node)
    served: set[str] | None = None
    while True:
        try:
            served = advertise_once(node, queue, settings, client(), started, served, enqueue)
        except redis.RedisError as exc:
            log.warning("cannot advertise this worker now (%s)", exc)
        except Exception:  # in a thread nobody joins: say it, and advertise again next turn
            log.exception("advertising this worker failed; trying again")
        time.sleep(ADVERT_SECONDS / 3)


def advertise_once(
    node: str,
    queue: str,
    settings: InstrumentSettings,
    client: redis.Redis,
    started: datetime,
    served: set[str] | None,
    enqueue: Callable[[str], object],
) -> set[str]:
    """One turn of ``advertise_forever``: advertise, then re-check; the providers served now.

    served: the providers served at the previous turn (None at the first): one served
    now and not then is a fix (a key file that appeared) the blocked lineages can use.
    """
    now = set(servable(settings))
    advert = Advert(node=node, queue=queue, providers=sorted(now), started=started)
    advertise(client, advert)
    recheck(client, advert, now - served if served is not None else set(), enqueue)
    return now
