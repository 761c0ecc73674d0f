"""Hostile organisms against what lives share: the host kernel, its keyrings, its ptys.

Each test is an attack an organism could make (issue 24), lived for real (bwrap, Emacs,
cgroup v1) by the root worker and by a real unprivileged worker (the fixtures of
tests/support/two_workers.py). The organism drives the kernel with python3's ctypes
from the host's /usr, which the sandbox sees. Non-destructive on the host: the calls
that the filter refuses are the ones whose success would stay inside the life's own
namespaces or keyrings; nothing here writes a host setting or installs a helper.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest
from support.sandbox import SMALL, kernel_dir, label_fixture  # noqa: F401  (fixtures, by name)
from support.two_workers import (  # noqa: F401  (fixtures, used by name)
    Life,
    Worker,
    lines,
    members,
    sh,
    unprivileged_worker_fixture,
    worker_fixture,
)

from worker.instrument import syscall_filter
from worker.instrument.ceilings import select_ceiling
from worker.instrument.keyring import join_fresh_session_keyring
from worker.instrument.records import Provenance
from worker.instrument.sandbox import (
    KERNEL_PARENT,
    KERNEL_PREFIX,
    OWNER_SUFFIX,
    _create,
    resolve_emacs,
    run_sandbox,
    sweep_kernel_dirs,
)

pytestmark = [pytest.mark.root, pytest.mark.bwrap, pytest.mark.cgroups]

T = TypeVar("T")
LIBC = ctypes.CDLL(None, use_errno=True)

# Runs inside the sandbox: `python3 - ARGS <<EOF` with this on stdin. call(NR, *ARGS) makes
# the raw system call and prints "NAME ok" or "NAME ERRNO".
PROBE = r"""
import ctypes, errno, mmap, sys
libc = ctypes.CDLL(None, use_errno=True)
def arg(value):
    return ctypes.c_char_p(value) if isinstance(value, bytes) else ctypes.c_long(value)
def call(name, nr, *args):
    ctypes.set_errno(0)
    done = libc.syscall(ctypes.c_long(nr), *map(arg, args))
    code = ctypes.get_errno()
    print(name, "ok" if done != -1 else errno.errorcode.get(code, str(code)), flush=True)
