"""The fleet's sources in words: which one did not answer, where it is, and why.

Owns naming the broker, the observation store and the shared repository as a user
configured them (the URL, without its password, and the variable that sets it) and
saying why a connection failed from the operating system's error under the client's, so that
no client error text (``Error 111 connecting to ...``) reaches a user. ``status``,
``run --follow`` and ``doctor`` word an unanswered source through here.

Trusts: the settings; reads exceptions only for their types and errno.
"""

from __future__ import annotations

import errno
import socket
from typing import Literal

from worker.fleet.settings import Settings
from worker.instrument.store import redact_url

Source = Literal["broker", "store", "repository"]
UNKNOWN_REASON = "cannot be reached"
# Each source's name in a sentence.
NOUNS: dict[Source, str] = {
    "broker": "broker",
    "store": "observation store",
    "repository": "shared repository",
}


def unreachable(exc: BaseException) -> str:
    """Why a connection failed, in words, from the operating system's error under it."""
    cause: BaseException | None = exc
    while cause is not None and not (isinstance(cause, OSError) and cause.errno):
        cause = cause.__cause__ or cause.__context__
    code = cause.errno if isinstance(cause, OSError) else None
    reasons = {
        errno.ECONNREFUSED: "refused the connection: nothing listens there",
        errno.ENOENT: "has no socket at that path: nothing listens there",
        errno.EACCES: "may not be opened by this user (permission denied)",
        errno.EHOSTUNREACH: "is unreachable: no route to the host",
        errno.ENETUNREACH: "is unreachable: no route to the network",
        errno.ETIMEDOUT: "did not answer in time (a firewall, or a host that is down)",
    }
    if code in reasons:
        return reasons[code]
    if isinstance(cause, socket.gaierror):
        return "names a host that does not resolve"
    return UNKNOWN_REASON


def named(source: Source, settings: Settings) -> str:
    """The source as configured: what it is, where, and the variable that says so."""
    if source == "broker":
        if not settings.broker_url:
            return (
                f"the embedded broker ({settings.broker}, under OUROBOROS_HOME; "
                "OUROBOROS_BROKER_URL names another)"
            )
        return f"the broker (OUROBOROS_BROKER_URL={redact_url(settings.broker)})"
    if source == "repository":
        if settings.lineage_repos:
            homes = ", ".join(f"{h}={redact_url(u)}" for h, u in settings.lineage_homes.items())
            return f"the shared repositories (OUROBOROS_LINEAGE_REPOS: {homes})"
        repository = redact_url(settings.lineage_repo_url)
        return f"the shared repository (OUROBOROS_LINEAGE_REPO={repository})"
    store = redact_url(settings.observations_url)
    where = f" at {settings.s3_endpoint_url}" if settings.s3_endpoint_url else ""
    return f"the observation store (OUROBOROS_OBSERVATIONS={store}{where})"


def why(source: Source, settings: Settings, exc: BaseException) -> str:
    """One line: which source did not answer, where it is configured, and why."""
    reason = unreachable(exc)
    if reason == UNKNOWN_REASON:
        # No operating system error to word: the client's own first line, as it said it.
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        reason = f"did not answer ({redact_url(first)})"
    return f"{named(source, settings)} {reason}"
