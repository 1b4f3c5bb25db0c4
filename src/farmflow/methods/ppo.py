"""PPO against the reward model, with a per-token KL penalty to the SFT policy (AlpacaFarm §3.4).

Each PPO step:

1. **Rollout.** Sample one response per prompt for `rollout_batch_size` prompts of the
   unlabeled split at `temperature`. Score (prompt, response) with the reward model;
   a response that never emits EOS gets `penalty_reward_value` instead.
2. **Shaped rewards.** Per response token t: ``-kl_coef * max(0, log π(y_t) - log π_SFT(y_t))``
   (the frozen SFT policy, log-probs at the sampling temperature), plus the scalar reward
   on the last response token; whitened over the rollout without shifting the mean.
3. **Advantages.** `gae` with the value model's per-token values (γ = λ = 1 by default),
   then normalized over the *whole rollout batch* (not per minibatch).
4. **Optimization.** `ppo_epochs` passes over the rollout in minibatches of
   `step_batch_size`; loss = clipped policy loss + `vf_coef` × clipped value loss
   (`ppo_loss`), one AdamW over policy and value parameters.

The policy starts from SFT; the value model is the reward model's backbone with a fresh,
zero-initialized value head (`farmflow.models.value_from_reward`), so every initial value
is 0. Defaults (`farmflow.config.PPOConfig`) follow AlpacaFarm's Appendix B and its released
code: rollout batch 512, step batch 256, 2 epochs per step, KL coefficient 0.02, lr 1e-5,
temperature 1.0, 300-token responses, penalty -1 for responses without EOS, value-loss
weight 0.1, clip ranges 0.2, whitened rewards, AdamW ε 1e-5.

Rollouts and updates run on the policy's device; the update goes through
`farmflow.models.runtime.Runtime` (mixed precision on a GPU, micro-batches of
`micro_batch_size` accumulated into each minibatch, LoRA on the policy when the model asks
for it).

**Several processes** (``accelerate launch``, DDP): each process takes an equal, contiguous
share of every rollout batch (`rollout_batch_size` and `step_batch_size` must divide by the
number of processes), samples it with its own unwrapped policy and its own sampling seed,
scores it with its own reward, reference and value models, and keeps it: each minibatch is
the union of every process's share of `step_batch_size / processes` rows, and gradients are
averaged by DDP. The statistics that span the rollout are computed over all processes
(`global_mean`: reward whitening, advantage whitening, the logged reward, KL and entropy),
so they equal a one-process computation over the union of the shares. With one process
the share is the whole rollout; N processes draw other (equally distributed) samples, since
each share has its own random stream. The process count is not in the stage key: an artifact
trained on N processes is reused by a run on M (change `seed` to train again;
docs/real-farm.md). FSDP and DeepSpeed are refused (`refuse_sharded`).

The `synthetic-tiny` preset scales the batches and steps down and raises the learning rate
for a 0.6M-parameter model: rollout 128, step batch 64, 23 steps (3/8 of a pass), lr 1e-4,
KL coefficient 0.05, 48-token responses. In the demo PPO raises mean gold reward from 0.593
(SFT) to 0.611 (docs/results.md, demo leaderboard). A larger learning rate over-optimizes
the weak reward model: at lr 3e-4 the proxy reward keeps rising while gold peaks at step 5
and ends below SFT's (docs/results.md, over-optimization).
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from farmflow.config import PPOConfig
from farmflow.models import batch_order, decode_response, left_pad, sample_ids, score
from farmflow.models.checkpoint import Checkpointer
from farmflow.models.runtime import Runtime, all_sum, device_of, num_processes, to_device, world_size
from farmflow.progress import progress

VERSION = "1"


# --------------------------------------------------------------------------- losses
def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float = 1.0, lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over (batch, time); the value after the last step is 0.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``;
    returns ``(advantages, advantages + values)``.
    """
    if rewards.shape != values.shape or rewards.dim() != 2:
        raise ValueError(f"gae: rewards {tuple(rewards.shape)} and values {tuple(values.shape)} must both be (batch, time)")
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    return advantages, advantages + values


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def global_mean(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of `x` (over the entries where `mask` is 1) across every process's share of a rollout.

    In one process it is ``x.mean()`` (``masked_mean(x, mask)``), bit for bit; with several it
    sums (value, count) over the processes in float64 (a collective: every process calls it).
    """
    if world_size() == 1:
        return x.mean() if mask is None else masked_mean(x, mask)
    mask = torch.ones_like(x) if mask is None else mask.to(x.dtype)
    total = all_sum(torch.stack([(x * mask).sum(), mask.sum()]).double())
    return (total[0] / total[1].clamp(min=1)).to(x.dtype)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Whiten `x` over the masked entries of every process: unit variance, and zero mean if `shift_mean` (else the mean is kept)."""
    mean = global_mean(x, mask)
    var = global_mean((x - mean) ** 2, mask)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    return (out if shift_mean else out + mean) * mask


def ppo_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, values: torch.Tensor,
    old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip_range: float = 0.2,
    clip_range_value: float = 0.2, vf_coef: float = 0.1,
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
        "policy_loss": policy_loss, "value_loss": value_loss,
        "clipfrac": masked_mean((pg_2 > pg_1).to(mask.dtype), mask),
        "value_clipfrac": masked_mean((vf_2 > vf_1).to(mask.dtype), mask),
        "approx_kl": 0.5 * masked_mean((logprobs - old_logprobs) ** 2, mask),
    }
    return loss, {k: v.detach() for k, v in stats.items()}


