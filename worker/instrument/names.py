"""The names and patterns every part of the fleet spells the same way, defined once.

Owns: what a commit id, a lineage name and a lineage branch look like (a lineage
name is the project's own rule and git's reference-name rule for its branch, as
libgit2 checks it, so no name can leave a ref git refuses); the paths of
a lineage's tree that the kernel owns; the ceiling driver names; the generation
numbering rule (a commit is generation N only if its subject starts ``gen N: ``, so
a hand commit titled ``gen notes`` is not one); and the queue of an instrument.
Writers (the pipeline) and readers (status, the browser) import these, so they
cannot disagree. Pure data and functions: imports nothing of the fleet, and nothing
beyond the standard library at import time (the sandbox side loads it alone).
"""

from __future__ import annotations

import re
from typing import Literal, get_args

COMMIT_PATTERN = r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$"
# The shared repository every lineage lives in unless several are configured
# (worker.fleet.homes); a root naming no home lives there.
DEFAULT_HOME = "default"
HOME_PATTERN = r"^[a-z0-9-]{1,32}$"
_HOME_NAME = re.compile(HOME_PATTERN)
BRANCH_PREFIX = "lineage-"
# The project's own rule; git's is asked of libgit2 (``lineage_name_problem``).
_LINEAGE_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")

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


def lineage_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a lineage, or None if it can.

    Within the project's characters git still refuses a branch ``lineage-a..b``,
    ``lineage-a.`` and ``lineage-a.lock``; writing one leaves a ref every git reader
    then trips on, so git's own check decides, not a copy of its rules.
    """
    if not _LINEAGE_NAME.fullmatch(name):
        return "use 1-63 characters from a-z 0-9 . _ -, starting with a letter or digit"
    # Imported here: the unprivileged worker's sandbox side imports this module with the
    # standard library alone (no pygit2), and never checks a name.
    import pygit2

    if not pygit2.reference_is_valid_name(f"refs/heads/{BRANCH_PREFIX}{name}"):
        return "git refuses it as a branch name (no '..', no '.' or '.lock' at the end)"
    return None


def cohort_label_problem(label: str) -> str | None:
    """Why ``label`` cannot name a cohort, or None if it can: a lineage name's characters,
    so a label is as safe in a URL, a file name and a terminal as a lineage name is."""
    if not _LINEAGE_NAME.fullmatch(label):
        return "use 1-63 characters from a-z 0-9 . _ -, starting with a letter or digit"
    return None


def is_lineage_name(name: str) -> bool:
    return lineage_name_problem(name) is None


def queue_name(fingerprint: str) -> str:
    """The Celery queue of an instrument: hosts with other code never serve it."""
    return f"gen.{fingerprint[:12]}"


def is_home_name(text: str) -> bool:
    """Whether ``text`` is a home's name (``HOME_PATTERN``)."""
    return _HOME_NAME.fullmatch(text) is not None
