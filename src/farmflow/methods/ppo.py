"""PPO against the reward model with a per-token KL penalty to the SFT policy (AlpacaFarm §3.4; Schulman et al., 2017).

The policy starts from SFT; the value model is the reward model's backbone with a fresh, zero-initialized value head
(`farmflow.models.value_from_reward`), or with `value_from='policy'` the SFT policy's (`value_from_policy`: for a
reward model that reads another tokenizer). Each step (the loop's sections below):

1. **Rollout.** Sample one response per prompt for `rollout_batch_size` unlabeled prompts at `temperature`; score it
   with the reward model; a response that never emits EOS gets `penalty_reward_value` (`farmflow.methods.rl`).
2. **Shaped rewards.** Per response token t: ``-kl_coef * max(0, log π(y_t) - log π_SFT(y_t))`` (the frozen SFT
   policy, log-probs at the sampling temperature), plus the scalar reward on the last token; whitened over the
   rollout without shifting the mean (`farmflow.methods.rl.shape_rewards`, `masked_whiten`).
3. **Advantages.** `gae` with the value model's per-token values (γ = λ = 1), whitened over the whole rollout.
4. **Update.** `ppo_epochs` passes over the rollout in minibatches of `step_batch_size`; loss = clipped policy loss
   + `vf_coef` × clipped value loss (`ppo_loss`), one AdamW over policy and value parameters.

Loss (`ppo_loss`), with ``r = exp(log π - log π_old)``, advantages A, returns R, values V:

    policy = mean_t max(-A·r, -A·clip(r, 1 ± clip_range))
    value  = 0.5 · mean_t max((V - R)², (clip(V, V_old ± clip_range_value) - R)²)
    loss   = policy + vf_coef · value

Defaults and their sources are the `farmflow.config.PPOConfig` field descriptions (AlpacaFarm Appendix B); results in
docs/methods.md. Under ``accelerate launch`` (DDP) each process samples an equal, contiguous share of every rollout
and contributes ``step_batch_size / processes`` rows to every minibatch; whitening and the logged statistics span
all processes (`farmflow.methods.rl.global_mean`). FSDP and DeepSpeed are refused (`refuse_sharded`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from farmflow.config import PPOConfig
from farmflow.methods.rl import (
    RewardFn,
    check_lengths,
    check_shares,
    global_mean,
    linear_schedule,
    masked_mean,
    masked_whiten,
    pack,
    refuse_sharded,
    response_logits,
    sample_and_score,
    shape_rewards,
    share_seed,
    take,
    token_logprobs,
    total_steps,
)
from farmflow.models import batch_order
from farmflow.models.checkpoint import Checkpointer
from farmflow.models.runtime import Runtime, device_of, num_processes, to_device
from farmflow.progress import progress
from farmflow.training_metrics import recorder

VERSION = "1"


# ---------------------------------------------------------------------------- loss
def gae(
    rewards: torch.Tensor, values: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over (batch, time); the value after the last step is 0.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``;
    returns ``(advantages, advantages + values)``.
    """
    if rewards.shape != values.shape or rewards.dim() != 2:
        raise ValueError(
            f"gae: rewards {tuple(rewards.shape)} and values {tuple(values.shape)} must both be (batch, time)"
        )
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    return advantages, advantages + values


