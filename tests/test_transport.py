"""The worker transport's screen, fast: real messages pass it, every malformed shape is named.

Messages are published by the real clients (Celery's ``send_task``, kombu's Producer)
onto a private database of the machine's Redis and popped raw off the list, exactly
as the worker's ``BRPOP`` sees them. The end-to-end drop by a running worker is in
``tests/test_fleet_faults.py``.
"""

from __future__ import annotations

import json

import pytest
import redis
from kombu import Connection, Producer
from kombu.exceptions import OperationalError
from support.fleet import free_port, task_envelope

from worker.fleet.app import GENERATION_TASK, RECONCILE_TASK, client_app, sender
from worker.fleet.settings import Settings
from worker.fleet.transport import (
    MAX_MESSAGE_BYTES,
    ScreeningConnection,
    envelope_problem,
    problem,
)
from worker.instrument.job import GenerationJob

QUEUE = "gen.0123456789ab"
TASKS = frozenset({GENERATION_TASK})


def _popped(url: str) -> bytes:
    raw = redis.Redis.from_url(url).rpop(QUEUE)
    assert raw is not None
    return raw


def test_a_job_sent_by_the_fleets_own_client_passes(redis_url: str) -> None:
    app = client_app(Settings(broker_url=redis_url))
    app.send_task(GENERATION_TASK, kwargs={"payload": {"lineage": "x"}}, queue=QUEUE)
    assert problem(_popped(redis_url), tasks=TASKS) is None


def test_a_recovered_job_is_popped_before_the_jobs_queued_ahead_of_it(redis_url: str) -> None:
    send = sender(client_app(Settings(broker_url=redis_url)))
    job = GenerationJob(lineage="front", expected_commit="a" * 40, provider="scripted")
    for job_id, first in (("queued-1", False), ("queued-2", False), ("recovered", True)):
        send(job, job_id, QUEUE, 600, first)
    # The order kombu's Redis transport pops in, which is the order a worker runs them in.
    with Connection(redis_url) as connection:
        channel = connection.default_channel
        popped = [channel.basic_get(QUEUE, no_ack=True).headers["id"] for _ in range(3)]
    assert popped == ["recovered", "queued-1", "queued-2"]


def test_a_job_requeued_for_its_dead_pool_child_goes_back_to_the_front(redis_url: str) -> None:
    send = sender(client_app(Settings(broker_url=redis_url)))
    job = GenerationJob(lineage="again", expected_commit="a" * 40, provider="scripted")
    for job_id in ("orphaned", "queued-1", "queued-2"):
        send(job, job_id, QUEUE, 600, False)
    with ScreeningConnection(redis_url) as connection:
        channel = connection.default_channel
        delivered = channel.basic_get(QUEUE)
        assert delivered.headers["id"] == "orphaned"
        # What Celery does when the pool child running it dies (task_reject_on_worker_lost).
        channel.basic_reject(delivered.delivery_tag, requeue=True)
        popped = [channel.basic_get(QUEUE, no_ack=True).headers["id"] for _ in range(3)]
    assert popped == ["orphaned", "queued-1", "queued-2"]
    assert redis.Redis.from_url(redis_url).hlen("unacked") == 0


def test_a_pickled_message_is_refused_by_content_type(redis_url: str) -> None:
    with Connection(redis_url) as connection:
        Producer(connection).publish(
            [[], {}, {}],
            serializer="pickle",
            routing_key=QUEUE,
            exchange="",
            headers={"task": GENERATION_TASK, "id": "p"},
        )
    why = problem(_popped(redis_url), tasks=TASKS)
    assert why == (
        "content type 'application/x-python-serialize' refused: this fleet accepts JSON only"
    )


def test_a_task_this_queue_does_not_carry_is_refused(redis_url: str) -> None:
    app = client_app(Settings(broker_url=redis_url))
    app.send_task(RECONCILE_TASK, queue=QUEUE)
    why = problem(_popped(redis_url), tasks=TASKS)
    assert why == f"unknown task '{RECONCILE_TASK}': this queue carries {GENERATION_TASK}"


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"\x80\x04 not json", "not JSON"),
        (b"[1, 2, 3]", "not a kombu message envelope"),
        (
            json.dumps({**task_envelope(GENERATION_TASK, [[], {}, {}]), "properties": {}}).encode(),
            "not a kombu message envelope (properties.delivery_tag: Field required",
        ),
        (
            json.dumps(task_envelope(GENERATION_TASK, {"not": "a task body"})).encode(),
            "the body is not a Celery task body [args, kwargs, embed]",
        ),
        (
            json.dumps({**task_envelope(GENERATION_TASK, []), "body": "%%%"}).encode(),
            "the body is not base64-encoded JSON",
        ),
        (
            json.dumps(
                task_envelope(GENERATION_TASK, [[], {"x": "x" * MAX_MESSAGE_BYTES}, {}])
            ).encode(),
            "-byte limit",
        ),
    ],
    ids=["not-json", "not-an-envelope", "no-delivery-tag", "bad-body", "not-base64", "oversized"],
)
def test_each_malformed_shape_is_named(raw: bytes, why: str) -> None:
    reason = problem(raw, tasks=TASKS)
    assert reason is not None and why in reason


def test_a_broadcast_is_checked_for_its_envelope_only() -> None:
    control = task_envelope("anything", {"method": "ping"})
    assert envelope_problem(control, tasks=None) is None
    assert envelope_problem({"method": "ping"}, tasks=None) is not None


def test_the_worker_reconnects_to_a_restarted_broker_within_a_fraction_of_a_second() -> None:
    # kombu's own pacing waits 2 s after the first refusal, then 4, 6, ... up to 30: every
    # second of it a second in which no life starts after a Redis restart.
    waits: list[float] = []
    nowhere = ScreeningConnection(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(OperationalError):
        nowhere.ensure_connection(lambda _exc, wait: waits.append(wait), max_retries=4)
    assert len(waits) == 4
    assert waits[0] <= 0.25
    assert max(waits) <= 2.0
