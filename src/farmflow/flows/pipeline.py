"""The pipeline: the shared upstream stages (`Upstream`), each method's stages (`method_outputs`) and the fan-out.

Every flow runs the shared upstream stages (data → base model → SFT → pairs → annotation →
reward model, each only when a method needs it), then its methods' stages, generation on the
evaluation set and evaluation. Parallel methods share one `Upstream`: a stage two methods need
runs once (per-stage locks), and `fan_out` runs the methods' branches side by side.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any, Callable

from prefect import task
from prefect.cache_policies import NO_CACHE

from farmflow.config import METHODS, BestOfNConfig, ExecutionConfig, FarmConfig
from farmflow.flows.runner import StageRunner
from farmflow.storage import ArtifactRef, canonical_json
from farmflow.tasks import (
    annotate_task,
    base_model_task,
    best_of_n_task,
    data_task,
    generate_task,
    sample_pairs_task,
    sft_task,
    train_reward_task,
)
from farmflow.tasks.core import log
from farmflow.tasks.methods import TRAINED_ON_PAIRS, dpo_task, expert_iteration_task, reference_logps_task


def config_key(cfg: FarmConfig) -> str:
    """Short content hash of what a farm computes: the stage-key view of its sections (no operational fields such as
    batch sizes, backends or API limits), not its name, store, checkpoints or execution."""
    from farmflow.tasks.core import key_config

    sections = {
        name: getattr(cfg, name)
        for name in type(cfg).model_fields
        if name not in ("name", "store", "checkpoints", "execution")
    }
    payload = canonical_json(key_config(sections))
    return hashlib.sha256(payload.encode()).hexdigest()[:8]


BASELINES = ("untrained", "sft")
"""Evaluated in every flow for context: the randomly initialized model and the SFT model."""


class Upstream:
    """The shared stages every method builds on; each is run (or fetched from the cache) on first use."""

    def __init__(self, run: StageRunner, cfg: FarmConfig, given: dict[str, ArtifactRef] | None = None):
        """`given`: stages already at hand (e.g. ``{"preferences": a subset}``), used instead of running them."""
        self.run, self.cfg = run, cfg
        self._refs: dict[str, ArtifactRef] = dict(given or {})
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def _get(self, name: str, make) -> ArtifactRef:
        with self._guard:  # one lock per stage: parallel methods wait for a shared stage instead of running it twice
            lock = self._locks.setdefault(name, threading.Lock())
        with lock:
            if name not in self._refs:
                self._refs[name] = make()
        return self._refs[name]

    @property
    def data(self) -> ArtifactRef:
        return self._get("data", lambda: self.run(data_task, self.cfg.data))

    @property
    def base(self) -> ArtifactRef:
        return self._get("base", lambda: self.run(base_model_task, self.cfg.model, data=self.data))

    @property
    def sft(self) -> ArtifactRef:
        return self._get(
            "sft",
            lambda: self.run(sft_task, self.cfg.sft, data=self.data, base=self.base, checkpoints=self.cfg.checkpoints),
        )

    @property
    def preferences(self) -> ArtifactRef:
        def make() -> ArtifactRef:
            pairs = self.run(sample_pairs_task, self.cfg.pairs, data=self.data, policy=self.sft)
            if self.cfg.annotation.kind == "human":  # the paper's human arm: a person's labels of these pairs
                from farmflow.tasks.preferences import human_config, human_preferences_task

                config = human_config(self.run.store, self.cfg.annotation.labeler)
                return self.run(human_preferences_task, config, pairs=pairs)
            return self.run(annotate_task, self.cfg.annotation, pairs=pairs)

        return self._get("preferences", make)

    @property
    def reward_backbone(self) -> ArtifactRef:
        """The model the reward model starts from: the SFT policy, or `reward.backbone`'s own base model fine-tuned on
        the same split (its stages are labelled "base_model reward" and "sft reward"), or with ``fine_tune=False`` that
        pretrained base model as it is."""
        backbone = self.cfg.reward.backbone
        if backbone is None:
            return self.sft

        def make() -> ArtifactRef:
            base = self.run(base_model_task, backbone.model, "base_model reward", data=self.data)
            if not backbone.fine_tune:
                return base
            sft = (backbone.sft or self.cfg.sft).model_copy(update={"snapshot_epochs": ()})
            return self.run(sft_task, sft, "sft reward", data=self.data, base=base, checkpoints=self.cfg.checkpoints)

        return self._get("reward_backbone", make)

    @property
    def reward(self) -> ArtifactRef:
        return self._get(
            "reward",
            lambda: self.run(
                train_reward_task,
                self.cfg.reward,
                preferences=self.preferences,
                sft=self.reward_backbone,
                checkpoints=self.cfg.checkpoints,
            ),
        )

    def refs(self) -> dict[str, ArtifactRef]:
        return dict(self._refs)


def generate_outputs(up: Upstream, policy: ArtifactRef, generator: str, control: str = "") -> ArtifactRef:
    """The evaluation-set outputs of `policy`, named `generator` in the outputs table and the stage's label."""
    config = {"sample": up.cfg.generation, "generator": generator, "control": control}
    return up.run(generate_task, config, f"generate {generator}", data=up.data, policy=policy)


def best_of_n_outputs(
    up: Upstream, policy: ArtifactRef, cfg: BestOfNConfig, split: str, label: str, max_prompts: int | None = None
) -> ArtifactRef:
    config = {
        "best_of_n": cfg,
        "max_new_tokens": up.cfg.generation.max_new_tokens,
        "split": split,
        "max_prompts": max_prompts,
    }
    return up.run(
        best_of_n_task,
        config,
        label,
        data=up.data,
        policy=policy,
        reward=up.reward,
        backend=up.cfg.generation.backend,
        batch_size=up.cfg.generation.batch_size,
    )


