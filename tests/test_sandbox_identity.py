"""Hostile organisms against the sandbox's walls, lived by a root worker and by an unprivileged one.

Every test here is an attack an organism could make, run for real (bwrap, Emacs,
cgroup v1) twice: once by this root test process, whose lives run under a dropped
uid of their own, and once by a real unprivileged worker process (a uid with no
account, in cgroup v1 directories delegated to it, as a ``Delegate=yes`` service or a
container gets them), whose lives run as itself. Checks are non-destructive: the
organism asks the kernel whether it could write (``test -w``), it never changes a
host setting; the one write it attempts is into /dev and /dev/shm of its own sandbox.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from support.sandbox import WALLS, label_fixture  # noqa: F401  (fixtures, used by name)
from support.two_workers import (  # noqa: F401  (fixtures, used by name)
    REPO,
    SETTINGS,
    Worker,
    lines,
    sh,
    unprivileged_worker_fixture,
    worker_fixture,
)

from worker.instrument.identity import IdentityPool, SandboxIdentity

pytestmark = [pytest.mark.root, pytest.mark.bwrap, pytest.mark.cgroups]


# --- identity -------------------------------------------------------------------------------


def test_no_uid_inside_the_sandbox_maps_to_host_root(worker: Worker) -> None:
    own_userns = os.readlink("/proc/self/ns/user")
    maps: dict[int, tuple[int, str]] = {}
    stop = threading.Event()

    def watch() -> None:
        # From the host, the sandbox's processes are those of a uid under another user ns.
        while not stop.is_set():
            for status in Path("/proc").glob("[0-9]*/status"):
                try:
                    uid = int(re.search(r"^Uid:\s+(\d+)", status.read_text(), re.M)[1])  # type: ignore[index]
                    if uid == 0 or os.readlink(status.parent / "ns/user") == own_userns:
                        continue
                    maps[int(status.parent.name)] = (uid, (status.parent / "uid_map").read_text())
                except (OSError, TypeError):
                    continue
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        life = worker(sh("sleep 2; id -u; grep ^Uid: /proc/self/status"))
    finally:
        stop.set()
        watcher.join()
    out = lines(life)
    assert out[0] != "0" and "\t0\t" not in out[1], out
    # Other user namespaces on the host (containers, say) are not this life's.
    mine = {pid: text for pid, (uid, text) in maps.items() if uid == life.uid}
    assert mine, "no sandbox process was seen from the host"
    for pid, text in mine.items():
        rows = [tuple(map(int, row.split())) for row in text.splitlines()]
        # Read from the host: the host uids this namespace's uids stand for.
        assert rows == [(life.uid, life.uid, 1)], (pid, text)
        assert all(not outside <= 0 < outside + count for _, outside, count in rows)


def test_a_root_worker_gives_concurrent_lives_distinct_uids_and_refuses_an_account_range(
    tmp_path: Path,
) -> None:
    pool = IdentityPool(SETTINGS.sandbox_uid_base, 3, lock_dir=tmp_path / "locks")
    with pool.hold() as first, pool.hold() as second, pool.hold() as third:
        assert len({first.uid, second.uid, third.uid}) == 3 and first.drop
        with pytest.raises(Exception, match="every sandbox uid"), pool.hold():
            pass
    with pool.hold() as again:
        assert again.uid == first.uid  # released at the end of each life
    root_account = IdentityPool(pwd.getpwnam("nobody").pw_uid, 1)
    with pytest.raises(Exception, match=r"holds accounts .*nobody"):
        root_account.check()


def test_the_identity_drop_clears_groups_and_capabilities() -> None:
    identity = SandboxIdentity(60123, 60123, drop=True)
    argv = identity.command(["/usr/bin/true"])
    assert argv[1:6] == [
        "--reuid=60123",
        "--regid=60123",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
    ]
    assert SandboxIdentity(1000, 1000, drop=False).command(["x"]) == ["x"]


# --- kernel interfaces ----------------------------------------------------------------------


def test_kernel_knobs_are_read_only_and_host_files_masked(worker: Worker) -> None:
    out = lines(worker(sh(WALLS)))
    assert "sys-writable 0" in out
    assert "core-pattern-writable" not in out
    masked = {line.split()[0]: line.split()[1] for line in out if line.startswith("masked-")}
    assert {"masked-keys", "masked-cmdline", "masked-acpi"} <= set(masked)
    assert set(masked.values()) == {"0"}, masked
    # devpts lets the organism open ptys (Emacs's start-process wants one), never store a file.
    assert [line for line in out if line.startswith("writable")] == [
        "writable /work",
        "writable /tmp",
        "writable /run",
    ]
    assert not [line for line in out if line.startswith(("wrote-", "made-"))]
    assert "dev-null-works" in out


LEAKS = r"""
cat /proc/self/mountinfo /proc/self/cgroup /proc/cmdline 2>/dev/null
for p in /proc/[0-9]*; do
  cat $p/environ $p/cmdline 2>/dev/null; echo
  readlink $p/cwd $p/exe 2>/dev/null
