"""Every observed generation as one table: the columns, their types, and the files.

Owns the table's schema (``COLUMNS``: one row per observed generation, every scalar
field of its observation, its lineage's cohort and parent, each column with its type
and meaning, as docs/browsing.md lists them), reading the rows from the store one
observation at a time (the index says which generations are observed), and writing
them as Parquet (pyarrow, in batches), CSV or JSON Lines. A file is written beside its
destination and linked into place only when complete, so a failed export leaves
nothing and an existing file is never replaced.

Trusts: the reader it is given. Organism-made text reaches the table only as the
decoder's rejection reason, carried as data; JSON Lines escape C1 and bidi controls
as every JSON answer of the read side does.
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Literal

from scheduler.legible import escape_for_json
from scheduler.reader import Reader
from worker.instrument.errors import Refusal
from worker.instrument.lineage import LineageMetadata
from worker.instrument.physics import Physics
from worker.instrument.records import DEATHS, STOP_REASONS, Observation

if TYPE_CHECKING:
    import pyarrow as pa

Format = Literal["parquet", "csv", "jsonl"]
FORMATS: tuple[Format, ...] = ("parquet", "csv", "jsonl")
MEDIA_TYPES: dict[Format, str] = {
    "parquet": "application/vnd.apache.parquet",
    "csv": "text/csv; charset=utf-8",
    "jsonl": "application/jsonl; charset=utf-8",
}
Kind = Literal["string", "int64", "float64", "bool", "timestamp"]
Value = str | int | float | bool | datetime | None
# Rows per Parquet row group written: memory stays bounded whatever the fleet's size.
BATCH_ROWS = 4096


@dataclass(frozen=True)
class Column:
    name: str
    kind: Kind
    doc: str
    get: Callable[[Observation, LineageMetadata | None], Value]


def _stops(reason: str) -> Column:
    return Column(
        f"stop_{reason}",
        "int64",
        f"answered calls whose answer ended {reason}",
        lambda o, m: sum(call.stop_reason == reason for call in o.model_calls),
    )


def _physics(field: str) -> Column:
    # Every pinned figure is an integer but the budget, a Decimal read as a double.
    if field == "budget_usd":
        return Column(
            "physics_budget_usd",
            "float64",
            "pinned physics: budget_usd",
            lambda o, m: float(o.constraints.budget_usd),
        )
    return Column(
        f"physics_{field}",
        "int64",
        f"pinned physics: {field}",
        lambda o, m: int(getattr(o.constraints, field)),
    )


COLUMNS: tuple[Column, ...] = (
    Column("lineage", "string", "the lineage's name", lambda o, m: o.lineage),
    Column(
        "cohort",
        "string",
        "the lineage's cohort (null: none)",
        lambda o, m: m.cohort if m else None,
    ),
    Column(
        "parent_lineage",
        "string",
        "the lineage it was forked from (null: seeded by init)",
        lambda o, m: m.parent.lineage if m and m.parent else None,
    ),
    Column(
        "parent_generation",
        "int64",
        "the generation of the parent it was forked from",
        lambda o, m: m.parent.generation if m and m.parent else None,
    ),
    Column(
        "generation",
        "int64",
        "the generation's number (1 is the first life)",
        lambda o, m: o.generation,
    ),
    Column("outcome", "string", "changed, no-change or the kind of death", lambda o, m: o.outcome),
    Column("died", "bool", "the outcome is a death", lambda o, m: o.outcome in DEATHS),
    Column(
        "rejection_reason",
        "string",
        "why the decoder rejected the result (organism-made names inside)",
        lambda o, m: o.rejection_reason,
    ),
    Column("exit_status", "int64", "the life's exit status", lambda o, m: o.exit_status),
    Column("signal", "int64", "the signal that ended the life", lambda o, m: o.signal),
    Column(
        "driver_result",
        "string",
        "how the ceiling driver saw the end",
        lambda o, m: o.driver_result,
    ),
    Column(
        "parent_commit", "string", "the commit the life started from", lambda o, m: o.parent_commit
    ),
    Column("lineage_commit", "string", "the generation's commit", lambda o, m: o.lineage_commit),
    Column("started_at", "timestamp", "when the life started (UTC)", lambda o, m: o.started_at),
    Column("finished_at", "timestamp", "when the life ended (UTC)", lambda o, m: o.finished_at),
    Column("duration_seconds", "float64", "the life's wall time", lambda o, m: o.duration_seconds),
    Column(
        "queue_wait_seconds",
        "float64",
        "time the job waited for a worker",
        lambda o, m: o.provenance.queue_wait_seconds,
    ),
    Column("cpu_usage_nsec", "int64", "CPU time of the life", lambda o, m: o.cpu_usage_nsec),
    Column(
        "memory_peak_bytes", "int64", "peak memory of the life", lambda o, m: o.memory_peak_bytes
    ),
    Column("oom_kills", "int64", "out-of-memory kills in the life", lambda o, m: o.oom_kills),
    Column("archive_bytes", "int64", "size of the result archive", lambda o, m: o.archive_bytes),
    Column(
        "published_bytes", "int64", "bytes of the published tree", lambda o, m: o.published_bytes
    ),
    Column(
        "published_files", "int64", "files in the published tree", lambda o, m: o.published_files
    ),
    Column(
        "repo_bytes", "int64", "what it added to the shared repository", lambda o, m: o.repo_bytes
    ),
    Column(
        "lineage_repo_bytes",
        "int64",
        "the lineage's total in the shared repository after it",
        lambda o, m: o.lineage_repo_bytes,
    ),
    Column("provider", "string", "the model provider", lambda o, m: o.provider),
    Column("model", "string", "the model", lambda o, m: o.model),
    Column(
        "model_calls", "int64", "calls through the model socket", lambda o, m: len(o.model_calls)
    ),
    Column(
        "model_calls_answered",
        "int64",
        "calls the model answered (HTTP 200)",
        lambda o, m: sum(call.status == 200 for call in o.model_calls),
    ),
    Column(
        "model_calls_over_limit",
        "int64",
        "calls past the call limit (answered 429, sent nowhere)",
        lambda o, m: o.model_calls_over_limit,
    ),
    Column(
        "input_tokens",
        "int64",
        "input tokens of every call",
        lambda o, m: sum(call.input_tokens for call in o.model_calls),
    ),
    Column(
        "output_tokens",
        "int64",
        "output tokens of every call",
        lambda o, m: sum(call.output_tokens for call in o.model_calls),
    ),
    *(_stops(reason) for reason in STOP_REASONS),
    Column("spent_usd", "float64", "dollars spent on the model", lambda o, m: float(o.spent_usd)),
    Column(
        "run_budget_exhausted",
        "bool",
        "a call was refused under the run's budget",
        lambda o, m: o.run_budget_exhausted,
    ),
    Column(
        "model_failure",
        "string",
        "refused or unavailable: the provider's failure (null: none)",
        lambda o, m: o.model_failure.kind if o.model_failure else None,
    ),
    Column(
        "model_unavailable",
        "bool",
        "no call of the generation was answered",
        lambda o, m: o.model_unavailable,
    ),
    Column("stderr_chars", "int64", "characters of stderr kept", lambda o, m: len(o.stderr)),
    Column("stderr_truncated", "bool", "stderr was cut at 1 MiB", lambda o, m: o.stderr_truncated),
    Column("run_id", "string", "the run that asked for the generation", lambda o, m: o.run_id),
    Column(
        "instrument_fingerprint",
        "string",
        "the instrument that ran the life",
        lambda o, m: o.provenance.instrument_fingerprint,
    ),
    Column(
        "fleet_version", "string", "the fleet's version", lambda o, m: o.provenance.fleet_version
    ),
    Column("worker_host", "string", "the worker's host", lambda o, m: o.provenance.worker_host),
    Column(
        "ceiling_driver",
        "string",
        "the resource ceiling driver",
        lambda o, m: o.provenance.ceiling_driver,
    ),
    Column(
        "syscall_filter",
        "string",
        "the syscall filter's digest (null: before filters)",
        lambda o, m: o.provenance.syscall_filter,
    ),
    Column("attempt", "int64", "the task's delivery attempt", lambda o, m: o.provenance.attempt),
    *(_physics(field) for field in Physics.model_fields),
)


def rows(reader: Reader, names: Iterable[str]) -> Iterator[list[Value]]:
    """One row per observed generation of each lineage, oldest first, read one at a time."""
    metas = reader.metadata()
    for name in names:
        meta = metas.get(name)
        for entry in reader.indexed(name):
            observation = reader.observation(name, entry.generation)
            if observation is not None:
                yield [column.get(observation, meta) for column in COLUMNS]


def observed(reader: Reader, names: Iterable[str]) -> int:
    """How many rows ``rows`` will yield at most: the indexed generations."""
    return sum(len(reader.indexed(name)) for name in names)


def write(rows: Iterable[list[Value]], fmt: Format, destination: Path) -> int:
    """Write ``rows`` to ``destination`` as ``fmt``; refused if it exists. Rows written."""
    if destination.exists() or destination.is_symlink():
        raise Refusal(f"{destination} exists; choose another --to FILE (none is ever replaced)")
    directory = destination.parent
    try:
        fd, temporary = tempfile.mkstemp(dir=directory, prefix=f".{destination.name}.")
    except OSError as exc:
        raise Refusal(
            f"cannot write in {directory}: {exc.strerror}; choose another --to FILE"
        ) from None
    try:
        with os.fdopen(fd, "wb") as out:
            written = WRITERS[fmt](rows, out)
        os.link(temporary, destination)
    except FileExistsError:
        raise Refusal(
            f"{destination} exists; choose another --to FILE (none is ever replaced)"
        ) from None
    finally:
        os.unlink(temporary)
    return written


def _parquet(rows: Iterable[list[Value]], out: IO[bytes]) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = arrow_schema()
    written = 0
    with pq.ParquetWriter(out, schema) as writer:
        for batch in _batches(rows):
            columns = list(zip(*batch, strict=True))
            writer.write_batch(pa.record_batch(columns, schema=schema))
            written += len(batch)
        if not written:
            writer.write_table(schema.empty_table())
    return written


def arrow_schema() -> pa.Schema:
    import pyarrow as pa

    types = {
        "string": pa.string(),
        "int64": pa.int64(),
        "float64": pa.float64(),
        "bool": pa.bool_(),
        "timestamp": pa.timestamp("us", tz="UTC"),
    }
    return pa.schema([pa.field(c.name, types[c.kind], nullable=True) for c in COLUMNS])


def _csv(rows: Iterable[list[Value]], out: IO[bytes]) -> int:
    import io

    text = io.TextIOWrapper(out, encoding="utf-8", newline="")
    writer = csv.writer(text)
    writer.writerow([column.name for column in COLUMNS])
    written = 0
    for row in rows:
        writer.writerow(["" if v is None else _text(v) for v in row])
        written += 1
    text.flush()
    text.detach()
    return written


def _jsonl(rows: Iterable[list[Value]], out: IO[bytes]) -> int:
    names = [column.name for column in COLUMNS]
    written = 0
    for row in rows:
        record = {
            name: value.isoformat() if isinstance(value, datetime) else value
            for name, value in zip(names, row, strict=True)
        }
        out.write((escape_for_json(json.dumps(record)) + "\n").encode())
        written += 1
    return written


def _text(value: Value) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _batches(rows: Iterable[list[Value]]) -> Iterator[list[list[Value]]]:
    batch: list[list[Value]] = []
    for row in rows:
        batch.append(row)
        if len(batch) == BATCH_ROWS:
            yield batch
            batch = []
    if batch:
        yield batch


WRITERS: dict[Format, Callable[[Iterable[list[Value]], IO[bytes]], int]] = {
    "parquet": _parquet,
    "csv": _csv,
    "jsonl": _jsonl,
}
