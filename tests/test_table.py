"""``schedule-lineage table`` and its web download: every observed generation as one file,
exported from a moto S3 store and read back as a notebook would, with pandas and DuckDB,
every column of the type docs/browsing.md documents."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow as pa
import pytest
from support.browse import Served, sample_observation
from support.fleet import S3_REGION, Fleet

from scheduler.table import COLUMNS, arrow_schema
from worker.fleet.assembly import observation_store
from worker.fleet.settings import Settings
from worker.instrument.records import IndexEntry, LineageIndex, ModelFailure, Observation
from worker.instrument.store_keys import generation_key, index_key

pytestmark = [pytest.mark.full]

DOCS = Path(__file__).resolve().parents[1] / "docs" / "browsing.md"
# What DuckDB calls each documented type.
DUCKDB_TYPES = {
    "string": "VARCHAR",
    "int64": "BIGINT",
    "float64": "DOUBLE",
    "bool": "BOOLEAN",
    "timestamp": "TIMESTAMP WITH TIME ZONE",
}
# A rejection reason quotes organism-made names: a spreadsheet formula and a bidi override.
HOSTILE_REASON = '=HYPERLINK("x") name \u202eevil, "quoted"\nsecond line'
WHEN = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


@dataclass
class Exported:
    fleet: Fleet
    observations: dict[tuple[str, int], Observation]


def documented() -> list[tuple[str, str]]:
    """The (column, type) rows of the table in docs/browsing.md."""
    section = DOCS.read_text().split("## Observations as a table", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z_0-9]+)` \| ([a-z0-9]+) \|", section, re.MULTILINE)


def test_the_documented_schema_is_the_table_s_own() -> None:
    assert documented() == [(column.name, column.kind) for column in COLUMNS]


def sha(name: str, number: int) -> str:
    return hashlib.sha1(f"{name} {number}".encode()).hexdigest()


# CSV carries no types: a notebook names the text columns (a commit of digits alone
# would read as a number otherwise).
TEXT = {column.name: "string" for column in COLUMNS if column.kind == "string"}


def observe(settings: Settings, name: str, outcomes: list[str]) -> list[Observation]:
    """Observations of generations 1..N of ``name`` and its index, in the fleet's store."""
    store = observation_store(settings)
    made = []
    for number, outcome in enumerate(outcomes, start=1):
        observation = sample_observation(
            name,
            number,
            sha(name, number - 1),
            sha(name, number),
            outcome,
            WHEN + timedelta(minutes=number),
            "stderr line\n",
        )
        update: dict[str, object] = {"repo_bytes": 4096 * number if number > 1 else None}
        if outcome == "decoder_rejection":
            update["rejection_reason"] = HOSTILE_REASON
        if outcome == "no-change":
            update["model_failure"] = ModelFailure(
                kind="refused", reason="openai answered HTTP 401", failed_calls=1, answered_calls=0
            )
        observation = observation.model_copy(update=update)
        key = generation_key(name, number)
        store.put_once(key, observation.model_dump_json(by_alias=True).encode())
        made.append(observation)
    index = LineageIndex(lineage=name, generations=[IndexEntry.of(o) for o in made])
    store.put(index_key(name), index.model_dump_json().encode())
    return made


@pytest.fixture
def exported(
    tmp_path: Path, s3_endpoint: str, s3_bucket: str, aws_test_credentials: tuple[str, str]
) -> Exported:
    """A fleet on moto S3: cohort ``exp`` of two replicates and a lineage outside it."""
    key_id, secret = aws_test_credentials
    fleet = Fleet(
        tmp_path,
        OUROBOROS_OBSERVATIONS=f"s3://{s3_bucket}/fleet",
        OUROBOROS_S3_ENDPOINT_URL=s3_endpoint,
        OUROBOROS_S3_REGION=S3_REGION,
        AWS_ACCESS_KEY_ID=key_id,
        AWS_SECRET_ACCESS_KEY=secret,
    )
    fleet.ok("init", "exp", "--replicates", "2")
    fleet.ok("init", "outside")
    settings = Settings(
        home=tmp_path / ".ouroboros",
        observations=f"s3://{s3_bucket}/fleet",
        s3_endpoint_url=s3_endpoint,
        s3_region=S3_REGION,
    )
    plan = {
        "exp-1": ["changed", "process_exit", "decoder_rejection"],
        "exp-2": ["no-change", "changed"],
        "outside": ["changed"],
    }
    observations = {
        (name, o.generation): o
        for name, outcomes in plan.items()
        for o in observe(settings, name, outcomes)
    }
    return Exported(fleet, observations)