"""

# x86_64 numbers (asm/unistd_64.h); each call is made with arguments it would accept.
ATTACKS = r"""
params = ctypes.create_string_buffer(120)
call("keyctl", 250, 0, -3, 1)
call("add_key", 248, b"user", b"planted", b"v", 1, -3)
call("request_key", 249, b"user", b"ouroboros-callout", b"callout", 0)
call("io_uring_setup", 425, 1, ctypes.addressof(params))
call("userfaultfd", 323, 1)
call("perf_event_open", 298, ctypes.addressof(ctypes.create_string_buffer(128)), 0, -1, -1, 0)
call("bpf", 321, 0, 0, 0)
call("memfd_secret", 447, 0)
call("kexec_load", 246, 0, 0, 0, 0)
call("init_module", 175, 0, 0, b"")
call("finit_module", 313, 0, b"", 0)
call("delete_module", 176, b"ext4", 0)
call("mount", 165, b"none", b"/tmp", b"tmpfs", 0, 0)
call("umount2", 166, b"/tmp", 0)
call("pivot_root", 155, b"/tmp", b"/tmp")
call("fsopen", 430, b"tmpfs", 0)
call("open_tree", 428, -100, b"/tmp", 1)
call("move_mount", 429, -100, b"/tmp", -100, b"/run", 0)
call("unshare", 272, 0x00020000)
call("setns", 308, 0, 0)
call("clone_newuts", 56, 0x04000000 | 17, 0, 0, 0, 0)
call("clone_newuser", 56, 0x10000000 | 17, 0, 0, 0, 0)
call("clone3", 435, 0, 0)
call("open_tree_attr", 467, -100, b"/usr", 0, 0, 0)
call("listmount", 458, 0, 0, 0, 0)
call("unreviewed_last", 511, 0, 0, 0)
call("personality_read_implies_exec", 135, 0x0400000)
call("personality_high_bits", 135, 0x100400000)
call("personality_linux32", 135, 0x0008)
call("personality_query", 135, 0xFFFFFFFF)
call("personality_linux", 135, 0)
call("socket_vsock", 41, 40, 1, 0)
call("socket_packet", 41, 17, 3, 0)
call("socket_bluetooth", 41, 31, 1, 0)
call("socket_alg", 41, 38, 5, 0)
call("socket_appletalk_high_bits", 41, 5 | 1 << 32, 2, 0)
call("socket_netlink_audit", 41, 16, 3, 9)
call("socket_unix", 41, 1, 1, 0)
call("socket_inet", 41, 2, 2, 0)
call("socket_netlink_route", 41, 16, 3, 0)
call("ptrace", 101, 0, 0, 0, 0)
call("process_vm_readv", 310, 1, 0, 0, 0, 0, 0)
call("set_mempolicy", 238, 0, 0, 0)
call("mbind", 237, 0, 0, 0, 0, 0, 0)
call("kcmp", 312, 1, 1, 0, 0, 0)
call("ioctl_tiocsti", 16, 0, 0x5412, b"x")
call("x32_getpid", 0x40000000 | 39)
code = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
code.write(bytes.fromhex("b814000000cd80c3"))  # mov eax, 20 (i386 getpid); int 0x80; ret
i386 = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(code)))()
print("i386_getpid", "ok" if i386 >= 0 else errno.errorcode.get(-i386, str(-i386)))
# Last: unfiltered, socketpair(AF_VSOCK) inside the sandbox ended the probe with SIGSEGV
# on this kernel, which must not hide the calls above from the unfiltered comparison.
pair = ctypes.create_string_buffer(8)
call("socketpair_vsock", 53, 40, 1, 0, ctypes.addressof(pair))
call("socketpair_netlink", 53, 16, 3, 0, ctypes.addressof(pair))
call("socketpair_unix_high_bits", 53, 1 | 1 << 32, 1, 0, ctypes.addressof(pair))
call("socketpair_unix", 53, 1, 1, 0, ctypes.addressof(pair))
"""
# clone3 (so that libc falls back to clone) and calls newer than the filter's review
# fail as calls the kernel lacks would.
ENOSYS_ANSWERED = {"clone3", "open_tree_attr", "listmount", "unreviewed_last"}
KEPT = {
    "personality_query",
    "personality_linux",
    "socket_unix",
    "socket_inet",
    "socket_netlink_route",
    "socketpair_unix",
}
# What these calls do with no filter in the way: they would succeed, or fail for another
# reason than EPERM; so an EPERM from them is the filter's.
UNFILTERED = {
    "keyctl": "ok",
    "add_key": "ok",
    # With a callout the kernel runs /sbin/request-key as host root (ENOENT: none here).
    "request_key": "ENOENT",
    "io_uring_setup": "ok",
    "userfaultfd": "ok",
    "personality_read_implies_exec": "ok",
    "clone3": "EINVAL",
    # Linux 6.15 and later: a mount-tree descriptor, as open_tree gives (which is refused).
    "open_tree_attr": "ok",
    "ioctl_tiocsti": "ENOTTY",
    "socket_netlink_audit": "ok",
}


def python(script: str) -> str:
    """An organism that runs ``script`` (after PROBE) in the sandbox's python3."""
    return sh(f"python3 - <<'EOF' 2>&1\n{PROBE}{script}\nEOF")


def outcomes(life: Life) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in lines(life) if " " in line)


def root_life(organism: str, label: str, filtered: bool = True) -> Life:
    with kernel_dir(organism) as (kernel, identity):
        result = run_sandbox(
            kernel, SMALL, select_ceiling("cgroup1"), label, resolve_emacs(), identity, filtered
        )
    archive = result.archive or b""
    return Life(result.death(), members(archive), archive, result.stderr.decode(), identity.uid)


