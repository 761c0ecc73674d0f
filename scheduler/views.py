"""What browsing shows: the view models shared by the JSON API, the web pages and the CLI.

Owns the shape of every answer the reader gives (and so the OpenAPI schema of the
JSON API). Figures come from the worker's own records (``IndexEntry``,
``Observation``, ``RunRecord``, ``LineageMetadata``), reused as they are; what is
added here is what only the shared repository knows (commits, numbering, journal,
diffs) and what is derived for display (progress, counts, chart series); a live
worker is liveness's own answer (``LiveWorker``).

Trusts: nothing beyond its types; every string in these models that came from a
lineage is organism-made and must be escaped wherever it is rendered.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Literal

from pydantic import BaseModel, computed_field

from scheduler.genealogy import Genealogy
from scheduler.history import CommitKind, JournalEntry
from scheduler.liveness import LiveWorker
from worker.fleet.runs import Progress
from worker.instrument.lineage import LineageMetadata, Parentage
from worker.instrument.records import DEATHS, IndexEntry, Observation, ReplayReport

LineageKind = Literal["fleet", "imported"]


def is_death(outcome: str) -> bool:
    """An observed death (``cgroup_oom``, ...) or a death only the subject tells of."""
    return outcome in DEATHS or outcome == "died"


class CommitView(BaseModel):
    """One commit of a lineage branch and what its subject says."""

    sha: str
    parents: list[str]
    committed_at: datetime
    subject: str
    kind: CommitKind
    generation: int | None
    exit_status: int | None
    summary: str | None
    # The subject's "model unavailable" mark (never set in lineages older than it).
    model_unavailable: bool = False


class GenerationRow(BaseModel):
    """A commit with the figures of its observation, when one is indexed."""

    commit: CommitView
    figures: IndexEntry | None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def outcome(self) -> str:
        """The observed outcome (e.g. ``cgroup_oom``), else what the subject says."""
        return self.figures.outcome if self.figures else self.commit.kind

    @computed_field  # type: ignore[prop-decorator]
    @property
    def model_unavailable(self) -> bool:
        """Whether no model call of the generation was answered (the record, else the
        subject): a mark beside its outcome, shown wherever the outcome is."""
        return self.figures.model_unavailable if self.figures else self.commit.model_unavailable


class LineageSummary(BaseModel):
    """One lineage as the overview and the family view list it."""

    name: str
    kind: LineageKind
    status: str
    head: str
    seed_sha256: str | None
    instrument_fingerprint: str | None
    generations: int
    outcomes: dict[str, int]
    # Generations marked "model unavailable", whatever their outcome.
    model_unavailable: int = 0
    out_of_loop: int
    last_generation_at: datetime | None
    spent_usd: Decimal | None
    observed: int
    backlog: int | None
    run: Progress | None
    # What blocks or pauses it and when it is tried again (from the broker; None when
    # nothing does, or the broker was not asked).
    blocked: str | None = None
    # The lineage it was forked from (None: a root) and the lineages forked from it.
    parent: Parentage | None = None
    children: list[str] = []
    # The cohort in its root metadata (None: in none, or imported).
    cohort: str | None = None
    # Its deaths by kind (``outcomes`` counts them together as "died").
    deaths: dict[str, int] = {}
    # The outcome of its latest generation (None before its first).
    last_outcome: str | None = None


class PageInfo(BaseModel):
    number: int
    per_page: int
    rows: int
    pages: int


class SeriesPoint(BaseModel):
    generation: int
    value: float


class DeathMark(BaseModel):
    """A generation that died, marked on every chart of its lineage."""

    generation: int
    outcome: str


class Series(BaseModel):
    """One chart's data: at most a few hundred points, each the maximum of a bucket."""

    key: str
    title: str
    unit: str
    bucket: int
    points: list[SeriesPoint]
    # The lineage's deaths, each a marker linking to its generation's page.
    deaths: list[DeathMark] = []


class GridCell(BaseModel):
    """One generation of one lineage in a cohort's outcome grid."""

    generation: int
    outcome: str
    model_unavailable: bool = False


class Curve(BaseModel):
    """One line of an overlay. A lineage's point at ``generation`` x is its generation
    x + ``offset`` (a parent drawn from a fork point), whose page it links; a line that is
    no lineage's (a share of the cohort) has ``lineage`` None and links nowhere."""

    label: str
    lineage: str | None
    offset: int = 0
    points: list[SeriesPoint] = []


class Overlay(BaseModel):
    """Several lineages' curves of one figure on shared axes, with their median."""

    key: str
    title: str
    unit: str
    # What the x axis counts: "generation", or "generations since the fork".
    axis: str = "generation"
    # Generations per point: each point is the maximum of a bucket of this many.
    bucket: int = 1
    curves: list[Curve]
    # At each generation, the median of the curves that reach it (None: not drawn).
    median: list[SeriesPoint] | None = None


class LineageView(BaseModel):
    summary: LineageSummary
    metadata: LineageMetadata | None
    genealogy: Genealogy
    # The generation page of the exact parent generation, when it has one here.
    parent_url: str | None
    page: PageInfo
    rows: list[GenerationRow]
    series: list[Series]
    # A fork's size and spend beside its parent's, from the fork point on (none: a root).
    fork: list[Overlay] = []
    # Every generation's outcome, oldest first (a square may stand for several).
    strip: list[GridCell] = []


class FileDiff(BaseModel):
    """One path's change between two commits; the patch is omitted when too large."""

    path: str
    added: int | None
    deleted: int | None
    binary: bool
    patch: str | None
    omitted: str | None = None


class GenerationView(BaseModel):
    lineage: str
    row: GenerationRow
    parent: str | None
    previous: int | None
    next: int | None
    journal: JournalEntry | None
    diff: list[FileDiff]
    observation: Observation | None
    lethal_body: str | None
    # A death's first error as Emacs printed it, found in the full stderr (None: none found).
    first_error: str | None = None
    # The latest replay of the generation (``schedule-lineage replay``), if any.
    replay: ReplayReport | None = None


class CompareView(BaseModel):
    lineage: str
    a: GenerationRow
    b: GenerationRow
    diff: list[FileDiff]


class FamilyView(BaseModel):
    """Lineages seeded from one organism, and every lineage forked from one of them."""

    seed_sha256: str
    lineages: list[LineageSummary]


class JournalRow(BaseModel):
    """A commit with its journal entry (the CLI journal view)."""

    commit: CommitView
    entry: JournalEntry | None


class QueueWait(BaseModel):
    """An instrument queue that running lineages need and no live worker serves."""

    queue: str
    lineages: list[str]
    # Live workers that serve other instruments' queues instead.
    elsewhere: list[LiveWorker]
    # What would serve it: the command that starts a worker, or where to run one.
    advice: str


class CohortRow(BaseModel):
    summary: LineageSummary
    # Generation N is cells[N - 1]; None where the lineage has no generation N yet.
    cells: list[GridCell | None]


class CohortView(BaseModel):
    """A cohort's (or a chosen set's) lineages: their outcome grid (lineage x generation),
    the share of them that lived and that changed at each generation, and their size and
    cumulative spend overlaid with the median."""

    # The cohort's label; None for a set of lineages chosen by name.
    label: str | None
    generations: int
    rows: list[CohortRow]
    shares: Overlay | None = None
    overlays: list[Overlay] = []


class Overview(BaseModel):
    lineages: list[LineageSummary]
    broker: Literal["no broker", "inspected", "unreachable"]
    workers: list[LiveWorker]
    waiting: list[QueueWait] = []
