"""Cohorts: replicates made by ``init --replicates``, any lineages grouped by ``--cohort``,
``run`` and ``status`` over a cohort, and the root field old roots still read without."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import get_args

import pytest
from pydantic import ValidationError
from support.browse import Served, settings_of
from support.cohort import write_cohort
from support.fleet import SMALL_PHYSICS, Fleet

from scheduler.views import CohortView
from scheduler.web.api import ErrorBody
from scheduler.web.render import GRID_MARKS
from worker.instrument.lineage import LineageMetadata
from worker.instrument.physics import Physics
from worker.instrument.records import Outcome

HOSTILE_LABELS = ["Bad", "a b", "-lead", "../up", "x" * 64, "ex\u202ep", "e\u200bx", ""]


def root(fleet: Fleet, lineage: str) -> dict[str, object]:
    meta: dict[str, object] = json.loads(fleet.show(lineage, ".ouroboros-lineage.json", ""))
    return meta


def lineages(fleet: Fleet) -> list[str]:
    refs = fleet.git("for-each-ref", "--format=%(refname:lstrip=2)", "refs/heads/")
    return sorted(refs.split())


def statuses(fleet: Fleet, *args: str) -> dict[str, dict[str, object]]:
    rows = json.loads(fleet.ok("status", "--json", *args).stdout)
    return {row["lineage"]: row for row in rows}


def root_meta(**extra: object) -> dict[str, object]:
    return {
        "schema": "ouroboros-fleet-lineage/v1",
        "name": "old",
        "created_at": datetime(2026, 1, 1, tzinfo=UTC).isoformat(),
        "instrument_fingerprint": "e" * 64,
        "instrument_version": "0.1.0",
        "instrument_commit": "a" * 40,
        "instrument_repository": "tests",
        "instrument_ref": "tests",
        "seed_sha256": "b" * 64,
        "physics": Physics().model_dump(mode="json"),
        **extra,
    }


def test_every_outcome_has_a_letter_of_its_own_in_a_cohort_s_grid() -> None:
    assert set(GRID_MARKS) == set(get_args(Outcome))
    assert len(set(GRID_MARKS.values())) == len(GRID_MARKS)


def test_a_root_written_before_cohorts_reads_and_writes_back_byte_for_byte() -> None:
    raw = (json.dumps(root_meta(), indent=2) + "\n").encode()
    meta = LineageMetadata.model_validate_json(raw)
    assert meta.cohort is None
    assert b"cohort" not in meta.to_json()
    assert LineageMetadata.model_validate_json(meta.to_json()) == meta


@pytest.mark.parametrize("label", HOSTILE_LABELS)
def test_a_root_with_an_illegible_cohort_label_does_not_validate(label: str) -> None:
    with pytest.raises(ValidationError, match="cohort"):
        LineageMetadata.model_validate(root_meta(cohort=label))


def test_replicates_share_one_seed_and_physics_as_one_cohort(fleet: Fleet) -> None:
    out = fleet.ok("init", "exp", "--replicates", "4", *SMALL_PHYSICS).stdout
    names = [f"exp-{n}" for n in range(1, 5)]
    assert lineages(fleet) == [f"lineage-{name}" for name in names]
    assert all(f"created lineage {name} " in out for name in names) and "cohort exp" in out
    roots = [root(fleet, name) for name in names]
    assert {r["cohort"] for r in roots} == {"exp"}
    assert len({r["seed_sha256"] for r in roots}) == 1
    assert len({json.dumps(r["physics"], sort_keys=True) for r in roots}) == 1
    assert roots[0]["physics"]["wall_seconds"] == 60  # type: ignore[index]
    shown = statuses(fleet, "--cohort", "exp")
    assert sorted(shown) == names and {row["cohort"] for row in shown.values()} == {"exp"}
    # The table shows the cohort too.
    assert "cohort" in fleet.ok("status", "--cohort", "exp", COLUMNS="160").stdout


def test_a_taken_replicate_name_refuses_them_all_before_any_is_written(fleet: Fleet) -> None:
    fleet.ok("init", "exp-3")
    line = fleet.refused("init", "exp", "--replicates", "4")
    assert "exp-3 already exists" in line
    assert lineages(fleet) == ["lineage-exp-3"]
    # A replicate name past the length rule is refused the same way, naming it.
    long = "n" * 61
    assert f"{long}-10" in fleet.refused("init", long, "--replicates", "10")
    assert lineages(fleet) == ["lineage-exp-3"]


@pytest.mark.parametrize("label", ["Bad", "a b", "../up", "x" * 64, "ex\u202ep"])
def test_an_illegible_label_is_refused_in_one_line_before_anything_is_made(
    fleet: Fleet, label: str
) -> None:
    for command in (["init", "one", "--cohort", label], ["status", "--cohort", label]):
        assert "invalid cohort label" in fleet.refused(*command)
    assert not fleet.repo.exists()


def test_replicates_are_counted_from_one_to_a_thousand(fleet: Fleet) -> None:
    for bad in ("0", "1001", "two"):
        result = fleet.cli("init", "exp", "--replicates", bad)
        assert result.returncode == 2 and "--replicates" in result.stderr
        assert "Traceback" not in result.stderr
    assert not fleet.repo.exists()


def test_cohort_groups_any_lineages_made_by_init_and_fork(fleet: Fleet) -> None:
    fleet.ok("init", "exp", "--replicates", "2", "--cohort", "trial")
    fleet.ok("init", "solo", "--cohort", "mixed")
    assert "cohort: mixed" in fleet.ok("fork", "kid", "--from", "exp-1", "--cohort", "mixed").stdout
    fleet.ok("fork", "loner", "--from", "exp-2")
    assert sorted(statuses(fleet, "--cohort", "trial")) == ["exp-1", "exp-2"]
    mixed = statuses(fleet, "--cohort", "mixed")
    assert sorted(mixed) == ["kid", "solo"]
    assert root(fleet, "kid")["parent"]["lineage"] == "exp-1"  # type: ignore[index]
    assert "cohort" not in root(fleet, "loner")
    # Named lineages and a cohort together: each once.
    assert sorted(statuses(fleet, "loner", "kid", "--cohort", "mixed")) == ["kid", "loner", "solo"]
    assert "invalid cohort label" in fleet.refused("fork", "k2", "--from", "exp-1", "--cohort", "X")
    assert "no lineage is in cohort empty" in fleet.refused("status", "--cohort", "empty")


def test_run_over_a_cohort_starts_a_run_for_each_of_its_lineages(fleet: Fleet) -> None:
    fleet.ok("init", "exp", "--replicates", "3", *SMALL_PHYSICS)
    fleet.ok("init", "other", *SMALL_PHYSICS)
    out = fleet.ok("run", "--cohort", "exp", "--generations", "2").stdout  # queued: no worker
    started = [line.split()[2] for line in out.splitlines() if line.startswith("run ")]
    assert started == ["exp-1", "exp-2", "exp-3"]
    shown = statuses(fleet)
    assert {name: row["target"] for name, row in shown.items()} == {
        "exp-1": 2,
        "exp-2": 2,
        "exp-3": 2,
        "other": None,
    }
    assert "no lineage is in cohort nope" in fleet.refused(
        "run", "--cohort", "nope", "--generations", "1"
    )
    assert "--cohort LABEL" in fleet.refused("run", "--generations", "1")


@pytest.mark.full
def test_the_cohort_api_answers_its_grid_shares_and_curves_with_their_median(
    tmp_path: Path,
) -> None:
    fleet = Fleet(tmp_path)
    plans = {
        "trio-1": ["changed", "changed"],
        "trio-2": ["changed", "process_exit", "changed"],
        "trio-3": ["no-change", "cgroup_oom"],
    }
    write_cohort(settings_of(fleet), "trio", plans)
    fleet.ok("init", "alone")
    served = Served(fleet, tmp_path / "serve.log")
    try:
        view = CohortView.model_validate(served.get("/api/cohorts/trio").json())
        assert view.label == "trio" and view.generations == 3
        assert [row.summary.name for row in view.rows] == list(plans)
        assert [[c.outcome if c else None for c in row.cells] for row in view.rows] == [
            ["changed", "changed", None],
            ["changed", "process_exit", "changed"],
            ["no-change", "cgroup_oom", None],
        ]
        assert view.rows[1].summary.deaths == {"process_exit": 1}
        assert view.shares is not None
        lived, changed = (
            [(p.generation, round(p.value)) for p in c.points] for c in view.shares.curves
        )
        assert lived == [(1, 100), (2, 33), (3, 100)]
        assert changed == [(1, 67), (2, 33), (3, 100)]
        organism, spent = view.overlays
        assert [c.lineage for c in organism.curves] == list(plans)
        # Sizes at generation 1: 19, 19 and 8 bytes; the median 19.
        assert organism.median is not None and organism.median[0].value == 19
        assert spent.median is not None and [p.generation for p in spent.median] == [1, 2, 3]

        chosen = CohortView.model_validate(served.get("/api/cohorts?lineages=trio-3,alone").json())
        assert chosen.label is None
        assert [row.summary.name for row in chosen.rows] == ["alone", "trio-3"]
        for path in (
            "/api/cohorts/absent",
            "/api/cohorts/Bad%20label",
            "/api/cohorts?lineages=nope",
        ):
            reply = served.get(path)
            assert reply.status_code == 404, path
            ErrorBody.model_validate(reply.json())
        assert served.get("/api/cohorts").status_code == 422
        paths = served.get("/openapi.json").json()["paths"]
        assert paths["/api/cohorts/{label}"]["get"]["responses"]["200"]["content"][
            "application/json"
        ]["schema"] == {"$ref": "#/components/schemas/CohortView"}
        assert "/api/cohorts" in paths
    finally:
        served.stop()