# --- the syscall filter --------------------------------------------------------------------


def test_every_refused_call_fails_with_eperm_and_the_kept_ones_work(worker: Worker) -> None:
    found = outcomes(worker(python(ATTACKS)))
    assert {name: found[name] for name in ENOSYS_ANSWERED} == dict.fromkeys(
        ENOSYS_ANSWERED, "ENOSYS"
    )
    assert len(found) == ATTACKS.count("call(") + 1, found
    refused = {name for name in found if name not in KEPT | ENOSYS_ANSWERED}
    assert {name: found[name] for name in refused} == dict.fromkeys(refused, "EPERM")
    assert {name: found[name] for name in KEPT} == dict.fromkeys(KEPT, "ok")


def test_without_the_filter_the_same_calls_reach_the_kernel(label: str) -> None:
    """The probe can tell: unfiltered, the calls it relies on do not fail with EPERM.

    request_key reaches the kernel's usermode helper: ENOENT says it looked for
    /sbin/request-key to run as host root. A host that has one is not asked to run it.
    """
    attacks, expected = ATTACKS, UNFILTERED
    if Path("/sbin/request-key").exists():
        attacks = ATTACKS.replace('b"callout", 0)', "0, 0)")
        expected = {**UNFILTERED, "request_key": "ENOKEY"}
    found = outcomes(root_life(python(attacks), label, filtered=False))
    assert {name: found[name] for name in expected} == expected


def test_the_filter_digest_is_of_its_definition_and_names_every_group() -> None:
    digest = syscall_filter.DIGEST
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest)
    groups = {group.name for group in syscall_filter.DEFINITION.groups}
    assert {"keyrings", "io_uring", "mounts", "namespaces", "socket_families"} <= groups
    assert all(group.reason and group.anchor for group in syscall_filter.DEFINITION.groups)
    changed = syscall_filter.DEFINITION.model_copy(
        update={"groups": syscall_filter.DEFINITION.groups[1:]}
    )
    assert syscall_filter.canonical(changed) != syscall_filter.canonical()
    # Compiled by libseccomp: classic BPF, 8 bytes an instruction.
    program = syscall_filter.compiled()
    assert program and len(program) % 8 == 0


def test_a_sweep_removes_what_a_killed_worker_left_beside_its_kernel_directory() -> None:
    ended = subprocess.run(["/bin/sh", "-c", "echo $$"], capture_output=True, text=True)
    kernel = Path(tempfile.mkdtemp(prefix=KERNEL_PREFIX, dir=KERNEL_PARENT))
    beside = [kernel.with_name(kernel.name + suffix) for suffix in (".seccomp", ".boot_id")]
    for path in beside:
        path.write_bytes(b"left")
    kernel.with_name(kernel.name + OWNER_SUFFIX).write_text(ended.stdout.strip())
    sweep_kernel_dirs()
    assert not kernel.exists() and not any(path.exists() for path in beside)
    assert not kernel.with_name(kernel.name + OWNER_SUFFIX).exists()


