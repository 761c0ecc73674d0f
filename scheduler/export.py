"""Exporting a lineage as one self-verifying archive a researcher can publish.

Owns ``schedule-lineage export NAME [--to FILE]``: the branch is fetched at one
head into a scratch repository and bundled from there (the shared repository gets
no ref, lock or object from an export), and the archive holds, for exactly that
head, every observation byte for byte as the store holds it, every run record and
the metadata object, under a manifest of sha256 sums (``scheduler.archive``).

Decisions: a lineage with a run still going is refused (its records are still
being written; cancel it or let it stop); a lineage imported from a bundle is
refused (it has no records to export: its history is the bundle it came from); an
observation of a generation the head does not hold (one that landed during the
export) is left out; a numbered generation whose observation the store lacks
(still pending, or lost) is declared ``unobserved`` in the manifest; the metadata
object is the seed commit's, and if the store's copy differs the export says so.
Nothing is written anywhere but the archive, which never replaces a file.

Trusts: the fleet's shared repository and observation store.
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pydantic import ValidationError

from scheduler.archive import (
    BUNDLE,
    METADATA,
    SUFFIX,
    Manifest,
    digests,
    generation_member,
    run_member,
    write_archive,
)
from worker.fleet.runs import RunRecord, run_progress
from worker.instrument.errors import Refusal
from worker.instrument.fingerprint import package_version
from worker.instrument.gitrepo import LineageCache, branch_ref, run_git
from worker.instrument.lineage import check_name
from worker.instrument.names import METADATA_PATH, generation_number
from worker.instrument.records import LineageIndex, Observation
from worker.instrument.store import ObservationStore
from worker.instrument.store_keys import generation_key, index_key, metadata_key, runs_prefix


@dataclass(frozen=True)
class Exported:
    path: Path
    manifest: Manifest
    manifest_sha256: str
    observations: int
    runs: int
    notes: list[str]


def export_lineage(
    name: str, target: Path | None, cache: LineageCache, store: ObservationStore
) -> Exported:
    check_name(name)
    target = (target or Path(f"{name}{SUFFIX}")).absolute()
    if target.exists() or target.is_symlink():
        raise Refusal(f"{target} exists; choose another --to FILE")
    if not target.parent.is_dir():
        raise Refusal(f"{target.parent} is not a directory; choose another --to FILE")
    if cache.fetch(name) is None:
        raise Refusal(f"no lineage named {name}; see schedule-lineage status for all")
    with tempfile.TemporaryDirectory(prefix="ouroboros-export-") as scratch:
        work = Path(scratch)
        repo = work / "repo"
        repo.mkdir()
        run_git(repo, "init", "--bare", "--quiet")
        ref = branch_ref(name)
        # One head for the whole export: whatever lands meanwhile is not in this archive.
        run_git(
            repo,
            "fetch",
            "--quiet",
            "--no-tags",
            str(cache.git_dir),
            f"{cache.tracking_ref(name)}:{ref}",
        )
        head = run_git(repo, "rev-parse", ref).stdout.decode().strip()
        history = _generations(repo, ref)
        root = run_git(repo, "rev-list", "--max-parents=0", ref).stdout.decode().split()[-1]
        pinned = run_git(repo, "cat-file", "blob", f"{root}:{METADATA_PATH}", check=False)
        if pinned.returncode != 0:
            raise Refusal(
                f"lineage {name} was imported from a bundle and has no records to export; "
                "the bundle it came from is its whole history"
            )
        _refuse_running(name, store, len(history))
        notes: list[str] = []
        members: dict[str, Path] = {BUNDLE: work / BUNDLE, METADATA: work / METADATA}
        run_git(repo, "bundle", "create", "--quiet", str(members[BUNDLE]), ref)
        stored_meta = store.get(metadata_key(name))
        if stored_meta is not None and stored_meta != pinned.stdout:
            notes.append(
                f"the store's metadata object differs from the seed commit's {METADATA_PATH}; "
                "the archive holds the seed commit's"
            )
        members[METADATA].write_bytes(pinned.stdout)
        observed = _observations(name, store, history, work, members, notes)
        runs = _runs(name, store, work, members)
        manifest = Manifest(
            lineage=name,
            head=head,
            generations=len(history),
            unobserved=sorted(set(history) - observed),
            exported_at=datetime.now(UTC),
            exported_by=package_version(),
            files=digests(members.items()),
        )
        write_archive(target, manifest, members)
    return Exported(
        path=target,
        manifest=manifest,
        manifest_sha256=hashlib.sha256(manifest.to_json()).hexdigest(),
        observations=len(observed),
        runs=runs,
        notes=notes,
    )


def _generations(repo: Path, ref: str) -> dict[int, str]:
    """Generation number -> commit, newest commit of a number winning, as readers count."""
    log = run_git(repo, "log", "--first-parent", "--format=%H %s", ref).stdout
    found: dict[int, str] = {}
    for line in reversed(log.decode(errors="replace").splitlines()):
        commit, _, subject = line.partition(" ")
        number = generation_number(subject)
        if number is not None:
            found[number] = commit
    return found


def _refuse_running(name: str, store: ObservationStore, generation: int) -> None:
    keys = store.list(runs_prefix(name))
    if not keys:
        return
    runs = [_run(store, key) for key in keys]
    latest = max(runs, key=lambda run: (run.created_at, run.run_id))
    index = LineageIndex.parse(store.get(index_key(name)), name)
    if run_progress(latest, generation, index.generations).stopped is None:
        raise Refusal(
            f"lineage {name} has run {latest.run_id} still going; cancel it "
            f"(schedule-lineage cancel {name}) or let it stop, then export"
        )


def _observations(
    name: str,
    store: ObservationStore,
    history: dict[int, str],
    work: Path,
    members: dict[str, Path],
    notes: list[str],
) -> set[int]:
    (work / "generations").mkdir()
    observed: set[int] = set()
    for number, commit in sorted(history.items()):
        raw = store.get(generation_key(name, number))
        if raw is None:
            continue
        try:
            observation = Observation.model_validate_json(raw)
        except ValidationError:
            notes.append(f"left out generation {number}'s observation: the store's is unreadable")
            continue
        if observation.lineage_commit != commit:
            notes.append(
                f"left out generation {number}'s observation: it is of commit "
                f"{observation.lineage_commit[:12]}, not {commit[:12]}"
            )
            continue
        member = generation_member(number)
        (work / member).write_bytes(raw)
        members[member] = work / member
        observed.add(number)
    return observed


def _runs(name: str, store: ObservationStore, work: Path, members: dict[str, Path]) -> int:
    (work / "runs").mkdir()
    count = 0
    for key in store.list(runs_prefix(name)):
        raw = store.get(key) or b""
        run = _run(store, key, raw)
        member = run_member(run.run_id)
        (work / member).write_bytes(raw)
        members[member] = work / member
        count += 1
    return count


def _run(store: ObservationStore, key: str, raw: bytes | None = None) -> RunRecord:
    try:
        return RunRecord.model_validate_json(raw if raw is not None else store.get(key) or b"")
    except ValidationError:
        raise Refusal(
            f"the store's run record {key} is unreadable; repair it, then export"
        ) from None
