"""How much feedback is enough: the reward-model methods trained on 1/8, 1/4, 1/2 and all of the preference pairs.

The shared stages (data → base → SFT → pairs → preferences) run once. Each share of the PREF pairs is its own
``subsample_preferences`` artifact (nested: a smaller share is part of every larger one, the val pairs are kept whole
for the reward model's held-out accuracy), so each size is cached like any stage; "all" is the preferences artifact
itself, so its points are the compare flow's. On each share the methods train as in the compare flow (best-of-n: a
reward model on that share, then reranking; DPO: on that share directly) and are evaluated with the farm's evaluation
annotator. The SFT model is the zero-pairs point. One ``feedback`` artifact holds the table, ``feedback.md`` and
``feedback.png`` (win rate against the number of pairs, one line per method).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
from prefect import flow
from prefect.artifacts import create_markdown_artifact

from farmflow.config import METHODS as METHOD_NAMES
from farmflow.config import FarmConfig
from farmflow.flows.form import PresetName, prefect_run_name, run_config
from farmflow.flows.pipeline import REWARD_METHODS, Upstream, method_label, method_outputs
from farmflow.flows.runner import StageRunner
from farmflow.storage import ArtifactRef, stage_key
from farmflow.storage.schemas import SCHEMAS
from farmflow.tasks import evaluate_task
from farmflow.tasks.preferences import subsample_preferences_task

FRACTIONS = (0.125, 0.25, 0.5, 1.0)
METHODS = ("best_of_n", "dpo")
"""The reward-model methods: best-of-n (through a reward model) and DPO (its implicit reward model)."""


def pref_pairs(run: StageRunner, preferences: ArtifactRef) -> int:
    return sum(s == "pref" for s in run.store.read_table(preferences).column("split").to_pylist())


def study_points(
    cfg: FarmConfig, methods: tuple[str, ...] = METHODS, fractions: tuple[float, ...] = FRACTIONS
) -> tuple[list[dict], StageRunner]:
    """One point per (method, share of the pairs), plus the SFT model at zero pairs: win rate ± SE, mean gold, pairs,
    the reward model's held-out accuracy where one was trained, the evaluation's key."""
    run = StageRunner(cfg.store.location, cfg.execution, cfg.name)
    full = Upstream(run, cfg)
    shared = {"data": full.data, "base": full.base, "sft": full.sft}
    sft_eval = run(
        evaluate_task, cfg.evaluation.annotator, "evaluate sft", outputs=method_outputs(full, "sft"), data=full.data
    )
    points = [point("sft", 0.0, 0, sft_eval)]
    for fraction in sorted(set(fractions)):
        subset = (
            full.preferences
            if fraction == 1
            else run(
                subsample_preferences_task,
                {"fraction": fraction, "seed": cfg.data.seed},
                f"subsample_preferences {fraction:g}",
                preferences=full.preferences,
            )
        )
        up = Upstream(run, cfg, given={**shared, "preferences": subset})
        pairs = pref_pairs(run, subset)
        for m in methods:
            name = method_label(cfg, m)
            outputs = method_outputs(up, m)
            ev = run(
                evaluate_task,
                cfg.evaluation.annotator,
                f"evaluate {name} ({pairs} pairs)",
                outputs=outputs,
                data=full.data,
            )
            extra = {}
            if m in REWARD_METHODS:
                extra["reward_accuracy"] = up.refs()["reward"].metrics.get("heldout_accuracy", math.nan)
            points.append(point(name, fraction, pairs, ev) | extra)
    return points, run


def point(method: str, fraction: float, pairs: int, evaluation: ArtifactRef) -> dict:
    m = evaluation.metrics
    return {
        "method": method,
        "fraction": fraction,
        "pairs": pairs,
        "win_rate": m["win_rate"],
        "standard_error": m["standard_error"],
        "mean_gold": m.get("mean_gold", math.nan),
        "reward_accuracy": math.nan,
        "evaluation_key": evaluation.key,
    }


def feedback_markdown(points: list[dict], title: str) -> str:
    num = lambda x, f: "—" if x is None or x != x else format(x, f)  # noqa: E731
    lines = [
        f"### {title}",
        "",
        "| method | share of pairs | PREF pairs | win rate | ± SE | mean gold | reward model held-out accuracy |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in points:
        lines.append(
            f"| {p['method']} | {p['fraction']:g} | {p['pairs']} | {num(p['win_rate'], '.1f')} "
            f"| {num(p['standard_error'], '.1f')} | {num(p['mean_gold'], '.3f')} | {num(p['reward_accuracy'], '.3f')} |"
        )
    return "\n".join(lines) + "\n"


def plot_feedback(points: list[dict], path: str, title: str) -> None:
    """Win rate ± SE (left) and mean gold reward (right, synthetic farm) against the number of PREF pairs (log2
    axis), one line per method; the zero-pairs point (SFT) as a dashed level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gold = any(p["mean_gold"] == p["mean_gold"] for p in points)
    fig, axes = plt.subplots(1, 2 if gold else 1, figsize=(9 if gold else 5.5, 3.8), dpi=90, squeeze=False)
    panels = [("win_rate", "win rate vs reference (%), ± 1 SE")] + ([("mean_gold", "mean gold reward")] if gold else [])
    for ax, (field, label) in zip(axes[0], panels):
        for method in dict.fromkeys(p["method"] for p in points if p["pairs"]):
            mine = sorted((p for p in points if p["method"] == method), key=lambda p: p["pairs"])
            err = [0 if p["standard_error"] != p["standard_error"] else p["standard_error"] for p in mine]
            ax.errorbar(
                [p["pairs"] for p in mine],
                [p[field] for p in mine],
                yerr=err if field == "win_rate" else None,
                marker="o",
                capsize=3,
                label=method,
            )
        for p in points:
            if not p["pairs"]:
                ax.axhline(p[field], color="grey", ls="--", lw=1, label=f"{p['method']} (no pairs)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("preference pairs trained on (PREF split)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def commit_study(run: StageRunner, points: list[dict], title: str) -> ArtifactRef:
    """The ``feedback`` artifact: the points (Parquet), feedback.md and feedback.png; keyed by its evaluations."""
    key = stage_key("feedback", "2", {"title": title, "points": [p["evaluation_key"] for p in points]})
    ref = run.store.get("feedback", key)
    if ref is None:
        with tempfile.TemporaryDirectory() as tmp:
            plot_feedback(points, f"{tmp}/feedback.png", title)
            png = Path(f"{tmp}/feedback.png").read_bytes()
        ref = run.store.put_table(
            "feedback",
            key,
            pa.Table.from_pylist(points, schema=SCHEMAS["feedback"]),
            "feedback",
            config={"title": title},
            extra_files={"feedback.md": feedback_markdown(points, title).encode(), "feedback.png": png},
        )
    return ref


@flow(name="feedback-size", flow_run_name=prefect_run_name, log_prints=True)
def feedback_flow(
    preset: PresetName | None = None,
    methods: list[str] | None = None,
    fractions: list[float] | None = None,
    overrides: list[str] | None = None,
    advanced: FarmConfig | None = None,
) -> dict[str, Any]:
    """The reward-model methods (default best-of-n and DPO) on 1/8, 1/4, 1/2 and all of the preference pairs: win
    rate against the number of pairs (table + plot, also a Prefect markdown artifact)."""
    cfg = run_config(preset, advanced, overrides)
    chosen = tuple(methods or METHODS)
    unknown = [m for m in chosen if m not in METHOD_NAMES]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; known: {', '.join(METHOD_NAMES)}")
    points, run = study_points(cfg, chosen, tuple(fractions or FRACTIONS))
    title = f"Win rate vs preference pairs ({cfg.name})"
    ref = commit_study(run, points, title)
    markdown = feedback_markdown(points, title)
    create_markdown_artifact(markdown + f"\nTable and plot (feedback.png): `{ref.uri}`\n", key="feedback-size")
    return {"preset": cfg.name, "points": points, "markdown": markdown, "artifact": ref.uri, "stages": run.timings}
