"""Direct preference optimization (Rafailov et al., 2023) from the SFT model.

Loss, for a batch of pairs with chosen output y_c and rejected y_r:

    −log σ(β · [(log π(y_c|x) − log π_ref(y_c|x)) − (log π(y_r|x) − log π_ref(y_r|x))])

averaged over pairs, where log π(y|x) is the sum of the response tokens' log-probs and
π_ref is the frozen SFT policy. β · (log π − log π_ref) is DPO's implicit reward; the
fraction of training pairs where it ranks the chosen output higher is reported as
``implicit_reward_accuracy`` (0.5 at the start, when π = π_ref, by convention a tie is a
miss) and should rise.

The reference log-probs do not change during training, so they are computed once by
`sequence_logps` in their own stage and stored as an artifact (`reference_logps` table),
never recomputed per step. Ties (preference 1.5) are skipped.

Defaults (`DPOConfig`) follow AlpacaFarm's dpo.sh for LLaMA-7B: β 0.1, 2 epochs, AdamW
lr 1e-6, 3% warmup then cosine, batch 128 pairs, no weight decay. The loop runs through
`farmflow.models.runtime.Runtime` (device, processes, micro-batches of `micro_batch_size`
pairs weighted by their share of the batch, LoRA when the model asks for it).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from farmflow.config import DPOConfig
from farmflow.models import batch_order, encode_examples, next_token_rows, optimizer_and_schedule
from farmflow.models.checkpoint import Checkpointer
from farmflow.models.runtime import Runtime, device_of
from farmflow.progress import progress
from farmflow.training_metrics import Pairs, recorder

VERSION = "1"


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
    beta: float = 0.1,
) -> torch.Tensor:
    """Mean of −log σ(β·[(π_c − ref_c) − (π_r − ref_r)]) over the batch."""
    margin = (policy_chosen_logps - reference_chosen_logps) - (policy_rejected_logps - reference_rejected_logps)
    return -F.logsigmoid(beta * margin).mean()


def sequence_logps(
    model,
    tokenizer,
    prompts: Sequence[str],
    responses: Sequence[str],
    max_len: int,
    average: bool = False,
    with_tokens: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, int]:
    """Sum (or with `average`, mean) of log π(response token | prefix) over the response tokens (and </s>) of each
    example; `with_tokens` also returns how many tokens the forward read (prompt and response, no padding).

    Only the positions that predict a response token are projected onto the vocabulary (`next_token_rows` as
    ``logits_to_keep``), and each token's log-prob is its logit minus the row's logsumexp (no full log-softmax
    tensor is kept for the backward). No KV cache is built.
    """
    ids, mask, labels = (t.to(device_of(model)) for t in encode_examples(tokenizer, prompts, responses, max_len))
    rows, targets = next_token_rows(labels)
    logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=rows, use_cache=False).logits.float()
    token_logps = logits.gather(1, targets[:, None]).squeeze(1) - logits.logsumexp(-1)
    # back to (example, position), row-major as the logits are, then summed per example (deterministic on a GPU)
    total = token_logps.new_zeros(rows.shape).masked_scatter(rows, token_logps).sum(-1)
    total = total / rows.sum(1).clamp(min=1) if average else total
    return (total, int(mask.sum())) if with_tokens else total


@torch.no_grad()
def reference_logps(
    model,
    tokenizer,
    prompts: Sequence[str],
    out_1: Sequence[str],
    out_2: Sequence[str],
    max_len: int,
    batch_size: int = 64,
    average: bool = False,
    label: str = "reference_logps",
) -> tuple[list[float], list[float]]:
    """Log-probs of both outputs of every pair under `model` (the frozen reference); per token with `average`.

    `label` names the progress bar and its log lines.
    """
    model.eval()
    l1, l2 = [], []
    with progress(label, len(prompts), unit="pair") as bar:
        for i in range(0, len(prompts), batch_size):
            sl = slice(i, i + batch_size)
            both = sequence_logps(
                model, tokenizer, list(prompts[sl]) * 2, list(out_1[sl]) + list(out_2[sl]), max_len, average
            )
            half = len(both) // 2
            both = both.cpu()
            l1 += both[:half].tolist()
            l2 += both[half:].tolist()
            bar.update(half)
    return l1, l2


def chosen_rejected(rows: Sequence[dict]) -> list[tuple[int, bool]]:
    """(row index, output_2 is chosen) for every pair that is not a tie."""
    return [
        (i, r["preference"] > 1.5) for i, r in enumerate(rows) if r["preference"] is not None and r["preference"] != 1.5
    ]


def train_dpo(
    model,
    tokenizer,
    prompts: Sequence[str],
    out_1: Sequence[str],
    out_2: Sequence[str],
    preferences: Sequence[float],
    ref_1: Sequence[float],
    ref_2: Sequence[float],
    cfg: DPOConfig,
    max_len: int,
    checkpointer: Checkpointer | None = None,
) -> dict[str, float]:
    """Train `model` in place with the DPO loss; `ref_1`/`ref_2` are the stored reference log-probs."""
    pairs = chosen_rejected([{"preference": p} for p in preferences])
    if not pairs:
        raise ValueError("dpo: no pair with a preference other than a tie to learn from")
    pair_prompts, chosen, rejected, ref_c_all, ref_r_all = [], [], [], [], []
    for i, second_chosen in pairs:
        c, r = (1, 0) if second_chosen else (0, 1)
        outs, refs = (out_1[i], out_2[i]), (ref_1[i], ref_2[i])
        pair_prompts.append(prompts[i])
        chosen.append(outs[c])
        rejected.append(outs[r])
        ref_c_all.append(refs[c])
        ref_r_all.append(refs[r])

    total = max(1, round(cfg.epochs * -(-len(pairs) // cfg.batch_size)))
    batches = batch_order(len(pairs), cfg.batch_size, total, cfg.seed)
    rt = Runtime(model, len(batches[0]), cfg.micro_batch_size, "dpo")
    trained = rt.adapt(model)
    opt, sched = optimizer_and_schedule(trained, cfg.lr, cfg.weight_decay, total, cfg.warmup_ratio)
    trained, opt = rt.prepare(trained, opt)
    ckpt = rt.checkpointer(checkpointer or Checkpointer(None, "dpo", "", 0))
    state = {"modules": {"model": rt.unwrap(trained)}, "optimizers": {"opt": opt}, "schedulers": {"sched": sched}}
    start, extra = ckpt.restore(**state)
    losses, accs = list(extra.get("losses", [])), list(extra.get("accuracies", []))
    rec, implicit = recorder("dpo"), Pairs()
    trained.train()
    with progress("dpo", total, unit="step", initial=start) as bar:
        for step in range(start, total):
            step_loss = step_acc = step_tokens = 0.0
            for rows in rt.micro_batches():
                part = batches[step][rows]
                with rt.accumulate(trained):
                    logps, read = sequence_logps(
                        trained,
                        tokenizer,
                        [pair_prompts[i] for i in part] * 2,
                        [chosen[i] for i in part] + [rejected[i] for i in part],
                        max_len,
                        with_tokens=True,
                    )
                    pi_c, pi_r = logps[: len(part)], logps[len(part) :]
                    ref_c = torch.tensor([ref_c_all[i] for i in part], device=logps.device)
                    ref_r = torch.tensor([ref_r_all[i] for i in part], device=logps.device)
                    loss = dpo_loss(pi_c, pi_r, ref_c, ref_r, cfg.beta)
                    implicit.add(cfg.beta * (pi_c - ref_c), cfg.beta * (pi_r - ref_r))
                    share = len(part) / len(batches[step])
                    rt.backward(loss, share)
                    rt.step(trained, opt, sched, 1.0)
                step_loss += loss.item() * share
                step_acc += ((pi_c - ref_c) > (pi_r - ref_r)).float().mean().item() * share
                step_tokens += read
            losses.append(rt.sum(step_loss))
            accs.append(rt.sum(step_acc))
            rec.log(
                step + 1,
                epoch=(step + 1) * cfg.epochs / total,
                loss=losses[-1],
                tokens=int(rt.sum(step_tokens)),
                **rt.stats,
                **implicit.figures(rt.sum),
            )
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", acc=f"{accs[-1]:.2f}")
            ckpt.save(step + 1, **state, extra={"losses": losses, "accuracies": accs})
    rt.finish(trained)
    k = max(1, len(losses) // 10)
    return {
        "steps": float(total),
        "resumed_from_step": float(start),
        "processes": float(rt.processes),
        "pairs": float(len(pairs)),
        "train_loss_first": losses[0],
        "train_loss_last": sum(losses[-k:]) / k,
        "implicit_reward_accuracy_first": sum(accs[:k]) / k,
        "implicit_reward_accuracy_last": sum(accs[-k:]) / k,
    }
