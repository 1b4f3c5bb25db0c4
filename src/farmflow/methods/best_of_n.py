"""Best-of-n: sample n outputs per prompt from the policy, keep the one the reward model likes best.

No training: optimization pressure comes from n alone (AlpacaFarm reranks n=1024 samples
drawn at temperature 1.0; `farmflow.config.BestOfNConfig`). Sampling prefills each prompt
once and repeats its KV cache n times (`farmflow.models.sample`). Candidate j of a prompt
has its own random stream, so the candidates nest across n: best-of-4 reranks best-of-2's
two candidates plus two more, and a curve over n compares the same samples (paired), with
the proxy reward non-decreasing in n.
"""

from __future__ import annotations

from typing import Sequence

from farmflow.models import sample, score
from farmflow.progress import progress

VERSION = "1"


def best_of_n(
    policy, policy_tokenizer, reward_model, reward_tokenizer, prompts: Sequence[str], *, n: int, temperature: float,
    top_p: float, max_new_tokens: int, batch_size: int, seed: int,
) -> tuple[list[str], list[float]]:
    """The highest-reward of n samples for each prompt, and its reward."""
    with progress("best_of_n: sample", len(prompts), unit="prompt") as bar:
        candidates = sample(
            policy, policy_tokenizer, prompts, n=n, temperature=temperature, top_p=top_p,
            max_new_tokens=max_new_tokens, batch_size=max(1, batch_size // n), seed=seed, progress=bar.update,
        )
    flat_prompts = [p for p, c in zip(prompts, candidates) for _ in c]
    flat_outputs = [o for c in candidates for o in c]
    with progress("best_of_n: score", len(flat_outputs), unit="sample") as bar:
        rewards = score(reward_model, reward_tokenizer, flat_prompts, flat_outputs, batch_size=batch_size, progress=bar.update).tolist()
    best, best_r = [], []
    for i in range(len(prompts)):
        chunk = rewards[i * n: (i + 1) * n]
        j = max(range(n), key=chunk.__getitem__)
        best.append(candidates[i][j])
        best_r.append(chunk[j])
    return best, best_r
