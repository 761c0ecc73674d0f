"""A real sandbox host: a booted Debian 12 guest (systemd 252, cgroup v2) running the fleet.

Owns the end-to-end check of ``deploy/install.sh`` and the ceiling drivers on the
kind of host production runs on, which this CI machine (cgroup v1, no systemd) is
not: the image of ``scripts/vm-image.sh`` is booted under QEMU (TCG), the fleet is
installed from this checkout with ``deploy/install.sh`` as the unprivileged
``ouroboros`` user with lingering, and the worker, a user service with
``Delegate=yes``, runs real generations:

* ``doctor``, run as the worker runs (``install.sh --doctor``), finds the driver working;
* a life that rewrites itself ends ``changed``; one that outgrows its memory
  ceiling ends ``cgroup_oom`` with its OOM kills and peak memory, and the source
  of each figure; an endless loop ends ``wall_timeout``; a fork bomb is held at
  the task ceiling;
* the sandbox-identity walls hold under this real unprivileged worker: the life is
  the worker's own non-root uid, the only one mapped in its namespace, and nothing
  under /proc/sys is writable;

on Debian 12's own systemd once with the systemd driver (``auto`` picks it) and
once with ``OUROBOROS_CEILING=cgroup2`` in the subtree the service's
``Delegate=yes`` hands it, from one boot. The same on systemd 254 (bookworm with
systemd from bookworm-backports) takes another boot, more than the CI's budget
leaves: ``OUROBOROS_VM_RUNS=backports-systemd`` runs it instead of the default.

The guest has no network but its forwarded ssh port; the Python packages come
built into the image (scripts/vm-image.sh), their installation in a cached layer
over it (``vm_guest.fleet_layer``), the source is copied in over ssh. It holds
the machine-wide lock (``machine_to_itself``): TCG needs the machine's cores.

In the same boot, the compose file's worker container as a cgroup-v2 Docker host
runs it (``vm_container``): in its own cgroup namespace, through the real
entrypoint, the cgroup2 driver's lives pass the same checks.
"""

from __future__ import annotations

import io
import os
import re
import tarfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import pytest
from test_sandbox import PRELUDE
from test_sandbox_identity import WALLS, elisp
from vm_container import CGROUP, ContainerHost
from vm_container import NAME as CONTAINER_NAME
from vm_guest import WORKER_UNIT, Guest, Host, build_image, fleet_layer, install_fleet

pytestmark = [
    pytest.mark.vm,
    pytest.mark.root,
    # A cold image cache adds its build (debootstrap: several minutes) to the first test.
    pytest.mark.timeout(3600),
]

SYSTEMD_VERSIONS = {"bookworm": "252", "backports": "254"}
DRIVERS = ("systemd", "cgroup2")


def chosen_runs(spelled: str) -> list[tuple[str, str]]:
    """The runs OUROBOROS_VM_RUNS names: FLAVOUR-DRIVER, comma-separated."""
    runs = []
    for run in spelled.split(","):
        flavour, _, driver = run.strip().partition("-")
        if flavour not in SYSTEMD_VERSIONS or driver not in DRIVERS:
            raise pytest.UsageError(
                f"OUROBOROS_VM_RUNS: {run!r} is not FLAVOUR-DRIVER, with FLAVOUR one of"
                f" {', '.join(SYSTEMD_VERSIONS)} and DRIVER one of {', '.join(DRIVERS)}"
            )
        runs.append((flavour, driver))
    return runs


