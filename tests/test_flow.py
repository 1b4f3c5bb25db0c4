"""The best-of-n flow end to end on synthetic-micro, with a real Prefect API.

Cache behaviour is asserted by counting executions: `farmflow.tasks.EXECUTED` counts the
stages whose computation actually ran, Prefect's task states say which were cached.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from prefect_server import all_artifacts, migrated_home

from farmflow import tasks
from farmflow.config import load_config
from farmflow.flows import best_of_n_flow

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]
sys.path.insert(0, str(Path(__file__).parent))  # test_real_farm's tiny hub-style model

ALL_STAGES = {
    "data",
    "base_model",
    "sft",
    "sample_pairs",
    "annotate",
    "train_reward",
    "generate",
    "best_of_n",
    "evaluate",
}


def _run(cfg):
    tasks.EXECUTED.clear()
    summary = best_of_n_flow(advanced=cfg)
    return summary, dict(tasks.EXECUTED)


def test_flow_end_to_end_then_fully_cached_then_only_best_of_n(micro_config):
    summary, executed = _run(micro_config)
    # cold: every stage ran; generate and evaluate once per evaluated method
    assert set(executed) == ALL_STAGES
    assert executed["generate"] == 2 and executed["evaluate"] == 3
    methods = [r["method"] for r in summary["leaderboard"]]
    assert sorted(methods) == ["best_of_4", "sft", "untrained"]
    for row in summary["leaderboard"]:
        assert 0 <= row["win_rate"] <= 100 and row["n"] == micro_config.data.eval_size
        assert 0 <= row["mean_gold"] <= 1
    assert 0 <= summary["reward_model"]["heldout_accuracy"] <= 1
    assert not any(s["cached"] for s in summary["stages"])

    # the leaderboard is a real Parquet artifact with the declared schema, plus Markdown and a plot
    folder = summary["artifacts"]["leaderboard"]
    board = pq.read_table(f"{folder}/data.parquet")
    assert board.num_rows == 3 and "win_rate" in board.column_names
    assert "| sft |" in open(f"{folder}/leaderboard.md").read()
    assert open(f"{folder}/leaderboard.png", "rb").read(4) == b"\x89PNG"
    # ... and a Prefect markdown artifact
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        keys = {a.key for a in all_artifacts(client)}
    assert {"leaderboard", "leaderboard-table"} <= keys

    # same config again: nothing executes, every stage reports cached
    again, executed = _run(micro_config)
    assert executed == {}
    assert all(s["cached"] for s in again["stages"])
    assert again["leaderboard"] == summary["leaderboard"]

    # only n changes: best-of-n and its evaluation rerun, nothing upstream
    cfg = load_config("synthetic-micro", [f"store.uri={micro_config.store.uri}", "best_of_n.n=3"])
    changed, executed = _run(cfg)
    assert executed == {"best_of_n": 1, "evaluate": 1}
    rerun = {s["stage"] for s in changed["stages"] if not s["cached"]}
    assert rerun == {"best_of_n", "evaluate best_of_3"}

    # batch sizes only: memory and speed, not results (every sample has its own random stream)
    cfg = load_config(
        "synthetic-micro", [f"store.uri={micro_config.store.uri}", "pairs.batch_size=5", "generation.batch_size=3"]
    )
    resized, executed = _run(cfg)
    assert executed == {}
    same = lambda board: [(r["method"], r["win_rate"], r["mean_gold"], r["evaluation_key"]) for r in board]  # noqa: E731
    assert same(resized["leaderboard"]) == same(
        summary["leaderboard"]
    )  # (LC win rates now pool best_of_3's evaluation too)


def test_a_change_to_one_split_reruns_only_the_stages_that_read_it(micro_config, tmp_path):
    """Each stage is keyed on the splits it reads, not the whole data artifact: a new evaluation set retrains no model.

    With a pretrained base model (the real farm's case: SFT is the expensive stage), SFT is
    keyed on the SFT split's content, pairs on PREF and val, evaluation on eval.
    """
    from test_real_farm import tiny_llama_without_pad

    folder = tiny_llama_without_pad(tmp_path / "hub-model")
    overrides = [f"store.uri={micro_config.store.uri}", f"model.pretrained={folder}"]
    _, executed = _run(load_config("synthetic-micro", overrides))
    assert set(executed) == ALL_STAGES
    eval_size = micro_config.data.eval_size + 2
    changed, executed = _run(load_config("synthetic-micro", [*overrides, f"data.eval_size={eval_size}"]))
    assert executed == {
        "data": 1,
        "generate": 2,
        "best_of_n": 1,
        "evaluate": 3,
    }  # no SFT, pairs, labels or reward model
    assert all(r["n"] == eval_size for r in changed["leaderboard"])
    _, executed = _run(load_config("synthetic-micro", [*overrides, f"data.eval_size={eval_size}", "data.val_size=5"]))
    assert executed == {"data": 1, "sample_pairs": 1, "annotate": 1, "train_reward": 1, "best_of_n": 1, "evaluate": 1}
    _, executed = _run(load_config("synthetic-micro", [*overrides, "data.sft_size=30"]))
    assert executed["sft"] == 1 and "base_model" not in executed  # a pretrained base model reads no data
    # the synthetic farm's own tokenizer is trained on the SFT split alone: a new evaluation set retrains nothing,
    # a new SFT split is a new base model
    _, executed = _run(micro_config)
    store_uri = f"store.uri={micro_config.store.uri}"
    _, executed = _run(load_config("synthetic-micro", [store_uri, f"data.eval_size={eval_size}"]))
    assert executed == {"generate": 2, "best_of_n": 1, "evaluate": 3}  # the data artifact is the run's above
    _, executed = _run(load_config("synthetic-micro", [store_uri, "data.sft_size=30"]))
    assert executed["base_model"] == 1 and executed["sft"] == 1


def test_deleted_artifact_is_recomputed_not_trusted(micro_config):
    first, _ = _run(micro_config)
    # remove the SFT checkpoint behind Prefect's back: its cached ref now points nowhere
    shutil.rmtree(first["artifacts"]["sft"])
    second, executed = _run(micro_config)
    assert executed == {"sft": 1}  # recomputed with the same key; downstream keys unchanged
    assert second["leaderboard"] == first["leaderboard"]


def test_demo_cli_runs_micro_and_prints_leaderboard(micro_config):
    from typer.testing import CliRunner

    from farmflow.cli import app

    result = CliRunner().invoke(app, ["demo", "--preset", "synthetic-micro", "--store", micro_config.store.uri])
    assert result.exit_code == 0, result.output
    for text in ("Leaderboard", "untrained", "sft", "best_of_4", "reward model", "Stages", "artifacts in"):
        assert text in result.output
    latest = CliRunner().invoke(app, ["leaderboard", "--store", micro_config.store.uri])
    assert latest.exit_code == 0, latest.output
    assert "best_of_4" in latest.output and "leaderboard.png" in latest.output
    as_json = json.loads(CliRunner().invoke(app, ["leaderboard", "--json", "--store", micro_config.store.uri]).output)
    assert {r["method"] for r in as_json["leaderboard"]} >= {
        "untrained",
        "sft",
        "best_of_4",
    } and "/leaderboard/" in as_json["artifact"]


def _fresh_prefect_env(tmp_path, **extra: str) -> dict:
    """A child process's environment with its own Prefect home and no API URL: it starts a temporary API."""
    from procs import python_env

    env = python_env(
        PREFECT_HOME=str(migrated_home(tmp_path / "prefect")),
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180",
        **extra,
    )
    env.pop("PREFECT_API_URL", None)
    return env


def test_cli_in_a_fresh_process_starts_one_temporary_api_and_reuses_it(micro_config, tmp_path):
    """Without PREFECT_API_URL the CLI starts Prefect's temporary API in the background while
    torch and the flows import; the flow run must use that server, not start a second one."""
    import json
    import subprocess
    import sys

    env = _fresh_prefect_env(tmp_path, PREFECT_LOGGING_LEVEL="INFO", FARMFLOW_LOG_DIR=str(tmp_path / "logs"))
    cli = "from farmflow.cli import app; app()"
    argv = [
        sys.executable,
        "-c",
        cli,
        "run",
        "best-of-n",
        "--preset",
        "synthetic-micro",
        "--store",
        micro_config.store.uri,
        "--json",
    ]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert sorted(r["method"] for r in summary["leaderboard"]) == ["best_of_4", "sft", "untrained"]
    # one server for the whole run: the CLI's (its start line may print before logging is set up, so it is
    # counted by its stop line); a second one started by the flow would print its own start line
    assert done.stderr.count("Stopping temporary server") == 1, done.stderr[-3000:]
    assert done.stderr.count("Starting temporary server") <= 1, done.stderr[-3000:]
    assert done.stderr.index("Stopping temporary server") > done.stderr.rindex("Beginning flow run")
    # the CLI waits for the temporary API to record every task run before it exits and stops it: stopped
    # mid-write, the API printed "Error flushing ... events" tracebacks and lost the last task runs
    (api_output,) = (tmp_path / "logs").glob("*-prefect-api-*.log")  # the server's own output
    for text in (done.stderr, api_output.read_text()):
        assert "Traceback" not in text and "Error flushing" not in text, text[-3000:]
    import sqlite3

    with contextlib.closing(sqlite3.connect(tmp_path / "prefect" / "prefect.db")) as db:
        states = dict(db.execute("select state_type, count(*) from task_run group by state_type").fetchall())
    assert set(states) == {"COMPLETED"} and states["COMPLETED"] >= len(summary["stages"]), states


def test_no_temporary_api_when_an_api_url_is_set(monkeypatch):
    import threading

    from farmflow.cli.runs import start_temporary_api

    before = threading.active_count()
    wait = start_temporary_api()  # the session's harness has set PREFECT_API_URL
    assert threading.active_count() == before and wait() is None


API_EARLY = """
import sys, httpx
from farmflow.cli.runs import start_temporary_api
wait = start_temporary_api()
assert "torch" not in sys.modules and "farmflow.flows" not in sys.modules  # nothing heavy imported yet
import farmflow.flows  # the imports the server start overlaps
wait()
from prefect.server.api.server import SubprocessASGIServer
server = SubprocessASGIServer()
print(httpx.get(server.api_url + "/health").status_code)
"""


def test_temporary_api_is_up_once_the_waiter_returns(tmp_path):
    import subprocess
    import sys

    env = _fresh_prefect_env(tmp_path)
    done = subprocess.run([sys.executable, "-c", API_EARLY], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["200"]
