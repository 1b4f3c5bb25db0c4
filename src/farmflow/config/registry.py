"""The one table of methods: `METHODS`, read by everything that lists, configures, runs, deploys or documents them.

Each `Method` entry gives a method's config section (`FarmConfig` builds its fields from the table), its stages and
whether they load a model (the default ``execution.gpu_stages``), what it learns from (which shared upstream stages it
needs, and its family on the leaderboard plot), its flow's summary (one flow and one deployment per method, named with
hyphens) and its row of the docs' methods table (`methods_table`). `farmflow.tasks.registry` and
`farmflow.flows` derive their stages, tasks, flows and choices from it; the CLI checks names against it without
importing Prefect or torch.

A method that trains a policy from the SFT model on the annotated PREF pairs names its training function (`train`):
the stage, its Prefect task and its flow's wiring are then made from this entry alone (`farmflow.tasks.methods`,
`farmflow.flows.pipeline.method_outputs`). A method with other inputs (DPO's reference log-probs, PPO's value model)
declares its stages in `farmflow.tasks.registry` and its wiring in `farmflow.flows.pipeline`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from farmflow.config.base import Section
from farmflow.config.methods import (
    BestOfNConfig,
    DPOConfig,
    ExpertIterationConfig,
    PPOConfig,
    QuarkConfig,
    RewardConditioningConfig,
    SFTConfig,
)


@dataclass(frozen=True)
class Method:
    """One method: all farmflow needs to configure, run, deploy, list and document it."""

    name: str
    """Its config section (``FarmConfig.<name>``), module (``farmflow.methods.<name>``), main stage and leaderboard
    name; its flow and deployment use hyphens (``best-of-n``, ``best-of-n/farmflow``)."""
    title: str
    """What the docs call it."""
    section: type[Section]
    """Its config section's class; a farm starts from its defaults (the paper's settings)."""
    description: str
    """The section's description (the config reference and the run form's help)."""
    learns_from: Literal["preferences", "reward model"]
    """The annotated pairs, or the reward model trained on them: the shared upstream it needs, and its family on the
    leaderboard plot."""
    summary: str
    """What its flow runs (the flow's description in the Prefect UI)."""
    stages: tuple[str, ...] = ()
    """The stages it runs after the shared upstream, in order (with `train`: its own stage, then ``generate``)."""
    gpu: bool = True
    """Its stages load a model: they go to the GPU pool in distributed mode (``execution.gpu_stages``)."""
    train: str | None = None
    """The function in ``farmflow.methods.<name>`` that trains the SFT policy on the PREF pairs,
    ``train(model, tokenizer, pairs, config, max_len, checkpointer) -> metrics``; its stage (inputs: preferences,
    sft; version: the module's ``VERSION``) and its flow's wiring are made from this entry. None: the method's stages
    are declared in `farmflow.tasks.registry` and wired in `farmflow.flows.pipeline.method_outputs`."""
    control: str | None = None
    """With `train`: the section's field holding a control token that starts every prompt at generation."""

    def __post_init__(self) -> None:
        if self.train and not self.stages:
            object.__setattr__(self, "stages", (self.name, "generate"))

    @property
    def flow(self) -> str:
        """Its flow's name (and its deployment's flow): the name with hyphens."""
        return self.name.replace("_", "-")


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            "feedme",
            "binary FeedME",
            SFTConfig,
            "Binary FeedME: supervised fine-tuning from the SFT model on the preferred output of each pair "
            "(AlpacaFarm: the SFT recipe).",
            "preferences",
            "SFT → pairs → simulated preferences → binary FeedME (SFT on the preferred outputs), evaluated.",
            train="train_feedme",
        ),
        Method(
            "reward_conditioning",
            "binary reward conditioning",
            RewardConditioningConfig,
            "Binary reward conditioning: SFT on both outputs with a good/bad control token.",
            "preferences",
            "SFT → pairs → simulated preferences → binary reward conditioning (good/bad control tokens), evaluated.",
            train="train_reward_conditioning",
            control="good_token",
        ),
        Method(
            "dpo",
            "DPO",
            DPOConfig,
            "Direct preference optimization from the SFT model on the preference pairs.",
            "preferences",
            "SFT → pairs → simulated preferences → reference log-probs → DPO, evaluated.",
            ("reference_logps", "dpo", "generate"),
        ),
        Method(
            "best_of_n",
            "best-of-n",
            BestOfNConfig,
            "Best-of-n reranking with the reward model.",
            "reward model",
            "SFT → pairs → simulated preferences → reward model → best-of-n reranking, evaluated with the baselines.",
            ("best_of_n",),
        ),
        Method(
            "expert_iteration",
            "expert iteration",
            ExpertIterationConfig,
            "Expert iteration: SFT on the reward model's best-of-n outputs for the unlabeled split.",
            "reward model",
            "SFT → preferences → reward model → best-of-n on the unlabeled split → SFT on the selections, evaluated.",
            ("best_of_n", "expert_iteration", "generate"),
        ),
        Method(
            "ppo",
            "PPO",
            PPOConfig,
            "PPO from the SFT policy against the reward model (value model from the reward model).",
            "reward model",
            "SFT → preferences → reward model → PPO against it with a KL penalty to SFT, evaluated.",
            ("ppo", "generate"),
        ),
        Method(
            "quark",
            "Quark",
            QuarkConfig,
            "Quark (top-quantile variant) from the SFT policy with the reward model.",
            "reward model",
            "SFT → preferences → reward model → Quark (top-quantile variant), evaluated.",
            ("quark", "generate"),
        ),
    )
}
"""Method name → `Method`, in the order the compare flow (and `farmflow demo`) runs them and the docs list them."""

FLOW_NAMES = ("compare", *(m.flow for m in METHODS.values()))
"""The flows `farmflow run` runs (`farmflow.flows.FLOWS`): compare, then one per method."""


def methods_table() -> str:
    """The methods table of docs/methods.md (Markdown), one row per method after SFT's."""
    rows = [
        "| method | module | flow | learns from | stages after the shared upstream |",
        "|---|---|---|---|---|",
        "| SFT | `sft.py` | (every flow) | demonstrations | `sft` |",
    ]
    for m in METHODS.values():
        stages = " → ".join(f"`{s}`" for s in m.stages)
        rows.append(f"| {m.title} | `{m.name}.py` | `{m.flow}` | {m.learns_from} | {stages} |")
    return "\n".join(rows)
