"""The embedded broker: a private Redis the project starts itself when none is configured.

Owns starting (and stopping) ``redis-server`` on a Unix socket under
``$OUROBOROS_HOME/redis`` with append-only persistence, so a one-machine fleet gets a
real broker that survives a killed worker and a restart, with no port exposed. Used
only when ``OUROBOROS_BROKER_URL`` is empty.

Also owns its lifetime: beside every server it starts runs an idle watch (``watch``,
this module run as a program), which shuts the server down once no client has been
connected and none has connected for ``OUROBOROS_EMBEDDED_REDIS_IDLE_SECONDS``; a
worker keeps its connections open, so only a home nothing uses any more loses its
Redis. The append-only file keeps every key, and the next command that needs the
broker starts it again. Nothing here is a secret: the watch's arguments are a path
and a number, and it gets none of the caller's environment but what Python needs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import redis

from worker.fleet.settings import Settings
from worker.instrument.errors import Refusal

# The idle watch's connection name: its own connection is no use of the server.
WATCH_NAME = "ouroboros-idle-watch"
_WATCH_ENV = ("PATH", "HOME", "PYTHONPYCACHEPREFIX")


def _client(settings: Settings) -> redis.Redis:
    return redis.Redis(unix_socket_path=str(settings.redis_socket), socket_timeout=2)


def running(settings: Settings) -> bool:
    try:
        return bool(_client(settings).ping())
    except (redis.RedisError, OSError):
        return False


def ensure(settings: Settings) -> None:
    """Start the embedded Redis unless a broker URL is configured or it already runs."""
    if settings.broker_url or running(settings):
        return
    server = shutil.which("redis-server")
    if server is None:
        raise Refusal(
            "redis-server is not installed and OUROBOROS_BROKER_URL is empty; "
            "run scripts/setup.sh or set OUROBOROS_BROKER_URL=redis://host:6379/0"
        )
    directory = settings.redis_socket.parent
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    subprocess.run(
        [
            server,
            "--daemonize",
            "yes",
            "--port",
            "0",
            "--unixsocket",
            str(settings.redis_socket),
            "--unixsocketperm",
            "700",
            "--dir",
            str(directory),
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            "--maxmemory-policy",
            "noeviction",
            "--pidfile",
            str(directory / "redis.pid"),
            "--logfile",
            str(directory / "redis.log"),
        ],
        check=True,
        capture_output=True,
    )
    deadline = time.monotonic() + 20
    while not running(settings):
        if time.monotonic() > deadline:
            raise Refusal(f"the embedded Redis did not start; see {directory / 'redis.log'}")
        time.sleep(0.05)
    _start_watch(settings)


def _start_watch(settings: Settings) -> None:
    """The idle watch of the server just started, detached from this process.

    Through ``setsid -f``, which forks it into a session of its own and returns: the
    watch is init's child, never a zombie of a long-lived caller (a worker) once it ends.
    """
    root = Path(__file__).resolve().parents[2]  # where the ``worker`` package lives
    env = {name: os.environ[name] for name in _WATCH_ENV if name in os.environ}
    subprocess.run(
        [
            "setsid",
            "-f",
            sys.executable,
            "-m",
            "worker.fleet.embedded_redis",
            str(settings.redis_socket),
            str(settings.embedded_redis_idle_seconds),
        ],
        env={**env, "PYTHONPATH": str(root)},
        cwd="/",
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=True,
    )


def watch(socket: Path, idle_seconds: float) -> None:
    """Shut the server at ``socket`` down once nothing has used it for ``idle_seconds``.

    Used means: a client other than an idle watch is connected, or a connection was
    made since the last look (a short command that came and went in between). Returns
    as soon as the server is gone, whoever stopped it.
    """
    client = redis.Redis(unix_socket_path=str(socket), socket_timeout=10, client_name=WATCH_NAME)
    poll = min(max(idle_seconds / 4, 0.2), 10.0)
    last_used = time.monotonic()
    connections = None
    while True:
        try:
            made = client.info("stats")["total_connections_received"]
            others = [c for c in client.client_list() if c.get("name") != WATCH_NAME]
        except (redis.RedisError, OSError):
            return
        if others or made != connections:
            last_used = time.monotonic()
        connections = made
        if time.monotonic() - last_used >= idle_seconds:
            # The server closes the connection as it exits, persisting its append-only file.
            with contextlib.suppress(redis.ConnectionError):
                client.shutdown()
            return
        time.sleep(poll)


def clients(settings: Settings) -> int:
    """How many clients other than idle watches the running embedded Redis has now."""
    listed = _client(settings).client_list()
    # This question's own connection is one of them.
    return sum(c.get("name") != WATCH_NAME for c in listed) - 1


def stop(settings: Settings) -> None:
    """Shut the embedded Redis down, persisting its append-only file."""
    if settings.broker_url or not running(settings):
        return
    # The server closes the connection as it exits.
    with contextlib.suppress(redis.ConnectionError):
        _client(settings).shutdown(nosave=False)


if __name__ == "__main__":
    watch(Path(sys.argv[1]), float(sys.argv[2]))
