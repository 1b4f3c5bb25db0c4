"""Prefect flows: they only wire stage tasks together (see `farmflow.tasks`).

`best_of_n_flow` runs data → base model → SFT → pairs → annotation → reward model →
best-of-n, and evaluates the untrained model, SFT and best-of-n against the reference
outputs. Every stage is cached by its stage key: a rerun with the same config executes
nothing, a changed `best_of_n.n` reruns best-of-n and its evaluation only.

Prefect's result records (the persisted `ArtifactRef`s) are kept inside the store under
``_prefect/``, so wiping the store also wipes Prefect's cache, and a cached ref whose
artifact has disappeared from the store is recomputed instead of trusted.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow

from farmflow.config import FarmConfig, load_config
from farmflow.storage import ArtifactRef, open_store
from farmflow.tasks import (
    annotate_task, base_model_task, best_of_n_task, data_task, evaluate_task, generate_task, leaderboard_task,
    sample_pairs_task, sft_task, train_reward_task,
)


class StageRunner:
    """Runs stage tasks against one store and records, per stage, seconds and cache hits."""

    def __init__(self, store_uri: str):
        self.store_uri = store_uri
        self.store = open_store(store_uri)
        self.result_storage = self.store.root / "_prefect"  # a Path: local result storage, no block to save
        self.timings: list[dict[str, Any]] = []

    def __call__(self, task, config: Any, label: str | None = None, **inputs: ArtifactRef) -> ArtifactRef:
        bound = task.with_options(result_storage=self.result_storage)
        start = time.perf_counter()
        state = bound(self.store_uri, config, return_state=True, **inputs)
        ref: ArtifactRef = state.result()
        if not self.store.exists(ref):  # Prefect remembered a result the store no longer has
            state = bound.with_options(refresh_cache=True)(self.store_uri, config, return_state=True, **inputs)
            ref = state.result()
        seconds = time.perf_counter() - start
        started = time.time() - seconds
        cached = state.name == "Cached" or _created_before(ref, started)
        self.timings.append({"stage": label or task.name, "key": ref.key, "seconds": seconds, "cached": cached})
        return ref


def _created_before(ref: ArtifactRef, epoch: float) -> bool:
    from datetime import datetime

    return datetime.fromisoformat(ref.created).timestamp() < epoch


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    cfg = flow_run.parameters.get("config")
    name = cfg.get("name") if isinstance(cfg, dict) else getattr(cfg, "name", None)
    return f"best-of-n/{name or flow_run.parameters.get('preset')}"


@flow(name="best-of-n", flow_run_name=_flow_run_name, log_prints=True)
def best_of_n_flow(config: FarmConfig | None = None, preset: str = "synthetic-tiny") -> dict[str, Any]:
    """SFT → pairs → simulated preferences → reward model → best-of-n, all evaluated.

    Pass a full `config`, or just the name of a `preset` (used when config is None).
    Returns a JSON-able summary: leaderboard rows, reward-model metrics, per-stage timing.
    """
    cfg = config if config is not None else load_config(preset)
    run = StageRunner(cfg.store.uri)

    data = run(data_task, cfg.data)
    base = run(base_model_task, cfg.model, data=data)
    sft = run(sft_task, cfg.sft, data=data, base=base)
    pairs = run(sample_pairs_task, cfg.pairs, data=data, policy=sft)
    prefs = run(annotate_task, cfg.annotation, pairs=pairs)
    reward = run(train_reward_task, cfg.reward, preferences=prefs, sft=sft)

    outputs = {
        "untrained": run(generate_task, {"sample": cfg.generation, "generator": "untrained"}, "generate untrained", data=data, policy=base),
        "sft": run(generate_task, {"sample": cfg.generation, "generator": "sft"}, "generate sft", data=data, policy=sft),
        f"best_of_{cfg.best_of_n.n}": run(
            best_of_n_task,
            {"best_of_n": cfg.best_of_n, "max_new_tokens": cfg.generation.max_new_tokens, "batch_size": cfg.generation.batch_size},
            data=data, policy=sft, reward=reward,
        ),
    }
    evaluations = {m: run(evaluate_task, cfg.evaluation.annotator, f"evaluate {m}", outputs=o, data=data) for m, o in outputs.items()}
    board = leaderboard_task(run.store_uri, evaluations)
    rows = run.store.read_table(board).to_pylist()
    return {
        "preset": cfg.name,
        "store": str(run.store.root),
        "leaderboard": rows,
        "reference_mean_gold": next(iter(evaluations.values())).metrics.get("reference_mean_gold"),
        "reward_model": {k: v for k, v in reward.metrics.items() if k.startswith("heldout")},
        "stages": run.timings,
        "artifacts": {name: ref.uri for name, ref in {"sft": sft, "reward": reward, "preferences": prefs, "leaderboard": board}.items()},
    }
