"""The aggregate resource scope: each driver, the preflight and the refusal.

cgroup1 is exercised for real (this kind of host has writable cgroup v1); cgroup2 against
a directory tree standing in for cgroupfs, plus its availability on the real host;
systemd through stand-in ``systemd-run``/``systemctl`` executables on PATH, as the seed
test does. Every real scope a test opens is closed by it, and the fixtures check that no
cgroup directory or process is left behind. The systemd and cgroup2 drivers on a real
systemd and a real delegated v2 hierarchy are in tests/test_vm_host.py (a booted guest).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from support.sandbox import (  # noqa: F401  (fixtures, used by name)
    label_fixture,
    leftovers,
    logged_calls,
    standins_fixture,
)

from worker.instrument.ceilings import CeilingError, cgroup1, cgroup2, select_ceiling
from worker.instrument.ceilings.base import (
    SCOPE_PARENT,
    create_scope_dir,
    join_command,
    own_cgroup_dirs,
)
from worker.instrument.ceilings.cgroup1 import CONTROLLERS as V1_CONTROLLERS
from worker.instrument.ceilings.cgroup1 import Cgroup1Ceiling
from worker.instrument.ceilings.cgroup2 import Cgroup2Ceiling
from worker.instrument.ceilings.systemd import SystemdCeiling
from worker.instrument.errors import Refusal
from worker.instrument.physics import Physics

MINIMAL_ENV = {"PATH": "/usr/bin:/bin"}


# --- cgroup1, for real ----------------------------------------------------------------------


@pytest.mark.root
@pytest.mark.cgroups
def test_cgroup1_scope_holds_the_cpu_memory_and_task_ceilings(label: str) -> None:
    with Cgroup1Ceiling().open(Physics(), label) as enclosure:
        cpu, memory, pids = (enclosure.directories[c] for c in ("cpu", "memory", "pids"))
        assert (cpu / "cpu.cfs_period_us").read_text().strip() == "100000"
        assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "20000"  # 120 s of 600 s
        assert int((memory / "memory.limit_in_bytes").read_text()) == 1024**3
        memsw = memory / "memory.memsw.limit_in_bytes"
        if memsw.exists():  # memory plus swap, and the default swap ceiling is 0
            assert int(memsw.read_text()) == 1024**3
        assert (pids / "pids.max").read_text().strip() == "64"
        assert all(d.parent.name == SCOPE_PARENT for d in enclosure.directories.values())
        assert all(d.name.startswith(f"{label}-") for d in enclosure.directories.values())


@pytest.mark.root
@pytest.mark.cgroups
def test_cgroup1_command_runs_inside_the_scope_and_figures_name_their_sources(
    label: str,
) -> None:
    with Cgroup1Ceiling().open(Physics(), label) as enclosure:
        done = subprocess.run(
            enclosure.command(
                [
                    "/bin/sh",
                    "-c",
                    "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done; cat /proc/self/cgroup",
                ]
            ),
            capture_output=True,
            text=True,
            env=MINIMAL_ENV,
            check=True,
        )
        lines = {line.split(":")[1]: line.split(":", 2)[2] for line in done.stdout.splitlines()}
        for controller in V1_CONTROLLERS:
            inside = next(path for names, path in lines.items() if controller in names.split(","))
            assert inside.endswith(f"/{SCOPE_PARENT}/{enclosure.directories[controller].name}")
        figures = enclosure.figures()
    assert figures.driver == "cgroup1"
    assert figures.result == "exited"
    assert figures.cpu_usage_nsec and figures.cpu_usage_nsec > 0
    assert figures.memory_peak_bytes and figures.memory_peak_bytes > 0
    assert figures.oom_kills == 0
    assert figures.sources["cpu_usage_nsec"] == "cgroup1:cpuacct.usage"
    assert figures.sources["memory_peak_bytes"] == "cgroup1:memory.max_usage_in_bytes"
    assert figures.sources["oom_kills"] == "cgroup1:memory.oom_control oom_kill"


@pytest.mark.root
@pytest.mark.cgroups
def test_cgroup1_kill_ends_every_process_in_the_scope(label: str) -> None:
    with Cgroup1Ceiling().open(Physics(), label) as enclosure:
        process = subprocess.Popen(
            enclosure.command(["/bin/sh", "-c", "sleep 300 & sleep 300 & wait"]),
            env=MINIMAL_ENV,
        )
        procs = enclosure.directories["pids"] / "cgroup.procs"
        deadline = time.monotonic() + 30
        while len(procs.read_text().split()) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(procs.read_text().split()) == 3
        enclosure.kill("wall")
        assert procs.read_text() == ""
        assert process.wait(timeout=30) == -9
        enclosure.kill()  # the sweep that follows does not change why it ended
        assert enclosure.figures().result == "timeout"


@pytest.mark.root
@pytest.mark.cgroups
def test_cgroup1_sweep_after_a_clean_exit_is_not_a_kill(label: str) -> None:
    with Cgroup1Ceiling().open(Physics(), label) as enclosure:
        # The life's process ends by itself, leaving a straggler the sweep must kill.
        argv = ["/bin/sh", "-c", "sleep 300 </dev/null >/dev/null 2>&1 & exit 0"]
        assert subprocess.run(enclosure.command(argv), env=MINIMAL_ENV).returncode == 0
        procs = enclosure.directories["pids"] / "cgroup.procs"
        assert len(procs.read_text().split()) == 1
        enclosure.kill()
        assert procs.read_text() == ""
        assert enclosure.figures().result == "exited"


@pytest.mark.root
@pytest.mark.cgroups
def test_cgroup1_kill_for_an_overflowing_result_says_killed(label: str) -> None:
    with Cgroup1Ceiling().open(Physics(), label) as enclosure:
        process = subprocess.Popen(enclosure.command(["/bin/sleep", "300"]), env=MINIMAL_ENV)
        procs = enclosure.directories["pids"] / "cgroup.procs"
        deadline = time.monotonic() + 30
        while not procs.read_text().split() and time.monotonic() < deadline:
            time.sleep(0.02)
        enclosure.kill("overflow")
        assert process.wait(timeout=30) == -9
        assert enclosure.figures().result == "killed"


@pytest.mark.root
@pytest.mark.cgroups
def test_cgroup1_memory_past_the_ceiling_is_counted_as_an_oom_kill(label: str) -> None:
    physics = Physics(memory_max_bytes="32M")
    with Cgroup1Ceiling().open(physics, label) as enclosure:
        done = subprocess.run(
            enclosure.command([sys.executable, "-c", "x = b'x' * (256 << 20)"]),
            capture_output=True,
            env=MINIMAL_ENV,
        )
        figures = enclosure.figures()
    assert done.returncode == -9
    assert figures.oom_kills >= 1
    assert figures.result == "oom-kill"


@pytest.mark.root
@pytest.mark.cgroups
def test_cgroup1_close_is_idempotent_and_one_label_opens_two_scopes(label: str) -> None:
    ceiling = Cgroup1Ceiling()
    first, second = ceiling.open(Physics(), label), ceiling.open(Physics(), label)
    assert first.directories["memory"] != second.directories["memory"]
    for enclosure in (first, second):
        enclosure.close()
        enclosure.close()
        assert not any(d.exists() for d in enclosure.directories.values())


@pytest.mark.root
@pytest.mark.cgroups
def test_a_scope_nothing_joined_is_a_host_fault_not_a_figure(label: str) -> None:
    with Cgroup1Ceiling().open(Physics(), label) as enclosure:
        subprocess.run(["/bin/true"], check=True)  # ran outside the scope
        with pytest.raises(CeilingError, match="could not join"):
            enclosure.figures()


@pytest.mark.full
def test_joining_a_missing_cgroup_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    done = subprocess.run(
        join_command([tmp_path / "missing"], ["/bin/touch", str(marker)]),
        capture_output=True,
        env=MINIMAL_ENV,
    )
    assert done.returncode == 125
    assert not marker.exists()


@pytest.mark.root
@pytest.mark.cgroups
def test_a_scope_left_by_a_killed_worker_is_removed_by_the_next_one(label: str) -> None:
    dead = subprocess.run(["/bin/sh", "-c", "echo $$"], capture_output=True, text=True)
    memory = own_cgroup_dirs()["memory"] / SCOPE_PARENT
    memory.mkdir(exist_ok=True)
    debris = memory / f"{label}-{int(dead.stdout)}-0badc0de"
    live_creator = memory / f"{label}-{os.getpid()}-0badc0de"
    debris.mkdir()
    live_creator.mkdir()
    try:
        with Cgroup1Ceiling().open(Physics(), label):
            assert not debris.exists()
            assert live_creator.exists()  # its creator (this process) may still close it
    finally:
        live_creator.rmdir()


def test_cgroup1_is_unavailable_without_a_pids_hierarchy(tmp_path: Path) -> None:
    parents = {c: tmp_path for c in ("cpu", "cpuacct", "memory")}
    reason = Cgroup1Ceiling(parents).unavailable_reason()
    assert reason is not None and "pids" in reason


def test_own_cgroups_are_found_below_each_mounts_root(tmp_path: Path) -> None:
    mountinfo, cgroup = tmp_path / "mountinfo", tmp_path / "cgroup"
    mountinfo.write_text(
        "30 25 0:26 /docker/abc /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
        "31 25 0:27 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
        "32 25 0:28 /elsewhere /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n"
        "33 25 0:29 / /sys/fs/cgroup/uni\\040fied rw - cgroup2 cgroup2 rw\n"
    )
    cgroup.write_text(
        "3:cpu,cpuacct:/docker/abc/job\n4:memory:/docker/abc\n5:pids:/docker/abc\n0::/w\n"
    )
    assert own_cgroup_dirs(mountinfo, cgroup) == {
        "cpu": Path("/sys/fs/cgroup/cpu,cpuacct/job"),
        "cpuacct": Path("/sys/fs/cgroup/cpu,cpuacct/job"),
        "memory": Path("/sys/fs/cgroup/memory/docker/abc"),
        # pids is mounted from a root this process's cgroup is not below: unreachable.
        "": Path("/sys/fs/cgroup/uni fied/w"),
    }


# --- cgroup2, against a stand-in tree -------------------------------------------------------


@pytest.fixture
def fake_v2(tmp_path: Path) -> Path:
    """A directory standing in for this process's cgroup in a delegating v2 hierarchy."""
    own = tmp_path / "own"
    own.mkdir()
    (own / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (own / "cgroup.subtree_control").write_text("\n")
    return own


def test_cgroup2_availability_follows_the_hosts_controllers() -> None:
    own = own_cgroup_dirs().get("")
    offered = (own / "cgroup.controllers").read_text().split() if own else []
    reason = Cgroup2Ceiling().unavailable_reason()
    missing = [c for c in ("cpu", "memory", "pids") if c not in offered]
    if missing:  # this kind of host: the controllers are bound to the v1 hierarchies
        assert reason is not None and " ".join(missing) in reason
    else:
        assert reason is None


def test_cgroup2_is_unavailable_when_controllers_are_not_offered(fake_v2: Path) -> None:
    (fake_v2 / "cgroup.controllers").write_text("hugetlb\n")
    reason = Cgroup2Ceiling(fake_v2).unavailable_reason()
    assert reason is not None and "cpu memory pids" in reason and "hugetlb" in reason


def test_cgroup2_scope_delegates_controllers_and_holds_the_ceilings(fake_v2: Path) -> None:
    physics = Physics(memory_max_bytes="512M", tasks_max=32)
    enclosure = Cgroup2Ceiling(fake_v2).open(physics, "v2")
    scope = enclosure.directory
    assert scope.parent == fake_v2 / SCOPE_PARENT
    for delegating in (fake_v2, fake_v2 / SCOPE_PARENT):
        assert (delegating / "cgroup.subtree_control").read_text() == "+cpu +memory +pids\n"
    assert (scope / "cpu.max").read_text() == "20000 100000\n"
    assert (scope / "memory.max").read_text() == f"{512 * 1024**2}\n"
    assert (scope / "pids.max").read_text() == "32\n"
    # Without swap accounting the kernel has no memory.swap.max; nothing is invented.
    assert not (scope / "memory.swap.max").exists()


@pytest.mark.full
def test_cgroup2_command_joins_the_scope_before_exec(fake_v2: Path) -> None:
    enclosure = Cgroup2Ceiling(fake_v2).open(Physics(), "v2")
    done = subprocess.run(
        enclosure.command(["/bin/sh", "-c", "echo $$"]),
        capture_output=True,
        text=True,
        env=MINIMAL_ENV,
        check=True,
    )
    # The joining shell execs the command, so the pid it wrote is the command's own.
    assert (enclosure.directory / "cgroup.procs").read_text() == done.stdout


def test_cgroup2_figures_come_from_cpu_stat_memory_peak_and_memory_events(
    fake_v2: Path,
) -> None:
    enclosure = Cgroup2Ceiling(fake_v2).open(Physics(), "v2")
    scope = enclosure.directory
    (scope / "cpu.stat").write_text("usage_usec 1500\nuser_usec 1000\nsystem_usec 500\n")
    (scope / "memory.peak").write_text("4194304\n")
    (scope / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 2\noom_kill 2\n")
    figures = enclosure.figures()
    assert figures.driver == "cgroup2"
    assert figures.result == "oom-kill"
    assert figures.cpu_usage_nsec == 1_500_000
    assert figures.memory_peak_bytes == 4194304
    assert figures.oom_kills == 2
    assert figures.sources["cpu_usage_nsec"] == "cgroup2:cpu.stat usage_usec"
    assert figures.sources["memory_peak_bytes"] == "cgroup2:memory.peak"
    assert figures.sources["oom_kills"] == "cgroup2:memory.events oom_kill"


def test_cgroup2_kill_writes_cgroup_kill_and_close_removes_the_scope(fake_v2: Path) -> None:
    enclosure = Cgroup2Ceiling(fake_v2).open(Physics(), "v2")
    scope = enclosure.directory
    procs, kill = scope / "cgroup.procs", scope / "cgroup.kill"
    procs.write_text("4242\n4243\n")

    def kernel() -> None:  # what the kernel does on a write to cgroup.kill
        while not kill.exists():
            time.sleep(0.01)
        procs.write_text("")

    threading.Thread(target=kernel, daemon=True).start()
    enclosure.kill()
    assert kill.read_text() == "1\n"
    for name in (
        "cpu.max",
        "memory.max",
        "pids.max",
        "cgroup.procs",
        "cgroup.kill",
        "cgroup.subtree_control",
    ):
        (scope / name).unlink(missing_ok=True)
    enclosure.close()
    enclosure.close()
    assert not scope.exists()


def test_cgroup2_open_explains_a_cgroup_that_cannot_delegate(fake_v2: Path) -> None:
    (fake_v2 / "cgroup.subtree_control").unlink()
    # Readable, and refuses writes even from root, as the kernel does with EBUSY here.
    (fake_v2 / "cgroup.subtree_control").symlink_to("/proc/version")
    with pytest.raises(CeilingError, match="cannot delegate controllers"):
        Cgroup2Ceiling(fake_v2).open(Physics(), "v2")


def test_cgroup2_scope_parent_removed_while_it_is_prepared_is_made_again(
    fake_v2: Path,
) -> None:
    attempts: list[Path] = []

    def closed_meanwhile(base: Path) -> None:
        # The first time, another scope's close() removes the empty parent just before
        # its controllers are written: the write fails as it does in cgroupfs.
        attempts.append(base)
        if len(attempts) == 1:
            base.rmdir()
        cgroup2._delegate(base)

    scope = create_scope_dir(fake_v2, "v2-scope", closed_meanwhile)
    # Twice before the scope's mkdir, once after it (see the test below).
    assert attempts == [fake_v2 / SCOPE_PARENT] * 3
    assert scope == fake_v2 / SCOPE_PARENT / "v2-scope" and scope.is_dir()


def test_cgroup2_scope_parent_made_anew_by_another_life_gets_its_controllers(
    fake_v2: Path,
) -> None:
    calls: list[Path] = []

    def replaced_meanwhile(base: Path) -> None:
        # The first time, right after this life enables the controllers, another life's
        # close() removes the empty parent and a third life makes it anew, not yet
        # delegating: the scope is then made in a parent without cpu, memory and pids.
        calls.append(base)
        cgroup2._delegate(base)
        if len(calls) == 1:
            (base / "cgroup.subtree_control").unlink()
            base.rmdir()
            base.mkdir()

    scope = create_scope_dir(fake_v2, "v2-scope", replaced_meanwhile)
    assert scope.is_dir() and scope.parent == fake_v2 / SCOPE_PARENT
    # The stand-in file keeps what was written to it (the kernel's would list
    # "cpu memory pids"): written, here, to the parent that holds the scope.
    enabled = (scope.parent / "cgroup.subtree_control").read_text().split()
    assert enabled == ["+cpu", "+memory", "+pids"]


def test_a_scope_whose_parent_cannot_be_prepared_again_is_removed(fake_v2: Path) -> None:
    sibling = fake_v2 / SCOPE_PARENT / "sibling"
    sibling.mkdir(parents=True)
    calls: list[Path] = []

    def fails_the_second_time(base: Path) -> None:
        calls.append(base)
        if len(calls) == 2:
            raise CeilingError("cannot write '+cpu' to the parent")

    with pytest.raises(CeilingError, match="cannot write"):
        create_scope_dir(fake_v2, "v2-scope", fails_the_second_time)
    assert not (fake_v2 / SCOPE_PARENT / "v2-scope").exists()
    assert sibling.is_dir()  # another life's scope, and so its parent, stay


# --- cgroup2 in a container's own cgroup namespace, against a stand-in tree ---------------


def container_view(tmp_path: Path, cgroup_path: str, real_root: bool = False) -> Path:
    """A /proc/self whose cgroup2 mount shows a namespace root (the host's root if real_root).

    Returns the proc directory; the stand-in root is ``tmp_path / "cgroup"``, holding
    processes 1 and 7 and offering the controllers, with none enabled yet.
    """
    root, proc = tmp_path / "cgroup", tmp_path / "proc"
    root.mkdir()
    proc.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("\n")
    (root / "cgroup.procs").write_text("1\n7\n")
    if not real_root:
        (root / "cgroup.type").write_text("domain\n")
    (proc / "mountinfo").write_text(f"233 231 0:26 / {root} rw - cgroup2 cgroup2 rw,nsdelegate\n")
    (proc / "cgroup").write_text(f"0::{cgroup_path}\n")
    return proc


@contextmanager
def kernel_moves(root: Path, moved: list[int]) -> Iterator[None]:
    """What the kernel does on a write to ``root/worker/cgroup.procs``: the pid leaves the root.

    The leaf's cgroup.procs is a FIFO served by a thread, so each move is seen as it
    is written, as the driver goes on to read the root's list.
    """
    leaf = root / "worker"
    leaf.mkdir()
    os.mkfifo(leaf / "cgroup.procs")

    def serve() -> None:
        # Held open for writing too, for the whole test: the FIFO never lacks a reader
        # (a write that came between one read's end and the next open failed with
        # EPIPE) and never reaches its end.
        with open(os.open(leaf / "cgroup.procs", os.O_RDWR)) as fifo:
            for line in fifo:
                pid = line.strip()
                if pid == "stop":
                    return
                moved.append(int(pid))
                listed = (root / "cgroup.procs").read_text().split()
                (root / "cgroup.procs").write_text("".join(f"{p}\n" for p in listed if p != pid))

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    yield
    (leaf / "cgroup.procs").write_text("stop\n")
    server.join(timeout=10)


def test_cgroup2_in_a_namespace_root_moves_its_processes_to_a_leaf_first(
    tmp_path: Path,
) -> None:
    proc = container_view(tmp_path, "/")
    root, moved = tmp_path / "cgroup", []
    ceiling = Cgroup2Ceiling(proc_self=proc)
    assert ceiling.base() == (root, True)
    assert ceiling.unavailable_reason() is None
    with kernel_moves(root, moved):
        enclosure = ceiling.open(Physics(), "v2")
    # Every process of the root went to the leaf (the kernel would refuse the
    # controllers while one is left there); a pid may be written twice if the list is
    # read before the kernel took it off.
    assert set(moved) == {1, 7}
    assert (root / "cgroup.procs").read_text() == ""
    assert enclosure.directory.parent == root / SCOPE_PARENT
    for delegating in (root, root / SCOPE_PARENT):
        assert (delegating / "cgroup.subtree_control").read_text() == "+cpu +memory +pids\n"
    assert ceiling.placement() == (
        f"the root of this container's cgroup namespace, {root}: its processes in"
        f" {root}/worker, scopes under {root}/{SCOPE_PARENT}"
    )


def test_cgroup2_in_the_namespace_roots_leaf_puts_scopes_beside_it(tmp_path: Path) -> None:
    # A later process of the container (a pool child, the doctor through docker exec).
    proc = container_view(tmp_path, "/worker")
    root = tmp_path / "cgroup"
    (root / "worker").mkdir()
    (root / "cgroup.procs").write_text("")
    enclosure = Cgroup2Ceiling(proc_self=proc).open(Physics(), "v2")
    assert enclosure.directory.parent == root / SCOPE_PARENT
    assert (root / "cgroup.subtree_control").read_text() == "+cpu +memory +pids\n"


def test_cgroup2_outside_a_namespace_root_uses_its_own_cgroup(tmp_path: Path) -> None:
    proc = container_view(tmp_path, "/", real_root=True)
    root = tmp_path / "cgroup"
    # The host's real root may hold processes and delegate: nothing is moved.
    assert Cgroup2Ceiling(proc_self=proc).base() == (root, False)
    (proc / "cgroup").write_text("0::/worker\n")
    (root / "worker").mkdir()
    assert Cgroup2Ceiling(proc_self=proc).base() == (root / "worker", False)
    (root / "cgroup.type").write_text("domain\n")
    (proc / "cgroup").write_text("0::/system.slice\n")
    assert Cgroup2Ceiling(proc_self=proc).base() == (root / "system.slice", False)
    assert Cgroup2Ceiling(proc_self=proc).placement() == (
        f"scopes under {root}/system.slice/{SCOPE_PARENT}"
    )


def test_cgroup2_refuses_a_namespace_root_holding_processes_of_another_pid_namespace(
    tmp_path: Path,
) -> None:
    proc = container_view(tmp_path, "/")
    (tmp_path / "cgroup" / "cgroup.procs").write_text("0\n1\n")
    with pytest.raises(CeilingError, match="outside this pid namespace"):
        Cgroup2Ceiling(proc_self=proc).open(Physics(), "v2")


def test_cgroup2_names_a_namespace_root_whose_processes_it_may_not_move(tmp_path: Path) -> None:
    proc = container_view(tmp_path, "/")
    leaf = tmp_path / "cgroup" / "worker"
    leaf.mkdir()
    # Refuses writes even from root, as the kernel refuses the unprivileged worker a
    # root-owned cgroup.procs.
    (leaf / "cgroup.procs").symlink_to("/proc/version")
    with pytest.raises(CeilingError) as refused:
        Cgroup2Ceiling(proc_self=proc).open(Physics(), "v2")
    message = str(refused.value)
    assert "cannot move process 1" in message and "worker-entrypoint.sh" in message


# --- systemd, through stand-ins ---------------------------------------------------------


@pytest.mark.full
def test_systemd_is_unavailable_when_no_user_manager_answers(standins: Path) -> None:
    (standins / "no-manager").touch()
    reason = SystemdCeiling().unavailable_reason()
    assert reason is not None and "no systemd user manager answers" in reason


@pytest.mark.full
def test_systemd_from_252_is_available_and_older_is_not(standins: Path) -> None:
    (standins / "version").write_text("252\n")
    assert SystemdCeiling().unavailable_reason() is None
    (standins / "version").write_text("251\n")
    reason = SystemdCeiling().unavailable_reason()
    assert reason is not None and "251" in reason and "252+" in reason


@pytest.mark.full
def test_systemd_unit_carries_the_ceilings_as_properties(standins: Path) -> None:
    ceiling = SystemdCeiling()
    assert ceiling.unavailable_reason() is None
    enclosure = ceiling.open(Physics(), "lineage-1")
    subprocess.run(enclosure.command(["/bin/true"]), env=MINIMAL_ENV, check=True)
    (arguments,) = logged_calls(standins / "systemd-run.args")
    for expected in (
        "--user",
        "--wait",
        "--pipe",
        "CPUQuota=20%",
        "MemoryMax=1G",
        "MemorySwapMax=0",
        "TasksMax=64",
        "RuntimeMaxSec=600",
        "KillMode=control-group",
        "KeyringMode=private",
        "KillSignal=SIGKILL",
    ):
        assert expected in arguments
    assert f"--unit={enclosure.unit}" in arguments
    assert enclosure.unit.startswith("ouroboros-lineage-1-") and enclosure.unit.endswith(".service")
    # An option of 254+ only: the argv is escaped instead, on every version.
    assert "--expand-environment=no" not in arguments
    # The collector of the unit's cgroup figures, run after its processes ended.
    (stop_post,) = [a for a in arguments if a.startswith("ExecStopPost=")]
    assert stop_post == (
        f"ExecStopPost=/bin/sh {enclosure.figures_dir}/collect.sh {enclosure.figures_file}"
    )
    # The service gets an environment of PATH alone, whatever the user manager holds.
    command = arguments[arguments.index("--") + 1 :]
    assert command[1:] == ["-i", "PATH=/usr/bin:/bin", "/bin/true"]
    enclosure.close()
    assert not enclosure.figures_dir.exists()


@pytest.mark.full
def test_systemd_argv_reaches_the_service_unexpanded(standins: Path) -> None:
    # The stand-in expands "$NAME", "${NAME}" and "$$" as the manager does.
    words = ["$STANDIN_MANAGER_VAR", "${STANDIN_MANAGER_VAR}x", "$$", "100%h", "a b", "'\\\""]
    enclosure = SystemdCeiling().open(Physics(), "lineage-1")
    done = subprocess.run(
        enclosure.command(["/bin/sh", "-c", 'printf "%s\\n" "$@"', "sh", *words]),
        env=MINIMAL_ENV,
        capture_output=True,
        text=True,
        check=True,
    )
    enclosure.close()
    assert done.stdout.splitlines() == words
    (arguments,) = logged_calls(standins / "systemd-run.args")
    assert "$$STANDIN_MANAGER_VAR" in arguments


@pytest.mark.full
def test_systemd_figures_are_read_back_with_systemctl_show(standins: Path) -> None:
    (standins / "show").write_text(
        "Result=oom-kill\nCPUUsageNSec=12000000\nMemoryPeak=4194304\nOOMKills=1\n"
    )
    enclosure = SystemdCeiling().open(Physics(), "lineage-1")
    figures = enclosure.figures()
    (show,) = logged_calls(standins / "systemctl.args")
    assert show[show.index("show") :] == [
        "show",
        enclosure.unit,
        "-p",
        "Result,CPUUsageNSec,MemoryPeak,OOMKills",
    ]
    assert figures.driver == "systemd"
    assert figures.result == "oom-kill"
    assert (figures.cpu_usage_nsec, figures.memory_peak_bytes, figures.oom_kills) == (
        12000000,
        4194304,
        1,
    )
    assert figures.sources["memory_peak_bytes"] == "systemd:MemoryPeak"


@pytest.mark.full
def test_systemd_figures_a_manager_does_not_report_are_named_so(standins: Path) -> None:
    # No collector ran (the unit never started, say), and the manager reports little.
    (standins / "show").write_text("Result=success\nCPUUsageNSec=[not set]\n")
    figures = SystemdCeiling().open(Physics(), "lineage-1").figures()
    assert figures.cpu_usage_nsec is None and figures.memory_peak_bytes is None
    assert figures.oom_kills == 0
    assert figures.sources["cpu_usage_nsec"] == (
        "systemd:CPUUsageNSec not set, and no cgroup2:cpu.stat usage_usec"
    )
    assert figures.sources["oom_kills"] == (
        "systemd:OOMKills not reported by this systemd, and no cgroup2:memory.events oom_kill"
    )


def stop_post_file(unit: str, result: str = "oom-kill") -> str:
    """What the ExecStopPost= collector writes for ``unit`` after an OOM kill."""
    cgroup = f"/user.slice/user-1000.slice/user@1000.service/app.slice/{unit}"
    return (
        f"cgroup {cgroup}\nservice_result {result}\nmemory.peak 67108864\n"
        "memory.events low 0\nmemory.events high 0\nmemory.events max 31\n"
        "memory.events oom 2\nmemory.events oom_kill 2\nmemory.events oom_group_kill 0\n"
        "cpu.stat usage_usec 1500\ncpu.stat user_usec 1000\ncpu.stat system_usec 500\n"
    )


@pytest.mark.full
def test_systemd_252_figures_come_from_the_units_own_cgroup_files(standins: Path) -> None:
    # systemd 252: no MemoryPeak or OOMKills, and the unit (with its cgroup) is gone.
    (standins / "version").write_text("252\n")
    (standins / "show").write_text("Result=success\nCPUUsageNSec=[not set]\n")
    enclosure = SystemdCeiling().open(Physics(), "lineage-1")
    (standins / "stop-post").write_text(stop_post_file(enclosure.unit))
    subprocess.run(enclosure.command(["/bin/true"]), env=MINIMAL_ENV, check=True)
    figures = enclosure.figures()
    enclosure.close()
    assert figures.result == "oom-kill"
    assert (figures.cpu_usage_nsec, figures.memory_peak_bytes, figures.oom_kills) == (
        1_500_000,
        64 * 1024**2,
        2,
    )
    where = "of the unit's cgroup /user.slice/user-1000.slice/user@1000.service/app.slice/"
    assert figures.sources == {
        "cpu_usage_nsec": f"cgroup2:cpu.stat usage_usec {where}{enclosure.unit}",
        "memory_peak_bytes": f"cgroup2:memory.peak {where}{enclosure.unit}",
        "oom_kills": f"cgroup2:memory.events oom_kill {where}{enclosure.unit}",
        "result": "systemd:$SERVICE_RESULT at ExecStopPost",
    }


@pytest.mark.full
def test_systemd_figures_of_the_manager_come_before_the_cgroup_files(standins: Path) -> None:
    (standins / "show").write_text("Result=success\nCPUUsageNSec=7000\nMemoryPeak=4096\n")
    enclosure = SystemdCeiling().open(Physics(), "lineage-1")
    (standins / "stop-post").write_text(stop_post_file(enclosure.unit, "success"))
    subprocess.run(enclosure.command(["/bin/true"]), env=MINIMAL_ENV, check=True)
    figures = enclosure.figures()
    enclosure.close()
    assert (figures.cpu_usage_nsec, figures.memory_peak_bytes, figures.oom_kills) == (7000, 4096, 2)
    assert figures.sources["cpu_usage_nsec"] == "systemd:CPUUsageNSec"
    assert figures.sources["memory_peak_bytes"] == "systemd:MemoryPeak"
    assert figures.sources["oom_kills"].startswith("cgroup2:memory.events oom_kill of the unit")


@pytest.mark.full
def test_systemd_collector_of_another_cgroup_is_a_host_fault(standins: Path) -> None:
    enclosure = SystemdCeiling().open(Physics(), "lineage-1")
    (standins / "stop-post").write_text(stop_post_file("elsewhere.service"))
    subprocess.run(enclosure.command(["/bin/true"]), env=MINIMAL_ENV, check=True)
    with pytest.raises(CeilingError, match="ran in another cgroup"):
        enclosure.figures()
    enclosure.close()


@pytest.mark.full
def test_systemd_kills_spare_the_collector(standins: Path) -> None:
    # A SIGKILL to the whole unit would also kill the ExecStopPost= collector when the
    # manager is already running it: seen on systemd 252 after a second kill (the
    # sweep), and on 254 when RuntimeMaxSec fired just before the worker's own wall
    # timer; the life then had no figures. Only the main process is ever signalled,
    # and only once.
    enclosure = SystemdCeiling().open(Physics(), "lineage-1")
    enclosure.kill("wall")
    enclosure.kill()
    enclosure.kill("overflow")
    enclosure.close()
    kills = [call for call in logged_calls(standins / "systemctl.args") if "kill" in call]
    assert len(kills) == 1, kills
    assert kills[0][-3:] == ["--kill-whom=main", "--signal=SIGKILL", enclosure.unit], kills


@pytest.mark.full
def test_systemd_result_says_why_the_worker_killed_the_unit(standins: Path) -> None:
    (standins / "show").write_text("Result=signal\n")
    enclosure = SystemdCeiling().open(Physics(), "lineage-1")
    (standins / "stop-post").write_text(stop_post_file(enclosure.unit, "signal"))
    subprocess.run(enclosure.command(["/bin/true"]), env=MINIMAL_ENV, check=True)
    enclosure.kill("wall")
    enclosure.kill()
    figures = enclosure.figures()
    enclosure.close()
    # An OOM kill outranks the worker's wall-time kill: the manager's word stands.
    assert (figures.result, figures.oom_kills) == ("signal", 2)
    enclosure = SystemdCeiling().open(Physics(), "lineage-1")
    (standins / "stop-post").write_text(
        stop_post_file(enclosure.unit, "signal").replace("oom_kill 2", "oom_kill 0")
    )
    subprocess.run(enclosure.command(["/bin/true"]), env=MINIMAL_ENV, check=True)
    enclosure.kill("wall")
    figures = enclosure.figures()
    enclosure.close()
    assert figures.result == "timeout"
    assert figures.sources["result"] == "the worker's kill (wall time or result overflow)"


@pytest.mark.full
def test_systemd_kill_and_close_kill_stop_and_reset_the_unit(standins: Path) -> None:
    enclosure = SystemdCeiling().open(Physics(), "lineage-1")
    enclosure.kill()
    enclosure.close()
    enclosure.close()
    verbs = [call[2:] for call in logged_calls(standins / "systemctl.args")]
    assert verbs == [
        ["kill", "--kill-whom=main", "--signal=SIGKILL", enclosure.unit],
        ["stop", enclosure.unit],
        ["reset-failed", enclosure.unit],
    ]


# --- choosing a driver ----------------------------------------------------------------------


@pytest.mark.root
@pytest.mark.cgroups
def test_auto_chooses_cgroup1_on_a_host_without_systemd_or_cgroup2_controllers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert SystemdCeiling().unavailable_reason() is not None
    assert Cgroup2Ceiling().unavailable_reason() is not None
    assert select_ceiling("auto").name == "cgroup1"
    assert leftovers("probe") == []


@pytest.mark.full
def test_auto_prefers_systemd_when_a_user_manager_answers(standins: Path) -> None:
    ceiling = select_ceiling("auto")
    assert ceiling.name == "systemd"
    # The preflight ran a probe unit and cleaned it up.
    (probe,) = logged_calls(standins / "systemd-run.args")
    assert probe[-1] == "/bin/true"


@pytest.mark.full
def test_scope_failure_is_preflight_not_an_organism_death(standins: Path) -> None:
    (standins / "fail").touch()
    with pytest.raises(Refusal) as refused:
        select_ceiling("systemd")
    message = str(refused.value)
    assert "aggregate resource scope" in message
    assert "systemd: probe scope exited 1" in message
    assert "\n" not in message


def test_forced_driver_that_cannot_work_is_refused_with_its_reason() -> None:
    with pytest.raises(Refusal) as refused:
        select_ceiling("cgroup2")
    message = str(refused.value)
    assert "the aggregate resource scope cannot be set up" in message
    assert "cgroup2: " in message and "systemd:" not in message
    assert "no unbounded fallback" in message


@pytest.mark.full
def test_no_working_driver_is_refused_with_every_drivers_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setattr(Cgroup1Ceiling, "unavailable_reason", lambda _self: "off for this test")
    with pytest.raises(Refusal) as refused:
        select_ceiling("auto")
    message = str(refused.value)
    assert "the aggregate resource scope" in message
    for reason in ("systemd: ", "cgroup2: ", "cgroup1: off for this test"):
        assert reason in message
    assert "--ceiling" in message and "\n" not in message


def test_unknown_driver_name_is_refused() -> None:
    with pytest.raises(Refusal, match="unknown ceiling 'docker'"):
        select_ceiling("docker")


def test_cgroup1_without_swap_accounting_refuses_when_swap_is_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for controller in ("cpu", "memory", "pids"):
        (tmp_path / controller).mkdir()
    swaps = tmp_path / "swaps"
    swaps.write_text("Filename\tType\tSize\tUsed\tPriority\n/swapfile\tfile\t1048572\t0\t-2\n")
    monkeypatch.setattr(cgroup1, "PROC_SWAPS", swaps)
    directories = {name: tmp_path / name for name in ("cpu", "memory", "pids")}
    with pytest.raises(CeilingError, match="swap ceiling cannot be enforced"):
        cgroup1._limit(directories, Physics())
    swaps.write_text("Filename\tType\tSize\tUsed\tPriority\n")
    cgroup1._limit(directories, Physics())
    assert (tmp_path / "memory" / "memory.limit_in_bytes").read_text().strip() == str(1024**3)
