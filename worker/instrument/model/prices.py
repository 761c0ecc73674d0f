"""Model prices: the built-in table, explicit overrides, and the cost of a token count.

Owns what one million input or output tokens of a model costs in USD, and the exact
Decimal arithmetic that turns token counts into dollars. The built-in table covers
the recognised models of each provider at their published, uncached, standard-tier
prices; any other model needs explicit prices (``OUROBOROS_MODEL_INPUT_USD_PER_MTOK``
and ``OUROBOROS_MODEL_OUTPUT_USD_PER_MTOK``) rather than a guess, because the
spending ceiling is only as hard as the price behind it. Explicit prices belong to
the one provider and model the settings name (``OUROBOROS_MODEL_PROVIDER`` and
``OUROBOROS_MODEL_NAME``, or that provider's default model): prices set for a local
server never reprice another provider's calls. Update the table when providers
change their prices. Trusts: the settings it is given.
"""

from __future__ import annotations

import re
from decimal import Decimal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from worker.instrument.errors import Refusal
from worker.instrument.model.catalogue import DEFAULT_MODELS, MODEL_SETTING, PROVIDER_SETTING
from worker.instrument.settings import InstrumentSettings

INPUT_PRICE_SETTING = "OUROBOROS_MODEL_INPUT_USD_PER_MTOK"
OUTPUT_PRICE_SETTING = "OUROBOROS_MODEL_OUTPUT_USD_PER_MTOK"


class Prices(BaseModel):
    """USD per million tokens, input and output."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input_usd_per_mtok: Decimal = Field(ge=0)
    output_usd_per_mtok: Decimal = Field(ge=0)

    def cost_usd(self, input_tokens: int, output_tokens: int) -> Decimal:
        """Exact cost of the given token counts (scaleb divides by 10**6 without rounding)."""
        per_mtok = input_tokens * self.input_usd_per_mtok + output_tokens * self.output_usd_per_mtok
        return per_mtok.scaleb(-6)


def _prices(input_usd: str, output_usd: str) -> Prices:
    return Prices(input_usd_per_mtok=Decimal(input_usd), output_usd_per_mtok=Decimal(output_usd))


# Standard-tier prices per provider and model id. The default prompt limit (196,608
# bytes plus 4,096 framing tokens) keeps every request below the long-context
# thresholds at which some of these models charge more.
BUILTIN_PRICES: dict[str, dict[str, Prices]] = {
    "anthropic": {
        "claude-opus-4-8": _prices("5.00", "25.00"),
        "claude-opus-4-7": _prices("5.00", "25.00"),
        "claude-opus-4-6": _prices("5.00", "25.00"),
        "claude-opus-4-5": _prices("5.00", "25.00"),
        "claude-sonnet-4-6": _prices("3.00", "15.00"),
        "claude-sonnet-4-5": _prices("3.00", "15.00"),
        "claude-haiku-4-5": _prices("1.00", "5.00"),
    },
    "openai": {
        "gpt-5.6": _prices("5.00", "30.00"),
        "gpt-5.6-sol": _prices("5.00", "30.00"),
        "gpt-5.6-terra": _prices("2.50", "15.00"),
        "gpt-5.6-luna": _prices("1.00", "6.00"),
        "gpt-5.2": _prices("1.75", "14.00"),
        "gpt-5.1": _prices("1.25", "10.00"),
        "gpt-5": _prices("1.25", "10.00"),
        "gpt-5-mini": _prices("0.25", "2.00"),
        "gpt-5-nano": _prices("0.05", "0.40"),
    },
    # Fictitious nominal prices: the scripted stand-in costs nothing, but charging
    # it something makes every demo and test exercise the real ledger.
    "scripted": {
        "scripted": _prices("1.00", "5.00"),
    },
}

# Dated snapshot ids (claude-sonnet-4-5-20250929, gpt-5-2025-08-07) cost what their
# alias costs.
_SNAPSHOT_SUFFIX = re.compile(r"-(\d{8}|\d{4}-\d{2}-\d{2})$")


def builtin_prices(provider: str, model: str) -> Prices | None:
    """The table's prices for a recognised model of this provider, or None."""
    table = BUILTIN_PRICES.get(provider, {})
    return table.get(model) or table.get(_SNAPSHOT_SUFFIX.sub("", model))


def explicit_prices_apply(provider: str, model: str, settings: InstrumentSettings) -> bool:
    """Whether the explicit price settings name this provider and model."""
    named = settings.model_name or DEFAULT_MODELS.get(settings.model_provider)
    return provider == settings.model_provider and model == named


def resolve_prices(provider: str, model: str, settings: InstrumentSettings) -> Prices:
    """Explicit prices where given for this provider and model, else the built-in ones;
    Refusal when either is unknown.

    Each explicit setting overrides its half of the built-in price on its own, so a
    negotiated input price can be set without restating the output price.
    """
    builtin = builtin_prices(provider, model)
    applies = explicit_prices_apply(provider, model, settings)
    explicit_input = settings.model_input_usd_per_mtok if applies else None
    explicit_output = settings.model_output_usd_per_mtok if applies else None
    input_usd = _decimal(explicit_input) if explicit_input is not None else None
    output_usd = _decimal(explicit_output) if explicit_output is not None else None
    if builtin is not None:
        input_usd = builtin.input_usd_per_mtok if input_usd is None else input_usd
        output_usd = builtin.output_usd_per_mtok if output_usd is None else output_usd
    if input_usd is None or output_usd is None:
        raise Refusal(
            f"no built-in prices for model {model!r} of provider {provider!r}: set "
            f"{INPUT_PRICE_SETTING} and {OUTPUT_PRICE_SETTING} (USD per million tokens; "
            f"0 for a free local server) with {PROVIDER_SETTING}={provider} and "
            f"{MODEL_SETTING}={model}, the provider and model they price"
        )
    try:
        return Prices(input_usd_per_mtok=input_usd, output_usd_per_mtok=output_usd)
    except ValidationError:
        raise Refusal(
            f"{INPUT_PRICE_SETTING} and {OUTPUT_PRICE_SETTING} must be finite and not negative"
        ) from None


def _decimal(value: float) -> Decimal:
    # Through str: Decimal(0.1) would carry the float's binary error into the ledger.
    return Decimal(str(value))
