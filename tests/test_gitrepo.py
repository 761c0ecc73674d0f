"""The lineage cache's git: in-process objects, the compare-and-swap push, no auto-gc.

Real bare repositories throughout, read back with the git binary: the trees and
commits written in-process must be what git itself would write, a push must move the
shared branch only from the expected head, and a generation must spawn no git
process at all (traced with strace), least of all a gc or maintenance.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from pathlib import Path

import pytest
from support.fleet import SMALL_PHYSICS, Fleet, helper_name, seed_file

from worker.fleet.repo_admin import ensure_shared_repo
from worker.instrument.errors import Refusal
from worker.instrument.gitrepo import (
    Entry,
    LineageCache,
    branch_ref,
    run_git,
)

# Full tier: real git is the oracle.
pytestmark = pytest.mark.full


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


def test_caches_made_by_many_processes_at_once_are_one_whole_cache(
    shared: Path, tmp_path: Path
) -> None:
    """The pool children of two workers on one host made their replay cache at their
    first replay, at once: one failed on the other's config.lock (seen in the demo)."""
    path = tmp_path / "cache" / "replay" / "lineages.git"
    start = threading.Barrier(8)
    failures: list[BaseException] = []

    def make() -> None:
        start.wait()
        try:
            LineageCache(path, str(shared), writes_objects=False)
        except BaseException as exc:
            failures.append(exc)

    makers = [threading.Thread(target=make) for _ in range(8)]
    for maker in makers:
        maker.start()
    for maker in makers:
        maker.join(30)
    assert failures == []
    assert git(path, "config", "gc.auto") == "0"
    assert [p.name for p in path.parent.iterdir()] == ["lineages.git"]


def test_repositories_are_made_to_refuse_rewrites_and_deletions(
    shared: Path, tmp_path: Path
) -> None:
    cache = LineageCache(tmp_path / "cache", str(shared))
    for repo in (shared, cache.git_dir):
        for name in ("denyNonFastForwards", "denyDeletes"):
            assert git(repo, "config", "--type=bool", f"receive.{name}") == "true"
        # Left unset: git's fsck refuses trees the decoder records (deploy/README.md).
        assert run_git(repo, "config", "receive.fsckObjects", check=False).returncode != 0


# An ssh stand-in: git runs it as ``ssh [options] HOST COMMAND``; the command goes to
# git-shell, as the compose fleet's git-ssh account and the VM test's sshd force it.
_FAKE_SSH = '#!/bin/sh\nfor command; do :; done\nexec git-shell -c "$command"\n'


