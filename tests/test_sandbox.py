"""The sandbox: real lives of small Emacs Lisp organisms in bubblewrap under cgroup v1.

Each test builds a kernel directory like the pipeline's (base.tar holding the organism,
journal.md, lineage.json, capabilities.json, stage.sh) and runs one life through
``run_sandbox`` with the real cgroup1 driver, then judges what came back. Organisms
report what they saw by writing files into /work and exiting 0, so the published tar
is the evidence. Physics are small so that every ceiling is reached in seconds.
"""

from __future__ import annotations

import io
import os
import socket
import subprocess
import tarfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.endings import ended
from support.sandbox import (  # noqa: F401  (fixtures, used by name)
    JOURNAL,
    SMALL,
    kernel_dir,
    label_fixture,
    logged_calls,
    standins_fixture,
)

from worker.fleet.settings import Settings
from worker.instrument.ceilings import Ceiling, select_ceiling
from worker.instrument.ceilings.cgroup1 import Cgroup1Ceiling, Cgroup1Enclosure
from worker.instrument.ceilings.systemd import SystemdCeiling
from worker.instrument.errors import Refusal
from worker.instrument.physics import Physics
from worker.instrument.sandbox import (
    SandboxResult,
    bwrap_argv,
    resolve_emacs,
    run_sandbox,
)

SECRET = "sk-ouroboros-test-secret-never-inside"


def real_life(test: Callable[..., None]) -> Callable[..., None]:
    """Marks a test that lives a real life: bubblewrap, as root, in a cgroup v1 scope."""
    return pytest.mark.bwrap(pytest.mark.cgroups(pytest.mark.root(test)))


@pytest.fixture(scope="module")
def emacs() -> Path:
    return resolve_emacs()


@pytest.fixture(scope="module")
def cgroup1() -> Ceiling:
    return select_ceiling("cgroup1")


def live(
    organism: str,
    ceiling: Ceiling,
    label: str,
    emacs: Path,
    physics: Physics = SMALL,
) -> SandboxResult:
    with kernel_dir(organism) as (kernel, identity):
        return run_sandbox(kernel, physics, ceiling, label, emacs, identity)


def published(result: SandboxResult) -> dict[str, bytes]:
    """Regular files of the result archive, by name without the leading ./"""
    assert result.death() is None, (result.death(), result.stderr[-2000:])
    assert result.archive is not None
    with tarfile.open(fileobj=io.BytesIO(result.archive)) as tar:
        return {
            member.name.removeprefix("./"): tar.extractfile(member).read()  # type: ignore[union-attr]
            for member in tar.getmembers()
            if member.isfile()
        }


# --- how lives end --------------------------------------------------------------------------


@real_life
def test_clean_exit_returns_a_tar_of_the_organisms_writes(
    tmp_path: Path, cgroup1: Ceiling, label: str, emacs: Path
) -> None:
    organism = '(princ "said on stdout\\n") (report "hello.txt" "written in the sandbox")'
    result = live(organism, cgroup1, label, emacs)
    files = published(result)
    assert set(files) == {"organism.el", "hello.txt"}  # emacs -Q itself leaves nothing in /work
    assert files["hello.txt"] == b"written in the sandbox"
    assert b"(report" in files["organism.el"]
    # The organism's stdout went to stderr, so the tar stream stayed a tar stream.
    assert b"said on stdout" in result.stderr
    assert (result.exit_status, result.signal, result.wall_timeout) == (0, None, False)
    assert result.archive_bytes == len(result.archive or b"")
    assert result.figures.driver == "cgroup1"
    # The sweep of the scope after a clean exit is not a kill of the life.
    assert result.figures.result == "exited"
    assert result.figures.cpu_usage_nsec and result.figures.memory_peak_bytes
    assert set(result.figures.sources) >= {"cpu_usage_nsec", "memory_peak_bytes", "oom_kills"}


@real_life
def test_exit_three_is_a_process_exit_that_publishes_nothing(
    tmp_path: Path, cgroup1: Ceiling, label: str, emacs: Path
) -> None:
    result = live('(report "x" "staged") (kill-emacs 3)', cgroup1, label, emacs)
    assert result.death() == "process_exit"
    assert (result.exit_status, result.signal, result.archive) == (3, None, None)


