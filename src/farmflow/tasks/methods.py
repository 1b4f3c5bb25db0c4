"""Stages of the methods that learn from the preferences directly or from reranked samples.

* ``best_of_n``: policy + reward model → the best of n samples per instruction of a split (eval: best-of-n's outputs;
  unlabeled: expert iteration's selections); ``best_of_n_prefix`` and ``best_of_n_rescore`` derive others from it.
* ``feedme``, ``reward_conditioning`` and any method whose `farmflow.config.METHODS` entry names a ``train``
  function: SFT model + preferences → policy (`trained_on_pairs_task`; reward conditioning's tokenizer gains the
  control tokens).
* ``reference_logps``: SFT model + preferences → per-pair log-probs of both outputs (DPO's reference).
* ``dpo``: SFT model + preferences + reference log-probs → policy.
* ``expert_iteration``: SFT model + best-of-n selections on the unlabeled split → policy.

PPO and Quark are in `farmflow.tasks.rl`. Every training stage takes an optional `checkpoints` (`CheckpointConfig`)
that is not part of its key: it only says how often the loop saves a resumable state.
"""

from __future__ import annotations

import importlib
from typing import Any, Literal

import pyarrow as pa
from prefect import Task

from farmflow.config import METHODS, BestOfNConfig, CheckpointConfig, DPOConfig, Method, SFTConfig
from farmflow.data import prompts_of, split_rows
from farmflow.generation import scored_candidates_vllm
from farmflow.progress import progress
from farmflow.storage import ArtifactRef, Store
from farmflow.storage.schemas import SCHEMAS
from farmflow.tasks.pipeline import outputs_table
from farmflow.tasks.registry import STAGES
from farmflow.tasks.stage import Model, StageRun, Table, stage_task

CANDIDATES = "candidates.parquet"
"""Every candidate best-of-n drew and its reward (schema ``candidates``), beside the chosen outputs."""


def train_pairs(run: StageRun, preferences: ArtifactRef) -> list[dict]:
    """The PREF split's annotated pairs (val pairs stay held out for measurements)."""
    return split_rows(run.store.read_table(preferences), "pref")


# ------------------------------------------------------------------------- best-of-n
@stage_task(STAGES["best_of_n"])
def best_of_n_task(
    run: StageRun,
    config: dict,
    data: ArtifactRef,
    policy: ArtifactRef,
    reward: ArtifactRef,
    backend: Literal["hf", "vllm"] = "hf",
    batch_size: int = 64,
) -> Table:
    """Best of n policy samples per instruction of a split, chosen by the reward model.

    config: {"best_of_n": BestOfNConfig, "max_new_tokens": int, "split": "eval", "max_prompts": None}. The eval split
    gives best-of-n's evaluated outputs; the unlabeled split gives expert iteration's selections (`max_prompts` keeps
    the first ones only). `backend` (generation.backend) picks the sampler and `batch_size` (generation.batch_size) is
    the number of sequences per forward pass: options like `checkpoints`, not part of the key (each candidate has its
    own random stream, so the batch size does not change the samples).
    """
    cfg = BestOfNConfig.model_validate(config["best_of_n"])
    rows = split_rows(run.store.read_table(data), config.get("split", "eval"))[: config.get("max_prompts")]
    args = dict(
        n=cfg.n,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_new_tokens=config["max_new_tokens"],
        batch_size=batch_size,
        seed=cfg.seed,
    )
    if backend == "vllm":
        candidates, rewards = scored_candidates_vllm(
            run.store.model_dir(policy), run.store.model_dir(reward), prompts_of(rows), **args
        )
    else:
        from farmflow.methods.best_of_n import scored_candidates
        from farmflow.models import FEATURES, load_policy, load_reward

        model, tokenizer = load_policy(run.store.model_dir(policy))
        reward_model, reward_tokenizer = load_reward(run.store.model_dir(reward))
        candidates, rewards = scored_candidates(
            model, tokenizer, reward_model, reward_tokenizer, prompts_of(rows), **args, memo=FEATURES
        )
    every = [{"id": r["id"], "sample": j, "output": o} for r, c in zip(rows, candidates) for j, o in enumerate(c)]
    return scored_outputs(rows, every, cfg.n, cfg.n, rewards)


