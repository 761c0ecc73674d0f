"""A booted Debian guest under QEMU, for the tests that need a real systemd host.

Owns booting the image of ``scripts/vm-image.sh`` (TCG: no KVM is needed), the guest's
network, running commands in it over ssh as root, powering it off, and installing
this checkout's fleet in it with ``deploy/install.sh`` (``install_fleet``, which gives
a ``Host``: the operator's commands, as root or as the ``ouroboros`` user). Every boot
writes to a copy-on-write overlay of its own, so the cached images stay pristine and
each test module starts from the same freshly built guest.

Under TCG, installing the fleet's dependencies and compiling their bytecode takes
the better part of half an hour. So ``fleet_layer`` caches, beside the image (whose
name is already a hash of the dependency list), a second copy-on-write layer: the
guest after ``deploy/install.sh`` installed a release of this checkout, with the
dependencies' bytecode compiled and the worker not started. A test boots that
layer and runs ``deploy/install.sh`` again with its own wheel: the dependency set
is the same, so install.sh copies the installed dependencies and installs only the
project. Should the set differ after all, install.sh installs it: slow, not wrong.

The guest's network is QEMU's user mode with ``restrict=on``: the guest reaches no
address at all, except the host's loopback ports the caller forwards by name
(``guestfwd``: the guest connects to 10.0.2.100:PORT and QEMU runs ``nc`` to the
host's 127.0.0.1:PORT for each connection), and the host reaches the guest's sshd
through one forwarded loopback port.

Trusts QEMU and the image; the guest itself is a test subject.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from support.fleet import INSTRUMENT_COMMIT, free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
# The address the guest dials to reach a forwarded host port.
HOST_ALIAS = "10.0.2.100"
MEMORY_MIB = 2048
CPUS = 2
WORKER_UNIT = "ouroboros-worker.service"
ENV_FILE = "/etc/ouroboros/ouroboros.env"
# The dependencies' bytecode, compiled into the account's checked cache as a layer is
# built; the layer's name carries a hash of it, so a layer built otherwise is not reused.
COMPILE_DEPENDENCIES = (
    "as-ouroboros /opt/ouroboros/current/venv/bin/python"
    " -X pycache_prefix=/var/lib/ouroboros/.cache/ouroboros-fleet/pycache"
    " -m compileall -q -j 2 --invalidation-mode checked-hash"
    " /opt/ouroboros/current/venv/lib >/dev/null"
)
LAYER = f"fleet-layer-{hashlib.sha256(COMPILE_DEPENDENCIES.encode()).hexdigest()[:12]}.qcow2"
# The guest has no package registry: pip takes the wheels built into the image.
PIP_ARGS = "--pip-arg=--no-index --pip-arg=--find-links=/opt/ouroboros-wheels"
# One Python start for several commands of the CLI: under TCG each start costs tens
# of seconds. argv[1] is a JSON list of argument lists, run in order; the first
# that fails ends the batch with its traceback or exit status.
CLI_BATCH = """
import json, sys
from scheduler.cli import cli
for args in json.loads(sys.argv[1]):
    print("$ schedule-lineage", *args, flush=True)
    cli.main(args, prog_name="schedule-lineage", standalone_mode=False)
