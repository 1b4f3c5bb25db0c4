"""DuckDB views over the store (local and S3) and the `farmflow sql` / `farmflow artifacts` commands."""

from __future__ import annotations

import csv
import io
import json
from datetime import datetime, timezone

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from farmflow.cli import app
from farmflow.storage import LocalStore, open_store
from farmflow.storage.schemas import SCHEMAS
from farmflow.storage.sql import connect, create_views_sql, view_sql

runner = CliRunner()

PAIR = {"instruction": "Sort 3, 1, 2.", "input": "", "output_1": "1, 2, 3", "output_2": "3, 2, 1"}
# evaluation preferences (1: reference preferred, 2: evaluated output preferred, 1.5: tie)
PREFS = {"sft": [2.0, 1.0, 1.5], "best_of_4": [2.0, 2.0, 1.0]}
WIN_RATE = {"sft": 50.0, "best_of_4": 200 / 3}  # mean(preference - 1) * 100, by hand


def table(format: str, rows: list[dict]) -> pa.Table:
    schema = SCHEMAS[format]
    return pa.Table.from_pylist([{f.name: r.get(f.name) for f in schema} for r in rows], schema=schema)


def annotation(annotator: str, preference: float, price: float) -> dict:
    return {
        "key": "k-" + PAIR["output_1"],
        "annotator": annotator,
        "annotator_hash": annotator[:3],
        "model": "gpt-x",
        **PAIR,
        "preference": preference,
        "status": "ok",
        "error": None,
        "raw_completion": f"Output ({int(preference)})",
        "prompt_tokens": 100,
        "completion_tokens": 5,
        "price_usd": price,
        "latency_s": 0.5,
        "created": datetime(2026, 1, 1, tzinfo=timezone.utc),
    }


def fill(store) -> None:
    """A store with one artifact of every kind and an annotation row log in two chunks."""
    store.put_table(
        "data",
        "d1",
        table("instructions", [{"id": "e1", "split": "eval", "instruction": "x", "input": "", "output": "y"}]),
        "instructions",
        config={"seed": 0},
    )
    store.put_table(
        "sample_pairs",
        "p1",
        table("pairs", [{"id": f"p{i}", "split": "pref", **PAIR} for i in range(4)]),
        "pairs",
        config={"temperature": 1.0},
        inputs={"data": "d1"},
    )
    for method, prefs in PREFS.items():
        outs = [
            {"id": f"e{i}", "instruction": "x", "input": "", "output": "o" * (i + 1), "generator": method}
            for i in range(3)
        ]
        store.put_table("generate", f"g-{method}", table("outputs", outs), "outputs", config={"generator": method})
        evals = [
            {
                "id": f"e{i}",
                "instruction": "x",
                "input": "",
                "output_1": "ref",
                "output_2": "o",
                "generator": method,
                "annotator": "pool",
                "preference": p,
            }
            for i, p in enumerate(prefs)
        ]
        store.put_table(
            "evaluate",
            f"ev-{method}",
            table("evaluation", evals),
            "evaluation",
            inputs={"outputs": f"g-{method}"},
            metrics={"win_rate": WIN_RATE[method]},
        )
    board = [
        {
            "method": m,
            "win_rate": w,
            "standard_error": 1.0,
            "mean_gold": None,
            "avg_length": 2,
            "n": 3,
            "annotator": "pool",
            "evaluation_key": f"ev-{m}",
        }
        for m, w in WIN_RATE.items()
    ]
    store.put_table("leaderboard", "lb", table("leaderboard", board), "leaderboard")
    with store.put_model("sft", "m1", "policy", config={"lr": 0.001}) as (folder, metrics):
        (folder / "model.safetensors").write_bytes(b"w")
        metrics["loss"] = 1.5
    store.append_rows(
        "annotations",
        table("annotations", [annotation("gpt4-a", 1.0, 0.002), annotation("gpt4-b", 2.0, 0.003)]),
        "annotations",
    )
    store.append_rows("annotations", table("annotations", [annotation("gpt4-a", 1.0, 0.002)]), "annotations")


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        st = LocalStore(tmp_path / "store")
    else:
        st = open_store(request.getfixturevalue("s3_uri"))
    fill(st)
    return st


def rows(con, sql: str) -> list[tuple]:
    return con.sql(sql).fetchall()