def known(value: object) -> object:
    """A cell's value, None for any reader's null (None, NaN, pd.NA)."""
    return None if pd.isna(value) else value  # type: ignore[call-overload]


def check_rows(frame: pd.DataFrame, exported: Exported, lineages: set[str]) -> None:
    """The frame holds exactly the observed generations of ``lineages``, with their figures."""
    assert list(frame.columns) == [column.name for column in COLUMNS]
    expected = {key: o for key, o in exported.observations.items() if key[0] in lineages}
    got = {(row.lineage, int(row.generation)): row for row in frame.itertuples()}
    assert sorted(got) == sorted(expected)
    for key, observation in expected.items():
        row = got[key]
        assert row.outcome == observation.outcome
        assert bool(row.died) == (observation.outcome not in ("changed", "no-change"))
        assert known(row.cohort) == (None if key[0] == "outside" else "exp")
        assert int(row.input_tokens) == 40 and int(row.output_tokens) == 12
        assert int(row.stop_max_tokens) == 1 and int(row.stop_complete) == 0
        assert int(row.published_files) == 3
        assert int(row.cpu_usage_nsec) == key[1] * 10**9
        assert row.spent_usd == pytest.approx(float(observation.spent_usd))
        assert pd.Timestamp(row.finished_at) == pd.Timestamp(observation.finished_at)
        assert row.lineage_commit == observation.lineage_commit
        failure = "refused" if observation.outcome == "no-change" else None
        assert known(row.model_failure) == failure
        if observation.repo_bytes is None:
            assert pd.isna(row.repo_bytes)
        else:
            assert int(row.repo_bytes) == observation.repo_bytes
        if observation.outcome == "decoder_rejection":
            assert row.rejection_reason == HOSTILE_REASON


def test_a_cohort_to_parquet_reads_back_typed_with_pandas_and_duckdb(
    exported: Exported, tmp_path: Path
) -> None:
    target = tmp_path / "exp.parquet"
    result = exported.fleet.ok(
        "table", "--cohort", "exp", "--format", "parquet", "--to", str(target)
    )
    assert f"wrote 5 generations of 2 lineages to {target}" in result.stdout
    # The notebook's one line.
    frame = pd.read_parquet(target)
    check_rows(frame, exported, {"exp-1", "exp-2"})
    typed = pd.read_parquet(target, dtype_backend="pyarrow")
    schema = arrow_schema()
    for column in COLUMNS:
        assert typed[column.name].dtype == pd.ArrowDtype(schema.field(column.name).type), column
    assert pa.types.is_timestamp(schema.field("finished_at").type)
    described = duckdb.sql(f"DESCRIBE SELECT * FROM read_parquet('{target}')").fetchall()
    assert [(name, kind) for name, kind, *_ in described] == [
        (column.name, DUCKDB_TYPES[column.kind]) for column in COLUMNS
    ]
    deaths = duckdb.sql(
        f"SELECT lineage, generation, outcome FROM read_parquet('{target}') "
        "WHERE died ORDER BY generation"
    ).fetchall()
    assert deaths == [("exp-1", 2, "process_exit"), ("exp-1", 3, "decoder_rejection")]
    [(spend,)] = duckdb.sql(f"SELECT sum(spent_usd) FROM read_parquet('{target}')").fetchall()
    assert spend == pytest.approx(5 * float(Decimal("0.0012")))


