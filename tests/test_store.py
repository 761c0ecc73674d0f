"""The observation store: write-once, overwrite, listing order, isolation and failure modes.

Behaviour tests run against both backends (``observation_store``); S3 is moto's
standalone server over HTTP. The 409 tests use a scripted S3 stand-in over real
sockets because no emulator produces ConditionalRequestConflict on demand.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import boto3
import pytest

from worker.fleet.settings import Settings
from worker.instrument.errors import Refusal
from worker.instrument.store import FileStore, ObservationStore, StoreUnavailable, open_store
from worker.instrument.store_keys import generation_key, metadata_key, run_key


def test_put_once_writes_once_and_leaves_the_first_object(
    observation_store: ObservationStore,
) -> None:
    key = generation_key("alpha", 1)

    assert observation_store.put_once(key, b'{"first": true}') is True
    assert observation_store.put_once(key, b'{"second": true}') is False
    assert observation_store.get(key) == b'{"first": true}'


def test_put_overwrites(observation_store: ObservationStore) -> None:
    key = metadata_key("alpha")

    observation_store.put(key, b"old")
    observation_store.put(key, b"new")

    assert observation_store.get(key) == b"new"


def test_get_of_a_missing_key_is_none(observation_store: ObservationStore) -> None:
    observation_store.put(metadata_key("alpha"), b"{}")

    assert observation_store.get(generation_key("alpha", 1)) is None
    # A "directory" of other keys is no object either.
    assert observation_store.get("lineages/alpha") is None


def test_list_returns_keys_sorted_in_generation_order(
    observation_store: ObservationStore,
) -> None:
    generations = [generation_key("alpha", n) for n in range(1, 13)]
    for key in random.Random(7).sample(generations, len(generations)):
        observation_store.put_once(key, b"{}")
    observation_store.put(metadata_key("alpha"), b"{}")
    observation_store.put(run_key("alpha", "r1"), b"{}")
    observation_store.put(metadata_key("alphabet"), b"{}")

    assert observation_store.list("lineages/alpha/generations/") == generations
    assert observation_store.list("lineages/alpha/") == [
        *generations,
        metadata_key("alpha"),
        run_key("alpha", "r1"),
    ]
    # A prefix is a plain string prefix, as S3 lists it, on both backends.
    assert observation_store.list("lineages/alpha/m") == [metadata_key("alpha")]
    assert observation_store.list("lineages/alph") == [
        *generations,
        metadata_key("alpha"),
        run_key("alpha", "r1"),
        metadata_key("alphabet"),
    ]
    assert observation_store.list("lineages/beta/") == []


def test_concurrent_put_once_has_exactly_one_winner(
    observation_store: ObservationStore,
) -> None:
    key = generation_key("alpha", 3)
    start = threading.Barrier(8)
    results: dict[int, bool] = {}

    def write(writer: int) -> None:
        start.wait()
        results[writer] = observation_store.put_once(key, f"writer {writer}".encode())

    threads = [threading.Thread(target=write, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    winners = [writer for writer, won in results.items() if won]
    assert len(results) == 8
    assert len(winners) == 1
    assert observation_store.get(key) == f"writer {winners[0]}".encode()


@pytest.mark.parametrize(
    "bad",
    ["", "/lineages/a.json", "lineages/../a.json", "lineages//a.json", "lineages/a/",
     "lineages\\a.json", "lineages/./a.json", "lineages/.hidden", "lineages/a\x00.json"],
)  # fmt: skip
def test_invalid_keys_are_refused(observation_store: ObservationStore, bad: str) -> None:
    with pytest.raises(ValueError, match="invalid store key"):
        observation_store.put_once(bad, b"x")
    with pytest.raises(ValueError, match="invalid store key"):
        observation_store.put(bad, b"x")
    with pytest.raises(ValueError, match="invalid store key"):
        observation_store.get(bad)


@pytest.mark.parametrize("bad", ["/lineages/", "lineages/../", "..", "lineages//a", "a\\b"])
def test_invalid_list_prefixes_are_refused(file_store: ObservationStore, bad: str) -> None:
    with pytest.raises(ValueError, match="invalid store prefix"):
        file_store.list(bad)


def test_s3_prefixes_in_one_bucket_do_not_see_each_other(
    s3_settings: Settings, s3_bucket: str
) -> None:
    one = open_store(f"s3://{s3_bucket}/fleet-one", s3_settings)
    two = open_store(f"s3://{s3_bucket}/fleet-two/", s3_settings)
    whole = open_store(f"s3://{s3_bucket}", s3_settings)
    key = generation_key("alpha", 1)

    assert one.put_once(key, b"one") is True
    assert two.put_once(key, b"two") is True

    assert one.list("") == [key]
    assert two.list("") == [key]
    assert (one.get(key), two.get(key)) == (b"one", b"two")
    assert whole.list("") == [f"fleet-one/{key}", f"fleet-two/{key}"]


def test_s3_json_objects_are_stored_as_application_json(
    s3_store: ObservationStore, s3_settings: Settings, s3_bucket: str
) -> None:
    s3_store.put_once(generation_key("alpha", 1), b"{}")

    client = boto3.session.Session().client(
        "s3", endpoint_url=s3_settings.s3_endpoint_url, region_name=s3_settings.s3_region
    )
    head = client.head_object(Bucket=s3_bucket, Key=f"prefix/{generation_key('alpha', 1)}")
    assert head["ContentType"] == "application/json"


def test_s3_unreachable_endpoint_fails_fast_naming_the_store_not_the_credentials(
    aws_test_credentials: tuple[str, str], tmp_path: Path
) -> None:
    # Bound but not listening: connections are refused, and no one else can take it.
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{holder.getsockname()[1]}"
        settings = Settings(home=tmp_path, s3_endpoint_url=closed, s3_region="us-east-1")
        store = open_store("s3://observations/fleet", settings)

        began = time.monotonic()
        with pytest.raises(StoreUnavailable) as raised:
            store.put_once(generation_key("alpha", 1), b"{}")
        elapsed = time.monotonic() - began

    message = str(raised.value)
    assert elapsed < 15
    assert "s3://observations/fleet" in message
    assert closed in message
    for secret in aws_test_credentials:
        assert secret not in message


def test_s3_missing_bucket_is_store_unavailable(s3_settings: Settings) -> None:
    store = open_store("s3://no-such-bucket-here/fleet", s3_settings)

    with pytest.raises(StoreUnavailable, match=r"s3://no-such-bucket-here/fleet.*NoSuchBucket"):
        store.put(metadata_key("alpha"), b"{}")


def test_file_store_creates_its_directory_on_first_write(tmp_path: Path) -> None:
    base = tmp_path / "not yet" / "observations"
    store = open_store(base.as_uri(), Settings(home=tmp_path))

    assert store.get(metadata_key("alpha")) is None
    assert store.list("") == []
    assert not base.exists()

    store.put(metadata_key("alpha"), b"{}")
    assert (base / metadata_key("alpha")).read_bytes() == b"{}"


def test_file_store_readers_never_see_a_partial_object(file_store: ObservationStore) -> None:
    # Large enough that a plain write would be observed half done.
    versions = [bytes([letter]) * (4 * 1024 * 1024) for letter in b"ab"]
    once_key, put_key = generation_key("alpha", 1), metadata_key("alpha")
    done = threading.Event()
    seen: set[bytes | None] = set()
    torn: list[int] = []

    def read() -> None:
        while not done.is_set():
            for key in (once_key, put_key):
                data = file_store.get(key)
                if data is not None and data not in versions:
                    torn.append(len(data))
                seen.add(data if data is None else data[:1])

    reader = threading.Thread(target=read)
    reader.start()
    try:
        file_store.put_once(once_key, versions[0])
        for round_ in range(20):
            file_store.put(put_key, versions[round_ % 2])
    finally:
        done.set()
        reader.join()

    assert torn == []
    assert b"a" in seen
    # Staging files are gone and never listed.
    assert file_store.list("") == [once_key, put_key]
    assert isinstance(file_store, FileStore)
    left = sorted(path.name for path in (file_store.base / "lineages/alpha").iterdir())
    assert left == ["generations", "metadata.json"]


def test_file_store_failure_is_store_unavailable(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    store = open_store((blocker / "observations").as_uri(), Settings(home=tmp_path))

    with pytest.raises(StoreUnavailable, match=str(blocker)):
        store.put_once(metadata_key("alpha"), b"{}")


@pytest.mark.parametrize(
    "url",
    ["", "http://minio:9000/bucket", "/srv/observations", "file://relative/path",
     "file:relative", "s3://", "s3://Not_A_Bucket/p", "s3://bucket/a/../b",
     "s3://bucket/p?versioning=1"],
)  # fmt: skip
def test_unknown_store_urls_are_refused(url: str, tmp_path: Path) -> None:
    with pytest.raises(Refusal) as raised:
        open_store(url, Settings(home=tmp_path))

    assert "OUROBOROS_OBSERVATIONS" in str(raised.value)
    assert "file:///absolute/path or s3://bucket[/prefix]" in str(raised.value)


def test_store_url_with_credentials_is_refused_without_echoing_them(tmp_path: Path) -> None:
    with pytest.raises(Refusal) as raised:
        open_store("s3://AKIAEXAMPLE:hunter2@bucket/p", Settings(home=tmp_path))

    assert "hunter2" not in str(raised.value)
    assert "AKIAEXAMPLE" not in str(raised.value)


class ScriptedS3:
    """An S3 stand-in answering each PutObject with the next scripted error code or 200."""

    def __init__(self, answers: list[str | None]) -> None:
        self.answers = answers
        self.puts: list[str | None] = []
        script = self

        class Handler(BaseHTTPRequestHandler):
            # HTTP/1.1 so that botocore's "Expect: 100-continue" is answered at once.
            protocol_version = "HTTP/1.1"

            def do_PUT(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                script.puts.append(self.headers.get("If-None-Match"))
                code = script.answers.pop(0) if script.answers else "ConditionalRequestConflict"
                status = {None: 200, "PreconditionFailed": 412}.get(code, 409)
                body = b"" if code is None else _error_xml(code)
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("ETag", '"0"')
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


def _error_xml(code: str) -> bytes:
    return f"<Error><Code>{code}</Code><Message>scripted</Message></Error>".encode()


StartScript = Callable[[list[str | None]], ScriptedS3]


@pytest.fixture
def scripted_s3(aws_test_credentials: tuple[str, str]) -> Iterator[StartScript]:
    """Starts ScriptedS3 servers (with the dummy credentials set) and stops them after."""
    started: list[ScriptedS3] = []

    def start(answers: list[str | None]) -> ScriptedS3:
        script = ScriptedS3(answers)
        serve = threading.Thread(target=script.server.serve_forever, args=(0.05,), daemon=True)
        serve.start()
        started.append(script)
        return script

    yield start
    for script in started:
        script.server.shutdown()
        script.server.server_close()


@pytest.mark.parametrize(
    ("answers", "written"),
    [(["ConditionalRequestConflict", "PreconditionFailed"], False),
     (["ConditionalRequestConflict", None], True)],
)  # fmt: skip
def test_s3_conditional_write_conflict_is_retried_until_settled(
    scripted_s3: StartScript, answers: list[str | None], written: bool, tmp_path: Path
) -> None:
    script = scripted_s3(answers)
    settings = Settings(home=tmp_path, s3_endpoint_url=script.url, s3_region="us-east-1")

    store = open_store("s3://observations/fleet", settings)

    assert store.put_once(generation_key("alpha", 1), b"{}") is written
    assert script.puts == ["*", "*"]


def test_s3_conditional_write_conflict_that_never_settles_is_store_unavailable(
    scripted_s3: StartScript, tmp_path: Path
) -> None:
    script = scripted_s3([])
    settings = Settings(home=tmp_path, s3_endpoint_url=script.url, s3_region="us-east-1")

    store = open_store("s3://observations/fleet", settings)

    with pytest.raises(StoreUnavailable, match="ConditionalRequestConflict"):
        store.put_once(generation_key("alpha", 1), b"{}")
