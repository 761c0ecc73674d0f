"""The overview's list of lineages: filtered, sorted and paginated by query parameters.

Owns what the overview's query parameters mean (``ListingQuery``: sort by name,
generation, last outcome, spend or last update, either way; filter by state, last
outcome, a kind of death the lineage has suffered, cohort and instrument; a page of
``per_page``), the choices each filter offers (the values present in the fleet), and
the links that change one parameter while keeping the others. Pure: it orders the
summaries the reader already made, so a page of 1,000 lineages costs a sort, not a read.

Trusts: the summaries. Every parameter is validated by pydantic (an unknown sort or a
page out of range is a 422); a filter value that matches nothing shows no lineage.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Literal
from urllib.parse import urlencode

from pydantic import BaseModel, Field

from scheduler.views import LineageSummary

DEFAULT_PER_PAGE = 50
MAX_PER_PAGE = 500
SortKey = Literal["name", "generation", "outcome", "spend", "updated"]
SORT_KEYS: tuple[SortKey, ...] = ("name", "generation", "outcome", "spend", "updated")
FILTERS = ("state", "outcome", "death", "cohort", "instrument")
_NEVER = datetime.min.replace(tzinfo=UTC)


class ListingQuery(BaseModel):
    """The overview's query parameters; an empty filter is no filter."""

    sort: SortKey = "name"
    order: Literal["asc", "desc"] = "asc"
    state: str = ""
    outcome: str = ""
    death: str = ""
    cohort: str = ""
    # The instrument's fingerprint, or its first characters (as ``gen.<12>`` shows them).
    instrument: str = ""
    page: int = Field(1, ge=1)
    per_page: int = Field(DEFAULT_PER_PAGE, ge=1, le=MAX_PER_PAGE)

    def href(self, **changes: str | int) -> str:
        """This listing's URL with ``changes``, every other parameter kept; a change of
        filter or order starts again at page 1. Defaults are left out of the URL."""
        if "page" not in changes:
            changes["page"] = 1
        chosen = self.model_copy(update=changes)
        defaults = ListingQuery()
        kept = {
            key: value
            for key, value in chosen.model_dump().items()
            if value != getattr(defaults, key)
        }
        return "/?" + urlencode(kept) if kept else "/"

    def sorted_by(self, key: SortKey) -> str:
        """The link of a column heading: by ``key``, reversed if already sorted by it."""
        flipped = "desc" if self.sort == key and self.order == "asc" else "asc"
        return self.href(sort=key, order=flipped if self.sort == key else "asc")


class Listing(BaseModel):
    query: ListingQuery
    lineages: list[LineageSummary]
    # Lineages in the fleet, and those the filters kept.
    total: int
    matched: int
    pages: int
    # Each filter's values present in the fleet, for its menu.
    choices: dict[str, list[str]]


def listing(summaries: list[LineageSummary], query: ListingQuery) -> Listing:
    """The page of ``summaries`` that ``query`` asks for, with the filters' choices."""
    kept = [s for s in summaries if _matches(s, query)]
    kept.sort(key=_KEYS[query.sort], reverse=query.order == "desc")
    pages = max(1, -(-len(kept) // query.per_page))
    page = min(query.page, pages)
    start = (page - 1) * query.per_page
    return Listing(
        query=query.model_copy(update={"page": page}),
        lineages=kept[start : start + query.per_page],
        total=len(summaries),
        matched=len(kept),
        pages=pages,
        choices=_choices(summaries),
    )


def _matches(summary: LineageSummary, query: ListingQuery) -> bool:
    return (
        (not query.state or summary.status == query.state)
        and (not query.outcome or summary.last_outcome == query.outcome)
        and (not query.death or query.death in summary.deaths)
        and (not query.cohort or summary.cohort == query.cohort)
        and (
            not query.instrument
            or (summary.instrument_fingerprint or "").startswith(query.instrument)
        )
    )


def _choices(summaries: list[LineageSummary]) -> dict[str, list[str]]:
    found: dict[str, set[str]] = {name: set() for name in FILTERS}
    for s in summaries:
        found["state"].add(s.status)
        found["death"].update(s.deaths)
        if s.last_outcome:
            found["outcome"].add(s.last_outcome)
        if s.cohort:
            found["cohort"].add(s.cohort)
        if s.instrument_fingerprint:
            found["instrument"].add(s.instrument_fingerprint[:12])
    return {name: sorted(values) for name, values in found.items()}


# Ties keep name order (the reader lists lineages by name and the sort is stable).
_KEYS = {
    "name": lambda s: s.name,
    "generation": lambda s: s.generations,
    "outcome": lambda s: s.last_outcome or "",
    "spend": lambda s: s.spent_usd or Decimal(0),
    "updated": lambda s: s.last_generation_at or _NEVER,
}
