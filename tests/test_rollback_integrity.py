"""Rollback integrity: a lineage never loses the body its next life loads.

A life that exits 0 after making organism.el a symlink, deleting it or making it a
directory is a decoder_rejection death, and organism.el stays a regular 100644 file
holding the body that lived. A lineage recorded before that rule, whose parent holds
organism.el as a symlink, a directory, an executable or not at all, is repaired by its
next death. A file beside the body (organism.el.elc, organism.el.el) is never loaded in
its place. Every tree a death or a life leaves unpacks into the next life's /work: a
body put back where the parent's other files leave it no room comes back with the files
it lived with, and a tree the stage cannot unpack is never given to life after life.
Lives run on real bwrap, Emacs, git and cgroups; the history walk of
``LineageCache.last_body`` is also checked on histories built with git plumbing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.fleet import Fleet
from support.lives import make_lineage, push_hand_commit, run_one

from worker.instrument.gitrepo import PAGE_BYTES, Entry, LineageCache, footprint
from worker.instrument.journal import DEATH_SUBJECT
from worker.instrument.names import ORGANISM_PATH

GOOD = '(message "alive")\n'
REJECTED = ": a result must hold the body the next life loads as a regular file"
TRICKS = {
    "symlink": (
        '(rename-file "/work/organism.el" "/work/real.el")\n'
        '(make-symbolic-link "real.el" "/work/organism.el")\n',
        "organism.el is a symlink to 'real.el'",
    ),
    "deleted": ('(delete-file "/work/organism.el")\n', "organism.el is missing"),
    "directory": (
        '(delete-file "/work/organism.el")\n(make-directory "/work/organism.el")\n',
        "organism.el is a directory",
    ),
}


def organism_at_head(fleet: Fleet, lineage: str) -> tuple[str, str]:
    """The mode and text of organism.el at the lineage's head, which must be a blob."""
    listing = fleet.git("ls-tree", f"lineage-{lineage}", ORGANISM_PATH)
    mode, kind, sha = listing.partition("\t")[0].split()
    assert kind == "blob", listing
    assert not any(path.startswith(f"{ORGANISM_PATH}/") for path in fleet.files(lineage))
    return mode, fleet.git("cat-file", "blob", sha)


def generations(fleet: Fleet, lineage: str) -> int:
    return sum(subject.startswith("gen ") for subject in fleet.subjects(lineage))


def assert_next_life_is_ordinary(fleet: Fleet, lineage: str) -> None:
    generation = generations(fleet, lineage) + 1
    run_one(fleet, lineage)
    assert fleet.subjects(lineage)[0] == f"gen {generation}: no-change"
    observation = fleet.observation(lineage, generation)
    assert (observation["outcome"], observation["exit_status"]) == ("no-change", 0)


# --- a life cannot publish a tree without a regular organism.el --------------------------


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
@pytest.mark.parametrize("trick", sorted(TRICKS))
def test_a_life_that_unmakes_its_body_dies_and_the_body_that_lived_stays(
    tmp_path: Path, trick: str
) -> None:
    fleet = Fleet(tmp_path)
    make_lineage(fleet, "trickster", GOOD)
    lived = fleet.show("trickster", ORGANISM_PATH)
    code, reason = TRICKS[trick]
    push_hand_commit(fleet, "trickster", {ORGANISM_PATH: lived + code}, f"external edit: {trick}")
    run_one(fleet, "trickster")
    assert fleet.subjects("trickster")[0] == "gen 1: died (exit 0); staged writes discarded"
    observation = fleet.observation("trickster", 1)
    assert observation["outcome"] == "decoder_rejection"
    assert observation["exit_status"] == 0
    assert observation["rejection_reason"] == reason + REJECTED
    assert organism_at_head(fleet, "trickster") == ("100644", lived)
    assert "real.el" not in fleet.files("trickster")
    assert_next_life_is_ordinary(fleet, "trickster")


# --- a file beside the body is never loaded in its place ---------------------------------

