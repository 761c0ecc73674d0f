"""The fleet's configuration: the instrument's settings plus the plumbing, prefix ``OUROBOROS_``.

Owns every setting a worker, the scheduler or the web UI reads beyond those of the
instrument (``worker.instrument.settings``): where the fleet's services are (broker,
shared repository, observation store), local paths, concurrency, the delivery and
recovery timings, and the fleet-wide caps on calls to each model provider and to
each model; and ``load_settings``, which refuses a bad value in one line. None of
these decide or record a generation (the cap decides when a call is sent, within
the call's own deadline, never what it may do), so this module is not fingerprinted:
a queueing fix never forces a lineage to start over. With nothing configured,
everything lives under ``OUROBOROS_HOME`` (default ``./.ouroboros/``): a bare
repository ``lineages.git``, a ``file://`` observation store and a private Redis socket.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from pydantic_settings import NoDecode

from worker.instrument.errors import Refusal
from worker.instrument.names import DEFAULT_HOME, HOME_PATTERN
from worker.instrument.repo_urls import repository_place
from worker.instrument.settings import InstrumentSettings

ModelName = Annotated[str, StringConstraints(min_length=1, max_length=200)]
# A home's name is short and plain: it is part of a cache's path, a spool's and a root's.
HomeName = Annotated[str, StringConstraints(pattern=HOME_PATTERN)]
# As OUROBOROS_LINEAGE_REPO takes it: a path, file://, ssh:// or git's host:path.
RepoUrl = Annotated[str, StringConstraints(min_length=1, max_length=4096, pattern=r"^\S+$")]


class ModelLimits(BaseModel):
    """The fleet-wide cap on calls to one model at each provider; 0 switches a limit off."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_concurrent_calls: int = Field(0, ge=0, le=100_000)
    requests_per_minute: int = Field(0, ge=0, le=10_000_000)
    tokens_per_minute: int = Field(0, ge=0, le=10**10)


