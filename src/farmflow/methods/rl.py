"""What PPO and Quark share: rollouts (sample, score, pack), the KL penalty, whitening over processes, schedules.

Both methods sample one response per prompt from the policy they train, score it with a reward function, and pack
(prompt, response) into one left/right-padded batch whose logits at the response columns are read back
(`response_logits`). Under ``accelerate launch`` each process samples a contiguous share of every rollout
(`share_seed`, `check_shares`); statistics that span the rollout are taken over every process (`global_mean`).
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Sequence

import torch

from farmflow.models import decode_response, prompt_ids, sample_ids, score
from farmflow.models.runtime import Runtime, all_gather_objects, all_sum, world_size

RewardFn = Callable[[Sequence[str], Sequence[str]], torch.Tensor]
"""(prompts, response texts) → one scalar reward per response, e.g. `reward_model_fn(...)`."""


# ------------------------------------------------------------------- statistics over processes
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
    """Whiten `x` over the masked entries of every process: unit variance; zero mean if `shift_mean`."""
    mean = global_mean(x, mask)
    var = global_mean((x - mean) ** 2, mask)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    return (out if shift_mean else out + mean) * mask


# ---------------------------------------------------------------------------- KL penalty
def shape_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
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


# ------------------------------------------------------------------------------ rollouts
def reward_model_fn(reward_model, reward_tokenizer, batch_size: int = 64) -> RewardFn:
    """The reward model's score of each (prompt, response) as a `RewardFn` (returned on the CPU)."""
    return lambda prompts, responses: score(reward_model, reward_tokenizer, prompts, responses, batch_size=batch_size)


def sample_and_score(
    policy,
    tokenizer,
    reward_fn: RewardFn,
    prompts: Sequence[str],
    *,
    temperature: float,
    max_new_tokens: int,
    penalty_reward_value: float | None,
    batch_size: int,
    seed: int,
) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """One response per prompt (token ids, EOS kept), its reward and whether it ended.

    Responses that never emit EOS within `max_new_tokens` get `penalty_reward_value` (None: no penalty).
    """
    responses = [
        r[0]
        for r in sample_ids(
            policy,
            tokenizer,
            prompts,
            n=1,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            seed=seed,
        )
    ]
    ended = torch.tensor([bool(r) and r[-1] == tokenizer.eos_token_id for r in responses])
    responses = [r or [tokenizer.pad_token_id] for r in responses]  # a sampled pad token is dropped; keep one token
    texts = [decode_response(tokenizer, r) for r in responses]
    scores = reward_fn(prompts, texts).float()
    if penalty_reward_value is not None:
        scores = torch.where(ended, scores, torch.full_like(scores, penalty_reward_value))
    return responses, scores, ended


def gather_rollout(
    responses: list[list[int]], scores: torch.Tensor, ended: torch.Tensor
) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """Every process's share of a rollout (responses, scores, ended) joined in rank order: the whole batch, everywhere.

    A collective; in one process it returns its arguments.
    """
    parts = all_gather_objects((responses, scores.cpu(), ended.cpu()))
    if len(parts) == 1:
        return responses, scores, ended
    return [r for p in parts for r in p[0]], torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])


def pack(
    tokenizer, prompts: Sequence[str], responses: Sequence[Sequence[int]], max_prompt_len: int
) -> dict[str, torch.Tensor]:
    """``<s> prompt`` left-padded to a common width P, then the response tokens right-padded.

    Returns input_ids, attention_mask, position_ids (all (batch, P + R)), the response tokens
    and their mask (batch, R). The logits at columns ``P-1 .. P+R-2`` predict the responses.
    """
    ids = prompt_ids(tokenizer, prompts, max_prompt_len)
    p_width, r_width = max(len(x) for x in ids), max(len(r) for r in responses)
    prompt_tokens = torch.full((len(ids), p_width), tokenizer.pad_token_id, dtype=torch.long)
    tokens = torch.full((len(responses), r_width), tokenizer.pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((len(ids), p_width), dtype=torch.long)
    response_mask = torch.zeros((len(responses), r_width), dtype=torch.long)
    for i, (p, r) in enumerate(zip(ids, responses)):
        prompt_tokens[i, p_width - len(p) :] = torch.tensor(p, dtype=torch.long)
        prompt_mask[i, p_width - len(p) :] = 1
        tokens[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
        response_mask[i, : len(r)] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return {
        "input_ids": torch.cat([prompt_tokens, tokens], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "tokens": tokens,
        "response_mask": response_mask,
    }


def take(batch: dict[str, torch.Tensor], idx: torch.Tensor | slice) -> dict[str, torch.Tensor]:
    return {k: v[idx] for k, v in batch.items()}


def response_logits(model, batch: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    """Logits (batch, R, vocab) that predict each response token, divided by the temperature."""
    width = batch["tokens"].shape[
        1
    ]  # responses fill the last `width` columns; the column before each token predicts it
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        logits_to_keep=width + 1,
    )  # no vocabulary projection for the prompt columns
    return out.logits[:, :width].float() / temperature


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


# ------------------------------------------------------------------- schedule and checks
def linear_schedule(
    opt: torch.optim.Optimizer, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup then linear decay to 0 (transformers' "linear" schedule, AlpacaFarm's RL default)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def total_steps(num_prompts: int, epochs: float, rollout_batch_size: int) -> int:
    return max(1, math.floor(epochs * num_prompts / rollout_batch_size))


def share_seed(seed: int, rank: int) -> int:
    """Sampling/shuffling seed of process `rank`'s share: `seed` itself for rank 0 (and a one-process run), else a
    32-bit hash of (seed, rank) (torch's CPU generator keeps only the low 32 bits of a seed)."""
    return seed if rank == 0 else int.from_bytes(hashlib.sha256(f"{seed}/{rank}".encode()).digest()[:4], "little")


def check_shares(section: str, processes: int, **sizes: int) -> None:
    """One clear error when a batch (config field -> its size) does not split evenly between the processes."""
    for field, size in sizes.items():
        if size % processes:
            raise ValueError(
                f"{section}.{field} ({size}) does not divide evenly between the {processes} processes "
                "(execution.num_processes): every process takes an equal share of each batch"
            )


def refuse_sharded(rt: Runtime, section: str) -> None:
    """PPO and Quark sample from the policy they train: not from a policy sharded by FSDP or DeepSpeed."""
    if rt.sharded:
        raise ValueError(
            f"{section} does not run under FSDP or DeepSpeed (execution.accelerate_config): it samples from the policy "
            "it trains, and a sharded policy cannot generate per process. Use a DDP config "
            "(execution.accelerate_config=multi_gpu: every GPU holds the policy, value, reference and reward models) "
            "or one process (model.lora for a large policy)"
        )


def check_lengths(policy, max_new_tokens: int, section: str) -> None:
    """Refuse responses that would leave no room for the prompt in the model's context."""
    context = policy.config.max_position_embeddings
    if max_new_tokens >= context:
        raise ValueError(
            f"{section}.max_new_tokens ({max_new_tokens}) must be smaller than the model's context ({context} tokens)"
        )
