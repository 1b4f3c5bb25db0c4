"""Every stage, declared once: its name, code version, inputs, how its key is made, and where it runs.

`STAGES` is a plain table. The stages of a method that `farmflow.config.METHODS` wires alone (its entry names a
``train`` function) are made from that entry (`trained_on_pairs`); every other stage is written out here. The stage
modules (`farmflow.tasks.pipeline`, `.methods`, `.rl`, `.analysis`) attach each
stage's work with ``@stage_task(STAGES["sft"])`` (`farmflow.tasks.stage`), and `farmflow.tasks.core.TASKS` lists the
resulting Prefect tasks by name. Nothing is registered by importing a module.

A stage key is ``stage_key(name, version, key_config(config), keyed_inputs)``: bump a stage's version whenever its code
changes what it produces (most versions live in the method module, e.g. `farmflow.methods.dpo.VERSION`). Those are
read from the modules' source (`declared_version`), not imported: a method module imports torch, and a run whose
stages are all cached computes every stage's key and loads no model, so it need not pay torch's import (seconds).
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import farmflow
from farmflow.config import METHODS, Method, SampleConfig
from farmflow.data import synthetic
from farmflow.evaluation import VERSION as EVAL_VERSION
from farmflow.storage import ArtifactRef, part_key, stage_key
from farmflow.tasks.keys import config_get, key_config


@functools.cache
def declared_version(module: str, name: str = "VERSION") -> str:
    """The string constant `name` that `module` (a farmflow module, e.g. ``farmflow.methods.dpo``) assigns at its top
    level, read from its source without importing it or its package."""
    source = Path(farmflow.__file__).parent.joinpath(*module.split(".")[1:]).with_suffix(".py")
    for node in ast.parse(source.read_text(), str(source)).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"{source} assigns no {name} at its top level")


def method_version(method: str) -> str:
    """A method module's ``VERSION`` (`farmflow.methods.<method>`)."""
    return declared_version(f"farmflow.methods.{method}")


Reads = Callable[[Any], dict[str, "tuple[str, ...] | None"]]


@dataclass(frozen=True)
class Stage:
    """One stage's facts.

    * `inputs`: the stage function's `ArtifactRef` parameters; each input's key enters the stage key.
    * `reads(config)`: {input: the parts of it the stage reads} (the data artifact's splits, ``()`` for none, None for
      all); those parts' digests stand in for the input's key, so SFT keeps its key when only the eval split changes.
      It must name every split the stage's function reads, or a change there would be missed.
    * `typed(config)`: the config as the stage's function takes it when it arrives as JSON (a GPU worker's stage flow),
      so operational fields inside it stay out of every key.
    * `complete(store, ref, config)`: does a committed artifact hold everything `config` asks for (PPO's snapshots)?
      If not, the stage runs again under the same key and adds what is missing.
    * `gpu`: loads a model on the accelerator (`farmflow.config.GPU_STAGES`, the default ``execution.gpu_stages``).
    * `processes`: under ``execution.launcher=accelerate``, 'all' runs on every process (the loop splits each batch),
      'one' in a single child process (sampling, scoring).
    * `summary`: the log line after a run, a format string over the artifact's metrics (or a function of them).
    """

    name: str
    version: str
    inputs: tuple[str, ...] = ()
    reads: Reads | None = None
    typed: Callable[[Any], Any] | None = None
    complete: Callable[[Any, ArtifactRef, Any], bool] | None = None
    gpu: bool = False
    processes: Literal["one", "all"] = "one"
    summary: str | Callable[[dict[str, float]], str] = ""

    def typed_config(self, config: Any) -> Any:
        """`config` as the stage's function sees it, so every key computed for it is the same."""
        return self.typed(config) if self.typed is not None else config

    def keyed_inputs(self, config: Any, inputs: dict[str, ArtifactRef]) -> dict[str, ArtifactRef | str]:
        """The inputs as the stage key sees them: an input read only in parts counts by those parts' digests."""
        reads = self.reads(config) if self.reads is not None else {}
        return {name: part_key(ref, reads[name]) if name in reads else ref for name, ref in inputs.items()}

    def key(self, config: Any, inputs: dict[str, ArtifactRef]) -> str:
        """The stage key of this (typed) config and these inputs."""
        return stage_key(self.name, self.version, key_config(config), self.keyed_inputs(config, inputs))

    def is_complete(self, store: Any, ref: ArtifactRef, config: Any) -> bool:
        """A committed artifact serves `config` unless `complete` says something it asks for is missing."""
        return self.complete is None or self.complete(store, ref, config)


