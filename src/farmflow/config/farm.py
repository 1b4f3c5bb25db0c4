"""The whole farm: one section per stage, plus data, model, store and execution."""

from __future__ import annotations

from pydantic import Field

from farmflow.config.annotators import AnnotatorConfig
from farmflow.config.base import Section
from farmflow.config.data import DataConfig
from farmflow.config.evaluation import EvaluationConfig
from farmflow.config.execution import CheckpointConfig, ExecutionConfig, StoreConfig
from farmflow.config.methods import (
    BestOfNConfig,
    DPOConfig,
    ExpertIterationConfig,
    PPOConfig,
    QuarkConfig,
    RewardConditioningConfig,
    RewardConfig,
    SampleConfig,
    SFTConfig,
)
from farmflow.config.model import ModelConfig


class FarmConfig(Section):
    name: str = Field(
        "custom", description="Name of the preset this config came from (informational; not part of any stage key)."
    )
    data: DataConfig = Field(default_factory=DataConfig, description="Instruction data and splits.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Tokenizer and base model.")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="Supervised fine-tuning on demonstrations.")
    pairs: SampleConfig = Field(
        default_factory=SampleConfig,
        description="Sampling two outputs per PREF/val instruction (paper: temperature 1.0).",
    )
    annotation: AnnotatorConfig = Field(
        default_factory=lambda: AnnotatorConfig(label_noise=0.5),
        description="Annotators that label the pairs (p_sim^ann: the pool plus 25% label flips).",
    )
    reward: RewardConfig = Field(
        default_factory=RewardConfig, description="Bradley-Terry reward model, initialized from SFT."
    )
    best_of_n: BestOfNConfig = Field(
        default_factory=BestOfNConfig, description="Best-of-n reranking with the reward model."
    )
    feedme: SFTConfig = Field(
        default_factory=SFTConfig,
        description="Binary FeedME: supervised fine-tuning from the SFT model on the preferred output of each pair "
        "(AlpacaFarm: the SFT recipe).",
    )
    reward_conditioning: RewardConditioningConfig = Field(
        default_factory=RewardConditioningConfig,
        description="Binary reward conditioning: SFT on both outputs with a good/bad control token.",
    )
    dpo: DPOConfig = Field(
        default_factory=DPOConfig,
        description="Direct preference optimization from the SFT model on the preference pairs.",
    )
    expert_iteration: ExpertIterationConfig = Field(
        default_factory=ExpertIterationConfig,
        description="Expert iteration: SFT on the reward model's best-of-n outputs for the unlabeled split.",
    )
    ppo: PPOConfig = Field(
        default_factory=PPOConfig,
        description="PPO from the SFT policy against the reward model (value model from the reward model).",
    )
    quark: QuarkConfig = Field(
        default_factory=QuarkConfig,
        description="Quark (top-quantile variant) from the SFT policy with the reward model.",
    )
    generation: SampleConfig = Field(
        default_factory=lambda: SampleConfig(temperature=0.7),
        description="Generation on the evaluation set (paper: temperature 0.7).",
    )
    evaluation: EvaluationConfig = Field(
        default_factory=EvaluationConfig, description="Win rate against the reference outputs."
    )
    store: StoreConfig = Field(default_factory=StoreConfig, description="Where artifacts are kept.")
    checkpoints: CheckpointConfig = Field(
        default_factory=CheckpointConfig,
        description="Periodic checkpoints of long loops (SFT, DPO, PPO, Quark...) in the store; a killed run resumes "
        "from the last. Not part of any stage key.",
    )
    execution: ExecutionConfig = Field(
        default_factory=ExecutionConfig,
        description="Where stages run: in this process (local) or GPU stages on a GPU work pool (distributed); "
        "parallel methods, retries.",
    )