@real_life
def test_death_by_signal_is_a_signal(
    tmp_path: Path, cgroup1: Ceiling, label: str, emacs: Path
) -> None:
    result = live("(signal-process (emacs-pid) 9)", cgroup1, label, emacs)
    assert result.death() == "signal"
    assert result.signal == 9
    assert result.exit_status == 137  # bwrap and the shell report a signal N as 128+N
    assert result.figures.oom_kills == 0
    assert result.archive is None


@real_life
def test_memory_past_the_ceiling_ends_cgroup_oom(
    tmp_path: Path, cgroup1: Ceiling, label: str, emacs: Path
) -> None:
    organism = "(let (hoard) (while t (push (make-string 4000000 ?x) hoard)))"
    physics = SMALL.model_copy(update={"memory_max_bytes": 64 * 1024**2})
    result = live(organism, cgroup1, label, emacs, physics)
    assert result.death() == "cgroup_oom"
    assert result.figures.oom_kills >= 1
    assert result.signal == 9  # the OOM kill's SIGKILL, which the cause outranks
    assert result.archive is None


@real_life
def test_endless_loop_ends_wall_timeout(
    tmp_path: Path, cgroup1: Ceiling, label: str, emacs: Path
) -> None:
    physics = SMALL.model_copy(update={"wall_seconds": 3, "cpu_seconds": 3})
    result = live("(while t)", cgroup1, label, emacs, physics)
    assert result.death() == "wall_timeout"
    assert result.wall_timeout
    assert result.figures.result == "timeout"
    assert result.archive is None


@real_life
def test_fork_bomb_is_contained_by_the_task_ceiling_and_the_host_is_unharmed(
    tmp_path: Path, cgroup1: Ceiling, label: str, emacs: Path
) -> None:
    opened: list[Cgroup1Enclosure] = []

    class Watched(Cgroup1Ceiling):
        def open(self, physics: Physics, label: str) -> Cgroup1Enclosure:
            opened.append(super().open(physics, label))
            return opened[-1]

    samples: list[int] = []
    refusals: list[int] = []
    done = threading.Event()

    def watch() -> None:  # the scope's task count, as the kernel accounts it, during the life
        while not done.is_set():
            if opened:
                pids = opened[0].directories["pids"]
                try:
                    samples.append(int((pids / "pids.current").read_text()))
                    events = (pids / "pids.events").read_text().split()
                    refusals.append(int(events[events.index("max") + 1]))
                except (OSError, ValueError):
                    pass  # the scope is being removed
            done.wait(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    organism = (
        '(call-process "/bin/sh" nil 0 nil "-c" "b() { b | b & }; b") (while t (sleep-for 1))'
    )
    physics = SMALL.model_copy(update={"wall_seconds": 4, "cpu_seconds": 4, "tasks_max": 16})
    try:
        result = live(organism, Watched(), label, emacs, physics)
    finally:
        done.set()
        watcher.join()
    assert result.death() == "wall_timeout"
    assert samples and max(samples) <= 16
    assert refusals and max(refusals) > 0  # forks were refused at the ceiling
    # Everything in the scope is dead and gone (the label fixture checks), and the host forks.
    assert subprocess.run(["/bin/true"], check=False).returncode == 0


@real_life
def test_archive_over_the_cap_is_a_decoder_rejection(
    tmp_path: Path, cgroup1: Ceiling, label: str, emacs: Path
) -> None:
    # A sparse file costs /work nothing, but tar writes all of its gigabyte.
    organism = '(write-region "x" nil "/work/sparse" (* 1024 1024 1024))'
    physics = SMALL.model_copy(update={"work_bytes": 1024**2, "work_files": 16})
    result = live(organism, cgroup1, label, emacs, physics)
    assert result.death() == "decoder_rejection"
    assert result.archive_overflow
    assert result.figures.result == "killed"
    assert result.archive is None
    assert physics.archive_cap_bytes < result.archive_bytes < physics.archive_cap_bytes + 2**20


@real_life
def test_two_lives_run_at_once_in_threads_each_under_its_own_uid(
    cgroup1: Ceiling, label: str, emacs: Path
) -> None:
    def one(index: int) -> SandboxResult:
        organism = f'(sleep-for 1) (report "who" (format "{index} %d" (user-uid)))'
        return live(organism, cgroup1, label, emacs)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(one, [1, 2]))
    who = [published(r)["who"].split() for r in results]
    assert [index for index, _ in who] == [b"1", b"2"]
    uids = {int(uid) for _, uid in who}
    assert len(uids) == 2 and all(uid >= Settings().sandbox_uid_base for uid in uids)


