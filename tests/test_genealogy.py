"""Forks without a sandbox, and genealogy wherever lineages are read: status, journal, API, pages.

The family is built from lineages that need no life to exist: the legacy sample
(imported, a root), forks of it two deep, and the hostile lineage whose generation
2 died, forked from that death. Refusals are checked for every way a fork can be
asked wrongly; each leaves the repository and the store as they were.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import NamedTuple

import pytest
from support.browse import Served, import_fixture, settings_of, write_hostile_lineage
from support.fleet import Fleet
from support.lives import push_hand_commit

from worker.fleet import embedded_redis

# Full tier: its lineages are made with the CLI and git.
pytestmark = pytest.mark.full


class Family(NamedTuple):
    """The forked family, with what the repository and store held before any fork."""

    fleet: Fleet
    revenant_output: str
    refs_before: list[str]
    objects_before: set[str]
    store_before: list[str]


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> Family:
    fleet = Fleet(tmp_path_factory.mktemp("genealogy"))
    import_fixture(fleet)
    write_hostile_lineage(settings_of(fleet))
    refs, objects = repository_state(fleet)
    store = store_listing(fleet)
    fleet.ok("fork", "kid", "--from", "sample@2", "--memory-max", "2G")
    fleet.ok("fork", "grandkid", "--from", "kid")
    revenant = fleet.ok("fork", "revenant", "--from", "xss@2").stdout
    fleet.ok("fork", "by-commit", "--from", f"sample@{commit_of(fleet, 'sample', 3)[:10]}")
    fleet.ok("fork", "by-seed", "--from", "sample@0")
    many = {f"file{n}.txt": "x\n" for n in range(20)}
    push_hand_commit(fleet, "by-seed", many, "external edit: twenty files")
    return Family(fleet, revenant, refs, objects, store)


@pytest.fixture(scope="module")
def served(family: Family) -> Iterator[Served]:
    server = Served(family.fleet, family.fleet.home / "serve.log")
    yield server
    server.stop()


def commit_of(fleet: Fleet, lineage: str, generation: int) -> str:
    for line in fleet.git("log", "--format=%H %s", f"lineage-{lineage}").splitlines():
        sha, subject = line.split(" ", 1)
        if subject.startswith(f"gen {generation}: "):
            return sha
    raise AssertionError(f"{lineage} has no generation {generation}")


def meta(fleet: Fleet, lineage: str) -> dict[str, object]:
    return json.loads(fleet.show(lineage, ".ouroboros-lineage.json"))


def repository_state(fleet: Fleet) -> tuple[list[str], set[str]]:
    objects = {str(p.relative_to(fleet.repo)) for p in (fleet.repo / "objects").rglob("*")}
    refs = fleet.git("for-each-ref", "--format=%(refname) %(objectname)").splitlines()
    return refs, {o for o in objects if (fleet.repo / o).is_file()}


def store_listing(fleet: Fleet) -> list[str]:
    return sorted(str(p.relative_to(fleet.observations)) for p in fleet.observations.rglob("*"))


def test_a_fork_of_an_imported_lineage_records_its_parent_and_takes_its_tree(
    family: Family,
) -> None:
    fleet = family.fleet
    parent = commit_of(fleet, "sample", 2)
    kid = meta(fleet, "kid")
    assert kid["parent"] == {"lineage": "sample", "commit": parent, "generation": 2}
    # An imported parent pins no physics: the defaults, with the option given.
    assert kid["physics"]["memory_max_bytes"] == 2 * 1024**3
    assert kid["physics"]["wall_seconds"] == 600
    assert fleet.subjects("kid") == ["seed"]
    assert fleet.show("kid", "journal.md") == ""
    parent_files = set(fleet.git("ls-tree", "-r", "--name-only", parent).splitlines())
    assert set(fleet.files("kid")) == parent_files | {".ouroboros-lineage.json"}
    assert fleet.show("kid", "organism.el") == fleet.git("show", f"{parent}:organism.el")
    # Its seed is a root of its own: numbering starts again at 1.
    assert fleet.git("rev-list", "--count", "lineage-kid").strip() == "1"
    grandkid = meta(fleet, "grandkid")
    assert grandkid["parent"]["lineage"] == "kid"
    assert grandkid["parent"]["generation"] == 0
    assert grandkid["parent"]["instrument_fingerprint"] == kid["instrument_fingerprint"]
    assert grandkid["physics"] == kid["physics"]


def test_a_fork_of_a_death_takes_the_body_its_rollback_restored(family: Family) -> None:
    fleet = family.fleet
    death = commit_of(fleet, "xss", 2)
    assert "xss generation 2 died: revenant starts from the body its rollback restored" in (
        family.revenant_output
    )
    assert fleet.show("revenant", "organism.el") == fleet.git("show", f"{death}:organism.el")
    assert meta(fleet, "revenant")["parent"]["instrument_fingerprint"] == "e" * 64
    assert "instrument: eeeeeeeeeeee v0.1.0 -> " in family.revenant_output


def test_forking_leaves_every_parent_untouched(family: Family) -> None:
    fleet = family.fleet
    refs, objects = repository_state(fleet)
    parents = ("lineage-sample ", "lineage-xss ")
    assert [r for r in refs if r.split("/")[-1].startswith(parents)] == family.refs_before
    assert family.objects_before <= objects  # objects are only ever added
    # Every record but the forks' own: their lineages' and their names' claims.
    touched = [
        p
        for p in store_listing(fleet)
        if not p.startswith(("lineages/", "claims/"))
        or p.split("/")[1].removesuffix(".json") in ("sample", "xss")
    ]
    assert touched == family.store_before


def test_a_fork_from_a_commit_id_and_from_the_seed(family: Family) -> None:
    fleet = family.fleet
    by_commit = meta(fleet, "by-commit")["parent"]
    assert by_commit == {
        "lineage": "sample",
        "commit": commit_of(fleet, "sample", 3),
        "generation": 3,
    }
    seed = fleet.git("rev-list", "--max-parents=0", "lineage-sample").strip()
    assert meta(fleet, "by-seed")["parent"] == {
        "lineage": "sample",
        "commit": seed,
        "generation": 0,
    }


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["nova", "--from", "absent"], "no lineage named absent"),
        (["nova", "--from", "sample@99"], "lineage sample has no generation 99"),
        (["nova", "--from", "sample@abcdef1234"], "lineage sample has no commit abcdef1234"),
        (["nova", "--from", "sample@two"], "give a generation number"),
        (["kid", "--from", "sample"], "lineage kid already exists"),
        (["Bad_Name", "--from", "sample"], "invalid lineage name"),
        (["nova", "--from", "sample", "--cpu-seconds", "1"], "under 1% of wall"),
        (["nova", "--from", "by-seed", "--work-files", "16"], "does not fit work_bytes"),
    ],
)
def test_fork_refusals_are_one_line_and_change_nothing(
    family: Family, args: list[str], needle: str
) -> None:
    fleet = family.fleet
    before = repository_state(fleet)[0]
    result = fleet.cli("fork", *args)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr
    assert repository_state(fleet)[0] == before
    assert not (fleet.observations / "lineages" / "nova").exists()


def test_status_and_journal_show_parent_ancestry_and_children(family: Family) -> None:
    fleet = family.fleet
    try:
        rows = {r["lineage"]: r for r in json.loads(fleet.ok("status", "--json").stdout)}
        table = fleet.ok("status", COLUMNS="300").stdout
    finally:
        embedded_redis.stop(settings_of(fleet))
    assert rows["sample"]["genealogy"]["parent"] is None  # legacy: a root
    assert [c["lineage"] for c in rows["sample"]["genealogy"]["children"]][:1] == ["by-seed"]
    assert {"kid", "by-commit", "by-seed"} <= {
        c["lineage"] for c in rows["sample"]["genealogy"]["children"]
    }
    ancestry = rows["grandkid"]["genealogy"]["ancestry"]
    assert [(a["lineage"], a["generation"], a["present"]) for a in ancestry] == [
        ("kid", 0, True),
        ("sample", 2, True),
    ]
    assert ancestry[1]["instrument_fingerprint"] is None  # the imported root pinned none
    # A root's metadata has no parent field at all: it reads as roots always did.
    assert "parent" not in meta(fleet, "xss")
    assert rows["xss"]["genealogy"] == {
        "parent": None,
        "ancestry": [],
        "children": [
            {
                "lineage": "revenant",
                "generation": 2,
                "commit": commit_of(fleet, "xss", 2),
                "instrument_fingerprint": meta(fleet, "revenant")["instrument_fingerprint"],
                "instrument_version": "0.1.0",
            }
        ],
    }
    assert "forked from kid@0 (from sample@2)" in table
    journal = fleet.ok("journal", "kid").stdout
    assert "genealogy: forked from sample@2; children grandkid@0" in journal
    assert f"seeded from sample commit {commit_of(fleet, 'sample', 2)}" in journal
    assert "genealogy: children revenant@2" in fleet.ok("journal", "xss").stdout
    legacy = fleet.ok("journal", "sample").stdout
    assert "genealogy: children by-seed@0, kid@2, by-commit@3\n" in legacy


def test_api_and_pages_show_genealogy_and_link_the_exact_parent_generation(
    served: Served,
) -> None:
    kid = served.get("/api/lineages/kid").json()
    assert kid["genealogy"]["parent"]["lineage"] == "sample"
    assert kid["parent_url"] == "/lineages/sample/generations/2"
    assert [c["lineage"] for c in kid["genealogy"]["children"]] == ["grandkid"]
    assert kid["summary"]["parent"]["generation"] == 2
    assert kid["summary"]["children"] == ["grandkid"]
    sample = served.get("/api/lineages/sample").json()
    assert sample["genealogy"]["parent"] is None and sample["parent_url"] is None
    # A fork of the seed (no generation page) links the parent's lineage page.
    assert served.get("/api/lineages/grandkid").json()["parent_url"] == "/lineages/kid"
    page = served.get("/lineages/kid").text
    assert '<a href="/lineages/sample/generations/2">sample generation 2</a>' in page
    assert '<a href="/lineages/grandkid">grandkid</a>' in page
    assert "nothing: a root lineage" in served.get("/lineages/sample").text
    overview = {s["name"]: s for s in served.get("/api/").json()["lineages"]}
    assert overview["grandkid"]["parent"]["lineage"] == "kid"
    seed = overview["sample"]["seed_sha256"]
    members = [s["name"] for s in served.get(f"/api/families/{seed}").json()["lineages"]]
    assert {"sample", "by-seed", "kid", "grandkid", "by-commit"} <= set(members)
    assert "xss" not in members and "revenant" not in members
    family_page = served.get(f"/families/{seed}").text
    assert "<td>kid@0</td>" in family_page and "<td>sample@2</td>" in family_page
