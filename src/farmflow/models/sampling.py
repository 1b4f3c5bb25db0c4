"""Batched sampling with a KV cache, every sample on its own random stream, and reward scores.

`sample`: batched ancestral sampling (temperature, top-p, n samples per prompt). The prompt
is prefilled once; its KV cache is then repeated n times, so best-of-n pays for one prefill
per prompt, not n. Sample j of prompt i draws its tokens from its own random stream
(`sample_seed`), so it does not depend on the batch size, on the other prompts of the call,
or on n: best-of-2's candidates are the first two of best-of-4's.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np
import torch
from transformers import LlamaForCausalLM, LlamaForSequenceClassification, PreTrainedTokenizerFast

from farmflow.models.encoding import left_pad, pack_examples, pack_shared, tokenize_examples
from farmflow.models.runtime import device_of

SAMPLER_VERSION = "3"  # part of the sampling stages' keys; 3: an over-long prompt keeps its BOS when cut to fit
"""Bump when the samples drawn for a given seed change; part of the key of every stage that samples."""


def sample_seed(seed: int, prompt: int, sample: int) -> int:
    """Seed of the random stream of sample `sample` of prompt `prompt` (its index in the call), from the call's `seed`.

    A 63-bit hash, so neighbouring seeds, prompts and samples get unrelated streams. The hf
    sampler and the vLLM backend both seed each (prompt, sample) with it.
    """
    digest = hashlib.blake2b(f"farmflow-sample/{seed}/{prompt}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def sample_uniforms(seed: int, prompts: Sequence[int], n: int, steps: int) -> torch.Tensor:
    """Uniforms in [0, 1), shape (len(prompts) * n, steps): row i * n + j drives sample j of prompt ``prompts[i]``.

    Counter-based: entry (row, t) is the SplitMix64 finalizer of the row's `sample_seed` plus
    (t + 1) golden-ratio increments, i.e. step t of a SplitMix64 stream seeded with it, so
    any row and step is computed on its own (torch's CPU generator would keep only 32 bits of
    the seed, and streams of different samples would then collide).
    """
    keys = np.array([sample_seed(seed, i, j) for i in prompts for j in range(n)], dtype=np.uint64).reshape(-1, 1)
    z = keys + np.arange(1, steps + 1, dtype=np.uint64)[None, :] * np.uint64(0x9E3779B97F4A7C15)  # wraps mod 2**64
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return torch.from_numpy((z >> np.uint64(11)).astype(np.float64) / 2.0**53)


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """One token per row by inverting the (temperature, top-p) CDF at the row's uniform `u`."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the most likely token
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    cdf = probs.double().cumsum(-1)
    if not bool(torch.isfinite(cdf[:, -1]).all()):
        raise ValueError(
            "sampling: the model produced non-finite logits (NaN or inf); the checkpoint or its dtype is broken"
        )
    target = (u.to(cdf) * cdf[:, -1]).unsqueeze(-1)  # in [0, total): zero-probability tokens are never hit
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


