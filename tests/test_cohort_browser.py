"""A real browser walks a cohort of four replicates: the overview filtered to the cohort,
its outcome grid, and a death's square to that generation's page (screenshots kept in
the test's directory)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.browse import Served, settings_of
from support.browser import Watched, watched_page
from support.cohort import write_cohort
from support.fleet import Fleet

pytestmark = pytest.mark.browser

PLANS = {
    "rep-1": ["changed", "changed", "no-change", "changed"],
    "rep-2": ["changed", "process_exit", "changed"],
    "rep-3": ["no-change", "cgroup_oom"],
    "rep-4": ["changed", "changed", "wall_timeout", "changed", "changed"],
}


@pytest.fixture
def cohort_page(tmp_path: Path) -> Iterator[Watched]:
    fleet = Fleet(tmp_path)
    write_cohort(settings_of(fleet), "rep", PLANS)
    fleet.ok("init", "stray")
    served = Served(fleet, tmp_path / "serve.log")
    try:
        with watched_page(served.url, tmp_path) as watched:
            yield watched
    finally:
        served.stop()


def test_a_cohort_s_grid_leads_from_a_death_to_its_generation(cohort_page: Watched) -> None:
    watched, page = cohort_page, cohort_page.page
    page.goto(watched.base + "/")
    rows = page.locator("#lineages tbody tr")
    assert rows.count() == 5
    assert page.locator("#lineages a[href='/cohorts/rep']").count() == 4
    page.select_option("#cohort-filter select", "rep")
    page.click("#cohort-filter button")
    page.wait_for_url("**/?cohort=rep")
    assert rows.count() == 4 and "stray" not in page.locator("#lineages").inner_text()
    watched.shot("overview-filtered")

    page.click("#cohort-filter a[href='/cohorts/rep']")
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

    # The lineage page charts the organism's size, files and cumulative spend, deaths marked.
    page.goto(watched.base + "/lineages/rep-4")
    captions = page.locator(".charts figcaption").all_inner_texts()
    for title in ("Organism size (bytes)", "Files published (files)", "Cumulative spend (USD)"):
        assert any(c.startswith(title) and c.endswith("red: 1 death") for c in captions), captions
    organism = page.locator(".charts figure").filter(has_text="Organism size")
    # Generations 1, 2, 4 and 5 grew the body by a line each; 3 died and kept it.
    titles = organism.locator("circle title").all_text_contents()
    assert [t.split(": ")[0] for t in titles] == [f"gen {n}" for n in range(1, 6)]
    sizes = [float(t.split(": ")[1].split()[0]) for t in titles]
    assert sizes[0] < sizes[1] == sizes[2] < sizes[3] < sizes[4]
    watched.shot("lineage-charts")
    organism.locator("a.death-mark").click()
    page.wait_for_url("**/lineages/rep-4/generations/3")
    assert "wall_timeout" in page.locator("main").inner_text()
    assert not watched.errors and not watched.dialogs and not watched.foreign
