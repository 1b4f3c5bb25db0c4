"""The whole farm: one section per stage, plus data, model, store and execution.

`FarmConfig`'s fields are the shared pipeline's sections (`_Upstream`), one section per method of
`farmflow.config.registry.METHODS` (``FarmConfig.dpo``: a `DPOConfig`, described by its entry), then generation,
evaluation, store, checkpoints and execution (`_Downstream`); so a method added to the table has its section.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, create_model

from farmflow.config.annotators import AnnotatorConfig
from farmflow.config.base import Section
from farmflow.config.data import DataConfig
from farmflow.config.evaluation import EvaluationConfig
from farmflow.config.execution import CheckpointConfig, ExecutionConfig, StoreConfig
from farmflow.config.methods import RewardConfig, SampleConfig, SFTConfig
from farmflow.config.model import ModelConfig
from farmflow.config.registry import METHODS


class _Upstream(Section):
    """The farm's sections before the methods' (field order is the run form's order)."""

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


class _Downstream(Section):
    """The farm's sections after the methods'."""

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


def _fields(section: type[Section]) -> dict[str, Any]:
    return {name: (f.annotation, f) for name, f in section.model_fields.items()}


FarmConfig = create_model(
    "FarmConfig",
    __base__=Section,
    __module__=__name__,
    __doc__="The whole farm: the shared pipeline's sections, one per method (`METHODS`), evaluation and execution.",
    **_fields(_Upstream),
    **{m.name: (m.section, Field(default_factory=m.section, description=m.description)) for m in METHODS.values()},
    **_fields(_Downstream),
)
