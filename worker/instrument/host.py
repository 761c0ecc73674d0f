"""The host side of a pipeline: the facts it is built with and the sandbox that lives a life.

Owns ``HostFacts`` (the emacs binary, the versions of bwrap and emacs, the host's name,
the ceiling driver's name and the identities lives run under), ``probe_host``, which
finds them once where a pipeline is built (``worker.fleet.assembly.build_pipeline``,
for the worker and ``run --local`` alike), and ``Sandbox``: what the pipeline asks of a
sandbox, one life in a prepared kernel directory. ``BwrapSandbox`` is the real one,
``worker.instrument.sandbox.run_sandbox`` under the host's ceiling. So the pipeline
itself probes nothing and starts nothing: given a stand-in sandbox, its planning,
judging, committing, rollback and publication run in this process alone.

Trusts the host's PATH for emacs and bwrap (checked by ``resolve_emacs`` and the
identity probe) and the ceiling driver it is given.
"""

from __future__ import annotations

import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import NamedTuple, Protocol

from worker.instrument.ceilings import Ceiling
from worker.instrument.identity import IdentityPool, SandboxIdentity
from worker.instrument.physics import Physics
from worker.instrument.sandbox import SandboxResult, resolve_emacs, run_sandbox, sweep_kernel_dirs
from worker.instrument.settings import InstrumentSettings


class Identities(Protocol):
    """Where a life's identity comes from: one held for each life (``IdentityPool``)."""

    def hold(self) -> AbstractContextManager[SandboxIdentity]: ...


class Sandbox(Protocol):
    """One life of the organism in ``kernel`` (prepared, owned by ``identity``) under
    ``physics``; every way the organism can end is a result, never an exception."""

    def live(
        self, kernel: Path, physics: Physics, label: str, identity: SandboxIdentity
    ) -> SandboxResult: ...


class HostFacts(NamedTuple):
    """What a pipeline knows of its host, found once before its first generation."""

    name: str
    emacs: Path
    emacs_version: str
    bwrap_version: str
    ceiling_driver: str
    identities: Identities


class BwrapSandbox:
    """The real sandbox: bubblewrap and emacs inside the ceiling's scope."""

    def __init__(self, ceiling: Ceiling, emacs: Path) -> None:
        self.ceiling = ceiling
        self.emacs = emacs

    def live(
        self, kernel: Path, physics: Physics, label: str, identity: SandboxIdentity
    ) -> SandboxResult:
        return run_sandbox(kernel, physics, self.ceiling, label, self.emacs, identity)


def probe_host(settings: InstrumentSettings, ceiling: Ceiling) -> HostFacts:
    """This host's facts, or a Refusal (no emacs under /usr, no working user namespace
    for the configured identities); sweeps the kernel directories of killed workers."""
    emacs = resolve_emacs()
    identities = IdentityPool(settings.sandbox_uid_base, settings.sandbox_uid_count)
    identities.probe()
    # Each probe is a program start (emacs's a tenth of a second): run them at once.
    with ThreadPoolExecutor(2) as probes:
        bwrap = probes.submit(_first_line, ["bwrap", "--version"])
        emacs_version = probes.submit(_first_line, [str(emacs), "--version"])
        sweep_kernel_dirs()
        return HostFacts(
            name=socket.gethostname(),
            emacs=emacs,
            emacs_version=emacs_version.result(),
            bwrap_version=bwrap.result(),
            ceiling_driver=ceiling.name,
            identities=identities,
        )


def _first_line(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout
    except OSError:
        return "unknown"
    return out.splitlines()[0].strip() if out else "unknown"
