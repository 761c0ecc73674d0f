"""``/metrics``: the fleet in Prometheus text format, gathered at scrape time.

Owns the metric names, their help and labels, and gathering them when scraped
(prometheus_client's custom-collector pattern: nothing is kept between scrapes but
the tally of observations already read). Every source is read-only:

- the reader (shared repository, observation store): per-lineage summaries and
  index figures: generations by outcome, those marked "model unavailable" (every
  model call failed at the provider; a counter beside the outcome, which the mark
  does not change), deaths, spend, the run's budget and
  progress, observation backlog, model calls, and the wall, CPU and peak-memory
  histograms, exact at every scrape;
- observation objects, each read once (they are write-once) into a running tally:
  model calls, tokens and cost by provider, and the histograms of a generation's
  whole duration (from enqueue to the life's end) and of its queue wait. At most
  ``OBSERVATIONS_PER_SCRAPE`` new ones are read per scrape, so a web process that
  starts over a long history catches up over a few scrapes instead of stalling one;
  until it has, these counters rise faster than the fleet works;
- the broker's Redis: in-flight, running and blocked lineages, queue depth;
- the live-workers provider (Celery's control broadcast, remembered a few
  seconds): live workers per queue, lineages waiting for one.

Labels are bounded and never organism-made: ``lineage`` (names the operator chose,
matching the lineage name pattern; fleet lineages only), ``outcome`` (the
observation schema's closed set), ``provider`` (the catalogue's names, else
``other``), ``queue`` (``gen.<fingerprint12>`` of instruments lineages are pinned
to or live workers serve, and the control queue), ``direction`` (input, output).
Blocked reasons and worker hostnames are never labels.

Trusts: the reader, the settings' broker and the workers provider it is given.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from decimal import Decimal
from typing import get_args

import redis
from celery import Celery
from fastapi import APIRouter, Request, Response
from kombu.exceptions import ChannelError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from scheduler.liveness import Workers
from scheduler.reader import Reader
from scheduler.views import LineageSummary
from scheduler.web.workers import WorkersProvider
from worker.fleet import block_markers, embedded_redis, leases, markers, redis_keys
from worker.fleet.app import CONTROL_QUEUE, client_app
from worker.fleet.settings import Settings
from worker.instrument.model.catalogue import PROVIDER_NAMES
from worker.instrument.names import queue_name
from worker.instrument.records import DEATHS, IndexEntry, Observation, Outcome

OBSERVATIONS_PER_SCRAPE = 500
OUTCOMES: tuple[str, ...] = get_args(Outcome)
MIB = 2**20
WALL_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
DURATION_BUCKETS = (*WALL_BUCKETS, 7200, 21600, 86400)
CPU_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800)
MEMORY_BUCKETS = tuple(float(2**n * MIB) for n in range(2, 15))  # 4 MiB .. 16 GiB

router = APIRouter(include_in_schema=False)


@router.get("/metrics")
def metrics(request: Request) -> Response:
    """The fleet's metrics in the Prometheus text exposition format."""
    registry: CollectorRegistry = request.app.state.metrics
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def registry_for(
    reader: Reader, workers: WorkersProvider, settings: Settings | None
) -> CollectorRegistry:
    """A registry holding the fleet's collector and this web process's own figures."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(reader, workers, settings))
    ProcessCollector(registry=registry)
    return registry


class Buckets:
    """One histogram being filled: counts per upper bound (le), their sum."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = list(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def add(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            cumulative += count
            buckets.append((bound, float(cumulative)))
        return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=self.sum)


