"""The deployment artefacts, checked against the code they deploy.

docker-compose.yml, .env.example, the Dockerfile, the systemd units and
deploy/install.sh name settings, commands and files of this package; these tests
fail when either side drifts: a setting compose sets that the model does not
have, a model field missing from the documented configuration, a service command
the CLI does not offer, a unit systemd would reject, an install that is not
idempotent. Everything runs on this machine: PyYAML parses the compose file (no
docker engine needed), `systemd-analyze verify` checks the units offline, and the
install script runs twice in a scratch root.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import click
import pytest
import yaml

from worker.fleet.settings import Settings
from worker.instrument.gitrepo import IDENTITY, REPO_CONFIG

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
HOST_ENV = DEPLOY / "ouroboros.env"
DOCKERFILE = ROOT / "Dockerfile"
INSTALL = DEPLOY / "install.sh"
SYSTEM_UNITS = ("ouroboros-reconciler.service", "ouroboros-web.service")
USER_UNITS = (
    "ouroboros-worker.service",
    "ouroboros-worker@.service",
    "ouroboros-doctor.service",
    "ouroboros-repack.service",
)

# OUROBOROS_CONFIG names the TOML file the settings are read from: a source of
# the model, not one of its fields. Every other OUROBOROS_* name is a field.
NOT_FIELDS = {"OUROBOROS_CONFIG"}
SETTING_NAME = re.compile(r"\bOUROBOROS_[A-Z0-9_]+\b")
INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)")
# The images built from this repository (everything else is a third-party image).
OUR_IMAGES = ("ouroboros-fleet:", "ouroboros-flower:")
FLEET_SERVICES = {
    "redis",
    "minio",
    "minio-init",
    "repo-init",
    "git-ssh",
    "worker",
    "worker-drain",
    "reconciler",
    "web",
    "flower",
    "cli",
}


def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def services() -> dict[str, dict]:
    return compose()["services"]


def setting_names() -> set[str]:
    return {f"OUROBOROS_{name.upper()}" for name in Settings.model_fields}


def deployment_files() -> list[Path]:
    files = [COMPOSE_FILE, ENV_EXAMPLE, DOCKERFILE]
    files += [p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix != ".md"]
    return files


def as_argv(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else list(value)


# --- compose ---------------------------------------------------------------------


def test_the_compose_file_parses_and_holds_the_whole_fleet():
    spec = compose()
    assert set(spec["services"]) == FLEET_SERVICES
    assert set(spec["volumes"]) >= {"redis-data", "minio-data", "lineages", "git-ssh-hostkeys"}
    for name, service in spec["services"].items():
        assert "image" in service, f"{name} names no image"


def test_every_ouroboros_variable_in_the_deployment_is_a_settings_field():
    known = setting_names() | NOT_FIELDS
    found: dict[str, set[str]] = {}
    for path in deployment_files():
        for name in SETTING_NAME.findall(path.read_text(errors="replace")):
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    for service in services().values():
        for name in service.get("environment") or {}:
            if name.startswith("OUROBOROS_"):
                found.setdefault(name, set()).add("docker-compose.yml environment")
    unknown = {name: sorted(where) for name, where in found.items() if name not in known}
    assert not unknown, f"not fields of worker.fleet.settings.Settings: {unknown}"


@pytest.mark.parametrize("path", [ENV_EXAMPLE, HOST_ENV], ids=lambda p: p.name)
def test_every_setting_of_the_model_is_listed_in_the_env_files(path: Path):
    listed = set(re.findall(r"^#?\s*(OUROBOROS_[A-Z0-9_]+)=", path.read_text(), re.M))
    missing = sorted(setting_names() - listed)
    assert not missing, f"{path.name} does not list {missing}"


def test_every_variable_the_compose_file_interpolates_is_in_env_example():
    listed = set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]*)=", ENV_EXAMPLE.read_text(), re.M))
    used = set(INTERPOLATION.findall(COMPOSE_FILE.read_text()))
    missing = sorted(used - listed)
    assert not missing, f".env.example does not list {missing}"


def test_compose_only_knobs_are_not_named_like_settings():
    # An OUROBOROS_* variable that only steers compose would read as a setting.
    for name in INTERPOLATION.findall(COMPOSE_FILE.read_text()):
        if name.startswith("OUROBOROS_"):
            assert name in setting_names(), name


def test_no_provider_key_travels_in_a_compose_environment():
    for name, service in services().items():
        for variable, value in (service.get("environment") or {}).items():
            assert not variable.endswith("_API_KEY"), f"{name} sets {variable}"
            assert "API_KEY" not in str(value), f"{name}: {variable}"
    worker = services()["worker"]
    assert worker["environment"]["CREDENTIALS_DIRECTORY"] == "/run/credentials/ouroboros"
    mounts = [v for v in worker["volumes"] if v.endswith(":/run/credentials/ouroboros:ro")]
    assert mounts, "the worker mounts no read-only credentials directory"


def test_every_long_running_service_has_a_health_check():
    for name, service in services().items():
        one_shot = service.get("restart") == "no" or "cli" in service.get("profiles", [])
        if not one_shot:
            assert service.get("restart") == "unless-stopped", name
            assert service.get("healthcheck", {}).get("test"), f"{name} has no health check"


def test_redis_persists_appends_and_never_evicts():
    redis = services()["redis"]
    conf_mount = next(v for v in redis["volumes"] if v.endswith("ouroboros.conf:ro"))
    conf = (ROOT / conf_mount.split(":")[0]).read_text()
    assert re.search(r"^appendonly yes$", conf, re.M)
    assert re.search(r"^maxmemory-policy noeviction$", conf, re.M)
    assert "/usr/local/etc/redis/ouroboros.conf" in redis["command"]
    assert "--requirepass" in redis["command"]
    assert "redis-data:/data" in redis["volumes"]


def test_the_worker_gets_exactly_the_privileges_bwrap_and_cgroups_need():
    for name in ("worker", "worker-drain"):
        worker = services()[name]
        assert not worker.get("privileged")
        assert worker["cap_add"] == ["SYS_ADMIN"]
        assert set(worker["security_opt"]) == {
            "seccomp=unconfined",
            "apparmor=unconfined",
            "systempaths=unconfined",
            "no-new-privileges:true",
        }
        assert worker["cgroup"] == "private"
        assert worker["init"] is True
        assert worker["user"] == "root"
        assert worker["entrypoint"] == ["/usr/local/libexec/ouroboros/worker-entrypoint.sh"]
    for name, service in services().items():
        if name not in ("worker", "worker-drain"):
            assert not service.get("cap_add"), name
            assert not service.get("privileged"), name
            assert "unconfined" not in " ".join(service.get("security_opt", [])), name
    entrypoint = (DEPLOY / "docker" / "worker-entrypoint.sh").read_text()
    # Everything privileged is dropped before the worker runs.
    assert "--bounding-set=-all" in entrypoint and "--no-new-privs" in entrypoint
    assert "COPY --chmod=0755 deploy/docker/worker-entrypoint.sh" in DOCKERFILE.read_text()


def test_the_minio_init_job_and_the_git_server_use_files_that_exist():
    minio_init = services()["minio-init"]
    assert minio_init["entrypoint"] == ["/bin/sh", "/deploy/minio-init.sh"]
    assert (DEPLOY / "compose" / "minio" / "minio-init.sh").is_file()
    assert minio_init["depends_on"]["minio"]["condition"] == "service_healthy"
    for source in re.findall(r"^COPY (?:--chmod=\S+ )?(\S+) ", DOCKERFILE.read_text(), re.M):
        if source != ".":
            assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"


def repo_init(repository: Path) -> None:
    """Run the repo-init service's command, with ``repository`` for the volume's."""
    service = services()["repo-init"]
    assert service["entrypoint"] == ["/bin/sh", "-c"]
    command = service["command"][0].replace("/srv/git/lineages.git", str(repository))
    subprocess.run(["/bin/sh", "-c", command], check=True)


@pytest.mark.parametrize("existing", [False, True], ids=["new", "made-before"])
@pytest.mark.full
def test_repo_init_configures_the_repository_as_the_package_makes_it(
    tmp_path: Path, existing: bool
) -> None:
    """At every ``up``, a new or existing repository gets every setting of one the package
    makes, among them the receive checks: a forced rewrite and a deletion are refused."""
    repository = tmp_path / "lineages.git"
    if existing:
        subprocess.run(["git", "init", "--bare", "--quiet", str(repository)], check=True)
    repo_init(repository)
    repo_init(repository)

    def config(*args: str) -> str:
        return subprocess.run(
            ["git", f"--git-dir={repository}", "config", *args],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    for name, value in REPO_CONFIG.items():
        kind = "bool" if value in ("true", "false") else "int"
        assert config(f"--type={kind}", name) == value, name
    for name in ("denyNonFastForwards", "denyDeletes"):
        assert REPO_CONFIG[f"receive.{name}"] == "true"
    work = tmp_path / "work.git"
    subprocess.run(["git", "init", "--bare", "--quiet", str(work)], check=True)

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", f"--git-dir={work}", *args],
            input="",
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, **IDENTITY},
        ).stdout.strip()

    tree = git("mktree")
    seed = git("commit-tree", tree, "-m", "seed")
    head = git("commit-tree", tree, "-p", seed, "-m", "gen 1")
    forged = git("commit-tree", tree, "-p", seed, "-m", "forged")

    def push(*args: str) -> int:
        argv = ["git", f"--git-dir={work}", "push", "--quiet", str(repository), *args]
        return subprocess.run(argv, capture_output=True).returncode

    assert push(f"{head}:refs/heads/lineage-x") == 0
    assert push("--force", f"{forged}:refs/heads/lineage-x") != 0
    assert push("--delete", "refs/heads/lineage-x") != 0
    landed = ["git", f"--git-dir={repository}", "rev-parse", "refs/heads/lineage-x"]
    assert subprocess.run(landed, capture_output=True, text=True).stdout.strip() == head


def test_the_operators_guide_sets_every_setting_where_it_makes_a_repository():
    """The restore snippet and the advice for a repository made elsewhere name each
    setting of a repository the package makes: the receive checks are not lost by a
    restore or by an ssh server of the operator's own."""
    guide = (DEPLOY / "README.md").read_text()
    restore = guide[guide.index("git init --bare --quiet /srv/git/lineages.git") :]
    restore = restore[: restore.index("```")]
    elsewhere = guide[guide.index("**A repository that is not created here**") :]
    elsewhere = elsewhere[: elsewhere.index("\n\n")]
    for name, value in REPO_CONFIG.items():
        assert f"config {name} {value} &&" in restore, name
        assert f"{name} {value}" in " ".join(elsewhere.split()), name


