"""Per-method flows and the compare flow on synthetic-micro with a real Prefect API."""

from __future__ import annotations

import math

import pyarrow.parquet as pq
import pytest

from farmflow import tasks
from farmflow.config import load_config
from farmflow.flows import compare_flow, dpo_flow
from farmflow.storage import open_store

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]

MINE = ["feedme", "reward_conditioning", "dpo", "expert_iteration"]


def _run(flow, cfg, **kw):
    tasks.EXECUTED.clear()
    summary = flow(advanced=cfg, **kw)
    return summary, dict(tasks.EXECUTED)


def test_compare_runs_each_method_once_over_shared_upstream(micro_config):
    summary, executed = _run(compare_flow, micro_config, methods=MINE)
    assert sorted(r["method"] for r in summary["leaderboard"]) == sorted(["untrained", "sft", *MINE])
    # shared stages once; every method trained once; reference log-probs computed once
    for stage in ("data", "base_model", "sft", "sample_pairs", "annotate", "train_reward", "reference_logps", *MINE):
        assert executed[stage] == 1, stage
    assert executed["generate"] == 2 + len(MINE) and executed["evaluate"] == 2 + len(MINE)
    assert executed["best_of_n"] == 1  # expert iteration's selection on the unlabeled split
    for row in summary["leaderboard"]:
        assert row["n"] == micro_config.data.eval_size and 0 <= row["mean_gold"] <= 1

    store = open_store(micro_config.store.uri)
    refs = {r.stage: r for r in store.list()}
    # expert iteration drew its candidates from the unlabeled split (and only the first max_prompts)
    selections = store.read_table(refs["best_of_n"]).to_pylist()
    assert len(selections) == micro_config.expert_iteration.max_prompts
    assert all(r["id"].startswith("unlabeled-") for r in selections)
    # DPO's reference log-probs are an artifact with one row per PREF pair
    logps = store.read_table(refs["reference_logps"])
    assert logps.num_rows == micro_config.data.pref_size and logps.column_names == ["id", "logp_1", "logp_2"]
    dpo = refs["dpo"].metrics  # every PREF pair has a preference (no ties): one epoch of 120 pairs in batches of 16
    assert (dpo["pairs"], dpo["steps"]) == (micro_config.data.pref_size, 8)
    assert dpo["train_loss_first"] == pytest.approx(math.log(2), abs=0.01)  # pi = pi_ref at the start
    assert dpo["train_loss_last"] < dpo["train_loss_first"]
    assert dpo["implicit_reward_accuracy_last"] == 11 / 16  # the last batch: 11 of its 16 pairs ranked right (seeded)
    # reward conditioning generated with its good token: the tokenizer saved with the policy knows it
    rc_dir = store.model_dir(refs["reward_conditioning"])
    assert "<|good|>" in (rc_dir / "tokenizer.json").read_text()

    # rerun: nothing executes; a DPO hyperparameter: only DPO and its generation/evaluation
    again, executed = _run(compare_flow, micro_config, methods=MINE)
    assert executed == {} and again["leaderboard"] == summary["leaderboard"]
    cfg = load_config("synthetic-micro", [f"store.uri={micro_config.store.uri}", "dpo.beta=0.2"])
    changed, executed = _run(compare_flow, cfg, methods=MINE)
    # DPO's stages, its point on the over-optimization curve, the curve; the leaderboard is always rebuilt
    assert executed == {"dpo": 1, "generate": 1, "evaluate": 1, "proxy_reward": 1, "overoptimization": 1}
    assert {s["stage"] for s in changed["stages"] if not s["cached"]} == {
        "dpo",
        "generate dpo",
        "evaluate dpo",
        "proxy_reward dpo",
        "overoptimization",
    }

    # expert iteration, 2 rounds: round 1 comes from the cache; round 2 samples its candidates with its own seed
    # (a round that reused round 1's seed would redraw round 1's sample streams)
    two = load_config("synthetic-micro", [f"store.uri={micro_config.store.uri}", "expert_iteration.rounds=2"])
    _, executed = _run(compare_flow, two, methods=["expert_iteration"])
    assert executed["best_of_n"] == 1 and executed["expert_iteration"] == 1
    seeds = sorted(store.record(r)["config"]["best_of_n"]["seed"] for r in store.list() if r.stage == "best_of_n")
    assert seeds == [0, 1_000_003]


def test_method_flow_shares_the_cache_with_compare(micro_config):
    _run(compare_flow, micro_config, methods=["dpo"])
    summary, executed = _run(dpo_flow, micro_config)
    assert executed == {}
    assert sorted(r["method"] for r in summary["leaderboard"]) == ["dpo", "sft", "untrained"]
    board = pq.read_table(f"{summary['artifacts']['leaderboard']}/data.parquet")
    assert board.num_rows == 3


def test_unknown_method_is_a_clear_error(micro_config):
    with pytest.raises(ValueError, match="unknown method"):
        compare_flow.fn(advanced=micro_config, methods=["nope"])
