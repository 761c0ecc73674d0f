"""The fleet harness: an isolated fleet home driven as a user drives it, for tests and benches.

One copy serves both the tests (``from support.fleet import ...``) and the
benchmarks (``bench/common.py`` puts ``tests/`` on ``sys.path``):

* ``Fleet``: a private ``HOME`` and ``OUROBOROS_HOME`` (shared bare repository, file
  observation store, state), ``OUROBOROS_INSTRUMENT_COMMIT`` fixed, the ``scripted``
  provider, and ``python -m scheduler`` run as a subprocess with that clean
  environment; git helpers that read the shared repository;
* ``Worker``: a real ``celery -A worker worker`` process in its own process group,
  stopped or killed by its own pid;
* ``PrivateRedis``: a throw-away redis-server on a free 127.0.0.1 port, optionally
  with append-only persistence, that can be killed and restarted on the same port;
* ``Switch``: a TCP forwarder that can refuse every connection, like a dead store;
* ``MotoServer``: moto's standalone S3 server in a subprocess, spoken to over HTTP;
* ``free_port``, ``wait_for``, ``http_answers``, ``seed_file``, ``copy_instrument``,
  ``terminate``, and ``task_envelope`` (a
  Celery task message as kombu's Redis transport stores it, to publish hostile variants).
* ``MACHINE_REDIS``: the machine's Redis the tests share (``OUROBOROS_TEST_REDIS``,
  default ``redis://127.0.0.1:6379``), so two test sessions on one machine can each
  point at a redis-server of their own instead of flushing each other's databases. A
  database number in it is dropped: the tests choose their databases themselves. Under
  pytest-xdist each worker process has a redis-server of its own (``support.xdist_redis``).
* ``Follower``: ``schedule-lineage ARGS`` in the background, its output read line by line.
* ``helper_name``: what ``Fleet.traced`` reports a spawned process as.
* ``BYTECODE_CACHE``: one private bytecode cache for every fleet process of this
  test session or benchmark, the importing process and its children included (it
  sets ``sys.pycache_prefix`` and ``PYTHONPYCACHEPREFIX``): a fleet home of its own
  then costs no compiling of every package again, and nothing lands in the user's
  own cache. Removed at exit.

Imports nothing of ``worker`` or ``scheduler``: a benchmark must be able to load it
before it chooses which copy of the instrument its process imports.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from support.xdist_redis import machine_redis

INSTRUMENT_COMMIT = "a" * 40

# Enough to make an organism's life observable in a second or two of CPU.
SMALL_PHYSICS = ["--wall", "60", "--cpu-seconds", "60", "--memory-max", "512M"]

T = TypeVar("T")

BYTECODE_CACHE = tempfile.mkdtemp(prefix="ouro-pycache-")
atexit.register(shutil.rmtree, BYTECODE_CACHE, True)
sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"] = BYTECODE_CACHE

_EXECVE = re.compile(r'execve\("[^"]*", \[(.*?)\](?:, | \.\.\.).*= 0$')
_CLONE = re.compile(r"^(?:<\.\.\. )?(?:clone3?|v?fork)[( ].*= (\d+)$")
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at the moment of the call."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.2) -> T:
    """Poll ``predicate`` until it returns something true, and return that."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def terminate(process: subprocess.Popen[bytes], grace: float = 10) -> None:
    """SIGTERM ``process`` (if it still runs) and reap it; SIGKILL if it lingers."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def http_answers(url: str, process: subprocess.Popen[bytes], log_path: Path, name: str) -> bool:
    """Whether ``url`` answers HTTP at all (any status); raises if ``process`` has exited."""
    if process.poll() is not None:
        raise RuntimeError(f"{name} exited with {process.returncode}:\n{log_path.read_text()}")
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True  # the server speaks; whether the path exists does not matter here
    except OSError:
        return False


def seed_file(directory: Path, body: str, name: str = "seed.el") -> Path:
    path = directory / name
    path.write_text(";;; test organism  -*- lexical-binding: t; -*-\n" + body)
    return path


def copy_instrument(source: Path, target: Path) -> Path:
    """A copy of the checkout's importable code (``source`` is its root) to put on PYTHONPATH."""
    for part in ("worker", "scheduler", "sandbox_scripts"):
        shutil.copytree(source / part, target / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(source / "organism.el", target / "organism.el")
    (target / "worker" / "organism.el").unlink()
    shutil.copy2(source / "organism.el", target / "worker" / "organism.el")
    return target


def task_envelope(
    task: str, body: object, content_type: str = "application/json"
) -> dict[str, object]:
    """A task message as kombu's Redis transport keeps it on a queue (body: args, kwargs, embed)."""
    return {
        "body": base64.b64encode(json.dumps(body).encode()).decode(),
        "content-encoding": "utf-8",
        "content-type": content_type,
        "headers": {"lang": "py", "task": task, "id": "hostile"},
        "properties": {
            "delivery_tag": "hostile-tag",
            "body_encoding": "base64",
            "delivery_info": {"exchange": "", "routing_key": "x"},
        },
    }


# A consumer of one queue through kombu's own Redis transport, as a worker's main process
# consumes it (prefetch 1, acknowledged late): it takes one message and is SIGKILLed in
# the callback, where Celery would run task_received. kombu has already moved the message
# into its unacked hash; nothing else has been written.
GRABBER = """
import os, signal, sys
from kombu import Connection, Consumer, Exchange, Queue
from worker.fleet.settings import Settings

name = sys.argv[1]
queue = Queue(name, Exchange(name, type="direct"), routing_key=name)

def taken(body, message):
    print(message.headers["id"], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

with Connection(Settings().broker) as connection:
    with Consumer(connection, [queue], callbacks=[taken], accept=["json"], prefetch_count=1):
        while True:
            connection.drain_events(timeout=float(sys.argv[2]))
"""


def grab(env: dict[str, str], cwd: Path, queue: str, wait: float = 120) -> str:
    """A kombu consumer takes the next message of ``queue`` (within ``wait`` seconds) and
    is killed holding it; the task id it took."""
    done = subprocess.run(
        [sys.executable, "-c", GRABBER, queue, str(wait)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=wait + 30,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    return done.stdout.strip()


class Fleet:
    """One isolated fleet home and the CLI bound to it."""

    def __init__(self, home: Path, **extra_env: str) -> None:
        self.home = home
        self.env = {
            "PATH": os.environ["PATH"],
            "HOME": str(home),
            "OUROBOROS_HOME": str(home / ".ouroboros"),
            "OUROBOROS_INSTRUMENT_COMMIT": INSTRUMENT_COMMIT,
            "OUROBOROS_MODEL_PROVIDER": "scripted",
            "PYTHONPYCACHEPREFIX": BYTECODE_CACHE,
            **extra_env,
        }

    @property
    def repo(self) -> Path:
        return self.home / ".ouroboros" / "lineages.git"

    @property
    def observations(self) -> Path:
        return self.home / ".ouroboros" / "observations"

    def cli(self, *args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess[str]:
        """``schedule-lineage ARGS`` as a subprocess (``python -m scheduler``)."""
        return subprocess.run(
            [sys.executable, "-m", "scheduler", *args],
            env={**self.env, **env},
            # Not the checkout: ``python -m`` puts the working directory first on sys.path.
            cwd=self.home,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def ok(self, *args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess[str]:
        """``cli``, which must succeed."""
        result = self.cli(*args, timeout=timeout, **env)
        if result.returncode != 0:
            raise AssertionError(
                f"schedule-lineage {' '.join(args)} failed ({result.returncode}):\n"
                f"{result.stderr}{result.stdout}"
            )
        return result

    def refused(self, *args: str, **env: str) -> str:
        """``cli``, which must refuse: exit 2, one line on stderr, no traceback; the line."""
        result = self.cli(*args, **env)
        assert result.returncode == 2, result.stdout + result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
        return lines[0]

    def traced(self, *args: str, timeout: float = 600) -> list[list[str]]:
        """Run ``ok(*args)`` under ``strace -f``; the argv of every process it started
        outside a sandbox (a ``bwrap`` and its descendants are a life), in no order."""
        with tempfile.TemporaryDirectory(prefix="ouro-strace-") as scratch:
            prefix = Path(scratch) / "trace"
            command = [sys.executable, "-m", "scheduler", *args]
            trace = ["-e", "trace=execve,clone,clone3,fork,vfork", "-o", str(prefix)]
            subprocess.run(
                ["strace", "-f", "-ff", "-qq", "-s", "200", *trace, *command],
                env=self.env,
                cwd=self.home,
                capture_output=True,
                check=True,
                timeout=timeout,
            )
            return _helpers(Path(scratch))

    def git(self, *args: str) -> str:
        return subprocess.run(
            ["git", f"--git-dir={self.repo}", *args], capture_output=True, text=True, check=True
        ).stdout

    def git_bytes(self, *args: str, input: bytes | None = None) -> bytes:
        return subprocess.run(
            ["git", f"--git-dir={self.repo}", *args], input=input, capture_output=True, check=True
        ).stdout

    def subjects(self, lineage: str) -> list[str]:
        return self.git("log", "--format=%s", f"lineage-{lineage}").splitlines()

    def show(self, lineage: str, path: str, rev: str = "") -> str:
        return self.git("show", f"lineage-{lineage}{rev}:{path}")

    def files(self, lineage: str) -> list[str]:
        return self.git("ls-tree", "-r", "--name-only", f"lineage-{lineage}").splitlines()

    def observation_path(self, lineage: str, generation: int) -> Path:
        return self.observations / "lineages" / lineage / "generations" / f"{generation:06d}.json"

    def observation(self, lineage: str, generation: int) -> dict[str, object]:
        return json.loads(self.observation_path(lineage, generation).read_text())

    def observation_numbers(self, lineage: str) -> list[int]:
        directory = self.observations / "lineages" / lineage / "generations"
        return sorted(int(p.stem) for p in directory.glob("*.json")) if directory.exists() else []


def _helpers(trace_dir: Path) -> list[list[str]]:
    """Processes outside a sandbox in ``strace -ff`` files (one per process: ``trace.PID``).

    The traced command itself is the one process that no clone in the trace started.
    """
    programs: dict[int, list[str]] = {}
    parent: dict[int, int] = {}
    for path in trace_dir.iterdir():
        pid = int(path.name.rsplit(".", 1)[1])
        for line in path.read_text(errors="replace").splitlines():
            if (execve := _EXECVE.search(line)) is not None:
                programs[pid] = _STRING.findall(execve[1])
            elif (clone := _CLONE.match(line)) is not None:
                parent[int(clone[1])] = pid

    def life(pid: int) -> bool:
        argv = programs.get(pid, [""])
        return os.path.basename(argv[0]) == "bwrap" and "--" in argv

    def in_sandbox(pid: int) -> bool:
        while pid in parent:
            pid = parent[pid]
            if life(pid):
                return True
        return False

    return [
        argv
        for pid, argv in programs.items()
        if pid in parent and not life(pid) and not in_sandbox(pid)
    ]


def helper_name(argv: list[str]) -> str:
    """A spawned process's name: its program, and for git its subcommand."""
    name = os.path.basename(argv[0]) if argv else "?"
    if name == "git":
        rest = iter(argv[1:])
        for arg in rest:
            if arg == "-c":
                next(rest, None)
            elif not arg.startswith("-"):
                return f"git {arg}"
    return name


class Worker:
    """A real ``celery -A worker worker`` process in its own process group.

    Without gossip and mingle unless ``as_deployed``: the deployment's units run the
    worker with both (their traffic is what a cost measurement must see).
    """

    def __init__(
        self,
        fleet: Fleet,
        name: str,
        *extra_args: str,
        concurrency: int = 1,
        as_deployed: bool = False,
        **env: str,
    ) -> None:
        self.name = name
        self.log_path = fleet.home / f"worker-{name}.log"
        self.log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "worker",
                "worker",
                "--loglevel=INFO",
                "-n",
                f"{name}@%h",
                f"--concurrency={concurrency}",
                *([] if as_deployed else ["--without-gossip", "--without-mingle"]),
                *extra_args,
            ],
            env={**fleet.env, **env},
            cwd=fleet.home,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while "ready." not in self.text():
            if self.process.poll() is not None:
                raise AssertionError(f"worker {self.name} exited:\n{self.text()}")
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"worker {self.name} not ready in {timeout:g} s:\n{self.text()}"
                )
            time.sleep(0.1)

    def pool_children(self) -> list[int]:
        """The pids of the main process's children (its prefork pool)."""
        path = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        return [int(pid) for pid in path.read_text().split()]

    def kill(self) -> None:
        """SIGKILL the whole worker: main process, pool children, sandboxes."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self, grace: float = 30) -> None:
        """SIGTERM (warm shutdown) to the worker's own process group; SIGKILL if it lingers."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


class PrivateRedis:
    """A throw-away redis-server on a free TCP port; no persistence unless ``appendonly``.

    ``kill`` is a SIGKILL (a crash); ``start`` brings it back on the same port and
    directory, so with ``appendonly`` (fsync on every write) it comes back with its data.
    With ``password`` every client must give it; it stays in the server's 0600
    configuration file, never in a process argument.
    """

    def __init__(
        self, directory: Path, *, appendonly: bool = False, password: str | None = None
    ) -> None:
        self.port = free_port()
        self.directory = directory
        self.password = password
        directory.mkdir(parents=True, exist_ok=True)
        self.log_path = directory / "redis.log"
        self.log = self.log_path.open("ab")
        self.config = directory / "redis.conf"
        self.config.touch(mode=0o600)
        self.config.write_text(
            f'port {self.port}\nbind 127.0.0.1\nsave ""\n'
            f"appendonly {'yes' if appendonly else 'no'}\nappendfsync always\n"
            f"dir {directory}\n" + (f"requirepass {password}\n" if password else "")
        )
        self.url = self.url_at("127.0.0.1")
        self.start()

    def url_at(self, host: str) -> str:
        """The broker URL of this server as a client at ``host`` reaches it."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{host}:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", str(self.config)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_for(self._pings, 20, "the private redis-server", 0.05)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def _pings(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError("redis-server exited; see its log")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                # Up, and asking for the password this server requires: it answers.
                return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def stop(self) -> None:
        terminate(self.process)
        self.log.close()


# The machine's Redis, unless a test session names another or is an xdist worker (see
# the docstring). Its database number is dropped: the tests choose their own.
MACHINE_REDIS = re.sub(r"/\d*/?$", "", machine_redis(PrivateRedis))


class Switch:
    """A TCP forwarder to the S3 endpoint that can refuse every connection, like a dead store."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.listener: socket.socket | None = None
        self.up()

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)


# The region every test bucket on the moto server is made in.
S3_REGION = "us-east-1"


class MotoServer:
    """moto's standalone S3 server on a free 127.0.0.1 port, logging to ``log_path``."""

    START_SECONDS = 30

    def __init__(self, log_path: Path) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            wait_for(self._answers, self.START_SECONDS, f"moto_server on {self.url}", 0.1)
        except AssertionError:
            self.stop()
            raise

    def _answers(self) -> bool:
        return http_answers(f"{self.url}/moto-api/", self.process, self.log_path, "moto_server")

    def stop(self) -> None:
        terminate(self.process)


class Follower:
    """``schedule-lineage ARGS`` in the background, its output read line by line as it comes."""

    def __init__(self, fleet: Fleet, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "scheduler", *args],
            # As at a terminal: a test session started in the background (where the
            # shell ignores SIGINT, and children inherit that) must not make Ctrl-C moot.
            preexec_fn=_interruptible,
            env={**fleet.env, "COLUMNS": "400"},
            cwd=fleet.home,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def said(self, text: str, timeout: float) -> str:
        return wait_for(
            lambda: next((line for line in self.lines if text in line), None),
            timeout,
            f"{text!r} in the output; so far:\n" + "\n".join(self.lines),
        )

    def finish(self, timeout: float) -> int:
        code = self.process.wait(timeout)
        self.reader.join(10)
        return code


def _interruptible() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
