"""How good is a judge? Agreement with reference preferences, position and length bias, beside two baselines.

Input: an AlpacaEval annotations file, a JSON list of pairs with a reference preference (instruction, output_1,
output_2, optional input, preference: 1 = output_1 better, 2 = output_2, 0 or 1.5 a tie; fractions and numeric
strings as in the weighted judges' files, read with `stats.parse_preference`, and a fraction's side of 1.5 decides).
The pairs are the first `limit` rows with a decisive reference; ties and unreadable preferences met before them are
skipped and counted.

Every judge sees every pair in both orders. Its verdict on a pair is ``(p_1_shown_first, p_1_shown_second)``:
P(output_1 better) with output_1 shown as (a) and shown as (b); None where that order got no usable answer. The hf
judge gives its two next-token probabilities; an api judge two answers (1 or 0; fractions for ``format=logprobs``).
Per judge:

* agreement: the share of pairs where the judge's choice matches the reference's. The choice averages the orders it
  answered: output_1 when the mean is above .5, output_2 below; exactly .5 (the orders disagree) or no answer at all
  is undecided and scores half. 95% Wilson score interval (`wilson`);
* position bias: among pairs answered in both orders, the share where the judge chose the same slot both times,
  i.e. its choice followed the position, not the content; split into slot (a) and slot (b);
* length bias: among its decided choices on pairs of different length (characters), the share for the longer output;
* parse failures (orders without a usable answer) and seconds per judged pair (both orders; cached pairs are free).

Baselines on the same pairs: ``longer`` (the longer output wins; equal lengths score half) and ``coin`` (a fair coin
per pair, seeded by `seed` and the pair's content: expected 50%, the realised value reported).

The metrics are in `farmflow.evaluation.agreement`, the judges (specs, verdicts in both orders, the row cache) in
`farmflow.evaluation.judges`.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Sequence

from farmflow.evaluation.agreement import (
    INTERVAL,
    Pair,
    agreement,
    choice,
    coin_choices,
    length_bias,
    longer_choices,
    position_bias,
    summary,
    wilson,
)
from farmflow.evaluation.judges import (
    ORDER_CAP,
    SPEC_HELP,
    JudgeSpec,
    api_verdicts,
    check_judges,
    hf_verdicts,
    order_seed,
    parse_judge,
    split_api_target,
)
from farmflow.evaluation.stats import parse_preference

PAPER = [
    {
        "who": "GPT-4 vs human majority",
        "agreement": 0.65,
        "source": "AlpacaFarm (Dubois et al., 2023), annotator agreement",
    },
    {
        "who": "human vs human majority",
        "agreement": 0.66,
        "source": "AlpacaFarm (Dubois et al., 2023), annotator agreement",
    },
    {
        "who": "longest output vs human majority",
        "agreement": 0.622,
        "source": "AlpacaEval annotator leaderboard ('longest'; there 'gpt4' 66.6%, 'humans' 65.7%)",
    },
]


# ----------------------------------------------------------------------------- reading
def read_pairs(path: str | Path, limit: int | None = None) -> tuple[list[Pair], dict]:
    """The first `limit` (None: all) pairs of an annotations file with a decisive reference, and what the file holds:
    rows read, ties and unreadable preferences skipped before the limit, the reference's annotator name."""
    from farmflow.data.alpaca import read_records  # a DataError (a ValueError) names the file and what is wrong

    p = Path(path)
    rows = read_records(p)
    pairs: list[Pair] = []
    skipped = Counter()
    names = Counter()
    for i, r in enumerate(rows):
        if limit is not None and len(pairs) >= limit:
            break
        if not isinstance(r, dict):
            raise ValueError(f"{p}: row {i} is not an object")
        for k in ("instruction", "output_1", "output_2"):
            if not isinstance(r.get(k), str):
                raise ValueError(
                    f"{p}: row {i} has no string field {k!r} (needed: instruction, output_1, output_2, preference)"
                )
        ref = parse_preference(r.get("preference"))
        if ref is None:
            skipped["invalid"] += 1
        elif ref == 1.5:
            skipped["tie"] += 1
        else:
            pairs.append(
                Pair(r["instruction"], r.get("input") or "", r["output_1"], r["output_2"], 1.0 if ref < 1.5 else 2.0)
            )
            names[str(r.get("annotator") or "reference")] += 1
    if not pairs:
        raise ValueError(
            f"{p}: no row with a decisive reference preference ({skipped['tie']} ties, "
            f"{skipped['invalid']} missing or malformed)"
        )
    return pairs, {
        "rows_read": len(pairs) + sum(skipped.values()),
        "skipped_ties": skipped["tie"],
        "skipped_invalid": skipped["invalid"],
        "reference": names.most_common(1)[0][0],
    }


