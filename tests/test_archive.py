"""Lineage archives: export, verify with nothing but the archive, import into a second fleet.

The published lineage is the hostile one (a changed generation, an out-of-loop
commit, a death; observations full of markup) with a run record, plus a fork of it.
The second fleet has its own bare repository and its own bucket on the session's
moto S3 server, spoken to over HTTP; both fleets are served and must show the same
lineage. Tampered archives are rebuilt member by member with tarfile and must be
refused with the line that names what was done to them; hostile archives (path
traversal, links, duplicates, oversize members, garbage) are refused before use.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import NamedTuple

import boto3
import pytest
from support.browse import Served, import_fixture, settings_of, write_hostile_lineage
from support.fleet import S3_REGION, Fleet

from scheduler import archive as archive_format
from scheduler.verify import check
from worker.fleet.assembly import observation_store
from worker.fleet.runs import RunRecord, new_run_id
from worker.instrument.errors import Refusal
from worker.instrument.gitrepo import IDENTITY, run_git
from worker.instrument.store_keys import run_key

# Full tier: its lineages are made and checked with git and the CLI.
pytestmark = pytest.mark.full

Members = dict[str, bytes]


class Published(NamedTuple):
    fleet: Fleet
    archive: Path
    kid_archive: Path
    run_id: str


def members_of(path: Path) -> Members:
    with tarfile.open(path, "r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]


def pack(members: Members, path: Path) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def refs_and_files(fleet: Fleet) -> tuple[str, list[str]]:
    files = sorted(str(p.relative_to(fleet.home)) for p in fleet.observations.rglob("*"))
    return fleet.git("for-each-ref", "--format=%(refname) %(objectname)"), files


def write_run(fleet: Fleet, lineage: str, status: str, target: int) -> str:
    now = datetime.now(UTC)
    run = RunRecord(
        run_id=new_run_id(),
        lineage=lineage,
        created_at=now,
        start_generation=0,
        target_generation=target,
        provider="scripted",
        model=None,
        budget_usd=Decimal("1"),
        status=status,  # type: ignore[arg-type]
        cancelled_at=now if status == "cancelled" else None,
    )
    store = observation_store(settings_of(fleet))
    store.put(run_key(lineage, run.run_id), run.model_dump_json(indent=2).encode())
    return run.run_id


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Published:
    fleet = Fleet(tmp_path_factory.mktemp("publisher"))
    write_hostile_lineage(settings_of(fleet), "pub")
    run_id = write_run(fleet, "pub", "cancelled", 2)
    fleet.ok("fork", "pubkid", "--from", "pub@1")
    before = refs_and_files(fleet)
    archive = fleet.home / "pub.ouroboros.tar.gz"
    done = fleet.ok("export", "pub", "--to", str(archive))
    assert "exported lineage pub: 2 generations" in done.stdout
    assert "2 observations (0 unobserved), 1 run records" in done.stdout
    kid_archive = fleet.home / "kid.tgz"
    fleet.ok("export", "pubkid", "--to", str(kid_archive))
    # Exporting wrote nothing to the repository or the store.
    assert refs_and_files(fleet) == before
    return Published(fleet, archive, kid_archive, run_id)


@pytest.fixture
def second(
    tmp_path: Path, s3_endpoint: str, s3_bucket: str, aws_test_credentials: tuple[str, str]
) -> Fleet:
    """Another fleet: its own bare repository and its own bucket on moto, over HTTP."""
    home = tmp_path / "second"
    home.mkdir()
    key_id, secret = aws_test_credentials
    return Fleet(
        home,
        OUROBOROS_OBSERVATIONS=f"s3://{s3_bucket}/fleet2",
        OUROBOROS_S3_ENDPOINT_URL=s3_endpoint,
        OUROBOROS_S3_REGION=S3_REGION,
        AWS_ACCESS_KEY_ID=key_id,
        AWS_SECRET_ACCESS_KEY=secret,
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
    )


def bucket_state(fleet: Fleet) -> dict[str, tuple[str, str]]:
    """Every object of the fleet's bucket: key -> (ETag, LastModified)."""
    client = boto3.session.Session().client(
        "s3", endpoint_url=fleet.env["OUROBOROS_S3_ENDPOINT_URL"], region_name=S3_REGION
    )
    bucket = fleet.env["OUROBOROS_OBSERVATIONS"].removeprefix("s3://").split("/")[0]
    listed = client.list_objects_v2(Bucket=bucket).get("Contents", [])
    return {o["Key"]: (o["ETag"], str(o["LastModified"])) for o in listed}


