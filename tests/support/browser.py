"""A real browser for the web UI tests: Debian's chromium, headless, driven by Playwright.

``watched_page`` opens one page that records every console error, script error,
dialog and request to anywhere but the served UI, so a test can assert that the UI ran
nothing and fetched nothing from elsewhere; ``Watched.shot`` keeps a screenshot in the
test's directory (of the whole page, or of one element).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from playwright.sync_api import ConsoleMessage, Dialog, Page, Request, sync_playwright

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


class Watched:
    """A page whose console errors, script errors, dialogs and requests are recorded."""

    def __init__(self, page: Page, base: str, shots: Path) -> None:
        self.page, self.base, self.shots = page, base, shots
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.foreign: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))
        page.on("dialog", self._dialog)
        page.on("request", self._request)

    def _console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.errors.append(f"console: {message.text}")

    def _dialog(self, dialog: Dialog) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def _request(self, request: Request) -> None:
        if not request.url.startswith((self.base, "data:")):
            self.foreign.append(request.url)

    def shot(self, name: str, selector: str | None = None, *, top: bool = False) -> None:
        """The whole page, the element ``selector`` finds, or (``top``) the page from its
        top down to that element's bottom, as ``NAME.png``."""
        path = str(self.shots / f"{name}.png")
        if selector is None:
            self.page.screenshot(path=path, full_page=True)
            return
        element = self.page.locator(selector)
        if not top:
            element.screenshot(path=path)
            return
        box = element.bounding_box()
        width = self.page.viewport_size
        assert box is not None and width is not None, selector
        clip = {"x": 0, "y": 0, "width": width["width"], "height": box["y"] + box["height"] + 8}
        self.page.screenshot(path=path, clip=clip)  # type: ignore[arg-type]


@contextmanager
def watched_page(base: str, shots: Path) -> Iterator[Watched]:
    """A fresh headless page for the UI served at ``base``; screenshots go to ``shots``."""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(15_000)
            yield Watched(page, base, shots)
        finally:
            browser.close()
