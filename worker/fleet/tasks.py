"""The worker's Celery app: the generation and reconcile tasks and the worker's start-up.

Owns ``worker_app``, which ``worker.celery`` calls once to build the app that
``celery -A worker worker`` runs: the client configuration of ``worker.fleet.app``,
the queues this worker serves (its own instrument's ``gen.<fingerprint12>`` and the
control queue), the generation task (validate the payload, check it against its run's
record, hold the lineage's lease while the pipeline runs, then plan what comes next),
the reconcile task that beat schedules, the start-up preflight (a working ceiling, the
observation store of an existing fleet present, the spool drained), the freeze
of the parent's objects before the pool forks (so the pool children share their
pages), and the main process's watch over what it holds: the markers of the jobs it
has fetched (renewed every third of ``lease_seconds`` until each job ends, so a
worker killed before its pool child starts a job is noticed within
``lease_seconds``), the jobs whose holder died on this host (released every
``SWEEP_SECONDS``, so the worker restarted after a kill, or any other on the host,
frees its predecessor's work and re-enqueues it at once, at the front of its queue),
its turns at the fleet's reconcile pass (every ``reconcile_interval_seconds``, one
worker at a time through ``leases.Turn``: no run waits on a reconciler process nobody
started, and a follow-up a broker outage lost is sent once Redis is back)
and the observation store (probed with every spool retry; its outages are logged once
when they start and once when they end). Its Redis clients and its sends wait out a
broker restart (``leases.OUTLAST_RESTART``, ``PUBLISH_RETRY``): a life that lands
while Redis restarts releases its lease and sends its follow-up once Redis is back.

A thread of its own advertises which model providers this worker can serve and
re-checks the lineages blocked on its queue (``worker.fleet.capabilities``). A refusal
here, or a generation whose model calls failed at the provider, blocks or pauses the
lineage and sends no follow-up (``worker.fleet.blocks``).

Trusts: its settings, its instrument, the observation store and the broker. Trusts no
message: the transport (``worker.fleet.transport``) drops whatever is not a JSON Celery
message of a task this queue carries, and a payload that is not a valid job is rejected
with a logged reason; either way the worker serves on. A life is charged at its run
record's prices, never a message's: a job whose model, prices, target or budget are
not its run record's (``worker.fleet.runs.tampered``) is rejected as tampered, logged at
error level, nothing run, and its run planned anew; a job of a run the record says has
ended is dropped; one whose record cannot be read now (the store away, and the record
not read by this pool child before) blocks its lineage for ``blocks.RECHECK_SECONDS``,
after which the reconcile pass plans it again.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import redis
from celery import Celery, Task, signals
from celery.exceptions import CPendingDeprecationWarning
from celery.worker import state as worker_state
from celery.worker.request import Request
from kombu.exceptions import OperationalError
from pydantic import ValidationError

from worker.fleet import blocks, capabilities, embedded_redis, leases
from worker.fleet.app import (
    CONTROL_QUEUE,
    GENERATION_TASK,
    RECONCILE_TASK,
    client_app,
    sender,
    serve,
    unacked_keys,
)
from worker.fleet.assembly import build_pipeline, lineage_cache, observation_store
from worker.fleet.outage import Outage, probe
from worker.fleet.places import require_store_of_fleet
from worker.fleet.planner import Planner
from worker.fleet.runs import RunRecord, tampered
from worker.fleet.settings import Settings
from worker.fleet.transport import ScreeningAMQP
from worker.instrument.errors import Refusal, StaleJob
from worker.instrument.fingerprint import Instrument
from worker.instrument.gitrepo import GitError
from worker.instrument.job import GenerationJob, GenerationReport
from worker.instrument.pipeline import Pipeline
from worker.instrument.store import StoreUnavailable

# How often a worker looks for jobs whose holder died on its host: a few cheap Redis
# calls, against a lineage otherwise stalled until its marker and lease expire.
SWEEP_SECONDS = 1.0
# A worker's sends (follow-ups, recoveries) wait out a broker restart as its Redis
# clients do (about 12 s); Celery's default gives up after 0.6 s.
PUBLISH_RETRY = {"max_retries": 14, "interval_start": 0, "interval_step": 0.25, "interval_max": 1}
# The run records a pool child remembers for a store outage: what a job is checked
# against (model, prices, target, budget) never changes, so an outage stops no run whose
# record the child has read before.
RUNS_REMEMBERED = 256

log = logging.getLogger(__name__)


def worker_app(settings: Settings, instrument: Instrument) -> Celery:
    """The app of a sandbox host: its tasks, its queues and its start-up, for ``instrument``."""
    app = client_app(settings, amqp=ScreeningAMQP)
    app.conf.task_publish_retry_policy = PUBLISH_RETRY
    # Celery's consumer gives up after 100 attempts (about 3 minutes at the transport's
    # pacing) and the worker exits; a worker waits out a broker outage of any length,
    # and its reconcile turns resend what the outage lost once Redis is back.
    app.conf.broker_connection_max_retries = None
    serve(app, instrument.queue)
    app.conf.broker_transport_options = {
        **app.conf.broker_transport_options,
        "task_queues": {instrument.queue: [GENERATION_TASK], CONTROL_QUEUE: [RECONCILE_TASK]},
    }
    fetched: dict[str, str] = {}  # job id -> lineage, for the jobs this main process holds

    @cache
    def main_client() -> redis.Redis:
        # The main process's own client; pool children never use it (they fork first).
        return leases.redis_client(settings, outlast_restart=True)

    @cache
    def child_client() -> redis.Redis:
        # A pool child's own client, kept for all its jobs: a client per job opened new
        # connections every time, and redis-py reads its package metadata for each one
        # (about 15 ms of CPU per generation, bench/bench_parallel.py).
        return leases.redis_client(settings, outlast_restart=True)

    def planner_on(client: redis.Redis) -> Planner:
        return Planner(
            settings=settings,
            store=observation_store(settings),
            cache=lineage_cache(settings),
            client=client,
            send=sender(app),
            unacked=lambda: unacked_keys(app),
        )

    @cache
    def main_planner() -> Planner:
        # The main process's own, for the jobs it releases; pool children never use it.
        return planner_on(main_client())

    @cache
    def pipeline() -> Pipeline:
        return build_pipeline(settings, shared_cap=True)

    @cache
    def planner() -> Planner:
        return planner_on(child_client())

    remembered: OrderedDict[tuple[str, str], RunRecord | None] = OrderedDict()

    def run_record(lineage: str, run_id: str) -> RunRecord | None:
        """The run's durable record, read anew for every job (a cancellation changes it);
        while the store is away, the one this pool child read last, if any."""
        key = (lineage, run_id)
        try:
            record = planner().run_record(lineage, run_id)
        except StoreUnavailable:
            if key not in remembered:
                raise
            return remembered[key]
        remembered[key] = record
        remembered.move_to_end(key)
        while len(remembered) > RUNS_REMEMBERED:
            remembered.popitem(last=False)
        return record

    @app.task(name=GENERATION_TASK, bind=True)
    def generation(self: Task[..., str], payload: object = None) -> str:
        """Run one generation; then plan the lineage's next one."""
        request = self.request
        assert request.id is not None, "a delivered task always has its id"
        job = _job(payload, request.id)
        if job is None:
            return "rejected"
        client = child_client()
        if job.run_id and leases.cancel_requested(client, job.lineage, job.run_id):
            # Cancelled, or replaced by a newer run, while it waited: its life must not
            # be paid for; whatever the newest record wants comes next instead.
            log.info("%s: run %s ended; not running %s", job.lineage, job.run_id, request.id)
            leases.clear_in_flight(client, job.lineage, request.id)
            _plan_next(planner(), job, None)
            return "cancelled"
        try:
            run = run_record(job.lineage, job.run_id) if job.run_id else None
        except StoreUnavailable as exc:
            # Unchecked prices are never charged: the lineage waits for the re-check,
            # when the reconcile pass (or a worker's re-check) plans it again.
            reason = f"the prices of run {job.run_id} cannot be checked now: {exc}"
            log.error("%s: not running %s: %s", job.lineage, request.id, reason)
            blocks.block(client, job, request.hostname, instrument.queue, "worker", reason)
            leases.clear_in_flight(client, job.lineage, request.id)
            return "unchecked"
        why = tampered(job, run)
        if why is not None:
            log.error(
                "%s: rejected job %s as tampered (%s); nothing run", job.lineage, request.id, why
            )
            leases.clear_in_flight(client, job.lineage, request.id)
            # A genuine job rewritten on its way leaves its run without one: plan it anew.
            _plan_next(planner(), job, None)
            return "tampered"
        if run is not None and run.status != "active":
            # Its run ended after the cancel flag (a hint that expires) was gone.
            log.info("%s: run %s ended; not running %s", job.lineage, job.run_id, request.id)
            leases.clear_in_flight(client, job.lineage, request.id)
            _plan_next(planner(), job, None)
            return "cancelled"
        redelivered = bool((request.delivery_info or {}).get("redelivered"))
        attempt = 1 + request.retries + int(redelivered)
        report = None
        try:
            with leases.holding(client, job.lineage, request.id, settings.lease_seconds):
                report = pipeline().run(job, task_id=request.id, attempt=attempt)
        except leases.LeaseBusy:
            log.info("%s: another worker holds the lease; not running %s", job.lineage, request.id)
            return "busy"
        except StaleJob as exc:
            log.info("stale job %s: %s", request.id, exc)
        except Refusal as exc:
            log.error("%s cannot advance here: %s", job.lineage, exc)
            blocks.block(client, job, request.hostname, instrument.queue, "worker", str(exc))
            _plan_next(planner(), job, None)
            return "refused"
        if report is None:
            _plan_next(planner(), job, None)
            return "stale"
        _after_landing(client, planner(), job, report, request.hostname, instrument.queue)
        log.info("%s gen %d: %s %s", job.lineage, report.generation, report.outcome, report.commit)
        return report.outcome

    @app.task(name=RECONCILE_TASK)
    def reconcile() -> list[str]:
        """Re-enqueue every lineage whose run wants more and has nothing in flight."""
        return planner().reconcile()

    @signals.worker_init.connect(weak=False)
    def preflight(**_: object) -> None:
        """Refuse to start without a working ceiling; finish publications a crash left."""
        try:
            embedded_redis.ensure(settings)
            require_store_of_fleet(settings)
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
        threading.Thread(
            target=_drain_forever, args=(pipeline, settings), name="spool-drain", daemon=True
        ).start()
        # Recoveries read the store and the repository: in a thread of their own, so a
        # slow store never holds up the sweep and the markers' renewals.
        recoveries = ThreadPoolExecutor(1, thread_name_prefix="recovery")
        threading.Thread(
            target=_watch_markers,
            args=(
                fetched,
                main_client,
                lambda lineage: recoveries.submit(_recover, main_planner, lineage),
                settings.lease_seconds,
            ),
            name="markers",
            daemon=True,
        ).start()
        threading.Thread(
            target=_take_turns,
            args=(
                main_client,
                lambda keep: recoveries.submit(lambda: main_planner().reconcile(keep)).result(),
                settings.reconcile_interval_seconds,
            ),
            name="reconcile-turns",
            daemon=True,
        ).start()

    @cache
    def advert_planner() -> Planner:
        # The advertising thread's own: a planner's repository cache is not shared
        # between threads (the recoveries have theirs).
        return planner_on(main_client())

    @signals.celeryd_after_setup.connect(weak=False)
    def advertise(sender: str, **_: object) -> None:
        """Advertise what this worker can serve, and re-check the lineages blocked on it."""
        threading.Thread(
            target=capabilities.advertise_forever,
            args=(
                sender,
                instrument.queue,
                settings,
                main_client,
                lambda lineage: _recover(advert_planner, lineage, "once its block was cleared"),
            ),
            name="advertise",
            daemon=True,
        ).start()

    @signals.worker_shutdown.connect(weak=False)
    def withdraw(sender: object = None, **_: object) -> None:
        with contextlib.suppress(redis.RedisError):
            hostname = str(getattr(sender, "hostname", sender))
            capabilities.withdraw(main_client(), leases.node_name(hostname))

    @signals.task_received.connect(weak=False)
    def on_fetched(request: Request, **_: object) -> None:
        """From now on the job's marker lives as long as this worker holds the job."""
        if request.name != GENERATION_TASK:
            return
        try:
            job = GenerationJob.model_validate((request.kwargs or {}).get("payload"))
        except (ValidationError, AttributeError):
            return  # the pool child rejects it, with its reasons
        fetched[request.id] = job.lineage
        _keep_marker(main_client(), job.lineage, request.id, settings.lease_seconds)

    @signals.celeryd_after_setup.connect(weak=False)
    def quiet_connection_loss(**_: object) -> None:
        # Celery warns at every connection loss that a future release will cancel running
        # tasks by default. This fleet decided not to (worker.fleet.app): the warning is
        # noise. Installed here because Celery's logging set-up re-enables its warnings.
        warnings.filterwarnings(
            "ignore", message=r"\s*In Celery 5.1 we introduced", category=CPendingDeprecationWarning
        )

    @signals.celeryd_after_setup.connect(weak=False)
    def share_with_pool(**_: object) -> None:
        # Sent after the preflight and the logging set-up, before the prefork pool forks
        # its children (one per concurrent life). What the parent holds by then (every
        # module, the app, the pipeline it drained with) is the bulk of a child's heap.
        # Frozen, no child's garbage collector ever walks those objects, so their pages
        # stay shared with the parent instead of being copied into every child at its
        # first full collection (bench/bench_parallel.py: a busy child's private memory
        # went from about 45 MiB to 23 MiB, and its CPU per life down by a fifth).
        gc.collect()
        gc.freeze()
        log.info("%d objects frozen before the pool forks", gc.get_freeze_count())

    @signals.worker_process_init.connect(weak=False)
    def fresh_clients(**_: object) -> None:
        # A pool child must not share the parent's sockets (S3, Redis): build its own.
        child_client.cache_clear()
        pipeline.cache_clear()
        planner.cache_clear()
        remembered.clear()

    return app