# The guests (scripts/vm-image.sh --systemd FLAVOUR), and the drivers each runs; the
# runs of one flavour share a boot.
RUNS = chosen_runs(os.environ.get("OUROBOROS_VM_RUNS", "bookworm-systemd,bookworm-cgroup2"))
TASKS_MAX = 24
SEEDS = "/var/lib/ouroboros/seeds"
FORKS = 64
# Each lineage: its seed (None: the canonical one) and its physics.
LINEAGES: dict[str, tuple[str | None, list[str]]] = {
    "grower": (None, ["--wall", "300"]),
    "glutton": (
        "(let (hoard) (dotimes (_ 4000) (push (make-string (* 1024 1024) ?x) hoard)))\n",
        ["--wall", "300", "--memory-max", "128M"],
    ),
    "looper": ("(while t)\n", ["--wall", "15", "--cpu-seconds", "15"]),
    "forker": (
        PRELUDE
        + '(report "forks" (shell '
        + elisp(
            f"exec 2>&1; i=0; while [ $i -lt {FORKS} ]; do sleep 60 >/dev/null 2>&1 &"
            " i=$((i+1)); echo $i >/work/forks-started; done"
        )
        + "))\n",
        ["--wall", "300", "--tasks-max", str(TASKS_MAX)],
    ),
    "prober": (
        PRELUDE
        + '(report "identity" (shell "id -u; cat /proc/self/uid_map"))\n'
        + f'(report "walls" (shell {elisp(WALLS)}))\n',
        ["--wall", "300"],
    ),
}


def seeds(drivers: list[str]) -> bytes:
    """The seeds of LINEAGES for each driver's lineages, as a tar to unpack at /."""
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        for driver in drivers:
            for name, (seed, _physics) in LINEAGES.items():
                if seed is None:
                    continue
                data = (";;; -*- lexical-binding: t; -*-\n" + seed).encode()
                member = tarfile.TarInfo(f"{SEEDS}/{name}-{driver}.el".lstrip("/"))
                member.size, member.mode = len(data), 0o644
                tar.addfile(member, io.BytesIO(data))
    return archive.getvalue()


def init_commands(driver: str) -> list[list[str]]:
    """``schedule-lineage init`` of each of LINEAGES for ``driver``."""
    commands = []
    for name, (seed, physics) in LINEAGES.items():
        seed_args = [] if seed is None else ["--seed", f"{SEEDS}/{name}-{driver}.el"]
        commands.append(["init", f"{name}-{driver}", *seed_args, *physics])
    return commands


class Guests:
    """One booted guest at a time, with the fleet installed; another flavour replaces it.

    A flavour's guest is booted once, from the cached layer of ``fleet_layer``, and
    serves each of its drivers in turn: the worker is restarted with the next
    OUROBOROS_CEILING. Every lineage of every driver is created at once, in one
    Python start.
    """

    def __init__(self, scratch: pytest.TempPathFactory, report: Callable[[str], None]) -> None:
        self.scratch = scratch
        self.report = report
        self.flavour: str | None = None
        self.driver: str | None = None
        self.guest: Guest | None = None
        self.current: Host | None = None

    def host(self, flavour: str, driver: str) -> Host:
        if self.flavour == flavour and self.current is not None:
            if self.driver != driver:
                started = time.monotonic()
                self.current.set_ceiling(driver)
                self.current.user_systemctl("restart", WORKER_UNIT)
                self.driver = driver
                self.report(
                    f"vm host {flavour}: worker restarted for the {driver} driver in"
                    f" {time.monotonic() - started:.0f} s"
                )
            return self.current
        self.close()
        times: dict[str, float] = {}
        started = time.monotonic()
        image = build_image(flavour)
        times["image"] = time.monotonic() - started
        started = time.monotonic()
        layer = fleet_layer(image, self.scratch.mktemp(f"vm-{flavour}-layer"))
        times["layer"] = time.monotonic() - started
        guest = self.guest = Guest(image, self.scratch.mktemp(f"vm-{flavour}"), layer=layer)
        self.flavour = flavour
        times["boot"] = guest.boot()
        started = time.monotonic()
        # All of LINEAGES live at once: the looper's 15 s of wall time and each life's
        # waits overlap the others' work on the guest's two CPUs.
        host = install_fleet(guest, driver, concurrency=len(LINEAGES))
        times["install"] = time.monotonic() - started
        started = time.monotonic()
        drivers = [d for f, d in RUNS if f == flavour]
        guest.run(
            f"tar -C / -xf - && chown -R ouroboros: {SEEDS}",
            input=seeds(drivers),
        )
        host.cli_batch([command for d in drivers for command in init_commands(d)])
        times["init"] = time.monotonic() - started
        self.current, self.driver = host, driver
        version = (image / "systemd-version").read_text().strip()
        self.report(
            f"vm host {flavour} ({version}): "
            + ", ".join(f"{k} {v:.0f} s" for k, v in times.items())
        )
        return host

    def close(self) -> None:
        # Its overlay is thrown away: nothing in the guest needs a clean shutdown.
        if self.guest is not None:
            self.guest.power_off()
        self.flavour, self.driver, self.guest, self.current = None, None, None, None


