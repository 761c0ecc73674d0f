"""The per-lineage index, paged: one store object per segment of generations.

Owns where the index lives in the store and how it is read back whole or from a
generation on. The index holds every stored observation's summary (``IndexEntry``)
so overviews, tables and run progress never read the observations themselves; it is
derived data, rebuildable from them.

Generations 1-256 are in segment 0 (``lineages/<name>/index/000000.json``), 257-512 in
segment 1, and so on; each segment object is a ``LineageIndex`` of its own entries.
A publication rewrites the segment of its generation (and the one before, only to
repair a gap there: ``add``), so the bytes written per generation are
bounded by one segment, however long the history. Every segment but the last two is
only ever written again by such a repair or by a publication that waited in a spool
for more than a segment's worth of generations.

Lineages indexed before segments have one whole-history object,
``lineages/<name>/index.json``. It is still read, under the segments (an entry a
segment holds wins), seeds a segment the first time that segment is written, and is
never written again: old lineages stay readable as they were.

Trusts the store's objects to be what workers wrote: a damaged one raises
``pydantic.ValidationError`` here (readers that must go on skip it themselves).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from worker.instrument.records import IndexEntry, LineageIndex, Observation
from worker.instrument.store_keys import (
    generation_key,
    index_key,
    index_segment_key,
    index_segments_prefix,
)

if TYPE_CHECKING:
    from worker.instrument.store import ObservationStore

SEGMENT_ENTRIES = 256
INDEX_ATTEMPTS = 3
# Generations still pending in a spool leave gaps too; each write probes this many.
INDEX_REPAIRS = 8
_SUFFIX = ".json"


def segment_of(generation: int) -> int:
    return (generation - 1) // SEGMENT_ENTRIES


def first_of(segment: int) -> int:
    """The first generation of ``segment``."""
    return segment * SEGMENT_ENTRIES + 1


def segment_keys(store: ObservationStore, lineage: str) -> dict[int, str]:
    """The lineage's stored segments: number -> key (other names under the prefix skipped)."""
    prefix = index_segments_prefix(lineage)
    found = {}
    for key in store.list(prefix):
        stem = key[len(prefix) :].removesuffix(_SUFFIX)
        if (
            key.endswith(_SUFFIX)
            and stem.isdigit()
            and key == index_segment_key(lineage, int(stem))
        ):
            found[int(stem)] = key
    return found


def legacy_entries(store: ObservationStore, lineage: str) -> list[IndexEntry]:
    """The entries of the whole-history index object of a lineage from before segments."""
    return LineageIndex.parse(store.get(index_key(lineage)), lineage).generations


def merged(lineage: str, *parts: list[IndexEntry], since: int = 1) -> LineageIndex:
    """One index of ``parts`` (a later part's entry wins), from generation ``since`` on."""
    entries = {e.generation: e for part in parts for e in part if e.generation >= since}
    return LineageIndex(lineage=lineage, generations=[entries[n] for n in sorted(entries)])


def read_index(store: ObservationStore, lineage: str, since: int = 1) -> LineageIndex:
    """The lineage's index from generation ``since`` on: only the segments that hold it
    are read, so asking for a run's generations costs the run's length, not history's."""
    parts = [legacy_entries(store, lineage)]
    for segment, key in sorted(segment_keys(store, lineage).items()):
        if segment >= segment_of(max(since, 1)):
            parts.append(LineageIndex.parse(store.get(key), lineage).generations)
    return merged(lineage, *parts, since=since)


def add(store: ObservationStore, observation: Observation) -> None:
    """Add the observation's summary to its segment of the lineage's index.

    Two publishers of one lineage (a spool drain beside a live generation) may rewrite
    a segment at once and one may lose the other's entry. So the write is read back
    until it holds this entry, and every write first fills gaps below this
    generation, in its segment and the one before, from the write-once observation
    objects: an entry lost once is restored by a later publication. The segment of
    this generation is the only one written, unless a gap was found in the one before.
    """
    lineage, generation = observation.lineage, observation.generation
    entry = IndexEntry.of(observation)
    current = segment_of(generation)
    legacy: list[IndexEntry] | None = None
    for _ in range(INDEX_ATTEMPTS):
        segments: dict[int, LineageIndex] = {}
        for segment in sorted({max(current - 1, 0), current}):
            raw = store.get(index_segment_key(lineage, segment))
            if raw is None and legacy is None:
                legacy = legacy_entries(store, lineage)
            seed = [e for e in legacy or [] if segment_of(e.generation) == segment]
            segments[segment] = LineageIndex.parse(raw, lineage) if raw else merged(lineage, seed)
        known = {e.generation for index in segments.values() for e in index.generations}
        written = {current}
        for missing in _gaps(store, lineage, known, first_of(min(segments)), generation):
            segment = segment_of(missing.generation)
            segments[segment] = segments[segment].with_entry(missing)
            written.add(segment)
        segments[current] = segments[current].with_entry(entry)
        for segment in sorted(written):
            data = segments[segment].model_dump_json().encode()
            store.put(index_segment_key(lineage, segment), data)
        key = index_segment_key(lineage, current)
        if entry in LineageIndex.parse(store.get(key), lineage).generations:
            return


def _gaps(
    store: ObservationStore, lineage: str, known: set[int], lowest: int, below: int
) -> Iterator[IndexEntry]:
    """Entries of stored observations from ``lowest`` to below ``below`` that ``known``
    lacks (a bounded number per call)."""
    absent = [n for n in range(below - 1, lowest - 1, -1) if n not in known][:INDEX_REPAIRS]
    for generation in absent:
        raw = store.get(generation_key(lineage, generation))
        if raw is not None:
            yield IndexEntry.of(Observation.model_validate_json(raw))
