"""A micro real-format run, end to end in the flow (issue 8).

AlpacaFarm-format data read in place from ../shared (never copied here): SFT on 64 real Alpaca
examples, pairs for a small PREF/val split, the first 16 AlpacaEval instructions with their
Davinci003 reference outputs. A tiny model trained from scratch on that text, API annotation
through the loopback judge server (real HTTP through the `openai` client; p_sim_ann for the
pairs, p_sim_eval for evaluation), the reward model, best-of-n, the leaderboard. Real
instructions have no synthetic task, so the judge decides by its biases only (length, lists,
position); the test recomputes every label the judge gave from those biases.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from prefect_server import all_artifacts

from farmflow import tasks
from farmflow.annotators.cache import canonical
from farmflow.annotators.oracle import task_from_text
from farmflow.annotators.prompts import Item
from farmflow.annotators.server import JudgeConfig, JudgeServer, JudgeState
from farmflow.config import load_config
from farmflow.data.alpaca import load_eval, load_instructions
from farmflow.evaluation.leaderboard import reference_label
from farmflow.storage import open_store
from farmflow.storage.schemas import SCHEMAS

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
ALPACA, EVAL = DATA / "alpaca_en_demo.json", DATA / "alpaca_eval_davinci003_outputs.json"
SECRET = "sk-farmflow-e2e-3b9d7c1fa0e2"  # the judge requires it: every request carried it; no artifact or log line may
SIZES = {"sft": 64, "pref": 48, "val": 16, "eval": 16}

needs_data = pytest.mark.skipif(not (ALPACA.is_file() and EVAL.is_file()), reason=f"shared data not found in {DATA}")


def real_micro_overrides(judge_url: str, store: str) -> list[str]:
    """`--set` overrides of synthetic-micro for the real-format run (docs/real-farm.md, "Try it on CPU")."""
    data = {
        "source": "local",
        "instructions_path": str(ALPACA),
        "eval_path": str(EVAL),
        "sft_size": SIZES["sft"],
        "pref_size": SIZES["pref"],
        "unlabeled_size": 0,
        "val_size": SIZES["val"],
        "eval_size": SIZES["eval"],
    }
    return [
        f"data={json.dumps(data)}",
        "sft.epochs=4",
        f"annotation={json.dumps({'preset': 'p_sim_ann', 'base_url': judge_url})}",
        f"evaluation.annotator={json.dumps({'preset': 'p_sim_eval', 'base_url': judge_url})}",
        f"store.uri={store}",
    ]


def judge_label(state: JudgeState, annotators: dict, row: dict, swapped: bool) -> float:
    """The label the loopback judge gives a row (relative to its output_1/output_2) shown in that order, recomputed."""
    if row["output_1"] == row["output_2"]:
        return 1.5  # a tie, never sent
    a = annotators[row["annotator"]]
    first, second = (row["output_2"], row["output_1"]) if swapped else (row["output_1"], row["output_2"])
    item = Item(row["instruction"], row["input"], first, second)
    p = state.p_second(a.model, item)
    shown = (
        1.0 + p
        if a.prompt_format == "logprobs"
        else (2.0 if state.choose(a.model, a.temperature, item, p) == "b" else 1.0)
    )
    return 3.0 - shown if swapped else shown


def shown_swapped(cache_rows: dict, row: dict) -> bool:
    """Was the row's output_2 shown first? The row cache stores the order of the canonical (sorted) outputs."""
    c1, c2, flipped = canonical(row["output_1"], row["output_2"])
    return cache_rows[(row["annotator"], row["instruction"], c1, c2)]["swapped"] != flipped


def run_flow(cfg) -> tuple[dict, dict]:
    from farmflow.flows import best_of_n_flow

    tasks.EXECUTED.clear()
    summary = best_of_n_flow(advanced=cfg)
    return summary, dict(tasks.EXECUTED)


def by_stage(store) -> dict[str, list]:
    out: dict[str, list] = {}
    for ref in store.list():
        out.setdefault(ref.stage, []).append(ref)
    return out


def board_json(rows: list[dict]) -> str:
    return json.dumps(rows, sort_keys=True)  # NaN-safe equality


def test_reference_label_names_the_evaluation_set():
    key = "0123456789abcdef"
    assert (
        reference_label(key)
        == reference_label(key, {"source": "synthetic"})
        == "reference outputs of data 0123456789ab"
    )
    local = {"source": "local", "eval_path": "/data/alpaca_eval_davinci003_outputs.json"}
    assert reference_label(key, local) == "reference outputs of data 0123456789ab (alpaca_eval_davinci003_outputs.json)"
    hub = {"source": "hub", "hub_name": "tatsu-lab/alpaca_farm"}
    assert (
        reference_label(key, hub)
        == "reference outputs of data 0123456789ab (tatsu-lab/alpaca_farm: alpaca_farm_evaluation)"
    )


