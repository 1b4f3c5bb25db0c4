"""The training and sampling sections: SFT, sampling, the reward model and each method's (defaults: the paper's).

Which methods there are, and which section each one reads, is `farmflow.config.registry.METHODS`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from farmflow.config.base import MAX_BATCH, MAX_EPOCHS, MAX_ROWS, MAX_SAMPLES, MAX_TOKENS, Section
from farmflow.config.model import ModelConfig


class SFTConfig(Section):
    epochs: float = Field(3.0, gt=0, le=MAX_EPOCHS, description="Passes over the SFT split (paper: 3 epochs).")
    batch_size: int = Field(
        128, ge=1, le=MAX_BATCH, description="Sequences per optimizer step (Alpaca/AlpacaFarm recipe: 128)."
    )
    lr: float = Field(
        2e-5, gt=0, description="Peak AdamW learning rate (paper: 2e-5 for LLaMA-7B; tiny models need ~1e-3)."
    )
    warmup_ratio: float = Field(
        0.03, ge=0, lt=1, description="Fraction of steps with linear warmup; cosine decay after (paper: 0.03)."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay (paper: 0).")
    seed: int = Field(0, ge=0, description="Seed for data order.")
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        le=MAX_BATCH,
        json_schema_extra={"stage_key": False},
        description="Sequences per forward pass (per process); gradients of the micro-batches accumulate into one "
        "optimizer step of batch_size, so results equal the unaccumulated run up to float rounding (memory only; None: "
        "the whole batch at once). Not part of the stage key.",
    )
    packing: bool = Field(
        False,
        json_schema_extra={"stage_key": False},
        description="Pack each micro-batch's examples end to end into rows of up to the model's max_seq_len tokens "
        "(position ids restart at every example, attention stays inside it) instead of padding each to the longest: "
        "fewer padding tokens, the same loss up to float rounding. Needs an attention kernel that reads packed "
        "position ids (sdpa and eager build a block-diagonal mask from them). Not part of the stage key.",
    )
    snapshot_epochs: tuple[float, ...] = Field(
        (),
        json_schema_extra={"stage_key": False},
        description="The sft stage also commits the policy after each of these epochs (each between 0 and epochs) as "
        "an 'sft_snapshot' artifact: the validation study's shorter-trained SFT baselines, from the one run. Not part "
        "of the stage key: a committed SFT run without these snapshots is trained again with the same seed to add "
        "them. The other stages that train with this section (FeedME, reward conditioning, expert iteration) "
        "commit none.",
    )

    @model_validator(mode="after")
    def _snapshots_inside(self) -> "SFTConfig":
        outside = [e for e in self.snapshot_epochs if not 0 < e < self.epochs]
        if outside:
            raise ValueError(f"snapshot_epochs must lie between 0 and epochs ({self.epochs:g}), got {outside}")
        return self


class SampleConfig(Section):
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature (paper: 1.0 for pairs and reranking, 0.7 for evaluation)."
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    max_new_tokens: int = Field(48, ge=1, le=MAX_TOKENS, description="Longest generated response in tokens.")
    batch_size: int = Field(
        64,
        ge=1,
        le=MAX_BATCH,
        json_schema_extra={"stage_key": False},
        description="Prompts per generation batch (memory and speed only: each sample has its own random stream, so "
        "the samples do not depend on it; not part of the stage key).",
    )
    seed: int = Field(0, ge=0, description="Seed of the sampling generator.")
    backend: Literal["hf", "vllm"] = Field(
        "hf",
        json_schema_extra={"stage_key": False},
        description="Sampler: 'hf' (farmflow's batched KV-cache sampler on the transformers model) or 'vllm' (needs "
        "`pip install vllm` where the stage runs; see farmflow.generation). Same outputs schema, but vLLM's samples "
        "differ from hf's for the same seed. Operational: not part of the stage key, so an artifact sampled by either "
        "backend is reused.",
    )


class RewardBackboneConfig(Section):
    """A reward model of its own size: a base model fine-tuned on the SFT split like the policy, then given the
    reward head, instead of the SFT policy itself (AlpacaFarm initializes the reward model from the SFT model)."""

    model: ModelConfig = Field(
        description="The backbone's base model: a tiny Llama of these sizes trained from scratch (its tokenizer is "
        "trained on the same text with the same vocab_size, so it is the policy's), or `pretrained`."
    )
    sft: SFTConfig | None = Field(
        None,
        description="How the backbone is fine-tuned on the SFT split's demonstrations (None: the farm's `sft` "
        "section, without its snapshots).",
    )
    fine_tune: bool = Field(
        True,
        json_schema_extra={"stage_key": "unless_default"},
        description="Fine-tune the backbone on the SFT split before it gets the reward head (False: the pretrained "
        "model as it is, such as an instruct model that already follows instructions; needs `model.pretrained`).",
    )

    @model_validator(mode="after")
    def _as_is_needs_a_pretrained_model(self) -> "RewardBackboneConfig":
        if not self.fine_tune and not self.model.pretrained:
            raise ValueError("fine_tune=False needs model.pretrained: a model trained from scratch starts random")
        if not self.fine_tune and self.sft is not None:
            raise ValueError("sft is set but fine_tune=False: the backbone is not fine-tuned, so drop one of them")
        return self


class RewardConfig(Section):
    epochs: float = Field(1.0, gt=0, le=MAX_EPOCHS, description="Passes over the preference pairs (paper: 1 epoch).")
    batch_size: int = Field(16, ge=1, le=MAX_BATCH, description="Pairs per optimizer step (AlpacaFarm: 16).")
    lr: float = Field(
        3e-6, gt=0, description="Peak AdamW learning rate (AlpacaFarm: 3e-6 for LLaMA-7B; tiny models need ~3e-4)."
    )
    warmup_ratio: float = Field(
        0.03, ge=0, lt=1, description="Fraction of steps with linear warmup; cosine decay after (AlpacaFarm: 0.03)."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay (AlpacaFarm: 0).")
    seed: int = Field(0, ge=0, description="Seed for data order and the fresh scalar head.")
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        le=MAX_BATCH,
        json_schema_extra={"stage_key": False},
        description="Pairs per forward pass (per process); gradients of the micro-batches accumulate into one "
        "optimizer step of batch_size, so results equal the unaccumulated run up to float rounding (memory only; None: "
        "the whole batch at once). Not part of the stage key.",
    )
    packing: bool = Field(
        False,
        json_schema_extra={"stage_key": False},
        description="Read each micro-batch's pairs in one packed forward pass: a pair's prompt once, both outputs "
        "after it (the second attending to the prompt and itself only, a 4D attention mask), several pairs to a row "
        "of up to twice the model's max_seq_len, instead of two right-padded rows per pair: fewer positions, the same "
        "rewards and gradients up to float rounding (sdpa and eager attention). The model records it and scores packed "
        "too (best-of-n's candidates after one copy of their prompt). Not part of the stage key.",
    )
    eval_every: int = Field(
        0,
        ge=0,
        json_schema_extra={"stage_key": "unless_default"},
        description="Optimizer steps between accuracy measurements on the val pairs during training, kept in the "
        "stage's metrics (0: once, after training; AlpacaFarm's script measures every 10 steps).",
    )
    select: Literal["last", "best_val"] = Field(
        "last",
        json_schema_extra={"stage_key": "unless_default"},
        description="Which weights the stage keeps: 'last', the final ones (AlpacaFarm), or 'best_val', those of the "
        "measurement every eval_every steps with the highest accuracy against the val pairs' own labels (never gold: "
        "what a researcher without gold can select on), as Hugging Face's load_best_model_at_end.",
    )

    train_backbone: bool = Field(
        True,
        json_schema_extra={"stage_key": "unless_default"},
        description="Train the whole model (AlpacaFarm). False: the backbone stays frozen and only the scalar head "
        "trains, on what it reads (the last hidden state at each output's closing </s>), computed once before the "
        "first step: one forward pass per output instead of a forward and a backward pass per output and epoch, so a "
        "large pretrained backbone is affordable on a CPU (a linear probe: it learns what the backbone's features "
        "already separate; many cheap epochs and a higher lr, ~1e-3, suit it). One process; no checkpoints (a "
        "restart recomputes the features).",
    )
    train_layers: int | None = Field(
        None,
        ge=1,
        json_schema_extra={"stage_key": "unless_default"},
        description="With train_backbone=True, train only the backbone's top this many transformer blocks (and its "
        "final norm) with the head; the embeddings and lower blocks stay as initialized. Each step still reads every "
        "block forward, but the backward pass stops at the lowest trained block and the optimizer holds state for the "
        "trained blocks only (SmolLM2-135M, top 4 of 30 blocks: BENCHMARKS.md). None: every block (AlpacaFarm). "
        "Between a frozen backbone's linear probe and full fine-tuning; one process or DDP (not FSDP/DeepSpeed).",
    )
    feature_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        json_schema_extra={"stage_key": "unless_default"},
        description="Precision a frozen backbone (train_backbone=False) reads its features in, when training the head "
        "and whenever the reward model scores later (recorded in its config.json). bfloat16 runs the backbone under "
        "autocast: SmolLM2-135M reads 2.7x faster on a 2-core CPU with avx512_bf16 (BENCHMARKS.md), its features "
        "within about 2% of float32's; slower than float32 on CPUs without native bfloat16. The head trains and "
        "scores in float32, so rewards are not rounded to bfloat16.",
    )
    backbone: RewardBackboneConfig | None = Field(
        None,
        json_schema_extra={"stage_key": "unless_default"},
        description="Start the reward model from a backbone of its own (a larger model, or a pretrained one) "
        "instead of the SFT policy (None: the SFT policy, as AlpacaFarm). PPO's value model reads the policy's tokens: "
        "with a backbone of another tokenizer, start it from the policy (ppo.value_from='policy').",
    )

    @model_validator(mode="after")
    def _selection_needs_measurements(self) -> "RewardConfig":
        if self.select == "best_val" and self.eval_every == 0:
            raise ValueError("select='best_val' needs eval_every > 0 (the steps between val measurements)")
        if self.train_layers is not None and not self.train_backbone:
            raise ValueError(
                "train_layers needs train_backbone=True: it is how many of the backbone's top blocks train"
            )
        if self.feature_dtype != "float32" and self.train_backbone:
            raise ValueError(
                f"feature_dtype={self.feature_dtype!r} needs train_backbone=False: it is the precision a frozen "
                "backbone's features are read in"
            )
        return self


class BestOfNConfig(Section):
    n: int = Field(
        16,
        ge=1,
        le=MAX_SAMPLES,
        description="Samples drawn per prompt and reranked by the reward model (paper: n=1024).",
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the candidates (paper: 1.0).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold for candidates.")
    seed: int = Field(0, ge=0, description="Seed of the candidate sampler.")


class RewardConditioningConfig(Section):
    train: SFTConfig = Field(
        default_factory=SFTConfig,
        description="Supervised fine-tuning from the SFT model on both outputs of every pair (AlpacaFarm: the SFT "
        "recipe, 3 epochs, lr 2e-5, batch 128).",
    )
    good_token: str = Field(
        "<|good|>",
        min_length=1,
        description="Control token prepended to the preferred output's sequence, and used when sampling.",
    )
    bad_token: str = Field(
        "<|bad|>", min_length=1, description="Control token prepended to the other output's sequence."
    )

    @model_validator(mode="after")
    def _distinct(self) -> "RewardConditioningConfig":
        if self.good_token == self.bad_token:
            raise ValueError("good_token and bad_token must differ")
        return self


class DPOConfig(Section):
    beta: float = Field(
        0.1,
        gt=0,
        description="Strength of the implicit KL constraint to the SFT (reference) policy (DPO paper and AlpacaFarm: "
        "0.1).",
    )
    epochs: float = Field(
        2.0, gt=0, le=MAX_EPOCHS, description="Passes over the preference pairs (AlpacaFarm dpo.sh: 2 epochs)."
    )
    batch_size: int = Field(
        128,
        ge=1,
        le=MAX_BATCH,
        description="Pairs per optimizer step (AlpacaFarm dpo.sh: 8 GPUs x 1 x 16 accumulation = 128).",
    )
    lr: float = Field(1e-6, gt=0, description="Peak AdamW learning rate (AlpacaFarm dpo.sh: 1e-6 for LLaMA-7B).")
    warmup_ratio: float = Field(
        0.03, ge=0, lt=1, description="Fraction of steps with linear warmup; cosine decay after (AlpacaFarm: 0.03)."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay (AlpacaFarm: 0).")
    seed: int = Field(0, ge=0, description="Seed for data order.")
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        le=MAX_BATCH,
        json_schema_extra={"stage_key": False},
        description="Pairs per forward pass (per process); gradients of the micro-batches accumulate into one "
        "optimizer step of batch_size, so results equal the unaccumulated run up to float rounding (memory only; None: "
        "the whole batch at once). Not part of the stage key.",
    )


class ExpertIterationConfig(Section):
    rounds: int = Field(
        1,
        ge=1,
        le=MAX_EPOCHS,
        description="Rounds of (best-of-n on the unlabeled split, then SFT); round r samples from round r-1's policy "
        "(paper: 1 round).",
    )
    n: int = Field(
        16,
        ge=1,
        le=MAX_SAMPLES,
        description="Samples per unlabeled instruction, the reward model keeps the best (paper: best-of-16).",
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the candidates (paper: 1.0).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold for candidates.")
    max_prompts: int | None = Field(
        None,
        ge=1,
        le=MAX_ROWS,
        description="Use only this many unlabeled instructions (None: the whole split, as the paper).",
    )
    train: SFTConfig = Field(
        default_factory=SFTConfig,
        description="Fine-tuning from the SFT initialization on the selected outputs (AlpacaFarm expiter.sh: 3 epochs, "
        "lr 2e-5, batch 128).",
    )
    seed: int = Field(0, ge=0, description="Seed of the candidate sampler.")


class PPOConfig(Section):
    """PPO from the SFT policy against the reward model (AlpacaFarm Appendix B; alpaca_farm rl/ppo_utils.py)."""

    epochs: float = Field(
        10.0,
        gt=0,
        le=MAX_EPOCHS,
        description="Passes over the unlabeled prompts; steps = epochs x prompts / rollout_batch_size (alpaca_farm "
        "rlhf_ppo.sh: total_epochs 10).",
    )
    rollout_batch_size: int = Field(
        512,
        ge=1,
        le=MAX_BATCH,
        description="Prompts sampled per PPO step, one response each (paper Appendix B: 512). On several processes "
        "each samples an equal share: it must divide by their number.",
    )
    step_batch_size: int = Field(
        256,
        ge=1,
        le=MAX_BATCH,
        description="Rollouts per optimizer step; each PPO step makes ppo_epochs x rollout/step optimizer steps "
        "(paper: 256). On several processes each contributes an equal share: it must divide by their number.",
    )
    ppo_epochs: int = Field(
        2,
        ge=1,
        le=MAX_EPOCHS,
        description="Passes over each rollout batch (paper: 2 epochs per step; alpaca_farm noptepochs).",
    )
    micro_batch_size: int = Field(
        32,
        ge=1,
        le=MAX_BATCH,
        json_schema_extra={"stage_key": False},
        description="Prompts per sampling batch, sequences per forward pass when scoring rollouts and per "
        "gradient-accumulation chunk (memory only: not part of the stage key).",
    )
    lr: float = Field(
        1e-5,
        gt=0,
        description="Peak AdamW learning rate for policy and value model (paper Appendix B: 1e-5; the released "
        "rlhf_ppo.sh uses 3e-6).",
    )
    warmup_steps: int = Field(
        5,
        ge=0,
        le=MAX_EPOCHS,
        description="PPO steps of linear warmup, then linear decay to 0 (alpaca_farm rlhf_ppo.sh: 5; transformers' "
        "linear schedule).",
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay (alpaca_farm: 0).")
    adam_eps: float = Field(
        1e-5, gt=0, description="AdamW epsilon (alpaca_farm: 1e-5, the OpenAI PPO default, not PyTorch's 1e-8)."
    )
    max_grad_norm: float = Field(
        1.0,
        gt=0,
        description="Gradient norm clipping over policy and value parameters (alpaca_farm: transformers' default 1.0).",
    )
    kl_coef: float = Field(
        0.02,
        ge=0,
        description="Fixed coefficient of the per-token KL penalty against the frozen SFT policy (alpaca_farm "
        "rlhf_ppo.sh: 0.02).",
    )
    temperature: float = Field(
        1.0,
        gt=0,
        description="Sampling temperature of rollouts; log-probs are computed at the same temperature (paper: 1.0).",
    )
    max_new_tokens: int = Field(
        300, ge=1, le=MAX_TOKENS, description="Longest response in tokens (alpaca_farm response_len: 300)."
    )
    penalty_reward_value: float | None = Field(
        -1.0,
        description="Reward given instead of the reward model's score to responses that never emit EOS (alpaca_farm "
        "penalty_reward_value: -1; None: no penalty).",
    )
    whiten_rewards: bool = Field(
        True,
        description="Whiten the shaped per-token rewards over the rollout batch before GAE, keeping their mean "
        "(alpaca_farm: True).",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount of GAE (paper: 1).")
    lam: float = Field(1.0, ge=0, le=1, description="Lambda of GAE (paper: 1).")
    clip_range: float = Field(0.2, gt=0, description="Clip range of the policy ratio (alpaca_farm cliprange: 0.2).")
    clip_range_value: float = Field(
        0.2,
        gt=0,
        description="Clip range of value predictions around the rollout's values (alpaca_farm cliprange_value: 0.2).",
    )
    vf_coef: float = Field(
        0.1, ge=0, description="Weight of the value loss in the total loss (alpaca_farm vf_coef: 0.1)."
    )
    value_from: Literal["reward", "policy"] = Field(
        "reward",
        json_schema_extra={"stage_key": "unless_default"},
        description="What the value model starts from, with a fresh zero-initialized head: 'reward', the reward "
        "model's backbone (alpaca_farm), or 'policy', the SFT policy's. The value model reads the policy's tokens, so "
        "a reward model on a backbone with another tokenizer (reward.backbone, e.g. a pretrained one) needs 'policy'.",
    )
    snapshot_every: int = Field(
        0,
        ge=0,
        json_schema_extra={"stage_key": False},
        description="Also commit the policy every this many PPO steps as a 'ppo_snapshot' artifact, for "
        "over-optimization curves (0: off). Not part of PPO's key: a committed PPO run without these snapshots is "
        "trained again with the same seed to add them, and the over-optimization flow's PPO is the comparison's.",
    )
    seed: int = Field(0, ge=0, description="Seed for prompt order, rollout sampling and minibatch order.")


class QuarkConfig(Section):
    """Quark, top-quantile variant (AlpacaFarm §3.4 and Appendix B; alpaca_farm rl/quark_trainer.py)."""

    epochs: float = Field(
        10.0,
        gt=0,
        le=MAX_EPOCHS,
        description="Passes over the unlabeled prompts; steps = epochs x prompts / rollout_batch_size (alpaca_farm "
        "rlhf_quark.sh: total_epochs 10).",
    )
    rollout_batch_size: int = Field(
        512,
        ge=1,
        le=MAX_BATCH,
        description="Prompts sampled and scored per Quark step; the pool is reset to these every step (paper: 512). On "
        "several processes each samples an equal share: it must divide by their number.",
    )
    step_batch_size: int = Field(
        256,
        ge=1,
        le=MAX_BATCH,
        description="Top-quantile samples per optimizer step, cycled when the quantile is smaller (paper: 256).",
    )
    grad_steps_per_rollout: int = Field(
        1, ge=1, le=MAX_EPOCHS, description="Optimizer steps per rollout (alpaca_farm num_gradient_steps_per_step: 1)."
    )
    micro_batch_size: int = Field(
        32,
        ge=1,
        le=MAX_BATCH,
        json_schema_extra={"stage_key": False},
        description="Prompts per sampling batch, sequences per forward pass / gradient-accumulation chunk (memory "
        "only: not part of the stage key).",
    )
    num_quantiles: int = Field(
        5,
        ge=1,
        le=MAX_BATCH,
        description="Reward quantiles the rollout is split into; only the best one is trained on (Quark, Lu et al. "
        "2022: 5 quantiles; top-quantile variant).",
    )
    lr: float = Field(3e-6, gt=0, description="Peak AdamW learning rate (alpaca_farm rlhf_quark.sh: 3e-6).")
    warmup_steps: int = Field(
        5,
        ge=0,
        le=MAX_EPOCHS,
        description="Steps of linear warmup, then linear decay to 0 (alpaca_farm rlhf_quark.sh: 5).",
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay (alpaca_farm: 0).")
    adam_eps: float = Field(1e-5, gt=0, description="AdamW epsilon (alpaca_farm: 1e-5).")
    max_grad_norm: float = Field(
        1.0, gt=0, description="Gradient norm clipping (alpaca_farm: transformers' default 1.0)."
    )
    kl_coef: float = Field(
        0.05,
        ge=0,
        description="Coefficient of the per-token KL(policy || SFT) penalty (alpaca_farm rlhf_quark.sh: 0.05). No "
        "entropy term.",
    )
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature of rollouts and of the trained log-probs (paper: 1.0)."
    )
    max_new_tokens: int = Field(
        300, ge=1, le=MAX_TOKENS, description="Longest response in tokens (alpaca_farm response_len: 300)."
    )
    penalty_reward_value: float | None = Field(
        -1.0,
        description="Score given to responses that never emit EOS, so they rank last (the value PPO uses; "
        "alpaca_farm's Quark applies none: None).",
    )
    seed: int = Field(0, ge=0, description="Seed for prompt order, rollout sampling and minibatch order.")
