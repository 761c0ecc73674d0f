"""Cohorts: naming a cohort's replicates and finding the lineages of a cohort.

Owns the replicate naming rule (``NAME-1`` .. ``NAME-K``: the lineages sort together
and each one's number says which replicate it is) and answering "which lineages are in
cohort C" from the lineages' root metadata. A lineage's cohort is written once, in its
root (``worker.instrument.lineage``); nothing here writes.

Trusts: the root metadata it is given (already validated by pydantic).
"""

from __future__ import annotations

from collections.abc import Mapping

from worker.instrument.errors import Refusal
from worker.instrument.lineage import LineageMetadata, check_cohort, check_name

MAX_REPLICATES = 1000


def replicate_names(name: str, replicates: int) -> list[str]:
    """The names of ``replicates`` lineages started as one cohort from ``name``."""
    names = [f"{name}-{number}" for number in range(1, replicates + 1)]
    for replicate in names:
        check_name(replicate)
    return names


def in_cohort(metas: Mapping[str, LineageMetadata | None], label: str) -> list[str]:
    """Every lineage of cohort ``label`` among ``metas``, by name (none for a bad label)."""
    return sorted(name for name, meta in metas.items() if meta and meta.cohort == label)


def members(metas: Mapping[str, LineageMetadata | None], label: str) -> list[str]:
    """Every lineage of cohort ``label``, by name; refused when it has none."""
    check_cohort(label)
    names = in_cohort(metas, label)
    if not names:
        raise Refusal(
            f"no lineage is in cohort {label}; start one with "
            f"schedule-lineage init NAME --replicates K --cohort {label}"
        )
    return names
