"""The catalogue of model providers: their names, default models and the settings naming them.

Owns the one list of provider names that the job contract, the CLI and the
providers share, the refusal of a name not on it, and the rule naming a run's model
(the provider's default when none is given). Pure data: importing it costs
nothing and reaches no vendor.
"""

from __future__ import annotations

from worker.instrument.errors import Refusal

PROVIDER_SETTING = "OUROBOROS_MODEL_PROVIDER"
MODEL_SETTING = "OUROBOROS_MODEL_NAME"
PROVIDER_NAMES: tuple[str, ...] = ("anthropic", "openai", "openai-compatible", "scripted")
DEFAULT_MODELS: dict[str, str] = {
    "anthropic": "claude-opus-4-8",
    "openai": "gpt-5.6",
    "scripted": "scripted",
}


def require_known(name: str) -> None:
    """Refuse a provider name this instrument does not know, naming the setting."""
    if name not in PROVIDER_NAMES:
        raise Refusal(
            f"unknown model provider {name!r}: set {PROVIDER_SETTING} or --provider to "
            f"one of {', '.join(PROVIDER_NAMES)}"
        )


def model_of(provider: str, model: str | None) -> str:
    """The model asked for, else the provider's default; Refusal when it has none."""
    named = model or DEFAULT_MODELS.get(provider)
    if not named:
        raise Refusal(f"the {provider} provider needs a model name: set {MODEL_SETTING} or --model")
    return named
