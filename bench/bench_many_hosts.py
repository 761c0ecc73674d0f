"""Benchmark: K worker hosts on one machine against one set of shared services.

Each host is a network namespace of its own with a UTS namespace of its own (its own
hostname, so the fleet's holder identity, ``worker/fleet/holders.py``, sees K hosts),
joined to a private bridge by a veth pair on a private subnet (``--subnet``), with its
own ``HOME`` and ``OUROBOROS_HOME`` (state, lineage cache) and one real
``celery -A worker worker`` (as ``tests/support/fleet.Worker`` starts it, gossip and
mingle on, as deployed). All hosts share, listening on the bridge's address in the
root namespace:

* ONE repository server: an sshd whose one key is forced to git-shell on the shared
  bare repository (``tests/support/vm_fleet.GitSshd``, as ``bench_shared_costs`` uses it);
  with ``--homes N``, N of them, each on its own bare repository (the lineages spread
  over N homes, ``OUROBOROS_LINEAGE_REPOS``, by the rendezvous rule), their CPU summed;
* ONE Redis over TCP with a password (``PrivateRedis``, also bound to the bridge);
* ONE S3 endpoint: moto's standalone server over HTTP.

For each K of ``--hosts`` (default 1,2,4,8; the hosts of a smaller K stay up and the
next K adds hosts) the bench runs ``--lineages-per-host`` lineages a host of the
canonical seed with the ``scripted`` provider answering at once (``bench_shared_costs``'s
"instant" lives), waits ``--warm-up`` seconds and until every host has landed a
generation, then measures ``--window`` seconds: generations landed a second (each
worker's "succeeded" log lines), Redis's server CPU (``INFO cpu``) and commands a
second (``INFO commandstats``, the bench's own ``INFO`` left out), the repository
server's CPU (sshd and its children), moto's CPU, the workers' own CPU (each
worker's process tree: its pool and the sandboxes' lives) and the machine's CPU use
from ``/proc/stat`` (of its ``os.cpu_count()`` cores; on a shared machine what the
fleet did not use is other jobs'). At the end every lineage is
cancelled and its branch checked: in exactly one home, the one its name chooses;
history linear, ``gen N`` subjects without a gap or a repeat (no generation landed
twice).

The bench changes no host setting (no sysctl, no iptables, no route beyond the
bridge's own address) and removes its namespaces (with /run/netns if it made it),
bridge and veths on exit, on error and on Ctrl-C; a start also removes what an
earlier crashed run left (names ``ouroh-*``, and the processes in those namespaces).

Run: ``.venv/bin/python bench/bench_many_hosts.py [--hosts 1,2,4,8] [--homes 1] [--window 60]`` as
root (namespaces, sshd). A measurement, not a test: exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_shared_costs import (
    BUCKET,
    PREFIX,
    S3_KEY_ID,
    S3_SECRET,
    SUCCEEDED,
    create_bucket,
    process_cpu,
)
from common import SMALL_PHYSICS, BenchFleet, bench_args, machine_note, wait_for

# The fleet harness (tests/support), on sys.path since common's import.
from support.fleet import S3_REGION, Fleet, MotoServer, Worker, free_port, http_answers

if TYPE_CHECKING:  # imported at run time only after BenchFleet.activate()
    from support.vm_fleet import GitSshd

NAME = "ouroh"  # every namespace, bridge and veth this bench makes starts so
BRIDGE = f"{NAME}-br"
GENERATION = re.compile(r"^gen (\d+):")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class Network:
    """A bridge in the root namespace holding the subnet's first address, and K hosts,
    each a network namespace joined to it by a veth pair."""

    def __init__(self, subnet: str) -> None:
        self.subnet = ipaddress.ip_network(subnet)
        self.prefix = self.subnet.prefixlen
        self.address = str(self.subnet[1])  # the services' address
        self.hosts: list[str] = []
        # ``ip netns add`` makes /run/netns (a bind mount of itself) if it is missing.
        self.made_run_netns = not Path("/run/netns").exists()

    @staticmethod
    def clean() -> None:
        """Remove what this bench made, here or in an earlier run that crashed: the
        processes left in its namespaces (its own workers), the namespaces, the bridge."""
        for line in ip("netns", "list", check=False).stdout.splitlines():
            namespace = line.split()[0]
            if not namespace.startswith(f"{NAME}-"):
                continue
            for pid in ip("netns", "pids", namespace, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            ip("netns", "del", namespace, check=False)
        for line in ip("-o", "link", "show", check=False).stdout.splitlines():
            link = line.split(":")[1].strip().split("@")[0]
            if link.startswith(f"{NAME}-"):
                ip("link", "del", link, check=False)

    def up(self) -> None:
        self.clean()
        taken = ip("-o", "-4", "addr", "show").stdout
        for found in re.findall(r"inet (\S+)", taken):
            if ipaddress.ip_interface(found).network.overlaps(self.subnet):
                raise SystemExit(f"bench_many_hosts: {self.subnet} overlaps {found}, in use here")
        ip("link", "add", BRIDGE, "type", "bridge")
        ip("addr", "add", f"{self.address}/{self.prefix}", "dev", BRIDGE)
        ip("link", "set", BRIDGE, "up")

    def add_host(self) -> str:
        """A namespace joined to the bridge; its name."""
        index = len(self.hosts)
        namespace, outside = f"{NAME}-h{index}", f"{NAME}-v{index}"
        ip("netns", "add", namespace)
        self.hosts.append(namespace)
        ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        ip("link", "set", outside, "master", BRIDGE)
        ip("link", "set", outside, "up")
        address = f"{self.subnet[10 + index]}/{self.prefix}"
        ip("-n", namespace, "addr", "add", address, "dev", "eth0")
        ip("-n", namespace, "link", "set", "lo", "up")
        ip("-n", namespace, "link", "set", "eth0", "up")
        return namespace

    def down(self) -> None:
        self.clean()
        run_netns = Path("/run/netns")
        if self.made_run_netns and run_netns.is_dir() and not any(run_netns.iterdir()):
            # A bind mount on the same filesystem: os.path.ismount cannot see it.
            while subprocess.run(["mountpoint", "-q", str(run_netns)]).returncode == 0:
                subprocess.run(["umount", str(run_netns)], check=True)
            run_netns.rmdir()


class HostWorker(Worker):
    """``Worker``'s celery command, run in a host's network namespace and a UTS namespace
    of its own named ``hostname`` (nsenter and unshare exec: the pid is celery's)."""

    def __init__(
        self, fleet: Fleet, namespace: str, hostname: str, concurrency: int, **env: str
    ) -> None:
        self.name = hostname
        self.log_path = fleet.home / f"worker-{hostname}.log"
        self.log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{namespace}", "unshare", "--uts",
             "sh", "-c", 'hostname "$0" && exec "$@"', hostname,
             sys.executable, "-m", "celery", "-A", "worker", "worker", "--loglevel=INFO",
             "-n", f"{hostname}@%h", f"--concurrency={concurrency}"],
            env={**fleet.env, **env},
            cwd=fleet.home,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


