"""The paged lineage index: segments written one at a time, read back whole.

Against both real stores (a directory and moto's S3 server over HTTP): a segmented
index reads back exactly as the whole-history object of before did, a lineage written
in that old format stays readable (and is continued in segments without rewriting
it), a publication writes one segment however long the history, lost entries are
repaired across a segment boundary, and the browser's reader sees the same figures
from either format.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from support.browse import sample_observation, write_hostile_lineage

from scheduler.reader import Reader
from worker.fleet.settings import Settings
from worker.instrument import index
from worker.instrument.records import IndexEntry, LineageIndex, Observation
from worker.instrument.store import ObservationStore
from worker.instrument.store_keys import generation_key, index_key, index_segment_key

SEGMENT = 5
WHEN = datetime(2026, 3, 1, tzinfo=UTC)


@pytest.fixture(autouse=True)
def small_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Segments of five entries, so that a few dozen generations span several."""
    monkeypatch.setattr(index, "SEGMENT_ENTRIES", SEGMENT)


def observation(lineage: str, generation: int) -> Observation:
    outcome = "changed" if generation % 4 else "process_exit"
    made = sample_observation(
        lineage,
        generation,
        f"{generation - 1:040x}",
        f"{generation:040x}",
        outcome,
        WHEN + timedelta(minutes=generation),
        "",
    )
    spent = Decimal("0.01") * generation
    return made.model_copy(update={"spent_usd": spent, "run_id": "r1" if generation > 10 else None})


def publish(store: ObservationStore, lineage: str, generation: int, indexed: bool = True) -> None:
    """What a publication does: the write-once observation, then (normally) the index."""
    made = observation(lineage, generation)
    store.put_once(generation_key(lineage, generation), made.model_dump_json().encode())
    if indexed:
        index.add(store, made)


def whole(lineage: str, generations: range) -> LineageIndex:
    """The index as the whole-history format held it."""
    return LineageIndex(
        lineage=lineage,
        generations=[IndexEntry.of(observation(lineage, n)) for n in generations],
    )


def test_segments_read_back_as_the_whole_index_did(observation_store: ObservationStore) -> None:
    for generation in range(1, 24):
        publish(observation_store, "paged", generation)
    assert index.read_index(observation_store, "paged") == whole("paged", range(1, 24))
    assert sorted(index.segment_keys(observation_store, "paged")) == [0, 1, 2, 3, 4]
    assert observation_store.get(index_key("paged")) is None
    # From a generation on: only what a run of generations 12-23 needs.
    assert index.read_index(observation_store, "paged", since=12) == whole("paged", range(12, 24))


def test_a_publication_writes_one_segment_however_long_the_history(
    observation_store: ObservationStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[tuple[str, int]] = []
    put = observation_store.put

    def recording_put(key: str, data: bytes) -> None:
        written.append((key, len(data)))
        put(key, data)

    monkeypatch.setattr(observation_store, "put", recording_put)
    sizes = {}
    for generation in range(1, 43):
        written.clear()
        publish(observation_store, "long", generation)
        assert [key for key, _ in written] == [index_segment_key("long", (generation - 1) // 5)]
        sizes[generation] = written[0][1]
    # The fifth entry of a segment costs the same early and late in the history.
    assert sizes[40] <= sizes[5] * 1.1


def test_an_old_whole_index_lineage_stays_readable_and_is_continued_in_segments(
    observation_store: ObservationStore,
) -> None:
    old = whole("old", range(1, 13))
    for generation in range(1, 13):
        publish(observation_store, "old", generation, indexed=False)
    raw = old.model_dump_json().encode()
    observation_store.put(index_key("old"), raw)
    assert index.read_index(observation_store, "old") == old

    publish(observation_store, "old", 13)
    assert index.read_index(observation_store, "old") == whole("old", range(1, 14))
    # The old object is never rewritten; the new segment took its share of it.
    assert observation_store.get(index_key("old")) == raw
    segment = LineageIndex.parse(observation_store.get(index_segment_key("old", 2)), "old")
    assert [e.generation for e in segment.generations] == [11, 12, 13]


def test_lost_entries_are_repaired_across_a_segment_boundary(
    observation_store: ObservationStore,
) -> None:
    for generation in range(1, 8):
        # 4 and 5 are stored but their index writes were lost (a crash, a race).
        publish(observation_store, "holes", generation, indexed=generation not in (4, 5))
    assert index.read_index(observation_store, "holes") == whole("holes", range(1, 8))


@pytest.mark.full
def test_the_browser_reads_the_same_figures_from_either_format(
    tmp_path: Path, file_store: ObservationStore
) -> None:
    settings = Settings(home=tmp_path / "home", observations=file_store.url)
    write_hostile_lineage(settings, "both")
    reader = Reader(file_store, Path(settings.lineage_repo_url))
    before = reader.lineage("both")
    old = LineageIndex.parse(file_store.get(index_key("both")), "both")

    (file_store.base / index_key("both")).unlink()
    stored = [
        Observation.model_validate_json(file_store.get(generation_key("both", e.generation)) or b"")
        for e in old.generations
    ]
    for made in stored:
        index.add(file_store, made)
    assert index.read_index(file_store, "both") == old
    after = Reader(file_store, Path(settings.lineage_repo_url)).lineage("both")
    assert after == before
    assert reader.lineage("both") == before
