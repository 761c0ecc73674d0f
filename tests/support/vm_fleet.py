"""A two-host fleet: the control host's services here, and a booted guest joining them.

Owns, for tests/test_vm_host.py, the host's side of a fleet whose second host is
the guest of ``vm_guest`` (``ControlHost``), started before the guest boots, on
free loopback ports, because QEMU forwards only the ports it was started with
(``ControlHost.ports``, reached from the guest at ``vm_guest.HOST_ALIAS``):

* a private redis-server that requires a password (``PrivateRedis``); the
  password is in its 0600 configuration file, never in a process argument;
* the session's moto S3 server (tests/conftest.py), one bucket of its own;
* the shared bare repository, served over ssh by an sshd of its own
  (``GitSshd``): key-only, each key forced to git-upload-pack or git-receive-pack
  of that one repository, through git-shell as the compose fleet's git-ssh
  service forces its account;
* ``Fleet``, the host's side as the fleet tests drive it: the CLI and the host's
  worker, on the repository's local path.

``join`` configures the guest's installed fleet as an operator does (its
settings, its S3 credential file, its key authorized and the server's key
pinned), and ``landed`` reads what a lineage left: its commits and observations.

Trusts: redis-server, OpenSSH, git and moto on the host; the guest is a test subject.
"""

from __future__ import annotations

import json
import secrets
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, NamedTuple

import boto3

from support.fleet import Fleet, PrivateRedis, free_port, terminate, wait_for
from support.vm_guest import HOST_ALIAS, Host
from worker.instrument.store_keys import generation_key

S3_REGION = "us-east-1"
# moto takes any credentials; they are still treated as secrets (never in argv).
S3_KEY_ID = "ouroboros-test-key-id"
S3_SECRET = "ouroboros-test-secret"
OBSERVATIONS_PREFIX = "fleet"
# Short, so that a powered-off host's lease and marker expire within the test.
LEASE_SECONDS = 15
RECONCILE_SECONDS = 1
GUEST_KEY = "/var/lib/ouroboros/.ssh/id_ed25519.pub"
GUEST_KNOWN_HOSTS = "/var/lib/ouroboros/.ssh/known_hosts"
GUEST_S3_CREDENTIALS = "/etc/ouroboros/credentials/s3-writer.ini"
# Every key the sshd accepts runs this instead of what the client asked: the fetch or
# push of the one repository, through git-shell, or nothing. git asks for
# "git-upload-pack '/path'" (or receive-pack), the path quoted exactly so.
FORCED_COMMAND = (
    'case "$SSH_ORIGINAL_COMMAND" in'
    " \"git-upload-pack '{repo}'\"|\"git-receive-pack '{repo}'\")"
    ' exec git-shell -c "$SSH_ORIGINAL_COMMAND";;'
    " *) echo 'only fetch and push of {repo}' >&2; exit 1;;"
    " esac"
)
SSHD_CONFIG = """\
ListenAddress 127.0.0.1:{port}
HostKey {host_key}
PidFile none
AuthorizedKeysFile {authorized_keys}
# The test's directory is under /tmp, writable by all: sshd's strict modes would
# refuse every key file below it.
StrictModes no
# The only account this host has for it is root: its logins run only the forced
# command of the key they used.
AllowUsers root
PermitRootLogin forced-commands-only
AuthenticationMethods publickey
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
UseDNS no
# git needs none of these; each is a way to use the server for something else.
AllowTcpForwarding no
AllowStreamLocalForwarding no
AllowAgentForwarding no
X11Forwarding no
PermitTunnel no
PermitTTY no
PermitUserEnvironment no
PrintMotd no
LogLevel VERBOSE
"""
# sshd as root wants its privilege-separation directory, /run/sshd, which this host
# does not have: the test's sshd gets it on a /run of its own, in a mount namespace of
# its own, so nothing on the host changes. In that namespace root's ~/.bashrc reads
# as empty: bash, root's shell, runs it before every command sshd gives it (a
# developer's pyenv set-up there forks ~100 processes a connection), where the
# deployment's git account has git-shell as its shell and no startup files.
PRIVATE_RUN = (
    "mount -t tmpfs -o mode=0755,size=1m sshd-run /run && mkdir -m 0755 /run/sshd"
    " && { [ ! -f ~root/.bashrc ] || mount --bind /dev/null ~root/.bashrc; }"
)


