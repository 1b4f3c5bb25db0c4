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
    """Outputs laid out to be read in one forward pass, each prompt once (`pack_shared`, `pack_pairs`)."""

    input_ids: torch.Tensor
    """(rows, width) token ids, `pad_token_id` after the last unit of a row."""
    position_ids: torch.Tensor
    """(rows, width): each output continues its prompt's positions, as if read on its own after it."""
    allowed: torch.Tensor
    """(rows, 1, width, width) bool, True where query position i may attend to key position j."""
    ends: torch.Tensor
    """(outputs, 2) from `pack_shared`, (pairs, 2, 2) from `pack_pairs`: the (row, column) whose score is each
    output's reward."""

    def attention_mask(self, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
        """`allowed` as a Hugging Face model takes a ready 4D mask: bool for sdpa, an additive float bias for eager."""
        if attn_implementation == "sdpa":
            return self.allowed
        return torch.zeros(self.allowed.shape, dtype=dtype).masked_fill(~self.allowed, torch.finfo(dtype).min)


def pack_shared(
    tokenizer: PreTrainedTokenizerFast,
    groups: Sequence[tuple[list[int], Sequence[list[int]]]],
    max_len: int,
    capacity: int,
) -> PackedPairs:
    """Outputs that share a prompt, packed for one forward pass that reads the prompt once per unit.

    `groups`: (prompt ids, its outputs' ids). Every output is the example `pack_examples` makes of (prompt, output),
    so its reward equals the one read from that example alone, up to float rounding. A group becomes ``prompt
    output_1 output_2 ...``: each output attends to the prompt and to itself, not to the other outputs, and its
    position ids continue the prompt's; an output whose example cuts the prompt differently from the group's first
    carries its own cut prompt (positions from 0, attending to itself only). A group longer than `capacity` tokens is
    split into units that each repeat the prompt. Units go into rows of up to `capacity` tokens (or the longest unit),
    longest first, each into the first row with room (first-fit decreasing), and attend only within themselves; the
    row width bounds the dense attention mask's cost. An output's reward is read where a sequence classifier reads it
    alone: at its example's last token that is not `pad_token_id`. `ends` lists the outputs group by group.
    """
    pad = tokenizer.pad_token_id
    units: list[dict] = []  # tokens, positions, branch (0: the shared prompt, j: output j's own), sees, reads
    n_out = 0
    for prompt, outputs in groups:
        cut = [_cut(tokenizer, prompt, o, max_len) for o in outputs]
        shared = cut[0][0] if cut else []
        unit = None
        for p, o in cut:
            shares = p == shared
            own, first = (o, len(p)) if shares else (p + o, 0)
            if (
                unit is None
                or (shares and not unit["shared"])
                or (unit["reads"] and len(unit["tokens"]) + len(own) > capacity)
            ):
                prefix = shared if shares else []  # an output of its own cut starts a unit without the shared prompt
                unit = {"tokens": list(prefix), "positions": list(range(len(prefix))), "reads": [], "shared": shares}
                unit["branch"], unit["sees"] = [0] * len(prefix), [True] * len(prefix)
                units.append(unit)
            start, br = len(unit["tokens"]), len(unit["reads"]) + 1
            unit["tokens"] += own
            unit["positions"] += range(first, first + len(own))
            unit["branch"] += [br] * len(own)
            unit["sees"] += [first > 0] * len(own)
            example = p + o
            last = max((k for k, t in enumerate(example) if t != pad), default=0)  # index in the example alone
            # the example is this branch alone, or the unit's shared prompt (at the unit's start) and this branch
            col = start + last if first == 0 else (last if last < len(p) else start + last - len(p))
            unit["reads"].append((n_out, col))
            n_out += 1
    width_cap = max([capacity] + [len(u["tokens"]) for u in units])
    rows: list[list[int]] = []  # unit indices per row
    room: list[int] = []
    for u in sorted(range(len(units)), key=lambda u: -len(units[u]["tokens"])):
        n = len(units[u]["tokens"])
        at = next((k for k, left in enumerate(room) if left >= n), None)
        if at is None:
            rows.append([])
            room.append(width_cap)
            at = len(rows) - 1
        rows[at].append(u)
        room[at] -= n
    width = max((width_cap - left for left in room), default=0)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    unit = torch.full((len(rows), width), -1, dtype=torch.long)
    branch = torch.full((len(rows), width), -1, dtype=torch.long)
    sees = torch.zeros((len(rows), width), dtype=torch.bool)
    ends = torch.zeros((n_out, 2), dtype=torch.long)
    for r, members in enumerate(rows):
        at = 0
        for u in members:
            x = units[u]
            n = len(x["tokens"])
            ids[r, at : at + n] = torch.tensor(x["tokens"])
            pos[r, at : at + n] = torch.tensor(x["positions"])
            branch[r, at : at + n] = torch.tensor(x["branch"])
            sees[r, at : at + n] = torch.tensor(x["sees"])
            unit[r, at : at + n] = u
            for k, col in x["reads"]:
                ends[k] = torch.tensor([r, at + col])
            at += n
    q_unit, k_unit = unit[:, :, None], unit[:, None, :]
    q_branch, k_branch = branch[:, :, None], branch[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = causal & (q_unit == k_unit) & ((k_branch == q_branch) | ((k_branch == 0) & sees[:, :, None]))
    allowed |= torch.eye(width, dtype=torch.bool)  # padding attends to itself: no query without a key
    return PackedPairs(ids, pos, allowed[:, None], ends)


def pack_pairs(
    tokenizer: PreTrainedTokenizerFast,
    p_ids: Sequence[list[int]],
    r1_ids: Sequence[list[int]],
    r2_ids: Sequence[list[int]],
    max_len: int,
) -> PackedPairs:
    """Preference pairs packed for one forward pass that reads each prompt once (`pack_shared`, a pair a group).

    A pair becomes ``prompt output_1 output_2`` (``prompt_1 output_1 prompt_2 output_2`` when the two outputs'
    examples cut the prompt differently), in rows of up to 2 × `max_len` tokens, so a pair is never split. Against two
    right-padded rows per pair this skips each prompt's second reading and most of the padding. `ends` is (pairs, 2,
    2): output_1's and output_2's read-out (row, column).
    """
    layout = pack_shared(tokenizer, [(p, [a, b]) for p, a, b in zip(p_ids, r1_ids, r2_ids)], max_len, 2 * max_len)
    layout.ends = layout.ends.reshape(len(p_ids), 2, 2)
    return layout


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
