"""Model providers: one provider-neutral call, translated to each vendor's HTTP API.

Owns the request and response translation for ``anthropic`` (Messages API),
``openai`` (Responses API), ``openai-compatible`` (Chat Completions at a configured
base URL: vLLM, llama.cpp, Ollama) and ``scripted`` (an offline, deterministic
stand-in), the one base-URL rule they share, and the choice among them with its
refusals. One ``generate`` is one HTTP request: retrying is the model socket's job.
Every provider reduces a vendor reply to text, how the model stopped (complete, cut
at the token limit, refused, or incomplete) and the usage the vendor reported, if
any. Any failure becomes ProviderUnavailable, which says whether the vendor may
have billed the request and whether the same request may succeed later, and whose
message names the provider and the kind of failure but never a key or the vendor's
error prose (which can quote key fragments).

The base URL of every provider is the address its API's ``/v1/...`` paths hang
from, given with or without that ``/v1``: ``https://api.anthropic.com`` and
``https://api.anthropic.com/v1`` both lead to ``https://api.anthropic.com/v1/messages``.

Over 500 lines for that one job: four translations, each a request model, a reply
model and its reading of the vendor's stop reasons and errors, side by side so that a
reader compares them in one place; split per vendor, the shared failure rules would
be copied four times.

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

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from worker.instrument.errors import Refusal
from worker.instrument.model.catalogue import model_of, require_known
from worker.instrument.model.credentials import Credential
from worker.instrument.model.prices import Prices, resolve_prices
from worker.instrument.model.retry import retry_after_seconds, should_retry
from worker.instrument.records import StopReason
from worker.instrument.settings import InstrumentSettings

ANTHROPIC_VERSION = "2023-06-01"
# A vendor reply larger than this is not a reply to a prompt of at most a few
# hundred KiB with at most tens of thousands of output tokens.
MAX_REPLY_BYTES = 32 * 1024 * 1024
MAX_ERROR_BODY_BYTES = 64 * 1024
_ERROR_KIND = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# The statuses by which a vendor calls a request itself invalid (ProviderUnavailable).
INVALID_REQUEST_STATUSES = (400, 422)
_Shape = TypeVar("_Shape", bound=BaseModel)


class GenerationContext(BaseModel):
    """What the model socket knows about the generation it serves (for the scripted stand-in)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lineage: str
    generation: int
    organism_source: str