# --- what the organism cannot do ------------------------------------------------------------


@real_life
def test_writing_more_than_work_holds_cannot_hurt_the_host_and_publishes_nothing(
    tmp_path: Path, cgroup1: Ceiling, label: str, emacs: Path
) -> None:
    organism = '(report "big" (make-string (* 3 1024 1024) ?x))'
    physics = SMALL.model_copy(update={"work_bytes": 2 * 1024**2})
    with kernel_dir(organism) as (kernel, identity):
        before = sorted(p.name for p in kernel.rglob("*"))
        result = run_sandbox(kernel, physics, cgroup1, label, emacs, identity)
        assert sorted(p.name for p in kernel.rglob("*")) == before
    assert result.death() == "process_exit"
    assert result.archive is None
    assert b"No space left on device" in result.stderr


@real_life
def test_network_connections_fail_even_to_loopback(
    tmp_path: Path, cgroup1: Ceiling, label: str, emacs: Path
) -> None:
    with socket.socket() as listener, socket.socket(socket.AF_UNIX) as model:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        organism = f"""
(defun attempt (&rest spec)
  (condition-case err (progn (apply #'make-network-process :name "n" spec) "connected")
    (error (format "%S" err))))
(report "loopback" (attempt :host "127.0.0.1" :service {listener.getsockname()[1]}))
(report "outside" (attempt :host "1.1.1.1" :service 80))
(report "model" (attempt :family 'local :service "/kernel/model.sock"))
"""
        with kernel_dir(organism) as (kernel, identity):
            model.bind(str(kernel / "model.sock"))
            identity.own(kernel / "model.sock")
            model.listen()
            result = run_sandbox(kernel, SMALL, cgroup1, label, emacs, identity)
        with pytest.raises(TimeoutError):
            listener.accept()
    files = published(result)
    assert b"file-error" in files["loopback"] and b"refused" in files["loopback"]
    assert b"file-error" in files["outside"] and b"unreachable" in files["outside"]
    # The one way out is the host's model socket.
    assert files["model"] == b"connected"


