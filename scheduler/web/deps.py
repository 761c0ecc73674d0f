"""Request-scoped access to what the app was built with, shared by API and pages.

Owns reaching the app's reader and live-workers provider from a request, the
assembly of the overview (lineages from the reader, workers from the provider)
and the validation of URL parts the reader does not check itself.
"""

from __future__ import annotations

import re

from fastapi import Request

from scheduler.reader import NotFound, Reader
from scheduler.views import Overview

_SEED_SHA = re.compile(r"^[0-9a-f]{64}$")


def reader_of(request: Request) -> Reader:
    reader: Reader = request.app.state.reader
    return reader


def overview(request: Request) -> Overview:
    workers = request.app.state.workers()
    return Overview(
        lineages=reader_of(request).summaries(),
        broker="no broker" if workers is None else "inspected",
        workers=workers or [],
    )


def seed_sha(text: str) -> str:
    if not _SEED_SHA.match(text):
        raise NotFound(f"no family {text!r}")
    return text
