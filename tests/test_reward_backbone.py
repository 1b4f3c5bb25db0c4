"""`reward.backbone`: a reward model started from a model of its own size instead of the SFT policy.

Stages are counted by execution (`farmflow.tasks.EXECUTED`); the models are read back from the store.
"""

from __future__ import annotations

import json

import pytest
import torch

from farmflow import tasks
from farmflow.config import load_config
from farmflow.flows import StageRunner, Upstream
from farmflow.models import load_tokenizer
from farmflow.tasks.rl import ppo_task

pytestmark = pytest.mark.usefixtures("prefect_harness")

TO_REWARD = {"data": 1, "base_model": 2, "sft": 2, "sample_pairs": 1, "annotate": 1, "train_reward": 1}
"""Stage executions up to a reward model with a backbone of its own: the policy's base model and SFT, the backbone's."""
BACKBONE = {"model": {"hidden_size": 48, "num_layers": 1, "num_heads": 2, "intermediate_size": 96, "vocab_size": 384}}


def _upstream(cfg) -> Upstream:
    return Upstream(StageRunner(cfg.store.location, cfg.execution, cfg.name), cfg)


def _hidden_size(store, ref) -> int:
    return json.loads((store.model_dir(ref) / "config.json").read_text())["hidden_size"]


def test_the_reward_model_starts_from_its_own_backbone_trained_once(micro_config):
    plain = _upstream(micro_config)
    cfg = load_config(
        "synthetic-micro", [f"store.uri={micro_config.store.uri}", f"reward.backbone={json.dumps(BACKBONE)}"]
    )
    tasks.EXECUTED.clear()
    up = _upstream(cfg)
    reward = up.reward
    # the policy's base model and SFT, then the backbone's own: two of each; one set of pairs, labels, reward model
    assert dict(tasks.EXECUTED) == TO_REWARD
    store = up.run.store
    assert store.record(reward)["inputs"]["sft"] == up.reward_backbone.key != up.sft.key
    assert _hidden_size(store, reward) == 48 and _hidden_size(store, up.sft) == 32
    # trained on the same text with the same vocab_size, the backbone's tokenizer is the policy's (PPO relies on it)
    assert load_tokenizer(store.model_dir(reward)).get_vocab() == load_tokenizer(store.model_dir(up.sft)).get_vocab()
    # pairs and labels are the policy's: the backbone changes the reward model only
    assert up.preferences == plain.preferences

    tasks.EXECUTED.clear()
    again = _upstream(cfg)
    assert again.reward == reward and dict(tasks.EXECUTED) == {}
    # without a backbone the reward model starts from the SFT policy, as in AlpacaFarm
    assert store.record(plain.reward)["inputs"]["sft"] == plain.sft.key and plain.reward != reward
    assert dict(tasks.EXECUTED) == {"train_reward": 1}


def test_ppo_refuses_a_reward_model_whose_tokenizer_is_not_the_policys(micro_config):
    other = BACKBONE | {"model": BACKBONE["model"] | {"vocab_size": 320}}
    cfg = load_config(
        "synthetic-micro", [f"store.uri={micro_config.store.uri}", f"reward.backbone={json.dumps(other)}"]
    )
    up = _upstream(cfg)
    reward = up.reward
    refusal = r"^ppo\.value_from='reward': .*\(reward\.backbone\); set ppo\.value_from=policy"
    with pytest.raises(ValueError, match=refusal):
        up.run(ppo_task, cfg.ppo, data=up.data, sft=up.sft, reward=reward)
    assert not [r for r in up.run.store.list() if r.stage == "ppo"]


def test_ppo_on_a_reward_model_of_another_tokenizer_starts_its_value_model_from_the_policy(micro_config):
    from safetensors.torch import load_file

    from farmflow.models import value_from_policy

    other = BACKBONE | {"model": BACKBONE["model"] | {"vocab_size": 320}}
    sets = [f"store.uri={micro_config.store.uri}", f"reward.backbone={json.dumps(other)}", "ppo.value_from=policy"]
    cfg = load_config("synthetic-micro", sets)
    up = _upstream(cfg)
    assert (
        load_tokenizer(up.run.store.model_dir(up.reward)).get_vocab()
        != load_tokenizer(up.run.store.model_dir(up.sft)).get_vocab()
    )
    tasks.EXECUTED.clear()
    ppo = up.run(ppo_task, cfg.ppo, data=up.data, sft=up.sft, reward=up.reward)
    assert dict(tasks.EXECUTED) == {"ppo": 1} and ppo.stage == "ppo"
    assert ppo.metrics["steps"] > 0

    # the value model: the SFT policy's transformer, every weight as SFT left it, and a zero head
    value = value_from_policy(up.run.store.model_dir(up.sft))
    sft = load_file(next(up.run.store.model_dir(up.sft).glob("*.safetensors")))
    backbone = value.backbone.state_dict()
    assert {f"model.{k}" for k in backbone} == set(sft) - {"lm_head.weight"}
    assert all(torch.equal(v, sft[f"model.{k}"]) for k, v in backbone.items())
    assert torch.count_nonzero(value.head.weight) == 0 and torch.count_nonzero(value.head.bias) == 0


