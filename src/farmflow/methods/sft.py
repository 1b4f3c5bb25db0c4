"""Supervised fine-tuning on demonstrations (the SFT step every AlpacaFarm method starts from).

Loss: next-token cross-entropy on the response tokens only (prompt and padding are
masked with -100), averaged over response tokens in the batch.

Defaults (`farmflow.config.SFTConfig`) follow the Alpaca/AlpacaFarm recipe for LLaMA-7B:
3 epochs, AdamW, peak lr 2e-5, 3% linear warmup then cosine decay, no weight decay,
batch 128. The `synthetic-tiny` preset trains a ~1M-parameter model from scratch, so it
uses more epochs and a much larger learning rate (see the preset).

The loop runs through `farmflow.models.runtime.Runtime`: on a GPU when there is one, over
several processes under ``accelerate launch`` (each takes a share of every batch), in
micro-batches of `micro_batch_size` whose gradients accumulate, and through LoRA adapters
when the model asks for them. The loss of a micro-batch is weighted by its share of the
batch's response tokens, so the update is the full batch's. With ``packing`` the examples of a
micro-batch are laid end to end in rows of up to `max_len` tokens (`farmflow.models.pack_rows`)
instead of padded; the loss is the same up to float rounding.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from farmflow.config import SFTConfig
from farmflow.models import (
    IGNORE,
    batch_order,
    next_token_rows,
    optimizer_and_schedule,
    pack_examples,
    pack_rows,
    tokenize_examples,
)
from farmflow.models.checkpoint import Checkpointer
from farmflow.models.runtime import Runtime
from farmflow.progress import progress
from farmflow.training_metrics import recorder

VERSION = "1"


RESPONSE_ROWS_MIN_VOCAB = 4096
"""From this vocabulary size on, `lm_loss` projects only the response positions onto the vocabulary
(`response_rows_loss`); below it, the full logits (`sft_loss`). The two are equal up to float rounding. A
vocabulary of 49,152 (SmolLM2) makes the full projection and its log-softmax the largest cost of a step, most
of it on prompt and padding positions; the synthetic farm's 1,024 makes it a small one, and its documented results
(docs/evaluation.md) come from the full-logits rounding, to which its 0.6M-parameter reward model is sensitive
(see "Known limits of the synthetic reward model")."""


def sft_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting labels[t+1] from logits[t], ignoring -100 labels."""
    shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1])
    shift_labels = labels[:, 1:].reshape(-1)
    return F.cross_entropy(shift_logits.float(), shift_labels, ignore_index=IGNORE)


def response_rows_loss(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None = None,
):
    """`sft_loss` with the vocabulary projection and cross-entropy over the response positions only.

    The model returns logits for the positions that predict a counted label (`next_token_rows` as
    ``logits_to_keep``), one row each, and the labels are shifted instead of the logits sliced. No KV cache is
    built (``use_cache=False``): a training forward never reads one.
    """
    rows, targets = next_token_rows(labels)
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=rows,
        use_cache=False,
    ).logits
    return F.cross_entropy(logits.float(), targets)