class GitSshd:
    """An sshd on a free loopback port, key-only, forced to git on one bare repository."""

    def __init__(self, directory: Path, repository: Path) -> None:
        directory.mkdir(mode=0o700, parents=True)
        self.port = free_port()
        self.repository = repository
        self.host_key = directory / "ssh_host_ed25519_key"
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ouroboros-vm-git",
             "-f", str(self.host_key)],
            check=True,
        )  # fmt: skip
        self.authorized_keys = directory / "authorized_keys"
        self.authorized_keys.touch(mode=0o600)
        config = directory / "sshd_config"
        config.write_text(
            SSHD_CONFIG.format(
                port=self.port, host_key=self.host_key, authorized_keys=self.authorized_keys
            )
        )
        self.log_path = directory / "sshd.log"
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                 f'{PRIVATE_RUN} && exec "$@"', "sshd-run",
                 "/usr/sbin/sshd", "-D", "-e", "-f", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        wait_for(self._greets, 30, f"sshd on 127.0.0.1:{self.port}", 0.1)

    def _greets(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"sshd exited:\n{self.log_path.read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2) as sock:
                return sock.recv(4).startswith(b"SSH-")
        except OSError:
            return False

    def authorize(self, public_key: str) -> None:
        """Let ``public_key`` fetch from and push to the repository, and nothing else."""
        forced = FORCED_COMMAND.format(repo=self.repository).replace('"', '\\"')
        with self.authorized_keys.open("a") as keys:
            keys.write(f'restrict,command="{forced}" {public_key.strip()}\n')

    def known_host(self, host: str) -> str:
        """The known_hosts line that pins this server's key as ``host`` dials it."""
        kind, key = self.host_key.with_suffix(".pub").read_text().split()[:2]
        return f"[{host}]:{self.port} {kind} {key}\n"

    def url(self, host: str) -> str:
        return f"ssh://root@{host}:{self.port}{self.repository}"

    def stop(self) -> None:
        terminate(self.process)


class ControlHost:
    """The fleet's shared services on this host, and the host's own CLI and worker settings."""

    def __init__(self, scratch: Path, s3_endpoint: str) -> None:
        self.redis = PrivateRedis(scratch / "redis", password=secrets.token_hex(16))
        try:
            self._start(scratch, s3_endpoint)
        except BaseException:
            self.redis.stop()
            raise

    def _start(self, scratch: Path, s3_endpoint: str) -> None:
        self.s3_endpoint = s3_endpoint
        self.bucket = f"vm-fleet-{secrets.token_hex(6)}"
        self.s3 = boto3.client(
            "s3",
            endpoint_url=s3_endpoint,
            region_name=S3_REGION,
            aws_access_key_id=S3_KEY_ID,
            aws_secret_access_key=S3_SECRET,
        )
        self.s3.create_bucket(Bucket=self.bucket)
        home = scratch / "home"
        home.mkdir()
        self.fleet = Fleet(
            home,
            OUROBOROS_BROKER_URL=self.redis.url,
            OUROBOROS_OBSERVATIONS=f"s3://{self.bucket}/{OBSERVATIONS_PREFIX}",
            OUROBOROS_S3_ENDPOINT_URL=s3_endpoint,
            OUROBOROS_S3_REGION=S3_REGION,
            OUROBOROS_LEASE_SECONDS=str(LEASE_SECONDS),
            OUROBOROS_RECONCILE_INTERVAL_SECONDS=str(RECONCILE_SECONDS),
            OUROBOROS_SPOOL_RETRY_SECONDS="2",
            AWS_ACCESS_KEY_ID=S3_KEY_ID,
            AWS_SECRET_ACCESS_KEY=S3_SECRET,
            AWS_CONFIG_FILE="/dev/null",
            AWS_SHARED_CREDENTIALS_FILE="/dev/null",
        )
        self.sshd = GitSshd(scratch / "sshd", self.fleet.repo)

    @property
    def ports(self) -> tuple[int, ...]:
        """The loopback ports the guest must reach: broker, store, git."""
        s3_port = int(self.s3_endpoint.rsplit(":", 1)[1])
        return (self.redis.port, s3_port, self.sshd.port)

    @property
    def secrets(self) -> tuple[str, ...]:
        return (self.redis.password, S3_SECRET)

    @property
    def logs(self) -> list[Path]:
        return [self.redis.log_path, self.sshd.log_path]

    def guest_settings(self) -> dict[str, str]:
        """What an operator writes in the guest's /etc/ouroboros/ouroboros.env to join."""
        s3_port = self.ports[1]
        return {
            "OUROBOROS_BROKER_URL": self.redis.url_at(HOST_ALIAS),
            "OUROBOROS_LINEAGE_REPO": self.sshd.url(HOST_ALIAS),
            "OUROBOROS_OBSERVATIONS": f"s3://{self.bucket}/{OBSERVATIONS_PREFIX}",
            "OUROBOROS_S3_ENDPOINT_URL": f"http://{HOST_ALIAS}:{s3_port}",
            "OUROBOROS_S3_REGION": S3_REGION,
            "OUROBOROS_LEASE_SECONDS": str(LEASE_SECONDS),
            "OUROBOROS_SPOOL_RETRY_SECONDS": "2",
        }

    def observation(self, lineage: str, generation: int) -> dict[str, Any]:
        key = f"{OBSERVATIONS_PREFIX}/{generation_key(lineage, generation)}"
        body = self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        return json.loads(body)  # type: ignore[no-any-return]

    def observation_numbers(self, lineage: str) -> list[int]:
        prefix = f"{OBSERVATIONS_PREFIX}/{generation_key(lineage, 1).rsplit('/', 1)[0]}/"
        listing = self.s3.list_objects_v2(Bucket=self.bucket, Prefix=prefix)
        keys = [item["Key"] for item in listing.get("Contents", [])]
        return sorted(int(key.removeprefix(prefix).removesuffix(".json")) for key in keys)

    def stop(self) -> None:
        self.sshd.stop()
        self.redis.stop()


def join(host: Host, control: ControlHost) -> tuple[float, float]:
    """The guest's fleet pointed at ``control``'s services, and its worker restarted.

    As an operator does it (deploy/README.md, "Sandbox hosts under systemd"): the
    settings, the S3 credential file, the worker's key authorized on the git server
    and the server's key pinned in the worker's known_hosts, then install.sh again,
    which writes the credential's LoadCredential= line and restarts the worker.
    Every secret travels on ssh's stdin. Returns the seconds the configuration and
    install.sh took.
    """
    started = time.monotonic()
    guest = host.guest
    control.sshd.authorize(guest.run(f"cat {GUEST_KEY}").stdout)
    guest.run(
        f"install -m 0644 -o ouroboros -g ouroboros /dev/stdin {GUEST_KNOWN_HOSTS}",
        input=control.sshd.known_host(HOST_ALIAS),
    )
    guest.run(
        f"install -m 0640 -o root -g ouroboros /dev/stdin {GUEST_S3_CREDENTIALS}",
        input=f"[default]\naws_access_key_id = {S3_KEY_ID}\naws_secret_access_key = {S3_SECRET}\n",
    )
    host.set_settings(control.guest_settings())
    configured = time.monotonic()
    host.reinstall()
    return configured - started, time.monotonic() - configured


class Landed(NamedTuple):
    """What a lineage left: its generation commits, oldest first, and their observations."""

    subjects: list[str]
    commits: list[str]
    parents: list[list[str]]
    observations: list[dict[str, Any]]


def landed(control: ControlHost, lineage: str) -> Landed:
    """The branch's history (first line of each commit) and every stored observation."""
    lines = control.fleet.git("log", "--reverse", "--format=%H %P%x00%s", f"lineage-{lineage}")
    subjects, commits, parents = [], [], []
    for line in lines.splitlines():
        ids, _, subject = line.partition("\0")
        commit, *its_parents = ids.split()
        if not subject.startswith("gen "):
            continue
        subjects.append(subject)
        commits.append(commit)
        parents.append(its_parents)
    observations = [control.observation(lineage, n) for n in control.observation_numbers(lineage)]
    return Landed(subjects, commits, parents, observations)
