"""Crash-safe publication: a worker that dies between its spool checkpoint and the push
(or the observation) loses nothing; the next worker process on the host finishes it."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
from support.fleet import INSTRUMENT_COMMIT, SMALL_PHYSICS, Fleet

from worker.fleet.assembly import build_pipeline
from worker.fleet.settings import Settings
from worker.instrument.index import add, read_index, segment_keys
from worker.instrument.job import GenerationJob
from worker.instrument.pipeline import Pipeline
from worker.instrument.records import Observation
from worker.instrument.spool import ORPHAN_SECONDS, TEMP_PREFIX, Spool

pytestmark = [pytest.mark.bwrap, pytest.mark.cgroups, pytest.mark.root]


class Crash(BaseException):
    """Stands for the process dying: nothing after it runs, no handler catches it."""


def settings_for(fleet: Fleet) -> Settings:
    return Settings(
        home=fleet.home / ".ouroboros",
        instrument_commit=INSTRUMENT_COMMIT,
        model_provider="scripted",
    )


def crash_before_the_push(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lineage: str) -> Fleet:
    """A lineage whose first generation's worker died between checkpoint and push."""
    fleet = Fleet(tmp_path)
    fleet.ok("init", lineage, *SMALL_PHYSICS)
    monkeypatch.chdir(tmp_path)
    first = build_pipeline(settings_for(fleet))
    head = first.head(lineage)

    def die(*_: object) -> bool:
        raise Crash

    monkeypatch.setattr(first.cache, "push_cas", die)
    with pytest.raises(Crash):
        first.run(GenerationJob(lineage=lineage, expected_commit=head, provider="scripted"))
    return fleet


def test_crash_after_the_checkpoint_is_finished_by_the_next_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet = crash_before_the_push(tmp_path, monkeypatch, "phoenix")
    assert fleet.subjects("phoenix") == ["seed"]
    pending = list((tmp_path / ".ouroboros/state/spool").glob("phoenix.*.json"))
    assert len(pending) == 1

    restarted = build_pipeline(settings_for(fleet))
    assert restarted.drain() == 0
    assert fleet.subjects("phoenix")[0].startswith("gen 1: changed")
    observation = fleet.observation("phoenix", 1)
    assert observation["lineage_commit"] == fleet.git("rev-parse", "lineage-phoenix").strip()
    assert not list((tmp_path / ".ouroboros/state/spool").glob("*.json"))
    assert [e.generation for e in read_index(restarted.store, "phoenix").generations] == [1]


def test_the_temp_file_of_a_save_killed_mid_write_is_swept_by_the_next_drain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SIGKILL runs no handler: a worker killed between mkstemp and the rename leaves its
    # temp file behind, and nothing else would ever remove it.
    fleet = Fleet(tmp_path)
    fleet.ok("init", "tidy", *SMALL_PHYSICS)
    monkeypatch.chdir(tmp_path)
    pipeline = build_pipeline(settings_for(fleet))
    spool = tmp_path / ".ouroboros/state/spool"
    orphan, writing = spool / f"{TEMP_PREFIX}orphan", spool / f"{TEMP_PREFIX}writing"
    orphan.write_bytes(b'{"lineage": "tidy", "gener')
    writing.write_bytes(b"{")
    old = time.time() - ORPHAN_SECONDS - 1
    os.utime(orphan, (old, old))
    assert pipeline.drain() == 0
    assert not orphan.exists()
    # A save still being written (any younger one) is left to its writer.
    assert writing.exists()


def test_a_checkpoint_whose_push_lost_the_race_is_discarded_not_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from support.lives import push_hand_commit

    fleet = crash_before_the_push(tmp_path, monkeypatch, "loser")
    push_hand_commit(fleet, "loser", {"notes.txt": "meanwhile\n"}, "external edit: meanwhile")

    restarted = build_pipeline(settings_for(fleet))
    assert restarted.drain() == 0
    assert fleet.subjects("loser") == ["external edit: meanwhile", "seed"]
    assert fleet.observation_numbers("loser") == []
    assert not list((tmp_path / ".ouroboros/state/spool").glob("*.json"))