class ProviderReply(BaseModel):
    """The text of one model answer, how the model stopped, and the usage it reported.

    Usage is None (both figures) when the vendor's reply carried none, which Chat
    Completions allows: the socket then charges the call's whole reservation.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str
    stop_reason: StopReason
    input_tokens: int | None = Field(ge=0)
    output_tokens: int | None = Field(ge=0)

    @model_validator(mode="after")
    def _usage_whole_or_absent(self) -> ProviderReply:
        if (self.input_tokens is None) != (self.output_tokens is None):
            raise ValueError("usage is reported whole (input and output) or not at all")
        return self

    @property
    def usage_reported(self) -> bool:
        return self.input_tokens is not None


class ProviderUnavailable(Exception):
    """The model gave no usable answer.

    may_have_billed says whether the vendor may have served (and billed) the request
    although we got no usable reply: true once the whole request was sent and the
    answer was lost, timed out or malformed; false when the request never arrived
    or the vendor answered with an HTTP error, for which it does not bill.

    retryable says whether the same request may succeed later (a rate limit, an
    overload, a server error, a lost connection, a stall); retry_after is the wait in
    seconds the vendor asked for, if any; status is the vendor's HTTP status, if any.

    refused says whether the provider said no in a way waiting will not fix: a 4xx
    it does not call passing (401, 403, 404, ...), a redirect (the base URL is not the
    API's) or a key the worker cannot read. invalid says the vendor called the request
    itself invalid (400 or 422, not passing): an unknown model, or a prompt over the
    model's context window, which the organism can provoke; only the socket, which
    sees the generation's other calls, can tell the two apart, so it is not refused
    here. Every other failure is a passing one, or one the vendor's own fault may
    explain (a reply cut short or malformed).
    """

    def __init__(
        self,
        reason: str,
        *,
        may_have_billed: bool = False,
        retryable: bool = False,
        retry_after: float | None = None,
        status: int | None = None,
        refused: bool = False,
    ) -> None:
        super().__init__(reason)
        self.may_have_billed = may_have_billed
        self.retryable = retryable
        self.retry_after = retry_after
        self.status = status
        self.invalid = not retryable and status in INVALID_REQUEST_STATUSES
        self.refused = refused or (
            not retryable and status is not None and 300 <= status < 500 and not self.invalid
        )


class Provider(ABC):
    """One configured model behind the provider-neutral generate call."""

    name: ClassVar[str]
    # Whether calls count against the fleet-wide cap of the provider: a vendor's rate
    # limits are shared by every worker; an offline stand-in has none.
    capped: ClassVar[bool] = True

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
        """One request: answer within max_output_tokens, or raise ProviderUnavailable.

        timeout bounds connecting and each wait for the vendor's next byte.
        """


class _HTTPProvider(Provider):
    """A vendor reached over HTTP at a base URL from settings, with a key from credentials."""

    credential: ClassVar[Credential]
    key_required: ClassVar[bool] = True
    base_url_field: ClassVar[str]  # the Settings field; its variable is OUROBOROS_<FIELD>

    def __init__(self, model: str, prices: Prices, base_url: str) -> None:
        super().__init__(model, prices)
        self.base_url = base_url

    def endpoint(self, path: str) -> str:
        """The URL of ``/v1{path}``: the base is taken with or without its ``/v1``."""
        base = self.base_url.rstrip("/")
        return f"{base.removesuffix('/v1')}/v1{path}"

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
            raise ProviderUnavailable(str(exc), refused=True) from None
        return {} if key is None else self.auth_headers(key)


class _Usage(BaseModel):
    input_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0)


class _Part(BaseModel):
    """A typed piece of a vendor reply; text parts are the answer, refusals say why not."""

    type: str
    text: str | None = None
    refusal: str | None = None


class _AnthropicReply(BaseModel):
    content: list[_Part]
    stop_reason: str | None = None
    usage: _Usage | None = None


# Anthropic's stop_reason values. tool_use and pause_turn cannot end a finished text
# answer (no tools are offered); model_context_window_exceeded cuts it like max_tokens
# but is not the limit the organism asked for. Anything unknown is incomplete too.
_ANTHROPIC_STOPS: dict[str, StopReason] = {
    "end_turn": "complete",
    "stop_sequence": "complete",
    "max_tokens": "max_tokens",
    "refusal": "refused",
}


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
            self.endpoint("/messages"),
            {**self._headers_for_call(), "anthropic-version": ANTHROPIC_VERSION},
            {
                "model": self.model,
                "max_tokens": max_output_tokens,
                "messages": [{"role": "user", "content": prompt}],
            },
            timeout,
        )
        reply = _parse(self.name, _AnthropicReply, payload)
        # Thinking blocks are the model's working, not its answer.
        text = "".join(b.text for b in reply.content if b.type == "text" and b.text is not None)
        stop = _ANTHROPIC_STOPS.get(reply.stop_reason or "", "incomplete")
        return _reply(text, stop, reply.usage)


class _OpenAIItem(BaseModel):
    type: str
    content: list[_Part] | None = None


class _IncompleteDetails(BaseModel):
    reason: str | None = None


class _OpenAIReply(BaseModel):
    status: str | None = None
    incomplete_details: _IncompleteDetails | None = None
    output: list[_OpenAIItem]
    usage: _Usage | None = None


# incomplete_details.reason of a Responses reply whose status is "incomplete".
_OPENAI_INCOMPLETE: dict[str, StopReason] = {
    "max_output_tokens": "max_tokens",
    "content_filter": "refused",
}


class OpenAIProvider(_HTTPProvider):
    """OpenAI Responses API: POST {base}/v1/responses, never stored by the vendor."""

    name = "openai"
    credential = Credential("OPENAI_API_KEY")
    base_url_field = "openai_base_url"

    def generate(
        self, prompt: str, max_output_tokens: int, timeout: float, context: GenerationContext
    ) -> ProviderReply:
        payload = _post_json(
            self.name,
            self.endpoint("/responses"),
            self._headers_for_call(),
            {
                "model": self.model,
                "input": prompt,
                "max_output_tokens": max_output_tokens,
                # The default keeps prompt and answer at the vendor for 30 days; the
                # observation is the record, and nothing refers to a stored response.
                "store": False,
            },
            timeout,
        )
        reply = _parse(self.name, _OpenAIReply, payload)
        parts = [part for item in reply.output for part in item.content or ()]
        text = "".join(p.text for p in parts if p.type == "output_text" and p.text is not None)
        stop: StopReason
        if reply.status == "completed":
            refused = any(p.type == "refusal" for p in parts)
            stop = "refused" if refused and not text else "complete"
        elif reply.status == "incomplete":
            reason = reply.incomplete_details.reason if reply.incomplete_details else None
            stop = _OPENAI_INCOMPLETE.get(reason or "", "incomplete")
        else:
            stop = "incomplete"
        return _reply(text, stop, reply.usage)


class _ChatMessage(BaseModel):
    content: str | None = None
    refusal: str | None = None


class _ChatChoice(BaseModel):
    message: _ChatMessage
    finish_reason: str | None = None


class _ChatUsage(BaseModel):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)


class _ChatReply(BaseModel):
    choices: list[_ChatChoice]
    usage: _ChatUsage | None = None


# finish_reason of a Chat Completions choice; tool and function calls, a missing reason
# and anything unknown are incomplete.
_CHAT_STOPS: dict[str, StopReason] = {
    "stop": "complete",
    "length": "max_tokens",
    "content_filter": "refused",
}


class OpenAICompatibleProvider(_HTTPProvider):
    """Chat Completions at a configured base URL such as http://host:8000/v1.

    The output limit goes in ``max_completion_tokens`` (OpenAI's current field, the
    only one its reasoning models take) or, for a server that knows only the older
    one, ``max_tokens``: the setting OUROBOROS_OPENAI_COMPATIBLE_MAX_TOKENS_FIELD.
    """

    name = "openai-compatible"
    credential = Credential("OPENAI_COMPATIBLE_API_KEY")
    key_required = False  # local servers usually take none
    base_url_field = "openai_compatible_base_url"

    def __init__(self, model: str, prices: Prices, base_url: str, max_tokens_field: str) -> None:
        super().__init__(model, prices, base_url)
        self.max_tokens_field = max_tokens_field

    def generate(
        self, prompt: str, max_output_tokens: int, timeout: float, context: GenerationContext
    ) -> ProviderReply:
        payload = _post_json(
            self.name,
            self.endpoint("/chat/completions"),
            self._headers_for_call(),
            {
                "model": self.model,
                "messages": [{"role": "user", "content": prompt}],
                self.max_tokens_field: max_output_tokens,
            },
            timeout,
        )
        reply = _parse(self.name, _ChatReply, payload)
        if not reply.choices:
            return _reply("", "incomplete", _chat_usage(reply.usage))
        choice = reply.choices[0]
        text = choice.message.content or ""
        stop = _CHAT_STOPS.get(choice.finish_reason or "", "incomplete")
        if choice.message.refusal and not text:
            stop = "refused"
        return _reply(text, stop, _chat_usage(reply.usage))


def _chat_usage(usage: _ChatUsage | None) -> _Usage | None:
    if usage is None:
        return None
    return _Usage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens)


def _reply(text: str, stop: StopReason, usage: _Usage | None) -> ProviderReply:
    """A vendor's answer, neutral; a reply cut at the limit before any text is incomplete.

    A reasoning model can spend every granted token before it writes a word: that
    empty answer is no cut-off text but no answer at all.
    """
    if stop == "max_tokens" and not text:
        stop = "incomplete"
    return ProviderReply(
        text=text,
        stop_reason=stop,
        input_tokens=usage.input_tokens if usage else None,
        output_tokens=usage.output_tokens if usage else None,
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
    at max_output_tokens like a real model's would be, and then says so (max_tokens).
    """

    name = "scripted"
    capped = False

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
        whole = scripted_body(context).encode("utf-8")
        answer = whole[:limit].decode("utf-8", errors="ignore")
        return ProviderReply(
            text=answer,
            stop_reason="complete" if len(whole) <= limit else "max_tokens",
            input_tokens=_estimate_tokens(prompt),
            output_tokens=_estimate_tokens(answer),
        )


class ScriptedKnobs(BaseSettings):
    """The scripted stand-in's knob for benchmarks, read from the environment alone.

    Not an instrument setting (``InstrumentSettings`` holds only what decides or records
    a real generation): ``OUROBOROS_SCRIPTED_LATENCY_SECONDS`` makes the stand-in take
    that long to answer, as a model would.
    """

    model_config = SettingsConfigDict(env_prefix="OUROBOROS_SCRIPTED_", extra="ignore")

    latency_seconds: float = Field(0.0, ge=0, le=600)


def scripted_latency_seconds() -> float:
    try:
        return ScriptedKnobs().latency_seconds
    except ValidationError as exc:
        raise Refusal(
            f"OUROBOROS_SCRIPTED_LATENCY_SECONDS: {exc.errors()[0]['msg']}; unset it or give "
            "seconds from 0 to 600"
        ) from None


def _estimate_tokens(text: str) -> int:
    return math.ceil(len(text.encode("utf-8")) / SCRIPTED_BYTES_PER_TOKEN)


HTTP_PROVIDERS: dict[str, type[_HTTPProvider]] = {
    p.name: p for p in (AnthropicProvider, OpenAIProvider, OpenAICompatibleProvider)
}


def make_provider(
    name: str, model: str | None, settings: InstrumentSettings, prices: Prices | None = None
) -> Provider:
    """The configured provider, or a Refusal saying which setting to fix.

    Checked here, before any sandbox starts: the provider name, its key (present and
    usable; read again at each call), the model, its prices and the base URL. With
    no model, the provider's default model is used; openai-compatible has none.
    prices: the run's own (they travel with its jobs); None: this worker's.
    """
    require_known(name)
    if name == "scripted":
        model = model_of(name, model)
        prices = prices or resolve_prices(name, model, settings)
        return ScriptedProvider(model, prices, scripted_latency_seconds())
    provider = HTTP_PROVIDERS[name]
    provider.read_key()
    model = model_of(name, model)
    prices = prices or resolve_prices(name, model, settings)
    base_url = _base_url(settings, provider.base_url_field)
    if provider is OpenAICompatibleProvider:
        return OpenAICompatibleProvider(
            model, prices, base_url, settings.openai_compatible_max_tokens_field
        )
    return provider(model, prices, base_url)


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
        headers = {name.lower(): value for name, value in (exc.headers or {}).items()}
        raise ProviderUnavailable(
            f"{provider} answered HTTP {exc.code}{_error_kind(exc)}",
            retryable=should_retry(exc.code, headers),
            retry_after=retry_after_seconds(headers),
            status=exc.code,
        ) from None
    except urllib.error.URLError as exc:
        # urllib raises URLError only while connecting and sending: nothing was served.
        raise ProviderUnavailable(
            f"{provider} unreachable: {_describe(exc.reason)}", retryable=True
        ) from None
    except TimeoutError:
        raise ProviderUnavailable(
            f"{provider} stalled: nothing for {timeout:g} s after the request was sent",
            may_have_billed=True,
            retryable=True,
        ) from None
    except (OSError, http.client.HTTPException) as exc:
        raise ProviderUnavailable(
            f"{provider} connection lost after the request was sent: {_describe(exc)}",
            may_have_billed=True,
            retryable=True,
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
