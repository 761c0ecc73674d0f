"""``schedule-lineage doctor``: what this host has and lacks for the fleet.

Owns the list of host checks (bwrap, emacs, git, the ceiling driver's preflight, the
broker, the shared repository, the observation store, provider keys). A local
repository or file store must be writable by this user, not only reachable: a file
is created and removed in it (``worker.fleet.places``), since root passes every mode
check but not a read-only mount or an immutable directory. The broker's
is told in words: an embedded broker that is not running is fine (it starts on
demand), distinct from a configured broker that is refused, unreachable or unnamed;
no client error text is shown. A provider key
check reports only whether a key is present and where it would be read from, never
its value.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from collections.abc import Callable

import redis
from pydantic import BaseModel

from scheduler.sources import unreachable
from worker.fleet import embedded_redis, redis_keys
from worker.fleet.assembly import observation_store
from worker.fleet.homes import Homes
from worker.fleet.places import places, unwritable
from worker.fleet.settings import Settings
from worker.instrument.ceilings import select_ceiling
from worker.instrument.model.credentials import Credential
from worker.instrument.model.providers import HTTP_PROVIDERS
from worker.instrument.names import DEFAULT_HOME
from worker.instrument.sandbox import resolve_emacs


class Check(BaseModel):
    name: str
    ok: bool
    detail: str
    essential: bool = True


def _binary(name: str, hint: str) -> Check:
    path = shutil.which(name)
    if path is None:
        return Check(name=name, ok=False, detail=f"not found; {hint}")
    version = subprocess.run([path, "--version"], capture_output=True, text=True)
    first = (version.stdout or version.stderr).splitlines()
    return Check(name=name, ok=True, detail=f"{path} ({first[0] if first else 'unknown version'})")


def _attempt(name: str, probe: Callable[[], str]) -> Check:
    try:
        return Check(name=name, ok=True, detail=probe())
    except Exception as exc:  # every failure is a finding to report, not a crash
        return Check(
            name=name, ok=False, detail=str(exc).splitlines()[0] if str(exc) else repr(exc)
        )


def _ceiling(settings: Settings) -> str:
    ceiling = select_ceiling(settings.ceiling, settings.cgroup_parent)
    placement = ceiling.placement()
    return f"{ceiling.name} driver works" + (f" ({placement})" if placement else "")


def checks(settings: Settings) -> list[Check]:
    results = [
        _binary("bwrap", "install bubblewrap (scripts/setup.sh)"),
        _attempt("emacs", lambda: str(resolve_emacs())),
        _binary("git", "install git (scripts/setup.sh)"),
        _attempt("ceiling", lambda: _ceiling(settings)),
        _broker(settings),
        _attempt("repository", lambda: _repository(settings)),
        _attempt("store", lambda: _store_probe(settings)),
    ]
    for provider in HTTP_PROVIDERS.values():
        credential = provider.credential
        results.append(
            _attempt(
                credential.variable,
                functools.partial(_presence, credential),
            ).model_copy(update={"essential": False})
        )
    return results


def _broker(settings: Settings) -> Check:
    """The broker, in words: embedded and idle is fine (it starts on demand); broken is not."""
    if not settings.broker_url:
        if embedded_redis.running(settings):
            return Check(
                name="broker", ok=True, detail=f"embedded Redis at {settings.redis_socket} answers"
            )
        server = shutil.which("redis-server")
        if server is None:
            return Check(
                name="broker",
                ok=False,
                detail="embedded broker cannot start: redis-server is not installed; run "
                "scripts/setup.sh or set OUROBOROS_BROKER_URL",
            )
        return Check(
            name="broker",
            ok=True,
            detail=f"embedded broker not running (it starts on demand, with {server}, "
            f"at the first run or worker, and stops after "
            f"{settings.embedded_redis_idle_seconds:g} s idle; socket {settings.redis_socket})",
        )
    where = _redacted(settings.broker)
    try:
        redis_keys.redis_client(settings).ping()
    except redis.AuthenticationError:
        problem = "refused the credentials in OUROBOROS_BROKER_URL"
    except redis.ResponseError as exc:
        problem = f"answered with an error ({str(exc).split()[0] if str(exc) else 'unknown'})"
    except redis.TimeoutError:
        problem = "did not answer in time (a firewall, or an overloaded server)"
    except (redis.ConnectionError, OSError) as exc:
        problem = unreachable(exc)
    else:
        return Check(name="broker", ok=True, detail=f"{where} answers")
    return Check(name="broker", ok=False, detail=f"{where} {problem}")


def _repository(settings: Settings) -> str:
    homes = Homes(settings, "scheduler")
    for home in settings.lineage_homes:
        homes.cache(home).ls_remote("refs/heads/*")  # a Refusal if unreadable
    reached = ", ".join(
        url if home == DEFAULT_HOME else f"{url} (home {home})"
        for home, url in settings.lineage_homes.items()
    )
    return f"{reached} reachable{_writable(settings, repository=True)}"


def _presence(credential: Credential) -> str:
    # Reads the key only to learn that it exists; the value never leaves here.
    if credential.read() is None:
        raise LookupError("absent")
    return "present"


def _store_probe(settings: Settings) -> str:
    store = observation_store(settings)
    listed = len(store.list("lineages/"))
    return f"{store.url} lists {listed} objects{_writable(settings, repository=False)}"


def _writable(settings: Settings, *, repository: bool) -> str:
    """ ", writable" for local repositories (every home's; or the file store) this user can
    write; else raises."""
    local = [place for place in places(settings) if place.repository == repository]
    for place in local:
        if not place.present():
            raise LookupError(f"no {place.what} at {place.path} (schedule-lineage init makes one)")
        for directory in place.writable_dirs():
            if (problem := unwritable(directory)) is not None:
                raise PermissionError(f"{place.path} is reachable but not writable ({problem})")
    return ", writable" if local else ""


def _redacted(url: str) -> str:
    """A broker URL without its password."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.split('@', 1)[1]}"
