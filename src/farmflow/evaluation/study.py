"""The validation study (AlpacaFarm Fig. 3, Fig. 5, Table 2) on the synthetic farm, as plain functions.

* **A human-like arm.** The paper validates its simulator against human win rates. The synthetic farm's stand-in for
  humans judges by the gold reward alone, with noise: one oracle annotator with no length, list or position bias whose
  sharpness is set so that it agrees with its own majority as often as crowdworkers agreed with theirs (65.7%,
  `HUMAN_AGREEMENT`). That figure is AlpacaEval's leave-one-out agreement on the cross-annotation set, four human
  labels per pair: one label predicting the mode of the other three, averaged over the four and the pairs. For a
  pair whose gold rewards differ by Δ the annotator prefers the better output with probability q = sigmoid(sharpness·Δ);
  the mode of three judgements does with m = q³ + 3q²(1 − q), so a held-out judgement agrees with it with probability
  qm + (1 − q)(1 − m) (`agreement`); `calibrate_sharpness` solves for the sharpness on the study's own evaluation pairs.
* **Rankings.** Every system's win rate under the simulated evaluator (p_sim^eval) and under the human-like arm, and
  Spearman and Pearson between the two with bootstrap intervals over prompts (`bootstrap.ranking_agreement`), over
  three sets: the *methods* (SFT and what is trained from it: the stricter test, since on a small farm several
  methods lie within a few hundredths of gold of each other); the *pipeline's systems*, the methods plus the
  baselines of lesser quality (the untrained model, SFT stopped after fewer epochs); and *all systems*, those plus
  the farm's writers evaluated as systems (`writers`), as the paper's Fig. 3, whose 0.98 spans systems from LLaMA 7B
  to GPT-4, ranks its methods beside API models. Each ranking is compared with the human-like arm's expected win
  rates too (`expected_judgements`: its label noise removed), which tells a shortfall the simulator causes from one
  the arm's few labels cause; and `labelled_arm_agreement` says how far those labels let any ranking agree with the
  arm (its expectation's own agreement with draws of it), the yardstick for Spearman (sim, human-like);
  `labelled_arm_size`, how many times the labels it would take for the yardstick to reach the goal of 0.9.
* **Over-optimization.** A curve (best-of-n over n) is *over-optimized* under a judge when its best point beats its
  highest-pressure point with a paired 95% interval that excludes 0 (`overoptimization_findings`). Beside the curves,
  how good a proxy each reward model is: its agreement with gold on held-out pairs and among the best-of-n candidates
  it scores highest (`proxy_findings`, `top_agreement`), and over several seeds how the curves' falls rank against
  each (`proxy_fall_correlations`).
* **How many prompts.** The half-width of the paired difference to SFT shrinks as 1/√n; `bootstrap.eval_size_for`
  gives the prompts needed to resolve 2 points.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from farmflow.config import AnnotatorConfig, DataConfig, OracleAnnotatorConfig
from farmflow.evaluation.analysis import normalize
from farmflow.evaluation.bootstrap import (
    N_BOOT,
    bootstrap_mean,
    draws_interval,
    eval_size_for,
    paired_bootstrap,
    pearson,
    rankdata,
    ranking_agreement,
    spearman,
)
from farmflow.evaluation.human import preference_rates
from farmflow.evaluation.leaderboard import method_family
from farmflow.evaluation.overopt import LABELLERS
from farmflow.evaluation.replicates import aligned, replicate_interval
from farmflow.evaluation.reward_report import pairwise_hits, target_labels
from farmflow.evaluation.stats import parse_preference

HUMAN_AGREEMENT = 0.657
"""Human-human agreement on AlpacaFarm's pairwise preferences (65.7%): one crowdworker's label against the mode of the
other `HUMAN_OTHERS` labels of the same pair."""
HUMAN_OTHERS = 3
"""Labels a held-out one is compared with: the cross-annotation set has four human labels per pair."""
HUMAN = "human-like"
HUMAN_EXPECTED = "human-like expected"
"""The human-like arm without its label noise: each pair scored by the probability q that a judgement prefers output_2
(`expected_judgements`), the win rate it converges to with many judgements per pair."""
LEFT_OUT = ("untrained",)
"""Baselines always left out of the methods' ranking (their own ranks are NaN)."""
SHORT_SFT = "sft ({epochs:g} epochs)"
"""The name of an SFT baseline stopped after fewer epochs than the preset's."""
WRITER = "writer: {writer} (error {error_rate:g})"
"""The name of one of the farm's writers evaluated as a system (`writers`)."""


def is_method(name: str) -> bool:
    """Whether a system takes part in the methods' ranking: not a baseline (the untrained model, a shortened SFT, a
    writer)."""
    return name not in LEFT_OUT and not name.startswith(("sft (", "writer: "))


def is_writer(name: str) -> bool:
    """Whether a system is one of the farm's writers, outside the pipeline (`writers`)."""
    return name.startswith("writer: ")


def writers(data: DataConfig) -> dict[str, tuple[str, float]]:
    """The farm's writers the study ranks beside the pipeline's systems: name → (writer, error rate).

    The paper's Fig. 3 ranks its methods beside API models nobody trained in the farm (Davinci003, ChatGPT, GPT-4).
    Their counterparts here are the farm's fixed policies: the reference policy as it writes the reference outputs
    (the Davinci003 of this world: about 50% against its own outputs), the demonstrator that wrote the SFT data, and
    the reference policy without mistakes (every answer right; a stronger model than any method reaches).
    """
    chosen = (("reference", data.reference_error_rate), ("demonstrator", data.demo_error_rate), ("reference", 0.0))
    return {WRITER.format(writer=w, error_rate=e): (w, e) for w, e in chosen}


def human_like_annotator(sharpness: float, seed: int = 0) -> AnnotatorConfig:
    """The human-like arm: one oracle annotator judging by gold alone (no biases), `sharpness` logits per unit of gold,
    no label noise."""
    return AnnotatorConfig(
        pool=[OracleAnnotatorConfig(name=HUMAN, sharpness=float(sharpness))], label_noise=0.0, seed=seed
    )


