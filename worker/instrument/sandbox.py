"""The sandbox: one organism life in bubblewrap, inside an aggregate resource scope.

Owns what the organism can see and do (the bwrap options), the host side of a life
(spawning it in its scope as its identity, in a session keyring of its own, under the
syscall filter; the wall clock, reading the bounded result tar and stderr concurrently)
and the raw account of how it ended (``SandboxResult.death``). What the organism sees:
/usr read-only, a read-only /dev without ptys, /proc with the kernel's knobs read-only,
its host-disclosing files masked and a boot_id of the life's own, sized tmpfs /work,
/tmp and /run, the kernel directory read-only at /kernel; no network, no capability, no
uid that maps to host root (worker.instrument.identity), no keyring of the worker's
(worker.instrument.keyring), no system call the filter refuses
(worker.instrument.syscall_filter).

No pty: a life runs Emacs in batch mode, which reads no terminal, and Emacs gives a
subprocess pipes when no pty can be had. bwrap's /dev holds a devpts instance of its
own, but every non-initial instance draws on one host-wide pool (kernel.pty.max less
kernel.pty.reserve) that one life could empty for every other, so an empty read-only
tmpfs covers /dev/pts and /dev/ptmx leads nowhere.

Trusts the ceiling driver for the CPU, memory and task ceilings and their figures, and
``sandbox_scripts/stage.sh`` (written into the kernel directory by the pipeline) for
what happens inside. Trusts nothing that comes out of the sandbox: stdout is bytes up
to a cap, left for the decoder to judge; stderr is data. Nothing from the worker's
environment reaches the sandbox, its argv or bwrap's own environment but PATH.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from pydantic import BaseModel, ConfigDict

from worker.instrument import keyring, syscall_filter
from worker.instrument.ceilings import Ceiling, Figures
from worker.instrument.errors import Refusal
from worker.instrument.identity import SandboxIdentity
from worker.instrument.physics import Physics
from worker.instrument.records import STDERR_CAP_BYTES, Outcome

SANDBOX_PATH = "/usr/bin:/bin"
# bwrap's own environment is readable inside the sandbox as /proc/1/environ.
HOST_ENV = {"PATH": SANDBOX_PATH}
STAGE_SCRIPT = "/kernel/stage.sh"
KERNEL_PREFIX = "ouroboros-kernel-"
# The kernel directory's parent is the life's to read (/proc/self/mountinfo names the
# source of /kernel): /tmp on every host, never the worker's TMPDIR, which may name a
# user or a deployment.
KERNEL_PARENT = Path("/tmp")
OWNER_SUFFIX = ".owner"
# Beside the kernel directory, never inside it (the life sees that): the compiled syscall
# filter, which the worker opens for bwrap, and the life's own boot_id.
FILTER_SUFFIX = ".seccomp"
BOOT_ID_SUFFIX = ".boot_id"
BOOT_ID = "/proc/sys/kernel/random/boot_id"
# The descriptor on which bwrap reads the filter (--seccomp).
FILTER_FD = 3
# Opens the filter on FILTER_FD for the command that follows; the path is an argument of
# this shell only, which execs at once, so no long-lived argv names a host path.
_OPEN_FILTER = f'filter=$1; shift; exec "$@" {FILTER_FD}<"$filter"'
# The kernel directory's copy of the host's /bin/sh, executable but not readable by the
# sandbox: running it makes the staging runner non-dumpable (see sandbox_scripts/stage.sh).
STAGE_SHELL = "/kernel/sh"
READ_ONLY_PROC = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs")
MASKED_PROC = (
    "/proc/acpi",
    "/proc/asound",
    "/proc/cmdline",
    "/proc/config.gz",
    "/proc/consoles",
    "/proc/iomem",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/partitions",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/tty",
)
# Debian's merged /usr: the top-level directories are symlinks into it.
USR_SYMLINKS = {"/bin": "usr/bin", "/lib": "usr/lib", "/lib64": "usr/lib64", "/sbin": "usr/sbin"}
# A little over the observation's cap, so cap_stderr can tell that it cut.
STDERR_KEEP_BYTES = STDERR_CAP_BYTES + 4096
STDERR_TAIL_BYTES = 8192
HIGHEST_SIGNAL = 64
_CHUNK_BYTES = 65536


class SandboxResult(BaseModel):
    """How one life ended, as the worker observed it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    exit_status: int | None
    signal: int | None
    wall_timeout: bool
    archive: bytes | None
    archive_bytes: int
    archive_overflow: bool
    stderr: bytes
    stderr_tail: bytes
    figures: Figures
    duration_seconds: float

    def death(self) -> Outcome | None:
        """None for a life that ended well, else the outcome name of its death."""
        result = self.figures.result
        # The worker's own verdicts first: it ended these lives, whatever they were doing.
        if self.wall_timeout or result == "timeout":
            return "wall_timeout"
        if self.archive_overflow:
            return "decoder_rejection"
        signalled = self.signal is not None or result in ("signal", "core-dump")
        if self.exit_status == 0 and not signalled:
            return None
        # An OOM kill arrives as SIGKILL (bwrap reports 137): name the cause, not the signal.
        if self.figures.oom_kills > 0 or result == "oom-kill":
            return "cgroup_oom"
        return "signal" if signalled else "process_exit"


