"""Safety of the web UI: organism-made text renders inert, URLs cannot traverse."""

from __future__ import annotations

import pytest
from support.browse import (
    PAYLOAD,
    PAYLOAD_ESCAPED,
    Served,
)

# Full tier: its sample lineages are made with git and served by `serve`.
pytestmark = pytest.mark.full

HOSTILE_PAGES = [
    "/",
    "/lineages/xss",
    "/lineages/xss/generations/1",
    "/lineages/xss/generations/2",
    "/lineages/xss/compare/1/2",
]


@pytest.fixture
def served(served_sample: Served) -> Served:
    """The session's one served sample (conftest)."""
    return served_sample


def test_organism_text_is_escaped_on_every_page(served: Served) -> None:
    seen = ""
    for path in HOSTILE_PAGES:
        page = served.get(path)
        assert page.status_code == 200, path
        html = page.text
        assert PAYLOAD not in html and "<script" not in html and "<img" not in html, path
        assert "<b>" not in html, path
        seen += html
    # Each place organism text reaches: file name and diff, subject, journal lines,
    # stderr, prompt, response, call error, provenance, figure sources.
    generation_1 = served.get("/lineages/xss/generations/1").text
    assert f"<code>{PAYLOAD_ESCAPED}" in generation_1  # the file name
    assert f'<span class="add">+{PAYLOAD_ESCAPED}' in generation_1  # its diff
    assert f'<pre class="wrap prompt">Rewrite yourself. {PAYLOAD_ESCAPED}' in generation_1
    assert f"(message &#34;{PAYLOAD_ESCAPED}" in generation_1  # the response
    assert f"error: <code>{PAYLOAD_ESCAPED}" in generation_1
    death = served.get("/lineages/xss/generations/2").text
    assert death.count(PAYLOAD_ESCAPED) >= 4  # lethal body, journal lines, stderr, ...
    # The first error Emacs printed leads the page, escaped as every other organism text.
    first = f'<pre class="wrap">Debugger entered--Lisp error: (error &#34;{PAYLOAD_ESCAPED}'
    assert first in death.split('id="first-error"')[1].split("</section>")[0]
    assert f"external edit: {PAYLOAD_ESCAPED}" in served.get("/lineages/xss").text
    # The JSON API carries the same text as data, unchanged.
    api = served.get("/api/lineages/xss/generations/2").json()
    assert PAYLOAD in api["observation"]["stderr"]


def test_no_page_can_run_a_script_even_if_markup_slipped_through(served: Served) -> None:
    for path in HOSTILE_PAGES:
        policy = served.get(path).headers["content-security-policy"]
        assert "default-src 'none'" in policy and "script-src" not in policy


@pytest.mark.parametrize(
    "target",
    [
        "/lineages/../../../../etc/passwd",
        "/lineages/..%2F..%2F..%2Fetc%2Fpasswd",
        "/lineages/%2e%2e%2f%2e%2e%2fetc%2fpasswd",
        "/lineages/..",
        "/lineages/.git",
        "/lineages/sample%00",
        "/lineages/sample%0A",
        "/lineages/sample%2F..%2Fxss",
        "/lineages/SAMPLE",
        "/lineages/sample/generations/..%2F..%2F..%2Fetc%2Fpasswd",
        "/lineages/sample/generations/-1",
        "/lineages/sample/generations/1e0",
        "/lineages/sample/generations/%D9%A3",
        "/lineages/sample/generations/1%00",
        "/lineages/sample/compare/1/..%2F2",
        "/api/lineages/..%2F..%2Fetc%2Fpasswd",
        "/api/lineages/sample/generations/..",
        "/families/..%2F..%2Fetc%2Fpasswd",
        "/api/families/../../etc/passwd",
    ],
)
def test_traversal_attempts_are_404(served: Served, target: str) -> None:
    assert served.raw(target) == 404