def shape_rewards(
    scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, kl_coef: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: ``-kl_coef × max(0, logπ - logπ_ref)``, plus `scores` on each last response token.

    Returns (rewards, kl) of shape (batch, time), zero past each response's end. The KL
    estimate is clipped at 0 as in AlpacaFarm, so no token earns a bonus for being less
    likely under the policy than under the SFT model.
    """
    kl = (logprobs - ref_logprobs).clamp(min=0.0) * mask
    rewards = -kl_coef * kl
    last = mask.sum(1).long() - 1
    rewards[torch.arange(len(scores)), last] += scores
    return rewards, kl


# ------------------------------------------------------------------ rollouts (shared with Quark)
def pack(tokenizer, prompts: Sequence[str], responses: Sequence[Sequence[int]], max_prompt_len: int) -> dict[str, torch.Tensor]:
    """``<s> prompt`` left-padded to a common width P, then the response tokens right-padded.

    Returns input_ids, attention_mask, position_ids (all (batch, P + R)), the response tokens
    and their mask (batch, R). The logits at columns ``P-1 .. P+R-2`` predict the responses.
    """
    prompt_ids, prompt_mask = left_pad(tokenizer, prompts, max_prompt_len)
    width = max(len(r) for r in responses)
    tokens = torch.full((len(responses), width), tokenizer.pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((len(responses), width), dtype=torch.long)
    for i, r in enumerate(responses):
        tokens[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
        response_mask[i, : len(r)] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return {
        "input_ids": torch.cat([prompt_ids, tokens], dim=1), "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0), "tokens": tokens, "response_mask": response_mask,
    }


def take(batch: dict[str, torch.Tensor], idx: torch.Tensor | slice) -> dict[str, torch.Tensor]:
    return {k: v[idx] for k, v in batch.items()}


def response_logits(model, batch: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    """Logits (batch, R, vocab) that predict each response token, divided by the temperature."""
    width = batch["tokens"].shape[1]  # responses fill the last `width` columns; the column before each token predicts it
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"],
                logits_to_keep=width + 1)  # no vocabulary projection for the prompt columns
    return out.logits[:, :width].float() / temperature


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def response_values(value_model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Value of the state before each response token, (batch, R)."""
    width = batch["tokens"].shape[1]
    start = batch["input_ids"].shape[1] - width - 1
    return value_model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])[:, start: start + width]


