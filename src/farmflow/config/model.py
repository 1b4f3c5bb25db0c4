"""The tokenizer and base model: a tiny Llama trained from scratch, or a pretrained causal LM (optionally with LoRA)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from farmflow.config.base import MAX_TOKENS, MAX_WIDTH, Section


class LoraConfig(Section):
    """Low-rank adapters (peft) for policy training on small GPUs; the saved policy is always the merged model."""

    r: int = Field(
        16,
        ge=1,
        le=MAX_WIDTH,
        description="Rank of each adapter (LoRA paper: 4-64; 16 is a common choice for 7B instruction tuning).",
    )
    alpha: float = Field(
        32.0, gt=0, description="Adapter scaling numerator: updates are scaled by alpha / r (commonly 2 x r)."
    )
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the adapter input during training.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Names of the linear layers that get adapters (Llama attention projections by default; add "
        "gate_proj, up_proj, down_proj for the MLP, or ['all-linear']).",
    )


class ModelConfig(Section):
    pretrained: str | None = Field(
        None,
        description="Start from this causal LM instead of training a tokenizer and a tiny model from scratch (None): a "
        "local folder, a model-cache name (`farmflow models get smollm2-135m-instruct`, `farmflow models import "
        "FILE.gguf --name NAME`; `farmflow models ls`) or a Hugging Face hub id; tokenizer from the same place. A "
        "folder or cache name is keyed by its files' contents. The size fields below then do not apply, except "
        "max_seq_len.",
    )
    revision: str | None = Field(
        None,
        description="Hub revision (commit, tag or branch) of `pretrained`; a commit pins the weights and so the stage "
        "keys. None: the newest, keyed by name only. (A local folder is keyed by its files' contents instead.)",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Weights dtype of a pretrained model, kept by every stage after it (bfloat16 on GPUs that have it; "
        "paper: bf16/fp32 mixed).",
    )
    attn_implementation: Literal["sdpa", "eager"] = Field(
        "sdpa", description="Attention kernel of a pretrained model (PyTorch SDPA or eager)."
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute activations in the backward pass of a pretrained model (less memory, ~30% more time); "
        "saved in its config.",
    )
    hidden_size: int = Field(128, ge=8, le=MAX_WIDTH, description="Width of the tiny Llama-style model.")
    num_layers: int = Field(4, ge=1, le=MAX_WIDTH, description="Transformer blocks.")
    num_heads: int = Field(4, ge=1, le=MAX_WIDTH, description="Attention heads (hidden_size must be divisible by it).")
    intermediate_size: int = Field(384, ge=8, le=MAX_WIDTH, description="MLP width.")
    max_seq_len: int = Field(
        160,
        ge=16,
        le=MAX_TOKENS,
        description="Longest prompt + response in tokens; longer sequences are truncated (also caps a pretrained "
        "model's context).",
    )
    vocab_size: int = Field(
        1024, ge=300, le=MAX_WIDTH, description="Size of the byte-level BPE vocabulary trained on the farm's text."
    )
    seed: int = Field(0, ge=0, description="Seed for weight initialization.")
    lora: LoraConfig | None = Field(
        None,
        description="Train policies through LoRA adapters (SFT, FeedME, reward conditioning, expert iteration, DPO, "
        "the PPO/Quark policy; not the reward or value model): less GPU memory, the saved checkpoint is the merged "
        "model. None: full fine-tuning (the paper). Recorded in the checkpoint's config, so every later "
        "policy-training stage applies it.",
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        return self
