"""The compose file's worker container, on a booted guest of tests/test_vm_host.py.

Owns putting ``vm_container.sh`` (a container runtime in miniature: a cgroup of the
container's own, new cgroup, mount, pid and uts namespaces, cgroup2 mounted afresh
and read-only, an init that stays pid 1 as root) into a guest, the container's
environment (what docker-compose.yml's ``environment:`` gives the worker, with a
fleet of its own: embedded broker, repository and store under ``HOME``, as a
single compose host keeps them in its volumes), and ``ContainerHost``: that
fleet driven as its operator would, the CLI as the compose ``cli`` service runs
it, the doctor through the entrypoint as ``docker compose exec`` runs it.

Trusts the guest's util-linux (unshare, nsenter, runuser, setpriv) and the release
that ``vm_guest.install_fleet`` installed, which the container runs.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from support.fleet import wait_for
from support.vm_guest import CLI_BATCH, Host

NAME = "vm-container"
RUNTIME = "/usr/local/sbin/vm-container"
HOME = "/var/lib/ouroboros-container"
# The container's cgroup on the guest: the root of its cgroup namespace.
CGROUP = f"/sys/fs/cgroup/{NAME}"
SCRIPT = Path(__file__).with_name("vm_container.sh")


def environment(concurrency: int) -> str:
    """The worker's environment: the compose file's settings, this fleet's home."""
    return "\n".join(
        [
            "PATH=/opt/ouroboros/current/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "PYTHONUNBUFFERED=1",
            f"OUROBOROS_HOME={HOME}",
            "OUROBOROS_CEILING=cgroup2",
            f"OUROBOROS_CONCURRENCY={concurrency}",
            "OUROBOROS_MODEL_PROVIDER=scripted",
            # Under TCG on a busy machine the worker may take minutes to start.
            "OUROBOROS_WORKER_WAIT_SECONDS=900",
            "",
        ]
    )


class ContainerHost(Host):
    """The guest's container and the fleet in it; ``start`` it first, ``stop`` it last."""

    def start(self, concurrency: int) -> None:
        """The container up, its worker starting through the entrypoint (as root, then not)."""
        self.guest.put(RUNTIME, SCRIPT.read_bytes(), mode="0755")
        self.guest.put(f"/etc/{NAME}.env", environment(concurrency).encode())
        self.guest.run(
            # The image's build argument, OUROBOROS_INSTRUMENT_COMMIT, as the release has it.
            f"cat /opt/ouroboros/current/instrument.env >>/etc/{NAME}.env"
            f" && install -d -o ouroboros -g ouroboros -m 0750 {HOME}"
            f" && {RUNTIME} start"
        )

    def wait_ready(self, timeout: float = 900) -> None:
        """Until the worker's preflight made the namespace root delegate (its health check)."""

        def delegating() -> bool:
            if self.guest.run(f"test -e /proc/$(cat /run/{NAME}.unshare)", check=False).returncode:
                raise AssertionError(f"the container ended:\n{self.log()}")
            control = self.guest.run(f"cat {CGROUP}/cgroup.subtree_control").stdout
            return bool(control.strip())

        try:
            wait_for(delegating, timeout, "the container's worker preflight", interval=5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.log()}") from exc

    def cli_batch(self, commands: list[list[str]], timeout: float = 600) -> str:
        return self.guest.run(
            f"{RUNTIME} cli python -c {shlex.quote(CLI_BATCH)} {shlex.quote(json.dumps(commands))}",
            timeout=timeout,
        ).stdout

    def doctor(self) -> str:
        # Wide enough that no detail wraps in the table.
        done = self.guest.run(
            f"{RUNTIME} exec env COLUMNS=400 schedule-lineage doctor", check=False, timeout=600
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def show(self, lineage: str, path: str) -> str:
        return self.guest.run(
            f"{RUNTIME} cli git --git-dir={HOME}/lineages.git show lineage-{lineage}:{path}"
        ).stdout

    def observation(self, lineage: str, generation: int) -> dict[str, object]:
        path = f"{HOME}/observations/lineages/{lineage}/generations/{generation:06d}.json"
        return json.loads(self.guest.run(f"cat {path}").stdout)  # type: ignore[no-any-return]

    def cgroup_of(self, pid: str) -> str:
        """The cgroup of a guest pid, as the guest sees it."""
        return self.guest.run(f"sed -n 's/^0:://p' /proc/{pid}/cgroup").stdout.strip()

    def processes(self, cgroup: str) -> list[tuple[int, str]]:
        """The uid and command line of each process in a cgroup (a guest path)."""
        listed = self.guest.run(f'ps -o uid=,args= -p "$(paste -sd, {cgroup}/cgroup.procs)"')
        return [
            (int(uid), args) for uid, args in (p.split(None, 1) for p in listed.stdout.splitlines())
        ]

    def init_pid(self) -> str:
        return self.guest.run(f"{RUNTIME} init-pid").stdout.strip()

    def log(self) -> str:
        return self.guest.run(f"tail -c 3000 /var/log/{NAME}.log", check=False).stdout

    def stop(self) -> None:
        # The guest is thrown away after the test: a failed stop must not hide why it ended.
        self.guest.run(f"{RUNTIME} stop", timeout=120, check=False)
