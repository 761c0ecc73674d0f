"""The HTML pages: overview, lineage, generation, compare, family and cohort views.

Owns which template each URL renders and with what; the data is the same view
model the JSON API returns for the mirror URL. Templates escape everything.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from scheduler.reader import DEFAULT_PER_PAGE, MAX_PER_PAGE, parse_generation
from scheduler.web.deps import chosen_names, lineage_view, overview, reader_of, seed_sha
from scheduler.web.listing import SORT_KEYS, ListingQuery, listing
from scheduler.web.render import templates

router = APIRouter(include_in_schema=False, default_response_class=HTMLResponse)


@router.get("/")
def fleet(request: Request, query: Annotated[ListingQuery, Query()]) -> Response:
    """The overview: its lineages filtered, sorted and paginated as ``query`` says.

    The filter form sends every field, empty or default ones too: such a query is sent
    on to its shortest spelling, the one every link of the page uses.
    """
    canonical = query.href(page=query.page)
    if request.url.query and canonical != f"/?{request.url.query}":
        return RedirectResponse(canonical, status_code=303)
    view = overview(request)
    shown = listing(view.lineages, query)
    context = {"view": view, "listing": shown, "q": shown.query, "sort_keys": SORT_KEYS}
    return templates.TemplateResponse(request, "overview.html", context)


@router.get("/cohorts/{label}")
def cohort(request: Request, label: str) -> Response:
    view = reader_of(request).cohort(label)
    return templates.TemplateResponse(request, "cohort.html", {"view": view})


@router.get("/cohorts")
def chosen(request: Request, lineages: Annotated[list[str], Query()]) -> Response:
    """Lineages chosen by name (``?lineages=a,b,c`` or ``lineages`` repeated) as a cohort."""
    view = reader_of(request).chosen(chosen_names(lineages))
    return templates.TemplateResponse(request, "cohort.html", {"view": view})


@router.get("/lineages/{name}")
def lineage(
    request: Request,
    name: str,
    page: int = Query(1, ge=1),
    per_page: int = Query(DEFAULT_PER_PAGE, ge=1, le=MAX_PER_PAGE),
) -> Response:
    view = lineage_view(request, name, page, per_page)
    return templates.TemplateResponse(request, "lineage.html", {"view": view})


@router.get("/lineages/{name}/generations/{gen}")
def generation(request: Request, name: str, gen: str) -> Response:
    view = reader_of(request).generation(name, parse_generation(gen))
    return templates.TemplateResponse(request, "generation.html", {"view": view})


@router.get("/lineages/{name}/compare")
def compare_form(request: Request, name: str, a: str = "", b: str = "") -> Response:
    """The lineage page's compare form (a plain GET form: the UI runs no script)."""
    first, second = parse_generation(a), parse_generation(b)
    reader_of(request).history(name)
    return RedirectResponse(f"/lineages/{name}/compare/{first}/{second}", status_code=303)


@router.get("/lineages/{name}/compare/{a}/{b}")
def compare(request: Request, name: str, a: str, b: str) -> Response:
    view = reader_of(request).compare(name, parse_generation(a), parse_generation(b))
    return templates.TemplateResponse(request, "compare.html", {"view": view})


@router.get("/families/{seed}")
def family(request: Request, seed: str) -> Response:
    view = reader_of(request).family(seed_sha(seed))
    return templates.TemplateResponse(request, "family.html", {"view": view})
