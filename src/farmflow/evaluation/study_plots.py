"""The validation study's figures (PNG, matplotlib): the paper's Fig. 3 (simulated vs human win rates over methods)
and Fig. 5 (win rate against the proxy reward as best-of-n's n grows, per labeller and judge)."""

from __future__ import annotations

import math
from typing import Sequence

from farmflow.evaluation.cost import label_points
from farmflow.evaluation.leaderboard import FAMILY_COLOURS, method_family
from farmflow.evaluation.overopt import draw_win_rates


def _agg():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_rankings(rows: Sequence[dict], summary: Sequence[dict], path: str, title: str = "Validation study") -> None:
    """Each system's win rate under the human-like arm (x) and the simulated arm (y), 95% intervals on both, with the
    Spearman and Pearson correlations (methods; pipeline systems; all systems) and their intervals in the title (paper
    Fig. 3)."""
    plt = _agg()
    fig, ax = plt.subplots(figsize=(6.4, 5.8), dpi=120)
    for r in rows:
        colour = FAMILY_COLOURS[method_family(r["method"])]
        ax.errorbar(
            r["human_win_rate"],
            r["sim_win_rate"],
            xerr=[[r["human_win_rate"] - r["human_low"]], [r["human_high"] - r["human_win_rate"]]],
            yerr=[[r["sim_win_rate"] - r["sim_low"]], [r["sim_high"] - r["sim_win_rate"]]],
            fmt="o",
            color=colour,
            capsize=2,
        )
    lo = min(min(r["human_low"], r["sim_low"]) for r in rows) - 2
    hi = max(max(r["human_high"], r["sim_high"]) for r in rows) + 2
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls="--")
    ax.set_xlabel("human-like win rate vs reference (%)")
    ax.set_ylabel("simulated (p_sim^eval) win rate vs reference (%)")
    found = {s["quantity"]: s for s in summary}
    lines = [title]
    for suffix, over in (("", "methods"), (", pipeline systems", "pipeline systems"), (", all systems", "all systems")):
        parts = [
            f"{name} {found[q]['value']:.2f} [{found[q]['low']:.2f}, {found[q]['high']:.2f}]"
            for name in ("Spearman", "Pearson")
            if (q := f"{name} (sim, human-like){suffix}") in found
        ]
        if parts:
            lines.append(f"{over}: " + ", ".join(parts))
    ax.set_title("\n".join(lines), fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    label_points(ax, [(r["method"], r["human_win_rate"], r["sim_win_rate"], 7) for r in rows])
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def plot_overoptimization(curve: Sequence[dict], path: str, title: str = "Over-optimization") -> None:
    """One panel per labeller (whose labels trained the reward model): win rate under each judge against the proxy
    reward, best-of-n's points (solid, labelled by n) and PPO's snapshots where present (dotted, labelled by step), and
    the mean gold reward (×100, black dashed) on one axis (paper Fig. 5)."""
    plt = _agg()
    labellers = list(dict.fromkeys(r["labeller"] for r in curve))
    judges = list(dict.fromkeys(r["annotator"] for r in curve))
    fig, axes = plt.subplots(1, len(labellers), figsize=(6 * len(labellers), 4.8), dpi=120, squeeze=False)
    for ax, labeller in zip(axes[0], labellers):
        families = [f for f in ("best_of_n", "ppo") if any(r["family"] == f for r in curve)]
        for family in families:
            style = {"best_of_n": ("-", "o", ""), "ppo": (":", "^", "step ")}[family]
            for j, judge in enumerate(judges):
                line = sorted(
                    (
                        r
                        for r in curve
                        if r["labeller"] == labeller and r["annotator"] == judge and r["family"] == family
                    ),
                    key=lambda r: r["pressure"],
                )
                if not line:
                    continue
                label = f"{family}, judged by {judge}"
                draw_win_rates(ax, line, style[2], ls=style[0], marker=style[1], color=f"C{j}", label=label)
            gold = sorted(
                {r["label"]: r for r in curve if r["labeller"] == labeller and r["family"] == family}.values(),
                key=lambda r: r["pressure"],
            )
            if gold and not any(math.isnan(r["mean_gold"]) for r in gold):
                ax.plot(
                    [r["proxy_reward"] for r in gold],
                    [100 * r["mean_gold"] for r in gold],
                    color="black",
                    ls="--" if family == "best_of_n" else "-.",
                    marker="s",
                    ms=3,
                    label=f"{family}, gold reward ×100",
                )
        ax.set_title(f"reward model on {labeller} labels", fontsize=9)
        ax.set_xlabel("proxy reward (mean over eval outputs)")
        ax.set_ylabel("win rate vs reference (%) / gold ×100")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title + " (points: best-of-n's n, PPO's step)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_curves_over_seeds(rows: Sequence[dict], path: str, title: str = "Over-optimization over seeds") -> None:
    """`curves_over_seeds` as one panel per family and judge (gold first): each reward model's curve, the mean over the
    seeds against the pressure (best-of-n's n on a log scale, PPO's step), with its 95% Student-t band over the seeds.
    The paper's Fig. 5 with the seed-to-seed spread in: where the bands of a curve's peak and its end overlap, another
    seed may show no fall."""
    plt = _agg()
    families = list(dict.fromkeys(r["family"] for r in rows))
    judges = list(dict.fromkeys(r["judge"] for r in rows))
    fig, axes = plt.subplots(
        len(families),
        len(judges),
        figsize=(4.2 * len(judges), 3.4 * len(families)),
        dpi=120,
        squeeze=False,
        layout="constrained",
    )
    for row, family in zip(axes, families):
        for ax, judge in zip(row, judges):
            mine = [r for r in rows if r["family"] == family and r["judge"] == judge]
            for i, labeller in enumerate(dict.fromkeys(r["labeller"] for r in mine)):
                line = sorted((r for r in mine if r["labeller"] == labeller), key=lambda r: r["pressure"])
                x = [r["pressure"] for r in line]
                ax.plot(x, [r["mean"] for r in line], marker="o", ms=3, color=f"C{i}", label=f"RM on {labeller}")
                band = [(r["pressure"], r["low"], r["high"]) for r in line if not math.isnan(r["low"])]
                if band:
                    ax.fill_between(*zip(*band), color=f"C{i}", alpha=0.2, lw=0)
            if family == "best_of_n":
                ax.set_xscale("log", base=2)
            ax.set_title(f"{family}, {'gold reward ×100' if judge == 'gold' else f'judged by {judge}'}", fontsize=9)
            ax.set_xlabel("n" if family == "best_of_n" else "PPO step")
            ax.set_ylabel("gold ×100" if judge == "gold" else "win rate vs reference (%)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    seeds = max(r["seeds"] for r in rows)
    fig.suptitle(f"{title}: mean over {seeds} seeds, 95% Student-t band")
    fig.savefig(path)
    plt.close(fig)
