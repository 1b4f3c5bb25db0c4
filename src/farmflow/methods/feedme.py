"""Binary FeedME (AlpacaFarm Appendix A.1): supervised fine-tuning of the SFT model on the preferred outputs.

OpenAI's FeedME fine-tunes on outputs human labelers rated 7/7; AlpacaFarm's pairwise
adaptation keeps, for every annotated pair, the output the annotator preferred and runs
supervised fine-tuning on those (prompt, chosen output) examples starting from the SFT
model. The loss is the SFT loss (`farmflow.methods.sft.sft_loss`: cross-entropy on the
response tokens). Tied labels (preference 1.5) carry no choice and are skipped.

Defaults (`FarmConfig.feedme`, an `SFTConfig`) are AlpacaFarm's SFT recipe: 3 epochs,
AdamW lr 2e-5, 3% warmup then cosine, batch 128.
"""

from __future__ import annotations

from typing import Sequence

from farmflow.config import SFTConfig
from farmflow.data import prompts_of
from farmflow.methods.sft import train_sft
from farmflow.models.checkpoint import Checkpointer

VERSION = "1"


def chosen_examples(rows: Sequence[dict]) -> tuple[list[str], list[str]]:
    """(prompts, preferred outputs) of the annotated pairs; ties are left out."""
    kept = [r for r in rows if r["preference"] is not None and r["preference"] != 1.5]
    chosen = [r["output_2"] if r["preference"] > 1.5 else r["output_1"] for r in kept]
    return prompts_of(kept), chosen


def train_feedme(
    model,
    tokenizer,
    rows: Sequence[dict],
    cfg: SFTConfig,
    max_len: int,
    checkpointer: Checkpointer | None = None,
) -> dict[str, float]:
    """Fine-tune `model` (the SFT policy) in place on the preferred outputs of `rows`."""
    prompts, chosen = chosen_examples(rows)
    if not prompts:
        raise ValueError("feedme: no pair with a preference other than a tie to learn from")
    metrics = train_sft(model, tokenizer, prompts, chosen, cfg, max_len, checkpointer, name="feedme")
    return {**metrics, "examples": float(len(prompts))}
