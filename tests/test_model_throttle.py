"""The cap on calls to a provider: kept in one process, and shared by a fleet through Redis.

Every case runs against both forms: ``LocalThrottle`` (the instrument's in-process
cap) and ``RedisThrottle`` on the machine's real Redis (keys under a prefix of the
test's own, so concurrent suites never share a count). Two RedisThrottle objects
with clients of their own stand for two workers. The "minute" of the paces is cut
to a second so that the cases run in seconds.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis
from support.fleet import MACHINE_REDIS

from worker.fleet.assembly import model_cap, model_throttle
from worker.fleet.model_throttle import RedisThrottle
from worker.fleet.settings import Settings
from worker.instrument.model.throttle import Cap, LocalThrottle, NoRoom, Throttle

REDIS_URL = f"{MACHINE_REDIS}/0"
WINDOW = 1.0
NEVER = threading.Event()

MakeThrottle = Callable[[Cap], Throttle]


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
    local: dict[Cap, LocalThrottle] = {}

    def make(cap: Cap) -> Throttle:
        if request.param == "local":
            return local.setdefault(cap, LocalThrottle(cap))
        return RedisThrottle(redis.Redis.from_url(REDIS_URL), cap, prefix=prefix)

    return make


def soon(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


@pytest.mark.full
def test_concurrent_calls_beyond_the_cap_wait_until_one_ends(make_throttle: MakeThrottle) -> None:
    cap = Cap(concurrent_calls=2)
    first, second = make_throttle(cap), make_throttle(cap)
    waited: list[float] = []

    def third() -> None:
        with first.admit("p", 1, soon(), NEVER) as admission:
            waited.append(admission.waited_seconds)

    with first.admit("p", 1, soon(), NEVER), second.admit("p", 1, soon(), NEVER):
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
        with workers[number % 2].admit("p", 1, soon(), NEVER):
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

    with throttle.admit("p", 300, soon(), NEVER):
        first = time.monotonic()
    # Larger than the whole minute's budget: it goes, and is followed by a longer gap.
    with throttle.admit("p", 2000, soon(), NEVER):
        second = time.monotonic()
    with throttle.admit("p", 1, soon(), NEVER):
        third = time.monotonic()

    assert second - first >= 0.9 * 0.3 * WINDOW
    assert third - second >= 0.9 * 2 * WINDOW


@pytest.mark.full
def test_each_provider_has_a_cap_of_its_own(make_throttle: MakeThrottle) -> None:
    throttle = make_throttle(Cap(concurrent_calls=1))

    with (
        throttle.admit("anthropic", 1, soon(), NEVER),
        throttle.admit("openai", 1, soon(), NEVER) as other,
    ):
        assert other.waited_seconds < 0.5


@pytest.mark.full
def test_no_room_before_the_deadline_raises_without_holding_anything(
    make_throttle: MakeThrottle,
) -> None:
    cap = Cap(concurrent_calls=1)
    holder, waiter = make_throttle(cap), make_throttle(cap)

    with holder.admit("p", 1, soon(), NEVER):
        started = time.monotonic()
        with (
            pytest.raises(NoRoom, match="no room under the fleet's cap for p") as refused,
            waiter.admit("p", 1, soon(0.5), NEVER),
        ):
            pytest.fail("admitted beyond the cap")
        assert time.monotonic() - started < 3
    assert refused.value.waited_seconds >= 0.4

    with waiter.admit("p", 1, soon(), NEVER) as admission:
        assert admission.waited_seconds < 0.5


@pytest.mark.full
def test_a_waiter_gives_up_at_once_when_the_life_ends(make_throttle: MakeThrottle) -> None:
    cap = Cap(concurrent_calls=1)
    holder, waiter = make_throttle(cap), make_throttle(cap)
    ended = threading.Event()
    outcome: list[str] = []

    def wait() -> None:
        try:
            with waiter.admit("p", 1, soon(30), ended):
                outcome.append("admitted")
        except NoRoom:
            outcome.append("gave up")

    with holder.admit("p", 1, soon(), NEVER):
        caller = threading.Thread(target=wait)
        caller.start()
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

    with abandoned.admit("p", 1, soon(), NEVER) as admission:
        # The life ended while the vendor still holds the request.
        admission.release()
        admission.release()
        with other.admit("p", 1, soon(), NEVER) as next_call:
            assert next_call.waited_seconds < 1
            with pytest.raises(NoRoom), other.admit("p", 1, soon(0.3), NEVER):
                pass
    # The release, its repeat and the block's end gave back one call's room, not three.
    with (
        other.admit("p", 1, soon(), NEVER),
        pytest.raises(NoRoom),
        other.admit("p", 1, soon(0.3), NEVER),
    ):
        pass


@pytest.mark.full
def test_a_dead_workers_hold_expires_with_its_deadline(prefix: str) -> None:
    cap = Cap(concurrent_calls=1)
    client = redis.Redis.from_url(REDIS_URL)
    dead = RedisThrottle(client, cap, prefix=prefix, hold_margin_seconds=0)
    # A worker that took room and died: its hold is never released.
    hold = dead.admit("p", 1, soon(1.0), NEVER)
    hold.__enter__()
    alive = RedisThrottle(redis.Redis.from_url(REDIS_URL), cap, prefix=prefix)

    with alive.admit("p", 1, soon(), NEVER) as admission:
        assert 0.5 <= admission.waited_seconds < 3


@pytest.mark.full
def test_unreachable_redis_lets_the_call_through_and_says_so(prefix: str) -> None:
    unreachable = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=1)
    throttle = RedisThrottle(unreachable, Cap(concurrent_calls=1), prefix=prefix)

    with throttle.admit("p", 1, soon(), NEVER) as admission:
        assert admission.note is not None
        assert "could not be reached" in admission.note


@pytest.mark.full
def test_the_idle_cap_leaves_no_key_behind(prefix: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    throttle = RedisThrottle(client, Cap(concurrent_calls=1, requests_per_minute=5), prefix=prefix)

    with throttle.admit("p", 1, soon(), NEVER):
        pass

    calls, pace = throttle.keys("p")
    assert not client.exists(calls)
    # The pace outlives the last request by its gap (12 s at 5 a minute) and a second.
    assert 0 < client.pttl(pace) <= 13_000


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