VIEW_COLUMNS = {
    "artifacts": ["stage", "key", "kind", "format", "rows", "created", "uri", "config", "inputs", "metrics"],
    "pairs": ["stage", "key", *SCHEMAS["pairs"].names],
    "outputs": ["stage", "key", *SCHEMAS["outputs"].names],
    "evaluations": ["stage", "key", *SCHEMAS["evaluation"].names],
    "leaderboard": ["stage", "key", *SCHEMAS["leaderboard"].names],
    "preferences": ["stage", "key", *SCHEMAS["preferences"].names],
    "instructions": ["stage", "key", *SCHEMAS["instructions"].names],
    "annotations": SCHEMAS["annotations"].names,
}


def test_views_columns_and_rows(store):
    con = connect(store)
    for view, columns in VIEW_COLUMNS.items():
        assert con.sql(f"SELECT * FROM {view}").columns == columns, view

    arts = rows(con, "SELECT stage, key, kind, format, rows FROM artifacts ORDER BY stage, key")
    assert arts == [
        ("data", "d1", "table", "instructions", 1),
        ("evaluate", "ev-best_of_4", "table", "evaluation", 3),
        ("evaluate", "ev-sft", "table", "evaluation", 3),
        ("generate", "g-best_of_4", "table", "outputs", 3),
        ("generate", "g-sft", "table", "outputs", 3),
        ("leaderboard", "lb", "table", "leaderboard", 2),
        ("sample_pairs", "p1", "table", "pairs", 4),
        ("sft", "m1", "model", "policy", None),
    ]
    # config, inputs and metrics are JSON; uri and created are the ref's
    assert rows(
        con, "SELECT config->>'$.temperature', inputs->>'$.data' FROM artifacts WHERE stage = 'sample_pairs'"
    ) == [("1.0", "d1")]
    assert rows(con, "SELECT (metrics->>'$.loss')::DOUBLE, config->>'$.lr' FROM artifacts WHERE kind = 'model'") == [
        (1.5, "0.001")
    ]
    ref = store.get("sample_pairs", "p1")
    assert rows(con, "SELECT uri, created FROM artifacts WHERE key = 'p1'") == [
        (ref.uri, datetime.fromisoformat(ref.created))
    ]

    assert rows(con, "SELECT stage, key, count(*) FROM pairs GROUP BY ALL") == [("sample_pairs", "p1", 4)]
    assert rows(con, "SELECT count(*) FROM outputs") == [(6,)]
    assert rows(con, "SELECT count(*) FROM preferences") == [(0,)]
    # win rate per method from the per-instruction evaluations, against the hand-computed values
    win = dict(rows(con, "SELECT generator, avg(preference - 1) * 100 FROM evaluations GROUP BY generator"))
    assert win == pytest.approx(WIN_RATE)
    assert rows(con, "SELECT method, evaluation_key FROM leaderboard ORDER BY win_rate DESC") == [
        ("best_of_4", "ev-best_of_4"),
        ("sft", "ev-sft"),
    ]
    # rows trace back to their artifacts
    assert rows(
        con,
        "SELECT DISTINCT a.stage, (a.metrics->>'$.win_rate')::DOUBLE FROM evaluations e JOIN artifacts a USING (key) "
        "WHERE e.generator = 'sft'",
    ) == [("evaluate", pytest.approx(50.0))]

    # the annotation cache: cost per annotator, and disagreement on the same pair
    cost = rows(
        con, "SELECT annotator, count(*), sum(price_usd) FROM annotations GROUP BY annotator ORDER BY annotator"
    )
    assert cost == [("gpt4-a", 2, pytest.approx(0.004)), ("gpt4-b", 1, pytest.approx(0.003))]
    disagree = rows(
        con, "SELECT count(DISTINCT preference) FROM annotations GROUP BY instruction, input, output_1, output_2"
    )
    assert disagree == [(2,)]


def test_views_never_read_uncommitted_data(store, tmp_path):
    stray = table("pairs", [{"id": "stray", "split": "pref", **PAIR}])
    if isinstance(store, LocalStore):  # a writer died before its rename: a staging folder
        (store.root / ".staging" / "sample_pairs-zz-1").mkdir(parents=True)
        pq.write_table(stray, store.root / ".staging" / "sample_pairs-zz-1" / "data.parquet")
    else:  # a writer died before its commit: an attempt folder without a commit record
        pq.write_table(stray, f"{store.base}/sample_pairs/zz/attempt/data.parquet", filesystem=store.arrow_fs)
    con = connect(store)
    assert rows(con, "SELECT count(*) FROM pairs") == [(4,)]
    assert rows(con, "SELECT count(*) FROM artifacts") == [(8,)]


