"""A scheduler's planner in this process, its ``send`` recorded instead of sent: the rig
of the fleet's rules (``test_fleet_rules``) and of the hostile Redis tests
(``test_recovery_against_planted_keys``, ``test_contested_redis_keys``).

``Rig`` makes lineages the way ``schedule-lineage init`` does (the project's own
``create_lineage``) and lands generations with its own ``LineageCache``; ``entry`` and
``report`` build an index entry and a generation's report; ``dead_holder`` names a
process of this host that has exited.
"""

from __future__ import annotations

import hashlib
import secrets
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import redis

from support.fleet import PrivateRedis
from worker.fleet import holders, redis_keys
from worker.fleet.assembly import observation_store
from worker.fleet.homes import Homes
from worker.fleet.planner import Planner
from worker.fleet.repo_admin import ensure_shared_repo
from worker.fleet.runs import RunRecord
from worker.fleet.settings import Settings
from worker.instrument import journal
from worker.instrument.fingerprint import Instrument
from worker.instrument.gitrepo import Entry
from worker.instrument.job import GenerationJob, GenerationReport
from worker.instrument.lineage import LineageMetadata, create_lineage
from worker.instrument.names import DEFAULT_HOME, ORGANISM_PATH
from worker.instrument.physics import Physics
from worker.instrument.records import IndexEntry, LineageIndex
from worker.instrument.store_keys import index_key

SEED = b';;; rules organism  -*- lexical-binding: t; -*-\n(message "hi")\n'
INSTRUMENT = Instrument(
    fingerprint=hashlib.sha256(b"fleet-rules stand-in instrument").hexdigest(),
    version="0.0.0",
    scripts={},
    seed=SEED,
    sources={},
)
PHYSICS = Physics(wall_seconds=60, cpu_seconds=60)
WHEN = datetime(2026, 3, 1, tzinfo=UTC)
HEAD = "c" * 40


@dataclass
class Sent:
    """A ``send`` that records its calls instead of talking to Celery."""

    calls: list[tuple[GenerationJob, str, str, int]] = field(default_factory=list)
    # Per call: sent to the front of its queue, ahead of the jobs already waiting there.
    first: list[bool] = field(default_factory=list)

    def __call__(
        self, job: GenerationJob, job_id: str, queue: str, time_limit: int, first: bool
    ) -> None:
        self.calls.append((job, job_id, queue, time_limit))
        self.first.append(first)

    @property
    def jobs(self) -> list[GenerationJob]:
        return [job for job, *_ in self.calls]


@dataclass
class Rig:
    """A planner on a private repository and store, the real Redis and a fake send."""

    planner: Planner
    sent: Sent
    client: redis.Redis
    name: Callable[[str], str]

    def lineage(self, stem: str) -> tuple[str, LineageMetadata]:
        """A new lineage, made the way ``schedule-lineage init`` makes one."""
        name = self.name(stem)
        settings = self.planner.settings
        ensure_shared_repo(settings.lineage_repo_url)
        meta = create_lineage(
            name=name,
            seed=SEED,
            physics=PHYSICS,
            instrument=INSTRUMENT,
            commit="a" * 40,
            repository="tests",
            ref="tests",
            cache=self.planner.homes.cache(DEFAULT_HOME),
            store=self.planner.store,
        )
        return name, meta

    def head(self, lineage: str) -> str:
        head = self.planner.homes.fetch(lineage)
        assert head is not None
        return head

    def land(self, lineage: str, generation: int) -> str:
        """Push generation ``generation`` (a ``gen N: changed`` commit) onto the lineage."""
        cache = self.planner.homes.home_cache(lineage)
        parent = self.head(lineage)
        tree = cache.tree(parent)
        body = SEED + f";; generation {generation}\n".encode()
        tree[ORGANISM_PATH] = Entry("100644", cache.hash_bytes(body))
        subject = journal.subject_changed(generation, journal.changed_summary((1, 0), 1))
        commit = cache.commit(parent, tree, subject)
        assert cache.push_cas(lineage, commit, parent)
        return commit

    def observe(
        self, lineage: str, generation: int, run_id: str, spent: str, exhausted: bool = False
    ) -> None:
        """Add a generation's entry to the lineage index, as publication does."""
        store = self.planner.store
        index = LineageIndex.parse(store.get(index_key(lineage)), lineage)
        index = index.with_entry(entry(generation, run_id, spent, exhausted))
        store.put(index_key(lineage), index.model_dump_json().encode())

    def run(self, lineage: str, generations: int, budget: str = "1.00") -> RunRecord:
        return self.planner.start_run(
            lineage, self.head(lineage), generations, "scripted", None, Decimal(budget)
        )

    def first_generation(
        self, stem: str, generations: int, budget: str = "1.00"
    ) -> tuple[GenerationJob, str]:
        """A new lineage's run, its first job as enqueued, and the commit that job landed."""
        name, _ = self.lineage(stem)
        self.run(name, generations, budget)
        job = self.planner.enqueue(name)
        assert job is not None
        return job, self.land(name, 1)


def entry(generation: int, run_id: str | None, spent: str, exhausted: bool = False) -> IndexEntry:
    return IndexEntry(
        generation=generation,
        outcome="changed",
        parent_commit="b" * 40,
        lineage_commit=HEAD,
        finished_at=WHEN,
        duration_seconds=1.0,
        cpu_usage_nsec=None,
        memory_peak_bytes=None,
        model_calls=1,
        spent_usd=Decimal(spent),
        run_id=run_id,
        run_budget_exhausted=exhausted,
    )


def report(
    job: GenerationJob, generation: int, commit: str, spent: str, **changes: object
) -> GenerationReport:
    values: dict[str, object] = {
        "lineage": job.lineage,
        "generation": generation,
        "outcome": "changed",
        "parent": job.expected_commit,
        "commit": commit,
        "spent_usd": Decimal(spent),
        "run_budget_exhausted": False,
        "observation_stored": True,
    }
    return GenerationReport.model_validate({**values, **changes})


def dead_holder() -> str:
    """The holder name of a process of this host that has exited."""
    process = subprocess.Popen(["sleep", "60"])
    name = holders.holder_name(process.pid)
    process.kill()
    process.wait()
    return name


def plant_holder(client: redis.Redis, lineage: str, record: str, ttl: int = 600) -> None:
    """The holder record ``record`` of ``lineage``, entered in this host's set of holders as
    a worker of this host enters its own (``markers.claim_running``)."""
    client.set(redis_keys.holder_key(lineage), record, ex=ttl)
    client.zadd(redis_keys.host_holders_key(holders.this_host()), {lineage: time.time() + ttl})


def planner_rig(tmp_path: Path, server: PrivateRedis, client: redis.Redis) -> Rig:
    """A scheduler's planner on ``server`` through ``client``, recording what it sends."""
    settings = Settings(
        home=tmp_path / "home",
        broker_url=server.url,
        visibility_timeout_seconds=7200,
        inflight_ttl_seconds=3600,
    )
    store = observation_store(settings)
    planner = Planner(
        settings=settings,
        store=store,
        homes=Homes(settings, "scheduler", store),
        client=client,
        send=Sent(),
    )
    return Rig(planner=planner, sent=planner.send, client=client, name=_name)  # type: ignore[arg-type]


def _name(stem: str) -> str:
    return f"{stem}-{secrets.token_hex(6)}"
