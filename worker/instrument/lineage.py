"""Lineage identity: names, the root metadata file, creation and validation.

Owns the schema of ``.ouroboros-lineage.json`` (written once, in the seed commit),
the rules for lineage names, creating a lineage (seed commit on ``lineage-NAME`` in
the shared bare repository plus the metadata object in the observation store), the
record of the lineage a fork was seeded from (``Parentage``: kept in the root, so the
step from one instrument to another is on the record of the lineage itself) and
checking that a worker may continue a lineage: schema, instrument fingerprint,
version and commit must all equal the worker's own, because a lineage is never
continued under different physics.

Trusts: the instrument identity it is given. Treats the metadata read back from a
lineage as untrusted input (validated with pydantic).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from worker.instrument.errors import Refusal
from worker.instrument.fields import CohortLabel, LineageName
from worker.instrument.fingerprint import Instrument
from worker.instrument.gitrepo import Entry, LineageCache
from worker.instrument.names import (
    COMMIT_PATTERN,
    DEFAULT_HOME,
    HOME_PATTERN,
    JOURNAL_PATH,
    KERNEL_OWNED,
    METADATA_PATH,
    ORGANISM_PATH,
    cohort_label_problem,
    lineage_name_problem,
)
from worker.instrument.physics import Physics
from worker.instrument.store import ObservationStore
from worker.instrument.store_keys import metadata_key

SCHEMA: Final = "ouroboros-fleet-lineage/v1"


class Parentage(BaseModel):
    """Where a forked lineage's seed came from: a commit of another lineage.

    ``generation`` is how many generations that commit's history holds (0: the
    parent's seed). The instrument fields are the parent's pinned instrument, None
    for a parent recorded outside this fleet (an imported lineage has none).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    lineage: LineageName
    commit: str = Field(pattern=COMMIT_PATTERN)
    generation: int = Field(ge=0)
    instrument_fingerprint: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    instrument_version: str | None = None
    instrument_commit: str | None = Field(None, pattern=COMMIT_PATTERN)


class LineageMetadata(BaseModel):
    """The lineage root: who may continue it and under which physics."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    schema_name: Literal["ouroboros-fleet-lineage/v1"] = Field(SCHEMA, alias="schema")
    name: LineageName
    created_at: datetime
    instrument_fingerprint: str = Field(pattern=r"^[0-9a-f]{64}$")
    instrument_version: str
    instrument_commit: str = Field(pattern=COMMIT_PATTERN)
    instrument_repository: str
    instrument_ref: str
    seed_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    physics: Physics
    # None for a lineage seeded by init (and for every lineage made before forks existed).
    parent: Parentage | None = None
    # The cohort the lineage was started in (replicates of one seed and physics, or any
    # grouping chosen at init or fork); None for a lineage in none, and for every root
    # written before cohorts existed.
    cohort: CohortLabel | None = None
    # The shared repository ("home") the lineage lives in, chosen once when it is made
    # (worker.fleet.homes); None for the home called ``default``, so a root written
    # before homes existed, or in a fleet of one, reads byte for byte as it did.
    home: str | None = Field(None, pattern=HOME_PATTERN)

    @property
    def home_name(self) -> str:
        return self.home or DEFAULT_HOME

    def to_json(self) -> bytes:
        # Without the absent fields, so a root's metadata reads as it always did.
        return (self.model_dump_json(by_alias=True, indent=2, exclude_none=True) + "\n").encode()


def check_name(name: str) -> str:
    if (problem := lineage_name_problem(name)) is not None:
        raise Refusal(f"invalid lineage name {name!r}: {problem}")
    return name


def check_cohort(label: str) -> str:
    if (problem := cohort_label_problem(label)) is not None:
        raise Refusal(f"invalid cohort label {label!r}: {problem}")
    return label


def check_free(name: str, cache: LineageCache, store: ObservationStore) -> None:
    """Refuse ``name`` unless it is valid and neither the repository nor the store has it."""
    check_name(name)
    if cache.fetch(name) is not None:
        raise Refusal(f"lineage {name} already exists; choose another name")
    if store.get(metadata_key(name)) is not None:
        # Its write-once observations would shadow the new lineage's forever.
        raise Refusal(
            f"the observation store still holds records of an earlier lineage {name} "
            f"({store.url}); choose another name"
        )


def parse_metadata(raw: bytes | None, lineage: str) -> LineageMetadata:
    if raw is None:
        raise Refusal(
            f"lineage {lineage} has no {METADATA_PATH} in its seed commit; it was not created "
            "by this fleet (import it for browsing, or start a new lineage)"
        )
    try:
        return LineageMetadata.model_validate_json(raw)
    except ValidationError as exc:
        raise Refusal(
            f"lineage {lineage} has an unreadable {METADATA_PATH} ({exc.error_count()} errors); "
            "start a new lineage"
        ) from None


def check_continuable(meta: LineageMetadata, instrument: Instrument, commit: str) -> None:
    """Refuse to continue a lineage under an instrument other than the one that seeded it."""
    if meta.instrument_fingerprint != instrument.fingerprint:
        raise Refusal(
            f"lineage {meta.name}: instrument fingerprint differs "
            f"({meta.instrument_fingerprint[:12]} pinned, {instrument.fingerprint[:12]} here); "
            "its physics would change - start a new lineage, or carry this one forward with "
            f"schedule-lineage fork NEW --from {meta.name}"
        )
    if meta.instrument_version != instrument.version:
        raise Refusal(
            f"lineage {meta.name}: instrument version differs ({meta.instrument_version} pinned, "
            f"{instrument.version} here); start a new lineage"
        )
    if meta.instrument_commit != commit:
        raise Refusal(
            f"lineage {meta.name}: instrument commit differs ({meta.instrument_commit[:12]} "
            f"pinned, {commit[:12]} here); start a new lineage"
        )


def root_metadata(cache: LineageCache, head: str, lineage: str) -> LineageMetadata:
    """The metadata of the lineage's root commit (out-of-loop commits cannot alter it)."""
    return _metadata_at(cache, cache.history(lineage, head).root, lineage)