@pytest.fixture
def served_pair(published: Published, second: Fleet) -> Iterator[tuple[Served, Served]]:
    second.ok("import", str(published.archive))
    second.ok("import", str(published.kid_archive))
    first_server = Served(published.fleet, published.fleet.home / "serve-first.log")
    second_server = Served(second, second.home / "serve-second.log")
    yield first_server, second_server
    first_server.stop()
    second_server.stop()


def test_an_export_verifies_with_nothing_but_the_archive(
    published: Published, tmp_path: Path
) -> None:
    elsewhere = Fleet(tmp_path)  # no repository, no store: only the file
    done = elsewhere.ok("verify", str(published.archive))
    assert "verified" in done.stdout
    assert "lineage pub, 2 generations" in done.stdout
    assert "2 observations (0 declared unobserved), 1 run records, metadata" in done.stdout
    members = members_of(published.archive)
    assert sorted(members) == [
        "generations/000001.json",
        "generations/000002.json",
        "lineage.bundle",
        "manifest.json",
        "metadata.json",
        f"runs/{published.run_id}.json",
    ]
    manifest = json.loads(members["manifest.json"])
    assert manifest["schema"] == "ouroboros-lineage-archive/v1"
    assert manifest["head"] == published.fleet.git("rev-parse", "lineage-pub").strip()
    # Observations are the store's bytes, not a re-serialisation of them.
    stored = published.fleet.observation_path("pub", 2).read_bytes()
    assert members["generations/000002.json"] == stored


def test_import_into_a_second_fleet_on_s3_is_write_once_and_idempotent(
    published: Published, second: Fleet
) -> None:
    first = second.ok("import", str(published.archive)).stdout
    assert "imported lineage pub" in first and "created" in first
    assert "4 records written, 0 already present" in first
    assert second.git("rev-parse", "lineage-pub") == published.fleet.git("rev-parse", "lineage-pub")
    objects = bucket_state(second)
    assert set(objects) == {
        "fleet2/claims/pub.json",
        "fleet2/lineages/pub/metadata.json",
        "fleet2/lineages/pub/generations/000001.json",
        "fleet2/lineages/pub/generations/000002.json",
        f"fleet2/lineages/pub/runs/{published.run_id}.json",
        "fleet2/lineages/pub/index.json",
    }
    refs = second.git("for-each-ref")
    again = second.ok("import", str(published.archive)).stdout
    assert "already there" in again and "0 records written, 4 already present" in again
    assert bucket_state(second) == objects  # not one object rewritten
    assert second.git("for-each-ref") == refs


def test_the_second_fleet_shows_the_same_lineage(served_pair: tuple[Served, Served]) -> None:
    first, second = served_pair
    for path in (
        "/api/lineages/pub",
        "/api/lineages/pub/generations/1",
        "/api/lineages/pub/generations/2",
        "/api/lineages/pubkid",
    ):
        assert second.get(path).json() == first.get(path).json(), path
    page = second.get("/lineages/pubkid").text
    assert '<a href="/lineages/pub/generations/1">pub generation 1</a>' in page
    assert second.get("/api/lineages/pub").json()["summary"]["children"] == ["pubkid"]
    assert "Lineage pub" in second.get("/lineages/pub").text


def test_a_fork_imported_without_its_parent_shows_the_parent_as_absent(
    published: Published, second: Fleet
) -> None:
    second.ok("import", str(published.kid_archive))
    server = Served(second, second.home / "serve.log")
    try:
        view = server.get("/api/lineages/pubkid").json()
        page = server.get("/lineages/pubkid").text
    finally:
        server.stop()
    assert view["genealogy"]["ancestry"][0]["present"] is False
    assert view["parent_url"] is None
    assert 'pub generation 1 <span class="muted">(not in this repository)</span>' in page


