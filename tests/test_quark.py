"""Quark (top-quantile): its loss against a hand computation, quantile selection, a toy reward,
the stage task end to end on synthetic-micro, and resume after SIGKILL."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from rl_helpers import (
    TOY_PROMPTS,
    digit_reward,
    kill_when_checkpointed,
    micro_artifacts,
    toy_models,
    uninterrupted_history,
)

from farmflow import tasks
from farmflow.config import QuarkConfig
from farmflow.methods import quark
from farmflow.models import load_policy
from farmflow.storage import open_store
from farmflow.tasks import rl


# ----------------------------------------------------------------------- loss
def _hand_kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q))


def test_quark_loss_by_hand():
    # two positions over a 2-token vocabulary; position 2 is padding
    logits = torch.log(torch.tensor([[[0.75, 0.25], [0.5, 0.5], [0.9, 0.1]]]))
    ref_logits = torch.log(torch.tensor([[[0.5, 0.5], [0.2, 0.8], [0.1, 0.9]]]))
    tokens = torch.tensor([[0, 1, 0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = quark.quark_loss(logits, ref_logits, tokens, mask, kl_coef=0.5)
    nll = [-math.log(0.75), -math.log(0.5)]
    kl = [_hand_kl([0.75, 0.25], [0.5, 0.5]), _hand_kl([0.5, 0.5], [0.2, 0.8])]
    assert loss.item() == pytest.approx(sum(n + 0.5 * k for n, k in zip(nll, kl)) / 2, rel=1e-5)
    assert stats["nll"].item() == pytest.approx(sum(nll) / 2, rel=1e-5)
    assert stats["kl_token"].item() == pytest.approx(sum(kl) / 2, rel=1e-5)
    assert stats["kl"].item() == pytest.approx(sum(kl), rel=1e-5)  # per sequence (one sequence)


def test_quark_loss_without_kl_is_the_nll_and_zero_kl_when_equal_to_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 7, generator=gen)
    tokens = torch.randint(0, 7, (3, 4), generator=gen)
    mask = torch.ones(3, 4)
    loss, stats = quark.quark_loss(logits, logits.clone(), tokens, mask, kl_coef=10.0)
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), tokens.reshape(-1))
    assert loss.item() == pytest.approx(nll.item(), rel=1e-5)
    assert stats["kl"].item() == pytest.approx(0.0, abs=1e-6)
    # logits shifted by a constant are the same distribution: the KL term is 0 again
    shifted = logits.clone().requires_grad_()
    loss_kl, _ = quark.quark_loss(
        shifted, logits + 1.0, tokens, mask, kl_coef=1.0
    )  # +1 on every logit: same distribution
    loss_nll, _ = quark.quark_loss(logits.clone().requires_grad_(), logits, tokens, mask, kl_coef=0.0)
    assert loss_kl.item() == pytest.approx(loss_nll.item(), rel=1e-5)


def test_top_quantile_keeps_the_best_fraction():
    scores = torch.tensor([0.1, 0.9, 0.5, -1.0, 0.7, 0.3, 0.8, 0.2, 0.0, 0.6])
    assert quark.top_quantile(scores, 5).tolist() == [1, 6]  # 10 // 5 = 2 best
    assert quark.top_quantile(scores, 2).tolist() == [1, 6, 4, 9, 2]
    assert quark.top_quantile(scores, 1).tolist() == scores.argsort(descending=True).tolist()
    assert quark.top_quantile(scores[:3], 5).tolist() == [1]  # at least one sample


# ------------------------------------------------------------------ toy reward
def test_quark_on_a_toy_reward_improves():
    policy, ref, _, tok = toy_models()
    cfg = QuarkConfig(
        epochs=16,
        rollout_batch_size=60,
        step_batch_size=30,
        grad_steps_per_rollout=2,
        micro_batch_size=60,
        lr=3e-3,
        warmup_steps=0,
        kl_coef=0.05,
        max_new_tokens=8,
        penalty_reward_value=None,
    )
    summary, history = quark.train_quark(policy, ref, digit_reward, tok, TOY_PROMPTS, cfg)
    assert summary["steps"] == len(history) == 32
    assert summary["reward_first"] < 0.12
    assert summary["reward_last"] > summary["reward_first"] + 0.15  # measured: 0.08 -> 0.36
    assert all(h["pool_reward"] >= h["reward"] for h in history)  # the pool is the best quantile of the rollout
    assert 0 <= summary["kl_first"] < summary["kl_last"] < 12
    assert summary["nll_last"] < summary["nll_first"]


# ------------------------------------------------------------------ micro farm
@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    return micro_artifacts(tmp_path_factory.mktemp("quark-micro") / "store")


MICRO = QuarkConfig(epochs=1, rollout_batch_size=48, step_batch_size=8, micro_batch_size=24, lr=1e-4, max_new_tokens=12)


def test_quark_task_end_to_end_on_micro(micro):
    tasks.EXECUTED.clear()
    ref = rl.quark_task.fn(micro["uri"], MICRO, micro["data"], micro["sft"], micro["reward"])
    assert ref.stage == "quark" and ref.format == "policy" and ref.metrics["steps"] == 240 // 48
    history = rl.read_history(micro["uri"], ref)
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(h[k]) for h in history for k in ("reward", "pool_reward", "kl", "nll", "loss"))
    assert all(h["pool_reward"] >= h["reward"] for h in history)
    model, _ = load_policy(open_store(micro["uri"]).model_dir(ref))
    sft, _ = load_policy(open_store(micro["uri"]).model_dir(micro["sft"]))
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), sft.parameters()))
    again = rl.quark_task.fn(micro["uri"], MICRO, micro["data"], micro["sft"], micro["reward"])
    assert again.key == ref.key and tasks.EXECUTED["quark"] == 1


@pytest.mark.slow
def test_quark_resumes_after_sigkill_with_the_same_step_count(micro):
    cfg = QuarkConfig.model_validate({**MICRO.model_dump(), "epochs": 8, "seed": 3})  # 40 steps
    killed_at = kill_when_checkpointed("quark_task", cfg, micro, "quark", min_step=3)
    assert 3 <= killed_at < 40
    ref = rl.quark_task.fn(
        micro["uri"], cfg, micro["data"], micro["sft"], micro["reward"], checkpoints=micro["cfg"].checkpoints
    )
    assert ref.metrics["resumed_from_step"] == killed_at
    assert ref.metrics["steps"] == 40
    history = rl.read_history(micro["uri"], ref)
    assert [h["step"] for h in history] == list(range(1, 41))
    assert all(math.isfinite(h["loss"]) for h in history)
    assert not list((Path(micro["uri"]) / "_checkpoints" / "quark").glob("*/step-*"))
    # the resumed run took exactly the steps an uninterrupted one takes
    straight = uninterrupted_history(micro, "quark", cfg)
    for resumed, expected in zip(history, straight, strict=True):
        for k in ("reward", "kl", "loss"):
            assert resumed[k] == pytest.approx(expected[k], rel=1e-4, abs=1e-6), (resumed["step"], k)
