"""The lineage cache's git: in-process objects, the compare-and-swap push, no auto-gc.

Real bare repositories throughout, read back with the git binary: the trees and
commits written in-process must be what git itself would write, a push must move the
shared branch only from the expected head, and a generation must spawn no git
process at all (traced with strace), least of all a gc or maintenance.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from lineage_support import SMALL_PHYSICS, Fleet, helper_name, seed_file

from worker.instrument.errors import Refusal
from worker.instrument.gitrepo import (
    Entry,
    LineageCache,
    branch_ref,
    ensure_shared_repo,
    run_git,
)


def git(repo: Path, *args: str, input: bytes | None = None) -> str:
    return run_git(repo, *args, input=input).stdout.decode().strip()


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    path = tmp_path / "shared.git"
    ensure_shared_repo(str(path))
    return path


def seeded(cache: LineageCache, lineage: str, body: bytes = b"(seed)\n") -> str:
    """A seed commit pushed as a new lineage; its id."""
    commit = cache.commit(None, {"organism.el": Entry("100644", cache.hash_bytes(body))}, "seed")
    assert cache.push_cas(lineage, commit, None)
    return commit


def child(cache: LineageCache, parent: str, body: bytes) -> str:
    entries = {**cache.tree(parent), "organism.el": Entry("100644", cache.hash_bytes(body))}
    return cache.commit(parent, entries, "gen 1: changed")


def test_a_push_that_lost_the_race_is_refused_and_the_winner_stays(
    shared: Path, tmp_path: Path
) -> None:
    one = LineageCache(tmp_path / "one", str(shared))
    two = LineageCache(tmp_path / "two", f"file://{shared}")
    seed = seeded(one, "race")
    assert two.fetch("race") == seed
    winner, loser = child(one, seed, b"(one)\n"), child(two, seed, b"(two)\n")

    assert one.push_cas("race", winner, seed)
    assert not two.push_cas("race", loser, seed)
    assert git(shared, "rev-parse", branch_ref("race")) == winner
    assert two.fetch("race") == winner
    assert not two.branch_contains("race", loser)
    # A creation is a compare-and-swap against "absent": refused once the branch exists.
    assert not two.push_cas("race", loser, None)
    # Not a fast-forward: refused even with the right expected head, the branch kept.
    assert not two.push_cas("race", seed, winner)
    assert not two.push_cas("race", loser, winner)
    assert git(shared, "rev-parse", branch_ref("race")) == winner


def test_a_push_while_another_writer_holds_the_branch_is_refused(
    shared: Path, tmp_path: Path
) -> None:
    cache = LineageCache(tmp_path / "cache", str(shared))
    seed = seeded(cache, "locked")
    nxt = child(cache, seed, b"(next)\n")
    lock = shared / "refs" / "heads" / "lineage-locked.lock"
    lock.write_text(f"{seed}\n")
    assert not cache.push_cas("locked", nxt, seed)
    assert git(shared, "rev-parse", branch_ref("locked")) == seed
    lock.unlink()
    assert cache.push_cas("locked", nxt, seed)
    assert git(shared, "rev-parse", branch_ref("locked")) == nxt


def test_pushed_history_is_complete_in_the_shared_repository(shared: Path, tmp_path: Path) -> None:
    cache = LineageCache(tmp_path / "cache", str(shared))
    head = seeded(cache, "deep")
    for n in range(5):
        entries = {
            **cache.tree(head),
            f"lib/{n}/part.el": Entry("100644", cache.hash_bytes(f"({n})\n".encode())),
        }
        nxt = cache.commit(head, entries, f"gen {n + 1}: changed")
        assert cache.push_cas("deep", nxt, head)
        head = nxt
    # git checks every object reachable from every ref, and each one's format.
    subprocess.run(["git", f"--git-dir={shared}", "fsck", "--strict", "--no-dangling"], check=True)
    fresh = LineageCache(tmp_path / "fresh", str(shared))
    assert fresh.fetch("deep") == head
    assert fresh.tree(head) == cache.tree(head)
    assert fresh.history("deep", head).generations == 5
    subprocess.run(["git", f"--git-dir={fresh.git_dir}", "fsck", "--strict"], check=True)


def test_trees_are_byte_for_byte_what_git_writes(shared: Path, tmp_path: Path) -> None:
    """Git's entry order (a tree sorts as its name plus "/"), modes, nesting, and names
    that are not UTF-8 (kept as surrogate escapes) all round-trip."""
    cache = LineageCache(tmp_path / "cache", str(shared))
    blob = cache.hash_bytes(b"x\n")
    link = cache.hash_bytes(b"target")
    odd = b"caf\xe9.el".decode("utf-8", errors="surrogateescape")
    entries = {
        "a": Entry("100644", blob),
        "a.b": Entry("100755", blob),
        "a-b/c": Entry("100644", blob),
        "a/b": Entry("100644", blob),
        "a0": Entry("120000", link),
        "ab/deep/er/file": Entry("100644", blob),
        "b": Entry("160000", "1" * 40),
        odd: Entry("100644", blob),
    }
    # "a" cannot be a file and a directory at once.
    del entries["a"]
    commit = cache.commit(None, entries, "seed")
    index = tmp_path / "index"
    listing = b"".join(
        f"{e.mode} {e.sha}\t".encode() + p.encode("utf-8", errors="surrogateescape") + b"\0"
        for p, e in entries.items()
    )
    env = {"GIT_INDEX_FILE": str(index)}
    run_git(cache.git_dir, "update-index", "-z", "--index-info", input=listing, env=env)
    expected = run_git(cache.git_dir, "write-tree", env=env).stdout.decode().strip()
    assert git(cache.git_dir, "rev-parse", f"{commit}^{{tree}}") == expected
    assert cache.tree(commit) == entries
    assert git(cache.git_dir, "log", "--format=%an <%ae>|%s", commit) == (
        "ouroboros <ouroboros@localhost>|seed"
    )


def test_repositories_are_made_without_automatic_gc(shared: Path, tmp_path: Path) -> None:
    cache = LineageCache(tmp_path / "cache", str(shared))
    for repo in (shared, cache.git_dir):
        assert git(repo, "config", "gc.auto") == "0"
        assert git(repo, "config", "maintenance.auto") == "false"
        assert git(repo, "config", "receive.autogc") == "false"


def test_a_remote_url_is_not_mistaken_for_a_local_path(tmp_path: Path) -> None:
    """``host:path`` is git's ssh syntax: it goes to the git binary, which cannot reach it."""
    cache = LineageCache(tmp_path / "cache", "nosuchhost.invalid:lineages.git")
    with pytest.raises(Refusal, match=r"nosuchhost\.invalid"):
        cache.fetch("any")
    assert not (tmp_path / "nosuchhost.invalid:lineages.git").exists()


