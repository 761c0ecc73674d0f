"""The trusted git path attacked: dead lock holders, racing writers, hostile bundles.

A writer SIGKILLed while it holds a branch's lock (a real process, killed inside its
ref transaction) must not stop the lineage for good; a live writer's lock must still
refuse a push. Writers racing on one lineage from separate processes must neither
lose nor double a generation. A bundle imported with ``import-bundle`` goes through
git's object checks, with the path warnings (``.git``, ``..``, a name holding "/")
made errors, so no tree that git itself would not check out enters the shared
repository. Real bare repositories, real processes, the git binary to read back.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.fleet import SMALL_PHYSICS, Fleet, seed_file

from worker.fleet.repo_admin import ensure_shared_repo
from worker.instrument.gitrepo import (
    IDENTITY,
    STALE_LOCK_SECONDS,
    Entry,
    GitError,
    LineageCache,
    branch_ref,
    run_git,
)

# Full tier: real git is the oracle.
pytestmark = pytest.mark.full

# Holds the transaction's lock of one ref, says so, and waits to be killed.
_HOLDER = """
import sys, time, pygit2
repo = pygit2.Repository(sys.argv[1])
with repo.transaction() as transaction:
    transaction.lock_ref(sys.argv[2])
    print("locked", flush=True)
    time.sleep(600)
"""


def git(repo: Path, *args: str) -> str:
    return run_git(repo, *args).stdout.decode().strip()


def killed_holding(repo: Path, ref: str) -> Path:
    """The lock file a real writer left when SIGKILLed inside its ref transaction."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(repo), ref], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    lock = repo / f"{ref}.lock"
    assert lock.exists()
    return lock