def _job(payload: object, task_id: str) -> GenerationJob | None:
    """The payload as a job, or None (logged with its reasons) when it is not one."""
    try:
        return GenerationJob.model_validate(payload)
    except ValidationError as exc:
        reasons = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'payload'}: {e['msg']}" for e in exc.errors()[:5]
        )
        log.error("rejected malformed job %s: %s", task_id, reasons)
        return None


def _plan_next(planner: Planner, job: GenerationJob, report: GenerationReport | None) -> None:
    """Send the lineage's next job: the follow-up of a landed one, else what the record says."""
    try:
        follow = planner.follow_up(job, report) if report else None
        if follow is not None:
            planner.submit(follow)
        else:
            # Stale, refused elsewhere, finished, or superseded by a newer run: ask the
            # durable record what (if anything) comes next.
            planner.enqueue(job.lineage)
    except (StoreUnavailable, redis.RedisError, OperationalError) as exc:
        # The generation landed; only its follow-up waits, for the fleet's next reconcile
        # turn once the broker and the store answer (this worker takes turns too).
        log.warning("%s: cannot plan now (%s); the next reconcile turn will", job.lineage, exc)


def _after_landing(
    client: redis.Redis,
    planner: Planner,
    job: GenerationJob,
    report: GenerationReport,
    node: str | None,
    queue: str,
) -> None:
    """What follows a generation that landed: its follow-up, unless the provider failed."""
    if report.model_failure is not None:
        # The provider failed, not the organism: no follow-up to burn the run on.
        blocks.stop_for_provider(client, job, report, node, queue)
        return
    blocks.clear_if_over(client, job.lineage)
    _plan_next(planner, job, report)


