"""Benchmark: what one host's dead-holder sweep costs Redis, by the keys Redis holds.

Every worker walks Redis's whole keyspace once a ``upkeep.SWEEP_SECONDS`` looking for
holder records of its own host whose process died (``markers.release_dead_holders``),
so a fleet of ``H`` hosts walks it ``H`` times a second, over a keyspace that grows
with ``H``. This measures one walk on a private redis-server filled with ``K`` keys
shaped as a running fleet's (per lineage: a lease, an in-flight marker, a holder
record and a blocked marker; ``--lineages`` of them), at Redis's default ``COUNT`` of
10 keys a ``SCAN`` call and at the sweep's own (``markers.SWEEP_SCAN_COUNT``), the two
interleaved walk by walk. Per walk: the ``SCAN`` calls and the server's CPU
(``INFO cpu``, user + system, read before and after each batch of walks), and the
ratio of the two ``COUNT``s' CPU.

Run: ``.venv/bin/python bench/bench_holder_sweep.py [--lineages 6400] [--walks 20]``
from the repository root. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from support.fleet import PrivateRedis  # noqa: E402

from worker.fleet import redis_keys  # noqa: E402
from worker.fleet.markers import SWEEP_SCAN_COUNT  # noqa: E402


def server_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def scan_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats").get("cmdstat_scan", {"calls": 0})
    return int(stats["calls"])


def walk(client: redis.Redis, count: int, walks: int) -> tuple[float, float]:
    """CPU seconds of the server and SCAN calls per walk, over ``walks`` walks."""
    cpu, calls = server_cpu(client), scan_calls(client)
    for _ in range(walks):
        for _key in client.scan_iter(f"{redis_keys.HOLDERS_PREFIX}*", count=count):
            pass
    # INFO's own calls are a few microseconds: left in, on both sides alike.
    return (server_cpu(client) - cpu) / walks, (scan_calls(client) - calls) / walks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lineages", type=int, default=6400, help="lineages' keys to hold")
    parser.add_argument("--walks", type=int, default=20, help="walks per COUNT per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as scratch:
        server = PrivateRedis(Path(scratch))
        try:
            client = redis.Redis.from_url(server.url)
            with client.pipeline(transaction=False) as pipe:
                for n in range(args.lineages):
                    lineage = f"lineage-{n:06d}"
                    pipe.set(redis_keys.lease_key(lineage), f"host:boot:{n}:1:2/x", ex=3600)
                    pipe.set(redis_keys.inflight_key(lineage), f"{lineage}.abc.{n}", ex=3600)
                    pipe.set(redis_keys.holder_key(lineage), f"{lineage}.abc.{n} h:b:1", ex=3600)
                    pipe.set(redis_keys.blocked_key(lineage), "{}", ex=3600)
                pipe.execute()
            keys = client.dbsize()
            totals = {10: [0.0, 0.0], SWEEP_SCAN_COUNT: [0.0, 0.0]}
            for _ in range(args.rounds):
                for count, total in totals.items():
                    cpu, calls = walk(client, count, args.walks)
                    total[0] += cpu / args.rounds
                    total[1] += calls / args.rounds
        finally:
            server.stop()

    print(f"{keys} keys ({args.lineages} lineages x 4), {args.walks * args.rounds} walks each")
    for count, (cpu, calls) in totals.items():
        print(
            f"  COUNT {count:>5}: {calls:8.0f} SCAN calls, {cpu * 1000:7.2f} ms server CPU a walk"
        )
    slow, fast = totals[10][0], totals[SWEEP_SCAN_COUNT][0]
    print(f"server CPU a walk, COUNT {SWEEP_SCAN_COUNT} / COUNT 10: {fast / slow:.2f}x")
    for hosts in (10, 100, 1000):
        # The keyspace grows with the hosts: 64 lives a host, ~4 keys a lineage.
        per_walk = fast * (hosts * 64 * 4) / keys
        print(
            f"  {hosts:>5} hosts, each walking {hosts * 64 * 4} keys a second: "
            f"{hosts * per_walk:.2f} cores of Redis (COUNT {SWEEP_SCAN_COUNT}), "
            f"{hosts * slow * (hosts * 64 * 4) / keys:.2f} (COUNT 10)"
        )


if __name__ == "__main__":
    main()
