"""Refusals: the one exception type that means "the user asked for something we will not do".

Owns the mapping from a refusal to exit status 2 and a single clear line. Anything
raised as a Refusal is a user or environment mistake, never a bug, so callers print
its message without a traceback.
"""

from __future__ import annotations


class Refusal(Exception):
    """A request refused before anything was changed; the message says what and what to do."""

    exit_status = 2


class StaleJob(Exception):
    """The lineage branch moved past the commit a job expected; the job does nothing."""
