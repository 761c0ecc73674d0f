"""Git plumbing for lineages: the worker's local cache and the shared bare repository.

Owns every git command the worker runs: creating the shared bare repository,
incremental fetches of one lineage branch into the local cache, reading blobs and
trees, writing blobs and commits without a work tree, and the compare-and-swap push
(``--force-with-lease`` with an explicit expected value, verified again by the
receiving side's ref transaction). Commits are built with a private index from
(mode, blob) pairs, so no ``.gitignore``, ``.gitattributes``, filter, hook or
external diff helper of the lineage's content can influence what is recorded.

Trusts: the git binary and the configured remote. Treats every path and byte of
lineage content as data.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

from worker.instrument.errors import Refusal
from worker.instrument.names import BRANCH_PREFIX, generation_number

FETCH_ATTEMPTS = 5
IDENTITY = {
    "GIT_AUTHOR_NAME": "ouroboros",
    "GIT_AUTHOR_EMAIL": "ouroboros@localhost",
    "GIT_COMMITTER_NAME": "ouroboros",
    "GIT_COMMITTER_EMAIL": "ouroboros@localhost",
}
# Tree modes of a regular file: a symlink (120000), a gitlink or a tree is not one.
_REGULAR_MODES = frozenset({"100644", "100755"})
_SYMLINK_MODE = "120000"
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
)


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


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> Path:
    return Path(url.removeprefix("file://"))


def ensure_shared_repo(url: str) -> None:
    """Create the shared bare repository if it is a local path that does not exist yet."""
    if not is_local(url):
        return
    path = local_path(url)
    if (path / "HEAD").exists():
        return
    if path.exists() and any(path.iterdir()):
        raise Refusal(
            f"{path} exists but is not a bare git repository; "
            "point OUROBOROS_LINEAGE_REPO elsewhere"
        )
    path.mkdir(parents=True, exist_ok=True)
    run_git(path, "init", "--bare", "--quiet")


class LineageCache:
    """The worker's local bare cache of the shared repository."""

    def __init__(self, cache_dir: Path, remote_url: str) -> None:
        self.git_dir = cache_dir
        self.remote_url = remote_url
        self._known: dict[str, Lineage] = {}
        if not (cache_dir / "HEAD").exists():
            cache_dir.mkdir(parents=True, exist_ok=True)
            self.git("init", "--bare", "--quiet")

    def git(self, *args: str, **kwargs: object) -> subprocess.CompletedProcess[bytes]:
        return run_git(self.git_dir, *args, **kwargs)  # type: ignore[arg-type]

    def tracking_ref(self, lineage: str) -> str:
        return f"refs/remotes/shared/{BRANCH_PREFIX}{lineage}"

    def fetch(self, lineage: str) -> str | None:
        """Fetch one lineage branch (only new objects travel); its head, or None if absent."""
        ref = branch_ref(lineage)
        refspec = f"+{ref}:{self.tracking_ref(lineage)}"
        for attempt in range(FETCH_ATTEMPTS):
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
            # Another process of this host moved the same tracking ref meanwhile.
            time.sleep(0.05 * (attempt + 1))
        raise GitError(f"git fetch of {ref} kept losing its ref lock to other processes")

    def ls_remote(self, *patterns: str) -> str:
        """The shared repository's matching refs; a Refusal if it cannot be read at all."""
        result = self.git("ls-remote", self.remote_url, *patterns, check=False)
        if result.returncode != 0:
            raise Refusal(
                f"cannot read the shared lineage repository {self.remote_url}: "
                f"{result.stderr.decode(errors='replace').strip().splitlines()[0]} "
                "(create a lineage with schedule-lineage init, or fix OUROBOROS_LINEAGE_REPO)"
            )
        return result.stdout.decode()

    def rev(self, name: str) -> str:
        return (
            self.git("rev-parse", "--verify", "--quiet", f"{name}^{{commit}}")
            .stdout.decode()
            .strip()
        )

    def read_blob(self, commit: str, path: str) -> bytes | None:
        result = self.git("cat-file", "blob", f"{commit}:{path}", check=False)
        return result.stdout if result.returncode == 0 else None

    def tree(self, commit: str) -> dict[str, Entry]:
        """Every blob of a commit's tree, recursively: path -> (mode, sha)."""
        out = self.git("ls-tree", "-r", "-z", "--full-tree", commit).stdout
        entries: dict[str, Entry] = {}
        for record in out.split(b"\0"):
            if not record:
                continue
            meta, _, path = record.partition(b"\t")
            mode, _kind, sha = meta.decode().split()
            entries[path.decode("utf-8", errors="surrogateescape")] = Entry(mode, sha)
        return entries

    def cat_blobs(self, shas: Iterable[str]) -> dict[str, bytes]:
        """Contents of many blobs through one ``cat-file --batch`` process."""
        wanted = list(dict.fromkeys(shas))
        if not wanted:
            return {}
        out = self.git(
            "cat-file", "--batch", input="".join(f"{s}\n" for s in wanted).encode()
        ).stdout
        blobs: dict[str, bytes] = {}
        pos = 0
        for sha in wanted:
            header_end = out.index(b"\n", pos)
            size = int(out[pos:header_end].split()[2])
            blobs[sha] = out[header_end + 1 : header_end + 1 + size]
            pos = header_end + 1 + size + 1
        return blobs

    def blob_sizes(self, shas: Iterable[str]) -> dict[str, int]:
        """Sizes of many blobs through one ``cat-file --batch-check`` process."""
        wanted = list(dict.fromkeys(shas))
        if not wanted:
            return {}
        out = self.git(
            "cat-file", "--batch-check", input="".join(f"{s}\n" for s in wanted).encode()
        ).stdout
        sizes: dict[str, int] = {}
        for line in out.decode().splitlines():
            fields = line.split()  # "<sha> <type> <size>", or "<sha> missing"
            if len(fields) == 3:
                sizes[fields[0]] = int(fields[2])
        return sizes

    def footprint(self, entries: Mapping[str, Entry]) -> Footprint:
        """What these tree entries take once unpacked into /work (see ``Footprint``)."""
        sizes = self.blob_sizes(
            e.sha for e in entries.values() if e.mode in _REGULAR_MODES or e.mode == _SYMLINK_MODE
        )
        return footprint((path, e.mode, sizes.get(e.sha, 0)) for path, e in entries.items())

    def root_of(self, commit: str) -> str:
        """The root commit ``commit`` descends from by first parents: the lineage's seed."""
        out = self.git("rev-list", "--first-parent", "--max-parents=0", commit).stdout.decode()
        return out.split()[0]

    def history(self, lineage: str, head: str) -> Lineage:
        """The root commit and the number of ``gen `` commits up to ``head``.

        Remembered per lineage and extended by the new commits only when ``head``
        descends from the last one seen, so the cost of a generation does not grow
        with the length of its history.
        """
        known = self._known.get(lineage)
        if known is not None and known.head == head:
            return known
        if known is not None and self.is_ancestor(known.head, head):
            subjects = self._log("%s", f"{known.head}..{head}")
            found = Lineage(head, known.root, known.generations + _generations(subjects))
        else:
            records = [line.split("\0", 2) for line in self._log("%H%x00%P%x00%s", head)]
            roots = [sha for sha, parents, _ in records if not parents]
            found = Lineage(
                head, roots[-1] if roots else head, _generations(s for _, _, s in records)
            )
        self._known[lineage] = found
        return found

    def is_ancestor(self, ancestor: str, descendant: str) -> bool:
        result = self.git("merge-base", "--is-ancestor", ancestor, descendant, check=False)
        return result.returncode == 0

    def _log(self, fmt: str, revisions: str) -> list[str]:
        out = self.git("log", f"--format={fmt}", revisions).stdout
        return out.decode(errors="replace").splitlines()

    def body_before(self, commit: str, path: str, rollback_subject: str) -> bytes | None:
        """The body ``path`` had before the last change to it that was not a rollback.

        The bytes of ``last_body``; see there.
        """
        body = self.last_body(commit, path, rollback_subject)
        return body.data if body is not None else None

    def last_body(self, commit: str, path: str, rollback_subject: str) -> Body | None:
        """The body ``path`` had before the last change to it that was not a rollback.

        Rollback commits (subjects matching ``rollback_subject``) are skipped so that a
        death after a rollback never restores the body that died before it. Only a
        regular file counts as a body: where ``path`` was a symlink, a directory or absent
        before that change (lineages recorded before the decoder refused such results),
        the change before it is asked, and so on back, so the answer is the last body
        that was a regular file. If no change has one, it is the seed body: ``path`` in
        the root commit. None only when not even the root holds ``path`` as a regular
        file, which no lineage made by ``schedule-lineage init`` lacks.

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
        ``000000`` where ``path`` did not exist (as a blob: a directory there shows as
        its files, never as ``path`` itself).
        """
        # The newest change nearly always answers; the rest of the history is read only
        # when it does not.
        for window in (("-n", "1"), ("--skip", "1")):
            out = self.git(
                "log",
                *window,
                "--first-parent",
                "--format=%H %P",
                "--raw",
                "--no-abbrev",
                "--no-renames",
                "--invert-grep",
                "-E",
                f"--grep={rollback_subject}",
                commit,
                "--",
                path,
            ).stdout
            # Each change is a line of its id and parents (first parent first), then
            # ":<old mode> <new mode> <old sha> <new sha> <status>\t<path>"; git quotes a
            # path with unusual bytes, so a line names ``path`` only if it is ``path``.
            first_parent = ""
            for line in out.decode(errors="replace").splitlines():
                meta, _, name = line.partition("\t")
                if not meta.startswith(":"):
                    if meta:
                        first_parent = (meta.split()[1:] or [""])[0]
                    continue
                if name == path and first_parent:
                    old_mode, _new_mode, old_sha = meta[1:].split()[:3]
                    yield Entry(old_mode, old_sha), first_parent

    def hash_bytes(self, data: bytes) -> str:
        return (
            self.git("hash-object", "-w", "--no-filters", "--stdin", input=data)
            .stdout.decode()
            .strip()
        )

    def hash_files(self, paths: list[Path]) -> list[str]:
        """Write many files as blobs through one process; one path per line, so none
        may hold a line break (the decoder refuses such names before they get here)."""
        if not paths:
            return []
        if any("\n" in str(p) or "\r" in str(p) for p in paths):
            raise ValueError("a path with a line break cannot be hashed by path")
        listing = "".join(f"{p}\n" for p in paths).encode()
        out = self.git("hash-object", "-w", "--no-filters", "--stdin-paths", input=listing).stdout
        return out.decode().split()

    def numstat(self, old_sha: str | None, new_sha: str | None) -> tuple[int, int]:
        """Lines added and deleted between two blobs (git's own counting, no helpers)."""
        # Only a missing side needs the empty blob written (an added or removed file).
        empty = self.hash_bytes(b"") if old_sha is None or new_sha is None else ""
        out = (
            self.git(
                "diff",
                "--numstat",
                "--no-ext-diff",
                "--no-textconv",
                old_sha or empty,
                new_sha or empty,
            )
            .stdout.decode()
            .split()
        )
        if not out or out[0] == "-":
            return 0, 0
        return int(out[0]), int(out[1])

    def commit(self, parent: str | None, entries: Mapping[str, Entry], message: str) -> str:
        """Write a commit whose tree is exactly ``entries`` (private index, no work tree)."""
        with tempfile.TemporaryDirectory(prefix="ouro-index-") as scratch:
            index_env = {"GIT_INDEX_FILE": str(Path(scratch) / "index")}
            info = b"".join(
                f"{entry.mode} {entry.sha}\t".encode()
                + path.encode("utf-8", errors="surrogateescape")
                + b"\0"
                for path, entry in sorted(entries.items())
            )
            self.git("update-index", "-z", "--index-info", input=info, env=index_env)
            tree = self.git("write-tree", env=index_env).stdout.decode().strip()
        args = ["commit-tree", tree, "-m", message]
        if parent:
            args[2:2] = ["-p", parent]
        return self.git(*args, env=IDENTITY).stdout.decode().strip()

    def push_cas(self, lineage: str, new: str, expected: str | None) -> bool:
        """Move the shared branch to ``new`` only if it is still at ``expected`` (None: absent)."""
        ref = branch_ref(lineage)
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
            self.git("update-ref", self.tracking_ref(lineage), new)
            return True
        if "[rejected]" in output or "[remote rejected]" in output or "stale info" in output:
            return False
        raise GitError(f"push of {ref} failed: {output.strip()[-500:]}")

    def branch_contains(self, lineage: str, commit: str) -> bool:
        """Whether ``commit`` is on the shared branch (after a fresh fetch)."""
        head = self.fetch(lineage)
        if head is None:
            return False
        result = self.git("merge-base", "--is-ancestor", commit, head, check=False)
        return result.returncode == 0
