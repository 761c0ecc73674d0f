"""The observation store's key layout, defined once for writers and readers.

Owns where each record lives under a store's prefix::

    lineages/<name>/metadata.json
    lineages/<name>/generations/000001.json     (one write-once object per generation)
    lineages/<name>/index/000000.json           (derived: index segment 0, generations 1-256)
    lineages/<name>/index.json                  (derived: the whole index before segments)
    lineages/<name>/runs/<run-id>.json
    lineages/<name>/replays/000001.json         (the latest replay of a generation, overwritten)
    claims/<name>.json                          (write-once: the home a name was made in)

Generation numbers are zero-padded so that a plain listing sorts them in order.
Pure functions; the store validates every key before any backend sees it.
"""

from __future__ import annotations

LINEAGES_PREFIX = "lineages/"


def claim_key(lineage: str) -> str:
    """Outside ``lineages/``: a claim is the fleet's, not part of a lineage's record."""
    return f"claims/{lineage}.json"


def metadata_key(lineage: str) -> str:
    return f"{LINEAGES_PREFIX}{lineage}/metadata.json"


def generation_key(lineage: str, generation: int) -> str:
    return f"{LINEAGES_PREFIX}{lineage}/generations/{generation:06d}.json"


def index_key(lineage: str) -> str:
    return f"{LINEAGES_PREFIX}{lineage}/index.json"


def index_segments_prefix(lineage: str) -> str:
    return f"{LINEAGES_PREFIX}{lineage}/index/"


def index_segment_key(lineage: str, segment: int) -> str:
    return f"{index_segments_prefix(lineage)}{segment:06d}.json"


def runs_prefix(lineage: str) -> str:
    return f"{LINEAGES_PREFIX}{lineage}/runs/"


def run_key(lineage: str, run_id: str) -> str:
    return f"{runs_prefix(lineage)}{run_id}.json"


def replays_prefix(lineage: str) -> str:
    return f"{LINEAGES_PREFIX}{lineage}/replays/"


def replay_key(lineage: str, generation: int) -> str:
    """The latest replay report of a generation: overwritten, never part of the record."""
    return f"{replays_prefix(lineage)}{generation:06d}.json"