def _keep_marker(client: redis.Redis, lineage: str, job_id: str, ttl_seconds: int) -> None:
    try:
        leases.keep_marker(client, lineage, job_id, ttl_seconds)
    except redis.RedisError as exc:
        log.warning("%s: could not renew the marker of %s (%s)", lineage, job_id, exc)


def _watch_markers(
    fetched: dict[str, str],
    client: Callable[[], redis.Redis],
    recover: Callable[[str], object],
    ttl_seconds: int,
) -> None:
    """Release and re-enqueue the jobs of dead holders on this host; renew the markers
    of those fetched here.

    The marker of every job this process still holds is renewed every third of
    ``ttl_seconds``; a finished one is forgotten.
    """
    renewed = time.monotonic()
    while True:
        time.sleep(SWEEP_SECONDS)
        released: list[tuple[str, str]] = []
        # The broker away: nothing to release now, and the renewals below log it.
        with contextlib.suppress(redis.RedisError):
            released = leases.release_dead_holders(client())
        for lineage, _job_id in released:
            recover(lineage)
        if time.monotonic() - renewed < ttl_seconds / 3:
            continue
        renewed = time.monotonic()
        held = {request.id for request in list(worker_state.reserved_requests)}
        for job_id, lineage in list(fetched.items()):
            if job_id in held:
                _keep_marker(client(), lineage, job_id, ttl_seconds)
            else:
                fetched.pop(job_id, None)