def test_import_refuses_a_name_taken_in_the_repository_or_the_store(
    published: Published, tmp_path: Path
) -> None:
    taken = Fleet(tmp_path / "taken")
    (tmp_path / "taken").mkdir()
    taken.ok("init", "pub")
    head = taken.git("rev-parse", "lineage-pub")
    result = taken.cli("import", str(published.archive))
    assert result.returncode == 2
    assert "lineage pub already exists here" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert taken.git("rev-parse", "lineage-pub") == head
    assert taken.observation_numbers("pub") == []

    stale = Fleet(tmp_path / "stale")
    (tmp_path / "stale").mkdir()
    leftover = stale.observations / "lineages" / "pub" / "metadata.json"
    leftover.parent.mkdir(parents=True)
    leftover.write_text("{}\n")
    result = stale.cli("import", str(published.archive))
    assert result.returncode == 2
    assert "already holds lineages/pub/metadata.json with other content" in result.stderr
    assert not (stale.repo / "refs" / "heads" / "lineage-pub").exists()
    assert leftover.read_text() == "{}\n"


def _observation_edited(members: Members, number: int, **changes: object) -> bytes:
    data = json.loads(members[f"generations/{number:06d}.json"])
    data.update(changes)
    return json.dumps(data, indent=2).encode()


def _listed(members: Members, name: str, digest: str | None) -> None:
    """The manifest with ``name`` listed with ``digest``, or not listed at all (None)."""
    manifest = json.loads(members["manifest.json"])
    if digest is None:
        del manifest["files"][name]
    else:
        manifest["files"][name] = digest
    members["manifest.json"] = json.dumps(manifest).encode()


def _resum(members: Members, name: str) -> None:
    _listed(members, name, hashlib.sha256(members[name]).hexdigest())


def changed_observation(m: Members) -> str:
    m["generations/000001.json"] = _observation_edited(m, 1, spent_usd="0")
    return "problem: sum: generations/000001.json has sha256 "


def changed_observation_resummed(m: Members) -> str:
    m["generations/000001.json"] = _observation_edited(m, 1, generation=2)
    _resum(m, "generations/000001.json")
    return "problem: generations/000001.json: holds generation 2, not 1"


def observation_of_another_commit(m: Members) -> str:
    other = json.loads(m["generations/000002.json"])["lineage_commit"]
    m["generations/000001.json"] = _observation_edited(m, 1, lineage_commit=other)
    _resum(m, "generations/000001.json")
    return f"problem: generations/000001.json: names commit {other[:12]}, but generation 1 is "


def missing_observation(m: Members) -> str:
    del m["generations/000002.json"]
    return "problem: missing: generations/000002.json is listed in the manifest but not in "


def missing_observation_and_entry(m: Members) -> str:
    del m["generations/000002.json"]
    _listed(m, "generations/000002.json", None)
    return (
        "problem: missing: generation 2 has no observation (generations/000002.json) and the "
        "manifest does not declare it unobserved"
    )


def extra_observation(m: Members) -> str:
    m["generations/000003.json"] = m["generations/000002.json"]
    return "problem: extra: generations/000003.json is in the archive but not in the manifest"


def extra_observation_listed(m: Members) -> str:
    m["generations/000003.json"] = _observation_edited(m, 2, generation=3)
    _resum(m, "generations/000003.json")
    return "problem: generations/000003.json: generation 3 is not in the lineage's history"


def wrong_sum(m: Members) -> str:
    _listed(m, "metadata.json", "0" * 64)
    actual = hashlib.sha256(m["metadata.json"]).hexdigest()
    return f"problem: sum: metadata.json has sha256 {actual}, the manifest says {'0' * 64}"


def dot_git_on_top_of_the_branch(m: Members) -> str:
    """A hand commit on the branch whose tree holds .git/config: git refuses to check it
    out, and a fetch from a bundle (git's unbundle) runs no object checks of its own."""
    manifest = json.loads(m["manifest.json"])
    ref = f"refs/heads/lineage-{manifest['lineage']}"
    with tempfile.TemporaryDirectory() as scratch:
        repo, bundle = Path(scratch) / "r.git", Path(scratch) / "b.bundle"
        run_git(repo, "init", "--bare", "--quiet")
        bundle.write_bytes(m["lineage.bundle"])
        run_git(repo, "fetch", "--quiet", str(bundle), f"{ref}:{ref}")
        blob = run_git(repo, "hash-object", "-w", "--stdin", input=b"[core]\n").stdout.decode()
        inner = b"100644 config\0" + bytes.fromhex(blob.strip())
        sub = run_git(repo, "hash-object", "-w", "-t", "tree", "--stdin", input=inner)
        top = run_git(repo, "cat-file", "tree", f"{manifest['head']}^{{tree}}").stdout
        tree = (
            run_git(
                repo,
                "hash-object",
                "-w",
                "-t",
                "tree",
                "--literally",
                "--stdin",
                input=b"40000 .git\0" + bytes.fromhex(sub.stdout.decode().strip()) + top,
            )
            .stdout.decode()
            .strip()
        )
        head = (
            run_git(repo, "commit-tree", tree, "-p", manifest["head"], "-m", "hand", env=IDENTITY)
            .stdout.decode()
            .strip()
        )
        run_git(repo, "update-ref", ref, head)
        run_git(repo, "bundle", "create", str(bundle), ref)
        m["lineage.bundle"] = bundle.read_bytes()
    _resum(m, "lineage.bundle")
    manifest = json.loads(m["manifest.json"])
    manifest["head"] = head
    m["manifest.json"] = json.dumps(manifest).encode()
    return "problem: lineage.bundle: git refused its objects (error in tree "


