"""``/metrics``: the fleet in Prometheus text format, from its sources' latest answers.

Owns the metric names, their help and labels, and rendering them when scraped
(prometheus_client's custom-collector pattern). A scrape never waits on the store
or the broker: each is read by a ``scheduler.web.probes.Probe`` in the background,
at most once per probe interval (``OUROBOROS_WEB_PROBE_SECONDS``, 2 s), and the
scrape renders the latest answers, waiting at most ``BUDGET_SECONDS`` in all, and
only for a source with no recent answer. Every source is read-only:

- the shared repository, read at each scrape (local git, and the one source
  without which there is nothing to show): which fleet lineages exist, their
  instrument queues and latest generation;
- the observation store (probed): per-lineage summaries and index figures:
  generations by outcome, those marked "model unavailable" (every model call
  failed at the provider; a counter beside the outcome, which the mark does not
  change), deaths, spend, the run's budget and progress, observation backlog,
  model calls, and the wall, CPU and peak-memory histograms;
- observation objects, each read once (they are write-once) into a running tally:
  model calls, tokens and cost by provider, and the histograms of a generation's
  whole duration (from enqueue to the life's end) and of its queue wait. At most
  ``OBSERVATIONS_PER_PASS`` new ones are read per store probe, so a web process that
  starts over a long history catches up over a few probes; until it has, these
  counters rise faster than the fleet works;
- the broker's Redis (probed, ``scheduler.web.broker``): in-flight, running and
  blocked lineages, queue depth;
- the live workers (Celery's control broadcast, probed): live workers per queue,
  lineages waiting for one.

A source that did not answer its latest probe reads 0 in ``ouroboros_store_up`` or
``ouroboros_broker_up``, and every figure it gives is NaN (``UNKNOWN``): the
scrape itself still succeeds, so the target stays up and says what is down. NaN,
not zero: a zero would read as a fact (no workers, a counter reset that
``increase()`` would turn into a jump), and NaN compares false, so no threshold
alert fires on a figure nobody could read. NaN, not a missing series: the series
keep their identity through an outage instead of going stale and coming back, and
an absent series is indistinguishable from a renamed or removed one. The tally's
counters (by provider, durations, queue waits) only say what was read so far, so
they stay as they are.

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
import math
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, get_args

from fastapi import APIRouter, Request, Response
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
from scheduler.web.broker import BrokerFigures, fleet_queues
from scheduler.web.probes import BUDGET_SECONDS, Probe
from scheduler.web.workers import known
from worker.fleet.app import CONTROL_QUEUE
from worker.instrument.model.catalogue import PROVIDER_NAMES
from worker.instrument.records import DEATHS, IndexEntry, Observation, Outcome

OBSERVATIONS_PER_PASS = 500
# What a figure reads when its source did not answer.
UNKNOWN = math.nan
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
    reader: Reader, workers: Probe[Workers | None], broker: Probe[BrokerFigures], interval: float
) -> CollectorRegistry:
    """A registry holding the fleet's collector and this web process's own figures."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(reader, workers, broker, interval))
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

    def unknown(self) -> None:
        """Make every count and the sum unknown (their source did not answer)."""
        self.counts = [UNKNOWN] * len(self.counts)  # type: ignore[list-item]
        self.sum = UNKNOWN

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


@dataclass(frozen=True)
class StoreFigures:
    """One pass over the store: each fleet lineage's summary and indexed figures."""

    lineages: dict[str, LineageSummary]
    indexed: dict[str, list[IndexEntry]]


@dataclass(frozen=True)
class GitLineage:
    """A fleet lineage as the shared repository alone knows it."""

    name: str
    queue: str
    generation: int