def read_candidates(store: Store, best_of_n: ArtifactRef, reader: str) -> tuple[list[dict], list[dict], int]:
    """A best-of-n artifact's output rows, its candidates (checked: as many per row, in row order), that count.
    `reader`: the stage reading them, for the error."""
    rows = store.read_table(best_of_n).to_pylist()
    every = store.read_table(best_of_n, CANDIDATES, "candidates").to_pylist()
    big = len(every) // max(1, len(rows))
    if (
        not rows
        or len(every) != big * len(rows)
        or any(c["id"] != r["id"] for i, r in enumerate(rows) for c in every[i * big : (i + 1) * big])
    ):
        raise ValueError(
            f"{reader}: {CANDIDATES} of {best_of_n.stage} {best_of_n.key} does not hold the same number of "
            "candidates per output row"
        )
    return rows, every, big


def scored_outputs(rows: list[dict], every: list[dict], big: int, n: int, rewards: list[float] | None = None) -> Table:
    """Best-of-n among each row's first n of `big` candidates; with all of them (n = big) the candidates are kept, with
    `rewards` when given (new scores), else their own."""
    from farmflow.methods.best_of_n import pick_best

    rewards = [c["reward"] for c in every] if rewards is None else rewards
    outs, scores = pick_best(
        [[c["output"] for c in every[i * big : (i + 1) * big]] for i in range(len(rows))], rewards, n=n
    )
    extra = (
        {
            CANDIDATES: (
                pa.Table.from_pylist([c | {"reward": r} for c, r in zip(every, rewards)], schema=SCHEMAS["candidates"]),
                "candidates",
            )
        }
        if n == big
        else {}
    )
    return Table(
        outputs_table(rows, outs, f"best_of_{n}", scores),
        "outputs",
        {"mean_reward": sum(scores) / max(1, len(scores))},
        extra_tables=extra,
    )


@stage_task(STAGES["best_of_n_prefix"])
def best_of_n_prefix_task(run: StageRun, config: dict, best_of_n: ArtifactRef, reward: ArtifactRef) -> Table:
    """Best-of-k from a best-of-N artifact's candidates, k ≤ N: no sampling, no scoring.

    Candidates nest across n (each has its own random stream), so the first k of best-of-N's
    candidates are exactly best-of-k's, and the reward model's favourite among them is
    best-of-k's output (`farmflow.methods.best_of_n.pick_best`). The over-optimization flow
    samples the largest n once and derives the others. config: {"n": k}. `reward` must be
    the reward model that scored the candidates (it is recorded, so the proxy reward of
    these outputs is reused rather than recomputed).
    """
    scored_by = run.store.record(best_of_n)["inputs"].get("reward")
    if scored_by != reward.key:
        raise ValueError(
            f"best_of_n_prefix: {best_of_n.stage} {best_of_n.key} was scored by reward model {scored_by}, "
            f"not {reward.key}"
        )
    rows, every, big = read_candidates(run.store, best_of_n, run.stage)
    if not 1 <= config["n"] <= big:
        raise ValueError(f"best_of_n_prefix: n={config['n']} must be between 1 and the artifact's n={big}")
    return scored_outputs(rows, every, big, config["n"])