@lru_cache(maxsize=4096)
def _metadata_at(cache: LineageCache, root: str, lineage: str) -> LineageMetadata:
    # A commit id names its content for good, so the parsed metadata never goes stale.
    return parse_metadata(cache.read_blob(root, METADATA_PATH), lineage)


def create_lineage(
    *,
    name: str,
    seed: bytes,
    physics: Physics,
    instrument: Instrument,
    commit: str,
    repository: str,
    ref: str,
    cache: LineageCache,
    store: ObservationStore,
    files: Mapping[str, Entry] | None = None,
    parent: Parentage | None = None,
    cohort: str | None = None,
    home: str = DEFAULT_HOME,
) -> LineageMetadata:
    """Create ``lineage-NAME`` with its seed commit, then its metadata object.

    The seed commit holds ``seed`` as organism.el, an empty journal, the metadata, and
    ``files`` (a fork's other files, already in the cache; the kernel's own paths and
    organism.el among them are ignored). ``cache`` is the cache of the lineage's
    ``home``, which the root records.
    """
    check_free(name, cache, store)
    if cohort is not None:
        check_cohort(cohort)
    meta = LineageMetadata(
        name=name,
        created_at=datetime.now(UTC),
        instrument_fingerprint=instrument.fingerprint,
        instrument_version=instrument.version,
        instrument_commit=commit,
        instrument_repository=repository,
        instrument_ref=ref,
        seed_sha256=hashlib.sha256(seed).hexdigest(),
        physics=physics,
        parent=parent,
        cohort=cohort,
        home=None if home == DEFAULT_HOME else home,
    )
    kept = {p: e for p, e in (files or {}).items() if p not in KERNEL_OWNED | {ORGANISM_PATH}}
    entries = {
        **kept,
        ORGANISM_PATH: Entry("100644", cache.hash_bytes(seed)),
        JOURNAL_PATH: Entry("100644", cache.hash_bytes(b"")),
        METADATA_PATH: Entry("100644", cache.hash_bytes(meta.to_json())),
    }
    seed_commit = cache.commit(None, entries, "seed")
    if not cache.push_cas(name, seed_commit, None):
        raise Refusal(f"lineage {name} already exists; choose another name")
    store.put(metadata_key(name), meta.to_json())
    return meta


def read_seed(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise Refusal(
            f"cannot read seed {path}: {exc.strerror}; pass a readable --seed FILE"
        ) from None