class BridgedMoto(MotoServer):
    """moto's standalone server listening on ``host`` (the bridge's address)."""

    def __init__(self, log_path: Path, host: str) -> None:
        port = free_port()
        self.url = f"http://{host}:{port}"
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            wait_for(
                lambda: http_answers(f"{self.url}/moto-api/", self.process, log_path, "moto"),
                self.START_SECONDS,
                f"moto_server on {self.url}",
                0.1,
            )
        except AssertionError:
            self.stop()
            raise


@dataclass
class Meters:
    """Every service's counters, and the machine's, at one moment."""

    at: float
    landed: int
    redis_commands: int
    redis_cpu: float
    sshd_cpu: float
    moto_cpu: float
    workers_cpu: float
    machine_busy: float  # seconds of all cores
    machine_total: float


def machine_cpu() -> tuple[float, float]:
    """Busy and total CPU seconds of every core since boot (/proc/stat's first line)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / ticks, sum(fields[:8]) / ticks


@dataclass
class Row:
    hosts: int
    lineages: int
    seconds: float
    generations: int
    redis_cpu: float
    redis_commands: float
    sshd_cpu: float
    moto_cpu: float
    workers_cpu: float
    machine: float  # cores busy

    @property
    def rate(self) -> float:
        return self.generations / self.seconds


def main() -> None:
    parser = bench_args(__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="1,2,4,8", help="host counts, ascending")
    parser.add_argument("--lineages-per-host", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=1, help="per worker")
    parser.add_argument("--window", type=float, default=60.0, help="measured seconds per K")
    parser.add_argument("--warm-up", type=float, default=15.0, help="seconds before a window")
    parser.add_argument("--subnet", default="10.213.77.0/24", help="the bridge's private subnet")
    parser.add_argument(
        "--homes", type=int, default=1, help="shared repositories, each on its own server"
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_many_hosts: run as root (network namespaces, a private sshd)")
    counts = sorted({int(k) for k in args.hosts.split(",")})

    network = Network(args.subnet)
    # Ctrl-C and SIGTERM both unwind through the finally blocks below.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        network.up()
        with BenchFleet("hosts", keep=args.keep, redis_password=secrets.token_hex(16)) as fleet:
            fleet.activate()
            run_all(args, counts, network, fleet)
    finally:
        network.down()
    os._exit(0)  # the Celery producer's threads must not hold the exit


def run_all(
    args: argparse.Namespace, counts: list[int], network: Network, fleet: BenchFleet
) -> None:
    import redis
    from support import vm_fleet

    from worker.fleet.repo_admin import ensure_shared_repo

    assert fleet.redis is not None
    client = redis.Redis.from_url(fleet.redis_url)
    # The same server, also on the bridge: the hosts reach it there.
    client.config_set("bind", f"127.0.0.1 {network.address}")
    redis_url = fleet.redis.url_at(network.address)
    moto = BridgedMoto(fleet.root / "moto.log", network.address)
    # GitSshd listens on loopback (its readiness check) and, here, on the bridge too.
    vm_fleet.SSHD_CONFIG = vm_fleet.SSHD_CONFIG.replace(
        "ListenAddress 127.0.0.1:{port}\n",
        f"ListenAddress 127.0.0.1:{{port}}\nListenAddress {network.address}:{{port}}\n",
    )
    sshds: dict[str, GitSshd] = {}
    workers: list[HostWorker] = []
    # The default home is the fleet's repository; each other home a bare repository beside it.
    repos = {"default": fleet.repo}
    repos |= {f"h{i}": fleet.root / "homes" / f"h{i}.git" for i in range(1, args.homes)}
    try:
        create_bucket(moto.url)
        key = fleet.root / "worker-key"
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "bench", "-f", str(key)],
            check=True,
        )
        known_hosts = fleet.root / "known_hosts"
        for home, repo in repos.items():
            repo.parent.mkdir(exist_ok=True)
            ensure_shared_repo(str(repo))
            sshds[home] = vm_fleet.GitSshd(fleet.root / f"sshd-{home}", repo)
            sshds[home].authorize(key.with_suffix(".pub").read_text())
            with known_hosts.open("a") as known:
                known.write(sshds[home].known_host(network.address))
        urls = {home: sshd.url(network.address) for home, sshd in sshds.items()}
        others = {home: url for home, url in urls.items() if home != "default"}
        host_env = {
            "OUROBOROS_BROKER_URL": redis_url,
            "OUROBOROS_LINEAGE_REPO": urls["default"],
            "OUROBOROS_LINEAGE_REPOS": json.dumps(others) if others else "",
            "OUROBOROS_OBSERVATIONS": f"s3://{BUCKET}/{PREFIX}",
            "OUROBOROS_S3_ENDPOINT_URL": moto.url,
            "OUROBOROS_S3_REGION": S3_REGION,
            "AWS_ACCESS_KEY_ID": S3_KEY_ID,
            "AWS_SECRET_ACCESS_KEY": S3_SECRET,
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "GIT_SSH_COMMAND": (
                f"ssh -F /dev/null -i {key} -o IdentitiesOnly=yes"
                f" -o UserKnownHostsFile={known_hosts} -o StrictHostKeyChecking=yes"
                " -o BatchMode=yes"
            ),
        }
        # The scheduler's commands use the repositories' local paths (the control host) and
        # the same bucket.
        fleet.env.update(
            {k: v for k, v in host_env.items() if k.startswith(("OUROBOROS_S3", "AWS_"))},
            OUROBOROS_OBSERVATIONS=host_env["OUROBOROS_OBSERVATIONS"],
        )
        local = {
            "OUROBOROS_LINEAGE_REPO": str(fleet.repo),
            "OUROBOROS_LINEAGE_REPOS": json.dumps(
                {home: str(repo) for home, repo in repos.items() if home != "default"}
            )
            if others
            else "",
        }
        print(machine_note())
        ports = ", ".join(f"{home} :{sshd.port}" for home, sshd in sshds.items())
        print(
            f"services on {network.address} (bridge {BRIDGE}, {network.subnet}): "
            f"{len(sshds)} repositories over ssh (git-shell forced; {ports}), Redis with a "
            f"password :{fleet.redis.port}, S3 = moto {moto.url}",
            flush=True,
        )
        moto_pid = moto.process.pid

        def meters() -> Meters:
            commands = client.info("commandstats")
            busy, total = machine_cpu()
            cpu = client.info("cpu")
            return Meters(
                at=time.monotonic(),
                landed=sum(len(SUCCEEDED.findall(w.text())) for w in workers),
                redis_commands=sum(
                    int(v["calls"]) for k, v in commands.items() if k != "cmdstat_info"
                ),
                redis_cpu=float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
                sshd_cpu=sum(process_cpu(sshd.process.pid) for sshd in sshds.values()),
                moto_cpu=process_cpu(moto_pid),
                workers_cpu=sum(process_cpu(w.process.pid) for w in workers),
                machine_busy=busy,
                machine_total=total,
            )

        lineages: list[str] = []
        rows: list[Row] = []
        for count in counts:
            new_workers: list[HostWorker] = []
            while len(network.hosts) < count:
                namespace = network.add_host()
                index = len(network.hosts) - 1
                home = fleet.root / f"host-{index}"
                home.mkdir()
                host_fleet = Fleet(home, **{**fleet.env, "HOME": str(home)})
                host_fleet.env["OUROBOROS_HOME"] = str(home / ".ouroboros")
                worker = HostWorker(
                    host_fleet,
                    namespace,
                    f"{NAME}-host{index}",
                    args.concurrency,
                    **host_env,
                )
                workers.append(worker)
                new_workers.append(worker)
            for worker in new_workers:
                worker.wait_ready(180)
            while len(lineages) < count * args.lineages_per_host:
                name = f"l{len(lineages)}"
                fleet.fleet.ok("init", name, *SMALL_PHYSICS, **local)
                fleet.fleet.ok("run", name, "--generations", "100000", **local)
                lineages.append(name)
            started = [len(SUCCEEDED.findall(w.text())) for w in workers]
            time.sleep(args.warm_up)
            wait_for(
                lambda started=started: all(
                    len(SUCCEEDED.findall(w.text())) > s
                    for w, s in zip(workers, started, strict=True)
                ),
                300,
                f"every one of {count} hosts to land a generation",
                0.5,
            )
            before = meters()
            time.sleep(args.window)
            after = meters()
            seconds = after.at - before.at
            row = Row(
                hosts=count,
                lineages=len(lineages),
                seconds=seconds,
                generations=after.landed - before.landed,
                redis_cpu=(after.redis_cpu - before.redis_cpu) / seconds,
                redis_commands=(after.redis_commands - before.redis_commands) / seconds,
                sshd_cpu=(after.sshd_cpu - before.sshd_cpu) / seconds,
                moto_cpu=(after.moto_cpu - before.moto_cpu) / seconds,
                workers_cpu=(after.workers_cpu - before.workers_cpu) / seconds,
                machine=(after.machine_busy - before.machine_busy)
                / (after.machine_total - before.machine_total)
                * (os.cpu_count() or 1),
            )
            rows.append(row)
            print(
                f"K={count}: {row.generations} generations in {seconds:.1f} s, "
                f"{row.lineages} lineages; {machine_note()}",
                flush=True,
            )

        for name in lineages:
            fleet.fleet.ok("cancel", name, **local)
        keys = [f"ouroboros:{kind}:{name}" for name in lineages for kind in ("inflight", "lease")]
        wait_for(lambda: not client.exists(*keys), 300, "the lineages to finish", 0.5)
        for worker in workers:
            worker.stop(120)
        report(rows, check(repos, lineages), workers, len(repos))
    finally:
        for worker in workers:
            worker.stop(60)
        for sshd in sshds.values():
            sshd.stop()
        moto.stop()


def git_in(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", f"--git-dir={repo}", *args], capture_output=True, text=True, check=True
    ).stdout


def check(repos: dict[str, Path], lineages: list[str]) -> list[str]:
    """Each lineage's branch: in one home only, the rule's choice; no merge; ``gen N``
    subjects 1..n with no gap or repeat."""
    from worker.fleet.homes import rendezvous

    problems = []
    for name in lineages:
        branch = f"lineage-{name}"
        holders = [
            h for h, repo in repos.items() if git_in(repo, "for-each-ref", f"refs/heads/{branch}")
        ]
        if holders != [rendezvous(name, repos)]:
            problems.append(f"{name}: in homes {holders}, not only {rendezvous(name, repos)}")
            continue
        repo = repos[holders[0]]
        merges = git_in(repo, "rev-list", "--merges", branch).split()
        numbers = [
            int(m[1])
            for subject in reversed(git_in(repo, "log", "--format=%s", branch).splitlines())
            if (m := GENERATION.match(subject))
        ]
        expected = list(range(numbers[0], numbers[0] + len(numbers))) if numbers else []
        if merges or numbers != expected:
            repeats = [n for n, c in Counter(numbers).items() if c > 1]
            problems.append(f"{name}: {len(merges)} merges, repeated {repeats[:5]}")
    return problems


def report(rows: list[Row], problems: list[str], workers: list[HostWorker], homes: int) -> None:
    cores = os.cpu_count() or 1
    print()
    print(
        f"{'hosts':>5} {'lineages':>8} | {'gen/s':>6} {'per host':>8} | "
        f"{'Redis CPU':>9} {'cmds/s':>7} | {'repo CPU':>8} | {'moto CPU':>8} | "
        f"{'workers':>8} | {'machine':>12}"
    )
    print(
        f"{'':>5} {'':>8} | {'':>6} {'':>8} | {'(cores)':>9} {'':>7} | {'(cores)':>8} | "
        f"{'(cores)':>8} | {'(cores)':>8} | {f'(of {cores} cores)':>12}"
    )
    for r in rows:
        print(
            f"{r.hosts:>5} {r.lineages:>8} | {r.rate:>6.2f} {r.rate / r.hosts:>8.2f} | "
            f"{r.redis_cpu:>9.3f} {r.redis_commands:>7.0f} | {r.sshd_cpu:>8.3f} | "
            f"{r.moto_cpu:>8.3f} | {r.workers_cpu:>8.2f} | {r.machine:>12.2f}"
        )
    print()
    print("per generation (service CPU ms, Redis commands):")
    for r in rows:
        n = max(r.generations, 1) / r.seconds
        print(
            f"  K={r.hosts}: Redis {r.redis_cpu / n * 1000:.1f} ms, "
            f"{r.redis_commands / n:.0f} commands; repository {r.sshd_cpu / n * 1000:.0f} ms; "
            f"moto {r.moto_cpu / n * 1000:.0f} ms"
        )
    # A service saturates at one core (Redis is one thread; sshd and moto are bounded by
    # the machine here too); the machine at 90 % of its cores.
    verdict = "nothing saturated"
    for r in rows:
        services = {"Redis": r.redis_cpu, "the repository server": r.sshd_cpu, "moto": r.moto_cpu}
        busiest = max(services, key=lambda s: services[s])
        fleet = r.workers_cpu + sum(services.values())
        state = (
            f"at K={r.hosts}: machine {r.machine:.2f} of {cores} cores busy (the fleet's "
            f"workers {r.workers_cpu:.2f}, services {sum(services.values()):.2f}, other jobs "
            f"{max(r.machine - fleet, 0.0):.2f}); busiest service {busiest}, "
            f"{services[busiest]:.2f} of a core"
        )
        if services[busiest] >= 0.9:
            verdict = f"saturated first: {busiest}, {state}"
            break
        if r.machine >= 0.9 * cores:
            verdict = f"saturated first: this {cores}-core machine, {state}"
            break
        verdict = f"nothing saturated; {state}"
    print(f"\n{verdict}")
    where = f"each in its one home of {homes}, " if homes > 1 else ""
    print(
        "history: " + (f"{where}linear, no gap or repeat in any lineage" if not problems else "")
        + "; ".join(problems)
    )  # fmt: skip
    if any("Traceback" in w.text() for w in workers):
        print("note: a worker logged a traceback; see --keep", file=sys.stderr)


if __name__ == "__main__":
    main()
