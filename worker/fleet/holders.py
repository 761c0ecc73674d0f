"""Holder identity: a process named so that its own host can tell, at once, that it died.

Owns ``holder_name`` (host, boot, pid, the process's start time and its pid namespace),
``this_host`` (the part of it that names the host) and ``holder_dead``: a holder on
this host, since this boot, in this pid namespace, whose pid is gone or now names
another process. A holder on another host (or in
another pid namespace of this one) is never judged dead here: only its lease's or
marker's expiry outlives it. Also ``node_name``, a Celery node name as the fleet's
records hold one.

Trusts /proc of this host; a token read back from Redis is anyone's and is only parsed.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
from pathlib import Path

# A pid is at most pid_max (2**22): seven digits.
_PID = re.compile(r"[0-9]{1,7}")


def start_time(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot, None if it is gone.

    A zombie is gone: a worker killed with its pool stays one until something reaps it,
    which in a container whose init reaps lazily (or never) may take a long while.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its end.
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown-boot"


def _pid_namespace() -> str:
    """This process's pid namespace: two containers may share a hostname and a kernel."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "unknown-pidns"


def holder_name(pid: int | None = None) -> str:
    """This process as a lease holder: host, boot, pid, start time (a reused pid differs)
    and pid namespace.

    The namespace comes last: a worker of an earlier release on the same host reads
    the first four fields only, and so still finds this holder alive.
    """
    pid = pid or os.getpid()
    return f"{socket.gethostname()}:{_boot_id()}:{pid}:{start_time(pid)}:{_pid_namespace()}"


def this_host() -> str:
    """This host as far as ``holder_dead`` can see: its name, boot and pid namespace,
    as one short token (the holders a sweep here can judge are all of this one)."""
    seen = f"{socket.gethostname()}:{_boot_id()}:{_pid_namespace()}"
    return hashlib.sha256(seen.encode()).hexdigest()[:16]


def node_name(hostname: str | None) -> str:
    """A Celery node name as the records here hold one: what no pattern of theirs takes is
    replaced (a host may be named anything)."""
    return re.sub(r"[^A-Za-z0-9@._-]", "_", hostname or "unknown")[:200]


def holder_dead(token: str) -> bool:
    """True if ``token``'s holder ran on this host, since this boot, in this pid namespace,
    and is gone. A holder this process cannot see (another pid namespace) is not dead."""
    host, boot, pid, started, pidns = [*token.rsplit("/", 1)[0].split(":"), *[""] * 5][:5]
    if (host, boot, pidns) != (socket.gethostname(), _boot_id(), _pid_namespace()):
        return False
    if not _PID.fullmatch(pid):
        return False
    return start_time(int(pid)) != started
