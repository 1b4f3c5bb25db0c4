"""Simulate, then validate with people, at micro size: label pairs through the labeling server's HTTP API, train a
reward model and DPO on a person's labels, measure every simulated annotator against them, re-judge the leaderboard
with them, and show each row's cost beside its quality. Every stage is the real one, called without Prefect."""

from __future__ import annotations

import json
import math
import threading
import time

import httpx
import pytest
from typer.testing import CliRunner

from farmflow.cli import app
from farmflow.config import AnnotatorConfig, load_config
from farmflow.evaluation.cost import COST_COLUMNS
from farmflow.labeling.labels import labels, load_pairs
from farmflow.labeling.server import make_app
from farmflow.loopback import free_port
from farmflow.storage import open_store
from farmflow.tasks import TASKS
from farmflow.tasks.methods import dpo_task, reference_logps_task
from farmflow.tasks.preferences import human_config, human_preferences_task


class LabelServer:
    """The labeling app on a real uvicorn server on 127.0.0.1, in a thread."""

    def __init__(self, store, pairs: list[dict], labeler: str):
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(make_app(store, pairs, labeler), host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the labeling server did not start"
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def label_all(url: str, labeler: str, choose) -> int:
    """Label every pair the server offers `labeler`: `choose(first, second)` gives the key pressed (1, 2 or t)."""
    n = 0
    state = httpx.get(f"{url}/api/state", params={"labeler": labeler}).json()
    while state["pair"] is not None:
        pair = state["pair"]
        answer = httpx.post(
            f"{url}/api/label",
            json={"labeler": labeler, "key": pair["key"], "label": choose(pair["first"], pair["second"])},
        )
        assert answer.status_code == 200, answer.text
        state, n = answer.json(), n + 1
    assert state["done"] == state["total"] == n
    return n


def longer(first: str, second: str) -> str:
    """A labeler who prefers the longer output (the first shown on equal length)."""
    return "2" if len(second) > len(first) else "1"


def shorter(first: str, second: str) -> str:
    return "1" if longer(first, second) == "2" else "2"


def own(row: dict, pair: dict) -> float:
    """A stored label's preference in `pair`'s own output order."""
    return row["preference"] if row["output_1"] == pair["output_1"] else 3.0 - row["preference"]


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    """A micro farm's stages up to the reward model on the simulated labels, and the config."""
    uri = str(tmp_path_factory.mktemp("human") / "store")
    cfg = load_config("synthetic-micro")
    data_cfg = cfg.data.model_copy(update={"sft_size": 24, "pref_size": 24, "unlabeled_size": 0, "eval_size": 6})
    data_cfg = data_cfg.model_copy(update={"val_size": 4})
    refs = {"data": TASKS["data"].fn(uri, data_cfg)}
    refs["base"] = TASKS["base_model"].fn(uri, cfg.model, data=refs["data"])
    refs["sft"] = TASKS["sft"].fn(uri, cfg.sft, data=refs["data"], base=refs["base"])
    refs["pairs"] = TASKS["sample_pairs"].fn(uri, cfg.pairs, data=refs["data"], policy=refs["sft"])
    return uri, cfg, refs


def test_human_arm_people_as_reference_and_judge_and_cost(farm, tmp_path):
    uri, cfg, refs = farm
    store = open_store(uri)
    cli = CliRunner()

    # 1. alice labels the sampled pairs through the labeling server; her labels train a reward model and DPO
    pairs = load_pairs(store, f"sample_pairs/{refs['pairs'].key}")
    with LabelServer(store, pairs, "alice") as url:
        assert label_all(url, "alice", longer) == len({(p["instruction"], p["output_1"], p["output_2"]) for p in pairs})
    prefs = human_preferences_task.fn(uri, human_config(store, "alice"), pairs=refs["pairs"])
    rows = store.read_table(prefs).to_pylist()
    given = {
        (r["instruction"], r["input"], frozenset((r["output_1"], r["output_2"]))): r for r in labels(store, "alice")
    }
    assert len(rows) == len(pairs) and {r["annotator"] for r in rows} == {"human:alice"}
    for r in rows:
        assert r["preference"] == own(
            given[(r["instruction"], r["input"], frozenset((r["output_1"], r["output_2"])))], r
        )
        if len(r["output_1"]) != len(r["output_2"]):  # alice's rule, read back from the stage's table
            assert r["preference"] == (2.0 if len(r["output_2"]) > len(r["output_1"]) else 1.0)
    reward = TASKS["train_reward"].fn(uri, cfg.reward, preferences=prefs, sft=refs["sft"])
    assert store.record(reward)["inputs"]["preferences"] == prefs.key
    reference = reference_logps_task.fn(uri, {}, preferences=prefs, sft=refs["sft"])
    dpo = dpo_task.fn(uri, cfg.dpo, preferences=prefs, sft=refs["sft"], reference=reference)
    assert dpo.metrics["pairs"] == sum(r["split"] == "pref" for r in rows)
    # the feedback-size study's shares of these preferences: nested, val pairs whole, cached per share
    from farmflow.tasks.preferences import subsample_preferences_task

    half = subsample_preferences_task.fn(uri, {"fraction": 0.5, "seed": 0}, preferences=prefs)
    quarter = subsample_preferences_task.fn(uri, {"fraction": 0.25, "seed": 0}, preferences=prefs)
    n_pref = sum(r["split"] == "pref" for r in rows)
    assert half.metrics["pref_pairs"] == math.ceil(n_pref / 2) and quarter.metrics["pref_pairs"] == math.ceil(
        n_pref / 4
    )
    ids = lambda ref: {r["id"] for r in store.read_table(ref).to_pylist()}  # noqa: E731
    assert ids(quarter) < ids(half) and {r["id"] for r in rows if r["split"] == "val"} <= ids(quarter)
    assert subsample_preferences_task.fn(uri, {"fraction": 0.5, "seed": 0}, preferences=prefs).key == half.key
    # unchanged labels: the same stage key; a label taken back: new preferences
    assert human_preferences_task.fn(uri, human_config(store, "alice"), pairs=refs["pairs"]).key == prefs.key
    with LabelServer(store, pairs, "alice") as url:
        httpx.post(f"{url}/api/undo", json={"labeler": "alice"}).raise_for_status()
    assert human_config(store, "alice")["labels"] != store.record(prefs)["config"]["labels"]

    # 2. three methods evaluated by the simulated judge, one leaderboard
    sample = {"sample": cfg.generation, "control": ""}
    outputs = {
        "sft": TASKS["generate"].fn(uri, sample | {"generator": "sft"}, data=refs["data"], policy=refs["sft"]),
        "dpo": TASKS["generate"].fn(uri, sample | {"generator": "dpo"}, data=refs["data"], policy=dpo),
        "best_of_2": TASKS["best_of_n"].fn(
            uri,
            {"best_of_n": cfg.best_of_n.model_copy(update={"n": 2}), "max_new_tokens": 12, "split": "eval"},
            data=refs["data"],
            policy=refs["sft"],
            reward=reward,
        ),
    }
    evaluations = {
        m: TASKS["evaluate"].fn(uri, cfg.evaluation.annotator, outputs=o, data=refs["data"]) for m, o in outputs.items()
    }
    from farmflow.tasks.analysis import leaderboard_task

    board = leaderboard_task.fn(uri, evaluations)

    # 3. alice and bob label the leaderboard's evaluation pairs (bob prefers the shorter output)
    eval_pairs = load_pairs(store, board.key[:16])
    with LabelServer(store, eval_pairs, "alice") as url:
        label_all(url, "alice", longer)
        label_all(url, "bob", shorter)

    # 4. agreement: every simulated annotator of the evaluation pool against the people, and people against each other
    result = cli.invoke(
        app,
        ["eval", "annotators", "--reference", "human", "--oracle", "--preset", "synthetic-micro", "--store", uri]
        + ["--draws", "2", "--json"],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    pool = {a.name for a in cfg.evaluation.annotator.pool}
    assert {r["annotator"] for r in report["annotators"]} == pool
    for r in report["annotators"]:
        assert r["ci_low"] <= r["agreement"] <= r["ci_high"] and r["labels"] == 2 * r["pairs"]
    people = {r["annotator"]: r for r in report["humans"]}
    both = {}  # pair content → (alice, bob) in the same output order
    for name in ("alice", "bob"):
        for r in labels(store, name):
            both.setdefault((r["instruction"], r["input"], r["output_1"], r["output_2"]), {})[name] = r["preference"]
    compared = [v for v in both.values() if len(v) == 2]
    same = sum(v["alice"] == v["bob"] for v in compared)
    assert people["human vs human"]["n"] == 2 * len(compared)
    assert people["human vs human"]["agreement"] == pytest.approx(same / len(compared))
    assert report["rankings"]["methods"] == 3 and report["rankings"]["leaderboard"] == board.key

    # 5. the leaderboard judged by alice: her labels of each method's pairs, by hand
    result = cli.invoke(app, ["leaderboard", "--store", uri, "--judge", "human:alice", "--json"])
    assert result.exit_code == 0, result.output
    judged = {r["method"]: r for r in json.loads(result.stdout)["leaderboard"]}
    mine = {
        (r["instruction"], r["input"], frozenset((r["output_1"], r["output_2"]))): r for r in labels(store, "alice")
    }
    for method, ev in evaluations.items():
        wins = [
            own(mine[(r["instruction"], r["input"], frozenset((r["output_1"], r["output_2"])))], r) - 1
            for r in store.read_table(ev).to_pylist()
        ]
        assert judged[method]["n"] == len(wins)
        assert judged[method]["win_rate"] == pytest.approx(100 * sum(wins) / len(wins))
        assert judged[method]["simulated_win_rate"] == pytest.approx(ev.metrics["win_rate"])
    result = cli.invoke(app, ["leaderboard", "--store", uri, "--judge", "human:alice"])
    assert "ranking under people vs the simulated judge: 3 method" in result.stdout

    # 6. cost beside quality: each row's seconds are the sums of its stages' recorded seconds
    plot = tmp_path / "cost.png"
    result = cli.invoke(app, ["leaderboard", "--store", uri, "--cost", "--cost-plot", str(plot), "--json"])
    assert result.exit_code == 0, result.output
    costed = {r["method"]: r for r in json.loads(result.stdout)["leaderboard"]}
    s = lambda *names: sum(refs[n].metrics["seconds"] for n in names)  # noqa: E731
    assert costed["sft"]["train_seconds"] == pytest.approx(s("data", "base", "sft"))
    assert costed["sft"]["answer_seconds"] == pytest.approx(outputs["sft"].metrics["seconds"])
    assert costed["sft"]["judge_seconds"] == pytest.approx(evaluations["sft"].metrics["seconds"])
    human_arm = s("data", "base", "sft", "pairs") + prefs.metrics["seconds"]
    assert costed["best_of_2"]["train_seconds"] == pytest.approx(human_arm + reward.metrics["seconds"])
    assert costed["dpo"]["train_seconds"] == pytest.approx(
        human_arm + reference.metrics["seconds"] + dpo.metrics["seconds"]
    )
    for r in costed.values():
        assert r["wall_seconds"] == pytest.approx(r["train_seconds"] + r["answer_seconds"] + r["judge_seconds"])
        assert r["api_usd"] == 0 and r["api_requests"] == 0  # the oracle pool and people are free
    cheapest = min(costed.values(), key=lambda r: r["wall_seconds"])
    assert cheapest["pareto"]
    assert not any(
        r["pareto"]
        and any(o["wall_seconds"] <= r["wall_seconds"] and o["win_rate"] > r["win_rate"] for o in costed.values())
        for r in costed.values()
    )
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stored = {r["method"]: r for r in store.read_table(board).to_pylist()}  # the board's Parquet holds the same
    for method, r in costed.items():
        assert {c: stored[method][c] for c in (*COST_COLUMNS, "pareto")} == pytest.approx(
            {c: r[c] for c in (*COST_COLUMNS, "pareto")}
        )


def test_human_annotator_config_is_a_bare_value_and_leaves_other_keys_alone():
    from farmflow.tasks.keys import key_config

    cfg = AnnotatorConfig.model_validate("human:alice")
    assert (cfg.kind, cfg.labeler) == ("human", "alice")
    assert "labeler" not in key_config(AnnotatorConfig())  # existing annotate/evaluate keys are unchanged
    with pytest.raises(ValueError, match="needs labeler"):
        AnnotatorConfig(kind="human")
    farm = load_config("synthetic-micro", ["annotation=human:alice"])
    assert farm.annotation.kind == "human"
    from farmflow.annotators import annotate

    with pytest.raises(ValueError, match="leaderboard --judge human:alice"):
        annotate([], cfg)


def test_agreement_with_people_by_hand():
    from farmflow.evaluation.agreement import wilson
    from farmflow.evaluation.human import human_agreement

    def lab(who: str, i: int, p: float, flip: bool = False) -> dict:
        a, b = f"short {i}", f"a much longer answer {i}"
        return {
            "instruction": f"q{i}",
            "input": "",
            "output_1": b if flip else a,
            "output_2": a if flip else b,
            "annotator": who,
            "preference": 3.0 - p if flip else p,
        }

    rows = [lab("human:ann", i, 2.0) for i in range(4)] + [lab("human:bob", 0, 1.0), lab("human:bob", 1, 2.0)]
    # sim: draws on q0 (2, 2), q1 (1, 2 given in the flipped order), q2 (1), q3 (2); q0's humans split: left out
    rows += [lab("sim", 0, 2.0), lab("sim", 0, 2.0), lab("sim", 1, 1.0), lab("sim", 1, 2.0, flip=True)]
    rows += [lab("sim", 2, 1.0), lab("sim", 3, 2.0)]
    report = human_agreement(rows)
    sim = report["annotators"][0]
    # the human majority: q0 split (1.5, left out), q1..q3 output_2; sim's labels there: 1, 2, 1, 2 → 2 of 4
    assert (sim["n"], sim["agreement"]) == (4, 0.5)
    assert (sim["ci_low"], sim["ci_high"]) == pytest.approx(wilson(2, 4))
    assert sim["bias"] == pytest.approx((0.5 + 1 + 0) / 3)  # modes: q1 1.5 (a split), q2 1, q3 2
    assert sim["variance"] == pytest.approx((0 + 0 + 1 + 1) / 4)  # q0: (2, 2) agree; q1: (1, 2) disagree
    assert sim["length_pref"] == pytest.approx(4 / 6)
    people = {r["annotator"]: r for r in report["humans"]}
    assert (people["human:ann"]["n"], people["human:ann"]["agreement"]) == (2, 0.5)  # vs bob on q0 (no), q1 (yes)
    assert people["human vs human"]["n"] == 4 and people["human vs human"]["agreement"] == 0.5
    assert report["pairs"] == 4 and report["pairs_labeled_twice"] == 2


def test_ranking_agreement_and_pareto_and_nested_subsets(tmp_path):
    from farmflow.evaluation.cost import pareto
    from farmflow.evaluation.human import ranking_agreement
    from farmflow.tasks.preferences import subsample

    def ev(method: int) -> list[dict]:  # method m wins instruction i when i < m (of 6)
        return [
            {"id": str(i), "instruction": f"q{i}", "input": "", "output_1": f"ref {i}", "output_2": f"m{method} {i}"}
            | {"preference": 2.0 if i < method else 1.0}
            for i in range(6)
        ]

    evals = {f"m{m}": ev(m) for m in (1, 3, 5)}
    humans = {}
    from farmflow.evaluation.analysis import pair_key

    for rows in evals.values():
        for r in rows:
            key, flipped = pair_key(r)
            humans[key] = 3.0 - r["preference"] if flipped else r["preference"]  # people agree with the judge
    out = ranking_agreement(evals, humans)
    assert out["methods"] == 3 and out["spearman"] == pytest.approx(1.0)
    assert out["human"] == pytest.approx({"m1": 100 / 6, "m3": 50.0, "m5": 500 / 6})
    assert out["ci_low"] <= 1.0 and out["ci_high"] == pytest.approx(1.0)

    from farmflow.flows.feedback import feedback_markdown, plot_feedback

    points = [
        {"method": m, "fraction": f, "pairs": int(16 * f), "win_rate": 10 * f, "standard_error": 1.0}
        | {"mean_gold": f, "reward_accuracy": math.nan, "evaluation_key": f"{m}{f}"}
        for m, fs in (("sft", (0,)), ("dpo", (0.25, 0.5, 1)))
        for f in fs
    ]
    plot_feedback(points, str(tmp_path / "f.png"), "t")
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    assert "| dpo | 0.5 | 8 | 5.0 | 1.0 | 0.500 | — |" in feedback_markdown(points, "t")

    assert pareto([1, 2, 3, 4], [10, 5, 20, math.nan]) == [True, False, True, False]
    assert pareto([1, 1], [5, 5]) == [True, True]

    rows = [{"id": str(i), "split": "pref"} for i in range(16)] + [{"id": "v", "split": "val"}]
    shares = {f: {r["id"] for r in subsample(rows, f, 0) if r["split"] == "pref"} for f in (0.125, 0.25, 0.5, 1)}
    assert [len(s) for s in shares.values()] == [2, 4, 8, 16]
    assert shares[0.125] < shares[0.25] < shares[0.5] < shares[1]
    assert all(any(r["id"] == "v" for r in subsample(rows, f, 0)) for f in shares)


def test_api_dollars_and_requests_of_a_row_are_its_annotation_and_judging_spend(monkeypatch, tmp_path):
    """Annotation and evaluation by API judges on the loopback judge server: a row's API requests are the ones the
    server answered, its dollars the annotate stage's run total plus the evaluation's cache rows."""
    import pyarrow as pa
    from test_api_annotators import KEY, judge, make_rows, pool

    from farmflow.annotators.server import JudgeConfig, JudgeServer
    from farmflow.evaluation.cost import by_evaluation, cost_rows
    from farmflow.labeling.labels import simulated_labels
    from farmflow.storage.schemas import SCHEMAS
    from farmflow.tasks.pipeline import annotate_task, evaluate_task

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    uri = str(tmp_path / "store")
    store = open_store(uri)
    rows = make_rows(12)

    def table(kind: str, given: list[dict]) -> pa.Table:
        return pa.Table.from_pylist([{k: r.get(k) for k in SCHEMAS[kind].names} for r in given], schema=SCHEMAS[kind])

    references = [r | {"split": "eval", "family": "x", "output": r["output_1"]} for r in rows]
    data = store.put_table("data", "d", table("instructions", references), "instructions")
    pairs = store.put_table("sample_pairs", "p", table("pairs", rows), "pairs", inputs={"data": data})
    server = JudgeServer(JudgeConfig(api_key=KEY))
    with server as url:
        annotated = annotate_task.fn(uri, pool(judge(model="gpt-4o", batch_size=4, base_url=url)), pairs)
        # a policy trained on those preferences answers the evaluation set (its outputs: each pair's output_2)
        answers = [r | {"output": r["output_2"], "generator": "m"} for r in rows]
        outputs = store.put_table(
            "generate", "o", table("outputs", answers), "outputs", inputs={"data": data, "policy": annotated}
        )
        judge_e = judge(name="e", model="gpt-4o", batch_size=3, base_url=url)
        evaluation = evaluate_task.fn(uri, pool(judge_e), outputs, data)
        requests = server.state.stats["requests"]
    board = [{"method": "m", "win_rate": 50.0, "evaluation_key": evaluation.key}]
    row = cost_rows(board, store.records(), simulated_labels(store), by_evaluation(store, board))[0]
    eval_rows = [r for r in simulated_labels(store) if r["annotator"] == "e"]
    assert annotated.metrics["requests"] == 3 and len(eval_rows) == 12 and requests == 3 + 4
    assert row["api_requests"] == pytest.approx(requests)
    assert row["api_usd"] == pytest.approx(annotated.metrics["cost_usd"] + sum(r["price_usd"] for r in eval_rows))
    assert row["api_usd"] > annotated.metrics["cost_usd"] > 0
    # the leaderboard stage writes the same cost into its Parquet table (and so into the runs row log)
    from farmflow.tasks.analysis import leaderboard_task

    stored = open_store(uri).read_table(leaderboard_task.fn(uri, {"m": evaluation})).to_pylist()[0]
    for column in COST_COLUMNS:
        assert stored[column] == pytest.approx(row[column])
    assert stored["pareto"] is True and stored["api_usd"] > 0


def test_crowded_methods_get_labels_that_do_not_overlap():
    """Methods of about the same cost and win rate (the usual leaderboard), and best-of-n's points over n among them:
    every label readable, none on another."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from farmflow.evaluation.cost import label_points

    points = [("dpo", 446, 54.5, 8), ("expert_iteration", 553, 53.5, 8), ("ppo", 512, 53.2, 8), ("quark", 500, 52.0, 8)]
    points += [("feedme", 431, 51.7, 8), ("best_of_4", 436, 50.5, 8), ("sft", 376, 50.0, 8), ("untrained", 7, 27.3, 8)]
    points += [("n=1", 436, 50.0, 7), ("n=2", 434, 49.2, 7), ("n=8", 443, 51.2, 7), ("n=16", 455, 52.0, 7)]
    fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=100)
    ax.plot([p[1] for p in points], [p[2] for p in points], "o")
    ax.set_xscale("log")
    label_points(ax, points)
    from matplotlib.text import Text

    fig.canvas.draw()
    boxes = [Text.get_window_extent(t) for t in ax.texts]  # the words themselves, not the lines back to the points
    assert sorted(t.get_text() for t in ax.texts) == sorted(p[0] for p in points)
    names = [t.get_text() for t in ax.texts]
    overlaps = [(names[i], names[j]) for i in range(len(boxes)) for j in range(i) if boxes[i].overlaps(boxes[j])]
    assert not overlaps, overlaps
    plt.close(fig)
