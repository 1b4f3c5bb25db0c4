"""Token ids for training and sampling: ``<s> prompt response </s>`` examples with response-only labels, and
left-padded prompts."""

from __future__ import annotations

from dataclasses import dataclass
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
        p, r = _cut(tokenizer, p, r, max_len)
        rows.append(p + r)
        labels.append([IGNORE] * len(p) + r)
    width = max(len(x) for x in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    label_t = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(zip(rows, labels)):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        label_t[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(ids)] = 1
    return input_ids, mask, label_t


def _cut(tokenizer: PreTrainedTokenizerFast, p: list[int], r: list[int], max_len: int) -> tuple[list[int], list[int]]:
    """One example as `pack_examples` trains on it: (``<s>`` + prompt, response + ``</s>``), cut to `max_len` tokens."""
    r = r + [tokenizer.eos_token_id]
    room = max_len - 1 - min(len(r), max(1, max_len // 4))
    p = [tokenizer.bos_token_id] + (p[-room:] if len(p) > room else p)
    return p, r[: max_len - len(p)]


@dataclass
class PackedPairs:
    """Both outputs of preference pairs laid out to be read in one forward pass (`pack_pairs`)."""

    input_ids: torch.Tensor
    """(rows, width) token ids, `pad_token_id` after the last pair of a row."""
    position_ids: torch.Tensor
    """(rows, width): each output continues its prompt's positions, as if read on its own after it."""
    allowed: torch.Tensor
    """(rows, 1, width, width) bool, True where query position i may attend to key position j."""
    ends: torch.Tensor
    """(pairs, 2, 2): the (row, column) whose score is output_1's and output_2's reward."""

    def attention_mask(self, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
        """`allowed` as a Hugging Face model takes a ready 4D mask: bool for sdpa, an additive float bias for eager."""
        if attn_implementation == "sdpa":
            return self.allowed
        return torch.zeros(self.allowed.shape, dtype=dtype).masked_fill(~self.allowed, torch.finfo(dtype).min)


def pack_pairs(
    tokenizer: PreTrainedTokenizerFast,
    p_ids: Sequence[list[int]],
    r1_ids: Sequence[list[int]],
    r2_ids: Sequence[list[int]],
    max_len: int,
) -> PackedPairs:
    """Preference pairs packed for one forward pass that reads each prompt once.

    Every output is the example `pack_examples` makes of (prompt, output), so its reward equals the one read
    from that example alone, up to float rounding. A pair becomes ``prompt output_1 output_2``: output_2 attends
    to the prompt and to itself, not to output_1, and its position ids continue the prompt's (when the two
    outputs' examples cut the prompt differently, the pair is ``prompt_1 output_1 prompt_2 output_2`` instead).
    Pairs go into rows of up to 2 × `max_len` tokens, longest first, each into the first row with room
    (first-fit decreasing), and attend only within themselves. Against two right-padded rows per pair this
    skips each prompt's second reading and most of the padding. An output's reward is read where a sequence
    classifier reads it alone: at its example's last token that is not `pad_token_id`.
    """
    pad = tokenizer.pad_token_id
    units = []  # per pair: tokens, positions, branch (0: the shared prompt, 1/2: an output's own), read-out offsets
    for p, r1, r2 in zip(p_ids, r1_ids, r2_ids):
        (pa, a), (pb, b) = _cut(tokenizer, p, r1, max_len), _cut(tokenizer, p, r2, max_len)
        if pa == pb:
            parts = [(pa, 0, 0), (a, 1, len(pa)), (b, 2, len(pa))]
        else:
            parts = [(pa + a, 1, 0), (pb + b, 2, 0)]
        tokens, positions, branch = [], [], []
        for seg, br, first in parts:
            tokens += seg
            positions += range(first, first + len(seg))
            branch += [br] * len(seg)
        reads = []
        for example, br in ((pa + a, 1), (pb + b, 2)):
            last = max((k for k, t in enumerate(example) if t != pad), default=0)  # index in the example alone
            # the example is the prompt (shared or this branch's own) followed by this branch's output
            own = [k for k, x in enumerate(branch) if x == br]
            shared = [k for k, x in enumerate(branch) if x == 0]
            reads.append((shared + own)[last])
        units.append((tokens, positions, branch, reads))
    capacity = 2 * max_len
    rows: list[list[int]] = []  # unit indices per row
    room: list[int] = []
    for u in sorted(range(len(units)), key=lambda u: -len(units[u][0])):
        n = len(units[u][0])
        at = next((k for k, left in enumerate(room) if left >= n), None)
        if at is None:
            rows.append([])
            room.append(capacity)
            at = len(rows) - 1
        rows[at].append(u)
        room[at] -= n
    width = max(capacity - left for left in room)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    unit = torch.full((len(rows), width), -1, dtype=torch.long)
    branch = torch.full((len(rows), width), -1, dtype=torch.long)
    ends = torch.zeros((len(units), 2, 2), dtype=torch.long)
    for r, members in enumerate(rows):
        at = 0
        for u in members:
            tokens, positions, br, reads = units[u]
            n = len(tokens)
            ids[r, at : at + n] = torch.tensor(tokens)
            pos[r, at : at + n] = torch.tensor(positions)
            branch[r, at : at + n] = torch.tensor(br)
            unit[r, at : at + n] = u
            ends[u, :, 0] = r
            ends[u, :, 1] = torch.tensor(reads) + at
            at += n
    q_unit, k_unit = unit[:, :, None], unit[:, None, :]
    q_branch, k_branch = branch[:, :, None], branch[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = causal & (q_unit == k_unit) & ((k_branch == 0) | (k_branch == q_branch))
    allowed |= torch.eye(width, dtype=torch.bool)  # padding attends to itself: no query without a key
    return PackedPairs(ids, pos, allowed[:, None], ends)


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