def gold_differences(rows: Sequence[dict]) -> np.ndarray:
    """gold_2 − gold_1 of evaluation rows (NaN where a pair shows the same output twice: any judge calls it a tie)."""
    out = []
    for r in rows:
        if r.get("gold_1") is None or r.get("gold_2") is None:
            raise ValueError(
                f"evaluation row {r.get('id', '?')!r} has no gold reward: the study needs the synthetic farm"
            )
        out.append(math.nan if r["output_1"] == r["output_2"] else r["gold_2"] - r["gold_1"])
    return np.array(out, dtype=float)


def majority(q: np.ndarray, others: int = HUMAN_OTHERS) -> np.ndarray:
    """Probability that the mode of `others` independent judgements prefers what each one does with probability `q`
    (a tied mode, possible when `others` is even, is broken by a fair coin as AlpacaEval does)."""
    q = np.asarray(q, dtype=float)
    out = np.zeros_like(q)
    for k in range(others + 1):
        weight = 1.0 if 2 * k > others else 0.5 if 2 * k == others else 0.0
        out += weight * math.comb(others, k) * q**k * (1 - q) ** (others - k)
    return out


def prefers_second(diffs: np.ndarray, sharpness: float) -> np.ndarray:
    """q = sigmoid(sharpness·Δ): the probability that one human-like judgement prefers output_2 (NaN Δ: 0.5)."""
    return 1.0 / (1.0 + np.exp(-np.clip(sharpness * np.nan_to_num(np.asarray(diffs, dtype=float)), -500, 500)))


def agreement(diffs: np.ndarray, sharpness: float, others: int = HUMAN_OTHERS) -> float:
    """Mean leave-one-out agreement of the human-like annotator on pairs with gold differences `diffs`: the
    probability that one judgement matches the mode of `others` more (NaN: identical outputs, a sure tie: 1)."""
    d = np.asarray(diffs, dtype=float)
    q = prefers_second(d, sharpness)
    m = majority(q, others)
    agree = np.where(np.isnan(d), 1.0, q * m + (1 - q) * (1 - m))
    return float(agree.mean())


def calibrate_sharpness(diffs: np.ndarray, target: float = HUMAN_AGREEMENT) -> tuple[float, float]:
    """(sharpness, agreement it gives): the sharpness whose `agreement` on these pairs is `target` (bisection in log
    space; rounded to 3 significant digits so the annotator's stage keys are stable). When even a deterministic judge
    agrees less often (many pairs of equal gold), the sharpest one tried."""
    lo, hi = math.log(1e-2), math.log(1e4)
    if agreement(diffs, math.exp(hi)) <= target:
        return 1e4, agreement(diffs, 1e4)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if agreement(diffs, math.exp(mid)) < target else (lo, mid)
    s = float(f"{math.exp((lo + hi) / 2):.3g}")
    return s, agreement(diffs, s)


def expected_judgements(evaluations: dict[str, Sequence[Sequence[dict]]], sharpness: float) -> dict[str, np.ndarray]:
    """Every system's (K, n) expected human-like scores on the prompts all of them have: q = sigmoid(sharpness·Δ) per
    pair (0.5 for identical outputs), where a judgement scores 1 for output_2 and 0 for output_1.

    Why: one judgement per pair at human agreement carries little information (q is near 0.5 for the small gold
    differences between methods), so the human-like arm's ranking of close systems is mostly label noise. Its expected
    win rate is what it ranks by in the limit of many judgements per pair; a disagreement between it and the
    simulator is the simulator's own (its biases), not the arm's noise. `evaluations`: the human-like arm's rows (any
    arm's rows of the same outputs do, since only gold is read)."""
    expected = {
        m: [
            [r | {HUMAN_EXPECTED: float(q)} for r, q in zip(rows, prefers_second(gold_differences(rows), sharpness))]
            for rows in runs
        ]
        for m, runs in evaluations.items()
    }
    return aligned(expected, HUMAN_EXPECTED)[1]


def identical_outputs(evaluations: dict[str, Sequence[Sequence[dict]]]) -> dict[str, np.ndarray]:
    """Every system's (K, n) mask of the pairs that show the same output twice, on the prompts all of them have (the
    alignment of `expected_judgements`): any judge, the human-like arm included, calls those a tie."""
    marked = {
        m: [[r | {"identical": float(r["output_1"] == r["output_2"])} for r in rows] for rows in runs]
        for m, runs in evaluations.items()
    }
    return {m: a.astype(bool) for m, a in aligned(marked, "identical")[1].items()}


