"""The web process's bounds on its dependencies: ``Probe`` and ``GuardedStore``.

A probe's source here is a function that blocks until the test lets it go (a source
that hangs), fails, or answers: the contract is about time and sharing, whatever the
source. The store guard is tested over boto3's real S3 client against a listener that
never answers and against moto's S3 server.
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import pytest
from support.fleet import S3_REGION
from support.prometheus import Silent

from scheduler.web.probes import Probe
from scheduler.web.store_guard import GuardedStore
from worker.fleet.settings import Settings
from worker.instrument.store import StoreUnavailable, open_store


def test_concurrent_readers_share_one_probe_and_none_waits_past_the_budget() -> None:
    release = threading.Event()
    calls = []

    def hangs() -> int:
        calls.append(1)
        release.wait(10)
        return 42

    probe = Probe("hangs", hangs, interval=60, budget=0.2)
    started = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda _: probe.latest(), range(64)))
    elapsed = time.monotonic() - started
    assert answers == [None] * 64  # no answer yet: unknown
    assert elapsed < 1.5, elapsed  # 64 readers, 16 at a time: each waited once, at most 0.2 s
    assert len(calls) == 1
    release.set()
    deadline = time.monotonic() + 5
    while (answer := probe.latest()) is None:
        assert time.monotonic() < deadline
    assert (answer.value, answer.error) == (42, None)
    assert len(calls) == 1


def test_one_probe_per_interval_and_a_recent_answer_is_served_meanwhile() -> None:
    calls: list[float] = []

    def counts() -> int:
        calls.append(time.monotonic())
        time.sleep(0.3)  # slower than the budget: readers get the last answer meanwhile
        return len(calls)

    probe = Probe("counts", counts, interval=0.5, budget=1.0)
    first = probe.latest()
    assert first is not None and first.value == 1
    started = time.monotonic()
    while time.monotonic() - started < 2.0:
        began = time.monotonic()
        answer = probe.latest()
        assert time.monotonic() - began < 0.1  # never waits while a recent answer exists
        assert answer is not None and answer.ok
        time.sleep(0.01)
    # ~200 reads in 2 s; the source was asked about once per interval plus its own time.
    assert 2 <= len(calls) <= 6, len(calls)


def test_a_failure_is_an_answer_and_an_old_answer_is_none() -> None:
    fail = threading.Event()

    def flaky() -> str:
        if fail.is_set():
            raise ConnectionRefusedError(111, "Connection refused")
        return "fine"

    probe = Probe("flaky", flaky, interval=0.1, budget=0.5, max_age=0.3)
    answer = probe.latest()
    assert answer is not None and answer.value == "fine"
    fail.set()
    time.sleep(0.15)
    probe.latest()  # starts the next probe
    time.sleep(0.1)
    answer = probe.latest()
    assert answer is not None and answer.value is None
    assert answer.error == "refused the connection: nothing listens there"


def test_an_answer_older_than_max_age_is_not_given() -> None:
    release = threading.Event()
    calls = []

    def once_then_hangs() -> str:
        calls.append(1)
        if len(calls) > 1:
            release.wait(10)
        return "answer"

    probe = Probe("stale", once_then_hangs, interval=0.1, budget=0.05, max_age=0.3)
    assert probe.latest() is not None
    time.sleep(0.15)
    assert probe.latest() is not None  # due, asked again; the last answer is still recent
    time.sleep(0.3)
    assert probe.latest() is None  # the source hangs: what it said long ago is no answer
    release.set()


def _s3_settings(endpoint: str) -> Settings:
    return Settings(s3_endpoint_url=endpoint, s3_region=S3_REGION)


@pytest.mark.full
def test_a_hanging_store_costs_one_call_budget_then_fails_fast(
    aws_test_credentials: tuple[str, str],
) -> None:
    silent = Silent()
    try:
        inner = open_store("s3://hanging/fleet", _s3_settings(f"http://127.0.0.1:{silent.port}"))
        store = GuardedStore(inner, call_seconds=0.3, down_seconds=1.0)
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match=r"did not answer within 0\.3 s"):
            store.get("lineages/alpha/index.json")
        assert time.monotonic() - started < 1.0
        connections = len(silent.accepted)
        started = time.monotonic()
        for _ in range(50):
            with pytest.raises(StoreUnavailable, match=r"did not answer within 0\.3 s"):
                store.list("lineages/")
        assert time.monotonic() - started < 0.5  # failed fast: the outage is remembered
        assert len(silent.accepted) == connections  # and the store was not asked again
        with pytest.raises(StoreUnavailable, match="only reads"):
            store.put("lineages/alpha/x", b"x")
    finally:
        silent.stop()


@pytest.mark.full
def test_a_store_that_comes_back_is_read_again(tmp_path: Path, s3_endpoint: str) -> None:
    bucket = f"guard-{uuid.uuid4().hex[:12]}"
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name=S3_REGION)
    inner = open_store(f"s3://{bucket}/fleet", _s3_settings(s3_endpoint))
    store = GuardedStore(inner, call_seconds=2.0, down_seconds=0.5)
    with pytest.raises(StoreUnavailable):
        store.get("lineages/alpha/index.json")  # no such bucket yet: the store refuses
    s3.create_bucket(Bucket=bucket)
    s3.put_object(Bucket=bucket, Key="fleet/lineages/alpha/index.json", Body=b"{}")
    with pytest.raises(StoreUnavailable):
        store.get("lineages/alpha/index.json")  # still within the remembered outage
    time.sleep(0.6)
    assert store.get("lineages/alpha/index.json") == b"{}"
    assert store.list("lineages/") == ["lineages/alpha/index.json"]
