"""Pydantic field types built on the rules of ``worker.instrument.names``.

Owns ``LineageName``: a lineage name in a model, validated by the one rule that
``names.lineage_name_problem`` spells. Kept apart from ``names``, which the sandbox side
imports with the standard library alone. Trusts nothing it validates.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

from worker.instrument.names import lineage_name_problem


def _lineage_name(name: str) -> str:
    if (problem := lineage_name_problem(name)) is not None:
        raise ValueError(f"invalid lineage name: {problem}")
    return name


# A lineage name in a pydantic model: the same rule as ``lineage_name_problem``.
LineageName = Annotated[str, AfterValidator(_lineage_name)]
