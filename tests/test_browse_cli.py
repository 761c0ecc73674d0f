"""The browsing commands through the real CLI: import-bundle, journal, observations."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from support.browse import (
    PAYLOAD,
    import_fixture,
    sample_bundle,
    settings_of,
    write_hostile_lineage,
)
from support.fleet import Fleet
from support.legacy_lineage import (
    FIXTURE_BACKTRACE,
    FIXTURE_GENERATIONS,
    FIXTURE_OUT_OF_LOOP,
    write_legacy_bundle,
)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Fleet:
    fleet = Fleet(tmp_path_factory.mktemp("browse-cli"), COLUMNS="200")
    import_fixture(fleet)
    write_hostile_lineage(settings_of(fleet))
    return fleet


def test_import_makes_the_bundle_branch_a_lineage_branch(fleet: Fleet, tmp_path: Path) -> None:
    # The recording is deterministic, so a second one names the very commit imported.
    assert fleet.git("rev-parse", "lineage-sample").strip() == (
        write_legacy_bundle(tmp_path / "again.bundle")
    )
    assert fleet.subjects("sample")[-1] == "seed"
    # Only the lineage branch is added: no temporary import ref or FETCH_HEAD remains.
    refs = fleet.git("for-each-ref", "--format=%(refname)").split()
    assert "refs/heads/lineage-sample" in refs
    assert not [ref for ref in refs if "import" in ref]


def test_import_refusals_are_one_line_with_exit_2(fleet: Fleet, tmp_path: Path) -> None:
    bundle = sample_bundle(fleet.home)
    assert "already exists" in fleet.refused("import-bundle", str(bundle), "sample")
    for bad_name in ("../escape", "Upper", "x\n", ""):
        assert "invalid lineage name" in fleet.refused("import-bundle", str(bundle), bad_name)
    garbage = tmp_path / "garbage.bundle"
    garbage.write_bytes(b"# v2 git bundle\nnot really\n")
    assert "not a complete git bundle" in fleet.refused("import-bundle", str(garbage), "g")
    assert "cannot read bundle" in fleet.refused(
        "import-bundle", str(tmp_path / "missing.bundle"), "m"
    )
    # Two branches with different tips are two lineages, not one.
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(bundle), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "branch", "other", "HEAD~3"], check=True)
    two = tmp_path / "two.bundle"
    subprocess.run(
        ["git", "-C", str(clone), "bundle", "create", "-q", str(two), "main", "other"],
        check=True,
    )
    assert "2 branch tips" in fleet.refused("import-bundle", str(two), "two")
    # A bundle whose branch has no organism.el is not a lineage.
    subprocess.run(["git", "-C", str(clone), "rm", "-q", "organism.el"], check=True)
    subprocess.run(
        [
            "git",
            "-C",
            str(clone),
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "commit",
            "-qm",
            "x",
        ],
        check=True,
    )
    bare = tmp_path / "bare.bundle"
    subprocess.run(
        ["git", "-C", str(clone), "bundle", "create", "-q", str(bare), "main"], check=True
    )
    assert "no organism.el" in fleet.refused("import-bundle", str(bare), "bare")
    listed = fleet.git("for-each-ref", "--format=%(refname)").split()
    assert not {"refs/heads/lineage-two", "refs/heads/lineage-bare"} & set(listed)


def test_journal_view_numbers_generations_and_shows_the_backtrace(fleet: Fleet) -> None:
    out = fleet.ok("journal", "sample").stdout
    for line in FIXTURE_BACKTRACE:
        assert line.strip() in out
    assert "exit 255" in out
    rows = json.loads(fleet.ok("journal", "sample", "--json").stdout)
    numbered = {
        r["commit"]["generation"]: r["commit"]["kind"] for r in rows if r["commit"]["generation"]
    }
    assert numbered == FIXTURE_GENERATIONS
    assert [r["commit"]["subject"] for r in rows if r["commit"]["generation"] is None] == list(
        reversed(FIXTURE_OUT_OF_LOOP)
    )
    death = next(r for r in rows if r["commit"]["generation"] == 1)
    assert death["entry"]["stderr_lines"] == FIXTURE_BACKTRACE


def test_observations_view_lists_and_details(fleet: Fleet) -> None:
    listing = json.loads(fleet.ok("observations", "sample", "--json").stdout)
    assert [(r["commit"]["generation"], r["outcome"], r["figures"]) for r in listing] == [
        (g, outcome, None) for g, outcome in FIXTURE_GENERATIONS.items()
    ]
    assert "no observation objects" in fleet.ok("observations", "sample").stdout
    detail = json.loads(fleet.ok("observations", "xss", "2", "--json").stdout)
    assert detail["observation"]["outcome"] == "process_exit"
    assert PAYLOAD in detail["observation"]["stderr"]
    table = fleet.ok("observations", "xss").stdout
    assert "process_exit" in table and "changed" in table


def test_terminal_output_shows_organism_text_inert(fleet: Fleet) -> None:
    out = fleet.ok("observations", "xss", "2").stdout
    # The escape sequence in stderr is shown, not sent; markup is printed literally.
    assert "\x1b[2J" not in out and "\\x1b[2J" in out
    assert "<b>bold</b>" in out


def test_views_refuse_unknown_lineages_and_generations(fleet: Fleet) -> None:
    assert "no lineage named nope" in fleet.refused("journal", "nope")
    assert "no generation" in fleet.refused("observations", "sample", "9")
    assert "no generation" in fleet.refused("observations", "sample", "../1")
