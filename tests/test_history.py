"""The runs table and the trend across runs: `farmflow.evaluation.history`, `farmflow leaderboard`,
`farmflow history`, the DuckDB views, and two real compare runs on synthetic-micro."""

from __future__ import annotations

import csv
import io
import json
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prefect_server import all_artifacts
from typer.testing import CliRunner

from farmflow.cli import app
from farmflow.evaluation.history import flag_changes, pick_run, run_rows, significant, trend, trend_long, trend_text
from farmflow.storage import LocalStore
from farmflow.storage.schemas import SCHEMAS
from farmflow.storage.sql import connect

runner = CliRunner()


def run_info(i: int, preset: str = "synthetic-micro", history: bool = True, config_key: str = "cfg0") -> dict:
    return {
        "run_id": f"{i:x}0aa00{i:x}",
        "flow_run_id": f"0199-{i}-flow-run",
        "flow_run_name": f"compare/{preset}/{config_key}",
        "flow": "compare",
        "run_at": datetime(2026, 3, 1 + i, 2, 30, tzinfo=timezone.utc),
        "preset": preset,
        "config_key": config_key,
        "history": history,
        "leaderboard_key": f"lb{i}",
    }


def board_row(method: str, win: float, se: float, gold: float = float("nan")) -> dict:
    return {f.name: None for f in SCHEMAS["leaderboard"]} | {
        "method": method,
        "family": "x",
        "win_rate": win,
        "standard_error": se,
        "mean_gold": gold,
        "gold_standard_error": 0.01,
        "lc_win_rate": win - 1,
        "avg_length": 12,
        "n": 16,
        "annotator": "oracle pool (3)",
        "evaluation_key": f"ev-{method}",
    }


def rows_of(*runs: tuple[dict, list[dict]]) -> list[dict]:
    return [r for info, board in runs for r in run_rows(board, info).to_pylist()]


# -------------------------------------------------------------- the plain functions
def test_run_rows_put_the_run_before_each_leaderboard_row_and_nan_gold_becomes_null():
    cost = {"train_seconds": 10.0, "wall_seconds": 12.5, "api_usd": 0.25, "api_requests": 40.0, "pareto": True}
    table = run_rows([board_row("sft", 40.0, 3.0, gold=0.5) | cost, board_row("dpo", 55.5, 4.0)], run_info(1))
    assert table.schema == SCHEMAS["runs"]
    rows = table.to_pylist()
    assert [(r["run_id"], r["preset"], r["method"], r["win_rate"]) for r in rows] == [
        ("10aa001", "synthetic-micro", "sft", 40.0),
        ("10aa001", "synthetic-micro", "dpo", 55.5),
    ]
    assert [r["mean_gold"] for r in rows] == [0.5, None]  # the real farm has no gold reward: null, not NaN
    assert rows[0]["leaderboard_key"] == "lb1" and rows[1]["evaluation_key"] == "ev-dpo" and rows[0]["history"] is True
    assert {k: rows[0][k] for k in cost} == cost  # each row's cost rides along
    assert rows[1]["wall_seconds"] is None and rows[1]["pareto"] is None


