"""Reward model: Bradley–Terry on pairwise preferences, initialized from the SFT model.

Loss: with preference p in [1, 2] (1: output_1 preferred, 2: output_2, fractional values
allowed for soft labels), the probability that output_2 wins is sigmoid(r_2 − r_1) and
the loss is the mean binary cross-entropy of that probability against p − 1.

The model is the SFT backbone with a fresh scalar head read at the last non-padding
token (`farmflow.models.reward_from_policy`); with `RewardConfig.backbone` the backbone is a
model of its own size fine-tuned on the same demonstrations. Defaults (`farmflow.config.RewardConfig`)
follow AlpacaFarm's reward-modeling script for LLaMA-7B: 1 epoch, AdamW lr 3e-6, batch
16, 3% warmup then cosine, no weight decay. The loop runs through
`farmflow.models.runtime.Runtime` (device, processes, micro-batches of `micro_batch_size`
pairs weighted by their share of the batch). A micro-batch's pairs are read in one forward
pass (`pair_rewards`): two right-padded rows per pair, or with ``packing`` each prompt once and
both outputs after it, several pairs to a row, with the same rewards up to float rounding; a model trained packed
also scores packed (`farmflow.models.packed_reads`): best-of-n's candidates for a prompt after one copy of it.

With ``train_backbone=False`` only the scalar head trains: the backbone's features (the hidden state the head
reads at each output's closing </s>) are computed once, before the first step, and every step is a linear
Bradley–Terry step on them (`farmflow.models.reward_features`). A pretrained backbone then costs one forward pass per
distinct output, which makes a pretrained reward model affordable on a CPU; with a feature memo, none for the outputs
another model on the same backbone read in this process (the study's two reward models train on the same outputs).
``feature_dtype="bfloat16"`` reads them under bfloat16 autocast (SmolLM2-135M: 2.7x faster on a 2-core CPU with native
bfloat16) while the head stays float32; the model records it, so it scores later as it trained.

``train_layers=k`` sits between the two: the top k transformer blocks train with the head, the rest stay as
initialized (`farmflow.models.train_top_layers`), so each step's backward pass stops at the lowest trained block.

Every ``eval_every`` steps the loop can measure the model on held-out pairs (AlpacaFarm's script
measures every 10 steps and keeps the final model); with ``select="best_val"`` it keeps the weights
of the measurement with the highest held-out accuracy instead, for a reward model that starts to
overfit its labels before training ends.
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from farmflow.config import RewardConfig
from farmflow.models import (
    FeatureMemo,
    batch_order,
    cpu_flags,
    optimizer_and_schedule,
    pack_examples,
    pack_pairs,
    reward_features,
    slow_half_precision,
    tokenize_examples,
    train_top_layers,
)
from farmflow.models.checkpoint import Checkpointer
from farmflow.models.runtime import Runtime
from farmflow.progress import log, progress
from farmflow.training_metrics import Pairs, recorder

VERSION = "1"


def bradley_terry_loss(reward_1: torch.Tensor, reward_2: torch.Tensor, preference: torch.Tensor) -> torch.Tensor:
    """Mean BCE of sigmoid(reward_2 − reward_1) against (preference − 1)."""
    target = preference.to(reward_1.dtype) - 1.0
    return F.binary_cross_entropy_with_logits(reward_2 - reward_1, target)


def pair_rewards(
    model, tokenizer, prompts, out_1, out_2, max_len, packed: bool = False, unwrapped=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both rewards of each pair (all three given as token ids) from one forward pass; no KV cache is built.

    Padded (as TRL's RewardTrainer): every output its own right-padded row after its prompt, read by the
    classifier at its last non-padding token. `packed` (`RewardConfig.packing`): the pairs laid out by
    `farmflow.models.pack_pairs`, each prompt read once and each output attending to its prompt and itself with
    the positions it has alone, so every reward equals the padded one up to float rounding, from fewer positions.
    Hugging Face's classifier keeps only each row's last score, so a hook on its head reads all of them and the
    two read-out positions of each pair are picked. `unwrapped` is the module behind a DDP/FSDP-prepared `model`
    (`Runtime.unwrap`).
    """
    unwrapped = unwrapped or model
    param = next(unwrapped.parameters())
    if not packed:
        ids, mask, _ = pack_examples(tokenizer, list(prompts) * 2, list(out_1) + list(out_2), max_len)
        r = model(input_ids=ids.to(param.device), attention_mask=mask.to(param.device), use_cache=False)
        r = r.logits[:, 0].float()
        return r[: len(prompts)], r[len(prompts) :]
    layout = pack_pairs(tokenizer, prompts, out_1, out_2, max_len)
    scores = []
    hook = unwrapped.score.register_forward_hook(lambda _module, _args, out: scores.append(out))
    try:
        model(
            input_ids=layout.input_ids.to(param.device),
            attention_mask=layout.attention_mask(unwrapped.config._attn_implementation, param.dtype).to(param.device),
            position_ids=layout.position_ids.to(param.device),
            use_cache=False,
        )
    finally:
        hook.remove()
    ends = layout.ends.to(param.device)
    r = scores[0][ends[..., 0], ends[..., 1], 0].float()  # (pairs, 2)
    return r[:, 0], r[:, 1]