def resolve_emacs() -> Path:
    """The real emacs binary on the host: the sandbox sees /usr, not /etc/alternatives."""
    found = shutil.which("emacs")
    if found is None:
        raise Refusal("emacs is not installed on this worker; install emacs-nox")
    real = Path(os.path.realpath(found))
    if not real.is_relative_to("/usr"):
        raise Refusal(f"emacs resolves to {real}, outside /usr, the only host tree in the sandbox")
    return real


def bwrap_argv(
    kernel_dir: Path, physics: Physics, emacs: Path, filtered: bool = True
) -> tuple[list[str], bytes]:
    """The bwrap command line of one life and its options, which bwrap reads from stdin.

    The options travel on stdin (``--args 0``), not in the argv, because the argv of a
    process is readable by anyone who can see it and they name host paths. With
    ``filtered`` (always, but in the bench that prices it), bwrap loads the filter
    it reads on FILTER_FD (see ``run_sandbox``).
    """
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise Refusal("bubblewrap is not installed on this worker; install the bubblewrap package")
    options = [
        "--clearenv",
        # HOME is the life's own /tmp, never /work: Emacs looks in ~/.emacs.d (its
        # native-compilation cache first of all) before it loads organism.el, so a
        # HOME that was committed would let one life plant what every later one loads.
        *("--setenv", "HOME", "/tmp", "--setenv", "PATH", SANDBOX_PATH),
        "--unshare-all",
        # Implied by --unshare-all; spelled out so that the options alone show there is no network.
        "--unshare-net",
        # A user namespace of its own, in which it may not create more: a nested user
        # namespace would hand the organism a full capability set again.
        *("--unshare-user", "--disable-userns"),
        # The same name on every worker: a lineage's physics do not depend on the host.
        *("--hostname", "ouroboros"),
        # The staging runner is pid 1, so no bwrap process the organism could open
        # (/proc/1/fd) holds the result stream; see sandbox_scripts/stage.sh.
        "--as-pid-1",
        "--new-session",
        "--die-with-parent",
        # bwrap started with capabilities keeps them unless told otherwise.
        *("--cap-drop", "ALL"),
        *("--ro-bind", "/usr", "/usr"),
        *(item for link, target in USR_SYMLINKS.items() for item in ("--symlink", target, link)),
        *("--proc", "/proc"),
        *_kernel_interfaces_closed(),
        # Every life has a boot_id of its own: the host's would tell lives apart by host
        # and tie lives of one host together.
        *("--ro-bind", str(_beside(kernel_dir, BOOT_ID_SUFFIX)), BOOT_ID),
        # A read-only /dev: its devices still work, but nothing can be stored there
        # (an unsized tmpfs at /dev or /dev/shm would bypass tmp_bytes). No ptys: see
        # the module's docstring.
        *("--dev", "/dev", "--perms", "0555", "--size", "4096", "--tmpfs", "/dev/pts"),
        *("--remount-ro", "/dev/pts", "--remount-ro", "/dev"),
        *("--size", str(physics.work_bytes), "--tmpfs", "/work"),
        *("--size", str(physics.tmp_bytes), "--tmpfs", "/tmp"),
        *("--size", str(physics.run_bytes), "--tmpfs", "/run"),
        *("--ro-bind", os.path.abspath(kernel_dir), "/kernel"),
        # bwrap's root is an unsized tmpfs: only /work, /tmp and /run stay writable.
        *("--remount-ro", "/"),
        *("--chdir", "/work"),
        *(("--seccomp", str(FILTER_FD)) if filtered else ()),
    ]
    argv = [bwrap, "--args", "0", "--", STAGE_SHELL, STAGE_SCRIPT, str(emacs)]
    return argv, b"".join(option.encode() + b"\0" for option in options)


