"""Token ids for training and sampling: ``<s> prompt response </s>`` examples with response-only labels, and
left-padded prompts."""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import PreTrainedTokenizerFast

IGNORE = -100
"""Label of a position that no loss covers (prompt and padding): PyTorch's cross-entropy ``ignore_index``."""


def encode_examples(
    tokenizer: PreTrainedTokenizerFast,
    prompts: Sequence[str],
    responses: Sequence[str],
    max_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``<s> prompt response </s>``: (input_ids, attention_mask, labels).

    Labels are -100 on the prompt and padding, so a causal-LM loss covers response tokens
    (and the closing </s>) only. Too-long examples keep the whole prompt when possible and
    lose the end of the response; a prompt too long to leave room for a quarter of
    `max_len` of response is cut from the left (after <s>), so every example keeps
    response tokens to learn from.
    """
    return pack_examples(tokenizer, *tokenize_examples(tokenizer, prompts, responses), max_len)


def tokenize_examples(
    tokenizer: PreTrainedTokenizerFast, prompts: Sequence[str], responses: Sequence[str]
) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of prompts and responses (no special tokens): tokenize a dataset once, `pack_examples` per batch."""
    return (
        tokenizer(list(prompts), add_special_tokens=False)["input_ids"],
        tokenizer(list(responses), add_special_tokens=False)["input_ids"],
    )


def pack_examples(
    tokenizer: PreTrainedTokenizerFast,
    p_ids: Sequence[list[int]],
    r_ids: Sequence[list[int]],
    max_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`encode_examples` from token ids (`tokenize_examples`)."""
    rows, labels = [], []
    for p, r in zip(p_ids, r_ids):
        r = r + [tokenizer.eos_token_id]
        room = max_len - 1 - min(len(r), max(1, max_len // 4))
        p = [tokenizer.bos_token_id] + (p[-room:] if len(p) > room else p)
        ids = (p + r)[:max_len]
        lab = ([IGNORE] * len(p) + r)[:max_len]
        rows.append(ids)
        labels.append(lab)
    width = max(len(x) for x in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    label_t = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(zip(rows, labels)):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        label_t[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(ids)] = 1
    return input_ids, mask, label_t


def response_window(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    labels: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A right-padded batch (`encode_examples`) moved to the left padding, plus how many last positions need logits.

    Every row then ends in the last column, so all response tokens sit in the last `keep`
    columns, where `keep` = width − (earliest label column) + 1. Returns (input_ids,
    attention_mask, labels, position_ids, keep); pass ``logits_to_keep=keep`` to the model and
    compare its logits with ``labels[:, -keep:]``. On short answers to long prompts (the
    synthetic farm: ~30% of positions) this skips most of the vocabulary projection; the
    result is the same up to float rounding. DPO's log-probs use it. SFT does not: it would cut
    an SFT step by ~15%, but its float rounding re-draws the synthetic farm's pairs, and the
    0.6M-parameter reward model trained on them is weak enough for that to decide whether
    best-of-n beats SFT; see docs/evaluation.md, "Known limits of the synthetic reward model".
    """
    width = input_ids.shape[1]
    shift = width - attention_mask.sum(1)
    index = (
        torch.arange(width, device=input_ids.device)[None, :] - shift[:, None]
    ) % width  # roll row i right by shift[i]
    ids, mask, labels = (t.gather(1, index) for t in (input_ids, attention_mask, labels))
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    has_label = labels != IGNORE
    first = int(torch.where(has_label.any(1), has_label.float().argmax(1), width - 1).min())
    return ids, mask, labels, positions, width - first + 1


def prompt_ids(tokenizer: PreTrainedTokenizerFast, prompts: Sequence[str], max_prompt_len: int) -> list[list[int]]:
    """``<s>`` + each prompt's tokens, the prompt cut from the left to fit `max_prompt_len` (BOS kept, as in
    training)."""
    ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    return [[tokenizer.bos_token_id] + x[len(x) - min(len(x), max(0, max_prompt_len - 1)) :] for x in ids]


def left_pad(
    tokenizer: PreTrainedTokenizerFast,
    prompts: Sequence[str],
    max_prompt_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded `prompt_ids` for generation: (input_ids, attention_mask), every prompt ending in the last column."""
    ids = prompt_ids(tokenizer, prompts, max_prompt_len)
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, width - len(x) :] = torch.tensor(x)
        mask[i, width - len(x) :] = 1
    return input_ids, mask
