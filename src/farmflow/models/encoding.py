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


def next_token_rows(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions whose next label counts, and those labels: (rows, targets).

    Position t predicts label t+1, so `rows` (a (batch, width) bool mask) is ``labels[:, 1:] != -100`` shifted one
    column left (the last column predicts nothing), and `targets` holds the counted labels in the same (row-major)
    order. Given as ``logits_to_keep=rows``, a Hugging Face causal LM projects only those positions onto the
    vocabulary and returns (rows.sum(), vocab) logits, so the loss never touches prompt or padding positions and
    nothing slices the logits (whose backward would fill a full-size zero gradient).
    """
    following = labels[:, 1:]
    counted = following != IGNORE
    rows = torch.cat([counted, torch.zeros_like(counted[:, :1])], 1)
    return rows, following[counted]


def pack_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor, max_len: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A right-padded batch (`encode_examples`) packed end to end: (input_ids, position_ids, labels).

    Examples go in order into the current row while it has room for them (`max_len` tokens), else start a new one;
    rows are right-padded to the longest. Position ids restart at 0 with every example (and with the padding, a
    segment of its own), which is how a Hugging Face model given no attention mask tells packed sequences apart
    and keeps attention inside each. No loss crosses an example boundary: an example's first label is that of
    its <s> (-100), so the last token of the one before predicts nothing.
    """
    lengths = attention_mask.sum(1).tolist()
    rows: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if rows[-1] and used + n > max_len:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    width = max(sum(lengths[i] for i in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    packed_labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            n = lengths[i]
            ids[r, at : at + n] = input_ids[i, :n]
            packed_labels[r, at : at + n] = labels[i, :n]
            positions[r, at : at + n] = torch.arange(n)
            at += n
        positions[r, at:] = torch.arange(width - at)
    return ids, positions, packed_labels


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
