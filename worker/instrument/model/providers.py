"""Model providers: one provider-neutral call, translated to each vendor's HTTP API.

Owns the request and response translation for ``anthropic`` (Messages API),
``openai`` (Responses API), ``openai-compatible`` (Chat Completions at a configured
base URL: vLLM, llama.cpp, Ollama) and ``scripted`` (an offline, deterministic
stand-in), and the choice among them with its refusals. Every provider reduces a
vendor reply to text plus the usage the vendor reported; any failure becomes
ProviderUnavailable, whose message names the provider and the kind of failure but
never a key or the vendor's error prose (which can quote key fragments).

Trusts: the settings and base URLs it is given, and the usage figures a vendor
reports (the ledger caps any charge at the reservation). Does not trust the shape
of a vendor reply: each is validated by a pydantic model before use.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from abc import ABC, abstractmethod
from decimal import Decimal
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from worker.instrument.errors import Refusal
from worker.instrument.model.catalogue import DEFAULT_MODELS, MODEL_SETTING, require_known
from worker.instrument.model.credentials import Credential
from worker.instrument.model.prices import Prices, resolve_prices
from worker.instrument.settings import InstrumentSettings

ANTHROPIC_VERSION = "2023-06-01"
# A vendor reply larger than this is not a reply to a prompt of at most a few
# hundred KiB with at most tens of thousands of output tokens.
MAX_REPLY_BYTES = 32 * 1024 * 1024
MAX_ERROR_BODY_BYTES = 64 * 1024
_ERROR_KIND = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_Shape = TypeVar("_Shape", bound=BaseModel)


class GenerationContext(BaseModel):
    """What the broker knows about the generation it serves (for the scripted stand-in)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lineage: str
    generation: int
    organism_source: str


class ProviderReply(BaseModel):
    """The text of one model answer and the usage the vendor reported for it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str
    input_tokens: int
    output_tokens: int


class ProviderUnavailable(Exception):
    """The model gave no usable answer.

    may_have_billed says whether the vendor may have served (and billed) the request
    although we got no usable reply: true once the whole request was sent and the
    answer was lost, timed out or malformed; false when the request never arrived
    or the vendor answered with an HTTP error, for which it does not bill.
    """

    def __init__(self, reason: str, *, may_have_billed: bool = False) -> None:
        super().__init__(reason)
        self.may_have_billed = may_have_billed


class Provider(ABC):
    """One configured model behind the provider-neutral generate call."""

    name: ClassVar[str]

    def __init__(self, model: str, prices: Prices) -> None:
        self.model = model
        self.input_usd_per_mtok: Decimal = prices.input_usd_per_mtok
        self.output_usd_per_mtok: Decimal = prices.output_usd_per_mtok

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model={self.model!r})"

    @abstractmethod
    def generate(
        self, prompt: str, max_output_tokens: int, timeout: float, context: GenerationContext
    ) -> ProviderReply:
        """Answer within max_output_tokens, or raise ProviderUnavailable."""


class _HTTPProvider(Provider):
    """A vendor reached over HTTP at a base URL from settings, with a key from credentials."""

    credential: ClassVar[Credential]
    key_required: ClassVar[bool] = True
    base_url_field: ClassVar[str]  # the Settings field; its variable is OUROBOROS_<FIELD>

    def __init__(self, model: str, prices: Prices, base_url: str) -> None:
        super().__init__(model, prices)
        self.base_url = base_url

    @classmethod
    def read_key(cls) -> str | None:
        """The key now; Refusal when it is required and missing, or set but unusable."""
        return cls.credential.require() if cls.key_required else cls.credential.read()

    def auth_headers(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    def _headers_for_call(self) -> dict[str, str]:
        # The key is read at each call, so a rotated key file applies and a removed
        # key fails this call only.
        try:
            key = self.read_key()
        except Refusal as exc:
            raise ProviderUnavailable(str(exc)) from None
        return {} if key is None else self.auth_headers(key)


class _Usage(BaseModel):
    input_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0)


class _Part(BaseModel):
    """A typed piece of a vendor reply; only text parts matter here."""

    type: str
    text: str | None = None


class _AnthropicReply(BaseModel):
    content: list[_Part]
    usage: _Usage


class AnthropicProvider(_HTTPProvider):
    """Anthropic Messages API: POST {base}/v1/messages."""

    name = "anthropic"
    credential = Credential("ANTHROPIC_API_KEY")
    base_url_field = "anthropic_base_url"

    def auth_headers(self, key: str) -> dict[str, str]:
        return {"x-api-key": key}

    def generate(
        self, prompt: str, max_output_tokens: int, timeout: float, context: GenerationContext
    ) -> ProviderReply:
        payload = _post_json(
            self.name,
            f"{self.base_url}/v1/messages",
            {**self._headers_for_call(), "anthropic-version": ANTHROPIC_VERSION},
            {
                "model": self.model,
                "max_tokens": max_output_tokens,
                "messages": [{"role": "user", "content": prompt}],
            },
            timeout,
        )
        reply = _parse(self.name, _AnthropicReply, payload)
        text = "".join(b.text for b in reply.content if b.type == "text" and b.text is not None)
        return ProviderReply(
            text=text,
            input_tokens=reply.usage.input_tokens,
            output_tokens=reply.usage.output_tokens,
        )


class _OpenAIItem(BaseModel):
    type: str
    content: list[_Part] | None = None


class _OpenAIReply(BaseModel):
    output: list[_OpenAIItem]
    usage: _Usage


class OpenAIProvider(_HTTPProvider):
    """OpenAI Responses API: POST {base}/v1/responses."""

    name = "openai"
    credential = Credential("OPENAI_API_KEY")
    base_url_field = "openai_base_url"

    def generate(
        self, prompt: str, max_output_tokens: int, timeout: float, context: GenerationContext
    ) -> ProviderReply:
        payload = _post_json(
            self.name,
            f"{self.base_url}/v1/responses",
            self._headers_for_call(),
            {"model": self.model, "input": prompt, "max_output_tokens": max_output_tokens},
            timeout,
        )
        reply = _parse(self.name, _OpenAIReply, payload)
        text = "".join(
            part.text
            for item in reply.output
            for part in item.content or ()
            if part.type == "output_text" and part.text is not None
        )
        return ProviderReply(
            text=text,
            input_tokens=reply.usage.input_tokens,
            output_tokens=reply.usage.output_tokens,
        )


class _ChatMessage(BaseModel):
    content: str | None = None


class _ChatChoice(BaseModel):
    message: _ChatMessage


class _ChatUsage(BaseModel):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)


class _ChatReply(BaseModel):
    choices: list[_ChatChoice]
    usage: _ChatUsage


class OpenAICompatibleProvider(_HTTPProvider):
    """Chat Completions at a configured base URL such as http://host:8000/v1."""

    name = "openai-compatible"
    credential = Credential("OPENAI_COMPATIBLE_API_KEY")
    key_required = False  # local servers usually take none
    base_url_field = "openai_compatible_base_url"

    def generate(
        self, prompt: str, max_output_tokens: int, timeout: float, context: GenerationContext
    ) -> ProviderReply:
        payload = _post_json(
            self.name,
            f"{self.base_url}/chat/completions",
            self._headers_for_call(),
            {
                "model": self.model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_output_tokens,
            },
            timeout,
        )
        reply = _parse(self.name, _ChatReply, payload)
        text = (reply.choices[0].message.content or "") if reply.choices else ""
        return ProviderReply(
            text=text,
            input_tokens=reply.usage.prompt_tokens,
            output_tokens=reply.usage.completion_tokens,
        )


