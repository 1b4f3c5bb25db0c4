"""Over-optimization curves (AlpacaFarm Fig. 5 and 12).

As optimization pressure against a learned (proxy) reward grows, the proxy reward keeps
rising while the true quality first rises, then falls. A curve is a list of *points*;
a point is one optimization pressure with its evaluation-set outputs:

* best-of-n: pressure n (n = 1, 2, 4, ...), the reward model picks 1 of n samples;
* PPO (or Quark): pressure = training steps of a checkpoint (or its KL to SFT).

For each point we record the proxy reward (the reward model's mean score of the outputs),
the simulated win rate against the reference outputs under each evaluating annotator, and
in the synthetic farm the gold reward. A curve belongs to a *labeller*: the annotator whose
labels of the PREF pairs trained the reward model being optimized. The paper (Fig. 5)
contrasts p_sim^ann (the noisy pool) with a single greedy annotator (p_sim^GPT-4), each
labelling, being optimized against and judging; `greedy_oracle` is the synthetic farm's
analogue of the latter.

Plain functions here; the stages are in `farmflow.tasks.analysis`, the flow in
`farmflow.flows.overoptimization`.
"""

from __future__ import annotations

import math
from typing import Sequence

from pydantic import BaseModel, Field

from farmflow.config import AnnotatorConfig, OracleAnnotatorConfig
from farmflow.storage import ArtifactRef


def greedy_oracle(seed: int = 0) -> AnnotatorConfig:
    """One oracle annotator without noise: the offline analogue of p_sim^GPT-4 (temperature 0).

    Its logit is 1000 × (gold difference + 0.01·tanh(length difference / 40 chars)), so a gold
    difference of 0.02 or more decides the label all but surely (at least 20 logits against a
    length term of at most 10: its quality judgement is deterministic), and on equal gold the
    label is drawn with the longer output favoured, as LLM judges favour length: 5 characters
    longer wins with probability 0.78, 40 with 0.9995. The draw on ties carries no quality, so a
    reward model's gold errors against this labeller are its own. No label noise, no position
    bias.
    """
    return AnnotatorConfig(
        pool=[OracleAnnotatorConfig(name="greedy", sharpness=1000.0, length_bias=10.0)], label_noise=0.0, seed=seed
    )


GREEDY_ORACLE = greedy_oracle()
"""The named single greedy annotator (p_sim^GPT-4's analogue in the synthetic farm)."""
LABELLERS = ("p_sim^ann", "greedy")
"""Paper Fig. 5: the noisy pool (over-optimizes) and the single low-variance annotator (does not), each labelling and
judging its own curve."""
ANNOTATOR_NAMES = ("p_sim^ann", "greedy", "p_sim^eval")
"""Who can label or judge a curve: the farm's annotation pool, `GREEDY_ORACLE`, the farm's evaluation pool."""


def annotator_labels(names: Sequence[str]) -> dict[str, str]:
    """Each name as its label in `ANNOTATOR_NAMES` (the preset spelling p_sim_ann / p_sim_eval is accepted too);
    an unknown name is a ValueError naming it."""
    label = {n: n.replace("p_sim_", "p_sim^", 1) if n.startswith("p_sim_") else n for n in names}
    unknown = [n for n in names if label[n] not in ANNOTATOR_NAMES]
    if unknown:
        raise ValueError(f"unknown annotator(s) {unknown}; known: {', '.join(ANNOTATOR_NAMES)}")
    return label


class CurvePoint(BaseModel):
    """One optimization pressure on an over-optimization curve."""

    label: str = Field(description="Name of the point, e.g. 'best_of_16' or 'ppo step 200'.")
    family: str = Field(
        description="Method whose pressure this is: 'best_of_n', 'ppo', 'quark', ... (one line per family)."
    )
    pressure: float = Field(description="Optimization pressure: n for best-of-n, training steps (or KL) for PPO.")
    outputs: ArtifactRef = Field(
        description="The point's evaluation-set outputs (an 'outputs' table: one per eval instruction)."
    )


def curve_rows(points: Sequence[dict]) -> list[dict]:
    """Rows of the ``overoptimization`` table, one per (point, annotator), by labeller, family, pressure.

    Each point: label, labeller (whose labels trained the reward model), family, pressure,
    outputs_key, proxy_reward, and evaluations:
    {annotator label: {"key": evaluate key, "metrics": the evaluate stage's metrics}}.
    """
    rows = []
    for p in points:
        for annotator, ev in p["evaluations"].items():
            m = ev["metrics"]
            rows.append(
                {
                    "labeller": p["labeller"],
                    "label": p["label"],
                    "family": p["family"],
                    "pressure": float(p["pressure"]),
                    "annotator": annotator,
                    "proxy_reward": float(p["proxy_reward"]),
                    "win_rate": m["win_rate"],
                    "standard_error": m["standard_error"],
                    "lc_win_rate": m.get("lc_win_rate", math.nan),
                    "mean_gold": m.get("mean_gold", math.nan),
                    "avg_length": int(m["avg_length"]),
                    "n": int(m["n_total"]),
                    "outputs_key": p["outputs_key"],
                    "evaluation_key": ev["key"],
                }
            )
    rows.sort(key=lambda r: (r["labeller"], r["family"], r["pressure"], r["annotator"]))
    return rows


