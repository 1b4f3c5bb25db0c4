"""Replicated comparisons: seeds per replicate, stage keys, cache reuse counted by executions (real Prefect API)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from farmflow import tasks
from farmflow.config import load_config
from farmflow.evaluation.replicates import interval_rows
from farmflow.flows import compare_flow, config_key
from farmflow.flows.replicates import SEED_STEP, replicate_config
from farmflow.tasks.core import key_config


def test_replicate_zero_is_the_config_and_the_replicate_fields_enter_no_key():
    cfg = load_config("synthetic-micro")
    assert replicate_config(cfg, 0) is cfg
    more = load_config("synthetic-micro", ["evaluation.replicates=3", "evaluation.replicate_sft=false"])
    assert config_key(more) == config_key(cfg)
    assert key_config(more.evaluation) == key_config(cfg.evaluation)
    assert "replicates" not in key_config(cfg.evaluation)


def test_replicate_r_shifts_every_seed_but_the_data_splits():
    cfg = load_config("synthetic-micro")
    r2 = replicate_config(cfg, 2)
    shift = 2 * SEED_STEP
    assert r2.data == cfg.data  # same instructions, same evaluation prompts
    for section in ("sft", "pairs", "reward", "best_of_n", "dpo", "ppo", "quark", "generation", "model"):
        assert getattr(r2, section).seed == getattr(cfg, section).seed + shift, section
    assert r2.annotation.seed == cfg.annotation.seed + shift  # annotator assignment and label noise
    assert r2.evaluation.annotator.seed == cfg.evaluation.annotator.seed + shift
    assert r2.expert_iteration.train.seed == cfg.expert_iteration.train.seed + shift  # nested sections too
    shared = replicate_config(load_config("synthetic-micro", ["evaluation.replicate_sft=false"]), 2)
    assert shared.model == cfg.model and shared.sft == cfg.sft  # every replicate starts from replicate 0's SFT
    assert shared.pairs.seed == cfg.pairs.seed + shift
    # a reward model's own backbone is an SFT model too: replicated with SFT, shared when SFT is
    backbone = 'reward.backbone={"model": {"hidden_size": 48}, "sft": {"epochs": 1}}'
    own = replicate_config(load_config("synthetic-micro", [backbone]), 2).reward.backbone
    assert (own.model.seed, own.sft.seed) == (shift, shift)
    kept = replicate_config(load_config("synthetic-micro", [backbone, "evaluation.replicate_sft=false"]), 2)
    assert kept.reward.backbone == load_config("synthetic-micro", [backbone]).reward.backbone
    assert kept.reward.seed == cfg.reward.seed + shift
    with pytest.raises(ValueError, match="≥ 0"):
        replicate_config(cfg, -1)


def test_one_seed_for_every_stage_is_a_replicate_of_a_preset_whose_seeds_are_0():
    from farmflow.config import PRESETS
    from farmflow.flows.form import with_seed

    # the study's --seed 1000·r (the run form's seed knob) therefore reads and writes replicate r's cache entries
    for name in PRESETS:
        cfg = load_config(name)
        assert with_seed(cfg, 3 * SEED_STEP) == replicate_config(cfg, 3), name
    moved = load_config("synthetic-micro", ["reward.seed=5"])
    assert with_seed(moved, SEED_STEP) != replicate_config(moved, 1)  # 1000, not 1005: only the zero seeds line up
    assert with_seed(moved, SEED_STEP).data == moved.data


def _nan_free(rows):
    return [{k: (None if v != v else v) for k, v in r.items()} for r in rows]


def _run(cfg, replicates):
    tasks.EXECUTED.clear()
    summary = compare_flow(advanced=cfg, methods=["dpo"], replicates=replicates)
    return summary, sum(tasks.EXECUTED.values())


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.slow
def test_replicates_are_cached_like_any_stage(micro_config, monkeypatch):
    """K=1, then K=2 (only replicate 1 runs), K=2 again (nothing, the leaderboard read back), K=3 (only replicate 2),
    counted by executions."""
    single, ran_1 = _run(micro_config, 1)
    assert ran_1 > 0 and "replicates" not in single

    two, ran_2 = _run(micro_config, 2)
    executed_2 = {s["key"] for s in two["stages"] if not s["cached"]}
    # replicate 0 is the unreplicated run: its stages are cache hits; replicate 1 (SFT replicated) runs every stage
    # but the data stage (the same instructions)
    assert executed_2 and not executed_2 & {s["key"] for s in single["stages"]}
    assert ran_2 == len(executed_2) == len(two["stages"]) // 2 - 1
    assert all(s["cached"] for s in two["stages"][: len(two["stages"]) // 2])

    boards = []
    counted = lambda *a, **kw: boards.append(a) or interval_rows(*a, **kw)  # noqa: E731
    with monkeypatch.context() as patch:
        patch.setattr("farmflow.flows.replicates.interval_rows", counted)
        again, ran_again = _run(micro_config, 2)
    assert ran_again == 0 and all(s["cached"] for s in again["stages"]) and boards == []
    assert _nan_free(again["leaderboard"]) == _nan_free(two["leaderboard"])  # the same numbers (NaN ≠ NaN)

    three, ran_3 = _run(micro_config, 3)
    assert ran_3 == ran_2  # one more replicate: the same stages once more, under new seeds
    assert {s["stage"] for s in three["stages"] if not s["cached"]} >= {"sft", "dpo", "evaluate dpo [replicate 2]"}

    rows = {r["method"]: r for r in three["leaderboard"]}
    assert set(rows) == {"untrained", "sft", "dpo"}
    for r in rows.values():
        assert r["replicates"] == 3 and r["n"] == micro_config.data.eval_size
        assert r["win_rate_low"] <= r["win_rate"] <= r["win_rate_high"]
        assert 1 <= r["rank_best"] <= r["rank_worst"] <= 3
    assert rows["dpo"]["resolved"] in ("better", "worse", "tied") and rows["sft"]["resolved"] == ""
    assert rows["dpo"]["diff_low"] <= rows["dpo"]["diff_to_sft"] <= rows["dpo"]["diff_high"]
    folder = three["artifacts"]["leaderboard"]
    assert pq.read_table(f"{folder}/data.parquet").num_rows == 3
    assert "3 replicate(s) ×" in three["markdown"] and open(f"{folder}/leaderboard.png", "rb").read(4) == b"\x89PNG"
    assert three["run"]["rows"] == 3  # recorded in the runs table like any comparison
