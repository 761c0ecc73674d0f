"""``serve`` answers within its budget whatever the broker and the store do.

A real ``schedule-lineage serve`` over real HTTP, its broker and its observation
store each a ``Silent`` listener (accepts, never answers: the hanging dependency) or
a port nothing listens on (refused). Many requests at once, to ``/metrics``, pages and
the API, must each answer within ``BUDGET_SECONDS``; ``/metrics`` must say which
source is down (``ouroboros_broker_up``, ``ouroboros_store_up``) and mark what it
could not read as unknown (NaN), and the sources must be asked once per probe
interval, not once per request.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.browse import Served
from support.fleet import S3_REGION, SMALL_PHYSICS, Fleet, free_port
from support.prometheus import Silent

# Full tier: `serve` and the CLI as processes, moto's server.
pytestmark = pytest.mark.full

# The web process's own waits add up to at most 0.75 s (a quarter of a second for a
# probe with no answer yet, half a second for a store read); alone on this machine
# every answer comes in well under a second (bench/soak_metrics.py). The rest of the
# budget is for the CPU the machine's other test runs take; a request that waited on
# a hanging source instead would take that source's whole timeout, 5 s and more.
BUDGET_SECONDS = 2.0
PATHS = ["/metrics", "/", "/api/", "/lineages/alpha", "/api/lineages/alpha", "/metrics"]
CONCURRENT = 12


@pytest.fixture
def silent() -> Iterator[Silent]:
    listener = Silent()
    yield listener
    listener.stop()


def _fleet(home: Path, s3_endpoint: str) -> tuple[Fleet, str]:
    """A home with lineage ``alpha`` initialised on moto's S3; the bucket's URL."""
    bucket = f"outage-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name=S3_REGION).create_bucket(Bucket=bucket)
    env = {
        "OUROBOROS_OBSERVATIONS": f"s3://{bucket}/fleet",
        "OUROBOROS_S3_REGION": S3_REGION,
        "AWS_ACCESS_KEY_ID": "ouroboros-test-key-id",
        "AWS_SECRET_ACCESS_KEY": "ouroboros-test-secret",
    }
    fleet = Fleet(home, OUROBOROS_S3_ENDPOINT_URL=s3_endpoint, **env)
    fleet.ok("init", "alpha", *SMALL_PHYSICS)
    return fleet, bucket


def timed(served: Served, paths: list[str]) -> list[tuple[str, int, float, str]]:
    """Each path asked at once, on its own connection: (path, status, seconds, body)."""

    def ask(path: str) -> tuple[str, int, float, str]:
        with httpx.Client(base_url=served.url, timeout=30) as client:
            started = time.monotonic()
            reply = client.get(path)
            return path, reply.status_code, time.monotonic() - started, reply.text

    with ThreadPoolExecutor(len(paths)) as pool:
        return list(pool.map(ask, paths))


def samples(text: str) -> dict[str, float]:
    """Unlabelled samples of a scrape, and labelled ones as name{k=v,...}."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return found


def assert_bounded(served: Served) -> list[tuple[str, int, float, str]]:
    answers = timed(served, PATHS * (CONCURRENT // len(PATHS)))
    slow = [(path, seconds) for path, _, seconds, _ in answers if seconds >= BUDGET_SECONDS]
    assert not slow, f"answers over {BUDGET_SECONDS} s: {slow}"
    for path, status, _, body in answers:
        # A page needs the store: 503 says it did not answer; /metrics always answers.
        assert status == 200 if path == "/metrics" else status in (200, 503), (path, body)
    return answers


@pytest.mark.parametrize("broker", ["hanging", "refused"])
def test_every_answer_is_bounded_with_broker_and_store_down(
    tmp_path: Path, s3_endpoint: str, silent: Silent, broker: str
) -> None:
    fleet, _ = _fleet(tmp_path, s3_endpoint)
    broker_port = silent.port if broker == "hanging" else free_port()
    store_hangs = Silent()
    down = Fleet(
        tmp_path,
        **{
            **fleet.env,
            "OUROBOROS_BROKER_URL": f"redis://127.0.0.1:{broker_port}/0",
            "OUROBOROS_S3_ENDPOINT_URL": f"http://127.0.0.1:{store_hangs.port}",
        },
    )
    served = Served(down, tmp_path / "serve.log")
    try:
        first = assert_bounded(served)
        # Later requests find the outage already known: none waits for a source.
        time.sleep(0.5)
        again = assert_bounded(served)
        scrape = samples(next(body for path, _, _, body in again if path == "/metrics"))
        connections = len(silent.accepted) + len(store_hangs.accepted)
    finally:
        served.stop()
        store_hangs.stop()
    assert scrape["ouroboros_broker_up"] == 0
    assert scrape["ouroboros_store_up"] == 0
    # The repository still answers: the lineage and its latest generation are known ...
    assert scrape["ouroboros_lineage_generation{lineage=alpha}"] == 0
    # ... and what the broker and the store would say is unknown, not zero.
    for unknown in (
        "ouroboros_lineage_in_flight{lineage=alpha}",
        "ouroboros_lineages_in_flight",
        "ouroboros_workers_answered",
        "ouroboros_lineage_deaths_total{lineage=alpha}",
        "ouroboros_generations_total{outcome=changed}",
        "ouroboros_observation_backlog",
        "ouroboros_generation_wall_seconds_count",
    ):
        assert math.isnan(scrape[unknown]), unknown
    # One probe per interval, not one per request: asked per request, each of them would
    # have connected to both; here a handful of probes and of store reads (the guard's
    # pool bounds how many hang at once) did.
    requests = len(first) + len(again)
    assert connections <= requests // 2, (connections, requests)


def test_serve_never_starts_the_embedded_broker(tmp_path: Path) -> None:
    """The embedded default after the demo: no broker runs, and serving does not start one."""
    fleet = Fleet(tmp_path)
    fleet.ok("init", "alpha", *SMALL_PHYSICS)
    served = Served(fleet, tmp_path / "serve.log")
    try:
        # Over two probe intervals, so the broker is asked more than once.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            answers = assert_bounded(served)
        scrape = samples(next(body for path, _, _, body in answers if path == "/metrics"))
    finally:
        served.stop()
    assert scrape["ouroboros_broker_up"] == 0
    assert scrape["ouroboros_store_up"] == 1  # the file store of the home answers
    assert math.isnan(scrape["ouroboros_lineage_in_flight{lineage=alpha}"])
    assert not (tmp_path / ".ouroboros" / "redis" / "redis.sock").exists()
    assert not list((tmp_path / ".ouroboros").glob("redis/*.aof*"))
