"""The worker's broker transport: kombu's Redis transport, screening every message it pops.

Owns the rule of what a worker accepts off the broker before Celery sees it. Anyone who
can reach the broker's Redis can ``LPUSH`` bytes onto a queue; kombu's own transport
decodes them inside its event loop, where a non-JSON string or an envelope without a
``delivery_tag`` stops the whole worker. Here each message popped from a queue (through
redis-py's documented response-callback hook on ``BRPOP``) and each fanout message (the
control broadcasts) is checked first: its size, that it is JSON, that it is a kombu
envelope, that its content type is JSON, and, on a task queue, that it names a task this
worker runs and carries a Celery task body. A message that fails is dropped (it was
already popped, so nothing is redelivered) with one log line naming the queue and why.

It also reconnects within a fraction of a second of a broker's return, and keeps a
broker loss from stopping the worker later: kombu acknowledges,
rejects or restores a message through the channel it came on even after that channel's
connection is gone, and raises ``AttributeError`` out of the consumer (a kombu bug
known since 3.x). ``ClosingQoS`` leaves such a message in Redis's ``unacked`` set,
where the visibility timeout returns it (stale by then). A message requeued because
its pool child died goes back to the front of its queue, not behind every job queued
since: it is a recovery, like the reconciler's jobs (``worker.fleet.app``).

Trusts: nothing in a message. Its settings come from the worker's transport options.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from celery.app.amqp import AMQP
from kombu import Connection
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.objects import cached_property
from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger(__name__)

# A generation job is well under 4 KiB; anything near this bound is not one.
MAX_MESSAGE_BYTES = 256 * 1024


class _DeliveryInfo(BaseModel):
    exchange: str
    routing_key: str


class _Properties(BaseModel):
    delivery_tag: str
    body_encoding: Literal["base64"]
    delivery_info: _DeliveryInfo


class _Envelope(BaseModel):
    """The envelope kombu's Redis transport wraps every message in."""

    model_config = ConfigDict(populate_by_name=True)

    body: str
    content_type: str = Field(alias="content-type")
    content_encoding: str = Field(alias="content-encoding")
    headers: dict[str, Any]
    properties: _Properties


def problem(
    raw: bytes, *, tasks: frozenset[str] | None, max_bytes: int = MAX_MESSAGE_BYTES
) -> str | None:
    """Why the raw message ``raw`` must be dropped, or None if it may reach Celery.

    tasks: the task names the queue may carry, or None for a queue that carries no
    tasks (control broadcasts, events), where only the envelope is checked.
    """
    if len(raw) > max_bytes:
        return f"{len(raw)} bytes, over the {max_bytes}-byte limit"
    try:
        decoded = json.loads(raw)
    except ValueError:
        return "not JSON"
    return envelope_problem(decoded, tasks=tasks)


def envelope_problem(decoded: object, *, tasks: frozenset[str] | None) -> str | None:
    """Why the decoded message ``decoded`` must be dropped, or None (see ``problem``)."""
    try:
        envelope = _Envelope.model_validate(decoded)
    except ValidationError as exc:
        where = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'message'}: {e['msg']}" for e in exc.errors()[:3]
        )
        return f"not a kombu message envelope ({where})"
    if envelope.content_type != "application/json":
        return f"content type {envelope.content_type!r} refused: this fleet accepts JSON only"
    if tasks is None:
        return None
    task = envelope.headers.get("task")
    if not isinstance(task, str) or task not in tasks:
        return f"unknown task {str(task)[:80]!r}: this queue carries {', '.join(sorted(tasks))}"
    if not isinstance(envelope.headers.get("id"), str):
        return "no task id in the headers"
    return _body_problem(envelope.body)


def _body_problem(body: str) -> str | None:
    """A Celery task body (protocol 2) is base64 of the JSON ``[args, kwargs, embed]``."""
    try:
        decoded = json.loads(base64.b64decode(body, validate=True))
    except (binascii.Error, ValueError):
        return "the body is not base64-encoded JSON"
    shape_ok = (
        isinstance(decoded, list)
        and len(decoded) == 3
        and isinstance(decoded[0], list)
        and isinstance(decoded[1], dict)
        and isinstance(decoded[2], dict)
    )
    return None if shape_ok else "the body is not a Celery task body [args, kwargs, embed]"


