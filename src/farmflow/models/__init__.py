"""Tokenizer and model factory, batched sampling with a KV cache, reward scoring.

* `train_tokenizer`: a byte-level BPE trained locally on the farm's text (no downloads).
* `build_policy`: a tiny Llama-style causal LM from `ModelConfig`; `random_llama`: a 1-layer one for any tokenizer.
* `sample` (`sampling`): batched ancestral sampling (temperature, top-p, n samples per
  prompt) with a KV cache, each sample on its own random stream; `score`: reward scores.
* `encode_examples` (`encoding`): training examples with response-only labels.
* Reward model: the policy backbone with a scalar head read at the last non-padding
  token (`LlamaForSequenceClassification`, num_labels=1), so it saves and loads with
  ``save_pretrained``/``from_pretrained`` like any Hugging Face model.

Loaders put models on this process's device (`runtime.default_device`: its GPU, else the
CPU); sampling, scoring and log-probs move their inputs to the model's device. Training
loops run through `farmflow.models.runtime.Runtime` (accelerate).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any, Iterable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

from farmflow.config import ModelConfig
from farmflow.modelcache import resolve_model, unavailable
from farmflow.models.encoding import (
    IGNORE,
    encode_examples,
    left_pad,
    next_token_rows,
    pack_examples,
    pack_pairs,
    pack_rows,
    pack_shared,
    prompt_ids,
    tokenize_examples,
)
from farmflow.models.runtime import (
    FULL_STATE,
    cast_state,
    cpu_flags,
    default_device,
    for_compute,
    is_main_process,
    slow_half_precision,
    stored_dtype,
)
from farmflow.models.sampling import (
    FEATURES,
    SAMPLER_VERSION,
    FeatureMemo,
    decode_response,
    feature_dtype,
    packed_reads,
    reward_features,
    sample,
    sample_ids,
    sample_next,
    sample_seed,
    sample_uniforms,
    score,
)
from farmflow.progress import log

hf_logging.disable_progress_bar()  # per-checkpoint load/save bars are noise in stage logs

PAD, BOS, EOS = "<pad>", "<s>", "</s>"


# ------------------------------------------------------------------ tokenizer
def train_tokenizer(texts: Iterable[str], vocab_size: int, pad: bool = True) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `texts` (deterministic for the same texts). `pad=False` leaves the pad token out, as
    many hub tokenizers do (BOS and EOS then take ids 0 and 1)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS] if pad else [BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD if pad else None, padding_side="right"
    )


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(str(path), padding_side="right")


# ---------------------------------------------------------------------- models
def build_policy(cfg: ModelConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A randomly initialized tiny Llama (seeded by cfg.seed)."""
    torch.manual_seed(cfg.seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_seq_len,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    config.farmflow_lora = cfg.lora.model_dump() if cfg.lora else None
    return LlamaForCausalLM(config)


def random_llama(
    tokenizer: PreTrainedTokenizerFast,
    seed: int = 0,
    max_positions: int = 1024,
    init_range: float = 0.02,
    tie: bool = False,
) -> LlamaForCausalLM:
    """A random 1-layer Llama (hidden size 32) for `tokenizer`: the stand-in for a hub checkpoint in tests and smoke
    benchmarks. A wide `init_range` (e.g. 0.3) makes its next-token choices clear-cut rather than near uniform."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        initializer_range=init_range,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(config)


def load_pretrained(cfg: ModelConfig) -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    """Any causal LM by local folder, model-cache name (`farmflow models get`) or hub id, ready for our encode/sample
    functions. A hub id that cannot be downloaded raises ModelUnavailable (one line naming the commands that cache it).

    A missing pad token, or one that is also EOS, gets a token of its own (new embedding rows set to the mean of the
    others); a missing BOS reuses EOS, since every sequence starts with BOS here. Padding side is
    right (training; sampling left-pads by itself). The context is capped at
    cfg.max_seq_len; gradient checkpointing is recorded in the config (`load_policy`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model(cfg.pretrained)
    local = Path(source).is_dir()
    if slow_half_precision(cfg.dtype, torch.cuda.is_available(), cpu_flags()):
        log(
            "model.dtype %s on a CPU without native bfloat16/float16 (no avx512_bf16, amx, avx512_fp16): stored in "
            "it, later stages compute in float32 here",
            cfg.dtype,
        )
    revision = None if local else cfg.revision
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, padding_side="right", revision=revision)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=getattr(torch, cfg.dtype), revision=revision, attn_implementation=cfg.attn_implementation
        )
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
    model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id = (
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    )
    model.config.max_position_embeddings = min(
        cfg.max_seq_len, getattr(model.config, "max_position_embeddings", cfg.max_seq_len)
    )
    model.config.farmflow_gradient_checkpointing = cfg.gradient_checkpointing
    model.config.farmflow_attn_implementation = (
        cfg.attn_implementation
    )  # config.json does not keep it; every later load applies it
    model.config.farmflow_lora = (
        cfg.lora.model_dump() if cfg.lora else None
    )  # policy training applies it (runtime.adapt)
    return model, tokenizer


def _from_pretrained(cls, path: str | Path, **kwargs: Any):
    """`cls.from_pretrained(path)` with the attention kernel `model.attn_implementation` chose for the base model
    (recorded as farmflow_attn_implementation: Hugging Face's config.json does not keep it)."""
    config = Path(path) / "config.json"
    attn = json.loads(config.read_text()).get("farmflow_attn_implementation") if config.is_file() else None
    return for_compute(cls.from_pretrained(str(path), **({"attn_implementation": attn} if attn else {}), **kwargs))


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

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state
        return self.head(hidden).squeeze(-1).float()


