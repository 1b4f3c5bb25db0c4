"""Tokenizer and model factory, batched sampling with a KV cache, reward scoring.

* `train_tokenizer`: a byte-level BPE trained locally on the farm's text (no downloads).
* `build_policy`: a tiny Llama-style causal LM from `ModelConfig`.
* `sample`: batched ancestral sampling (temperature, top-p, n samples per prompt). The
  prompt is prefilled once; its KV cache is then repeated n times, so best-of-n pays for
  one prefill per prompt, not n. Sample j of prompt i draws its tokens from its own random
  stream (`sample_seed`), so it does not depend on the batch size, on the other prompts of
  the call, or on n: best-of-2's candidates are the first two of best-of-4's.
* Reward model: the policy backbone with a scalar head read at the last non-padding
  token (`LlamaForSequenceClassification`, num_labels=1), so it saves and loads with
  ``save_pretrained``/``from_pretrained`` like any Hugging Face model.

Loaders put models on this process's device (`runtime.default_device`: its GPU, else the
CPU); sampling, scoring and log-probs move their inputs to the model's device. Training
loops run through `farmflow.models.runtime.Runtime` (accelerate).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)

from farmflow.config import ModelConfig
from farmflow.modelcache import resolve_model, unavailable
from farmflow.models.runtime import FULL_STATE, default_device, device_of, is_main_process

from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # per-checkpoint load/save bars are noise in stage logs

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
IGNORE = -100


# ------------------------------------------------------------------ tokenizer
def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `texts` (deterministic for the same texts)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, padding_side="right")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(str(path), padding_side="right")


# ---------------------------------------------------------------------- models
def build_policy(cfg: ModelConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A randomly initialized tiny Llama (seeded by cfg.seed)."""
    torch.manual_seed(cfg.seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_seq_len, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
    )
    config.farmflow_lora = cfg.lora.model_dump() if cfg.lora else None
    return LlamaForCausalLM(config)


