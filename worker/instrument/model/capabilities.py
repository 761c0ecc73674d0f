"""The model socket's ABI as the sandbox sees it, and the manifest that discloses it.

Owns the provider-neutral ABI's names (the socket's and the journal's paths inside
the sandbox, ``POST /generate``, the request and answer headers) and
``capabilities``, the manifest written to ``/kernel/capabilities.json``: the ABI, its
limits (from ``limits``) and the generation's physics, in provider-neutral terms.

Trusts the physics it is given. Never discloses a provider, model, price, URL or key.
"""

from __future__ import annotations

from typing import Any

from worker.instrument import syscall_filter
from worker.instrument.model import limits
from worker.instrument.physics import Physics

CAPABILITIES_SCHEMA = "ouroboros-capabilities/v1"
SANDBOX_SOCKET = "/kernel/model.sock"
SANDBOX_JOURNAL = "/kernel/journal.md"
GENERATE_PATH = "/generate"
MAX_TOKENS_HEADER = "X-Ouroboros-Max-Output-Tokens"
STOP_REASON_HEADER = "X-Ouroboros-Stop-Reason"


def capabilities(physics: Physics) -> dict[str, Any]:
    """The manifest for /kernel/capabilities.json: the ABI and the constraints, nothing else.

    Inert data in provider-neutral terms; never a provider, model, price, URL or key.
    """
    return {
        "schema": CAPABILITIES_SCHEMA,
        "operations": {
            "generate": {
                "transport": "HTTP/1.1 over a Unix stream socket; one request per connection",
                "socket": SANDBOX_SOCKET,
                "method": "POST",
                "path": GENERATE_PATH,
                "request": {
                    "body": "the prompt as raw UTF-8, 1 to max_prompt_bytes bytes",
                    "headers": {
                        "Host": "required by HTTP/1.1: any value",
                        "Content-Length": "required: the body's size in bytes",
                        MAX_TOKENS_HEADER: (
                            "optional: an integer from 1 to max_output_tokens; "
                            "max_output_tokens when absent"
                        ),
                    },
                },
                "responses": {
                    "200": (
                        "the model's answer as raw UTF-8 (text/plain; charset=utf-8), "
                        f"with the header {STOP_REASON_HEADER}"
                    ),
                    "400": "invalid request; the body says what is wrong",
                    "402": "budget exhausted; nothing was sent to the model",
                    "429": "call limit of the generation reached; nothing was sent",
                    "502": (
                        "model unavailable: every attempt failed, or no answer within "
                        "model_timeout_seconds or before model_margin_seconds from the "
                        "end of wall_seconds, or the call came after that deadline"
                    ),
                },
                "response_headers": {
                    STOP_REASON_HEADER: {
                        "on": "every 200",
                        "values": {
                            "complete": "the model finished its answer",
                            "max_tokens": (
                                "the answer was cut at the granted output tokens; the body "
                                "is the text up to the cut"
                            ),
                            "refused": "the model declined to answer; the body may be empty",
                            "incomplete": (
                                "the model stopped short for another reason, or spent every "
                                "granted token before writing any answer (reasoning)"
                            ),
                        },
                        "advice": "only a complete answer is whole",
                    },
                },
                "retries": (
                    "a call the model could not answer for a passing reason (rate limit, "
                    "overload, server error, lost connection, stall) is tried again after "
                    "a backoff, as long as model_timeout_seconds and the life's wall time "
                    "less model_margin_seconds allow; the fleet also caps the calls made to "
                    "the model at once and per minute, and waiting for that cap counts "
                    "against the same time"
                ),
                "limits": {
                    "connections": {
                        "max": limits.MAX_CONNECTIONS,
                        "beyond": "503 at once, then closed; nothing waits for a free one",
                    },
                    "request_head_bytes": {
                        "max": limits.MAX_HEAD_BYTES,
                        "beyond": "431, then closed; counts the request line and headers",
                    },
                    "request_seconds": {
                        "max": limits.REQUEST_SECONDS,
                        "beyond": "408, then closed; from connecting to the body's last byte",
                    },
                    "answer_seconds": {
                        "max": limits.ANSWER_SECONDS,
                        "beyond": "closed unanswered; the call is audited and charged still",
                    },
                    "requests_per_connection": {
                        "max": 1,
                        "beyond": "never read: every answer carries Connection: close",
                    },
                    "calls_per_generation": {
                        "max": limits.MAX_CALLS,
                        "beyond": "429 and nothing sent to the model; only counted",
                    },
                    "audited_text_bytes": {
                        "max": limits.AUDIT_TEXT_BYTES,
                        "beyond": "later prompts and answers audited by size and sha256 only",
                    },
                    "refused_text_bytes": {
                        "max": limits.REFUSED_TEXT_BYTES,
                        "beyond": (
                            "later calls answered without reaching the model (400, 402, "
                            "502 too late) audited by size and sha256 only"
                        ),
                    },
                },
                "spending": (
                    "each call first reserves its worst case from budget_usd: every prompt "
                    "byte plus 4096 tokens as input and every granted output token as "
                    "output. An answered call is then charged its reported usage (its "
                    "whole reservation when the model reports none), a failed attempt "
                    "nothing, and an attempt whose answer was lost after the model "
                    "received it its whole reservation; a call tries again after such a "
                    "loss only if the budget can cover another worst case"
                ),
            },
            "journal": {"path": SANDBOX_JOURNAL, "access": "read-only"},
        },
        "constraints": {
            **physics.model_dump(mode="json"),
            "cpu_quota_percent": physics.cpu_quota_percent,
            "archive_cap_bytes": physics.archive_cap_bytes,
            "network": "none",
            "syscall_filter": {
                "digest": syscall_filter.DIGEST,
                "refused": "EPERM (clone3: ENOSYS, so that libc falls back to clone)",
            },
        },
    }
