"""The read side never hands a reader raw bidi or C1 controls: the CLI on a terminal,
``--json``, the JSON API, and the web diff in a real browser.

A lineage written with the worker's own code (as lineages recorded before the decoder
refused these in names are) carries U+202E RIGHT-TO-LEFT OVERRIDE, U+2067 RIGHT-TO-LEFT
ISOLATE and U+009B (a C1 CSI, which xterm acts on) in every organism-made field: a file
name and its content (the diff), commit subjects, journal lines, stderr.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright
from support.browse import Served, settings_of, write_hostile_lineage
from support.fleet import Fleet

pytestmark = pytest.mark.full

# "evil\u202e" shows the rest right to left; "\x9b31m" is CSI 31 m (red) on xterm.
BIDI = "gnp.\u202etxt.el \u2067iso\u2069 csi\x9b31m red"
RAW = ("\u202e", "\u2067", "\u2069", "\x9b")

CHROMIUM = "/usr/bin/chromium"


def _raw(text: str) -> list[str]:
    return [f"U+{ord(ch):04X}" for ch in RAW if ch in text]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("read-side-controls")
    fleet = Fleet(home, COLUMNS="200")
    write_hostile_lineage(settings_of(fleet), "bidi", payload=BIDI)
    server = Served(fleet, home / "serve.log")
    yield server
    server.stop()


@pytest.mark.parametrize(
    "args",
    [("journal", "bidi"), ("observations", "bidi"), ("observations", "bidi", "2")],
    ids=" ".join,
)
def test_the_cli_escapes_bidi_and_c1_controls(served: Served, args: tuple[str, ...]) -> None:
    out = served.fleet.ok(*args)
    assert _raw(out.stdout + out.stderr) == []
    if args != ("observations", "bidi"):  # the listing shows no organism text
        assert "\\u202e" in out.stdout and "\\x9b" in out.stdout


@pytest.mark.parametrize("args", [("journal", "bidi"), ("observations", "bidi", "2")], ids=" ".join)
def test_json_output_escapes_them_and_still_reads_back(
    served: Served, args: tuple[str, ...]
) -> None:
    out = served.fleet.ok(*args, "--json").stdout
    assert _raw(out) == []
    assert "\\u202e" in out and "\\u009b" in out
    assert BIDI in json.dumps(json.loads(out), ensure_ascii=False)


@pytest.mark.parametrize(
    "path",
    ["/api/lineages/bidi", "/api/lineages/bidi/generations/2", "/api/lineages/bidi/generations/1"],
)
def test_the_json_api_escapes_them_and_still_reads_back(served: Served, path: str) -> None:
    answer = served.get(path)
    assert answer.status_code == 200, answer.text
    assert _raw(answer.text) == []
    assert "\\u202e" in answer.text
    assert BIDI in json.dumps(answer.json(), ensure_ascii=False)


@pytest.mark.parametrize(
    "path",
    [
        "/",
        "/lineages/bidi",
        "/lineages/bidi/generations/1",
        "/lineages/bidi/generations/2",
        "/lineages/bidi/compare/1/2",
    ],
)
def test_no_page_prints_them_raw(served: Served, path: str) -> None:
    """Not only the diff: stderr, prompts, responses, the lethal body, journal text and
    every reason show each control as ``<U+XXXX>`` (a hostile review found them raw)."""
    answer = served.get(path)
    assert answer.status_code == 200, answer.text
    assert _raw(answer.text) == []
    # Nor another character a reader cannot see: the hostile stderr's ESC, a ZWSP.
    assert "\x1b" not in answer.text and "\u200b" not in answer.text
    if "generations" in path:
        assert "&lt;U+202E&gt;" in answer.text


@pytest.mark.browser
def test_the_web_diff_marks_each_control_visibly(served: Served, tmp_path: Path) -> None:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page()
            page.goto(served.url + "/lineages/bidi/generations/1")
            page.wait_for_load_state("load")
            diff = page.locator("details.diff").first
            shown = diff.inner_text()
            assert _raw(shown) == []
            markers = diff.locator("span.control")
            titles = set(markers.evaluate_all("nodes => nodes.map(n => n.title)"))
            assert titles >= {
                "U+202E RIGHT-TO-LEFT OVERRIDE",
                "U+2067 RIGHT-TO-LEFT ISOLATE",
                "U+2069 POP DIRECTIONAL ISOLATE",
                "U+009B control",
            }
            assert markers.first.is_visible()
            assert "<U+202E>" in shown
            page.screenshot(path=str(tmp_path / "bidi-diff.png"), full_page=True)
        finally:
            browser.close()
