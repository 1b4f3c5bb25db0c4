"""Best-of-n (AlpacaFarm Appendix A.2): sample n outputs per prompt, keep the one the reward model likes best.

No training: optimization pressure comes from n alone (AlpacaFarm reranks n=1024 samples
drawn at temperature 1.0; `farmflow.config.BestOfNConfig`). Sampling prefills each prompt
once and repeats its KV cache n times (`farmflow.models.sample`). Candidate j of a prompt
has its own random stream, so the candidates nest across n: best-of-4 reranks best-of-2's
two candidates plus two more, and a curve over n compares the same samples (paired), with
the proxy reward non-decreasing in n. `pick_best(..., n=k)` on best-of-N's candidates is
therefore exactly best-of-k for any k ≤ N (the over-optimization flow samples once).
"""

from __future__ import annotations

from typing import Sequence

from farmflow.models import FeatureMemo, sample, score
from farmflow.progress import progress

VERSION = "2"  # 2: the artifact keeps every candidate and its reward (candidates.parquet)


def pick_best(
    candidates: Sequence[Sequence[str]], rewards: Sequence[float], n: int | None = None
) -> tuple[list[str], list[float]]:
    """Per prompt, the candidate with the highest reward among its first `n` (all when None), the first on ties.

    `rewards` is flat, prompt-major (one per candidate).
    """
    total = sum(len(c) for c in candidates)
    if total != len(rewards):
        raise ValueError(f"pick_best: {len(rewards)} rewards for {total} candidates")
    best, best_r, k = [], [], 0
    for cands in candidates:
        m = len(cands) if n is None else n
        if not 1 <= m <= len(cands):
            raise ValueError(f"pick_best: n={n} but a prompt has {len(cands)} candidates")
        chunk = rewards[k : k + m]
        j = max(range(m), key=chunk.__getitem__)
        best.append(cands[j])
        best_r.append(chunk[j])
        k += len(cands)
    return best, best_r


def scored_candidates(
    policy,
    policy_tokenizer,
    reward_model,
    reward_tokenizer,
    prompts: Sequence[str],
    *,
    n: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    batch_size: int,
    seed: int,
    memo: FeatureMemo | None = None,
) -> tuple[list[list[str]], list[float]]:
    """n samples per prompt and the reward of each (flat, prompt-major); each distinct sample of a prompt is scored
    once (`farmflow.models.score`, which takes the `memo`)."""
    with progress("best_of_n: sample", len(prompts), unit="prompt") as bar:
        candidates = sample(
            policy,
            policy_tokenizer,
            prompts,
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            batch_size=max(1, batch_size // n),
            seed=seed,
            progress=bar.update,
        )
    flat_prompts = [p for p, c in zip(prompts, candidates) for _ in c]
    flat_outputs = [o for c in candidates for o in c]
    with progress("best_of_n: score", len(flat_outputs), unit="sample") as bar:
        rewards = score(
            reward_model,
            reward_tokenizer,
            flat_prompts,
            flat_outputs,
            batch_size=batch_size,
            progress=bar,
            memo=memo,
        ).tolist()
    return candidates, rewards


def best_of_n(
    policy, policy_tokenizer, reward_model, reward_tokenizer, prompts: Sequence[str], **kwargs
) -> tuple[list[str], list[float]]:
    """The highest-reward of n samples for each prompt, and its reward (keyword arguments: `scored_candidates`)."""
    return pick_best(*scored_candidates(policy, policy_tokenizer, reward_model, reward_tokenizer, prompts, **kwargs))