done
"""


def test_nothing_readable_names_the_workers_directory_pid_or_host(
    worker: Worker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "worker-cwd-marker"
    marker.mkdir()
    monkeypatch.chdir(marker)
    seen = "\n".join(lines(worker(sh(LEAKS))))
    host_cmdline = Path("/proc/cmdline").read_text().strip()
    for secret in ("worker-cwd-marker", str(REPO), "pytest", host_cmdline, "ouroboros-delegated"):
        assert secret not in seen, secret
    assert f"-{os.getpid()}-" not in seen
    # The host paths in the mount table are the kernel directory's neutral name and the
    # life's boot_id beside it.
    roots = {line.split()[3] for line in seen.splitlines() if re.match(r"^\d+ \d+ \d+:\d+ ", line)}
    kernel = re.compile(r"^/([^/]+/)*ouroboros-kernel-[a-z0-9_]+(\.boot_id)?$")
    odd = {r for r in roots if not kernel.match(r) and r.count("/") > 1 and r != "/usr"}
    assert not odd, odd


# --- the result channel ---------------------------------------------------------------------

INJECT = r"""
mkdir /tmp/i && echo forged > /tmp/i/injected.txt && tar -C /tmp/i -cf /tmp/inject.tar injected.txt
( while :; do for f in /proc/[0-9]*/fd/*; do cat /tmp/inject.tar >> $f; done 2>/dev/null; done ) \
  </dev/null >/dev/null 2>&1 &
sleep 0.5
cat /tmp/inject.tar > /proc/1/fd/1 2>/dev/null && echo wrote-pid1-stdout
ls /proc/1/fd >/dev/null 2>&1 && echo listed-pid1-fds
cat /proc/1/environ >/dev/null 2>&1 && echo read-pid1-environ
echo attempted
"""


def test_the_result_stream_is_out_of_the_organisms_reach(worker: Worker) -> None:
    life = worker(sh(INJECT))
    # The shell's own output is a descriptor the loop below writes into too: search it.
    out = "\n".join(lines(life))
    assert "attempted" in out
    for success in ("wrote-pid1-stdout", "listed-pid1-fds", "read-pid1-environ"):
        assert success not in out
    # A process left running writes into every descriptor it can open until it is
    # killed, and it is killed before the result is packed.
    assert set(life.files) == {"organism.el", "out"}
    # The stream is the staging runner's archive from its first byte: nothing came before.
    assert life.archive.startswith(b"./\0")


# --- doctor ---------------------------------------------------------------------------------


def doctor(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scheduler", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "OUROBOROS_HOME": str(tmp_path / "home"), **env},
    )


def test_doctor_reports_the_identity_lives_will_have(tmp_path: Path) -> None:
    done = doctor(tmp_path)
    checks = {check["name"]: check for check in json.loads(done.stdout)}
    assert checks["identity"]["ok"]
    assert f"from {SETTINGS.sandbox_uid_base}.." in checks["identity"]["detail"]
    assert "no uid maps to host root" in checks["identity"]["detail"]


def test_doctor_refuses_a_host_without_unprivileged_user_namespaces(tmp_path: Path) -> None:
    # Run as the dropped uid, so it must lie outside pytest's root-only temp dirs.
    standin = Path(tempfile.mkdtemp(prefix="ouroboros-standin-")) / "bwrap"
    standin.parent.chmod(0o755)
    # What bubblewrap says where the kernel forbids unprivileged user namespaces.
    standin.write_text(
        "#!/bin/sh\necho 'bwrap: No permissions to create new namespace, likely because the"
        " kernel does not allow non-privileged user namespaces.' >&2\nexit 1\n"
    )
    standin.chmod(0o755)
    try:
        done = doctor(tmp_path, PATH=f"{standin.parent}:{os.environ['PATH']}")
    finally:
        shutil.rmtree(standin.parent)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert "No permissions to create new namespace" in done.stderr
    assert "unprivileged user namespaces must be enabled" in done.stderr


def test_doctor_refuses_a_uid_range_that_holds_an_account(tmp_path: Path) -> None:
    nobody = pwd.getpwnam("nobody").pw_uid
    done = doctor(tmp_path, OUROBOROS_SANDBOX_UID_BASE=str(nobody - 10))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert f"{nobody} (nobody)" in done.stderr and "OUROBOROS_SANDBOX_UID_BASE" in done.stderr
