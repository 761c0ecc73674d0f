"""A real Prometheus server for tests and benches, a fleet it watches, and a silent listener.

``Prometheus`` runs Debian's ``prometheus`` (installed by scripts/setup.sh) on a free
loopback port with a private data directory, scraping one target at a short
interval, and asks it through its HTTP API. ``Watched`` is a fleet home whose
broker (a private redis-server) and store (moto's S3 server) are its own to stop,
with one lineage run for real, served, and scraped by such a Prometheus. ``Silent``
is the hanging dependency: it accepts every connection and never sends a byte, as a
broker or a store that is wedged does.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import socket
import subprocess
import threading
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import boto3

from support.browse import Served
from support.fleet import (
    S3_REGION,
    SMALL_PHYSICS,
    Fleet,
    MotoServer,
    PrivateRedis,
    free_port,
    http_answers,
    terminate,
    wait_for,
)

START_SECONDS = 60
# moto's server takes any credentials; these are only what boto3 insists on sending.
CREDENTIALS = {
    "aws_access_key_id": "ouroboros-test-key-id",
    "aws_secret_access_key": "ouroboros-test-secret",
}


class Prometheus:
    """``prometheus`` scraping ``target`` (host:port) every ``interval`` seconds."""

    def __init__(self, directory: Path, target: str, interval: float = 1.0) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed: run scripts/setup.sh")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = directory / "prometheus.yml"
        config.write_text(
            json.dumps(
                {
                    "global": {
                        "scrape_interval": f"{interval:g}s",
                        "scrape_timeout": f"{interval:g}s",
                        "evaluation_interval": f"{interval:g}s",
                    },
                    "scrape_configs": [
                        {"job_name": "ouroboros", "static_configs": [{"targets": [target]}]}
                    ],
                }
            )
        )
        self.log_path = directory / "prometheus.log"
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={directory / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            wait_for(self._ready, START_SECONDS, f"prometheus on {self.url}", 0.2)
        except AssertionError:
            self.stop()
            raise

    def _ready(self) -> bool:
        return http_answers(f"{self.url}/-/ready", self.process, self.log_path, "prometheus")

    def query(self, promql: str) -> list[tuple[dict[str, str], float]]:
        """The instant vector ``promql`` evaluates to now, as (labels, value) pairs."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return [(r["metric"], float(r["value"][1])) for r in body["data"]["result"]]

    def scalar(self, promql: str) -> float:
        """The single value ``promql`` evaluates to now; NaN when it is empty."""
        found = self.query(promql)
        assert len(found) <= 1, found
        return found[0][1] if found else math.nan

    def wait(self, promql: str, timeout: float = 60) -> list[tuple[dict[str, str], float]]:
        """Wait until ``promql`` (a filter: ``x == 1``) selects something, and return it."""
        found: list[list[tuple[dict[str, str], float]]] = []

        def selects() -> bool:
            found[:] = [self.query(promql)]
            return bool(found[0])

        wait_for(selects, timeout, f"prometheus: {promql}", 0.5)
        return found[0]

    def target_health(self) -> tuple[str, str]:
        """The scrape target's health ("up", "down", "unknown") and its last error."""
        with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=10) as reply:
            [target] = json.load(reply)["data"]["activeTargets"]
        return str(target["health"]), str(target["lastError"])

    def stop(self) -> None:
        terminate(self.process)


class Watched:
    """Lineage ``alpha`` run for ``generations`` real lives, served and scraped.

    ``broker`` and ``store`` are this home's own: stop them to make an outage.
    """

    def __init__(self, home: Path, generations: int, interval: float) -> None:
        self.broker = PrivateRedis(home / "redis")
        self.store = MotoServer(home / "moto.log")
        self.served: Served | None = None
        self.prometheus: Prometheus | None = None
        try:
            self.bucket = f"watched-{uuid.uuid4().hex[:12]}"
            self.s3 = boto3.client(
                "s3", endpoint_url=self.store.url, region_name=S3_REGION, **CREDENTIALS
            )
            self.s3.create_bucket(Bucket=self.bucket)
            fleet = Fleet(
                home,
                OUROBOROS_BROKER_URL=self.broker.url,
                OUROBOROS_OBSERVATIONS=f"s3://{self.bucket}/fleet",
                OUROBOROS_S3_ENDPOINT_URL=self.store.url,
                OUROBOROS_S3_REGION=S3_REGION,
                **{name.upper(): value for name, value in CREDENTIALS.items()},
            )
            fleet.ok("init", "alpha", *SMALL_PHYSICS)
            fleet.ok("run", "alpha", "--generations", str(generations), "--local")
            self.served = Served(fleet, home / "serve.log")
            (home / "prometheus").mkdir()
            self.prometheus = Prometheus(
                home / "prometheus", f"127.0.0.1:{self.served.port}", interval=interval
            )
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.prometheus is not None:
            self.prometheus.stop()
        if self.served is not None:
            self.served.stop()
        self.store.stop()
        self.broker.stop()


class Silent:
    """A TCP listener on 127.0.0.1 that accepts every connection and never answers."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="silent", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # closed by ``stop``
            while True:
                connection, _ = self.listener.accept()
                self.accepted.append(connection)  # held open, never read or written

    def stop(self) -> None:
        self.listener.close()
        for connection in self.accepted:
            connection.close()