def test_csv_and_json_lines_hold_the_same_rows(exported: Exported, tmp_path: Path) -> None:
    csv_file, jsonl_file = tmp_path / "all.csv", tmp_path / "all.jsonl"
    exported.fleet.ok("table", "--format", "csv", "--to", str(csv_file))
    exported.fleet.ok("table", "exp-1", "outside", "--format", "jsonl", "--to", str(jsonl_file))
    every = {"exp-1", "exp-2", "outside"}
    frame = pd.read_csv(csv_file, dtype=TEXT, parse_dates=["started_at", "finished_at"])
    check_rows(frame, exported, every)
    from_duckdb = duckdb.sql(f"SELECT * FROM read_csv('{csv_file}')").df()
    check_rows(from_duckdb, exported, every)
    text = jsonl_file.read_text()
    # The organism's bidi override is escaped, never raw, as in every JSON the read side writes.
    assert "\u202e" not in text and "\\u202e" in text
    lines = pd.read_json(jsonl_file, lines=True)
    check_rows(lines, exported, {"exp-1", "outside"})
    first = json.loads(text.splitlines()[0])
    assert isinstance(first["died"], bool) and isinstance(first["cpu_usage_nsec"], int)


def test_an_existing_file_is_never_replaced_and_bad_requests_are_refused(
    exported: Exported, tmp_path: Path
) -> None:
    fleet = exported.fleet
    kept = tmp_path / "kept.parquet"
    kept.write_bytes(b"mine")
    assert "exists" in fleet.refused("table", "--format", "parquet", "--to", str(kept))
    assert kept.read_bytes() == b"mine"
    target = str(tmp_path / "t.csv")
    assert "not both" in fleet.refused(
        "table", "exp-1", "--cohort", "exp", "--format", "csv", "--to", target
    )
    assert "no lineage named nope" in fleet.refused(
        "table", "nope", "--format", "csv", "--to", target
    )
    assert "no lineage is in cohort" in fleet.refused(
        "table", "--cohort", "none", "--format", "csv", "--to", target
    )
    assert "invalid cohort label" in fleet.refused(
        "table", "--cohort", "A", "--format", "csv", "--to", target
    )
    result = fleet.cli("table", "--format", "xlsx", "--to", target)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix in {".csv", ".parquet"}) == [
        "kept.parquet"
    ]


@pytest.fixture
def served(exported: Exported, tmp_path: Path) -> Iterator[Served]:
    server = Served(exported.fleet, tmp_path / "serve.log")
    yield server
    server.stop()


def test_the_web_ui_serves_the_same_table_for_a_lineage_and_a_cohort(
    served: Served, exported: Exported, tmp_path: Path
) -> None:
    reply = served.get("/cohorts/exp/table.parquet")
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"] == "application/vnd.apache.parquet"
    assert 'filename="cohort-exp.observations.parquet"' in reply.headers["content-disposition"]
    assert "default-src 'none'" in reply.headers["content-security-policy"]
    downloaded = tmp_path / "down.parquet"
    downloaded.write_bytes(reply.content)
    check_rows(pd.read_parquet(downloaded), exported, {"exp-1", "exp-2"})
    lineage = served.get("/lineages/outside/table.csv")
    assert lineage.status_code == 200 and lineage.headers["content-type"].startswith("text/csv")
    (tmp_path / "outside.csv").write_bytes(lineage.content)
    check_rows(pd.read_csv(tmp_path / "outside.csv", dtype=TEXT), exported, {"outside"})
    page = served.get("/cohorts/exp")
    assert page.status_code == 200 and 'href="/cohorts/exp/table.parquet"' in page.text
    # The grid follows the history (these observations name no commit of it), the table the store.
    assert "No generation has lived yet" in page.text and "outside" not in page.text
    overview = served.get("/?cohort=exp").text
    assert 'href="/lineages/exp-2"' in overview and 'href="/lineages/outside"' not in overview
    for missing in (
        "/cohorts/none",
        "/cohorts/BAD",
        "/cohorts/none/table.csv",
        "/cohorts/BAD/table.csv",
        "/cohorts/exp/table.xlsx",
        "/lineages/nope/table.csv",
        "/lineages/outside/table.exe",
    ):
        assert served.get(missing).status_code == 404, missing
    assert served.raw("/cohorts/..%2F..%2Fetc/table.csv") == 404
