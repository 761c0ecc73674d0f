"""The immutable runtime: what this worker process is, fixed at start.

Owns the rule that the trusted instrument is every module in ``worker/instrument/``
(fingerprinted by being there: there is no list to keep), loading them eagerly (and,
for a worker, the fleet plumbing in ``worker/fleet/``: ``load_plumbing``), the
in-memory copies of the sandbox scripts and the seed organism, the instrument
fingerprint (sha256 over exactly the bytes loaded), the instrument version and
commit (``source_commit`` asks git, or reads what a build recorded), and the
fleet-version check.
After ``Instrument.load()`` the worker never reads its own code from disk again, so
editing files under a running worker changes nothing it does; a restarted worker
with different bytes has a different fingerprint and serves a different queue.
The code imported is the code of those bytes: ``worker/__init__.py`` keeps the
bytecode in a private cache as checked hash-based pycs, validated against the source
on every import.

Trusts: the files of its own package at load time (the build's commit record among
them: it is installed with the code), and the environment for
``OUROBOROS_FLEET_VERSION`` / ``OUROBOROS_INSTRUMENT_COMMIT``.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import pkgutil
import re
import subprocess
from functools import cache
from importlib import metadata, resources
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from worker.instrument.errors import Refusal
from worker.instrument.names import COMMIT_PATTERN, ORGANISM_PATH, queue_name
from worker.instrument.source_commit import BUILD_FILE, SourceCommit, read_checkout

PACKAGE_ROOT = Path(__file__).resolve().parents[2]

INSTRUMENT_PACKAGE = "worker.instrument"
# Fleet plumbing, loaded eagerly by a worker too (so editing it on disk changes nothing
# a running worker does) but not fingerprinted: queues and leases are not physics, and
# a fix to them must not force every lineage to start over. ``worker.celery`` is the
# entry point that loads the instrument and the plumbing, so it is loaded already.
FLEET_PACKAGE = "worker.fleet"
SANDBOX_SCRIPTS: tuple[str, ...] = ("stage.sh",)
SEED_NAME = ORGANISM_PATH
_COMMIT = re.compile(COMMIT_PATTERN)


def package_version() -> str:
    try:
        return metadata.version("ouroboros-fleet")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


class Instrument(BaseModel):
    """The identity and in-memory assets of the running instrument."""

    model_config = ConfigDict(frozen=True)

    fingerprint: str
    version: str
    scripts: dict[str, bytes]
    seed: bytes
    sources: dict[str, int]

    @property
    def queue(self) -> str:
        """The Celery queue of this instrument: hosts with other code never serve it."""
        return queue_name(self.fingerprint)

    @classmethod
    def load(cls) -> Instrument:
        """Import every trusted module, read scripts and seed, and fingerprint the bytes."""
        digest = hashlib.sha256()
        sizes: dict[str, int] = {}
        for name in package_modules(INSTRUMENT_PACKAGE):
            module = importlib.import_module(name)
            path = Path(module.__file__ or "")
            data = path.read_bytes()
            _absorb(digest, f"module:{name}", data)
            sizes[name] = len(data)
        scripts = {}
        for script in SANDBOX_SCRIPTS:
            data = resources.files("sandbox_scripts").joinpath(script).read_bytes()
            _absorb(digest, f"script:{script}", data)
            scripts[script] = data
        # worker/organism.el links to the top-level seed in a checkout and is a copy in a wheel.
        seed = resources.files("worker").joinpath(SEED_NAME).read_bytes()
        _absorb(digest, f"seed:{SEED_NAME}", seed)
        version = package_version()
        check_fleet_version(version)
        return cls(
            fingerprint=digest.hexdigest(),
            version=version,
            scripts=scripts,
            seed=seed,
            sources=sizes,
        )


def load_plumbing() -> None:
    """Import every module of the fleet plumbing, as a long-running worker must.

    Not part of ``Instrument.load``: a command line that runs generations itself
    (``run --local``) never imports the broker's side (Celery, the planner) at all,
    and paid a tenth of a second per start to load it.
    """
    for name in package_modules(FLEET_PACKAGE):
        importlib.import_module(name)


def package_modules(package: str) -> list[str]:
    """Every module in a package's folder, the package itself first, in a stable order."""
    root = importlib.import_module(package)
    found = pkgutil.walk_packages(root.__path__, prefix=f"{package}.")
    return [package, *sorted(info.name for info in found)]


def _absorb(digest: hashlib._Hash, label: str, data: bytes) -> None:
    # Length-prefixed so that moving bytes between two files changes the fingerprint.
    digest.update(f"{label}\0{len(data)}\0".encode())
    digest.update(data)


def check_fleet_version(version: str) -> None:
    wanted = os.environ.get("OUROBOROS_FLEET_VERSION")
    if wanted and wanted != version:
        raise Refusal(
            f"OUROBOROS_FLEET_VERSION={wanted} but this package is version {version}; "
            "install the matching release or unset OUROBOROS_FLEET_VERSION"
        )


@cache
def current() -> Instrument:
    """The instrument of this process, loaded once."""
    return Instrument.load()


def instrument_commit(configured: str | None) -> str:
    """The commit of the instrument's source: configured, else the one its build recorded
    (an installed wheel), else the clean checkout's HEAD."""
    if configured:
        commit = configured.strip().lower()
        if not _COMMIT.match(commit):
            raise Refusal(
                f"OUROBOROS_INSTRUMENT_COMMIT={configured!r} is not a 40- or 64-hex commit id"
            )
        return commit
    built = built_commit()
    if built is not None:
        if built.dirty:
            raise Refusal(
                f"this package was built from a checkout with uncommitted tracked changes "
                f"(on top of {built.commit[:12]}); rebuild it from a clean checkout "
                "(a lineage must name the exact code it ran under)"
            )
        return built.commit
    checkout = read_checkout(PACKAGE_ROOT)
    if checkout is None:
        raise Refusal(
            "the instrument is neither a git checkout nor a package built from one; set "
            "OUROBOROS_INSTRUMENT_COMMIT to the commit it was built from"
        )
    if checkout.dirty:
        raise Refusal(
            f"the instrument checkout {PACKAGE_ROOT} has uncommitted tracked changes; "
            "commit them (a lineage must name the exact code it ran under)"
        )
    return checkout.commit


def built_commit() -> SourceCommit | None:
    """The commit a build wrote into the package (see ``source_commit``), if it did."""
    record = resources.files("worker").joinpath(BUILD_FILE)
    if not record.is_file():
        return None
    try:
        built = SourceCommit.decode(record.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise Refusal(
            f"the package's {BUILD_FILE} is unreadable ({error}); reinstall the package"
        ) from None
    if not _COMMIT.match(built.commit):
        raise Refusal(
            f"the package's {BUILD_FILE} names {built.commit!r}, not a commit id; "
            "reinstall the package"
        )
    return built


def instrument_provenance() -> tuple[str, str]:
    """Repository URL and ref of the checkout, best effort (provenance only)."""
    git = ["git", "-C", str(PACKAGE_ROOT)]
    remote = subprocess.run([*git, "remote", "get-url", "origin"], capture_output=True, text=True)
    ref = subprocess.run([*git, "symbolic-ref", "-q", "HEAD"], capture_output=True, text=True)
    return (remote.stdout.strip() or str(PACKAGE_ROOT), ref.stdout.strip() or "detached")
