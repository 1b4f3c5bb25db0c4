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

An api judge runs through `farmflow.annotators.annotate` and so through the row cache. The cache keys a pair by its
content and the judge's identity, not by the order it was shown in, so the two orders are asked as two judges whose
only difference is a completion cap (`ORDER_CAP`) one and two tokens above the format's own: enough for the answer
either way, and each order gets its cache rows. The order shown follows the annotator seed; each group of pairs is
sent with a seed that shows it in the wanted order (`order_seed`), and the returned ``swapped`` column is checked.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Callable, Sequence
from urllib.parse import parse_qsl

from pydantic import ValidationError

from farmflow.annotators import annotate, unit_hash
from farmflow.annotators.cache import canonical, max_tokens
from farmflow.config import AnnotatorConfig, ApiAnnotatorConfig, HFJudgeConfig
from farmflow.evaluation.stats import parse_preference

Z95 = 1.959963984540054  # standard normal quantile at 0.975
INTERVAL = "Wilson score interval, 95%"
ORDER_CAP = (1, 2)  # completion tokens above the format's default cap: output_1 shown first, output_1 shown second
SPEC_HELP = (
    "hf:MODEL[?batch_size=N&max_prompt_tokens=N&dtype=D&device=D&gguf_file=F&revision=R] "
    "(a model-cache name, folder or hub id), api:BASE_URL@MODEL[?temperature=T&format=F&style=S"
    "&max_in_flight=N&timeout_s=S] "
    "(an OpenAI-compatible endpoint; key in $OPENAI_API_KEY; default format choice, temperature 0), "
    "longer or coin (the baselines, always included)"
)
# Agreement of other judges with human majority labels, for scale (the reference here is a file's judge instead).
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
HF_OPTIONS = {"batch_size", "max_prompt_tokens", "dtype", "device", "gguf_file", "revision"}
API_OPTIONS = {"temperature": "temperature", "format": "prompt_format", "style": "style"}
POOL_OPTIONS = {"max_in_flight", "timeout_s"}  # the api judge's request limits (a slow local server wants few at once)


@dataclass(frozen=True)
class Pair:
    """One judged pair; `reference` is the file's decisive preference (1.0: output_1 better, 2.0: output_2)."""

    instruction: str
    input: str
    output_1: str
    output_2: str
    reference: float


Verdict = tuple[float | None, float | None]  # P(output_1 better) with output_1 shown first / second


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


