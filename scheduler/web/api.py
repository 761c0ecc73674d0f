"""The JSON API: the web pages' data under /api/, one route per page.

Owns the JSON mirror of every page (overview, lineage, generation, compare,
family, cohort and a chosen set of lineages) and the documentation of every status it
answers. Responses are the reader's pydantic view models, so the OpenAPI schema
documents them exactly; the errors (404 for no such lineage, generation, family or
cohort; 503 for an unreachable observation store) carry ``ErrorBody``, and 422 (a query
parameter out of range) is FastAPI's own validation body. Nothing here renders or
escapes: JSON is data.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel

from scheduler.reader import DEFAULT_PER_PAGE, MAX_PER_PAGE, parse_generation
from scheduler.views import (
    CohortView,
    CompareView,
    FamilyView,
    GenerationView,
    LineageView,
    Overview,
)
from scheduler.web.deps import chosen_names, lineage_view, overview, reader_of, seed_sha


class ErrorBody(BaseModel):
    """What every error of the API answers: one sentence saying what was wrong."""

    detail: str


UNAVAILABLE: dict[int | str, dict[str, Any]] = {
    503: {"model": ErrorBody, "description": "The observation store did not answer."}
}
NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorBody, "description": "No such lineage, generation, family or cohort."},
    **UNAVAILABLE,
}

router = APIRouter(prefix="/api", tags=["api"], responses=UNAVAILABLE)


@router.get("/", response_model=Overview)
def fleet(request: Request) -> Overview:
    """Every lineage with status, progress, outcome counts and spend; live workers."""
    return overview(request)


@router.get("/lineages/{name}", response_model=LineageView, responses=NOT_FOUND)
def lineage(
    request: Request,
    name: str,
    page: int = Query(1, ge=1),
    per_page: int = Query(DEFAULT_PER_PAGE, ge=1, le=MAX_PER_PAGE),
) -> LineageView:
    """One lineage: metadata, physics, a page of its history (newest first), chart series."""
    return lineage_view(request, name, page, per_page)


@router.get(
    "/lineages/{name}/generations/{gen}", response_model=GenerationView, responses=NOT_FOUND
)
def generation(request: Request, name: str, gen: str) -> GenerationView:
    """One generation: journal entry, diff against its parent, observation, lethal body."""
    return reader_of(request).generation(name, parse_generation(gen))


@router.get("/lineages/{name}/compare/{a}/{b}", response_model=CompareView, responses=NOT_FOUND)
def compare(request: Request, name: str, a: str, b: str) -> CompareView:
    """Two generations of one lineage: their figures and the diff between their commits."""
    return reader_of(request).compare(name, parse_generation(a), parse_generation(b))


@router.get("/families/{seed}", response_model=FamilyView, responses=NOT_FOUND)
def family(request: Request, seed: str) -> FamilyView:
    """Every lineage whose seed organism has this sha256."""
    return reader_of(request).family(seed_sha(seed))


@router.get("/cohorts/{label}", response_model=CohortView, responses=NOT_FOUND)
def cohort(request: Request, label: str) -> CohortView:
    """A cohort: its outcome grid, the share that lived and changed, overlaid curves."""
    return reader_of(request).cohort(label)


@router.get("/cohorts", response_model=CohortView, responses=NOT_FOUND)
def chosen(request: Request, lineages: Annotated[list[str], Query()]) -> CohortView:
    """Lineages chosen by name (``?lineages=a,b,c``), answered as a cohort is (no label)."""
    return reader_of(request).chosen(chosen_names(lineages))
