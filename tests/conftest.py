"""Shared fixtures: observation stores, a real S3 endpoint for the test session, a
fleet on a private database of the machine's Redis with its workers, and the
machine-wide lock of the heaviest tests.

S3 is moto's standalone server in a subprocess, spoken to over HTTP by the real
boto3 stack: nothing in this process is patched, so signing, addressing, retries
and the ``If-None-Match`` write-once path are exercised as against MinIO or AWS.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import pytest
import redis
from support.browse import Served, serve_session_sample
from support.fleet import MACHINE_REDIS, S3_REGION, Fleet, MotoServer, PrivateRedis, Worker
from support.litellm import running_proxy
from support.rig import Rig, Sent

from worker.fleet import assembly, redis_keys
from worker.fleet.homes import Homes
from worker.fleet.planner import Planner
from worker.fleet.settings import Settings
from worker.instrument.store import ObservationStore, open_store

# The tiers (--fast) and their enforcement; how xdist groups the heavy modules;
# pytester runs the tiers' own tests.
pytest_plugins = ["support.tiers", "support.xdist_schedule", "pytester"]
# The lock every test that wants most of this 2-core machine holds while it runs
# (the compose fleet; a virtual machine): two of them at once, from one session or
# two, would each miss their deadlines. The kernel drops it when the holder exits.
HEAVY_LOCK = Path("/run/lock/ouroboros-heavy-tests.lock")
HEAVY_LOCK_WAIT_SECONDS = 45 * 60
_databases = itertools.count()


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A private, empty database on the machine's Redis."""
    url = f"{MACHINE_REDIS}/{1 + next(_databases) % 15}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url
    client.flushdb()


