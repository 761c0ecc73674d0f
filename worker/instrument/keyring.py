"""A session keyring of its own for every life.

Owns how a life is started outside the worker's keyrings: the process that becomes the
life is forked (and watched until it ends) from a thread that has just joined a fresh,
empty, anonymous session keyring (``keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL)``, as
``keyctl session -`` does). Since Linux 3.8 the session keyring is a credential of
each thread, not of the process, so the worker and its other threads keep theirs; the
child inherits the thread's, so no key the worker possesses is reachable from the
life, and what the life adds is linked only into a keyring that goes when the life's
last process does.

The join happens before the uid drop (``setpriv`` runs in the child). A uid's user
keyring (``@u``) is not a session keyring: lives that share a uid share it, and only
the syscall filter, which refuses ``keyctl`` and ``add_key``, closes it
(docs/design.md, threat model). Trusts the kernel's keyrings; reads nothing of the
organism's.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from worker.instrument.errors import Refusal

T = TypeVar("T")

# keyctl has no glibc wrapper: its number per architecture (asm/unistd.h).
_SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}
KEYCTL_JOIN_SESSION_KEYRING = 1


def in_fresh_session_keyring(spawn: Callable[[], T]) -> T:
    """``spawn()`` run in a thread of its own that has joined a new anonymous session keyring.

    What ``spawn`` forks inherits that keyring. The thread lasts as long as ``spawn``:
    a child's parent-death signal (bwrap's --die-with-parent) follows the forking thread.
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ouroboros-keyring") as thread:
        return thread.submit(_joined, spawn).result()


def _joined(spawn: Callable[[], T]) -> T:
    join_fresh_session_keyring()
    return spawn()


def join_fresh_session_keyring() -> int:
    """Give the calling thread a new, empty, anonymous session keyring; its serial number."""
    number = _SYS_KEYCTL.get(platform.machine())
    if number is None:
        raise Refusal(
            f"no keyctl system call number is known for {platform.machine()}; a life's "
            "keyring cannot be made its own on this worker"
        )
    libc = ctypes.CDLL(None, use_errno=True)
    serial = int(libc.syscall(number, KEYCTL_JOIN_SESSION_KEYRING, None))
    if serial < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"joining a fresh session keyring: {os.strerror(code)}")
    return serial