class Settings(InstrumentSettings):
    """Every OUROBOROS_* setting. Paths left empty are derived from ``home``."""

    home: Path = Path(".ouroboros")
    broker_url: str = ""
    lineage_repo: str = ""
    # Several shared repositories ("homes"), JSON: home name -> repository URL (a local
    # path or ssh://). Empty: one home, ``default``, at ``lineage_repo`` (worker.fleet.homes).
    # Parsed here, not by pydantic-settings, so bad JSON is refused in one line.
    lineage_repos: Annotated[dict[HomeName, RepoUrl], NoDecode] = Field(default_factory=dict)
    observations: str = ""
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_path_style: bool = True
    concurrency: int = Field(1, ge=1, le=256)
    state_dir: Path | None = None
    fleet_version: str | None = None
    visibility_timeout_seconds: int = Field(7200, ge=10)
    inflight_ttl_seconds: int = Field(3600, ge=5)
    lease_seconds: int = Field(60, ge=3)
    reconcile_interval_seconds: float = Field(30.0, ge=0.2)
    spool_retry_seconds: float = Field(30.0, ge=0.2)
    # How long ``run --follow``/``--wait`` waits while no live worker serves a lineage's
    # queue before it gives up (exit 1; the run itself stays queued).
    worker_wait_seconds: float = Field(120.0, ge=1, le=7 * 24 * 3600)
    # How long ``run --follow``/``--wait`` keeps trying while the broker, the store or the
    # repository does not answer before it gives up (exit 1; the runs go on on the fleet).
    follow_outage_seconds: float = Field(600.0, ge=1, le=7 * 24 * 3600)
    # How long the embedded Redis stays up with no client connected (worker.fleet.embedded_redis).
    embedded_redis_idle_seconds: float = Field(600.0, ge=1, le=7 * 24 * 3600)
    web_host: str = "127.0.0.1"
    web_port: int = Field(8765, ge=1, le=65535)
    # How often the web process asks the broker, the live workers and the store for
    # what its pages and /metrics show (scheduler.web.probes): at most once per
    # interval, whatever the number of requests.
    web_probe_seconds: float = Field(2.0, ge=0.2, le=60)
    # The fleet-wide cap on calls to each model provider, shared by every worker through
    # the broker's Redis (worker.fleet.model_throttle); 0 switches a limit off. The
    # defaults keep a fleet within the smallest paid tiers' limits: raise them to yours.
    model_max_concurrent_calls: int = Field(16, ge=0, le=100_000)
    model_requests_per_minute: int = Field(50, ge=0, le=10_000_000)
    model_tokens_per_minute: int = Field(0, ge=0, le=10**10)
    # A cap per model as well, which a call satisfies beside its provider's: JSON, e.g.
    # {"gpt-4o": {"requests_per_minute": 30}}. Parsed here, not by pydantic-settings,
    # so that bad JSON is refused in one line like any other bad value.
    model_cap_per_model: Annotated[dict[ModelName, ModelLimits], NoDecode] = Field(
        default_factory=dict
    )

    @field_validator("observations")
    @classmethod
    def _known_store_scheme(cls, value: str) -> str:
        if value and not value.startswith(("file://", "s3://")):
            raise ValueError(
                f"{value!r} is not an observation store URL; use file:///path or s3://bucket/prefix"
            )
        return value

    @field_validator("model_cap_per_model", mode="before")
    @classmethod
    def _model_caps_from_json(cls, value: Any) -> Any:
        return _json_object(value, '{"gpt-4o": {"requests_per_minute": 30}}')

    @field_validator("lineage_repos", mode="before")
    @classmethod
    def _homes_from_json(cls, value: Any) -> Any:
        return _json_object(value, '{"a": "/srv/a.git", "b": "ssh://host/srv/b.git"}')

    @model_validator(mode="after")
    def _one_repository_per_home(self) -> Settings:
        # Two homes on one repository would each hold every branch of the other; a move
        # between them would delete the lineage's only branch.
        seen: dict[str, str] = {}
        for home, url in self.lineage_homes.items():
            place = repository_place(url)
            if place in seen:
                raise PydanticCustomError(
                    "homes",
                    "homes {first} and {second} are one repository ({place}); give every home "
                    "of OUROBOROS_LINEAGE_REPOS (and OUROBOROS_LINEAGE_REPO) its own",
                    {"first": seen[place], "second": home, "place": place},
                )
            seen[place] = home
        return self

    @property
    def home_dir(self) -> Path:
        return self.home.expanduser().resolve()

    @property
    def redis_socket(self) -> Path:
        """The embedded Redis's private Unix socket (used when no broker URL is set)."""
        return self.home_dir / "redis" / "redis.sock"

    @property
    def broker(self) -> str:
        return self.broker_url or f"redis+socket://{self.redis_socket}"

    @property
    def lineage_repo_url(self) -> str:
        """The default home's repository (the only one unless OUROBOROS_LINEAGE_REPOS)."""
        return (
            self.lineage_repos.get(DEFAULT_HOME)
            or self.lineage_repo
            or str(self.home_dir / "lineages.git")
        )

    @property
    def lineage_homes(self) -> dict[str, str]:
        """Every home's repository URL by name, in name order; ``default`` always among them."""
        homes = {**self.lineage_repos, DEFAULT_HOME: self.lineage_repo_url}
        return dict(sorted(homes.items()))

    @property
    def observations_url(self) -> str:
        return self.observations or (self.home_dir / "observations").as_uri()

    @property
    def state_path(self) -> Path:
        return (self.state_dir or self.home_dir / "state").expanduser().resolve()


def _json_object(value: Any, example: str) -> Any:
    """A setting's JSON text parsed (empty: {}); other values are left to pydantic."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value, object_pairs_hook=_once_each) if value.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"not JSON ({exc.msg} at character {exc.pos}); use e.g. {example}"
        ) from None


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose every key is given once (json keeps the last of twins)."""
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise ValueError(f"{key!r} is given twice; give each name once")
        found[key] = value
    return found


def load_settings() -> Settings:
    """The settings, or a one-line Refusal naming the first bad one (and where in it)."""
    try:
        return Settings()
    except ValidationError as exc:
        first = exc.errors()[0]
        if not first["loc"]:
            raise Refusal(f"configuration: {first['msg']}") from None
        field, *inside = (str(part) for part in first["loc"])
        where = f" {'.'.join(inside)}:" if inside else ""
        raise Refusal(f"OUROBOROS_{field.upper()}:{where} {first['msg']}") from None
