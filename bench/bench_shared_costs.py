"""Benchmark: what one generation costs each shared service, on the paths a second host uses.

One real ``celery -A worker worker`` (run as the deployment's units run it: gossip,
mingle and task events on) reaches every shared service the way a worker on another
host does:

* the **shared repository over ssh**: a private sshd on a free 127.0.0.1 port with its
  own host key, one authorized key whose forced command is git-shell on that one
  repository (``tests/support/vm_fleet.GitSshd``, the compose fleet's git-ssh
  service's rule); the worker's ``OUROBOROS_LINEAGE_REPO`` is ``ssh://root@127.0.0.1:
  PORT/...`` and its ``GIT_SSH_COMMAND`` a wrapper around ssh (key, pinned host key)
  that logs each connection's kind and wall as the worker sees it;
* **Redis over TCP with a password** (``requirepass``), read before and after with
  ``INFO commandstats``, ``INFO stats`` and ``INFO cpu``;
* **S3 over HTTP**: moto's standalone server behind a byte-counting TCP forwarder
  (``tests/support/fleet.Switch``), requests by method from moto's request log.

The scheduler's own commands (``init``, ``run``, ``cancel``) use the repository's
local path, as on the control host, and happen outside the measured windows. The
bench itself never touches a service inside a window except for the INFO snapshots
(left out of the counts): it counts landed generations in the worker's log.

Windows, each counted on the services' own meters:

* **idle**: the worker with nothing to do, ``--idle`` seconds: the per-host background
  (heartbeats, gossip, polling of the queues, lease and marker upkeep);
* **instant**: the canonical seed with the ``scripted`` provider answering at once;
* **model-bound**: the same with ``OUROBOROS_SCRIPTED_LATENCY_SECONDS`` (``--latency``,
  default 2) per call.

Each life kind runs ``--generations`` (default 20) after ``--warm-up`` (default 2) on
a worker of its own (concurrency 1). Figures are per generation; "marginal" is the
figure less the idle rate over the window's seconds (what a generation adds beyond
the host's background, the input of the sizing model in deploy/README.md).

Outside the windows: the messages the idle worker publishes, by channel and size
(each reaches every subscriber: every gossiping worker), the keys Redis holds (the
dead-holder sweep walks them all), and the server CPU of ssh connections whose
command the forced command refuses (ssh without git). ``--multiplex`` gives the
worker's ssh one kept connection (``ControlMaster``) that each git runs over.

Run: ``.venv/bin/python bench/bench_shared_costs.py [--generations 20]`` as root
(sshd). A measurement, not a test: exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import boto3

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SMALL_PHYSICS, BenchFleet, bench_args, machine_note, wait_for

# The fleet harness (tests/support), on sys.path since common's import.
from support.fleet import S3_REGION, MotoServer, Switch, Worker

if TYPE_CHECKING:  # imported at run time only after BenchFleet.activate()
    import redis
    from support.vm_fleet import GitSshd

S3_KEY_ID = "ouroboros-bench-key-id"
S3_SECRET = "ouroboros-bench-secret"
BUCKET = "ouroboros-costs"
PREFIX = "fleet"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# werkzeug's request line in moto's log: "PUT /bucket/key HTTP/1.1" 200 -
REQUEST_LINE = re.compile(r'"([A-Z]+) (\S+) HTTP/1\.[01]" (\d{3})')
SUCCEEDED = re.compile(r"Task ouroboros\.generation\[[^\]]+\] succeeded")

# GIT_SSH_COMMAND: ssh with the worker's key and the server's pinned host key, nothing
# of root's own ssh configuration; each connection logged as "KIND START END". Named
# "ssh" so that git speaks to it as to OpenSSH (port option, protocol v2).
SSH_WRAPPER = """\
#!/bin/sh
start=$(date +%s.%N)
ssh -F /dev/null -i {key} -o IdentitiesOnly=yes -o UserKnownHostsFile={known_hosts} \\
  -o StrictHostKeyChecking=yes -o BatchMode=yes {multiplex} "$@"
