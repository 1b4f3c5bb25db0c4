"""Stages of the methods that optimize the reward model online: PPO and Quark.

* ``ppo``: data (unlabeled prompts) + SFT model + reward model → policy. With
  ``config.snapshot_every`` > 0 it also commits the policy every that many steps as a
  ``ppo_snapshot`` artifact (`ppo_snapshots` lists them), for over-optimization curves.
* ``quark``: data (unlabeled prompts) + SFT model + reward model → policy.

Each policy artifact also holds the per-step training curves as ``history.json`` in its
model folder (`read_history`). With ``execution.launcher=accelerate`` both run on every
process of ``accelerate launch`` (DDP; each samples a share of every rollout, see
`farmflow.methods.rl`); rank 0 writes the artifacts, snapshots included. `checkpoints` (`CheckpointConfig`) is not part
of the stage key: it only says how often the loop saves a resumable state.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from farmflow.config import CheckpointConfig, PPOConfig, QuarkConfig
from farmflow.data import prompts_of, split_rows
from farmflow.storage import ArtifactRef, open_store
from farmflow.tasks.registry import SNAPSHOT_STAGE, STAGES, snapshot_key, snapshots_complete  # noqa: F401 (re-exported)
from farmflow.tasks.stage import Model, StageRun, stage_task

if TYPE_CHECKING:
    from farmflow.methods.rl import RewardFn

HISTORY_FILE = "history.json"


def unlabeled_prompts(run: StageRun, data: ArtifactRef) -> list[str]:
    rows = split_rows(run.store.read_table(data), "unlabeled")
    if not rows:
        raise ValueError(
            f"{run.stage}: the data artifact {data.key[:12]} has no 'unlabeled' rows to roll out on "
            "(data.unlabeled_size is 0)"
        )
    return prompts_of(rows)


def reward_fn(run: StageRun, reward: ArtifactRef) -> RewardFn:
    from farmflow.methods.rl import reward_model_fn
    from farmflow.models import load_reward

    reward_model, reward_tokenizer = load_reward(run.store.model_dir(reward))
    return reward_model_fn(reward_model.requires_grad_(False), reward_tokenizer)


def read_history(store_uri: str, ref: ArtifactRef) -> list[dict[str, float]]:
    """The per-step metrics (reward, KL, entropy, ...) a PPO or Quark artifact was trained with."""
    return json.loads((open_store(store_uri).model_dir(ref) / HISTORY_FILE).read_text())


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


@stage_task(STAGES["ppo"])
def ppo_task(
    run: StageRun,
    config: PPOConfig,
    data: ArtifactRef,
    sft: ArtifactRef,
    reward: ArtifactRef,
    checkpoints: CheckpointConfig | None = None,
) -> Model:
    """PPO from the SFT policy against the reward model, on the unlabeled split's prompts."""
    from farmflow.methods.ppo import train_ppo
    from farmflow.models import load_policy, load_tokenizer, value_from_policy, value_from_reward

    prompts = unlabeled_prompts(run, data)
    policy, tokenizer = load_policy(run.store.model_dir(sft))
    if config.value_from == "policy":
        value_model = value_from_policy(run.store.model_dir(sft))
    elif load_tokenizer(run.store.model_dir(reward)).get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            "ppo.value_from='reward': the value model starts from the reward model and reads the policy's tokens, but "
            "the reward model's tokenizer is not the policy's (reward.backbone); set ppo.value_from=policy to start it "
            "from the SFT policy"
        )
    else:
        value_model = value_from_reward(run.store.model_dir(reward))
    ref_policy, _ = load_policy(run.store.model_dir(sft))

    def snapshot(step: int, model) -> None:
        if config.snapshot_every and step % config.snapshot_every == 0:
            run.snapshot(SNAPSHOT_STAGE, snapshot_key(run.key, step), model, tokenizer, {"step": step}, "ppo")

    summary, history = train_ppo(
        policy,
        ref_policy,
        value_model,
        reward_fn(run, reward),
        tokenizer,
        prompts,
        config,
        run.checkpointer(checkpoints),
        snapshot,
    )
    return Model(policy, tokenizer, summary, extra_files={HISTORY_FILE: json.dumps(history, indent=1)})


@stage_task(STAGES["quark"])
def quark_task(
    run: StageRun,
    config: QuarkConfig,
    data: ArtifactRef,
    sft: ArtifactRef,
    reward: ArtifactRef,
    checkpoints: CheckpointConfig | None = None,
) -> Model:
    """Quark (top-quantile variant) from the SFT policy with the reward model, on the unlabeled split's prompts."""
    from farmflow.methods.quark import train_quark
    from farmflow.models import load_policy

    prompts = unlabeled_prompts(run, data)
    policy, tokenizer = load_policy(run.store.model_dir(sft))
    ref_policy, _ = load_policy(run.store.model_dir(sft))
    summary, history = train_quark(
        policy, ref_policy, reward_fn(run, reward), tokenizer, prompts, config, run.checkpointer(checkpoints)
    )
    return Model(policy, tokenizer, summary, extra_files={HISTORY_FILE: json.dumps(history, indent=1)})


__all__ = [
    "HISTORY_FILE",
    "ppo_snapshots",
    "ppo_task",
    "quark_task",
    "read_history",
    "snapshot_key",
    "snapshots_complete",
]