RewardFn = Callable[[Sequence[str], Sequence[str]], torch.Tensor]
"""(prompts, response texts) → one scalar reward per response, e.g. `reward_model_fn(...)`."""


def reward_model_fn(reward_model, reward_tokenizer, batch_size: int = 64) -> RewardFn:
    """The reward model's score of each (prompt, response) as a `RewardFn` (scores on the reward model's device, returned on the CPU)."""
    return lambda prompts, responses: score(reward_model, reward_tokenizer, prompts, responses, batch_size=batch_size)


def sample_and_score(
    policy, tokenizer, reward_fn: RewardFn, prompts: Sequence[str], *, temperature: float, max_new_tokens: int,
    penalty_reward_value: float | None, batch_size: int, seed: int,
) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """One response per prompt (token ids, EOS kept), its reward and whether it ended.

    Responses that never emit EOS within `max_new_tokens` get `penalty_reward_value` (None: no penalty).
    """
    responses = [r[0] for r in sample_ids(policy, tokenizer, prompts, n=1, temperature=temperature,
                                          max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed)]
    ended = torch.tensor([bool(r) and r[-1] == tokenizer.eos_token_id for r in responses])
    responses = [r or [tokenizer.pad_token_id] for r in responses]  # a sampled pad token is dropped; keep one token
    texts = [decode_response(tokenizer, r) for r in responses]
    scores = reward_fn(prompts, texts).float()
    if penalty_reward_value is not None:
        scores = torch.where(ended, scores, torch.full_like(scores, penalty_reward_value))
    return responses, scores, ended


