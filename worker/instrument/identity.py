"""The sandbox's identity: which host uid a life runs as, and the proof that it is not root.

Owns the rule of DESIGN's "sandbox's identity": no uid inside a sandbox maps to host
uid 0, whatever uid the worker has. An unprivileged worker runs every life as itself
(bwrap maps only that uid into the sandbox's user namespace). A root worker runs each
concurrent life under a uid of its own from ``sandbox_uid_base`` ..
``sandbox_uid_base + sandbox_uid_count - 1`` (as isolate gives every box its own
uid): the process joins its cgroup as root, then ``setpriv`` drops to that uid, with
no supplementary group and no capability, before bwrap starts, and bwrap — now
unprivileged — creates the user namespace. Because the kernel checks writes under
``/proc/sys`` against the uid, not capabilities, this is what keeps a life from the
host's sysctls (``kernel.core_pattern`` would run a helper as host root).

A uid is held by an ``flock`` on ``<lock_dir>/<uid>``, released by the kernel when
the holder exits, so uids are unique across every worker process on the host and a
killed worker frees its uid without a clean-up step.

Trusts the host's passwd database to say which uids belong to real accounts (a range
that overlaps one is refused) and bwrap to build the namespace. Nothing here reads
anything the organism wrote.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pwd
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from worker.instrument.errors import Refusal

LOCK_DIR = Path("/run/ouroboros/sandbox-uids")
_PROBE_TIMEOUT_SECONDS = 30
_USERNS_ADVICE = (
    "unprivileged user namespaces must be enabled (sysctl kernel.unprivileged_userns_clone=1 "
    "where it exists, user.max_user_namespaces > 0, and on Ubuntu 24.04+ an AppArmor profile "
    "allowing bwrap to create them)"
)


class SandboxIdentity(NamedTuple):
    """The host uid and gid one life runs as, and whether the worker must drop to them."""

    uid: int
    gid: int
    drop: bool

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run as this identity: a root worker's setpriv drop, else unchanged."""
        if not self.drop:
            return argv
        setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
        return [
            setpriv,
            f"--reuid={self.uid}",
            f"--regid={self.gid}",
            "--clear-groups",
            # Nothing of root's may survive the drop into bwrap, which then holds
            # capabilities only inside the user namespace it creates.
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--",
            *argv,
        ]

    def own(self, path: Path) -> None:
        """Give ``path`` to this identity, so that it and root alone may reach it."""
        if self.drop:
            os.chown(path, self.uid, self.gid, follow_symlinks=False)

    def describe(self) -> str:
        mode = "dropped to from root" if self.drop else "the worker's own"
        return f"uid {self.uid} gid {self.gid} ({mode}), mapped to itself in a user namespace"


class IdentityPool:
    """The identities this worker's lives run under; ``hold()`` lends one per life."""

    def __init__(self, base: int, count: int, lock_dir: Path = LOCK_DIR) -> None:
        self.base = base
        self.count = count
        self.lock_dir = lock_dir
        self.privileged = os.geteuid() == 0

    def check(self) -> None:
        """Refuse a host where a life could map host root or share a real account's uid."""
        if not self.privileged:
            if os.getuid() == 0 or os.getgid() == 0:
                raise Refusal(
                    "the worker's real uid or gid is 0 while its effective uid is not; run it "
                    "as root or as an ordinary user, not a mixture"
                )
            return
        if self.base <= 0 or self.base + self.count > 2**31:
            raise Refusal(f"the sandbox uid range {self._range()} is not a range of host uids")
        taken = sorted(
            f"{entry.pw_uid} ({entry.pw_name})"
            for entry in pwd.getpwall()
            if self.base <= entry.pw_uid < self.base + self.count
        )
        if taken:
            raise Refusal(
                f"the sandbox uid range {self._range()} holds accounts {', '.join(taken[:5])}; "
                "set OUROBOROS_SANDBOX_UID_BASE to a range no account uses"
            )

    @contextmanager
    def hold(self) -> Iterator[SandboxIdentity]:
        """An identity for one life, exclusive on this host until the block ends."""
        if not self.privileged:
            yield SandboxIdentity(os.getuid(), os.getgid(), drop=False)
            return
        self.lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for uid in range(self.base, self.base + self.count):
            handle = os.open(self.lock_dir / str(uid), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(handle)
                if exc.errno in (errno.EAGAIN, errno.EACCES):
                    continue
                raise
            try:
                yield SandboxIdentity(uid, uid, drop=True)
            finally:
                os.close(handle)
            return
        raise Refusal(
            f"every sandbox uid in {self._range()} is in use on this host; raise "
            "OUROBOROS_SANDBOX_UID_COUNT or run fewer concurrent lives"
        )

    def describe(self) -> str:
        """The identity lives will have, in one line (for doctor)."""
        if not self.privileged:
            return (
                f"every life as the worker's uid {os.getuid()}, mapped to itself in a user "
                "namespace; no uid maps to host root"
            )
        return (
            f"each life under a uid of its own from {self._range()}, dropped to from root "
            "before bwrap; no uid maps to host root"
        )

    def probe(self) -> SandboxIdentity:
        """Build one real user namespace as a life's identity would; its identity, or Refusal."""
        self.check()
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise Refusal(
                "bubblewrap is not installed on this worker; install the bubblewrap package"
            )
        with self.hold() as identity:
            argv = identity.command(
                [
                    bwrap,
                    *("--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL"),
                    *("--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin"),
                    *("--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64"),
                    *("--proc", "/proc", "--", "/bin/cat", "/proc/self/status"),
                ]
            )
            done = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=_PROBE_TIMEOUT_SECONDS,
                env={"PATH": "/usr/bin:/bin"},
                cwd="/",
            )
        if done.returncode != 0:
            detail = " ".join(done.stderr.split())[:300] or f"exit {done.returncode}"
            raise Refusal(
                f"a sandbox cannot be built as {identity.describe()}: {detail}; {_USERNS_ADVICE}"
            )
        if _status_uids(done.stdout) & {"0"}:
            raise Refusal(f"a probe sandbox ran as uid 0 ({identity.describe()}); refusing")
        return identity

    def _range(self) -> str:
        return f"{self.base}..{self.base + self.count - 1}"


def _status_uids(status: str) -> set[str]:
    """Every uid on the Uid: line of a /proc/<pid>/status text."""
    for line in status.splitlines():
        if line.startswith("Uid:"):
            return set(line.split()[1:])
    return {"0"}