SCRIPTED_MARK = ";; scripted stand-in edit: generation"
_SCRIPTED_LINE = re.compile(rf"^{re.escape(SCRIPTED_MARK)} \d+$", re.MULTILINE)
SCRIPTED_BYTES_PER_TOKEN = 4


def scripted_body(context: GenerationContext) -> str:
    """The organism's committed source with one deterministic edit marking the generation.

    The edit is a comment line, replaced in place if present and appended otherwise,
    so the body stays loadable, changes every generation and does not grow.
    """
    line = f"{SCRIPTED_MARK} {context.generation}"
    source = context.organism_source
    if _SCRIPTED_LINE.search(source):
        return _SCRIPTED_LINE.sub(line, source, count=1)
    separator = "\n" if source and not source.endswith("\n") else ""
    return f"{source}{separator}{line}\n"


class ScriptedProvider(Provider):
    """Offline, keyless, deterministic stand-in for a model; not a model.

    Ignores the prompt and answers with scripted_body(context) after the configured
    latency. Tokens are estimated as bytes / 4, rounded up, and the answer is cut
    at max_output_tokens like a real model's would be.
    """

    name = "scripted"

    def __init__(self, model: str, prices: Prices, latency_seconds: float) -> None:
        super().__init__(model, prices)
        self.latency_seconds = latency_seconds

    def generate(
        self, prompt: str, max_output_tokens: int, timeout: float, context: GenerationContext
    ) -> ProviderReply:
        if self.latency_seconds > timeout:
            time.sleep(timeout)
            raise ProviderUnavailable(f"scripted: no answer within {timeout:g} s")
        time.sleep(self.latency_seconds)
        limit = max_output_tokens * SCRIPTED_BYTES_PER_TOKEN
        answer = scripted_body(context).encode("utf-8")[:limit].decode("utf-8", errors="ignore")
        return ProviderReply(
            text=answer,
            input_tokens=_estimate_tokens(prompt),
            output_tokens=_estimate_tokens(answer),
        )


