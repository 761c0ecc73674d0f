"""Lives in a real sandbox, piece by piece, for the sandbox, ceiling, identity and VM tests:
a kernel directory as the pipeline prepares it (``kernel_files``, ``kernel_dir``),
small physics (``SMALL``), the organisms' shared ``PRELUDE`` and ``WALLS`` script,
``elisp`` quoting; and the ceiling fixtures (``label``: a scope label of which nothing
may remain; ``standins``: stand-in systemd executables first on ``PATH``), which a test
module imports by name to use.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from worker.fleet.settings import Settings
from worker.instrument.ceilings.base import SCOPE_PARENT, own_cgroup_dirs
from worker.instrument.identity import IdentityPool, SandboxIdentity
from worker.instrument.physics import Physics
from worker.instrument.sandbox import kernel_directory

STANDINS = Path(__file__).parent / "standins"
STAGE = Path(__file__).resolve().parents[2] / "sandbox_scripts" / "stage.sh"
JOURNAL = b"# journal\n\n## gen 1 \xe2\x80\x94 no-change\n"
SMALL = Physics(
    wall_seconds=30,
    cpu_seconds=30,
    memory_max_bytes="256M",
    work_bytes="4M",
    work_files=64,
    tmp_bytes="4M",
    run_bytes="1M",
)
# Shared by the organisms below: (report NAME TEXT) writes /work/NAME; (shell SCRIPT) runs
# SCRIPT with /bin/sh inside the sandbox and returns its output.
PRELUDE = """
(defun report (name text)
  (with-temp-file (concat "/work/" name) (insert text)))
(defun shell (script)
  (with-temp-buffer
    (call-process "/bin/sh" nil t nil "-c" script)
    (buffer-string)))
"""

WALLS = r"""
echo sys-writable $(find /proc/sys -type f -writable 2>/dev/null | wc -l)
test -w /proc/sys/kernel/core_pattern && echo core-pattern-writable
for p in keys cmdline timer_list sched_debug kcore latency_stats timer_stats; do
  [ -e /proc/$p ] && echo masked-$p $(cat /proc/$p 2>/dev/null | wc -c)
done
[ -d /proc/acpi ] && echo masked-acpi $(ls -A /proc/acpi | wc -l)
for p in / /usr /kernel /dev /dev/shm /dev/pts /proc/sys /proc/sys/kernel /proc/irq /proc/bus \
         /proc/fs /proc/sysrq-trigger /work /tmp /run; do
  test -w $p && echo writable $p
done
touch /dev/shm/x 2>/dev/null && echo wrote-dev-shm
touch /dev/planted 2>/dev/null && echo wrote-dev
touch /dev/pts/planted 2>/dev/null && echo wrote-dev-pts
mkdir /dev/shm/d 2>/dev/null && echo made-dir-in-dev-shm
echo hi >/dev/null && echo dev-null-works
"""


IDENTITIES = IdentityPool(Settings().sandbox_uid_base, Settings().sandbox_uid_count)


def kernel_files(organism: str) -> dict[str, bytes]:
    """The files of a kernel directory as the pipeline prepares it, with ``organism``."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        data = (PRELUDE + organism).encode()
        info = tarfile.TarInfo("organism.el")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return {
        "base.tar": buffer.getvalue(),
        "journal.md": JOURNAL,
        "lineage.json": b"{}\n",
        "capabilities.json": b"{}\n",
        "stage.sh": STAGE.read_bytes(),
    }


@contextmanager
def kernel_dir(organism: str) -> Iterator[tuple[Path, SandboxIdentity]]:
    """A kernel directory holding ``organism``, and the identity whose life it is (its own
    unprivileged uid, since the tests run as root)."""
    with (
        IDENTITIES.hold() as identity,
        kernel_directory(kernel_files(organism), identity) as kernel,
    ):
        yield kernel, identity


def elisp(text: str) -> str:
    """``text`` as an Emacs Lisp string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def leftovers(label: str) -> list[str]:
    """Scope directories and processes of ``label`` still present on this host."""
    found = [
        str(path)
        for parent in own_cgroup_dirs().values()
        for path in (parent / SCOPE_PARENT).glob(f"{label}-*")
    ]
    for cgroup in Path("/proc").glob("[0-9]*/cgroup"):
        try:
            if f"/{SCOPE_PARENT}/{label}-" in cgroup.read_text():
                found.append(str(cgroup.parent))
        except OSError:
            continue  # the process ended while we looked
    return found


@pytest.fixture(name="label")
def label_fixture(request: pytest.FixtureRequest) -> Iterator[str]:
    """A scope label unique to the test; afterwards, nothing of it may remain.

    The digest of the test's node id keeps two tests whose names share their first 32
    characters apart when they run at once (pytest-xdist)."""
    digest = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:8]
    name = f"t-{request.node.name[:32].replace('[', '-').replace(']', '')}-{digest}"
    yield name
    assert leftovers(name) == []


@pytest.fixture(name="standins")
def standins_fixture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory of stand-in systemd executables first on PATH; configure it with files."""
    directory = tmp_path / "standins"
    directory.mkdir()
    for name in ("systemd-run", "systemctl"):
        shutil.copy(STANDINS / name, directory / name)
        (directory / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{directory}:/usr/bin:/bin")
    return directory


def logged_calls(path: Path) -> list[list[str]]:
    """The argv of every call a stand-in recorded, in order."""
    calls: list[list[str]] = [[]]
    for line in path.read_text().splitlines():
        if line == "----":
            calls.append([])
        else:
            calls[-1].append(line)
    return calls[:-1]
