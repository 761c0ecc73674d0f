"""The Celery app of a sandbox host: ``celery -A worker worker``.

Owns the broker configuration (JSON only, late acks, requeue on a lost pool child,
prefetch 1, visibility timeout above any life plus publication, connection retry,
task events for Flower), the queues this worker serves (its own instrument's
``gen.<fingerprint12>`` and the control queue), the generation task and the
reconcile task that beat schedules. A job payload is validated with pydantic;
a malformed or hostile message is rejected with a logged reason and the worker
keeps serving. The instrument is loaded when this module is imported, so the
worker's code, scripts and seed are fixed from its first moment.

Trusts: its settings and the broker. Trusts no message.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from functools import cache

from celery import Celery, signals
from kombu import Queue
from pydantic import ValidationError

from worker import coordination, embedded_redis
from worker.assembly import build_pipeline, lineage_cache, observation_store
from worker.errors import Refusal, StaleJob
from worker.generation import GenerationJob, Pipeline
from worker.instrument import Instrument, current
from worker.planner import Planner
from worker.settings import Settings
from worker.store import StoreUnavailable

GENERATION_TASK = "ouroboros.generation"
RECONCILE_TASK = "ouroboros.reconcile"
CONTROL_QUEUE = "ouroboros.control"
BLOCKED_SECONDS = 300

log = logging.getLogger("ouroboros.worker")


def _load() -> tuple[Settings, Instrument]:
    try:
        return Settings(), current()
    except Refusal as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


settings, instrument = _load()
app = Celery("ouroboros", broker=settings.broker, set_as_current=True)
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
    worker_cancel_long_running_tasks_on_connection_loss=True,
    broker_connection_retry_on_startup=True,
    broker_transport_options={"visibility_timeout": settings.visibility_timeout_seconds},
    worker_send_task_events=True,
    task_send_sent_event=True,
    task_queues=(Queue(instrument.queue), Queue(CONTROL_QUEUE)),
    task_default_queue=CONTROL_QUEUE,
    task_routes={RECONCILE_TASK: {"queue": CONTROL_QUEUE}},
    beat_schedule={
        "reconcile": {"task": RECONCILE_TASK, "schedule": settings.reconcile_interval_seconds}
    },
)


@cache
def pipeline() -> Pipeline:
    return build_pipeline(settings)


@cache
def planner() -> Planner:
    return Planner(
        settings=settings,
        store=observation_store(settings),
        cache=lineage_cache(settings),
        client=coordination.redis_client(settings),
        send=send_job,
    )


def send_job(job: GenerationJob, job_id: str, queue: str, time_limit: int) -> None:
    app.send_task(
        GENERATION_TASK,
        kwargs={"payload": job.model_dump(mode="json")},
        task_id=job_id,
        queue=queue,
        time_limit=time_limit,
        soft_time_limit=time_limit - 30,
    )


@app.task(name=GENERATION_TASK, bind=True)
def generation(self: object, payload: object = None) -> str:
    """Run one generation; then plan the lineage's next one."""
    request = self.request  # type: ignore[attr-defined]
    try:
        job = GenerationJob.model_validate(payload)
    except ValidationError as exc:
        reasons = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'payload'}: {e['msg']}" for e in exc.errors()[:5]
        )
        log.error("rejected malformed job %s: %s", request.id, reasons)
        return "rejected"
    client = coordination.redis_client(settings)
    lease = coordination.Lease(client, job.lineage, settings.lease_seconds)
    if not lease.acquire():
        log.info("%s: another worker holds the lease; not running %s", job.lineage, request.id)
        return "busy"
    coordination.claim_running(client, job.lineage, request.id, settings.lease_seconds)
    beating = threading.Event()
    heart = threading.Thread(
        target=_heartbeat, args=(lease, job.lineage, request.id, beating), daemon=True
    )
    heart.start()
    redelivered = bool((request.delivery_info or {}).get("redelivered"))
    report = None
    try:
        report = pipeline().run(
            job, task_id=request.id, attempt=1 + request.retries + int(redelivered)
        )
        log.info("%s gen %d: %s %s", job.lineage, report.generation, report.outcome, report.commit)
        outcome = report.outcome
    except StaleJob as exc:
        log.info("stale job %s: %s", request.id, exc)
        outcome = "stale"
    except Refusal as exc:
        log.error("%s cannot advance here: %s", job.lineage, exc)
        coordination.block(client, job.lineage, str(exc), BLOCKED_SECONDS)
        outcome = "refused"
    finally:
        beating.set()
        heart.join()
        coordination.clear_in_flight(client, job.lineage, request.id)
        lease.release()
    follow = planner().follow_up(job, report) if report else None
    try:
        if follow is not None:
            planner().submit(follow)
        else:
            # Stale, refused elsewhere, finished, or superseded by a newer run: ask the
            # durable record what (if anything) comes next.
            planner().enqueue(job.lineage)
    except StoreUnavailable as exc:
        log.warning("%s: cannot plan now (%s); the reconciler will", job.lineage, exc)
    return outcome


def _heartbeat(lease: coordination.Lease, lineage: str, job_id: str, done: threading.Event) -> None:
    """Keep the lease and the running marker alive while the generation runs."""
    while not done.wait(settings.lease_seconds / 3):
        try:
            lease.renew()
            coordination.claim_running(lease.client, lineage, job_id, settings.lease_seconds)
        except Exception:  # a broker hiccup: correctness never rests on the lease
            log.warning("%s: lease renewal failed", lineage, exc_info=True)


@app.task(name=RECONCILE_TASK)
def reconcile() -> list[str]:
    """Re-enqueue every lineage whose run wants more and has nothing in flight."""
    return planner().reconcile()


def _drain_forever() -> None:
    while True:
        time.sleep(settings.spool_retry_seconds)
        try:
            pipeline().drain()
        except Exception:  # keep retrying: the spool is the only copy until it lands
            log.exception("spool drain failed; retrying in %ss", settings.spool_retry_seconds)


@signals.worker_init.connect
def _preflight(**_: object) -> None:
    """Refuse to start without a working ceiling; finish publications a crash left."""
    try:
        embedded_redis.ensure(settings)
        remaining = pipeline().drain()
    except Refusal as exc:
        log.critical("refusing to start: %s", exc)
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    log.info(
        "instrument %s (version %s) serving queue %s; %d publications pending",
        instrument.fingerprint[:12],
        instrument.version,
        instrument.queue,
        remaining,
    )
    threading.Thread(target=_drain_forever, name="spool-drain", daemon=True).start()


@signals.worker_process_init.connect
def _fresh_clients(**_: object) -> None:
    # A pool child must not share the parent's sockets (S3, Redis): build its own.
    pipeline.cache_clear()
    planner.cache_clear()