status=$?
for last; do :; done
echo "${{last%% *}} $start $(date +%s.%N)" >> {log}
exit $status
"""


class CountingForwarder(Switch):
    """The S3 endpoint's forwarder, counting the bytes each way."""

    def __init__(self, target_port: int) -> None:
        self.sent = 0  # client to server: requests and their bodies
        self.received = 0  # server to client
        self.lock = threading.Lock()
        super().__init__(target_port)

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:  # type: ignore[override]
        upward = source.getsockname()[1] == self.port
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                with self.lock:
                    if upward:
                        self.sent += len(data)
                    else:
                        self.received += len(data)
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)


@dataclass
class Meters:
    """Every service's counters at one moment."""

    at: float
    redis_commands: Counter[str]
    redis_in: int
    redis_out: int
    redis_cpu: float
    sshd_cpu: float
    s3_sent: int
    s3_received: int
    s3_log_offset: int
    git_log_offset: int


@dataclass
class Window:
    """The difference of two ``Meters``, and what happened in between."""

    seconds: float
    generations: int
    redis_commands: Counter[str]
    redis_bytes: int
    redis_cpu: float
    sshd_cpu: float
    s3_requests: Counter[str]
    s3_bytes: int
    git_walls: dict[str, list[float]] = field(default_factory=dict)


def create_bucket(endpoint: str) -> None:
    """The bench's bucket on the S3 endpoint at ``endpoint``, with the bench's keys."""
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=S3_REGION,
        aws_access_key_id=S3_KEY_ID,
        aws_secret_access_key=S3_SECRET,
    ).create_bucket(Bucket=BUCKET)


def process_cpu(pid: int) -> float:
    """CPU seconds of ``pid``, its reaped children and its live descendants.

    A reaped child's time is in its parent's cutime+cstime; a live one's (a multiplexed
    connection's sshd) is its own until then: the sum over the live tree counts each once.
    """
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stats[int(entry)] = (
                    Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                )
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        total += sum(int(value) for value in stats[current][11:15])
        pending.extend(child for child, fields in stats.items() if int(fields[1]) == current)
    return total / CLOCK_TICKS


