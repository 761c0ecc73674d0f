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

Then the same guest becomes the fleet's second host (``vm_fleet``): its worker is
configured as an operator configures one, for the services this host runs on
loopback ports only the guest's forwarded connections reach: a Redis that wants a
password, moto's S3, and the shared bare repository over ssh (an sshd of the
test's, key-only, each key forced to fetch and push of that repository). A
worker on this host serves the same queue, and:

* both workers serve ``gen.<fingerprint12>`` of the instrument this checkout is;
* six lineages of three generations each, run across both, land every
  generation once, in order, on a linear branch, each with one observation in
  the bucket that names its commit and its parent, and each host lived some (the
  observation's ``worker_host``);
* the broker's password and the S3 secret show in no command line (``ps`` on
  either side while the lives ran) and no log (the guest's journal, this host's
  worker, reconciler, Redis and sshd); the guest logs its broker redacted, and its
  settings and S3 credentials are 0640 root:ouroboros;
* the guest powered off (QEMU killed) while it lives a lineage's generation: the
  lineage's lease expires, the reconciler re-enqueues it, and the worker on this
  host lives that generation and the next, each once, both observed as its own.

That last test ends the guest: it runs last.

The guest has no network but its forwarded ssh port and the ports of this host's
fleet services; the Python packages come
built into the image (scripts/vm-image.sh), their installation in a cached layer
over it (``vm_guest.fleet_layer``), the source is copied in over ssh. It holds
the machine-wide lock (``machine_to_itself``): TCG needs the machine's cores.

