"""Human labels as the reference and as the judge: simulated annotators against people, people against each other,
and the methods' ranking under human labels against their ranking under the simulated judge.

Input rows are label records like `farmflow.evaluation.analysis` takes (instruction, input, output_1, output_2,
annotator, preference; price_usd and latency_s when known). A label whose annotator starts with ``human:`` is a
person's (`farmflow.labeling`). Pairs are matched by content (instruction, input and the set of the two outputs,
`analysis.pair_key`), so a label counts whichever order its outputs came in.

* `human_agreement`: per simulated annotator, agreement with the humans' majority label of each pair it labeled
  (pairs where the humans split evenly or chose a tie are left out), with a 95% Wilson score interval over its labels;
  bias and variance as `analysis.annotator_table` defines them, with the human majority as the reference; length and
  list preference, price and seconds per 1000. Per person, and pooled as ``human vs human``: agreement with the
  majority of the *other* people on the pairs labeled at least twice (the paper's human-human agreement, 66%).
* `human_win_rates`: a method's win rate over the evaluation pairs people labeled (their majority label; AlpacaEval's
  definition, `stats.win_rate_stats`).
* `ranking_agreement`: Spearman correlation of the methods' win rates under human labels and under the simulated
  judge, with a 95% percentile bootstrap interval over instructions (both sides resampled together).
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from typing import Sequence

from farmflow.evaluation.agreement import wilson
from farmflow.evaluation.analysis import agree, mode, normalize, pair_key, ranking_correlation
from farmflow.evaluation.analysis import preference_rates as label_rates
from farmflow.evaluation.stats import win_rate_stats

HUMAN = "human:"
PAPER_HUMAN_HUMAN = 0.66  # AlpacaFarm (Dubois et al., 2023): a human vs the mode of the three other humans of a pair
BOOTSTRAP = 1000


def is_human(annotator: str) -> bool:
    return annotator.startswith(HUMAN)


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else math.nan


def _interval(scores: Sequence[float]) -> dict:
    low, high = wilson(sum(scores), len(scores))
    return {"agreement": _mean(scores), "ci_low": low, "ci_high": high, "n": len(scores)}


def preference_rates(labels: Sequence[dict]) -> dict[str, float]:
    """Among decisive normalized labels: the share for the longer output and for the list-formatted one."""
    return label_rates([(lab["preference"], lab) for lab in labels])


def human_agreement(rows: Sequence[dict]) -> dict:
    """The report (module doc): ``annotators`` (one row per simulated annotator), ``humans`` (one row per person and
    a pooled ``human vs human`` row), the number of pairs people labeled and how many of them twice or more."""
    labels = normalize(rows)
    people: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for lab in labels:
        if is_human(lab["annotator"]):
            people[lab["pair"]][lab["annotator"]].append(lab["preference"])
    if not people:
        raise ValueError("no human labels (annotator human:NAME) among the labels")
    reference = {pair: mode([p for ps in per.values() for p in ps]) for pair, per in people.items()}
    simulated: dict[str, list[dict]] = defaultdict(list)
    for lab in labels:
        if not is_human(lab["annotator"]) and lab["pair"] in people:
            simulated[lab["annotator"]].append(lab)
    table = []
    for name in sorted(simulated):
        mine = simulated[name]
        draws: dict[str, list[float]] = defaultdict(list)
        for lab in mine:
            draws[lab["pair"]].append(lab["preference"])
        scores, bias, variance = [], [], []
        for pair, ds in draws.items():
            ref = reference[pair]
            if ref != 1.5:
                scores += [agree(p, ref) for p in ds]
                bias.append(1.0 - agree(mode(ds), ref))
            if len(ds) >= 2:
                variance += [1.0 - agree(p, mode(ds[:i] + ds[i + 1 :])) for i, p in enumerate(ds)]
        prices = [float(lab["price_usd"]) for lab in mine if lab.get("price_usd") is not None]
        seconds = [float(lab["latency_s"]) for lab in mine if lab.get("latency_s") is not None]
        table.append(
            {
                "annotator": name,
                "labels": len(mine),
                "pairs": len(draws),
                **_interval(scores),
                "bias": _mean(bias),
                "variance": _mean(variance),
                **preference_rates(mine),
                "price_per_1000": 1000 * _mean(prices),
                "seconds_per_1000": 1000 * _mean(seconds),
            }
        )
    humans, pooled = [], []
    for name in sorted({a for per in people.values() for a in per}):
        scores = []
        for per in people.values():
            others = [p for a, ps in per.items() if a != name for p in ps]
            if name in per and others and mode(others) != 1.5:
                scores += [agree(p, mode(others)) for p in per[name]]
        humans.append({"annotator": name, **_interval(scores)})
        pooled += scores
    humans.append({"annotator": "human vs human", **_interval(pooled), "published": PAPER_HUMAN_HUMAN})
    shape = {lab["pair"]: {"len": lab["len"], "list": lab["list"]} for lab in labels}
    majority = [{"preference": reference[pair], **shape[pair]} for pair in people]
    return {
        "pairs": len(people),
        "pairs_labeled_twice": sum(len(per) >= 2 for per in people.values()),
        "humans_prefer": preference_rates(majority),
        "annotators": table,
        "humans": humans,
        "interval": "Wilson score interval, 95%",
    }


def human_preferences(rows: Sequence[dict]) -> dict[str, float]:
    """Pair (`analysis.pair_key`) → the people's majority preference, relative to the canonical output order."""
    per: dict[str, list[float]] = defaultdict(list)
    for lab in normalize([r for r in rows if is_human(str(r.get("annotator") or ""))]):
        per[lab["pair"]].append(lab["preference"])
    return {pair: mode(ps) for pair, ps in per.items()}