# Each would be loaded instead of organism.el by `emacs -l /work/organism.el`, and each
# kills the life that loads it. Contents are Emacs Lisp string literals.
SHADOWS = {
    "organism.el.elc": ";ELC\\034\\0\\0\\0\\n(kill-emacs 7)\\n",
    "organism.el.el": "(kill-emacs 8)\\n",
    "organism.el.el.gz": "not gzip at all\\n",
}
SHADOWING = (
    # Raw bytes, never compressed by jka-compr on the way out.
    "(let ((coding-system-for-write 'no-conversion) (file-name-handler-alist nil))\n"
    + "".join(f'  (write-region "{text}" nil "/work/{name}")\n' for name, text in SHADOWS.items())
    + ")\n"
    + '(message "organism.el ran")\n'
)


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
def test_a_shadow_beside_the_body_is_an_ordinary_file_never_loaded(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    make_lineage(fleet, "shadowed", SHADOWING)
    run_one(fleet, "shadowed")
    assert fleet.subjects("shadowed")[0] == "gen 1: changed (organism unchanged; 3 other paths)"
    assert set(SHADOWS) <= set(fleet.files("shadowed"))
    assert fleet.show("shadowed", "organism.el.el") == SHADOWS["organism.el.el"].replace(
        "\\n", "\n"
    )
    # The next life loads organism.el, which writes the same shadows again: no change.
    assert_next_life_is_ordinary(fleet, "shadowed")
    assert "organism.el ran" in str(fleet.observation("shadowed", 2)["stderr"])


# Plants, where an Emacs with HOME=/work would look for its native-compilation cache
# before it loads organism.el, a broken .eln for a library that start-up itself loads.
ELN_SHADOW = """
(when (featurep 'native-compile)
  (let* ((source (locate-file "regexp-opt" load-path '(".el" ".el.gz")))
         (eln (file-name-nondirectory (comp-el-to-eln-filename source)))
         (dir (expand-file-name comp-native-version-dir "/work/.emacs.d/eln-cache/")))
    (make-directory dir t)
    (unless (file-symlink-p (expand-file-name eln dir))
      (make-symbolic-link "/dev/null" (expand-file-name eln dir)))))
(message "home %s, first eln dir %s" (getenv "HOME")
         (and (boundp 'native-comp-eln-load-path) (car native-comp-eln-load-path)))
"""


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
def test_an_emacs_cache_planted_under_work_is_never_loaded_by_a_later_life(
    tmp_path: Path,
) -> None:
    fleet = Fleet(tmp_path)
    make_lineage(fleet, "planted", ELN_SHADOW)
    run_one(fleet, "planted")
    stderr = str(fleet.observation("planted", 1)["stderr"])
    assert "home /tmp," in stderr and "/work" not in stderr.split("first eln dir")[1]
    assert_next_life_is_ordinary(fleet, "planted")


# --- a death repairs a lineage recorded before the rule ---------------------------------


def legacy_commits(
    cache: LineageCache, lived: bytes, state: str
) -> list[tuple[str, dict[str, Entry]]]:
    """(subject, organism paths) of the commits that left a lineage in ``state``."""

    def blob(mode: str, data: bytes) -> Entry:
        return Entry(mode, cache.hash_bytes(data))

    return {
        # A life left a dangling symlink and lived; the next died, and the rollback of
        # the time kept the symlink's mode, storing the body that lived as its target.
        "symlink": [
            ("gen 1: changed (organism +1/-2; 1 paths)", {ORGANISM_PATH: blob("120000", b"gone")}),
            (
                "gen 2: died (exit 255); staged writes discarded",
                {ORGANISM_PATH: blob("120000", lived)},
            ),
        ],
        "missing": [("gen 1: changed (organism +0/-2; 1 paths)", {})],
        "directory": [
            (
                "gen 1: changed (organism +0/-2; 2 paths)",
                {f"{ORGANISM_PATH}/inner.el": blob("100644", b'(message "inner")\n')},
            )
        ],
        "executable": [
            (
                "external edit: lethal, executable",
                {ORGANISM_PATH: blob("100755", lived + b"(kill-emacs 9)\n")},
            )
        ],
    }[state]


def push_legacy_commits(fleet: Fleet, lineage: str, state: str) -> None:
    """Commit a legacy state on the lineage branch with git plumbing, as an old fleet did."""
    cache = LineageCache(fleet.repo, str(fleet.repo))
    ref = f"refs/heads/lineage-{lineage}"
    start = head = cache.rev(ref)
    lived = cache.read_blob(head, ORGANISM_PATH)
    assert lived is not None
    for subject, organism in legacy_commits(cache, lived, state):
        kept = {
            path: entry
            for path, entry in cache.tree(head).items()
            if path != ORGANISM_PATH and not path.startswith(f"{ORGANISM_PATH}/")
        }
        head = cache.commit(head, {**kept, **organism}, subject)
    fleet.git("update-ref", ref, head, start)


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
@pytest.mark.parametrize("state", ["symlink", "missing", "directory", "executable"])
def test_a_death_on_a_legacy_parent_restores_a_regular_body(tmp_path: Path, state: str) -> None:
    fleet = Fleet(tmp_path)
    make_lineage(fleet, "legacy", GOOD)
    lived = fleet.show("legacy", ORGANISM_PATH)
    push_legacy_commits(fleet, "legacy", state)
    generation = generations(fleet, "legacy") + 1
    run_one(fleet, "legacy")
    assert fleet.subjects("legacy")[0].startswith(f"gen {generation}: died (exit ")
    assert fleet.observation("legacy", generation)["outcome"] == "process_exit"
    assert organism_at_head(fleet, "legacy") == ("100644", lived)
    assert_next_life_is_ordinary(fleet, "legacy")


# --- last_body: the last body that was a regular file ---------------------------------


@pytest.fixture
def cache(tmp_path: Path) -> LineageCache:
    return LineageCache(tmp_path / "cache", str(tmp_path / "remote"))


def history(cache: LineageCache, *commits: tuple[str, str | None, bytes]) -> str:
    """Commit each (subject, organism.el mode or None for absent, content) in turn."""
    head: str | None = None
    for subject, mode, data in commits:
        entries = {"journal.md": Entry("100644", cache.hash_bytes(b""))}
        if mode == "040000":
            entries[f"{ORGANISM_PATH}/inner.el"] = Entry("100644", cache.hash_bytes(data))
        elif mode is not None:
            entries[ORGANISM_PATH] = Entry(mode, cache.hash_bytes(data))
        head = cache.commit(head, entries, subject)
    assert head is not None
    return head


def body_before(cache: LineageCache, head: str) -> bytes | None:
    """The bytes of the body a death at ``head`` restores (``last_body``), if any."""
    body = cache.last_body(head, ORGANISM_PATH, DEATH_SUBJECT)
    return body.data if body is not None else None


SEED = ("seed", "100644", b"(seed)\n")


def test_the_rule_is_kept_for_regular_bodies(cache: LineageCache) -> None:
    first = ("gen 1: changed (organism +1/-1; 1 paths)", "100644", b"(first)\n")
    second = ("gen 2: changed (organism +1/-1; 1 paths)", "100644", b"(second)\n")
    assert body_before(cache, history(cache, SEED, first, second)) == b"(first)\n"
    # A death after a rollback never restores the body that died before it.
    rolled = ("gen 2: died (exit 9); staged writes discarded", "100644", b"(seed)\n")
    assert body_before(cache, history(cache, SEED, first, rolled)) == b"(seed)\n"
    # An executable body is a regular file, and a body all the same.
    executable = ("gen 1: changed (organism +1/-1; 1 paths)", "100755", b"(first)\n")
    assert body_before(cache, history(cache, SEED, executable, second)) == b"(first)\n"


def test_a_symlink_or_missing_body_is_passed_over(cache: LineageCache) -> None:
    linked = ("gen 1: changed (organism +1/-1; 1 paths)", "120000", b"gone")
    died = ("gen 2: died (exit 255); staged writes discarded", "120000", b"(seed)\n")
    assert body_before(cache, history(cache, SEED, linked, died)) == b"(seed)\n"
    missing = ("gen 1: changed (organism +0/-1; 1 paths)", None, b"")
    assert body_before(cache, history(cache, SEED, missing)) == b"(seed)\n"


def test_the_walk_goes_back_to_the_last_regular_body(cache: LineageCache) -> None:
    head = history(
        cache,
        SEED,
        ("gen 1: changed (organism +1/-1; 1 paths)", "100644", b"(first)\n"),
        ("gen 2: changed (organism +1/-1; 2 paths)", "040000", b"(inner)\n"),
        ("gen 3: changed (organism +1/-0; 2 paths)", "120000", b"elsewhere.el"),
        ("gen 4: changed (organism +0/-1; 1 paths)", None, b""),
        ("gen 5: died (exit 255); staged writes discarded", "120000", b"(first)\n"),
    )
    assert body_before(cache, head) == b"(first)\n"


def test_without_any_earlier_regular_body_the_seed_is_the_answer(cache: LineageCache) -> None:
    assert body_before(cache, history(cache, SEED)) == b"(seed)\n"
    lost = ("gen 1: died (exit 255); staged writes discarded", None, b"")
    assert body_before(cache, history(cache, SEED, lost)) == b"(seed)\n"
    linked = ("gen 1: died (exit 255); staged writes discarded", "120000", b"(seed)\n")
    assert body_before(cache, history(cache, SEED, linked)) == b"(seed)\n"
    # Only a root that holds no regular organism.el (no lineage init made) has none.
    assert body_before(cache, history(cache, ("seed", "120000", b"elsewhere.el"))) is None


# --- every tree a death or a life leaves unpacks into the next life's /work ---------------

SMALL_WORK = ["--work-bytes", "8M"]
# Gen 1 pads this body to ~5 MB; gen 2 swaps it for a small lethal body and a ~5 MB file;
# gen 3 dies. The padded body put back beside that file would need ~10 MB of an 8 MB
# /work; it comes back with the tree it lived in instead, and runs again.
HOARDER = r"""
(let ((generation (with-temp-buffer
                    (insert-file-contents "/kernel/lineage.json")
                    (re-search-forward "\"generation\": \\([0-9]+\\)")
                    (string-to-number (match-string 1)))))
  (cond
   ((= generation 1)
    (let ((self (with-temp-buffer (insert-file-contents "/work/organism.el") (buffer-string))))
      (with-temp-file "/work/organism.el"
        (insert self)
        (dotimes (_ 5000) (insert ";" (make-string 999 ?p) "\n")))))
   ((= generation 2)
    (with-temp-file "/work/organism.el" (insert "(kill-emacs 1)\n"))
    (with-temp-file "/work/big.bin" (insert (make-string 5000000 ?b))))
   (t (message "generation %d: the padded body runs" generation))))
"""


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
def test_a_body_without_room_beside_the_parents_files_comes_back_with_its_own(
    tmp_path: Path,
) -> None:
    fleet = Fleet(tmp_path)
    make_lineage(fleet, "hoarder", HOARDER, *SMALL_WORK)
    for _ in range(3):
        run_one(fleet, "hoarder")
    third, second, first = fleet.subjects("hoarder")[:3]
    assert third == "gen 3: died (exit 1); staged writes discarded"
    assert second.startswith("gen 2: changed (organism +1/-") and second.endswith("; 2 paths)")
    assert first == "gen 1: changed (organism +5000/-0; 1 paths)"
    padded = fleet.show("hoarder", ORGANISM_PATH, "~2")
    assert len(padded) > 5_000_000
    # The rollback restores the tree the padded body lived in: big.bin goes with gen 2.
    assert organism_at_head(fleet, "hoarder") == ("100644", padded)
    assert sorted(fleet.files("hoarder")) == [
        ".ouroboros-lineage.json",
        "journal.md",
        ORGANISM_PATH,
    ]
    assert "## gen 3 — died — " in fleet.show("hoarder", "journal.md")
    run_one(fleet, "hoarder")
    assert fleet.subjects("hoarder")[0] == "gen 4: no-change"
    observation = fleet.observation("hoarder", 4)
    assert (observation["outcome"], observation["exit_status"]) == ("no-change", 0)
    assert "generation 4: the padded body runs" in str(observation["stderr"])


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
def test_a_tree_the_stage_cannot_unpack_kills_one_life_not_every_life(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    make_lineage(fleet, "unpackable", GOOD)
    # A hand commit adds a name no file system takes (a component over 255 bytes): git
    # stores it, tar cannot create it, so the stage exits 70 before the organism runs.
    cache = LineageCache(fleet.repo, str(fleet.repo))
    ref = "refs/heads/lineage-unpackable"
    head = cache.rev(ref)
    tree = cache.tree(head)
    tree[f"notes/{'n' * 300}"] = Entry("100644", cache.hash_bytes(b"unreachable\n"))
    fleet.git("update-ref", ref, cache.commit(head, tree, "external edit: a long name"), head)
    run_one(fleet, "unpackable")
    assert fleet.subjects("unpackable")[0] == "gen 1: died (exit 70); staged writes discarded"
    assert fleet.observation("unpackable", 1)["outcome"] == "process_exit"
    assert "stage: cannot unpack /kernel/base.tar" in fleet.show("unpackable", "journal.md")
    # Not the tree it could not start from: the seed's, where the body last lived.
    assert not any(path.startswith("notes/") for path in fleet.files("unpackable"))
    assert_next_life_is_ordinary(fleet, "unpackable")


# Files of 4,097 bytes written sparse (one page each in /work) unpack dense (two pages).
SPARSE = (
    '(make-directory "/work/sparse")\n'
    '(dotimes (i 1100) (write-region "x" nil (format "/work/sparse/%04d" i) 4096))\n'
)


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
def test_a_result_that_would_not_unpack_dense_is_refused(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    make_lineage(fleet, "sparse", GOOD, *SMALL_WORK)
    seed = fleet.show("sparse", ORGANISM_PATH)
    push_hand_commit(fleet, "sparse", {ORGANISM_PATH: seed + SPARSE}, "external edit: sparse")
    run_one(fleet, "sparse")
    assert fleet.subjects("sparse")[0] == "gen 1: died (exit 0); staged writes discarded"
    observation = fleet.observation("sparse", 1)
    assert observation["outcome"] == "decoder_rejection"
    reason = str(observation["rejection_reason"])
    assert reason.startswith("the tree would take ") and reason.endswith(
        f"more than the work_bytes limit {8 * 1024**2}"
    )
    assert not any(path.startswith("sparse/") for path in fleet.files("sparse"))
    assert organism_at_head(fleet, "sparse") == ("100644", seed)
    assert_next_life_is_ordinary(fleet, "sparse")


# --- the footprint of a tree and where a body lived, on git plumbing -----------------------


def test_the_footprint_counts_whole_pages_and_what_the_decoder_counts() -> None:
    page = PAGE_BYTES
    found = footprint(
        [
            ("organism.el", "100644", 1),
            ("a/b/data.bin", "100755", page + 1),
            ("a/link", "120000", 9),
            ("empty", "100644", 0),
            ("module", "160000", 0),
        ]
    )
    # Pages: 1 + 2 + 0 for the files, 1 for the symlink, 2 for the directories a, a/b.
    assert found == (4, page + 2, 6 * page)
    assert found.fits(6 * page, 4)
    assert not found.fits(6 * page - 1, 4)
    assert not found.fits(6 * page, 3)


def test_the_body_put_back_knows_the_tree_it_lived_in(cache: LineageCache) -> None:
    first = ("gen 1: changed (organism +1/-1; 1 paths)", "100644", b"(first)\n")
    second = ("gen 2: changed (organism +1/-1; 1 paths)", "100644", b"(second)\n")
    head = history(cache, SEED, first, second)
    body = cache.last_body(head, ORGANISM_PATH, DEATH_SUBJECT)
    assert body is not None
    assert (body.data, body.lived_in) == (b"(first)\n", cache.rev(f"{head}~1"))
    assert cache.read_blob(body.lived_in, ORGANISM_PATH) == b"(first)\n"
    # The seed body lived in the root.
    seed = cache.last_body(history(cache, SEED, first), ORGANISM_PATH, DEATH_SUBJECT)
    assert seed is not None
    assert seed.data == b"(seed)\n"
    assert seed.lived_in == cache.root_of(seed.lived_in)
    # Passing over a symlink, the body is the last regular one and its tree the one before.
    linked = ("gen 3: changed (organism +1/-1; 1 paths)", "120000", b"gone")
    died = ("gen 4: died (exit 255); staged writes discarded", "120000", b"(second)\n")
    head = history(cache, SEED, first, second, linked, died)
    body = cache.last_body(head, ORGANISM_PATH, DEATH_SUBJECT)
    assert body is not None
    assert (body.data, body.lived_in) == (b"(second)\n", cache.rev(f"{head}~2"))