In the same boot, the compose file's worker container as a cgroup-v2 Docker host
runs it (``vm_container``): in its own cgroup namespace, through the real
entrypoint, the cgroup2 driver's lives pass the same checks.
"""

from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
import tarfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import redis
from support.fleet import Worker, seed_file, wait_for
from support.lives import SLOW, WRITES_STATE, background
from support.sandbox import PRELUDE, WALLS, elisp
from support.vm_container import CGROUP, ContainerHost
from support.vm_container import NAME as CONTAINER_NAME
from support.vm_fleet import LEASE_SECONDS, ControlHost, Landed, join, landed
from support.vm_guest import (
    HOST_ALIAS,
    WORKER_UNIT,
    Guest,
    Host,
    build_image,
    fleet_layer,
    install_fleet,
)

from scheduler.liveness import ask
from worker.fleet.app import client_app
from worker.fleet.settings import Settings
from worker.instrument.fingerprint import current

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

    def __init__(
        self,
        scratch: pytest.TempPathFactory,
        report: Callable[[str], None],
        host_ports: tuple[int, ...] = (),
    ) -> None:
        self.scratch = scratch
        self.report = report
        self.host_ports = host_ports
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
        guest = self.guest = Guest(
            image, self.scratch.mktemp(f"vm-{flavour}"), self.host_ports, layer=layer
        )
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
def control_host(
    machine_to_itself: None, s3_endpoint: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlHost]:
    """The fleet's services on this host: up before a guest boots, which can reach only
    the ports it was started with."""
    control = ControlHost(tmp_path_factory.mktemp("vm-control"), s3_endpoint)
    try:
        yield control
    finally:
        control.stop()


@pytest.fixture(scope="module")
def guests(
    machine_to_itself: None,
    control_host: ControlHost,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Guests]:
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    pool = Guests(tmp_path_factory, reporter.write_line if reporter else print, control_host.ports)
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


# The guest as a second fleet host. These come last in the module, the power-off last
# of all: it ends the guest's life, and a test after it would boot another.
FLEET_NAMES = [f"shared-{n}" for n in range(1, 7)]
FLEET_GENERATIONS = 3
# The lineage whose life the guest is living when it loses power. Its first life (no
# state.el yet) sleeps: long enough to be caught in the act over ssh, short enough
# for the host's worker to live it again; the next ones do not.
NAPPER = "napper"
NAPPER_SECONDS = 15
NAPS_ONCE = f'(unless (file-exists-p "/work/state.el") (sleep-for {NAPPER_SECONDS}))\n'
GUEST_WORKER = "ouroboros-worker@ouroboros-guest"


class TwoHosts(NamedTuple):
    """The guest joined to the host's fleet, after the shared lineages' run."""

    control: ControlHost
    host: Host
    guests: Guests
    workers: list[Worker]
    queue: str
    serving: list[str]
    found: dict[str, Landed]
    reconciler_log: Path
    # What ``ps`` showed on either side while the run went on, and the guest's journal.
    host_ps: str
    guest_ps: str
    guest_journal: str


def ps() -> str:
    return subprocess.run(
        ["ps", "-e", "-ww", "-o", "args="], capture_output=True, text=True, check=True
    ).stdout


@pytest.fixture(scope="module")
def two_hosts(guests: Guests, control_host: ControlHost) -> Iterator[TwoHosts]:
    """The last guest booted joins the fleet; both hosts' workers run FLEET_NAMES.

    The host's worker is a real Celery worker as the fleet tests start them, on the
    repository's local path; the guest's is its ``ouroboros-worker.service``, on the
    same repository over ssh. Each lineage was created here, so its queue is the
    checkout's instrument: the guest serves it only if its installed release is
    the same instrument.
    """
    started = time.monotonic()
    host = guests.host(*RUNS[-1])
    fleet = control_host.fleet
    seed = seed_file(fleet.home, SLOW.format(seconds=0.5) + WRITES_STATE, "shared.el")
    napper = seed_file(fleet.home, NAPS_ONCE + WRITES_STATE, "nap.el")
    physics = ["--wall", "120", "--cpu-seconds", "60", "--memory-max", "512M"]
    with ThreadPoolExecutor(1) as pool:
        created = pool.submit(
            lambda: (
                [fleet.ok("init", name, "--seed", str(seed), *physics) for name in FLEET_NAMES]
                + [fleet.ok("init", NAPPER, "--seed", str(napper), *physics)]
            )
        )
        configured = join(host, control_host)
        created.result()
    meta = json.loads(fleet.show(FLEET_NAMES[0], ".ouroboros-lineage.json"))
    queue = "gen." + meta["instrument_fingerprint"][:12]
    workers = [Worker(fleet, "host", concurrency=2)]
    reconciler_log = fleet.home / "reconciler.log"
    reconciler = background(fleet, "reconcile", "--loop", log=reconciler_log)
    try:
        workers[0].wait_ready()
        app = client_app(Settings(broker_url=control_host.redis.url))

        def both_serve() -> list[str]:
            serving = ask(app, timeout=2).serving(queue)
            return serving if GUEST_WORKER in serving and len(serving) > 1 else []

        serving = wait_for(both_serve, 900, f"both hosts' workers to serve {queue}", interval=2)
        joined = time.monotonic() - started
        with ThreadPoolExecutor(1) as pool:
            run = pool.submit(
                fleet.ok, "run", *FLEET_NAMES, "--generations", str(FLEET_GENERATIONS),
                "--wait", timeout=2400,
            )  # fmt: skip
            host_ps, guest_ps = [], []
            while not run.done():
                host_ps.append(ps())
                guest_ps.append(host.guest.run("ps -e -ww -o args=").stdout)
                time.sleep(5)
            run.result()
        lived = time.monotonic() - started - joined
        guests.report(
            f"vm second host: joined in {joined:.0f} s (guest configured {configured[0]:.0f} s,"
            f" install.sh {configured[1]:.0f} s, its worker serving"
            f" {joined - sum(configured):.0f} s later); {len(FLEET_NAMES)} x"
            f" {FLEET_GENERATIONS} generations across both hosts in {lived:.0f} s"
        )
        yield TwoHosts(
            control=control_host,
            host=host,
            guests=guests,
            workers=workers,
            queue=queue,
            serving=serving,
            found={name: landed(control_host, name) for name in FLEET_NAMES},
            reconciler_log=reconciler_log,
            host_ps="\n".join(host_ps),
            guest_ps="\n".join(guest_ps),
            guest_journal=host.guest.run("journalctl --no-pager -o cat").stdout,
        )
    finally:
        reconciler.kill()
        reconciler.wait()
        for worker in workers:
            worker.stop()


def assert_exactly_once(found: Landed, count: int, lineage: str) -> None:
    """Generations 1..count, each once, in order, on a linear branch; one observation each."""
    numbered = [s.split(":")[0] for s in found.subjects]
    assert numbered == [f"gen {n}" for n in range(1, count + 1)], lineage
    assert all(len(parents) == 1 for parents in found.parents), found.parents
    assert [p[0] for p in found.parents[1:]] == found.commits[:-1]
    assert [o["generation"] for o in found.observations] == list(range(1, count + 1))
    for observation, commit, parents in zip(
        found.observations, found.commits, found.parents, strict=True
    ):
        assert observation["lineage_commit"] == commit
        assert observation["parent_commit"] == parents[0]


def test_both_hosts_serve_the_queue_of_the_same_instrument(two_hosts: TwoHosts) -> None:
    assert two_hosts.queue == current().queue
    assert GUEST_WORKER in two_hosts.serving
    assert f"host@{socket.gethostname()}" in two_hosts.serving


def test_lineages_advance_across_both_hosts_exactly_once(two_hosts: TwoHosts) -> None:
    lived_on: dict[str, int] = {}
    for name, found in two_hosts.found.items():
        assert_exactly_once(found, FLEET_GENERATIONS, name)
        for observation in found.observations:
            where = observation["provenance"]["worker_host"]
            lived_on[where] = lived_on.get(where, 0) + 1
    # Both hosts lived some: each observation names the host its worker ran on.
    assert set(lived_on) == {socket.gethostname(), "ouroboros-guest"}, lived_on
    assert sum(lived_on.values()) == len(FLEET_NAMES) * FLEET_GENERATIONS


def test_secrets_stay_out_of_command_lines_and_logs(two_hosts: TwoHosts) -> None:
    logs = {
        **{path.name: path.read_text(errors="replace") for path in two_hosts.control.logs},
        "host worker": two_hosts.workers[0].text(),
        "reconciler": two_hosts.reconciler_log.read_text(errors="replace"),
        "guest journal": two_hosts.guest_journal,
        "ps on the host": two_hosts.host_ps,
        "ps in the guest": two_hosts.guest_ps,
    }
    for secret in two_hosts.control.secrets:
        leaks = [where for where, text in logs.items() if secret in text]
        assert not leaks, f"a secret shows in: {', '.join(leaks)}"
    # The guest's worker did log its broker, redacted (Celery's banner).
    assert f"redis://:**@{HOST_ALIAS}:{two_hosts.control.redis.port}/0" in two_hosts.guest_journal
    # The settings (the broker's password) and the S3 credentials: root writes them, the
    # worker's account reads them, nobody else.
    modes = two_hosts.host.guest.run(
        "stat -c '%a %U %G' /etc/ouroboros/ouroboros.env /etc/ouroboros/credentials/s3-writer.ini"
    ).stdout.split("\n")
    assert modes[:2] == ["640 root ouroboros"] * 2


def test_a_guest_powered_off_mid_life_leaves_its_lineage_to_the_host(
    two_hosts: TwoHosts,
) -> None:
    fleet, guest = two_hosts.control.fleet, two_hosts.host.guest
    # The host's worker steps aside, so that the guest's takes the napper's job.
    two_hosts.workers[0].stop()
    fleet.ok("run", NAPPER, "--generations", "2")
    redis_client = redis.Redis.from_url(two_hosts.control.redis.url, socket_timeout=10)
    lease = wait_for(
        lambda: redis_client.get(f"ouroboros:lease:{NAPPER}"), 600, "the napper's lease"
    )
    assert lease.decode().startswith("ouroboros-guest:"), lease
    # The guest holds the job now: a worker here may start meanwhile.
    heir = Worker(fleet, "heir", concurrency=2)
    two_hosts.workers.append(heir)
    wait_for(
        lambda: guest.run("pgrep -u ouroboros -x bwrap", check=False).returncode == 0,
        300,
        "the napper's life to run in the guest",
        interval=1,
    )
    two_hosts.guests.close()
    powered_off = time.monotonic()
    assert landed(two_hosts.control, NAPPER).subjects == []
    heir.wait_ready()
    wait_for(
        lambda: len(two_hosts.control.observation_numbers(NAPPER)) == 2,
        LEASE_SECONDS + NAPPER_SECONDS + 600,
        "the host's worker to finish the napper's run",
        interval=1,
    )
    two_hosts.guests.report(
        f"vm second host: the run the guest lost finished on the host"
        f" {time.monotonic() - powered_off:.0f} s after the power-off"
    )
    found = landed(two_hosts.control, NAPPER)
    assert_exactly_once(found, 2, NAPPER)
    assert {o["provenance"]["worker_host"] for o in found.observations} == {socket.gethostname()}
    assert f"{NAPPER} gen 2: changed" in heir.text()