def test_a_change_of_exactly_two_combined_ses_is_not_flagged_just_above_is():
    # se 3 and 4: combined sqrt(9 + 16) = 5, so the threshold is 10 win-rate points (exact in floating point)
    assert not significant({"win_rate": 50.0, "standard_error": 3.0}, {"win_rate": 60.0, "standard_error": 4.0})
    assert significant({"win_rate": 50.0, "standard_error": 3.0}, {"win_rate": 60.01, "standard_error": 4.0})
    assert not significant({"win_rate": 50.0, "standard_error": None}, {"win_rate": 90.0, "standard_error": 4.0})
    rows = rows_of(
        (run_info(1), [board_row("sft", 50.0, 3.0), board_row("dpo", 50.0, 3.0), board_row("ppo", 70.0, 3.0)]),
        (run_info(2), [board_row("sft", 60.0, 4.0), board_row("dpo", 60.01, 4.0)]),  # ppo not in this run
        (run_info(3), [board_row("sft", 60.0, 4.0), board_row("dpo", 60.01, 4.0), board_row("ppo", 59.9, 4.0)]),
    )
    changes = flag_changes(rows)
    # dpo rose by 10.01 > 10; ppo's consecutive runs are 1 and 3: it fell by 10.1 > 10; sft's +10 is not flagged
    assert [(c["method"], c["from_run"], c["to_run"], c["mark"]) for c in changes] == [
        ("dpo", "10aa001", "20aa002", "▲"),
        ("ppo", "10aa001", "30aa003", "▼"),
    ]
    assert changes[0]["delta"] == pytest.approx(10.01) and changes[0]["threshold"] == 10.0
    assert changes[1]["delta"] == pytest.approx(-10.1)


def test_trend_one_column_per_run_oldest_first_with_marks_and_last_n():
    rows = rows_of(
        (run_info(3), [board_row("sft", 60.0, 4.0, 0.52), board_row("dpo", 80.0, 3.0, 0.7)]),  # appended out of order
        (run_info(1), [board_row("sft", 50.0, 3.0, 0.5), board_row("dpo", 50.0, 3.0, 0.6)]),
        (run_info(2, config_key="cfg1"), [board_row("sft", 50.0, 3.0, 0.5)]),
    )
    t = trend(rows)
    assert [r["run_id"] for r in t["runs"]] == ["10aa001", "20aa002", "30aa003"]
    assert [m["method"] for m in t["methods"]] == ["dpo", "sft"]  # by win rate in the newest run
    dpo = t["methods"][0]["cells"]
    # 50 → 80 across the run without dpo
    assert dpo[1] is None and dpo[2]["flag"] == "▲" and dpo[2]["delta"] == 30.0
    sft = t["methods"][1]["cells"]
    assert [c["flag"] for c in sft] == ["", "", ""] and [c["delta"] for c in sft] == [None, 0.0, 10.0]
    text = trend_text(t, "History")
    assert (
        "80.0 ± 3.0 ▲" in text
        and "cfg1" in text
        and "▲ dpo: 50.0 → 80.0 (Δ +30.0, 2 combined SEs 8.5), run 10aa001 → 30aa003" in text
    )
    assert "mean gold reward ± SE" in text and "0.700 ± 0.010" in text
    newest = trend(rows, last=2)
    assert [r["run_id"] for r in newest["runs"]] == ["20aa002", "30aa003"] and newest[
        "changes"
    ] == []  # dpo has one run there
    assert [(r["run_id"], r["method"]) for r in trend_long(newest)] == [
        ("20aa002", "sft"),
        ("30aa003", "dpo"),
        ("30aa003", "sft"),
    ]


def test_pick_run_by_id_or_flow_run_id_prefix_and_default_preset():
    rows = rows_of(
        (run_info(1), [board_row("sft", 50.0, 3.0)]),
        (run_info(2, preset="synthetic-tiny"), [board_row("sft", 40.0, 3.0)]),
        (run_info(3), [board_row("sft", 30.0, 3.0), board_row("dpo", 60.0, 3.0)]),
    )
    board, why = pick_run(rows)
    assert board[0]["run_id"] == "20aa002" and why == "the newest run of preset synthetic-tiny (the default)"
    board, why = pick_run(rows, preset="synthetic-micro")
    assert [r["method"] for r in board] == ["dpo", "sft"] and board[0]["run_id"] == "30aa003"
    assert pick_run(rows, run="0199-1-")[0][0]["run_id"] == "10aa001"
    with pytest.raises(LookupError, match="several runs match '0199'"):
        pick_run(rows, run="0199")
    with pytest.raises(
        LookupError,
        match="no runs of preset 'alpaca-small' in this store; presets with runs: synthetic-micro, synthetic-tiny",
    ):
        pick_run(rows, preset="alpaca-small")
    only_micro = [r for r in rows if r["preset"] == "synthetic-micro"]
    assert (
        pick_run(only_micro)[1]
        == "the newest run of preset synthetic-micro (no runs of synthetic-tiny; the preset of the newest run)"
    )


