"""PPO: GAE and the clipped losses against hand computations, rollout details, a toy reward,
the stage task end to end on synthetic-micro, and resume after SIGKILL."""

from __future__ import annotations

import logging
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
from farmflow.config import PPOConfig
from farmflow.data import prompts_of, split_rows
from farmflow.methods import ppo
from farmflow.methods import rl as rl_methods
from farmflow.models import load_policy, value_from_reward
from farmflow.storage import open_store
from farmflow.tasks import rl
from farmflow.tasks.stage import StageRun


# ------------------------------------------------------------------------ GAE
def test_gae_undiscounted_is_reward_to_go_minus_value():
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    values = torch.tensor([[0.5, 0.5, 0.5]])
    adv, ret = ppo.gae(rewards, values)
    assert torch.allclose(adv, torch.tensor([[5.5, 4.5, 2.5]]))
    assert torch.allclose(ret, torch.tensor([[6.0, 5.0, 3.0]]))


def test_gae_discounted_by_hand():
    # row 0: t=1: delta=0+0.9*0-0.4=-0.4 -> A=-0.4; t=0: delta=1+0.9*0.4-0.2=1.16 -> A=1.16+0.45*(-0.4)=0.98
    # row 1: t=1: delta=2-(-1)=3 -> A=3;              t=0: delta=0+0.9*(-1)-1=-1.9 -> A=-1.9+0.45*3=-0.55
    rewards = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    values = torch.tensor([[0.2, 0.4], [1.0, -1.0]])
    adv, ret = ppo.gae(rewards, values, gamma=0.9, lam=0.5)
    assert torch.allclose(adv, torch.tensor([[0.98, -0.4], [-0.55, 3.0]]))
    assert torch.allclose(ret, adv + values)
    assert torch.allclose(ret, torch.tensor([[1.18, 0.0], [0.45, 2.0]]))


@pytest.mark.parametrize("shape", [(3, 1), (2, 5), (4, 7)])
def test_gae_limits_lam_zero_is_td_error_and_one_step_is_r_minus_v(shape):
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    adv, _ = ppo.gae(rewards, values, gamma=0.7, lam=0.0)
    next_values = torch.cat([values[:, 1:], torch.zeros(shape[0], 1)], dim=1)
    assert torch.allclose(adv, rewards + 0.7 * next_values - values)
    # gamma = lam = 1: advantage = sum of future rewards - value, for every shape
    adv, ret = ppo.gae(rewards, values)
    to_go = rewards.flip(1).cumsum(1).flip(1)
    assert adv.shape == ret.shape == shape
    assert torch.allclose(adv, to_go - values, atol=1e-6)
    assert torch.allclose(ret, to_go, atol=1e-6)


def test_gae_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="must both be \\(batch, time\\)"):
        ppo.gae(torch.zeros(2, 3), torch.zeros(2, 4))


