"""The embedded broker: a private Redis the project starts itself when none is configured.

Owns starting (and stopping) ``redis-server`` on a Unix socket under
``$OUROBOROS_HOME/redis`` with append-only persistence, so a one-machine fleet gets a
real broker that survives a killed worker and a restart, with no port exposed. Used
only when ``OUROBOROS_BROKER_URL`` is empty.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time

import redis

from worker.fleet.settings import Settings
from worker.instrument.errors import Refusal


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


def stop(settings: Settings) -> None:
    """Shut the embedded Redis down, persisting its append-only file."""
    if settings.broker_url or not running(settings):
        return
    # The server closes the connection as it exits.
    with contextlib.suppress(redis.ConnectionError):
        _client(settings).shutdown(nosave=False)