TAMPERINGS: list[Callable[[Members], str]] = [
    changed_observation,
    changed_observation_resummed,
    observation_of_another_commit,
    missing_observation,
    missing_observation_and_entry,
    extra_observation,
    extra_observation_listed,
    wrong_sum,
    dot_git_on_top_of_the_branch,
]


@pytest.mark.parametrize("tamper", TAMPERINGS, ids=lambda t: t.__name__)
def test_a_tampered_archive_is_refused_with_the_line_that_names_it(
    published: Published, tmp_path: Path, tamper: Callable[[Members], str]
) -> None:
    members = members_of(published.archive)
    expected = tamper(members)
    tampered = pack(members, tmp_path / "tampered.tgz")
    fleet = Fleet(tmp_path)
    result = fleet.cli("verify", str(tampered))
    assert result.returncode == 1, result.stdout
    assert expected in result.stderr
    problems = result.stderr.count("problem: ")
    assert result.stderr.strip().splitlines()[-1].endswith(f"does not verify: {problems} problems")
    assert "Traceback" not in result.stderr
    imported = fleet.cli("import", str(tampered))
    assert imported.returncode == 2
    assert expected in imported.stderr
    assert "nothing was imported" in imported.stderr
    assert not fleet.repo.exists() or fleet.git("for-each-ref") == ""
    assert not fleet.observations.exists()


def test_a_bundle_of_another_branch_is_named(published: Published, tmp_path: Path) -> None:
    members = members_of(published.archive)
    members["lineage.bundle"] = members_of(published.kid_archive)["lineage.bundle"]
    _resum(members, "lineage.bundle")
    result = Fleet(tmp_path).cli("verify", str(pack(members, tmp_path / "swapped.tgz")))
    assert result.returncode == 1
    assert "problem: lineage.bundle: holds refs/heads/lineage-pubkid at " in result.stderr


def _hostile(tmp_path: Path, add: Callable[[tarfile.TarFile], None]) -> Path:
    path = tmp_path / "hostile.tgz"
    with tarfile.open(path, "w:gz") as tar:
        add(tar)
    return path


