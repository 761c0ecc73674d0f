"""The trusted decoder: what a result archive may publish, and that no archive writes
outside the destination.

Archives are built in memory with ``tarfile`` (and by hand where no writer would produce
the shape), plus real GNU tar output, the likeliest writer inside the sandbox.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import time
import unicodedata
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple, TypeVar

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.fleet import Fleet
from support.lives import make_lineage, run_one
from support.tarballs import LIMITS, body, build, directory, link, regular

from worker.instrument.decoder import (
    DecodeLimits,
    DecoderRejection,
    TreeEntry,
    decode_archive,
)
from worker.instrument.names import KERNEL_OWNED
from worker.instrument.path_rules import is_dotgit, is_gitattributes, is_gitmodules, shown
from worker.instrument.physics import Physics

T = TypeVar("T")


# --- building archives -----------------------------------------------------------------


def special(name: str, kind: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type = kind
    return info, b""


def decode(archive: bytes, dest: Path, limits: DecodeLimits = LIMITS) -> dict[str, TreeEntry]:
    return {entry.path: entry for entry in decode_archive(archive, dest, limits)}


def rejection(archive: bytes, dest: Path, limits: DecodeLimits = LIMITS) -> str:
    with pytest.raises(DecoderRejection) as caught:
        decode_archive(archive, dest, limits)
    reason = str(caught.value)
    assert reason == caught.value.reason
    assert "\n" not in reason
    return reason


def snapshot(root: Path, skip: Path | None = None) -> dict[str, tuple[object, ...]]:
    """Every path under root with its type, mode, times and content, never following."""
    seen: dict[str, tuple[object, ...]] = {}
    for current, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(current, name)
            if skip is not None and (path == skip or skip in path.parents):
                continue
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                detail: object = os.readlink(path)
            elif stat.S_ISREG(info.st_mode):
                detail = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                detail = None
            seen[str(path.relative_to(root))] = (info.st_mode, info.st_mtime_ns, detail)
    return seen


def published_tree(dest: Path) -> tuple[dict[str, tuple[object, ...]], set[str]]:
    """The files and symlinks under dest, and its directories; anything else fails."""
    entries: dict[str, tuple[object, ...]] = {}
    directories: set[str] = set()
    for current, dirs, files in os.walk(dest):
        for name in [*dirs, *files]:
            path = Path(current, name)
            relative = str(path.relative_to(dest))
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                entries[relative] = ("symlink", os.readlink(path))
            elif stat.S_ISREG(mode):
                entries[relative] = ("file", stat.S_IMODE(mode), path.stat().st_size)
            else:
                assert stat.S_ISDIR(mode), f"{relative} is neither file, symlink nor directory"
                assert stat.S_IMODE(mode) == 0o755
                directories.add(relative)
    return entries, directories


def assert_disk_matches(dest: Path, published: Iterable[TreeEntry]) -> None:
    entries = list(published)
    assert [entry.path for entry in entries] == sorted(entry.path for entry in entries)
    on_disk, directories = published_tree(dest)
    expected = {
        entry.path: ("symlink", entry.target)
        if entry.kind == "symlink"
        else ("file", 0o755 if entry.executable else 0o644, entry.size)
        for entry in entries
    }
    assert on_disk == expected
    # Only directories that hold something are written: git stores no empty directory.
    implied = {str(Path(entry.path).parent) for entry in entries} - {"."}
    assert directories == {str(p) for d in implied for p in [Path(d), *Path(d).parents]} - {"."}


# --- what is published -----------------------------------------------------------------


def test_normal_tree_round_trips_with_exec_bits_and_nested_dirs(tmp_path: Path) -> None:
    archive = build(
        directory("./"),
        regular("./organism.el", b'(message "hi")\n'),
        regular("./bin/run", b"#!/bin/sh\n", mode=0o775),
        regular("./bin/owner-only-exec", b"x", mode=0o744),
        regular("./bin/group-exec-only", b"y", mode=0o654),
        directory("./lib/deep/er"),
        regular("./lib/deep/er/state.el", b"(:generation 1)\n", mode=0o600),
        regular("notes/plain-name.txt", b"no ./ prefix\n"),
    )
    old_umask = os.umask(0o077)  # the result must not depend on the worker's umask
    try:
        entries = decode_archive(archive, tmp_path / "dest", LIMITS)
    finally:
        os.umask(old_umask)
    assert [(e.path, e.executable, e.size) for e in entries] == [
        ("bin/group-exec-only", False, 1),
        ("bin/owner-only-exec", True, 1),
        ("bin/run", True, 10),
        ("lib/deep/er/state.el", False, 16),
        ("notes/plain-name.txt", False, 13),
        ("organism.el", False, 15),
    ]
    assert all(e.kind == "file" and e.target is None for e in entries)
    assert (tmp_path / "dest/lib/deep/er/state.el").read_bytes() == b"(:generation 1)\n"
    assert_disk_matches(tmp_path / "dest", entries)


@pytest.mark.full
def test_real_gnu_tar_output_decodes_in_every_format(tmp_path: Path) -> None:
    source = tmp_path / "work"
    (source / "sub" / "deep").mkdir(parents=True)
    (source / "organism.el").write_text("(body)\n")
    (source / "run.sh").write_text("#!/bin/sh\n")
    (source / "run.sh").chmod(0o755)
    long_name = "n" * 150  # needs a GNU long-name or pax header
    (source / "sub" / "deep" / long_name).write_bytes(b"z" * 3000)
    (source / "host").symlink_to("/etc/passwd")
    for fmt in ("gnu", "posix"):
        result = subprocess.run(
            ["tar", f"--format={fmt}", "-C", str(source), "-cf", "-", "."],
            check=True,
            capture_output=True,
        ).stdout
        entries = decode(result, tmp_path / f"dest-{fmt}")
        assert sorted(entries) == ["host", "organism.el", "run.sh", f"sub/deep/{long_name}"]
        assert entries["run.sh"].executable
        assert entries["host"].target == "/etc/passwd"
        assert entries[f"sub/deep/{long_name}"].size == 3000


def test_long_names_via_gnu_and_pax_headers_decode(tmp_path: Path) -> None:
    name = "/".join(["d" * 90] * 3) + "/file"
    target = "../" * 40 + "t" * 60
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        entries = decode(
            build(body(), regular(name, b"data"), link("l", target), fmt=fmt),
            tmp_path / f"d{fmt}",
        )
        assert entries[name].size == 4
        assert entries["l"].target == target


def test_empty_directories_are_dropped(tmp_path: Path) -> None:
    archive = build(
        directory("./"), directory("./empty"), directory("./full"), regular("full/f"), body()
    )
    entries = decode(archive, tmp_path / "dest")
    assert list(entries) == ["full/f", "organism.el"]
    assert not (tmp_path / "dest" / "empty").exists()


def test_gitignored_files_are_kept(tmp_path: Path) -> None:
    archive = build(
        regular(".gitignore", b"hidden.txt\n*\n"), regular("hidden.txt", b"hereditary"), body()
    )
    assert sorted(decode(archive, tmp_path / "dest")) == [".gitignore", "hidden.txt", "organism.el"]


def test_symlink_to_host_path_is_stored_verbatim_and_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("host data\n")
    archive = build(
        body(b"(body)\n"),
        link("passwd", "/etc/passwd"),
        link("secret", str(outside / "secret")),
        link("up", "../../outside"),
        link("dangling", "../nowhere/at/all"),
    )
    entries = decode(archive, tmp_path / "dest")
    assert {path: (e.kind, e.target, e.size) for path, e in entries.items()} == {
        "dangling": ("symlink", "../nowhere/at/all", 17),
        "organism.el": ("file", None, 7),
        "passwd": ("symlink", "/etc/passwd", 11),
        "secret": ("symlink", str(outside / "secret"), len(str(outside / "secret"))),
        "up": ("symlink", "../../outside", 13),
    }
    for name in entries.keys() - {"organism.el"}:
        assert (tmp_path / "dest" / name).is_symlink()
    assert_disk_matches(tmp_path / "dest", entries.values())


# --- what is rejected ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "what"),
    [
        (tarfile.FIFOTYPE, "a FIFO"),
        (tarfile.CHRTYPE, "a character device"),
        (tarfile.BLKTYPE, "a block device"),
        (b"V", "member type b'V'"),
    ],
)
def test_special_files_are_rejected(tmp_path: Path, kind: bytes, what: str) -> None:
    reason = rejection(build(regular("ok"), special("node", kind)), tmp_path / "dest")
    assert reason.startswith(f"member 'node': {what} is not accepted")


def test_hard_link_is_rejected(tmp_path: Path) -> None:
    archive = build(regular("a", b"data"), link("b", "a", kind=tarfile.LNKTYPE))
    assert rejection(archive, tmp_path / "dest").startswith("member 'b': a hard link")


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("/etc/cron.d/evil", "absolute path"),
        ("//double", "absolute path"),
        ("../escape", "'..' path component"),
        ("a/../../escape", "'..' path component"),
        ("a/..", "'..' path component"),
        ("a/./b", "'.' path component"),
        ("././a", "'.' path component"),
        ("a//b", "empty path component"),
        ("a/", "empty path component"),
        (".", "only a directory may name the archive root"),
        ("", "empty name"),
        ("x" * 256, "path component longer than 255 bytes"),
        ("a/" * 129 + "f", "more than 128 path components"),
    ],
)
def test_unsafe_or_ambiguous_paths_are_rejected(tmp_path: Path, name: str, rule: str) -> None:
    assert rule in rejection(build(regular(name, b"x")), tmp_path / "dest")


def test_nul_in_a_pax_path_is_rejected(tmp_path: Path) -> None:
    info, data = regular("placeholder", b"x")
    info.pax_headers = {"path": "a\0b"}
    assert "NUL in the name" in rejection(build((info, data)), tmp_path / "dest")


def test_non_utf8_names_and_targets_are_rejected(tmp_path: Path) -> None:
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        reason = rejection(build(regular("bad-\udcff", b"x"), fmt=fmt), tmp_path / f"n{fmt}")
        assert reason == "member b'bad-\\xff': the name is not valid UTF-8"
        reason = rejection(build(link("l", "t-\udcfe"), fmt=fmt), tmp_path / f"t{fmt}")
        assert reason == "member 'l': the symlink target is not valid UTF-8"


@pytest.mark.parametrize(
    "name",
    [
        ".git",
        ".git/config",
        "./.git/hooks/post-checkout",
        "a/b/.git/config",
        "sub/.git",
        ".GIT/config",  # git refuses every case of .git
        "a/.Git",
        "git~1/config",  # the NTFS short name of .git
        ".git./x",  # NTFS drops trailing dots and spaces
        ".git /x",
        ".git::$INDEX_ALLOCATION/x",  # an NTFS stream of .git
    ],
)
def test_dot_git_is_rejected_at_top_and_nested(tmp_path: Path, name: str) -> None:
    for member in (regular(name, b"x"), directory(name), link(name, "target")):
        assert "a .git directory" in rejection(build(member), tmp_path / "dest")


def test_names_merely_starting_with_dot_git_are_kept(tmp_path: Path) -> None:
    names = [".github/workflows/ci.yml", ".gitignore", ".gitattributes", ".gitx", "a.git"]
    names.append("organism.el")
    archive = build(*(regular(name, b"x") for name in names))
    assert sorted(decode(archive, tmp_path / "dest")) == sorted(names)


def test_gitmodules_in_any_spelling_git_knows_is_rejected_as_file_or_symlink(
    tmp_path: Path,
) -> None:
    # A planted submodule URL ("--upload-pack=...") fails git fsck, so a mirror that
    # checks objects would refuse the lineage: no .gitmodules is ever committed.
    for name in (".gitmodules", "sub/.GitModules", "gitmod~1", ".gitmodules "):
        planted = regular(name, b'[submodule "x"]\n\turl = --upload-pack=touch /tmp/pwned\n')
        assert "a .gitmodules" in rejection(build(planted, body()), tmp_path / "file")
        assert "a .gitmodules" in rejection(build(link(name, "/etc/passwd")), tmp_path / "link")


@pytest.mark.parametrize("owned", sorted(KERNEL_OWNED))
def test_kernel_owned_paths_are_rejected_at_top_level_only(tmp_path: Path, owned: str) -> None:
    for member in (regular(owned, b"forged"), regular(f"./{owned}"), link(owned, "x")):
        assert "is kernel-owned" in rejection(build(member), tmp_path / "dest")
    assert "is kernel-owned" in rejection(build(regular(f"{owned}/inner")), tmp_path / "dest")
    kept = decode(build(regular(f"notes/{owned}"), body()), tmp_path / "ok")
    assert list(kept) == [f"notes/{owned}", "organism.el"]


def test_too_many_files_are_rejected(tmp_path: Path) -> None:
    limits = DecodeLimits(max_bytes=1000, max_files=3)
    at_limit = [body(), link("b", "organism.el"), regular("c/d")]
    assert len(decode(build(directory("e"), *at_limit), tmp_path / "ok", limits)) == 3
    reason = rejection(build(*at_limit, regular("e")), tmp_path / "dest", limits)
    assert reason == "member 'e': more than 3 files and symlinks (the work_files limit)"


def test_too_many_bytes_are_rejected(tmp_path: Path) -> None:
    limits = DecodeLimits(max_bytes=10, max_files=100)
    at_limit = [body(b"12345"), regular("b", b"12345"), link("c", "x" * 50)]
    assert len(decode(build(*at_limit), tmp_path / "ok", limits)) == 3
    reason = rejection(build(*at_limit, regular("d", b"!")), tmp_path / "dest", limits)
    assert reason == "member 'd': files total more than 10 bytes (the work_bytes limit)"


def test_writing_through_a_symlink_is_rejected(tmp_path: Path) -> None:
    sandbox = tmp_path / "sandbox"
    outside = sandbox / "outside"
    outside.mkdir(parents=True)
    (outside / "sentinel").write_text("untouched\n")
    before = snapshot(sandbox)
    for target in (str(outside), "../outside", "."):
        archive = build(link("d", target), regular("d/sentinel", b"pwned"))
        assert rejection(archive, sandbox / "dest") == (
            "member 'd/sentinel': lies under 'd', which is a symlink; "
            "nothing is written through a symlink"
        )
        archive = build(link("d", target), directory("d/sub"), regular("d/sub/new", b"x"))
        assert "lies under 'd', which is a symlink" in rejection(archive, sandbox / "dest")
        # Declaring the symlink's name again as a directory is no way around it either.
        archive = build(link("d", target), directory("d/"), regular("d/new", b"x"))
        assert rejection(archive, sandbox / "dest") == "member 'd/': duplicate member"
    assert snapshot(sandbox, skip=sandbox / "dest") == before


def test_member_under_a_file_is_rejected(tmp_path: Path) -> None:
    reason = rejection(build(regular("f", b"x"), regular("f/g", b"y")), tmp_path / "dest")
    assert "lies under 'f', which is a file" in reason


def test_file_replacing_an_implied_directory_is_rejected(tmp_path: Path) -> None:
    for member in (regular("a", b"x"), link("a", "/tmp")):
        reason = rejection(build(regular("a/b", b"y"), member), tmp_path / "dest")
        assert reason == "member 'a': earlier members lie under it as a directory"


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (regular("a", b"1"), regular("a", b"2")),
        (regular("a", b"1"), regular("./a", b"2")),
        (regular("a", b"1"), link("a", "/etc/passwd")),
        (link("a", "/etc/passwd"), regular("a", b"2")),
        (directory("d"), directory("./d/")),
        (directory("./"), directory(".")),
    ],
)
def test_duplicate_member_is_rejected(
    tmp_path: Path, first: tuple[tarfile.TarInfo, bytes], second: tuple[tarfile.TarInfo, bytes]
) -> None:
    assert rejection(build(first, second), tmp_path / "dest").endswith(": duplicate member")


def test_directory_or_symlink_carrying_data_is_rejected(tmp_path: Path) -> None:
    # No tar writer makes this; readers disagree on whether such data is skipped.
    for info, _ in (directory("d/"), link("l", "target")):
        info.size = 5
        archive = info.tobuf(tarfile.GNU_FORMAT) + b"hello".ljust(512, b"\0") + bytes(1024)
        assert "carrying 5 data bytes is malformed" in rejection(archive, tmp_path / "dest")


def test_sparse_files_and_global_headers_are_rejected(tmp_path: Path) -> None:
    sparse, _ = regular("s", b"")
    sparse.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0"}
    assert "sparse files are not accepted" in rejection(build((sparse, b"")), tmp_path / "a")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", pax_headers={"comment": "global"}) as archive:
        archive.addfile(regular("f")[0])
    assert "a global pax header is not accepted" in rejection(buffer.getvalue(), tmp_path / "b")


def corrupt_variants() -> list[tuple[str, bytes, str]]:
    good = build(regular("file", b"x" * 2000), regular("second", b"y"))
    flipped = bytearray(good)
    flipped[3] ^= 0x20  # inside the first header's name: the checksum no longer holds
    lone_zero = good[:512] + good[512 : 512 + 2048] + bytes(512) + good[512 + 2048 :]
    return [
        ("empty", b"", "truncated at byte 0"),
        ("garbage", b"this is not a tar archive\n" * 40, "not a ustar, GNU or pax header"),
        ("cut inside data", good[:1200], "truncated inside the data of the member at byte 0"),
        ("cut inside a header", good[: 512 + 2048 + 100], "truncated at byte 2560"),
        ("no end marker", good[: 512 + 2048 + 1024], "before the end-of-archive marker"),
        ("one zero block", good[: 512 + 2048 + 1024 + 512], "inside the end-of-archive marker"),
        ("checksum", bytes(flipped), "fails its checksum"),
        ("trailing data", good + b"smuggled", "data follows the end-of-archive marker"),
        ("member after a lone zero block", lone_zero, "data follows the end-of-archive marker"),
        ("gzip", b"\x1f\x8b\x08\x00" + bytes(600), "not a ustar, GNU or pax header"),
    ]


@pytest.mark.parametrize(("label", "archive", "reason"), corrupt_variants())
def test_corrupt_or_truncated_archives_are_rejected_with_a_reason(
    tmp_path: Path, label: str, archive: bytes, reason: str
) -> None:
    message = rejection(archive, tmp_path / "dest")
    assert message.startswith("corrupt archive: ") and reason in message, label


def test_pax_headers_are_parsed_in_linear_time(tmp_path: Path) -> None:
    # Python 3.11.7's tarfile needs seconds for this header and hours for a few MiB.
    info, data = regular("f", b"x")
    info.pax_headers = {"comment": "1" * 60_000}
    started = time.monotonic()
    assert list(decode(build((info, data), body()), tmp_path / "ok")) == ["f", "organism.el"]
    info.pax_headers = {"comment": "1" * 70_000}
    assert "extended header at byte 0 holds" in rejection(build((info, data)), tmp_path / "no")
    assert time.monotonic() - started < 1


def test_reason_is_one_line_even_for_hostile_names(tmp_path: Path) -> None:
    reason = rejection(build(regular("evil\nname\r/../x", b"")), tmp_path / "dest")
    assert reason == "member 'evil\\nname\\r/../x': U+000A control character in the name"
    reason = rejection(build(regular("z" * 300 + "/..", b"")), tmp_path / "dest")
    assert "...(cut)" in reason and len(reason) < 250


def test_limits_come_from_the_lineage_physics() -> None:
    physics = Physics(work_bytes="64M", work_files=500)
    assert DecodeLimits.from_physics(physics) == DecodeLimits(
        max_bytes=64 * 1024 * 1024, max_files=500
    )


def test_destination_must_be_fresh(tmp_path: Path) -> None:
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / "stale").write_text("left over")
    with pytest.raises(ValueError, match="not empty"):
        decode_archive(build(body()), tmp_path / "dest", LIMITS)


# --- agreement with git ----------------------------------------------------------------

# Characters that make up git's special names, plus HFS+-ignored code points.
_GITISH = st.text(alphabet=list(".gGiItTmMoOdDuUlLeEsS~147 :\\ab\u200c\ufeff"), max_size=14)
_TRICKY = st.sampled_from(
    [
        *[".git", ".GIT", "git~1", "GIT~1", ".git.", ".git ", ".git:x", ".git\\x", "git~2"],
        *[".gitx", ".gitmodules", ".GITMODULES", "gitmod~1", "gitmod~5", "gi7eba~1", "gi7eb~12"],
        *["~1234567", "gi7eba~10", ".gitmodules:x", ".gitmodules\\x", ".gitm\u200codules"],
        ".\ufeffgit",
    ]
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    names=st.lists(
        st.tuples(
            st.lists(st.one_of(_TRICKY, _GITISH), min_size=1, max_size=3).map("/".join),
            st.booleans(),
        ),
        min_size=1,
        max_size=25,
    )
)
@pytest.mark.full
def test_decoder_refuses_exactly_the_paths_git_would_silently_drop(
    tmp_path_factory: pytest.TempPathFactory, names: list[tuple[str, bool]]
) -> None:
    """The publisher feeds paths to `git update-index --index-info`, which skips a path
    it refuses with only a warning; so the decoder must refuse precisely those, and
    beyond them only names a person cannot read as they are (the only unprintable
    characters drawn here are the zero-width ones HFS+ ignores, category Cf)."""
    work = tmp_path_factory.mktemp("git-agreement")
    subprocess.run(["git", "init", "-q", str(work / "repo")], check=True)
    env = {**os.environ, "GIT_INDEX_FILE": str(work / "index")}
    blob = "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"  # the empty blob
    paths = [(f"t{i}/{name}", is_symlink) for i, (name, is_symlink) in enumerate(names)]
    info = "".join(
        f"{'120000' if is_symlink else '100644'} {blob}\t{path}\0" for path, is_symlink in paths
    )
    git = ["git", "-C", str(work / "repo"), "-c", "core.protectHFS=true"]
    git += ["-c", "core.protectNTFS=true"]
    subprocess.run(
        [*git, "update-index", "--add", "-z", "--index-info"],
        input=info.encode(),
        env=env,
        check=True,
        capture_output=True,
    )
    listed = subprocess.run(
        [*git, "ls-files", "-z"], env=env, check=True, capture_output=True
    ).stdout
    git_kept = set(listed.decode().split("\0")) - {""}
    for index, (path, is_symlink) in enumerate(paths):
        member = link(path, "target") if is_symlink else regular(path, b"")
        try:
            decode_archive(build(body(), member), work / f"dest{index}", LIMITS)
            decoder_kept = True
        except DecoderRejection:
            decoder_kept = False
        # Beyond update-index: no .gitmodules at all, in git's own spellings of it, and
        # what git fsck refuses besides (a .git after a backslash, a directory git reads
        # as .gitattributes): test_decoder_git_parity checks those against real git.
        parts = tuple(path.split("/"))
        expected = path in git_kept and path.isprintable()
        expected = expected and not any(is_gitmodules(part) for part in parts)
        expected = expected and not any(is_dotgit(part) for part in parts)
        expected = expected and not any(is_gitattributes(part) for part in parts[:-1])
        assert decoder_kept == expected, (path, is_symlink)


# --- hostile archives ------------------------------------------------------------------

_OUTSIDE = "{outside}"  # replaced by the absolute path of the sibling "outside" directory


def mostly(common: st.SearchStrategy[T], rare: st.SearchStrategy[T]) -> st.SearchStrategy[T]:
    """Draw from ``common`` about four times in five."""
    return st.integers(0, 4).flatmap(lambda draw: rare if draw == 0 else common)


class Spec(NamedTuple):
    prefix: str
    components: list[str]
    trailing_slash: bool
    kind: bytes
    target: str
    data: bytes
    mode: int


_BENIGN_COMPONENTS = st.sampled_from(["a", "b", "sub", "outside", "dest", "sentinel.txt", "é"])
_COMPONENTS = st.one_of(
    _BENIGN_COMPONENTS,
    st.sampled_from(
        [
            *[".", "..", "", ".git", ".GIT", "git~1", ".gitmodules", "journal.md", "\n", "\0"],
            *[".ouroboros-lineage.json", "\udcff", "x" * 120, "y" * 256, "a\\b", " "],
        ]
    ),
)
_BENIGN_PREFIXES = st.sampled_from(["", "./"])
_PREFIXES = st.one_of(
    _BENIGN_PREFIXES, st.sampled_from(["/", "//", "../", "../../", "./../", _OUTSIDE + "/"])
)
# Any of these is published verbatim as a symlink target, however far it points.
_STORABLE_TARGETS = st.one_of(
    st.sampled_from(
        [
            *[_OUTSIDE, _OUTSIDE + "/sentinel.txt", "../outside", "../outside/sentinel.txt"],
            *["..", ".", "/", "a", "sub", "sub/..", "/nonexistent-ouroboros/x"],
        ]
    ),
    st.integers(1, 3).map(lambda depth: "../" * depth + "outside/sentinel.txt"),
)
_TARGETS = st.one_of(_STORABLE_TARGETS, st.sampled_from(["", "\0", "bad-\udcff"]))
_BENIGN_TYPES = st.sampled_from([tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE])
_TYPES = st.one_of(
    _BENIGN_TYPES,
    st.sampled_from(
        [tarfile.LNKTYPE, tarfile.FIFOTYPE, tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.CONTTYPE]
    ),
    st.sampled_from([tarfile.AREGTYPE, tarfile.GNUTYPE_SPARSE]),
    st.binary(min_size=1, max_size=1),
)


def specs(
    prefixes: st.SearchStrategy[str],
    components: st.SearchStrategy[str],
    kinds: st.SearchStrategy[bytes],
    targets: st.SearchStrategy[str],
    trailing_slash: st.SearchStrategy[bool],
) -> st.SearchStrategy[list[Spec]]:
    member = st.builds(
        Spec,
        prefix=prefixes,
        components=st.lists(components, min_size=1, max_size=4),
        trailing_slash=trailing_slash,
        kind=kinds,
        target=targets,
        data=st.binary(max_size=64),
        mode=st.sampled_from([0o644, 0o755, 0o4777, 0o000]),
    )
    return st.lists(
        member, min_size=1, max_size=10, unique_by=lambda spec: tuple(spec.components)
    ).flatmap(
        # Duplicates: replay some members later in the archive.
        lambda members: mostly(
            st.just([]), st.lists(st.sampled_from(members), min_size=1, max_size=2)
        ).map(lambda again: members + again)
    )


# Half the archives draw only plain names, types and storable targets, so that extraction
# itself is exercised; they still hold far-pointing symlinks, a member under a symlink or
# a file, a file where a directory was implied, and duplicates.
_ARCHIVE_SPECS = st.one_of(
    specs(_BENIGN_PREFIXES, _BENIGN_COMPONENTS, _BENIGN_TYPES, _STORABLE_TARGETS, st.just(False)),
    specs(_PREFIXES, _COMPONENTS, _TYPES, _TARGETS, st.booleans()),
)
_MUTATIONS = mostly(
    st.none(),
    st.tuples(
        st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=3),
        st.one_of(st.none(), st.integers(0, 1 << 20)),
    ),
)
Mutation = tuple[list[tuple[int, int]], int | None] | None


def hostile_archive(specs: list[Spec], fmt: int, mutation: Mutation, outside: Path) -> bytes:
    members = [body()]  # without it every archive is refused and nothing is extracted
    for spec in specs:
        name = spec.prefix.replace(_OUTSIDE, str(outside)) + "/".join(spec.components)
        info = tarfile.TarInfo(name + ("/" if spec.trailing_slash else ""))
        info.type, info.mode = spec.kind, spec.mode
        info.linkname = spec.target.replace(_OUTSIDE, str(outside))
        if spec.kind in (tarfile.REGTYPE, tarfile.CONTTYPE, tarfile.AREGTYPE):
            info.size = len(spec.data)
        members.append((info, spec.data[: info.size]))
    archive = build(*members, fmt=fmt)
    if mutation is not None:
        flips, cut = mutation
        mutated = bytearray(archive)
        for position, value in flips:
            mutated[position % len(mutated)] = value
        archive = bytes(mutated[: cut % (len(mutated) + 1)] if cut is not None else mutated)
    return archive


@settings(
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    members=_ARCHIVE_SPECS,
    fmt=st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]),
    mutation=_MUTATIONS,
)
def test_hostile_archives_never_write_outside_the_destination(
    tmp_path: Path, members: list[Spec], fmt: int, mutation: Mutation
) -> None:
    # A fresh sandbox per example: the function-scoped tmp_path is shared by examples.
    sandbox = tmp_path / "sandbox"
    shutil.rmtree(sandbox, ignore_errors=True)
    dest, outside = sandbox / "dest", sandbox / "outside"
    outside.mkdir(parents=True)
    dest.mkdir()  # made before the snapshot, so that its parent's mtime is left alone
    (outside / "sentinel.txt").write_text("sentinel\n")
    archive = hostile_archive(members, fmt, mutation, outside)
    before = snapshot(tmp_path, skip=dest)
    above = sorted(os.listdir(tmp_path.parent))
    try:
        entries = decode_archive(archive, dest, DecodeLimits(max_bytes=4096, max_files=12))
    except DecoderRejection as rejected:
        assert "\n" not in str(rejected)
        event(f"rejected: {rejected.reason.partition(': ')[2][:24]}")
        entries = None
    else:
        event(f"published {len(entries) if len(entries) < 3 else 'three or more'} entries")
    assert snapshot(tmp_path, skip=dest) == before
    assert sorted(os.listdir(tmp_path.parent)) == above
    if entries is None:
        published_tree(dest)  # whatever partial content: files, symlinks, dirs only
    else:
        assert_disk_matches(dest, entries)


@pytest.mark.parametrize(
    "name",
    ["x\n/etc/hostname", "foo\r", "tab\there", "bell\x07", "esc\x1b[31m", "del\x7f", "csi\x9b"],
)
def test_control_characters_in_names_and_targets_are_rejected(tmp_path: Path, name: str) -> None:
    # A line break would split the name in git's path-per-line interfaces; an ESC or a
    # C1 CSI would reach a terminal through git log.
    assert "control character in the name" in rejection(
        build(regular(name, b"AAA")), tmp_path / "dest"
    )
    first = next(ch for ch in name if not ch.isprintable())
    assert rejection(build(body(), link("l", name)), tmp_path / "dest") == (
        f"member 'l': U+{ord(first):04X} control character in the symlink target"
    )


@pytest.mark.parametrize(
    ("char", "named"),
    [
        ("\u202e", "U+202E RIGHT-TO-LEFT OVERRIDE"),
        ("\u202a", "U+202A LEFT-TO-RIGHT EMBEDDING"),
        ("\u2067", "U+2067 RIGHT-TO-LEFT ISOLATE"),
        ("\u200f", "U+200F RIGHT-TO-LEFT MARK"),
        ("\u200b", "U+200B ZERO WIDTH SPACE"),
        ("\u2060", "U+2060 WORD JOINER"),
        ("\ufeff", "U+FEFF ZERO WIDTH NO-BREAK SPACE"),
        ("\u00ad", "U+00AD SOFT HYPHEN"),
        ("\u2028", "U+2028 LINE SEPARATOR"),
        ("\u2029", "U+2029 PARAGRAPH SEPARATOR"),
        ("\U000e0041", "U+E0041 TAG LATIN CAPITAL LETTER A"),
    ],
)
def test_invisible_characters_in_names_and_targets_are_rejected_by_name(
    tmp_path: Path, char: str, named: str
) -> None:
    # "gnp.\u202etxt.el" shows as "gnp.le.txt" wherever bidi text is rendered.
    for name in (f"gnp.{char}txt.el", f"dir{char}/file", f"{char}"):
        reason = rejection(build(body(), regular(name, b"x")), tmp_path / "dest")
        # The name as shown escapes the character: the reason itself reads unambiguously.
        assert reason == f"member {shown(name.encode())}: {named} in the name"
        assert reason.isprintable()  # the reason itself shows the name escaped
    reason = rejection(build(body(), link("l", f"real{char}.el")), tmp_path / "dest")
    assert reason == f"member 'l': {named} in the symlink target"


def test_every_format_and_separator_character_is_rejected(tmp_path: Path) -> None:
    invisible = [
        chr(code)
        for code in range(sys.maxunicode + 1)
        if unicodedata.category(chr(code)) in ("Cf", "Zl", "Zp")
    ]
    assert len(invisible) > 150
    for char in invisible:
        reason = rejection(build(body(), regular(f"a{char}b", b"x")), tmp_path / "dest")
        assert reason.endswith(f"U+{ord(char):04X} {unicodedata.name(char)} in the name")


# Look-alikes outside Cf: they render as nothing (default-ignorable) or as a space that
# is not U+0020, so "journal.md" followed by one lists as a second journal.md.
LOOK_ALIKES = [
    ("\u034f", "U+034F COMBINING GRAPHEME JOINER"),
    ("\u17b4", "U+17B4 KHMER VOWEL INHERENT AQ"),
    ("\u115f", "U+115F HANGUL CHOSEONG FILLER"),
    ("\u1160", "U+1160 HANGUL JUNGSEONG FILLER"),
    ("\u3164", "U+3164 HANGUL FILLER"),
    ("\uffa0", "U+FFA0 HALFWIDTH HANGUL FILLER"),
    ("\u00a0", "U+00A0 NO-BREAK SPACE"),
    ("\u2007", "U+2007 FIGURE SPACE"),
    ("\u3000", "U+3000 IDEOGRAPHIC SPACE"),
]


@pytest.mark.parametrize(("char", "named"), LOOK_ALIKES)
def test_look_alike_characters_in_names_and_targets_are_rejected_by_name(
    tmp_path: Path, char: str, named: str
) -> None:
    for name in (f"journal.md{char}", f"organism{char}.el", f"dir{char}/file", char):
        reason = rejection(build(body(), regular(name, b"x")), tmp_path / "dest")
        # The name as shown escapes the character: the reason itself reads unambiguously.
        assert reason == f"member {shown(name.encode())}: {named} in the name"
    reason = rejection(build(body(), link("l", f"real{char}.el")), tmp_path / "dest")
    assert reason == f"member 'l': {named} in the symlink target"


def test_visible_non_ascii_names_are_kept(tmp_path: Path) -> None:
    names = ["é.el", "日本語/ノート.txt", "a b.txt", "Ω≈ç√.el"]
    archive = build(body(), *(regular(name, b"x") for name in names), link("l", "Ω/ノート"))
    assert sorted(decode(archive, tmp_path / "dest")) == sorted([*names, "l", "organism.el"])


def test_a_decomposed_name_beside_its_composed_twin_is_rejected(tmp_path: Path) -> None:
    archive = build(body(), regular("café.el", b"x"), regular("cafe\u0301.el", b"y"))
    assert rejection(archive, tmp_path / "dest") == (
        "member 'cafe\u0301.el': the name is not in Unicode's composed form (NFC), so it "
        "would read as 'café.el'; write it composed"
    )


# --- the body --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("members", "reason"),
    [
        ([regular("other.el", b"x")], "organism.el is missing"),
        ([regular("sub/organism.el", b"x")], "organism.el is missing"),
        (
            [regular("real.el", b"x"), link("organism.el", "real.el")],
            "organism.el is a symlink to 'real.el'",
        ),
        ([link("organism.el", "/etc/passwd")], "organism.el is a symlink to '/etc/passwd'"),
        ([directory("organism.el")], "organism.el is a directory"),
        ([regular("organism.el/inner.el", b"x")], "organism.el is a directory"),
    ],
)
def test_a_result_without_a_regular_organism_el_is_rejected_naming_what_it_is(
    tmp_path: Path, members: list[tuple[tarfile.TarInfo, bytes]], reason: str
) -> None:
    assert rejection(build(directory("./"), *members), tmp_path / "dest") == (
        f"{reason}: a result must hold the body the next life loads as a regular file"
    )


def test_organism_el_of_any_other_type_is_rejected_as_that_member(tmp_path: Path) -> None:
    for member, what in (
        (special("organism.el", tarfile.FIFOTYPE), "a FIFO"),
        (link("organism.el", "real.el", kind=tarfile.LNKTYPE), "a hard link"),
    ):
        archive = build(regular("real.el", b"x"), member)
        assert rejection(archive, tmp_path / "dest").startswith(f"member 'organism.el': {what}")


def test_an_executable_organism_el_is_a_regular_file(tmp_path: Path) -> None:
    entries = decode(build(regular("organism.el", b"(body)\n", mode=0o755)), tmp_path / "dest")
    assert entries["organism.el"].kind == "file" and entries["organism.el"].executable


# --- through a real life ---------------------------------------------------------------


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
def test_a_bidi_name_written_by_a_life_is_a_decoder_rejection_naming_it(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    make_lineage(
        fleet,
        "spoofer",
        "(let ((file-name-coding-system 'utf-8))\n"
        '  (with-temp-file "/work/gnp.\\u202etxt.el" (insert "shows as gnp.le.txt")))\n',
    )
    run_one(fleet, "spoofer")
    assert fleet.subjects("spoofer")[0] == "gen 1: died (exit 0); staged writes discarded"
    observation = fleet.observation("spoofer", 1)
    assert observation["outcome"] == "decoder_rejection"
    assert observation["rejection_reason"] == (
        "member './gnp.\\u202etxt.el': U+202E RIGHT-TO-LEFT OVERRIDE in the name"
    )
    assert fleet.files("spoofer") == [".ouroboros-lineage.json", "journal.md", "organism.el"]


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
@pytest.mark.parametrize(("char", "named"), LOOK_ALIKES)
def test_a_look_alike_name_written_by_a_life_is_a_decoder_rejection_naming_it(
    tmp_path: Path, char: str, named: str
) -> None:
    """A life forging a second journal.md (the kernel's own journal, shown by the web UI
    and the CLI) dies, and the lineage's tree keeps only the kernel's files."""
    fleet = Fleet(tmp_path)
    make_lineage(
        fleet,
        "forger",
        "(let ((file-name-coding-system 'utf-8))\n"
        f'  (with-temp-file "/work/journal.md\\u{ord(char):04x}" (insert "# forged journal")))\n',
    )
    run_one(fleet, "forger")
    assert fleet.subjects("forger")[0] == "gen 1: died (exit 0); staged writes discarded"
    observation = fleet.observation("forger", 1)
    assert observation["outcome"] == "decoder_rejection"
    assert observation["rejection_reason"] == (
        f"member {shown(('./journal.md' + char).encode())}: {named} in the name"
    )
    assert fleet.files("forger") == [".ouroboros-lineage.json", "journal.md", "organism.el"]
