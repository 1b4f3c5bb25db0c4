"""Named farms: each preset is a function that builds a fresh `FarmConfig`."""

from __future__ import annotations

from typing import Any

from farmflow.config.annotators import AnnotatorConfig
from farmflow.config.base import ConfigError
from farmflow.config.data import DataConfig
from farmflow.config.evaluation import EvaluationConfig
from farmflow.config.execution import ExecutionConfig
from farmflow.config.farm import FarmConfig
from farmflow.config.methods import (
    BestOfNConfig,
    DPOConfig,
    ExpertIterationConfig,
    PPOConfig,
    QuarkConfig,
    RewardConditioningConfig,
    RewardConfig,
    SampleConfig,
    SFTConfig,
)
from farmflow.config.model import ModelConfig


def _synthetic_tiny() -> FarmConfig:
    """The demo: meaningful results in minutes on 2 CPU cores.

    Training sizes keep AlpacaFarm's split proportions at 4/10 of the paper's. The evaluation set has 1,860
    instructions, what the validation study estimated a paired difference between two methods needs to resolve 2
    points under p_sim^eval (400 resolve about 4; docs/results.md, validation study); only the evaluation stages
    read it, so its size leaves every trained model's key alone. The ~0.6M-parameter model trains from scratch, hence
    many SFT epochs (16) and large learning rates. Best-of-n uses n=4 at temperature 0.7 instead of the paper's n=1024
    at 1.0: a reward model this small cannot make up for the noisier temperature-1.0 samples, and larger n
    over-optimizes it (docs/results.md, section "Over-optimization").

    FeedME, reward conditioning, DPO and expert iteration fine-tune a converged SFT model,
    so their learning rates are 10-30x below SFT's (the measurements behind each setting:
    docs/methods.md, the presets table). Reward conditioning trains 1 epoch and expert
    iteration 2 epochs on half of the unlabeled split, at a small cost in gold, to keep the
    cold demo short. The demo's leaderboard, gold rewards and wall time are in docs/results.md (demo leaderboard).

    PPO and Quark keep the paper's structure with smaller batches (rollout 128 prompts,
    48-token responses) and a larger learning rate (1e-4). PPO runs 23 steps (3/8 of a pass
    over the unlabeled split) with KL coefficient 0.05; Quark runs 62 steps with 0.1.
    Stronger optimization (PPO lr 3e-4, Quark lr 3e-4) raises the proxy reward further but loses
    gold (over-optimization of the weak reward model; docs/results.md, over-optimization).
    """
    return FarmConfig(
        name="synthetic-tiny",
        data=DataConfig(
            sft_size=4000, pref_size=4000, unlabeled_size=8000, val_size=800, eval_size=1860, reference_error_rate=0.9
        ),
        model=ModelConfig(hidden_size=128, num_layers=2, num_heads=4, intermediate_size=384, vocab_size=1024),
        sft=SFTConfig(epochs=16, batch_size=32, lr=3e-3),
        pairs=SampleConfig(temperature=1.0, max_new_tokens=48, batch_size=128),
        reward=RewardConfig(epochs=2, batch_size=32, lr=5e-4),
        best_of_n=BestOfNConfig(n=4, temperature=0.7),
        feedme=SFTConfig(epochs=2, batch_size=32, lr=1e-4),
        reward_conditioning=RewardConditioningConfig(train=SFTConfig(epochs=1, batch_size=32, lr=3e-4)),
        dpo=DPOConfig(epochs=2, batch_size=32, lr=1e-4),
        expert_iteration=ExpertIterationConfig(
            n=4, temperature=0.7, max_prompts=4000, train=SFTConfig(epochs=2, batch_size=32, lr=5e-4)
        ),
        ppo=PPOConfig(
            epochs=0.375,
            rollout_batch_size=128,
            step_batch_size=64,
            micro_batch_size=64,
            lr=1e-4,
            warmup_steps=2,
            kl_coef=0.05,
            max_new_tokens=48,
        ),
        quark=QuarkConfig(
            epochs=1,
            rollout_batch_size=128,
            step_batch_size=32,
            micro_batch_size=64,
            lr=1e-4,
            warmup_steps=2,
            kl_coef=0.1,
            max_new_tokens=48,
        ),
        generation=SampleConfig(temperature=0.7, max_new_tokens=48, batch_size=128),
    )


LOOKUP_FAMILIES = ("list_items", "categorize")
"""The synthetic task families whose correctness the farm's reward model can learn from preference pairs (a word's
category, a category's members: lookups), where it cannot learn to check a sum, a sort or a copy
(docs/evaluation.md, known limits of the synthetic reward model)."""


