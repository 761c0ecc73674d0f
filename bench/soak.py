"""Chaos soak: a private fleet advancing many lineages while faults are thrown at it.

Starts a throw-away fleet (``common.BenchFleet``): a private Redis with append-only
persistence (fsync on every write), moto's S3 server behind a switchable TCP proxy as
the observation store, ``--workers`` real workers and a ``reconcile --loop``. It then
runs ``--lineages`` lineages for ``--rounds`` runs of ``--generations`` generations
each, alternating a fault-free round and a chaos round, so both throughputs are
measured side by side in one run. During a chaos round one fault at a time, drawn
from ``--faults``, comes every ``--every`` seconds:

* ``kill-main``, ``kill-child``, ``kill-tree``: SIGKILL a worker's main process, one of
  its pool children (one holding a lease when there is one) or its whole process group;
  a killed worker is restarted at once, as systemd's ``Restart=always`` would;
* ``fetch-kill``: at one of two exact instants of the hand-over, in turn: a worker whose
  pool child is stopped fetches a job and is killed before the child can claim it
  (after ``task_received``), or a kombu consumer takes a job off the queue and is
  killed in its callback, before ``task_received`` (the message in ``unacked``, no
  holder record: only the reconcile pass frees it, after the lease);
* ``redis-aof`` / ``redis-lost``: SIGKILL Redis and restart it with its append-only
  file, or with its data deleted;
* ``store-outage``: the proxy refuses every connection to the store for ``--outage``
  seconds;
* ``garbage``: a malformed message (not JSON, no delivery tag, pickle, unknown task,
  oversized) pushed onto the generation queue.

A fault's recovery is measured twice from the moment the fault ends (the kill, the
restart, the store back): *landed*, until every lineage it hit has landed its next
generation or finished its run (the targets are judged on this one), and *resumed*,
until each of them is in a live worker's hands again (its lease held by a living
process), or has landed or finished: landed less the queue and the life. The lineages
a fault hits: the lives the killed process ran (or held: a pool child's lease, a
fetched job), the lives in flight when Redis restarts with its data, when the store
comes back or when garbage arrives, and every unfinished lineage when Redis loses its
data (every queued job is gone).

When the last round has landed, the soak waits for the spool to drain, stops
everything and checks every invariant: a linear first-parent history with ``gen 1..N``
exactly once and in order, one observation per generation whose number, commit and
parent match git, the index and ``status --json`` agreeing with both, every spool
empty, no process left in any worker's session and no leftover cgroup. With ``--homes
N`` the lineages are spread over N shared repositories (``OUROBOROS_LINEAGE_REPOS``, the
default one and N-1 beside it) and each branch must be in its rule's home and no other. It prints a
table and a timeline of the faults, and exits 1 if an invariant fails; the timing
targets are printed, never enforced (``tests/test_soak.py`` runs a short soak in CI
and checks the exit status).

    .venv/bin/python bench/soak.py                          # the long soak (see docs/benchmarks.md)
    .venv/bin/python bench/soak.py --lineages 3 --generations 3 --rounds 2 --workers 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from common import PYTHON, SMALL_PHYSICS, BenchFleet, bench_args, machine_note, median, wait_for
from support.fleet import MotoServer, Switch, Worker, grab, task_envelope

FAULTS = (
    "kill-main",
    "kill-child",
    "kill-tree",
    "fetch-kill",
    "redis-aof",
    "redis-lost",
    "store-outage",
    "garbage",
)
# Each life rewrites its state, so every generation is a new commit.
ORGANISM = '(with-temp-file "/work/state.el" (insert (format "%S" (random))))\n'
GEN_SUBJECT = re.compile(r"^gen (\d+): ")
BUCKET = "soak"
# Beyond lost, doubled and extra: what else a soak that holds every invariant leaves at 0.
MUST_BE_ZERO = (
    "missing observations",
    "spool entries",
    "leftover processes",
    "leftover cgroups",
    "worker exits",
)


@dataclass
class Fault:
    kind: str
    ended: float = 0.0
    hit: int = 0
    # lineage -> its head when the fault ended; landed once each has moved or finished.
    waiting: dict[str, str | None] = field(default_factory=dict)
    recovered: float | None = None
    # The same, until each is held by a living process again (or has moved or finished).
    resuming: dict[str, str | None] = field(default_factory=dict)
    resumed: float | None = None


def parse_args() -> argparse.Namespace:
    parser = bench_args(__doc__.splitlines()[0])
    parser.add_argument("--lineages", type=int, default=12)
    parser.add_argument("--homes", type=int, default=1, help="shared repositories")
    parser.add_argument("--generations", type=int, default=24, help="per lineage and round")
    parser.add_argument("--rounds", type=int, default=4, help="alternately fault-free and chaos")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2, help="lives at once per worker")
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated kinds")
    parser.add_argument("--every", default="2:5", help="seconds between faults, MIN:MAX")
    parser.add_argument("--outage", type=float, default=15.0, help="store outage seconds")
    parser.add_argument("--lease", type=int, default=15, help="OUROBOROS_LEASE_SECONDS")
    parser.add_argument("--reconcile", type=float, default=5.0, help="reconcile interval")
    parser.add_argument("--seed", type=int, default=1, help="of the fault schedule")
    parser.add_argument("--round-timeout", type=float, default=3600.0)
    args = parser.parse_args()
    unknown = set(args.faults.split(",")) - set(FAULTS)
    if unknown:
        parser.error(f"unknown faults {', '.join(sorted(unknown))}; choose from {FAULTS}")
    return args


class Soak:
    """The fleet under test, the fault injector, and the recovery monitor."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.random = random.Random(args.seed)
        self.bench = BenchFleet("soak", args.redis_url, args.keep, redis_appendonly=True)
        self.root = self.bench.root
        self.moto = MotoServer(self.root / "moto.log")
        self.switch = Switch(int(self.moto.url.rsplit(":", 1)[1]))
        credentials = {
            "AWS_ACCESS_KEY_ID": "soak-key-id",
            "AWS_SECRET_ACCESS_KEY": "soak-secret",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }
        self.bench.env.update(
            credentials,
            OUROBOROS_OBSERVATIONS=f"s3://{BUCKET}/fleet",
            OUROBOROS_S3_ENDPOINT_URL=f"http://127.0.0.1:{self.switch.port}",
            OUROBOROS_S3_REGION="us-east-1",
            OUROBOROS_LEASE_SECONDS=str(args.lease),
            OUROBOROS_RECONCILE_INTERVAL_SECONDS=str(args.reconcile),
            OUROBOROS_SPOOL_RETRY_SECONDS="1",
        )
        # The default home is the fleet's repository; the others beside it, made by init.
        self.repos = {"default": self.bench.repo}
        self.repos |= {f"h{i}": self.root / "homes" / f"h{i}.git" for i in range(1, args.homes)}
        if args.homes > 1:
            (self.root / "homes").mkdir()
            others = {h: str(r) for h, r in self.repos.items() if h != "default"}
            self.bench.env["OUROBOROS_LINEAGE_REPOS"] = json.dumps(others)
        self.bench.activate()
        import boto3
        import redis

        self.s3 = boto3.client(
            "s3",
            endpoint_url=self.moto.url,
            region_name="us-east-1",
            aws_access_key_id=credentials["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=credentials["AWS_SECRET_ACCESS_KEY"],
        )
        self.s3.create_bucket(Bucket=BUCKET)
        self.redis = redis.Redis.from_url(self.bench.redis_url, socket_timeout=5)
        tag = os.urandom(3).hex()
        self.lineages = self.spread(f"soak{tag}-", args.lineages)
        self.target = 0
        self.workers: list[Worker | None] = [None] * args.workers
        self.incarnations = 0
        self.every_worker: list[Worker] = []
        self.faults: list[Fault] = []
        self.began = time.monotonic()
        self.schedule: list[str] = []
        self.garbage_sent = 0
        self.lock = threading.Lock()
        self.slots = threading.Lock()
        self.unexpected_exits = 0
        self.heads: dict[str, tuple[str | None, int]] = {}
        self.reconciler: subprocess.Popen[bytes] | None = None
        self.fetch_kills = 0

    # -- the fleet ----------------------------------------------------------------

    def start_worker(self, slot: int, concurrency: int | None = None) -> Worker:
        self.incarnations += 1
        worker = Worker(
            self.bench.fleet,
            f"w{slot}-{self.incarnations}",
            concurrency=concurrency or self.args.concurrency,
        )
        self.every_worker.append(worker)
        worker.wait_ready(300)
        if 0 <= slot < len(self.workers):
            self.workers[slot] = worker
        return worker

    def start(self) -> None:
        seed = self.bench.write_seed("soak.el", ORGANISM)
        for name in self.lineages:
            self.bench.cli("init", name, "--seed", str(seed), *SMALL_PHYSICS)
        for slot in range(self.args.workers):
            self.start_worker(slot)
        log = (self.root / "reconciler.log").open("wb")
        self.reconciler = subprocess.Popen(
            [PYTHON, "-m", "scheduler", "reconcile", "--loop"],
            env=self.bench.env,
            cwd=self.root,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def spread(self, stem: str, count: int) -> list[str]:
        """``count`` names ``stem``NN, skipping a name whose home (by the rule) already has
        its share, so the lineages are spread over every home as evenly as they can be."""
        share = -(-count // len(self.repos))
        taken: Counter[str] = Counter()
        names: list[str] = []
        number = 0
        while len(names) < count:
            name = f"{stem}{number:02d}"
            number += 1
            if taken[home := self.home(name)] < share:
                taken[home] += 1
                names.append(name)
        return names

    def home(self, lineage: str) -> str:
        """The home the rule places ``lineage`` in (worker.fleet.homes)."""
        from worker.fleet.homes import rendezvous

        return rendezvous(lineage, self.repos)

    def git(self, lineage: str, *args: str) -> bytes:
        """git in the repository of ``lineage``'s home."""
        repo = self.repos[self.home(lineage)]
        return subprocess.run(
            ["git", f"--git-dir={repo}", *args], capture_output=True, check=True
        ).stdout

    def generation(self, lineage: str) -> tuple[str | None, int]:
        """The lineage's head and its generation number (cached per head)."""
        head = self.bench.head(lineage, self.repos[self.home(lineage)])
        known = self.heads.get(lineage)
        if known is not None and known[0] == head:
            return known
        subject = self.git(lineage, "log", "-1", "--format=%s", head or "HEAD").decode()
        match = GEN_SUBJECT.match(subject)
        value = (head, int(match.group(1)) if match else 0)
        self.heads[lineage] = value
        return value

    def unfinished(self) -> list[str]:
        return [name for name in self.lineages if self.generation(name)[1] < self.target]

    # -- faults -------------------------------------------------------------------

    def leased(self) -> dict[str, int]:
        """lineage -> the pid of the process holding its lease."""
        found = {}
        for key in self.redis.scan_iter("ouroboros:lease:*"):
            token = (self.redis.get(key) or b"").decode(errors="replace")
            pid = token.rsplit("/", 1)[0].split(":")[2:3]
            if pid and pid[0].isdigit():
                found[key.decode().rsplit(":", 1)[1]] = int(pid[0])
        return found

    def living_worker(self) -> tuple[int, Worker]:
        slots = [(n, w) for n, w in enumerate(self.workers) if w and w.process.poll() is None]
        return self.random.choice(slots)

    def revive(self) -> None:
        """Restart a worker that exited on its own (counted: a worker must never do that)."""
        with self.slots:
            for slot, worker in enumerate(self.workers):
                if worker is not None and worker.process.poll() is not None:
                    self.unexpected_exits += 1
                    print(f"worker {worker.name} exited on its own; see {worker.log_path}")
                    self.start_worker(slot)

    def hit(self, worker: Worker) -> list[str]:
        """The lineages whose lives ``worker`` runs."""
        pids = {worker.process.pid, *self._children(worker)}
        return [name for name, pid in self.leased().items() if pid in pids]

    @staticmethod
    def _children(worker: Worker) -> list[int]:
        try:
            return worker.pool_children()
        except OSError:
            return []

    def inject(self, kind: str) -> Fault | None:
        fault = Fault(kind)
        hit: list[str]
        if kind in ("kill-main", "kill-tree"):
            with self.slots:  # killed and restarted as one step, as systemd would
                slot, worker = self.living_worker()
                hit = self.hit(worker)
                if kind == "kill-main":
                    os.kill(worker.process.pid, signal.SIGKILL)
                    worker.process.wait()
                else:
                    worker.kill()
                fault.ended = time.monotonic()
                self.start_worker(slot)
        elif kind == "kill-child":
            _, worker = self.living_worker()
            children = self._children(worker)
            leased = self.leased()
            holding = [pid for pid in children if pid in leased.values()]
            if not children:
                return None
            victim = self.random.choice(holding or children)
            hit = [name for name, pid in leased.items() if pid == victim]
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
            fault.ended = time.monotonic()
        elif kind == "fetch-kill" and self.pre_receipt():
            try:
                job_id = grab(self.bench.env, self.root, self.queue(), wait=60)
            except (AssertionError, subprocess.TimeoutExpired):
                return None
            fault.ended = time.monotonic()
            hit = [name for name in self.lineages if job_id.startswith(f"{name}.")]
        elif kind == "fetch-kill":
            worker = self.start_worker(-1, concurrency=1)
            for child in self._children(worker):
                os.kill(child, signal.SIGSTOP)
            try:
                fetched = wait_for(lambda: _received(worker), 60, "a fetch", 0.2)
            except AssertionError:
                worker.kill()
                return None
            worker.kill()
            fault.ended = time.monotonic()
            hit = [fetched]
        elif kind in ("redis-aof", "redis-lost"):
            assert self.bench.redis is not None
            # With its data, Redis loses only connections: the lives in flight are hit.
            # Without, every queued job is gone too: every unfinished lineage is hit.
            hit = list(self.leased()) if kind == "redis-aof" else self.unfinished()
            self.bench.redis.kill()
            if kind == "redis-lost":
                for path in self.bench.redis.directory.glob("appendonly*"):
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
            self.bench.redis.start()
            fault.ended = time.monotonic()
        elif kind == "store-outage":
            self.switch.down()
            time.sleep(self.args.outage)
            hit = list(self.leased())
            self.switch.up()
            fault.ended = time.monotonic()
        else:
            hit = list(self.leased())  # the worker that pops it must live on to land them
            queue = self.queue()
            self.redis.lpush(queue, self.random.choice(garbage()))
            self.garbage_sent += 1
            # Wait for its drop, so that no later fault (Redis losing its data) takes it away.
            with contextlib.suppress(AssertionError):
                wait_for(lambda: self.drops() >= self.garbage_sent, 60, "the drop", 0.2)
            fault.ended = time.monotonic()
        fault.waiting = {name: self.generation(name)[0] for name in hit}
        fault.resuming = dict(fault.waiting)
        fault.hit = len(hit)
        return fault

    def pre_receipt(self) -> bool:
        """Whether this fetch-kill comes before ``task_received`` (every other one does)."""
        self.fetch_kills += 1
        return self.fetch_kills % 2 == 1

    def drops(self) -> int:
        """Garbage messages the workers logged as dropped."""
        return sum(w.text().count("dropped a message on queue") for w in self.every_worker)

    def queue(self) -> str:
        meta = json.loads(
            self.git(
                self.lineages[0], "show", f"lineage-{self.lineages[0]}:.ouroboros-lineage.json"
            )
        )
        return "gen." + meta["instrument_fingerprint"][:12]

    def chaos(self, stop: threading.Event) -> None:
        """Inject faults until ``stop``: every kind in turn, in a shuffled order each cycle."""
        low, high = (float(part) for part in self.args.every.split(":"))
        while not stop.wait(self.random.uniform(low, high)):
            if not self.schedule:
                self.schedule = self.args.faults.split(",")
                self.random.shuffle(self.schedule)
            fault = self.inject(self.schedule.pop())
            if fault is not None:
                with self.lock:
                    self.faults.append(fault)

    def held_alive(self, name: str) -> bool:
        """True if a living process holds the lineage's lease (all of the fleet is on this host)."""
        import redis

        from worker.fleet.holders import holder_dead

        try:
            token = self.redis.get(f"ouroboros:lease:{name}")
        except redis.RedisError:
            return False  # Redis is being restarted: nothing is known to hold it
        return token is not None and not holder_dead(token.decode(errors="replace"))

    def watch(self) -> None:
        """Mark each fault resumed, then landed, as every lineage it hit is again in hand."""
        with self.lock:
            open_faults = [f for f in self.faults if f.recovered is None]
        now = time.monotonic()
        for fault in open_faults:
            for name, head in list(fault.waiting.items()):
                current, number = self.generation(name)
                if current != head or number >= self.target:
                    del fault.waiting[name]
                    fault.resuming.pop(name, None)
                elif name in fault.resuming and self.held_alive(name):
                    del fault.resuming[name]
            if not fault.resuming and fault.resumed is None:
                fault.resumed = now - fault.ended
            if not fault.waiting:
                fault.recovered = now - fault.ended

    # -- rounds -------------------------------------------------------------------

    def round(self, chaos: bool) -> tuple[int, float]:
        """One run of every lineage; the generations it landed and the seconds it took."""
        self.target += self.args.generations
        began = time.monotonic()
        self.bench.cli("run", *self.lineages, "--generations", str(self.args.generations))
        stop = threading.Event()
        injector = threading.Thread(target=self.chaos, args=(stop,), daemon=True)
        if chaos:
            injector.start()
        deadline = began + self.args.round_timeout
        while self.unfinished():
            self.watch()
            self.revive()
            if time.monotonic() > deadline:
                raise SystemExit(f"round not finished within {self.args.round_timeout:g} s")
            time.sleep(0.5)
        elapsed = time.monotonic() - began
        stop.set()
        if chaos:
            injector.join()
        self.watch()
        return self.args.generations * len(self.lineages), elapsed

    # -- the end ------------------------------------------------------------------

    def observation_keys(self, lineage: str) -> list[str]:
        from worker.instrument.store_keys import generation_key

        prefix = "fleet/" + generation_key(lineage, 1).rsplit("/", 1)[0] + "/"
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return [item["Key"] for page in pages for item in page.get("Contents", [])]

    def observations(self, lineage: str) -> dict[int, dict[str, object]]:
        found = {}
        for key in self.observation_keys(lineage):
            body = self.s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
            found[int(key.rsplit("/", 1)[1].split(".")[0])] = json.loads(body)
        return found

    def spool_entries(self) -> int:
        """Files left in the spools (the default home's, and each other home's under
        ``spools/``): pending publications, or temp files of killed saves."""
        state = self.root / ".ouroboros" / "state"
        return sum(1 for spool in state.glob("spool*") for p in spool.rglob("*") if p.is_file())

    def settle(self) -> None:
        """Wait for every observation to land and the spool to drain, then stop the fleet."""
        with contextlib.suppress(AssertionError):
            wait_for(
                lambda: (
                    all(len(self.observation_keys(n)) >= self.target for n in self.lineages)
                    and not self.spool_entries()
                ),
                300,
                "the spool to drain",
                2,
            )
        if self.reconciler is not None:
            self.reconciler.terminate()
            self.reconciler.wait(timeout=30)
        for worker in self.workers:
            if worker is not None:
                worker.stop(60)

    def index_entries(self, name: str) -> list[dict[str, object]]:
        """Every entry of the lineage's paged index, read from its segments on the store."""
        from worker.instrument.store_keys import index_segments_prefix

        prefix = f"fleet/{index_segments_prefix(name)}"
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        keys = [item["Key"] for page in pages for item in page.get("Contents", [])]
        return [
            entry
            for key in sorted(keys)
            for entry in json.loads(self.s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())[
                "generations"
            ]
        ]

    def check(self) -> dict[str, object]:
        """Every invariant, counted."""
        counts: Counter[str] = Counter()
        problems: list[str] = []
        status = {
            row["lineage"]: row
            for row in json.loads(self.bench.fleet.ok("status", "--json").stdout)
            if row["lineage"] in self.lineages
        }
        for name in self.lineages:
            holders = [h for h, repo in self.repos.items() if self.bench.head(name, repo)]
            if holders != [self.home(name)]:
                problems.append(f"{name}: in homes {holders}, not only {self.home(name)}")
            log = self.git(
                name, "log", "--first-parent", "--format=%H %P%x09%s", f"lineage-{name}"
            ).decode()
            commits = {}
            numbers = []
            for line in reversed(log.splitlines()):
                hashes, subject = line.split("\t", 1)
                sha, *parents = hashes.split()
                if len(parents) > 1:
                    problems.append(f"{name}: merge commit {sha[:12]}")
                match = GEN_SUBJECT.match(subject)
                if match:
                    number = int(match.group(1))
                    numbers.append(number)
                    commits[number] = (sha, parents[0] if parents else "")
            seen = Counter(numbers)
            counts["landed"] += len(seen)
            counts["lost"] += len(set(range(1, self.target + 1)) - set(seen))
            counts["doubled"] += sum(n - 1 for n in seen.values())
            if numbers != sorted(numbers):
                problems.append(f"{name}: generations out of order")
            observed = self.observations(name)
            counts["extra observations"] += len(set(observed) - set(commits))
            counts["missing observations"] += len(set(commits) - set(observed))
            for number, record in observed.items():
                if number in commits and (
                    record["generation"] != number
                    or (record["lineage_commit"], record["parent_commit"]) != commits[number]
                ):
                    problems.append(f"{name}: observation {number} does not match git")
            indexed = {
                e["generation"]: (e["lineage_commit"], e["parent_commit"])
                for e in self.index_entries(name)
            }
            if indexed != {n: commits[n] for n in commits}:
                problems.append(f"{name}: the index disagrees with git")
            row = status.get(name, {})
            if (row.get("generation"), row.get("observation_backlog"), row.get("in_flight")) != (
                self.target,
                0,
                None,
            ):
                problems.append(f"{name}: status says {row}")
        counts["spool entries"] = self.spool_entries()
        counts["leftover processes"] = len(self.leftover_processes())
        counts["leftover cgroups"] = len(self.leftover_cgroups())
        counts["worker exits"] = self.unexpected_exits
        dropped = self.drops()
        if dropped != self.garbage_sent:
            problems.append(f"{self.garbage_sent} garbage messages sent, {dropped} drops logged")
        return {"counts": counts, "problems": problems}

    def leftover_processes(self) -> list[int]:
        sessions = {w.process.pid for w in self.every_worker}
        left = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[3]) in sessions and stat[0] != "Z":  # field 6: the session id
                left.append(int(entry.name))
        return left

    def leftover_cgroups(self) -> list[Path]:
        prefix = self.lineages[0].rsplit("-", 1)[0] + "-"
        return [path for path in Path("/sys/fs/cgroup").glob("**/" + prefix + "*") if path.is_dir()]

    def close(self) -> None:
        if self.reconciler is not None and self.reconciler.poll() is None:
            self.reconciler.kill()
            self.reconciler.wait()
        # Only workers not yet reaped: a reaped one's pid may belong to someone else now.
        for worker in self.every_worker:
            if worker.process.poll() is None:
                worker.kill()
        for pid in self.leftover_processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.switch.down()
        self.moto.stop()
        self.bench.close()


def _received(worker: Worker) -> str | None:
    match = re.search(r"Task ouroboros\.generation\[([^.\]]+)\.", worker.text())
    return match.group(1) if match else None


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def garbage() -> list[bytes]:
    """One message of each malformed shape a worker must drop."""
    good = task_envelope("ouroboros.generation", [[], {}, {}])
    return [
        b"not JSON {",
        json.dumps({k: v for k, v in good.items() if k != "properties"}).encode(),
        json.dumps(
            task_envelope("ouroboros.generation", [[], {}, {}], "application/x-python-serialize")
        ).encode(),
        json.dumps(task_envelope("os.system", [["id"], {}, {}])).encode(),
        json.dumps(task_envelope("ouroboros.generation", [[], {"x": "x" * 400_000}, {}])).encode(),
    ]


def report(soak: Soak, rounds: list[tuple[bool, int, float]], verdict: dict[str, object]) -> bool:
    args = soak.args
    counts: Counter[str] = verdict["counts"]  # type: ignore[assignment]
    problems: list[str] = verdict["problems"]  # type: ignore[assignment]
    print(
        f"\nchaos soak: {args.lineages} lineages x {args.generations} generations x "
        f"{args.rounds} rounds, {args.workers} workers x {args.concurrency}, lease "
        f"{args.lease} s, reconcile every {args.reconcile:g} s; {machine_note()}"
    )
    if args.homes > 1:
        spread = Counter(soak.home(name) for name in soak.lineages)
        print("homes: " + ", ".join(f"{home} {spread[home]}" for home in soak.repos))
    print(f"\n{'invariant':<24}{'count':>8}")
    for key in ("landed", "lost", "doubled", "extra observations", *MUST_BE_ZERO):
        print(f"{key:<24}{counts[key]:>8}")
    print("\nfault timeline (s from the soak's start; recovery s from the fault's end):")
    print(f"{'#':>3} {'fault':<14}{'ended':>8}{'hit':>5}{'resumed':>9}{'landed':>8}")
    for number, fault in enumerate(soak.faults, 1):
        print(
            f"{number:>3} {fault.kind:<14}{fault.ended - soak.began:>8.1f}{fault.hit:>5}"
            f"{_seconds(fault.resumed):>9}{_seconds(fault.recovered):>8}"
        )
    print(
        f"\n{'fault':<14}{'count':>6}{'landed':>8}{'max s':>8}{'median s':>10}"
        f"{'resumed':>9}{'max s':>8}{'median s':>10}"
    )
    by_kind: dict[str, list[Fault]] = {}
    for fault in soak.faults:
        by_kind.setdefault(fault.kind, []).append(fault)
    worst = worst_resumed = 0.0
    for kind in FAULTS:
        faults = by_kind.get(kind, [])
        times = [f.recovered for f in faults if f.recovered is not None]
        resumed = [f.resumed for f in faults if f.resumed is not None]
        worst = max([worst, *times])
        worst_resumed = max([worst_resumed, *resumed])
        if faults:
            print(
                f"{kind:<14}{len(faults):>6}{len(times):>8}"
                f"{max(times, default=0):>8.1f}{median(times) if times else 0:>10.1f}"
                f"{len(resumed):>9}"
                f"{max(resumed, default=0):>8.1f}{median(resumed) if resumed else 0:>10.1f}"
            )
    clean = [(n, s) for chaos, n, s in rounds if not chaos]
    chaotic = [(n, s) for chaos, n, s in rounds if chaos]

    def rate(samples: list[tuple[int, float]]) -> float:
        return 60 * sum(n for n, _ in samples) / max(sum(s for _, s in samples), 1e-9)

    print(
        f"\nthroughput: fault-free {rate(clean):.1f} generations/min, "
        f"under chaos {rate(chaotic):.1f} ({rate(chaotic) / max(rate(clean), 1e-9):.0%})"
    )
    total = counts["landed"]
    exact = not (counts["lost"] or counts["doubled"] or counts["extra observations"])
    target_recovery = args.lease + args.reconcile + 15
    unrecovered = sum(1 for f in soak.faults if f.recovered is None)
    unresumed = sum(1 for f in soak.faults if f.resumed is None)
    print("\ntargets:")
    print(
        f"  0 lost/doubled/extra over >= 500 generations with >= 30 faults: "
        f"{total} generations, {len(soak.faults)} faults, "
        f"{'PASS' if exact and total >= 500 and len(soak.faults) >= 30 else 'MISS'}"
    )
    print(
        f"  worst recovery (landed) <= {target_recovery:g} s: {worst:.1f} s, "
        f"{unrecovered} unrecovered, "
        f"{'PASS' if worst <= target_recovery and not unrecovered else 'MISS'}"
    )
    print(
        f"  (not the target) worst resumed: {worst_resumed:.1f} s, {unresumed} never resumed, "
        f"{'within' if worst_resumed <= target_recovery and not unresumed else 'beyond'} "
        f"{target_recovery:g} s"
    )
    print(
        f"  chaos throughput >= 70% of fault-free: "
        f"{'PASS' if rate(chaotic) >= 0.7 * rate(clean) else 'MISS'}"
    )
    holds = exact and not problems and not any(counts[key] for key in MUST_BE_ZERO)
    for problem in problems:
        print(f"  problem: {problem}")
    print(f"\ninvariants: {'all hold' if holds else 'VIOLATED'}")
    return holds


def main() -> int:
    args = parse_args()
    # A stopped soak still stops its fleet (SIGTERM would skip the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    soak = Soak(args)
    try:
        soak.start()
        rounds = []
        for number in range(args.rounds):
            chaos = number % 2 == 1
            landed, seconds = soak.round(chaos)
            rounds.append((chaos, landed, seconds))
            print(
                f"round {number + 1}: {'chaos' if chaos else 'fault-free'}, {landed} "
                f"generations in {seconds:.1f} s",
                flush=True,
            )
        soak.settle()
        holds = report(soak, rounds, soak.check())
    finally:
        soak.close()
    return 0 if holds else 1


if __name__ == "__main__":
    sys.exit(main())