class Lives(NamedTuple):
    """One generation of each of LINEAGES, lived on a guest's worker under one driver."""

    host: Host
    flavour: str
    driver: str
    doctor: str
    observations: dict[str, dict[str, Any]]


@pytest.fixture(scope="module")
def guests(
    machine_to_itself: None,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Guests]:
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    pool = Guests(tmp_path_factory, reporter.write_line if reporter else print)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="module", params=RUNS, ids=[f"{f}-{d}" for f, d in RUNS])
def lives(guests: Guests, request: pytest.FixtureRequest) -> Lives:
    flavour, driver = request.param
    host = guests.host(flavour, driver)
    names = [f"{name}-{driver}" for name in LINEAGES]
    started = time.monotonic()
    # The doctor (its own Python start, in its own unit) meanwhile.
    with ThreadPoolExecutor(1) as pool:
        doctor = pool.submit(host.doctor)
        host.cli("run", *names, "--generations", "1", "--wait", timeout=2400)
        found = {name: host.observation(f"{name}-{driver}", 1) for name in LINEAGES}
        report = doctor.result()
    guests.report(
        f"vm host {flavour}, {driver} driver: {len(names)} generations and the doctor in"
        f" {time.monotonic() - started:.0f} s"
    )
    return Lives(host, flavour, driver, report, found)


def test_the_guest_runs_the_systemd_it_stands_for(lives: Lives) -> None:
    version = lives.host.guest.run("systemctl --version").stdout.split()[1]
    assert version == SYSTEMD_VERSIONS[lives.flavour]


def test_doctor_finds_the_driver_working_as_the_worker_runs(lives: Lives) -> None:
    text = " ".join(lives.doctor.split())
    assert re.search(rf"ceiling\W+ok\W+{lives.driver} driver works", text), text


def test_a_life_that_rewrites_itself_ends_changed(lives: Lives) -> None:
    observation = lives.observations["grower"]
    assert observation["outcome"] == "changed", observation["stderr"]
    expected = "success" if lives.driver == "systemd" else "exited"
    assert observation["driver_result"] == expected
    assert observation["oom_kills"] == 0
    assert observation["cpu_usage_nsec"] > 0
    assert observation["memory_peak_bytes"] > 0


def test_memory_past_the_ceiling_ends_cgroup_oom_with_its_figures(lives: Lives) -> None:
    observation = lives.observations["glutton"]
    assert observation["outcome"] == "cgroup_oom", observation["stderr"]
    assert observation["driver_result"] == "oom-kill"
    assert observation["oom_kills"] >= 1
    assert 64 * 2**20 < observation["memory_peak_bytes"] <= 128 * 2**20
    sources = observation["figure_sources"]
    if lives.driver == "systemd":
        # systemd 252 has neither MemoryPeak nor OOMKills: the unit's own cgroup tells.
        assert sources["oom_kills"].startswith(
            "cgroup2:memory.events oom_kill of the unit's cgroup /user.slice/"
        ), sources
        assert sources["memory_peak_bytes"].startswith(
            "cgroup2:memory.peak of the unit's cgroup /user.slice/"
        ), sources
        assert sources["cpu_usage_nsec"] == "systemd:CPUUsageNSec"
    else:
        assert sources["oom_kills"] == "cgroup2:memory.events oom_kill"
        assert sources["memory_peak_bytes"] == "cgroup2:memory.peak"