def _recover(
    planner: Callable[[], Planner], lineage: str, why: str = "after its holder died"
) -> None:
    """Enqueue a released (or unblocked) lineage's next job now, at the front of its queue.

    The reconciler would, at its next pass; a duplicate of the dead holder's message,
    should the broker return it later, is harmlessly stale or busy.
    """
    try:
        if planner().enqueue(lineage, first=True) is not None:
            log.info("%s: re-enqueued %s", lineage, why)
    except (StoreUnavailable, redis.RedisError, OperationalError, GitError, Refusal) as exc:
        log.warning("%s: cannot re-enqueue now (%s); the next reconcile turn will", lineage, exc)
    except Exception:  # in a pool thread whose future nobody reads: say it, or it is lost
        log.exception("%s: re-enqueueing failed; the next reconcile turn will", lineage)


def _take_turns(
    client: Callable[[], redis.Redis],
    reconcile: Callable[[Callable[[], object]], list[str]],
    interval: float,
) -> None:
    """Every ``interval``, ask for the fleet's reconcile turn, and pass when given it.

    Every worker asks, one gets it: the fleet reconciles itself with no other process
    started, and a worker's follow-up lost to a broker outage of any length is planned
    again by whichever worker's turn comes first once Redis is back.
    """
    broker = Outage("the broker", "reconcile turn", log)
    turn: leases.Turn | None = None
    while True:
        time.sleep(interval)
        try:
            turn = turn or leases.Turn(client(), interval)
            enqueued = reconcile(turn.keep) if turn.take() else []
        except (redis.RedisError, OperationalError) as exc:
            broker.failed(exc)
            continue
        except (StoreUnavailable, GitError, Refusal) as exc:
            log.warning("reconcile turn: cannot pass now (%s); the next turn will", exc)
            continue
        except Exception:  # a thread nobody joins: say it, and keep taking turns
            log.exception("reconcile turn failed; the next turn will")
            continue
        broker.answered()
        if enqueued:
            log.info("reconcile turn: re-enqueued %s", ", ".join(enqueued))


def _drain_forever(pipeline: Callable[[], Pipeline], settings: Settings) -> None:
    store = Outage("the observation store", "worker", log)
    while True:
        time.sleep(settings.spool_retry_seconds)
        try:
            pipeline().drain()
            probe(pipeline().store)
        except StoreUnavailable as exc:
            store.failed(exc)
            continue
        except Exception:  # keep retrying: the spool is the only copy until it lands
            log.exception("spool drain failed; retrying in %ss", settings.spool_retry_seconds)
            continue
        store.answered()
