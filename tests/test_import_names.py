"""Hostile names in trees made outside the fleet: ``import-bundle`` and ``fork`` apply the
decoder's name rules to every name they would bring into the shared repository, and
refuse with the decoder's reason (exit 2, one line, no traceback), writing nothing.

The bundles are built by the test with git's own plumbing (``git mktree -z``), which
records any name, as a hostile recording would.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest
from support.fleet import Fleet

from worker.instrument.path_rules import shown

pytestmark = pytest.mark.full

_GIT_ID = ["-c", "user.name=t", "-c", "user.email=t@example.invalid"]


def _git(repo: Path, *args: str, input: bytes | None = None) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), *_GIT_ID, *args], input=input, capture_output=True, check=True
    )
    return done.stdout.decode().strip()


class Link(NamedTuple):
    """A symlink entry and its target, recorded as is."""

    target: str


Entries = dict[str, "bytes | Link | Entries"]


def _tree(repo: Path, entries: Entries) -> str:
    """A tree of ``entries`` (name -> content, link or subtree), names recorded as is."""
    lines = []
    for name, content in entries.items():
        if isinstance(content, dict):
            lines.append(f"040000 tree {_tree(repo, content)}\t{name}")
        elif isinstance(content, Link):
            blob = _git(repo, "hash-object", "-w", "--stdin", input=content.target.encode())
            lines.append(f"120000 blob {blob}\t{name}")
        else:
            blob = _git(repo, "hash-object", "-w", "--stdin", input=content)
            lines.append(f"100644 blob {blob}\t{name}")
    return _git(repo, "mktree", "-z", input="".join(f"{line}\0" for line in lines).encode())


def _recording(tmp_path: Path, *trees: Entries) -> Path:
    """A repository whose branch main is one commit per tree, oldest first."""
    repo = tmp_path / "recording"
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True)
    parent: list[str] = []
    for number, entries in enumerate(trees):
        commit = _git(repo, "commit-tree", *parent, "-m", f"step {number}", _tree(repo, entries))
        parent = ["-p", commit]
    _git(repo, "update-ref", "refs/heads/main", parent[1])
    return repo


def _bundle(repo: Path) -> Path:
    bundle = repo.parent / "hostile.bundle"
    _git(repo, "bundle", "create", "-q", str(bundle), "main")
    return bundle


def _refused(fleet: Fleet, *args: str) -> str:
    """The refusal's one line, which shows the hostile name escaped, never raw."""
    line = fleet.refused(*args)
    assert "\x1b" not in line and "\u202e" not in line and "\n" not in line
    return line


def _stored(fleet: Fleet) -> tuple[str, str]:
    """The shared repository's refs and objects: what a refused command must not change."""
    refs = fleet.git("for-each-ref", "--format=%(refname) %(objectname)")
    objects = fleet.git("count-objects", "-v")
    return refs, objects


BODY = b'(message "alive")\n'
HOSTILE = [
    pytest.param("esc\x1b[31m.el", "U+001B control character in the name", id="ESC"),
    pytest.param("x\nhostname", "U+000A control character in the name", id="newline"),
    pytest.param("gnp.\u202etxt.el", "U+202E RIGHT-TO-LEFT OVERRIDE in the name", id="U+202E"),
    pytest.param("journal.md\u034f", "U+034F COMBINING GRAPHEME JOINER in the name", id="U+034F"),
    pytest.param("organism.el\u3164", "U+3164 HANGUL FILLER in the name", id="U+3164"),
    pytest.param("organism\u00a0.el", "U+00A0 NO-BREAK SPACE in the name", id="U+00A0"),
    pytest.param("x" * 256, "path component longer than 255 bytes", id="over-NAME_MAX"),
]


@pytest.fixture
def fleet(tmp_path: Path) -> Fleet:
    (tmp_path / "fleet").mkdir()
    fleet = Fleet(tmp_path / "fleet")
    fleet.ok("init", "clean", "--seed", str(_seed(tmp_path)))
    return fleet


def _seed(tmp_path: Path) -> Path:
    seed = tmp_path / "seed.el"
    seed.write_bytes(BODY)
    return seed


@pytest.mark.parametrize(("name", "reason"), HOSTILE)
def test_import_bundle_refuses_a_hostile_name_with_the_decoders_reason(
    fleet: Fleet, tmp_path: Path, name: str, reason: str
) -> None:
    recording = _recording(tmp_path, {"organism.el": BODY, "sub": {name: b"x"}})
    before = _stored(fleet)
    line = _refused(fleet, "import-bundle", str(_bundle(recording)), "imported")
    assert line.endswith(
        f"holds a name no life could publish: {shown(('sub/' + name).encode())}: {reason} "
        "(rename it in every commit, e.g. with git filter-repo, and bundle again)"
    )
    assert _stored(fleet) == before


def test_import_bundle_refuses_a_hostile_name_anywhere_in_the_history(
    fleet: Fleet, tmp_path: Path
) -> None:
    """Removed again by a later commit, the name is still in the history every reader
    walks (the web diff, ``history``)."""
    recording = _recording(
        tmp_path,
        {"organism.el": BODY},
        {"organism.el": BODY, "gnp.\u202etxt.el": b"x"},
        {"organism.el": BODY},
    )
    before = _stored(fleet)
    line = _refused(fleet, "import-bundle", str(_bundle(recording)), "imported")
    assert "'gnp.\\u202etxt.el': U+202E RIGHT-TO-LEFT OVERRIDE in the name" in line
    assert _stored(fleet) == before


def test_import_bundle_still_takes_a_bundle_of_legible_names(fleet: Fleet, tmp_path: Path) -> None:
    names = {"organism.el": BODY, "é.el": b"x", "ノート": {"a b.txt": b"y"}}
    recording = _recording(tmp_path, names)
    fleet.ok("import-bundle", str(_bundle(recording)), "imported")
    listed = fleet.git("ls-tree", "-r", "--name-only", "-z", "lineage-imported").split("\0")
    assert sorted(listed[:-1]) == ["organism.el", "é.el", "ノート/a b.txt"]


def test_import_bundle_refuses_a_symlink_target_the_decoder_refuses(
    fleet: Fleet, tmp_path: Path
) -> None:
    recording = _recording(tmp_path, {"organism.el": BODY, "l": Link("real\u202e.el")})
    before = _stored(fleet)
    line = _refused(fleet, "import-bundle", str(_bundle(recording)), "imported")
    assert "'l': U+202E RIGHT-TO-LEFT OVERRIDE in the symlink target" in line
    assert _stored(fleet) == before


@pytest.mark.parametrize(("name", "reason"), HOSTILE)
def test_fork_refuses_a_source_tree_holding_a_hostile_name(
    fleet: Fleet, tmp_path: Path, name: str, reason: str
) -> None:
    """A lineage recorded before these rules (written here straight into the shared
    repository) cannot be forked from a commit whose tree holds such a name; its seed,
    whose names are legible, still can."""
    recording = _recording(tmp_path, {"organism.el": BODY}, {"organism.el": BODY, name: b"x"})
    _git(recording, "push", "-q", str(fleet.repo), "main:refs/heads/lineage-old")
    before = _stored(fleet)
    line = _refused(fleet, "fork", "heir", "--from", "old")
    assert line.endswith(
        f"holds a name no life could publish: {shown(name.encode())}: {reason}; "
        "fork another generation"
    )
    assert _stored(fleet) == before
    fleet.ok("fork", "heir", "--from", "old@0")
    assert name not in fleet.git("ls-tree", "--name-only", "-z", "lineage-heir").split("\0")
