"""Verifying a lineage archive with nothing but the archive: every problem, one line each.

Owns ``schedule-lineage verify`` (and the check ``import`` makes before writing
anything): the sums of the manifest hold, nothing it lists is missing and nothing it
does not list is there; the bundle is a complete git bundle of exactly the branch
``lineage-NAME`` at the manifest's head, its objects fetched into a scratch
repository that must pass ``git fsck --strict``
(``scheduler.importer.fetch_checked``); every observation is of its lineage and of
the generation its name says, and names that generation's commit and that commit's
parent; every numbered generation has its observation or is declared unobserved; no
observation is of a generation the history lacks; the metadata object is the
lineage's root metadata byte for byte; every run record is of the lineage and named
by its id, and every run an observation names is there.

Trusts: the git binary (run with no hooks, no configuration of this machine, and
fsck --strict on every object fetched). Treats the archive as hostile: unpacking is
``scheduler.archive``'s, which sums every member before writing any and writes only
those the manifest vouches for, and every record is validated with pydantic before use.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from pydantic import ValidationError

from scheduler.archive import (
    BUNDLE,
    MANIFEST,
    METADATA,
    RUNS,
    Manifest,
    Unpacked,
    generation_member,
    generation_of,
    run_member,
    unpack,
)
from scheduler.importer import fetch_checked, last_line
from worker.fleet.runs import RunRecord
from worker.instrument.gitrepo import branch_ref, run_git
from worker.instrument.lineage import LineageMetadata
from worker.instrument.names import METADATA_PATH, generation_number
from worker.instrument.records import Observation


@dataclass
class Checked:
    """What verifying an archive found; ``problems`` empty means it verified."""

    unpacked: Unpacked
    repo: Path
    manifest: Manifest | None = None
    manifest_sha256: str | None = None
    problems: list[str] = field(default_factory=list)
    observations: dict[int, bytes] = field(default_factory=dict)
    runs: dict[str, bytes] = field(default_factory=dict)
    metadata: bytes | None = None

    def add(self, problem: str) -> None:
        self.problems.append(problem)


class Generation(NamedTuple):
    commit: str
    parent: str | None


def check(archive: Path, scratch: Path) -> Checked:
    """Unpack ``archive`` under ``scratch`` and check it; a Refusal if it cannot be read."""
    unpacked = unpack(archive, _fresh(scratch / "members"))
    repo = _fresh(scratch / "repo")
    run_git(repo, "init", "--bare", "--quiet")
    checked = Checked(unpacked, repo)
    raw = unpacked.read(MANIFEST)
    if raw is None:
        checked.add(f"missing: {MANIFEST} (the archive lists nothing it holds)")
        return checked
    checked.manifest_sha256 = hashlib.sha256(raw).hexdigest()
    try:
        manifest = Manifest.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the document"
        checked.add(f"{MANIFEST}: not a manifest ({where}: {first['msg']})")
        return checked
    checked.manifest = manifest
    _check_sums(checked, manifest)
    history = _check_bundle(checked, manifest)
    if history is not None:
        _check_observations(checked, manifest, history)
        _check_metadata(checked, manifest)
    _check_runs(checked, manifest)
    return checked


def _fresh(path: Path) -> Path:
    path.mkdir(mode=0o700)
    return path


def _check_sums(checked: Checked, manifest: Manifest) -> None:
    """The sums taken while the archive was read, against the manifest's. A member that
    fails its sum was never written, so every later check finds it missing too."""
    sums = checked.unpacked.sums
    for name, expected in sorted(manifest.files.items()):
        actual = sums.get(name)
        if actual is None:
            checked.add(f"missing: {name} is listed in the manifest but not in the archive")
            continue
        if actual != expected:
            checked.add(f"sum: {name} has sha256 {actual}, the manifest says {expected}")
    for name in sorted(sums):
        if name not in manifest.files:
            checked.add(f"extra: {name} is in the archive but not in the manifest")
    for required in (BUNDLE, METADATA):
        if required not in manifest.files:
            checked.add(f"missing: the manifest lists no {required}")


def _check_bundle(checked: Checked, manifest: Manifest) -> dict[int, Generation] | None:
    """The numbered generations of the bundle's branch, fetched into the scratch repository."""
    path = checked.unpacked.members.get(BUNDLE)
    if path is None:
        return None
    repo, ref = checked.repo, branch_ref(manifest.lineage)
    verified = run_git(repo, "bundle", "verify", "--quiet", str(path), check=False)
    if verified.returncode != 0:
        checked.add(f"{BUNDLE}: not a complete git bundle ({last_line(verified.stderr)})")
        return None
    listing = run_git(repo, "bundle", "list-heads", str(path)).stdout.decode(errors="replace")
    heads = [tuple(line.split(" ", 1)) for line in listing.splitlines() if " " in line]
    if heads != [(manifest.head, ref)]:
        found = ", ".join(f"{r} at {s[:12]}" for s, r in heads) or "no branch"
        checked.add(
            f"{BUNDLE}: holds {found}, not {ref} at the manifest's head {manifest.head[:12]}"
        )
        return None
    refused = fetch_checked(repo, path, ref, ref)
    if refused is not None:
        checked.add(f"{BUNDLE}: git refused its objects ({refused})")
        return None
    log = run_git(repo, "log", "--first-parent", "--format=%H %P%x00%s", ref).stdout
    generations: dict[int, Generation] = {}
    for line in reversed(log.decode(errors="replace").splitlines()):
        ids, _, subject = line.partition("\0")
        commit, *parents = ids.split()
        number = generation_number(subject)
        if number is not None:
            generations[number] = Generation(commit, parents[0] if parents else None)
    if len(generations) != manifest.generations:
        checked.add(
            f"{MANIFEST}: says {manifest.generations} generations, the history numbers "
            f"{len(generations)}"
        )
    return generations


