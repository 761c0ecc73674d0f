"""Footprint budgets: what a lineage may leave on the fleet's shared storage.

A generation whose tree would add more than ``generation_repo_bytes`` to the shared
repository, or take the lineage past ``lineage_repo_bytes`` in all, dies
``footprint_exceeded``, is rolled back like any death, and adds none of its objects.
Calls the model never saw keep their text under a small cap of their own, and an
observation never exceeds OBSERVATION_MAX_BYTES. Lives run on real bwrap, Emacs, git
and cgroups; the refused calls on a real model socket.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pygit2
import pytest
from support.browse import Served, sample_observation
from support.fleet import Fleet
from support.lives import make_lineage, push_hand_commit, run_one
from support.model import CONTEXT, DoubleProvider, request

from worker.instrument import growth
from worker.instrument.decoder import TreeEntry
from worker.instrument.lineage import LineageMetadata
from worker.instrument.model import limits
from worker.instrument.model.server import ModelSocket
from worker.instrument.names import ORGANISM_PATH
from worker.instrument.observation_bound import (
    ERROR_CHARS,
    OBSERVATION_MAX_BYTES,
    bounded,
    size,
)
from worker.instrument.physics import GENERATION_REPO_BYTES, LINEAGE_REPO_BYTES, Physics
from worker.instrument.records import STDERR_CUT_MARK, Observation

GOOD = '(message "alive")\n'
DIED = "gen {}: died (exit 0); staged writes discarded"


def noise(size: int) -> str:
    """Elisp that writes ``size`` random bytes to a new file under /work."""
    return (
        '(call-process "head" "/dev/urandom" '
        '(list :file (format "/work/noise-%d" (random 1000000000))) nil '
        f'"-c" "{size}")\n'
    )


def objects_bytes(repo: Path) -> int:
    """What the shared repository's objects take on disk."""
    du = subprocess.run(
        ["du", "-sb", str(repo / "objects")], capture_output=True, text=True, check=True
    )
    return int(du.stdout.split()[0])


def message(fleet: Fleet, lineage: str) -> str:
    return fleet.git("log", "-1", "--format=%B", f"lineage-{lineage}").rstrip("\n")


def noise_files(fleet: Fleet, lineage: str) -> list[str]:
    return [path for path in fleet.files(lineage) if path.startswith("noise-")]


# --- the budgets in real lives -----------------------------------------------------------


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
def test_a_generation_over_the_default_budget_dies_and_adds_nothing_to_the_repository(
    tmp_path: Path,
) -> None:
    fleet = Fleet(tmp_path)
    make_lineage(fleet, "hoarder", GOOD)
    lived = fleet.show("hoarder", ORGANISM_PATH)
    body = lived + noise(GENERATION_REPO_BYTES + 1024**2)
    push_hand_commit(fleet, "hoarder", {ORGANISM_PATH: body}, "external edit: hoard")
    before = objects_bytes(fleet.repo)

    run_one(fleet, "hoarder")

    assert fleet.subjects("hoarder")[0] == DIED.format(1)
    observation = fleet.observation("hoarder", 1)
    assert observation["outcome"] == "footprint_exceeded"
    reason = str(observation["rejection_reason"])
    assert reason.startswith("the tree would add ")
    assert reason.endswith(f"more than the generation_repo_bytes budget {GENERATION_REPO_BYTES}")
    assert (observation["repo_bytes"], observation["lineage_repo_bytes"]) == (0, 0)
    # 9 MiB of random data does not compress: had it been stored, the objects grew by it.
    assert objects_bytes(fleet.repo) - before < 1024**2
    assert noise_files(fleet, "hoarder") == []
    # Rolled back like any death: the body before the hoarding one, which lives on.
    assert fleet.show("hoarder", ORGANISM_PATH) == lived
    assert reason in fleet.show("hoarder", "journal.md")
    assert message(fleet, "hoarder").endswith(f"\n\n{growth.TRAILER}: 0")
    run_one(fleet, "hoarder")
    assert fleet.subjects("hoarder")[0] == "gen 2: no-change"


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
def test_a_lineage_reaches_its_total_over_several_generations_and_then_grows_no_more(
    tmp_path: Path,
) -> None:
    fleet = Fleet(tmp_path)
    chunk = 600 * 1024
    make_lineage(
        fleet, "grower", GOOD, "--generation-repo-bytes", "1M", "--lineage-repo-bytes", "2M"
    )
    body = fleet.show("grower", ORGANISM_PATH) + noise(chunk)
    push_hand_commit(fleet, "grower", {ORGANISM_PATH: body}, "external edit: grow")
    each = growth.object_bytes(chunk)

    for _ in range(4):
        run_one(fleet, "grower")

    totals = []
    for generation in (1, 2, 3):
        observation = fleet.observation("grower", generation)
        assert observation["outcome"] == "changed"
        assert observation["repo_bytes"] == each
        totals.append(observation["lineage_repo_bytes"])
    assert totals == [each, 2 * each, 3 * each]
    died = fleet.observation("grower", 4)
    assert died["outcome"] == "footprint_exceeded"
    assert died["rejection_reason"] == (
        "the tree would bring what the lineage added to the shared repository to "
        f"{4 * each} bytes, more than the lineage_repo_bytes budget {2 * 1024**2}"
    )
    assert died["lineage_repo_bytes"] == 3 * each
    assert fleet.subjects("grower")[0] == DIED.format(4)
    assert len(noise_files(fleet, "grower")) == 3
    assert message(fleet, "grower").endswith(f"\n\n{growth.TRAILER}: {3 * each}")
    # The read side tells of it: status counts the death, the web shows why and how much.
    (row,) = json.loads(fleet.ok("status", "--json").stdout)
    assert (row["lineage"], row["deaths"], row["last_outcome"]) == (
        "grower",
        1,
        "footprint_exceeded",
    )
    served = Served(fleet, tmp_path / "serve.log")
    try:
        page = served.get("/lineages/grower/generations/4").text
        assert "footprint_exceeded" in page and "lineage_repo_bytes budget" in page
        page = served.get("/lineages/grower/generations/3").text
        assert f"{each} bytes added; the lineage's total {3 * each} of {2 * 1024**2}" in page
    finally:
        served.stop()


