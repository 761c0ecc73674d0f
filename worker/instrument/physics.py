"""The physics of a lineage: the constraints every generation lives under.

Owns the constraint model, its defaults (those of the single-host original), the parsing
of human sizes such as ``1G``, and the derived figures (CPU quota, the result-archive
cap). Among the constraints are the footprint budgets on the shared repository
(``generation_repo_bytes``, ``lineage_repo_bytes``; ``growth`` counts them). Physics are
pinned in the lineage root at creation and read back from there; nothing else may change
them for an existing lineage.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
# The time a model call leaves the organism before its wall: enough for a life at the
# default CPU quota (20% of a core) to hear a 502, write what it chooses and exit, and
# for the stage to pack /work, yet under 2% of the default 600 s wall.
MODEL_MARGIN_SECONDS = 10
GENERATION_REPO_BYTES = 8 * 1024**2
LINEAGE_REPO_BYTES = 1024**3


def parse_size(value: object) -> int:
    """Parse ``1G``, ``512M``, ``64MiB`` or a plain byte count into bytes (binary units)."""
    if isinstance(value, bool):
        raise ValueError("a size must be a number of bytes or a value like 512M or 1G")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size cannot be negative")
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(
            f"{value!r} is not a size; use a byte count or a value like 512M, 1G, 64MiB"
        )
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


Size = Annotated[int, BeforeValidator(parse_size), Field(ge=0)]


class Physics(BaseModel):
    """Constraints pinned per lineage and disclosed to the organism in capabilities.json."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    wall_seconds: int = Field(600, ge=1, le=7 * 24 * 3600)
    cpu_seconds: int = Field(120, ge=1, le=7 * 24 * 3600)
    memory_max_bytes: Size = Field(1024**3, ge=16 * 1024**2, le=1024**4)
    memory_swap_max_bytes: Size = Field(0, le=1024**4)
    tasks_max: int = Field(64, ge=4, le=65536)
    work_bytes: Size = Field(256 * 1024**2, ge=1024**2, le=64 * 1024**3)
    work_files: int = Field(10_000, ge=16, le=10_000_000)
    tmp_bytes: Size = Field(64 * 1024**2, ge=1024**2, le=64 * 1024**3)
    run_bytes: Size = Field(16 * 1024**2, ge=1024**2, le=64 * 1024**3)
    max_prompt_bytes: int = Field(196_608, ge=1, le=64 * 1024**2)
    max_output_tokens: int = Field(12_000, ge=1, le=10_000_000)
    model_timeout_seconds: int = Field(600, ge=1, le=24 * 3600)
    # A model call's deadline is at most the end of the wall less this margin. When
    # not given (every lineage pinned before it existed included) it is
    # MODEL_MARGIN_SECONDS, or half the wall if that is shorter.
    model_margin_seconds: int = Field(MODEL_MARGIN_SECONDS, ge=0, le=24 * 3600)
    budget_usd: Decimal = Field(Decimal("1.00"), ge=0, le=1_000_000, decimal_places=6)
    # What a generation, and a lineage in all, may add to the shared repository, as
    # ``growth`` counts it. A lineage pinned before these existed reads back with the
    # defaults: 512 times a generation's 8 MiB, far above what a lineage's organism.el
    # and notes add, far below what would fill a fleet's disks.
    generation_repo_bytes: Size = Field(GENERATION_REPO_BYTES, ge=64 * 1024, le=64 * 1024**3)
    lineage_repo_bytes: Size = Field(LINEAGE_REPO_BYTES, ge=64 * 1024, le=1024**4)

    @model_validator(mode="before")
    @classmethod
    def _margin_fits_a_short_wall(cls, data: object) -> object:
        # A lineage pinned with a wall under twice the default margin before the margin
        # existed must still read back (and live): its margin is then half its wall.
        if isinstance(data, dict) and "model_margin_seconds" not in data:
            wall = data.get("wall_seconds", cls.model_fields["wall_seconds"].default)
            if isinstance(wall, int) and not isinstance(wall, bool) and wall >= 0:
                return {**data, "model_margin_seconds": min(MODEL_MARGIN_SECONDS, wall // 2)}
        return data

    @model_validator(mode="after")
    def _margin_under_wall(self) -> Physics:
        if self.model_margin_seconds >= self.wall_seconds:
            raise ValueError(
                f"model_margin_seconds={self.model_margin_seconds} leaves a model call no "
                f"time in wall_seconds={self.wall_seconds}; lower --model-margin or raise "
                "--wall"
            )
        return self

    @model_validator(mode="after")
    def _cpu_at_least_one_percent_of_wall(self) -> Physics:
        if self.cpu_seconds * 100 < self.wall_seconds:
            raise ValueError(
                f"cpu_seconds={self.cpu_seconds} is under 1% of wall_seconds="
                f"{self.wall_seconds}; raise --cpu-seconds or lower --wall"
            )
        return self

    @property
    def cpu_quota_percent(self) -> float:
        """Aggregate CPU share of one core that spends cpu_seconds over wall_seconds."""
        return self.cpu_seconds / self.wall_seconds * 100

    @property
    def archive_cap_bytes(self) -> int:
        """Largest result tar accepted on the sandbox's stdout."""
        return self.work_bytes + self.work_files * 1024 + 1024**2