def _kernel_interfaces_closed() -> list[str]:
    """Options that make /proc's kernel knobs read-only and mask what discloses the host.

    Docker's read-only and masked path lists are the anchor, plus /proc/cmdline. Only
    paths this kernel has are covered (bwrap cannot mount over a missing one). The
    sources are the host's, which is harmless: a sysctl file answers for the namespaces
    of whoever opens it, and the mounts are read-only.
    """
    options: list[str] = []
    for path in READ_ONLY_PROC:
        if os.path.lexists(path):
            options += ["--ro-bind", path, path]
    for path in MASKED_PROC:
        if os.path.isdir(path):
            options += ["--perms", "0555", "--size", "4096", "--tmpfs", path, "--remount-ro", path]
        elif os.path.lexists(path):
            options += ["--ro-bind", "/dev/null", path]
    return options


@contextmanager
def kernel_directory(files: Mapping[str, bytes], identity: SandboxIdentity) -> Iterator[Path]:
    """A fresh kernel directory holding ``files`` and the staging shell, for one life.

    It lives under /tmp (KERNEL_PARENT), not the state dir, because a Unix socket path
    (the model socket goes here) must stay short. Its name carries no pid, lineage or
    host detail, since the organism can read it (it is the source of the /kernel mount
    in /proc/self/mountinfo); an owner file beside it names the worker process using it.
    """
    kernel = Path(tempfile.mkdtemp(prefix=KERNEL_PREFIX, dir=KERNEL_PARENT))
    owner_file = kernel.with_name(kernel.name + OWNER_SUFFIX)
    try:
        owner_file.write_text(str(os.getpid()))
        for name, data in files.items():
            (kernel / name).write_bytes(data)
            (kernel / name).chmod(0o644)
        # The worker's alone: bwrap reads it on a descriptor the worker opened.
        _create(_beside(kernel, FILTER_SUFFIX), syscall_filter.compiled(), 0o600)
        boot_id = _beside(kernel, BOOT_ID_SUFFIX)
        _create(boot_id, f"{uuid.uuid4()}\n".encode(), 0o444)
        identity.own(boot_id)
        # Executable but unreadable for the life: see sandbox_scripts/stage.sh.
        shutil.copyfile(os.path.realpath("/bin/sh"), kernel / "sh")
        (kernel / "sh").chmod(0o111)
        # mkdtemp made the directory 0700: it and everything in it belong to the life's
        # identity alone (and root), so no other sandbox or local user may read the
        # lineage or reach the model socket inside.
        for path in (kernel, *kernel.iterdir()):
            identity.own(path)
        yield kernel
    finally:
        _remove(kernel)


def sweep_kernel_dirs() -> None:
    """Remove the kernel directories of worker processes that were killed."""
    for owner_file in KERNEL_PARENT.glob(f"{KERNEL_PREFIX}*{OWNER_SUFFIX}"):
        try:
            pid = owner_file.read_text().strip()
        except OSError:
            continue
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _remove(owner_file.with_name(owner_file.name.removesuffix(OWNER_SUFFIX)))


def _create(path: Path, data: bytes, mode: int) -> None:
    """A new file at ``path`` holding ``data``: never one planted there, never through a link.

    The temp dir is shared with every local user, who can read the kernel directory's
    name and race to put a file or a symlink beside it first.
    """
    handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(handle, "wb") as file:
        file.write(data)
    path.chmod(mode)


def _beside(kernel: Path, suffix: str) -> Path:
    return kernel.with_name(kernel.name + suffix)


def _remove(kernel: Path) -> None:
    """The kernel directory and what lies beside it; the owner file last, as its mark."""
    shutil.rmtree(kernel, ignore_errors=True)
    for suffix in (FILTER_SUFFIX, BOOT_ID_SUFFIX, OWNER_SUFFIX):
        _beside(kernel, suffix).unlink(missing_ok=True)


def run_sandbox(
    kernel_dir: Path,
    physics: Physics,
    ceiling: Ceiling,
    label: str,
    emacs: Path,
    identity: SandboxIdentity,
    filtered: bool = True,
) -> SandboxResult:
    """Live one life of the organism in ``kernel_dir`` under ``physics`` as ``identity``.

    Never raises for the organism: only for host faults (CeilingError, OSError, Refusal);
    every way the organism can end, including overrunning its wall time or its archive
    cap, is a result. The process is forked in a fresh session keyring, joins its scope
    (as the worker), opens the filter for bwrap, then drops to ``identity``;
    ``kernel_dir`` must already belong to that identity. ``filtered=False`` is
    for the bench that prices the filter, never for a generation.

    The whole life is watched from the thread that joined the keyring and forked it:
    bwrap's --die-with-parent follows the forking thread, not the worker process.
    """
    return keyring.in_fresh_session_keyring(
        lambda: _live(kernel_dir, physics, ceiling, label, emacs, identity, filtered)
    )


