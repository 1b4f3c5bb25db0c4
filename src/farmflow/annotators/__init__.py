"""Simulated pairwise annotators: the offline oracle pool and API judges on any OpenAI-compatible endpoint.

An annotator looks at (instruction, input, output_a, output_b), shown in that order, and
returns 1 if it prefers the first output shown, 2 for the second, 1.5 for a tie (the
`logprobs` API format gives fractions in between). A pool assigns each pair to one
annotator (seeded hash of instruction + input), randomizes the order the two outputs are
shown in and un-swaps the answer, so the stored `preference` always refers to
``output_1``/``output_2`` of the table (1 = output_1 preferred, AlpacaFarm convention).

* kind ``oracle`` (`oracle.OracleAnnotator`): the synthetic farm's crowdworker, judging
  with the gold reward plus biases and noise; offline and free.
* kind ``api`` (`api.annotate_api`): LLM judges through `openai.AsyncOpenAI`, with our
  prompt templates (`prompts`), the row-level cache (`cache`), rate and cost limits. The
  loopback judge server (`server`) answers them offline with the oracle pool.
* kind ``hf`` (`hf.annotate_hf`): one local causal LM judging in this process from its
  next-token probabilities of (a) vs (b), read in both orders and averaged (so there is no
  order shown: ``swapped`` is False), with the same row-level cache. torch and transformers
  load only for this kind.

Label noise (p_sim^ann): with probability `label_noise` the label is a fair coin and the
annotator is never asked (the paper uses 0.5, i.e. 25% of labels flipped, half the cost).
All randomness comes from hashes of (seed, pair content), so a pair gets the same
annotator, order and label whatever batch or process it is annotated in.

A judge's identity (`judges_key`) is what the row cache keys its answers by, and part of
the key of every stage that annotates: another endpoint, model, prompt or prompt version
never reuses these labels.
"""

from __future__ import annotations

from typing import Callable, Sequence

import pyarrow as pa

from farmflow.annotators.api import AnnotationError, RunStats, annotate_api
from farmflow.annotators.cache import annotator_hash, resolve_base_url
from farmflow.annotators.oracle import Annotator, OracleAnnotator, is_list, sigmoid, task_from_text, unit_hash
from farmflow.config import AnnotatorConfig, StoreConfig
from farmflow.data import gold_reward
from farmflow.storage.schemas import SCHEMAS


class AnnotationIncomplete(RuntimeError):
    """Some pairs failed or were not sent (cost cap); what was judged is cached, a rerun asks the rest."""


def judges_key(cfg: AnnotatorConfig) -> dict:
    """What the fields of `cfg` alone do not pin down, for the key of every stage that uses it
    (`farmflow.tasks.core.key_config`): for API annotators, each judge's identity as the row cache hashes it
    (resolved endpoint, $OPENAI_BASE_URL included, model asked, prompt format and version, batch size, temperature,
    token cap), so another judge never reuses these labels; for the hf judge, its identity (`hf.judge_hash`).
    Nothing for the oracle."""
    if cfg.kind == "hf":
        from farmflow.annotators.hf import judge_hash  # torch and transformers load only for this kind

        return {"judge": judge_hash(cfg.hf)}
    if cfg.kind != "api":
        return {}
    return {"judges": [annotator_hash(a, resolve_base_url(a, cfg), cfg.served_model) for a in cfg.api_pool]}


def build_pool(cfg: AnnotatorConfig) -> list[Annotator]:
    if cfg.kind == "oracle":
        return [OracleAnnotator(a) for a in cfg.pool]
    raise ValueError(f"annotation.kind: unknown annotator kind {cfg.kind!r}")


def _annotate_oracle(rows: Sequence[dict], cfg: AnnotatorConfig) -> pa.Table:
    pool = build_pool(cfg)
    if cfg.kind == "oracle":
        untasked = next((r for r in rows if not r.get("task")), None)
        if untasked is not None:
            raise ValueError(
                f"oracle annotators need synthetic tasks with a gold reward; row {untasked.get('id', '?')!r} has none "
                "(use an API annotator for real data)"
            )
    out: list[dict] = []
    for row in rows:
        key = (row["instruction"], row["input"])
        annotator = pool[int(unit_hash(cfg.seed, "assign", *key) * len(pool))]
        swapped = unit_hash(cfg.seed, "order", *key, row["output_1"], row["output_2"]) < 0.5
        noised = (
            cfg.label_noise > 0
            and unit_hash(cfg.seed, "noise", *key, row["output_1"], row["output_2"]) < cfg.label_noise
        )
        if row["output_1"] == row["output_2"]:  # a tie is a tie, noisy annotators or not
            preference, noised = 1.5, False
        elif noised:
            preference = 1.0 if unit_hash(cfg.seed, "coin", *key, row["output_1"], row["output_2"]) < 0.5 else 2.0
        else:
            first, second = (row["output_2"], row["output_1"]) if swapped else (row["output_1"], row["output_2"])
            shown = annotator.judge(row, first, second, cfg.seed)
            preference = 3.0 - shown if swapped else shown
        out.append(
            {
                **{k: row.get(k, "") for k in ("id", "split", "instruction", "input", "output_1", "output_2", "task")},
                "annotator": annotator.name,
                "preference": preference,
                "noised": noised,
                "swapped": swapped,
                "gold_1": gold_reward(row.get("task"), row["output_1"]),
                "gold_2": gold_reward(row.get("task"), row["output_2"]),
            }
        )
    return pa.Table.from_pylist(out, schema=SCHEMAS["preferences"])