def test_the_ssh_push_moves_a_hardened_branch_only_forward(
    shared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fleet's push over ssh (``git push --force-with-lease`` of a fast-forward) lands
    on a repository made here; the receiving side refuses the one that is not, even
    with the right expected head."""
    fake_ssh = tmp_path / "fake-ssh"
    fake_ssh.write_text(_FAKE_SSH)
    fake_ssh.chmod(0o755)
    monkeypatch.setenv("GIT_SSH_COMMAND", str(fake_ssh))
    remote = LineageCache(tmp_path / "remote", f"ssh://fleet.invalid{shared}")
    assert remote.fetch("far") is None
    seed = seeded(remote, "far")
    first = child(remote, seed, b"(one)\n")
    assert remote.push_cas("far", first, seed)
    assert git(shared, "rev-parse", branch_ref("far")) == first
    # A stale expected head: refused by the lease, as before.
    assert not remote.push_cas("far", child(remote, seed, b"(late)\n"), seed)
    # The right expected head but a commit that does not descend from it (the in-process
    # push refuses it itself): the receiving side refuses it now.
    assert not remote.push_cas("far", child(remote, seed, b"(back)\n"), first)
    assert git(shared, "rev-parse", branch_ref("far")) == first
    fresh = LineageCache(tmp_path / "fresh", f"ssh://fleet.invalid{shared}")
    assert fresh.fetch("far") == first
    second = child(fresh, first, b"(two)\n")
    assert fresh.push_cas("far", second, first)
    assert git(shared, "rev-parse", branch_ref("far")) == second


def test_a_shared_repository_made_before_is_hardened_by_its_owner_only(tmp_path: Path) -> None:
    """A repository an earlier version made (gc settings only) gets the receive settings
    from the next command that ensures it, when this account owns it; another account's
    is left unwritten, with a warning saying what to run."""
    old = tmp_path / "old.git"
    subprocess.run(["git", "init", "--bare", "--quiet", str(old)], check=True)
    for name, value in (("gc.auto", "0"), ("maintenance.auto", "false")):
        git(old, "config", name, value)
    assert run_git(old, "config", "receive.denyDeletes", check=False).returncode != 0
    ensure_shared_repo(f"file://{old}")
    for name in ("denyNonFastForwards", "denyDeletes", "autogc"):
        expected = "false" if name == "autogc" else "true"
        assert git(old, "config", "--type=bool", f"receive.{name}") == expected
    # Nothing else changed, and set once: a second pass writes nothing.
    assert git(old, "config", "gc.auto") == "0"
    before = (old / "config").read_bytes()
    ensure_shared_repo(str(old))
    assert (old / "config").read_bytes() == before


def test_repack_hardens_a_repository_made_before(tmp_path: Path) -> None:
    """The daily repack, run by the repository's owner, brings an earlier version's
    shared repository up to date, and a push rewriting a lineage is refused after it."""
    fleet = Fleet(tmp_path)
    subprocess.run(["git", "init", "--bare", "--quiet", str(fleet.repo)], check=True)
    cache = LineageCache(tmp_path / "cache", str(fleet.repo))
    seed = seeded(cache, "old")
    head = child(cache, seed, b"(one)\n")
    assert cache.push_cas("old", head, seed)
    out = fleet.ok("repack").stdout
    assert f"{fleet.repo}: set " in out and "receive.denyNonFastForwards" in out
    assert git(fleet.repo, "config", "--type=bool", "receive.denyDeletes") == "true"
    forced = subprocess.run(
        ["git", f"--git-dir={cache.git_dir}", "push", "--force", str(fleet.repo),
         f"{seed}:{branch_ref('old')}"],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert forced.returncode != 0 and git(fleet.repo, "rev-parse", branch_ref("old")) == head
    assert f"{fleet.repo}: set " not in fleet.ok("repack").stdout


@pytest.mark.root
def test_another_accounts_repository_is_not_rewritten(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    theirs = tmp_path / "theirs.git"
    subprocess.run(["git", "init", "--bare", "--quiet", str(theirs)], check=True)
    os.chown(theirs / "config", 65534, 65534)
    before = (theirs / "config").read_bytes()
    with caplog.at_level(logging.WARNING):
        ensure_shared_repo(str(theirs))
    assert (theirs / "config").read_bytes() == before
    assert "receive.denyNonFastForwards=true" in caplog.text
    assert f"git --git-dir={theirs} config receive.denyDeletes true" in caplog.text


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
    spawned = {}
    for name, generations in (("once", 1), ("thrice", 3)):
        fleet.ok("init", name, "--seed", str(seed), *SMALL_PHYSICS)
        traced = fleet.traced("run", name, "--local", "--generations", str(generations))
        spawned[generations] = [helper_name(argv) for argv in traced]
        assert fleet.subjects(name)[0].startswith(f"gen {generations}: ")
    assert [name for name in spawned[3] if name.startswith("git")] == []
    # The start-up's probes (versions, the ceiling, the loader cache ctypes reads to find
    # libseccomp) and nothing per generation: three generations spawn what one does.
    assert sorted(spawned[3]) == sorted(spawned[1]), spawned
    assert len(spawned[3]) <= 6, spawned


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