# ------------------------------------------------------------- store, DuckDB, CLI
@pytest.fixture
def store(tmp_path):
    """A real store with three recorded runs: two of synthetic-micro (the second one flagged for best_of_4) and one of
    synthetic-tiny recorded without history, plus the leaderboard artifact of the newest micro run."""
    st = LocalStore(tmp_path / "store")
    st.append_rows(
        "runs",
        run_rows([board_row("best_of_4", 50.0, 3.0, 0.6), board_row("sft", 45.0, 3.0, 0.5)], run_info(1)),
        "runs",
    )
    st.append_rows(
        "runs", run_rows([board_row("sft", 30.0, 3.0)], run_info(2, preset="synthetic-tiny", history=False)), "runs"
    )
    board3 = [board_row("best_of_4", 65.0, 4.0, 0.7), board_row("sft", 45.0, 3.0, 0.5)]
    st.append_rows("runs", run_rows(board3, run_info(3, config_key="cfg1")), "runs")
    table = run_rows(board3, run_info(3)).select(SCHEMAS["leaderboard"].names)
    st.put_table("leaderboard", "lb3", table, "leaderboard", extra_files={"leaderboard.md": b"# board"})
    return st


def invoke(*args: str):
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def test_sql_queries_runs_and_leaderboard_history_reads_runs_with_history_and_legacy_chunks(store, tmp_path):
    # a chunk of the row log stores wrote before the runs table, from a version without gold_standard_error
    legacy = run_rows([board_row("sft", 42.0, 3.0)], run_info(0, config_key="old")).to_pylist()
    cols = [c for c in SCHEMAS["leaderboard_history"].names if c != "gold_standard_error"]
    folder = tmp_path / "store" / "_rows" / "leaderboard_history"
    folder.mkdir(parents=True)
    pq.write_table(
        pa.Table.from_pylist([{c: r[c] for c in cols} for r in legacy]),
        folder / "2026-03-01T023000.000000Z0000-00000000.parquet",
    )
    out = json.loads(invoke("sql", "select count(*) as n from runs", "--store", str(store.root), "--format", "json"))
    assert out == [{"n": 5}]
    con = connect(store)
    assert con.sql("SELECT * FROM runs").columns == SCHEMAS["runs"].names
    history = con.sql(
        "SELECT config_key, method, win_rate, gold_standard_error FROM leaderboard_history ORDER BY run_at, method"
    ).fetchall()
    # the legacy chunk, then the two micro runs recorded with history; the tiny run recorded without it is not there
    assert history == [
        ("old", "sft", 42.0, None),
        ("cfg0", "best_of_4", 50.0, 0.01),
        ("cfg0", "sft", 45.0, 0.01),
        ("cfg1", "best_of_4", 65.0, 0.01),
        ("cfg1", "sft", 45.0, 0.01),
    ]
    assert con.sql("SELECT * FROM leaderboard_history").columns == SCHEMAS["leaderboard_history"].names


def test_leaderboard_shows_one_run_by_id_or_preset(store):
    out = invoke("leaderboard", "--store", str(store.root))
    assert "showing the newest run of preset synthetic-tiny (the default)" in out and "20aa002" in out
    shown = json.loads(invoke("leaderboard", "--store", str(store.root), "--preset", "synthetic-micro", "--json"))
    assert (
        shown["run"]["run_id"] == "30aa003"
        and shown["run"]["config_key"] == "cfg1"
        and shown["run"]["run_at"].startswith("2026-03-04")
    )
    assert [(r["method"], r["win_rate"]) for r in shown["leaderboard"]] == [("best_of_4", 65.0), ("sft", 45.0)]
    assert shown["artifact"] == store.get("leaderboard", "lb3").uri and set(shown["leaderboard"][0]) == set(
        SCHEMAS["leaderboard"].names
    )
    by_id = json.loads(invoke("leaderboard", "--store", str(store.root), "--run", "10aa", "--json"))
    assert (
        by_id["shown"] == "run 10aa001" and by_id["artifact"] is None
    )  # its leaderboard artifact is not in this store
    assert [r["mean_gold"] for r in by_id["leaderboard"]] == [0.6, 0.5]
    bad = runner.invoke(app, ["leaderboard", "--store", str(store.root), "--run", "zz"])
    assert bad.exit_code == 2 and "no run matches 'zz'; newest runs: 10aa001, 20aa002, 30aa003" in bad.output


