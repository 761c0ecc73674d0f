"""``schedule-lineage status`` asks the live workers only when a run could be waiting.

The broadcast that asks which queues live workers serve waits out its whole timeout,
so ``status`` of lineages without a running run must not send it; with an active run
it must (a run waiting for a worker of its instrument is what it detects).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.fleet import SMALL_PHYSICS, Fleet

from scheduler.status import FleetClient
from worker.fleet import embedded_redis
from worker.fleet.settings import Settings

# Full tier: the CLI as a process.
pytestmark = pytest.mark.full


def test_status_without_a_running_run_sends_no_broadcast(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.ok("init", "idle", *SMALL_PHYSICS)
    settings = Settings(home=tmp_path / ".ouroboros")
    try:
        handle = FleetClient(settings)
        (row,) = handle.statuses()
        assert (row.lineage, row.generation, row.run_id) == ("idle", 0, None)
        assert "app" not in handle.__dict__  # the Celery client was never even built

        fleet.ok("run", "idle", "--generations", "2")
        busy = FleetClient(settings)
        (row,) = busy.statuses(["idle"])
        assert row.run_id is not None and row.stopped is None
        assert "app" in busy.__dict__
        # The broker answers and no worker serves the queue: the run is reported waiting.
        assert row.waiting_for_instrument is True and row.workers == []
    finally:
        embedded_redis.stop(settings)