def main() -> None:
    parser = bench_args(__doc__.splitlines()[0])
    parser.add_argument("--generations", type=int, default=20, help="per life kind")
    parser.add_argument("--warm-up", type=int, default=2, help="generations before a window")
    parser.add_argument("--latency", type=float, default=2.0, help="model-bound call, seconds")
    parser.add_argument("--idle", type=float, default=30.0, help="seconds of the idle window")
    parser.add_argument(
        "--multiplex",
        action="store_true",
        help="the worker's ssh keeps one connection open and multiplexes git over it",
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_shared_costs: run as root (a private sshd serves the repository)")

    with BenchFleet("costs", keep=args.keep, redis_password=secrets.token_hex(16)) as fleet:
        fleet.activate()
        import redis
        from support.vm_fleet import GitSshd

        assert fleet.redis is not None
        moto = MotoServer(fleet.root / "moto.log")
        forwarder = CountingForwarder(int(moto.url.rsplit(":", 1)[1]))
        credentials = {
            "AWS_ACCESS_KEY_ID": S3_KEY_ID,
            "AWS_SECRET_ACCESS_KEY": S3_SECRET,
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }
        create_bucket(moto.url)
        shared = {
            "OUROBOROS_OBSERVATIONS": f"s3://{BUCKET}/{PREFIX}",
            "OUROBOROS_S3_ENDPOINT_URL": f"http://127.0.0.1:{forwarder.port}",
            "OUROBOROS_S3_REGION": S3_REGION,
            **credentials,
        }
        sshd = GitSshd(fleet.root / "sshd", fleet.repo)
        try:
            run(args, fleet, sshd, moto, forwarder, shared, redis.Redis.from_url(fleet.redis_url))
        finally:
            sshd.stop()
            moto.stop()
            forwarder.down()
    os._exit(0)  # the Celery producer's threads must not hold the exit


def run(
    args: argparse.Namespace,
    fleet: BenchFleet,
    sshd: GitSshd,
    moto: MotoServer,
    forwarder: CountingForwarder,
    shared: dict[str, str],
    client: redis.Redis,
) -> None:
    generations: int = args.generations
    warm_up: int = args.warm_up
    latency: float = args.latency
    idle: float = args.idle

    key = fleet.root / "worker-key"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "bench", "-f", str(key)], check=True
    )
    sshd.authorize(key.with_suffix(".pub").read_text())
    known_hosts = fleet.root / "known_hosts"
    known_hosts.write_text(sshd.known_host("127.0.0.1"))
    git_log = fleet.root / "git-connections.log"
    git_log.touch()
    wrapper_dir = fleet.root / "ssh-wrapper"
    wrapper_dir.mkdir()
    wrapper = wrapper_dir / "ssh"
    multiplex = (
        f"-o ControlMaster=auto -o ControlPath={fleet.root}/ssh-%C -o ControlPersist=30"
        if args.multiplex
        else ""
    )
    wrapper.write_text(
        SSH_WRAPPER.format(key=key, known_hosts=known_hosts, log=git_log, multiplex=multiplex)
    )
    wrapper.chmod(0o755)
    # Every process of the fleet sees the shared services as a second host does; the
    # scheduler's commands name the repository's local path, as on the control host.
    fleet.env.update(
        shared, OUROBOROS_LINEAGE_REPO=sshd.url("127.0.0.1"), GIT_SSH_COMMAND=str(wrapper)
    )
    local = str(fleet.repo)
    sshd_pid = sshd.process.pid

    def meters() -> Meters:
        stats, cpu = client.info("stats"), client.info("cpu")
        commands = Counter(
            {
                name.removeprefix("cmdstat_"): int(value["calls"])
                for name, value in client.info("commandstats").items()
            }
        )
        return Meters(
            at=time.monotonic(),
            redis_commands=commands,
            redis_in=int(stats["total_net_input_bytes"]),
            redis_out=int(stats["total_net_output_bytes"]),
            redis_cpu=float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
            sshd_cpu=process_cpu(sshd_pid),
            s3_sent=forwarder.sent,
            s3_received=forwarder.received,
            s3_log_offset=moto.log_path.stat().st_size,
            git_log_offset=git_log.stat().st_size,
        )

    def window(before: Meters, after: Meters, landed: int) -> Window:
        commands = after.redis_commands - before.redis_commands
        commands.pop("info", None)  # the bench's own snapshots
        with moto.log_path.open("rb") as log:
            log.seek(before.s3_log_offset)
            text = log.read(after.s3_log_offset - before.s3_log_offset).decode(errors="replace")
        requests = Counter(match[1] for match in REQUEST_LINE.finditer(text))
        with git_log.open("rb") as log:
            log.seek(before.git_log_offset)
            lines = log.read(after.git_log_offset - before.git_log_offset).decode().splitlines()
        walls: dict[str, list[float]] = {}
        for line in lines:
            kind, start, end = line.split()
            walls.setdefault(kind, []).append(float(end) - float(start))
        return Window(
            seconds=after.at - before.at,
            generations=landed,
            redis_commands=commands,
            redis_bytes=(after.redis_in - before.redis_in) + (after.redis_out - before.redis_out),
            redis_cpu=after.redis_cpu - before.redis_cpu,
            sshd_cpu=after.sshd_cpu - before.sshd_cpu,
            s3_requests=requests,
            s3_bytes=(after.s3_sent - before.s3_sent) + (after.s3_received - before.s3_received),
            git_walls=walls,
        )

    def landed(worker: Worker) -> int:
        return len(SUCCEEDED.findall(worker.text()))

    def measure(name: str, worker: Worker) -> Window:
        fleet.fleet.ok("init", name, *SMALL_PHYSICS, OUROBOROS_LINEAGE_REPO=local)
        fleet.fleet.ok("run", name, "--generations", "100000", OUROBOROS_LINEAGE_REPO=local)
        timeout = 120 + 30 * (latency + 5) * (warm_up + generations)
        wait_for(lambda: landed(worker) >= warm_up, timeout, f"{name}: the warm-up", 0.05)
        start_count, before = landed(worker), meters()
        wait_for(
            lambda: landed(worker) >= start_count + generations,
            timeout,
            f"{name}: {generations} generations",
            0.05,
        )
        end_count, after = landed(worker), meters()
        fleet.fleet.ok("cancel", name, OUROBOROS_LINEAGE_REPO=local)
        # The generation in flight finishes before its worker is stopped.
        keys = [f"ouroboros:{kind}:{name}" for kind in ("inflight", "lease")]
        wait_for(lambda: not client.exists(*keys), timeout, f"{name}: to finish", 0.2)
        return window(before, after, end_count - start_count)

    def event_sizes(seconds: float) -> dict[str, list[int]]:
        """Sizes of the messages published (heartbeats, task events) by channel, sampled
        outside every window: each goes to every subscriber of its channel."""
        subscription = client.pubsub(ignore_subscribe_messages=True)
        subscription.psubscribe("*")
        sizes: dict[str, list[int]] = {}
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            message = subscription.get_message(timeout=left)
            if message is not None:
                channel = message["channel"].decode()
                sizes.setdefault(channel, []).append(len(channel) + len(message["data"]))
        subscription.close()
        return sizes

    print(machine_note())
    print(
        f"repository over ssh (git-shell forced) at 127.0.0.1:{sshd.port}, Redis with a "
        f"password at {fleet.redis.port if fleet.redis else '?'}, S3 = moto over HTTP",
        flush=True,
    )
    windows: dict[str, Window] = {}
    worker = fleet.start_worker("instant", as_deployed=True)
    time.sleep(5)  # start-up traffic (mingle, first polls) is not the idle rate
    before = meters()
    time.sleep(idle)
    windows["idle"] = window(before, meters(), 0)
    print(f"idle: {idle:g} s measured", flush=True)
    keys_at_rest = client.dbsize()
    subscribers = client.pubsub_numpat()
    channels = [c.decode() for c in client.pubsub_channels()]
    sizes = event_sizes(idle / 2)
    windows["instant"] = measure("instant", worker)
    print(f"instant: {generations} generations in {windows['instant'].seconds:.1f} s", flush=True)
    worker.stop(120)
    worker = fleet.start_worker(
        "bound", as_deployed=True, OUROBOROS_SCRIPTED_LATENCY_SECONDS=str(latency)
    )
    windows["model-bound"] = measure("bound", worker)
    print(
        f"model-bound ({latency:g} s a call): {generations} generations in "
        f"{windows['model-bound'].seconds:.1f} s",
        flush=True,
    )
    report(windows)
    # What the ssh connection alone costs the server: a command the forced command
    # refuses (no git runs), as many times as a window's connections, outside windows.
    cpu_before, refused = process_cpu(sshd_pid), 10
    for _ in range(refused):
        subprocess.run(
            [str(wrapper), "-p", str(sshd.port), "root@127.0.0.1", "refused"],
            capture_output=True,
            timeout=120,
        )
    print(
        f"\nan ssh connection whose command is refused (no git): "
        f"{(process_cpu(sshd_pid) - cpu_before) / refused * 1000:.1f} ms of server CPU each"
    )
    print(f"\nthe idle worker's pattern subscriptions: {subscribers}; channels: {channels}")
    print(
        f"keys in Redis with one idle worker: {keys_at_rest}; after the runs: "
        f"{client.dbsize()} (the holder sweep walks the whole keyspace each second)"
    )
    print(f"messages published in {idle / 2:g} s of an idle worker, by channel:")
    for channel, each in sorted(sizes.items()):
        print(
            f"  {channel}: {len(each) / (idle / 2):.2f}/s, mean {sum(each) / len(each):.0f} bytes"
        )
    if any("Traceback" in w.text() for w in fleet.workers):
        print("note: a worker logged a traceback; see --keep", file=sys.stderr)


