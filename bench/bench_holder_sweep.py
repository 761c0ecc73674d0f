"""Benchmark: what one host's sweep for dead holders costs Redis, by the keys Redis holds.

Every worker looks for the holder records of its own host whose process died, once a
``upkeep.SWEEP_SECONDS`` (``markers.release_dead_holders``). It used to walk Redis's
whole keyspace for them (``SCAN``, Redis's default of 10 keys a call), so a fleet of
``H`` hosts walked a keyspace that grows with ``H``, ``H`` times a second; it now
reads its host's own set of holders (``redis_keys.host_holders_key``). This measures
both on a private redis-server holding ``--lineages`` lineages' keys as a running
fleet's (a lease, an in-flight marker, a holder record and a blocked marker each), 64
of whose holders are this host's live processes entered as the worker enters them
(``markers.claim_running``): the old walk (reproduced here) and the sweep itself,
interleaved batch by batch. Per sweep: Redis's commands (``INFO commandstats``) and
its server CPU (``INFO cpu``, user + system, read around each batch), their ratio, and
what the sweeps of 10, 100 and 1,000 hosts of 64 lives would cost Redis by each.

Run: ``.venv/bin/python bench/bench_holder_sweep.py [--lineages 6400] [--sweeps 20]``
from the repository root. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from support.fleet import PrivateRedis  # noqa: E402

from worker.fleet import markers, redis_keys  # noqa: E402

LIVES = 64


def server_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def commands(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(int(each["calls"]) for name, each in stats.items() if name != "cmdstat_info")


def walk(client: redis.Redis) -> None:
    """The sweep as it was: every holder record found by a walk of the whole keyspace."""
    for key in client.scan_iter(redis_keys.holder_key("*")):
        client.get(key)


def sweep(client: redis.Redis) -> None:
    assert markers.release_dead_holders(client) == []


def measure(client: redis.Redis, how: Callable[[redis.Redis], None], n: int) -> tuple[float, float]:
    """Server CPU seconds and commands per sweep, over ``n`` sweeps."""
    cpu, calls = server_cpu(client), commands(client)
    for _ in range(n):
        how(client)
    # The INFO reads around the batch are left out of the commands, in on both sides alike
    # in the CPU (a few microseconds each).
    return (server_cpu(client) - cpu) / n, (commands(client) - calls) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lineages", type=int, default=6400, help="lineages' keys to hold")
    parser.add_argument("--sweeps", type=int, default=20, help="sweeps of each kind a round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as scratch:
        server = PrivateRedis(Path(scratch))
        try:
            client = redis.Redis.from_url(server.url)
            with client.pipeline(transaction=False) as pipe:
                for n in range(args.lineages):
                    lineage = f"lineage-{n:06d}"
                    job = f"{lineage}.abc.{n}"
                    pipe.set(redis_keys.lease_key(lineage), f"host:boot:{n}:1:2/x", ex=3600)
                    pipe.set(redis_keys.inflight_key(lineage), job, ex=3600)
                    pipe.set(redis_keys.holder_key(lineage), f"{job} host:boot:{n}:1:2", ex=3600)
                    pipe.set(redis_keys.blocked_key(lineage), "{}", ex=3600)
                pipe.execute()
            for n in range(LIVES):
                markers.claim_running(client, f"lineage-{n:06d}", f"job-{n}", 3600)
            keys = client.dbsize()
            kinds = {"walk of the keyspace": walk, "host's own set": sweep}
            totals = {name: [0.0, 0.0] for name in kinds}
            for _ in range(args.rounds):
                for name, how in kinds.items():
                    cpu, calls = measure(client, how, args.sweeps)
                    totals[name][0] += cpu / args.rounds
                    totals[name][1] += calls / args.rounds
        finally:
            server.stop()

    print(
        f"{keys} keys ({args.lineages} lineages x 4, {LIVES} holders of this host), "
        f"{args.sweeps * args.rounds} sweeps each; a sweep:"
    )
    for name, (cpu, calls) in totals.items():
        print(f"  {name:>20}: {calls:7.0f} commands, {cpu * 1000:7.3f} ms of server CPU")
    walked, own = totals["walk of the keyspace"][0], totals["host's own set"][0]
    print(f"server CPU a sweep, own set / walk: {own / walked:.4f}x")
    print("Redis cores for every host's sweep once a second (64 lives a host, 4 keys a life):")
    for hosts in (10, 100, 1000):
        # The walk grows with the keyspace, which grows with the hosts; the own set does not.
        by_walk = hosts * walked * (hosts * LIVES * 4) / keys
        print(f"  {hosts:>5} hosts: walk {by_walk:8.2f}, own set {hosts * own:6.3f}")


if __name__ == "__main__":
    main()
