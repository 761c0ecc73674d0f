"""A real browser walks a cohort of four replicates and a fork: the overview sorted,
filtered and choosing lineages, the cohort's outcome grid, the share that lived and
changed and the overlaid curves with their median, a death's marker to its generation's
page led by the first error Emacs printed, and a fork's curves beside its parent's.

Screenshots are kept in the test's directory (``shot``); the ``readme-*`` ones are of
single elements, the README's pictures (``scripts/readme-screenshots.sh`` copies them
to docs/img/).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.browse import Served, settings_of
from support.browser import Watched, watched_page
from support.cohort import write_cohort, write_lives
from support.fleet import Fleet

pytestmark = pytest.mark.browser

PLANS = {
    "rep-1": ["changed", "changed", "no-change", "changed"],
    "rep-2": ["changed", "process_exit", "changed"],
    "rep-3": ["no-change", "cgroup_oom"],
    "rep-4": ["changed", "changed", "wall_timeout", "changed", "changed"],
}
# Forked from rep-4 at generation 2; it grows three lines a change, its parent one.
KID = ["changed", "process_exit", "changed", "changed", "no-change", "changed"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The module's one fleet, served: every test here only reads it."""
    home = tmp_path_factory.mktemp("cohort-browser")
    fleet = Fleet(home)
    write_cohort(settings_of(fleet), "rep", PLANS)
    fleet.ok("init", "stray")
    fleet.ok("fork", "kid", "--from", "rep-4@2")
    write_lives(settings_of(fleet), "kid", KID, grow=3)
    server = Served(fleet, home / "serve.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def cohort_page(served: Served, tmp_path: Path) -> Iterator[Watched]:
    with watched_page(served.url, tmp_path) as watched:
        yield watched


def names(page: Watched) -> list[str]:
    return page.page.locator("#lineages tbody tr td:nth-child(2) > a").all_inner_texts()


def test_a_cohort_s_grid_leads_from_a_death_to_its_generation(cohort_page: Watched) -> None:
    watched, page = cohort_page, cohort_page.page
    page.goto(watched.base + "/")
    rows = page.locator("#lineages tbody tr")
    assert rows.count() == 6
    assert page.locator("#lineages a[href='/cohorts/rep']").count() == 4
    page.select_option("#filters select[name=cohort]", "rep")
    page.click("#filters button")
    # The form sends every field; the page answers at the query's shortest spelling.
    page.wait_for_url("**/?cohort=rep")
    assert rows.count() == 4 and "stray" not in page.locator("#lineages").inner_text()
    watched.shot("overview-filtered")

    page.click("#filters a[href='/cohorts/rep']")
    page.wait_for_url("**/cohorts/rep")
    grid = page.locator("#grid")
    assert grid.locator("tbody tr").count() == 4
    # One square per generation lived, in its lineage's row; a death is a death square.
    for name, outcomes in PLANS.items():
        squares = grid.locator(f"a[id^='cell-{name}-']")
        assert squares.count() == len(outcomes), name
        for number, outcome in enumerate(outcomes, start=1):
            square = page.locator(f"#cell-{name}-{number}")
            assert square.get_attribute("title") == f"{name} gen {number}: {outcome}"
    assert grid.locator("a.death").count() == 3
    # Generation 5 exists only in rep-4: the other rows hold empty cells there.
    assert grid.locator("td.none").count() == 4 * 5 - sum(map(len, PLANS.values()))
    watched.shot("cohort-grid")

    page.click("#cell-rep-2-2")
    page.wait_for_url("**/lineages/rep-2/generations/2")
    assert "process_exit" in page.locator("main").inner_text()
    assert "void-function gen-2" in page.content()
    watched.shot("death-generation")

    # The lineage page charts size in bytes and lines, files, spend, tokens..., deaths marked.
    page.goto(watched.base + "/lineages/rep-4")
    captions = page.locator(".charts figcaption").all_inner_texts()
    for title in (
        "Organism size (bytes)",
        "Organism lines (lines)",
        "Files published (files)",
        "Cumulative spend (USD)",
        "Tokens (input and output) (tokens)",
        "Duration (s)",
        "Peak memory (MiB)",
    ):
        assert any(c.startswith(title) and "red: 1 death" in c for c in captions), title
    organism = page.locator(".charts figure").filter(has_text="Organism size")
    # Generations 1, 2, 4 and 5 grew the body by a line each; 3 died and kept it.
    titles = organism.locator("circle title").all_text_contents()
    assert [t.split(": ")[0] for t in titles] == [f"gen {n}" for n in range(1, 6)]
    sizes = [float(t.split(": ")[1].split()[0]) for t in titles]
    assert sizes[0] < sizes[1] == sizes[2] < sizes[3] < sizes[4]
    assert organism.locator("a.point").evaluate_all(
        "as => as.map(a => a.getAttribute('href'))"
    ) == [f"/lineages/rep-4/generations/{n}" for n in range(1, 6)]
    lines = page.locator(".charts figure").filter(has_text="Organism lines")
    counted = [t.split(": ")[1] for t in lines.locator("circle title").all_text_contents()]
    assert counted == ["2 lines", "3 lines", "3 lines", "4 lines", "5 lines"]
    # The death is lettered by its kind (t: wall_timeout) and titled with it.
    assert organism.locator(".death-mark text").text_content() == "t"
    assert organism.locator(".death-mark title").text_content() == "gen 3: wall_timeout"
    # The strip: one square per generation, each titled with its outcome.
    strip = page.locator("#strip rect title").all_text_contents()
    assert strip == [f"gen {n}: {o}" for n, o in enumerate(PLANS["rep-4"], start=1)]
    watched.shot("lineage-charts")
    organism.locator("a.death-mark").click()
    page.wait_for_url("**/lineages/rep-4/generations/3")
    # The first error Emacs printed leads the page: under its title, above everything else.
    first = page.locator("main > h1 + section#first-error pre")
    assert first.inner_text() == "Debugger entered--Lisp error: (void-function gen-3)"
    assert first.bounding_box()["y"] < page.locator("#death").bounding_box()["y"]  # type: ignore[index]
    # The journal's own lines stay as they were.
    assert "Loading organism" in page.locator("#backtrace").inner_text()
    assert "wall_timeout" in page.locator("main").inner_text()
    watched.shot("readme-first-error", "main > h1 + section#first-error", top=True)
    assert not watched.errors and not watched.dialogs and not watched.foreign


def test_a_cohort_s_curves_overlay_its_lineages_with_the_median(cohort_page: Watched) -> None:
    watched, page = cohort_page, cohort_page.page
    page.goto(watched.base + "/cohorts/rep")
    shares = page.locator("#overlay-shares")
    lived = shares.locator("g.curve[data-label='lived (did not die)'] circle title")
    # Generation 2: rep-2 and rep-3 died, rep-1 and rep-4 lived.
    assert lived.all_text_contents()[:3] == [
        "lived (did not die) gen 1: 100%",
        "lived (did not die) gen 2: 50%",
        "lived (did not die) gen 3: 67%",
    ]
    changed = shares.locator("g.curve[data-label='changed the organism'] circle title")
    assert changed.first.text_content() == "changed the organism gen 1: 75%"
    for key in ("organism", "spent"):
        figure = page.locator(f"#overlay-{key}")
        curves = figure.locator("g.curve:not(.median)")
        assert sorted(curves.evaluate_all("gs => gs.map(g => g.dataset.label)")) == list(PLANS)
        assert figure.locator("g.curve.median").count() == 1
        assert "median" in figure.locator("figcaption").inner_text()
    # Sizes at generation 1: 19 bytes (a line grown), 19, 8 (no change) and 19: median 19;
    # at generation 2: 30, 19 (died), 8 (died) and 30: median 24.5.
    median = page.locator("#overlay-organism g.median circle title").all_text_contents()
    assert median[:2] == ["median gen 1: 19 bytes", "median gen 2: 24.5 bytes"]
    watched.shot("cohort-curves")
    watched.shot("readme-cohort", "main")
    # A point of a lineage's curve leads to that generation's page.
    point = page.locator("#overlay-organism g.curve[data-label='rep-2'] a").nth(1)
    assert point.get_attribute("href") == "/lineages/rep-2/generations/2"
    point.click()
    page.wait_for_url("**/lineages/rep-2/generations/2")
    assert page.locator("#first-error pre").inner_text().endswith("(void-function gen-2)")

    assert not watched.errors and not watched.dialogs and not watched.foreign
    response = page.goto(watched.base + "/cohorts/absent")
    assert response is not None and response.status == 404


def test_the_overview_sorts_filters_and_compares_chosen_lineages(cohort_page: Watched) -> None:
    watched, page = cohort_page, cohort_page.page
    page.goto(watched.base + "/")
    assert names(watched) == ["kid", "rep-1", "rep-2", "rep-3", "rep-4", "stray"]
    page.click("#sort-generation")
    page.wait_for_url("**/?sort=generation")
    assert names(watched)[:2] == ["stray", "rep-3"]
    page.click("#sort-generation")
    page.wait_for_url("**/?sort=generation&order=desc")
    assert names(watched)[:2] == ["kid", "rep-4"]
    assert page.locator("th[aria-sort='descending']").inner_text().startswith("GENS")
    # Deaths by kind: one badge per kind, none reading "died".
    kid = page.locator("#lineages tbody tr").first
    assert "process_exit" in kid.inner_text() and "died" not in kid.inner_text()
    # A filter keeps the sort; the death-kind menu offers each kind the fleet has suffered.
    assert page.locator("#filters select[name=death] option").all_inner_texts() == [
        "any",
        "cgroup_oom",
        "process_exit",
        "wall_timeout",
    ]
    page.select_option("#filters select[name=death]", "process_exit")
    page.click("#filters button")
    page.wait_for_url("**/?sort=generation&order=desc&death=process_exit")
    assert names(watched) == ["kid", "rep-2"]
    page.select_option("#filters select[name=outcome]", "changed")
    page.click("#filters button")
    page.wait_for_url("**/?sort=generation&order=desc&outcome=changed&death=process_exit")
    assert names(watched) == ["kid", "rep-2"]
    assert page.locator(".last-outcome").all_inner_texts() == ["changed", "changed"]
    watched.shot("overview-sorted-filtered")
    watched.shot("readme-overview", "main")
    # Pages of two, the links keeping the sort and the filters.
    page.goto(watched.base + "/?sort=spend&order=desc&per_page=2")
    assert names(watched) == ["kid", "rep-4"]
    page.click("a[rel=next]")
    page.wait_for_url("**/?sort=spend&order=desc&page=2&per_page=2")
    assert names(watched) == ["rep-1", "rep-2"]
    assert "6 of 6 lineages, page 2 of 3" in page.locator("nav.pager").first.inner_text()
    # Ticked lineages open side by side, as a cohort's page.
    page.goto(watched.base + "/")
    page.check("input[name=lineages][value=rep-1]")
    page.check("input[name=lineages][value=kid]")
    page.click("#choose button")
    page.wait_for_url("**/cohorts?lineages=kid&lineages=rep-1")
    assert page.locator("h1").inner_text() == "Chosen lineages"
    assert page.locator("#grid tbody th").all_inner_texts() == ["kid", "rep-1"]
    assert page.locator("#overlay-organism g.curve:not(.median)").count() == 2
    page.goto(watched.base + "/cohorts?lineages=rep-1,rep-3")
    assert page.locator("#grid tbody th").all_inner_texts() == ["rep-1", "rep-3"]
    assert not watched.errors and not watched.dialogs and not watched.foreign


def test_a_fork_s_curves_run_beside_its_parent_s_from_the_fork(cohort_page: Watched) -> None:
    watched, page = cohort_page, cohort_page.page
    page.goto(watched.base + "/lineages/kid")
    beside = page.locator("#overlay-fork-organism")
    assert "generations since the fork (rep-4 generation 2)" in beside.inner_text()
    kid = beside.locator("g.curve[data-label='kid'] a")
    parent = beside.locator("g.curve[data-label='rep-4 (parent)'] a")
    assert kid.count() == len(KID)
    # The parent after its generation 2: generations 3, 4 and 5, drawn at 1, 2 and 3.
    assert [parent.nth(i).get_attribute("href") for i in range(parent.count())] == [
        f"/lineages/rep-4/generations/{n}" for n in (3, 4, 5)
    ]
    titles = beside.locator("g.curve[data-label='kid'] title").all_text_contents()
    assert titles[0].startswith("kid gen 1: ")
    spent = page.locator("#overlay-fork-spent g.curve")
    assert spent.count() == 2 and page.locator("#overlay-fork-spent g.median").count() == 0
    watched.shot("fork-beside-parent")
    watched.shot("readme-fork", "#overlay-fork-organism")
    parent.first.click()
    page.wait_for_url("**/lineages/rep-4/generations/3")
    assert page.locator("#first-error").count() == 1
    # A root lineage has no such section.
    page.goto(watched.base + "/lineages/rep-4")
    assert page.locator("#beside-parent").count() == 0
    assert not watched.errors and not watched.dialogs and not watched.foreign