def ppo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float = 0.2,
    clip_range_value: float = 0.2,
    vf_coef: float = 0.1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO policy loss + `vf_coef` × clipped value loss; all inputs (batch, time).

    * policy: mean over response tokens of ``max(-A·r, -A·clip(r, 1±clip_range))`` with
      ``r = exp(logprobs - old_logprobs)``;
    * value: ``0.5 × mean(max((V - R)², (V_clipped - R)²))`` with V_clipped = V clipped to
      ``old_values ± clip_range_value``.

    Returns the 0-dim loss and detached statistics (policy_loss, value_loss, clipfrac,
    value_clipfrac, approx_kl).
    """
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old_logprobs)
    pg_1 = -advantages * ratio
    pg_2 = -advantages * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    policy_loss = masked_mean(torch.maximum(pg_1, pg_2), mask)
    values_clipped = old_values + (values - old_values).clamp(-clip_range_value, clip_range_value)
    vf_1, vf_2 = (values - returns) ** 2, (values_clipped - returns) ** 2
    value_loss = 0.5 * masked_mean(torch.maximum(vf_1, vf_2), mask)
    loss = policy_loss + vf_coef * value_loss
    stats = {
        "policy_loss": policy_loss,
        "value_loss": value_loss,
        "clipfrac": masked_mean((pg_2 > pg_1).to(mask.dtype), mask),
        "value_clipfrac": masked_mean((vf_2 > vf_1).to(mask.dtype), mask),
        "approx_kl": 0.5 * masked_mean((logprobs - old_logprobs) ** 2, mask),
    }
    return loss, {k: v.detach() for k, v in stats.items()}


# --------------------------------------------------------------------------- helpers
def response_values(value_model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Value of the state before each response token, (batch, R)."""
    width = batch["tokens"].shape[1]
    start = batch["input_ids"].shape[1] - width - 1
    return value_model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])[:, start : start + width]


def disable_dropout(model: torch.nn.Module) -> None:
    """Dropout off in `model` (its modules and attention-dropout rates; LoRA's too) while it stays in train mode.

    PPO takes the old log-probs and values in eval mode and the new ones in train mode; with dropout
    on, the ratio would not start at 1 and the clipping would react to dropout noise (TRL does the same)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0


# ----------------------------------------------------------------------------- loop
@torch.no_grad()
def rollout(
    policy, ref_policy, value_model, reward_fn: RewardFn, tokenizer, prompts: Sequence[str], cfg: PPOConfig, seed: int
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Sample, score and evaluate one rollout batch (this process's share); returns its tensors and statistics.

    Pass plain (unwrapped) models. Whitening and statistics span every process's share.
    """
    # --- 1. rollout: sample, score, then log-probs, entropy and values of every response token
    policy.eval()
    max_prompt = max(1, policy.config.max_position_embeddings - cfg.max_new_tokens)
    responses, scores, ended = sample_and_score(
        policy,
        tokenizer,
        reward_fn,
        prompts,
        temperature=cfg.temperature,
        max_new_tokens=cfg.max_new_tokens,
        penalty_reward_value=cfg.penalty_reward_value,
        batch_size=cfg.micro_batch_size,
        seed=seed,
    )
    batch = to_device(pack(tokenizer, prompts, responses, max_prompt), device_of(policy))
    scores = scores.to(batch["tokens"].device)
    parts: dict[str, list[torch.Tensor]] = {"logprobs": [], "ref_logprobs": [], "values": [], "entropy": []}
    for start in range(0, len(prompts), cfg.micro_batch_size):
        chunk = take(batch, slice(start, start + cfg.micro_batch_size))
        logits = response_logits(policy, chunk, cfg.temperature)
        logp_all = torch.log_softmax(logits, dim=-1)
        parts["logprobs"].append(logp_all.gather(-1, chunk["tokens"].unsqueeze(-1)).squeeze(-1))
        parts["entropy"].append(-(logp_all.exp() * logp_all).sum(-1))
        parts["ref_logprobs"].append(
            token_logprobs(response_logits(ref_policy, chunk, cfg.temperature), chunk["tokens"])
        )
        parts["values"].append(response_values(value_model, chunk))
    mask = batch["response_mask"].float()
    logprobs, ref_logprobs, entropy = (torch.cat(parts[k]) * mask for k in ("logprobs", "ref_logprobs", "entropy"))
    values = torch.cat(parts["values"]) * mask
    # --- 2. shaped rewards: the KL penalty to SFT per token, the reward on the last token
    rewards, kl = shape_rewards(scores, logprobs, ref_logprobs, mask, cfg.kl_coef)
    if cfg.whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False)
    # --- 3. advantages
    advantages, returns = gae(rewards, values, cfg.gamma, cfg.lam)
    advantages = masked_whiten(advantages, mask)  # over the whole rollout batch
    batch.update(logprobs=logprobs, values=values, advantages=advantages, returns=returns)
    lengths = mask.sum(1)
    stats = {  # over every process's share (global_mean)
        "reward": global_mean(scores).item(),
        "ended": global_mean(ended.float()).item(),
        "kl": global_mean(((logprobs - ref_logprobs) * mask).sum(1)).item(),  # per-sequence KL estimate (unclipped)
        "kl_penalty": global_mean(kl.sum(1)).item() * cfg.kl_coef,
        "entropy": global_mean(entropy, mask).item(),
        "response_tokens": global_mean(lengths).item(),
    }
    return batch, stats