# ----------------------------------------------------------------------------- the report
def judge_quality(
    path: str | Path, specs: Sequence[str], limit: int | None = None, seed: int = 0, store_uri: str | None = None
) -> dict:
    """Run each judge of `specs` on the first `limit` decisive pairs of `path`; the report (module doc) as a dict:
    the file's counts, one row per judge, the `longer` and `coin` baselines, the paper's reference points."""
    from farmflow.progress import progress

    judges = [j for j in (parse_judge(s) for s in dict.fromkeys(specs)) if j is not None]
    check_judges(judges)
    pairs, info = read_pairs(path, limit)
    rows = []
    for j in judges:
        with progress(f"judge {j.spec}", len(pairs) * (2 if j.kind == "api" else 1), unit="pair") as bar:
            verdicts, stats = (hf_verdicts if j.kind == "hf" else api_verdicts)(j, pairs, store_uri, bar.update)
        rows.append(summary(j.spec, j.kind, [choice(v) for v in verdicts], pairs, verdicts, **stats))
    baselines = [
        summary("longer", "baseline", longer_choices(pairs), pairs),
        summary("coin", "baseline", coin_choices(pairs, seed), pairs, expected_agreement=0.5),
    ]
    reference_longer = length_bias([p.reference for p in pairs], pairs)
    return {
        "file": str(path),
        "reference": info["reference"],
        "pairs": len(pairs),
        "limit": limit,
        "seed": seed,
        "rows_read": info["rows_read"],
        "skipped_ties": info["skipped_ties"],
        "skipped_invalid": info["skipped_invalid"],
        "interval": INTERVAL,
        "reference_prefers_longer": reference_longer["prefers_longer"],
        "judges": rows,
        "baselines": baselines,
        "paper": PAPER,
    }


def report_markdown(report: dict) -> str:
    """The report as a Markdown table: judges, then the baselines, then the paper's reference points."""

    def pct(x: float | None) -> str:
        return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}"

    lines = [
        (
            f"Reference: {report['reference']} in {report['file']}: {report['pairs']} pairs (the first with a decisive "
            f"preference; {report['skipped_ties']} ties and {report['skipped_invalid']} unreadable skipped before "
            f"them). The reference prefers the longer output in {pct(report['reference_prefers_longer'])}%. Interval: "
            f"{report['interval']}."
        ),
        "",
        (
            "| judge | agreement % | 95% interval | undecided | same slot both orders % | prefers longer % "
            "| parse failures | s / pair |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["judges"] + report["baselines"]:
        name = r["judge"] + (
            " (baseline, expected 50.0)"
            if "expected_agreement" in r
            else " (baseline)"
            if r["kind"] == "baseline"
            else ""
        )
        secs = r.get("seconds_per_pair")
        speed = f"{secs:.2f}" if secs is not None else "cached" if r.get("cached") else "—"
        slots = (
            "—"
            if r["position_bias"] is None
            else f"{pct(r['position_bias'])} (a {pct(r['first_slot'])}, b {pct(r['second_slot'])})"
        )
        lines.append(
            f"| {name} | {pct(r['agreement'])} | {pct(r['ci_low'])}–{pct(r['ci_high'])} | {r['undecided']} "
            f"| {slots} | {pct(r['prefers_longer'])} | {r.get('parse_failures', '—')} | {speed} |"
        )
    for ref in report["paper"]:
        lines.append(f"| {ref['who']} (published) | {pct(ref['agreement'])} | | | | | | |")
    lines += [
        "",
        "Published points agree with human majority labels, not with this file's reference: "
        + "; ".join(f"{ref['who']}: {ref['source']}" for ref in report["paper"])
        + ".",
    ]
    return "\n".join(lines) + "\n"


__all__ = [
    "INTERVAL",
    "JudgeSpec",
    "ORDER_CAP",
    "PAPER",
    "Pair",
    "SPEC_HELP",
    "agreement",
    "api_verdicts",
    "check_judges",
    "choice",
    "coin_choices",
    "hf_verdicts",
    "judge_quality",
    "length_bias",
    "longer_choices",
    "order_seed",
    "parse_judge",
    "position_bias",
    "read_pairs",
    "report_markdown",
    "split_api_target",
    "summary",
    "wilson",
]