@pytest.fixture(scope="session")
def served_sample(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One ``schedule-lineage serve`` for the session over the legacy sample, its twin and
    a lineage full of hostile text: the read-only browse, API, schema and metrics tests
    share it."""
    server = serve_session_sample(tmp_path_factory.mktemp("served-sample"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def private_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedis]:
    """One throw-away redis-server for the session (see ``private_redis``)."""
    server = PrivateRedis(tmp_path_factory.mktemp("private-redis"))
    yield server
    server.stop()


@pytest.fixture
def private_redis(private_redis_server: PrivateRedis) -> Iterator[PrivateRedis]:
    """A redis-server of this session alone, emptied before and after the test: for tests
    that need every key of a server (not a database of the machine's Redis) to be theirs.
    A test that kills or restarts its server makes a ``PrivateRedis`` of its own."""
    client = redis.Redis.from_url(private_redis_server.url)
    client.flushall()
    yield private_redis_server
    client.flushall()
    client.close()


@pytest.fixture
def fleet(tmp_path: Path, redis_url: str) -> Fleet:
    """A fleet home on ``redis_url`` with short recovery timings (lease 6 s, retries 1 s)."""
    return Fleet(
        tmp_path,
        OUROBOROS_BROKER_URL=redis_url,
        OUROBOROS_LEASE_SECONDS="6",
        OUROBOROS_SPOOL_RETRY_SECONDS="1",
        OUROBOROS_RECONCILE_INTERVAL_SECONDS="1",
    )


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    """The workers a test starts; each is stopped (its own process group) at the end."""
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.stop()


@pytest.fixture(scope="session")
def aws_test_credentials() -> Iterator[tuple[str, str]]:
    """Dummy AWS credentials in os.environ for the session; yields (key id, secret).

    The store takes credentials only from the standard AWS chain, as in production,
    so the tests put them where that chain looks. pytest's monkeypatch is per test
    and cannot serve a session fixture, so os.environ is set here and restored at
    the end. Host profiles and config files are hidden so that nothing on this
    machine (a real key, a default addressing style) leaks into the tests.
    """
    values = {
        "AWS_ACCESS_KEY_ID": "ouroboros-test-key-id",
        "AWS_SECRET_ACCESS_KEY": "ouroboros-test-secret",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
    cleared = ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL")
    saved = {name: os.environ.get(name) for name in (*values, *cleared)}
    os.environ.update(values)
    for name in cleared:
        os.environ.pop(name, None)
    try:
        yield values["AWS_ACCESS_KEY_ID"], values["AWS_SECRET_ACCESS_KEY"]
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="session")
def s3_endpoint(
    aws_test_credentials: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """URL of a moto S3 server running as a subprocess for the whole session."""
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto_server.log")
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """Name of a fresh, empty bucket on the session's S3 endpoint."""
    name = f"obs-{uuid.uuid4().hex[:16]}"
    client = boto3.session.Session().client("s3", endpoint_url=s3_endpoint, region_name=S3_REGION)
    client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_settings(s3_endpoint: str, s3_bucket: str, tmp_path: Path) -> Settings:
    """Settings whose observation store is ``s3://<fresh bucket>/prefix`` on moto."""
    return Settings(
        home=tmp_path,
        observations=f"s3://{s3_bucket}/prefix",
        s3_endpoint_url=s3_endpoint,
        s3_region=S3_REGION,
    )


@pytest.fixture
def s3_store(s3_settings: Settings) -> ObservationStore:
    """An S3 observation store on a fresh bucket."""
    return open_store(s3_settings.observations_url, s3_settings)


@pytest.fixture
def file_store(tmp_path: Path) -> ObservationStore:
    """A file observation store in a directory that does not exist yet."""
    settings = Settings(home=tmp_path)
    return open_store(settings.observations_url, settings)


@pytest.fixture(params=["file", "s3"])
def observation_store(request: pytest.FixtureRequest) -> ObservationStore:
    """Each store kind in turn: tests using it run once per backend."""
    store: ObservationStore = request.getfixturevalue(f"{request.param}_store")
    return store


@pytest.fixture(scope="module")
def machine_to_itself(request: pytest.FixtureRequest) -> Iterator[None]:
    """Holds HEAVY_LOCK for the requesting module: no other heavy test runs meanwhile."""
    HEAVY_LOCK.parent.mkdir(parents=True, exist_ok=True)
    handle = os.open(HEAVY_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + HEAVY_LOCK_WAIT_SECONDS
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if time.monotonic() > deadline:
                holder = os.pread(handle, 200, 0).decode(errors="replace").strip()
                pytest.fail(
                    f"{HEAVY_LOCK} is still held after {HEAVY_LOCK_WAIT_SECONDS} s by {holder}"
                )
            time.sleep(5)
        os.ftruncate(handle, 0)
        os.pwrite(handle, f"pid {os.getpid()}: {request.module.__name__}\n".encode(), 0)
        yield
    finally:
        os.close(handle)


# The planner's rules on the machine's Redis (database 0, which the slow suite never
# flushes), each test's lineages unique: test_fleet_rules and test_fleet_blocks.
MACHINE_REDIS_DB0 = f"{MACHINE_REDIS}/0"


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(MACHINE_REDIS_DB0)
    yield client
    client.close()


@pytest.fixture
def unique(client: redis.Redis) -> Iterator[Callable[[str], str]]:
    """Lineage names no other test (or concurrent run) uses; their Redis keys go afterwards."""
    made: list[str] = []

    def name(stem: str) -> str:
        made.append(f"{stem}-{secrets.token_hex(6)}")
        return made[-1]

    yield name
    for lineage in made:
        for pattern in (f"{redis_keys.PREFIX}:*:{lineage}", f"{redis_keys.PREFIX}:*:{lineage}:*"):
            for key in client.scan_iter(match=pattern):
                client.delete(key)


@pytest.fixture
def rig(tmp_path: Path, client: redis.Redis, unique: Callable[[str], str]) -> Rig:
    settings = Settings(
        home=tmp_path / "home",
        broker_url=MACHINE_REDIS_DB0,
        visibility_timeout_seconds=7200,
        inflight_ttl_seconds=300,
    )
    sent = Sent()
    store = assembly.observation_store(settings)
    planner = Planner(
        settings=settings,
        store=store,
        homes=Homes(settings, "scheduler", store),
        client=client,
        send=sent,
    )
    return Rig(planner=planner, sent=sent, client=client, name=unique)


@pytest.fixture(scope="session")
def litellm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL of a LiteLLM proxy answering from mocks, for the whole session."""
    with running_proxy(tmp_path_factory.mktemp("litellm")) as url:
        yield url
