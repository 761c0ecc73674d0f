"""Waiting for a server the tests started as a subprocess, and stopping it.

Any HTTP answer, an error status included, means the server is up: the probe asks
only whether something speaks HTTP on the port, not whether the path exists.
"""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest


def wait_until_answering(
    url: str, server: subprocess.Popen[bytes], log_path: Path, *, name: str, seconds: float
) -> None:
    """Return once ``url`` answers; fail the test with the server's log otherwise."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"{name} exited with {server.returncode}:\n{log_path.read_text()}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.2)
    pytest.fail(f"{name} did not answer on {url} within {seconds} s:\n{log_path.read_text()}")


def stop(server: subprocess.Popen[bytes], *, seconds: float) -> None:
    """Terminate ``server``, killing it if it outlives ``seconds``."""
    server.terminate()
    try:
        server.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