# A life that makes every call it may with the largest prompt the socket takes, each
# invalid UTF-8 and so refused 400 before any reservation: free to the organism.
REFUSING = """
import socket
body = b"\\xff" * {size}
head = b"POST /generate HTTP/1.1\\r\\nHost: k\\r\\nContent-Length: %d\\r\\n\\r\\n" % len(body)
for _ in range({calls}):
    client = socket.socket(socket.AF_UNIX)
    client.connect("/kernel/model.sock")
    client.sendall(head + body)
    while client.recv(65536):
        pass
    client.close()
"""


def elisp_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
def test_a_life_of_a_thousand_free_calls_leaves_an_observation_of_a_few_megabytes(
    tmp_path: Path,
) -> None:
    fleet = Fleet(tmp_path)
    script = REFUSING.format(size=Physics().max_prompt_bytes, calls=limits.MAX_CALLS)
    body = f'(call-process "/usr/bin/python3" nil nil nil "-c" {elisp_string(script)})\n'
    make_lineage(fleet, "chatter", body, "--wall", "300", "--cpu-seconds", "300")

    run_one(fleet, "chatter")

    stored = fleet.observation_path("chatter", 1).stat().st_size
    observation = fleet.observation("chatter", 1)
    calls = observation["model_calls"]
    assert isinstance(calls, list) and len(calls) == limits.MAX_CALLS
    assert {call["status"] for call in calls} == {400}
    kept = sum(len(json.dumps(c["prompt"], ensure_ascii=False).encode()) for c in calls)
    assert 0 < kept <= limits.REFUSED_TEXT_BYTES
    # The life left 34.7 MB; the cap leaves its 1 MiB and a record per call.
    assert stored < limits.REFUSED_TEXT_BYTES + 2 * 1024**2