def train_ppo(
    policy,
    ref_policy,
    value_model,
    reward_fn: RewardFn,
    tokenizer,
    prompts: Sequence[str],
    cfg: PPOConfig,
    checkpointer: Checkpointer | None = None,
    on_step: Callable[[int, torch.nn.Module], None] | None = None,
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """Train `policy` (and `value_model`) in place with PPO on `prompts`; returns (summary, per-step history).

    `ref_policy` (the SFT model) stays frozen; `reward_fn` scores responses
    (`farmflow.methods.rl.reward_model_fn` for a reward model). The prompts of step s are
    a pure function of (seed, s), so a resumed run replays the steps an uninterrupted one
    would have taken. `on_step(completed_steps, policy)` runs after every step (e.g. to
    save snapshots for over-optimization curves).
    """
    # --- checks: refuse what cannot run before anything loads
    if cfg.step_batch_size > cfg.rollout_batch_size:
        raise ValueError(
            f"ppo.step_batch_size ({cfg.step_batch_size}) must not exceed "
            f"ppo.rollout_batch_size ({cfg.rollout_batch_size})"
        )
    check_lengths(policy, cfg.max_new_tokens, "ppo")
    ref_policy.eval().requires_grad_(False)
    steps = total_steps(len(prompts), cfg.epochs, cfg.rollout_batch_size)
    prompt_batches = batch_order(len(prompts), cfg.rollout_batch_size, steps, cfg.seed)
    if cfg.step_batch_size > len(
        prompt_batches[0]
    ):  # a rollout is min(rollout_batch_size, prompts) rows: no update would run
        raise ValueError(
            f"ppo.step_batch_size ({cfg.step_batch_size}) is larger than a rollout: "
            f"there are only {len(prompts)} prompts; "
            "lower ppo.step_batch_size"
        )
    check_shares("ppo", num_processes(), rollout_batch_size=len(prompt_batches[0]), step_batch_size=cfg.step_batch_size)
    # --- setup: runtime, optimizer over policy and value, schedule, restore from the checkpoint
    rt = Runtime(policy, cfg.step_batch_size, cfg.micro_batch_size, "ppo")
    refuse_sharded(rt, "ppo")
    trained = rt.adapt(policy)
    for m in (trained, value_model):  # the old log-probs and values come from eval mode: the ratio must start at 1
        disable_dropout(m)
    params = [p for m in (trained, value_model) for p in m.parameters() if p.requires_grad]
    params = list({id(p): p for p in params}.values())
    opt = torch.optim.AdamW(params, lr=cfg.lr, eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    sched = linear_schedule(opt, cfg.warmup_steps, steps)
    trained, value_model, opt = rt.prepare(trained, value_model, opt)
    ref_policy.to(rt.device)
    ckpt = checkpointer or Checkpointer(None, "ppo", "", 0)
    state = {
        "modules": {"policy": rt.unwrap(trained), "value": rt.unwrap(value_model)},
        "optimizers": {"opt": opt},
        "schedulers": {"sched": sched},
    }
    start, extra = ckpt.restore(**state)
    history: list[dict[str, float]] = list(extra.get("history", []))
    rec = recorder("ppo")
    with progress("ppo", steps, unit="step", initial=start) as bar:
        for step in range(start, steps):
            share = len(prompt_batches[step]) // rt.processes  # this process's contiguous share of the rollout batch
            batch_prompts = [prompts[i] for i in prompt_batches[step][rt.rank * share : (rt.rank + 1) * share]]
            seed = share_seed(cfg.seed * 1_000_003 + step, rt.rank)
            batch, stats = rollout(
                rt.unwrap(trained),
                ref_policy,
                rt.unwrap(value_model),
                reward_fn,
                tokenizer,
                batch_prompts,
                cfg,
                seed=seed,
            )
            stats.update(_optimize(rt, trained, value_model, opt, params, batch, cfg, seed=seed))  # 4. update
            stats["lr"] = sched.get_last_lr()[0]
            sched.step()
            history.append({"step": float(step + 1), **stats})
            rec.log(
                step + 1,
                epoch=(step + 1) * cfg.epochs / steps,
                tokens=rt.sum(batch["attention_mask"].sum()),
                grad_norm=rt.stats.get("grad_norm"),
                **stats,
            )
            bar.update(1)
            bar.set_postfix(reward=f"{stats['reward']:.3f}", kl=f"{stats['kl']:.2f}")
            if on_step is not None:
                on_step(step + 1, rt.plain(trained))
            ckpt.save(step + 1, **state, extra={"history": history})
    rt.finish(trained)
    return {**_summary(history, steps, start), "processes": float(rt.processes)}, history


def _optimize(rt: Runtime, policy, value_model, opt, params, batch, cfg: PPOConfig, seed: int) -> dict[str, float]:
    """4. Update: `ppo_epochs` passes over the rollout in shuffled minibatches of `step_batch_size`.

    `batch` is this process's share of the rollout; each process shuffles its own share and
    contributes `step_batch_size / processes` rows to every minibatch.
    """
    policy.train()
    value_model.train()
    gen = torch.Generator().manual_seed(seed)
    n = batch["tokens"].shape[0]
    totals: dict[str, float] = {}
    updates = 0
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(n, generator=gen)
        for start in range(0, n - rt.share + 1, rt.share):
            idx = order[start : start + rt.share]
            for rows in rt.local_micro_batches():
                chunk_idx = idx[rows]
                mb = take(batch, chunk_idx)
                with rt.accumulate(policy, value_model):
                    logprobs = token_logprobs(response_logits(policy, mb, cfg.temperature), mb["tokens"])
                    values = response_values(value_model, mb)
                    loss, st = ppo_loss(
                        logprobs,
                        mb["logprobs"],
                        mb["advantages"],
                        values,
                        mb["values"],
                        mb["returns"],
                        mb["response_mask"],
                        cfg.clip_range,
                        cfg.clip_range_value,
                        cfg.vf_coef,
                    )
                    rt.backward(loss, len(chunk_idx) / cfg.step_batch_size)
                    rt.step(params, opt, None, cfg.max_grad_norm)
                for k, v in st.items():
                    totals[k] = totals.get(k, 0.0) + v.item() * len(chunk_idx) / cfg.step_batch_size
            updates += 1
    opt.zero_grad(set_to_none=True)
    return {k: rt.sum(v) / max(1, updates) for k, v in totals.items()}


def _summary(history: list[dict[str, float]], steps: int, start: int) -> dict[str, float]:
    """First/last values of the main curves (last = mean of the final tenth of steps)."""
    tail = history[-max(1, len(history) // 10) :]
    out = {"steps": float(steps), "resumed_from_step": float(start)}
    for k in ("reward", "kl", "entropy", "clipfrac", "value_loss", "ended", "response_tokens"):
        out[f"{k}_first"] = history[0][k]
        out[f"{k}_last"] = sum(h[k] for h in tail) / len(tail)
    return out