@pytest.mark.root
@pytest.mark.bwrap
@pytest.mark.cgroups
def test_generations_spawn_no_git_process(tmp_path: Path) -> None:
    """Not a git fetch, push, gc nor maintenance: a local shared repository is written
    in-process, and nothing repacks it behind a generation's back."""
    fleet = Fleet(tmp_path)
    seed = seed_file(tmp_path, '(with-temp-file "/work/n" (insert "1"))\n', "n.el")
    fleet.ok("init", "quiet", "--seed", str(seed), *SMALL_PHYSICS)
    spawned = [
        helper_name(argv) for argv in fleet.traced("run", "quiet", "--local", "--generations", "3")
    ]
    assert fleet.subjects("quiet")[0].startswith("gen 3: ")
    assert [name for name in spawned if name.startswith("git")] == []
    # The pipeline's start-up probes (versions, the ceiling) and nothing per generation.
    assert len(spawned) <= 4, spawned


@pytest.mark.root
@pytest.mark.bwrap
@pytest.mark.cgroups
def test_repack_packs_what_generations_left_loose(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.ok("init", "packed", *SMALL_PHYSICS)
    fleet.ok("run", "packed", "--local", "--generations", "2")
    cache = tmp_path / ".ouroboros" / "state" / "cache" / "worker" / "lineages.git"

    def loose(repo: Path) -> int:
        return int(git(repo, "count-objects", "-v").splitlines()[0].split(": ")[1])

    # A local shared repository holds the objects; the cache borrows them.
    assert loose(fleet.repo) > 0
    assert (cache / "objects" / "info" / "alternates").read_text().strip() == str(
        (fleet.repo / "objects").resolve()
    )
    out = fleet.ok("repack").stdout
    assert str(fleet.repo) in out and str(cache) in out
    assert loose(fleet.repo) == 0 and loose(cache) == 0
    subprocess.run(["git", f"--git-dir={fleet.repo}", "fsck", "--strict"], check=True)
    # Generations go on from packed objects.
    fleet.ok("run", "packed", "--local", "--generations", "1")
    assert fleet.subjects("packed")[0].startswith("gen 3: ")


@pytest.mark.root
def test_a_shared_repository_of_another_account_opens_as_with_git(
    shared: Path, tmp_path: Path
) -> None:
    """The operator's shell beside the ``ouroboros`` service: ownership is not checked
    for a repository named by the settings (it is never discovered)."""
    seed = seeded(LineageCache(tmp_path / "first", str(shared)), "owned")
    subprocess.run(["chown", "-R", "54321:54321", str(shared)], check=True)
    cache = LineageCache(tmp_path / "operator", str(shared))
    assert cache.fetch("owned") == seed
    assert cache.push_cas("owned", child(cache, seed, b"(next)\n"), seed)