def _live(
    kernel_dir: Path,
    physics: Physics,
    ceiling: Ceiling,
    label: str,
    emacs: Path,
    identity: SandboxIdentity,
    filtered: bool,
) -> SandboxResult:
    argv, options = bwrap_argv(kernel_dir, physics, emacs, filtered)
    command = identity.command(argv)
    if filtered:
        filter_file = str(_beside(kernel_dir, FILTER_SUFFIX))
        command = ["/bin/sh", "-c", _OPEN_FILTER, "ouroboros-filter", filter_file, *command]
    with ceiling.open(physics, label) as enclosure:
        started = time.monotonic()
        options_pipe = _readable(options)
        try:
            process = subprocess.Popen(
                enclosure.command(command),
                stdin=options_pipe,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=HOST_ENV,
                # The worker's working directory would otherwise show as $PWD in the
                # environment of every process on the way to the sandbox.
                cwd="/",
                start_new_session=True,
            )
        finally:
            os.close(options_pipe)
        assert process.stdout is not None and process.stderr is not None
        archive = _Capture(
            process.stdout, physics.archive_cap_bytes, lambda: enclosure.kill("overflow")
        )
        stderr = _Capture(process.stderr, STDERR_KEEP_BYTES, None)
        try:
            wall_timeout = not _exited_within(process, physics.wall_seconds)
            if wall_timeout:
                enclosure.kill("wall")
        finally:
            # Whatever is still in the scope dies now, so both pipes reach end of file. After
            # a life that ended by itself this is a sweep, not a kill of the life: the
            # figures' result says so (see worker.ceilings.base.cgroupfs_result).
            enclosure.kill()
            process.wait()
            archive.join()
            stderr.join()
        duration = time.monotonic() - started
        figures = enclosure.figures()
    exit_status, signal = _status(process.returncode)
    result = SandboxResult(
        exit_status=exit_status,
        signal=signal,
        wall_timeout=wall_timeout,
        archive=None,
        archive_bytes=archive.total,
        archive_overflow=archive.overflow,
        stderr=bytes(stderr.head),
        stderr_tail=bytes(stderr.tail),
        figures=figures,
        duration_seconds=duration,
    )
    if result.death() is None:
        # Only a life that ended well has anything to publish.
        return result.model_copy(update={"archive": bytes(archive.head)})
    return result


def _readable(data: bytes) -> int:
    """A pipe's read end holding ``data`` and then end of file; the caller closes it.

    The options are a few kilobytes, well within a pipe's buffer, so writing them all
    before anyone reads cannot block.
    """
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, data)
    finally:
        os.close(write_end)
    return read_end


def _exited_within(process: subprocess.Popen[bytes], seconds: float) -> bool:
    """Wait for the child to exit, at most ``seconds``; whether it did.

    A pidfd wakes the moment the child exits: ``Popen.wait(timeout=...)`` polls with
    sleeps that grow to 50 ms, which would add that much to every short life.
    """
    pidfd = os.pidfd_open(process.pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], seconds)
    finally:
        os.close(pidfd)
    return bool(ready)


def _status(returncode: int) -> tuple[int | None, int | None]:
    """(exit status, signal) from the worker's child, which is bwrap or systemd-run.

    bwrap and the shell both report a death by signal N inside as exit 128+N, so such a
    status counts as that signal; an organism that exits 137 on purpose is read the same.
    """
    if returncode < 0:
        return None, -returncode
    if 128 < returncode <= 128 + HIGHEST_SIGNAL:
        return returncode, returncode - 128
    return returncode, None


class _Capture:
    """Reads one pipe to its end in a thread, keeping at most ``keep`` bytes of its head.

    With ``on_overflow``, a stream longer than ``keep`` is an overflow: the callback runs
    and reading stops. Without it, the excess is drained and only its tail is kept.
    """

    def __init__(
        self, stream: IO[bytes], keep: int, on_overflow: Callable[[], None] | None
    ) -> None:
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0
        self.overflow = False
        self._stream = stream
        self._keep = keep
        self._on_overflow = on_overflow
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with self._stream:
            # Popen's pipes are buffered readers (read1 returns what is there); typeshed
            # types them IO[bytes], which has no read1.
            while chunk := self._stream.read1(_CHUNK_BYTES):  # type: ignore[attr-defined]
                self.total += len(chunk)
                self.head += chunk[: max(0, self._keep - len(self.head))]
                if len(chunk) >= STDERR_TAIL_BYTES:
                    self.tail = bytearray(chunk[-STDERR_TAIL_BYTES:])
                else:
                    self.tail = (self.tail + chunk)[-STDERR_TAIL_BYTES:]
                if self.total > self._keep and self._on_overflow is not None:
                    self.overflow = True
                    self._on_overflow()
                    return

    def join(self) -> None:
        self._thread.join()
