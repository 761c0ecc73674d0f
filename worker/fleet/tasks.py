"""The worker's Celery app: the generation and reconcile tasks and the worker's start-up.

Owns ``WorkerApp``, which ``worker.celery`` builds once for the app that
``celery -A worker worker`` runs: the client configuration of ``worker.fleet.app``, the
queues this worker serves (its own instrument's ``gen.<fingerprint12>`` and the control
queue), the generation task (validate the payload, check it against its run's record,
hold the lineage's lease while the pipeline runs, then plan what comes next), the
reconcile task that beat schedules, the start-up preflight (a working ceiling, the
observation store of an existing fleet present, the spool drained), the freeze of the
parent's objects before the pool forks (so the pool children share their pages), and the
main process's upkeep, started by the preflight and run by ``worker.fleet.upkeep``: the
markers of the jobs it has fetched renewed, the jobs whose holder died on this host
released and re-enqueued, its turns at the fleet's reconcile pass, and the spool retried
with the store probed. Its Redis clients and its sends wait out a broker restart
(``redis_keys.OUTLAST_RESTART``, ``PUBLISH_RETRY``): a life that lands while Redis
restarts releases its lease and sends its follow-up once Redis is back.

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
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from functools import cached_property

import redis
from celery import Celery, Task, signals
from celery.app.task import Context
from celery.exceptions import CPendingDeprecationWarning
from celery.worker.request import Request
from kombu.exceptions import OperationalError
from pydantic import ValidationError

from worker.fleet import (
    blocks,
    capabilities,
    embedded_redis,
    holders,
    leases,
    markers,
    redis_keys,
    upkeep,
)
from worker.fleet.app import (
    CONTROL_QUEUE,
    GENERATION_TASK,
    RECONCILE_TASK,
    REPLAY_TASK,
    client_app,
    sender,
    serve,
    unacked_keys,
)
from worker.fleet.assembly import Pipelines, observation_store
from worker.fleet.homes import Homes
from worker.fleet.places import require_store_of_fleet
from worker.fleet.planner import Planner
from worker.fleet.runs import RunRecord, tampered
from worker.fleet.settings import Settings
from worker.fleet.transport import ScreeningAMQP
from worker.instrument.errors import Refusal, StaleJob
from worker.instrument.fingerprint import Instrument
from worker.instrument.job import GenerationJob, GenerationReport, ReplayJob
from worker.instrument.records import ReplayReport
from worker.instrument.replay import keep, recorded, replay, replay_problem
from worker.instrument.store import StoreUnavailable

# A worker's sends (follow-ups, recoveries) wait out a broker restart as its Redis
# clients do (about 12 s); Celery's default gives up after 0.6 s.
PUBLISH_RETRY = {"max_retries": 14, "interval_start": 0, "interval_step": 0.25, "interval_max": 1}
# The run records a pool child remembers for a store outage: what a job is checked
# against (model, prices, target, budget) never changes, so an outage stops no run whose
# record the child has read before.
RUNS_REMEMBERED = 256

log = logging.getLogger(__name__)


class WorkerApp:
    """The app of a sandbox host, for ``instrument``: its tasks, its queues, its start-up
    and the threads of its main process, one method each.

    What a process builds once and keeps (Redis clients, planners, the pipeline) is a
    cached property; a pool child drops the ones it must not share with the parent
    (``fresh_clients``) and builds its own on first use.
    """

    def __init__(self, settings: Settings, instrument: Instrument) -> None:
        self.settings = settings
        self.instrument = instrument
        self.fetched: dict[str, str] = {}  # job id -> lineage, for the jobs the main process holds
        self.remembered: OrderedDict[tuple[str, str], RunRecord | None] = OrderedDict()
        self.app = self._configured_app()
        self._register_tasks()
        signals.worker_init.connect(self.preflight, weak=False)
        for after_setup in (self.advertise, self.quiet_connection_loss, self.share_with_pool):
            signals.celeryd_after_setup.connect(after_setup, weak=False)
        signals.worker_shutdown.connect(self.withdraw, weak=False)
        signals.task_received.connect(self.on_fetched, weak=False)
        signals.worker_process_init.connect(self.fresh_clients, weak=False)

    def _configured_app(self) -> Celery:
        app = client_app(self.settings, amqp=ScreeningAMQP)
        app.conf.task_publish_retry_policy = PUBLISH_RETRY
        # Celery's consumer gives up after 100 attempts (about 3 minutes at the transport's
        # pacing) and the worker exits; a worker waits out a broker outage of any length,
        # and its reconcile turns resend what the outage lost once Redis is back.
        app.conf.broker_connection_max_retries = None
        queue = self.instrument.queue
        serve(app, queue)
        app.conf.broker_transport_options = {
            **app.conf.broker_transport_options,
            "task_queues": {
                queue: [GENERATION_TASK, REPLAY_TASK],
                CONTROL_QUEUE: [RECONCILE_TASK],
            },
        }
        return app

    def _register_tasks(self) -> None:
        @self.app.task(name=GENERATION_TASK, bind=True)
        def generation(task: Task[..., str], payload: object = None) -> str:
            """Run one generation; then plan the lineage's next one."""
            return self.generation(task.request, payload)

        @self.app.task(name=REPLAY_TASK)
        def replay(payload: object = None) -> str:
            """Replay one generation from its observation; keep its report."""
            return self.replay(payload)

        @self.app.task(name=RECONCILE_TASK)
        def reconcile() -> list[str]:
            """Re-enqueue every lineage whose run wants more and has nothing in flight."""
            return self.planner.reconcile()

    @cached_property
    def main_client(self) -> redis.Redis:
        """The main process's own client; pool children never use it (they fork first)."""
        return redis_keys.redis_client(self.settings, outlast_restart=True)

    @cached_property
    def child_client(self) -> redis.Redis:
        """A pool child's own client, kept for all its jobs.

        A client per job opened new connections every time, and redis-py reads its
        package metadata for each one (about 15 ms of CPU per generation,
        bench/bench_parallel.py).
        """
        return redis_keys.redis_client(self.settings, outlast_restart=True)

    def planner_on(self, client: redis.Redis) -> Planner:
        store = observation_store(self.settings)
        return Planner(
            settings=self.settings,
            store=store,
            homes=Homes(self.settings, store=store),
            client=client,
            send=sender(self.app),
            unacked=lambda: unacked_keys(self.app),
        )

    @cached_property
    def main_planner(self) -> Planner:
        """The main process's own, for the jobs it releases; pool children never use it."""
        return self.planner_on(self.main_client)

    @cached_property
    def advert_planner(self) -> Planner:
        """The advertising thread's own: a planner's repository cache is not shared between
        threads (the recoveries have theirs)."""
        return self.planner_on(self.main_client)

    @cached_property
    def pipelines(self) -> Pipelines:
        """The pipeline of each home (a pool child's; the main process's for its drains)."""
        return Pipelines(self.settings, shared_cap=True)

    @cached_property
    def replay_pipelines(self) -> Pipelines:
        """A pool child's pipelines for replays, on caches of the shared repositories of its
        own, so the objects a replay's judgement hashes never enter the generations'."""
        return Pipelines(self.settings, cache_role="replay")

    @cached_property
    def planner(self) -> Planner:
        """A pool child's planner, on its own client."""
        return self.planner_on(self.child_client)

    def run_record(self, lineage: str, run_id: str) -> RunRecord | None:
        """The run's durable record, read anew for every job (a cancellation changes it);
        while the store is away, the one this pool child read last, if any."""
        key, remembered = (lineage, run_id), self.remembered
        try:
            record = self.planner.run_record(lineage, run_id)
        except StoreUnavailable:
            if key not in remembered:
                raise
            return remembered[key]
        remembered[key] = record
        remembered.move_to_end(key)
        while len(remembered) > RUNS_REMEMBERED:
            remembered.popitem(last=False)
        return record

    def generation(self, request: Context, payload: object) -> str:
        """The generation task: check the job, live it under its lease, plan what follows."""
        assert request.id is not None, "a delivered task always has its id"
        job = _job(payload, request.id)
        if job is None:
            return "rejected"
        client, planner, queue = self.child_client, self.planner, self.instrument.queue
        if job.run_id and markers.cancel_requested(client, job.lineage, job.run_id):
            # Cancelled, or replaced by a newer run, while it waited: its life must not
            # be paid for; whatever the newest record wants comes next instead.
            log.info("%s: run %s ended; not running %s", job.lineage, job.run_id, request.id)
            markers.clear_in_flight(client, job.lineage, request.id)
            _plan_next(planner, job, None)
            return "cancelled"
        try:
            run = self.run_record(job.lineage, job.run_id) if job.run_id else None
        except StoreUnavailable as exc:
            # Unchecked prices are never charged: the lineage waits for the re-check,
            # when the reconcile pass (or a worker's re-check) plans it again.
            reason = f"the prices of run {job.run_id} cannot be checked now: {exc}"
            log.error("%s: not running %s: %s", job.lineage, request.id, reason)
            blocks.block(client, job, request.hostname, queue, "worker", reason)
            markers.clear_in_flight(client, job.lineage, request.id)
            return "unchecked"
        why = tampered(job, run)
        if why is not None:
            log.error(
                "%s: rejected job %s as tampered (%s); nothing run", job.lineage, request.id, why
            )
            markers.clear_in_flight(client, job.lineage, request.id)
            # A genuine job rewritten on its way leaves its run without one: plan it anew.
            _plan_next(planner, job, None)
            return "tampered"
        if run is not None and run.status != "active":
            # Its run ended after the cancel flag (a hint that expires) was gone.
            log.info("%s: run %s ended; not running %s", job.lineage, job.run_id, request.id)
            markers.clear_in_flight(client, job.lineage, request.id)
            _plan_next(planner, job, None)
            return "cancelled"
        redelivered = bool((request.delivery_info or {}).get("redelivered"))
        attempt = 1 + request.retries + int(redelivered)
        report = None
        try:
            with leases.holding(client, job.lineage, request.id, self.settings.lease_seconds):
                report = self.pipelines.run(job, task_id=request.id, attempt=attempt)
                if report is not None:
                    blocks.stop_for_provider(client, job, report, request.hostname, queue)
        except leases.LeaseBusy:
            log.info("%s: another worker holds the lease; not running %s", job.lineage, request.id)
            return "busy"
        except StaleJob as exc:
            log.info("stale job %s: %s", request.id, exc)
        except Refusal as exc:
            log.error("%s cannot advance here: %s", job.lineage, exc)
            blocks.block(client, job, request.hostname, queue, "worker", str(exc))
            _plan_next(planner, job, None)
            return "refused"
        if report is None:
            _plan_next(planner, job, None)
            return "stale"
        _after_landing(client, planner, job, report)
        log.info("%s gen %d: %s %s", job.lineage, report.generation, report.outcome, report.commit)
        return report.outcome

    def replay(self, payload: object) -> str:
        """The replay task: check the job names a generation of the branch, replay it
        from its observation, keep the report; the verdict. It holds no lease and
        plans nothing: a replay never touches the lineage, its runs or its markers."""
        try:
            job = ReplayJob.model_validate(payload)
        except ValidationError as exc:
            log.error("rejected a replay job: %s", exc.errors()[0]["msg"])
            return "rejected"
        try:
            pipeline = self.replay_pipelines.of(job.lineage)
            problem = replay_problem(pipeline.cache, pipeline.head(job.lineage), job)
        except Refusal as exc:
            problem = str(exc)
        if problem is not None:
            log.error("rejected the replay of %s gen %d: %s", job.lineage, job.generation, problem)
            return "rejected"
        observation = recorded(pipeline.store, job.lineage, job.generation)
        if observation is None:
            return "not replayable"
        started, clock = datetime.now(UTC), time.monotonic()
        try:
            report = replay(pipeline, observation, job.commit)
        except Exception as exc:  # unreported, the command would wait for it to its stall limit
            log.exception("the replay of %s gen %d failed", job.lineage, job.generation)
            report = ReplayReport(
                lineage=job.lineage,
                generation=job.generation,
                lineage_commit=job.commit,
                verdict="not replayable",
                # One short line: a report is shown on terminals and pages.
                reason=f"the replay failed on this worker ({type(exc).__name__}: "
                f"{' '.join(str(exc).split())[:500]}); see its log, and replay it again",
                recorded_outcome=observation.outcome,
                instrument_fingerprint=pipeline.instrument.fingerprint,
                replayed_at=started,
                duration_seconds=time.monotonic() - clock,
            )
        keep(pipeline.store, report)
        log.info("%s gen %d: replay %s", job.lineage, job.generation, report.verdict)
        return report.verdict

    def preflight(self, **_: object) -> None:
        """Refuse to start without a working ceiling; finish publications a crash left;
        start the main process's threads."""
        settings, instrument = self.settings, self.instrument
        try:
            embedded_redis.ensure(settings)
            require_store_of_fleet(settings)
            remaining = self.pipelines.drain()
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
            target=upkeep.drain_forever,
            args=(lambda: self.pipelines, settings),
            name="spool-drain",
            daemon=True,
        ).start()
        # Recoveries read the store and the repository: in a thread of their own, so a
        # slow store never holds up the sweep and the markers' renewals.
        recoveries = ThreadPoolExecutor(1, thread_name_prefix="recovery")
        threading.Thread(
            target=upkeep.watch_markers,
            args=(
                self.fetched,
                lambda: self.main_client,
                lambda lineage: recoveries.submit(
                    upkeep.recover, lambda: self.main_planner, lineage
                ),
                settings.lease_seconds,
            ),
            name="markers",
            daemon=True,
        ).start()
        threading.Thread(
            target=upkeep.take_turns,
            args=(
                lambda: self.main_client,
                lambda keep: recoveries.submit(lambda: self.main_planner.reconcile(keep)).result(),
                settings.reconcile_interval_seconds,
            ),
            name="reconcile-turns",
            daemon=True,
        ).start()

    def advertise(self, sender: str, **_: object) -> None:
        """Advertise what this worker can serve, and re-check the lineages blocked on it."""
        threading.Thread(
            target=capabilities.advertise_forever,
            args=(
                sender,
                self.instrument.queue,
                self.settings,
                lambda: self.main_client,
                lambda lineage: upkeep.recover(
                    lambda: self.advert_planner, lineage, "once its block was cleared"
                ),
            ),
            name="advertise",
            daemon=True,
        ).start()

    def withdraw(self, sender: object = None, **_: object) -> None:
        """Withdraw this worker's advertisement as it shuts down."""
        with contextlib.suppress(redis.RedisError):
            hostname = str(getattr(sender, "hostname", sender))
            capabilities.withdraw(self.main_client, holders.node_name(hostname))

    def on_fetched(self, request: Request, **_: object) -> None:
        """From now on the job's marker lives as long as this worker holds the job."""
        if request.name != GENERATION_TASK:
            return
        try:
            job = GenerationJob.model_validate((request.kwargs or {}).get("payload"))
        except (ValidationError, AttributeError):
            return  # the pool child rejects it, with its reasons
        self.fetched[request.id] = job.lineage
        upkeep.keep_marker(self.main_client, job.lineage, request.id, self.settings.lease_seconds)

    def quiet_connection_loss(self, **_: object) -> None:
        """Silence Celery's warning at every connection loss that a future release will
        cancel running tasks by default.

        This fleet decided not to (worker.fleet.app): the warning is noise. Installed
        after set-up because Celery's logging set-up re-enables its warnings.
        """
        warnings.filterwarnings(
            "ignore", message=r"\s*In Celery 5.1 we introduced", category=CPendingDeprecationWarning
        )

    def share_with_pool(self, **_: object) -> None:
        """Freeze what the parent holds before the prefork pool forks its children.

        Sent after the preflight and the logging set-up, before the pool forks its
        children (one per concurrent life). What the parent holds by then (every module,
        the app, the pipeline it drained with) is the bulk of a child's heap. Frozen, no
        child's garbage collector ever walks those objects, so their pages stay shared
        with the parent instead of being copied into every child at its first full
        collection (bench/bench_parallel.py: a busy child's private memory went from
        about 45 MiB to 23 MiB, and its CPU per life down by a fifth).
        """
        gc.collect()
        gc.freeze()
        log.info("%d objects frozen before the pool forks", gc.get_freeze_count())

    def fresh_clients(self, **_: object) -> None:
        """A pool child must not share the parent's sockets (S3, Redis): it builds its own."""
        for name in ("child_client", "pipeline", "planner"):
            self.__dict__.pop(name, None)
        self.remembered.clear()


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
) -> None:
    """What follows a generation that landed: its follow-up, unless the provider failed
    (then the run was stopped under the lease: ``blocks.stop_for_provider``)."""
    if report.model_failure is not None:
        # The provider failed, not the organism: no follow-up to burn the run on.
        return
    blocks.clear_if_over(client, job.lineage)
    _plan_next(planner, job, report)