def method_outputs(up: Upstream, method: str) -> ArtifactRef:
    """Train `method` (from the shared upstream artifacts) and return its evaluation-set outputs."""
    cfg, run, ck = up.cfg, up.run, up.cfg.checkpoints
    if method == "untrained":
        return generate_outputs(up, up.base, "untrained")
    if method == "sft":
        return generate_outputs(up, up.sft, "sft")
    if method in TRAINED_ON_PAIRS:  # wired by its METHODS entry alone: SFT + PREF pairs → policy → generate
        section, control = getattr(cfg, method), METHODS[method].control
        policy = run(TRAINED_ON_PAIRS[method], section, preferences=up.preferences, sft=up.sft, checkpoints=ck)
        return generate_outputs(up, policy, method, control=getattr(section, control) if control else "")
    if method == "dpo":
        reference = run(
            reference_logps_task, {}, preferences=up.preferences, sft=up.sft, batch_size=cfg.generation.batch_size
        )
        return generate_outputs(
            up,
            run(dpo_task, cfg.dpo, preferences=up.preferences, sft=up.sft, reference=reference, checkpoints=ck),
            "dpo",
        )
    if method == "best_of_n":
        return best_of_n_outputs(up, up.sft, cfg.best_of_n, "eval", "best_of_n")
    if method == "expert_iteration":
        ei = cfg.expert_iteration
        bon = BestOfNConfig(n=ei.n, temperature=ei.temperature, top_p=ei.top_p, seed=ei.seed)
        policy = up.sft
        for r in range(1, ei.rounds + 1):
            # each round its own sample streams (round 1 keeps the seed): with the same seed, round r's policy would
            # redraw from round 1's random numbers and largely re-propose its candidates
            round_bon = bon if r == 1 else bon.model_copy(update={"seed": round_seed(ei.seed, r)})
            selections = best_of_n_outputs(
                up, policy, round_bon, "unlabeled", f"expert_iteration select {r}", ei.max_prompts
            )
            policy = run(
                expert_iteration_task,
                ei.train,
                f"expert_iteration train {r}",
                sft=up.sft,
                selections=selections,
                checkpoints=ck,
            )
        return generate_outputs(up, policy, "expert_iteration")
    if method in ("ppo", "quark"):
        from farmflow.tasks import rl

        task = rl.ppo_task if method == "ppo" else rl.quark_task
        policy = run(task, getattr(cfg, method), data=up.data, sft=up.sft, reward=up.reward, checkpoints=ck)
        return generate_outputs(up, policy, method)
    raise ValueError(f"unknown method {method!r}; known: {', '.join((*BASELINES, *METHODS))}")


def round_seed(seed: int, r: int) -> int:
    """The candidate sampler's seed in expert-iteration round `r` (1-based): `seed` itself in round 1."""
    return seed if r == 1 else seed + 1_000_003 * (r - 1)


def method_label(cfg: FarmConfig, method: str) -> str:
    """The leaderboard name of a method (best-of-n carries its n)."""
    return f"best_of_{cfg.best_of_n.n}" if method == "best_of_n" else method


PREFERENCE_METHODS = tuple(m.name for m in METHODS.values() if m.learns_from == "preferences")
"""Methods that need the annotated pairs only (no reward model)."""
REWARD_METHODS = tuple(m.name for m in METHODS.values() if m.learns_from == "reward model")
"""Methods that need the reward model."""


def shared_upstream(up: Upstream, methods: list[str] | tuple[str, ...]) -> None:
    """Run (or fetch) the upstream stages the methods share, before they fan out."""
    needed = ["base", "sft"]  # the baselines
    if any(m in REWARD_METHODS for m in methods):
        needed.append("reward")
    elif any(m in PREFERENCE_METHODS for m in methods):
        needed.append("preferences")
    for name in needed:
        getattr(up, name)


@task(name="method", task_run_name="method {branch}", cache_policy=NO_CACHE, persist_result=False)
def _branch_task(work: Callable[[str], Any], branch: str) -> Any:
    """One method's stages (train, generate, evaluate) as a task run, so the UI shows each branch and its time."""
    return work(branch)


def fan_out(branches: list[str], work: Callable[[str], Any], execution: ExecutionConfig) -> dict[str, Any]:
    """`work(branch)` for every branch, at most `execution.max_parallel_methods` at once (threads).

    Every branch finishes (and its artifacts are committed) before the first error is raised.
    """
    parallel = min(execution.max_parallel_methods, len(branches))
    if parallel <= 1:  # one at a time, with the same promise: a failure does not skip the branches after it
        results, errors = {}, {}
        for b in branches:
            try:
                results[b] = work(b)
            except Exception as err:  # noqa: BLE001 - raised below, once every branch has run
                errors[b] = err
        if errors:
            log("methods failed: %s; the others finished and are cached", ", ".join(errors))
            raise next(iter(errors.values()))
        return results
    from prefect.task_runners import ThreadPoolTaskRunner

    with ThreadPoolTaskRunner(max_workers=parallel) as runner:
        futures = {b: runner.submit(_branch_task, {"work": work, "branch": b}) for b in branches}
        for future in futures.values():
            future.wait()
        states = {b: f.state for b, f in futures.items()}
    failed = [b for b, st in states.items() if not st.is_completed()]
    if failed:
        log("methods failed: %s; the others finished and are cached", ", ".join(failed))
    return {b: st.result() for b, st in states.items()}  # raises the first failure
