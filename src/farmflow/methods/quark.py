"""Quark, top-quantile variant: fine-tune on the best-scored of the policy's own samples (AlpacaFarm §3.4;
Lu et al., 2022).

Each step (the loop's sections below):

1. **Rollout.** Sample one response per prompt for `rollout_batch_size` unlabeled prompts at `temperature`, score each
   with the reward model (a response that never emits EOS gets `penalty_reward_value`, so it ranks last).
2. **Top quantile.** The data pool is *reset* to this rollout, sorted by reward, and only the best
   ``1 / num_quantiles`` kept (no reward tokens: the top-quantile variant trains on the best quantile only).
3. **Update.** `grad_steps_per_rollout` AdamW steps on minibatches of the pool with `quark_loss`.

Loss (`quark_loss`), per response token t, against the frozen SFT policy π_ref (no entropy term):

    mean_t [ -log π(y_t) + kl_coef · KL(π(·|t) ‖ π_ref(·|t)) ]

Defaults and their sources are the `farmflow.config.QuarkConfig` field descriptions (AlpacaFarm's released Quark
script); results in docs/methods.md. Rollouts, packing and schedules are shared with PPO (`farmflow.methods.rl`).
Under ``accelerate launch`` (DDP) each process samples and scores a contiguous share of every rollout; the shares are
gathered (`gather_rollout`), so every process ranks the whole rollout and holds the same pool. Each minibatch is split
between the processes; when it does not divide evenly the last processes pad with masked rows that carry no weight.
"""

from __future__ import annotations

from typing import Sequence

import torch

from farmflow.config import QuarkConfig
from farmflow.methods.rl import (
    RewardFn,
    check_lengths,
    check_shares,
    gather_rollout,
    linear_schedule,
    masked_mean,
    pack,
    refuse_sharded,
    response_logits,
    sample_and_score,
    share_seed,
    take,
    total_steps,
)
from farmflow.models import batch_order
from farmflow.models.checkpoint import Checkpointer
from farmflow.models.runtime import Runtime, device_of, num_processes, to_device
from farmflow.progress import progress
from farmflow.training_metrics import recorder, reward_quantiles

VERSION = "1"