def report(windows: dict[str, Window]) -> None:
    idle = windows["idle"]
    kinds = ["instant", "model-bound"]

    def per_gen(kind: str, value: float) -> float:
        return value / windows[kind].generations

    def marginal(kind: str, value: float, idle_value: float) -> float:
        w = windows[kind]
        return (value - idle_value / idle.seconds * w.seconds) / w.generations

    rows: list[tuple[str, str, list[str]]] = []

    def row(label: str, unit: str, values: list[float], idle_rate: float, fmt: str) -> None:
        cells = [format(v, fmt) for v in values]
        rows.append((label, unit, [*cells, format(idle_rate, fmt)]))

    life = [windows[k].seconds / windows[k].generations for k in kinds]
    row("life (window / generations)", "s", life, 0.0, ".2f")
    commands = [sum(windows[k].redis_commands.values()) for k in kinds]
    idle_commands = sum(idle.redis_commands.values())
    row("Redis commands", "", [per_gen(k, c) for k, c in zip(kinds, commands, strict=True)],
        idle_commands / idle.seconds, ".0f")  # fmt: skip
    row("Redis commands, marginal", "",
        [marginal(k, c, idle_commands) for k, c in zip(kinds, commands, strict=True)],
        0.0, ".0f")  # fmt: skip
    row("Redis bytes (in+out)", "KiB", [per_gen(k, windows[k].redis_bytes) / 1024 for k in kinds],
        idle.redis_bytes / idle.seconds / 1024, ".1f")  # fmt: skip
    row("Redis bytes, marginal", "KiB",
        [marginal(k, windows[k].redis_bytes, idle.redis_bytes) / 1024 for k in kinds],
        0.0, ".1f")  # fmt: skip
    row("Redis server CPU", "ms", [per_gen(k, windows[k].redis_cpu) * 1000 for k in kinds],
        idle.redis_cpu / idle.seconds * 1000, ".1f")  # fmt: skip
    row("Redis server CPU, marginal", "ms",
        [marginal(k, windows[k].redis_cpu, idle.redis_cpu) * 1000 for k in kinds],
        0.0, ".1f")  # fmt: skip
    row("repository server CPU (sshd+git)", "ms",
        [per_gen(k, windows[k].sshd_cpu) * 1000 for k in kinds],
        idle.sshd_cpu / idle.seconds * 1000, ".1f")  # fmt: skip
    connections = [sum(len(v) for v in windows[k].git_walls.values()) for k in kinds]
    row("  per ssh connection", "ms",
        [windows[k].sshd_cpu / max(n, 1) * 1000 for k, n in zip(kinds, connections, strict=True)],
        0.0, ".1f")  # fmt: skip
    for kind_name in ("git-receive-pack", "git-upload-pack"):
        counts = [len(windows[k].git_walls.get(kind_name, [])) for k in kinds]
        row(f"ssh {kind_name} connections", "",
            [per_gen(k, c) for k, c in zip(kinds, counts, strict=True)],
            len(idle.git_walls.get(kind_name, [])) / idle.seconds, ".2f")  # fmt: skip
        walls = [windows[k].git_walls.get(kind_name, []) for k in kinds]
        row("  wall of one (median)", "ms",
            [sorted(w)[len(w) // 2] * 1000 if w else 0.0 for w in walls], 0.0, ".0f")  # fmt: skip
    s3 = [sum(windows[k].s3_requests.values()) for k in kinds]
    row("S3 requests", "", [per_gen(k, c) for k, c in zip(kinds, s3, strict=True)],
        sum(idle.s3_requests.values()) / idle.seconds, ".2f")  # fmt: skip
    for method in sorted({m for w in windows.values() for m in w.s3_requests}):
        row(f"  {method}", "", [per_gen(k, windows[k].s3_requests[method]) for k in kinds],
            idle.s3_requests[method] / idle.seconds, ".2f")  # fmt: skip
    row("S3 bytes (in+out, HTTP)", "KiB", [per_gen(k, windows[k].s3_bytes) / 1024 for k in kinds],
        idle.s3_bytes / idle.seconds / 1024, ".1f")  # fmt: skip

    print()
    print(f"{'service':<36} {'unit':>4} | {'per gen (instant)':>17} | "
          f"{'per gen (model-bound)':>21} | {'idle host, per s':>16}")  # fmt: skip
    for label, unit, cells in rows:
        print(f"{label:<36} {unit:>4} | {cells[0]:>17} | {cells[1]:>21} | {cells[2]:>16}")
    print()
    print("Redis commands by kind, per generation (instant | model-bound | idle per s):")
    names = Counter[str]()
    for w in windows.values():
        names.update(w.redis_commands)
    for name, _ in names.most_common():
        print(
            f"  {name:<14} {per_gen('instant', windows['instant'].redis_commands[name]):8.1f}"
            f" {per_gen('model-bound', windows['model-bound'].redis_commands[name]):8.1f}"
            f" {idle.redis_commands[name] / idle.seconds:8.2f}"
        )


if __name__ == "__main__":
    main()
