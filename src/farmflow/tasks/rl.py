"""Stage tasks of the methods that optimize the reward model online: PPO and Quark.

* ``ppo``: data (unlabeled prompts) + SFT model + reward model → policy. With
  ``config.snapshot_every`` > 0 it also commits the policy every that many steps as a
  ``ppo_snapshot`` artifact (`ppo_snapshots` lists them), for over-optimization curves.
* ``quark``: data (unlabeled prompts) + SFT model + reward model → policy.

Each policy artifact also holds the per-step training curves as ``history.json`` in its
model folder (`read_history`). With ``execution.launcher=accelerate`` both run on every
process of ``accelerate launch`` (DDP; each samples a share of every rollout, see
`farmflow.methods.ppo`); rank 0 writes the artifacts, snapshots included. `checkpoints` (`CheckpointConfig`) is not part of the
stage key: it only says how often the loop saves a resumable state.
"""

from __future__ import annotations

import json
import time
from typing import Any

from farmflow.config import CheckpointConfig, PPOConfig, QuarkConfig
from farmflow.data import prompts_of, split_rows
from farmflow.methods import ppo, quark
from farmflow.models import SAMPLER_VERSION, load_policy, load_reward, save, value_from_reward
from farmflow.storage import ArtifactRef, LocalStore, open_store, stage_key
from farmflow.tasks.core import checkpointer, commit_policy, config_get, log, lookup, stage_task

HISTORY_FILE = "history.json"
SNAPSHOT_STAGE = "ppo_snapshot"


def _unlabeled_prompts(store: LocalStore, data: ArtifactRef, stage: str) -> list[str]:
    rows = split_rows(store.read_table(data), "unlabeled")
    if not rows:
        raise ValueError(f"{stage}: the data artifact {data.key[:12]} has no 'unlabeled' rows to roll out on (data.unlabeled_size is 0)")
    return prompts_of(rows)


def _reward_fn(store: LocalStore, reward: ArtifactRef) -> ppo.RewardFn:
    reward_model, reward_tokenizer = load_reward(store.model_dir(reward))
    return ppo.reward_model_fn(reward_model.requires_grad_(False), reward_tokenizer)


def read_history(store_uri: str, ref: ArtifactRef) -> list[dict[str, float]]:
    """The per-step metrics (reward, KL, entropy, ...) a PPO or Quark artifact was trained with."""
    return json.loads((open_store(store_uri).model_dir(ref) / HISTORY_FILE).read_text())


# -------------------------------------------------------------------------------- PPO
def snapshot_key(ppo_key: str, step: int) -> str:
    return stage_key(SNAPSHOT_STAGE, ppo.VERSION, {"step": step}, {"ppo": ppo_key})


def ppo_snapshots(store_uri: str, ppo_ref: ArtifactRef) -> dict[int, ArtifactRef]:
    """PPO step → committed policy snapshot of that run (empty when snapshot_every was 0)."""
    store = open_store(store_uri)
    out = {}
    for ref in store.list():
        if ref.stage == SNAPSHOT_STAGE:
            record = store.record(ref)
            if record["inputs"].get("ppo") == ppo_ref.key:
                out[int(record["config"]["step"])] = ref
    return dict(sorted(out.items()))


def snapshots_complete(store, ref: ArtifactRef, config: Any) -> bool:
    """Does the PPO artifact `ref` have a committed snapshot at every `snapshot_every` steps of its run?"""
    every = config_get(config, "snapshot_every", 0)
    steps = int(ref.metrics.get("steps", 0))
    return not every or all(store.get(SNAPSHOT_STAGE, snapshot_key(ref.key, s)) is not None for s in range(every, steps + 1, every))


@stage_task("ppo", version=f"{ppo.VERSION}+sampler{SAMPLER_VERSION}", reads=lambda c: {"data": ("unlabeled",)}, complete=snapshots_complete)
def ppo_task(
    store_uri: str, config: PPOConfig, data: ArtifactRef, sft: ArtifactRef, reward: ArtifactRef, checkpoints: CheckpointConfig | None = None,
) -> ArtifactRef:
    """PPO from the SFT policy against the reward model, on the unlabeled split's prompts."""
    store, key, hit = lookup("ppo", store_uri, config, data=data, sft=sft, reward=reward)
    if hit:
        return hit
    prompts = _unlabeled_prompts(store, data, "ppo")
    policy, tokenizer = load_policy(store.model_dir(sft))
    ref_policy, _ = load_policy(store.model_dir(sft))
    value_model = value_from_reward(store.model_dir(reward))
    ckpt = checkpointer(store, "ppo", key, checkpoints)

    def snapshot(step: int, model) -> None:
        if config.snapshot_every and step % config.snapshot_every == 0 and store.get(SNAPSHOT_STAGE, snapshot_key(key, step)) is None:
            with store.put_model(SNAPSHOT_STAGE, snapshot_key(key, step), "policy", config={"step": step}, inputs={"ppo": key}) as (folder, m):
                save(model, tokenizer, folder)
                m["step"] = float(step)

    started = time.perf_counter()
    summary, history = ppo.train_ppo(policy, ref_policy, value_model, _reward_fn(store, reward), tokenizer, prompts, config, ckpt, snapshot)
    summary["seconds"] = time.perf_counter() - started
    log("ppo: %d steps, reward %.3f -> %.3f, KL %.2f -> %.2f", summary["steps"], summary["reward_first"], summary["reward_last"],
        summary["kl_first"], summary["kl_last"])
    return commit_policy(store, "ppo", key, policy, tokenizer, config, {"data": data, "sft": sft, "reward": reward}, summary, ckpt,
                         {HISTORY_FILE: json.dumps(history, indent=1)})


# ------------------------------------------------------------------------------ Quark
@stage_task("quark", version=f"{quark.VERSION}+sampler{SAMPLER_VERSION}", reads=lambda c: {"data": ("unlabeled",)})
def quark_task(
    store_uri: str, config: QuarkConfig, data: ArtifactRef, sft: ArtifactRef, reward: ArtifactRef, checkpoints: CheckpointConfig | None = None,
) -> ArtifactRef:
    """Quark (top-quantile variant) from the SFT policy with the reward model, on the unlabeled split's prompts."""
    store, key, hit = lookup("quark", store_uri, config, data=data, sft=sft, reward=reward)
    if hit:
        return hit
    prompts = _unlabeled_prompts(store, data, "quark")
    policy, tokenizer = load_policy(store.model_dir(sft))
    ref_policy, _ = load_policy(store.model_dir(sft))
    ckpt = checkpointer(store, "quark", key, checkpoints)
    started = time.perf_counter()
    summary, history = quark.train_quark(policy, ref_policy, _reward_fn(store, reward), tokenizer, prompts, config, ckpt)
    summary["seconds"] = time.perf_counter() - started
    log("quark: %d steps, reward %.3f -> %.3f, KL %.2f -> %.2f", summary["steps"], summary["reward_first"], summary["reward_last"],
        summary["kl_first"], summary["kl_last"])
    return commit_policy(store, "quark", key, policy, tokenizer, config, {"data": data, "sft": sft, "reward": reward}, summary, ckpt,
                         {HISTORY_FILE: json.dumps(history, indent=1)})


__all__ = ["HISTORY_FILE", "ppo_snapshots", "ppo_task", "quark_task", "read_history", "snapshot_key"]
