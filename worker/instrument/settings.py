"""The settings that decide or record a generation: fingerprinted with the instrument.

Owns the OUROBOROS_* settings a generation's outcome or its record depends on: the
model provider, its prices, where it answers and how it is asked (the output-limit
field of Chat Completions, how long an attempt may stall before it is tried again),
the key directory, the ceiling driver, the sandbox uid range, and the instrument
commit. Sources, strongest first:
environment, the TOML file named by ``OUROBOROS_CONFIG`` (if any), defaults.
Provider keys are never fields: the model socket reads them at the moment of use
(environment, ``*_FILE`` or ``$CREDENTIALS_DIRECTORY``), so a settings dump can never
carry one. The fleet's plumbing (service URLs, timings, paths) extends this model in
``worker.fleet.settings``, outside the fingerprint: changing a lease must not force
every lineage to start over.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from worker.instrument.names import DriverName

CeilingName = Literal["auto"] | DriverName


class InstrumentSettings(BaseSettings):
    """The OUROBOROS_* settings of the trusted instrument."""

    model_config = SettingsConfigDict(env_prefix="OUROBOROS_", extra="ignore")

    model_provider: str = "scripted"
    model_name: str | None = None
    model_input_usd_per_mtok: float | None = None
    model_output_usd_per_mtok: float | None = None
    openai_compatible_base_url: str | None = None
    anthropic_base_url: str = "https://api.anthropic.com"
    openai_base_url: str = "https://api.openai.com"
    # OpenAI's reasoning models take only max_completion_tokens; some older local
    # servers know only max_tokens (worker.instrument.model.providers).
    openai_compatible_max_tokens_field: Literal["max_completion_tokens", "max_tokens"] = (
        "max_completion_tokens"
    )
    # An attempt that receives no byte for this long is abandoned and tried again
    # within the call's deadline (worker.instrument.model.retry).
    model_stall_seconds: float = Field(300.0, gt=0, le=24 * 3600)
    key_dir: Path | None = None
    ceiling: CeilingName = "auto"
    cgroup_parent: Path | None = None
    # A root worker runs each concurrent life under its own uid from this range; an
    # unprivileged worker runs lives as itself and ignores it (worker.instrument.identity).
    sandbox_uid_base: int = Field(60000, ge=1000, le=2**31 - 2**16)
    sandbox_uid_count: int = Field(1024, ge=1, le=2**16)
    instrument_commit: str | None = None

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
