"""Forking: a new lineage seeded from one commit of another, under this instrument.

Owns ``schedule-lineage fork NEW --from NAME[@GEN]``: resolving the source (the
head; ``@N`` the commit of generation N, ``@0`` the seed; ``@<hex>`` any commit of
the branch's first-parent history, 7 to 64 hex digits, at least one of them a
letter or more than 9 of them), and creating the new lineage through the
instrument's own ``create_lineage``: its seed commit is a new root whose tree is the
source commit's files with an empty journal and new metadata, pinned to the
instrument running here, and whose metadata records the parent (lineage, commit,
generation, and the parent's instrument fingerprint, version and commit).

A death's commit already holds the tree its rollback restored, so forking a death
forks that body, and the caller says so. The fork's physics are the parent's
pinned physics (the defaults for a parent without any, such as an imported
lineage), each overridable by ``init``'s options. Every name of the source tree must
pass the rules a life's result obeys (``tree_names``), or the fork is refused naming
it: the new lineage's lives would carry it, and every reader show it. The parent is only read: its
branch, objects and records are left exactly as they were.

Trusts: the scheduler's lineage cache and the instrument. Treats the parent's
content and metadata as data (validated before use).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

import pygit2

from scheduler.history import parse_subject
from scheduler.tree_names import refused_name
from worker.instrument.errors import Refusal
from worker.instrument.gitrepo import Entry, LineageCache
from worker.instrument.lineage import LineageMetadata, Parentage, check_name, parse_metadata
from worker.instrument.names import METADATA_PATH, ORGANISM_PATH, generation_number
from worker.instrument.physics import Physics

_GENERATION = re.compile(r"^[0-9]{1,9}$")
_COMMIT = re.compile(r"^[0-9a-f]{7,64}$")
_REGULAR = ("100644", "100755")


@dataclass(frozen=True)
class Source:
    """The commit a fork starts from, and what its lineage says about it."""

    lineage: str
    commit: str
    generation: int  # generations in the commit's history (0: the seed)
    died: bool
    meta: LineageMetadata | None  # None: a lineage recorded outside this fleet

    @property
    def physics(self) -> Physics | None:
        return self.meta.physics if self.meta else None

    def parentage(self) -> Parentage:
        return Parentage(
            lineage=self.lineage,
            commit=self.commit,
            generation=self.generation,
            instrument_fingerprint=self.meta.instrument_fingerprint if self.meta else None,
            instrument_version=self.meta.instrument_version if self.meta else None,
            instrument_commit=self.meta.instrument_commit if self.meta else None,
        )


def resolve(cache: LineageCache, spec: str) -> Source:
    """The source ``NAME[@GEN]`` names; a Refusal for an unknown lineage or generation."""
    name, at, where = spec.partition("@")
    check_name(name)
    head = cache.fetch(name)
    if head is None:
        raise Refusal(f"no lineage named {name}; see schedule-lineage status for all")
    # First parents, newest first: (commit, subject); a lineage is one line of bodies.
    log = [
        line.split("\0", 1)
        for line in cache.git("log", "--first-parent", "--format=%H%x00%s", head)
        .stdout.decode(errors="replace")
        .splitlines()
    ]
    position = _position(log, name, where) if at else 0
    commit, subject = log[position]
    older = log[position:]
    generations = sum(generation_number(s) is not None for _, s in older)
    root = older[-1][0]
    raw = cache.read_blob(root, METADATA_PATH)
    meta = parse_metadata(raw, name) if raw is not None else None
    died = parse_subject(subject, is_root=position == len(log) - 1).kind == "died"
    return Source(name, commit, generations, died, meta)


def _position(log: list[list[str]], name: str, where: str) -> int:
    if _GENERATION.fullmatch(where):
        number = int(where)
        if number == 0:
            return len(log) - 1
        for position, (_, subject) in enumerate(log):
            if generation_number(subject) == number:
                return position  # the newest commit of that number, as every reader counts
        raise Refusal(f"lineage {name} has no generation {number}")
    if _COMMIT.fullmatch(where.lower()):
        matches = [p for p, (sha, _) in enumerate(log) if sha.startswith(where.lower())]
        if len(matches) == 1:
            return matches[0]
        if matches:
            raise Refusal(
                f"{where} names {len(matches)} commits of lineage {name}; give more digits"
            )
        raise Refusal(f"lineage {name} has no commit {where} in its history")
    raise Refusal(
        f"{name}@{where}: after @ give a generation number (0 for the seed) or a commit id"
    )


class Seed(NamedTuple):
    """What a fork's seed commit holds: the body, the other files, and the parent record."""

    body: bytes
    files: dict[str, Entry]
    parent: Parentage
    # The source commit's tree: what a fork into another home copies there.
    tree: str


def seed_of(cache: LineageCache, source: Source, physics: Physics) -> Seed:
    """The seed a fork of ``source`` starts from; a Refusal if it could not live under
    ``physics``. The parent is only read."""
    tree = cache.tree(source.commit)
    organism = tree.get(ORGANISM_PATH)
    if organism is None or organism.mode not in _REGULAR:
        raise Refusal(
            f"{source.lineage}@{source.generation} ({source.commit[:12]}) has no regular "
            f"{ORGANISM_PATH}; fork another generation"
        )
    root = cache.repo[source.commit].peel(pygit2.Commit).tree
    refused = refused_name(cache.repo, [root])
    if refused is not None:
        raise Refusal(
            f"{source.lineage}@{source.generation} ({source.commit[:12]}) holds a name no "
            f"life could publish: {refused}; fork another generation"
        )
    files = {p: e for p, e in tree.items() if p != METADATA_PATH}
    found = cache.footprint(files)
    if not found.fits(physics.work_bytes, physics.work_files):
        raise Refusal(
            f"the tree of {source.lineage}@{source.generation} ({found.files} files, "
            f"{found.room} bytes of /work) does not fit work_bytes={physics.work_bytes} "
            f"work_files={physics.work_files}; raise --work-bytes or --work-files"
        )
    body = cache.cat_blobs([organism.sha])[organism.sha]
    return Seed(body, files, source.parentage(), str(root.id))


def describe(meta: LineageMetadata, source: Source) -> list[str]:
    """What ``fork`` prints: the new lineage, its parent, and the instrument step."""
    was = (
        f"{source.meta.instrument_fingerprint[:12]} v{source.meta.instrument_version}"
        if source.meta
        else "none (recorded outside this fleet)"
    )
    lines = [
        f"forked lineage {meta.name} (branch lineage-{meta.name}) from {source.lineage} "
        f"generation {source.generation}, commit {source.commit[:12]}",
        f"instrument: {was} -> {meta.instrument_fingerprint[:12]} v{meta.instrument_version}",
    ]
    if source.died:
        lines.append(
            f"{source.lineage} generation {source.generation} died: {meta.name} starts from the "
            f"body its rollback restored (organism.el sha256 {meta.seed_sha256[:12]})"
        )
    return lines