def test_leaderboard_of_a_store_without_runs_shows_its_newest_leaderboard_artifact(tmp_path):
    st = LocalStore(tmp_path / "old")
    st.put_table(
        "leaderboard",
        "lb",
        run_rows([board_row("sft", 45.0, 3.0)], run_info(1)).select(SCHEMAS["leaderboard"].names),
        "leaderboard",
    )
    shown = json.loads(invoke("leaderboard", "--store", str(st.root), "--json"))
    assert (
        shown["run"] is None
        and shown["artifact"] == st.get("leaderboard", "lb").uri
        and shown["leaderboard"][0]["win_rate"] == 45.0
    )
    assert "the newest leaderboard artifact (this store has no runs table)" in shown["shown"]
    assert runner.invoke(app, ["leaderboard", "--store", str(st.root), "--preset", "synthetic-micro"]).exit_code == 1


def test_history_command_text_md_csv_and_json(store, tmp_path):
    text = invoke("history", "--store", str(store.root), "--preset", "synthetic-micro")
    # best_of_4: 50 ± 3 → 65 ± 4, |Δ| = 15 > 2·5 = 10: flagged
    assert (
        "65.0 ± 4.0 ▲" in text
        and "▲ best_of_4: 50.0 → 65.0 (Δ +15.0, 2 combined SEs 10.0), run 10aa001 → 30aa003" in text
    )
    md = invoke("history", "--store", str(store.root), "--preset", "synthetic-micro", "--format", "md")
    assert "| best_of_4 | 50.0 ± 3.0 | 65.0 ± 4.0 ▲ |" in md and "* ▲ best_of_4: 50.0 → 65.0" in md
    rows = list(
        csv.DictReader(
            io.StringIO(invoke("history", "--store", str(store.root), "--preset", "synthetic-micro", "--format", "csv"))
        )
    )
    assert [(r["run_id"], r["method"], r["win_rate"], r["flag"]) for r in rows] == [
        ("10aa001", "best_of_4", "50.0", ""),
        ("10aa001", "sft", "45.0", ""),
        ("30aa003", "best_of_4", "65.0", "▲"),
        ("30aa003", "sft", "45.0", ""),
    ]
    plot = tmp_path / "trend.png"
    data = json.loads(invoke("history", "--store", str(store.root), "--json", "--last", "1", "--plot", str(plot)))
    assert (
        data["preset"] == "synthetic-tiny"
        and [r["run_id"] for r in data["runs"]] == ["20aa002"]
        and data["changes"] == []
    )
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert runner.invoke(app, ["history", "--store", str(store.root), "--format", "html"]).exit_code == 2
    for i in range(
        4, 12
    ):  # eight more runs: a table wider than 80 columns is never cut or wrapped (CliRunner is not a tty)
        store.append_rows("runs", run_rows([board_row("reward_conditioning", 50.0 + i, 3.0)], run_info(i)), "runs")
    wide = invoke("history", "--store", str(store.root), "--preset", "synthetic-micro", "--last", "10").splitlines()
    (row,) = [line for line in wide if line.startswith("reward_conditioning")]
    assert len(row) > 120 and row.count("±") == 8 and row.endswith("61.0 ± 3.0")
    (tmp_path / "empty").mkdir()  # an existing store without runs (a missing one is refused: test_bad_inputs)
    empty = runner.invoke(app, ["history", "--store", str(tmp_path / "empty")])
    assert empty.exit_code == 1 and "no runs recorded in this store yet" in empty.output