@pytest.mark.full
def test_a_budget_below_its_floor_is_refused_naming_the_option(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    refused = fleet.cli("init", "tiny", "--generation-repo-bytes", "1K")
    assert refused.returncode == 2
    assert "--generation-repo-bytes: " in refused.stderr and "65536" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert not (fleet.repo / "refs" / "heads" / "lineage-tiny").exists()


# --- the count -----------------------------------------------------------------------------


def test_an_object_counts_what_git_can_take_for_it_on_disk() -> None:
    assert growth.object_bytes(0) == growth.BLOCK_BYTES
    assert growth.object_bytes(4000) == growth.BLOCK_BYTES
    # zlib's worst case for incompressible data is a little over its size.
    assert growth.object_bytes(8 * 1024**2) == 8 * 1024**2 + growth.BLOCK_BYTES


def test_only_blobs_the_repository_lacks_count_and_each_once(tmp_path: Path) -> None:
    repo = pygit2.init_repository(str(tmp_path), bare=True)
    held = str(repo.create_blob(b"held"))
    new = str(pygit2.hash(b"x" * 5000))
    assert growth.new_bytes(repo, [(held, 4), (new, 5000), (new, 5000)]) == (
        growth.object_bytes(5000)
    )


def test_every_directory_counts_as_the_tree_git_writes_for_it(tmp_path: Path) -> None:
    """The count hashes each directory as git does (its sha is the one git stores), so a
    tree the repository holds is free and a new one counts."""
    files = {"a/b/c.txt": b"one", "a/b.d": b"two", "a/x": b"three", "top.el": b"four"}
    for path, data in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(data)
    decoded = [
        TreeEntry(path=p, kind="file", executable=p == "a/x", size=len(d), target=None)
        for p, d in files.items()
    ]
    decoded.append(TreeEntry(path="a/b/l", kind="symlink", executable=False, size=3, target="../x"))
    counted = dict(growth.tree_objects(decoded, tmp_path))
    repo = pygit2.init_repository(str(tmp_path / "repo"), bare=True)
    index = pygit2.Index()
    for entry in decoded:
        data = (entry.target or "").encode() if entry.kind == "symlink" else files[entry.path]
        mode = 0o120000 if entry.kind == "symlink" else 0o100755 if entry.executable else 0o100644
        index.add(pygit2.IndexEntry(entry.path, repo.create_blob(data), mode))
    root = repo[index.write_tree(repo)].peel(pygit2.Tree)
    a = root / "a"
    subtrees = {str(a.id), str((a.peel(pygit2.Tree) / "b").id)}
    assert subtrees <= counted.keys()  # the subtrees, as git wrote them; not the root
    assert str(root.id) not in counted
    assert growth.new_bytes(repo, counted.items()) == 0  # all held now


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
def test_a_tree_of_deep_unique_directories_counts_its_trees_and_dies_over_budget(
    tmp_path: Path,
) -> None:
    """One one-byte file (the same blob each time) at the end of each of 100 chains of 15
    unique 200-character directories: 1,500 trees, one 4 KiB blob (a hostile review saw
    250 MB of trees pass a 128 KiB lineage budget)."""
    fleet = Fleet(tmp_path)
    make_lineage(fleet, "nester", GOOD, "--generation-repo-bytes", "1M")
    lived = fleet.show("nester", ORGANISM_PATH)
    nest = (
        '(dotimes (i 100) (let ((dir (mapconcat (lambda (d) (format "%c%s%d-%d" ?d '
        '(make-string 190 ?x) i d)) (number-sequence 1 15) "/"))) '
        '(make-directory (concat "/work/" dir) t) '
        '(with-temp-file (concat "/work/" dir "/f") (insert "x"))))\n'
    )
    push_hand_commit(fleet, "nester", {ORGANISM_PATH: lived + nest}, "external edit: nest")
    before = objects_bytes(fleet.repo)

    run_one(fleet, "nester")

    observation = fleet.observation("nester", 1)
    assert observation["outcome"] == "footprint_exceeded", observation["rejection_reason"]
    assert "generation_repo_bytes budget 1048576" in str(observation["rejection_reason"])
    assert objects_bytes(fleet.repo) - before < 1024**2


def test_a_lineage_without_trailers_counts_from_zero_and_a_trailer_is_found_past_hand_commits(
    tmp_path: Path,
) -> None:

    repo = pygit2.init_repository(str(tmp_path), bare=True)
    signature = pygit2.Signature("t", "t@example.invalid")
    tree = repo.TreeBuilder().write()

    def commit(text: str, parents: list[pygit2.Oid]) -> pygit2.Oid:
        return repo.create_commit(None, signature, signature, text, tree, parents)

    seed = commit("seed\n", [])
    assert growth.recorded_total(repo, str(seed)) == 0
    gen = commit(f"gen 1: no-change\n\n{growth.trailer(12288)}\n", [seed])
    hand = commit("external edit\n\nRepository-Bytes: not a number\n", [gen])
    assert growth.recorded_total(repo, str(hand)) == 12288


def test_physics_pinned_before_the_budgets_reads_back_with_the_defaults() -> None:
    old = Physics().model_dump(mode="json")
    del old["generation_repo_bytes"], old["lineage_repo_bytes"]
    physics = Physics.model_validate(old)
    assert (physics.generation_repo_bytes, physics.lineage_repo_bytes) == (
        GENERATION_REPO_BYTES,
        LINEAGE_REPO_BYTES,
    )
    root = {
        "schema": "ouroboros-fleet-lineage/v1",
        "name": "old",
        "created_at": "2026-01-01T00:00:00Z",
        "instrument_fingerprint": "0" * 64,
        "instrument_version": "0.1.0",
        "instrument_commit": "0" * 40,
        "instrument_repository": "r",
        "instrument_ref": "main",
        "seed_sha256": "0" * 64,
        "physics": old,
    }
    assert LineageMetadata.model_validate_json(json.dumps(root)).physics == physics


# --- refused calls and the observation's size ------------------------------------------------


def test_a_thousand_refused_calls_with_the_largest_invalid_prompts_stay_under_the_caps(
    tmp_path: Path,
) -> None:
    physics = Physics()
    prompt = b"\xff" * physics.max_prompt_bytes
    provider = DoubleProvider()
    with ModelSocket(tmp_path / "model.sock", provider, physics, CONTEXT) as broker:
        statuses = {request(broker, prompt)[0] for _ in range(limits.MAX_CALLS)}
    assert statuses == {400}
    assert provider.asked == []
    calls = broker.calls
    assert len(calls) == limits.MAX_CALLS
    kept = [call for call in calls if not call.text_omitted]
    kept_bytes = sum(len(json.dumps(call.prompt, ensure_ascii=False).encode()) for call in kept)
    assert 0 < kept_bytes <= limits.REFUSED_TEXT_BYTES
    digest = hashlib.sha256(prompt).hexdigest()
    assert all(c.prompt_sha256 == digest and c.prompt_bytes == len(prompt) for c in calls)
    assert all(c.prompt == "" for c in calls if c.text_omitted)
    # What the issue saw as a 34.7 MB observation is now a few megabytes at most.
    observation = sample_observation("refused", 1, "a" * 40, "b" * 40, "no-change", NOW, "")
    observation = observation.model_copy(update={"model_calls": calls})
    assert size(observation) < limits.REFUSED_TEXT_BYTES + 2 * 1024**2


NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


def stuffed(calls: int, text: int, stderr: str = "") -> Observation:
    observation = sample_observation("big", 1, "a" * 40, "b" * 40, "no-change", NOW, stderr)
    (call,) = observation.model_calls
    made = [
        call.model_copy(update={"index": n, "prompt": f"{n}:" + "p" * text})
        for n in range(1, calls + 1)
    ]
    return observation.model_copy(update={"model_calls": made})


def test_an_observation_within_its_limit_is_kept_whole() -> None:
    observation = stuffed(3, 1000)
    assert bounded(observation) is observation


def test_over_its_limit_the_newest_calls_lose_their_text_first() -> None:
    observation = stuffed(10, 100_000)
    limit = 600_000
    cut = bounded(observation, limit)
    assert size(cut) <= limit < size(observation)
    omitted = [call.text_omitted for call in cut.model_calls]
    assert omitted == sorted(omitted) and omitted[0] is False and omitted[-1] is True
    assert cut.stderr == observation.stderr


def test_then_long_errors_then_stderr_are_cut_and_nothing_is_ever_over_the_limit() -> None:
    observation = stuffed(50, 10, stderr="e" * 500_000)
    long_error = "vendor said " + "x" * 50_000
    observation = observation.model_copy(
        update={
            "model_calls": [
                c.model_copy(update={"error": long_error}) for c in observation.model_calls
            ]
        }
    )
    cut = bounded(observation, 200_000)
    assert size(cut) <= 200_000
    assert all(c.error is not None and len(c.error) == ERROR_CHARS + 1 for c in cut.model_calls)
    assert cut.stderr == "e" * ERROR_CHARS + STDERR_CUT_MARK and cut.stderr_truncated
    with pytest.raises(ValueError, match="with every text cut"):
        bounded(observation, 1000)


def test_the_stated_limit_holds_a_full_audit_beside_a_full_stderr() -> None:
    # The audit's text cap and a whole stderr of control bytes (6 bytes each in JSON)
    # fit under the limit with room for every call's record.
    assert limits.AUDIT_TEXT_BYTES + 6 * 1024**2 + 8 * 1024**2 < OBSERVATION_MAX_BYTES