def age(lock: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(lock, (then, then))


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    path = tmp_path / "shared.git"
    ensure_shared_repo(str(path))
    return path


def seeded(cache: LineageCache, lineage: str) -> str:
    commit = cache.commit(None, {"organism.el": Entry("100644", cache.hash_bytes(b"()"))}, "seed")
    assert cache.push_cas(lineage, commit, None)
    return commit


def generation(cache: LineageCache, parent: str, number: int, body: bytes) -> str:
    entries = {**cache.tree(parent), "organism.el": Entry("100644", cache.hash_bytes(body))}
    return cache.commit(parent, entries, f"gen {number}: changed")


def test_a_branch_lock_left_by_a_killed_writer_is_broken_once_stale(
    shared: Path, tmp_path: Path
) -> None:
    cache = LineageCache(tmp_path / "cache", str(shared))
    seed = seeded(cache, "orphan")
    lock = killed_holding(shared, branch_ref("orphan"))
    first = generation(cache, seed, 1, b"(one)")
    # Young, it may be a live writer's: the push is a lost race and the lock stays.
    assert not cache.push_cas("orphan", first, seed)
    assert lock.exists()
    assert git(shared, "rev-parse", branch_ref("orphan")) == seed

    age(lock, STALE_LOCK_SECONDS + 60)
    assert cache.push_cas("orphan", first, seed)
    assert not lock.exists()
    assert git(shared, "rev-parse", branch_ref("orphan")) == first
    # Breaking a lock never bypasses the compare-and-swap.
    age(killed_holding(shared, branch_ref("orphan")), STALE_LOCK_SECONDS + 60)
    assert not cache.push_cas("orphan", generation(cache, seed, 1, b"(late)"), seed)
    assert git(shared, "rev-parse", branch_ref("orphan")) == first
    run_git(shared, "fsck", "--strict", "--no-dangling")


def test_a_tracking_lock_in_the_cache_is_retried_and_broken_once_stale(
    shared: Path, tmp_path: Path
) -> None:
    writer = LineageCache(tmp_path / "writer", str(shared))
    seed = seeded(writer, "tracked")
    reader = LineageCache(tmp_path / "reader", str(shared))
    lock = killed_holding(reader.git_dir, reader.tracking_ref("tracked"))
    # Only this host's processes write it, each for microseconds: a lock that stays
    # STALE_TRACKING_LOCK_SECONDS is a dead writer's (a pool child killed mid-fetch), and
    # the fetch waits it out and goes on, instead of failing for STALE_LOCK_SECONDS.
    assert reader.fetch("tracked") == seed
    assert not lock.exists()
    # One that a live writer keeps renewing is contention: retried, then one GitError
    # (not libgit2's OSError escaping the retries).
    lock = killed_holding(reader.git_dir, reader.tracking_ref("tracked"))
    renewing = threading.Event()

    def renew() -> None:
        while not renewing.wait(1):
            lock.touch()

    keeper = threading.Thread(target=renew)
    keeper.start()
    try:
        with pytest.raises(GitError, match="kept losing its lock"):
            reader.fetch("tracked")
    finally:
        renewing.set()
        keeper.join()


def _racer(shared: str, cache: str, lineage: str, tries: int, tag: str) -> int:
    """Generations this writer landed, each built on the head it fetched."""
    writer = LineageCache(Path(cache), shared)
    landed = 0
    for attempt in range(tries):
        head = writer.fetch(lineage)
        assert head is not None
        number = writer.history(lineage, head).generations + 1
        made = generation(writer, head, number, f"({tag} {attempt})".encode())
        landed += writer.push_cas(lineage, made, head)
    return landed


def test_racing_writers_never_lose_or_double_a_generation(shared: Path, tmp_path: Path) -> None:
    seeded(LineageCache(tmp_path / "seeder", str(shared)), "raced")
    tries = 40
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        landed = pool.starmap(
            _racer,
            [(str(shared), str(tmp_path / f"w{n}"), "raced", tries, f"w{n}") for n in range(3)],
        )
    subjects = git(shared, "log", "--first-parent", "--format=%s", branch_ref("raced")).split("\n")
    numbered = [s.split(":")[0] for s in reversed(subjects[:-1])]
    # Every landed push is exactly one generation, numbered in order, with no gap.
    assert numbered == [f"gen {n}" for n in range(1, sum(landed) + 1)]
    # A writer can lose to one that itself lost (both held the lock in turn), so how
    # many land depends on timing; that some do, and each exactly once, does not.
    assert sum(landed) > 0
    run_git(shared, "fsck", "--strict", "--no-dangling")
    assert git(shared, "for-each-ref", "--format=%(refname)") == branch_ref("raced")


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
def test_a_lineage_goes_on_after_a_writer_died_holding_its_branch(tmp_path: Path) -> None:
    """End to end: ``run --local`` after a real SIGKILL inside the ref transaction."""
    fleet = Fleet(tmp_path)
    seed = seed_file(tmp_path, '(with-temp-file "/work/state.el" (insert "1"))\n')
    fleet.ok("init", "phoenix", "--seed", str(seed), *SMALL_PHYSICS)
    fleet.ok("init", "other", *SMALL_PHYSICS)
    age(killed_holding(fleet.repo, branch_ref("phoenix")), STALE_LOCK_SECONDS + 60)
    fleet.ok("run", "phoenix", "--generations", "1", "--local")
    assert fleet.subjects("phoenix")[0].startswith("gen 1:")
    assert fleet.observation_numbers("phoenix") == [1]
    refs = git(fleet.repo, "for-each-ref", "--format=%(refname)").split("\n")
    assert sorted(refs) == [branch_ref("other"), branch_ref("phoenix")]


def _tree(repo: Path, entries: list[tuple[bytes, str, str]]) -> str:
    """A tree object written as given, names and modes unchecked (as a hostile one is)."""
    ordered = sorted(entries, key=lambda e: e[0] + (b"/" if e[1] == "40000" else b""))
    data = b"".join(
        f"{mode} ".encode() + name + b"\0" + bytes.fromhex(sha) for name, mode, sha in ordered
    )
    return (
        run_git(repo, "hash-object", "-w", "-t", "tree", "--literally", "--stdin", input=data)
        .stdout.decode()
        .strip()
    )


def _hostile_bundle(directory: Path, make: str) -> Path:
    """A complete one-branch bundle whose seed holds organism.el and the hostile ``make``."""
    repo = directory / "forge.git"
    run_git(repo, "init", "--bare", "--quiet")
    blob = run_git(repo, "hash-object", "-w", "--stdin", input=b"(x)\n").stdout.decode().strip()
    sub = _tree(repo, [(b"config", "100644", blob)])
    extra = {
        "dot-git": [(b".git", "40000", sub)],
        "ntfs-dot-git": [(b"GIT~1", "40000", sub)],
        "dot-dot": [(b"..", "40000", sub)],
        "slash-in-name": [(b"a/../../escape", "100644", blob)],
        "gitmodules-symlink": [(b".gitmodules", "120000", blob)],
        "zero-padded-mode": [(b"z", "0100644", blob)],
        "missing-blob": [(b"ghost", "100644", "0123456789" * 4)],
    }
    tree = _tree(repo, [(b"organism.el", "100644", blob), *extra.get(make, [])])
    if make == "no-author":
        body = f"tree {tree}\ncommitter x <x@y> 0 +0000\n\nseed\n".encode()
        commit = run_git(
            repo, "hash-object", "-w", "-t", "commit", "--literally", "--stdin", input=body
        )
        head = commit.stdout.decode().strip()
    else:
        head = (
            run_git(repo, "commit-tree", tree, "-m", "seed", env=IDENTITY).stdout.decode().strip()
        )
    run_git(repo, "update-ref", "refs/heads/hostile", head)
    bundle = directory / f"{make}.bundle"
    if make == "missing-blob":
        # git bundle create walks the objects and would not write one; the pack is
        # built by hand from the objects that exist, under a valid bundle header.
        objects = run_git(repo, "rev-list", "--objects", "--missing=print", head).stdout.decode()
        present = "\n".join(
            line.split()[0] for line in objects.splitlines() if not line.startswith("?")
        )
        pack = run_git(repo, "pack-objects", "--stdout", input=present.encode() + b"\n").stdout
        bundle.write_bytes(f"# v2 git bundle\n{head} refs/heads/hostile\n\n".encode() + pack)
    else:
        run_git(repo, "bundle", "create", str(bundle), "refs/heads/hostile")
    return bundle


HOSTILE_BUNDLES = {
    "dot-git": "hasDotgit",
    "ntfs-dot-git": "hasDotgit",
    "dot-dot": "hasDotdot",
    "slash-in-name": "fullPathname",
    "gitmodules-symlink": "gitmodulesSymlink",
    "zero-padded-mode": "zeroPaddedFilemode",
    "no-author": "missingAuthor",
    "missing-blob": "did not send all necessary objects",
}


@pytest.mark.parametrize("make", sorted(HOSTILE_BUNDLES))
def test_import_bundle_refuses_objects_git_refuses_and_writes_nothing(
    tmp_path: Path, make: str
) -> None:
    fleet = Fleet(tmp_path)
    fleet.ok("init", "kept", *SMALL_PHYSICS)
    before = sorted(p.relative_to(fleet.repo) for p in fleet.repo.rglob("*") if p.is_file())
    refused = fleet.cli("import-bundle", str(_hostile_bundle(tmp_path, make)), "evil")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert HOSTILE_BUNDLES[make] in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    after = sorted(p.relative_to(fleet.repo) for p in fleet.repo.rglob("*") if p.is_file())
    assert after == before
    run_git(fleet.repo, "fsck", "--strict", "--no-dangling")


def test_import_bundle_takes_a_clean_bundle_and_fsck_stays_strict(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.ok("import-bundle", str(_hostile_bundle(tmp_path, "clean")), "clean")
    run_git(fleet.repo, "fsck", "--strict", "--no-dangling")
    assert git(fleet.repo, "for-each-ref", "--format=%(refname)") == branch_ref("clean")


# Files named as git's own, symlinks up and out, a setuid bit: all data to the worker.
_GIT_LOOKALIKES = """
(make-directory "/work/refs/heads" t)
(with-temp-file "/work/refs/heads/lineage-evil" (insert (make-string 40 ?0) "\\n"))
(with-temp-file "/work/HEAD" (insert "ref: refs/heads/lineage-evil\\n"))
(make-directory "/work/objects/info" t)
(with-temp-file "/work/objects/info/alternates" (insert "/etc\\n"))
(with-temp-file "/work/-rf --force" (insert "x"))
(with-temp-file "/work/caf\\u00e9.el" (insert "x"))
(with-temp-file "/work/setuid" (insert "x"))
(set-file-modes "/work/setuid" #o4755)
(unless (file-symlink-p "/work/up") (make-symbolic-link "../../.." "/work/up"))
(unless (file-symlink-p "/work/refs-link") (make-symbolic-link "/work/refs" "/work/refs-link"))
"""


def outside_objects(repo: Path) -> list[Path]:
    """Every path of a bare repository but its objects."""
    return sorted(p for p in repo.rglob("*") if p.relative_to(repo).parts[0] != "objects")


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
def test_an_organism_naming_files_as_git_does_changes_only_its_branch(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    seed = seed_file(tmp_path, _GIT_LOOKALIKES)
    fleet.ok("init", "mimic", "--seed", str(seed), *SMALL_PHYSICS)
    layout = outside_objects(fleet.repo)
    fleet.ok("run", "mimic", "--generations", "2", "--local")
    assert fleet.subjects("mimic")[-2] == "gen 1: changed (organism unchanged; 8 other paths)"
    listing = dict(
        (line.split("\t")[1], line.split()[0])
        for line in fleet.git("ls-tree", "-r", "lineage-mimic").splitlines()
    )
    assert listing["refs/heads/lineage-evil"] == listing["HEAD"] == "100644"
    assert listing["objects/info/alternates"] == "100644"
    assert listing["setuid"] == "100755"
    assert listing["up"] == listing["refs-link"] == "120000"
    run_git(fleet.repo, "fsck", "--strict", "--no-dangling")
    assert git(fleet.repo, "for-each-ref", "--format=%(refname)") == branch_ref("mimic")
    # Nothing but objects was added to the shared repository: no ref, no alternates.
    assert outside_objects(fleet.repo) == layout
    assert not (fleet.repo / "objects" / "info" / "alternates").exists()


def test_a_tree_deeper_than_the_recursion_limit_is_written_as_git_writes_it(
    shared: Path, tmp_path: Path
) -> None:
    """An imported lineage's paths are not bound by the decoder's depth limit."""
    cache = LineageCache(tmp_path / "cache", str(shared))
    blob = cache.hash_bytes(b"deep\n")
    deep = "/".join(["d"] * (sys.getrecursionlimit() + 500)) + "/leaf"
    entries = {
        deep: Entry("100644", blob),
        "d/side": Entry("100755", blob),
        "organism.el": Entry("100644", blob),
    }
    commit = cache.commit(None, entries, "seed")
    assert cache.tree(commit) == entries
    listing = b"".join(f"{e.mode} {e.sha}\t{p}\0".encode() for p, e in entries.items())
    env = {"GIT_INDEX_FILE": str(tmp_path / "index")}
    run_git(cache.git_dir, "update-index", "-z", "--index-info", input=listing, env=env)
    expected = run_git(cache.git_dir, "write-tree", env=env).stdout.decode().strip()
    assert git(cache.git_dir, "rev-parse", f"{commit}^{{tree}}") == expected


def test_a_generation_commit_is_byte_for_byte_what_git_commit_tree_writes(
    shared: Path, tmp_path: Path
) -> None:
    """Same tree, parent, identity, dates and message: the same commit id as git's."""
    cache = LineageCache(tmp_path / "cache", str(shared))
    seed = seeded(cache, "twin")
    message = "gen 1: changed \u2014 caf\u00e9\r\n\n  indented\t\n\n\n[x](javascript:0)"
    entries = {**cache.tree(seed), "organism.el": Entry("100755", cache.hash_bytes(b"(y)"))}
    made = cache.commit(seed, entries, message)
    ours = cache.repo[made]
    hours, minutes = divmod(abs(ours.author.offset), 60)
    sign = "+" if ours.author.offset >= 0 else "-"
    date = f"@{ours.author.time} {sign}{hours:02d}{minutes:02d}"
    env = {**IDENTITY, "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}
    theirs = run_git(
        cache.git_dir,
        "commit-tree",
        str(ours.tree_id),
        "-p",
        seed,
        input=f"{message}\n".encode(),
        env=env,
    )
    assert theirs.stdout.decode().strip() == made


# --- a holder of the push key, through receive-pack ------------------------------------


def attacker(tmp_path: Path, shared: Path, lineage: str) -> tuple[LineageCache, str, str]:
    """A host's cache holding ``lineage`` at two generations, pushed; the seed and head."""
    cache = LineageCache(tmp_path / "attacker", str(shared))
    seed = seeded(cache, lineage)
    head = generation(cache, seed, 1, b"(kept)")
    assert cache.push_cas(lineage, head, seed)
    return cache, seed, head


def push(source: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A plain ``git push`` from ``source``, as an operator or an intruder types it."""
    return subprocess.run(
        ["git", f"--git-dir={source}", "push", *args], capture_output=True, text=True
    )


@pytest.mark.parametrize("scheme", ["", "file://"], ids=["path", "file-url"])
def test_a_forced_rewrite_or_a_delete_of_a_lineage_is_refused_by_the_repository(
    shared: Path, tmp_path: Path, scheme: str
) -> None:
    cache, seed, head = attacker(tmp_path, shared, "trusted")
    ref = branch_ref("trusted")
    url = f"{scheme}{shared}"
    # Another history of the lineage: generation 1 replaced, so not a fast-forward.
    rewritten = generation(cache, seed, 1, b"(forged)")
    forced = push(cache.git_dir, "--force", url, f"{rewritten}:{ref}")
    assert forced.returncode != 0 and "non-fast-forward" in forced.stderr, forced.stderr
    # Back to the seed: history cut, also not a fast-forward.
    assert push(cache.git_dir, "--force", url, f"{seed}:{ref}").returncode != 0
    for deletion in (["--delete", url, ref], [url, f":{ref}"]):
        deleted = push(cache.git_dir, *deletion)
        assert deleted.returncode != 0 and "deletion prohibited" in deleted.stderr
    assert git(shared, "rev-parse", ref) == head
    # What the fleet pushes still lands: a fast-forward, and a new branch.
    assert push(cache.git_dir, url, f"{generation(cache, head, 2, b'(two)')}:{ref}").returncode == 0
    assert push(cache.git_dir, url, f"{seed}:{branch_ref('copy')}").returncode == 0
    # A restore from a backup bundle into a fresh repository made here is a fetch, not
    # a receive: nothing of the hardening stands in its way.
    bundle = tmp_path / "backup.bundle"
    run_git(shared, "bundle", "create", "--quiet", str(bundle), "--all")
    restored = tmp_path / "restored.git"
    ensure_shared_repo(str(restored))
    run_git(restored, "fetch", "--quiet", str(bundle), "refs/*:refs/*")
    assert git(restored, "for-each-ref") == git(shared, "for-each-ref")
    run_git(restored, "fsck", "--strict", "--no-dangling")