# ----------------------------------------------------------------------------- metrics (plain numbers in and out)
def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion `successes / n` (half points allowed); NaNs when n is 0."""
    if n <= 0:
        return math.nan, math.nan
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def choice(verdict: Verdict) -> float:
    """1.0 (output_1), 2.0 (output_2) or 1.5 (undecided): the mean of the orders answered against .5."""
    known = [p for p in verdict if p is not None]
    if not known:
        return 1.5
    mean = sum(known) / len(known)
    return 1.0 if mean > 0.5 else 2.0 if mean < 0.5 else 1.5


def agreement(choices: Sequence[float], references: Sequence[float]) -> dict:
    """Share of choices equal to the reference (undecided: half), its Wilson interval, n and the undecided count."""
    score = sum(1.0 if c == r else 0.5 if c == 1.5 else 0.0 for c, r in zip(choices, references, strict=True))
    n = len(choices)
    low, high = wilson(score, n)
    return {
        "agreement": score / n if n else math.nan,
        "ci_low": low,
        "ci_high": high,
        "n": n,
        "undecided": sum(c == 1.5 for c in choices),
    }


def position_bias(verdicts: Sequence[Verdict]) -> dict:
    """Among pairs answered in both orders: the share where the same slot won both times, (a) and (b) apart.

    With output_1 shown as (a), (a) wins when p_1_shown_first > .5; with output_1 shown as (b), (a) (now output_2)
    wins when p_1_shown_second < .5."""
    both = [(f, s) for f, s in verdicts if f is not None and s is not None]
    first = sum(f > 0.5 and s < 0.5 for f, s in both)
    second = sum(f < 0.5 and s > 0.5 for f, s in both)
    n = len(both)
    share = (lambda k: k / n) if n else (lambda k: math.nan)
    return {
        "position_bias": share(first + second),
        "first_slot": share(first),
        "second_slot": share(second),
        "position_pairs": n,
    }


def length_bias(choices: Sequence[float], pairs: Sequence[Pair]) -> dict:
    """Share of decided choices for the longer output, over pairs whose outputs differ in length."""
    decided = [
        (c, len(p.output_1), len(p.output_2))
        for c, p in zip(choices, pairs, strict=True)
        if c != 1.5 and len(p.output_1) != len(p.output_2)
    ]
    longer = sum((c == 2.0) == (l2 > l1) for c, l1, l2 in decided)
    return {"prefers_longer": longer / len(decided) if decided else math.nan, "length_pairs": len(decided)}


def longer_choices(pairs: Sequence[Pair]) -> list[float]:
    """The `longer` baseline: the output with more characters wins; equal lengths are undecided."""
    return [
        1.0 if len(p.output_1) > len(p.output_2) else 2.0 if len(p.output_2) > len(p.output_1) else 1.5 for p in pairs
    ]


def coin_choices(pairs: Sequence[Pair], seed: int) -> list[float]:
    """The `coin` baseline: a fair coin per pair, from a hash of `seed` and the pair (the same whatever the order)."""
    return [
        1.0 if unit_hash(seed, "coin", p.instruction, p.input, p.output_1, p.output_2) < 0.5 else 2.0 for p in pairs
    ]


def summary(
    name: str,
    kind: str,
    choices: Sequence[float],
    pairs: Sequence[Pair],
    verdicts: Sequence[Verdict] | None = None,
    **extra,
) -> dict:
    """One row of the report: agreement (with interval), position bias (judges only), length bias, `extra`."""
    out = {"judge": name, "kind": kind, **agreement(choices, [p.reference for p in pairs])}
    out |= (
        position_bias(verdicts)
        if verdicts is not None
        else {"position_bias": None, "first_slot": None, "second_slot": None, "position_pairs": 0}
    )
    return out | length_bias(choices, pairs) | extra


# ----------------------------------------------------------------------------- judge specs
@dataclass(frozen=True)
class JudgeSpec:
    """A parsed ``--judge`` value: `kind` hf or api, the model, the api endpoint and the validated options."""

    spec: str
    kind: str
    model: str
    base_url: str | None = None
    options: dict = field(default_factory=dict)
    pool: dict = field(default_factory=dict)

    def hf_config(self) -> HFJudgeConfig:
        return HFJudgeConfig(model=self.model, **self.options)

    def api_annotator(self) -> ApiAnnotatorConfig:
        return ApiAnnotatorConfig(
            name=self.spec,
            model=self.model,
            base_url=self.base_url,
            **({"temperature": 0.0, "prompt_format": "choice"} | self.options),
        )


def split_api_target(target: str) -> tuple[str, str]:
    """(base URL, model) of ``BASE_URL@MODEL``: the first '@' in the URL's path, else the last '@' (a URL without a
    path). So a model name may hold '@', and user:password@ in a URL stays in the URL, where it is refused."""
    scheme, sep, rest = target.partition("://")
    slash = rest.find("/") if sep else -1
    at = target.find("@", len(scheme) + len(sep) + slash) if slash >= 0 else -1
    if at < 0:
        at = target.rfind("@")
    if at <= 0 or at == len(target) - 1:
        raise ValueError("an api judge is api:BASE_URL@MODEL, e.g. api:http://127.0.0.1:8000/v1@my-model")
    return target[:at], target[at + 1 :]


def parse_judge(spec: str) -> JudgeSpec | None:
    """A ``--judge`` value (`SPEC_HELP`); None for the baselines `longer` and `coin`. Bad values raise ValueError.

    Messages about an api judge never repeat its URL or options (they could hold a key)."""
    if spec in ("longer", "coin"):
        return None
    kind, _, rest = spec.partition(":")
    if kind not in ("hf", "api") or not rest:
        raise ValueError(f"--judge {spec!r}: expected {SPEC_HELP}")
    target, _, query = rest.partition("?")
    label = f"--judge {spec!r}" if kind == "hf" else "--judge api:..."
    try:
        options = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
    except ValueError:
        raise ValueError(f"{label}: options after '?' must be key=value pairs joined by '&'") from None
    known = HF_OPTIONS if kind == "hf" else set(API_OPTIONS) | POOL_OPTIONS
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"{label}: unknown option(s) {unknown}; known: {', '.join(sorted(known))}")
    if kind == "hf":
        parsed = JudgeSpec(spec, "hf", target, None, options)
    else:
        try:
            base_url, model = split_api_target(target)
        except ValueError as err:
            raise ValueError(f"{label}: {err}") from None
        parsed = JudgeSpec(
            spec,
            "api",
            model,
            base_url,
            {API_OPTIONS[k]: v for k, v in options.items() if k in API_OPTIONS},
            {k: v for k, v in options.items() if k in POOL_OPTIONS},
        )
    try:  # pydantic checks the values (a type, a range, a literal) and names the field
        parsed.hf_config() if kind == "hf" else (parsed.api_annotator(), AnnotatorConfig(**parsed.pool))
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise ValueError(f"{label}: {where + ': ' if where else ''}{first['msg']}") from None
    return parsed


def check_judges(specs: Sequence[JudgeSpec]) -> None:
    """Fail before any judging when a judge cannot run here: an hf model that is not available (ModelUnavailable),
    an api judge without $OPENAI_API_KEY (ValueError)."""
    from farmflow.modelcache import check_available

    for s in specs:
        if s.kind == "hf":
            check_available(s.model, s.options.get("revision"))
        elif not os.environ.get("OPENAI_API_KEY"):
            raise ValueError(f"--judge {s.spec!r}: set OPENAI_API_KEY (any value for a local server without a key)")


# ----------------------------------------------------------------------------- running judges
def rows_of(pairs: Sequence[Pair]) -> list[dict]:
    return [
        {
            "id": str(i),
            "split": "",
            "instruction": p.instruction,
            "input": p.input,
            "output_1": p.output_1,
            "output_2": p.output_2,
            "task": None,
        }
        for i, p in enumerate(pairs)
    ]


def hf_verdicts(
    spec: JudgeSpec, pairs: Sequence[Pair], store_uri: str | None, progress: Callable[[int], None] | None = None
) -> tuple[list[Verdict], dict]:
    """The hf judge's per-order probabilities on `pairs` (identical outputs: .5 both), and its run counts."""
    cfg = AnnotatorConfig(kind="hf", hf=spec.hf_config(), label_noise=0.0)
    table, metrics = annotate(rows_of(pairs), cfg, store_uri, allow_incomplete=True, progress=progress)
    first, second = table.column("p_1_shown_first").to_pylist(), table.column("p_1_shown_second").to_pylist()
    verdicts = [(0.5, 0.5) if f is None and s is None else (f, s) for f, s in zip(first, second)]
    judged = int(metrics.get("judged", 0))
    return verdicts, {
        "parse_failures": 0,
        "judged": judged,
        "cached": int(metrics.get("cached", 0)),
        "seconds_per_pair": metrics.get("judge_seconds", 0.0) / judged if judged else None,
    }


