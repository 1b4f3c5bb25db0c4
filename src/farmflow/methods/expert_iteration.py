"""Expert iteration (AlpacaFarm Appendix A.2): best-of-n on the unlabeled split, then SFT on the selected outputs.

Round r (1-based) draws n samples per **unlabeled** instruction from the previous
round's policy (round 1: the SFT model), keeps the one the reward model scores highest
(`farmflow.methods.best_of_n.best_of_n`), and fine-tunes from the SFT initialization on
those (instruction, selected output) examples with the SFT loss
(`farmflow.methods.sft.sft_loss`). Each round restarts from the SFT weights, as the
paper's single round does, so rounds differ only in the policy that proposes samples.

Defaults (`ExpertIterationConfig`): one round, best-of-16 at temperature 1.0 on the whole
unlabeled split, then AlpacaFarm's expiter.sh SFT recipe (3 epochs, lr 2e-5, batch 128).
The two halves are separate stages (`best_of_n` with split "unlabeled", then
`expert_iteration`), so the expensive selection is cached on its own.
"""

from __future__ import annotations

from typing import Sequence

from farmflow.config import SFTConfig
from farmflow.methods.sft import train_sft
from farmflow.models.checkpoint import Checkpointer

VERSION = "1"


def train_expert_iteration(
    model,
    tokenizer,
    prompts: Sequence[str],
    selected: Sequence[str],
    cfg: SFTConfig,
    max_len: int,
    checkpointer: Checkpointer | None = None,
) -> dict[str, float]:
    """Fine-tune `model` (fresh SFT weights) in place on the best-of-n selections."""
    if not prompts:
        raise ValueError("expert_iteration: no selected outputs to learn from (is the unlabeled split empty?)")
    metrics = train_sft(model, tokenizer, prompts, selected, cfg, max_len, checkpointer, name="expert_iteration")
    return {**metrics, "examples": float(len(prompts))}