def lm_loss(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    response_rows: bool,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The SFT loss of `model` on a batch: `response_rows_loss` with `response_rows` (a large vocabulary, see
    `RESPONSE_ROWS_MIN_VOCAB`), else `sft_loss` of the full logits. A packed batch (`pack_rows`) comes with its
    position ids and no attention mask."""
    if response_rows:
        return response_rows_loss(model, input_ids, attention_mask, labels, position_ids)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).logits
    return sft_loss(logits, labels)


def train_sft(
    model,
    tokenizer,
    prompts: Sequence[str],
    responses: Sequence[str],
    cfg: SFTConfig,
    max_len: int,
    checkpointer: Checkpointer | None = None,
    name: str = "sft",
    snapshot: Callable[[float, int, torch.nn.Module], None] | None = None,
) -> dict[str, float]:
    """Fine-tune `model` in place on (prompt, response) pairs; returns training metrics.

    With a `checkpointer`, the loop resumes from its latest checkpoint and saves new ones
    as it goes (the batches after a resume are the ones an uninterrupted run would see).
    `snapshot(epochs, step, model)` runs after the step that ends each of ``cfg.snapshot_epochs``
    (before that step's checkpoint, so a resumed run has passed every snapshot it skips).
    """
    per_epoch = math.ceil(len(prompts) / cfg.batch_size)
    total = max(1, round(cfg.epochs * per_epoch))
    marks: dict[int, list[float]] = {}  # step → the snapshot epochs it ends (two can round to one step)
    for e in cfg.snapshot_epochs if snapshot is not None else ():
        marks.setdefault(max(1, round(e * per_epoch)), []).append(e)
    batches = batch_order(len(prompts), cfg.batch_size, total, cfg.seed)
    response_rows = model.config.vocab_size >= RESPONSE_ROWS_MIN_VOCAB
    pad_id = tokenizer.pad_token_id
    rt = Runtime(model, len(batches[0]), cfg.micro_batch_size, name)
    trained = rt.adapt(model)
    opt, sched = optimizer_and_schedule(trained, cfg.lr, cfg.weight_decay, total, cfg.warmup_ratio)
    trained, opt = rt.prepare(trained, opt)
    ckpt = rt.checkpointer(checkpointer or Checkpointer(None, name, "", 0))
    state = {"modules": {"model": rt.unwrap(trained)}, "optimizers": {"opt": opt}, "schedulers": {"sched": sched}}
    start, extra = ckpt.restore(**state)
    losses, tokens = list(extra.get("losses", [])), int(extra.get("tokens", 0))
    rec = recorder(name)
    p_ids, r_ids = tokenize_examples(tokenizer, prompts, responses)  # once, not every step
    trained.train()
    with progress(name, total, unit="step", initial=start) as bar:
        for step in range(start, total):
            idx = batches[step]
            ids, mask, labels = pack_examples(tokenizer, [p_ids[i] for i in idx], [r_ids[i] for i in idx], max_len)
            targets = (labels[:, 1:] != IGNORE).sum()
            step_loss = 0.0
            for rows in rt.micro_batches():
                width = int(mask[rows].sum(1).max())  # right-padded: drop the columns only padding fills
                b_ids, b_mask, b_labels = (t[rows, :width].to(rt.device) for t in (ids, mask, labels))
                b_pos = None
                if cfg.packing:
                    b_ids, b_pos, b_labels = (
                        t.to(rt.device) for t in pack_rows(ids[rows], mask[rows], labels[rows], max_len, pad_id)
                    )
                    b_mask = None
                with rt.accumulate(trained):
                    loss = lm_loss(trained, b_ids, b_mask, b_labels, response_rows, b_pos)
                    share = (labels[rows, 1:] != IGNORE).sum() / targets
                    rt.backward(loss, share)
                    rt.step(trained, opt, sched, 1.0)
                step_loss += loss.item() * float(share)
            losses.append(rt.sum(step_loss))
            tokens += int(mask.sum())
            rec.log(
                step + 1, epoch=(step + 1) * cfg.epochs / total, loss=losses[-1], tokens=int(mask.sum()), **rt.stats
            )
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if step + 1 in marks:
                plain = rt.plain(trained)
                for e in marks[step + 1]:
                    snapshot(e, step + 1, plain)
            ckpt.save(step + 1, **state, extra={"losses": losses, "tokens": tokens})
    rt.finish(trained)
    tail = losses[-max(1, len(losses) // 10) :]
    return {
        "steps": float(total),
        "resumed_from_step": float(start),
        "train_loss_first": losses[0],
        "train_loss_last": sum(tail) / len(tail),
        "train_tokens": float(tokens),
        "processes": float(rt.processes),
    }
