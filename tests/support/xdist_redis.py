"""The Redis a test process shares with nothing: one redis-server per pytest-xdist worker.

Owns ``machine_redis()``, the address ``support.fleet.MACHINE_REDIS`` is read from. In a
serial session it is the machine's Redis (``OUROBOROS_TEST_REDIS``, default
``redis://127.0.0.1:6379``). Under pytest-xdist (``PYTEST_XDIST_WORKER`` set) each worker
process starts a throw-away redis-server of its own (``start``: the harness's
``PrivateRedis``) and puts its address in ``OUROBOROS_TEST_REDIS`` for itself and its
children: the tests number the databases they flush from a counter of their own process
(``redis_url``) and the planner's rules share database 0, so two workers on one server
would hand out the same database at the same moment and flush each other's keys. The
server keeps nothing on disk and is stopped when the worker exits.

Trusts: the server ``start`` gives it. Imports nothing of the project.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol


class Server(Protocol):
    url: str

    def stop(self) -> None: ...


def machine_redis(start: Callable[[Path], Server]) -> str:
    """The Redis URL this process's tests share."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is not None and os.environ.get("OUROBOROS_TEST_REDIS_WORKER") != worker:
        directory = Path(tempfile.mkdtemp(prefix=f"ouroboros-xdist-redis-{worker}-"))
        atexit.register(shutil.rmtree, directory, True)
        server = start(directory)
        atexit.register(server.stop)
        os.environ["OUROBOROS_TEST_REDIS"] = server.url
        # A child of this worker (a nested pytest session) inherits the server, not a new one.
        os.environ["OUROBOROS_TEST_REDIS_WORKER"] = worker
    return os.environ.get("OUROBOROS_TEST_REDIS", "redis://127.0.0.1:6379")