def train_reward(
    model,
    tokenizer,
    prompts: Sequence[str],
    out_1: Sequence[str],
    out_2: Sequence[str],
    preferences: Sequence[float],
    cfg: RewardConfig,
    max_len: int,
    checkpointer: Checkpointer | None = None,
    evaluate: Callable[[torch.nn.Module], dict[str, float]] | None = None,
    memo: FeatureMemo | None = None,
) -> dict[str, float]:
    """Train `model` in place on preference pairs; returns training metrics.

    With a `checkpointer`, the loop resumes from its latest checkpoint and saves new ones as it goes (as SFT).
    `evaluate(model)` measures a model on held-out pairs (figures including ``heldout_accuracy``); with
    `cfg.eval_every` it runs every that many steps and after the last, each time logged as a ``split="val"`` metrics
    row, and the returned metrics include the figures of the weights kept (the last measurement's, or with
    `cfg.select == "best_val"` those of the first measurement with the highest ``heldout_accuracy``, whose weights the
    model ends with; kept in the checkpoints too, so a resumed run selects the same)."""
    measuring = evaluate is not None and cfg.eval_every > 0
    if cfg.select == "best_val" and not measuring:
        raise ValueError("reward.select='best_val': no held-out pairs to measure on (the val split is empty)")
    total = max(1, round(cfg.epochs * math.ceil(len(prompts) / cfg.batch_size)))
    batches = batch_order(len(prompts), cfg.batch_size, total, cfg.seed)
    rt = Runtime(model, len(batches[0]), cfg.micro_batch_size, "reward")
    frozen = not cfg.train_backbone
    if frozen:
        if rt.processes > 1:
            raise ValueError("reward.train_backbone=False trains the head in one process: launch it without workers")
        model.base_model.requires_grad_(False)  # before the optimizer, which takes the trainable parameters only
        checkpointer = None  # the head trains in seconds; the features are the cost, and a restart recomputes them
    elif cfg.train_layers is not None:
        if rt.sharded:
            raise ValueError("reward.train_layers trains part of the backbone: launch it in one process or with DDP")
        train_top_layers(model, cfg.train_layers, "reward.train_layers")  # before the optimizer, as above
    opt, sched = optimizer_and_schedule(model, cfg.lr, cfg.weight_decay, total, cfg.warmup_ratio)
    model, opt = rt.prepare(model, opt)
    ckpt = rt.checkpointer(checkpointer or Checkpointer(None, "reward", "", 0))
    state = {"modules": {"model": rt.unwrap(model)}, "optimizers": {"opt": opt}, "schedulers": {"sched": sched}}
    inner = rt.unwrap(model)
    if frozen and cfg.feature_dtype != "float32":
        if slow_half_precision(cfg.feature_dtype, torch.cuda.is_available(), cpu_flags()):
            log(
                "reward.feature_dtype %s on a CPU without native support: features read slower than float32's",
                cfg.feature_dtype,
            )
        inner.config.farmflow_feature_dtype = cfg.feature_dtype  # saved with the model: it scores as it trained
    if cfg.packing and not frozen:
        inner.config.farmflow_packing = True  # likewise: it scores each prompt's outputs after one copy of it
    best = None  # a copy of the weights with the best held-out accuracy so far
    if cfg.select == "best_val":
        if rt.sharded:
            raise ValueError(
                "reward.select='best_val' keeps a full copy of the weights, which FSDP/DeepSpeed shard: use "
                "select='last' with them"
            )
        best = state["modules"]["best"] = copy.deepcopy(inner)
    start, extra = ckpt.restore(**state)
    selected = extra.get("selected", {"step": 0, "figures": {}})  # the kept measurement
    model.train()
    losses = list(extra.get("losses", []))
    rec, pairs = recorder("reward"), Pairs()
    p_ids, o_ids = tokenize_examples(tokenizer, prompts, list(out_1) + list(out_2))  # once, not every step
    o1_ids, o2_ids = o_ids[: len(prompts)], o_ids[len(prompts) :]
    if frozen:
        with progress("reward: features", len(o_ids), unit="output") as bar:
            features = reward_features(inner, tokenizer, p_ids * 2, o_ids, max_len, progress=bar, memo=memo)
        f1, f2 = features[: len(prompts)], features[len(prompts) :]
    with progress("reward", total, unit="step", initial=start) as bar:
        for step in range(start, total):
            idx = batches[step]
            step_loss = 0.0
            for rows in rt.micro_batches():
                part = idx[rows]
                with rt.accumulate(model):
                    if frozen:
                        r1, r2 = inner.score(f1[part])[:, 0].float(), inner.score(f2[part])[:, 0].float()
                    else:
                        r1, r2 = pair_rewards(
                            model,
                            tokenizer,
                            [p_ids[i] for i in part],
                            [o1_ids[i] for i in part],
                            [o2_ids[i] for i in part],
                            max_len,
                            cfg.packing,
                            inner,
                        )
                    loss = bradley_terry_loss(r1, r2, torch.tensor([preferences[i] for i in part], device=r1.device))
                    pairs.add_preferred(r1, r2, torch.tensor([preferences[i] for i in part]))
                    rt.backward(loss, len(part) / len(idx))
                    rt.step(model, opt, sched, 1.0)
                step_loss += loss.item() * len(part) / len(idx)
            losses.append(rt.sum(step_loss))
            tokens = sum(2 * len(p_ids[i]) + len(o1_ids[i]) + len(o2_ids[i]) for i in idx)
            rec.log(
                len(losses),
                epoch=len(losses) * cfg.epochs / total,
                loss=losses[-1],
                tokens=tokens,
                **rt.stats,
                **pairs.figures(rt.sum),
            )
            if measuring and ((step + 1) % cfg.eval_every == 0 or step + 1 == total):
                figures = evaluate(inner)
                model.train()
                rec.log(step + 1, split="val", **figures)
                if best is None or figures["heldout_accuracy"] > selected["figures"].get("heldout_accuracy", -1.0):
                    selected = {"step": step + 1, "figures": figures}
                    if best is not None:
                        best.load_state_dict(inner.state_dict())
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            ckpt.save(step + 1, **state, extra={"losses": losses, "selected": selected})
    if best is not None:
        inner.load_state_dict(best.state_dict())
    rt.finish(model)
    tail = losses[-max(1, len(losses) // 10) :]
    return (
        {
            "steps": float(total),
            "resumed_from_step": float(start),
            "processes": float(rt.processes),
            "train_loss_first": losses[0],
            "train_loss_last": sum(tail) / len(tail),
        }
        | selected["figures"]
        | ({"selected_step": float(selected["step"])} if best is not None else {})
    )
