"""The two workers the hostile-organism tests live every attack under: this root process,
whose lives run under a dropped uid of their own (``worker[root]``), and a real
unprivileged worker process, a uid with no account in cgroup v1 directories delegated to
it (``worker[unprivileged]``, the module-scoped ``unprivileged_worker``); what a life
gives back (``Life``, ``members``) and the organisms' ``sh`` and ``lines``.

A test module imports ``worker_fixture`` and ``unprivileged_worker_fixture`` (with
``support.sandbox.label_fixture``) by name to use them. It trusts the sandbox's own
``run_sandbox`` and the delegated cgroups it makes here; it writes no host setting.
"""

from __future__ import annotations

import base64
import fcntl
import io
import json
import os
import pwd
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from support.sandbox import SMALL, elisp, kernel_dir, kernel_files
from worker.fleet.settings import Settings
from worker.instrument.ceilings import select_ceiling
from worker.instrument.ceilings.base import join_command, own_cgroup_dirs
from worker.instrument.ceilings.cgroup1 import CONTROLLERS
from worker.instrument.sandbox import resolve_emacs, run_sandbox

REPO = Path(__file__).resolve().parents[2]
SETTINGS = Settings()
UID_LOCKS = Path("/run/lock/ouroboros-test-uids")
# What the unprivileged worker needs beside the repository's own packages.
RUNTIME_PACKAGES = (
    "pyseccomp.py",
    "pydantic",
    "pydantic_core",
    "annotated_types",
    "typing_inspection",
    "typing_extensions.py",
)


class Life(NamedTuple):
    death: str | None
    files: dict[str, bytes]
    archive: bytes
    stderr: str
    uid: int


Worker = Callable[[str], Life]


def sh(script: str) -> str:
    """An organism that runs ``script`` in /bin/sh and publishes its output as /work/out."""
    return f'(report "out" (shell {elisp(script)}))'


def lines(life: Life) -> list[str]:
    assert life.death is None, (life.death, life.stderr[-2000:])
    return life.files["out"].decode(errors="replace").splitlines()


# --- the two workers ------------------------------------------------------------------------


@pytest.fixture(name="worker", params=["root", "unprivileged"])
def worker_fixture(request: pytest.FixtureRequest, label: str) -> Worker:
    if request.param == "root":
        ceiling, emacs = select_ceiling("cgroup1"), resolve_emacs()

        def as_root(organism: str) -> Life:
            with kernel_dir(organism) as (kernel, identity):
                result = run_sandbox(kernel, SMALL, ceiling, label, emacs, identity)
            return Life(
                result.death(),
                members(result.archive or b""),
                result.archive or b"",
                result.stderr.decode(errors="replace"),
                identity.uid,
            )

        return as_root
    unprivileged: Worker = request.getfixturevalue("unprivileged_worker")
    return unprivileged


@pytest.fixture(name="unprivileged_worker", scope="module")
def unprivileged_worker_fixture() -> Iterator[Worker]:
    """A worker process as a uid with no account, in cgroups delegated to it."""
    uid, claim = _claim_uid()
    # pytest's own temp dirs are private to root: the runtime must be readable by any uid.
    runtime = _runtime(Path(tempfile.mkdtemp(prefix="ouroboros-unprivileged-")))
    delegated = _delegate(uid)
    python = _system_python()

    def live(organism: str) -> Life:
        job = {
            "files": {k: base64.b64encode(v).decode() for k, v in kernel_files(organism).items()},
            "physics": SMALL.model_dump(mode="json"),
            "uid_base": SETTINGS.sandbox_uid_base,
            "uid_count": SETTINGS.sandbox_uid_count,
        }
        drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        argv = [*drop, python, "-B", str(runtime / "unprivileged_worker.py")]
        done = subprocess.run(
            join_command(delegated, argv),
            input=json.dumps(job),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=runtime,
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(runtime)},
        )
        assert done.returncode == 0, done.stderr[-3000:]
        account = json.loads(done.stdout)
        assert account["identity"] == [uid, uid, False], account
        assert account["driver"] == "cgroup1"
        archive = base64.b64decode(account["archive"])
        return Life(account["death"], members(archive), archive, account["stderr"], uid)

    try:
        yield live
    finally:
        os.close(claim)
        shutil.rmtree(runtime)
        for directory in delegated:
            if (directory / "ouroboros").exists():
                (directory / "ouroboros").rmdir()
            directory.rmdir()


def _claim_uid() -> tuple[int, int]:
    """A uid with no account that no other test process uses now, and the lock that says so.

    Two unprivileged workers of one uid (pytest-xdist) would share its kernel keyrings and
    its processes; the lock is a file per uid under /run/lock, dropped by the kernel when
    the holder exits.
    """
    UID_LOCKS.mkdir(parents=True, exist_ok=True)
    for uid in range(59000, 59100):
        if _account(uid):
            continue
        handle = os.open(UID_LOCKS / f"{uid}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(handle)
            continue
        return uid, handle
    raise AssertionError("no free uid in 59000-59099 for an unprivileged worker")


def _account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def _runtime(root: Path) -> Path:
    """The repository's packages and their few dependencies, readable by any uid.

    The test's own interpreter and virtualenv may sit under a directory only root can
    enter (/root), so the unprivileged worker gets copies in a world-readable place.
    """
    site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    for name in ("worker", "sandbox_scripts"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in RUNTIME_PACKAGES:
        source = site / name
        if source.is_dir():
            shutil.copytree(source, root / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, root / name)
    shutil.copy2(Path(__file__).parent / "unprivileged_worker.py", root)
    for path in (root, *root.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root


def _system_python() -> str:
    """An interpreter of this test's Python version that any uid may run."""
    name = f"python{sys.version_info.major}.{sys.version_info.minor}"
    found = shutil.which(name, path="/usr/local/bin:/usr/bin:/bin")
    assert found, f"{name} is needed outside the virtualenv (scripts/setup.sh installs python3)"
    return found


def _delegate(uid: int) -> list[Path]:
    """A child of this process's cgroup in every v1 hierarchy the driver uses, owned by ``uid``."""
    own = own_cgroup_dirs()
    delegated: list[Path] = []
    for parent in sorted({own[controller] for controller in CONTROLLERS}):
        directory = parent / f"ouroboros-delegated-{os.getpid()}"
        directory.mkdir()
        for path in (directory, directory / "cgroup.procs", directory / "tasks"):
            os.chown(path, uid, uid)
        delegated.append(directory)
    return delegated


def members(archive: bytes) -> dict[str, bytes]:
    if not archive:
        return {}
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        return {
            member.name.removeprefix("./"): tar.extractfile(member).read()  # type: ignore[union-attr]
            for member in tar.getmembers()
            if member.isfile()
        }
