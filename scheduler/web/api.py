"""The JSON API: the web pages' data under /api/, one route per page.

Owns the JSON mirror of every page (overview, lineage, generation, compare,
family). Responses are the reader's pydantic view models, so the OpenAPI schema
documents them exactly. Nothing here renders or escapes: JSON is data.
"""

from __future__ import annotations

from fastapi import APIRouter, Query, Request

from scheduler.reader import DEFAULT_PER_PAGE, MAX_PER_PAGE, parse_generation
from scheduler.views import CompareView, FamilyView, GenerationView, LineageView, Overview
from scheduler.web.deps import overview, reader_of, seed_sha

router = APIRouter(prefix="/api", tags=["api"])


@router.get("/", response_model=Overview)
def fleet(request: Request) -> Overview:
    """Every lineage with status, progress, outcome counts and spend; live workers."""
    return overview(request)


@router.get("/lineages/{name}", response_model=LineageView)
def lineage(
    request: Request,
    name: str,
    page: int = Query(1, ge=1),
    per_page: int = Query(DEFAULT_PER_PAGE, ge=1, le=MAX_PER_PAGE),
) -> LineageView:
    """One lineage: metadata, physics, a page of its history (newest first), chart series."""
    return reader_of(request).lineage(name, page, per_page)


@router.get("/lineages/{name}/generations/{gen}", response_model=GenerationView)
def generation(request: Request, name: str, gen: str) -> GenerationView:
    """One generation: journal entry, diff against its parent, observation, lethal body."""
    return reader_of(request).generation(name, parse_generation(gen))


@router.get("/lineages/{name}/compare/{a}/{b}", response_model=CompareView)
def compare(request: Request, name: str, a: str, b: str) -> CompareView:
    """Two generations of one lineage: their figures and the diff between their commits."""
    return reader_of(request).compare(name, parse_generation(a), parse_generation(b))


@router.get("/families/{seed}", response_model=FamilyView)
def family(request: Request, seed: str) -> FamilyView:
    """Every lineage whose seed organism has this sha256."""
    return reader_of(request).family(seed_sha(seed))
