"""The observations table as a download: a lineage's, or a cohort's.

Owns the two download routes (``/lineages/NAME/table.FMT`` and
``/cohorts/LABEL/table.FMT``, FMT one of parquet, csv, jsonl): the file is the one
``schedule-lineage table`` writes (``scheduler.table``), built in a private temporary
directory and removed once sent. An unknown lineage, cohort or format is a 404.

Trusts: the app's reader. Validates the label and the format before any lookup.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response
from starlette.background import BackgroundTask

from scheduler.cohorts import in_cohort
from scheduler.reader import NotFound, Reader
from scheduler.table import FORMATS, MEDIA_TYPES, Format, rows, write
from scheduler.web.deps import reader_of

router = APIRouter(include_in_schema=False)


@router.get("/lineages/{name}/table.{fmt}")
def lineage_table(request: Request, name: str, fmt: str) -> Response:
    reader = reader_of(request)
    reader.history(name)
    return _download(reader, [name], _format(fmt), name)


@router.get("/cohorts/{label}/table.{fmt}")
def cohort_table(request: Request, label: str, fmt: str) -> Response:
    reader = reader_of(request)
    names = in_cohort(reader.metadata(), label)
    if not names:
        raise NotFound(f"no cohort {label!r}")
    return _download(reader, names, _format(fmt), f"cohort-{label}")


def _format(text: str) -> Format:
    for fmt in FORMATS:
        if text == fmt:
            return fmt
    raise NotFound(f"no table format {text!r}; use one of {', '.join(FORMATS)}")


def _download(reader: Reader, names: list[str], fmt: Format, stem: str) -> Response:
    directory = Path(tempfile.mkdtemp(prefix="ouroboros-table-"))
    try:
        path = directory / f"{stem}.observations.{fmt}"
        write(rows(reader, names), fmt, path)
    except BaseException:
        shutil.rmtree(directory)
        raise
    return FileResponse(
        path,
        media_type=MEDIA_TYPES[fmt],
        filename=path.name,
        background=BackgroundTask(shutil.rmtree, directory),
    )
