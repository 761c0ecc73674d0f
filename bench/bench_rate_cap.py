"""Benchmark: 20 lineages against a vendor that rate-limits, with and without the fleet's cap.

Twenty lineages of the canonical seed organism (one model call per life), physics
``--wall 180 --cpu-seconds 60 --memory-max 512M``, served by two real ``celery -A
worker worker --concurrency=10`` processes (two hosts' worth of workers sharing one
Redis) through the ``openai-compatible`` provider. The vendor is a stand-in in this
process: Chat Completions on 127.0.0.1 that answers after ``--latency`` seconds with
the organism's own source plus one marker line (a body that loads, so lineages
live on), and refuses beyond ``--limit`` requests in any rolling 60 s with 429 and
a ``retry-after`` saying when room comes.

Each side runs every lineage for ``--minutes`` after a warm-up:

* **capped**: the fleet's cap at ``--limit - 3`` requests per minute (the margin
  covers the moment between the cap admitting a request and the vendor counting it);
* **uncapped**: no cap at all, only the socket's retries.

Printed per side: generations landed and their outcomes; requests the vendor saw,
the most it saw in any 60 s, and the 429s it sent; model calls answered and lost
(502), calls lost to 429s, attempts per call, the time calls waited for the cap
(median, 90th percentile, max), and the order the cap served them in: of every
two attempts that waited for the cap at the same time, the share admitted in the
order they arrived (each attempt's start and wait, from its observation; the hosts
share one clock here). Target: the capped side loses no generation to 429s, the
vendor never sees more than ``--limit`` requests in a minute, and the cap serves
waiters in arrival order. Run: ``.venv/bin/python bench/bench_rate_cap.py
[--minutes 4 --limit 60 --sides capped,uncapped]``. A measurement, not a test: exits 0
either way.
"""

from __future__ import annotations

import bisect
import contextlib
import io
import itertools
import json
import math
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BenchFleet, bench_args, machine_note, median, wait_for

NAMES = [f"r{i:02d}" for i in range(20)]
PHYSICS = ["--wall", "180", "--cpu-seconds", "60", "--memory-max", "512M"]
WINDOW = 60.0
SOURCE_MARK = "=== YOUR CURRENT SOURCE ===\n"
ANSWER_MARK = ";; rate-cap stand-in answer"
NO_HEADERS: dict[str, str] = {}


@dataclass
class Vendor:
    """A Chat Completions stand-in that allows ``limit`` requests per rolling minute."""

    limit: int
    latency: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Arrival times of requests answered 200, and of those refused with 429.
    served: list[float] = field(default_factory=list)
    refused: list[float] = field(default_factory=list)

    def admit(self) -> float | None:
        """None when the request may be served now, else the seconds until room."""
        now = time.monotonic()
        with self.lock:
            recent = [t for t in self.served if t > now - WINDOW]
            if len(recent) >= self.limit:
                self.refused.append(now)
                return recent[-self.limit] + WINDOW - now
            self.served.append(now)
            return None

    def max_in_window(self, start: float, end: float) -> int:
        """The most requests served in any rolling minute between start and end."""
        times = sorted(t for t in self.served if start <= t <= end)
        return max(
            (bisect.bisect_right(times, t + WINDOW) - i for i, t in enumerate(times)), default=0
        )

    def count(self, times: list[float], start: float, end: float) -> int:
        return sum(1 for t in times if start <= t <= end)


def serve_vendor(vendor: Vendor) -> tuple[ThreadingHTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            wait = vendor.admit()
            if wait is not None:
                self._send(
                    429,
                    {"error": {"type": "rate_limit_exceeded", "message": "slow down"}},
                    {"retry-after": f"{max(wait, 0.0):.3f}"},
                )
                return
            time.sleep(vendor.latency)
            prompt = body["messages"][0]["content"]
            source = prompt.split(SOURCE_MARK, 1)[-1]
            lines = [line for line in source.splitlines() if not line.startswith(ANSWER_MARK)]
            answer = "\n".join(lines) + f"\n{ANSWER_MARK} {time.time():.3f}\n"
            tokens = (math.ceil(len(prompt) / 4), math.ceil(len(answer) / 4))
            self._send(
                200,
                {
                    "id": "chatcmpl-bench",
                    "object": "chat.completion",
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": answer},
                        }
                    ],
                    "usage": {
                        "prompt_tokens": tokens[0],
                        "completion_tokens": tokens[1],
                        "total_tokens": sum(tokens),
                    },
                },
            )

        def _send(self, status: int, payload: object, headers: dict[str, str] = NO_HEADERS) -> None:
            raw = json.dumps(payload).encode()
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            with contextlib.suppress(OSError):
                self.wfile.write(raw)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@dataclass
