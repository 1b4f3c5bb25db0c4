"""DuckDB views over a store (local or S3): what `farmflow sql` queries.

Views (every data view starts with the ``stage`` and ``key`` of the artifact a row came
from, so any row can be traced back to its artifact):

* ``artifacts``: one row per committed artifact: stage, key, kind, format, rows, created,
  uri, config, inputs and metrics (the last three as JSON);
* ``instructions``, ``pairs``, ``preferences``, ``outputs``, ``evaluations``, ``leaderboard``,
  ``overoptimization``, ``reward_report``: the rows of every committed table of that format
  (read from each ``_COMMIT.json``);
* ``annotations``: the row-level annotation cache, every chunk of ``_rows/annotations/``.
* ``runs``: one row per method and flow run that ended in a leaderboard, every chunk of
  ``_rows/runs/`` (what `farmflow leaderboard` and `farmflow history` read).
* ``training_metrics``: every training stage's per-step rows (step, epoch, split, tokens, wall_s,
  loss, lr, grad_norm, tokens_per_s and each method's own figures; see docs/training-metrics.md).
* ``leaderboard_history``: the nightly trend in the columns it always had: the runs recorded
  with ``history`` plus the chunks stores kept in ``_rows/leaderboard_history/`` before the
  ``runs`` table existed (no longer written), so old queries keep their meaning.

The views are built from the commit records, so they only ever read committed data, in
the attempt folder the record names (uncommitted or losing S3 uploads are never read).
A table or row-log chunk whose size differs from the one committed (a truncated file,
`farmflow.storage.integrity`) is left out with one warning line, so one damaged file does
not fail every query; ``farmflow artifacts verify --repair`` quarantines it.
They are a snapshot: an artifact committed later appears on the next `connect`. A view
with nothing to read yet still exists, with the columns of its schema and no rows.

On S3 the store's fsspec filesystem is registered with DuckDB (the httpfs extension is
not needed). `create_views_sql` gives the same views as plain SQL for the DuckDB CLI or a
notebook (see docs/store.md).
"""

from __future__ import annotations

import json
from typing import Any, Callable

import duckdb
import pyarrow as pa

from farmflow.progress import log
from farmflow.storage.schemas import SCHEMAS
from farmflow.storage.store import Store
from farmflow.training_metrics import FILE, FIXED, ROWS_METRIC

Warn = Callable[[str], None]

TABLE_VIEWS = {
    "instructions": "instructions",
    "pairs": "pairs",
    "preferences": "preferences",
    "outputs": "outputs",
    "evaluations": "evaluation",
    "leaderboard": "leaderboard",
    "overoptimization": "overoptimization",
    "reward_report": "reward_report",
}
"""View name → table format it collects."""

ARTIFACT_COLUMNS = [
    ("stage", "VARCHAR"),
    ("key", "VARCHAR"),
    ("kind", "VARCHAR"),
    ("format", "VARCHAR"),
    ("rows", "BIGINT"),
    ("created", "TIMESTAMPTZ"),
    ("uri", "VARCHAR"),
    ("config", "JSON"),
    ("inputs", "JSON"),
    ("metrics", "JSON"),
]


def _lit(value: Any) -> str:
    """A SQL literal (strings quoted, None as NULL)."""
    if value is None:
        return "NULL"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(value)
    return "'" + str(value).replace("'", "''") + "'"


def _duck_type(t: pa.DataType) -> str:
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "VARCHAR"
    if pa.types.is_floating(t):
        return "DOUBLE"
    if pa.types.is_integer(t):
        return "BIGINT"
    if pa.types.is_boolean(t):
        return "BOOLEAN"
    if pa.types.is_timestamp(t):
        return "TIMESTAMPTZ" if t.tz else "TIMESTAMP"
    raise TypeError(f"no DuckDB type for {t}")


def _empty(columns: list[tuple[str, str]]) -> str:
    return "SELECT " + ", ".join(f"NULL::{t} AS {name}" for name, t in columns) + " WHERE false"


def _artifacts_sql(records: list[dict]) -> str:
    if not records:
        return _empty(ARTIFACT_COLUMNS)
    rows = []
    for r in records:
        ref = r["ref"]
        values = [
            ref["stage"],
            ref["key"],
            ref["kind"],
            ref["format"],
            ref.get("rows"),
            ref["created"],
            ref["uri"],
            json.dumps(r.get("config"), sort_keys=True),
            json.dumps(r.get("inputs") or {}, sort_keys=True),
            json.dumps(ref.get("metrics") or {}, sort_keys=True),
        ]
        rows.append("(" + ", ".join(_lit(v) for v in values) + ")")
    names = [n for n, _ in ARTIFACT_COLUMNS]
    select = ", ".join(f"CAST({n} AS {t}) AS {n}" for n, t in ARTIFACT_COLUMNS)
    return f"SELECT {select} FROM (VALUES\n  " + ",\n  ".join(rows) + f"\n) AS t({', '.join(names)})"


def _table_sql(store: Store, records: list[dict], format: str) -> str:
    schema = SCHEMAS[format]
    parts = [
        f"SELECT {_lit(r['ref']['stage'])} AS stage, {_lit(r['ref']['key'])} AS key, * FROM "
        f"read_parquet({_lit(r['ref']['uri'] + '/data.parquet')})"
        for r in records
        if r["ref"]["kind"] == "table" and r["ref"]["format"] == format
    ]
    if not parts:
        return _empty([("stage", "VARCHAR"), ("key", "VARCHAR")] + [(f.name, _duck_type(f.type)) for f in schema])
    return "\nUNION ALL BY NAME\n".join(parts)