# --- commands ----------------------------------------------------------------------


def cli_group() -> click.Group:
    from scheduler import cli

    return cli.cli


def console_scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def check_schedule_lineage(argv: list[str], where: str) -> None:
    assert console_scripts().get("schedule-lineage") == "scheduler.cli:main", where
    group = cli_group()
    words = [a for a in argv if not a.startswith("-")]
    assert words, f"{where}: schedule-lineage without a subcommand"
    command = group.commands.get(words[0])
    assert command is not None, (
        f"{where}: schedule-lineage has no `{words[0]}` command (has: {sorted(group.commands)})"
    )
    offered = {opt for param in command.params for opt in getattr(param, "opts", [])}
    for arg in argv:
        if arg.startswith("--"):
            option = arg.split("=", 1)[0]
            assert option in offered, f"{where}: `schedule-lineage {words[0]}` has no {option}"


def check_celery(argv: list[str], where: str, image: str) -> None:
    assert argv[:2] == ["-A", "worker"], f"{where}: the Celery app is `-A worker`"
    subcommand = argv[2]
    if subcommand == "flower":
        # Flower is installed only in the flower image target (not a dependency).
        assert image.startswith("ouroboros-flower:"), where
        assert re.search(
            r"FROM base AS flower\n(?:(?!FROM ).*\n)*?.*\bpip install \"flower",
            DOCKERFILE.read_text(),
        )
        return
    assert subcommand in {"worker", "beat", "inspect"}, f"{where}: celery {subcommand}"
    result = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "worker", subcommand, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"{where}: celery -A worker {subcommand}: {result.stderr}"