class FleetCollector(Collector):
    """Renders the fleet's metrics from the latest answers of the store, broker and workers."""

    def __init__(
        self,
        reader: Reader,
        workers: Probe[Workers | None],
        broker: Probe[BrokerFigures],
        interval: float,
    ) -> None:
        self.reader = reader
        self.workers = workers
        self.broker = broker
        self.tally = Tally()
        self.tally_lock = threading.Lock()
        self.store = Probe("store", self._read_store, interval=interval)

    def collect(self) -> Iterator[Metric]:
        probes: tuple[Probe[Any], ...] = (self.store, self.broker, self.workers)
        for probe in probes:
            probe.refresh()
        # One shared deadline: a scrape waits for no answer longer than the budget.
        until = time.monotonic() + BUDGET_SECONDS
        store, broker, workers = (probe.latest(until) for probe in probes)
        lineages = self._git_lineages()
        figures = store.value if store is not None else None
        yield GaugeMetricFamily(
            "ouroboros_store_up",
            "1 if the observation store answered its latest probe (every few seconds).",
            value=int(figures is not None),
        )
        yield from self._lineage_metrics(lineages, figures)
        yield from self._histograms(figures)
        with self.tally_lock:  # the store probe adds to it meanwhile
            yield from self._tally_metrics()
            yield from self._provider_metrics()
        yield from self._worker_metrics(lineages, figures, known(workers))
        yield from self._broker_metrics(lineages, broker.value if broker is not None else None)

    def _git_lineages(self) -> list[GitLineage]:
        """Every fleet lineage, from the shared repository alone (no store, no broker)."""
        heads = self.reader.heads()
        return [
            GitLineage(
                name,
                queue,
                max(self.reader.history(name, heads).by_generation, default=0),
            )
            for name, queue in sorted(fleet_queues(self.reader).items())
            if name in heads
        ]

    def _read_store(self) -> StoreFigures:
        """The probe's pass over the store; also reads new observations into the tally."""
        lineages = {s.name: s for s in self.reader.summaries() if s.kind == "fleet"}
        indexed = {name: self.reader.indexed(name) for name in lineages}
        self._read_observations(indexed)
        return StoreFigures(lineages, indexed)

    # -- the store ------------------------------------------------------------

    def _read_observations(self, indexed: dict[str, list[IndexEntry]]) -> None:
        budget = OBSERVATIONS_PER_PASS
        for name, entries in indexed.items():
            for entry in entries:
                if budget == 0:
                    return
                if (name, entry.generation) in self.tally.seen:
                    continue
                budget -= 1
                observation = self.reader.observation(name, entry.generation)
                with self.tally_lock:
                    self.tally.seen.add((name, entry.generation))
                    if observation is not None:
                        self.tally.add(observation)

    def _lineage_metrics(
        self, lineages: list[GitLineage], store: StoreFigures | None
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
        fleet_deaths = fleet_spent = fleet_budget = fleet_backlog = 0.0
        fleet_unavailable = fleet_running = 0.0
        partial = store is None
        for lineage in lineages:
            name = lineage.name
            head.add_metric([name], lineage.generation)
            summary = store.lineages.get(name) if store else None
            if store is None or summary is None:
                # Not read from the store (down, or the lineage is newer than its last
                # answer): every figure it gives is unknown, and so are the totals.
                for family in (deaths, unavailable, spent, calls, backlog):
                    family.add_metric([name], UNKNOWN)
                for outcome in OUTCOMES:
                    by_outcome.add_metric([name, outcome], UNKNOWN)
                for family in (budget, run_spent, run_left):
                    family.add_metric([name], UNKNOWN)
                partial = True
                continue
            entries = store.indexed[name]
            outcomes = Counter[str](e.outcome for e in entries)
            for outcome in OUTCOMES:
                by_outcome.add_metric([name, outcome], outcomes[outcome])
            fleet.update(outcomes)
            died = sum(outcomes[o] for o in DEATHS)
            deaths.add_metric([name], died)
            marked = sum(e.model_unavailable for e in entries)
            unavailable.add_metric([name], marked)
            fleet_unavailable += marked
            money = float(sum((e.spent_usd for e in entries), Decimal(0)))
            spent.add_metric([name], money)
            calls.add_metric([name], sum(e.model_calls for e in entries))
            backlog.add_metric([name], summary.backlog or 0)
            fleet_backlog += summary.backlog or 0
            fleet_running += summary.status == "running"
            fleet_deaths += died
            fleet_spent += money
            if summary.run is not None:
                progress = summary.run
                budget.add_metric([name], float(progress.run.budget_usd))
                run_spent.add_metric([name], float(progress.spent_usd))
                left = 0 if progress.stopped else max(0, progress.wanted - progress.done)
                run_left.add_metric([name], left)
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
            total.add_metric([outcome], UNKNOWN if partial else fleet[outcome])
        yield total
        if partial:
            fleet_deaths = fleet_spent = fleet_budget = fleet_backlog = UNKNOWN
            fleet_unavailable = fleet_running = UNKNOWN
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
            value=fleet_backlog,
        )
        yield GaugeMetricFamily(
            "ouroboros_lineages_running_runs",
            "Fleet lineages whose latest run still wants generations.",
            value=fleet_running,
        )

    def _histograms(self, store: StoreFigures | None) -> Iterable[Metric]:
        wall, cpu, memory = Buckets(WALL_BUCKETS), Buckets(CPU_BUCKETS), Buckets(MEMORY_BUCKETS)
        for entries in store.indexed.values() if store else ():
            for entry in entries:
                wall.add(entry.duration_seconds)
                if entry.cpu_usage_nsec is not None:
                    cpu.add(entry.cpu_usage_nsec / 1e9)
                if entry.memory_peak_bytes is not None:
                    memory.add(float(entry.memory_peak_bytes))
        if store is None:
            for histogram in (wall, cpu, memory):
                histogram.unknown()
        yield wall.family("ouroboros_generation_wall_seconds", "Wall time of each observed life.")
        yield cpu.family("ouroboros_generation_cpu_seconds", "CPU time of each observed life.")
        yield memory.family(
            "ouroboros_generation_memory_peak_bytes", "Peak memory of each observed life."
        )

    def _tally_metrics(self) -> Iterable[Metric]:
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

    # -- the broker and the live workers ----------------------------------------

    def _worker_metrics(
        self, lineages: list[GitLineage], store: StoreFigures | None, workers: Workers | None
    ) -> Iterable[Metric]:
        answered = workers is not None and workers.reachable
        serving = workers.per_queue() if workers is not None and answered else {}
        queues = {CONTROL_QUEUE, *(lineage.queue for lineage in lineages)}
        queues.update(q for q in serving if q.startswith("gen."))
        live = GaugeMetricFamily(
            "ouroboros_live_workers",
            "Live workers consuming each queue (Celery control broadcast).",
            labels=["queue"],
        )
        for queue in sorted(queues):
            live.add_metric([queue], serving.get(queue, 0) if answered else UNKNOWN)
        waiting = _per_lineage(
            GaugeMetricFamily,
            "ouroboros_lineage_waiting_for_worker",
            "1 while the lineage's run wants more and no live worker serves its queue.",
        )
        for lineage in lineages:
            summary = store.lineages.get(lineage.name) if store else None
            if workers is None or not answered or summary is None:
                waiting.add_metric([lineage.name], UNKNOWN)
                continue
            unserved = summary.status == "running" and workers.unserved(lineage.queue)
            waiting.add_metric([lineage.name], int(unserved))
        yield from (live, waiting)
        yield GaugeMetricFamily(
            "ouroboros_workers_answered",
            "Live workers that answered the broker's broadcast.",
            value=len(workers.workers) if workers is not None and answered else UNKNOWN,
        )

    def _broker_metrics(
        self, lineages: list[GitLineage], broker: BrokerFigures | None
    ) -> Iterable[Metric]:
        yield GaugeMetricFamily(
            "ouroboros_broker_up",
            "1 if the broker answered its latest probe (every few seconds).",
            value=int(broker is not None),
        )
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
            marks = broker.marks.get(lineage.name) if broker else None
            if marks is None:
                for family in (in_flight, running, blocked):
                    family.add_metric([lineage.name], UNKNOWN)
                continue
            in_flight.add_metric([lineage.name], int(marks.in_flight))
            running.add_metric([lineage.name], int(marks.running))
            blocked.add_metric([lineage.name], int(marks.blocked))
            counts.update(in_flight=marks.in_flight, blocked=marks.blocked)
        yield from (in_flight, running, blocked)
        yield GaugeMetricFamily(
            "ouroboros_lineages_in_flight",
            "Lineages with a job queued or running.",
            value=counts["in_flight"] if broker else UNKNOWN,
        )
        yield GaugeMetricFamily(
            "ouroboros_lineages_blocked",
            "Lineages blocked.",
            value=counts["blocked"] if broker else UNKNOWN,
        )
        depth = GaugeMetricFamily(
            "ouroboros_queue_depth", "Messages waiting in each queue.", labels=["queue"]
        )
        queues = {CONTROL_QUEUE, *(lineage.queue for lineage in lineages)}
        for queue in sorted(queues):
            depth.add_metric([queue], broker.depths.get(queue, 0) if broker else UNKNOWN)
        yield depth