# ---------------------------------------------------------------------------- loss
def quark_loss(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float = 0.05,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean over response tokens of ``-log π(y_t) + kl_coef × KL(π(·|t) ‖ π_ref(·|t))``.

    `logits`, `ref_logits`: (batch, time, vocab), already divided by the temperature and
    aligned with `tokens` (batch, time); `mask` marks response tokens. The KL is exact
    over the vocabulary at each position. Returns the 0-dim loss and detached statistics
    (nll, kl per token, kl per sequence).
    """
    mask = mask.to(logits.dtype)
    logp = torch.log_softmax(logits, dim=-1)
    ref_logp = torch.log_softmax(ref_logits, dim=-1)
    nll = -logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    kl = (logp.exp() * (logp - ref_logp)).sum(-1)
    loss = masked_mean(nll + kl_coef * kl, mask)
    stats = {"nll": masked_mean(nll, mask), "kl_token": masked_mean(kl, mask), "kl": (kl * mask).sum(1).mean()}
    return loss, {k: v.detach() for k, v in stats.items()}


def top_quantile(scores: torch.Tensor, num_quantiles: int) -> torch.Tensor:
    """Indices of the best ``len(scores) // num_quantiles`` samples (at least one), best first."""
    keep = max(1, len(scores) // num_quantiles)
    return torch.argsort(scores, descending=True, stable=True)[:keep]


# ---------------------------------------------------------------------------- loop
def train_quark(
    policy,
    ref_policy,
    reward_fn: RewardFn,
    tokenizer,
    prompts: Sequence[str],
    cfg: QuarkConfig,
    checkpointer: Checkpointer | None = None,
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """Train `policy` in place with Quark on `prompts`; returns (summary, per-step history).

    `ref_policy` (the SFT model) stays frozen; `reward_fn` scores responses
    (`farmflow.methods.rl.reward_model_fn` for a reward model). The prompts and sampling seed of step s are a pure
    function of (seed, s), so a resumed run replays the steps an uninterrupted one would have taken.
    """
    check_lengths(policy, cfg.max_new_tokens, "quark")
    ref_policy.eval().requires_grad_(False)
    steps = total_steps(len(prompts), cfg.epochs, cfg.rollout_batch_size)
    prompt_batches = batch_order(len(prompts), cfg.rollout_batch_size, steps, cfg.seed)
    processes = num_processes()
    check_shares("quark", processes, rollout_batch_size=len(prompt_batches[0]))
    pool_size = max(1, min(cfg.rollout_batch_size, len(prompts)) // cfg.num_quantiles)  # what `top_quantile` keeps
    rows = min(
        cfg.step_batch_size, pool_size
    )  # per optimizer step; padded to a multiple of the processes (`_optimize`)
    rt = Runtime(policy, -(-rows // processes) * processes, cfg.micro_batch_size, "quark")
    refuse_sharded(rt, "quark")
    trained = rt.adapt(policy)
    opt = torch.optim.AdamW(
        [p for p in trained.parameters() if p.requires_grad], lr=cfg.lr, eps=cfg.adam_eps, weight_decay=cfg.weight_decay
    )
    sched = linear_schedule(opt, cfg.warmup_steps, steps)
    trained, opt = rt.prepare(trained, opt)
    ref_policy.to(rt.device)
    ckpt = checkpointer or Checkpointer(None, "quark", "", 0)
    state = {"modules": {"policy": rt.unwrap(trained)}, "optimizers": {"opt": opt}, "schedulers": {"sched": sched}}
    start, extra = ckpt.restore(**state)
    history: list[dict[str, float]] = list(extra.get("history", []))
    rec = recorder("quark")
    max_prompt = max(1, policy.config.max_position_embeddings - cfg.max_new_tokens)
    with progress("quark", steps, unit="step", initial=start) as bar:
        for step in range(start, steps):
            seed = cfg.seed * 1_000_003 + step
            batch_prompts = [prompts[i] for i in prompt_batches[step]]
            share = len(batch_prompts) // rt.processes  # each process samples and scores its contiguous share
            # --- 1. rollout: this process's share, then the whole batch on every process
            trained.eval()
            with torch.no_grad():
                responses, scores, ended = sample_and_score(
                    rt.unwrap(trained),
                    tokenizer,
                    reward_fn,
                    batch_prompts[rt.rank * share : (rt.rank + 1) * share],
                    temperature=cfg.temperature,
                    max_new_tokens=cfg.max_new_tokens,
                    penalty_reward_value=cfg.penalty_reward_value,
                    batch_size=cfg.micro_batch_size,
                    seed=share_seed(seed, rt.rank),
                )
            responses, scores, ended = gather_rollout(responses, scores, ended)  # the whole rollout, on every process
            # --- 2. top quantile: the pool is this rollout's best quantile only
            keep = top_quantile(scores, cfg.num_quantiles).tolist()
            pool = to_device(
                pack(tokenizer, [batch_prompts[i] for i in keep], [responses[i] for i in keep], max_prompt),
                device_of(trained),
            )
            stats = {
                "reward": scores.mean().item(),
                "ended": ended.float().mean().item(),
                "pool_reward": scores[keep].mean().item(),
                "pool_threshold": scores[keep].min().item(),
                "response_tokens": float(sum(len(r) for r in responses)) / len(responses),
            }
            stats.update(_optimize(rt, trained, ref_policy, opt, pool, cfg, seed))  # --- 3. update
            stats["lr"] = sched.get_last_lr()[0]
            sched.step()
            history.append({"step": float(step + 1), **stats})
            rec.log(
                step + 1,
                epoch=(step + 1) * cfg.epochs / steps,
                tokens=int(pool["attention_mask"].sum()),
                grad_norm=rt.stats.get("grad_norm"),
                **stats,
                **reward_quantiles(scores.tolist(), cfg.num_quantiles),
            )
            bar.update(1)
            bar.set_postfix(reward=f"{stats['reward']:.3f}", kl=f"{stats['kl']:.2f}")
            ckpt.save(step + 1, **state, extra={"history": history})
    rt.finish(trained)
    tail = history[-max(1, len(history) // 10) :]
    summary = {"steps": float(steps), "resumed_from_step": float(start), "processes": float(rt.processes)}
    for k in ("reward", "pool_reward", "kl", "nll", "ended", "response_tokens"):
        summary[f"{k}_first"] = history[0][k]
        summary[f"{k}_last"] = sum(h[k] for h in tail) / len(tail)
    return summary, history


def _optimize(
    rt: Runtime, policy, ref_policy, opt, pool: dict[str, torch.Tensor], cfg: QuarkConfig, seed: int
) -> dict[str, float]:
    """3. Update: `grad_steps_per_rollout` optimizer steps on minibatches of the pool (cycled when it is small).

    Every process holds the whole pool and takes its share of each minibatch. A minibatch is
    padded to `rt.batch_size` (a multiple of the processes) with repeated rows whose response
    mask is zero: they add no loss and no weight.
    """
    policy.train()
    n = pool["tokens"].shape[0]
    totals: dict[str, float] = {}
    for idx in batch_order(n, cfg.step_batch_size, cfg.grad_steps_per_rollout, seed):
        real = len(idx)
        idx = [idx[i % real] for i in range(rt.batch_size)]  # = idx in one process
        for rows in rt.micro_batches():
            chunk = torch.tensor(idx[rows])
            mb = take(pool, chunk)
            counted = len(range(real)[rows])  # the chunk's real rows (all of them unless padded)
            if counted < len(chunk):
                mb["response_mask"] = mb["response_mask"] * (torch.arange(rows.start, rows.stop) < real).unsqueeze(
                    1
                ).to(mb["response_mask"])
            with torch.no_grad():
                ref_logits = response_logits(ref_policy, mb, cfg.temperature)
            with rt.accumulate(policy):
                loss, st = quark_loss(
                    response_logits(policy, mb, cfg.temperature),
                    ref_logits,
                    mb["tokens"],
                    mb["response_mask"],
                    cfg.kl_coef,
                )
                rt.backward(loss, counted / real)
                rt.step(policy, opt, None, cfg.max_grad_norm)
            if 0 < counted < len(chunk):
                st["kl"] = st["kl"] * len(chunk) / counted  # per real sequence, not per padded row
            for k, v in {"loss": loss.detach(), **st}.items():
                totals[k] = totals.get(k, 0.0) + v.item() * counted / real
    opt.zero_grad(set_to_none=True)
    return {k: rt.sum(v) / cfg.grad_steps_per_rollout for k, v in totals.items()}