def human_judged(evaluation: Sequence[dict], humans: dict[str, float]) -> list[dict]:
    """The rows of an ``evaluation`` table that people labeled, with their preference in the row's own order."""
    out = []
    for row in evaluation:
        key, flipped = pair_key(row)
        if key in humans:
            p = humans[key]
            out.append(row | {"preference": 3.0 - p if flipped else p, "annotator": "humans"})
    return out


def human_win_rates(evaluation: Sequence[dict], humans: dict[str, float]) -> dict[str, float]:
    """Win rate statistics of one method over its evaluation pairs people labeled; ``n_total`` 0 when none."""
    judged = human_judged(evaluation, humans)
    if not judged:
        return {"win_rate": math.nan, "standard_error": math.nan, "n_total": 0.0}
    return win_rate_stats(
        [r["preference"] for r in judged], [r["output_2"] for r in judged], [r.get("gold_2") for r in judged]
    )


def ranking_agreement(evaluations: dict[str, Sequence[dict]], humans: dict[str, float], seed: int = 0) -> dict:
    """Spearman of the methods' win rates under human labels vs the simulated judge's, with a bootstrap interval.

    `evaluations`: method → its ``evaluation`` rows (the simulated judge's preferences). Methods with no human-labeled
    pair are left out. The bootstrap resamples instruction ids (shared by every method) `BOOTSTRAP` times."""
    judged = {m: {r["id"]: r for r in human_judged(rows, humans)} for m, rows in evaluations.items()}
    methods = sorted(m for m in evaluations if judged[m])
    ids = sorted({i for m in methods for i in judged[m]})
    simulated = {m: {r["id"]: r["preference"] for r in evaluations[m] if r["preference"] is not None} for m in methods}

    def scores(sample: Sequence[str]) -> tuple[dict, dict]:
        human, sim = {}, {}
        for m in methods:
            h = [judged[m][i]["preference"] - 1 for i in sample if i in judged[m]]
            s = [simulated[m][i] - 1 for i in sample if i in simulated[m]]
            if h and s:
                human[m], sim[m] = 100 * _mean(h), 100 * _mean(s)
        return human, sim

    human, sim = scores(ids)
    point = ranking_correlation(human, sim)
    rng = random.Random(seed)
    draws = []
    for _ in range(BOOTSTRAP if len(methods) >= 2 else 0):
        rho = ranking_correlation(*scores([rng.choice(ids) for _ in ids]))["spearman"]
        if not math.isnan(rho):
            draws.append(rho)
    draws.sort()
    low = draws[int(0.025 * len(draws))] if draws else math.nan
    high = draws[min(len(draws) - 1, int(0.975 * len(draws)))] if draws else math.nan
    return {
        "methods": point["n"],
        "instructions": len(ids),
        "spearman": point["spearman"],
        "ci_low": low,
        "ci_high": high,
        "interval": f"percentile bootstrap over instructions, 95%, {len(draws)} resamples",
        "human": human,
        "simulated": sim,
    }


def agreement_markdown(report: dict) -> str:
    """The report as Markdown: simulated annotators vs the human majority, then people vs each other."""

    def pct(x: float | None) -> str:
        return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}"

    lines = [
        f"{report['pairs']} pairs labeled by people ({report['pairs_labeled_twice']} of them twice or more); "
        f"the human majority prefers the longer output in {pct(report['humans_prefer']['length_pref'])}%. "
        f"Interval: {report['interval']}.",
        "",
        "| annotator | labels | agreement with humans % | 95% interval | bias % | variance % | prefers longer % "
        "| prefers list % | $ / 1000 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["annotators"]:
        price = "—" if math.isnan(r["price_per_1000"]) else f"{r['price_per_1000']:.2f}"
        lines.append(
            f"| {r['annotator']} | {r['labels']} | {pct(r['agreement'])} | {pct(r['ci_low'])}–{pct(r['ci_high'])} "
            f"| {pct(r['bias'])} | {pct(r['variance'])} | {pct(r['length_pref'])} | {pct(r['list_pref'])} | {price} |"
        )
    lines += ["", "| person | labels compared | agreement with the other people % | 95% interval |"]
    lines.append("|---|---:|---:|---:|")
    for r in report["humans"]:
        published = f" (published: {pct(r['published'])})" if "published" in r else ""
        lines.append(
            f"| {r['annotator']}{published} | {r['n']} | {pct(r['agreement'])} "
            f"| {pct(r['ci_low'])}–{pct(r['ci_high'])} |"
        )
    return "\n".join(lines) + "\n"


__all__ = [
    "agreement_markdown",
    "human_agreement",
    "human_judged",
    "human_preferences",
    "human_win_rates",
    "is_human",
    "preference_rates",
    "ranking_agreement",
]
