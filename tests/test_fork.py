"""Forks of lineages that really lived, continued by ``run --local`` on real bwrap and cgroups.

A fork from the head, from an old generation, from a commit, with overridden
physics, from a real death, and across a changed instrument: a second snapshot
of the package whose staging runner differs (so its fingerprint does) and whose
commit is another, which cannot continue the parent but carries its fork forward
with the step between the two instruments on the record.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.fleet import SMALL_PHYSICS, Fleet, copy_instrument
from support.lives import push_hand_commit, run_one

from worker.fleet import embedded_redis
from worker.fleet.settings import Settings
from worker.instrument.fingerprint import PACKAGE_ROOT

pytestmark = [pytest.mark.bwrap, pytest.mark.cgroups, pytest.mark.root]

OTHER_COMMIT = "b" * 40


@pytest.fixture(scope="module")
def lived(tmp_path_factory: pytest.TempPathFactory) -> Fleet:
    """Lineage alpha with two generations under the instrument of this checkout."""
    fleet = Fleet(tmp_path_factory.mktemp("fork"))
    fleet.ok("init", "alpha", *SMALL_PHYSICS, "--budget-usd", "0.5")
    fleet.ok("run", "alpha", "--generations", "2", "--local")
    return fleet


def meta(fleet: Fleet, lineage: str) -> dict[str, object]:
    return json.loads(fleet.show(lineage, ".ouroboros-lineage.json"))


def commit(fleet: Fleet, rev: str) -> str:
    return fleet.git("rev-parse", rev).strip()


def tree_without_kernel_files(fleet: Fleet, rev: str) -> list[str]:
    listing = fleet.git("ls-tree", "-r", rev).splitlines()
    return sorted(line for line in listing if not line.endswith(("\tjournal.md", ".json")))


def test_a_fork_from_the_head_lives_on_under_the_parents_physics(lived: Fleet) -> None:
    head = commit(lived, "lineage-alpha")
    done = lived.ok("fork", "beta", "--from", "alpha").stdout
    assert "forked lineage beta (branch lineage-beta) from alpha generation 2" in done
    beta, alpha = meta(lived, "beta"), meta(lived, "alpha")
    assert beta["parent"] == {
        "lineage": "alpha",
        "commit": head,
        "generation": 2,
        "instrument_fingerprint": alpha["instrument_fingerprint"],
        "instrument_version": alpha["instrument_version"],
        "instrument_commit": alpha["instrument_commit"],
    }
    assert beta["physics"] == alpha["physics"]
    assert tree_without_kernel_files(lived, "lineage-beta") == tree_without_kernel_files(
        lived, "lineage-alpha"
    )
    assert lived.show("beta", "journal.md") == ""
    assert "beta gen 1: changed" in run_one(lived, "beta").stdout
    observation = lived.observation("beta", 1)
    assert observation["parent_commit"] == commit(lived, "lineage-beta~1")
    assert commit(lived, "lineage-alpha") == head  # the parent is untouched
    assert lived.observation_numbers("alpha") == [1, 2]


def test_forks_from_an_old_generation_and_from_a_commit(lived: Fleet) -> None:
    first = commit(lived, "lineage-alpha~1")
    lived.ok("fork", "old", "--from", "alpha@1")
    lived.ok("fork", "bycommit", "--from", f"alpha@{first[:12]}")
    for name in ("old", "bycommit"):
        assert meta(lived, name)["parent"]["commit"] == first  # type: ignore[index]
        assert meta(lived, name)["parent"]["generation"] == 1  # type: ignore[index]
        assert lived.show(name, "organism.el") == lived.show("alpha", "organism.el", "~1")
    assert lived.show("old", "organism.el") != lived.show("alpha", "organism.el")


def test_a_fork_with_overridden_physics_lives_under_them(lived: Fleet) -> None:
    lived.ok("fork", "roomy", "--from", "alpha@1", "--memory-max", "1G", "--wall", "30")
    physics = meta(lived, "roomy")["physics"]
    assert physics["memory_max_bytes"] == 1024**3  # type: ignore[index]
    assert physics["wall_seconds"] == 30  # type: ignore[index]
    assert physics["cpu_seconds"] == 60  # type: ignore[index]  # the parent's
    assert physics["budget_usd"] == "0.5"  # type: ignore[index]  # the parent's
    run_one(lived, "roomy")
    constraints = lived.observation("roomy", 1)["constraints"]
    assert constraints["memory_max_bytes"] == 1024**3  # type: ignore[index]
    assert constraints["wall_seconds"] == 30  # type: ignore[index]


def test_a_fork_of_a_real_death_starts_from_the_restored_body(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.ok("init", "mortal", *SMALL_PHYSICS)
    seed_body = fleet.show("mortal", "organism.el")
    push_hand_commit(fleet, "mortal", {"organism.el": '(error "boom")\n'}, "hand-commit: crasher")
    assert "mortal gen 1: process_exit" in run_one(fleet, "mortal").stdout
    done = fleet.ok("fork", "phoenix", "--from", "mortal@1").stdout
    assert "mortal generation 1 died: phoenix starts from the body its rollback restored" in done
    assert fleet.show("phoenix", "organism.el") == seed_body
    assert "phoenix gen 1: changed" in run_one(fleet, "phoenix").stdout


def test_a_fork_carries_a_lineage_across_a_changed_instrument(lived: Fleet, tmp_path: Path) -> None:
    changed = copy_instrument(PACKAGE_ROOT, tmp_path / "changed-instrument")
    with (changed / "sandbox_scripts" / "stage.sh").open("a") as runner:
        runner.write("\n# the next instrument\n")
    assert (changed / "sandbox_scripts" / "stage.sh").read_bytes() != (
        PACKAGE_ROOT / "sandbox_scripts" / "stage.sh"
    ).read_bytes()
    upgraded = {"PYTHONPATH": str(changed), "OUROBOROS_INSTRUMENT_COMMIT": OTHER_COMMIT}
    stuck = lived.cli("run", "alpha", "--generations", "1", "--local", **upgraded)
    assert stuck.returncode == 2 and "start a new lineage" in stuck.stderr

    done = lived.ok("fork", "successor", "--from", "alpha@2", **upgraded).stdout
    alpha, successor = meta(lived, "alpha"), meta(lived, "successor")
    old, new = alpha["instrument_fingerprint"], successor["instrument_fingerprint"]
    assert old != new
    assert f"instrument: {str(old)[:12]} v0.1.0 -> {str(new)[:12]} v0.1.0" in done
    assert successor["instrument_commit"] == OTHER_COMMIT
    assert successor["parent"]["instrument_fingerprint"] == old  # type: ignore[index]
    assert successor["parent"]["instrument_commit"] == alpha["instrument_commit"]  # type: ignore[index]

    assert "successor gen 1: changed" in run_one(lived, "successor", **upgraded).stdout
    provenance = lived.observation("successor", 1)["provenance"]
    assert provenance["instrument_fingerprint"] == new  # type: ignore[index]
    # And the instrument of this checkout cannot continue the fork.
    refused = lived.cli("run", "successor", "--generations", "1", "--local")
    assert refused.returncode == 2 and "instrument fingerprint differs" in refused.stderr
    try:
        rows = json.loads(lived.ok("status", "successor", "--json", **upgraded).stdout)
    finally:
        embedded_redis.stop(Settings(home=lived.home / ".ouroboros"))
    (ancestor,) = rows[0]["genealogy"]["ancestry"]
    assert ancestor["lineage"] == "alpha" and ancestor["instrument_fingerprint"] == old