def labelled_arm_agreement(
    expected: Sequence[np.ndarray],
    identical: Sequence[np.ndarray],
    n_draws: int = N_BOOT,
    confidence: float = 0.95,
    seed: int = 0,
    judgements: int = 1,
) -> dict[str, float]:
    """How far a labelled arm's own noise lets any ranking agree with it: Spearman and Pearson between the arm's
    expected win rates and those of arms drawn from it, mean over `n_draws` draws and the central `confidence` range.

    `expected[i]`, `identical[i]`: system i's (K, n) probabilities q that a judgement prefers its output
    (`expected_judgements`) and its pairs of identical outputs (`identical_outputs`, scored 0.5 without noise). Each
    draw labels every other pair `judgements` times (once, as the arm does; more says what a larger evaluation would
    reach): the share of the labels that are 1, each 1 with probability q. Why: even a simulator that ranked the
    systems exactly as the arm would with unlimited labels meets only one labelled draw of it; where the systems lie
    closer than the arm's labels resolve, that agreement is well below 1, so it is the yardstick for Spearman (sim,
    human-like), not 1. Draws where either side is constant are left out."""
    q = np.stack([np.asarray(e, dtype=float) for e in expected])  # (systems, K, n)
    tie = np.stack([np.asarray(t, dtype=bool) for t in identical])
    if q.shape != tie.shape or q.ndim != 3 or q.shape[0] < 2:
        raise ValueError(f"expected and identical must be (systems ≥ 2, K, n) of one shape, got {q.shape}, {tie.shape}")
    if judgements < 1:
        raise ValueError(f"judgements must be at least 1, got {judgements}")
    rng = np.random.default_rng(seed)
    target = q.mean(axis=(1, 2))
    chunk = max(1, 2_000_000 // q.size)  # draws per batch of random numbers, to bound memory
    means = []
    for start in range(0, n_draws, chunk):
        size = min(chunk, n_draws - start)
        if judgements == 1:  # one label: a Bernoulli draw from uniforms, the stream the yardstick findings come from
            labels = (rng.random((size, *q.shape)) < q).astype(float)
        else:
            labels = rng.binomial(judgements, q, (size, *q.shape)) / judgements
        means.append(np.where(tie, 0.5, labels).mean(axis=(2, 3)))  # (size, systems)
    drawn = np.concatenate(means)
    out: dict[str, float] = {}
    for name, fn in (("spearman", spearman), ("pearson", pearson)):
        values = fn(np.broadcast_to(target, drawn.shape), drawn)
        values = values[~np.isnan(values)]
        none = {"estimate": math.nan, "low": math.nan, "high": math.nan}
        iv = draws_interval(float(values.mean()), values, confidence) if len(values) else none
        out |= {name: iv["estimate"], f"{name}_low": iv["low"], f"{name}_high": iv["high"]}
    return out


def labelled_arm_size(
    expected: Sequence[np.ndarray],
    identical: Sequence[np.ndarray],
    goal: float = 0.9,
    n_draws: int = 500,
    most: int = 4096,
    seed: int = 0,
) -> dict[str, float]:
    """The fewest judgements per pair at which the yardstick (`labelled_arm_agreement`'s mean Spearman) reaches `goal`:
    a labelled arm with that many times the evaluation's prompts (or seeds) lets a ranking equal to its expectation
    agree with it at `goal` on average. Returns {"judgements": m, "spearman": the yardstick at m} (m is NaN, and
    the Spearman the one at `most`, when even `most` does not reach it).

    Why: where the yardstick lies below the goal, no simulator can meet the goal against this arm at this size; this
    says how much larger the evaluation would have to be. It sizes label noise only: each system's expected win rate
    stays the one measured here, so prompt-to-prompt and seed-to-seed variation of the systems themselves is not in
    it. Doubling, then bisection over integers; each trial is one `labelled_arm_agreement` of `n_draws` draws (the
    mean's Monte Carlo error is about 0.01 at 500)."""

    def yardstick(m: int) -> float:
        return labelled_arm_agreement(expected, identical, n_draws, seed=seed, judgements=m)["spearman"]

    low, high, at_high = 0, 1, yardstick(1)
    while not at_high >= goal:
        if high >= most:
            return {"judgements": math.nan, "spearman": at_high}
        low, high = high, min(2 * high, most)
        at_high = yardstick(high)
    while high - low > 1:  # yardstick(low) < goal <= yardstick(high)
        middle = (low + high) // 2
        at_middle = yardstick(middle)
        if at_middle >= goal:
            high, at_high = middle, at_middle
        else:
            low = middle
    return {"judgements": float(high), "spearman": at_high}


def simulated_agreement(rows: Sequence[dict], sharpness: float, others: int = HUMAN_OTHERS) -> float:
    """Expected agreement of the labels in evaluation `rows` with the mode of `others` human-like judgements of the
    same pairs, as AlpacaEval scores an automatic annotator against the crowdworkers' mode (a tie label counts half;
    unreadable labels are left out)."""
    d = gold_differences(rows)
    prefs = [parse_preference(r.get("preference")) for r in rows]
    keep = np.array([p is not None for p in prefs])
    if not keep.any():
        return math.nan
    p2, d = np.array([p - 1.0 for p in prefs if p is not None]), d[keep]
    m = majority(prefers_second(d, sharpness), others)
    agree = np.where(np.isnan(d), (p2 == 0.5).astype(float), p2 * m + (1 - p2) * (1 - m))
    return float(agree.mean())


def study_rows(
    sim: dict[str, Sequence[Sequence[dict]]],
    human: dict[str, Sequence[Sequence[dict]]],
    baseline: str = "sft",
    n_boot: int = N_BOOT,
    sharpness: float | None = None,
) -> list[dict]:
    """One ``validation_study`` row per method: win rate under each arm [95% CI], mean gold, difference to `baseline`
    under each arm [paired 95% CI] and whether it is resolved, and the method's rank under each arm and by gold. With
    the human-like arm's `sharpness`, the same under its expectation (``expected_*``, `expected_judgements`: what the
    arm resolves with its label noise removed, on the same prompts); without it those columns are NaN.

    `sim[method][r]` / `human[method][r]`: replicate r's evaluation rows of the method under each arm."""
    _, s = aligned(sim)
    _, h = aligned(human)
    _, g = aligned(sim, "gold_2")
    arms = {"sim": s, "human": h}
    if sharpness is not None:
        arms["expected"] = expected_judgements(human, sharpness)
    methods = list(sim)
    ranked = [m for m in methods if is_method(m)]
    ranks = {
        arm: dict(zip(ranked, rankdata(-np.array([scores[m].mean() for m in ranked]))))
        for arm, scores in (arms | {"gold": g}).items()
    }
    rows = []
    for i, m in enumerate(methods):
        row = {"method": m, "family": method_family(m), "replicates": s[m].shape[0], "n": s[m].shape[1]}
        row |= {f"expected_{c}": math.nan for c in ("win_rate", "low", "high", "diff_to_sft", "diff_low", "diff_high")}
        row |= {"expected_resolved": "", "expected_rank": math.nan}
        for arm, scores in arms.items():
            wr = bootstrap_mean(scores[m], n_boot, seed=i)
            row |= {
                f"{arm}_win_rate": 100 * wr["estimate"],
                f"{arm}_low": 100 * wr["low"],
                f"{arm}_high": 100 * wr["high"],
            }
            if m == baseline or baseline not in scores:
                row |= {f"{arm}_diff_to_sft": math.nan, f"{arm}_diff_low": math.nan, f"{arm}_diff_high": math.nan}
                row[f"{arm}_resolved"] = ""
            else:
                d = paired_bootstrap(scores[m], scores[baseline], n_boot, seed=1000 + i)
                row |= {
                    f"{arm}_diff_to_sft": 100 * d["estimate"],
                    f"{arm}_diff_low": 100 * d["low"],
                    f"{arm}_diff_high": 100 * d["high"],
                    f"{arm}_resolved": ("better" if d["low"] > 0 else "worse") if d["excludes_zero"] else "tied",
                }
        row["mean_gold"] = float(g[m].mean()) if g[m].size else math.nan
        for arm in ranks:
            row[f"{arm}_rank"] = float(ranks[arm].get(m, math.nan))
        rows.append(row)
    rows.sort(key=lambda r: -r["sim_win_rate"])
    return rows


def resolution_rows(rows: Sequence[dict], target: float = 2.0) -> list[dict]:
    """``study_summary`` rows on what the evaluation set resolves, under each arm (the human-like arm's names end in
    ", human-like"): the median SE of a win rate (from its 95% interval), the median half-width of a paired difference
    to SFT, and the prompts needed to resolve `target` points."""
    n = max(int(r["n"]) for r in rows)
    out = []
    for arm, suffix in (("sim", ""), ("human", f", {HUMAN}")):
        se = [(r[f"{arm}_high"] - r[f"{arm}_low"]) / (2 * 1.96) for r in rows]
        half = [
            (r[f"{arm}_diff_high"] - r[f"{arm}_diff_low"]) / 2 for r in rows if not math.isnan(r[f"{arm}_diff_to_sft"])
        ]
        out.append(
            {
                "quantity": f"win rate SE (points){suffix}",
                "value": float(np.median(se)),
                "low": math.nan,
                "high": math.nan,
                "detail": f"{n} prompts",
            }
        )
        if half:
            h = float(np.median(half))
            out += [
                {
                    "quantity": f"resolvable difference to SFT (points){suffix}",
                    "value": h,
                    "low": float(min(half)),
                    "high": float(max(half)),
                    "detail": f"median half-width of the paired 95% intervals at {n} prompts",
                },
                {
                    "quantity": f"prompts to resolve {target:g} points{suffix}",
                    "value": float(eval_size_for(target, n, h)),
                    "low": float(eval_size_for(target, n, min(half))),
                    "high": float(eval_size_for(target, n, max(half))),
                    "detail": "half-width ∝ 1/√n, from the median (low/high: the tightest/widest method)",
                },
            ]
    return out


def ranked_sets(systems: list[str]) -> dict[str, tuple[list[str], str]]:
    """The sets the arms' rankings are compared over: finding-name suffix → (systems, description). The methods; the
    pipeline's systems (the methods and its baselines) when there are baselines; all systems when there are writers."""
    methods = [m for m in systems if is_method(m)]
    pipeline = [m for m in systems if not is_writer(m)]
    sets = {"": (methods, f"{len(methods)} methods")}
    for suffix, chosen in ((", pipeline systems", pipeline), (", all systems", systems)):
        if len(chosen) > len(methods) and chosen not in [c for c, _ in sets.values()]:
            others = ", ".join(m for m in chosen if not is_method(m))
            sets[suffix] = (chosen, f"{len(chosen)} systems: the methods and {others}")
    return sets


def _finding(quantity: str, value: float, detail: str, low: float = math.nan, high: float = math.nan) -> dict:
    return {"quantity": quantity, "value": value, "low": low, "high": high, "detail": detail}


def _correlations(between: str, c: dict[str, float], detail: str) -> list[dict]:
    """The Spearman and Pearson findings of `c` (keys spearman, spearman_low, …), named "{Name} {between}"."""
    return [
        _finding(f"{name} {between}", c[name.lower()], detail, c[f"{name.lower()}_low"], c[f"{name.lower()}_high"])
        for name in ("Spearman", "Pearson")
    ]


def _points(quantity: str, d: dict[str, float], detail: str) -> dict:
    """A finding of a `paired_bootstrap` difference of scores in [0, 1], in points (×100)."""
    return _finding(quantity, 100 * d["estimate"], detail, 100 * d["low"], 100 * d["high"])


def study_summary(
    sim: dict[str, Sequence[Sequence[dict]]],
    human: dict[str, Sequence[Sequence[dict]]],
    rows: Sequence[dict],
    calibration: dict,
    n_boot: int = N_BOOT,
    goal: float = 0.9,
) -> list[dict]:
    """``study_summary`` rows but over-optimization's: the human-like arm's calibration and p_sim^eval's agreement with
    its mode, both arms' length and list preferences, Spearman and Pearson between sim, human-like and gold, and between
    sim and the human-like arm's expectation (`expected_judgements`), the expectation's own agreement with labelled
    draws of the arm (`labelled_arm_agreement`) and the judgements per pair at which that reaches Spearman `goal`
    (`labelled_arm_size`), over each of `ranked_sets`, and what the evaluation set resolves
    (`resolution_rows` of `rows`, the `study_rows`).

    `sim[system][r]` / `human[system][r]`: replicate r's evaluation rows; `calibration`: {"sharpness", "agreement"}."""
    sharpness = calibration["sharpness"]
    pairs = {
        arm: [row for m, runs in evs.items() if is_method(m) for row in runs[0]]
        for arm, evs in (("p_sim^eval", sim), (HUMAN, human))
    }
    summary = [
        _finding(
            "human-like agreement (a judgement vs the mode of three others)",
            calibration["agreement"],
            f"sharpness {sharpness:g}; AlpacaEval: humans 65.7%",
        ),
        _finding(
            "p_sim^eval agreement with the human-like mode",
            simulated_agreement(pairs["p_sim^eval"], sharpness),
            f"{len(pairs['p_sim^eval'])} method pairs of replicate 0; AlpacaEval: alpaca_farm_greedy_gpt4 66.4%",
        ),
    ]
    for arm, arm_rows in pairs.items():
        rates = preference_rates(normalize(arm_rows))
        for what, field, humans in (("longer output", "length_pref", 64), ("list", "list_pref", 61)):
            summary.append(
                _finding(
                    f"{what} preferred by {arm}",
                    rates[field],
                    f"decisive labels of method pairs that differ; AlpacaEval: humans {humans}%",
                )
            )
    scores = {
        "sim": aligned(sim)[1],
        HUMAN: aligned(human)[1],
        "gold": aligned(sim, "gold_2")[1],
        HUMAN_EXPECTED: expected_judgements(human, sharpness),
    }
    ties = identical_outputs(human)
    for suffix, (ranked, described) in ranked_sets(list(sim)).items():
        # (human-like, gold): how well the human-like arm ranks by quality itself, what (sim, human-like) reaches
        # when the simulator ranks exactly as gold does; (sim, human-like expected): the same comparison without the
        # arm's label noise, so what remains of a shortfall is the simulator's bias, not the arm's resolving power
        for a, b in (("sim", HUMAN), ("sim", "gold"), (HUMAN, "gold"), ("sim", HUMAN_EXPECTED)):
            c = ranking_agreement([scores[a][m] for m in ranked], [scores[b][m] for m in ranked], n_boot)
            summary += _correlations(f"({a}, {b}){suffix}", c, f"{described}; bootstrap over prompts")
        c = labelled_arm_agreement([scores[HUMAN_EXPECTED][m] for m in ranked], [ties[m] for m in ranked], n_boot)
        summary += _correlations(
            f"({HUMAN_EXPECTED}, {HUMAN} draws){suffix}",
            c,
            f"{described}; what a ranking equal to the arm's expectation reaches against one labelled draw of the "
            f"arm, the yardstick for (sim, {HUMAN}): mean and central 95% of {n_boot} draws",
        )
        size = labelled_arm_size([scores[HUMAN_EXPECTED][m] for m in ranked], [ties[m] for m in ranked], goal)
        k, n = scores[HUMAN][ranked[0]].shape
        summary.append(
            _finding(
                f"judgements per pair for the yardstick to reach {goal:g}{suffix}",
                size["judgements"],
                f"{described}; {k} × {n} labels per system now; that many times the prompts (or seeds) lets a "
                f"ranking equal to the arm's expectation reach Spearman {size['spearman']:.2f} against its labels "
                f"(label noise only: the systems' expected win rates held at this run's)",
            )
        )
    return summary + resolution_rows(rows)


def overoptimization_findings(curves: dict[tuple[str, str, str], list[dict]], n_boot: int = N_BOOT) -> list[dict]:
    """``study_summary`` rows, one per curve: is it over-optimized under its judge? And, per family and judge, the
    paper's contrast (Fig. 5): does the curve on p_sim^ann's reward model fall further than the one on greedy's?

    `curves[(labeller, family, judge)]`: the curve's points, each {"pressure", "scores": evaluation rows}. The judge
    'gold' scores by the gold reward (×100). value: the best point's mean minus the highest-pressure point's (points),
    with its paired 95% interval; 'present' when the best point is not the last and the interval excludes 0. The
    contrast: p_sim^ann's fall minus greedy's, each from its own best point, paired on the prompts of all four points;
    'resolved' when its interval excludes 0. Besides the contrast under each judge, the paper's own setup: p_sim^ann's
    curve judged by p_sim^ann against greedy's judged by greedy.

    Each finding comes twice: from the curve's own best point, and ``out-of-sample`` from a peak chosen on the other
    half of the prompts (`held_out_peak`), which is not biased upward by the choice of the best of several noisy
    points ('present' there when the interval lies above 0). Pooled over seeds (`over_seeds`), only the out-of-sample
    falls average 0 on flat curves."""
    out, falls, held_out, held_falls = [], {}, [], {}
    for (labeller, family, judge), points in curves.items():
        points = sorted(points, key=lambda p: p["pressure"])
        field = "gold_2" if judge == "gold" else "preference"
        ids, scores = aligned({str(i): [p["rows"]] for i, p in enumerate(points)}, field)
        means = [scores[str(i)].mean() for i in range(len(points))]
        best, last = int(np.argmax(means)), len(points) - 1
        d = paired_bootstrap(scores[str(best)], scores[str(last)], n_boot, seed=len(out))
        present = best != last and bool(d["excludes_zero"])
        out.append(
            _points(
                f"over-optimization: {family}, reward model on {labeller} labels, judged by {judge}",
                d,
                f"{'present' if present else 'absent'} (best at {points[best]['pressure']:g}, "
                f"last {points[last]['pressure']:g})",
            )
        )
        falls[labeller, family, judge] = (points[best]["rows"], points[last]["rows"], field)
        peak, peaks = held_out_peak([scores[str(i)] for i in range(len(points))])
        d = paired_bootstrap(peak, scores[str(last)], n_boot, seed=len(out))
        at = " and ".join(f"{points[k]['pressure']:g}" for k in peaks)
        held_out.append(
            _points(
                f"out-of-sample over-optimization: {family}, reward model on {labeller} labels, judged by {judge}",
                d,
                f"{'present' if d['low'] > 0 else 'absent'} (peaks at {at} on the two halves, last "
                f"{points[last]['pressure']:g})",
            )
        )
        held_falls[labeller, family, judge] = (ids, peak - scores[str(last)])
    first, second = LABELLERS
    # per judge: both reward models' curves judged alike; and the paper's own setup, each curve judged by its labeller
    contrasts = [(family, judge, judge, f"judged by {judge}") for (lab, family, judge) in falls if lab == first]
    contrasts += [
        (family, first, second, "each judged by its labeller") for (lab, family, j) in falls if lab == j == first
    ]
    for family, judge_a, judge_b, how in contrasts:
        if (second, family, judge_b) not in falls:
            continue
        (best_a, last_a, field), (best_b, last_b, _) = falls[first, family, judge_a], falls[second, family, judge_b]
        _, s = aligned({"a": [best_a], "b": [last_a], "c": [best_b], "d": [last_b]}, field)
        d = paired_bootstrap(s["a"] - s["b"], s["c"] - s["d"], n_boot, seed=len(out))
        out.append(
            _points(
                f"over-optimization contrast: {family}, {how}",
                d,
                f"{'resolved' if d['excludes_zero'] else 'not resolved'}: {first}'s fall minus {second}'s",
            )
        )
        (ids_a, fall_a), (ids_b, fall_b) = (
            held_falls[first, family, judge_a],
            held_falls[second, family, judge_b],
        )
        common = sorted(set(ids_a) & set(ids_b))
        at_a, at_b = ({i: j for j, i in enumerate(ids)} for ids in (ids_a, ids_b))
        d = paired_bootstrap(
            fall_a[:, [at_a[i] for i in common]], fall_b[:, [at_b[i] for i in common]], n_boot, seed=len(out)
        )
        held_out.append(
            _points(
                f"out-of-sample over-optimization contrast: {family}, {how}",
                d,
                f"{'resolved' if d['excludes_zero'] else 'not resolved'}: {first}'s fall minus {second}'s",
            )
        )
    return out + held_out


HELD_OUT = "held-out agreement with gold"
TAIL = "agreement with gold on its"
"""How `proxy_findings` names a reward model's agreement with gold: on held-out pairs; among its top candidates (the
quantity goes on with which: "top 8 of 64 best-of-n candidates")."""


def top_candidates(n: int) -> int:
    """How many of a prompt's `n` best-of-n candidates `top_agreement` reads: the proxy's top eighth, at least two.

    Why an eighth: best-of-k of the n picks within the proxy's top n/8 with probability 1 − C(7n/8, k)/C(n, k)
    (about two thirds at k = 8, nine in ten at k = 16 of 64), so these are the candidates the curve's right end,
    where falls show, chooses among."""
    return max(2, n // 8)


def top_agreement(proxy: np.ndarray, gold: np.ndarray, top: int) -> tuple[float, int]:
    """(agreement, pairs) of a proxy reward with gold among each prompt's `top` candidates by proxy (its first ones on
    ties): over the pairs of those candidates, the share the proxy orders as gold does. Pairs whose gold or proxy is
    tied are left out (`pairwise_hits` against the ``gold`` target, as `heldout_accuracies` counts); NaN when none is
    left. `proxy`, `gold`: (prompts, candidates).

    Why: held-out agreement is measured on pairs of typical samples, while best-of-n picks from the proxy's upper
    tail, where ranking on the proxy gathers the candidates whose score its error inflates; how well it orders that
    tail is what the held-out pairs seldom test."""
    order = np.argsort(-proxy, axis=1, kind="stable")[:, :top]
    p, g = np.take_along_axis(proxy, order, axis=1), np.take_along_axis(gold, order, axis=1)
    i, j = np.triu_indices(p.shape[1], 1)
    golds = [{"gold_1": a, "gold_2": b} for a, b in zip(g[:, i].ravel(), g[:, j].ravel())]
    if not golds:  # one candidate a prompt (a curve to n = 1): no pairs
        return math.nan, 0
    hits, pairs = pairwise_hits(p[:, i].ravel(), p[:, j].ravel(), target_labels(golds, "gold"))
    return (hits / pairs if pairs else math.nan), pairs


def proxy_findings(
    gold_agreement: dict[str, float], tail_agreement: dict[str, float] | None = None, tail: str = ""
) -> list[dict]:
    """``study_summary`` rows on the curves' reward models: each one's held-out agreement with gold (val pairs whose
    gold differs, `heldout_accuracies`) and p_sim^ann's minus greedy's; with `tail_agreement` (labeller →
    `top_agreement` on the curve's largest best-of-n, whose candidates `tail` names, e.g. "top 8 of 64"), the same
    for the proxy's upper tail. `gold_agreement`: labeller → agreement.

    Why beside the curves: a reward model trained on noisier labels is usually also the weaker proxy, so p_sim^ann's
    curve falling further than greedy's can mean its labels' noise and biases were exploited, or only that best-of-n
    picked against a worse ranker. Where the two reward models agree with gold alike, the contrast speaks to the
    first; where p_sim^ann's agrees less, the gap is the confound to read the contrast against. The tail is where the
    two can part: reward models that agree alike on typical pairs can order the candidates best-of-n picks from
    differently."""
    measures = [(HELD_OUT, "", gold_agreement, "the curves' proxy, on val pairs whose gold differs")]
    if tail_agreement:
        measures.append(
            (
                f"{TAIL} {tail} best-of-n candidates",
                " on its top candidates",
                tail_agreement,
                f"the curves' proxy, on pairs of an eval prompt's {tail} candidates by it whose gold differs",
            )
        )
    first, second = LABELLERS
    out = []
    for measure, gap_measure, agreement, detail in measures:
        out += [
            _finding(f"reward model on {labeller} labels: {measure}", agreement[labeller], detail)
            for labeller in LABELLERS
            if labeller in agreement
        ]
        if all(labeller in agreement for labeller in LABELLERS):
            gap = agreement[first] - agreement[second]
            out.append(
                _finding(
                    f"reward model agreement with gold{gap_measure}: {first}'s minus {second}'s",
                    gap,
                    f"{first}'s reward model the {'weaker' if gap < 0 else 'stronger' if gap > 0 else 'equal'} proxy",
                )
            )
    return out


def held_out_peak(points: Sequence[np.ndarray], seed: int = 0) -> tuple[np.ndarray, tuple[int, int]]:
    """Each prompt's score at a curve's peak chosen without it: the prompts split in two halves at random (`seed`),
    each half scored at the point with the best mean on the other half. Returns those scores, (K, n) like each of
    `points` (a curve's points in order of pressure, each (K, n) on the same prompts), and the two peaks' indices.

    Why: the best of several noisy means is biased upward (the winner's curse), so the fall from the curve's own best
    point to its last is positive even where the curve is flat, and pooled over seeds it adds up to a "fall" that no
    seed shows. A peak chosen on other prompts is not: its mean minus the last point's has expectation 0 on a flat
    curve, and under a real fall it is the part of the fall that a peak chosen in advance would see."""
    n = points[0].shape[1]
    first = np.zeros(n, dtype=bool)
    first[np.random.default_rng(seed).permutation(n)[: n // 2]] = True
    means = lambda half: [float(p[:, half].mean()) if half.any() else 0.0 for p in points]  # noqa: E731
    peak_first, peak_second = int(np.argmax(means(~first))), int(np.argmax(means(first)))
    return np.where(first, points[peak_first], points[peak_second]), (peak_first, peak_second)


def proxy_fall_correlations(per_seed: Sequence[Sequence[dict]], n_boot: int = N_BOOT, seed: int = 0) -> list[dict]:
    """Over every seed's best-of-n curves (two a seed, one per reward model): Spearman between each reward model's
    agreement with gold, held out and among its top candidates (`proxy_findings`), and its curve's out-of-sample fall
    in gold (`overoptimization_findings`), with a 95% bootstrap interval over the curves; none below four curves.

    Why: which measure of proxy quality tells how far best-of-n falls says which gap a contrast between the two
    labellers' curves is to be read against (`proxy_findings`); the curves of several seeds are the sample."""
    pairs: dict[str, list[tuple[float, float]]] = {}
    for fs in per_seed:
        found = {f["quantity"]: f["value"] for f in fs}
        for labeller in LABELLERS:
            fall = found.get(
                f"out-of-sample over-optimization: best_of_n, reward model on {labeller} labels, judged by gold"
            )
            for measure in (HELD_OUT, TAIL):
                name = f"reward model on {labeller} labels: {measure}"
                value = next((v for q, v in found.items() if q.startswith(name)), None)
                if fall is not None and value is not None and math.isfinite(fall) and math.isfinite(value):
                    pairs.setdefault(measure, []).append((value, fall))
    out = []
    for measure, xy in pairs.items():
        if len(xy) < 4:
            continue
        x, y = np.array(xy).T
        picks = np.random.default_rng(seed).integers(0, len(xy), size=(n_boot, len(xy)))
        estimate, boot = float(spearman(x, y)), spearman(x[picks], y[picks])
        boot = boot[np.isfinite(boot)]  # a draw of one repeated curve has no ranks
        ci = (
            draws_interval(estimate, boot, 0.95)
            if math.isfinite(estimate) and boot.size
            else {"estimate": estimate, "low": math.nan, "high": math.nan}
        )  # every curve's agreement (or fall) the same: no ranking
        which = "held-out" if measure == HELD_OUT else "top-candidate"
        out.append(
            _finding(
                f"Spearman (reward model's {which} agreement with gold, its best-of-n curve's out-of-sample fall in "
                "gold)",
                ci["estimate"],
                f"{len(xy)} curves over {len(per_seed)} seeds; bootstrap over the curves; negative: the better proxy "
                "falls less",
                ci["low"],
                ci["high"],
            )
        )
    return out


def over_seeds(per_seed: Sequence[Sequence[dict]]) -> list[dict]:
    """`overoptimization_findings` (and `proxy_findings`) of several replicates (seeds) pooled: per curve and per
    contrast, the mean of the seeds' values with a 95% Student-t interval over the seeds (what another seed would
    show; each seed's own interval is over prompts), and on how many seeds a fall was present or a contrast resolved,
    in which direction (a proxy gap: on how many p_sim^ann's reward model was the weaker). A finding
    some seed lacks is pooled over the seeds that have it."""
    by_seed = [{f["quantity"]: f for f in fs} for fs in per_seed]
    out = []
    for quantity in by_seed[0]:
        found = [seed[quantity] for seed in by_seed if quantity in seed]
        values = [f["value"] for f in found]
        _, low, high = replicate_interval(values)
        first, second = LABELLERS
        if "over-optimization contrast:" in quantity:
            resolved = [f["value"] for f in found if f["detail"].startswith("resolved")]
            detail = (
                f"resolved on {sum(v > 0 for v in resolved)} of {len(found)} seeds with {first}'s fall the larger, "
                f"on {sum(v < 0 for v in resolved)} with {second}'s"
            )
        elif quantity.startswith("reward model agreement with gold"):
            detail = f"{first}'s the weaker proxy on {sum(v < 0 for v in values)} of {len(found)} seeds"
        elif quantity.startswith("reward model on"):
            detail = f"over {len(found)} seeds"
            low, high = max(low, 0.0), min(high, 1.0)  # an agreement: the t interval of few seeds can pass 0 or 1
        else:
            detail = f"present on {sum(f['detail'].startswith('present') for f in found)} of {len(found)} seeds"
        out.append(
            _finding(
                f"{quantity}, over {len(found)} seeds",
                float(np.mean(values)),
                f"{detail}; Student t over seeds",
                low,
                high,
            )
        )
    return out


def curves_over_seeds(per_seed: Sequence[Sequence[dict]]) -> list[dict]:
    """The over-optimization curves of several replicates (seeds), point by point: per reward model (``labeller``),
    family, judge and pressure, the mean of the seeds' win rates with a 95% Student-t interval over the seeds
    (``seeds``: how many drew the point); the judge ``gold`` is the mean gold reward ×100. `per_seed`: each seed's
    ``overoptimization`` rows. Pooled by pressure, not by proxy reward: each seed's reward models score on a scale of
    their own, while n (or a PPO step) means the same on every seed. Rows ordered by family, labeller (p_sim^ann
    first), judge (gold first) and pressure."""
    values: dict[tuple[str, str, str, float], list[float]] = {}
    for rows in per_seed:
        gold_seen = set()
        for r in rows:
            values.setdefault((r["family"], r["labeller"], r["annotator"], r["pressure"]), []).append(r["win_rate"])
            gold = (r["family"], r["labeller"], "gold", r["pressure"])
            if gold not in gold_seen and r["mean_gold"] is not None and not math.isnan(r["mean_gold"]):
                gold_seen.add(gold)
                values.setdefault(gold, []).append(100 * r["mean_gold"])
    # families and judges in the order they come, gold first; the labellers in LABELLERS' order (p_sim^ann, greedy)
    families, labellers, judges = (list(dict.fromkeys(key[part] for key in values)) for part in range(3))
    labellers.sort(key=lambda lab: LABELLERS.index(lab) if lab in LABELLERS else len(LABELLERS))

    def order(key: tuple[str, str, str, float]) -> tuple:
        family, labeller, judge, pressure = key
        return families.index(family), labellers.index(labeller), judge != "gold", judges.index(judge), pressure

    out = []
    for (family, labeller, judge, pressure), v in sorted(values.items(), key=lambda kv: order(kv[0])):
        _, low, high = replicate_interval(v)
        out.append(
            {
                "family": family,
                "labeller": labeller,
                "judge": judge,
                "pressure": float(pressure),
                "seeds": len(v),
                "mean": float(np.mean(v)),
                "low": low,
                "high": high,
            }
        )
    return out


def curves_markdown(rows: Sequence[dict]) -> str:
    """`curves_over_seeds` as Markdown: per family, a line per reward model and judge, a column per pressure, each
    cell the mean over the seeds [95% interval]."""
    lines = []
    for family in dict.fromkeys(r["family"] for r in rows):
        mine = [r for r in rows if r["family"] == family]
        pressures = sorted({r["pressure"] for r in mine})
        seeds = max(r["seeds"] for r in mine)
        name = "n" if family == "best_of_n" else "step"
        lines += [
            f"{family} over {seeds} seeds: mean over the seeds [95% Student-t interval] (gold ×100, win rates in %)",
            "",
            "| reward model on | judged by | " + " | ".join(f"{name} = {p:g}" for p in pressures) + " |",
            "|---|---|" + "---:|" * len(pressures),
        ]
        for labeller, judge in dict.fromkeys((r["labeller"], r["judge"]) for r in mine):
            cells = {r["pressure"]: r for r in mine if (r["labeller"], r["judge"]) == (labeller, judge)}
            lines.append(
                f"| {labeller} | {judge} | "
                + " | ".join(
                    f"{c['mean']:.1f} [{_f(c['low'], '.1f')}, {_f(c['high'], '.1f')}]" if (c := cells.get(p)) else "—"
                    for p in pressures
                )
                + " |"
            )
        lines.append("")
    return "\n".join(lines)


def _f(x: float, fmt: str) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _findings_table(summary: Sequence[dict]) -> list[str]:
    lines = ["| finding | value [95% CI] | detail |", "|---|---:|---|"]
    for s in summary:
        ci = f" [{_f(s['low'], '.3g')}, {_f(s['high'], '.3g')}]" if not math.isnan(s["low"]) else ""
        lines.append(f"| {s['quantity']} | {_f(s['value'], '.3g')}{ci} | {s['detail']} |")
    return lines


def study_markdown(
    rows: Sequence[dict],
    summary: Sequence[dict],
    title: str = "Validation study",
    curves: Sequence[dict] = (),
    per_seed: Sequence[dict] = (),
) -> str:
    """The study as Markdown: the findings (quantity, value [95% CI], detail), then one line per method; with curves
    drawn under several seeds, the curves pooled over them (`curves_markdown`) and each seed's findings (`per_seed`)
    after the methods, so that the pooled findings are the ones read first."""
    lines = [f"### {title}", "", *_findings_table(summary)]
    lines += [
        "",
        "| method | simulated (p_sim^eval) [95% CI] | human-like [95% CI] | mean gold | Δ vs SFT, simulated | "
        "Δ vs SFT, human-like | human-like expected: win rate, Δ vs SFT | ranks sim / human / expected / gold |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        diffs = [
            "—"
            if not r[f"{a}_resolved"]
            else f"{r[f'{a}_diff_to_sft']:+.1f} [{r[f'{a}_diff_low']:+.1f}, {r[f'{a}_diff_high']:+.1f}] "
            f"{r[f'{a}_resolved']}"
            for a in ("sim", "human", "expected")
        ]
        expected = _f(r["expected_win_rate"], ".1f") + ("" if diffs[2] == "—" else f", {diffs[2]}")
        ranks = " / ".join(_f(r[f"{a}_rank"], "g") for a in ("sim", "human", "expected", "gold"))
        lines.append(
            f"| {r['method']} | {r['sim_win_rate']:.1f} [{r['sim_low']:.1f}, {r['sim_high']:.1f}] | "
            f"{r['human_win_rate']:.1f} [{r['human_low']:.1f}, {r['human_high']:.1f}] | {_f(r['mean_gold'], '.3f')} | "
            f"{diffs[0]} | {diffs[1]} | {expected} | {ranks} |"
        )
    k, n = max(r["replicates"] for r in rows), max(r["n"] for r in rows)
    lines += ["", f"{k} replicate(s) × {n} evaluation prompts; intervals: bootstrap over prompts (and replicates)."]
    if curves:
        lines += ["", curves_markdown(curves).rstrip("\n")]
    if per_seed:
        lines += ["", "#### Each seed's over-optimization findings", "", *_findings_table(per_seed)]
    return "\n".join(lines) + "\n"