def _file(name: str, data: bytes = b"{}") -> Callable[[tarfile.TarFile], None]:
    def add(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    return add


def _link(name: str, kind: bytes, target: str) -> Callable[[tarfile.TarFile], None]:
    def add(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo(name)
        info.type, info.linkname = kind, target
        tar.addfile(info)

    return add


def _twice(tar: tarfile.TarFile) -> None:
    _file("manifest.json")(tar)
    _file("manifest.json")(tar)


@pytest.mark.parametrize(
    ("add", "needle"),
    [
        (_file("../escape.json"), "member '../escape.json' is not a name an export writes"),
        (_file("/tmp/absolute.json"), "member '/tmp/absolute.json' is not a name"),
        (_file("generations/../../escape.json"), "is not a name an export writes"),
        (_link("generations/000001.json", tarfile.SYMTYPE, "/etc/passwd"), "not a regular file"),
        (_link("metadata.json", tarfile.LNKTYPE, "/etc/passwd"), "not a regular file"),
        (_link("runs", tarfile.DIRTYPE, ""), "not a regular file"),
        (_twice, "member 'manifest.json' appears twice"),
    ],
)
def test_a_hostile_archive_is_refused_before_use(
    tmp_path: Path, add: Callable[[tarfile.TarFile], None], needle: str
) -> None:
    archive = _hostile(tmp_path, add)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with pytest.raises(Refusal, match="refusing the archive") as refused:
        check(archive, scratch)
    assert needle in str(refused.value)
    # Whatever was written before the refusal stays in the members directory.
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p != archive]
    assert all(p.parent == scratch / "members" for p in written), written
    result = Fleet(tmp_path).cli("verify", str(archive))
    assert result.returncode == 2
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_an_oversized_extended_header_is_refused_before_it_is_read(tmp_path: Path) -> None:
    archive = tmp_path / "pax.tgz"
    with tarfile.open(
        archive, "w:gz", format=tarfile.PAX_FORMAT, pax_headers={"comment": "x" * 2**20}
    ) as tar:
        _file("manifest.json")(tar)
    result = Fleet(tmp_path).cli("verify", str(archive))
    assert result.returncode == 2
    assert "an extended header of 1048" in result.stderr and "over 65536" in result.stderr


def test_an_oversized_member_and_a_non_archive_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(archive_format, "MAX_JSON_BYTES", 100)
    big = _hostile(tmp_path, _file("generations/000001.json", b"x" * 101))
    (tmp_path / "scratch").mkdir()
    with pytest.raises(Refusal, match="has 101 bytes, over 100"):
        check(big, tmp_path / "scratch")
    garbage = tmp_path / "garbage.tgz"
    garbage.write_bytes(b"not an archive at all\n")
    result = Fleet(tmp_path).cli("verify", str(garbage))
    assert result.returncode == 2
    assert "is not a readable lineage archive" in result.stderr
    assert "Traceback" not in result.stderr


def test_export_refusals(published: Published, tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    import_fixture(fleet)
    fleet.ok("init", "busy")
    write_run(fleet, "busy", "active", 5)
    existing = tmp_path / "taken.tgz"
    existing.write_text("mine\n")
    cases = [
        (["absent"], "no lineage named absent"),
        (["sample"], "lineage sample was imported from a bundle and has no records to export"),
        (["busy"], "lineage busy has run "),
        (["busy", "--to", str(existing)], "taken.tgz exists; choose another --to FILE"),
    ]
    for args, needle in cases:
        result = fleet.cli("export", *args)
        assert result.returncode == 2, args
        assert needle in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    assert existing.read_text() == "mine\n"
    assert not list(tmp_path.glob("*.ouroboros.tar.gz"))


def test_a_fork_whose_parent_here_is_another_lineage_is_refused(
    published: Published, tmp_path: Path
) -> None:
    """The kid names parent pub at a commit; this fleet's own pub never had it."""
    namesake = Fleet(tmp_path)
    namesake.ok("init", "pub")
    before = refs_and_files(namesake)
    result = namesake.cli("import", str(published.kid_archive))
    assert result.returncode == 2
    assert "says it was forked from pub at commit" in result.stderr
    assert "this fleet's lineage pub has no such commit" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert refs_and_files(namesake) == before

    family = Fleet(tmp_path / "family")
    (tmp_path / "family").mkdir()
    family.ok("import", str(published.archive))
    family.ok("import", str(published.kid_archive))
    assert family.git("rev-parse", "lineage-pubkid") == published.fleet.git(
        "rev-parse", "lineage-pubkid"
    )


class _Zeros(io.RawIOBase):
    """Endless zero bytes: the body of a gzip bomb, never held in memory."""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray) -> int:  # type: ignore[override]
        buffer[:] = bytes(len(buffer))
        return len(buffer)


def _bomb(path: Path, size: int, listed_sum: str | None = None) -> Path:
    """An archive whose lineage.bundle is ``size`` zero bytes, behind a valid manifest
    that lists it with ``listed_sum`` (by default its true sum)."""
    if listed_sum is None:
        digest, zeros, left = hashlib.sha256(), bytes(1024**2), size
        while left:
            digest.update(zeros[: min(left, len(zeros))])
            left -= min(left, len(zeros))
        listed_sum = digest.hexdigest()
    manifest = archive_format.Manifest(
        lineage="bomb",
        head="a" * 40,
        generations=0,
        unobserved=[],
        exported_at=datetime(2026, 3, 1, tzinfo=UTC),
        exported_by="a test",
        files={"lineage.bundle": listed_sum},
    ).to_json()
    with tarfile.open(path, "w:gz", compresslevel=9) as tar:
        info = tarfile.TarInfo("manifest.json")
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))
        info = tarfile.TarInfo("lineage.bundle")
        info.size = size
        tar.addfile(info, _Zeros())
    return path