# ---------------------------------------------------------------- PPO loss
def test_ppo_loss_by_hand():
    # token 1: ratio 1.5, A=+1 -> clipped at 1.2 -> -1.2 ; token 2: ratio 0.5, A=-1 -> clipped at 0.8 -> 0.8
    # token 3: ratio 1.1, A=+2 -> inside the range -> -2.2 ; token 4 is padding (ignored)
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 1.1, 9.0]])).requires_grad_()
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, -1.0, 2.0, 100.0]])
    values = torch.tensor([[0.5, -0.1, 0.3, 50.0]])
    old_values = torch.zeros(1, 4)
    returns = torch.tensor([[1.0, 1.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, stats = ppo.ppo_loss(
        logprobs, old, adv, values, old_values, returns, mask, clip_range=0.2, clip_range_value=0.2, vf_coef=0.1
    )
    policy_loss = (-1.2 + 0.8 - 2.2) / 3
    # values clipped to [-0.2, 0.2]: (0.2, -0.1, 0.2); squared errors unclipped (0.25, 1.21, 1.69),
    # clipped (0.64, 1.21, 1.44)
    value_loss = 0.5 * (0.64 + 1.21 + 1.69) / 3
    assert stats["policy_loss"].item() == pytest.approx(policy_loss)
    assert stats["value_loss"].item() == pytest.approx(value_loss)
    assert loss.item() == pytest.approx(policy_loss + 0.1 * value_loss)
    assert stats["clipfrac"].item() == pytest.approx(2 / 3)
    assert stats["value_clipfrac"].item() == pytest.approx(1 / 3)
    assert stats["approx_kl"].item() == pytest.approx(
        0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2 + math.log(1.1) ** 2) / 3
    )
    loss.backward()
    # clipped tokens and padding pass no gradient; token 3: d/dlogp (-A * exp(logp)) / 3
    assert torch.allclose(logprobs.grad, torch.tensor([[0.0, 0.0, -2.0 * 1.1 / 3, 0.0]]))


def test_ppo_loss_value_gradient_only_through_unclipped_side():
    values = torch.tensor([[0.5, 0.1]], requires_grad=True)
    returns = torch.tensor([[1.0, 1.0]])
    z = torch.zeros(1, 2)
    loss, _ = ppo.ppo_loss(z, z, z, values, z, returns, torch.ones(1, 2), vf_coef=1.0)
    loss.backward()
    # token 1: the clipped error (0.64) is larger, so it is used and has no gradient w.r.t. values
    # token 2: inside the clip range: d/dv 0.5 * (v - R)^2 / 2 = (0.1 - 1) / 2
    assert torch.allclose(values.grad, torch.tensor([[0.0, -0.45]]))


def test_shape_rewards_kl_per_token_and_score_on_last_token():
    logprobs = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, 0.0], [-1.0, -1.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    rewards, kl = rl_methods.shape_rewards(torch.tensor([2.0, -1.0]), logprobs, ref, mask, kl_coef=0.1)
    # KL estimate logp - ref clipped at 0: row 0 (0.5, 0 [was -1], pad 0); row 1 (0.5, 0.5, 2.5)
    assert torch.allclose(kl, torch.tensor([[0.5, 0.0, 0.0], [0.5, 0.5, 2.5]]))
    assert torch.allclose(rewards, torch.tensor([[-0.05, 2.0, 0.0], [-0.05, -0.05, -0.25 - 1.0]]))


def test_masked_whiten_uses_masked_entries_only():
    x = torch.tensor([[1.0, 3.0, 100.0], [5.0, 7.0, -100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    out = rl_methods.masked_whiten(x, mask)
    # masked entries 1, 3, 5, 7: mean 4, variance 5
    assert torch.allclose(out, torch.tensor([[-3.0, -1.0, 0.0], [1.0, 3.0, 0.0]]) / math.sqrt(5), atol=1e-5)
    # shift_mean=False keeps the mean (4) and scales the spread around it to unit variance
    scaled = rl_methods.masked_whiten(x, mask, shift_mean=False)
    assert torch.allclose(
        scaled, (torch.tensor([[-3.0, -1.0, 0.0], [1.0, 3.0, 0.0]]) / math.sqrt(5) + 4) * mask, atol=1e-5
    )


# --------------------------------------------------------------- rollouts
def test_rollout_logprobs_at_temperature_whole_batch_advantages_and_zero_initial_values():
    policy, ref, value, tok = toy_models()
    cfg = PPOConfig(
        rollout_batch_size=24,
        step_batch_size=8,
        micro_batch_size=5,
        max_new_tokens=6,
        temperature=0.6,
        penalty_reward_value=None,
        kl_coef=0.1,
    )
    prompts = TOY_PROMPTS[:24]
    batch, stats = ppo.rollout(policy, ref, value, digit_reward, tok, prompts, cfg, seed=3)
    mask = batch["response_mask"].float()
    # log-probs are those of the sampling distribution: logits / temperature, computed in one full pass
    logits = rl_methods.response_logits(policy, batch, 1.0)
    expected = torch.log_softmax(logits / 0.6, -1).gather(-1, batch["tokens"].unsqueeze(-1)).squeeze(-1) * mask
    assert torch.allclose(batch["logprobs"], expected, atol=1e-5)
    # advantages are normalized over the whole rollout batch (micro batches of 5 do not matter)
    assert rl_methods.masked_mean(batch["advantages"], mask).item() == pytest.approx(0.0, abs=1e-5)
    assert rl_methods.masked_mean(batch["advantages"] ** 2, mask).item() == pytest.approx(1.0, abs=1e-3)
    # the value head starts at zero; the policy equals the reference, so the KL is 0
    assert torch.count_nonzero(batch["values"]) == 0
    assert stats["kl"] == pytest.approx(0.0, abs=1e-6)
    assert 0 < stats["response_tokens"] <= 6


def test_responses_without_eos_get_the_penalty():
    policy, _, _, tok = toy_models()
    responses, scores, ended = rl_methods.sample_and_score(
        policy,
        tok,
        digit_reward,
        TOY_PROMPTS,
        temperature=1.0,
        max_new_tokens=3,
        penalty_reward_value=-7.0,
        batch_size=64,
        seed=0,
    )
    assert not ended.all() and len(responses) == len(TOY_PROMPTS)
    assert torch.all(scores[~ended] == -7.0)
    for r, s, e in zip(responses, scores, ended):
        assert e == (r[-1] == tok.eos_token_id)
        assert len(r) <= 3
    _, unpenalized, _ = rl_methods.sample_and_score(
        policy,
        tok,
        digit_reward,
        TOY_PROMPTS,
        temperature=1.0,
        max_new_tokens=3,
        penalty_reward_value=None,
        batch_size=64,
        seed=0,
    )
    assert torch.all((unpenalized >= 0) & (unpenalized <= 1))
    assert torch.equal(unpenalized[ended], scores[ended])


def test_value_model_from_reward_model_starts_at_zero(micro):
    value = value_from_reward(open_store(micro["uri"]).model_dir(micro["reward"]))
    ids = torch.tensor([[1, 5, 9, 12], [1, 7, 7, 0]])
    out = value(ids, torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]))
    assert out.shape == (2, 4) and torch.count_nonzero(out) == 0
    assert not torch.all(value.backbone.embed_tokens.weight == 0)  # a trained backbone, not a fresh one


# ------------------------------------------------------------- toy reward
def _toy_run(kl_coef: float):
    policy, ref, value, tok = toy_models()
    cfg = PPOConfig(
        epochs=16,
        rollout_batch_size=60,
        step_batch_size=30,
        micro_batch_size=60,
        lr=3e-3,
        warmup_steps=0,
        kl_coef=kl_coef,
        max_new_tokens=8,
        penalty_reward_value=None,
    )
    return ppo.train_ppo(policy, ref, value, digit_reward, tok, TOY_PROMPTS, cfg)


def test_ppo_on_a_toy_reward_raises_the_reward_with_bounded_kl():
    summary, history = _toy_run(kl_coef=0.05)
    assert summary["steps"] == len(history) == 32
    assert summary["reward_first"] < 0.12
    assert summary["reward_last"] > summary["reward_first"] + 0.2  # measured: 0.08 -> 0.45
    assert 0 < summary["kl_last"] < 12  # nats per response of <= 8 tokens
    assert summary["entropy_last"] < summary["entropy_first"]
    assert all(math.isfinite(h["value_loss"]) and 0 <= h["clipfrac"] <= 1 for h in history)
    # a 20x stronger KL penalty keeps the policy much closer to the reference
    strong, _ = _toy_run(kl_coef=1.0)
    assert strong["kl_last"] < summary["kl_last"] / 2


def test_step_batch_larger_than_rollout_is_refused():
    policy, ref, value, tok = toy_models()
    with pytest.raises(ValueError, match="step_batch_size \\(64\\) must not exceed ppo.rollout_batch_size \\(32\\)"):
        ppo.train_ppo(
            policy, ref, value, digit_reward, tok, TOY_PROMPTS, PPOConfig(rollout_batch_size=32, step_batch_size=64)
        )
    # fewer prompts than step_batch_size: a rollout too small for any update is refused up front, naming both numbers
    with pytest.raises(
        ValueError, match=r"ppo.step_batch_size \(64\) is larger than a rollout: there are only 40 prompts"
    ):
        ppo.train_ppo(
            policy,
            ref,
            value,
            digit_reward,
            tok,
            TOY_PROMPTS[:40],
            PPOConfig(rollout_batch_size=128, step_batch_size=64, max_new_tokens=8),
        )


def test_ppo_trains_without_dropout_so_the_first_ratio_is_one():
    """PPO turns dropout off (under LoRA, dropout 0.05, or in any model with dropout): the old log-probs (eval mode) and
    the new ones must not differ by dropout noise, so the ratio starts at 1."""
    policy, ref, value, tok = toy_models()
    policy.model.layers[0].mlp.act_fn = torch.nn.Sequential(policy.model.layers[0].mlp.act_fn, torch.nn.Dropout(0.5))
    policy.config.attention_dropout = 0.3
    for layer in policy.model.layers:
        layer.self_attn.attention_dropout = 0.3
    cfg = PPOConfig(
        epochs=1,
        rollout_batch_size=30,
        step_batch_size=30,
        micro_batch_size=30,
        lr=1e-12,
        warmup_steps=0,
        ppo_epochs=1,
        max_new_tokens=6,
    )
    summary, history = ppo.train_ppo(policy, ref, value, digit_reward, tok, TOY_PROMPTS[:30], cfg)
    assert (
        history[0]["clipfrac"] == 0.0 and abs(history[0]["approx_kl"]) < 1e-6
    )  # ratio 1 on the first (only) minibatch
    assert all(m.p == 0.0 for m in policy.modules() if isinstance(m, torch.nn.Dropout))


def test_responses_longer_than_the_context_are_refused():
    policy, ref, value, tok = toy_models()
    with pytest.raises(
        ValueError, match="ppo.max_new_tokens \\(64\\) must be smaller than the model's context \\(64 tokens\\)"
    ):
        ppo.train_ppo(policy, ref, value, digit_reward, tok, TOY_PROMPTS, PPOConfig(max_new_tokens=64))


# -------------------------------------------------------------- micro farm
@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    return micro_artifacts(tmp_path_factory.mktemp("ppo-micro") / "store")


MICRO = PPOConfig(
    epochs=1,
    rollout_batch_size=48,
    step_batch_size=24,
    micro_batch_size=24,
    lr=1e-4,
    max_new_tokens=12,
    snapshot_every=2,
)


def test_ppo_task_end_to_end_on_micro_with_snapshots(micro):
    tasks.EXECUTED.clear()
    ref = rl.ppo_task.fn(micro["uri"], MICRO, micro["data"], micro["sft"], micro["reward"])
    unlabeled = len(split_rows(open_store(micro["uri"]).read_table(micro["data"]), "unlabeled"))
    assert unlabeled == micro["cfg"].data.unlabeled_size == 240
    assert ref.stage == "ppo" and ref.format == "policy" and ref.metrics["steps"] == 240 // 48
    history = rl.read_history(micro["uri"], ref)
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(h[k]) for h in history for k in ("reward", "kl", "entropy", "clipfrac", "value_loss"))
    model, tok = load_policy(open_store(micro["uri"]).model_dir(ref))
    sft, _ = load_policy(open_store(micro["uri"]).model_dir(micro["sft"]))
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), sft.parameters()))  # it trained
    snaps = rl.ppo_snapshots(micro["uri"], ref)
    assert sorted(snaps) == [2, 4]
    snapshots = [load_policy(open_store(micro["uri"]).model_dir(snaps[step]))[0] for step in (2, 4)]
    for a, b in ((snapshots[0], snapshots[1]), (snapshots[1], model)):  # each is its own step's policy: 2, 4, then 5
        assert any(not torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    # same config and inputs: the committed artifact is reused
    again = rl.ppo_task.fn(micro["uri"], MICRO, micro["data"], micro["sft"], micro["reward"])
    assert again.key == ref.key and tasks.EXECUTED["ppo"] == 1


def test_snapshots_do_not_fork_the_ppo_run(micro, caplog):
    """snapshot_every is not part of PPO's key, so the over-optimization curve reuses the compared PPO run.

    The run without snapshots is the same artifact; asking for snapshots it lacks trains it
    again with the same seed, commits the missing ones and keeps the first commit of the policy.
    """
    first = rl.ppo_task.fn(micro["uri"], MICRO, micro["data"], micro["sft"], micro["reward"])  # snapshots at 2, 4
    runs = tasks.EXECUTED["ppo"]
    plain = rl.ppo_task.fn(
        micro["uri"], MICRO.model_copy(update={"snapshot_every": 0}), micro["data"], micro["sft"], micro["reward"]
    )
    assert plain == first and tasks.EXECUTED["ppo"] == runs  # a hit: nothing trained
    every_step = MICRO.model_copy(update={"snapshot_every": 1})
    assert not rl.snapshots_complete(open_store(micro["uri"]), first, every_step)
    caplog.set_level(logging.INFO, logger="farmflow")
    again = rl.ppo_task.fn(micro["uri"], every_step, micro["data"], micro["sft"], micro["reward"])
    said = [r.getMessage() for r in caplog.records if "without something this run asks for" in r.getMessage()]
    assert said == [f"ppo: {first.key[:12]} is committed without something this run asks for; computing it again"]
    assert (
        again == first and tasks.EXECUTED["ppo"] == runs + 1
    )  # trained again for steps 1, 3, 5; the policy stays the first commit
    snaps = rl.ppo_snapshots(micro["uri"], first)
    assert sorted(snaps) == [1, 2, 3, 4, 5]
    # the same seed replays the same run: the last step's snapshot is the committed policy, bit for bit
    final, _ = load_policy(open_store(micro["uri"]).model_dir(first))
    last, _ = load_policy(open_store(micro["uri"]).model_dir(snaps[5]))
    assert all(torch.equal(a, b) for a, b in zip(final.parameters(), last.parameters()))
    rl.ppo_task.fn(micro["uri"], every_step, micro["data"], micro["sft"], micro["reward"])
    assert tasks.EXECUTED["ppo"] == runs + 1  # complete now: a hit


def test_ppo_rolls_out_on_the_unlabeled_split_only(micro):
    store = open_store(micro["uri"])
    table = store.read_table(micro["data"])
    run = StageRun(store, micro["uri"], "ppo", "k")
    assert rl.unlabeled_prompts(run, micro["data"]) == prompts_of(split_rows(table, "unlabeled"))


def test_ppo_without_unlabeled_prompts_fails_clearly(tmp_path):
    from farmflow.config import load_config

    cfg = load_config("synthetic-micro", [f"store.uri={tmp_path}", "data.unlabeled_size=0"])
    data = tasks.data_task.fn(cfg.store.uri, cfg.data)
    with pytest.raises(ValueError, match="ppo: the data artifact .* has no 'unlabeled' rows"):
        rl.unlabeled_prompts(StageRun(open_store(cfg.store.uri), cfg.store.uri, "ppo", "k"), data)


@pytest.mark.slow
def test_ppo_resumes_after_sigkill_with_the_same_step_count(micro):
    cfg = PPOConfig.model_validate({**MICRO.model_dump(), "epochs": 8, "snapshot_every": 0, "seed": 5})  # 40 steps
    killed_at = kill_when_checkpointed("ppo_task", cfg, micro, "ppo", min_step=3)
    assert 3 <= killed_at < 40
    ref = rl.ppo_task.fn(
        micro["uri"], cfg, micro["data"], micro["sft"], micro["reward"], checkpoints=micro["cfg"].checkpoints
    )
    assert ref.metrics["resumed_from_step"] == killed_at
    assert ref.metrics["steps"] == 40
    history = rl.read_history(micro["uri"], ref)
    assert [h["step"] for h in history] == list(range(1, 41))
    assert all(math.isfinite(h["value_loss"]) and math.isfinite(h["policy_loss"]) for h in history)
    assert not list((Path(micro["uri"]) / "_checkpoints" / "ppo").glob("*/step-*"))  # cleared once committed
    # the resumed run took exactly the steps an uninterrupted one takes
    straight = uninterrupted_history(micro, "ppo", cfg)
    for resumed, expected in zip(history, straight, strict=True):
        for k in ("reward", "kl", "value_loss", "policy_loss"):
            assert resumed[k] == pytest.approx(expected[k], rel=1e-4, abs=1e-6), (resumed["step"], k)
