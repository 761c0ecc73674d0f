"""The decoder against git's own object checks: a tree the decoder accepts must pass
`git fsck --strict` (the check behind `import-bundle`, `transfer.fsckObjects` and
`receive.fsckObjects`), and a tree git fsck refuses must be a decoder rejection.

Each case is built twice: as the tar an organism would leave, for the decoder, and as
the same tree written with real git (`hash-object`, `mktree`, `commit-tree`), for
`git fsck --strict`. The decoder refuses every .gitmodules, whatever it holds, beyond
fsck (see test_decoder), so the .gitmodules cases here hold what fsck refuses too.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Literal, NamedTuple

import pytest
from support.tarballs import LIMITS, body, build, directory, link, regular

from worker.instrument import path_rules
from worker.instrument.decoder import DecoderRejection, decode_archive


class Member(NamedTuple):
    path: str
    kind: Literal["file", "symlink", "dir"] = "file"
    data: bytes = b""  # a file's bytes, or a symlink's target


_HOSTILE_MODULES = b'[submodule "x"]\n\tpath = x\n\turl = --upload-pack=touch${IFS}owned\n'
_NOT_FOUND = Member("a\\.gitx")  # stands for nothing special: accepted by both

# (id, members beside organism.el, whether git fsck --strict refuses the tree)
CASES: list[tuple[str, list[Member], bool]] = [
    # a .git after a backslash (fsck_tree: is_ntfs_dotgit after each '\\'): hasDotgit
    ("backslash-dotgit", [Member("a\\.git")], True),
    ("backslash-git~1", [Member("x\\GIT~1")], True),
    ("backslash-dotgit-dir", [Member("a\\.git. /x")], True),
    ("second-backslash-dotgit", [Member("a\\b\\.git:x")], True),
    ("backslash-dotgit-symlink", [Member("a\\.git", "symlink", b"t")], True),
    ("dotgit-then-backslash", [Member(".git\\x")], True),
    ("backslash-plain", [Member("a\\b"), Member("c\\.gitx"), Member("d\\git~2")], False),
    # a .gitmodules after a backslash (is_ntfs_dotgitmodules after each '\\')
    ("backslash-gitmodules", [Member("a\\.gitmodules", data=_HOSTILE_MODULES)], True),
    ("backslash-gitmodules-symlink", [Member("a\\.gitmodules", "symlink", b"t")], True),
    # a .gitmodules directory in an NTFS spelling: gitmodulesBlob
    ("gitmod~1-dir", [Member("gitmod~1/x")], True),
    ("gi7eba-dir", [Member("GI7EBA~1/x")], True),
    # .gitattributes that is not a blob: gitattributesBlob
    ("gitattributes-dir", [Member(".gitattributes/x")], True),
    ("GitAttributes-dir", [Member(".GitAttributes/x")], True),
    ("gitatt~1-dir", [Member("gitatt~1/x")], True),
    ("gitatt~4-dir", [Member("sub/GITATT~4/y/x", "symlink", b"t")], True),
    ("gi7d29~1-dir", [Member("gi7d29~1/x")], True),
    ("~1234567-dir", [Member("~1234567/x")], True),
    ("gitattributes-stream-dir", [Member(".gitattributes .:x/y")], True),
    ("gitatt~5-dir", [Member("gitatt~5/x")], False),
    ("backslash-gitattributes-dir", [Member("a\\.gitattributes/x")], False),
    ("empty-gitattributes-dir", [Member(".gitattributes", "dir")], False),
    # .gitattributes lines: gitattributesLineLength at 2048 bytes, before the first NUL
    ("line-2048", [Member(".gitattributes", data=b"*" * 2048 + b"\n")], True),
    ("line-2047", [Member(".gitattributes", data=b"*" * 2047 + b"\n")], False),
    ("last-line-2048-no-newline", [Member(".gitattributes", data=b"a\n" + b"*" * 2048)], True),
    ("last-line-2047-no-newline", [Member(".gitattributes", data=b"a\n" + b"*" * 2047)], False),
    ("long-line-after-nul", [Member(".gitattributes", data=b"*.el text\n\0" + b"*" * 3000)], False),
    ("nested-long-line", [Member("sub/.gitattributes", data=b"x\n" + b"y" * 3000 + b"\n")], True),
    ("ntfs-long-line", [Member("GitAtt~2 . ", data=b"*" * 3000)], True),
    ("ntfs-stream-long-line", [Member(".gitattributes:s", data=b"*" * 3000)], True),
    ("fallback-long-line", [Member("gi7d2~12", data=b"*" * 3000)], True),
    ("hfs-long-line", [Member(".GITATTRIBUTES", data=b"*" * 3000)], True),
    ("not-gitattributes", [Member(".gitattributes2", data=b"*" * 3000)], False),
    ("backslash-gitattributes", [Member("a\\.gitattributes", data=b"*" * 3000)], False),
    ("short-lines", [Member(".gitattributes", data=b"*.el text\n" * 500)], False),
    # symlinks named .gitattributes, .gitignore, .mailmap: only INFO, never refused
    ("symlink-gitattributes", [Member(".gitattributes", "symlink", b"/etc/passwd")], False),
    ("symlink-gitignore", [Member(".gitignore", "symlink", b"/etc/passwd")], False),
    ("symlink-mailmap", [Member("sub/.mailmap", "symlink", b"../x")], False),
    ("nothing-special", [_NOT_FOUND], False),
]


def _git(repo: Path, *args: str, data: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {
        **os.environ,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.invalid",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.invalid",
    }
    return subprocess.run(["git", "-C", str(repo), *args], input=data, env=env, capture_output=True)


def _write_tree(repo: Path, tree: dict[str, object]) -> str:
    """The tree object for ``tree`` (name -> (mode, bytes) or a nested dict), by mktree,
    which records names as given: no checkout-time path rule applies."""
    lines = []
    for name, value in tree.items():
        if isinstance(value, dict):
            mode, kind, oid = "040000", "tree", _write_tree(repo, value)
        else:
            mode, content = value  # type: ignore[misc]
            made = _git(repo, "hash-object", "-w", "--stdin", data=content)
            mode, kind, oid = mode, "blob", made.stdout.decode().strip()
        lines.append(f"{mode} {kind} {oid}\t{name}\0")
    made = _git(repo, "mktree", "-z", data="".join(lines).encode())
    assert made.returncode == 0, made.stderr
    return made.stdout.decode().strip()


def git_fsck_refuses(repo: Path, members: list[Member]) -> tuple[bool, str]:
    """Whether `git fsck --strict` refuses the commit of organism.el plus ``members``."""
    assert _git(repo.parent, "init", "-q", repo.name).returncode == 0
    tree: dict[str, object] = {"organism.el": ("100644", body()[1])}
    for member in members:
        if member.kind == "dir":
            continue  # git stores no empty directory; the decoder drops one
        *parents, leaf = member.path.split("/")
        level = tree
        for name in parents:
            level = level.setdefault(name, {})  # type: ignore[assignment]
        level[leaf] = ("120000" if member.kind == "symlink" else "100644", member.data)
    commit = _git(repo, "commit-tree", "-m", "gen", _write_tree(repo, tree))
    assert commit.returncode == 0, commit.stderr
    assert (
        _git(repo, "update-ref", "refs/heads/lineage", commit.stdout.decode().strip()).returncode
        == 0
    )
    fsck = _git(repo, "fsck", "--strict", "--no-dangling", "--no-progress")
    return fsck.returncode != 0, fsck.stderr.decode(errors="replace")


def decoder_refuses(dest: Path, members: list[Member]) -> tuple[bool, str]:
    tar_members = [body()]
    for member in members:
        if member.kind == "dir":
            tar_members.append(directory(member.path))
        elif member.kind == "symlink":
            tar_members.append(link(member.path, member.data.decode()))
        else:
            tar_members.append(regular(member.path, member.data))
    try:
        decode_archive(build(*tar_members), dest, LIMITS)
    except DecoderRejection as rejection:
        return True, rejection.reason
    return False, ""


@pytest.mark.parametrize(
    ("members", "fsck_refuses"),
    [pytest.param(members, refused, id=case) for case, members, refused in CASES],
)
@pytest.mark.full
def test_decoder_refuses_exactly_what_git_fsck_strict_refuses(
    tmp_path: Path, members: list[Member], fsck_refuses: bool
) -> None:
    git_refused, fsck_said = git_fsck_refuses(tmp_path / "repo", members)
    assert git_refused == fsck_refuses, fsck_said  # the corpus states git 2.39's verdict
    refused, reason = decoder_refuses(tmp_path / "dest", members)
    assert refused == git_refused, (reason, fsck_said)
    if refused and "gitattributes" in fsck_said.lower():
        assert "git fsck refuses" in reason


def test_a_gitattributes_over_git_size_limit_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gitattributesLarge (over 100 MiB) is beyond any test archive: the rule is checked
    with the limit scaled down, at the boundary."""
    monkeypatch.setattr(path_rules, "ATTR_MAX_FILE_SIZE", 10)
    assert not decoder_refuses(tmp_path / "at", [Member(".gitattributes", data=b"*\n" * 5)])[0]
    refused, reason = decoder_refuses(tmp_path / "over", [Member("sub/gitatt~3", data=b"*" * 11)])
    assert refused
    assert "gitattributesLarge" in reason
