"""The job contract: the message that asks for one generation, and the report it yields.

Owns ``GenerationJob`` (validated at every boundary: a hostile or malformed message
is rejected, never run) and ``GenerationReport`` (what the caller learns; the
commit and the observation, not this report, are the records). Both sides import
it: the scheduler and planner to send jobs, the pipeline to run them. ``ModelFailure``
is the observation's own record (``records``), re-exported here for the fleet. Imports
nothing of the sandbox, the model socket or Celery.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from worker.instrument.fields import LineageName
from worker.instrument.model.catalogue import PROVIDER_NAMES
from worker.instrument.model.prices import Prices
from worker.instrument.names import COMMIT_PATTERN
from worker.instrument.records import ModelFailure, Outcome


class GenerationJob(BaseModel):
    """The job message: which lineage, which commit it must extend, which model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lineage: LineageName
    expected_commit: str = Field(pattern=COMMIT_PATTERN)
    provider: Literal[PROVIDER_NAMES] = Field(  # type: ignore[valid-type]
        description="one of the known providers; a hostile name is rejected, not run"
    )
    model: str | None = Field(None, max_length=200)
    run_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]{1,80}$")
    target_generation: int | None = Field(None, ge=1)
    budget_usd: Decimal | None = Field(None, ge=0, description="what the run has left")
    # With its offset: a naive time cannot be subtracted from the life's start, and a job
    # carrying one must be rejected before its life, not fail after it.
    enqueued_at: AwareDatetime | None = None
    # The prices the run was started with: every worker charges the run's generations
    # alike, whatever its own settings say. None (a job of an older scheduler, or
    # ``run --local``): the worker's own prices for the provider and model.
    prices: Prices | None = None


class ReplayJob(BaseModel):
    """The replay message: which generation of which lineage, at which commit of its branch."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lineage: LineageName
    generation: int = Field(ge=1, le=999_999_999)
    commit: str = Field(pattern=COMMIT_PATTERN)


class GenerationReport(BaseModel):
    """What happened, for the caller (scheduler, CLI): never the source of truth."""

    lineage: str
    generation: int
    outcome: Outcome
    parent: str
    commit: str
    spent_usd: Decimal
    run_budget_exhausted: bool
    observation_stored: bool
    # Set when a call of the generation failed at the provider; the fleet stops
    # (refused) or pauses (unavailable) the run and sends no follow-up for it.
    model_failure: ModelFailure | None = None
