"""A wheel built from the repository knows its commit; one built from a dirty tree refuses.

Each wheel is built (``pip wheel``, offline: no build isolation) from a clone of this
checkout's HEAD made here, then installed into a fresh virtualenv and driven through
its own ``schedule-lineage`` console script with ``OUROBOROS_INSTRUMENT_COMMIT``
unset, from a folder that is no checkout. The fresh virtualenv holds the wheel alone;
the dependencies are those of the project's virtualenv, reached through a ``.pth``
line (a path line: that folder's own ``.pth`` files, among them the editable install
of this checkout, are not run), so the package imported is the installed one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from support.fleet import SMALL_PHYSICS, Fleet

from worker.instrument.fingerprint import PACKAGE_ROOT
from worker.instrument.source_commit import BUILD_FILE, SourceCommit, read_checkout

FINGERPRINT = "from worker.instrument.fingerprint import current; print(current().fingerprint)"
GIT_USER = ["-c", "user.name=t", "-c", "user.email=t@example.invalid"]


def clone_head(target: Path) -> str:
    """A clean clone of this checkout's HEAD; its commit."""
    subprocess.run(["git", "clone", "-q", str(PACKAGE_ROOT), str(target)], check=True)
    return subprocess.run(
        ["git", "-C", str(target), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()


def install_wheel(source: Path, scratch: Path) -> Path:
    """Build ``source``'s wheel, install it into a fresh virtualenv; its bin folder."""
    dist, venv = scratch / "dist", scratch / "venv"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(source)],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("ouroboros_fleet-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [
            venv / "bin" / "python",
            "-m",
            "pip",
            "--disable-pip-version-check",
            "-q",
            "install",
            "--no-deps",
            str(wheel),
        ],
        check=True,
    )
    (site,) = (venv / "lib").glob("python3*/site-packages")
    (site / "project-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv / "bin"


def installed(bin_dir: Path, fleet: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    """The installed ``schedule-lineage ARGS`` in the fleet's home, no commit configured."""
    env = {k: v for k, v in fleet.env.items() if k != "OUROBOROS_INSTRUMENT_COMMIT"}
    return subprocess.run(
        [str(bin_dir / "schedule-lineage"), *args],
        env=env,
        cwd=fleet.home,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
def test_an_installed_wheel_runs_a_lineage_under_the_commit_it_was_built_from(
    tmp_path: Path,
) -> None:
    commit = clone_head(tmp_path / "clone")
    bin_dir = install_wheel(tmp_path / "clone", tmp_path)
    fleet = Fleet(tmp_path / "home")
    fleet.home.mkdir()
    where = subprocess.run(
        [str(bin_dir / "python"), "-c", "import worker; print(worker.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=fleet.home,
    )
    assert where.stdout.startswith(str(tmp_path / "venv")), where.stdout

    created = installed(bin_dir, fleet, "init", "alpha", *SMALL_PHYSICS)
    assert created.returncode == 0, created.stderr
    ran = installed(bin_dir, fleet, "run", "alpha", "--generations", "1", "--local")
    assert ran.returncode == 0, ran.stderr
    assert "alpha gen 1: changed" in ran.stdout

    meta = json.loads(fleet.show("alpha", ".ouroboros-lineage.json"))
    assert meta["instrument_commit"] == commit
    # The record is data beside the code: the wheel's fingerprint is its checkout's.
    checkout = subprocess.run(
        [sys.executable, "-c", FINGERPRINT],
        env={**fleet.env, "PYTHONPATH": str(tmp_path / "clone")},
        cwd=fleet.home,
        capture_output=True,
        text=True,
        check=True,
    )
    assert meta["instrument_fingerprint"] == checkout.stdout.strip()
    assert fleet.subjects("alpha")[0].startswith("gen 1: changed")
    assert fleet.observation("alpha", 1)["outcome"] == "changed"


@pytest.mark.full
def test_a_wheel_built_from_a_dirty_tree_says_so_and_refuses(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    commit = clone_head(clone)
    with (clone / "organism.el").open("a") as seed:
        seed.write(";; edited, not committed\n")
    bin_dir = install_wheel(clone, tmp_path)
    fleet = Fleet(tmp_path / "home")
    fleet.home.mkdir()

    refused = installed(bin_dir, fleet, "init", "alpha")
    assert refused.returncode == 2, refused.stderr
    assert "built from a checkout with uncommitted tracked changes" in refused.stderr
    assert commit[:12] in refused.stderr
    assert "Traceback" not in refused.stderr
    assert not fleet.repo.exists() or not (fleet.repo / "refs/heads/lineage-alpha").exists()


@pytest.mark.full
def test_a_wheel_built_from_the_sdist_keeps_the_checkouts_commit(tmp_path: Path) -> None:
    # ``python -m build`` builds the wheel from the sdist, where there is no .git.
    clone = tmp_path / "clone"
    commit = clone_head(clone)
    build_sdist = "from setuptools import build_meta; print(build_meta.build_sdist('../sdist'))"
    subprocess.run([sys.executable, "-c", build_sdist], cwd=clone, check=True, capture_output=True)
    (sdist,) = (tmp_path / "sdist").glob("*.tar.gz")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--disable-pip-version-check",
            "-q",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(sdist),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        record = archive.read(f"worker/{BUILD_FILE}").decode()
    assert SourceCommit.decode(record) == SourceCommit(commit, dirty=False)


@pytest.mark.full
def test_only_the_top_of_a_checkout_is_read_as_one(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "inside").mkdir(parents=True)
    (repo / "tracked.txt").write_text("one\n")
    subprocess.run(["git", "-C", str(repo), "init", "-q"], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "."], check=True)
    subprocess.run(["git", "-C", str(repo), *GIT_USER, "commit", "-qm", "x"], check=True)
    head = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()

    assert read_checkout(repo) == SourceCommit(head, dirty=False)
    # A package installed in a folder of some repository is not that repository's code.
    assert read_checkout(repo / "inside") is None
    assert read_checkout(tmp_path) is None
    (repo / "untracked.txt").write_text("not ours\n")
    assert read_checkout(repo) == SourceCommit(head, dirty=False)
    (repo / "tracked.txt").write_text("two\n")
    assert read_checkout(repo) == SourceCommit(head, dirty=True)


@pytest.mark.parametrize(
    "text",
    ["", "[]", '{"commit": "abc"}', '{"commit": 1, "dirty": false}', '{"commit": "a", "dirty": 0}'],
)
def test_a_malformed_build_record_is_named_not_trusted(text: str) -> None:
    with pytest.raises(ValueError, match="not a build commit record"):
        SourceCommit.decode(text)


def test_a_build_record_reads_back_what_was_written() -> None:
    record = SourceCommit("b" * 40, dirty=True)
    assert SourceCommit.decode(record.encode()) == record
