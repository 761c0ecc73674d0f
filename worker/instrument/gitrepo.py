"""Git for lineages: the worker's local cache and the shared bare repository.

Owns every git operation of the worker: creating its cache, incremental fetches of one
lineage branch into the local cache, reading blobs and trees, writing blobs, trees and
commits, and the compare-and-swap push. Objects are read and written in this process
through libgit2 (pygit2), so a generation spawns no git process: no hook, filter,
attribute, ``.gitignore`` or external diff helper of the lineage's content exists
there to influence what is recorded, and no automatic gc or maintenance runs after a
write (repacking is scheduled: deploy/README.md).

The shared repository is reached two ways:

* a local path (``/srv/lineages.git`` or ``file://...``) is opened in-process: the
  objects missing on the other side are copied, each after everything it refers to
  (so an object present implies all it reaches is present), and the push is a
  reference transaction on the shared repository: lock the branch, compare it with
  the expected head (absent for a new lineage), write the new head, unlock. A push
  whose expected head is stale, or whose lock another writer holds, fails. A lock
  file older than ``STALE_LOCK_SECONDS`` was left by a writer that died holding it
  and is removed (``break_stale_lock``), so a SIGKILL never stops a lineage for good;
  in the cache, a tracking ref's lock is broken after ``STALE_TRACKING_LOCK_SECONDS``.
* any other URL (ssh) with the git binary: ``git fetch`` of the one branch and
  ``git push --force-with-lease`` with an explicit expected value, verified again by
  the receiving side's ref transaction.

Either way a push moves the branch only from the expected head, and one that loses
a race is reported as lost (``push_cas`` returns False), never retried here; in
process, one that would not fast-forward from the expected head fails too. Over ssh
the shared repository's own configuration (``REPO_CONFIG``, written into every
repository made here and set in an existing one by ``worker.fleet.repo_admin``)
refuses a non-fast-forward and a deletion, whoever pushes: the fleet's own pushes are
all fast-forwards or creations.

Over 500 lines for that one job: ``LineageCache`` holds the cache and the shared
repository open together, and its reads, writes and the compare-and-swap push rest on
the same invariants (an object present implies all it reaches), which one module keeps
in one place. Administration (creating the shared repository, hardening an existing
one) is ``worker.fleet.repo_admin``'s.

Trusts: libgit2, the git binary and the configured remote. Treats every path and
byte of lineage content as data.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import NamedTuple, cast

import pygit2
from pygit2.enums import ObjectType, Option

from worker.instrument.errors import Refusal
from worker.instrument.names import BRANCH_PREFIX, generation_number
from worker.instrument.repo_urls import local_repository

# A writer holds a ref's lock file for the milliseconds of one compare-and-swap. One
# this old was left by a writer that died holding it (SIGKILL, a lost host), and git
# never removes it: every push after it would be a lost race and every generation
# discarded, for ever. So a lock this old is broken (``break_stale_lock``). The margin
# covers a writer stalled mid-swap and clocks of hosts sharing the repository over NFS.
STALE_LOCK_SECONDS = 600
# A tracking ref of a host's cache is written only by that host's processes, each
# holding its lock for the microseconds of one write. One this old was left by a process
# killed holding it (a pool child SIGKILLed mid-fetch): broken then, so the lineage goes
# on within seconds on this host instead of failing there for STALE_LOCK_SECONDS. At
# worst a breaker races a writer stalled this long, and the next fetch rewrites the ref.
STALE_TRACKING_LOCK_SECONDS = 10
# Beside the refs, never among them: git ignores a file of this name in a git directory.
_LOCK_BREAKING = "ouroboros-lock-breaking"
log = logging.getLogger(__name__)
IDENTITY = {
    "GIT_AUTHOR_NAME": "ouroboros",
    "GIT_AUTHOR_EMAIL": "ouroboros@localhost",
    "GIT_COMMITTER_NAME": "ouroboros",
    "GIT_COMMITTER_EMAIL": "ouroboros@localhost",
}
# Tree modes of a regular file: a symlink (120000), a gitlink or a tree is not one.
_REGULAR_MODES = frozenset({"100644", "100755"})
_SYMLINK_MODE = "120000"
_TREE_MODE = 0o40000
_GITLINK_MODE = 0o160000
# What a tmpfs charges against its size= limit, measured on Linux 6.x with shmem huge
# pages off (the default): a regular file its data rounded up to whole pages (2,048
# files of one byte fill an 8 MiB tmpfs, and so do 1,024 files of 4,097 bytes; one 8 MiB
# file fills it exactly), a symlink a page when its target is too long to keep in the
# inode (128 bytes or more), a directory nothing.
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
# Only what git and ssh need travels into git's environment: never a provider key.
_PASSED_ENV = ("PATH", "HOME", "SSH_AUTH_SOCK", "GIT_SSH_COMMAND", "TMPDIR")
_SAFE_CONFIG = (
    "core.hooksPath=/dev/null",
    "core.attributesFile=/dev/null",
    "core.excludesFile=/dev/null",
    "diff.external=",
    "core.autocrlf=false",
    # Objects and refs reach the disk before a spool entry says they exist.
    "core.fsync=committed",
    # Repacking is scheduled (deploy/README.md), never a side effect of a fetch or push.
    "gc.auto=0",
    "maintenance.auto=false",
)
# The same promise for what this process writes through libgit2.
pygit2.option(Option.ENABLE_FSYNC_GITDIR, True)
# Repositories are opened at paths from the settings, never discovered, and libgit2
# runs nothing a repository's config names; as ``git --git-dir`` does, a repository
# owned by another account (the operator's shell beside the ``ouroboros`` service) opens.
pygit2.option(Option.SET_OWNER_VALIDATION, False)
# Configuration of every repository made here (each cache, and the shared one that
# ``worker.fleet.repo_admin`` creates), and set again by that module in an existing one
# its owner opens to write.
REPO_CONFIG = {
    # No automatic gc anywhere, including a receive-pack that a plain ``git push`` of an
    # operator starts: repacking is scheduled (deploy/README.md, "Repacking").
    "gc.auto": "0",
    "maintenance.auto": "false",
    "receive.autogc": "false",
    # What arrives through receive-pack (the ssh path's forced git-shell, a ``git push``
    # to the path) may only move a branch forward, never delete one: a holder of the
    # push key (a compromised host, an operator's slip) cannot rewrite or remove the
    # records researchers read. The fleet never needs more: a generation's commit
    # descends from the head it expects, a new lineage is a creation, and import-bundle
    # creates its branch (and deletes its staging ref) with local git commands, which
    # receive-pack never sees.
    # Not ``receive.fsckObjects``: the decoder now refuses what git's fsck refuses, but a
    # lineage recorded before it did may hold such a name (a backslash before ".git", a
    # .gitattributes directory or long line), and every later tree of that lineage would
    # be refused on the hosts that push over ssh and recorded on the others.
    # deploy/README.md says when an operator may turn it on.
    "receive.denyNonFastForwards": "true",
    "receive.denyDeletes": "true",
}


class GitError(RuntimeError):
    """A git command failed for a reason other than a lost compare-and-swap."""


class Entry(NamedTuple):
    mode: str
    sha: str


class Body(NamedTuple):
    """A body of a lineage: its bytes, its blob, and a commit whose tree it lived in."""

    data: bytes
    sha: str
    lived_in: str


class Footprint(NamedTuple):
    """What a tree takes once unpacked into a life's /work.

    ``files`` and ``file_bytes`` are what the decoder counts against ``work_files`` and
    ``work_bytes``; ``room`` is what the tmpfs /work (size ``work_bytes``) is charged:
    every regular file rounded up to whole pages, and, as margin, a page for every
    symlink and every directory (tmpfs charges a page for a long symlink target only,
    nothing for a directory). So a tree within the decoder's limits can still not fit:
    many small files, or files the organism wrote sparse, which unpack dense.
    """

    files: int
    file_bytes: int
    room: int

    def fits(self, work_bytes: int, work_files: int) -> bool:
        """Whether the tree unpacks into /work and would pass the decoder unchanged."""
        return (
            self.files <= work_files and self.file_bytes <= work_bytes and self.room <= work_bytes
        )


def footprint(items: Iterable[tuple[str, str, int]]) -> Footprint:
    """The footprint of a tree given as (path, tree mode, blob size) triples.

    A gitlink or any mode but a regular file's or a symlink's is not unpacked at all.
    """
    files = file_bytes = pages = 0
    directories: set[str] = set()
    for path, mode, size in items:
        if mode in _REGULAR_MODES:
            files += 1
            file_bytes += size
            pages += -(-size // PAGE_BYTES)
        elif mode == _SYMLINK_MODE:
            files += 1
            pages += 1
        else:
            continue
        parts = path.split("/")[:-1]
        directories.update("/".join(parts[: n + 1]) for n in range(len(parts)))
    return Footprint(files, file_bytes, (pages + len(directories)) * PAGE_BYTES)


class Lineage(NamedTuple):
    """What the cache knows of a lineage at one head: its root and its generation count."""

    head: str
    root: str
    generations: int


def _generations(subjects: Iterable[str]) -> int:
    """Generations are counted by subject, never by position (hand commits exist)."""
    return sum(generation_number(subject) is not None for subject in subjects)


def branch_ref(lineage: str) -> str:
    return f"refs/heads/{BRANCH_PREFIX}{lineage}"


def git_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {name: os.environ[name] for name in _PASSED_ENV if name in os.environ}
    env.update({"LC_ALL": "C", "GIT_TERMINAL_PROMPT": "0", "GIT_CONFIG_NOSYSTEM": "1"})
    env.update(extra or {})
    return env


def run_git(
    git_dir: Path,
    *args: str,
    input: bytes | None = None,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[bytes]:
    config = [item for pair in _SAFE_CONFIG for item in ("-c", pair)]
    result = subprocess.run(
        ["git", *config, f"--git-dir={git_dir}", *args],
        input=input,
        capture_output=True,
        env=git_env(env),
    )
    if check and result.returncode != 0:
        raise GitError(
            f"git {args[0]} failed ({result.returncode}): "
            f"{result.stderr.decode(errors='replace').strip()[-500:]}"
        )
    return result


def init_bare(path: Path) -> None:
    """Make a bare repository at ``path`` with ``REPO_CONFIG``."""
    pygit2.init_repository(str(path), bare=True)
    config = pygit2.Config(str(path / "config"))
    for name, value in REPO_CONFIG.items():
        config[name] = value


def init_bare_once(path: Path) -> None:
    """Make the bare repository at ``path`` unless another process has: made aside and
    renamed into place, so processes that make it at once (two workers' pool children
    at their first replay) never meet each other's half-made one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        init_bare(staged)
        with contextlib.suppress(OSError):
            # An empty directory is replaced; another process's repository stays.
            staged.rename(path)
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def break_stale_lock(git_dir: Path, ref: str, stale_seconds: float = STALE_LOCK_SECONDS) -> bool:
    """Remove ``ref``'s lock file if it is older than ``stale_seconds``; whether the lock
    is gone (broken here, or released meanwhile), so the caller may try again.

    Breakers take an exclusive flock in turn, so two that judged one lock stale never
    remove it one after the other (the second would remove a fresh lock a live writer
    took in between). A writer never waits on that flock: only a lock file that exists
    keeps it out, and only a breaker removes one it did not take.
    """
    lock = git_dir / f"{ref}.lock"
    with (git_dir / _LOCK_BREAKING).open("a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            age = time.time() - lock.lstat().st_mtime
        except FileNotFoundError:
            return True
        if age < stale_seconds:
            return False
        lock.unlink()
    log.warning("removed %s: %d seconds old, left by a writer that died holding it", lock, age)
    return True


def _mode(value: int) -> str:
    return f"{value:06o}"


def _entry_at(tree: pygit2.Tree, path: str) -> Entry | None:
    """What ``path`` is in ``tree`` as a file (blob, symlink or gitlink); None otherwise."""
    try:
        found = tree[path]
    except KeyError:
        return None
    return None if found.filemode == _TREE_MODE else Entry(_mode(found.filemode), str(found.id))


def _tree_object(items: Iterable[tuple[bytes, int, pygit2.Oid]]) -> bytes:
    """A tree object's bytes: entries in git's order (a tree sorts as its name plus "/")."""
    ordered = sorted(items, key=lambda i: i[0] + b"/" if i[1] == _TREE_MODE else i[0])
    return b"".join(f"{mode:o} ".encode() + name + b"\0" + oid.raw for name, mode, oid in ordered)


def copy_objects(source: pygit2.Repository, target: pygit2.Repository, tip: str) -> int:
    """Copy every object reachable from ``tip`` that ``target`` lacks; how many were copied.

    Each object is written after everything it refers to, so a present object implies
    its whole closure is present and the walk stops there (a copy cut short by a crash
    leaves ``target`` consistent, and the next copy completes it). A gitlink names a
    commit of another repository and is not followed.
    """
    order: list[pygit2.Oid] = []
    seen: set[pygit2.Oid] = set()
    stack: list[tuple[pygit2.Oid, bool]] = [(pygit2.Oid(hex=tip), False)]
    while stack:
        oid, children_done = stack.pop()
        if children_done:
            order.append(oid)
            continue
        if oid in seen or target.odb.exists(oid):
            continue
        seen.add(oid)
        stack.append((oid, True))
        kind, _ = source.odb.read_header(oid)
        if kind == ObjectType.COMMIT:
            commit = source[oid].peel(pygit2.Commit)
            stack.extend((parent, False) for parent in commit.parent_ids)
            stack.append((commit.tree_id, False))
        elif kind == ObjectType.TREE:
            tree = source[oid].peel(pygit2.Tree)
            stack.extend((e.id, False) for e in tree if e.filemode != _GITLINK_MODE)
    for oid in order:
        target.odb.write(*source.odb.read(oid))
    return len(order)


class LineageCache:
    """The worker's local bare cache of the shared repository.

    ``writes_objects=False`` (replay's cache) hashes a judged tree's blobs without
    storing them anywhere: a replay is judged, never published, so nothing it lived may
    land in the shared repository or grow a host's disk, however often it is asked for.
    The blobs it hashed are kept in memory for the judgement's line counts only.
    """

    def __init__(self, cache_dir: Path, remote_url: str, writes_objects: bool = True) -> None:
        self.git_dir = cache_dir
        self.remote_url = remote_url
        self.writes_objects = writes_objects
        self._unwritten: dict[str, bytes] = {}
        self._known: dict[str, Lineage] = {}
        if not (cache_dir / "HEAD").exists():
            init_bare_once(cache_dir)
        self.repo = pygit2.Repository(str(cache_dir))
        self._shared_path = local_repository(remote_url)
        self._shared_repo: pygit2.Repository | None = None
        if self._shared_path is not None and (self._shared_path / "HEAD").exists():
            self._shared()

    def git(self, *args: str, **kwargs: object) -> subprocess.CompletedProcess[bytes]:
        return run_git(self.git_dir, *args, **kwargs)  # type: ignore[arg-type]

    def tracking_ref(self, lineage: str) -> str:
        return f"refs/remotes/shared/{BRANCH_PREFIX}{lineage}"

    def _shared(self) -> pygit2.Repository:
        """The local shared repository, opened once; a Refusal if it cannot be.

        Its objects are the cache's too: listed in the cache's ``objects/info/alternates``
        (so git itself, repacking the cache, sees them), and new objects are written
        straight into it (``_objects``), once, rather than into the cache and copied.
        """
        if self._shared_repo is None:
            try:
                self._shared_repo = pygit2.Repository(str(self._shared_path))
            except (pygit2.GitError, KeyError) as exc:
                raise self._unreadable(str(exc)) from None
            objects = str(Path(self._shared_repo.path).resolve() / "objects")
            if objects != str((self.git_dir / "objects").resolve()):
                alternates = self.git_dir / "objects" / "info" / "alternates"
                if not alternates.exists() or alternates.read_text().strip() != objects:
                    alternates.parent.mkdir(parents=True, exist_ok=True)
                    # A name of its own per writer: two threads of one process (not only
                    # two processes) may write it at once, and one's rename took the
                    # other's file (seen in a loaded run of the suite).
                    handle, name = tempfile.mkstemp(prefix="alternates.", dir=alternates.parent)
                    os.fchmod(handle, 0o644)  # as git writes it, not mkstemp's 0600
                    with os.fdopen(handle, "w") as staged:
                        staged.write(f"{objects}\n")
                    Path(name).replace(alternates)
                self.repo.odb.add_disk_alternate(objects)
        return self._shared_repo

    def _objects(self) -> pygit2.Repository:
        """Where new objects are written: a local shared repository that exists, else the
        cache (whose objects a push copies).

        An object written there before its push loses a race is merely unreachable:
        no ref names it and the scheduled gc prunes it (deploy/README.md, "Repacking").
        """
        local = self._shared_path
        if local is not None and (self._shared_repo is not None or (local / "HEAD").exists()):
            return self._shared()
        return self.repo

    def _unreadable(self, why: str) -> Refusal:
        return Refusal(
            f"cannot read the shared lineage repository {self.remote_url}: {why} "
            "(create a lineage with schedule-lineage init, or fix OUROBOROS_LINEAGE_REPO)"
        )

    def fetch(self, lineage: str) -> str | None:
        """Fetch one lineage branch (only new objects travel); its head, or None if absent."""
        ref = branch_ref(lineage)
        if self._shared_path is not None:
            found = self._shared().references.get(ref)
            if found is None:
                return None
            head = str(found.resolve().target)
            try:
                copy_objects(self._shared(), self.repo, head)
            except KeyError:
                # A foreign ref naming an object the repository lacks (pygit2's
                # NotFoundError is a KeyError): no lineage can be read from it.
                raise GitError(f"{ref} names {head}, which the shared repository lacks") from None
            self._track(lineage, head)
            return head
        refspec = f"+{ref}:{self.tracking_ref(lineage)}"
        for _ in self._tracking_attempts(lineage):
            result = self.git(
                "fetch", "--quiet", "--no-tags", self.remote_url, refspec, check=False
            )
            if result.returncode == 0:
                return self.rev(self.tracking_ref(lineage))
            if b"couldn't find remote ref" in result.stderr:
                return None
            if b"cannot lock ref" not in result.stderr:
                # Tells an unreadable repository (a Refusal) from a failed transfer.
                self.ls_remote(ref)
                raise GitError(
                    f"git fetch of {ref} failed: "
                    f"{result.stderr.decode(errors='replace').strip()[-500:]}"
                )
            # "cannot lock ref": a process of this host holds the tracking ref's lock (or
            # died holding it); try again.
        raise GitError(f"git fetch of {ref} kept losing its ref lock to other processes")

    def _tracking_attempts(self, lineage: str) -> Iterator[None]:
        """Attempts at writing ``lineage``'s tracking ref, for as long as its lock may still be
        a live writer's; before each retry a lock left by a dead one is broken."""
        ref = self.tracking_ref(lineage)
        deadline = time.monotonic() + 2 * STALE_TRACKING_LOCK_SECONDS
        attempt = 0
        while True:
            yield
            attempt += 1
            if time.monotonic() > deadline:
                return
            time.sleep(min(0.05 * attempt, 0.5))
            break_stale_lock(self.git_dir, ref, STALE_TRACKING_LOCK_SECONDS)

    def _track(self, lineage: str, head: str) -> None:
        """Point the tracking ref at ``head`` (it keeps the fetched objects reachable)."""
        ref = self.tracking_ref(lineage)
        for _ in self._tracking_attempts(lineage):
            try:
                self.repo.references.create(ref, head, force=True)
                return
            except (pygit2.GitError, OSError):
                # libgit2's "failed to lock" is an OSError: another process of this host
                # moves the same tracking ref meanwhile, or one died holding its lock.
                continue
        raise GitError(f"the tracking ref of {lineage} kept losing its lock to other processes")

    def ls_remote(self, *patterns: str) -> str:
        """The shared repository's matching refs; a Refusal if it cannot be read at all."""
        result = self.git("ls-remote", self.remote_url, *patterns, check=False)
        if result.returncode != 0:
            raise self._unreadable(result.stderr.decode(errors="replace").strip().splitlines()[0])
        return result.stdout.decode()

    def rev(self, name: str) -> str:
        """The commit ``name`` (a ref, an id, ``X~N``) names; "" if none."""
        try:
            return str(self.repo.revparse_single(name).peel(pygit2.Commit).id)
        except (KeyError, ValueError, pygit2.GitError, pygit2.InvalidSpecError):
            return ""

    def _commit_of(self, commit: str) -> pygit2.Commit:
        return self.repo[commit].peel(pygit2.Commit)

    def read_blob(self, commit: str, path: str) -> bytes | None:
        entry = _entry_at(self._commit_of(commit).tree, path)
        if entry is None or entry.mode == _mode(_GITLINK_MODE):
            return None
        return self.repo.odb.read(entry.sha)[1]

    def tree(self, commit: str) -> dict[str, Entry]:
        """Every file of a commit's tree, recursively: path -> (mode, sha)."""
        entries: dict[str, Entry] = {}
        pending = [("", self._commit_of(commit).tree)]
        while pending:
            prefix, tree = pending.pop()
            for item in tree:
                # A tree's entries always have a name (the stubs allow None for any object).
                path = prefix + cast(str, item.name)
                if item.filemode == _TREE_MODE:
                    pending.append((path + "/", self.repo[item.id].peel(pygit2.Tree)))
                else:
                    entries[path] = Entry(_mode(item.filemode), str(item.id))
        return entries

    def cat_blobs(self, shas: Iterable[str]) -> dict[str, bytes]:
        """Contents of many blobs (those hashed and not stored included)."""
        return {
            sha: self._unwritten[sha] if sha in self._unwritten else self.repo.odb.read(sha)[1]
            for sha in dict.fromkeys(shas)
        }

    def forget_unwritten(self) -> None:
        """Drop the blobs a judgement hashed without storing (see the class docstring)."""
        self._unwritten.clear()

    def blob_sizes(self, shas: Iterable[str]) -> dict[str, int]:
        """Sizes of the blobs that exist among ``shas``."""
        sizes: dict[str, int] = {}
        for sha in dict.fromkeys(shas):
            try:
                sizes[sha] = self.repo.odb.read_header(sha)[1]
            except KeyError:
                continue
        return sizes

    def footprint(self, entries: Mapping[str, Entry]) -> Footprint:
        """What these tree entries take once unpacked into /work (see ``Footprint``)."""
        sizes = self.blob_sizes(
            e.sha for e in entries.values() if e.mode in _REGULAR_MODES or e.mode == _SYMLINK_MODE
        )
        return footprint((path, e.mode, sizes.get(e.sha, 0)) for path, e in entries.items())

    def _first_parents(self, commit: str) -> Iterator[pygit2.Commit]:
        current: pygit2.Commit | None = self._commit_of(commit)
        while current is not None:
            yield current
            current = (
                self.repo[current.parent_ids[0]].peel(pygit2.Commit) if current.parent_ids else None
            )

    def root_of(self, commit: str) -> str:
        """The root commit ``commit`` descends from by first parents: the lineage's seed."""
        for found in self._first_parents(commit):
            last = found
        return str(last.id)

    def history(self, lineage: str, head: str) -> Lineage:
        """The root commit and the number of ``gen `` commits up to ``head``.

        Remembered per lineage and extended by the new commits only when ``head``
        descends from the last one seen, so the cost of a generation does not grow
        with the length of its history.
        """
        known = self._known.get(lineage)
        if known is not None and known.head == head:
            return known
        walker = self.repo.walk(head, pygit2.enums.SortMode.TOPOLOGICAL)
        if known is not None and self.is_ancestor(known.head, head):
            walker.hide(known.head)
            found = Lineage(
                head, known.root, known.generations + _generations(map(_subject, walker))
            )
        else:
            commits = list(walker)
            roots = [str(c.id) for c in commits if not c.parent_ids]
            found = Lineage(
                head, roots[-1] if roots else head, _generations(map(_subject, commits))
            )
        self._known[lineage] = found
        return found

    def is_ancestor(self, ancestor: str, descendant: str) -> bool:
        return ancestor == descendant or self.repo.descendant_of(descendant, ancestor)

    def last_body(self, commit: str, path: str, rollback_subject: str) -> Body | None:
        """The body ``path`` had before the last change to it that was not a rollback.

        Rollback commits (messages with a line matching ``rollback_subject``) are skipped
        so that a death after a rollback never restores the body that died before it.
        Only a regular file counts as a body: where ``path`` was a symlink, a directory or
        absent before that change (lineages recorded before the decoder refused such
        results), the change before it is asked, and so on back, so the answer is the
        last body that was a regular file. If no change has one, it is the seed body:
        ``path`` in the root commit. None only when not even the root holds ``path`` as a
        regular file, which no lineage made by ``schedule-lineage init`` lacks.

        ``lived_in`` is the commit whose tree the body last lived in before that change:
        the change's first parent (a life started from that tree and replaced the body),
        or the root for the seed body.
        """
        for (mode, sha), lived_in in self._replaced(commit, path, rollback_subject):
            if mode in _REGULAR_MODES:
                return Body(self.cat_blobs([sha])[sha], sha, lived_in)
        root = self.root_of(commit)
        seed = self.tree(root).get(path)
        if seed is None or seed.mode not in _REGULAR_MODES:
            return None
        return Body(self.cat_blobs([seed.sha])[seed.sha], seed.sha, root)

    def _replaced(
        self, commit: str, path: str, rollback_subject: str
    ) -> Iterator[tuple[Entry, str]]:
        """What ``path`` was before each change to it that is not a rollback, newest first,
        with the commit it was that in: the change's first parent.

        Follows first parents, as the lineage's bodies follow one another. The mode is
        ``000000`` where ``path`` was not a file (absent, or a directory).
        """
        rollback = re.compile(rollback_subject, re.MULTILINE)
        for change in self._first_parents(commit):
            if not change.parent_ids:
                return
            parent = self.repo[change.parent_ids[0]]
            before = _entry_at(parent.tree, path)
            if before == _entry_at(change.tree, path) or rollback.search(_message(change)):
                continue
            yield before or Entry("000000", "0" * 40), str(parent.id)

    def hash_bytes(self, data: bytes) -> str:
        if self.writes_objects:
            return str(self._objects().create_blob(data))
        sha = str(pygit2.hash(data))
        if sha not in self.repo:
            self._unwritten[sha] = data
        return sha

    def hash_files(self, paths: list[Path]) -> list[str]:
        """Write many files as blobs, in order."""
        return [self.hash_bytes(path.read_bytes()) for path in paths]

    def numstat(self, old_sha: str | None, new_sha: str | None) -> tuple[int, int]:
        """Lines added and deleted between two blobs (a missing side is empty; a binary
        blob counts no lines, as ``git diff --numstat`` has it)."""
        patch = pygit2.Patch.create_from(self._blob(old_sha), self._blob(new_sha))
        if patch.delta.is_binary:
            return 0, 0
        _, added, deleted = patch.line_stats
        return added, deleted

    def _blob(self, sha: str | None) -> pygit2.Blob | bytes | None:
        if sha is None:
            return None
        if sha in self._unwritten:
            return self._unwritten[sha]
        return self.repo[sha].peel(pygit2.Blob)

    def commit(self, parent: str | None, entries: Mapping[str, Entry], message: str) -> str:
        """Write a commit whose tree is exactly ``entries`` (no index, no work tree).

        Trees are written deepest first, without recursion: an imported lineage's paths
        are not bound by the decoder's depth limit.
        """
        root: dict[bytes, object] = {}
        folders: list[tuple[dict[bytes, object], dict[bytes, object], bytes]] = []
        for path, entry in entries.items():
            *names, name = path.encode("utf-8", errors="surrogateescape").split(b"/")
            node = root
            for folder in names:
                child = node.setdefault(folder, {})
                if not child:
                    folders.append((node, child, folder))  # type: ignore[arg-type]
                node = child  # type: ignore[assignment]
            node[name] = entry

        objects = self._objects()

        def write(node: dict[bytes, object]) -> pygit2.Oid:
            items = [
                (name, _TREE_MODE, child)
                if isinstance(child, pygit2.Oid)
                else (name, int(child.mode, 8), pygit2.Oid(hex=child.sha))  # type: ignore[attr-defined]
                for name, child in node.items()
            ]
            return objects.odb.write(ObjectType.TREE, _tree_object(items))

        # A folder is listed after the one holding it, so reversed order is children first.
        for holder, subtree, folder_name in reversed(folders):
            holder[folder_name] = write(subtree)
        signature = pygit2.Signature(IDENTITY["GIT_AUTHOR_NAME"], IDENTITY["GIT_AUTHOR_EMAIL"])
        parents = [pygit2.Oid(hex=parent)] if parent else []
        made = objects.create_commit(
            None, signature, signature, f"{message}\n", write(root), parents
        )
        return str(made)

    def push_cas(self, lineage: str, new: str, expected: str | None) -> bool:
        """Move the shared branch to ``new`` only if it is still at ``expected`` (None: absent)."""
        ref = branch_ref(lineage)
        if self._shared_path is not None:
            landed = self._swap(ref, new, expected)
        else:
            landed = self._push(ref, new, expected)
        if landed:
            self._track(lineage, new)
        return landed

    def _swap(self, ref: str, new: str, expected: str | None) -> bool:
        """The in-process push: objects first, then the branch under its lock.

        Only a fast-forward: ``new`` must descend from ``expected``, as every
        generation's commit does from its parent; a lineage's branch never moves back.
        """
        if expected is not None and not self.is_ancestor(expected, new):
            return False
        shared = self._shared()
        copy_objects(self.repo, shared, new)
        landed = self._transact(shared, ref, new, expected)
        if landed is None and break_stale_lock(Path(shared.path), ref):
            landed = self._transact(shared, ref, new, expected)
        return bool(landed)

    def _transact(
        self, shared: pygit2.Repository, ref: str, new: str, expected: str | None
    ) -> bool | None:
        """One reference transaction; None if the branch's lock is held."""
        try:
            with shared.transaction() as transaction:
                transaction.lock_ref(ref)
                current = shared.references.get(ref)
                if (str(current.resolve().target) if current else None) != expected:
                    raise _LostRace
                transaction.set_target(ref, new, message="push")
        except _LostRace:
            return False
        except pygit2.GitError as exc:
            if "lock" in str(exc):
                # Another writer holds the branch: as a receiving side's failed ref lock.
                return None
            raise GitError(f"push of {ref} failed: {exc}") from exc
        return True

    def _push(self, ref: str, new: str, expected: str | None) -> bool:
        result = self.git(
            "push",
            "--porcelain",
            "--quiet",
            f"--force-with-lease={ref}:{expected or ''}",
            self.remote_url,
            f"{new}:{ref}",
            check=False,
        )
        output = result.stdout.decode(errors="replace") + result.stderr.decode(errors="replace")
        if result.returncode == 0:
            return True
        if "[rejected]" in output or "[remote rejected]" in output or "stale info" in output:
            return False
        raise GitError(f"push of {ref} failed: {output.strip()[-500:]}")

    def adopt(self, other: LineageCache, tip: str) -> int:
        """Copy what ``tip`` (a tree or commit in ``other``'s cache) reaches and this cache
        lacks to where this cache writes objects: a fork's seed made in another home's
        repository than its parent's. How many objects were copied."""
        return copy_objects(other.repo, self._objects(), tip)

    def branch_contains(self, lineage: str, commit: str) -> bool:
        """Whether ``commit`` is on the shared branch (after a fresh fetch)."""
        head = self.fetch(lineage)
        return head is not None and self.is_ancestor(commit, head)


class _LostRace(Exception):
    """The shared branch is not at the expected head: the transaction is abandoned."""


def _message(commit: pygit2.Commit) -> str:
    return commit.raw_message.decode("utf-8", errors="replace")


def _subject(commit: pygit2.Commit) -> str:
    """The first line of the message, as far as a ``gen N:`` subject needs it."""
    return _message(commit).split("\n", 1)[0]
