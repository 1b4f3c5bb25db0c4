"""How good is a reward model? Pairwise accuracy on held-out preference pairs, beside baselines.

A scorer gives each output of a pair a number; it is right on a pair when the higher number
goes to the preferred output. Pairs labelled a tie, and pairs the scorer ties, are left out
(and counted out of `pairs`). Four targets:

* ``labels``: the stored labels (p_sim^ann: a quarter are coin flips);
* ``unnoised``: only the pairs an annotator actually judged (rows with ``noised`` false);
* ``gold``: the synthetic farm's gold reward, on pairs whose gold differs;
* ``gold_ties``: the judged labels on the pairs whose gold is equal, which the annotators
  decide by their biases (length, lists, position): how much of the annotators' taste a
  scorer has picked up, apart from quality.

`report_rows` scores every scorer against every target that the rows support, for all
pairs and per task family (synthetic rows carry their task as JSON), with the binomial
standard error sqrt(p(1-p)/n). The ``reward_report`` stage (`farmflow.tasks.analysis`)
fills in the scorers: the reward model, the longer output, the SFT policy's mean token
log-likelihood (no training at all), and on the synthetic farm the gold reward and the
Bayes-optimal guess of the annotator pool.
"""

from __future__ import annotations

import json
import math
from typing import Sequence

TARGETS = ("labels", "unnoised", "gold", "gold_ties")


def pairwise_hits(
    reward_1: Sequence[float], reward_2: Sequence[float], preferences: Sequence[float]
) -> tuple[int, int]:
    """(pairs where the higher reward goes to the preferred output, pairs counted); label and reward ties left out."""
    hits = [(b > a) == (p > 1.5) for a, b, p in zip(reward_1, reward_2, preferences) if p != 1.5 and a != b]
    return sum(hits), len(hits)


def pairwise_accuracy(reward_1: Sequence[float], reward_2: Sequence[float], preferences: Sequence[float]) -> float:
    """Fraction of non-tied pairs where the higher reward goes to the preferred output; NaN when nothing is left."""
    hits, n = pairwise_hits(reward_1, reward_2, preferences)
    return hits / n if n else float("nan")


def target_labels(rows: Sequence[dict], target: str) -> list[float] | None:
    """Each row's label for `target` (1.5 leaves a row out), or None when the rows do not support it."""
    if target == "labels":
        return [r["preference"] if r["preference"] is not None else 1.5 for r in rows]
    if target == "unnoised":
        if not any("noised" in r for r in rows):
            return None
        return [1.5 if r.get("noised") or r["preference"] is None else r["preference"] for r in rows]
    if target == "gold":
        if not rows or any(r.get("gold_1") is None or r.get("gold_2") is None for r in rows):
            return None
        return [2.0 if r["gold_2"] > r["gold_1"] else 1.0 if r["gold_2"] < r["gold_1"] else 1.5 for r in rows]
    if target == "gold_ties":
        judged, gold = target_labels(rows, "unnoised"), target_labels(rows, "gold")
        if judged is None or gold is None:
            return None
        return [j if g == 1.5 else 1.5 for j, g in zip(judged, gold)]
    raise ValueError(f"unknown target {target!r}; expected one of {', '.join(TARGETS)}")


def family_of(row: dict) -> str:
    """The synthetic task family of a row, or "" (real data has no task)."""
    try:
        return json.loads(row.get("task") or "{}").get("family", "")
    except (TypeError, ValueError):
        return ""


def report_rows(
    rows: Sequence[dict], scorers: dict[str, tuple[Sequence[float], Sequence[float]]], by_family: bool = True
) -> list[dict]:
    """One row per (scorer, family, target): accuracy, standard error and pairs counted (`reward_report` schema).

    `scorers` maps a name to (score of output_1, score of output_2) for every row. Family
    "all" is every row; with `by_family`, each task family gets its own rows when the rows have tasks.
    """
    families = sorted({family_of(r) for r in rows} - {""}) if by_family else []
    groups = [("all", list(range(len(rows))))] + [
        (f, [i for i, r in enumerate(rows) if family_of(r) == f]) for f in families
    ]
    labels = {t: target_labels(rows, t) for t in TARGETS}
    out = []
    for name, (s1, s2) in scorers.items():
        if len(s1) != len(rows) or len(s2) != len(rows):
            raise ValueError(f"scorer {name!r}: {len(s1)}/{len(s2)} scores for {len(rows)} pairs")
        for family, idx in groups:
            for target, lab in labels.items():
                if lab is None:
                    continue
                hits, n = pairwise_hits([s1[i] for i in idx], [s2[i] for i in idx], [lab[i] for i in idx])
                acc = hits / n if n else float("nan")
                se = math.sqrt(acc * (1 - acc) / n) if n else float("nan")
                out.append(
                    {
                        "scorer": name,
                        "family": family,
                        "target": target,
                        "accuracy": acc,
                        "standard_error": se,
                        "pairs": n,
                    }
                )
    return out


def report_markdown(rows: Sequence[dict], title: str) -> str:
    """Two tables: every scorer against every target (all pairs), then per family against one target."""
    scorers = list(dict.fromkeys(r["scorer"] for r in rows))
    targets = [t for t in TARGETS if any(r["target"] == t for r in rows)]
    cell = {(r["scorer"], r["family"], r["target"]): r for r in rows}
    fmt = lambda r: "—" if r is None or r["pairs"] == 0 else f"{r['accuracy']:.3f} ± {r['standard_error']:.3f}"  # noqa: E731
    lines = [
        f"# {title}",
        "",
        "| scorer | " + " | ".join(f"vs {t} (pairs)" for t in targets) + " |",
        "|---" * (len(targets) + 1) + "|",
    ]
    for s in scorers:
        lines.append(
            f"| {s} | "
            + " | ".join(
                f"{fmt(cell.get((s, 'all', t)))} ({cell[(s, 'all', t)]['pairs']})" if (s, "all", t) in cell else "—"
                for t in targets
            )
            + " |"
        )
    families = list(dict.fromkeys(r["family"] for r in rows if r["family"] != "all"))
    if families:
        target = "unnoised" if "unnoised" in targets else targets[0]
        lines += [
            "",
            f"Per task family, against {target} labels:",
            "",
            "| scorer | " + " | ".join(families) + " |",
            "|---" * (len(families) + 1) + "|",
        ]
        for s in scorers:
            lines.append(f"| {s} | " + " | ".join(fmt(cell.get((s, f, target))) for f in families) + " |")
    return "\n".join(lines) + "\n"