def _estimate_tokens(text: str) -> int:
    return math.ceil(len(text.encode("utf-8")) / SCRIPTED_BYTES_PER_TOKEN)


HTTP_PROVIDERS: dict[str, type[_HTTPProvider]] = {
    p.name: p for p in (AnthropicProvider, OpenAIProvider, OpenAICompatibleProvider)
}


def make_provider(name: str, model: str | None, settings: InstrumentSettings) -> Provider:
    """The configured provider, or a Refusal saying which setting to fix.

    Checked here, before any sandbox starts: the provider name, its key (present and
    usable; read again at each call), the model, its prices and the base URL. With
    no model, the provider's default model is used; openai-compatible has none.
    """
    require_known(name)
    if name == "scripted":
        model = model or DEFAULT_MODELS[name]
        prices = resolve_prices(name, model, settings)
        return ScriptedProvider(model, prices, settings.scripted_latency_seconds)
    provider = HTTP_PROVIDERS[name]
    provider.read_key()
    model = model or DEFAULT_MODELS.get(name)
    if not model:
        raise Refusal(f"the {name} provider needs a model name: set {MODEL_SETTING} or --model")
    prices = resolve_prices(name, model, settings)
    return provider(model, prices, _base_url(settings, provider.base_url_field))


def _base_url(settings: InstrumentSettings, field: str) -> str:
    # urllib would also open file:// and ftp:// URLs; a base URL must be HTTP(S).
    value = getattr(settings, field) or ""
    parsed = urllib.parse.urlsplit(value)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise Refusal(
            f"OUROBOROS_{field.upper()} must be an http:// or https:// URL, not {value!r}"
        )
    return str(value).rstrip("/")


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect would carry the key's header to whatever host it names: refuse it."""

    def redirect_request(self, *_: object, **__: object) -> None:
        return None


# A 3xx then surfaces as an HTTPError, i.e. a failed call that billed nothing.
_OPENER = urllib.request.build_opener(_NoRedirects)


def _post_json(
    provider: str, url: str, headers: dict[str, str], body: dict[str, Any], timeout: float
) -> object:
    """POST a JSON body and return the decoded JSON reply, or raise ProviderUnavailable.

    Exceptions are re-raised ``from None``: a chained urllib exception would carry
    the request, and with it the key, into any traceback that logs it.
    """
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode("utf-8"),
        headers={"Content-Type": "application/json", **headers},
        method="POST",
    )
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            raw = response.read(MAX_REPLY_BYTES + 1)
    except urllib.error.HTTPError as exc:
        raise ProviderUnavailable(
            f"{provider} answered HTTP {exc.code}{_error_kind(exc)}"
        ) from None
    except urllib.error.URLError as exc:
        # urllib raises URLError only while connecting and sending: nothing was served.
        raise ProviderUnavailable(f"{provider} unreachable: {_describe(exc.reason)}") from None
    except (OSError, http.client.HTTPException) as exc:
        raise ProviderUnavailable(
            f"{provider} connection lost after the request was sent: {_describe(exc)}",
            may_have_billed=True,
        ) from None
    if len(raw) > MAX_REPLY_BYTES:
        raise ProviderUnavailable(
            f"{provider} reply exceeds {MAX_REPLY_BYTES} bytes", may_have_billed=True
        )
    try:
        return json.loads(raw)
    except ValueError:
        raise ProviderUnavailable(f"{provider} reply is not JSON", may_have_billed=True) from None


def _parse(provider: str, shape: type[_Shape], payload: object) -> _Shape:
    try:
        return shape.model_validate(payload)
    except ValidationError as exc:
        where = ".".join(str(part) for part in exc.errors()[0]["loc"])
        raise ProviderUnavailable(
            f"{provider} reply lacks the expected fields (first problem at {where or 'top'})",
            may_have_billed=True,
        ) from None


def _error_kind(exc: urllib.error.HTTPError) -> str:
    """The vendor's error type (e.g. ``overloaded_error``), never its message."""
    try:
        payload = json.loads(exc.read(MAX_ERROR_BODY_BYTES))
    except (OSError, ValueError, http.client.HTTPException):
        return ""
    finally:
        exc.close()
    error = payload.get("error") if isinstance(payload, dict) else None
    kind = error.get("type") if isinstance(error, dict) else None
    return f" ({kind})" if isinstance(kind, str) and _ERROR_KIND.fullmatch(kind) else ""


def _describe(reason: object) -> str:
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    return type(reason).__name__ if isinstance(reason, BaseException) else str(reason)