def test_an_endless_loop_ends_wall_timeout(lives: Lives) -> None:
    observation = lives.observations["looper"]
    assert observation["outcome"] == "wall_timeout", observation["stderr"]
    assert observation["driver_result"] == "timeout"
    # The figures outlive the wall-time kill: the systemd driver signals only the
    # unit's main process, so the ExecStopPost= collector the manager runs is spared
    # even when the manager's own RuntimeMaxSec fired first.
    assert observation["memory_peak_bytes"] > 0
    assert observation["oom_kills"] == 0
    assert observation["cpu_usage_nsec"] > 0


def test_a_fork_bomb_is_held_at_the_task_ceiling(lives: Lives) -> None:
    observation = lives.observations["forker"]
    assert observation["outcome"] == "changed", observation["stderr"]
    # The life went on after its forks were refused, and ended by itself.
    expected = "success" if lives.driver == "systemd" else "exited"
    assert observation["driver_result"] == expected
    assert observation["constraints"]["tasks_max"] == TASKS_MAX


def test_the_forks_stopped_below_the_ceiling(lives: Lives) -> None:
    name = f"forker-{lives.driver}"
    started = int(lives.host.show(name, "forks-started"))
    assert 0 < started < TASKS_MAX
    assert "Cannot fork" in lives.host.show(name, "forks")


def test_the_life_is_its_own_unprivileged_uid_and_proc_sys_is_read_only(
    lives: Lives,
) -> None:
    name = f"prober-{lives.driver}"
    prober = lives.observations["prober"]
    assert prober["outcome"] == "changed", prober["stderr"]
    worker_uid = int(lives.host.guest.run("id -u ouroboros").stdout)
    uid, uid_map = lives.host.show(name, "identity").splitlines()
    assert worker_uid != 0
    assert int(uid) == worker_uid
    # Seen from inside, one uid is mapped: the life's own. bwrap nests its namespace in
    # one of its own (whose root is the worker's uid outside), so the outside column
    # reads 0 here; the host-side view, U U 1, is test_sandbox_identity's (as root).
    inside, _outside, count = uid_map.split()
    assert (int(inside), count) == (worker_uid, "1")
    walls = lives.host.show(name, "walls").splitlines()
    assert "sys-writable 0" in walls
    assert "core-pattern-writable" not in walls
    assert not [line for line in walls if line.startswith(("wrote-", "made-"))]
    assert not {"writable /proc/sys", "writable /proc/sys/kernel"} & set(walls)


# --- the compose worker's container, in its own cgroup namespace, on the same boot --------


class ContainerRun(NamedTuple):
    """One generation of each of LINEAGES, lived by the worker of the guest's container."""

    lives: Lives
    # The container's init (docker-init's place): its cgroup and uid, as the guest sees them.
    init_cgroup: str
    init_uid: int
    # Whatever the container's worker leaf holds: each process's uid and command line.
    leaf: list[tuple[int, str]]
    root_procs: str
    root_subtree_control: str


