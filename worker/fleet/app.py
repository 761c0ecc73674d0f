"""The fleet's Celery configuration, and a client app for whoever only sends or inspects.

Owns the broker settings every Celery app of the fleet shares (JSON only, late acks,
requeue on a lost pool child, prefetch 1, a visibility timeout above any life plus
publication, connection retry, task events for Flower), the task and queue names
with their bindings (each queue on a direct exchange of its own name), and
``send_job`` with the job's place in its queue, ``send_replay`` (a replay job, on the
same queue, holding no lease), where the transport keeps delivered
messages (``unacked_keys``, for ``worker.fleet.orphans``): a job the reconciler recovers goes
ahead of every job already queued, so a lineage a fault stopped does not also wait
behind the queued work of every other lineage. A lost broker connection does not
cancel the lives in progress: each lands through the compare-and-swap push and the
write-once observation, and the redelivery that may follow finds the lineage moved
on (stale) or held (busy).

The scheduler, the web UI and the reconciler build a client app
here, which loads no instrument: only ``worker.fleet.tasks`` (through
``worker.celery``) builds the app that runs generations.

Trusts: its settings and the broker.
"""

from __future__ import annotations

from typing import Any, cast

from celery import Celery
from celery.app.amqp import AMQP
from kombu import Exchange, Queue

from worker.fleet.orphans import Unacked
from worker.fleet.planner import Send
from worker.fleet.settings import Settings
from worker.instrument.job import GenerationJob, ReplayJob

GENERATION_TASK = "ouroboros.generation"
RECONCILE_TASK = "ouroboros.reconcile"
REPLAY_TASK = "ouroboros.replay"
CONTROL_QUEUE = "ouroboros.control"
# A soft time limit leaves this much of the hard one to clean up.
SOFT_LIMIT_MARGIN_SECONDS = 30
# kombu's Redis transport pops priority 0 before 3 (one list per step of its default
# priority_steps, every worker polls them all): ordinary jobs wait at 3, a recovered
# one at 0, ahead of them.
RECOVERED_PRIORITY = 0
QUEUED_PRIORITY = 3


def client_app(settings: Settings, amqp: type[AMQP] | None = None) -> Celery:
    """A Celery app bound to the fleet's broker, with no task of its own."""
    app = Celery("ouroboros", broker=settings.broker, set_as_current=False, amqp=amqp)
    app.conf.update(
        accept_content=["json"],
        task_serializer="json",
        result_serializer="json",
        event_serializer="json",
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_concurrency=settings.concurrency,
        # A blip must not throw away a paid life: correctness rests on the push and the
        # observation, so the life lands and its redelivery is harmlessly stale or busy.
        worker_cancel_long_running_tasks_on_connection_loss=False,
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": settings.visibility_timeout_seconds},
        worker_send_task_events=True,
        task_send_sent_event=True,
        task_default_queue=CONTROL_QUEUE,
        task_default_exchange=CONTROL_QUEUE,
        task_default_routing_key=CONTROL_QUEUE,
        task_routes={RECONCILE_TASK: {"queue": CONTROL_QUEUE}},
        beat_schedule={
            "reconcile": {"task": RECONCILE_TASK, "schedule": settings.reconcile_interval_seconds}
        },
    )
    return app


def serve(app: Celery, instrument_queue: str) -> None:
    """Make ``app`` consume its instrument's queue and the control queue."""
    app.conf.task_queues = tuple(
        Queue(name, Exchange(name, type="direct"), routing_key=name)
        for name in (instrument_queue, CONTROL_QUEUE)
    )


def sender(app: Celery) -> Send:
    """The ``send`` of a Planner: one generation job onto its instrument's queue."""

    def send_job(
        job: GenerationJob, job_id: str, queue: str, time_limit: int, first: bool = False
    ) -> None:
        app.send_task(
            GENERATION_TASK,
            kwargs={"payload": job.model_dump(mode="json")},
            task_id=job_id,
            queue=queue,
            time_limit=time_limit,
            soft_time_limit=time_limit - SOFT_LIMIT_MARGIN_SECONDS,
            priority=RECOVERED_PRIORITY if first else QUEUED_PRIORITY,
        )

    return send_job


def send_replay(app: Celery, job: ReplayJob, queue: str, time_limit: int) -> None:
    """One replay job onto its instrument's queue (never a lease, never a run's)."""
    app.send_task(
        REPLAY_TASK,
        kwargs={"payload": job.model_dump(mode="json")},
        queue=queue,
        time_limit=time_limit,
        soft_time_limit=time_limit - SOFT_LIMIT_MARGIN_SECONDS,
        priority=QUEUED_PRIORITY,
    )


def unacked_keys(app: Celery) -> Unacked:
    """Where ``app``'s Redis transport keeps delivered, unacknowledged messages.

    Read from the transport's channel as its options configure it (key names and any
    global key prefix), without connecting.
    """
    with app.connection_for_write() as connection:
        # Kombu's virtual transports name their channel class here; its stubs do not.
        channel = cast(Any, connection.transport).Channel
        options = connection.transport_options or {}

    def option(name: str) -> str:
        return str(options.get(name, getattr(channel, name)))

    prefix = option("global_keyprefix")
    return Unacked(hash=prefix + option("unacked_key"), index=prefix + option("unacked_index_key"))
