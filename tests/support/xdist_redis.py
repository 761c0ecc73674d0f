"""The Redis a test process shares with nothing: one redis-server per pytest-xdist worker.

Owns ``machine_redis()``, the address ``support.fleet.MACHINE_REDIS`` is read from. In a
serial session it is the machine's Redis (``OUROBOROS_TEST_REDIS``, default
``redis://127.0.0.1:6379``). Under pytest-xdist (``PYTEST_XDIST_WORKER`` set) each worker
process starts a throw-away redis-server of its own on a free 127.0.0.1 port and puts its
address in ``OUROBOROS_TEST_REDIS`` for itself and its children: the tests number the
databases they flush from a counter of their own process (``redis_url``) and the
planner's rules share database 0, so two workers on one server would hand out the same
database at the same moment and flush each other's keys. The server keeps nothing on disk
and is stopped when the worker exits.

Trusts: the ``redis-server`` on PATH. Imports nothing of the project.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import tempfile
import time


def machine_redis() -> str:
    """The Redis URL this process's tests share, without a database number."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is not None and os.environ.get("OUROBOROS_TEST_REDIS_WORKER") != worker:
        os.environ["OUROBOROS_TEST_REDIS"] = _start_own_server(worker)
        # A child of this worker (a nested pytest session) inherits the server, not a new one.
        os.environ["OUROBOROS_TEST_REDIS_WORKER"] = worker
    return os.environ.get("OUROBOROS_TEST_REDIS", "redis://127.0.0.1:6379")


def _start_own_server(worker: str) -> str:
    directory = tempfile.mkdtemp(prefix=f"ouroboros-xdist-redis-{worker}-")
    atexit.register(shutil.rmtree, directory, True)
    # A free port can be taken between the probe and the bind; another one is tried then.
    for _ in range(5):
        port = _free_port()
        argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        server = subprocess.Popen(
            [*argv, "--appendonly", "no", "--dir", directory, "--databases", "16"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        if _answers(port, server):
            atexit.register(_stop, server)
            return f"redis://127.0.0.1:{port}"
        _stop(server)
    raise RuntimeError(f"xdist worker {worker}: no redis-server of its own would start")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _answers(port: int, server: subprocess.Popen[bytes]) -> bool:
    deadline = time.monotonic() + 20
    while server.poll() is None and time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return True
        except OSError:
            time.sleep(0.05)
    return False


def _stop(server: subprocess.Popen[bytes]) -> None:
    if server.poll() is None:
        server.terminate()
        server.wait(timeout=10)