def test_settings_come_from_a_toml_file_under_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "fleet.toml"
    config.write_text('ceiling = "cgroup1"\nconcurrency = 4\nmodel_provider = "openai"\n')
    monkeypatch.setenv("OUROBOROS_CONFIG", str(config))
    monkeypatch.setenv("OUROBOROS_CONCURRENCY", "2")
    settings = Settings()
    assert settings.ceiling == "cgroup1"
    assert settings.model_provider == "openai"
    assert settings.concurrency == 2  # the environment wins over the file
    assert os.environ["OUROBOROS_CONFIG"] == str(config)


class SlowReads:
    """The pipeline's store, with reads slowed to widen the window between get and put."""

    def __init__(self, store: object) -> None:
        self.store = store

    def get(self, key: str) -> bytes | None:
        raw = self.store.get(key)  # type: ignore[attr-defined]
        time.sleep(0.2)
        return raw

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)


def test_concurrent_index_writers_lose_no_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet = Fleet(tmp_path)
    fleet.ok("init", "racer", *SMALL_PHYSICS)
    fleet.ok("run", "racer", "--generations", "2", "--local")
    monkeypatch.chdir(tmp_path)
    pipeline = build_pipeline(settings_for(fleet))
    for key in segment_keys(pipeline.store, "racer").values():
        (fleet.observations / key).unlink()
    pipeline.store = SlowReads(pipeline.store)  # type: ignore[assignment]
    observations = [Observation.model_validate(fleet.observation("racer", n)) for n in (1, 2)]
    writers = [threading.Thread(target=add, args=(pipeline.store, o)) for o in observations]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert [e.generation for e in read_index(pipeline.store, "racer").generations] == [1, 2]


def test_a_directory_among_the_temp_names_does_not_stop_the_sweep(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    stray, orphan = spool.root / f"{TEMP_PREFIX}stray", spool.root / f"{TEMP_PREFIX}orphan"
    stray.mkdir()
    orphan.write_bytes(b"{")
    old = time.time() - ORPHAN_SECONDS - 1
    for path in (stray, orphan):
        os.utime(path, (old, old))
    assert spool.sweep_orphans() == 1
    assert stray.is_dir() and not orphan.exists()


def test_a_journal_kept_in_memory_never_hides_a_generation_another_process_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One process keeps the journal it committed last; a second process lives the next
    # generation; the first must then build on the second's journal, not its own.
    fleet = Fleet(tmp_path)
    fleet.ok("init", "relay", *SMALL_PHYSICS)
    monkeypatch.chdir(tmp_path)
    first, second = build_pipeline(settings_for(fleet)), build_pipeline(settings_for(fleet))
    read: list[str] = []
    cat_blobs = first.cache.cat_blobs

    def counted(shas: Iterable[str]) -> dict[str, bytes]:
        wanted = list(shas)
        read.extend(wanted)
        return cat_blobs(wanted)

    monkeypatch.setattr(first.cache, "cat_blobs", counted)

    def live(pipeline: Pipeline) -> None:
        head = pipeline.head("relay")
        pipeline.run(GenerationJob(lineage="relay", expected_commit=head, provider="scripted"))

    live(first)
    journal_of_gen_1 = fleet.git("rev-parse", "lineage-relay:journal.md").strip()
    read.clear()
    live(first)
    assert journal_of_gen_1 not in read  # taken from memory, not inflated again
    live(second)
    journal_of_gen_3 = fleet.git("rev-parse", "lineage-relay:journal.md").strip()
    read.clear()
    live(first)
    assert journal_of_gen_3 in read
    journal = fleet.show("relay", "journal.md")
    assert [line.split(" — ")[0] for line in journal.splitlines() if line.startswith("## ")] == [
        f"## gen {n}" for n in range(1, 5)
    ]
