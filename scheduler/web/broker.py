"""What the broker says about the fleet, read in one pass for the web process.

Owns ``BrokerFigures`` (each fleet lineage's in-flight, lease and blocked markers,
what blocks each lineage in words, and each queue's depth) and ``read_broker``, the
pass a ``scheduler.web.probes.Probe`` runs in the background: the overview's blocks
and ``/metrics``' broker figures both come from its latest answer, so a page view or
a scrape never waits on the broker itself. Every call is bounded by short connect
and socket timeouts (``TIMEOUT_SECONDS``), so a broker that accepts and never
answers ends a pass as "did not answer". The embedded broker is never started here:
when it is not running, the pass fails as a broker that is down.

Trusts: the settings' broker, and the reader's shared repository for which lineages
and queues to ask about.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis
from celery import Celery
from kombu.exceptions import ChannelError

from scheduler.reader import Reader
from worker.fleet import block_markers, embedded_redis, leases, markers, redis_keys
from worker.fleet.app import CONTROL_QUEUE, client_app
from worker.fleet.settings import Settings
from worker.instrument.names import queue_name

TIMEOUT_SECONDS = 1.0


class BrokerDown(Exception):
    """The broker cannot be asked: none configured, or the embedded one is not running."""


@dataclass(frozen=True)
class Marks:
    """One lineage's markers in the broker."""

    in_flight: bool
    running: bool
    blocked: bool


@dataclass(frozen=True)
class BrokerFigures:
    """One pass over the broker: markers per fleet lineage, blocks in words, queue depths."""

    marks: dict[str, Marks] = field(default_factory=dict)
    blocks: dict[str, str] = field(default_factory=dict)
    depths: dict[str, int] = field(default_factory=dict)


def fleet_queues(reader: Reader) -> dict[str, str]:
    """Each fleet lineage's instrument queue, from the shared repository alone."""
    return {
        name: queue_name(meta.instrument_fingerprint)
        for name, meta in reader.metadata().items()
        if meta is not None
    }


class BrokerReader:
    """``read`` makes one pass over the broker; the clients are built once and reused."""

    def __init__(self, settings: Settings | None, reader: Reader) -> None:
        self.settings = settings
        self.reader = reader
        self._client: redis.Redis | None = None
        self._app: Celery | None = None

    def read(self) -> BrokerFigures:
        settings = self.settings
        if settings is None:
            raise BrokerDown("no broker is configured")
        if not settings.broker_url and not embedded_redis.running(settings):
            raise BrokerDown("the embedded broker is not running")
        if self._client is None:
            self._client = redis_keys.redis_client(settings, timeout=TIMEOUT_SECONDS)
        client = self._client
        queues = fleet_queues(self.reader)
        marks = {
            name: Marks(
                in_flight=markers.in_flight(client, name) is not None,
                running=leases.lease_held(client, name),
                # Not one being tried again now (its retry time has come).
                blocked=block_markers.blocking(client, name) is not None,
            )
            for name in sorted(queues)
        }
        blocks = {name: record.describe() for name, record in block_markers.blocks(client).items()}
        depths = self._depths(settings, sorted({CONTROL_QUEUE, *queues.values()}))
        return BrokerFigures(marks=marks, blocks=blocks, depths=depths)

    def _depths(self, settings: Settings, queues: list[str]) -> dict[str, int]:
        if self._app is None:
            self._app = client_app(settings)
            self._app.conf.broker_transport_options = {
                **self._app.conf.broker_transport_options,
                "socket_timeout": TIMEOUT_SECONDS,
                "socket_connect_timeout": TIMEOUT_SECONDS,
            }
        depths = {}
        with self._app.connection_for_read() as connection:
            connection.ensure_connection(
                max_retries=1,
                interval_start=0,
                interval_step=0,
                timeout=TIMEOUT_SECONDS,  # type: ignore[arg-type]
            )
            channel = connection.default_channel
            for queue in queues:
                try:
                    # kombu's channels declare queues; the stubs' StdChannel lacks the method.
                    declared = channel.queue_declare(queue=queue, passive=True)  # type: ignore[attr-defined]
                    depths[queue] = int(declared.message_count)
                except ChannelError:  # the transport deletes a queue's list once it is empty
                    depths[queue] = 0
        return depths
