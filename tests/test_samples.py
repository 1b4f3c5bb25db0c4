"""`farmflow samples`: a method's evaluated responses beside SFT's, ranked by gold, judge or reward-model score.

The store is a real one holding what a compare run commits for two methods: their outputs, evaluations, proxy
rewards and the runs rows that name them.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from farmflow.cli import app
from farmflow.storage import open_store
from farmflow.storage.schemas import SCHEMAS

IDS = ["a", "b", "c", "d"]


def commit_method(store, method: str, answers: list[str], judge: list[float], gold: list[float], reward: list[float]):
    """outputs → evaluate and proxy_reward, as a compare run commits them; returns the evaluation key."""
    outputs = [
        {"id": i, "instruction": f"say {i}", "input": "", "output": o, "generator": method, "task": "t", "score": None}
        for i, o in zip(IDS, answers)
    ]
    out = store.put_table(
        "generate", f"out-{method}", pa.Table.from_pylist(outputs, schema=SCHEMAS["outputs"]), "outputs"
    )
    evaluation = [
        {
            "id": i,
            "instruction": f"say {i}",
            "input": "",
            "output_1": "ref",
            "output_2": o,
            "generator": method,
            "annotator": "oracle",
            "preference": 1.0 + p,
            "gold_1": 0.0,
            "gold_2": g,
        }
        for i, o, p, g in zip(IDS, answers, judge, gold)
    ]
    ev = store.put_table(
        "evaluate",
        f"ev-{method}",
        pa.Table.from_pylist(evaluation, schema=SCHEMAS["evaluation"]),
        "evaluation",
        inputs={"outputs": out},
    )
    scored = [o | {"score": r} for o, r in zip(outputs, reward)]
    store.put_table(
        "proxy_reward",
        f"px-{method}",
        pa.Table.from_pylist(scored, schema=SCHEMAS["outputs"]),
        "outputs",
        inputs={"outputs": out, "reward": out},
    )
    return ev.key


@pytest.fixture
def store_uri(tmp_path):
    store = open_store(tmp_path / "store")
    keys = {
        "sft": commit_method(
            store, "sft", ["s-a", "s-b", "s-c", "s-d"], [0.5, 0.5, 0.5, 0.5], [1, 1, 1, 1], [0, 0, 0, 0]
        ),
        "ppo": commit_method(
            store, "ppo", ["p-a", "p-b", "p-c", "p-d"], [0.9, 0.1, 0.6, 0.4], [3, -2, 0.5, 2], [7, 9, 8, 6]
        ),
    }
    run = {
        "run_id": "r1",
        "flow_run_id": "f1",
        "flow_run_name": "x",
        "flow": "compare",
        "run_at": datetime.now(timezone.utc),
        "preset": "p",
        "config_key": "c",
        "history": False,
        "leaderboard_key": "lb",
    }
    rows = [run | {"method": m, "evaluation_key": k} for m, k in keys.items()]
    store.append_rows("runs", pa.Table.from_pylist(rows, schema=SCHEMAS["runs"]), "runs")
    return str(store.root)


def samples(store_uri: str, *args: str):
    res = CliRunner().invoke(app, ["samples", *args, "--store", store_uri])
    return res


def test_worst_by_gold_side_by_side_with_sft(store_uri):
    res = samples(store_uri, "--method", "ppo", "--worst", "2", "--format", "json")
    assert res.exit_code == 0, res.output
    shown = json.loads(res.output)
    assert [s["id"] for s in shown] == ["b", "c"]  # gold -2 and 0.5: the two lowest
    assert shown[0]["ppo"] == {"output": "p-b", "judge": pytest.approx(0.1), "gold": -2.0, "reward": 9.0}
    assert shown[0]["sft"]["output"] == "s-b" and shown[0]["sft"]["reward"] == 0.0


def test_best_by_judge_and_by_reward(store_uri):
    by_judge = json.loads(samples(store_uri, "-m", "ppo", "--best", "--by", "judge", "2", "-f", "json").output)
    assert [s["id"] for s in by_judge] == ["a", "c"]  # P(beats the reference) 0.9, 0.6
    by_reward = json.loads(samples(store_uri, "-m", "ppo", "--best", "--by", "reward", "1", "-f", "json").output)
    assert [s["id"] for s in by_reward] == ["b"]  # reward 9, though its gold is the worst


def test_random_is_seeded_and_the_table_shows_both_answers(store_uri):
    one = samples(store_uri, "-m", "ppo", "--random", "--seed", "3", "3", "-f", "json").output
    assert one == samples(store_uri, "-m", "ppo", "--seed", "3", "3", "-f", "json").output  # --random is the default
    assert len(json.loads(one)) == 3
    table = samples(store_uri, "-m", "ppo", "--worst", "1")
    assert table.exit_code == 0 and "p-b" in table.output and "s-b" in table.output and "gold reward" in table.output


def test_unknown_method_names_the_ones_there(store_uri):
    res = samples(store_uri, "-m", "dpo")
    assert res.exit_code != 0 and "no evaluated run of 'dpo'" in res.output and "ppo, sft" in res.output