@pytest.mark.slow
@needs_data
def test_real_format_micro_run_through_the_flow(prefect_harness, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    monkeypatch.delenv("FARMFLOW_STORE", raising=False)
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="prefect")  # the flow and task run loggers (WARNING in tests otherwise)
    store_uri = str(tmp_path / "store")
    server = JudgeServer(JudgeConfig(api_key=SECRET))
    with server as url:
        cfg = load_config("synthetic-micro", real_micro_overrides(url, store_uri))
        summary, executed = run_flow(cfg)
        requests_after_first = server.state.stats["requests"]

        # ---- every stage ran, once per artifact it makes
        assert executed == {
            "data": 1,
            "base_model": 1,
            "sft": 1,
            "sample_pairs": 1,
            "annotate": 1,
            "train_reward": 1,
            "generate": 2,
            "best_of_n": 1,
            "evaluate": 3,
        }
        assert not any(s["cached"] for s in summary["stages"])
        store = open_store(store_uri)
        refs = by_stage(store)

        # ---- data: the shared files, split as configured; the evaluation set is Davinci003's
        (data,) = refs["data"]
        table = store.read_table(data).to_pylist()
        split = {s: [r for r in table if r["split"] == s] for s in SIZES}
        assert {s: len(v) for s, v in split.items()} == SIZES and len(table) == sum(SIZES.values())  # no unlabeled rows
        assert all(r["task"] is None for r in table)  # no synthetic task, no gold reward
        alpaca = {(r["instruction"], r["input"]): r["output"] for r in load_instructions(ALPACA)}
        assert all(alpaca[(r["instruction"], r["input"])] == r["output"] for r in split["sft"])  # real demonstrations
        davinci = load_eval(EVAL)[: SIZES["eval"]]
        assert [(r["instruction"], r["output"]) for r in split["eval"]] == [
            (r["instruction"], r["output"]) for r in davinci
        ]
        reference = {r["instruction"]: r["output"] for r in davinci}
        (sft,) = refs["sft"]
        assert sft.metrics["steps"] == 4 * SIZES["sft"] / cfg.sft.batch_size  # 4 epochs of 64 examples, batches of 16
        assert sft.metrics["train_loss_last"] < sft.metrics["train_loss_first"]

        # ---- annotation through the judge: every pair labelled, none lost, none paid twice
        annotators = {a.name: a for a in cfg.annotation.api_pool}
        judge = JudgeState(JudgeConfig())  # the server's own judgement, to recompute its answers
        (ann,) = refs["annotate"]
        prefs = store.read_table(ann).to_pylist()
        m = ann.metrics
        pairs = SIZES["pref"] + SIZES["val"]
        assert len(prefs) == m["pairs"] == pairs and m["judged"] + m["noised"] + m["ties"] == pairs
        assert m["failed"] == m["unsent"] == m["cached"] == 0 and m["requests"] > 0 and m["cost_usd"] > 0
        assert sorted(r["id"] for r in prefs) == sorted(r["id"] for r in split["pref"] + split["val"])
        assert all(
            task_from_text(r["instruction"], r["input"]) is None for r in prefs
        )  # the judge sees no task: biases only
        assert all(r["gold_1"] is None and r["gold_2"] is None for r in prefs)
        noised = [r for r in prefs if r["noised"]]
        assert {r["preference"] for r in noised} <= {1.0, 2.0} and len(noised) == m["noised"]
        assert 0.25 * pairs <= len(noised) <= 0.75 * pairs  # label noise 0.5 of the pairs (64 pairs: ±4 SD)
        judged = [r for r in prefs if not r["noised"]]
        for r in judged:
            assert r["preference"] == pytest.approx(judge_label(judge, annotators, r, r["swapped"]), abs=1e-9), r["id"]
            if annotators[r["annotator"]].prompt_format != "logprobs" and r["output_1"] != r["output_2"]:
                assert r["preference"] in (1.0, 2.0)
        stats = server.state.stats
        assert stats["status_401"] == 0 and stats["status_200"] == stats["requests"]  # the key went with every request
        answered = server.state.pairs
        assert max(answered.values()) == 1  # no pair asked twice

        # ---- reward model: accuracy against the labels only (there is no gold)
        (rm,) = refs["train_reward"]
        assert 0 <= rm.metrics["heldout_accuracy"] <= 1 and "heldout_gold_accuracy" not in rm.metrics
        assert set(summary["reward_model"]) <= {"heldout_accuracy", "heldout_accuracy_unnoised"}
        (bon,) = refs["best_of_n"]
        bon_rows = store.read_table(bon).to_pylist()
        assert len(bon_rows) == SIZES["eval"] and all(math.isfinite(r["score"]) for r in bon_rows)

        # ---- evaluation against the Davinci003 references: output_1 = reference, output_2 = the method's output
        evaluations = {store.read_table(e).column("generator")[0].as_py(): e for e in refs["evaluate"]}
        assert set(evaluations) == {"untrained", "sft", "best_of_4"}
        outputs = {
            r.stage + ":" + store.read_table(r).column("generator")[0].as_py(): store.read_table(r).to_pylist()
            for r in refs["generate"] + refs["best_of_n"]
        }
        board = {r["method"]: r for r in summary["leaderboard"]}
        assert set(board) == {"untrained", "sft", "best_of_4"}
        cache = {
            (c["annotator"], c["instruction"], c["output_1"], c["output_2"]): c
            for c in store.read_rows("annotations", "annotations").to_pylist()
        }
        assert all(c["status"] == "ok" for c in cache.values()) and len(cache) == len(
            answered
        )  # one judgement per pair asked
        for method, ev in evaluations.items():
            rows = store.read_table(ev).to_pylist()
            produced = outputs[("best_of_n:" if method == "best_of_4" else "generate:") + method]
            assert [r["output_2"] for r in rows] == [o["output"] for o in produced]  # in order, none lost
            assert all(r["output_1"] == reference[r["instruction"]] for r in rows)
            assert all(r["gold_1"] is None and r["gold_2"] is None for r in rows)
            for r in rows:  # p_sim_eval: no label noise, every label is the judge's
                swapped = r["output_1"] != r["output_2"] and shown_swapped(cache, r)
                assert r["preference"] == pytest.approx(judge_label(judge, annotators, r, swapped), abs=1e-9), (
                    method,
                    r["id"],
                )
            wins = [r["preference"] - 1 for r in rows]
            mean = sum(wins) / len(wins)
            sd = math.sqrt(sum((w - mean) ** 2 for w in wins) / (len(wins) - 1))
            row = board[method]
            assert row["n"] == SIZES["eval"] and row["win_rate"] == pytest.approx(100 * mean)
            assert row["standard_error"] == pytest.approx(100 * sd / math.sqrt(len(wins)))
            assert row["avg_length"] == int(sum(len(r["output_2"]) for r in rows) / len(rows))
            assert math.isnan(row["mean_gold"]) and row["annotator"] == "p_sim_eval"  # no gold reward: NaN, never 0
            assert "alpaca_eval_davinci003_outputs.json" in row["reference"]
        assert math.isnan(summary["reference_mean_gold"])
        assert answered and max(answered.values()) == 1 and len(answered) == stats["items_answered"]

        # ---- every table artifact is Parquet with its documented schema; models are safetensors folders
        for ref in store.list():
            if ref.kind == "table":
                assert pq.read_schema(Path(ref.uri) / "data.parquet").remove_metadata().equals(SCHEMAS[ref.format]), (
                    ref.stage
                )
            else:
                files = store.files(ref)
                assert any(f.endswith(".safetensors") for f in files) and not any(
                    f.endswith((".bin", ".pkl", ".pt")) for f in files
                )
        leaderboard = pq.read_table(Path(summary["artifacts"]["leaderboard"]) / "data.parquet").to_pylist()
        assert {r["method"] for r in leaderboard} == set(board) and all(math.isnan(r["mean_gold"]) for r in leaderboard)

        # ---- the same flow again: fully cached, nothing asked
        again, executed = run_flow(cfg)
        assert executed == {} and all(s["cached"] for s in again["stages"])
        assert server.state.stats["requests"] == requests_after_first
        assert board_json(again["leaderboard"]) == board_json(summary["leaderboard"])

        # ---- annotations and evaluations deleted from the store: recomputed from the row cache, nothing paid twice
        for ref in refs["annotate"] + refs["evaluate"]:
            shutil.rmtree(ref.uri)
        third, executed = run_flow(cfg)
        assert executed == {"annotate": 1, "evaluate": 3}
        assert server.state.stats["requests"] == requests_after_first
        (ann2,) = by_stage(store)["annotate"]
        assert ann2.key == ann.key and ann2.metrics["judged"] == 0 and ann2.metrics["cached"] == m["judged"]
        assert store.read_table(ann2).to_pylist() == prefs  # the same labels, from the row cache
        assert board_json(third["leaderboard"]) == board_json(summary["leaderboard"])

    # ---- the API key is in no artifact, no store file and no log line
    secret = SECRET.encode()
    scanned = 0
    for path in Path(store_uri).rglob("*"):
        if path.is_file():
            assert secret not in path.read_bytes(), path
            scanned += 1
    assert scanned > 20
    messages = [r.getMessage() + (r.exc_text or "") for r in caplog.records]
    assert any("annotate:" in msg for msg in messages)  # the flow's own log lines were captured
    assert not [msg for msg in messages if SECRET in msg]
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        published = [str(a.data) for a in all_artifacts(client)]
    assert published and not [d for d in published if SECRET in d]