def check_command(argv: list[str], where: str, image: str = "") -> None:
    """One command line: schedule-lineage, celery (also `python -m celery`), or none of ours."""
    if argv and argv[0].endswith(("/cgroup-delegate", "/worker-entrypoint.sh")):
        argv = argv[1:]  # wrappers that prepare cgroups, then exec the command
    if argv and argv[0].endswith("/python") and argv[1:3] == ["-m", "celery"]:
        argv = ["celery", *argv[3:]]
    if not argv:
        return
    program = Path(argv[0]).name
    if program == "schedule-lineage":
        check_schedule_lineage(argv[1:], where)
    elif program == "celery":
        check_celery(argv[1:], where, image)


def shell_commands(text: str) -> list[list[str]]:
    """The simple commands of a shell line that run our programs."""
    out = []
    for part in re.split(r"\|\||&&|[|;]", text):
        words = [w for w in shlex.split(part) if not w.startswith((">", "2>"))]
        for i, word in enumerate(words):
            if Path(word).name in ("schedule-lineage", "celery"):
                out.append(words[i:])
                break
    return out


@pytest.mark.full
def test_every_service_command_exists_in_the_package():
    checked = 0
    for name, service in services().items():
        image = service["image"]
        if not image.startswith(OUR_IMAGES):
            continue
        argv = as_argv(service.get("entrypoint")) + as_argv(service.get("command"))
        if argv[:2] == ["/bin/sh", "-c"]:
            for command in shell_commands(" ".join(argv[2:])):
                check_command(command, name, image)
        elif argv[:1] == ["schedule-lineage"] and name == "cli":
            # `docker compose run --rm cli <subcommand>`: the default is --help.
            assert console_scripts().get("schedule-lineage")
        else:
            check_command(argv, name, image)
            checked += 1
        test = service.get("healthcheck", {}).get("test", [])
        if test[:1] == ["CMD-SHELL"]:
            for command in shell_commands(test[1]):
                check_command(command, f"{name} healthcheck", image)
        elif test[:1] == ["CMD"]:
            check_command(test[1:], f"{name} healthcheck", image)
    assert checked >= 5


