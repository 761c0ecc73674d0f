"""Genealogy: which lineage each lineage was forked from, and which were forked from it.

Owns the one rule every view (``status``, ``journal``, the web UI, the JSON API)
uses to read a family tree out of lineage root metadata: a lineage's parent is the
``parent`` its root records (``worker.instrument.lineage.Parentage``); its ancestry
follows parents back to the first seed, across instrument versions, for as long as
each ancestor is a lineage of this repository; its children are the lineages whose
root names it. A lineage without a parent record (``init``, anything made before
forks existed, an imported legacy lineage) is a root.

Trusts: nothing beyond the validated metadata it is given. A recorded parent that
is not in this repository (a fork imported alone) ends the ancestry there and is
shown as absent; a cycle, which no fleet command can make, ends it too.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel

from worker.instrument.lineage import LineageMetadata, Parentage


class Ancestor(BaseModel):
    """One step up: the lineage a younger one was forked from, at which commit."""

    lineage: str
    generation: int
    commit: str
    instrument_fingerprint: str | None
    instrument_version: str | None
    present: bool


class Child(BaseModel):
    """A lineage forked from this one: from which generation, under which instrument."""

    lineage: str
    generation: int
    commit: str
    instrument_fingerprint: str
    instrument_version: str


class Genealogy(BaseModel):
    """A lineage's parent, its ancestry (parent first, back to the first seed), its children."""

    parent: Parentage | None
    ancestry: list[Ancestor]
    children: list[Child]

    @property
    def line(self) -> str:
        """One line for terminals: ``forked from a@3 (from b@7); children c@2, d@5``."""
        parts = []
        if self.ancestry:
            first, *older = self.ancestry
            text = f"forked from {first.lineage}@{first.generation}"
            if older:
                text += " (from " + ", from ".join(f"{a.lineage}@{a.generation}" for a in older)
                text += ")"
            parts.append(text)
        if self.children:
            parts.append(
                "children " + ", ".join(f"{c.lineage}@{c.generation}" for c in self.children)
            )
        return "; ".join(parts) or "root"


def genealogy(name: str, metas: Mapping[str, LineageMetadata | None]) -> Genealogy:
    """The genealogy of lineage ``name`` among the lineages ``metas`` (name -> root metadata)."""
    meta = metas.get(name)
    ancestry: list[Ancestor] = []
    seen = {name}
    parent = meta.parent if meta else None
    while parent is not None and parent.lineage not in seen:
        seen.add(parent.lineage)
        ancestor = metas.get(parent.lineage)
        ancestry.append(
            Ancestor(
                lineage=parent.lineage,
                generation=parent.generation,
                commit=parent.commit,
                instrument_fingerprint=parent.instrument_fingerprint,
                instrument_version=parent.instrument_version,
                present=parent.lineage in metas,
            )
        )
        parent = ancestor.parent if ancestor else None
    return Genealogy(
        parent=meta.parent if meta else None,
        ancestry=ancestry,
        children=children(name, metas),
    )


def children(name: str, metas: Mapping[str, LineageMetadata | None]) -> list[Child]:
    """Lineages forked from ``name``, oldest source generation first."""
    return offspring(metas).get(name, [])


def offspring(metas: Mapping[str, LineageMetadata | None]) -> dict[str, list[Child]]:
    """Every parent's children as ``children`` lists them, in one pass over ``metas`` (a
    view of every lineage asks this once, not once per lineage)."""
    found: dict[str, list[Child]] = {}
    for child, meta in metas.items():
        if meta is not None and meta.parent is not None:
            found.setdefault(meta.parent.lineage, []).append(
                Child(
                    lineage=child,
                    generation=meta.parent.generation,
                    commit=meta.parent.commit,
                    instrument_fingerprint=meta.instrument_fingerprint,
                    instrument_version=meta.instrument_version,
                )
            )
    return {
        parent: sorted(kids, key=lambda c: (c.generation, c.lineage))
        for parent, kids in found.items()
    }


def descendants(roots: list[str], metas: Mapping[str, LineageMetadata | None]) -> list[str]:
    """``roots`` and every lineage forked from one of them, at any depth, in that order."""
    order = list(dict.fromkeys(roots))
    for name in order:
        order.extend(c.lineage for c in children(name, metas) if c.lineage not in order)
    return order
