"""The job contract: the message that asks for one generation, and the report it yields.

Owns ``GenerationJob`` (validated at every boundary: a hostile or malformed message
is rejected, never run) and ``GenerationReport`` (what the caller learns; the
commit and the observation, not this report, are the records). Both sides import
it: the scheduler and planner to send jobs, the pipeline to run them. Imports
nothing of the sandbox, the model socket or Celery.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from worker.instrument.model.catalogue import PROVIDER_NAMES
from worker.instrument.model.prices import Prices
from worker.instrument.names import COMMIT_PATTERN, LINEAGE_NAME_PATTERN
from worker.instrument.records import Outcome


class GenerationJob(BaseModel):
    """The job message: which lineage, which commit it must extend, which model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lineage: str = Field(pattern=LINEAGE_NAME_PATTERN)
    expected_commit: str = Field(pattern=COMMIT_PATTERN)
    provider: Literal[PROVIDER_NAMES] = Field(  # type: ignore[valid-type]
        description="one of the known providers; a hostile name is rejected, not run"
    )
    model: str | None = Field(None, max_length=200)
    run_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]{1,80}$")
    target_generation: int | None = Field(None, ge=1)
    budget_usd: Decimal | None = Field(None, ge=0, description="what the run has left")
    enqueued_at: datetime | None = None
    # The prices the run was started with: every worker charges the run's generations
    # alike, whatever its own settings say. None (a job of an older scheduler, or
    # ``run --local``): the worker's own prices for the provider and model.
    prices: Prices | None = None


class ModelFailure(BaseModel):
    """The provider's failure in a generation, for the fleet to stop or pause the run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["refused", "unavailable"]
    # refused: the provider said no in a way waiting will not fix (401, 403, 404,
    #   unknown model, a request the provider calls invalid although the organism's
    #   own request was valid);
    # unavailable: passing failures (429, 5xx, timeouts, connection refused) that
    #   exhausted the retries or the call's deadline.
    reason: str  # the provider's reason, one printable line, <= 300 chars, never a secret
    failed_calls: int  # calls of this generation that failed at the provider
    answered_calls: int  # calls of this generation the provider answered


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
    model_failure: ModelFailure | None = None