class ClosingQoS(kombu_redis.QoS):
    """kombu's Redis QoS, which does not reach for a broker connection that is already gone,
    and requeues a rejected message at the front of its queue.

    A life that lands after the connection it was delivered on dropped is acknowledged
    (or requeued) through that dead channel; kombu then raises ``AttributeError`` out of
    the consumer and the worker exits. Here the message is only forgotten locally: it
    stays in Redis's ``unacked`` set, and the visibility timeout returns it, stale.
    """

    def _gone(self, what: str) -> bool:
        transport = self.channel.connection
        if transport is not None and transport.client is not None:
            return False
        log.warning(
            "cannot %s through a closed broker connection; the message comes back after "
            "the visibility timeout, stale",
            what,
        )
        return True

    def restore_unacked(self, client: Any = None) -> Any:
        return (
            None
            if self._gone("restore unacknowledged messages")
            else super().restore_unacked(client)
        )

    def ack(self, delivery_tag: str) -> None:
        if self._gone(f"acknowledge message {delivery_tag}"):
            self._quick_ack(delivery_tag)  # type: ignore[attr-defined]  # kombu's private API: not in the stubs
            return
        super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if self._gone(f"reject message {delivery_tag}"):
            self._quick_ack(delivery_tag)  # type: ignore[attr-defined]  # kombu's private API: not in the stubs
            return
        if not requeue:
            super().reject(delivery_tag)
            return
        # kombu requeues at the end BRPOP reaches last (leftmost); the front is the other.
        self.restore_by_tag(delivery_tag, leftmost=False)
        virtual.QoS.ack(self, delivery_tag)


class ScreeningChannel(kombu_redis.Channel):
    """A Redis channel that drops, with one log line, every message ``problem`` refuses."""

    QoS = ClosingQoS

    from_transport_options = (
        *kombu_redis.Channel.from_transport_options,
        "task_queues",
        "max_message_bytes",
    )
    # Queue name -> the task names it may carry; set from the worker's transport options.
    task_queues: ClassVar[dict[str, list[str]]] = {}
    max_message_bytes: int = MAX_MESSAGE_BYTES

    @cached_property
    def client(self) -> Any:
        """kombu's BRPOP client, with a response callback that screens what it pops."""
        client = self._create_client(asynchronous=True)  # type: ignore[attr-defined]  # kombu's private API: not in the stubs
        client.set_response_callback("BRPOP", self._screened_brpop)
        return client

    def _screened_brpop(self, response: Any, **_: Any) -> tuple[bytes, bytes] | None:
        # None makes kombu's _brpop_read raise Empty: the popped message is simply gone.
        if not response:
            return None
        key, raw = response
        queue = key.decode(errors="replace").rsplit(self.sep, 1)[0]
        allowed = self.task_queues.get(queue)
        why = problem(
            raw,
            tasks=frozenset(allowed) if allowed is not None else None,
            max_bytes=self.max_message_bytes,
        )
        if why is not None:
            log.error("dropped a message on queue %s: %s", queue, why)
            return None
        return key, raw

    # kombu's private hook for broadcasts (not in the stubs), screened like a queue's pop.
    def _deliver_fanout_message(self, message: Any, exchange: str) -> bool:
        why = envelope_problem(message, tasks=None)
        if why is not None:
            log.error("dropped a broadcast on exchange %s: %s", exchange, why)
            return False
        return bool(super()._deliver_fanout_message(message, exchange))  # type: ignore[misc]


class ScreeningTransport(kombu_redis.Transport):
    Channel = ScreeningChannel


class ScreeningConnection(Connection):
    """A kombu connection whose Redis transport (any URL spelling of it) screens messages,
    and which reconnects promptly after a broker restart.

    Celery's consumer reconnects with kombu's default pacing: 2 s after the first
    refusal, then 4, 6, ... up to 30 s apart. A restarted Redis is back within a second
    or two, and every second the consumer waits is a second in which no life starts;
    here the attempts come 0.25 s apart, growing to at most 2 s.
    """

    def get_transport_cls(self) -> type:
        cls: type = super().get_transport_cls()
        return ScreeningTransport if cls is kombu_redis.Transport else cls

    # The stubs type the intervals as int; kombu takes (and documents) seconds as floats.
    def ensure_connection(  # type: ignore[override]
        self,
        errback: Callable[..., Any] | None = None,
        max_retries: int | None = None,
        interval_start: float = 0.25,
        interval_step: float = 0.25,
        interval_max: float = 2.0,
        **kwargs: Any,
    ) -> Connection:
        return super().ensure_connection(
            errback,
            max_retries,  # type: ignore[arg-type]
            interval_start,  # type: ignore[arg-type]
            interval_step,  # type: ignore[arg-type]
            interval_max,  # type: ignore[arg-type]
            **kwargs,
        )


class ScreeningAMQP(AMQP):
    """Celery's AMQP layer on ``ScreeningConnection``; pass as ``Celery(amqp=...)``."""

    Connection: type[Connection] = ScreeningConnection