class Side:
    """One side's figures: lives and calls from its start (warm-up included) to its drain."""

    name: str
    cap: int
    # Generations landed in the measured window, and its length.
    measured: int = 0
    seconds: float = 0.0
    landed: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    calls: int = 0
    answered: int = 0
    lost: int = 0
    lost_to_429: int = 0
    attempts: list[int] = field(default_factory=list)
    cap_waits: list[float] = field(default_factory=list)
    # Every attempt the cap admitted: when it began to wait and when it was let through
    # (epoch seconds).
    admissions: list[tuple[float, float]] = field(default_factory=list)
    attempts_429: int = 0
    seen: int = 0
    refused: int = 0
    max_minute: int = 0


def observations(fleet: BenchFleet, name: str, first: int, last: int) -> Iterator[dict[str, Any]]:
    for generation in range(first, last + 1):
        path = fleet.observation_path(name, generation)
        if path.exists():
            yield json.loads(path.read_text())


def tally(side: Side, observation: dict[str, Any]) -> None:
    side.landed += 1
    outcome = observation["outcome"]
    side.outcomes[outcome] = side.outcomes.get(outcome, 0) + 1
    for call in observation["model_calls"]:
        side.calls += 1
        attempts = call.get("attempts", [])
        side.attempts.append(len(attempts))
        side.cap_waits.extend(a["cap_wait_seconds"] for a in attempts)
        for attempt in attempts:
            if attempt["outcome"] != "no_slot" and (
                attempt["request_seconds"] > 0 or attempt["vendor_status"] is not None
            ):
                arrived = datetime.fromisoformat(attempt["started_at"]).timestamp()
                side.admissions.append((arrived, arrived + attempt["cap_wait_seconds"]))
        side.attempts_429 += sum(1 for a in attempts if a.get("vendor_status") == 429)
        if call["status"] == 200:
            side.answered += 1
        else:
            side.lost += 1
            if attempts and attempts[-1].get("vendor_status") == 429:
                side.lost_to_429 += 1