def test_a_pretrained_backbone_as_it_is_with_only_the_head_trained(micro_config, tmp_path):
    from safetensors.torch import load_file
    from test_real_farm import tiny_llama_without_pad

    folder = tiny_llama_without_pad(tmp_path / "hub-model")
    backbone = {"model": {"pretrained": str(folder)}, "fine_tune": False}
    cfg = load_config(
        "synthetic-micro",
        [
            f"store.uri={micro_config.store.uri}",
            f"reward.backbone={json.dumps(backbone)}",
            "reward.train_backbone=false",
            "reward.lr=0.01",
        ],
    )
    tasks.EXECUTED.clear()
    up = _upstream(cfg)
    reward = up.reward
    # the backbone is the pretrained model as loaded: no SFT of its own, only the policy's
    assert dict(tasks.EXECUTED) == TO_REWARD | {"sft": 1}
    store = up.run.store
    assert store.record(reward)["inputs"]["sft"] == up.reward_backbone.key
    assert up.reward_backbone.stage == "base_model"
    # frozen: every backbone weight as the base model stage saved it; the head trained
    base = load_file(next(store.model_dir(up.reward_backbone).glob("*.safetensors")))
    trained = load_file(next(store.model_dir(reward).glob("*.safetensors")))
    assert set(trained) - {"score.weight"} == set(base) - {"lm_head.weight"}  # the causal LM's head gives way
    assert all(torch.equal(v, base[k]) for k, v in trained.items() if k != "score.weight")


def test_frozen_reward_models_on_one_pretrained_backbone_read_each_output_once(micro_config, tmp_path):
    from test_real_farm import tiny_llama_without_pad
    from transformers import LlamaModel

    from farmflow.models import FEATURES, load_reward

    folder = tiny_llama_without_pad(tmp_path / "hub-model")
    backbone = {"model": {"pretrained": str(folder)}, "fine_tune": False}
    sets = [
        f"store.uri={micro_config.store.uri}",
        f"reward.backbone={json.dumps(backbone)}",
        "reward.train_backbone=false",
    ]
    FEATURES.clear()
    reads = []
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda m, _a, out: reads.append(out[0].shape[0]) if isinstance(m, LlamaModel) else None
    )
    try:
        first = _upstream(load_config("synthetic-micro", sets)).reward
        read_first, reads[:] = sum(reads), []
        tasks.EXECUTED.clear()
        second = _upstream(load_config("synthetic-micro", [*sets, "reward.seed=1"])).reward  # another head
    finally:
        hook.remove()
    assert dict(tasks.EXECUTED) == {"train_reward": 1}
    assert read_first > 0 and reads == []  # its training and held-out outputs were all read for the first
    a, b = (load_reward(_upstream(micro_config).run.store.model_dir(r))[0] for r in (first, second))
    assert not torch.equal(a.score.weight, b.score.weight)


def test_a_backbone_as_it_is_must_be_pretrained():
    from farmflow.config import ConfigError

    with pytest.raises(ConfigError, match="fine_tune=False needs model.pretrained"):
        load_config("synthetic-micro", [f"reward.backbone={json.dumps(BACKBONE | {'fine_tune': False})}"])
    both = {"model": {"pretrained": "smollm2-135m-instruct"}, "sft": {"epochs": 1}, "fine_tune": False}
    with pytest.raises(ConfigError, match="sft is set but fine_tune=False"):
        load_config("synthetic-micro", [f"reward.backbone={json.dumps(both)}"])


def test_a_backbone_is_one_config_line_away_and_keys_only_when_set():
    from farmflow.config import ConfigError
    from farmflow.flows.pipeline import config_key

    with pytest.raises(ConfigError, match=r"reward\.backbone\.model.*Field required"):
        load_config("synthetic-micro", ["reward.backbone={}"])
    tiny = load_config("synthetic-micro")
    assert config_key(load_config("synthetic-micro", ["reward.backbone=null"])) == config_key(tiny)
    assert config_key(load_config("synthetic-micro", [f"reward.backbone={json.dumps(BACKBONE)}"])) != config_key(tiny)
    # the head-only switch keys only when set, as the backbone's fine-tuning switch
    assert config_key(load_config("synthetic-micro", ["reward.train_backbone=true"])) == config_key(tiny)
    assert config_key(load_config("synthetic-micro", ["reward.train_backbone=false"])) != config_key(tiny)
    tuned = load_config("synthetic-micro", [f"reward.backbone={json.dumps(BACKBONE | {'fine_tune': True})}"])
    assert config_key(tuned) == config_key(load_config("synthetic-micro", [f"reward.backbone={json.dumps(BACKBONE)}"]))