def test_empty_store_has_every_view_with_its_columns(tmp_path):
    con = connect(LocalStore(tmp_path / "empty"))
    for view, columns in VIEW_COLUMNS.items():
        rel = con.sql(f"SELECT * FROM {view}")
        assert rel.columns == columns and rel.fetchall() == [], view
    types = dict(
        zip(con.sql("SELECT * FROM annotations").columns, map(str, con.sql("SELECT * FROM annotations").types))
    )
    assert (
        types["price_usd"] == "DOUBLE"
        and types["prompt_tokens"] == "BIGINT"
        and types["created"] == "TIMESTAMP WITH TIME ZONE"
    )


def test_print_views_round_trip_through_a_fresh_connection(store):
    text = create_views_sql(store)
    views = view_sql(store)
    assert set(VIEW_COLUMNS) <= set(views) and text.count("CREATE OR REPLACE VIEW") == len(views)
    fresh = duckdb.connect()
    if not isinstance(store, LocalStore):
        fresh.register_filesystem(store.fs)
    fresh.execute(text)
    ours = connect(store)
    for view in views:
        query = f"SELECT * FROM {view} ORDER BY ALL"
        assert fresh.sql(query).fetchall() == ours.sql(query).fetchall(), view


def test_sql_cli_formats(store, tmp_path):
    uri = str(store.root) if isinstance(store, LocalStore) else store.location
    query = (
        "SELECT generator, avg(preference - 1) * 100 AS win_rate, count(*) AS n FROM evaluations "
        "GROUP BY generator ORDER BY generator"
    )

    result = runner.invoke(app, ["sql", query, "--store", uri])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    header = next(line for line in lines if "generator" in line)
    assert "win_rate" in header and "n" in header
    sft_line = next(line for line in lines if " sft " in line)
    assert "50.0" in sft_line and header.index("win_rate") <= sft_line.index("50.0") + 4  # aligned under its header

    result = runner.invoke(app, ["sql", query, "--store", uri, "--format", "csv"])
    assert result.exit_code == 0, result.output
    parsed = list(csv.DictReader(io.StringIO(result.output)))
    assert [(r["generator"], float(r["win_rate"]), int(r["n"])) for r in parsed] == [
        ("best_of_4", pytest.approx(WIN_RATE["best_of_4"]), 3),
        ("sft", 50.0, 3),
    ]

    result = runner.invoke(app, ["sql", query, "--store", uri, "-f", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)[1] == {"generator": "sft", "win_rate": 50.0, "n": 3}

    out = tmp_path / "win.parquet"
    result = runner.invoke(app, ["sql", query, "--store", uri, "--format", "parquet", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert pq.read_table(out).to_pylist()[1] == {"generator": "sft", "win_rate": 50.0, "n": 3}

    assert runner.invoke(app, ["sql", query, "--store", uri, "--format", "parquet"]).exit_code == 2  # needs --output
    bad = runner.invoke(app, ["sql", "SELECT nope FROM pairs", "--store", uri])
    assert bad.exit_code == 1 and "nope" in bad.output and "Traceback" not in bad.output

    views = runner.invoke(app, ["sql", "--print-views", "--store", uri])
    assert views.exit_code == 0 and views.output.count("CREATE OR REPLACE VIEW") == len(view_sql(store))


def test_artifacts_ls_and_show(store):
    uri = str(store.root) if isinstance(store, LocalStore) else store.location
    result = runner.invoke(app, ["artifacts", "ls", "--store", uri])
    assert result.exit_code == 0, result.output
    for key in ("d1", "p1", "ev-sft", "g-best_of_4", "lb", "m1"):
        assert f" {key} " in result.output
    only = runner.invoke(app, ["artifacts", "ls", "--store", uri, "--stage", "evaluate"])
    assert only.output.count(" evaluate ") == 2 and " p1 " not in only.output

    shown = runner.invoke(app, ["artifacts", "show", "m1", "--store", uri])
    assert shown.exit_code == 0, shown.output
    record = json.loads(shown.output)
    assert (
        record["ref"]["kind"] == "model"
        and record["config"] == {"lr": 0.001}
        and record["files"] == {"model/model.safetensors": 1}
    )
    assert json.loads(runner.invoke(app, ["artifacts", "show", "sample_pairs/p", "--store", uri]).output)["inputs"] == {
        "data": "d1"
    }
    ambiguous = runner.invoke(app, ["artifacts", "show", "ev-", "--store", uri])
    assert ambiguous.exit_code == 1 and "2 artifacts match" in ambiguous.output
    assert runner.invoke(app, ["artifacts", "show", "zzz", "--store", uri]).exit_code == 1