def load_pretrained(cfg: ModelConfig) -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    """Any causal LM by local folder, model-cache name (`farmflow models get`) or hub id, ready for our encode/sample
    functions. A hub id that cannot be downloaded raises ModelUnavailable (one line naming the commands that cache it).

    A missing pad token, or one that is also EOS, gets a token of its own (new embedding rows set to the mean of the others); a
    missing BOS reuses EOS, since every sequence starts with BOS here. Padding side is
    right (training; sampling left-pads by itself). The context is capped at
    cfg.max_seq_len; gradient checkpointing is recorded in the config (`load_policy`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model(cfg.pretrained)
    local = Path(source).is_dir()
    revision = None if local else cfg.revision
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, padding_side="right", revision=revision)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, cfg.dtype), revision=revision,
                                                     attn_implementation=cfg.attn_implementation)
    except OSError as err:  # transformers' "couldn't connect to https://huggingface.co", "not a valid model identifier"
        if local:
            raise
        raise unavailable(cfg.pretrained, str(err)) from None
    if tokenizer.eos_token is None:
        raise ValueError(f"model.pretrained {cfg.pretrained!r}: the tokenizer has no EOS token")
    if tokenizer.bos_token is None:
        tokenizer.bos_token = tokenizer.eos_token
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        # a pad token of its own: sampling drops padding by id, so a pad that is also EOS would drop every EOS
        # (each response then looks unfinished and gets PPO's no-EOS penalty)
        tokenizer.pad_token = None
        tokenizer.add_special_tokens({"pad_token": PAD})
        if len(tokenizer) > model.get_input_embeddings().num_embeddings:
            model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id = tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id
    model.config.max_position_embeddings = min(cfg.max_seq_len, getattr(model.config, "max_position_embeddings", cfg.max_seq_len))
    model.config.farmflow_gradient_checkpointing = cfg.gradient_checkpointing
    model.config.farmflow_attn_implementation = cfg.attn_implementation  # config.json does not keep it; every later load applies it
    model.config.farmflow_lora = cfg.lora.model_dump() if cfg.lora else None  # policy training applies it (runtime.adapt)
    return model, tokenizer


def _from_pretrained(cls, path: str | Path, **kwargs: Any):
    """`cls.from_pretrained(path)` with the attention kernel `model.attn_implementation` chose for the base model
    (recorded as farmflow_attn_implementation: Hugging Face's config.json does not keep it)."""
    config = Path(path) / "config.json"
    attn = json.loads(config.read_text()).get("farmflow_attn_implementation") if config.is_file() else None
    return cls.from_pretrained(str(path), **({"attn_implementation": attn} if attn else {}), **kwargs)


def load_policy(path: str | Path) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    from transformers import AutoModelForCausalLM

    model = _from_pretrained(AutoModelForCausalLM, path)
    if getattr(model.config, "farmflow_gradient_checkpointing", False):
        model.activation_checkpointing_enable()
    return model.to(default_device()), load_tokenizer(path)


def reward_from_policy(path: str | Path, seed: int = 0) -> LlamaForSequenceClassification:
    """Reward model initialized from a policy checkpoint: its backbone, a fresh scalar head."""
    torch.manual_seed(seed)
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the "newly initialized score head" warning is expected here
    try:
        return _from_pretrained(AutoModelForSequenceClassification, path, num_labels=1).to(default_device())
    finally:
        hf_logging.set_verbosity(level)


def load_reward(path: str | Path) -> tuple[LlamaForSequenceClassification, PreTrainedTokenizerFast]:
    return _from_pretrained(AutoModelForSequenceClassification, path).to(default_device()), load_tokenizer(path)


class ValueModel(torch.nn.Module):
    """Per-token values for PPO: a transformer backbone and a linear value head.

    ``forward`` returns one value per position, shape (batch, time): the value of the
    state after reading tokens up to and including that position.
    """

    def __init__(self, backbone: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)  # a fresh, zero-initialized head: every value starts at 0
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
        return self.head(hidden).squeeze(-1).float()


def value_from_reward(path: str | Path) -> ValueModel:
    """Value model initialized from a reward model: its backbone, a fresh zero-initialized head."""
    reward = _from_pretrained(AutoModelForSequenceClassification, path)
    return ValueModel(reward.base_model, reward.config.hidden_size).to(default_device())


def save(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, folder: str | Path) -> None:
    """`save_pretrained` of the model and tokenizer, by the main process only.

    A model trained under FSDP/DeepSpeed is saved from the full state dict `Runtime.finish`
    gathered, in its stored dtype (which config.json then records).
    """
    if not is_main_process():
        return
    state = model.__dict__.get(FULL_STATE)
    model.save_pretrained(str(folder), safe_serialization=True, state_dict=state)
    tokenizer.save_pretrained(str(folder))
    if state:
        config = json.loads((Path(folder) / "config.json").read_text())
        config["dtype"] = str(next(v.dtype for v in state.values() if v.is_floating_point())).removeprefix("torch.")
        (Path(folder) / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# ------------------------------------------------------------------- encoding
def encode_examples(
    tokenizer: PreTrainedTokenizerFast, prompts: Sequence[str], responses: Sequence[str], max_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``<s> prompt response </s>``: (input_ids, attention_mask, labels).

    Labels are -100 on the prompt and padding, so a causal-LM loss covers response tokens
    (and the closing </s>) only. Too-long examples keep the whole prompt when possible and
    lose the end of the response; a prompt too long to leave room for a quarter of
    `max_len` of response is cut from the left (after <s>), so every example keeps
    response tokens to learn from.
    """
    return pack_examples(tokenizer, *tokenize_examples(tokenizer, prompts, responses), max_len)


def tokenize_examples(tokenizer: PreTrainedTokenizerFast, prompts: Sequence[str], responses: Sequence[str]) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of prompts and responses (no special tokens): tokenize a dataset once, `pack_examples` per batch."""
    return (tokenizer(list(prompts), add_special_tokens=False)["input_ids"],
            tokenizer(list(responses), add_special_tokens=False)["input_ids"])


def pack_examples(
    tokenizer: PreTrainedTokenizerFast, p_ids: Sequence[list[int]], r_ids: Sequence[list[int]], max_len: int,
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
    input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
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
    index = (torch.arange(width, device=input_ids.device)[None, :] - shift[:, None]) % width  # roll row i right by shift[i]
    ids, mask, labels = (t.gather(1, index) for t in (input_ids, attention_mask, labels))
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    has_label = labels != IGNORE
    first = int(torch.where(has_label.any(1), has_label.float().argmax(1), width - 1).min())
    return ids, mask, labels, positions, width - first + 1


def prompt_ids(tokenizer: PreTrainedTokenizerFast, prompts: Sequence[str], max_prompt_len: int) -> list[list[int]]:
    """``<s>`` + each prompt's tokens, the prompt cut from the left to fit `max_prompt_len` (BOS kept, as in training)."""
    ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    return [[tokenizer.bos_token_id] + x[len(x) - min(len(x), max(0, max_prompt_len - 1)):] for x in ids]


def _left_pad(tokenizer: PreTrainedTokenizerFast, prompts: Sequence[str], max_prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = prompt_ids(tokenizer, prompts, max_prompt_len)
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, width - len(x):] = torch.tensor(x)
        mask[i, width - len(x):] = 1
    return input_ids, mask


# ------------------------------------------------------------------- sampling
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


def _sample_next(logits: torch.Tensor, temperature: float, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """One token per row by inverting the (temperature, top-p) CDF at the row's uniform `u`."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the most likely token
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    cdf = probs.double().cumsum(-1)
    if not bool(torch.isfinite(cdf[:, -1]).all()):
        raise ValueError("sampling: the model produced non-finite logits (NaN or inf); the checkpoint or its dtype is broken")
    target = (u.to(cdf) * cdf[:, -1]).unsqueeze(-1)  # in [0, total): zero-probability tokens are never hit
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


@torch.no_grad()
def sample_ids(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, prompts: Sequence[str], *, n: int = 1,
    temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 48, batch_size: int = 64, seed: int = 0,
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
        idx = order[start: start + batch_size]
        input_ids, mask = (t.to(device) for t in _left_pad(tokenizer, [prompts[i] for i in idx], max_prompt))
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
            nxt = _sample_next(logits, temperature, top_p, uniforms[:, step])  # every row its own stream, finished or not
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
            out = model(input_ids=nxt[active, None], attention_mask=mask, position_ids=next_pos[:, None], past_key_values=cache, use_cache=True)
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
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, prompts: Sequence[str], *, n: int = 1,
    temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 48, batch_size: int = 64, seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> list[list[str]]:
    """n sampled responses per prompt as text, ``result[prompt_index][sample_index]`` (see `sample_ids`)."""
    ids = sample_ids(model, tokenizer, prompts, n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                     batch_size=batch_size, seed=seed, progress=progress)
    return [[decode_response(tokenizer, r) for r in per_prompt] for per_prompt in ids]


# ---------------------------------------------------------------- reward scores
@torch.no_grad()
def score(
    reward_model: LlamaForSequenceClassification, tokenizer: PreTrainedTokenizerFast, prompts: Sequence[str],
    responses: Sequence[str], *, batch_size: int = 64, progress: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Scalar reward of each (prompt, response), read at the closing </s> token."""
    reward_model.eval()
    max_len, device = reward_model.config.max_position_embeddings, device_of(reward_model)
    out = []
    for start in range(0, len(prompts), batch_size):
        ids, mask, _ = encode_examples(tokenizer, prompts[start: start + batch_size], responses[start: start + batch_size], max_len)
        out.append(reward_model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[:, 0].float().cpu())
        if progress:
            progress(len(ids))
    return torch.cat(out) if out else torch.zeros(0)


# ---------------------------------------------------------------- optimization
def batch_order(n: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """Index batches for `steps` optimizer steps: reshuffled epochs, a batch never short.

    A pure function of its arguments, so a resumed loop replays exactly the batches an
    uninterrupted one would have seen from any step on.
    """
    rng = random.Random(seed)
    order: list[int] = []
    batches = []
    for _ in range(steps):
        while len(order) < min(batch_size, n):  # refill with a fresh shuffled epoch
            epoch = list(range(n))
            rng.shuffle(epoch)
            order += epoch
        batches.append(order[:batch_size])
        order = order[batch_size:]
    return batches


def optimizer_and_schedule(
    model: torch.nn.Module, lr: float, weight_decay: float, total_steps: int, warmup_ratio: float,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable parameters with linear warmup and cosine decay to 0 (the paper's SFT/reward schedule)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)
    warmup = max(1, int(total_steps * warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)