def _synthetic_lookup() -> FarmConfig:
    """synthetic-tiny on the lookup families with the paper's 10k preference pairs: a farm whose reward model can learn
    what its annotators reward.

    AlpacaFarm's over-optimization contrast (Fig. 5: the noisy pool's reward model over-optimizes, a single greedy
    annotator's does not) rests on a reward model that learns its labeller. On all six families this farm's reward
    model learns little beyond length and format (57-58% against gold with either labeller), so both over-optimize
    alike. On list_items and categorize it learns the answers themselves: best-of-n gains gold and the methods
    separate from SFT. With the paper's 10k preference pairs (synthetic-tiny has 4k) best-of-n against p_sim^ann's
    reward model loses more gold than against greedy's on four of six seeds and as much on the other two; at 4k which
    of the two falls further changes with the seed (docs/results.md, validation study on the lookup farm). Everything
    else is synthetic-tiny's; SFT wins 71-74% against the reference outputs here (their error rate is calibrated on
    all six families).
    """
    cfg = _synthetic_tiny()
    cfg.name, cfg.data.families = "synthetic-lookup", list(LOOKUP_FAMILIES)
    cfg.data.pref_size = 10_000
    return cfg


def _synthetic_micro() -> FarmConfig:
    """Tests: the whole flow in well under a minute."""
    return FarmConfig(
        name="synthetic-micro",
        data=DataConfig(sft_size=120, pref_size=120, unlabeled_size=240, val_size=24, eval_size=16),
        model=ModelConfig(
            hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=384, max_seq_len=128
        ),
        sft=SFTConfig(epochs=1, batch_size=16, lr=3e-3),
        pairs=SampleConfig(temperature=1.0, max_new_tokens=12, batch_size=64),
        reward=RewardConfig(epochs=1, batch_size=16, lr=1e-3),
        best_of_n=BestOfNConfig(n=4),
        feedme=SFTConfig(epochs=1, batch_size=16, lr=1e-3),
        reward_conditioning=RewardConditioningConfig(train=SFTConfig(epochs=1, batch_size=16, lr=1e-3)),
        dpo=DPOConfig(epochs=1, batch_size=16, lr=1e-3),
        expert_iteration=ExpertIterationConfig(n=2, max_prompts=48, train=SFTConfig(epochs=1, batch_size=16, lr=1e-3)),
        ppo=PPOConfig(
            epochs=1, rollout_batch_size=48, step_batch_size=24, micro_batch_size=24, lr=1e-4, max_new_tokens=12
        ),
        quark=QuarkConfig(
            epochs=1, rollout_batch_size=48, step_batch_size=8, micro_batch_size=24, lr=1e-4, max_new_tokens=12
        ),
        generation=SampleConfig(temperature=0.7, max_new_tokens=12, batch_size=64),
    )


def _alpaca_small() -> FarmConfig:
    """Real AlpacaFarm-format data at a size one GPU (or a patient CPU) runs: a few thousand instructions.

    Data from local files (override data.instructions_path / data.eval_path), split 10 : 10 : 20 : 2
    at 2000 / 2000 / 4000 / 400, evaluated on all 805 AlpacaEval instructions. The base model is
    SmolLM2-135M-Instruct from the model cache (`farmflow models get smollm2-135m-instruct`; override
    model.pretrained with any cache name, folder or hub id). Annotation through the
    paper's API pools (p_sim_ann for the pairs, p_sim_eval for evaluation); cost in docs/real-farm.md.
    """
    return FarmConfig(
        name="alpaca-small",
        data=DataConfig(
            source="local",
            instructions_path="data/alpaca_instructions.json",
            eval_path="data/alpaca_eval.json",
            sft_size=2000,
            pref_size=2000,
            unlabeled_size=4000,
            val_size=400,
            eval_size=805,
        ),
        model=ModelConfig(pretrained="smollm2-135m-instruct", dtype="bfloat16", max_seq_len=768),
        sft=SFTConfig(epochs=3, batch_size=32, lr=5e-5),
        pairs=SampleConfig(temperature=1.0, max_new_tokens=256, batch_size=32),
        annotation=AnnotatorConfig(preset="p_sim_ann"),
        reward=RewardConfig(epochs=1, batch_size=16, lr=1e-5),
        best_of_n=BestOfNConfig(n=16),
        generation=SampleConfig(temperature=0.7, max_new_tokens=256, batch_size=32),
        evaluation=EvaluationConfig(annotator=AnnotatorConfig(preset="p_sim_eval")),
    )


def _alpacafarm_7b() -> FarmConfig:
    """The paper's setting: LLaMA-7B-class SFT on 10k, the paper's split sizes and hyperparameters (the config
    defaults).

    Data from the Hugging Face hub (tatsu-lab/alpaca_farm; or data.source=local with exported files);
    model.pretrained a LLaMA-7B-class checkpoint by path or hub name; bf16 with gradient
    checkpointing; p_sim_ann / p_sim_eval API annotators. Cost in docs/real-farm.md.
    """
    return FarmConfig(
        name="alpacafarm-7b",
        data=DataConfig(source="hub"),
        model=ModelConfig(
            pretrained="huggyllama/llama-7b", dtype="bfloat16", gradient_checkpointing=True, max_seq_len=512 + 300
        ),
        execution=ExecutionConfig(launcher="accelerate", accelerate_config="fsdp"),
        sft=SFTConfig(micro_batch_size=4),
        feedme=SFTConfig(micro_batch_size=4),  # 4 sequences per GPU per pass, 128 per step
        reward=RewardConfig(micro_batch_size=2),
        dpo=DPOConfig(micro_batch_size=2),
        pairs=SampleConfig(temperature=1.0, max_new_tokens=300, batch_size=32),
        annotation=AnnotatorConfig(preset="p_sim_ann"),
        best_of_n=BestOfNConfig(n=1024),
        generation=SampleConfig(temperature=0.7, max_new_tokens=300, batch_size=32),
        evaluation=EvaluationConfig(annotator=AnnotatorConfig(preset="p_sim_eval")),
    )


