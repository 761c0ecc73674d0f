"""Importing a lineage archive into this fleet's shared repository and observation store.

Owns ``schedule-lineage import FILE``: the archive is verified first
(``scheduler.verify``; any problem refuses it and nothing is written), then the
branch is created from its bundle (``scheduler.importer``: only if no branch of
that name exists, as a compare-and-swap against "absent") and every observation,
run record and the metadata object is written at its write-once key; the lineage
index, derived data, is rebuilt from the imported observations.

Importing is idempotent and never overwrites: a branch already at the archive's
head is left as it is and a key already holding the archive's bytes is skipped, so
importing twice changes nothing. A lineage of that name with another head, or a
key holding other bytes, is a conflict, refused before anything is written, and so
is a fork whose parent lineage is present here without the commit it was forked at. A
lineage's name is written into its records (observations, metadata), so it is
imported under the name it was exported with or not at all.

Trusts: this fleet's repository and store. The archive is hostile until verified.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from scheduler.archive import BUNDLE
from scheduler.importer import import_bundle
from scheduler.verify import Checked, check
from worker.fleet.homes import Homes
from worker.fleet.repo_admin import ensure_shared_repo
from worker.instrument.errors import Refusal
from worker.instrument.gitrepo import branch_ref, run_git
from worker.instrument.lineage import LineageMetadata
from worker.instrument.names import generation_number
from worker.instrument.records import IndexEntry, LineageIndex, Observation
from worker.instrument.repo_urls import is_local, local_path
from worker.instrument.store import ObservationStore
from worker.instrument.store_keys import generation_key, index_key, metadata_key, run_key


class ArchiveProblems(Refusal):
    """The archive did not verify; ``problems`` says why, one line each."""

    def __init__(self, archive: Path, problems: list[str]) -> None:
        super().__init__(
            f"{archive} does not verify ({len(problems)} problems); nothing was imported"
        )
        self.problems = problems


@dataclass(frozen=True)
class Restored:
    lineage: str
    head: str
    branch_created: bool
    written: int
    present: int
    repository: str


def restore(archive: Path, homes: Homes, home: str | None, store: ObservationStore) -> Restored:
    """Import ``archive`` into the home its lineage lives in, or else into ``home`` (the
    rule's choice if None), reserved for it once everything is checked and before its
    branch is written (the archive names no home, ``worker.fleet.homes``)."""
    with tempfile.TemporaryDirectory(prefix="ouroboros-import-") as scratch:
        checked = check(archive, Path(scratch))
        if checked.problems or checked.manifest is None or checked.metadata is None:
            raise ArchiveProblems(archive, checked.problems)
        name, head = checked.manifest.lineage, checked.manifest.head
        destination = homes.destination(name, home)
        repo_url = homes.urls[destination]
        if not is_local(repo_url):
            raise Refusal(f"import writes to a local shared repository; {repo_url} is remote")
        objects = _objects(checked)
        ensure_shared_repo(repo_url)
        existing = _head(local_path(repo_url), name)
        if existing is not None and existing != head:
            raise Refusal(
                f"lineage {name} already exists here at {existing[:12]}, not at the archive's "
                f"head {head[:12]}; a lineage keeps its name, so this archive cannot be imported "
                "into this fleet"
            )
        _check_parent(homes.repository, name, checked.metadata)
        missing = _missing_keys(name, objects, store)
        if existing is None:
            import_bundle(
                checked.unpacked.members[BUNDLE],
                name,
                repo_url,
                lambda: homes.reserve(name, destination),
            )
        for key in missing:
            store.put_once(key, objects[key])
        _rebuild_index(name, checked, store)
    return Restored(
        name, head, existing is None, len(missing), len(objects) - len(missing), repo_url
    )


def _objects(checked: Checked) -> dict[str, bytes]:
    assert checked.manifest is not None and checked.metadata is not None
    name = checked.manifest.lineage
    objects = {metadata_key(name): checked.metadata}
    objects.update({generation_key(name, n): raw for n, raw in checked.observations.items()})
    objects.update({run_key(name, run_id): raw for run_id, raw in checked.runs.items()})
    return objects


def _head(repo: Path, name: str) -> str | None:
    found = run_git(repo, "rev-parse", "--verify", "--quiet", branch_ref(name), check=False)
    return found.stdout.decode().strip() if found.returncode == 0 else None


def _check_parent(repo_of: Callable[[str], str], name: str, metadata: bytes) -> None:
    """A fork's parent, where this fleet holds a lineage of that name, must be that one.

    Genealogy joins lineages by name: an archive whose metadata names a parent
    lineage present here but a commit that lineage never had would show it as that
    lineage's child. A parent absent here is shown as absent, which is the truth.
    """
    parent = LineageMetadata.model_validate_json(metadata).parent
    if parent is None:
        return
    url = repo_of(parent.lineage)
    if not is_local(url):
        raise Refusal(f"import reads the parent's shared repository; {url} is remote")
    repo = local_path(url)
    head = _head(repo, parent.lineage) if (repo / "HEAD").exists() else None
    if head is None:
        return
    held = run_git(repo, "merge-base", "--is-ancestor", parent.commit, head, check=False)
    if held.returncode != 0:
        raise Refusal(
            f"lineage {name} says it was forked from {parent.lineage} at commit "
            f"{parent.commit[:12]}, but this fleet's lineage {parent.lineage} has no such "
            "commit; it is another lineage of that name, so this archive cannot be imported "
            "into this fleet"
        )
    count = run_git(
        repo, "log", "--first-parent", "--format=%s", parent.commit, check=False
    ).stdout.decode(errors="replace")
    numbered = sum(generation_number(subject) is not None for subject in count.splitlines())
    if numbered != parent.generation:
        raise Refusal(
            f"lineage {name} says it was forked from {parent.lineage} at generation "
            f"{parent.generation}, but commit {parent.commit[:12]} is generation {numbered} "
            f"of this fleet's {parent.lineage}; this archive cannot be imported"
        )


def _missing_keys(name: str, objects: dict[str, bytes], store: ObservationStore) -> list[str]:
    """Keys the store lacks; a Refusal, before anything is written, if one holds other bytes."""
    missing = []
    for key, data in objects.items():
        held = store.get(key)
        if held is None:
            missing.append(key)
        elif held != data:
            raise Refusal(
                f"the observation store {store.url} already holds {key} with other content; "
                f"records of another lineage {name} are there, so this archive cannot be "
                "imported into this fleet"
            )
    return missing


def _rebuild_index(name: str, checked: Checked, store: ObservationStore) -> None:
    entries = [
        IndexEntry.of(Observation.model_validate_json(raw))
        for _, raw in sorted(checked.observations.items())
    ]
    if not entries:
        return  # as the exporting fleet had it: an index is written by a first observation
    rebuilt = LineageIndex(lineage=name, generations=entries).model_dump_json().encode()
    if store.get(index_key(name)) != rebuilt:
        store.put(index_key(name), rebuilt)