def linear_schedule(opt: torch.optim.Optimizer, warmup_steps: int, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup then linear decay to 0 (transformers' "linear" schedule, AlpacaFarm's RL default)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def total_steps(num_prompts: int, epochs: float, rollout_batch_size: int) -> int:
    return max(1, math.floor(epochs * num_prompts / rollout_batch_size))


def check_shares(section: str, processes: int, **sizes: int) -> None:
    """One clear error when a batch (config field -> its size) does not split evenly between the processes."""
    for field, size in sizes.items():
        if size % processes:
            raise ValueError(f"{section}.{field} ({size}) does not divide evenly between the {processes} processes "
                             "(execution.num_processes): every process takes an equal share of each batch")


def refuse_sharded(rt: Runtime, section: str) -> None:
    """PPO and Quark sample from the policy they train: not from a policy sharded by FSDP or DeepSpeed."""
    if rt.sharded:
        raise ValueError(
            f"{section} does not run under FSDP or DeepSpeed (execution.accelerate_config): it samples from the policy it "
            "trains, and a sharded policy cannot generate per process. Use a DDP config (execution.accelerate_config=multi_gpu: "
            "every GPU holds the policy, value, reference and reward models) or one process (model.lora for a large policy)")


def disable_dropout(model: torch.nn.Module) -> None:
    """Dropout off in `model` (its modules and attention-dropout rates; LoRA's dropout too) while it stays in train mode.

    PPO takes the old log-probs and values in eval mode and the new ones in train mode; with dropout
    on, the ratio would not start at 1 and the clipping would react to dropout noise (TRL does the same)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0


def share_seed(seed: int, rank: int) -> int:
    """Sampling/shuffling seed of process `rank`'s share: `seed` itself for rank 0 (and a one-process run), else a
    32-bit hash of (seed, rank) (torch's CPU generator keeps only the low 32 bits of a seed)."""
    return seed if rank == 0 else int.from_bytes(hashlib.sha256(f"{seed}/{rank}".encode()).digest()[:4], "little")


def check_lengths(policy, max_new_tokens: int, section: str) -> None:
    """Refuse responses that would leave no room for the prompt in the model's context."""
    context = policy.config.max_position_embeddings
    if max_new_tokens >= context:
        raise ValueError(f"{section}.max_new_tokens ({max_new_tokens}) must be smaller than the model's context ({context} tokens)")


# ----------------------------------------------------------------------------- loop
@torch.no_grad()
def rollout(policy, ref_policy, value_model, reward_fn: RewardFn, tokenizer, prompts: Sequence[str], cfg: PPOConfig,
            seed: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Sample, score and evaluate one rollout batch (this process's share); returns its tensors and statistics.

    Pass plain (unwrapped) models. Whitening and statistics span every process's share.
    """
    policy.eval()
    max_prompt = max(1, policy.config.max_position_embeddings - cfg.max_new_tokens)
    responses, scores, ended = sample_and_score(
        policy, tokenizer, reward_fn, prompts, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
        penalty_reward_value=cfg.penalty_reward_value, batch_size=cfg.micro_batch_size, seed=seed)
    batch = to_device(pack(tokenizer, prompts, responses, max_prompt), device_of(policy))
    scores = scores.to(batch["tokens"].device)
    parts: dict[str, list[torch.Tensor]] = {"logprobs": [], "ref_logprobs": [], "values": [], "entropy": []}
    for start in range(0, len(prompts), cfg.micro_batch_size):
        chunk = take(batch, slice(start, start + cfg.micro_batch_size))
        logits = response_logits(policy, chunk, cfg.temperature)
        logp_all = torch.log_softmax(logits, dim=-1)
        parts["logprobs"].append(logp_all.gather(-1, chunk["tokens"].unsqueeze(-1)).squeeze(-1))
        parts["entropy"].append(-(logp_all.exp() * logp_all).sum(-1))
        parts["ref_logprobs"].append(token_logprobs(response_logits(ref_policy, chunk, cfg.temperature), chunk["tokens"]))
        parts["values"].append(response_values(value_model, chunk))
    mask = batch["response_mask"].float()
    logprobs, ref_logprobs, entropy = (torch.cat(parts[k]) * mask for k in ("logprobs", "ref_logprobs", "entropy"))
    values = torch.cat(parts["values"]) * mask
    rewards, kl = shape_rewards(scores, logprobs, ref_logprobs, mask, cfg.kl_coef)
    if cfg.whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False)
    advantages, returns = gae(rewards, values, cfg.gamma, cfg.lam)
    advantages = masked_whiten(advantages, mask)  # over the whole rollout batch
    batch.update(logprobs=logprobs, values=values, advantages=advantages, returns=returns)
    lengths = mask.sum(1)
    stats = {  # over every process's share (global_mean)
        "reward": global_mean(scores).item(), "ended": global_mean(ended.float()).item(),
        "kl": global_mean(((logprobs - ref_logprobs) * mask).sum(1)).item(),  # per-sequence KL estimate (unclipped)
        "kl_penalty": global_mean(kl.sum(1)).item() * cfg.kl_coef,
        "entropy": global_mean(entropy, mask).item(), "response_tokens": global_mean(lengths).item(),
    }
    return batch, stats


def train_ppo(
    policy, ref_policy, value_model, reward_fn: RewardFn, tokenizer, prompts: Sequence[str], cfg: PPOConfig,
    checkpointer: Checkpointer | None = None, on_step: Callable[[int, torch.nn.Module], None] | None = None,
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """Train `policy` (and `value_model`) in place with PPO on `prompts`; returns (summary, per-step history).

    `ref_policy` (the SFT model) stays frozen; `reward_fn` scores responses (`reward_model_fn`
    for a reward model). The prompts of step s are
    a pure function of (seed, s), so a resumed run replays the steps an uninterrupted one
    would have taken. `on_step(completed_steps, policy)` runs after every step (e.g. to
    save snapshots for over-optimization curves).
    """
    if cfg.step_batch_size > cfg.rollout_batch_size:
        raise ValueError(f"ppo.step_batch_size ({cfg.step_batch_size}) must not exceed ppo.rollout_batch_size ({cfg.rollout_batch_size})")
    check_lengths(policy, cfg.max_new_tokens, "ppo")
    ref_policy.eval().requires_grad_(False)
    steps = total_steps(len(prompts), cfg.epochs, cfg.rollout_batch_size)
    prompt_batches = batch_order(len(prompts), cfg.rollout_batch_size, steps, cfg.seed)
    if cfg.step_batch_size > len(prompt_batches[0]):  # a rollout is min(rollout_batch_size, prompts) rows: no update would run
        raise ValueError(f"ppo.step_batch_size ({cfg.step_batch_size}) is larger than a rollout: there are only {len(prompts)} prompts; "
                         "lower ppo.step_batch_size")
    check_shares("ppo", num_processes(), rollout_batch_size=len(prompt_batches[0]), step_batch_size=cfg.step_batch_size)
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
    state = {"modules": {"policy": rt.unwrap(trained), "value": rt.unwrap(value_model)}, "optimizers": {"opt": opt}, "schedulers": {"sched": sched}}
    start, extra = ckpt.restore(**state)
    history: list[dict[str, float]] = list(extra.get("history", []))
    with progress("ppo", steps, unit="step", initial=start) as bar:
        for step in range(start, steps):
            share = len(prompt_batches[step]) // rt.processes  # this process's contiguous share of the rollout batch
            batch_prompts = [prompts[i] for i in prompt_batches[step][rt.rank * share: (rt.rank + 1) * share]]
            seed = share_seed(cfg.seed * 1_000_003 + step, rt.rank)
            batch, stats = rollout(rt.unwrap(trained), ref_policy, rt.unwrap(value_model), reward_fn, tokenizer, batch_prompts, cfg, seed=seed)
            stats.update(_optimize(rt, trained, value_model, opt, params, batch, cfg, seed=seed))
            stats["lr"] = sched.get_last_lr()[0]
            sched.step()
            history.append({"step": float(step + 1), **stats})
            bar.update(1)
            bar.set_postfix(reward=f"{stats['reward']:.3f}", kl=f"{stats['kl']:.2f}")
            if on_step is not None:
                on_step(step + 1, rt.plain(trained))
            ckpt.save(step + 1, **state, extra={"history": history})
    rt.finish(trained)
    return {**_summary(history, steps, start), "processes": float(rt.processes)}, history


def _optimize(rt: Runtime, policy, value_model, opt, params, batch, cfg: PPOConfig, seed: int) -> dict[str, float]:
    """`ppo_epochs` passes over the rollout in shuffled minibatches of `step_batch_size`.

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
            idx = order[start: start + rt.share]
            for rows in rt.local_micro_batches():
                chunk_idx = idx[rows]
                mb = take(batch, chunk_idx)
                with rt.accumulate(policy, value_model):
                    logprobs = token_logprobs(response_logits(policy, mb, cfg.temperature), mb["tokens"])
                    values = response_values(value_model, mb)
                    loss, st = ppo_loss(logprobs, mb["logprobs"], mb["advantages"], values, mb["values"], mb["returns"],
                                        mb["response_mask"], cfg.clip_range, cfg.clip_range_value, cfg.vf_coef)
                    rt.backward(loss, len(chunk_idx) / cfg.step_batch_size)
                    rt.step(params, opt, None, cfg.max_grad_norm)
                for k, v in st.items():
                    totals[k] = totals.get(k, 0.0) + v.item() * len(chunk_idx) / cfg.step_batch_size
            updates += 1
    opt.zero_grad(set_to_none=True)
    return {k: rt.sum(v) / max(1, updates) for k, v in totals.items()}


def _summary(history: list[dict[str, float]], steps: int, start: int) -> dict[str, float]:
    """First/last values of the main curves (last = mean of the final tenth of steps)."""
    tail = history[-max(1, len(history) // 10):]
    out = {"steps": float(steps), "resumed_from_step": float(start)}
    for k in ("reward", "kl", "entropy", "clipfrac", "value_loss", "ended", "response_tokens"):
        out[f"{k}_first"] = history[0][k]
        out[f"{k}_last"] = sum(h[k] for h in tail) / len(tail)
    return out