class Tally:
    """What has been read from observation objects so far: by provider, and two histograms."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()
        self.calls: Counter[str] = Counter()
        self.tokens: Counter[tuple[str, str]] = Counter()
        self.cost: defaultdict[str, float] = defaultdict(float)
        self.duration = Buckets(DURATION_BUCKETS)
        self.queue_wait = Buckets(DURATION_BUCKETS)

    def add(self, observation: Observation) -> None:
        provider = observation.provider if observation.provider in PROVIDER_NAMES else "other"
        for call in observation.model_calls:
            self.calls[provider] += 1
            self.tokens[provider, "input"] += call.input_tokens
            self.tokens[provider, "output"] += call.output_tokens
            self.cost[provider] += float(call.cost_usd)
        wait = observation.provenance.queue_wait_seconds
        life = (observation.finished_at - observation.started_at).total_seconds()
        self.duration.add(max(0.0, life + (wait or 0.0)))
        if wait is not None:
            self.queue_wait.add(max(0.0, wait))


def _per_lineage(
    kind: type[CounterMetricFamily] | type[GaugeMetricFamily], name: str, documentation: str
) -> CounterMetricFamily | GaugeMetricFamily:
    return kind(name, documentation, labels=["lineage"])


class FleetCollector(Collector):
    """Gathers the fleet's metrics from the reader, the broker and the live workers."""

    def __init__(self, reader: Reader, workers: WorkersProvider, settings: Settings | None) -> None:
        self.reader = reader
        self.workers = workers
        self.settings = settings
        self.tally = Tally()
        self.lock = threading.Lock()
        self._app: Celery | None = None

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            lineages = [s for s in self.reader.summaries() if s.kind == "fleet"]
            indexed = {s.name: self.reader.indexed(s.name) for s in lineages}
            self._read_observations(indexed)
            workers = self.workers()
            yield from self._lineage_metrics(lineages, indexed)
            yield from self._histograms(indexed)
            yield from self._provider_metrics()
            yield from self._broker_metrics(lineages, workers)

    # -- the store ------------------------------------------------------------

    def _read_observations(self, indexed: dict[str, list[IndexEntry]]) -> None:
        budget = OBSERVATIONS_PER_SCRAPE
        for name, entries in indexed.items():
            for entry in entries:
                if budget == 0:
                    return
                if (name, entry.generation) in self.tally.seen:
                    continue
                budget -= 1
                observation = self.reader.observation(name, entry.generation)
                self.tally.seen.add((name, entry.generation))
                if observation is not None:
                    self.tally.add(observation)

    def _lineage_metrics(
        self, lineages: list[LineageSummary], indexed: dict[str, list[IndexEntry]]
    ) -> Iterable[Metric]:
        by_outcome = CounterMetricFamily(
            "ouroboros_lineage_generations",
            "Observed generations of a lineage, by outcome.",
            labels=["lineage", "outcome"],
        )
        deaths = _per_lineage(
            CounterMetricFamily, "ouroboros_lineage_deaths", "Observed deaths of a lineage."
        )
        unavailable = _per_lineage(
            CounterMetricFamily,
            "ouroboros_lineage_model_unavailable_generations",
            "Observed generations of a lineage whose every model call failed at the provider.",
        )
        spent = _per_lineage(
            CounterMetricFamily,
            "ouroboros_lineage_spent_usd",
            "Dollars spent on model calls by a lineage's observed generations.",
        )
        calls = _per_lineage(
            CounterMetricFamily,
            "ouroboros_lineage_model_calls",
            "Model calls made by a lineage's observed generations.",
        )
        budget = _per_lineage(
            GaugeMetricFamily,
            "ouroboros_lineage_run_budget_usd",
            "The budget of the lineage's latest run.",
        )
        run_spent = _per_lineage(
            GaugeMetricFamily,
            "ouroboros_lineage_run_spent_usd",
            "Dollars spent so far by the lineage's latest run.",
        )
        run_left = _per_lineage(
            GaugeMetricFamily,
            "ouroboros_lineage_run_remaining_generations",
            "Generations the lineage's latest run still wants (0 once it stopped).",
        )
        backlog = _per_lineage(
            GaugeMetricFamily,
            "ouroboros_lineage_observation_backlog",
            "Generations committed whose observation is not stored yet (in a worker's spool).",
        )
        head = _per_lineage(
            GaugeMetricFamily, "ouroboros_lineage_generation", "The lineage's latest generation."
        )
        fleet = Counter[str]()
        fleet_deaths = fleet_spent = fleet_budget = 0.0
        fleet_unavailable = 0
        for lineage in lineages:
            entries = indexed[lineage.name]
            outcomes = Counter[str](e.outcome for e in entries)
            for outcome in OUTCOMES:
                by_outcome.add_metric([lineage.name, outcome], outcomes[outcome])
            fleet.update(outcomes)
            died = sum(outcomes[o] for o in DEATHS)
            deaths.add_metric([lineage.name], died)
            marked = sum(e.model_unavailable for e in entries)
            unavailable.add_metric([lineage.name], marked)
            fleet_unavailable += marked
            money = float(sum((e.spent_usd for e in entries), Decimal(0)))
            spent.add_metric([lineage.name], money)
            calls.add_metric([lineage.name], sum(e.model_calls for e in entries))
            backlog.add_metric([lineage.name], lineage.backlog or 0)
            head.add_metric([lineage.name], lineage.generations)
            fleet_deaths += died
            fleet_spent += money
            if lineage.run is not None:
                progress = lineage.run
                budget.add_metric([lineage.name], float(progress.run.budget_usd))
                run_spent.add_metric([lineage.name], float(progress.spent_usd))
                left = 0 if progress.stopped else max(0, progress.wanted - progress.done)
                run_left.add_metric([lineage.name], left)
                if progress.stopped is None:
                    fleet_budget += float(progress.remaining_usd)
        yield from (
            by_outcome,
            deaths,
            unavailable,
            spent,
            calls,
            budget,
            run_spent,
            run_left,
            backlog,
            head,
        )
        total = CounterMetricFamily(
            "ouroboros_generations",
            "Observed generations of every lineage, by outcome.",
            labels=["outcome"],
        )
        for outcome in OUTCOMES:
            total.add_metric([outcome], fleet[outcome])
        yield total
        yield CounterMetricFamily(
            "ouroboros_deaths", "Observed deaths of every lineage.", value=fleet_deaths
        )
        yield CounterMetricFamily(
            "ouroboros_model_unavailable_generations",
            "Observed generations of every lineage whose every model call failed at the provider.",
            value=fleet_unavailable,
        )
        yield CounterMetricFamily(
            "ouroboros_spent_usd", "Dollars spent on model calls, every lineage.", value=fleet_spent
        )
        yield GaugeMetricFamily(
            "ouroboros_budget_remaining_usd",
            "Dollars the active runs may still spend, summed.",
            value=fleet_budget,
        )
        yield GaugeMetricFamily(
            "ouroboros_observation_backlog",
            "Generations committed whose observation is not stored yet, every lineage.",
            value=sum(lineage.backlog or 0 for lineage in lineages),
        )
        yield GaugeMetricFamily(
            "ouroboros_lineages_running_runs",
            "Fleet lineages whose latest run still wants generations.",
            value=sum(1 for lineage in lineages if lineage.status == "running"),
        )

    def _histograms(self, indexed: dict[str, list[IndexEntry]]) -> Iterable[Metric]:
        wall, cpu, memory = Buckets(WALL_BUCKETS), Buckets(CPU_BUCKETS), Buckets(MEMORY_BUCKETS)
        for entries in indexed.values():
            for entry in entries:
                wall.add(entry.duration_seconds)
                if entry.cpu_usage_nsec is not None:
                    cpu.add(entry.cpu_usage_nsec / 1e9)
                if entry.memory_peak_bytes is not None:
                    memory.add(float(entry.memory_peak_bytes))
        yield wall.family("ouroboros_generation_wall_seconds", "Wall time of each observed life.")
        yield cpu.family("ouroboros_generation_cpu_seconds", "CPU time of each observed life.")
        yield memory.family(
            "ouroboros_generation_memory_peak_bytes", "Peak memory of each observed life."
        )
        yield self.tally.duration.family(
            "ouroboros_generation_duration_seconds",
            "Each observed generation from its enqueue to the end of its life.",
        )
        yield self.tally.queue_wait.family(
            "ouroboros_generation_queue_wait_seconds",
            "Each observed generation's wait from enqueue to the start of its life.",
        )

    def _provider_metrics(self) -> Iterable[Metric]:
        calls = CounterMetricFamily(
            "ouroboros_model_calls", "Model calls, by provider.", labels=["provider"]
        )
        tokens = CounterMetricFamily(
            "ouroboros_model_tokens",
            "Model tokens, by provider and direction.",
            labels=["provider", "direction"],
        )
        cost = CounterMetricFamily(
            "ouroboros_model_cost_usd",
            "Dollars charged for model calls, by provider.",
            labels=["provider"],
        )
        for provider in sorted(self.tally.calls):
            calls.add_metric([provider], self.tally.calls[provider])
            cost.add_metric([provider], self.tally.cost[provider])
            for direction in ("input", "output"):
                tokens.add_metric([provider, direction], self.tally.tokens[provider, direction])
        yield from (calls, tokens, cost)
        yield GaugeMetricFamily(
            "ouroboros_observations_tallied",
            "Observation objects read into the by-provider counters so far.",
            value=len(self.tally.seen),
        )

    # -- the broker -----------------------------------------------------------

    def _broker_metrics(
        self, lineages: list[LineageSummary], workers: Workers | None
    ) -> Iterable[Metric]:
        queues = {CONTROL_QUEUE}
        queues.update(
            queue_name(lineage.instrument_fingerprint)
            for lineage in lineages
            if lineage.instrument_fingerprint
        )
        serving = workers.per_queue() if workers and workers.reachable else {}
        queues.update(q for q in serving if q.startswith("gen."))
        live = GaugeMetricFamily(
            "ouroboros_live_workers",
            "Live workers consuming each queue (Celery control broadcast).",
            labels=["queue"],
        )
        waiting = _per_lineage(
            GaugeMetricFamily,
            "ouroboros_lineage_waiting_for_worker",
            "1 while the lineage's run wants more and no live worker serves its queue.",
        )
        if workers is not None and workers.reachable:
            for queue in sorted(queues):
                live.add_metric([queue], serving.get(queue, 0))
            for lineage in lineages:
                queue = queue_name(str(lineage.instrument_fingerprint))
                unserved = lineage.status == "running" and workers.unserved(queue)
                waiting.add_metric([lineage.name], int(unserved))
        yield from (live, waiting)
        yield GaugeMetricFamily(
            "ouroboros_workers_answered",
            "Live workers that answered the broker's broadcast.",
            value=len(workers.workers) if workers else 0,
        )
        yield from self._redis_metrics(lineages, sorted(queues))

    def _redis_metrics(self, lineages: list[LineageSummary], queues: list[str]) -> Iterable[Metric]:
        settings = self.settings
        up = settings is not None and (
            bool(settings.broker_url) or embedded_redis.running(settings)
        )
        families: list[Metric] = []
        if up and settings is not None:
            try:
                families = [*self._markers(settings, lineages), self._depths(settings, queues)]
            except (redis.RedisError, OSError, ChannelError):
                up, families = False, []
        yield GaugeMetricFamily(
            "ouroboros_broker_up", "1 if the broker answered this scrape.", value=int(up)
        )
        yield from families

    def _markers(self, settings: Settings, lineages: list[LineageSummary]) -> list[Metric]:
        client = redis_keys.redis_client(settings)
        in_flight = _per_lineage(
            GaugeMetricFamily,
            "ouroboros_lineage_in_flight",
            "1 while a job of the lineage is queued or running.",
        )
        running = _per_lineage(
            GaugeMetricFamily,
            "ouroboros_lineage_running",
            "1 while a worker holds the lineage's lease (a life is running).",
        )
        blocked = _per_lineage(
            GaugeMetricFamily,
            "ouroboros_lineage_blocked",
            "1 while the lineage is blocked or paused (see schedule-lineage status for why).",
        )
        counts = Counter[str]()
        for lineage in lineages:
            marks = {
                "in_flight": markers.in_flight(client, lineage.name) is not None,
                "running": leases.lease_held(client, lineage.name),
                # Not one being tried again now (its retry time has come).
                "blocked": block_markers.blocking(client, lineage.name) is not None,
            }
            in_flight.add_metric([lineage.name], int(marks["in_flight"]))
            running.add_metric([lineage.name], int(marks["running"]))
            blocked.add_metric([lineage.name], int(marks["blocked"]))
            counts.update(key for key, on in marks.items() if on)
        return [
            in_flight,
            running,
            blocked,
            GaugeMetricFamily(
                "ouroboros_lineages_in_flight",
                "Lineages with a job queued or running.",
                value=counts["in_flight"],
            ),
            GaugeMetricFamily(
                "ouroboros_lineages_blocked", "Lineages blocked.", value=counts["blocked"]
            ),
        ]

    def _depths(self, settings: Settings, queues: list[str]) -> Metric:
        depth = GaugeMetricFamily(
            "ouroboros_queue_depth", "Messages waiting in each queue.", labels=["queue"]
        )
        if self._app is None:
            self._app = client_app(settings)
        with self._app.connection_for_read() as connection:
            connection.ensure_connection(max_retries=1, interval_start=0, interval_step=0)
            channel = connection.default_channel
            for queue in queues:
                try:
                    # kombu's channels declare queues; the stubs' StdChannel lacks the method.
                    declared = channel.queue_declare(queue=queue, passive=True)  # type: ignore[attr-defined]
                    count = declared.message_count
                except ChannelError:  # the transport deletes a queue's list once it is empty
                    count = 0
                depth.add_metric([queue], count)
        return depth