"""


def build_image(flavour: str = "bookworm", timeout: float = 3600) -> Path:
    """The cached image directory of ``scripts/vm-image.sh`` (built first if need be)."""
    done = subprocess.run(
        [str(ROOT / "scripts/vm-image.sh"), "--systemd", flavour],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    if done.returncode != 0:
        raise AssertionError(f"scripts/vm-image.sh failed ({done.returncode}):\n{done.stderr}")
    return Path(done.stdout.strip().splitlines()[-1])


class GuestTimeout(AssertionError):
    """A command the guest did not finish in its time."""


class Guest:
    """One booted guest; ``host_ports`` are the host loopback ports it may dial."""

    def __init__(
        self,
        image: Path,
        scratch: Path,
        host_ports: tuple[int, ...] = (),
        layer: Path | None = None,
    ) -> None:
        """A guest of ``image``, or of ``layer`` (a qcow2 layer over it) when given."""
        self.image = image
        self.scratch = scratch
        self.ssh_port = free_port()
        self.console = scratch / "console.log"
        self.overlay = scratch / "overlay.qcow2"
        backing, backing_format = (layer, "qcow2") if layer else (image / "rootfs.raw", "raw")
        subprocess.run(
            ["qemu-img", "create", "-q", "-f", "qcow2", "-F", backing_format, "-b",
             str(backing), str(self.overlay)],
            check=True,
        )  # fmt: skip
        network = f"user,id=net0,restrict=on,hostfwd=tcp:127.0.0.1:{self.ssh_port}-:22"
        for port in host_ports:
            network += f",guestfwd=tcp:{HOST_ALIAS}:{port}-cmd:nc 127.0.0.1 {port}"
        self.command = [
            "qemu-system-x86_64", "-accel", "tcg", "-cpu", "max",
            "-smp", str(CPUS), "-m", str(MEMORY_MIB),
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-kernel", str(image / "vmlinuz"), "-initrd", str(image / "initrd.img"),
            "-append", "root=/dev/vda rw console=ttyS0 systemd.unified_cgroup_hierarchy=1"
            " net.ifnames=0 panic=-1",
            "-drive", f"file={self.overlay},if=virtio,format=qcow2,discard=unmap",
            "-netdev", network, "-device", "virtio-net-pci,netdev=net0",
            "-device", "virtio-rng-pci",
            "-serial", f"file:{self.console}",
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None

    def boot(self, timeout: float = 600) -> float:
        """Start QEMU and return the seconds until the guest's sshd answered."""
        started = time.monotonic()
        self.process = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=(self.scratch / "qemu.log").open("wb"),
            start_new_session=True,
        )

        def answers() -> bool:
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"QEMU exited {self.process.returncode}: {self.diagnosis()}")
            try:
                return self.run("true", check=False, timeout=30).returncode == 0
            except GuestTimeout:
                # sshd accepts connections before a loaded, booting guest can log anyone
                # in: not an answer yet.
                return False

        wait_for(answers, timeout, "the guest's sshd", interval=2)
        return time.monotonic() - started

    def ssh_command(self, command: str) -> list[str]:
        return [
            "ssh", "-F", "/dev/null", "-i", str(self.image / "id_ed25519"),
            "-p", str(self.ssh_port), "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes",
            "-o", "ConnectTimeout=20", "-o", "LogLevel=ERROR",
            "-o", "ServerAliveInterval=15", "root@127.0.0.1", command,
        ]  # fmt: skip

    def run(
        self,
        command: str,
        *,
        input: bytes | str | None = None,
        timeout: float = 600,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """``command`` run by bash as root in the guest."""
        argv = self.ssh_command(f"bash -c {shlex.quote(command)}")
        try:
            # Bytes go in as they are: a release's tarball holds binary files (PNGs).
            raw = subprocess.run(
                argv,
                input=input.encode() if isinstance(input, str) else input,
                capture_output=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise GuestTimeout(f"guest command timed out after {timeout} s: {command}") from exc
        done = subprocess.CompletedProcess(
            argv,
            raw.returncode,
            raw.stdout.decode(errors="replace"),
            raw.stderr.decode(errors="replace"),
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"guest command failed ({done.returncode}): {command}\n{done.stderr}{done.stdout}"
            )
        return done

    def put(self, path: str, data: bytes, mode: str = "0644") -> None:
        subprocess.run(
            self.ssh_command(f"install -D -m {mode} /dev/stdin {shlex.quote(path)}"),
            input=data,
            check=True,
            capture_output=True,
            timeout=600,
        )

    def diagnosis(self) -> str:
        """The end of the serial console, for a failure message."""
        try:
            return self.console.read_text(errors="replace")[-3000:]
        except OSError:
            return "(no console output)"

    def power_off(self, timeout: float = 120) -> None:
        """Pull the plug: QEMU ends at once, with nothing in the guest told."""
        if self.process is None:
            return
        # Popen.kill signals only a process it has not reaped: a second call is harmless.
        self.process.kill()
        self.process.wait(timeout)

    def shut_down(self, timeout: float = 180) -> bool:
        """A clean shutdown if the guest still answers, else pulling the plug.

        True if the guest powered itself off (its disk is consistent).
        """
        if self.process is None or self.process.poll() is not None:
            return False
        self.run("systemctl poweroff", check=False, timeout=60)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.power_off()
            return False
        return True


# Runs a command as the worker's account, with the worker's settings, from its home.
AS_OUROBOROS = """#!/bin/bash
set -a
. /etc/ouroboros/ouroboros.env
. /opt/ouroboros/current/instrument.env
set +a
cd /var/lib/ouroboros
exec runuser -u ouroboros -- env XDG_RUNTIME_DIR=/run/user/$(id -u ouroboros) "$@"
"""


class Host:
    """The guest with the fleet installed, driven as its operator would."""

    def __init__(self, guest: Guest, install: str) -> None:
        self.guest = guest
        self.install = install

    def reinstall(self) -> None:
        """deploy/install.sh again, as after a configuration change; it restarts the worker."""
        self.guest.run(f"{self.install} --start", timeout=1800)

    def as_ouroboros(self, command: str, timeout: float = 600) -> str:
        return self.guest.run(f"as-ouroboros {command}", timeout=timeout).stdout

    def cli(self, *args: str, timeout: float = 600) -> str:
        return self.cli_batch([list(args)], timeout)

    def cli_batch(self, commands: list[list[str]], timeout: float = 600) -> str:
        """Several ``schedule-lineage`` commands, in order, in one Python process."""
        return self.as_ouroboros(
            "/opt/ouroboros/current/venv/bin/python -c "
            + shlex.quote(CLI_BATCH)
            + " "
            + shlex.quote(json.dumps(commands)),
            timeout,
        )

    def set_setting(self, name: str, value: str) -> None:
        """``name`` set to ``value`` in the worker's settings (read when it starts)."""
        self.set_settings({name: value})

    def set_settings(self, values: dict[str, str]) -> None:
        """Each of ``values`` set in the worker's settings, as an operator edits the file.

        The file travels on ssh's stdin, never in a command line: a value may be a
        secret (the broker URL's password), and ``ps`` on either side would show it.
        It keeps the mode and owner install.sh gives it.
        """
        lines = [
            line
            for line in self.guest.run(f"cat {ENV_FILE}").stdout.splitlines()
            if line.partition("=")[0] not in values
        ]
        lines += [f"{name}={value}" for name, value in values.items()]
        self.guest.run(
            f"install -m 0640 -o root -g ouroboros /dev/stdin {ENV_FILE}",
            input="\n".join(lines) + "\n",
        )

    def set_ceiling(self, driver: str) -> None:
        """OUROBOROS_CEILING in the worker's settings (``systemd``: ``auto``, which picks it)."""
        self.set_setting("OUROBOROS_CEILING", "auto" if driver == "systemd" else driver)

    def user_systemctl(self, *args: str) -> str:
        return self.as_ouroboros("systemctl --user " + " ".join(args))

    def doctor(self) -> str:
        done = self.guest.run("/root/src/deploy/install.sh --doctor", check=False, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def show(self, lineage: str, path: str) -> str:
        return self.as_ouroboros(
            f"git --git-dir=/var/lib/ouroboros/lineages.git show lineage-{lineage}:{path}"
        )

    def observation(self, lineage: str, generation: int) -> dict[str, object]:
        """The observation as stored (the default file store), without a Python start-up."""
        path = (
            f"/var/lib/ouroboros/observations/lineages/{lineage}/generations/{generation:06d}.json"
        )
        return json.loads(self.guest.run(f"cat {path}").stdout)  # type: ignore[no-any-return]


def source_tar() -> bytes:
    """This checkout's tracked and untracked files (not ignored ones), as a tar."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    existing = b"\0".join(f for f in files.split(b"\0") if f and (ROOT / f.decode()).exists())
    return subprocess.run(
        ["tar", "--null", "-T", "-", "-cf", "-"],
        input=existing,
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout


def project_wheel(directory: Path) -> Path:
    """This checkout's wheel, built here: pip builds in seconds what takes minutes under TCG."""
    source = directory / "source"
    source.mkdir()
    subprocess.run(["tar", "-C", str(source), "-xf", "-"], input=source_tar(), check=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "-w",
            str(directory),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = directory.glob("ouroboros_fleet-*.whl")
    return wheel


def put_release(guest: Guest) -> str:
    """This checkout's source and wheel in the guest; the install.sh command that installs them."""
    wheel = project_wheel(guest.scratch)
    guest.run(
        "rm -rf /root/src && mkdir -p /root/src && tar -C /root/src -xf -", input=source_tar()
    )
    guest.put(f"/root/{wheel.name}", wheel.read_bytes())
    guest.put("/usr/local/bin/as-ouroboros", AS_OUROBOROS.encode(), mode="0755")
    return (
        f"/root/src/deploy/install.sh --no-apt --wheel /root/{wheel.name} {PIP_ARGS}"
        f" --instrument-commit {INSTRUMENT_COMMIT}"
    )


def fleet_layer(image: Path, scratch: Path, timeout: float = 3600) -> Path:
    """The cached layer over ``image`` with the fleet's dependencies installed (built if absent).

    Built by booting the image and running deploy/install.sh as ``install_fleet``
    does, then compiling the dependencies' bytecode into the account's own checked
    cache (worker/__init__.py), where every unit and command of the account reads
    it: under TCG, compiling them costs each Python process a minute or more. The
    paths are those of ``/opt/ouroboros/current``, which every later release keeps,
    and the pycs are checked against their sources' hashes, so the hard-linked
    dependencies of a later release find them valid. The worker is not started, and
    lingering is undone, so that a boot of the layer starts no worker of the layer's
    release.
    """
    layer = image / LAYER
    if layer.exists():
        return layer
    guest = Guest(image, scratch)
    try:
        guest.boot()
        guest.run(put_release(guest), timeout=timeout)
        guest.run(COMPILE_DEPENDENCIES, timeout=timeout)
        guest.run("loginctl disable-linger ouroboros")
        if not guest.shut_down():
            raise AssertionError(f"the layer's guest did not power off: {guest.diagnosis()}")
    finally:
        guest.power_off()
    partial = layer.with_suffix(".partial")
    shutil.copyfile(guest.overlay, partial)
    partial.rename(layer)
    return layer


def install_fleet(guest: Guest, ceiling: str, concurrency: int) -> Host:
    """This checkout installed with deploy/install.sh, its worker started; the operator's view.

    ``guest`` boots the layer of ``fleet_layer``: install.sh builds this checkout's
    release on the dependencies already there. The worker starts with ``ceiling``,
    and ``concurrency`` lives at once.
    """
    install = put_release(guest)
    host = Host(guest, install)
    host.set_ceiling(ceiling)
    host.set_setting("OUROBOROS_CONCURRENCY", str(concurrency))
    host.reinstall()
    return host