def _api_table(rows: Sequence[dict], judged: list[dict]) -> pa.Table:
    out = [
        {
            **{k: row.get(k, "") for k in ("id", "split", "instruction", "input", "output_1", "output_2", "task")},
            "annotator": j["annotator"],
            "preference": j["preference"],
            "noised": j["noised"],
            "swapped": j["swapped"],
            "gold_1": gold_reward(row.get("task"), row["output_1"]),
            "gold_2": gold_reward(row.get("task"), row["output_2"]),
            "p_1_shown_first": j.get("p_1_shown_first"),
            "p_1_shown_second": j.get("p_1_shown_second"),
        }
        for row, j in zip(rows, judged)
    ]
    return pa.Table.from_pylist(out, schema=SCHEMAS["preferences"])


def _incomplete_message(cfg: AnnotatorConfig, judged: list[dict], stats: RunStats) -> str:
    failed = [j for j in judged if j["status"] == "failed"]
    unsent = sum(j["status"] == "unsent" for j in judged)
    parts = []
    if failed:
        reasons = ", ".join(f"{k}: {v}" for k, v in stats.errors.most_common()) or "see the annotations cache"
        first = next((j.get("error") for j in failed if j.get("error")), None)
        parts.append(
            f"{len(failed)} of {len(judged)} pairs failed ({reasons})" + (f", e.g. {first[:200]}" if first else "")
        )
    if unsent:
        parts.append(
            f"max_cost_usd=${cfg.max_cost_usd:.6g} reached after ${stats.cost_usd:.6g}: {unsent} pairs not sent"
        )
    return (
        "annotation incomplete: "
        + "; ".join(parts)
        + ". Everything judged is in the row cache; rerun to ask the rest"
        + (" (raise annotation.max_cost_usd first)" if unsent else "")
        + "."
    )


def annotate(
    rows: Sequence[dict],
    cfg: AnnotatorConfig,
    store_uri: str | None = None,
    allow_incomplete: bool = False,
    progress: Callable[[int], None] | None = None,
) -> tuple[pa.Table, dict[str, float]]:
    """Label each pair (instruction, input, output_1, output_2, task) with the pool in `cfg`.

    Returns the ``preferences`` table (the input columns plus annotator, preference
    (1 = output_1, 2 = output_2, 1.5 = tie; null when failed), noised (label replaced by a
    coin), swapped (order shown was output_2 first), gold reward of both outputs, and for the
    hf judge P(output_1 better) with output_1 shown first and second) and the run totals
    (pairs, noised, cached, judged, failed, requests, tokens, cost_usd, ...; for the hf judge
    truncated and forward_passes). API and hf annotators use the row cache in the store at
    `store_uri` (default: the default store). Failed or unsent pairs raise
    `AnnotationIncomplete` unless `allow_incomplete`.
    `progress(n)` is told of every `n` pairs settled (judged, failed, cached, tied or noised).
    """
    if cfg.kind == "human":  # people's labels are read from the store, never asked for here
        raise ValueError(
            f"annotator human:{cfg.labeler} labels only the preference stage (annotation=human:NAME); to judge "
            f"evaluations with people's labels: farmflow leaderboard --judge human:{cfg.labeler}"
        )
    if cfg.kind == "oracle":
        table = _annotate_oracle(rows, cfg)
        if progress:
            progress(len(rows))
        return table, {
            "pairs": float(len(rows)),
            "noised": float(sum(table.column("noised").to_pylist())),
            "cost_usd": 0.0,
        }
    from farmflow.storage import open_store

    store = open_store(store_uri or StoreConfig().uri)
    if cfg.kind == "hf":
        from farmflow.annotators.hf import annotate_hf  # torch and transformers load only for this kind

        judged, hf_stats = annotate_hf(list(rows), cfg, store, progress)
        count = lambda status: float(sum(j["status"] == status for j in judged))  # noqa: E731
        return _api_table(rows, judged), {
            "pairs": float(len(rows)),
            "noised": count("noised"),
            "ties": count("tie"),
            "cached": float(hf_stats.cached),
            "judged": float(hf_stats.judged),
            "failed": 0.0,
            "truncated": float(hf_stats.truncated),
            "forward_passes": float(hf_stats.forward_passes),
            "prompt_tokens": float(hf_stats.prompt_tokens),
            "cost_usd": 0.0,
            "judge_seconds": hf_stats.seconds,
        }
    judged, stats = annotate_api(list(rows), cfg, store, progress)
    count = lambda status: float(sum(j["status"] == status for j in judged))  # noqa: E731
    metrics = {
        "pairs": float(len(rows)),
        "noised": count("noised"),
        "ties": count("tie"),
        "cached": float(sum(bool(j.get("cached")) and j["status"] == "ok" for j in judged)),
        "judged": float(stats.judged),
        "failed": count("failed"),
        "unsent": count("unsent"),
        "requests": float(stats.requests),
        "reasks": float(stats.reasks),
        "prompt_tokens": float(stats.prompt_tokens),
        "completion_tokens": float(stats.completion_tokens),
        "cost_usd": stats.cost_usd,
        "api_seconds": stats.seconds,
    }
    if (metrics["failed"] or metrics["unsent"]) and not allow_incomplete:
        raise AnnotationIncomplete(_incomplete_message(cfg, judged, stats))
    return _api_table(rows, judged), metrics


def annotate_pairs(rows: Sequence[dict], cfg: AnnotatorConfig, store_uri: str | None = None) -> pa.Table:
    """The ``preferences`` table of `annotate` (see there)."""
    return annotate(rows, cfg, store_uri)[0]


__all__ = [
    "AnnotationError",
    "AnnotationIncomplete",
    "Annotator",
    "OracleAnnotator",
    "annotate",
    "annotate_pairs",
    "build_pool",
    "is_list",
    "judges_key",
    "sigmoid",
    "task_from_text",
    "unit_hash",
]