def _check_observations(
    checked: Checked, manifest: Manifest, history: dict[int, Generation]
) -> None:
    unobserved = set(manifest.unobserved)
    for name, path in sorted(checked.unpacked.members.items()):
        number = generation_of(name)
        if number is None:
            continue
        problem = _observation_problem(manifest.lineage, number, path.read_bytes(), history)
        if problem:
            checked.add(f"{name}: {problem}")
        else:
            checked.observations[number] = path.read_bytes()
        if number in unobserved:
            checked.add(f"{name}: generation {number} is declared unobserved, yet here")
    for number in sorted(history):
        name = generation_member(number)
        if number not in unobserved and name not in checked.unpacked.members:
            checked.add(
                f"missing: generation {number} has no observation ({name}) and the "
                "manifest does not declare it unobserved"
            )
    for number in sorted(unobserved - history.keys()):
        checked.add(f"{MANIFEST}: declares generation {number} unobserved; the history lacks it")


def _observation_problem(
    lineage: str, number: int, raw: bytes, history: dict[int, Generation]
) -> str | None:
    try:
        observation = Observation.model_validate_json(raw)
    except ValidationError as exc:
        return f"not an observation ({exc.error_count()} errors)"
    if observation.lineage != lineage:
        return f"is an observation of lineage {observation.lineage!r}, not {lineage}"
    if observation.generation != number:
        return f"holds generation {observation.generation}, not {number}"
    known = history.get(number)
    if known is None:
        return f"generation {number} is not in the lineage's history"
    if observation.lineage_commit != known.commit:
        return (
            f"names commit {observation.lineage_commit[:12]}, but generation {number} is "
            f"commit {known.commit[:12]}"
        )
    if observation.parent_commit != known.parent:
        return (
            f"names parent {observation.parent_commit[:12]}, but generation {number}'s "
            f"parent is {(known.parent or 'none')[:12]}"
        )
    return None


def _check_metadata(checked: Checked, manifest: Manifest) -> None:
    raw = checked.unpacked.read(METADATA)
    if raw is None:
        return  # reported by the sums
    ref = branch_ref(manifest.lineage)
    root = run_git(checked.repo, "rev-list", "--max-parents=0", ref).stdout.decode().split()
    pinned = run_git(checked.repo, "cat-file", "blob", f"{root[-1]}:{METADATA_PATH}", check=False)
    try:
        meta = LineageMetadata.model_validate_json(raw)
    except ValidationError as exc:
        checked.add(f"{METADATA}: not lineage metadata ({exc.error_count()} errors)")
        return
    if pinned.returncode != 0 or pinned.stdout != raw:
        checked.add(
            f"{METADATA}: is not the root metadata ({METADATA_PATH}) of the seed commit "
            f"{root[-1][:12]}"
        )
    elif meta.name != manifest.lineage:
        checked.add(f"{METADATA}: names lineage {meta.name}, not {manifest.lineage}")
    else:
        checked.metadata = raw


def _check_runs(checked: Checked, manifest: Manifest) -> None:
    for name, path in sorted(checked.unpacked.members.items()):
        if not name.startswith(RUNS):
            continue
        raw = path.read_bytes()
        try:
            run = RunRecord.model_validate_json(raw)
        except ValidationError as exc:
            checked.add(f"{name}: not a run record ({exc.error_count()} errors)")
            continue
        if run.lineage != manifest.lineage or run_member(run.run_id) != name:
            checked.add(f"{name}: is run {run.run_id} of lineage {run.lineage}")
            continue
        checked.runs[run.run_id] = raw
    for number, raw in sorted(checked.observations.items()):
        run_id = Observation.model_validate_json(raw).run_id
        if run_id is not None and run_id not in checked.runs:
            checked.add(
                f"{generation_member(number)}: names run {run_id}, whose record "
                f"({run_member(run_id)}) the archive does not hold"
            )
