"""The two tiers of the suite: ``--fast`` runs, in this process, every test that needs no
process, service or sandbox; without it the whole suite runs, the fast tests included.

A test is in the full tier only when one of these says so:

* a marker: ``full`` (it starts a process, or speaks to a service, a sandbox or the
  machine's cgroups), or one of the markers that imply it (``root``, ``bwrap``,
  ``cgroups``, ``browser``, ``compose``, ``soak``, ``vm``);
* a fixture that is a service or starts one (``FULL_TIER_FIXTURES``), or the ``s3``
  case of ``observation_store``.

The tier is enforced, not a convention: under ``--fast`` each test runs with process
creation (``subprocess``, ``os.fork``/``posix_spawn``/``exec*``/``system``,
``multiprocessing``) refused, and with ``connect`` refused to any address no socket of
this process is bound to (an in-process server, a socket pair and a Unix socket the
test made stay allowed; Redis, moto or any other service does not). The refusal raises
``FullTierOnly`` where the call was made, and the test fails with its message even if
the code under test caught it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import multiprocessing.process
import os
import socket
import subprocess
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

FULL_MARKERS = ("full", "root", "bwrap", "cgroups", "browser", "compose", "soak", "vm")
FULL_TIER_FIXTURES = frozenset(
    {
        "redis_url",
        "fleet",
        "workers",
        "s3_endpoint",
        "s3_bucket",
        "s3_settings",
        "s3_store",
        "private_redis",
        "private_redis_server",
        "served_sample",
        "machine_to_itself",
    }
)
PROCESS_CALLS = (
    "fork",
    "forkpty",
    "posix_spawn",
    "posix_spawnp",
    "execv",
    "execve",
    "execvp",
    "execvpe",
    "system",
)


class FullTierOnly(RuntimeError):
    """What a test of the fast tier did that only the full tier may do."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fast",
        action="store_true",
        help="run only the fast tier: tests that need no process, service or sandbox",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "full: starts a process or needs a service, a sandbox or cgroups (full tier only)",
    )
    if config.getoption("fast"):
        # pyseccomp finds libseccomp on import with ctypes' find_library, which runs
        # `ldconfig -p`: a process of the session, not of whichever test imports it first.
        importlib.import_module("pyseccomp")
        # For the whole session: a server a module- or session-scoped fixture bound
        # during an earlier test is still this process's own.
        original_bind = socket.socket.bind

        def bind(self: socket.socket, address: Any) -> None:
            original_bind(self, address)
            _BOUND.add(_key(self.family, self.getsockname()))

        config.stash[_BIND] = socket.socket.__dict__.get("bind", _INHERITED)
        socket.socket.bind = bind  # type: ignore[method-assign]


def pytest_unconfigure(config: pytest.Config) -> None:
    if _BIND in config.stash:
        _restore(socket.socket, "bind", config.stash[_BIND])


def in_full_tier(item: pytest.Item) -> bool:
    if any(item.get_closest_marker(name) for name in FULL_MARKERS):
        return True
    if FULL_TIER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return True
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("observation_store") == "s3"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("fast"):
        return
    kept, full = [], []
    for item in items:
        (full if in_full_tier(item) else kept).append(item)
    if full:
        config.hook.pytest_deselected(items=full)
        items[:] = kept


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not item.config.getoption("fast"):
        return (yield)
    with _refusing(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    refused: list[str] = item.stash.get(_REFUSED, [])
    if refused:
        if report.outcome != "failed":
            report.outcome = "failed"
            report.longrepr = "\n".join(refused)
        refused.clear()
    return report


_REFUSED = pytest.StashKey[list[str]]()
_INHERITED = object()
# Every address a socket of this process has been bound to (under --fast).
_BOUND: set[Any] = set()
_BIND = pytest.StashKey[Any]()


@contextmanager
def _refusing(item: pytest.Item) -> Iterator[None]:
    refused = item.stash.setdefault(_REFUSED, [])

    def refuse(what: str) -> FullTierOnly:
        message = (
            f"{item.nodeid} {what}: it belongs in the full tier (mark it "
            "@pytest.mark.full, or use a fixture that is a service); --fast runs only "
            "tests that need no process, service or sandbox"
        )
        refused.append(message)
        return FullTierOnly(message)

    def process(name: str) -> Callable[..., Any]:
        def refused_call(*args: Any, **kwargs: Any) -> Any:
            raise refuse(f"started a process ({name})")

        return refused_call

    original_connect = socket.socket.connect
    original_connect_ex = socket.socket.connect_ex

    def checked(connect: Callable[[socket.socket, Any], Any]) -> Callable[..., Any]:
        @functools.wraps(connect)
        def connecting(self: socket.socket, address: Any) -> Any:
            if _key(self.family, address) not in _BOUND and not listening_here(address):
                raise refuse(f"connected to a service at {address!r}")
            return connect(self, address)

        return connecting

    patches: list[tuple[Any, str, Any]] = [
        (subprocess.Popen, "_execute_child", process("subprocess")),
        (multiprocessing.process.BaseProcess, "start", process("multiprocessing")),
        (socket.socket, "connect", checked(original_connect)),
        (socket.socket, "connect_ex", checked(original_connect_ex)),
        *((os, name, process(f"os.{name}")) for name in PROCESS_CALLS if hasattr(os, name)),
    ]
    # connect is inherited by socket.socket: its own __dict__ lacks it.
    saved = [(owner, name, owner.__dict__.get(name, _INHERITED)) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, value in saved:
            _restore(owner, name, value)


def _restore(owner: Any, name: str, value: Any) -> None:
    if value is _INHERITED:
        delattr(owner, name)
    else:
        setattr(owner, name, value)


def listening_here(address: Any) -> bool:
    """Whether a TCP socket of this very process listens on ``address``'s port: asked of
    the kernel, for a listener whose bind the watch above did not see (one bound before
    the session, or while another plugin held ``socket.socket.bind``)."""
    if not (isinstance(address, tuple) and len(address) >= 2 and isinstance(address[1], int)):
        return False
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                mine.add(target[len("socket:[") : -1])
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                # local address, state 0A (LISTEN), inode
                port = int(fields[1].rsplit(":", 1)[1], 16)
                if port == address[1] and fields[3] == "0A" and fields[9] in mine:
                    return True
    return False


def _key(family: int, address: Any) -> Any:
    """An address as bound and as connected to compare equal: a TCP port bound on any or
    on a loopback address is the same listener to a client of this process."""
    if family in (socket.AF_INET, socket.AF_INET6):
        return ("inet", address[1])
    return (family, address if isinstance(address, str | bytes) else str(address))