def order_seed(pair: Pair, output_1_second: bool) -> int:
    """The smallest annotator seed under which an api annotator shows `pair` with output_1 first (or second).

    The api annotators show the canonical output_2 first when ``unit_hash(seed, "order", instruction, input,
    canonical outputs) < .5``; `api_verdicts` checks the order they report."""
    c1, c2, flipped = canonical(pair.output_1, pair.output_2)
    for seed in count():
        canonical_2_first = unit_hash(seed, "order", pair.instruction, pair.input, c1, c2) < 0.5
        if (canonical_2_first != flipped) == output_1_second:
            return seed
    raise AssertionError("unreachable")


def api_verdicts(
    spec: JudgeSpec, pairs: Sequence[Pair], store_uri: str | None, progress: Callable[[int], None] | None = None
) -> tuple[list[Verdict], dict]:
    """The api judge's answer on `pairs` in both orders (module doc), and its run counts."""
    base = spec.api_annotator()
    per_order: list[list[float | None]] = []
    judged = cached = failed = 0
    start = time.perf_counter()
    for second, extra in zip((False, True), ORDER_CAP):
        annotator = base.model_copy(update={"max_tokens": max_tokens(base) + extra})
        groups: dict[int, list[int]] = defaultdict(list)
        for i, pair in enumerate(pairs):
            groups[order_seed(pair, second)].append(i)
        p1: list[float | None] = [None] * len(pairs)
        for seed, idx in sorted(groups.items()):
            cfg = AnnotatorConfig(kind="api", api_pool=[annotator], label_noise=0.0, seed=seed, **spec.pool)
            table, metrics = annotate(
                rows_of([pairs[i] for i in idx]), cfg, store_uri, allow_incomplete=True, progress=progress
            )
            shown = table.column("swapped").to_pylist()
            if any(s != second for s in shown):
                raise RuntimeError(
                    f"--judge {spec.spec!r}: the api annotator did not show the outputs in the order "
                    "its seed chose (farmflow.annotators changed how the order is drawn)"
                )
            for i, pref in zip(idx, table.column("preference").to_pylist()):
                p1[i] = None if pref is None else 2.0 - pref
            judged += int(metrics.get("judged", 0))
            cached += int(metrics.get("cached", 0))
            failed += int(metrics.get("failed", 0) + metrics.get("unsent", 0))
        per_order.append(p1)
    seconds = time.perf_counter() - start
    return list(zip(*per_order)), {
        "parse_failures": failed,
        "judged": judged // 2,
        "cached": cached // 2,
        "seconds_per_pair": 2 * seconds / judged if judged else None,
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
