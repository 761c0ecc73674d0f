"""Pydantic field types built on the rules of ``worker.instrument.names``.

Owns ``LineageName`` and ``CohortLabel``: a lineage name and a cohort label in a model,
each validated by the one rule ``names`` spells for it. Kept apart from ``names``,
which the sandbox side imports with the standard library alone. Trusts nothing it validates.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

from worker.instrument.names import cohort_label_problem, lineage_name_problem


def _lineage_name(name: str) -> str:
    if (problem := lineage_name_problem(name)) is not None:
        raise ValueError(f"invalid lineage name: {problem}")
    return name


# A lineage name in a pydantic model: the same rule as ``lineage_name_problem``.
LineageName = Annotated[str, AfterValidator(_lineage_name)]


def _cohort_label(label: str) -> str:
    if (problem := cohort_label_problem(label)) is not None:
        raise ValueError(f"invalid cohort label: {problem}")
    return label


# A cohort label in a pydantic model: the same rule as ``cohort_label_problem``.
CohortLabel = Annotated[str, AfterValidator(_cohort_label)]
