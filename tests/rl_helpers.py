"""Shared fixtures of the PPO and Quark tests: a toy task with a known reward, micro-farm artifacts,
and a real subprocess that is SIGKILLed mid-training."""

from __future__ import annotations

import copy
import random
import textwrap
from pathlib import Path

import torch
from procs import run_and_kill_when
from transformers import LlamaModel

from farmflow.config import ModelConfig, load_config
from farmflow.models import ValueModel, build_policy, train_tokenizer

# ------------------------------------------------------------------ toy task
# Prompts "Say <word>"; the reward is the fraction of digit characters in the response.
# A random tiny policy writes ~8% digits, so there is a dense signal to climb.
WORDS = ["alpha", "beta", "gamma", "delta", "seven", "three"]
TOY_PROMPTS = [f"Say {w}" for w in WORDS] * 20


def digit_reward(prompts, responses) -> torch.Tensor:
    return torch.tensor([sum(c.isdigit() for c in r) / max(1, len(r)) for r in responses])


def toy_models():
    """(policy, frozen copy, value model with a zero head, tokenizer), all tiny and seeded."""
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(8)) + f" {rng.randint(0, 999)}" for _ in range(300)]
    tok = train_tokenizer(texts, 300)
    policy = build_policy(
        ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=300, max_seq_len=64),
        tok,
    )
    torch.manual_seed(1)
    value = ValueModel(LlamaModel(policy.config), policy.config.hidden_size)
    return policy, copy.deepcopy(policy), value, tok


# ------------------------------------------------------------- micro farm
def micro_artifacts(root: Path) -> dict:
    """data, sft and reward artifacts of the synthetic-micro preset, built by the real stage tasks."""
    from farmflow import tasks

    cfg = load_config("synthetic-micro", [f"store.uri={root}"])
    uri = cfg.store.uri
    data = tasks.data_task.fn(uri, cfg.data)
    base = tasks.base_model_task.fn(uri, cfg.model, data)
    sft = tasks.sft_task.fn(uri, cfg.sft, data, base)
    prefs = tasks.annotate_task.fn(uri, cfg.annotation, tasks.sample_pairs_task.fn(uri, cfg.pairs, data, sft))
    reward = tasks.train_reward_task.fn(uri, cfg.reward, prefs, sft)
    return {"cfg": cfg, "uri": uri, "data": data, "sft": sft, "reward": reward}


def uninterrupted_history(art: dict, method: str, config) -> list[dict]:
    """Per-step history of the same training run in this process, never interrupted."""
    from farmflow.data import prompts_of, split_rows
    from farmflow.methods import ppo, quark
    from farmflow.methods import rl as rl_methods
    from farmflow.models import load_policy, load_reward, value_from_reward
    from farmflow.storage import open_store

    store = open_store(art["uri"])
    policy, tok = load_policy(store.model_dir(art["sft"]))
    ref_policy, _ = load_policy(store.model_dir(art["sft"]))
    reward_fn = rl_methods.reward_model_fn(*load_reward(store.model_dir(art["reward"])))
    prompts = prompts_of(split_rows(store.read_table(art["data"]), "unlabeled"))
    if method == "ppo":
        value = value_from_reward(store.model_dir(art["reward"]))
        return ppo.train_ppo(policy, ref_policy, value, reward_fn, tok, prompts, config)[1]
    return quark.train_quark(policy, ref_policy, reward_fn, tok, prompts, config)[1]


KILL_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from farmflow.config import CheckpointConfig, {config_class}
    from farmflow.storage import ArtifactRef
    from farmflow.tasks import rl
    uri, config, refs = sys.argv[1], {config_class}.model_validate_json(sys.argv[2]), json.loads(sys.argv[3])
    refs = {{k: ArtifactRef.model_validate(v) for k, v in refs.items()}}
    rl.{task}.fn(
        uri, config, refs["data"], refs["sft"], refs["reward"],
        checkpoints=CheckpointConfig(every_steps=1, every_seconds=0),
    )
""")


def kill_when_checkpointed(task: str, config, art: dict, stage: str, min_step: int) -> int:
    """Run `task` in a real process; SIGKILL it once a checkpoint of `min_step`+ steps exists.

    Returns the step of the newest checkpoint left behind.
    """
    import json

    script = KILL_SCRIPT.format(config_class=type(config).__name__, task=task)
    refs = json.dumps({k: art[k].model_dump(mode="json") for k in ("data", "sft", "reward")})
    folder = Path(art["uri"]) / "_checkpoints" / stage

    def newest() -> int:
        steps = [int(p.name.split("-")[1]) for p in folder.glob("*/step-*")]
        return max(steps, default=0)

    run_and_kill_when(
        [script, art["uri"], config.model_dump_json(), refs],
        lambda: newest() >= min_step,
        f"a checkpoint of step {min_step}+",
    )
    return newest()


def ddp_config(folder: Path) -> Path:
    """accelerate's config for 2 local processes (DDP; gloo on CPU)."""
    import yaml

    path = folder / "cpu_ddp.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "compute_environment": "LOCAL_MACHINE",
                "distributed_type": "MULTI_GPU",
                "num_machines": 1,
                "num_processes": 2,
                "machine_rank": 0,
                "mixed_precision": "no",
                "use_cpu": False,
            }
        )
    )
    return path
