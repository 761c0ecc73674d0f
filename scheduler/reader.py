"""The one read-only reader behind every browsing view (CLI and web UI).

Owns answering browsing questions from the two sources of truth: the shared bare
repository (which commits exist, their numbering, the journal, diffs, bodies) and
the observation store (metadata, the per-lineage index, observations, runs). It
never writes either. Lists and pages come from the history and the index object;
one observation object is read only when one generation is shown, so the cost of
the overview and of a lineage page does not grow with observation objects.

Caches are checked against what makes them valid: a branch head (commits are
immutable, so a history that moved on is extended by its new commits only, as the
worker's fetch is) and the index object's exact bytes (publication rewrites it), so
nothing stale is ever served and no cache needs expiry.

Trusts: the store and repository the settings name. Treats all lineage content as
data; validates lineage names and generation numbers before any lookup, and looks
lineages up among existing branches, so a URL or argument never reaches git or the
store as a path.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import NamedTuple, TypeVar

from pydantic import BaseModel, ValidationError

from scheduler.cohorts import in_cohort
from scheduler.curves import bucketed, cumulative, overlay, shares, since, strip
from scheduler.emacs_errors import first_error
from scheduler.genealogy import Child, Genealogy, descendants, genealogy, offspring
from scheduler.history import CommitKind, journal_entries, journal_entry, parse_subject
from scheduler.readgit import ReadOnlyGit
from scheduler.views import (
    CohortRow,
    CohortView,
    CommitView,
    CompareView,
    Curve,
    DeathMark,
    FamilyView,
    FileDiff,
    GenerationRow,
    GenerationView,
    GridCell,
    JournalRow,
    LineageSummary,
    LineageView,
    Overlay,
    PageInfo,
    Series,
    is_death,
)
from worker.fleet.runs import Progress, RunRecord, run_progress
from worker.fleet.settings import Settings
from worker.instrument.errors import Refusal
from worker.instrument.gitrepo import GitError
from worker.instrument.index import merged, segment_keys
from worker.instrument.lineage import LineageMetadata
from worker.instrument.names import (
    BRANCH_PREFIX,
    DEFAULT_HOME,
    JOURNAL_PATH,
    METADATA_PATH,
    ORGANISM_PATH,
    is_lineage_name,
)
from worker.instrument.records import IndexEntry, LineageIndex, Observation, ReplayReport
from worker.instrument.repo_urls import is_local, local_path
from worker.instrument.store import ObservationStore, open_store
from worker.instrument.store_keys import generation_key, index_key, replay_key

DEFAULT_PER_PAGE = 50
_Record = TypeVar("_Record", bound=BaseModel)
MAX_PER_PAGE = 500
# Distinct organism bodies read per ``cat-file --batch`` when counting their lines.
LINES_BATCH = 64
# Above this many changed lines in one comparison only organism.el's patch is shown:
# a published tree may hold hundreds of MiB, and a page must stay readable and fast.
PATCH_LINE_BUDGET = 20_000
LETHAL_BODY_BYTES = 1024 * 1024
_EMPTY_TREE = {
    40: "4b825dc642cb6eb9a060e54bf8d69288fbee4904",
    64: "6ef19b41225c5369f1c104d45d8d85efa9b057b53b14b4b9b939dd74decc5321",
}
_FIELD = "\x1f"
_RECORD = "\x1e"
log = logging.getLogger(__name__)


class NotFound(LookupError):
    """No such lineage or generation (or a malformed name or number)."""


class Commit(NamedTuple):
    """One commit as the history holds it: a tuple, because a history holds 10,000s."""

    sha: str
    parents: tuple[str, ...]
    committed_at: str
    subject: str
    kind: CommitKind
    generation: int | None
    exit_status: int | None
    summary: str | None
    model_unavailable: bool = False

    def view(self) -> CommitView:
        return CommitView(**self._asdict())


@dataclass(frozen=True)
class History:
    """Everything the repository says about one branch head; immutable, so cacheable."""

    name: str
    head: str
    commits: list[Commit]  # newest first
    by_generation: dict[int, Commit]
    metadata: LineageMetadata | None
    seed_sha256: str | None

    @property
    def numbered(self) -> int:
        return len(self.by_generation)


@dataclass
class Tally:
    """A lineage's generations counted: by outcome class, deaths by kind, observed ones
    and those marked "model unavailable"."""

    outcomes: Counter[str]
    deaths: Counter[str]
    observed: int
    unavailable: int


@dataclass
class IndexView:
    """A parsed index object with the derived figures every view needs."""

    raw: tuple[bytes, ...]  # every index object it was built from, in order
    entries: dict[int, IndexEntry]
    spent_usd: Decimal
    series: list[Series]


class Reader:
    """Read-only answers over the shared repositories (homes) and one observation store.

    ``repo`` is the default home's repository; ``others`` the other homes'. Their
    objects are read through ``repo`` (``ReadOnlyGit``'s alternates); each home's own
    branches are its lineages.
    """

    def __init__(self, store: ObservationStore, repo: Path, others: Sequence[Path] = ()) -> None:
        self.store = store
        self.git = ReadOnlyGit(repo, others)
        self.homes = [ReadOnlyGit(repo), *(ReadOnlyGit(other) for other in others)]
        self._lock = threading.Lock()
        self._histories: dict[str, History] = {}
        self._indexes: dict[str, IndexView] = {}
        self._index_parts: dict[str, tuple[bytes, list[IndexEntry]]] = {}
        self._warned: set[str] = set()
        # Commit -> organism.el's blob and size; blob -> its lines. Both never change.
        self._bodies: dict[str, tuple[str, float] | None] = {}
        self._lines: dict[str, float] = {}
        # Lineage -> the head and index view it was counted at, and the count.
        self._tallies: dict[str, tuple[str, IndexView | None, Tally]] = {}

    # -- lineages -------------------------------------------------------------

    def heads(self) -> dict[str, str]:
        """Every lineage branch of every home: name -> head commit (none of a home whose
        repository does not exist yet). A name in two homes is left out with a warning,
        as every command refuses it (``worker.fleet.homes``)."""
        heads: dict[str, str] = {}
        twice: set[str] = set()
        for home in self.homes:
            for name, sha in self._home_heads(home).items():
                if name in heads:
                    twice.add(name)
                heads[name] = sha
        for name in sorted(twice):
            self._warn(f"ignoring lineage {name}: its branch is in more than one shared repository")
        return self._commits_only({n: sha for n, sha in heads.items() if n not in twice})

    def _home_heads(self, home: ReadOnlyGit) -> dict[str, str]:
        if not (home.git_dir / "HEAD").exists():
            return {}
        listed = home.run(
            "for-each-ref",
            "--format=%(refname:lstrip=2) %(objectname)",
            f"refs/heads/{BRANCH_PREFIX}*",
        )
        # git skips a ref whose name or content it cannot read, and says so on stderr.
        for warning in listed.stderr.decode(errors="replace").splitlines():
            self._warn(warning.removeprefix("warning: "))
        heads = {}
        for line in listed.stdout.decode(errors="replace").splitlines():
            branch, _, sha = line.partition(" ")
            name = branch.removeprefix(BRANCH_PREFIX)
            # A branch no fleet command could have made is not a lineage we show.
            if branch.startswith(BRANCH_PREFIX) and is_lineage_name(name):
                heads[name] = sha
            else:
                self._warn(f"ignoring refs/heads/{branch}: not a lineage name")
        return heads

    def _commits_only(self, heads: dict[str, str]) -> dict[str, str]:
        """``heads`` without a branch whose head is not a commit here (a foreign or broken
        ref): every view would fail on its history, so it is left out with a warning."""
        if not heads:
            return heads
        checked = self.git.run(
            "cat-file",
            "--batch-check=%(objectname) %(objecttype)",
            input="".join(f"{sha}\n" for sha in heads.values()).encode(),
        ).stdout.decode(errors="replace")
        commits = {
            sha
            for sha, _, kind in (line.partition(" ") for line in checked.splitlines())
            if kind == "commit"
        }
        for name, sha in heads.items():
            if sha not in commits:
                self._warn(f"ignoring refs/heads/{BRANCH_PREFIX}{name}: {sha} is not a commit here")
        return {name: sha for name, sha in heads.items() if sha in commits}

    def _warn(self, message: str) -> None:
        """Log ``message`` once: a view reads the heads several times per answer."""
        if message not in self._warned:
            self._warned.add(message)
            log.warning("%s", message)

    def history(self, name: str, heads: dict[str, str] | None = None) -> History:
        """``name``'s history, its head looked up in ``heads`` (default: read them now)."""
        if not is_lineage_name(name):
            raise NotFound(f"no lineage named {name!r}")
        head = (heads if heads is not None else self.heads()).get(name)
        if head is None:
            raise NotFound(f"no lineage named {name}")
        return self._history(name, head)

    def summaries(self) -> list[LineageSummary]:
        heads = self.heads()
        metas = self.metadata(heads)
        kids = offspring(metas)
        return [
            self._summary(self._history(n, h), metas=metas, kids=kids)
            for n, h in sorted(heads.items())
        ]

    def summary(self, name: str) -> LineageSummary:
        heads = self.heads()
        return self._summary(self.history(name, heads), metas=self.metadata(heads))

    def metadata(self, heads: dict[str, str] | None = None) -> dict[str, LineageMetadata | None]:
        """Every lineage's root metadata (None: imported), what genealogy is read from."""
        heads = heads if heads is not None else self.heads()
        return {name: self._history(name, head).metadata for name, head in sorted(heads.items())}

    def genealogy(self, name: str) -> Genealogy:
        heads = self.heads()
        self.history(name, heads)
        return genealogy(name, self.metadata(heads))

    def family(self, seed_sha256: str) -> FamilyView:
        """Lineages seeded from this organism, then every lineage forked from one of them."""
        summaries = {s.name: s for s in self.summaries()}
        roots = [name for name, s in summaries.items() if s.seed_sha256 == seed_sha256]
        if not roots:
            raise NotFound(f"no lineage seeded from {seed_sha256}")
        members = descendants(roots, self.metadata())
        return FamilyView(seed_sha256=seed_sha256, lineages=[summaries[m] for m in members])

    def lineage(self, name: str, page: int = 1, per_page: int = DEFAULT_PER_PAGE) -> LineageView:
        # One read of the branch heads serves the history, the genealogy and the parent link.
        heads = self.heads()
        history = self.history(name, heads)
        index = self._index(name)
        per_page = max(1, min(per_page, MAX_PER_PAGE))
        pages = max(1, -(-len(history.commits) // per_page))
        if not 1 <= page <= pages:
            raise NotFound(f"lineage {name} has {pages} pages")
        window = history.commits[(page - 1) * per_page : page * per_page]
        metas = self.metadata(heads)
        return LineageView(
            summary=self._summary(history, index, metas),
            metadata=history.metadata,
            genealogy=genealogy(name, metas),
            parent_url=self._parent_url(history, heads),
            page=PageInfo(number=page, per_page=per_page, rows=len(history.commits), pages=pages),
            rows=[_row(commit, index) for commit in window],
            series=self._charts(history, index),
            fork=self._beside_parent(history, index, heads),
            strip=strip(
                [
                    _cell(n, _row(commit, index))
                    for n, commit in sorted(history.by_generation.items())
                ]
            ),
        )

    def cohort(self, label: str) -> CohortView:
        """Cohort ``label``'s lineages: their outcome grid, shares and overlaid curves."""
        heads = self.heads()
        metas = self.metadata(heads)
        names = in_cohort(metas, label)
        if not names:
            raise NotFound(f"no cohort {label!r}")
        return self._group(label, names, heads, metas)

    def chosen(self, names: Sequence[str]) -> CohortView:
        """The lineages ``names`` (each must exist), shown as a cohort is."""
        heads = self.heads()
        for name in names:
            self.history(name, heads)
        if not names:
            raise NotFound("no lineage chosen; name them as ?lineages=a,b,c")
        return self._group(None, sorted(set(names)), heads, self.metadata(heads))

    def _group(
        self,
        label: str | None,
        names: list[str],
        heads: dict[str, str],
        metas: dict[str, LineageMetadata | None],
    ) -> CohortView:
        rows, outcomes, sizes, spent = [], [], [], []
        for name in names:
            history = self._history(name, heads[name])
            index = self._index(name)
            numbered = {n: _row(commit, index) for n, commit in history.by_generation.items()}
            outcomes.append({n: row.outcome for n, row in numbered.items()})
            sizes.append((Curve(label=name, lineage=name), self._sizes(history)))
            spent.append((Curve(label=name, lineage=name), _spent(index)))
            cells = [
                _cell(n, found) if (found := numbered.get(n)) else None
                for n in range(1, max(numbered, default=0) + 1)
            ]
            rows.append(CohortRow(summary=self._summary(history, index, metas), cells=cells))
        width = max(len(row.cells) for row in rows)
        for row in rows:
            row.cells += [None] * (width - len(row.cells))
        lived, changed = shares(outcomes)
        return CohortView(
            label=label,
            generations=width,
            rows=rows,
            shares=overlay(
                "shares",
                "Lineages that lived and changed",
                "%",
                [
                    (Curve(label="lived (did not die)", lineage=None), lived),
                    (Curve(label="changed the organism", lineage=None), changed),
                ],
                with_median=False,
            ),
            overlays=[
                overlay("organism", "Organism size", "bytes", sizes, with_median=True),
                overlay("spent", "Cumulative spend", "USD", spent, with_median=True),
            ],
        )

    # -- generations ----------------------------------------------------------

    def generation(self, name: str, number: int) -> GenerationView:
        history = self.history(name)
        commit = _numbered(history, number)
        parent = commit.parents[0] if commit.parents else None
        specs = [f"{commit.sha}:{JOURNAL_PATH}"]
        if parent and commit.kind == "died":
            specs.append(f"{parent}:{ORGANISM_PATH}")
        blobs = self.git.blobs(specs)
        journal = blobs[specs[0]]
        lethal = blobs.get(specs[-1]) if len(specs) == 2 else None
        numbers = sorted(history.by_generation)
        position = numbers.index(number)
        observation = self._observation(name, commit)
        row = _row(commit, self._index(name))
        return GenerationView(
            lineage=name,
            row=row,
            parent=parent,
            previous=numbers[position - 1] if position > 0 else None,
            next=numbers[position + 1] if position + 1 < len(numbers) else None,
            journal=journal_entry(_text(journal), number) if journal is not None else None,
            diff=self._diff(parent, commit.sha),
            observation=observation,
            lethal_body=_text(lethal[:LETHAL_BODY_BYTES]) if lethal is not None else None,
            first_error=(
                first_error(observation.stderr)
                if observation is not None and is_death(row.outcome)
                else None
            ),
            replay=self._replay(name, commit),
        )

    def compare(self, name: str, a: int, b: int) -> CompareView:
        history = self.history(name)
        first, second = _numbered(history, a), _numbered(history, b)
        index = self._index(name)
        return CompareView(
            lineage=name,
            a=_row(first, index),
            b=_row(second, index),
            diff=self._diff(first.sha, second.sha),
        )

    def journal(self, name: str) -> list[JournalRow]:
        """Every commit, oldest first, with its generation's journal entry (CLI view)."""
        history = self.history(name)
        raw = self.git.blobs([f"{history.head}:{JOURNAL_PATH}"])[f"{history.head}:{JOURNAL_PATH}"]
        entries = journal_entries(_text(raw)) if raw is not None else {}
        return [
            JournalRow(
                commit=commit.view(),
                entry=entries.get(commit.generation) if commit.generation else None,
            )
            for commit in reversed(history.commits)
        ]

    def observed_rows(self, name: str) -> list[GenerationRow]:
        """Every numbered generation, oldest first, with its indexed figures (CLI view)."""
        history = self.history(name)
        index = self._index(name)
        return [_row(c, index) for c in reversed(history.commits) if c.generation is not None]

    def indexed(self, name: str) -> list[IndexEntry]:
        """The figures of every observed generation of ``name``, oldest first (metrics)."""
        if not is_lineage_name(name):
            raise NotFound(f"no lineage named {name!r}")
        index = self._index(name)
        return [index.entries[number] for number in sorted(index.entries)] if index else []

    def observation(self, name: str, number: int) -> Observation | None:
        """The stored observation of generation ``number``, whatever commit it names (metrics)."""
        if not is_lineage_name(name):
            raise NotFound(f"no lineage named {name!r}")
        return _stored(self.store, generation_key(name, number), Observation)

    # -- internals ------------------------------------------------------------

    def _replay(self, name: str, commit: Commit) -> ReplayReport | None:
        """The latest replay report of this very commit, if one reads."""
        assert commit.generation is not None
        report = _stored(self.store, replay_key(name, commit.generation), ReplayReport)
        # A replay of another commit with this number (a rewritten branch) is not this one's.
        return report if report is not None and report.lineage_commit == commit.sha else None

    def _parent_url(self, history: History, heads: dict[str, str]) -> str | None:
        """The page of the exact commit a fork was seeded from, where this repository has it.

        A generation's page when the recorded commit is that generation's; the parent's
        lineage page when the fork started from its seed or an out-of-loop commit.
        """
        parent = history.metadata.parent if history.metadata else None
        head = heads.get(parent.lineage) if parent else None
        if parent is None or head is None:
            return None
        found = self._history(parent.lineage, head).by_generation.get(parent.generation)
        if found is not None and found.sha == parent.commit:
            return f"/lineages/{parent.lineage}/generations/{parent.generation}"
        return f"/lineages/{parent.lineage}"

    def _history(self, name: str, head: str) -> History:
        with self._lock:
            known = self._histories.get(name)
        if known is not None and known.head == head:
            return known
        history = self._extend(known, head) if known is not None else None
        history = history or self._read_history(name, head)
        with self._lock:
            self._histories[name] = history
        return history

    def _log(self, revisions: str) -> list[Commit]:
        """Commits of ``revisions``, newest first, with what their subjects say."""
        fmt = _FIELD.join(("%H", "%P", "%cI", "%s")) + _RECORD
        out = self.git.run("log", "--topo-order", f"--format={fmt}", revisions).stdout
        commits: list[Commit] = []
        for record in out.decode(errors="replace").split(_RECORD):
            fields = record.strip("\n").split(_FIELD)
            if len(fields) != 4:
                continue
            sha, parents, when, subject = fields
            meaning = parse_subject(subject, is_root=not parents)
            commits.append(Commit(sha, tuple(parents.split()), when, subject, *meaning))
        return commits

    def _extend(self, known: History, head: str) -> History | None:
        """``known`` moved forward to ``head`` by reading only the new commits.

        None when ``head`` does not simply extend ``known.head`` (a rewritten branch):
        then the whole history is read again.
        """
        try:
            new = self._log(f"{known.head}..{head}")
        except GitError:
            return None  # the old head is gone from the repository altogether
        if not new or new[-1].parents[:1] != (known.head,):
            return None
        by_generation = dict(known.by_generation)
        for commit in reversed(new):
            if commit.generation is not None:
                by_generation[commit.generation] = commit
        return History(
            name=known.name,
            head=head,
            commits=new + known.commits,
            by_generation=by_generation,
            metadata=known.metadata,
            seed_sha256=known.seed_sha256,
        )

    def _read_history(self, name: str, head: str) -> History:
        commits = self._log(head)
        by_generation: dict[int, Commit] = {}
        for commit in reversed(commits):  # oldest first, so a repeated number keeps the newest
            if commit.generation is not None:
                by_generation[commit.generation] = commit
        root = commits[-1].sha
        specs = [f"{root}:{METADATA_PATH}", f"{root}:{ORGANISM_PATH}"]
        blobs = self.git.blobs(specs)
        seed = blobs[specs[1]]
        return History(
            name=name,
            head=head,
            commits=commits,
            by_generation=by_generation,
            metadata=_metadata(blobs[specs[0]]),
            seed_sha256=hashlib.sha256(seed).hexdigest() if seed is not None else None,
        )

    def _charts(self, history: History, index: IndexView | None) -> list[Series]:
        """The index's series and the organism's size from git, each with the deaths marked."""
        numbered = sorted(history.by_generation.items())
        deaths = [
            DeathMark(generation=n, outcome=outcome)
            for n, commit in numbered
            if is_death(outcome := _row(commit, index).outcome)
        ]
        organism = bucketed("organism", "Organism size", "bytes", self._sizes(history))
        lines = self._organism_lines([commit.sha for _, commit in numbered])
        counted = [(n, lines.get(commit.sha)) for n, commit in numbered]
        charts = [
            organism,
            bucketed("lines", "Organism lines", "lines", counted),
            *(index.series if index else []),
        ]
        return [series.model_copy(update={"deaths": deaths}) for series in charts if series.points]

    def _beside_parent(
        self, history: History, index: IndexView | None, heads: dict[str, str]
    ) -> list[Overlay]:
        """A fork's size and spend beside its parent's after the fork point (none: a root,
        or a parent no longer here)."""
        parentage = history.metadata.parent if history.metadata else None
        if parentage is None or parentage.lineage not in heads:
            return []
        parent = self._history(parentage.lineage, heads[parentage.lineage])
        fork_at = parentage.generation
        child = Curve(label=history.name, lineage=history.name)
        elder = Curve(label=f"{parent.name} (parent)", lineage=parent.name, offset=fork_at)
        axis = f"generations since the fork ({parent.name} generation {fork_at})"
        elder_spent = _spent(self._index(parent.name), after=fork_at)
        return [
            overlay(
                "fork-organism",
                "Organism size beside the parent",
                "bytes",
                [(child, self._sizes(history)), (elder, since(self._sizes(parent), fork_at))],
                with_median=False,
                axis=axis,
            ),
            overlay(
                "fork-spent",
                "Cumulative spend beside the parent",
                "USD",
                [(child, _spent(index)), (elder, since(elder_spent, fork_at))],
                with_median=False,
                axis=axis,
            ),
        ]

    def _sizes(self, history: History) -> list[tuple[int, float]]:
        """organism.el's size in bytes at each numbered generation of ``history``."""
        numbered = sorted(history.by_generation.items())
        sizes = self._organism_sizes([commit.sha for _, commit in numbered])
        return [(n, sizes[commit.sha]) for n, commit in numbered if commit.sha in sizes]

    def _organism_sizes(self, commits: list[str]) -> dict[str, float]:
        """organism.el's size at each commit, asked of git once per commit (they never change)."""
        unknown = [sha for sha in commits if sha not in self._bodies]
        if unknown:
            out = self.git.run(
                "cat-file",
                "--batch-check=%(objectname) %(objectsize)",
                input="".join(f"{sha}:{ORGANISM_PATH}\n" for sha in unknown).encode(),
            ).stdout.decode()
            with self._lock:
                for sha, line in zip(unknown, out.splitlines(), strict=True):
                    blob, _, size = line.partition(" ")
                    self._bodies[sha] = (blob, float(size)) if size.isdigit() else None
        return {sha: found[1] for sha in commits if (found := self._bodies.get(sha))}

    def _organism_lines(self, commits: list[str]) -> dict[str, float]:
        """organism.el's lines at each commit, each distinct body read from git once."""
        self._organism_sizes(commits)
        blobs = {found[0] for sha in commits if (found := self._bodies.get(sha))}
        unknown = sorted(blobs - self._lines.keys())
        for start in range(0, len(unknown), LINES_BATCH):
            read = self.git.blobs(unknown[start : start + LINES_BATCH])
            with self._lock:
                for blob, raw in read.items():
                    if raw is not None:
                        self._lines[blob] = float(len(raw.splitlines()))
        lines = {}
        for sha in commits:
            found = self._bodies.get(sha)
            if found and found[0] in self._lines:
                lines[sha] = self._lines[found[0]]
        return lines

    def _index(self, name: str) -> IndexView | None:
        """The lineage's index: its segments and any pre-segment index object, each
        parsed once per distinct content, the view rebuilt only when one changed.

        A segment older than the last two is rewritten only by a rare repair
        (``worker.instrument.index``), so once read it is served from this cache; the
        last two, and the whole-history object of a lineage from before segments, are
        read on every call. A damaged object reads as absent, figures and all.
        """
        keys = segment_keys(self.store, name)
        recent = set(sorted(keys)[-2:])
        parts = [self._index_part(index_key(name), name, fresh=True)]
        parts += [
            self._index_part(key, name, fresh=segment in recent)
            for segment, key in sorted(keys.items())
        ]
        found = [part for part in parts if part is not None]
        if not found:
            return None
        signature = tuple(raw for raw, _ in found)
        cached = self._indexes.get(name)
        if cached is not None and cached.raw == signature:
            return cached
        entries = merged(name, *(part for _, part in found)).generations
        view = IndexView(
            raw=signature,
            entries={entry.generation: entry for entry in entries},
            spent_usd=sum((e.spent_usd for e in entries), Decimal(0)),
            series=_series(entries),
        )
        self._indexes[name] = view
        return view

    def _index_part(
        self, key: str, name: str, *, fresh: bool
    ) -> tuple[bytes, list[IndexEntry]] | None:
        """One index object's raw bytes and entries; None if absent or damaged."""
        cached = self._index_parts.get(key)
        if cached is not None and not fresh:
            return cached
        raw = self.store.get(key)
        if raw is None:
            return None
        if cached is not None and cached[0] == raw:
            return cached
        try:
            part = (raw, LineageIndex.parse(raw, name).generations)
        except ValidationError:
            return None
        self._index_parts[key] = part
        return part

    def _observation(self, name: str, commit: Commit) -> Observation | None:
        assert commit.generation is not None
        observation = _stored(self.store, generation_key(name, commit.generation), Observation)
        if observation is None:
            return None
        # An observation of another commit with this number is not this generation's.
        return observation if observation.lineage_commit == commit.sha else None

    def _runs(self, name: str) -> list[RunRecord]:
        runs = []
        for key in self.store.list(f"lineages/{name}/runs/"):
            raw = self.store.get(key)
            try:
                runs.append(RunRecord.model_validate_json(raw or b""))
            except ValidationError:
                continue
        return sorted(runs, key=lambda run: run.run_id)

    def _summary(
        self,
        history: History,
        index: IndexView | None = None,
        metas: dict[str, LineageMetadata | None] | None = None,
        kids: dict[str, list[Child]] | None = None,
    ) -> LineageSummary:
        index = index if index is not None else self._index(history.name)
        metas = metas if metas is not None else self.metadata()
        kids = kids if kids is not None else offspring(metas)
        tally = self._tally(history, index)
        latest = max(history.by_generation, default=0)
        last = history.by_generation.get(latest)
        last_entry = index.entries.get(latest) if index else None
        fleet = history.metadata is not None
        runs = self._runs(history.name) if fleet else []
        progress = _progress(runs[-1], history, index) if runs else None
        if not fleet:
            status = "imported"
        elif progress and progress.stopped is None:
            status = "running"
        else:
            status = "idle"
        return LineageSummary(
            name=history.name,
            kind="fleet" if fleet else "imported",
            status=status,
            head=history.head,
            seed_sha256=history.seed_sha256,
            instrument_fingerprint=(
                history.metadata.instrument_fingerprint if history.metadata else None
            ),
            generations=latest,
            outcomes=dict(tally.outcomes),
            model_unavailable=tally.unavailable,
            out_of_loop=len(history.commits) - history.numbered,
            last_generation_at=(
                last_entry.finished_at
                if last_entry
                else datetime.fromisoformat(last.committed_at)
                if last
                else None
            ),
            spent_usd=index.spent_usd if index else None,
            observed=tally.observed,
            backlog=history.numbered - tally.observed if fleet else None,
            run=progress,
            parent=history.metadata.parent if history.metadata else None,
            children=[child.lineage for child in kids.get(history.name, [])],
            cohort=history.metadata.cohort if history.metadata else None,
            deaths=dict(tally.deaths),
            last_outcome=_outcome(last, index) if last else None,
        )

    def _tally(self, history: History, index: IndexView | None) -> Tally:
        """The lineage's outcome counts, counted again only when its head or its index
        changed (the index view is the same object while its bytes are the same)."""
        cached = self._tallies.get(history.name)
        if cached is not None and cached[0] == history.head and cached[1] is index:
            return cached[2]
        tally = Tally(Counter(), Counter(), 0, 0)
        for commit in history.by_generation.values():
            figures = _figures(commit, index)
            tally.observed += figures is not None
            outcome = figures.outcome if figures else commit.kind
            tally.outcomes[_outcome_class(outcome)] += 1
            if is_death(outcome):
                tally.deaths[outcome] += 1
            tally.unavailable += figures.model_unavailable if figures else commit.model_unavailable
        with self._lock:
            self._tallies[history.name] = (history.head, index, tally)
        return tally

    def _diff(self, old: str | None, new: str) -> list[FileDiff]:
        """Per-path changes, organism.el first, then the other paths in git's order."""
        base = old or _EMPTY_TREE[len(new)]
        stat = self.git.run("diff", "--numstat", "-z", base, new).stdout
        files: list[FileDiff] = []
        for record in stat.split(b"\0"):
            if not record:
                continue
            added, deleted, path = record.split(b"\t", 2)
            binary = added == b"-"
            files.append(
                FileDiff(
                    path=_text(path),
                    added=None if binary else int(added),
                    deleted=None if binary else int(deleted),
                    binary=binary,
                    patch=None,
                )
            )
        changed = sum((f.added or 0) + (f.deleted or 0) for f in files)
        if changed <= PATCH_LINE_BUDGET:
            self._attach_patches(files, self.git.run("diff", "-p", base, new).stdout)
        else:
            organism = next((f for f in files if f.path == ORGANISM_PATH), None)
            if organism and (organism.added or 0) + (organism.deleted or 0) <= PATCH_LINE_BUDGET:
                patch = self.git.run("diff", "-p", base, new, "--", ORGANISM_PATH).stdout
                self._attach_patches([organism], patch)
            for f in files:
                if f.patch is None and not f.binary:
                    f.omitted = f"{changed} lines changed in this comparison; patch not shown"
        return sorted(files, key=lambda f: f.path != ORGANISM_PATH)

    @staticmethod
    def _attach_patches(files: list[FileDiff], patch: bytes) -> None:
        """Split one patch into per-path sections, in the numstat's (git's) order.

        A type change (file to symlink) is two sections under one header, so sections
        are grouped by header line; paths are never parsed out of quoted headers.
        """
        groups: list[tuple[bytes, list[bytes]]] = []
        for section in patch.split(b"\ndiff --git "):
            section = section if section.startswith(b"diff --git ") else b"diff --git " + section
            header = section.split(b"\n", 1)[0]
            if groups and groups[-1][0] == header:
                groups[-1][1].append(section)
            else:
                groups.append((header, [section]))
        if not patch or len(groups) != len(files):
            return  # leave patches unset rather than risk showing one under another's name
        for f, (_, sections) in zip(files, groups, strict=True):
            f.patch = _text(b"\n".join(sections).rstrip(b"\n"))


def open_reader(settings: Settings) -> Reader:
    """The reader of the configured store and every home's shared repository (each of
    which must be local)."""
    for home, url in settings.lineage_homes.items():
        if not is_local(url):
            variable = (
                "OUROBOROS_LINEAGE_REPO" if home == DEFAULT_HOME else "OUROBOROS_LINEAGE_REPOS"
            )
            raise Refusal(
                f"browsing reads the shared repositories directly; {variable} names {url!r}"
                f" (home {home}), which is remote - run the browser on a host with local copies"
            )
    default = local_path(settings.lineage_repo_url)
    others = [
        local_path(url) for home, url in settings.lineage_homes.items() if home != DEFAULT_HOME
    ]
    return Reader(open_store(settings.observations_url, settings), default, others)


def _stored(store: ObservationStore, key: str, shape: type[_Record]) -> _Record | None:
    """The record at ``key``; None when there is none or it does not read as ``shape``."""
    raw = store.get(key)
    if raw is None:
        return None
    try:
        return shape.model_validate_json(raw)
    except ValidationError:
        return None


def parse_generation(text: str) -> int:
    """A generation number from a URL or argument: 1-999999999, digits only."""
    if not (text.isascii() and text.isdigit()) or len(text) > 9 or int(text) < 1:
        raise NotFound(f"no generation {text!r}")
    return int(text)


def _numbered(history: History, number: int) -> Commit:
    commit = history.by_generation.get(number)
    if commit is None:
        raise NotFound(f"lineage {history.name} has no generation {number}")
    return commit


def _figures(commit: Commit, index: IndexView | None) -> IndexEntry | None:
    if index is None or commit.generation is None:
        return None
    entry = index.entries.get(commit.generation)
    # Figures belong to the commit they were observed on, not merely to its number.
    return entry if entry is not None and entry.lineage_commit == commit.sha else None


def _cell(generation: int, row: GenerationRow) -> GridCell:
    return GridCell(
        generation=generation, outcome=row.outcome, model_unavailable=row.model_unavailable
    )


def _outcome(commit: Commit, index: IndexView | None) -> str:
    """What ``_row(commit, index).outcome`` says, without building the row."""
    figures = _figures(commit, index)
    return figures.outcome if figures else commit.kind


def _row(commit: Commit, index: IndexView | None) -> GenerationRow:
    return GenerationRow(commit=commit.view(), figures=_figures(commit, index))


def _outcome_class(outcome: str) -> str:
    return "died" if is_death(outcome) else outcome


def _progress(run: RunRecord, history: History, index: IndexView | None) -> Progress:
    return run_progress(run, history.numbered, index.entries.values() if index else ())


def _spent(index: IndexView | None, after: int = 0) -> list[tuple[int, float]]:
    """The lineage's cumulative spend at each observed generation (counted from ``after``)."""
    entries = sorted(index.entries.items()) if index else []
    return cumulative((n, float(entry.spent_usd)) for n, entry in entries if n > after)


def _series(entries: list[IndexEntry]) -> list[Series]:
    """Figures across generations from the index, bucketed to CHART_POINTS."""
    spent = cumulative((entry.generation, float(entry.spent_usd)) for entry in entries)
    charts: list[tuple[str, str, str, Callable[[IndexEntry], float | None]]] = [
        ("files", "Files published", "files", lambda e: e.published_files),
        ("duration", "Duration", "s", lambda e: e.duration_seconds),
        (
            "memory",
            "Peak memory",
            "MiB",
            lambda e: e.memory_peak_bytes / 2**20 if e.memory_peak_bytes is not None else None,
        ),
        ("cost", "Cost", "USD", lambda e: float(e.spent_usd)),
        ("calls", "Model calls", "calls", lambda e: e.model_calls),
        ("tokens", "Tokens (input and output)", "tokens", lambda e: e.tokens),
    ]
    series = [
        bucketed(key, title, unit, [(e.generation, value(e)) for e in entries])
        for key, title, unit, value in charts
    ]
    return [bucketed("spent", "Cumulative spend", "USD", spent), *series]


def _metadata(raw: bytes | None) -> LineageMetadata | None:
    if raw is None:
        return None
    try:
        return LineageMetadata.model_validate_json(raw)
    except ValidationError:
        return None


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")
