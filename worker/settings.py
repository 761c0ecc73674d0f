"""The fleet's configuration: one pydantic-settings model, prefix ``OUROBOROS_``.

Owns every setting a worker, the scheduler or the web UI reads, their defaults and
validation. Sources, strongest first: environment, the TOML file named by
``OUROBOROS_CONFIG`` (if any), defaults. With nothing configured, everything lives
under ``OUROBOROS_HOME`` (default ``./.ouroboros/``): a bare repository
``lineages.git``, a ``file://`` observation store and a private Redis socket.
Provider keys are never fields here: they are read at the moment of use by the
model broker (environment, ``*_FILE`` or ``$CREDENTIALS_DIRECTORY``) so that a
settings dump can never carry one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

CeilingName = Literal["auto", "systemd", "cgroup2", "cgroup1"]


class Settings(BaseSettings):
    """Every OUROBOROS_* setting. Paths left empty are derived from ``home``."""

    model_config = SettingsConfigDict(env_prefix="OUROBOROS_", extra="ignore")

    home: Path = Path(".ouroboros")
    broker_url: str = ""
    lineage_repo: str = ""
    observations: str = ""
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_path_style: bool = True
    model_provider: str = "scripted"
    model_name: str | None = None
    model_input_usd_per_mtok: float | None = None
    model_output_usd_per_mtok: float | None = None
    openai_compatible_base_url: str | None = None
    anthropic_base_url: str = "https://api.anthropic.com"
    openai_base_url: str = "https://api.openai.com"
    scripted_latency_seconds: float = Field(0.0, ge=0, le=600)
    key_dir: Path | None = None
    ceiling: CeilingName = "auto"
    cgroup_parent: Path | None = None
    concurrency: int = Field(1, ge=1, le=256)
    # A root worker runs each concurrent life under its own uid from this range; an
    # unprivileged worker runs lives as itself and ignores it (worker.identity).
    sandbox_uid_base: int = Field(60000, ge=1000, le=2**31 - 2**16)
    sandbox_uid_count: int = Field(1024, ge=1, le=2**16)
    state_dir: Path | None = None
    fleet_version: str | None = None
    instrument_commit: str | None = None
    visibility_timeout_seconds: int = Field(7200, ge=10)
    inflight_ttl_seconds: int = Field(3600, ge=5)
    lease_seconds: int = Field(60, ge=3)
    reconcile_interval_seconds: float = Field(30.0, ge=0.2)
    spool_retry_seconds: float = Field(30.0, ge=0.2)
    web_host: str = "127.0.0.1"
    web_port: int = Field(8765, ge=1, le=65535)

    @field_validator("observations")
    @classmethod
    def _known_store_scheme(cls, value: str) -> str:
        if value and not value.startswith(("file://", "s3://")):
            raise ValueError(
                f"{value!r} is not an observation store URL; use file:///path or s3://bucket/prefix"
            )
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        config_file = os.environ.get("OUROBOROS_CONFIG")
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if config_file:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=Path(config_file)))
        return tuple(sources)

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
        return self.lineage_repo or str(self.home_dir / "lineages.git")

    @property
    def observations_url(self) -> str:
        return self.observations or (self.home_dir / "observations").as_uri()

    @property
    def state_path(self) -> Path:
        return (self.state_dir or self.home_dir / "state").expanduser().resolve()