@real_life
def test_sandbox_environment_holds_no_secret(
    tmp_path: Path, cgroup1: Ceiling, label: str, emacs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    organism = r"""
(report "environment" (mapconcat #'identity process-environment "\n"))
(with-temp-file "/work/processes"
  (dolist (dir (directory-files "/proc" t "\\`[0-9]+\\'"))
    (dolist (name '("environ" "cmdline"))
      (ignore-errors (insert-file-contents-literally (expand-file-name name dir)))
      (insert "\n"))))
"""
    with kernel_dir(organism) as (kernel, identity):
        argv, options = bwrap_argv(kernel, SMALL, emacs)
        assert not any(SECRET in item or "OPENAI" in item for item in argv)
        assert SECRET.encode() not in options and b"OPENAI" not in options
        files = published(run_sandbox(kernel, SMALL, cgroup1, label, emacs, identity))
    environment = dict(line.split("=", 1) for line in files["environment"].decode().splitlines())
    assert set(environment) <= {"HOME", "PATH", "PWD", "OLDPWD"}
    assert (environment["HOME"], environment["PATH"]) == ("/tmp", "/usr/bin:/bin")
    seen = files["environment"] + files["processes"]
    # pid 1 is the staging runner, whose argv names only paths inside the sandbox.
    assert b"/kernel/sh\0/kernel/stage.sh\0" in files["processes"]
    assert b"bwrap" not in files["processes"]
    assert SECRET.encode() not in seen and b"OPENAI" not in seen


@real_life
def test_no_capability_is_effective_inside(
    tmp_path: Path, cgroup1: Ceiling, label: str, emacs: Path
) -> None:
    organism = '(report "status" (shell "cat /proc/self/status"))'
    files = published(live(organism, cgroup1, label, emacs))
    capabilities = dict(
        line.split(":\t") for line in files["status"].decode().splitlines() if line[:3] == "Cap"
    )
    assert capabilities["CapEff"] == "0000000000000000"
    assert capabilities["CapPrm"] == "0000000000000000"
    assert capabilities["CapBnd"] == "0000000000000000"


@real_life
def test_usr_and_kernel_cannot_be_remounted_writable(
    tmp_path: Path, cgroup1: Ceiling, label: str, emacs: Path
) -> None:
    script = (
        "mount -o remount,rw /usr; echo usr $?;"
        " mount -o remount,bind,rw /kernel; echo kernel $?;"
        " touch /usr/planted; echo usr-write $?;"
        " touch /planted; echo root-write $?;"
        " unshare -U true; echo user-namespace $?"
    )
    organism = f'(report "attempts" (shell "{{ {script}; }} 2>/dev/null"))'
    files = published(live(organism, cgroup1, label, emacs))
    attempts = dict(line.split() for line in files["attempts"].decode().splitlines())
    assert set(attempts) == {"usr", "kernel", "usr-write", "root-write", "user-namespace"}
    assert all(status != "0" for status in attempts.values()), attempts
    assert not Path("/usr/planted").exists()


@real_life
def test_kernel_journal_cannot_be_written(
    tmp_path: Path, cgroup1: Ceiling, label: str, emacs: Path
) -> None:
    organism = """
(defun attempt (form)
  (condition-case err (progn (eval form) "succeeded") (error (format "%S" err))))
(report "write" (attempt '(write-region "forged" nil "/kernel/journal.md")))
(report "append" (attempt '(write-region "forged" nil "/kernel/journal.md" t)))
(report "delete" (attempt '(delete-file "/kernel/journal.md")))
(report "chmod" (attempt '(set-file-modes "/kernel/journal.md" #o666)))
"""
    with kernel_dir(organism) as (kernel, identity):
        files = published(run_sandbox(kernel, SMALL, cgroup1, label, emacs, identity))
        assert (kernel / "journal.md").read_bytes() == JOURNAL
    for attempt in ("write", "append", "delete", "chmod"):
        assert b"Read-only file system" in files[attempt], files[attempt]


# --- the command line -----------------------------------------------------------------------


@pytest.mark.bwrap
def test_bwrap_argv_isolates_the_sandbox(tmp_path: Path, emacs: Path) -> None:
    kernel, lineage = tmp_path / "kernel", tmp_path / "lineage"
    argv, options = bwrap_argv(kernel, Physics(), emacs)
    # The argv, which anyone who sees the process can read, names no host path but bwrap's.
    assert Path(argv[0]).name == "bwrap"
    assert argv[1:] == ["--args", "0", "--", "/kernel/sh", "/kernel/stage.sh", str(emacs)]
    assert options.endswith(b"\0")
    arguments = [item.decode() for item in options.split(b"\0")[:-1]]
    joined = "\n".join(arguments)
    for flag in ("--clearenv", "--unshare-all", "--unshare-net", "--disable-userns"):
        assert flag in arguments
    for flag in ("--new-session", "--die-with-parent", "--as-pid-1"):
        assert flag in arguments
    assert arguments[arguments.index("--cap-drop") + 1] == "ALL"
    assert "--bind" not in arguments and "--dev-bind" not in arguments
    sizes = {arguments[i + 3]: arguments[i + 1] for i, a in enumerate(arguments) if a == "--size"}
    assert {k: v for k, v in sizes.items() if not k.startswith(("/proc/", "/dev/"))} == {
        "/work": "268435456",
        "/tmp": "67108864",
        "/run": "16777216",
    }
    assert all(arguments[i + 2] == "--tmpfs" for i, a in enumerate(arguments) if a == "--size")
    binds = [tuple(arguments[i + 1 : i + 3]) for i, a in enumerate(arguments) if a == "--ro-bind"]
    assert binds[0] == ("/usr", "/usr") and binds[-1] == (str(kernel), "/kernel")
    # Between them, only /proc's knobs bound read-only onto themselves, masks, and the
    # life's own boot_id from beside the kernel directory.
    boot_id = (f"{kernel}.boot_id", "/proc/sys/kernel/random/boot_id")
    assert all(
        dest.startswith("/proc/") and src in (dest, "/dev/null")
        for src, dest in binds[1:-1]
        if (src, dest) != boot_id
    )
    assert ("/proc/sys", "/proc/sys") in binds and boot_id in binds
    assert binds.index(("/proc/sys", "/proc/sys")) < binds.index(boot_id)
    # /dev read-only, with an empty read-only tmpfs over its devpts: no pty at all.
    assert arguments[arguments.index("--dev") + 1 :][:10] == [
        "/dev",
        "--perms",
        "0555",
        "--size",
        "4096",
        "--tmpfs",
        "/dev/pts",
        "--remount-ro",
        "/dev/pts",
        "--remount-ro",
    ]
    assert arguments[arguments.index("--seccomp") + 1] == "3"
    unfiltered = bwrap_argv(kernel, Physics(), emacs, filtered=False)[1]
    assert b"--seccomp" not in unfiltered
    settings = [tuple(arguments[i + 1 : i + 3]) for i, a in enumerate(arguments) if a == "--setenv"]
    assert settings == [("HOME", "/tmp"), ("PATH", "/usr/bin:/bin")]
    # The kernel directory, read-only, and the boot_id beside it.
    assert joined.count(str(tmp_path)) == 2
    assert str(lineage) not in joined and ".git" not in joined


def test_resolve_emacs_finds_the_real_binary_under_usr(emacs: Path) -> None:
    assert emacs.is_relative_to("/usr") and not emacs.is_symlink()
    assert os.access(emacs, os.X_OK)


def test_resolve_emacs_refuses_when_emacs_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(Refusal, match="emacs-nox"):
        resolve_emacs()


# --- classification -------------------------------------------------------------------------


def test_an_oom_kill_outranks_the_signal_it_caused() -> None:
    assert ended(137, 9, oom_kills=1).death() == "cgroup_oom"
    assert ended(None, 9, result="oom-kill").death() == "cgroup_oom"
    assert ended(255, oom_kills=1).death() == "cgroup_oom"
    assert ended(137, 9).death() == "signal"


def test_a_life_that_ends_well_is_no_death_even_after_a_child_was_oom_killed() -> None:
    assert ended(0).death() is None
    assert ended(0, oom_kills=1).death() is None


def test_the_workers_own_verdicts_come_first() -> None:
    assert ended(None, 9, wall_timeout=True, oom_kills=1).death() == "wall_timeout"
    assert ended(1, result="timeout").death() == "wall_timeout"  # systemd's RuntimeMaxSec
    assert ended(None, 9, overflow=True).death() == "decoder_rejection"
    assert ended(255, result="signal").death() == "signal"  # systemd-run reports a signal as 255
    assert ended(9).death() == "process_exit"


# --- the systemd driver, end to end through stand-ins -------------------------------------


@pytest.mark.bwrap
@pytest.mark.root
def test_systemd_scope_carries_a_life_and_its_oom_kill(
    tmp_path: Path, standins: Path, emacs: Path
) -> None:
    ceiling = SystemdCeiling()
    result = live("(kill-emacs 3)", ceiling, "s", emacs)
    assert result.death() == "process_exit"
    assert (result.exit_status, result.figures.driver) == (3, "systemd")
    assert result.figures.result == "exit-code"
    (call,) = logged_calls(standins / "systemd-run.args")
    # After env -i PATH=..., the shell that opens the syscall filter for bwrap, the root
    # worker's drop to the life's own uid, then bwrap.
    command = call[call.index("--") + 1 :]
    assert Path(command[0]).name == "env" and command[3:5] == ["/bin/sh", "-c"]
    assert command[7].endswith(".seccomp") and Path(command[8]).name == "setpriv"
    # The pool's first free uid: another test process's life may hold the base one.
    settings = Settings()
    pool = range(settings.sandbox_uid_base, settings.sandbox_uid_base + settings.sandbox_uid_count)
    (reuid,) = [arg.removeprefix("--reuid=") for arg in command if arg.startswith("--reuid=")]
    assert int(reuid) in pool
    assert Path(command[command.index("--") + 1]).name == "bwrap"
    (standins / "oom-kills").write_text("1\n")
    result = live("(signal-process (emacs-pid) 9)", ceiling, "s", emacs)
    assert result.death() == "cgroup_oom"
    assert result.figures.oom_kills == 1
    assert result.figures.sources["oom_kills"] == "systemd:OOMKills"
