"""Judges to measure: ``--judge`` specs (hf:MODEL, api:BASE_URL@MODEL) and their verdicts on pairs in both orders.

An api judge runs through `farmflow.annotators.annotate` and so through the row cache. The cache keys a pair by its
content and the judge's identity, not by the order it was shown in, so the two orders are asked as two judges whose
only difference is a completion cap (`ORDER_CAP`) one and two tokens above the format's own: enough for the answer
either way, and each order gets its cache rows. The order shown follows the annotator seed; each group of pairs is
sent with a seed that shows it in the wanted order (`order_seed`), and the returned ``swapped`` column is checked.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import count
from typing import Callable, Sequence
from urllib.parse import parse_qsl

from pydantic import ValidationError

from farmflow.annotators import annotate, unit_hash
from farmflow.annotators.cache import canonical, max_tokens
from farmflow.config import AnnotatorConfig, ApiAnnotatorConfig, HFJudgeConfig
from farmflow.evaluation.agreement import Pair, Verdict

ORDER_CAP = (1, 2)  # completion tokens above the format's default cap: output_1 shown first, output_1 shown second
SPEC_HELP = (
    "hf:MODEL[?batch_size=N&max_prompt_tokens=N&dtype=D&device=D&gguf_file=F&revision=R] "
    "(a model-cache name, folder or hub id), api:BASE_URL@MODEL[?temperature=T&format=F&style=S"
    "&max_in_flight=N&timeout_s=S] "
    "(an OpenAI-compatible endpoint; key in $OPENAI_API_KEY; default format choice, temperature 0), "
    "longer or coin (the baselines, always included)"
)
# Agreement of other judges with human majority labels, for scale (the reference here is a file's judge instead).
HF_OPTIONS = {"batch_size", "max_prompt_tokens", "dtype", "device", "gguf_file", "revision"}
API_OPTIONS = {"temperature": "temperature", "format": "prompt_format", "style": "style"}
POOL_OPTIONS = {"max_in_flight", "timeout_s"}  # the api judge's request limits (a slow local server wants few at once)


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