def test_the_filter_file_is_never_written_through_a_planted_link(tmp_path: Path) -> None:
    """A local user who saw the kernel directory's name plants a link beside it first."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"kept")
    with kernel_dir("") as (kernel, _identity):
        planted = kernel.with_name(kernel.name + ".planted")
        planted.symlink_to(victim)
        with pytest.raises(FileExistsError):
            _create(planted, b"filter", 0o600)
        planted.unlink()
    assert victim.read_bytes() == b"kept"


def test_an_observation_from_before_the_filter_still_reads() -> None:
    recorded = {
        "worker_host": "h",
        "fleet_version": "0.1",
        "instrument_fingerprint": "f",
        "ceiling_driver": "cgroup1",
        "bwrap_version": "0.8.0",
        "emacs_version": "28.2",
    }
    assert Provenance.model_validate(recorded).syscall_filter is None
    now = Provenance.model_validate({**recorded, "syscall_filter": syscall_filter.DIGEST})
    assert now.syscall_filter == syscall_filter.DIGEST


# --- the keyring ---------------------------------------------------------------------------

KEYRING = r"""
import ctypes
found = ctypes.create_string_buffer(256)
print("session", libc.syscall(250, 0, -3, 0))
call("search_secret", 250, 10, -3, b"user", b"ouroboros-worker-secret", 0)
call("read_secret", 250, 11, {serial}, ctypes.addressof(found), 256)
print("read", found.value.decode(errors="replace") or "-")
"""


def _with_worker_secret(live: Callable[[int], T]) -> tuple[int, T]:
    """``live(secret)`` from a thread whose session keyring holds a secret key, as a worker
    started from a login (pam_keyinit) or a service has; the keyring's serial and the result.
    """

    def thread() -> tuple[int, T]:
        session = join_fresh_session_keyring()
        secret = LIBC.syscall(248, b"user", b"ouroboros-worker-secret", b"s3cr3t-payload", 14, -3)
        assert secret > 0, ctypes.get_errno()
        return session, live(secret)

    with ThreadPoolExecutor(max_workers=1) as runner:
        return runner.submit(thread).result()


def test_a_life_cannot_reach_the_workers_session_keyring_without_the_filter(label: str) -> None:
    session, life = _with_worker_secret(
        lambda serial: root_life(python(KEYRING.format(serial=serial)), label, filtered=False)
    )
    found = outcomes(life)
    assert int(found["session"]) > 0 and int(found["session"]) != session, (found, session)
    assert found["search_secret"] == "ENOKEY"
    assert found["read_secret"] == "EACCES"
    assert found["read"] == "-"


def test_a_life_cannot_reach_the_workers_session_keyring(worker: Worker) -> None:
    """With the filter (as every generation lives), as root and as an unprivileged worker."""
    _session, life = _with_worker_secret(
        lambda serial: worker(python(KEYRING.format(serial=serial)))
    )
    found = outcomes(life)
    assert found["search_secret"] == found["read_secret"] == "EPERM"
    assert found["read"] == "-"


def test_a_control_life_in_the_workers_keyring_would_read_the_secret() -> None:
    """The keyring test can fail: a process that kept the worker's keyring reads the key."""

    def read(serial: int) -> bytes:
        found = ctypes.create_string_buffer(64)
        assert LIBC.syscall(250, 11, serial, found, 64) == 14
        return found.value

    _session, value = _with_worker_secret(read)
    assert value == b"s3cr3t-payload"


SHARE = r"""
import time
call("add", 248, b"user", b"ouroboros-note", b"from-a", 6, -3)
time.sleep(6)
"""
LOOK = r"""
import time
time.sleep(2)
call("search_note", 250, 10, -3, b"user", b"ouroboros-note", 0)
"""