def _f(x: float, fmt: str) -> str:
    return "—" if x is None or math.isnan(x) else format(x, fmt)


def curve_markdown(rows: Sequence[dict], title: str = "Over-optimization") -> str:
    """One line per point: labeller, pressure, proxy reward, gold reward, then win rate ± SE under each annotator."""
    annotators = list(dict.fromkeys(r["annotator"] for r in rows))
    points: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        points.setdefault((r["labeller"], r["family"], r["pressure"], r["label"]), {})[r["annotator"]] = r
    head = (
        "| labeller | point | pressure | proxy reward | mean gold | avg length | "
        + " | ".join(f"win rate ({a})" for a in annotators)
        + " |"
    )
    lines = [f"### {title}", "", head, "|---|---|---:|---:|---:|---:|" + "---:|" * len(annotators)]
    for (labeller, family, pressure, label), per in points.items():
        any_row = next(iter(per.values()))
        cells = [
            f"{_f(per[a]['win_rate'], '.1f')} ± {_f(per[a]['standard_error'], '.1f')}" if a in per else "—"
            for a in annotators
        ]
        lines.append(
            f"| {labeller} | {label} | {pressure:g} | {any_row['proxy_reward']:.3f} | "
            f"{_f(any_row['mean_gold'], '.3f')} | {any_row['avg_length']} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


def label_pressures(ax, line: Sequence[dict], y: str, prefix: str = "") -> None:
    """Label each point of a curve (x: proxy reward, y: the row's `y`) with its pressure (n, step...)."""
    for r in line:
        at = (r["proxy_reward"], r[y])
        ax.annotate(f"{prefix}{r['pressure']:g}", at, textcoords="offset points", xytext=(3, 3), fontsize=6)


def draw_win_rates(ax, line: Sequence[dict], prefix: str = "", **style) -> None:
    """One curve: win rate (± its standard error; no bar where it is unknown) against the proxy reward, each point
    labelled by its pressure; `style` goes to matplotlib (marker, colour, line style, label)."""
    ax.errorbar(
        [r["proxy_reward"] for r in line],
        [r["win_rate"] for r in line],
        yerr=[0 if math.isnan(r["standard_error"]) else r["standard_error"] for r in line],
        capsize=2,
        **style,
    )
    label_pressures(ax, line, "win_rate", prefix)


def plot_curves(rows: Sequence[dict], path: str, title: str = "Over-optimization") -> None:
    """Two panels against the proxy reward: win rate (± SE) per labeller and annotator, and gold reward per labeller
    (PNG).

    Colour: the labeller (whose reward model), marker: the family (best-of-n, PPO...), dashed:
    judged by an annotator other than the labeller. Each reward model has its own proxy-reward
    scale, so compare a curve's shape, not x positions across labellers.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        raise ValueError("no curve points to plot")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4), dpi=120)
    markers = "osD^v<>"
    labellers = list(dict.fromkeys(r["labeller"] for r in rows))
    families = list(dict.fromkeys(r["family"] for r in rows))
    annotators = list(dict.fromkeys(r["annotator"] for r in rows))

    def line_of(labeller: str, family: str, annotator: str | None = None) -> list[dict]:
        picked = [
            r
            for r in rows
            if r["labeller"] == labeller and r["family"] == family and annotator in (None, r["annotator"])
        ]
        if annotator is None:  # one row per point: gold and proxy do not depend on the annotator
            picked = list({r["label"]: r for r in picked if not math.isnan(r["mean_gold"])}.values())
        return sorted(picked, key=lambda r: r["pressure"])

    for li, labeller in enumerate(labellers):
        for fi, family in enumerate(families):
            for annotator in annotators:
                line = line_of(labeller, family, annotator)
                if not line:
                    continue
                draw_win_rates(
                    left,
                    line,
                    marker=markers[fi % len(markers)],
                    color=f"C{li}",
                    linestyle="-" if annotator == labeller else "--",
                    label=f"RM on {labeller} · {family} · judged by {annotator}",
                )
            line = line_of(labeller, family)
            if line:
                right.plot(
                    [r["proxy_reward"] for r in line],
                    [r["mean_gold"] for r in line],
                    marker=markers[fi % len(markers)],
                    color=f"C{li}",
                    label=f"RM on {labeller} · {family}",
                )
                label_pressures(right, line, "mean_gold")
    left.set_xlabel("proxy reward (its reward model, mean over eval outputs)")
    left.set_ylabel("simulated win rate vs reference (%)")
    left.legend(fontsize=6)
    left.grid(alpha=0.3)
    right.set_xlabel("proxy reward (its reward model, mean over eval outputs)")
    right.set_ylabel("gold reward (mean over eval outputs)")
    right.set_title("gold reward (synthetic farm)", fontsize=9)
    if right.lines:
        right.legend(fontsize=6)
    right.grid(alpha=0.3)
    fig.suptitle(title + " (labels: pressure)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
