"""The arithmetic and geometry behind the lineage, fork and cohort charts, the first
Emacs error of a death, and the overview's filters, sort and pages: pure functions,
tested in this process (fast tier)."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from urllib.parse import parse_qs, urlsplit

import pytest
from pydantic import ValidationError

from scheduler.curves import (
    CHART_POINTS,
    STRIP_CELLS,
    cumulative,
    median,
    overlay,
    shares,
    since,
    strip,
    thinned,
)
from scheduler.emacs_errors import MAX_CHARS, first_error
from scheduler.views import Curve, GridCell, LineageSummary
from scheduler.web.listing import ListingQuery, listing
from scheduler.web.overlays import plot


def test_the_median_is_taken_among_the_lineages_that_reach_each_generation() -> None:
    curves = [[(1, 1.0), (2, 5.0), (3, 9.0)], [(1, 3.0), (2, 7.0)], [(1, 2.0), (2, 100.0)]]
    assert median(curves) == [(1, 2.0), (2, 7.0), (3, 9.0)]
    # An even count: the mean of the middle two.
    assert median([[(1, 1.0)], [(1, 4.0)]]) == [(1, 2.5)]
    assert median([]) == []


def test_shares_count_every_kind_of_death_among_the_lineages_reaching_a_generation() -> None:
    lineages = [
        {1: "changed", 2: "process_exit", 3: "changed"},
        {1: "no-change", 2: "cgroup_oom"},
        {1: "changed", 2: "changed"},
        {1: "died", 2: "changed", 3: "wall_timeout", 4: "changed"},
    ]
    lived, changed = shares(lineages)
    assert lived == [(1, 75.0), (2, 50.0), (3, 50.0), (4, 100.0)]
    assert changed == [(1, 50.0), (2, 50.0), (3, 50.0), (4, 100.0)]


def test_running_totals_and_a_parent_renumbered_from_the_fork_point() -> None:
    assert cumulative([(1, 0.5), (3, 0.25), (4, 0.0)]) == [(1, 0.5), (3, 0.75), (4, 0.75)]
    assert since([(1, 10.0), (2, 20.0), (3, 30.0), (5, 50.0)], 2) == [(1, 30.0), (3, 50.0)]


def test_thinning_keeps_each_bucket_s_maximum_at_its_first_generation() -> None:
    values = [(1, 1.0), (2, None), (3, 7.0), (4, 2.0), (5, None), (6, None)]
    points = thinned(values, 2)
    assert [(p.generation, p.value) for p in points] == [(1, 1.0), (3, 7.0)]


def test_an_overlay_thins_every_curve_and_the_median_alike() -> None:
    long = [(n, float(n)) for n in range(1, 3 * CHART_POINTS + 1)]
    short = [(n, 2.0 * n) for n in range(1, CHART_POINTS + 1)]
    made = overlay(
        "organism",
        "Organism size",
        "bytes",
        [(Curve(label="a", lineage="a"), long), (Curve(label="b", lineage="b"), short)],
        with_median=True,
    )
    assert made.bucket == 3
    at = {c.label: [p.generation for p in c.points] for c in made.curves}
    assert len(at["a"]) == CHART_POINTS and set(at["b"]) <= set(at["a"])
    assert made.median is not None
    assert [p.generation for p in made.median] == at["a"]
    # Where both reach, the median is their mean; past b's end, a's own value.
    # Generations 1-3: medians 1.5, 3 and 4.5, the bucket's maximum shown.
    assert made.median[0].value == 4.5
    assert made.median[-1].value == float(3 * CHART_POINTS)
    assert overlay("x", "x", "bytes", [], with_median=False).median is None


def test_the_strip_shows_every_generation_or_the_worst_of_a_bucket() -> None:
    few = [GridCell(generation=n, outcome="changed") for n in range(1, 11)]
    assert strip(few) == few
    many = [GridCell(generation=n, outcome="no-change") for n in range(1, 4 * STRIP_CELLS + 1)]
    many[6] = GridCell(generation=7, outcome="cgroup_oom")
    many[5] = GridCell(generation=6, outcome="changed")
    shown = strip(many)
    assert len(shown) == STRIP_CELLS
    assert shown[1].outcome == "cgroup_oom" and shown[1].generation == 7
    assert shown[0].outcome == "no-change" and shown[2].generation == 9


def test_an_overlay_is_drawn_with_the_median_apart_and_every_point_linking_its_generation() -> None:
    made = overlay(
        "fork-organism",
        "Organism size beside the parent",
        "bytes",
        [
            (Curve(label="kid", lineage="kid"), [(1, 10.0), (2, 20.0)]),
            (Curve(label="rep (parent)", lineage="rep", offset=4), [(1, 5.0), (2, 40.0)]),
        ],
        with_median=True,
    )
    drawn = plot(made)
    assert drawn is not None and drawn.median is not None
    kid, parent = drawn.lines
    assert [d.href for d in kid.dots] == [
        "/lineages/kid/generations/1",
        "/lineages/kid/generations/2",
    ]
    # The parent's point 1 is its generation 5: one after the fork point, 4.
    assert [d.href for d in parent.dots] == [
        "/lineages/rep/generations/5",
        "/lineages/rep/generations/6",
    ]
    assert parent.dots[1].title == "rep (parent) gen 6: 40 bytes"
    assert kid.tone != parent.tone
    assert all(d.href is None for d in drawn.median.dots)
    assert [d.title for d in drawn.median.dots] == [
        "median gen 1: 7.5 bytes",
        "median gen 2: 30 bytes",
    ]
    # The highest value touches the top of the plot, zero its baseline.
    assert parent.dots[1].y == drawn.top and min(d.y for d in kid.dots) > drawn.top
    empty = overlay("x", "x", "bytes", [(Curve(label="a", lineage="a"), [])], with_median=True)
    assert plot(empty) is None


@pytest.mark.parametrize(
    ("stderr", "expected"),
    [
        (
            "Loading organism\nDebugger entered--Lisp error: (void-function gen-2)\n  gen-2()\n",
            "Debugger entered--Lisp error: (void-function gen-2)",
        ),
        (
            "x\nSymbol\u2019s value as variable is void: foo\n",
            "Symbol\u2019s value as variable is void: foo",
        ),
        (
            "Symbol's function definition is void: bar\r\n",
            "Symbol's function definition is void: bar",
        ),
        ("Wrong type argument: listp, 1\n", "Wrong type argument: listp, 1"),
        ("starting\nerror: boom\n", "error: boom"),
        # The backtrace's head wins over a plain-looking line printed before it.
        (
            'Wrong type argument: a decoy\nDebugger entered--Lisp error: (error "real")\n',
            'Debugger entered--Lisp error: (error "real")',
        ),
        ("all fine\nno error here\n", None),
        ("", None),
    ],
)
def test_the_first_error_emacs_printed_is_found_in_stderr(
    stderr: str, expected: str | None
) -> None:
    assert first_error(stderr) == expected


def test_a_first_error_line_is_cut_to_a_readable_length_and_kept_as_text() -> None:
    line = 'Debugger entered--Lisp error: (error "<script>alert(1)</script>' + "x" * 5000
    found = first_error(line + "\n")
    assert found is not None and len(found) == MAX_CHARS and found.endswith("…")
    assert "<script>" in found  # escaping is the page's (autoescape), the text stays as it is


def summary(name: str, **fields: object) -> LineageSummary:
    values: dict[str, object] = {
        "name": name,
        "kind": "fleet",
        "status": "idle",
        "head": "a" * 40,
        "seed_sha256": None,
        "instrument_fingerprint": "e" * 64,
        "generations": 0,
        "outcomes": {},
        "out_of_loop": 1,
        "last_generation_at": None,
        "spent_usd": None,
        "observed": 0,
        "backlog": 0,
        "run": None,
        **fields,
    }
    return LineageSummary.model_validate(values)


FLEET = [
    summary(
        "a-1",
        generations=5,
        spent_usd=Decimal("0.5"),
        cohort="a",
        last_outcome="changed",
        deaths={"cgroup_oom": 2},
        last_generation_at=datetime(2026, 1, 3, tzinfo=UTC),
    ),
    summary(
        "a-2",
        generations=9,
        spent_usd=Decimal("0.1"),
        cohort="a",
        last_outcome="process_exit",
        deaths={"process_exit": 1},
        status="running",
        last_generation_at=datetime(2026, 1, 5, tzinfo=UTC),
    ),
    summary("b", generations=1, spent_usd=Decimal("2"), last_outcome="no-change"),
    summary("imported", kind="imported", status="imported", instrument_fingerprint=None),
]


def names(query: ListingQuery) -> list[str]:
    return [s.name for s in listing(FLEET, query).lineages]


def test_the_overview_sorts_by_each_key_either_way() -> None:
    assert names(ListingQuery()) == ["a-1", "a-2", "b", "imported"]
    assert names(ListingQuery(sort="generation", order="desc")) == ["a-2", "a-1", "b", "imported"]
    assert names(ListingQuery(sort="spend", order="desc")) == ["b", "a-1", "a-2", "imported"]
    assert names(ListingQuery(sort="updated", order="desc"))[:2] == ["a-2", "a-1"]
    assert names(ListingQuery(sort="outcome")) == ["imported", "a-1", "b", "a-2"]


def test_the_overview_filters_by_state_outcome_death_cohort_and_instrument() -> None:
    assert names(ListingQuery(state="running")) == ["a-2"]
    assert names(ListingQuery(outcome="no-change")) == ["b"]
    assert names(ListingQuery(death="cgroup_oom")) == ["a-1"]
    assert names(ListingQuery(cohort="a", sort="spend")) == ["a-2", "a-1"]
    assert names(ListingQuery(instrument="eeeeeeeeeeee")) == ["a-1", "a-2", "b"]
    assert names(ListingQuery(cohort="absent")) == []
    choices = listing(FLEET, ListingQuery()).choices
    assert choices["death"] == ["cgroup_oom", "process_exit"]
    assert choices["state"] == ["idle", "imported", "running"]
    assert choices["cohort"] == ["a"] and choices["instrument"] == ["eeeeeeeeeeee"]


def test_the_overview_pages_and_its_links_keep_every_other_parameter() -> None:
    shown = listing(FLEET, ListingQuery(per_page=3, page=2, sort="spend", order="desc"))
    assert [s.name for s in shown.lineages] == ["imported"]
    assert (shown.matched, shown.total, shown.pages) == (4, 4, 2)
    # A page past the last shows the last.
    assert listing(FLEET, ListingQuery(per_page=3, page=9)).query.page == 2
    query = ListingQuery(cohort="a", sort="spend", order="desc", per_page=3, page=2)
    following = parse_qs(urlsplit(query.href(page=3)).query)
    assert following == {
        "sort": ["spend"],
        "order": ["desc"],
        "cohort": ["a"],
        "page": ["3"],
        "per_page": ["3"],
    }
    # A new filter or sort starts again at page 1; defaults stay out of the URL.
    assert query.href(state="idle") == "/?sort=spend&order=desc&state=idle&cohort=a&per_page=3"
    assert query.sorted_by("spend") == "/?sort=spend&cohort=a&per_page=3"
    assert query.sorted_by("name") == "/?cohort=a&per_page=3"
    assert ListingQuery().href() == "/"


def test_the_overview_refuses_an_unknown_sort_and_a_page_out_of_range() -> None:
    for bad in ({"sort": "size"}, {"order": "up"}, {"page": 0}, {"per_page": 501}):
        with pytest.raises(ValidationError):
            ListingQuery.model_validate(bad)