@pytest.mark.full
def test_every_unit_command_exists_in_the_package():
    for unit in SYSTEM_UNITS + USER_UNITS:
        text = (DEPLOY / "systemd" / unit).read_text()
        (line,) = re.findall(r"^ExecStart=(.*)$", text, re.M)
        argv = shlex.split(line)
        assert argv[0].startswith("/opt/ouroboros/"), unit
        if argv[0] == "/opt/ouroboros/libexec/cgroup-delegate":
            assert (DEPLOY / "systemd" / "cgroup-delegate.sh").is_file()
        check_command(argv, unit)


# --- shell scripts --------------------------------------------------------------------


def shell_scripts() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*.sh"))


@pytest.mark.full
def test_shell_scripts_are_strict_and_shellcheck_clean():
    scripts = shell_scripts()
    assert len(scripts) >= 7
    for script in scripts:
        text = script.read_text()
        assert text.startswith("#!"), script
        strict = "set -euo pipefail" if "bash" in text.splitlines()[0] else "set -eu"
        assert strict in text, f"{script.name} lacks `{strict}`"
        assert os.access(script, os.X_OK), f"{script.name} is not executable"
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing: apt-get install shellcheck"
    result = subprocess.run([shellcheck, *map(str, scripts)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# --- install.sh in a scratch root -------------------------------------------------------


def scratch_root(path: Path) -> Path:
    """A root filesystem with just the account databases install.sh edits."""
    etc = path / "etc"
    etc.mkdir(parents=True)
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (etc / "group").write_text("root:x:0:\n")
    (etc / "shadow").write_text("root:*:19000:0:99999:7:::\n")
    (etc / "gshadow").write_text("root:*::\n")
    for name in ("shadow", "gshadow"):
        (etc / name).chmod(0o640)
    return path


def install(root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    # --no-deps: the test checks the installer, not the dependency resolver; the
    # package itself is still built from this checkout and installed for real.
    result = subprocess.run(
        [
            "bash",
            str(INSTALL),
            "--root",
            str(root),
            "--python",
            sys.executable,
            "--pip-arg=--no-deps",
            "--components",
            "worker,reconciler,web",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under root: type, mode, owner, content digest or link target."""
    tree = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        if stat.S_ISLNK(info.st_mode):
            what: object = os.readlink(path)
        elif stat.S_ISREG(info.st_mode):
            what = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            what = None
        tree[str(path.relative_to(root))] = (
            stat.S_IFMT(info.st_mode),
            stat.S_IMODE(info.st_mode),
            info.st_uid,
            info.st_gid,
            what,
        )
    return tree


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = scratch_root(tmp_path_factory.mktemp("scratch") / "root")
    # Credential files present from the start, so that the units verified below
    # carry their LoadCredential= drop-ins.
    credentials = root / "etc/ouroboros/credentials"
    credentials.mkdir(parents=True)
    for name in ("ANTHROPIC_API_KEY", "s3-writer.ini", "s3-reader.ini"):
        (credentials / name).write_text("placeholder\n")
    install(root)
    first = snapshot(root)
    second_run = install(root)
    return {"root": root, "first": first, "second": snapshot(root), "second_run": second_run}


@pytest.mark.full
def test_install_twice_in_a_scratch_root_changes_nothing_the_second_time(installed):
    assert installed["first"] == installed["second"]
    assert "building release" not in installed["second_run"].stdout


@pytest.mark.full
def test_install_creates_the_account_release_units_and_lingering(installed):
    root: Path = installed["root"]
    passwd = (root / "etc/passwd").read_text()
    (entry,) = [line for line in passwd.splitlines() if line.startswith("ouroboros:")]
    uid = int(entry.split(":")[2])
    assert entry.endswith(":/var/lib/ouroboros:/usr/sbin/nologin")
    assert (root / "var/lib/systemd/linger/ouroboros").is_file()

    wrapper = root / "opt/ouroboros/libexec/cgroup-delegate"
    assert wrapper.read_bytes() == (DEPLOY / "systemd/cgroup-delegate.sh").read_bytes()
    assert os.access(wrapper, os.X_OK)

    current = root / "opt/ouroboros/current"
    assert os.readlink(current).startswith("releases/0.")
    script = current / "venv/bin/schedule-lineage"
    shebang = script.read_text().splitlines()[0]
    assert shebang.startswith("#!/opt/ouroboros/releases/"), "scratch path left in a shebang"
    assert str(root) not in (current / "venv/pyvenv.cfg").read_text()
    assert (current / "instrument.env").is_file()

    user_units = root / "var/lib/ouroboros/.config/systemd/user"
    for unit in USER_UNITS:
        assert (user_units / unit).read_text() == (DEPLOY / "systemd" / unit).read_text()
        assert (user_units / unit).stat().st_uid == uid
    wants = user_units / "default.target.wants/ouroboros-worker.service"
    assert os.readlink(wants) == "../ouroboros-worker.service"
    timer = user_units / "timers.target.wants/ouroboros-repack.timer"
    assert os.readlink(timer) == "../ouroboros-repack.timer"
    assert (user_units / "ouroboros-repack.timer").read_text() == (
        DEPLOY / "systemd" / "ouroboros-repack.timer"
    ).read_text()
    for unit in SYSTEM_UNITS:
        assert (root / "etc/systemd/system" / unit).is_file()
        link = root / "etc/systemd/system/multi-user.target.wants" / unit
        assert os.readlink(link) == f"/etc/systemd/system/{unit}"
    worker_credentials = user_units / "ouroboros-worker.service.d/50-credentials.conf"
    assert "LoadCredential=ANTHROPIC_API_KEY:/etc/ouroboros/credentials/ANTHROPIC_API_KEY" in (
        worker_credentials.read_text()
    )
    assert "Environment=AWS_SHARED_CREDENTIALS_FILE=%d/aws-credentials" in (
        worker_credentials.read_text()
    )
    delegate = root / f"etc/systemd/system/user@{uid}.service.d/ouroboros-delegate.conf"
    assert "Delegate=cpu cpuset io memory pids" in delegate.read_text()

    env = root / "etc/ouroboros/ouroboros.env"
    assert env.read_text() == HOST_ENV.read_text()
    assert stat.S_IMODE(env.stat().st_mode) == 0o640
    assert stat.S_IMODE((root / "etc/ouroboros/credentials").stat().st_mode) == 0o750


@pytest.mark.full
def test_the_installed_release_holds_every_file_of_the_packages(installed):
    # A deployment runs from a built wheel, not from this checkout: a template,
    # script or seed left out of the package data is missing on every host.
    root: Path = installed["root"]
    (site,) = (root / "opt/ouroboros/current/venv/lib").glob("python3*/site-packages")
    missing = []
    for package in ("worker", "scheduler", "sandbox_scripts"):
        for path in sorted((ROOT / package).rglob("*")):
            if path.is_dir() or "__pycache__" in path.parts or path.suffix == ".pyc":
                continue
            relative = path.relative_to(ROOT)
            if not (site / relative).is_file():
                missing.append(str(relative))
    assert not missing, f"not in the installed package (pyproject package-data?): {missing}"


@pytest.mark.full
def test_install_keeps_an_edited_env_file_and_loads_only_present_credentials(
    tmp_path: Path,
):
    root = scratch_root(tmp_path / "root")
    install(root)
    env = root / "etc/ouroboros/ouroboros.env"
    env.write_text("OUROBOROS_CONCURRENCY=4\n")
    credentials = root / "etc/ouroboros/credentials"
    (credentials / "OPENAI_API_KEY").write_text("sk-test\n")
    (credentials / "s3-reader.ini").write_text("[default]\n")
    install(root)
    assert env.read_text() == "OUROBOROS_CONCURRENCY=4\n"
    dropin = root / "var/lib/ouroboros/.config/systemd/user/ouroboros-worker.service.d"
    text = (dropin / "50-credentials.conf").read_text()
    assert "LoadCredential=OPENAI_API_KEY:/etc/ouroboros/credentials/OPENAI_API_KEY" in text
    assert "ANTHROPIC_API_KEY" not in text
    assert "aws-credentials" not in text  # no s3-writer.ini: the worker gets none
    web = root / "etc/systemd/system/ouroboros-web.service.d/50-credentials.conf"
    assert "LoadCredential=aws-credentials:/etc/ouroboros/credentials/s3-reader.ini" in (
        web.read_text()
    )


@pytest.mark.full
def test_a_new_release_with_the_same_dependencies_installs_only_the_project(tmp_path: Path):
    root = scratch_root(tmp_path / "root")
    install(root)
    # The same source, one byte more: another release, the same dependency set.
    source = tmp_path / "source"
    source.mkdir()
    for part in ("pyproject.toml", "organism.el", "README.md"):
        shutil.copy(ROOT / part, source / part)
    for part in ("worker", "scheduler", "sandbox_scripts"):
        shutil.copytree(ROOT / part, source / part, ignore=shutil.ignore_patterns("__pycache__"))
    with (source / "worker/__init__.py").open("a") as init:
        init.write("\n")
    first = os.readlink(root / "opt/ouroboros/current")
    second = install(root, "--source", str(source))
    assert "building release" in second.stdout
    assert "installing the dependencies" not in second.stdout
    releases = root / "opt/ouroboros"
    current = releases / "current"
    assert os.readlink(current) != first
    (dependencies,) = (root / "opt/ouroboros/dependencies").iterdir()
    (site,) = (current / "venv/lib").glob("python3*/site-packages")
    (shared,) = (dependencies / "venv/lib").glob("python3*/site-packages")
    # The dependencies are the same files, hard-linked; the project is this release's own.
    for name in ("click/__init__.py", "celery/__init__.py"):
        assert (site / name).stat().st_ino == (shared / name).stat().st_ino
    assert (site / "worker/__init__.py").read_text().endswith("\n\n")
    assert not (shared / "worker").exists()
    for path in (current / "venv/bin").iterdir():
        if path.is_file() and not path.is_symlink():
            text = path.read_bytes()
            assert b"/dependencies/" not in text and str(root).encode() not in text, path
    assert "/dependencies/" not in (current / "venv/pyvenv.cfg").read_text()
    assert (releases / first / "venv/bin/schedule-lineage").is_file()


# --- systemd-analyze verify ---------------------------------------------------------------


def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    assert path, "systemd-analyze is missing: apt-get install systemd (no manager is started)"
    return path


def assert_verified(result: subprocess.CompletedProcess[str], what: str) -> None:
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0 and not output, f"{what}:\n{output}"


@pytest.mark.full
def test_systemd_analyze_verifies_the_installed_system_units(installed):
    root: Path = installed["root"]
    # The units refer to targets of the distribution (multi-user.target,
    # network-online.target): give the scratch root this machine's.
    for kind in ("system", "user"):
        target = root / "usr/lib/systemd" / kind
        if not target.exists():
            shutil.copytree(Path("/usr/lib/systemd") / kind, target, symlinks=True)
    for unit in SYSTEM_UNITS:
        result = subprocess.run(
            [systemd_analyze(), "verify", f"--root={root}", f"/etc/systemd/system/{unit}"],
            capture_output=True,
            text=True,
        )
        assert_verified(result, unit)


@pytest.mark.full
def test_systemd_analyze_verifies_the_installed_user_units(installed, tmp_path: Path):
    # `systemd-analyze --user` has no --root: verify copies whose paths point into
    # the scratch root, from a unit directory of their own (with their drop-ins).
    root: Path = installed["root"]
    installed_units = root / "var/lib/ouroboros/.config/systemd/user"
    units = tmp_path / "units"
    shutil.copytree(installed_units, units, symlinks=True)
    release = os.readlink(root / "opt/ouroboros/current").removeprefix("releases/")
    for path in units.rglob("*"):
        if path.is_file() and not path.is_symlink():
            text = path.read_text().replace("/opt/ouroboros/", f"{root}/opt/ouroboros/")
            text = text.replace("WorkingDirectory=%h", f"WorkingDirectory={tmp_path}")
            path.write_text(text)
    # A template is verified through an instance: the release installed.
    (units / f"ouroboros-worker@{release}.service").symlink_to("ouroboros-worker@.service")
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "SYSTEMD_UNIT_PATH": f"{units}:"}
    for unit in (
        "ouroboros-worker.service",
        f"ouroboros-worker@{release}.service",
        "ouroboros-doctor.service",
    ):
        result = subprocess.run(
            [systemd_analyze(), "--user", "verify", str(units / unit)],
            capture_output=True,
            text=True,
            env=env,
        )
        assert_verified(result, unit)
