"""A real Prometheus scraping a real ``serve`` while the broker and then the store go down.

Debian's ``prometheus`` (scripts/setup.sh installs it) scrapes ``schedule-lineage
serve`` every second on loopback. The fleet's broker is a private redis-server and its
store moto's S3 server, each this test's own so it can stop them. Everything is
checked through Prometheus's HTTP API, as an operator's dashboards and alerts see it:
the target stays ``up`` through both outages with every scrape well under a second,
``ouroboros_broker_up`` and ``ouroboros_store_up`` follow their source down and back,
and PromQL over a real run's generations (real lives in bwrap under cgroups) agrees
with the observations in the store.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import get_args

import pytest
from support.prometheus import Watched

from worker.instrument.records import Observation, Outcome

# Full tier: Prometheus, `serve`, redis-server and moto as processes, and real lives.
pytestmark = pytest.mark.full

SCRAPE_BUDGET_SECONDS = 1.0
# The series of a metric whose value is unknown (NaN: the only value unequal to itself).
UNKNOWN = "{0} != {0}"


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
@pytest.mark.timeout(600)
def test_prometheus_sees_the_fleet_through_outages(tmp_path: Path) -> None:
    watched = Watched(tmp_path, generations=3, interval=1.0)
    try:
        prometheus, s3 = watched.prometheus, watched.s3
        assert prometheus is not None
        observed = Counter[str]()
        prefix = "fleet/lineages/alpha/generations/"
        for item in s3.list_objects_v2(Bucket=watched.bucket, Prefix=prefix)["Contents"]:
            body = s3.get_object(Bucket=watched.bucket, Key=item["Key"])["Body"].read()
            observed[Observation.model_validate_json(body).outcome] += 1
        assert sum(observed.values()) == 3

        # Everything up: PromQL over the run's generations matches the observations.
        prometheus.wait("ouroboros_broker_up == 1 and on() ouroboros_store_up == 1")
        prometheus.wait("sum(ouroboros_generations_total) == 3")
        by_outcome = {
            labels["outcome"]: value
            for labels, value in prometheus.query("sum by (outcome) (ouroboros_generations_total)")
            if value
        }
        assert by_outcome == {outcome: float(n) for outcome, n in observed.items()}
        assert prometheus.scalar('ouroboros_lineage_generation{lineage="alpha"}') == 3

        # The broker stops: still a successful scrape, which says so; then it comes back.
        watched.broker.kill()
        prometheus.wait("ouroboros_broker_up == 0")
        assert prometheus.scalar("up") == 1
        prometheus.wait(f"count({UNKNOWN.format('ouroboros_lineage_in_flight')}) == 1")
        watched.broker.start()
        prometheus.wait("ouroboros_broker_up == 1")

        # The store stops: the target stays up, the store gauge reads 0, its figures NaN.
        watched.store.stop()
        prometheus.wait("ouroboros_store_up == 0")
        outcomes = len(get_args(Outcome))
        prometheus.wait(f"count({UNKNOWN.format('ouroboros_generations_total')}) == {outcomes}")
        assert prometheus.scalar("up") == 1
        assert prometheus.scalar('ouroboros_lineage_generation{lineage="alpha"}') == 3
        assert prometheus.scalar("ouroboros_broker_up") == 1

        # Through it all: every scrape succeeded, and each took well under a second.
        health, error = prometheus.target_health()
        assert (health, error) == ("up", "")
        assert prometheus.scalar("min_over_time(up[10m])") == 1
        slowest = prometheus.scalar("max_over_time(scrape_duration_seconds[10m])")
        assert slowest < SCRAPE_BUDGET_SECONDS, slowest
    finally:
        watched.stop()
