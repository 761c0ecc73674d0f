"""Metrics soak: a real Prometheus scraping ``serve`` while the broker, then the store, stop.

Starts a throw-away fleet home (a private redis-server as the broker, moto's S3
server as the store), runs ``--generations`` real lives of one lineage with
``run --local`` so the figures are real, then serves it and points Debian's
Prometheus at it, scraping every ``--interval`` seconds. Three phases of
``--phase-seconds`` each: everything up; the broker stopped (SIGKILL); the store
stopped as well. Meanwhile a client asks the overview page, a lineage page and the
API twice a second, as a person browsing during an outage would.

At the end of each phase it asks Prometheus over the phase: the target's worst
``up``, the scrapes' count, slowest and mean duration (``scrape_duration_seconds``),
the source gauges, and the web process's resident memory
(``process_resident_memory_bytes``) now and at its highest; and it prints the
slowest page answer of the phase. It exits 1 unless the target stayed up,
every scrape took under a second, the gauges followed their sources and memory
grew less than ``--memory-growth`` (a fraction) from the first phase's end to the
last's. Needs root, bwrap and cgroups (the lives), like the test suite.

    .venv/bin/python bench/soak_metrics.py               # the issue's 5 minutes
    .venv/bin/python bench/soak_metrics.py --phase-seconds 20 --interval 1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

# The fleet and Prometheus harnesses live with the tests: one copy for both.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import httpx
from support.prometheus import Prometheus, Watched

PAGES = ["/", "/lineages/alpha", "/api/"]
SCRAPE_LIMIT_SECONDS = 1.0


class Browsing:
    """Asks ``PAGES`` in turn twice a second until stopped; keeps the slowest answer."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.slowest = (0.0, "")
        self.asked = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self._stop.wait(0.5):
                path = PAGES[self.asked % len(PAGES)]
                started = time.monotonic()
                client.get(path)
                took = time.monotonic() - started
                self.asked += 1
                self.slowest = max(self.slowest, (took, path))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def phase_figures(prometheus: Prometheus, seconds: float) -> dict[str, float]:
    """What Prometheus saw over the last ``seconds``."""
    window = f"[{int(seconds)}s]"
    return {
        "min up": prometheus.scalar(f"min_over_time(up{window})"),
        "max scrape s": prometheus.scalar(f"max_over_time(scrape_duration_seconds{window})"),
        "avg scrape s": prometheus.scalar(f"avg_over_time(scrape_duration_seconds{window})"),
        "scrapes": prometheus.scalar(f"count_over_time(up{window})"),
        "broker_up": prometheus.scalar("ouroboros_broker_up"),
        "store_up": prometheus.scalar("ouroboros_store_up"),
        "rss MiB": prometheus.scalar("process_resident_memory_bytes") / 2**20,
        "max rss MiB": prometheus.scalar(f"max_over_time(process_resident_memory_bytes{window})")
        / 2**20,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase-seconds", type=float, default=100)
    parser.add_argument("--interval", type=float, default=2)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--memory-growth", type=float, default=0.10)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="soak-metrics-") as tmp:
        watched = Watched(Path(tmp), args.generations, args.interval)
        browsing = None
        try:
            prometheus, served = watched.prometheus, watched.served
            assert prometheus is not None and served is not None
            prometheus.wait("ouroboros_broker_up == 1 and on() ouroboros_store_up == 1")
            browsing = Browsing(served.url)
            phases: list[tuple[str, dict[str, float]]] = []
            for name, act in (
                ("all up", None),
                ("broker stopped", watched.broker.kill),
                ("broker and store stopped", watched.store.stop),
            ):
                if act is not None:
                    act()
                time.sleep(args.phase_seconds)
                figures = phase_figures(prometheus, args.phase_seconds)
                figures["slowest page s"], browsing.slowest = browsing.slowest[0], (0.0, "")
                phases.append((name, figures))
                print(f"{name}: " + ", ".join(f"{k} {v:.3g}" for k, v in figures.items()))
            health = prometheus.target_health()
        finally:
            if browsing is not None:
                browsing.stop()
            watched.stop()

    print(f"pages asked: {browsing.asked}")
    print(f"target health at the end: {health}")
    first_rss, last_rss = phases[0][1]["rss MiB"], phases[-1][1]["rss MiB"]
    growth = last_rss / first_rss - 1
    print(
        f"memory: {first_rss:.1f} MiB after the first phase, {last_rss:.1f} MiB at the end "
        f"({growth:+.1%})"
    )
    failures = [
        f"{name}: {what}"
        for name, figures in phases
        for what, bad in (
            ("the target was down", figures["min up"] != 1),
            ("a scrape took a second or more", figures["max scrape s"] >= SCRAPE_LIMIT_SECONDS),
        )
        if bad
    ]
    expected = [(1, 1), (0, 1), (0, 0)]
    for (name, figures), (broker_up, store_up) in zip(phases, expected, strict=True):
        if (figures["broker_up"], figures["store_up"]) != (broker_up, store_up):
            failures.append(f"{name}: the source gauges read {figures}")
    if growth >= args.memory_growth:
        failures.append(f"memory grew {growth:.1%}")
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