def _on_tmpfs(
    fleet: Fleet, scratch: Path, size: str, *command: str
) -> subprocess.CompletedProcess[str]:
    """``command`` with TMPDIR on a private tmpfs of ``size`` (a mount namespace of the
    test's own: nothing of the host is mounted or filled)."""
    scratch.mkdir()
    script = f'mount -t tmpfs -o size={size} ouroboros-test {scratch} && exec "$@"'
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *command],
        env={**fleet.env, "TMPDIR": str(scratch)},
        cwd=fleet.home,
        capture_output=True,
        text=True,
        timeout=300,
    )


# Reports what check() found, the bytes of members it wrote, and what the whole tmpfs
# holds (the members and check's empty scratch repository): nothing else writes there.
_MEASURE = """
import json, os, sys
from pathlib import Path
from scheduler.verify import check
scratch = Path(os.environ["TMPDIR"]) / "check"
scratch.mkdir()
checked = check(Path(sys.argv[1]), scratch)
members = scratch / "members"
written = sum(p.stat().st_size for p in members.rglob("*") if p.is_file())
vfs = os.statvfs(scratch)
used = (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize
print(json.dumps({"problems": checked.problems, "written": written, "used": used}))
"""


@pytest.mark.root
def test_a_gzip_bomb_is_refused_having_written_nothing(tmp_path: Path) -> None:
    """1 GiB of zeros in about a megabyte, its sum not the manifest's: every member is
    summed before any is written, so the bomb costs its reading, not the disk. On a
    16 MiB tmpfs, writing it would have been refused by the reserve instead."""
    bomb = _bomb(tmp_path / "bomb.tgz", 1024**3, listed_sum="0" * 64)
    assert bomb.stat().st_size < 2 * 1024**2
    fleet = Fleet(tmp_path)
    measured = _on_tmpfs(
        fleet, tmp_path / "scratch", "16m", sys.executable, "-c", _MEASURE, str(bomb)
    )
    assert measured.returncode == 0, measured.stderr
    found = json.loads(measured.stdout)
    assert found["written"] == 0
    assert found["used"] < 256 * 1024  # an empty git repository and directories
    assert [p for p in found["problems"] if p.startswith("sum: lineage.bundle has sha256 ")]
    for command, status in (("verify", 1), ("import", 2)):
        result = _on_tmpfs(
            fleet,
            tmp_path / f"scratch-{command}",
            "16m",
            sys.executable,
            "-m",
            "scheduler",
            command,
            str(bomb),
        )
        assert result.returncode == status, result.stderr
        assert "problem: sum: lineage.bundle has sha256 " in result.stderr
        assert "would leave less than" not in result.stderr
        assert "Traceback" not in result.stderr
    assert not fleet.repo.exists() or fleet.git("for-each-ref") == ""


@pytest.mark.root
def test_a_bomb_its_manifest_vouches_for_stops_at_the_reserve(tmp_path: Path) -> None:
    """512 MiB of zeros whose sum the manifest does list is written, and stops with 5%
    of a private 128 MiB tmpfs (at least 16 MiB) still free."""
    bomb = _bomb(tmp_path / "bomb.tgz", 512 * 1024**2)
    assert bomb.stat().st_size < 4 * 1024**2
    fleet = Fleet(tmp_path)
    result = _on_tmpfs(
        fleet, tmp_path / "scratch", "128m", sys.executable, "-m", "scheduler", "import", str(bomb)
    )
    assert result.returncode == 2, result.stderr
    reserve = archive_format.reserve_bytes(128 * 1024**2)
    assert f"unpacking member lineage.bundle would leave less than {reserve} bytes" in (
        result.stderr
    )
    assert "point TMPDIR at a larger filesystem" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not fleet.repo.exists() or fleet.git("for-each-ref") == ""


def test_the_reserve_is_five_percent_of_the_filesystem_however_large() -> None:
    """As docs/design.md states: 5% of the scratch filesystem, never less than 16 MiB,
    and not capped (a 1 TiB scratch disk keeps 51 GiB free)."""
    assert archive_format.reserve_bytes(1024**4) == int(1024**4 * 0.05)
    assert archive_format.reserve_bytes(100 * 1024**3) == 5 * 1024**3
    assert archive_format.reserve_bytes(64 * 1024**2) == 16 * 1024**2
