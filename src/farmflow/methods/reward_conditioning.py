"""Binary reward conditioning (AlpacaFarm Appendix A.1): SFT on both outputs of each pair, marked good or bad.

Every annotated pair (x, y_1, y_2, preference) becomes two supervised examples: the
preferred output conditioned on a positive control token and the other output
conditioned on a negative one, so the data set is twice the number of pairs. Training
is the SFT loss (`farmflow.methods.sft.sft_loss`) from the SFT model; at test time the
model is sampled with the positive token. Ties (1.5) are skipped.

Placement: AlpacaFarm prepends the token to the whole sequence. We put it at the end of
the prompt, right before the response, so the left-truncation of over-long prompts
(`farmflow.models.encode_examples`, `sample`) can never drop it; the model still sees
the token before every response token. `conditioned_prompts` is the one place that
decides this, for training and sampling alike.

The control tokens are added to the tokenizer as special tokens (never split, saved and
loaded with the tokenizer); their new input and output embeddings start at the mean of
the existing ones, so they begin as an "average" token instead of random noise.

Defaults (`RewardConditioningConfig`): AlpacaFarm's SFT recipe (3 epochs, lr 2e-5, batch
128); tokens ``<|good|>`` and ``<|bad|>``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from farmflow.config import RewardConditioningConfig
from farmflow.data import prompts_of
from farmflow.methods.sft import train_sft
from farmflow.models.checkpoint import Checkpointer

VERSION = "1"


def conditioned_prompts(prompts: Sequence[str], token: str) -> list[str]:
    """Prompts carrying a control token (training and sampling use this one function)."""
    return [p + token for p in prompts]


def add_control_tokens(model, tokenizer, tokens: Sequence[str]) -> list[int]:
    """Add `tokens` as special tokens; new embedding rows = mean of the old ones. Returns their ids."""
    old = len(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)}, replace_extra_special_tokens=False)
    ids = tokenizer.convert_tokens_to_ids(list(tokens))
    if len(tokenizer) > old:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        with torch.no_grad():
            for emb in {
                id(m): m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
            }.values():
                emb.weight[old:] = emb.weight[:old].mean(dim=0, keepdim=True)
    return ids


def conditioned_examples(rows: Sequence[dict], good: str, bad: str) -> tuple[list[str], list[str]]:
    """Two examples per non-tied pair: (prompt + good, preferred) and (prompt + bad, other)."""
    prompts, responses = [], []
    for r, prompt in zip(rows, prompts_of(list(rows))):
        if r["preference"] is None or r["preference"] == 1.5:
            continue
        chosen, rejected = (r["output_2"], r["output_1"]) if r["preference"] > 1.5 else (r["output_1"], r["output_2"])
        prompts += [prompt + good, prompt + bad]
        responses += [chosen, rejected]
    return prompts, responses


def train_reward_conditioning(
    model,
    tokenizer,
    rows: Sequence[dict],
    cfg: RewardConditioningConfig,
    max_len: int,
    checkpointer: Checkpointer | None = None,
) -> dict[str, float]:
    """Add the control tokens to `model`/`tokenizer` and fine-tune on both outputs of every pair."""
    add_control_tokens(model, tokenizer, [cfg.good_token, cfg.bad_token])
    prompts, responses = conditioned_examples(rows, cfg.good_token, cfg.bad_token)
    if not prompts:
        raise ValueError("reward_conditioning: no pair with a preference other than a tie to learn from")
    metrics = train_sft(
        model, tokenizer, prompts, responses, cfg.train, max_len, checkpointer, name="reward_conditioning"
    )
    return {**metrics, "examples": float(len(prompts))}