def main() -> None:
    parser = bench_args(__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=4.0, help="measured minutes per side")
    parser.add_argument("--limit", type=int, default=60, help="the vendor's requests per minute")
    parser.add_argument("--latency", type=float, default=1.0, help="the vendor's answer time (s)")
    parser.add_argument("--sides", default="capped,uncapped", help="which sides, in order")
    args = parser.parse_args()

    vendor = Vendor(args.limit, args.latency)
    server, url = serve_vendor(vendor)
    model_env = {
        "OUROBOROS_MODEL_PROVIDER": "openai-compatible",
        "OUROBOROS_MODEL_NAME": "rate-limited",
        "OUROBOROS_OPENAI_COMPATIBLE_BASE_URL": url,
        "OUROBOROS_MODEL_INPUT_USD_PER_MTOK": "0",
        "OUROBOROS_MODEL_OUTPUT_USD_PER_MTOK": "0",
    }
    with BenchFleet("rate-cap", args.redis_url, args.keep) as fleet:
        fleet.activate(**model_env)
        import redis

        import scheduler.cli as cli_module

        client = redis.Redis.from_url(fleet.redis_url)

        def cli(*argv: str) -> None:
            with contextlib.redirect_stdout(io.StringIO()):
                cli_module.cli.main(list(argv), standalone_mode=False)

        def counts() -> dict[str, int]:
            return {name: fleet.observation_count(name) for name in NAMES}

        def quiet() -> bool:
            keys = [f"ouroboros:{kind}:{n}" for n in NAMES for kind in ("inflight", "lease")]
            return not client.exists(*keys)

        for name in NAMES:
            cli("init", name, *PHYSICS)
        print(machine_note())
        print(
            f"vendor: {args.limit} requests per rolling minute, {args.latency:g} s per answer; "
            f"{len(NAMES)} lineages on 2 workers of concurrency 10",
            flush=True,
        )

        for side_name in args.sides.split(","):
            cap = args.limit - 3 if side_name == "capped" else 0
            env = {
                **model_env,
                "OUROBOROS_MODEL_REQUESTS_PER_MINUTE": str(cap),
                "OUROBOROS_MODEL_MAX_CONCURRENT_CALLS": "16" if cap else "0",
            }
            workers = [fleet.start_worker(f"{side_name}{n}", 10, **env) for n in range(2)]
            side = Side(side_name, cap)
            print(f"{side_name}: warming up until every lineage lands a generation ...", flush=True)
            before, side_started = counts(), time.monotonic()
            cli("run", *NAMES, "--generations", "100000")
            wait_for(
                lambda before=before: all(c > before[n] for n, c in counts().items()),
                600,
                "every lineage to land a generation",
                0.2,
            )
            start_counts, started = counts(), time.monotonic()
            time.sleep(args.minutes * 60)
            end_counts, ended = counts(), time.monotonic()
            for name in NAMES:
                cli("cancel", name)
            wait_for(quiet, 600, "the side's generations to finish", 0.2)
            side_ended = time.monotonic()
            for worker in workers:
                worker.stop(60)
            fleet.workers.clear()
            side.seconds = ended - started
            side.measured = sum(end_counts.values()) - sum(start_counts.values())
            final = counts()
            for name in NAMES:
                for observation in observations(fleet, name, before[name] + 1, final[name]):
                    tally(side, observation)
            served = vendor.count(vendor.served, side_started, side_ended)
            side.refused = vendor.count(vendor.refused, side_started, side_ended)
            side.seen = served + side.refused
            side.max_minute = vendor.max_in_window(side_started, side_ended)
            report(side, args.limit)
        server.shutdown()
    os._exit(0)  # the Celery producer's threads must not hold the exit


def in_order(admissions: list[tuple[float, float]]) -> tuple[int, int]:
    """Of every two attempts that waited for the cap at once (the later arrived before
    the earlier was admitted), how many were admitted in arrival order, and how many
    such pairs there were."""
    ordered = sorted(admissions)
    kept = pairs = 0
    for (_, admitted), (later, later_admitted) in itertools.combinations(ordered, 2):
        if later < admitted:
            pairs += 1
            kept += admitted <= later_admitted
    return kept, pairs


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def report(side: Side, limit: int) -> None:
    minutes = side.seconds / 60
    waits = side.cap_waits or [0.0]
    cap = f"cap {side.cap} requests/min" if side.cap else "no cap"
    print(f"\n== {side.name} ({cap}) ==")
    print(
        f"throughput:            {side.measured / minutes:.1f} generations/min "
        f"over {side.seconds:.0f} s"
    )
    print(f"whole side:            {side.landed} generations landed {side.outcomes}")
    print(
        f"vendor saw:            {side.seen} requests, at most {side.max_minute} in any 60 s "
        f"(limit {limit}); sent {side.refused} 429s"
    )
    print(
        f"model calls:           {side.calls}: {side.answered} answered, {side.lost} lost (502), "
        f"{side.lost_to_429} lost to 429s"
    )
    print(
        f"attempts per call:     median {median(side.attempts or [0]):.0f}, "
        f"max {max(side.attempts or [0])}; {side.attempts_429} attempts met a 429"
    )
    print(
        f"wait for the cap:      median {median(waits):.1f} s, "
        f"90th percentile {percentile(waits, 0.9):.1f} s, max {max(waits):.1f} s"
    )
    kept, pairs = in_order(side.admissions)
    share = kept / pairs if pairs else 1.0
    print(
        f"arrival order:         {kept} of {pairs} pairs waiting at once admitted in the order "
        f"they arrived ({100 * share:.1f} %)"
    )
    held = side.lost_to_429 == 0 and side.max_minute <= limit
    fair = not side.cap or share >= 0.99
    print(
        f"verdict:               {'PASS' if held and fair else 'MISS'} "
        "(no call lost to 429s, limit held" + (", arrival order kept)" if side.cap else ")")
    )


if __name__ == "__main__":
    main()
