"""``/metrics`` scraped as Prometheus would, while a real fleet runs.

``schedule-lineage serve`` over real HTTP; a real ``celery -A worker worker``; a
private redis-server as the broker; observations on moto's S3 server. The scrape
is parsed with prometheus_client's own parser; its figures are checked against the
durable records, and every label against the bounded vocabulary.
"""

from __future__ import annotations

import math
import time
import uuid
from pathlib import Path

import boto3
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.browse import PAYLOAD, Served
from support.fleet import S3_REGION, SMALL_PHYSICS, Fleet, PrivateRedis, Worker, wait_for

from worker.instrument.model.catalogue import PROVIDER_NAMES

# Full tier: a private redis-server, workers and `serve`.
pytestmark = pytest.mark.full

LABELS = {"lineage", "outcome", "provider", "queue", "direction", "le"}
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(served: Served) -> Samples:
    reply = served.get("/metrics")
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return samples


def settled(served: Served) -> Samples:
    """A scrape in which every source had answered: no figure is unknown (NaN).

    The web process asks the store, the broker and the live workers in the
    background; a scrape right after it started may precede their first answers.
    """
    found: list[Samples] = []

    def complete() -> bool:
        samples = scrape(served)
        found[:] = [samples]
        return not any(math.isnan(v) for v in samples.values())

    wait_for(complete, 30, "a scrape with every source answered")
    return found[0]


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[name, frozenset(labels.items())]


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name`` over every series whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def label_values(samples: Samples, label: str) -> set[str]:
    return {v for (_, ls) in samples for k, v in ls if k == label}


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
# Over the default 120 s: a fleet of real workers lives generations while it is scraped.
@pytest.mark.timeout(600)
def test_metrics_follow_a_running_fleet(
    tmp_path: Path, private_redis: PrivateRedis, s3_endpoint: str
) -> None:
    bucket = f"metrics-{uuid.uuid4().hex[:12]}"
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name=S3_REGION)
    s3.create_bucket(Bucket=bucket)
    fleet = Fleet(
        tmp_path,
        OUROBOROS_BROKER_URL=private_redis.url,
        OUROBOROS_OBSERVATIONS=f"s3://{bucket}/fleet",
        OUROBOROS_S3_ENDPOINT_URL=s3_endpoint,
        OUROBOROS_S3_REGION=S3_REGION,
        AWS_ACCESS_KEY_ID="ouroboros-test-key-id",
        AWS_SECRET_ACCESS_KEY="ouroboros-test-secret",
        # Asked often enough to catch a short life's lease between two probes.
        OUROBOROS_WEB_PROBE_SECONDS="0.3",
    )
    names = ["alpha", "beta"]
    for name in names:
        fleet.ok("init", name, *SMALL_PHYSICS)
    served = Served(fleet, tmp_path / "serve.log")
    worker = None
    try:
        fleet.ok("run", *names, "--generations", "3", "--budget-usd", "5")
        queued = settled(served)
        [queue] = {q for q in label_values(queued, "queue") if q.startswith("gen.")}
        assert value(queued, "ouroboros_broker_up") == 1
        assert value(queued, "ouroboros_queue_depth", queue=queue) == 2
        assert value(queued, "ouroboros_lineages_in_flight") == 2
        assert value(queued, "ouroboros_live_workers", queue=queue) == 0
        for name in names:
            assert value(queued, "ouroboros_lineage_waiting_for_worker", lineage=name) == 1
            assert value(queued, "ouroboros_lineage_run_budget_usd", lineage=name) == 5
            assert value(queued, "ouroboros_lineage_run_remaining_generations", lineage=name) == 3

        # Each life waits 1.5 s for its model's answer: long enough for a probe to see
        # it running whatever the machine's speed (an instant life could land between
        # two probes, and on a fast machine all six did).
        worker = Worker(fleet, "metrics", OUROBOROS_SCRIPTED_LATENCY_SECONDS="1.5")
        worker.wait_ready()
        seen_running = seen_served = False
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            during = scrape(served)
            seen_running |= value(during, "ouroboros_lineage_running", lineage="alpha") == 1
            seen_running |= value(during, "ouroboros_lineage_running", lineage="beta") == 1
            seen_served |= value(during, "ouroboros_live_workers", queue=queue) == 1
            if total(during, "ouroboros_generations_total") == 6:
                break
            time.sleep(0.2)
        assert seen_running
        if not seen_served:
            # Generations this short can all land between two broadcasts the worker
            # answered in time on a loaded machine; the worker still serves its queue.
            wait_for(
                lambda: value(scrape(served), "ouroboros_live_workers", queue=queue) == 1,
                120,
                "the worker reported as serving its queue",
            )
        # The last generation's job is settled once its marker is gone (and the store's
        # figures, asked apart from the broker's, include its observation and the run's
        # end, which one probe may read a moment apart).
        final = wait_for(
            lambda: (
                (s := settled(served))["ouroboros_lineages_in_flight", frozenset()] == 0
                and total(s, "ouroboros_generations_total") == 6
                and total(s, "ouroboros_lineage_run_remaining_generations") == 0
                and s
            ),
            60,
            "no lineage in flight",
        )
    finally:
        if worker is not None:
            worker.stop()
        served.stop()

    assert total(final, "ouroboros_generations_total") == 6
    for name in names:
        assert total(final, "ouroboros_lineage_generations_total", lineage=name) == 3
        stored = s3.list_objects_v2(Bucket=bucket, Prefix=f"fleet/lineages/{name}/generations/")
        assert stored["KeyCount"] == 3
        assert value(final, "ouroboros_lineage_generation", lineage=name) == 3
        assert value(final, "ouroboros_lineage_run_remaining_generations", lineage=name) == 0
        assert value(final, "ouroboros_lineage_observation_backlog", lineage=name) == 0
        assert value(final, "ouroboros_lineage_in_flight", lineage=name) == 0
        assert value(final, "ouroboros_lineage_waiting_for_worker", lineage=name) == 0
    deaths = value(final, "ouroboros_deaths_total")
    assert deaths == total(final, "ouroboros_lineage_deaths_total")
    assert value(final, "ouroboros_queue_depth", queue=queue) == 0
    calls = total(final, "ouroboros_lineage_model_calls_total")
    assert calls >= 1
    assert value(final, "ouroboros_model_calls_total", provider="scripted") == calls
    assert value(final, "ouroboros_model_tokens_total", provider="scripted", direction="input") > 0
    assert value(final, "ouroboros_observations_tallied") == 6
    spent = value(final, "ouroboros_spent_usd_total")
    assert spent == pytest.approx(
        value(final, "ouroboros_model_cost_usd_total", provider="scripted")
    )
    for histogram in ("wall_seconds", "cpu_seconds", "memory_peak_bytes", "duration_seconds"):
        assert value(final, f"ouroboros_generation_{histogram}_count") == 6, histogram
        assert value(final, f"ouroboros_generation_{histogram}_bucket", le="+Inf") == 6
    assert_bounded(final, {"alpha", "beta"}, {queue, "ouroboros.control"})


def assert_bounded(samples: Samples, lineages: set[str], queues: set[str]) -> None:
    assert {k for (_, ls) in samples for k, _ in ls} <= LABELS
    assert label_values(samples, "lineage") <= lineages
    assert label_values(samples, "queue") <= queues
    assert label_values(samples, "provider") <= {*PROVIDER_NAMES, "other"}
    assert label_values(samples, "direction") <= {"input", "output"}


def test_no_organism_text_becomes_a_label(served_sample: Served) -> None:
    text = served_sample.get("/metrics").text
    samples = scrape(served_sample)
    assert "<script" not in text and PAYLOAD not in text
    # The imported lineage has no observations and no run: only fleet lineages are measured.
    assert_bounded(samples, {"xss"}, {"ouroboros.control", "gen.eeeeeeeeeeee"})
    assert value(samples, "ouroboros_lineage_generation", lineage="xss") == 2
