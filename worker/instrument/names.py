"""The names and patterns every part of the fleet spells the same way, defined once.

Owns: what a commit id, a lineage name and a lineage branch look like; the paths of
a lineage's tree that the kernel owns; the ceiling driver names; the generation
numbering rule (a commit is generation N only if its subject starts ``gen N: ``, so
a hand commit titled ``gen notes`` is not one); and the queue of an instrument.
Writers (the pipeline) and readers (status, the browser) import these, so they
cannot disagree. Pure data and functions: imports nothing of the fleet.
"""

from __future__ import annotations

import re
from typing import Literal, get_args

COMMIT_PATTERN = r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$"
LINEAGE_NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
BRANCH_PREFIX = "lineage-"

ORGANISM_PATH = "organism.el"
JOURNAL_PATH = "journal.md"
METADATA_PATH = ".ouroboros-lineage.json"
# Paths of a lineage's tree that only the kernel writes: a result holding one is refused.
KERNEL_OWNED: frozenset[str] = frozenset({JOURNAL_PATH, METADATA_PATH})

DriverName = Literal["systemd", "cgroup2", "cgroup1"]
DRIVER_NAMES: tuple[str, ...] = get_args(DriverName)

_GENERATION_SUBJECT = re.compile(r"^gen ([1-9][0-9]{0,8}): ")


def generation_number(subject: str) -> int | None:
    """N for a commit subject ``gen N: ...``; None for every other commit (seed, hand edits)."""
    match = _GENERATION_SUBJECT.match(subject)
    return int(match.group(1)) if match else None


def queue_name(fingerprint: str) -> str:
    """The Celery queue of an instrument: hosts with other code never serve it."""
    return f"gen.{fingerprint[:12]}"