# ------------------------------------------------------------- the flow
@pytest.mark.usefixtures("prefect_harness")
def test_two_compare_runs_are_recorded_and_the_second_publishes_the_trend(micro_config):
    from prefect.client.orchestration import get_client

    from farmflow.config import load_config
    from farmflow.flows import compare_flow

    root = micro_config.store.uri
    manual = compare_flow(advanced=micro_config, methods=["best_of_n"])  # a manual run: recorded, no trend published
    changed = load_config("synthetic-micro", [f"store.uri={root}", "best_of_n.n=2"])
    nightly = compare_flow(advanced=changed, methods=["best_of_n"], history=True)
    assert manual["run"]["rows"] == nightly["run"]["rows"] == 3 and "history" not in manual["artifacts"]

    store = LocalStore(root)
    runs = store.read_rows("runs", "runs").to_pylist()
    methods: dict[str, set[str]] = {}
    for r in runs:
        methods.setdefault(r["run_id"], set()).add(r["method"])
    assert methods == {
        manual["run"]["run_id"]: {"best_of_4", "sft", "untrained"},
        nightly["run"]["run_id"]: {"best_of_2", "sft", "untrained"},
    }
    first, second = runs[0], runs[-1]
    assert (
        first["run_id"] == first["flow_run_id"].replace("-", "")[-8:]
        and first["flow"] == "compare"
        and first["history"] is False
    )
    assert (first["config_key"], second["config_key"]) == (manual["config_key"], nightly["config_key"]) and first[
        "config_key"
    ] != second["config_key"]
    assert {r["method"]: r["win_rate"] for r in runs if r["run_id"] == first["run_id"]} == {
        r["method"]: r["win_rate"] for r in manual["leaderboard"]
    }
    assert all(
        r["mean_gold"] is not None
        and r["n"] == micro_config.data.eval_size
        and store.get("evaluate", r["evaluation_key"])
        for r in runs
    )
    assert store.get("leaderboard", second["leaderboard_key"]).uri == nightly["artifacts"]["leaderboard"]

    # the trend: both runs, the unchanged baselines equal in both, as the command and in the store's history artifact
    data = json.loads(invoke("history", "--store", root, "--json"))
    assert data["preset"] == "synthetic-micro" and [r["run_id"] for r in data["runs"]] == [
        first["run_id"],
        second["run_id"],
    ]
    sft = [r for r in data["trend"] if r["method"] == "sft"]
    assert len(sft) == 2 and sft[0]["win_rate"] == sft[1]["win_rate"] and sft[1]["delta"] == 0.0
    folder = nightly["artifacts"]["history"]
    assert (
        open(f"{folder}/history.png", "rb").read(4) == b"\x89PNG" and "best_of_2" in open(f"{folder}/history.md").read()
    )
    with get_client(sync_client=True) as client:
        artifacts = all_artifacts(client)
    keys = {
        run: {a.key for a in artifacts if str(a.flow_run_id) == run}
        for run in (first["flow_run_id"], second["flow_run_id"])
    }
    assert {"leaderboard", "overoptimization"} <= keys[first["flow_run_id"]]
    assert "history" in keys[second["flow_run_id"]] and "history" not in keys[first["flow_run_id"]]
    (published,) = [a for a in artifacts if str(a.flow_run_id) == second["flow_run_id"] and a.key == "history"]
    assert (
        f"`{first['run_id']}`" in published.data
        and f"`{second['run_id']}`" in published.data
        and folder in published.data
    )
    # the leaderboard_history view counts only the run made with history
    assert connect(store).sql("SELECT DISTINCT flow_run_id FROM leaderboard_history").fetchall() == [
        (second["flow_run_id"],)
    ]