ROW_VIEWS = {"annotations": "annotations", "runs": "runs"}
"""View name → row log (``_rows/<name>/``) it reads; each log's chunks have the schema of the same name."""


def _rows_sql(store: Store, namespace: str, bad: set[str]) -> str | None:
    """Every chunk of a row log (and of the logs nested in it) but the `bad` ones, or None when it has none."""
    if not store.row_chunks(namespace):
        return None
    if not any(p.startswith(store.rows_dir(namespace) + "/") for p in bad):
        chunks = _lit(store.url(store.rows_dir(namespace)) + "/**/*.parquet")
    else:  # the good chunks by name
        found = store.fs.find(store.rows_dir(namespace))
        good = [p for p in found if p.endswith(".parquet") and not p.rsplit("/", 1)[1].startswith(".") and p not in bad]
        if not good:
            return None
        chunks = "[" + ", ".join(_lit(store.url(p)) for p in good) + "]"
    return f"SELECT * FROM read_parquet({chunks}, union_by_name = true)"


def _row_view_sql(store: Store, namespace: str, bad: set[str]) -> str:
    return _rows_sql(store, namespace, bad) or _empty([(f.name, _duck_type(f.type)) for f in SCHEMAS[namespace]])


def _leaderboard_history_sql(store: Store, bad: set[str]) -> str:
    """The runs recorded with history, in the legacy columns, then the legacy chunks (union by name: a column an
    old chunk lacks is NULL there)."""
    columns = ", ".join(SCHEMAS["leaderboard_history"].names)
    recorded = f"SELECT {columns} FROM ({_row_view_sql(store, 'runs', bad)}) WHERE history"
    legacy = _rows_sql(store, "leaderboard_history", bad)
    return recorded if legacy is None else f"{recorded}\nUNION ALL BY NAME\n{legacy}"


def _training_metrics_sql(records: list[dict]) -> str:
    """Every training stage's per-step metrics (`farmflow.training_metrics`), method figures united by name."""
    parts = [
        f"SELECT {_lit(r['ref']['stage'])} AS stage, {_lit(r['ref']['key'])} AS key, * FROM "
        f"read_parquet({_lit(r['ref']['uri'] + '/model/' + FILE)})"
        for r in records
        if (r["ref"].get("metrics") or {}).get(ROWS_METRIC)
    ]
    if not parts:
        return _empty([("stage", "VARCHAR"), ("key", "VARCHAR")] + [(n, _duck_type(t)) for n, t in FIXED])
    return "\nUNION ALL BY NAME\n".join(parts)


def _intact(store: Store, records: list[dict], warn: Warn) -> tuple[list[dict], set[str]]:
    """(the records whose table files have their committed sizes, the row-log chunks that do not); one warning line
    per file left out."""
    good = []
    for r in records:
        ref = r["ref"]
        folder = ref["uri"].removeprefix("s3://")
        problem = store.size_problem(folder, r) if ref["kind"] == "table" else None
        if problem:
            what = f"{ref['stage']}/{ref['key']}"
            warn(f"sql: left out {what} ({problem}); `farmflow artifacts verify --repair` moves it away")
        else:
            good.append(r)
    bad = store.bad_chunks()
    for path, problem in bad:
        warn(f"sql: left out row-log chunk {store.url(path)} ({problem})")
    return good, {p for p, _ in bad}


def view_sql(store: Store, warn: Warn = log) -> dict[str, str]:
    """View name → its SELECT statement, for the store's committed artifacts right now (`warn`: told of each damaged
    file left out)."""
    records = store.records()
    tables, bad = _intact(store, records, warn)
    views = {"artifacts": _artifacts_sql(records)}
    views |= {name: _table_sql(store, tables, format) for name, format in TABLE_VIEWS.items()}
    views |= {name: _row_view_sql(store, namespace, bad) for name, namespace in ROW_VIEWS.items()}
    views["leaderboard_history"] = _leaderboard_history_sql(store, bad)
    views["training_metrics"] = _training_metrics_sql(tables)
    return views


def create_views_sql(store: Store, warn: Warn = log) -> str:
    """``CREATE OR REPLACE VIEW`` statements for every view, runnable in any DuckDB session."""
    header = f"-- farmflow views over {store.root} (a snapshot of its committed artifacts)\n"
    if str(store.root).startswith("s3://"):
        header += (
            "-- These read s3:// paths. Python: con.register_filesystem(s3fs.S3FileSystem(endpoint_url=...)) first.\n"
            "-- DuckDB CLI: INSTALL httpfs; LOAD httpfs; CREATE SECRET (TYPE s3, KEY_ID '...', SECRET '...',\n"
            "--   ENDPOINT 'host:9000', URL_STYLE 'path', USE_SSL false);  -- ENDPOINT etc. only for MinIO\n"
        )
    views = view_sql(store, warn)
    return header + "".join(f"CREATE OR REPLACE VIEW {name} AS\n{sql};\n\n" for name, sql in views.items())


def connect(store: Store, database: str = ":memory:", warn: Warn = log) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the store's filesystem registered and every view created."""
    con = duckdb.connect(database)
    if hasattr(store, "register_duckdb"):
        store.register_duckdb(con)
    con.execute(create_views_sql(store, warn))
    return con
