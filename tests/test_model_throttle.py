"""The cap on calls to a provider: kept in one process, and shared by a fleet through Redis.

Every case runs against both forms: ``LocalThrottle`` (the instrument's in-process
cap) and ``RedisThrottle`` on the machine's real Redis (keys under a prefix of the
test's own, so concurrent suites never share a count). Two RedisThrottle objects
with clients of their own stand for two workers, and a killed process for a worker
that dies while it waits. The "minute" of the paces is cut to a second so that the
cases run in seconds. Arrival order is made certain by waiting for each waiter's
place before the next one comes, never by sleeping.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from support.fleet import MACHINE_REDIS, wait_for

from worker.fleet.assembly import model_cap, model_caps, model_throttle
from worker.fleet.model_throttle import RedisThrottle
from worker.fleet.settings import Settings, load_settings
from worker.instrument.errors import Refusal
from worker.instrument.model.throttle import Cap, LocalThrottle, NoRoom

REDIS_URL = f"{MACHINE_REDIS}/0"
WINDOW = 1.0
NEVER = threading.Event()

ROOT = Path(__file__).resolve().parents[1]

Queued = LocalThrottle | RedisThrottle
MakeThrottle = Callable[..., Queued]


@pytest.fixture
def prefix() -> Iterator[str]:
    name = f"ouroboros-test-{uuid.uuid4().hex[:12]}"
    yield name
    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(f"{name}:*"):
        client.delete(key)


@pytest.fixture(params=["local", "redis"])
def make_throttle(request: pytest.FixtureRequest, prefix: str) -> MakeThrottle:
    """Throttles that share one cap: the same object in-process, one client each in Redis."""
    local: dict[tuple[Cap, tuple[tuple[str, Cap], ...]], LocalThrottle] = {}

    def make(cap: Cap, models: dict[str, Cap] | None = None) -> Queued:
        models = models or {}
        if request.param == "local":
            return local.setdefault((cap, tuple(models.items())), LocalThrottle(cap, models))
        return RedisThrottle(redis.Redis.from_url(REDIS_URL), cap, models, prefix=prefix)

    return make


def soon(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


def start_waiter(
    throttle: Queued, model: str, outcome: list[str], stop: threading.Event = NEVER
) -> threading.Thread:
    """A caller on a thread of its own that waits up to 30 s and says how it ended."""

    def wait() -> None:
        try:
            with throttle.admit("p", model, 1, soon(30), stop):
                outcome.append("admitted")
        except NoRoom:
            outcome.append("gave up")

    caller = threading.Thread(target=wait)
    caller.start()
    return caller


@pytest.mark.full
def test_concurrent_calls_beyond_the_cap_wait_until_one_ends(make_throttle: MakeThrottle) -> None:
    cap = Cap(concurrent_calls=2)
    first, second = make_throttle(cap), make_throttle(cap)
    waited: list[float] = []

    def third() -> None:
        with first.admit("p", "m", 1, soon(), NEVER) as admission:
            waited.append(admission.waited_seconds)

    with first.admit("p", "m", 1, soon(), NEVER), second.admit("p", "m", 1, soon(), NEVER):
        caller = threading.Thread(target=third)
        caller.start()
        time.sleep(0.6)
        assert waited == []
    caller.join(10)

    assert len(waited) == 1 and waited[0] >= 0.5


@pytest.mark.full
def test_requests_are_paced_one_per_minute_over_the_rate_across_workers(
    make_throttle: MakeThrottle,
) -> None:
    cap = Cap(requests_per_minute=4, window_seconds=WINDOW)
    workers = [make_throttle(cap), make_throttle(cap)]

    admitted = []
    for number in range(6):
        with workers[number % 2].admit("p", "m", 1, soon(), NEVER):
            admitted.append(time.monotonic())

    # Never a burst: each request a quarter of the "minute" after the one before, so no
    # window of that length, nor any shorter one, holds more than its share.
    gaps = [later - earlier for earlier, later in itertools.pairwise(admitted)]
    assert all(gap >= 0.9 * WINDOW / 4 for gap in gaps), gaps


@pytest.mark.full
def test_each_request_holds_back_the_next_for_its_tokens_share(
    make_throttle: MakeThrottle,
) -> None:
    throttle = make_throttle(Cap(tokens_per_minute=1000, window_seconds=WINDOW))

    with throttle.admit("p", "m", 300, soon(), NEVER):
        first = time.monotonic()
    # Larger than the whole minute's budget: it goes, and is followed by a longer gap.
    with throttle.admit("p", "m", 2000, soon(), NEVER):
        second = time.monotonic()
    with throttle.admit("p", "m", 1, soon(), NEVER):
        third = time.monotonic()

    assert second - first >= 0.9 * 0.3 * WINDOW
    assert third - second >= 0.9 * 2 * WINDOW


@pytest.mark.full
def test_each_provider_has_a_cap_of_its_own(make_throttle: MakeThrottle) -> None:
    throttle = make_throttle(Cap(concurrent_calls=1))

    with (
        throttle.admit("anthropic", "m", 1, soon(), NEVER),
        throttle.admit("openai", "m", 1, soon(), NEVER) as other,
    ):
        assert other.waited_seconds < 0.5


@pytest.mark.full
def test_no_room_before_the_deadline_raises_without_holding_anything(
    make_throttle: MakeThrottle,
) -> None:
    cap = Cap(concurrent_calls=1)
    holder, waiter = make_throttle(cap), make_throttle(cap)

    with holder.admit("p", "m", 1, soon(), NEVER):
        started = time.monotonic()
        with (
            pytest.raises(NoRoom, match="no room under the fleet's cap for p") as refused,
            waiter.admit("p", "m", 1, soon(0.5), NEVER),
        ):
            pytest.fail("admitted beyond the cap")
        assert time.monotonic() - started < 3
    assert refused.value.waited_seconds >= 0.4
    # Its place in the queue went with it: nobody waits behind a caller that gave up.
    assert waiter.waiting("p") == 0

    with waiter.admit("p", "m", 1, soon(), NEVER) as admission:
        assert admission.waited_seconds < 0.5


@pytest.mark.full
def test_a_waiter_gives_up_at_once_when_the_life_ends(make_throttle: MakeThrottle) -> None:
    cap = Cap(concurrent_calls=1)
    holder, waiter = make_throttle(cap), make_throttle(cap)
    ended = threading.Event()
    outcome: list[str] = []

    with holder.admit("p", "m", 1, soon(), NEVER):
        caller = start_waiter(waiter, "m", outcome, ended)
        time.sleep(0.3)
        started = time.monotonic()
        ended.set()
        caller.join(10)
        assert time.monotonic() - started < 2

    assert outcome == ["gave up"]


@pytest.mark.full
def test_room_given_back_early_is_free_at_once_and_is_given_back_only_once(
    make_throttle: MakeThrottle,
) -> None:
    cap = Cap(concurrent_calls=1)
    abandoned, other = make_throttle(cap), make_throttle(cap)

    with abandoned.admit("p", "m", 1, soon(), NEVER) as admission:
        # The life ended while the vendor still holds the request.
        admission.release()
        admission.release()
        with other.admit("p", "m", 1, soon(), NEVER) as next_call:
            assert next_call.waited_seconds < 1
            with pytest.raises(NoRoom), other.admit("p", "m", 1, soon(0.3), NEVER):
                pass
    # The release, its repeat and the block's end gave back one call's room, not three.
    with (
        other.admit("p", "m", 1, soon(), NEVER),
        pytest.raises(NoRoom),
        other.admit("p", "m", 1, soon(0.3), NEVER),
    ):
        pass


@pytest.mark.full
def test_a_dead_workers_hold_expires_with_its_deadline(prefix: str) -> None:
    cap = Cap(concurrent_calls=1)
    client = redis.Redis.from_url(REDIS_URL)
    dead = RedisThrottle(client, cap, prefix=prefix, hold_margin_seconds=0)
    # A worker that took room and died: its hold is never released.
    hold = dead.admit("p", "m", 1, soon(1.0), NEVER)
    hold.__enter__()
    alive = RedisThrottle(redis.Redis.from_url(REDIS_URL), cap, prefix=prefix)

    with alive.admit("p", "m", 1, soon(), NEVER) as admission:
        assert 0.5 <= admission.waited_seconds < 3


@pytest.mark.full
def test_unreachable_redis_lets_the_call_through_and_says_so(prefix: str) -> None:
    unreachable = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=1)
    throttle = RedisThrottle(unreachable, Cap(concurrent_calls=1), prefix=prefix)

    with throttle.admit("p", "m", 1, soon(), NEVER) as admission:
        assert admission.note is not None
        assert "could not be reached" in admission.note


@pytest.mark.full
def test_the_idle_cap_leaves_no_key_behind(prefix: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    throttle = RedisThrottle(client, Cap(concurrent_calls=1, requests_per_minute=5), prefix=prefix)

    with throttle.admit("p", "m", 1, soon(), NEVER):
        pass

    calls, pace, queue, places = throttle.keys("p")
    assert not client.exists(calls, queue, places)
    # The pace outlives the last request by its gap (12 s at 5 a minute) and a second.
    assert 0 < client.pttl(pace) <= 13_000


@pytest.mark.full
def test_waiters_are_admitted_in_the_order_they_arrived(make_throttle: MakeThrottle) -> None:
    cap = Cap(concurrent_calls=1)
    holder = make_throttle(cap)
    admitted: list[int] = []

    def wait(number: int) -> None:
        with make_throttle(cap).admit("p", "m", 1, soon(60), NEVER):
            admitted.append(number)

    callers = [threading.Thread(target=wait, args=(number,)) for number in range(6)]
    with holder.admit("p", "m", 1, soon(), NEVER):
        for number, caller in enumerate(callers):
            caller.start()
            wait_for(lambda n=number: holder.waiting("p") == n + 1, 10, f"waiter {number} to queue")
    for caller in callers:
        caller.join(60)

    assert admitted == list(range(6))


@pytest.mark.full
def test_a_waiter_that_dies_holds_up_those_behind_it_only_until_its_place_lapses(
    prefix: str,
) -> None:
    cap = Cap(concurrent_calls=1)
    holder = RedisThrottle(redis.Redis.from_url(REDIS_URL), cap, prefix=prefix)
    # A worker of its own, waiting with a place that lapses a second after its last look.
    dying = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import redis, threading, time\n"
            "from worker.fleet.model_throttle import RedisThrottle\n"
            "from worker.instrument.model.throttle import Cap\n"
            f"client = redis.Redis.from_url({REDIS_URL!r})\n"
            "throttle = RedisThrottle(client, Cap(concurrent_calls=1),"
            f" prefix={prefix!r}, place_seconds=1.0)\n"
            "with throttle.admit('p', 'm', 1, time.monotonic() + 600, threading.Event()):\n"
            "    time.sleep(600)\n",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    admitted: list[float] = []

    def wait() -> None:
        with RedisThrottle(redis.Redis.from_url(REDIS_URL), cap, prefix=prefix).admit(
            "p", "m", 1, soon(30), NEVER
        ) as admission:
            admitted.append(admission.waited_seconds)

    behind = threading.Thread(target=wait)
    try:
        with holder.admit("p", "m", 1, soon(60), NEVER):
            wait_for(lambda: holder.waiting("p") == 1, 30, "the dying worker to queue")
            behind.start()
            wait_for(lambda: holder.waiting("p") == 2, 10, "the live waiter to queue")
            dying.send_signal(signal.SIGKILL)
            dying.wait(10)
        # The dead worker heads the queue and never looks again: its place lapses.
        behind.join(30)
    finally:
        dying.kill()
        dying.wait(10)

    assert len(admitted) == 1 and admitted[0] < 30
    assert holder.waiting("p") == 0


@pytest.mark.full
def test_a_model_cap_holds_beside_its_providers_and_never_holds_up_other_models(
    make_throttle: MakeThrottle,
) -> None:
    cap, models = Cap(concurrent_calls=2), {"big": Cap(concurrent_calls=1)}
    first, second = make_throttle(cap, models), make_throttle(cap, models)
    outcome: list[str] = []

    with first.admit("p", "big", 1, soon(), NEVER):
        # The model's only room is taken; the provider's second is free for another model.
        waiter = start_waiter(second, "big", outcome)
        wait_for(lambda: first.waiting("p", "big") == 1, 10, "the second big call to queue")
        with second.admit("p", "small", 1, soon(), NEVER) as small:
            assert small.waited_seconds < 2
            assert outcome == []
            # The provider's cap is full now, whatever the model.
            with pytest.raises(NoRoom), second.admit("p", "other", 1, soon(0.5), NEVER):
                pass
        # The same model at another provider is that provider's own account.
        with second.admit("q", "big", 1, soon(), NEVER) as elsewhere:
            assert elsewhere.waited_seconds < 2
        assert outcome == []
    waiter.join(30)

    assert outcome == ["admitted"]


def test_a_cap_per_model_is_read_from_json_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "OUROBOROS_MODEL_CAP_PER_MODEL",
        '{"gpt-4o": {"requests_per_minute": 30, "max_concurrent_calls": 4}, "o3": {}}',
    )

    assert model_caps(load_settings()) == {
        "gpt-4o": Cap(concurrent_calls=4, requests_per_minute=30),
        "o3": Cap(),
    }


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"gpt-4o": {"requests_per_minute": 3', "not JSON"),
        ('{"gpt-4o": {"requests_per_minute": -1}}', "gpt-4o.requests_per_minute: Input should be"),
        ('{"gpt-4o": {"rpm": 3}}', "gpt-4o.rpm: Extra inputs are not permitted"),
        ('{"": {"requests_per_minute": 3}}', "at least 1 character"),
        ('["gpt-4o"]', "Input should be a valid dictionary"),
    ],
)
def test_a_bad_cap_per_model_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, value: str, message: str
) -> None:
    monkeypatch.setenv("OUROBOROS_MODEL_CAP_PER_MODEL", value)

    with pytest.raises(Refusal) as refused:
        load_settings()

    text = str(refused.value)
    assert text.startswith("OUROBOROS_MODEL_CAP_PER_MODEL: ") and message in text
    assert "\n" not in text


def test_the_settings_default_to_a_cap_every_paid_tier_can_take() -> None:
    assert model_cap(Settings()) == Cap(
        concurrent_calls=16, requests_per_minute=50, tokens_per_minute=0
    )
    assert model_cap(Settings(model_requests_per_minute=0)).requests_per_minute == 0


def test_a_fleet_worker_shares_the_cap_through_redis_and_a_local_run_keeps_its_own() -> None:
    settings = Settings(broker_url=REDIS_URL, model_max_concurrent_calls=3)

    shared = model_throttle(settings, shared=True)
    local = model_throttle(settings, shared=False)

    assert isinstance(shared, RedisThrottle) and shared.cap.concurrent_calls == 3
    assert isinstance(local, LocalThrottle) and local.cap.concurrent_calls == 3