@stage_task(STAGES["best_of_n_rescore"])
def best_of_n_rescore_task(
    run: StageRun, config: dict, best_of_n: ArtifactRef, reward: ArtifactRef, batch_size: int = 64
) -> Table:
    """The same candidates as a best-of-n artifact, scored and chosen by another reward model: no sampling.

    The over-optimization flow samples once for all labellers (the candidates depend only on
    the SFT model and the sampling settings). Keeps the candidates with the new rewards, so
    `best_of_n_prefix` works on it. config: {}. `batch_size` is an option (memory only).
    """
    from farmflow.models import FEATURES, load_reward, score

    rows, every, big = read_candidates(run.store, best_of_n, run.stage)
    model, tokenizer = load_reward(run.store.model_dir(reward))
    prompts = prompts_of(rows)
    with progress("best_of_n_rescore: score", len(every), unit="sample") as bar:
        rewards = score(
            model,
            tokenizer,
            [prompts[i // big] for i in range(len(every))],
            [c["output"] for c in every],
            batch_size=batch_size,
            progress=bar,
            memo=FEATURES,
        ).tolist()
    return scored_outputs(rows, every, big, big, rewards)


# --------------------------------------------------------------------- from preferences
def trained_on_pairs_task(method: Method) -> Task:
    """The stage task of a method `METHODS` wires alone (`Method.train`): its ``train`` function fine-tunes the SFT
    model on the PREF pairs, ``train(model, tokenizer, pairs, config, max_len, checkpointer) -> metrics``; the method
    module (and torch) is imported when the stage runs."""
    module = f"farmflow.methods.{method.name}"

    def stage(
        run: StageRun,
        config: Any,
        preferences: ArtifactRef,
        sft: ArtifactRef,
        checkpoints: CheckpointConfig | None = None,
    ) -> Model:
        from farmflow.models import load_policy

        train = getattr(importlib.import_module(module), method.train)
        model, tokenizer = load_policy(run.store.model_dir(sft))
        metrics = train(
            model,
            tokenizer,
            train_pairs(run, preferences),
            config,
            model.config.max_position_embeddings,
            run.checkpointer(checkpoints),
        )
        return Model(model, tokenizer, metrics)

    stage.__name__ = stage.__qualname__ = f"{method.name}_task"
    stage.__doc__ = f"{method.title}: fine-tune the SFT model on the PREF pairs ({module}.{method.train})."
    stage.__annotations__["config"] = method.section  # a GPU worker validates the JSON config into it
    return stage_task(STAGES[method.name])(stage)


TRAINED_ON_PAIRS: dict[str, Task] = {m.name: trained_on_pairs_task(m) for m in METHODS.values() if m.train}
"""Method name → the stage task made from its `METHODS` entry (binary FeedME, binary reward conditioning, ...)."""
feedme_task = TRAINED_ON_PAIRS["feedme"]
reward_conditioning_task = TRAINED_ON_PAIRS["reward_conditioning"]


@stage_task(STAGES["reference_logps"])
def reference_logps_task(
    run: StageRun, config: dict, preferences: ArtifactRef, sft: ArtifactRef, batch_size: int = 64
) -> Table:
    """Log-probs of both outputs of every PREF pair under the frozen SFT policy.

    config: {} (the output depends only on the inputs). `batch_size` (pairs per forward
    pass) is an option: memory only, not part of the key.
    """
    from farmflow.methods.dpo import reference_logps
    from farmflow.models import load_policy

    rows = train_pairs(run, preferences)
    model, tokenizer = load_policy(run.store.model_dir(sft))
    l1, l2 = reference_logps(
        model,
        tokenizer,
        prompts_of(rows),
        [r["output_1"] for r in rows],
        [r["output_2"] for r in rows],
        model.config.max_position_embeddings,
        batch_size,
    )
    return Table(pa.table({"id": [r["id"] for r in rows], "logp_1": l1, "logp_2": l2}), "logps")


@stage_task(STAGES["dpo"])
def dpo_task(
    run: StageRun,
    config: DPOConfig,
    preferences: ArtifactRef,
    sft: ArtifactRef,
    reference: ArtifactRef,
    checkpoints: CheckpointConfig | None = None,
) -> Model:
    """DPO from the SFT model on the PREF pairs, against the stored reference log-probs."""
    from farmflow.methods.dpo import train_dpo
    from farmflow.models import load_policy

    rows = train_pairs(run, preferences)
    ref = {r["id"]: r for r in run.store.read_table(reference).to_pylist()}
    missing = [r["id"] for r in rows if r["id"] not in ref]
    if missing:
        raise ValueError(
            f"dpo: reference log-probs {reference.key[:12]} lack {len(missing)} pair(s), e.g. {missing[0]!r}"
        )
    model, tokenizer = load_policy(run.store.model_dir(sft))
    metrics = train_dpo(
        model,
        tokenizer,
        prompts_of(rows),
        [r["output_1"] for r in rows],
        [r["output_2"] for r in rows],
        [r["preference"] for r in rows],
        [ref[r["id"]]["logp_1"] for r in rows],
        [ref[r["id"]]["logp_2"] for r in rows],
        config,
        model.config.max_position_embeddings,
        run.checkpointer(checkpoints),
    )
    return Model(model, tokenizer, metrics)


@stage_task(STAGES["expert_iteration"])
def expert_iteration_task(
    run: StageRun,
    config: SFTConfig,
    sft: ArtifactRef,
    selections: ArtifactRef,
    checkpoints: CheckpointConfig | None = None,
) -> Model:
    """Fine-tune from the SFT initialization on best-of-n selections (an ``outputs`` table of the unlabeled split)."""
    from farmflow.methods.expert_iteration import train_expert_iteration
    from farmflow.models import load_policy

    rows = run.store.read_table(selections).to_pylist()
    model, tokenizer = load_policy(run.store.model_dir(sft))
    metrics = train_expert_iteration(
        model,
        tokenizer,
        prompts_of(rows),
        [r["output"] for r in rows],
        config,
        model.config.max_position_embeddings,
        run.checkpointer(checkpoints),
    )
    return Model(model, tokenizer, metrics)