def generate_config(config: dict) -> dict:
    """generate's config with its sampling section typed (it arrives as JSON on a GPU worker)."""
    return {**config, "sample": SampleConfig.model_validate(config["sample"])}


SNAPSHOT_STAGE = "ppo_snapshot"
"""PPO's policy every ``ppo.snapshot_every`` steps, committed beside the run (over-optimization curves)."""


def snapshot_key(ppo_key: str, step: int) -> str:
    return stage_key(SNAPSHOT_STAGE, method_version("ppo"), {"step": step}, {"ppo": ppo_key})


def snapshots_complete(store: Any, ref: ArtifactRef, config: Any) -> bool:
    """Does the PPO artifact `ref` have a committed snapshot at every `snapshot_every` steps of its run?"""
    every = config_get(config, "snapshot_every", 0)
    steps = int(ref.metrics.get("steps", 0))
    return not every or all(
        store.get(SNAPSHOT_STAGE, snapshot_key(ref.key, s)) is not None for s in range(every, steps + 1, every)
    )


SFT_SNAPSHOT_STAGE = "sft_snapshot"
"""SFT's policy after each of ``sft.snapshot_epochs``, committed beside the run (the study's shorter-trained SFTs)."""


def sft_snapshot_key(sft_key: str, epochs: float) -> str:
    return stage_key(SFT_SNAPSHOT_STAGE, method_version("sft"), {"epochs": float(epochs)}, {"sft": sft_key})


def sft_snapshots_complete(store: Any, ref: ArtifactRef, config: Any) -> bool:
    """Does the SFT artifact `ref` have a committed snapshot after each of `snapshot_epochs`?"""
    return all(
        store.get(SFT_SNAPSHOT_STAGE, sft_snapshot_key(ref.key, e)) is not None
        for e in config_get(config, "snapshot_epochs", ())
    )


def _data_summary(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in metrics.items() if k != "seconds")


def _annotate_summary(m: dict[str, float]) -> str:
    line = f"output_2 preferred in {m['output_2_preferred']:.1%} of the pairs"
    if "requests" in m:  # API judges: what this run paid for
        line += (
            f"; {m['judged']:.0f} judged now, {m['cached']:.0f} from the cache, {m['noised']:.0f} label-noised; "
            f"{m['requests']:.0f} requests, ${m['cost_usd']:.4f}"
        )
    return line


# stages that sample: their outputs change with the sampler's random streams
SAMPLED = "+sampler" + declared_version("farmflow.models.sampling", "SAMPLER_VERSION")
LOSS = "loss {train_loss_first:.3f} -> {train_loss_last:.3f}"
RL = "{steps:.0f} steps, reward {reward_first:.3f} -> {reward_last:.3f}, KL {kl_first:.2f} -> {kl_last:.2f}"
UNLABELED = {"data": ("unlabeled",)}


def trained_on_pairs(method: Method) -> Stage:
    """The stage of a method the `METHODS` table wires alone (`Method.train`): SFT model + preferences → policy, its
    version the method module's ``VERSION``."""
    return Stage(
        method.name,
        method_version(method.name),
        ("preferences", "sft"),
        gpu=method.gpu,
        processes="all",
        summary="{examples:.0f} examples, {steps:.0f} steps, " + LOSS,
    )


STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        # --- the shared pipeline: data → base model → SFT → pairs → preferences → reward model
        Stage("data", f"1+synthetic{synthetic.VERSION}", summary=_data_summary),
        Stage(
            "base_model",
            "1",
            ("data",),
            reads=lambda c: {"data": () if config_get(c, "pretrained") else ("sft",)},
            summary="{parameters:.0f} parameters",
        ),
        Stage(
            "sft",
            method_version("sft"),
            ("data", "base"),
            reads=lambda c: {"data": ("sft",)},
            complete=sft_snapshots_complete,
            gpu=True,
            processes="all",
            summary="{steps:.0f} steps, " + LOSS + ", {train_tokens:.0f} tokens in {seconds:.1f}s",
        ),
        Stage(
            "sample_pairs",
            "1" + SAMPLED,
            ("data", "policy"),
            reads=lambda c: {"data": ("pref", "val")},
            gpu=True,
            summary="{identical_pairs:.0f} pairs with two identical outputs",
        ),
        Stage("annotate", "1", ("pairs",), summary=_annotate_summary),
        Stage(
            "human_preferences",
            "1",
            ("pairs",),
            summary="{labeled:.0f} of {pairs:.0f} pairs labeled ({labeled_pref:.0f} PREF)",
        ),
        Stage("subsample_preferences", "1", ("preferences",), summary="{pref_pairs:.0f} PREF pairs"),
        Stage(
            "train_reward",
            method_version("reward"),
            ("preferences", "sft"),
            gpu=True,
            processes="all",
            summary="held-out accuracy {heldout_accuracy:.3f} (un-noised labels {heldout_accuracy_unnoised:.3f}, "
            "gold {heldout_gold_accuracy:.3f})",
        ),
        # --- outputs and their evaluation
        Stage(
            "generate",
            "1" + SAMPLED,
            ("data", "policy"),
            reads=lambda c: {"data": ("eval",)},
            typed=generate_config,
            gpu=True,
        ),
        Stage(
            "write",
            f"1+synthetic{synthetic.VERSION}",
            ("data",),
            reads=lambda c: {"data": ("eval",)},
        ),
        Stage(
            "evaluate",
            EVAL_VERSION,
            ("outputs", "data"),
            reads=lambda c: {"data": ("eval",)},
            summary="win rate {win_rate:.1f} ± {standard_error:.1f}, mean gold {mean_gold:.3f}",
        ),
        # --- methods (farmflow.methods.*); those METHODS wires alone first
        *(trained_on_pairs(m) for m in METHODS.values() if m.train),
        Stage(
            "best_of_n",
            method_version("best_of_n") + SAMPLED,
            ("data", "policy", "reward"),
            reads=lambda c: {"data": (config_get(c, "split", "eval"),)},
            gpu=True,
            summary="mean reward {mean_reward:.3f}",
        ),
        Stage("best_of_n_prefix", "1", ("best_of_n", "reward"), summary="mean reward {mean_reward:.3f}"),
        Stage("best_of_n_rescore", "1", ("best_of_n", "reward"), gpu=True, summary="mean reward {mean_reward:.3f}"),
        Stage("reference_logps", method_version("dpo"), ("preferences", "sft"), gpu=True),
        Stage(
            "dpo",
            method_version("dpo"),
            ("preferences", "sft", "reference"),
            gpu=True,
            processes="all",
            summary="{pairs:.0f} pairs, " + LOSS + ", implicit reward accuracy {implicit_reward_accuracy_first:.2f} -> "
            "{implicit_reward_accuracy_last:.2f}",
        ),
        Stage(
            "expert_iteration",
            method_version("expert_iteration"),
            ("sft", "selections"),
            gpu=True,
            processes="all",
            summary="{examples:.0f} selections, " + LOSS,
        ),
        Stage(
            "ppo",
            method_version("ppo") + SAMPLED,
            ("data", "sft", "reward"),
            reads=lambda c: UNLABELED,
            complete=snapshots_complete,
            gpu=True,
            processes="all",
            summary=RL,
        ),
        Stage(
            "quark",
            method_version("quark") + SAMPLED,
            ("data", "sft", "reward"),
            reads=lambda c: UNLABELED,
            gpu=True,
            processes="all",
            summary=RL,
        ),
        # --- analysis
        Stage(
            "proxy_reward", "1", ("outputs", "reward"), gpu=True, summary="mean {mean_reward:.3f} over {n:.0f} outputs"
        ),
        Stage("overoptimization", "2", summary="{points:.0f} points"),
        Stage(
            "reward_report",
            "2",
            ("preferences", "sft", "reward"),
            gpu=True,
            summary="reward model {reward_model_labels:.3f}, policy log-likelihood {policy_loglik_labels:.3f}, "
            "longer output {longer_output_labels:.3f} against labels",
        ),
    )
}

VERSIONS: dict[str, str] = {name: s.version for name, s in STAGES.items()}
"""Stage name → code version (part of every stage key)."""

MULTI_PROCESS_STAGES = tuple(name for name, s in STAGES.items() if s.processes == "all")
"""Stages that `accelerate launch` starts on several processes (their loops split each batch; PPO, Quark: DDP only)."""