SHARED_DATA = "../shared/data"
"""Where the smol presets read real data: Alpaca examples and the AlpacaEval set, beside a checkout (override
data.instructions_path / data.eval_path to point elsewhere)."""


def _smol(
    name: str, sizes: dict, max_seq_len: int, new_tokens: int, batch: int, n: int, rl_batch: int, ppo_epochs: int = 2
) -> FarmConfig:
    """A real farm on 2 CPU cores: real Alpaca instructions, SmolLM2-135M-Instruct as the policy and as an in-process
    judge (`annotation.kind: hf`), evaluation against Davinci003's reference outputs. Every method, small batches.

    The judge is a 135M model: its agreement with GPT-4 is at chance (docs/evaluation.md), so the leaderboard shows
    that the machinery runs on real components, not which method is better. Learning rates are the AlpacaFarm
    settings for fine-tuning a pretrained model (SFT 2e-5, reward model and PPO 1e-5, DPO 1e-6 raised to 5e-6 for
    so few steps). The reward model packs its pairs (`RewardConfig.packing`: each prompt read once)."""
    judge = {"kind": "hf", "hf": {"model": "smollm2-135m-instruct", "max_prompt_tokens": max_seq_len + 2 * new_tokens}}
    train = {"epochs": 1, "batch_size": batch, "lr": 2e-5}
    rl = {
        "epochs": 1,
        "rollout_batch_size": rl_batch,
        "step_batch_size": rl_batch,
        "micro_batch_size": rl_batch,
        "lr": 1e-5,
        "warmup_steps": 0,
        "max_new_tokens": new_tokens,
    }
    return FarmConfig.model_validate(
        {
            "name": name,
            "data": {
                "source": "local",
                "instructions_path": f"{SHARED_DATA}/alpaca_en_demo.json",
                "eval_path": f"{SHARED_DATA}/alpaca_eval_davinci003_outputs.json",
                **sizes,
            },
            "model": {"pretrained": "smollm2-135m-instruct", "max_seq_len": max_seq_len},
            "sft": train,
            "pairs": {"temperature": 1.0, "max_new_tokens": new_tokens, "batch_size": 16},
            "annotation": judge,
            "reward": {"epochs": 1, "batch_size": batch, "lr": 1e-5, "packing": True},
            "best_of_n": {"n": n},
            "feedme": train,
            "reward_conditioning": {"train": train},
            "dpo": {"epochs": 1, "batch_size": batch, "lr": 5e-6},
            "expert_iteration": {"n": n, "max_prompts": sizes["unlabeled_size"], "train": train},
            "ppo": rl | {"ppo_epochs": ppo_epochs},
            "quark": rl | {"num_quantiles": 2},
            "generation": {"temperature": 0.7, "max_new_tokens": new_tokens, "batch_size": 16},
            "evaluation": {"annotator": judge},
        }
    )


def _smol_cpu() -> FarmConfig:
    """The real farm on 2 CPU cores in under half an hour: every method, 40 evaluation instructions, sequences cut at
    256 tokens (about a quarter of the Alpaca examples are longer; time per stage in docs/real-farm.md)."""
    return _smol(
        "smol-cpu",
        {"sft_size": 64, "pref_size": 48, "unlabeled_size": 16, "val_size": 16, "eval_size": 40},
        max_seq_len=256,
        new_tokens=48,
        batch=8,
        n=4,
        rl_batch=16,
    )


def _smol_micro() -> FarmConfig:
    """The smol-cpu path at toy sizes, for tests: a few minutes once the model is in the cache (PPO: one step of 4
    rollouts with one pass over them, the stage's whole path at a fraction of its cost). Each stage's compute is a
    135M model's forward and backward passes on 2 CPU cores, so the sizes stay toy-sized: a training batch of 4
    sequences of at most 128 tokens, 4 evaluation instructions."""
    return _smol(
        "smol-micro",
        {"sft_size": 4, "pref_size": 4, "unlabeled_size": 4, "val_size": 2, "eval_size": 4},
        max_seq_len=128,
        new_tokens=16,
        batch=4,
        n=2,
        rl_batch=4,
        ppo_epochs=1,
    )


PRESETS: dict[str, Any] = {
    "synthetic-tiny": _synthetic_tiny,
    "synthetic-micro": _synthetic_micro,
    "synthetic-lookup": _synthetic_lookup,
    "smol-cpu": _smol_cpu,
    "smol-micro": _smol_micro,
    "alpaca-small": _alpaca_small,
    "alpacafarm-7b": _alpacafarm_7b,
}


def preset(name: str) -> FarmConfig:
    """A fresh copy of a named preset."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]()
