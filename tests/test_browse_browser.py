"""A real browser (Debian's chromium, headless, driven by Playwright) walks the web UI."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.browse import PAYLOAD, Served, serve_sample_and_hostile
from support.browser import Watched, watched_page
from support.fleet import Fleet, wait_for
from support.legacy_lineage import FIXTURE_BACKTRACE

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    server = serve_sample_and_hostile(
        tmp_path_factory.mktemp("browse-browser"), ("offshoot", "sample@2")
    )
    server.wait_for_workers()
    yield server
    server.stop()


@pytest.fixture
def browser_page(served: Served, tmp_path: Path) -> Iterator[Watched]:
    with watched_page(served.url, tmp_path) as watched:
        yield watched


def test_walk_overview_lineage_generation_death_and_compare(
    served: Served, browser_page: Watched
) -> None:
    watched, page = browser_page, browser_page.page
    page.goto(served.url + "/")
    assert page.locator("h1").inner_text() == "Fleet overview"

    def inspected() -> bool:
        # The page shows the web process's latest probe of the broker; on a loaded
        # machine one probe may miss its 1 s (seen once beside another test process).
        if "no live workers answered" in page.locator("#workers").inner_text():
            return True
        page.reload()
        return False

    wait_for(inspected, 30, "the overview to show the broker's answer: no live workers")
    watched.shot("1-overview")

    page.locator("#lineages").get_by_role("link", name="sample", exact=True).click()
    page.wait_for_url("**/lineages/sample")
    rows = page.locator("#generations tbody tr")
    assert rows.count() == 10
    numbers = [n.inner_text() for n in page.locator("#generations tbody td.num a").all()]
    assert numbers == ["5", "4", "3", "2", "1"]
    assert "external edit: silence probe" in page.locator("#generations").inner_text()
    watched.shot("2-lineage")

    page.locator("#generations").get_by_role("link", name="2", exact=True).click()
    page.wait_for_url("**/lineages/sample/generations/2")
    assert "sample generation 2" in page.locator("h1").inner_text()
    assert "organism.el" in page.locator("details.diff summary").first.inner_text()
    watched.shot("3-generation")

    page.locator('nav.pager a[href="/lineages/sample/generations/1"]').click()
    page.wait_for_url("**/lineages/sample/generations/1")
    assert "died" in page.locator("h1").inner_text()
    assert page.locator("#lethal-body").inner_text().rstrip().endswith('(error "boom")')
    backtrace = page.locator("#backtrace").inner_text()
    assert [line.strip() for line in backtrace.strip().splitlines()] == [
        line.strip() for line in FIXTURE_BACKTRACE
    ]
    watched.shot("4-death")

    page.get_by_role("link", name="sample", exact=True).first.click()
    page.wait_for_url("**/lineages/sample")
    page.get_by_label("first generation").fill("1")
    page.get_by_label("second generation").fill("5")
    page.get_by_role("button", name="compare").click()
    page.wait_for_url("**/lineages/sample/compare/1/5")
    assert "generation 1 against 5" in page.locator("h1").inner_text()
    assert "README.md" in page.locator("main").inner_text()
    watched.shot("5-compare")

    assert watched.errors == []
    assert watched.foreign == []


def test_genealogy_links_a_fork_and_its_parent_generation(
    served: Served, browser_page: Watched
) -> None:
    watched, page = browser_page, browser_page.page
    page.goto(served.url + "/lineages/offshoot")
    assert "sample generation 2" in page.locator("#parent").inner_text()
    watched.shot("8-fork")
    page.locator("#parent").get_by_role("link", name="sample generation 2").click()
    page.wait_for_url("**/lineages/sample/generations/2")
    page.get_by_role("link", name="sample", exact=True).first.click()
    page.wait_for_url("**/lineages/sample")
    assert "a root lineage" in page.locator("#parent").inner_text()
    page.locator("#children").get_by_role("link", name="offshoot").click()
    page.wait_for_url("**/lineages/offshoot")
    assert watched.errors == []


def test_an_exported_lineage_reads_the_same_in_another_fleet(
    served: Served, browser_page: Watched, tmp_path: Path
) -> None:
    archive = tmp_path / "xss.ouroboros.tar.gz"
    served.fleet.ok("export", "xss", "--to", str(archive))
    (tmp_path / "elsewhere").mkdir()
    elsewhere = Fleet(tmp_path / "elsewhere")
    elsewhere.ok("import", str(archive))
    copy = Served(elsewhere, tmp_path / "elsewhere.log")
    try:
        for path in ("/lineages/xss", "/lineages/xss/generations/1", "/lineages/xss/generations/2"):
            texts = []
            for server in (served, copy):
                browser_page.page.goto(server.url + path)
                texts.append(browser_page.page.locator("main").inner_text())
            assert texts[0] == texts[1], path
        browser_page.shot("9-imported")
    finally:
        copy.stop()
    assert browser_page.errors == []


def test_hostile_pages_run_nothing_in_the_browser(served: Served, browser_page: Watched) -> None:
    watched, page = browser_page, browser_page.page
    for path in (
        "/",
        "/lineages/xss",
        "/lineages/xss/generations/1",
        "/lineages/xss/generations/2",
        "/lineages/xss/compare/1/2",
    ):
        page.goto(served.url + path)
        page.wait_for_load_state("load")
        # The markup is text on the page, never elements.
        assert page.locator("script").count() == 0, path
        assert page.locator("img").count() == 0, path
        assert page.locator("b").count() == 0, path
    assert PAYLOAD in page.locator("main").inner_text()
    assert page.evaluate("() => document.querySelectorAll('[onerror]').length") == 0
    watched.shot("6-hostile-compare")
    page.goto(served.url + "/lineages/xss/generations/2")
    assert PAYLOAD in page.locator("#stderr").inner_text()
    watched.shot("7-hostile-death")
    assert watched.dialogs == []
    assert watched.errors == []
