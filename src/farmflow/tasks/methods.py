"""Stage tasks of the methods that learn from the preferences directly or from reranked samples.

* ``feedme``: SFT model + preferences → policy (binary FeedME).
* ``reward_conditioning``: SFT model + preferences → policy whose tokenizer has the control tokens.
* ``reference_logps``: SFT model + preferences → per-pair log-probs of both outputs (DPO's reference).
* ``dpo``: SFT model + preferences + reference log-probs → policy.
* ``expert_iteration``: SFT model + best-of-n selections on the unlabeled split → policy.

Best-of-n and the selections come from `best_of_n_task`; PPO and Quark from `farmflow.tasks.rl`.
Every training stage takes an optional `checkpoints` (`CheckpointConfig`) that is not
part of its key: it only says how often the loop saves a resumable state.
"""

from __future__ import annotations

import time

import pyarrow as pa

from farmflow.config import CheckpointConfig, DPOConfig, RewardConditioningConfig, SFTConfig
from farmflow.data import prompts_of, split_rows
from farmflow.methods import dpo, expert_iteration, feedme, reward_conditioning
from farmflow.models import load_policy
from farmflow.storage import ArtifactRef
from farmflow.tasks.core import checkpointer, commit_policy, log, lookup, stage_task


def _commit_policy(store, stage: str, key: str, model, tokenizer, config, inputs: dict, metrics: dict, started: float, ckpt) -> ArtifactRef:
    return commit_policy(store, stage, key, model, tokenizer, config, inputs, {**metrics, "seconds": time.perf_counter() - started}, ckpt)


def _train_pairs(store, preferences: ArtifactRef) -> list[dict]:
    """The PREF split's annotated pairs (val pairs stay held out for measurements)."""
    return split_rows(store.read_table(preferences), "pref")


@stage_task("feedme", version=feedme.VERSION)
def feedme_task(
    store_uri: str, config: SFTConfig, preferences: ArtifactRef, sft: ArtifactRef, checkpoints: CheckpointConfig | None = None,
) -> ArtifactRef:
    """Binary FeedME: fine-tune the SFT model on the preferred output of each PREF pair."""
    store, key, hit = lookup("feedme", store_uri, config, preferences=preferences, sft=sft)
    if hit:
        return hit
    started, ckpt = time.perf_counter(), checkpointer(store, "feedme", key, checkpoints)
    model, tokenizer = load_policy(store.model_dir(sft))
    metrics = feedme.train_feedme(model, tokenizer, _train_pairs(store, preferences), config, model.config.max_position_embeddings, ckpt)
    log("feedme: %d examples, %d steps, loss %.3f -> %.3f", metrics["examples"], metrics["steps"], metrics["train_loss_first"], metrics["train_loss_last"])
    return _commit_policy(store, "feedme", key, model, tokenizer, config, {"preferences": preferences, "sft": sft}, metrics, started, ckpt)


@stage_task("reward_conditioning", version=reward_conditioning.VERSION)
def reward_conditioning_task(
    store_uri: str, config: RewardConditioningConfig, preferences: ArtifactRef, sft: ArtifactRef,
    checkpoints: CheckpointConfig | None = None,
) -> ArtifactRef:
    """Binary reward conditioning: SFT on both outputs of each PREF pair with good/bad control tokens."""
    store, key, hit = lookup("reward_conditioning", store_uri, config, preferences=preferences, sft=sft)
    if hit:
        return hit
    started, ckpt = time.perf_counter(), checkpointer(store, "reward_conditioning", key, checkpoints)
    model, tokenizer = load_policy(store.model_dir(sft))
    metrics = reward_conditioning.train_reward_conditioning(
        model, tokenizer, _train_pairs(store, preferences), config, model.config.max_position_embeddings, ckpt,
    )
    log("reward_conditioning: %d examples, loss %.3f -> %.3f", metrics["examples"], metrics["train_loss_first"], metrics["train_loss_last"])
    inputs = {"preferences": preferences, "sft": sft}
    return _commit_policy(store, "reward_conditioning", key, model, tokenizer, config, inputs, metrics, started, ckpt)