def test_concurrent_lives_share_no_key_and_none_outlives_its_life(label: str) -> None:
    """Without the filter, so that the keyring alone is tried (the filter refuses add_key)."""
    lives: dict[str, Life] = {}

    def live(name: str, organism: str) -> None:
        lives[name] = root_life(organism, f"{label}-{name}", filtered=False)

    writer = threading.Thread(target=live, args=("a", python(SHARE)))
    writer.start()
    live("b", python(LOOK))
    writer.join()
    assert outcomes(lives["a"]) == {"add": "ok"}
    assert outcomes(lives["b"]) == {"search_note": "ENOKEY"}
    # The writer's uid owned the key; with its life gone, the kernel collects it.
    deadline = time.monotonic() + 30
    while _keys_of(lives["a"].uid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _keys_of(lives["a"].uid) == 0


def _keys_of(uid: int) -> int:
    """How many keys ``uid`` owns on this host (/proc/key-users: 'uid: usage n/ni ...')."""
    for line in Path("/proc/key-users").read_text().splitlines():
        owner, _, rest = line.partition(":")
        if int(owner) == uid:
            return int(rest.split()[1].split("/")[0])
    return 0


# --- ptys ----------------------------------------------------------------------------------

PTYS = r"""
import os
for name, opener in (("openpty", os.openpty), ("ptmx", lambda: os.open("/dev/ptmx", os.O_RDWR)),
                     ("pts_ptmx", lambda: os.open("/dev/pts/ptmx", os.O_RDWR))):
    try:
        opener()
        print(name, "ok")
    except OSError as error:
        print(name, errno.errorcode[error.errno])
print("pts_entries", len(os.listdir("/dev/pts")))
print("pts_writable", os.access("/dev/pts", os.W_OK))
"""


def test_a_life_has_no_pty_and_its_subprocesses_get_pipes(worker: Worker) -> None:
    # The host lends ptys: the sandbox, not the machine, is what refuses them below.
    primary, secondary = os.openpty()
    os.close(primary)
    os.close(secondary)
    found = outcomes(worker(python(PTYS)))
    assert found["openpty"] == found["ptmx"] == found["pts_ptmx"] == "ENOENT", found
    assert (found["pts_entries"], found["pts_writable"]) == ("0", "False")
    life = worker(
        r"""
(let ((proc (start-process "echo" "*echo*" "/bin/echo" "through-a-pipe")))
  (while (accept-process-output proc 5))
  (report "out" (format "tty %S\n%s" (process-tty-name proc)
                        (with-current-buffer "*echo*" (buffer-string)))))
"""
    )
    assert lines(life)[:2] == ["tty nil", "through-a-pipe"]


# --- what the life may learn of its host ---------------------------------------------------

DISCLOSURE = r"""
echo boot_id $(cat /proc/sys/kernel/random/boot_id)
echo config_gz $(cat /proc/config.gz 2>/dev/null | wc -c)
for f in iomem consoles partitions tty/drivers; do
  echo "host_$f $(cat /proc/$f 2>/dev/null | wc -c)"
done
grep -E ' /(kernel|proc/sys/kernel/random/boot_id) ' /proc/self/mountinfo | cut -d' ' -f4 |
  sed 's/^/source /'
"""


def test_a_life_learns_no_boot_id_kernel_config_or_temp_dir_of_the_host(
    worker: Worker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert Path("/proc/config.gz").exists(), "this kernel has no /proc/config.gz to mask"
    host_boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    # A worker whose temp dir names its user: the life must not learn it.
    private = tmp_path / "alice-private-tmp"
    private.mkdir(mode=0o777)
    monkeypatch.setenv("TMPDIR", str(private))
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    found = [lines(worker(sh(DISCLOSURE))) for _ in "ab"]
    first, second = (dict(line.split(" ", 1) for line in out if " " in line) for out in found)
    # The two host paths in the mount table: the kernel directory and its boot_id beside it.
    sources = [line.split(" ", 1)[1] for line in found[0] if line.startswith("source ")]
    assert len(sources) == 2, found[0]
    neutral = re.compile(r"^(/tmp)?/ouroboros-kernel-[a-z0-9_]{8}(\.boot_id)?$")
    assert all(neutral.match(source) for source in sources), sources
    assert first["config_gz"] == "0"
    # The platform's device names, its consoles and disks are the host's, not the life's.
    assert all(Path(f"/proc/{f}").exists() for f in ("iomem", "consoles", "partitions", "tty"))
    host_files = {"host_iomem", "host_consoles", "host_partitions", "host_tty/drivers"}
    assert {name: first[name] for name in host_files} == dict.fromkeys(host_files, "0")
    assert re.fullmatch(r"[0-9a-f-]{36}", first["boot_id"])
    assert len({host_boot_id, first["boot_id"], second["boot_id"]}) == 3
