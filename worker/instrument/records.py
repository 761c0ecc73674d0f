"""The schema of what a generation records outside the lineage: observations and their index.

Owns the pydantic models the pipeline writes to the observation store (the key
layout is ``worker.instrument.store_keys``; run records, which the scheduler writes, are
``worker.fleet.runs``). Every record is produced by the trusted worker
or scheduler, never by an organism; organism-made text (stderr, prompts, responses)
is carried as data and capped where it could grow without bound.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from worker.instrument.physics import Physics

Outcome = Literal[
    "changed",
    "no-change",
    "process_exit",
    "signal",
    "wall_timeout",
    "cgroup_oom",
    "decoder_rejection",
    "footprint_exceeded",
]
# Every outcome but a life's two ways of ending alive.
DEATHS: frozenset[str] = frozenset(get_args(Outcome)) - {"changed", "no-change"}
# How a model's answer ended, as the socket tells the organism (X-Ouroboros-Stop-Reason):
# complete, cut at the output token limit, refused by the model, or stopped short for
# any other reason (a reasoning model that spent every token before answering included).
StopReason = Literal["complete", "max_tokens", "refused", "incomplete"]
STOP_REASONS: tuple[StopReason, ...] = ("complete", "max_tokens", "refused", "incomplete")
# What became of one attempt at the vendor: answered (200); failed (the vendor's error,
# or the connection's); no_slot (never sent: no room under the fleet's cap, or no free
# model thread, before the call's deadline); abandoned (sent, and the deadline or the
# end of the life came first).
AttemptOutcome = Literal["answered", "failed", "no_slot", "abandoned"]
# What a generation's provider failure was, for the fleet: refused (the provider said no
# in a way waiting will not fix) or unavailable (passing failures that outlasted the
# retries or the call's deadline).
ModelFailureKind = Literal["refused", "unavailable"]
MODEL_FAILURE_REASON_CHARS = 300
STDERR_CAP_BYTES = 1024 * 1024
STDERR_CUT_MARK = "\n[... stderr cut at 1 MiB by the kernel ...]\n"


class ModelAttempt(BaseModel):
    """One try at the vendor within a model call: the fleet's cap, the request, its fate.

    A call is tried again after a failure the vendor calls passing (rate limits,
    overload, server errors, lost connections, stalls), within the call's deadline.
    """

    model_config = ConfigDict(extra="forbid")

    number: int = Field(ge=1)
    started_at: datetime
    # Time spent waiting for the fleet-wide cap of the provider before the request.
    cap_wait_seconds: float = Field(ge=0)
    # Time from sending the request to its end; 0 when no request was sent.
    request_seconds: float = Field(ge=0)
    outcome: AttemptOutcome
    # The vendor's HTTP status, when it answered with one.
    vendor_status: int | None = None
    error: str | None = None
    # What the vendor asked for (retry-after-ms or retry-after), in seconds.
    retry_after_seconds: float | None = None
    # The wait before the next attempt; None when this attempt was the last.
    backoff_seconds: float | None = None
    # The vendor may have served, and billed, a request whose answer was lost.
    may_have_billed: bool = False
    cost_usd: Decimal = Decimal(0)
    # A note on the cap, e.g. that the shared cap could not be reached and was skipped.
    cap_note: str | None = None


class ModelCall(BaseModel):
    """One request through the model socket, as the model socket audited it."""

    model_config = ConfigDict(extra="forbid")

    index: int
    started_at: datetime
    duration_seconds: float
    status: int
    prompt: str
    response: str | None
    prompt_bytes: int = Field(0, ge=0)
    # The generation's audited text passed its cap: prompt and response are kept as
    # their sizes and sha256 only (every figure and every dollar is still here).
    text_omitted: bool = False
    prompt_sha256: str
    response_sha256: str | None
    requested_output_tokens: int | None
    input_tokens: int
    output_tokens: int
    reserved_usd: Decimal
    cost_usd: Decimal
    error: str | None = None
    # How the answer ended (200 only); the organism got it as X-Ouroboros-Stop-Reason.
    stop_reason: StopReason | None = None
    # False when the vendor's reply carried no usage: the call was then charged its
    # whole reservation (input_tokens and output_tokens are 0, not measured).
    usage_reported: bool = True
    attempts: list[ModelAttempt] = []


class ModelFailure(BaseModel):
    """The provider's failure in a generation, for the fleet to stop or pause the run.

    Present whenever at least one of the generation's calls failed at the provider
    (never for a 402 budget refusal, nor for the organism's own invalid request, which
    the socket answers 400 and sends nowhere, nor for a call that came after its
    deadline or found no room under the fleet's cap, which never reached the vendor).
    The generation is "model unavailable" exactly when no call was answered:
    ``answered_calls == 0``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # refused: 401, 403, 404, a redirect, a key the worker lacks, and a 400 or 422
    # (unknown model, say) when no call was answered (beside an answered call it is the
    # request's fault and not counted); unavailable: 429, 5xx, timeouts, connection
    # refused, exhausting the retries or the call's deadline.
    kind: ModelFailureKind
    # One printable line, never a secret: the socket's own words for the failure, which
    # name the provider and the kind of failure but never a key or the vendor's prose.
    reason: str = Field(max_length=MODEL_FAILURE_REASON_CHARS)
    failed_calls: int = Field(ge=1)
    answered_calls: int = Field(ge=0)

    @property
    def model_unavailable(self) -> bool:
        """No call of the generation was answered: its own mark everywhere."""
        return self.answered_calls == 0


class Provenance(BaseModel):
    model_config = ConfigDict(extra="forbid")

    worker_host: str
    fleet_version: str
    instrument_fingerprint: str
    ceiling_driver: str
    bwrap_version: str
    emacs_version: str
    # The digest of the syscall filter the life lived under; None in every observation
    # recorded before lives had one.
    syscall_filter: str | None = None
    task_id: str | None = None
    attempt: int = 1
    queue_wait_seconds: float | None = None


class Observation(BaseModel):
    """The trusted record of one generation, written once at its deterministic key."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_name: Literal["ouroboros-observation/v1"] = Field(
        "ouroboros-observation/v1", alias="schema"
    )
    lineage: str
    generation: int = Field(ge=1)
    parent_commit: str
    lineage_commit: str
    started_at: datetime
    finished_at: datetime
    duration_seconds: float
    outcome: Outcome
    rejection_reason: str | None = None
    exit_status: int | None
    signal: int | None = None
    driver_result: str
    cpu_usage_nsec: int | None
    memory_peak_bytes: int | None
    oom_kills: int
    figure_sources: dict[str, str]
    archive_bytes: int
    published_bytes: int
    published_files: int
    # What the generation added to the shared repository as ``growth`` counts it, and
    # the lineage's total after it; None in a record made before the count existed.
    repo_bytes: int | None = None
    lineage_repo_bytes: int | None = None
    provider: str
    model: str | None
    constraints: Physics
    model_calls: list[ModelCall]
    # Requests past the socket's call limit: answered 429, sent nowhere, only counted.
    model_calls_over_limit: int = Field(0, ge=0)
    spent_usd: Decimal
    run_budget_exhausted: bool = Field(
        False, description="a call was refused (402) under the run's narrowed budget"
    )
    stderr: str
    stderr_truncated: bool
    provenance: Provenance
    run_id: str | None = None
    # None in every observation recorded before provider failures were summarised.
    model_failure: ModelFailure | None = None

    @property
    def model_unavailable(self) -> bool:
        """Whether the generation is marked "model unavailable": no call was answered."""
        return self.model_failure is not None and self.model_failure.model_unavailable


class IndexEntry(BaseModel):
    """One generation's summary in the per-lineage index (what overviews and tables show)."""

    model_config = ConfigDict(extra="forbid")

    generation: int
    outcome: Outcome
    parent_commit: str
    lineage_commit: str
    finished_at: datetime
    duration_seconds: float
    cpu_usage_nsec: int | None
    memory_peak_bytes: int | None
    model_calls: int
    spent_usd: Decimal
    run_id: str | None
    run_budget_exhausted: bool = False
    model_unavailable: bool = False
    # Files of the published tree; None in an entry indexed before it was kept here.
    published_files: int | None = None
    # Input and output tokens of every call; None in an entry indexed before it was kept.
    tokens: int | None = None

    @classmethod
    def of(cls, observation: Observation) -> IndexEntry:
        return cls(
            generation=observation.generation,
            outcome=observation.outcome,
            parent_commit=observation.parent_commit,
            lineage_commit=observation.lineage_commit,
            finished_at=observation.finished_at,
            duration_seconds=observation.duration_seconds,
            cpu_usage_nsec=observation.cpu_usage_nsec,
            memory_peak_bytes=observation.memory_peak_bytes,
            model_calls=len(observation.model_calls),
            spent_usd=observation.spent_usd,
            run_id=observation.run_id,
            run_budget_exhausted=observation.run_budget_exhausted,
            model_unavailable=observation.model_unavailable,
            published_files=observation.published_files,
            tokens=sum(call.input_tokens + call.output_tokens for call in observation.model_calls),
        )


class LineageIndex(BaseModel):
    """Per-lineage index object: every stored observation's summary, in generation order.

    Publication rewrites it after each observation lands, so browsing never has to
    read every observation object. It is derived data: rebuildable from observations.
    """

    model_config = ConfigDict(extra="forbid")

    lineage: str
    generations: list[IndexEntry] = []

    @classmethod
    def parse(cls, raw: bytes | None, lineage: str) -> LineageIndex:
        """The index as stored (``raw``), or an empty one for a lineage without it yet."""
        return cls.model_validate_json(raw) if raw else cls(lineage=lineage)

    def with_entry(self, entry: IndexEntry) -> LineageIndex:
        kept = [e for e in self.generations if e.generation != entry.generation]
        return self.model_copy(
            update={"generations": sorted([*kept, entry], key=lambda e: e.generation)}
        )


def cap_stderr(raw: bytes) -> tuple[str, bool]:
    """Decode stderr for the record, keeping at most 1 MiB and marking the cut."""
    if len(raw) <= STDERR_CAP_BYTES:
        return raw.decode("utf-8", errors="replace"), False
    head = raw[:STDERR_CAP_BYTES].decode("utf-8", errors="replace")
    return head + STDERR_CUT_MARK, True


ReplayVerdict = Literal["reproduced", "diverged", "not replayable"]
# A replay's report keeps its diff and stderr excerpt short: it names a difference, it
# is not a second record of the life.
REPLAY_DETAIL_CHARS = 2000


class ReplayReport(BaseModel):
    """The latest replay of one generation: its verdict and what it rests on.

    Written by ``schedule-lineage replay`` under its own key beside the observation
    (``store_keys.replay_key``), overwritten by the next replay of the generation; it
    never changes the observation, the lineage or anything else the life recorded.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_name: Literal["ouroboros-replay/v1"] = Field("ouroboros-replay/v1", alias="schema")
    lineage: str
    generation: int = Field(ge=1)
    # The commit the replay judged, the one the observation records.
    lineage_commit: str
    verdict: ReplayVerdict
    # Why: the first difference for ``diverged``, the reason for ``not replayable``,
    # None for ``reproduced``.
    reason: str | None = None
    # The first differing path's short diff, or the replayed life's last stderr.
    detail: str | None = Field(None, max_length=REPLAY_DETAIL_CHARS)
    # What the organism read that differs between lives, where stderr or the diff shows it.
    likely_cause: str | None = None
    recorded_outcome: Outcome
    replayed_outcome: Outcome | None = None
    instrument_fingerprint: str
    replayed_at: datetime
    duration_seconds: float = Field(ge=0)