@stage_task("reference_logps", version=dpo.VERSION)
def reference_logps_task(store_uri: str, config: dict, preferences: ArtifactRef, sft: ArtifactRef, batch_size: int = 64) -> ArtifactRef:
    """Log-probs of both outputs of every PREF pair under the frozen SFT policy.

    config: {} (the output depends only on the inputs). `batch_size` (pairs per forward
    pass) is an option: memory only, not part of the key.
    """
    store, key, hit = lookup("reference_logps", store_uri, config, preferences=preferences, sft=sft)
    if hit:
        return hit
    rows = _train_pairs(store, preferences)
    model, tokenizer = load_policy(store.model_dir(sft))
    l1, l2 = dpo.reference_logps(model, tokenizer, prompts_of(rows), [r["output_1"] for r in rows], [r["output_2"] for r in rows],
                                 model.config.max_position_embeddings, batch_size)
    table = pa.table({"id": [r["id"] for r in rows], "logp_1": l1, "logp_2": l2})
    return store.put_table("reference_logps", key, table, "logps", config=config, inputs={"preferences": preferences, "sft": sft})


@stage_task("dpo", version=dpo.VERSION)
def dpo_task(
    store_uri: str, config: DPOConfig, preferences: ArtifactRef, sft: ArtifactRef, reference: ArtifactRef,
    checkpoints: CheckpointConfig | None = None,
) -> ArtifactRef:
    """DPO from the SFT model on the PREF pairs, against the stored reference log-probs."""
    store, key, hit = lookup("dpo", store_uri, config, preferences=preferences, sft=sft, reference=reference)
    if hit:
        return hit
    started, ckpt = time.perf_counter(), checkpointer(store, "dpo", key, checkpoints)
    rows = _train_pairs(store, preferences)
    ref = {r["id"]: r for r in store.read_table(reference).to_pylist()}
    missing = [r["id"] for r in rows if r["id"] not in ref]
    if missing:
        raise ValueError(f"dpo: reference log-probs {reference.key[:12]} lack {len(missing)} pair(s), e.g. {missing[0]!r}")
    model, tokenizer = load_policy(store.model_dir(sft))
    metrics = dpo.train_dpo(
        model, tokenizer, prompts_of(rows), [r["output_1"] for r in rows], [r["output_2"] for r in rows], [r["preference"] for r in rows],
        [ref[r["id"]]["logp_1"] for r in rows], [ref[r["id"]]["logp_2"] for r in rows], config, model.config.max_position_embeddings, ckpt,
    )
    log("dpo: %d pairs, loss %.3f -> %.3f, implicit reward accuracy %.2f -> %.2f", metrics["pairs"], metrics["train_loss_first"],
        metrics["train_loss_last"], metrics["implicit_reward_accuracy_first"], metrics["implicit_reward_accuracy_last"])
    inputs = {"preferences": preferences, "sft": sft, "reference": reference}
    return _commit_policy(store, "dpo", key, model, tokenizer, config, inputs, metrics, started, ckpt)


@stage_task("expert_iteration", version=expert_iteration.VERSION)
def expert_iteration_task(
    store_uri: str, config: SFTConfig, sft: ArtifactRef, selections: ArtifactRef, checkpoints: CheckpointConfig | None = None,
) -> ArtifactRef:
    """Fine-tune from the SFT initialization on best-of-n selections (an ``outputs`` table of the unlabeled split)."""
    store, key, hit = lookup("expert_iteration", store_uri, config, sft=sft, selections=selections)
    if hit:
        return hit
    started, ckpt = time.perf_counter(), checkpointer(store, "expert_iteration", key, checkpoints)
    rows = store.read_table(selections).to_pylist()
    model, tokenizer = load_policy(store.model_dir(sft))
    metrics = expert_iteration.train_expert_iteration(
        model, tokenizer, prompts_of(rows), [r["output"] for r in rows], config, model.config.max_position_embeddings, ckpt,
    )
    log("expert_iteration: %d selections, loss %.3f -> %.3f", metrics["examples"], metrics["train_loss_first"], metrics["train_loss_last"])
    return _commit_policy(store, "expert_iteration", key, model, tokenizer, config, {"sft": sft, "selections": selections}, metrics, started, ckpt)
