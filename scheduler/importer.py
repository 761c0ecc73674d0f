"""Importing a lineage recorded elsewhere (a git bundle) into the shared repository.

Owns ``schedule-lineage import-bundle``: a bundle whose history is one branch
becomes ``lineage-NAME``, created only if absent (a compare-and-swap against "no
such ref"), so an existing lineage is never touched. Nothing is written to the
observation store: an imported lineage has no observations, and readers fall back
to its history and journal. Workers will not continue it (it has no lineage root
metadata), which is right: its physics were never pinned by this fleet.

Trusts: the git binary. Treats the bundle as untrusted input: it is unbundled into
a scratch repository first, which must then pass ``git fsck --strict`` (a fetch from
a bundle runs no object checks of its own: git's unbundle ignores
``fetch.fsckObjects``), so a corrupt object, or a tree git itself would refuse to
check out (``.git``, ``..``, a name holding "/", a ``.gitmodules`` symlink) or would
never write (a zero-padded mode), is refused before anything reaches the shared
repository. Every name in every tree of its history must then pass the rules a life's
result obeys (``tree_names``: no control, bidi, invisible or look-alike character, no
name git reads as .git or .gitmodules), or the bundle is refused naming the path and the
character. Its checked objects enter that repository only through a temporary ref
that is removed again.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

import pygit2

from scheduler.tree_names import history_trees, refused_name
from worker.fleet.repo_admin import ensure_shared_repo
from worker.instrument.errors import Refusal
from worker.instrument.gitrepo import branch_ref, run_git
from worker.instrument.lineage import check_name
from worker.instrument.names import ORGANISM_PATH
from worker.instrument.repo_urls import is_local, local_path


def import_bundle(bundle: Path, name: str, repo_url: str, claim: Callable[[], None]) -> str:
    """Add the bundle's branch as lineage ``name``; return its head commit.

    ``claim`` is called once the bundle has been checked, before the shared repository
    gets anything of it: the name's claim for its home (``worker.fleet.homes``), which a
    refused bundle therefore never takes."""
    check_name(name)
    if not is_local(repo_url):
        raise Refusal(f"import-bundle writes to a local shared repository; {repo_url} is remote")
    # Absolute, so git can never read the path as an option.
    bundle = bundle.resolve()
    if not bundle.is_file() or not os.access(bundle, os.R_OK):
        raise Refusal(f"cannot read bundle {bundle}; pass a readable git bundle file")
    ensure_shared_repo(repo_url)
    repo = local_path(repo_url)
    ref = branch_ref(name)
    if run_git(repo, "rev-parse", "--verify", "--quiet", ref, check=False).returncode == 0:
        raise Refusal(f"lineage {name} already exists; choose another name")
    staging = f"refs/ouroboros-import/{uuid.uuid4().hex}"
    with tempfile.TemporaryDirectory(prefix="ouroboros-bundle-") as scratch_dir:
        scratch = Path(scratch_dir)
        run_git(scratch, "init", "--bare", "--quiet")
        # In an empty repository, "complete" means the bundle needs nothing it lacks.
        verified = run_git(scratch, "bundle", "verify", "--quiet", str(bundle), check=False)
        if verified.returncode != 0:
            raise Refusal(f"{bundle} is not a complete git bundle: {last_line(verified.stderr)}")
        problem = fetch_checked(scratch, bundle, _single_branch(scratch, bundle), staging)
        if problem is not None:
            raise Refusal(f"{bundle} holds objects git refuses: {problem}")
        tip = (
            run_git(scratch, "rev-parse", "--verify", f"{staging}^{{commit}}")
            .stdout.decode()
            .strip()
        )
        if run_git(scratch, "cat-file", "-e", f"{tip}:{ORGANISM_PATH}", check=False).returncode:
            raise Refusal(f"{bundle} is not a lineage: its branch has no {ORGANISM_PATH}")
        checked = pygit2.Repository(str(scratch))
        refused = refused_name(checked, history_trees(checked, tip))
        if refused is not None:
            raise Refusal(
                f"{bundle} holds a name no life could publish: {refused} "
                "(rename it in every commit, e.g. with git filter-repo, and bundle again)"
            )
        claim()
        run_git(
            repo,
            "fetch",
            "--quiet",
            "--no-tags",
            "--no-write-fetch-head",
            str(scratch),
            f"{staging}:{staging}",
        )
    try:
        # Empty old value: the ref is created only if nobody made it meanwhile.
        created = run_git(repo, "update-ref", ref, tip, "", check=False)
        if created.returncode != 0:
            raise Refusal(f"lineage {name} already exists; choose another name")
    finally:
        run_git(repo, "update-ref", "-d", staging)
    return tip


def fetch_checked(scratch: Path, bundle: Path, source: str, target: str) -> str | None:
    """Fetch ``source`` of ``bundle`` into ``scratch`` as ``target``, then check every
    object there as ``git fsck --strict`` does; the first problem git names, or None.

    ``scratch`` must be a repository holding nothing else, so fsck checks exactly the
    bundle's objects, and finds any the branch needs and the bundle lacks.
    """
    fetched = run_git(
        scratch,
        "fetch",
        "--quiet",
        "--no-tags",
        "--no-write-fetch-head",
        str(bundle),
        f"{source}:{target}",
        check=False,
    )
    if fetched.returncode != 0:
        return last_line(fetched.stderr)
    checked = run_git(
        scratch, "fsck", "--strict", "--no-dangling", "--no-progress", "--no-reflogs", check=False
    )
    if checked.returncode != 0:
        return last_line(checked.stdout + checked.stderr, first=True)
    return None


def _single_branch(repo: Path, bundle: Path) -> str:
    """The bundle ref to import: all its branches must name one commit."""
    listing = run_git(repo, "bundle", "list-heads", str(bundle)).stdout.decode(errors="replace")
    refs = [tuple(line.split(" ", 1)) for line in listing.splitlines() if " " in line]
    branches = [(sha, ref) for sha, ref in refs if ref.startswith("refs/heads/")]
    # A bundle made from a clone also lists HEAD and remote-tracking refs of the same tip.
    candidates = branches or [(sha, ref) for sha, ref in refs if ref != "HEAD"]
    tips = {sha for sha, _ in candidates}
    if len(tips) != 1:
        raise Refusal(
            f"{bundle} holds {len(tips)} branch tips; a lineage is one branch "
            "(bundle just that branch: git bundle create FILE BRANCH)"
        )
    return candidates[0][1]


def last_line(stderr: bytes, first: bool = False) -> str:
    """The last (or ``first``) line git wrote, as the one line of a refusal."""
    lines = [line for line in stderr.decode(errors="replace").splitlines() if line.strip()]
    if not lines:
        return "git could not read it"
    return lines[0 if first else -1].removeprefix("error: ")