def value_from_reward(path: str | Path) -> ValueModel:
    """Value model initialized from a reward model: its backbone, a fresh zero-initialized head."""
    reward = _from_pretrained(AutoModelForSequenceClassification, path)
    return ValueModel(reward.base_model, reward.config.hidden_size).to(default_device())


def value_from_policy(path: str | Path) -> ValueModel:
    """Value model initialized from a policy checkpoint: its transformer backbone without the LM head, a fresh
    zero-initialized value head."""
    from transformers import AutoModel

    backbone = _from_pretrained(AutoModel, path)
    return ValueModel(backbone, backbone.config.hidden_size).to(default_device())


def save(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, folder: str | Path) -> None:
    """`save_pretrained` of the model and tokenizer, by the main process only, in the model's stored dtype.

    A model computing in float32 over half-precision storage (upcast by `for_compute`, or float32 master weights
    mid-training: a snapshot) is saved in its stored dtype, as the same model saved after training would be; tied
    weights stay tied. A model trained under FSDP/DeepSpeed is saved from the full state dict `Runtime.finish`
    gathered, in its stored dtype. config.json records the dtype saved.
    """
    if not is_main_process():
        return
    state = model.__dict__.get(FULL_STATE)
    dtype = stored_dtype(model)
    if state is None and any(p.is_floating_point() and p.dtype != dtype for p in model.parameters()):
        state = cast_state(model.state_dict(), dtype)
    saved = state and next(v.dtype for v in state.values() if v.is_floating_point())
    model.save_pretrained(str(folder), safe_serialization=True, state_dict=state)  # empties `state` as it writes
    tokenizer.save_pretrained(str(folder))
    if saved:
        config = json.loads((Path(folder) / "config.json").read_text())
        config["dtype"] = str(saved).removeprefix("torch.")
        (Path(folder) / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------- optimization
def batch_order(n: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """Index batches for `steps` optimizer steps: reshuffled epochs, a batch never short.

    A pure function of its arguments, so a resumed loop replays exactly the batches an
    uninterrupted one would have seen from any step on. Linear in the indices drawn: a
    cursor walks the concatenated epochs (a batch that runs past an epoch's end takes the
    rest from the next one); each epoch is shuffled by the same `random.Random(seed)` stream.
    """
    rng = random.Random(seed)
    order: list[int] = []
    at, batches = 0, []
    for _ in range(steps):
        if len(order) - at < min(batch_size, n):  # refill with fresh shuffled epochs
            order = order[at:]
            at = 0
            while len(order) < min(batch_size, n):
                epoch = list(range(n))
                rng.shuffle(epoch)
                order += epoch
        batches.append(order[at : at + batch_size])
        at += batch_size
    return batches


def train_top_layers(model: torch.nn.Module, top: int, field: str = "train_layers") -> None:
    """Freeze `model`'s backbone except its top `top` transformer blocks and its final norm (in place).

    The embeddings and the lower blocks stop requiring gradients, so autograd's backward pass stops at the lowest
    trained block: a step costs a forward pass through every block and a backward pass through `top` of them, and the
    optimizer (`optimizer_and_schedule`) holds state for the trained parameters only. Heads outside the backbone (a
    reward model's `score`) keep training. `field` names the setting in the error raised when the model has no list
    of blocks or fewer than `top` of them.
    """
    base = model.base_model
    blocks = getattr(base, "layers", None)
    if blocks is None:
        blocks = getattr(base, "h", None)  # GPT-2 style
    if not isinstance(blocks, torch.nn.ModuleList):
        raise ValueError(f"{field}={top}: {type(base).__name__} has no list of transformer blocks to train the top of")
    if top > len(blocks):
        raise ValueError(f"{field}={top}: the backbone has {len(blocks)} transformer blocks")
    base.requires_grad_(False)
    for block in blocks[len(blocks) - top :]:
        block.requires_grad_(True)
    for name in ("norm", "ln_f"):  # the final norm reads the top block's output
        if isinstance(getattr(base, name, None), torch.nn.Module):
            getattr(base, name).requires_grad_(True)


def optimizer_and_schedule(
    model: torch.nn.Module,
    lr: float,
    weight_decay: float,
    total_steps: int,
    warmup_ratio: float,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable parameters with linear warmup and cosine decay to 0 (the paper's SFT/reward
    schedule)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)
    warmup = max(1, int(total_steps * warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


__all__ = [
    "BOS",
    "EOS",
    "FEATURES",
    "FeatureMemo",
    "IGNORE",
    "PAD",
    "SAMPLER_VERSION",
    "ValueModel",
    "batch_order",
    "build_policy",
    "decode_response",
    "encode_examples",
    "feature_dtype",
    "left_pad",
    "load_policy",
    "load_pretrained",
    "load_reward",
    "load_tokenizer",
    "next_token_rows",
    "optimizer_and_schedule",
    "pack_examples",
    "pack_pairs",
    "pack_shared",
    "pack_rows",
    "prompt_ids",
    "packed_reads",
    "reward_features",
    "reward_from_policy",
    "sample",
    "sample_ids",
    "sample_next",
    "sample_seed",
    "sample_uniforms",
    "save",
    "score",
    "tokenize_examples",
    "train_tokenizer",
    "train_top_layers",
    "value_from_policy",
    "value_from_reward",
]