@torch.no_grad()
def sample_ids(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    prompts: Sequence[str],
    *,
    n: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_new_tokens: int = 48,
    batch_size: int = 64,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> list[list[list[int]]]:
    """Token ids of n sampled responses per prompt, as ``result[prompt_index][sample_index]``.

    Each response ends with the EOS id when the model emitted it within `max_new_tokens`
    (RL methods need to know which responses never ended); padding is not included.
    Prompts are batched by length (less padding), prefilled once, and their KV cache is
    repeated n times; rows that emitted EOS leave the batch, so a batch costs its responses'
    lengths, not n x its longest. Sample j of prompt i is drawn with the uniforms of
    `sample_seed` (seed, i, j): the same samples for any batch size and any n (best-of-n
    candidates nest), up to float rounding of the logits in differently shaped batches.
    `progress(k)` is called after each batch with the number of prompts done.
    """
    model.eval()
    device = device_of(model)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    max_prompt = max(1, model.config.max_position_embeddings - max_new_tokens)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[list[list[int]]] = [[] for _ in prompts]
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        input_ids, mask = (t.to(device) for t in left_pad(tokenizer, [prompts[i] for i in idx], max_prompt))
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=position, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1]
        if n > 1:
            cache.batch_repeat_interleave(n)
            mask, logits = mask.repeat_interleave(n, 0), logits.repeat_interleave(n, 0)
            position = position.repeat_interleave(n, 0)
        next_pos = position[:, -1] + 1
        rows = logits.shape[0]
        logits = logits.float().clone()  # every row's next-token logits; finished rows keep stale ones (never used)
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        active = torch.arange(rows, device=device)  # rows whose state the model still advances
        tokens = []
        uniforms = sample_uniforms(seed, idx, n, max_new_tokens).to(device)
        for step in range(max_new_tokens):
            nxt = sample_next(
                logits, temperature, top_p, uniforms[:, step]
            )  # every row its own stream, finished or not
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            tokens.append(nxt)
            done |= nxt == eos
            if bool(done.all()) or len(tokens) == max_new_tokens:
                break
            going = ~done[active]
            if not bool(going.all()):  # drop finished rows from the batch: most responses end long before the longest
                keep = going.nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                active, mask, next_pos = active[keep], mask[keep], next_pos[keep]
            mask = torch.cat([mask, torch.ones(len(active), 1, dtype=mask.dtype, device=device)], dim=1)
            out = model(
                input_ids=nxt[active, None],
                attention_mask=mask,
                position_ids=next_pos[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logits[active] = out.logits[:, -1].float()
            next_pos = next_pos + 1
        generated = torch.stack(tokens, dim=1).tolist()
        for row, ids in enumerate(generated):
            if eos in ids:
                ids = ids[: ids.index(eos) + 1]
            results[idx[row // n]].append([t for t in ids if t != pad])
        if progress:
            progress(len(idx))
    return results


def decode_response(tokenizer: PreTrainedTokenizerFast, ids: Sequence[int]) -> str:
    """Text of a sampled response: up to the first EOS, special tokens dropped, stripped."""
    eos = tokenizer.eos_token_id
    ids = list(ids)
    if eos in ids:
        ids = ids[: ids.index(eos)]
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


def sample(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    prompts: Sequence[str],
    *,
    n: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_new_tokens: int = 48,
    batch_size: int = 64,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> list[list[str]]:
    """n sampled responses per prompt as text, ``result[prompt_index][sample_index]`` (see `sample_ids`)."""
    ids = sample_ids(
        model,
        tokenizer,
        prompts,
        n=n,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        seed=seed,
        progress=progress,
    )
    return [[decode_response(tokenizer, r) for r in per_prompt] for per_prompt in ids]


# ---------------------------------------------------------------- reward scores
Key = tuple[tuple[int, ...], tuple[int, ...]]


def _read_distinct(
    p_ids: Sequence[list[int]],
    o_ids: Sequence[list[int]],
    read: Callable[[list[list[int]], list[list[int]]], torch.Tensor],
    batch_size: int,
    progress: Callable[[int], None] | None,
    known: dict[Key, torch.Tensor] | None = None,
    by_prompt: bool = False,
) -> torch.Tensor:
    """``read(prompts, outputs)`` (token ids; one result row per example) of every (prompt, output), stacked in the
    given order. Each distinct pair is read once, in batches of similar length (less padding), and not at all when
    `known` holds it; what is read is added to `known`. `by_prompt`: batches of the same prompt's outputs instead, for
    a `read` that reads each prompt once. `progress` counts the given rows: repeats and known ones first,
    through its ``skip`` when it has one (`farmflow.progress.Progress`: they do not count towards the rate)."""
    keys = [(tuple(p), tuple(o)) for p, o in zip(p_ids, o_ids)]
    known = {} if known is None else known
    order = (lambda k: (len(k[0]), k[0], len(k[1]))) if by_prompt else (lambda k: len(k[0]) + len(k[1]))
    todo = sorted((k for k in dict.fromkeys(keys) if k not in known), key=order)
    if progress and len(keys) > len(todo):
        getattr(progress, "skip", progress)(len(keys) - len(todo))
    for start in range(0, len(todo), batch_size):
        batch = todo[start : start + batch_size]
        for k, row in zip(batch, read([list(p) for p, _ in batch], [list(o) for _, o in batch])):
            known[k] = row
        if progress:
            progress(len(batch))
    return torch.stack([known[k] for k in keys]) if keys else torch.zeros(0)


def backbone_digest(model: LlamaForSequenceClassification) -> str:
    """A digest of what a reward model's backbone computes: its class, pooling ids and every weight and buffer."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{type(model.base_model).__name__}/{model.config.pad_token_id}".encode())
    backbone = model.base_model
    for name, t in [*backbone.named_parameters(), *backbone.named_buffers()]:
        h.update(f"/{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy())
    return h.hexdigest()


def feature_dtype(model: LlamaForSequenceClassification) -> str:
    """The precision `model`'s backbone reads its features in (`RewardConfig.feature_dtype`, recorded in its config as
    ``farmflow_feature_dtype``; float32 when absent)."""
    return getattr(model.config, "farmflow_feature_dtype", None) or "float32"


def feature_precision(model: LlamaForSequenceClassification) -> contextlib.AbstractContextManager:
    """Where a reward model's backbone reads features: under autocast to its `feature_dtype` (the weights stay as they
    are stored; matrix products run in the lower precision, norms and softmax in float32), or as it is."""
    dtype = feature_dtype(model)
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_of(model).type, dtype=getattr(torch, dtype))


class FeatureMemo:
    """Backbone features (`reward_features`) already read in this process, per backbone weights.

    A reward model trained with a frozen backbone (``reward.train_backbone=False``) reads an output exactly as every
    other model on the same backbone does; only its scalar head differs. So reward models trained on the same
    outputs with other labels (the study's p_sim^ann and greedy ones) and their scoring of the same best-of-n
    candidates read each output once. Tables are keyed by `backbone_digest` (computing it reads every weight once,
    about a second per 500 MB), so a backbone whose weights differ in any way (a fine-tuned one) has a table of its
    own. Keeps the tables of the last `backbones` backbones, on the CPU: hidden size times the dtype's bytes per
    distinct output.
    """

    def __init__(self, backbones: int = 2):
        self.backbones = backbones
        self._tables: OrderedDict[tuple[str, int, str, bool], dict[Key, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    def table(self, model: LlamaForSequenceClassification, max_len: int) -> dict[Key, torch.Tensor]:
        """The features `model`'s backbone has read with this `max_len` in its `feature_dtype`, by (prompt ids, output
        ids) (a live dict)."""
        key = (backbone_digest(model), max_len, feature_dtype(model), packed_reads(model))
        with self._lock:
            table = self._tables.pop(key, None)
            self._tables[key] = table = {} if table is None else table
            while len(self._tables) > self.backbones:
                self._tables.popitem(last=False)
        return table

    def clear(self) -> None:
        with self._lock:
            self._tables.clear()


FEATURES = FeatureMemo()
"""The process's feature memo: the stages that read many outputs with one backbone pass it (`score`,
`farmflow.methods.reward.train_reward`)."""


PACKED_WIDTH = 256
"""Tokens per row when a reward model reads outputs packed (`pack_shared`): a prompt and a dozen or more short outputs
after it. A row's dense attention mask costs width² per layer, so a narrow row bounds it where a batch holds many
prompts; on best-of-n's candidates rows of 256 and of 1024 read alike (`bench.scoring`)."""


def packed_reads(model: LlamaForSequenceClassification) -> bool:
    """Whether `model` reads the outputs it scores packed, each prompt once (``farmflow_packing``, recorded by a reward
    model trained with `RewardConfig.packing`: it scores as it trained, the same rewards up to float rounding)."""
    return bool(getattr(model.config, "farmflow_packing", False))


def _padded_hidden(model, tokenizer, p: list[list[int]], o: list[list[int]], max_len: int) -> torch.Tensor:
    """The backbone's last hidden state where the classifier pools each example, read as right-padded rows."""
    param = next(model.parameters())
    ids, mask, _ = pack_examples(tokenizer, p, o, max_len)
    ids = ids.to(param.device)
    hidden = model.base_model(input_ids=ids, attention_mask=mask.to(param.device), use_cache=False)[0]
    positions = torch.arange(ids.shape[1], device=ids.device)
    last = (positions * (ids != model.config.pad_token_id)).argmax(-1)  # as the classifier pools
    return hidden[torch.arange(len(p), device=ids.device), last]


def _packed_hidden(model, tokenizer, p: list[list[int]], o: list[list[int]], max_len: int) -> torch.Tensor:
    """As `_padded_hidden`, with the outputs of each prompt read after one copy of it (`pack_shared`)."""
    param = next(model.parameters())
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(p):
        groups.setdefault(tuple(prompt), []).append(i)
    order = [i for members in groups.values() for i in members]
    layout = pack_shared(
        tokenizer, [(list(k), [o[i] for i in members]) for k, members in groups.items()], max_len, PACKED_WIDTH
    )
    hidden = model.base_model(
        input_ids=layout.input_ids.to(param.device),
        attention_mask=layout.attention_mask(model.config._attn_implementation, param.dtype).to(param.device),
        position_ids=layout.position_ids.to(param.device),
        use_cache=False,
    )[0]
    ends = layout.ends.to(param.device)
    rows = torch.empty((len(p), hidden.shape[-1]), dtype=hidden.dtype, device=hidden.device)
    rows[torch.tensor(order, device=hidden.device)] = hidden[ends[:, 0], ends[:, 1]]
    return rows


@torch.no_grad()
def reward_features(
    model: LlamaForSequenceClassification,
    tokenizer: PreTrainedTokenizerFast,
    p_ids: Sequence[list[int]],
    o_ids: Sequence[list[int]],
    max_len: int,
    *,
    batch_size: int = 64,
    progress: Callable[[int], None] | None = None,
    memo: FeatureMemo | None = None,
) -> torch.Tensor:
    """What the scalar head of `model` reads of each (prompt, output), both given as token ids: the backbone's last
    hidden state where the classifier pools, the last token that is not padding (the output's closing </s>), so that
    ``model.score(features)`` is the model's reward. Read in the model's `feature_precision`; rows in the given order,
    in the dtype of the head's weights and on the model's device; each distinct pair read once (`_read_distinct`), with
    a `memo` once per backbone and feature dtype in this process."""
    param = next(model.parameters())
    head_dtype = model.score.weight.dtype
    training = model.training
    model.eval()

    packed = packed_reads(model)

    def read(p: list[list[int]], o: list[list[int]]) -> torch.Tensor:
        with feature_precision(model):
            rows = (_packed_hidden if packed else _padded_hidden)(model, tokenizer, p, o, max_len).to(head_dtype)
        return rows.cpu() if memo is not None else rows

    known = memo.table(model, max_len) if memo is not None else None
    features = _read_distinct(p_ids, o_ids, read, batch_size, progress, known, by_prompt=packed)
    model.train(training)
    if not len(p_ids):
        return torch.zeros((0, model.config.hidden_size), dtype=head_dtype, device=param.device)
    return features.to(param.device)


@torch.no_grad()
def score(
    reward_model: LlamaForSequenceClassification,
    tokenizer: PreTrainedTokenizerFast,
    prompts: Sequence[str],
    responses: Sequence[str],
    *,
    batch_size: int = 64,
    progress: Callable[[int], None] | None = None,
    memo: FeatureMemo | None = None,
) -> torch.Tensor:
    """Scalar reward of each (prompt, response), read at the closing </s> token.

    Each distinct pair is read once, in batches of similar length. With a `memo` (`FEATURES`) the reward is the head
    applied to the backbone's features (`reward_features`), read once per backbone in this process: for reward models
    that share a frozen backbone. A model whose features are read in lower precision (`feature_dtype`) is read that way
    too, memo or not, with its head in its own dtype, and so is a model trained packed (`packed_reads`), which reads
    each prompt once before its outputs (best-of-n's candidates share their prompt: about a quarter of the positions
    for SmolLM2 on the synthetic farm's best-of-64). Otherwise it is the model's own forward pass (which a sharded
    model needs).
    """
    reward_model.eval()
    if not len(prompts):
        return torch.zeros(0)
    max_len, device = reward_model.config.max_position_embeddings, device_of(reward_model)
    p_ids, o_ids = tokenize_examples(tokenizer, prompts, responses)
    if memo is not None or feature_dtype(reward_model) != "float32" or packed_reads(reward_model):
        features = reward_features(
            reward_model, tokenizer, p_ids, o_ids, max_len, batch_size=batch_size, progress=progress, memo=memo
        )
        return reward_model.score(features)[:, 0].float().cpu()

    def read(p: list[list[int]], o: list[list[int]]) -> torch.Tensor:
        ids, mask, _ = pack_examples(tokenizer, p, o, max_len)
        return reward_model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[:, 0].float().cpu()

    return _read_distinct(p_ids, o_ids, read, batch_size, progress)
