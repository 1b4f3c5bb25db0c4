"""Replicated comparisons: the same experiment under K seeds, one leaderboard with intervals.

Replicate r (0-based) is the farm config with every seed shifted by ``SEED_STEP · r`` (`replicate_config`): model
initialization, SFT data order, pair sampling, annotator assignment and label noise, the reward model, every method's
sampling and training, generation and the evaluation judges. The data section keeps its seed, so every replicate
trains on the same instructions and is judged on the same evaluation prompts (the pairing of the bootstrap).
Replicate 0 is the config itself, so its stage keys are those of an unreplicated run and it comes from the cache
when that ran. With ``evaluation.replicate_sft`` False the base model and SFT keep their seeds too (and so does a
`reward.backbone`'s): every replicate starts from replicate 0's SFT model (cheaper; the intervals then leave SFT's own
variance out). Each replicate's
stages are ordinary stages with their own keys, so K = 3 after K = 2 runs only the third replicate.

`run_replicates` runs the replicates one after the other (each one's methods fan out as in `run_methods`), then
`replicate_board_task` builds the leaderboard with intervals (`farmflow.evaluation.replicates`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext

from farmflow.config import FarmConfig
from farmflow.evaluation.bootstrap import N_BOOT
from farmflow.evaluation.leaderboard import leaderboard_rows
from farmflow.evaluation.replicates import interval_markdown, interval_rows, plot_intervals
from farmflow.flows.form import KEPT_SEEDS, map_seeds
from farmflow.flows.pipeline import (
    BASELINES,
    Upstream,
    config_key,
    fan_out,
    method_label,
    method_outputs,
    shared_upstream,
)
from farmflow.flows.record import history_task, record_run_task
from farmflow.flows.runner import StageRunner
from farmflow.storage import ArtifactRef, open_store, stage_key
from farmflow.storage.schemas import SCHEMAS
from farmflow.tasks import evaluate_task, reward_model_summary
from farmflow.tasks.analysis import board_entry

SEED_STEP = 1000
"""Replicate r adds SEED_STEP · r to every seed it shifts (far from the small seeds people pick by hand)."""
SFT_SECTIONS = ("model", "sft", "reward.backbone")
"""The sections (dotted paths) whose seeds make an SFT model, the policy's and the reward model's own backbone's
(kept when ``evaluation.replicate_sft`` is False)."""


def replicate_config(cfg: FarmConfig, r: int) -> FarmConfig:
    """Replicate `r` of `cfg`: every ``seed`` field shifted by SEED_STEP · r, except the data section's (and the base
    model's and SFT's, the reward backbone's among them, when ``evaluation.replicate_sft`` is False). Replicate 0 is
    `cfg` itself."""
    if r < 0:
        raise ValueError(f"replicate index must be ≥ 0, got {r}")
    if r == 0:
        return cfg
    kept = set(KEPT_SEEDS) | (set() if cfg.evaluation.replicate_sft else set(SFT_SECTIONS))
    return map_seeds(cfg, lambda seed: seed + SEED_STEP * r, kept)


def replicate_evaluations(
    run: StageRunner, cfg: FarmConfig, methods: list[str] | tuple[str, ...], r: int
) -> tuple[Upstream, dict[str, tuple[ArtifactRef, ArtifactRef]]]:
    """Replicate `r`: the baselines and `methods` trained, generated and evaluated; {label: (outputs, evaluation)}."""
    cfg_r = replicate_config(cfg, r)
    up = Upstream(run, cfg_r)
    shared_upstream(up, methods)
    names = {m: method_label(cfg_r, m) for m in (*BASELINES, *methods)}
    tag = f" [replicate {r}]" if r else ""

    def branch(m: str) -> tuple[ArtifactRef, ArtifactRef]:
        outputs = method_outputs(up, m)
        label = f"evaluate {names[m]}{tag}"
        return outputs, run(evaluate_task, cfg_r.evaluation.annotator, label, outputs=outputs, data=up.data)

    done = fan_out(list(names), branch, cfg.execution)
    return up, {names[m]: done[m] for m in names}


def publish_board(markdown: str, rows: list[dict], uri: str, title: str) -> None:
    """The replicated leaderboard as Prefect markdown and table artifacts (keys leaderboard, leaderboard-table)."""
    create_markdown_artifact(
        markdown + f"\nParquet, Markdown and plot: `{uri}`\n", key="leaderboard", description=title
    )
    cols = (
        "method",
        "win_rate",
        "win_rate_low",
        "win_rate_high",
        "diff_to_sft",
        "diff_low",
        "diff_high",
        "resolved",
        "rank_best",
        "rank_worst",
        "mean_gold",
        "replicates",
        "n",
    )
    create_table_artifact(
        [{k: (None if r[k] != r[k] else r[k]) for k in cols} for r in rows], key="leaderboard-table", description=title
    )


@task(name="replicate_leaderboard", cache_policy=NO_CACHE, persist_result=False)
def replicate_board_task(
    store_uri: str, evaluations: list[dict[str, ArtifactRef]], title: str, n_boot: int = N_BOOT
) -> ArtifactRef:
    """The leaderboard of replicated evaluations (`evaluations[r]`: method → evaluate artifact of replicate r):
    a ``replicate_leaderboard`` table, ``leaderboard.md`` and ``leaderboard.png``; Prefect artifacts inside a flow.

    Each replicate's own leaderboard rows (LC win rate with difficulties pooled over that replicate's board) are
    averaged; intervals come from the bootstrap over the evaluation rows (`farmflow.evaluation.replicates`). Computed
    when its key (evaluations, title, draws) is new, read back from the store otherwise."""
    store = open_store(store_uri)
    flat = {f"{m}@{r}": ref for r, evs in enumerate(evaluations) for m, ref in evs.items()}
    key = stage_key("replicate_leaderboard", "1", {"title": title, "n_boot": n_boot}, flat)
    ref = store.get("replicate_leaderboard", key)
    if ref is not None:
        rows = store.read_table(ref).to_pylist()
        markdown = store.read_file(ref, "leaderboard.md").decode()
    else:
        tables = {name: store.read_table(ref).to_pylist() for name, ref in flat.items()}
        boards = [
            leaderboard_rows(
                [
                    board_entry(store, method, ref, store.record(ref), tables[f"{method}@{r}"], "board")
                    for method, ref in evs.items()
                ]
            )
            for r, evs in enumerate(evaluations)
        ]
        per_method = {m: [tables[f"{m}@{r}"] for r in range(len(evaluations))] for m in evaluations[0]}
        rows = interval_rows(boards, per_method, n_boot=n_boot)
        markdown = interval_markdown(rows, title)
        with tempfile.TemporaryDirectory() as tmp:
            plot_intervals(rows, f"{tmp}/leaderboard.png", title)
            png = Path(f"{tmp}/leaderboard.png").read_bytes()
        ref = store.put_table(
            "replicate_leaderboard",
            key,
            pa.Table.from_pylist(rows, schema=SCHEMAS["replicate_leaderboard"]),
            "replicate_leaderboard",
            inputs=flat,
            metrics={"replicates": float(len(evaluations))},
            extra_files={"leaderboard.md": markdown.encode(), "leaderboard.png": png},
        )
    if TaskRunContext.get() is not None:
        publish_board(markdown, rows, ref.uri, title)
    return ref


def run_replicates(
    cfg: FarmConfig, methods: list[str] | tuple[str, ...], title: str, replicates: int, history: bool = False
) -> dict[str, Any]:
    """Baselines plus `methods` under `replicates` seeds (module doc), one leaderboard with intervals.

    Returns the summary `run_methods` returns (its ``leaderboard`` the replicated rows) plus ``replicates`` and
    ``markdown`` (the interval table). The run is recorded in the store's runs table like any comparison; with
    `history`, the preset's trend is published (its flags compare the bootstrap SEs, seed variance included)."""
    if replicates < 1:
        raise ValueError(f"replicates must be ≥ 1, got {replicates}")
    run = StageRunner(cfg.store.location, cfg.execution, cfg.name)
    evaluations, first = [], None
    for r in range(replicates):
        up, done = replicate_evaluations(run, cfg, methods, r)
        first = first or up
        evaluations.append({name: ev for name, (_, ev) in done.items()})
    board = replicate_board_task(run.store_uri, evaluations, title)
    refs = first.refs()
    summary = {
        "preset": cfg.name,
        "config_key": config_key(cfg),
        "replicates": replicates,
        "store": str(run.store.root),
        "leaderboard": run.store.read_table(board).to_pylist(),
        "markdown": run.store.read_file(board, "leaderboard.md").decode(),
        "reference_mean_gold": next(iter(evaluations[0].values())).metrics.get("reference_mean_gold"),
        "reward_model": reward_model_summary(refs["reward"].metrics) if "reward" in refs else {},
        "stages": run.timings,
        "artifacts": {
            **{name: ref.uri for name, ref in refs.items() if name in ("sft", "reward", "preferences")},
            "leaderboard": board.uri,
        },
    }
    summary["run"] = record_run_task(run.store_uri, board, cfg.name, summary["config_key"], history)
    if history and (published := history_task(run.store_uri, cfg.name)) is not None:
        summary["artifacts"]["history"] = published.uri
    return summary