@pytest.fixture(scope="module")
def container(guests: Guests) -> ContainerRun:
    """The compose worker on a cgroup-v2 Docker host, emulated in the booted guest.

    Its own cgroup namespace, cgroup2 mounted read-only, the real entrypoint (root,
    then the unprivileged ``ouroboros`` user), ``celery -A worker worker``, the
    cgroup2 driver (``auto`` would pick it too: no user manager answers in there).
    The lineages are created and run with the CLI as the compose ``cli`` service
    runs it; the doctor goes through the entrypoint, as ``docker compose exec``.
    """
    host = guests.current or guests.host(*RUNS[-1])
    assert guests.flavour is not None
    box = ContainerHost(host.guest, host.install)
    names = [f"{name}-cgroup2" for name in LINEAGES]
    started = time.monotonic()
    box.start(concurrency=len(LINEAGES))
    try:
        # Seeds and lineages while the container's worker starts.
        box.guest.run(f"tar -C / -xf - && chown -R ouroboros: {SEEDS}", input=seeds(["cgroup2"]))
        box.cli_batch(init_commands("cgroup2"))
        box.wait_ready()
        with ThreadPoolExecutor(1) as pool:
            doctor = pool.submit(box.doctor)
            box.cli("run", *names, "--generations", "1", "--wait", timeout=2400)
            found = {name: box.observation(f"{name}-cgroup2", 1) for name in LINEAGES}
            report = doctor.result()
        init = box.init_pid()
        run = ContainerRun(
            lives=Lives(box, guests.flavour, "cgroup2", report, found),
            init_cgroup=box.cgroup_of(init),
            init_uid=int(box.guest.run(f"stat -c %u /proc/{init}").stdout),
            leaf=box.processes(f"{CGROUP}/worker"),
            root_procs=box.guest.run(f"cat {CGROUP}/cgroup.procs").stdout,
            root_subtree_control=box.guest.run(f"cat {CGROUP}/cgroup.subtree_control").stdout,
        )
    finally:
        box.stop()
    guests.report(
        f"vm host {guests.flavour}, the compose worker's container: its start,"
        f" {len(names)} generations and the doctor in {time.monotonic() - started:.0f} s"
    )
    return run


# The checks of every driver run, on the container's lives.
CONTAINER_CHECKS = (
    test_doctor_finds_the_driver_working_as_the_worker_runs,
    test_a_life_that_rewrites_itself_ends_changed,
    test_memory_past_the_ceiling_ends_cgroup_oom_with_its_figures,
    test_an_endless_loop_ends_wall_timeout,
    test_a_fork_bomb_is_held_at_the_task_ceiling,
    test_the_forks_stopped_below_the_ceiling,
    test_the_life_is_its_own_unprivileged_uid_and_proc_sys_is_read_only,
)


@pytest.mark.parametrize(
    "check",
    CONTAINER_CHECKS,
    ids=[check.__name__.removeprefix("test_") for check in CONTAINER_CHECKS],
)
def test_in_a_containers_cgroup_namespace(
    container: ContainerRun, check: Callable[[Lives], None]
) -> None:
    check(container.lives)


def test_the_containers_lives_were_lived_in_it(container: ContainerRun) -> None:
    for observation in container.lives.observations.values():
        provenance = observation["provenance"]
        assert (provenance["worker_host"], provenance["ceiling_driver"]) == (
            CONTAINER_NAME,
            "cgroup2",
        )


def test_the_doctor_names_the_containers_namespace_root(container: ContainerRun) -> None:
    text = " ".join(container.lives.doctor.split())
    assert (
        "cgroup2 driver works (the root of this container's cgroup namespace, /sys/fs/cgroup:"
        " its processes in /sys/fs/cgroup/worker, scopes under /sys/fs/cgroup/ouroboros)"
    ) in text, text


def test_the_unprivileged_worker_moved_the_containers_processes_to_a_leaf(
    container: ContainerRun,
) -> None:
    # The namespace root holds no process and hands cpu, memory and pids down.
    assert container.root_procs == ""
    assert container.root_subtree_control.split() == ["cpu", "memory", "pids"]
    # Root's init among them: moved by the worker, which runs as the ouroboros user.
    assert (container.init_cgroup, container.init_uid) == (f"/{CONTAINER_NAME}/worker", 0)
    worker_uid = int(container.lives.host.guest.run("id -u ouroboros").stdout)
    celery = [uid for uid, args in container.leaf if "celery" in args]
    assert celery and set(celery) == {worker_uid}, container.leaf
