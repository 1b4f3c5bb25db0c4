"""The in-process LLM judge as an annotator (annotation kind ``hf``): `annotate_hf` judges a preferences table's rows.

The judge itself (identity, loading, prompts, the forward pass) is `farmflow.annotators.hf_judge`, whose public names
this module re-exports: a local causal LM's next-token probabilities of the answers (a) and (b), never sampled, each
pair judged in both orders so position bias cancels; the preference is ``1 + P(output_2 better)`` in [1, 2] and
``swapped`` is always False.

Label noise, ties and the row cache work as for the API judges (`api.annotate_api`): the row key
holds the outputs in canonical order, the annotator hash is the judge's identity (`judge_hash`), and
judged rows are appended every `chunk_size` pairs, so a killed run loses at most one chunk. Concurrent
runs on one store judge each pair once: a run leases the pairs it judges and waits for the others'
answers in the row cache (`plan.settle`); a lease goes once its chunk is in the cache.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import farmflow.annotators.cache as cache
import farmflow.annotators.plan as planning
from farmflow.annotators.hf_judge import (
    ANSWER_LEAD,
    ANSWERS,
    CUT_MARK,
    PROMPT_VERSION,
    QUESTION,
    SYSTEM,
    Judge,
    Prompt,
    Verdict,
    answer_probs,
    cut_middle,
    encode,
    fit,
    judge_hash,
    judge_identity,
    judge_name,
    judge_pairs,
    judge_source,
    load_judge,
    render,
)
from farmflow.config import AnnotatorConfig
from farmflow.progress import log


# ----------------------------------------------------------------------------- the annotation run
@dataclass
class HFStats:
    judged: int = 0
    cached: int = 0
    truncated: int = 0
    forward_passes: int = 0
    prompt_tokens: int = 0
    seconds: float = 0.0
    truncated_examples: list[str] = field(default_factory=list)


def _cache_row(
    cfg: AnnotatorConfig, ahash: str, key: str, pair: tuple[str, str, str, str], v: Verdict, seconds: float
) -> dict:
    return {
        "key": key,
        "annotator": judge_name(cfg.hf),
        "annotator_hash": ahash,
        "model": cfg.hf.model,
        "instruction": pair[0],
        "input": pair[1],
        "output_1": pair[2],
        "output_2": pair[3],
        "preference": v.preference,
        "status": "ok",
        "error": None,
        "raw_completion": json.dumps({"mass_12": v.mass_12, "mass_21": v.mass_21, "cut_tokens": v.cut_tokens}),
        "prompt_tokens": v.prompt_tokens,
        "completion_tokens": 0,
        "price_usd": 0.0,
        "latency_s": seconds,
        "created": cache.now(),
        "prompt_format": "hf",
        "item": 1,
        "items": 1,
        "swapped": False,
        "p_1_shown_first": v.p_1_shown_first,
        "p_1_shown_second": v.p_1_shown_second,
    }


def annotate_hf(
    rows: list[dict], cfg: AnnotatorConfig, store, progress: Callable[[int], None] | None = None
) -> tuple[list[dict], HFStats]:
    """Judge `rows` (instruction, input, output_1, output_2) with the hf judge of `cfg`.

    Returns one dict per row (annotator, preference and the per-order probabilities relative to the
    row's output_1/output_2, noised, swapped (always False), status 'ok', 'tie' or 'noised', cached)
    and the run's stats. The judge is loaded only when some pair is not in the row cache.
    """
    ahash, name = judge_hash(cfg.hf), judge_name(cfg.hf)
    ok, _ = cache.read(store, {ahash}) if store is not None else ({}, {})
    plan: list[dict] = []
    todo: dict[str, tuple[str, str, str, str]] = {}
    for row in rows:
        ins, inp, o1, o2 = row["instruction"], row.get("input") or "", row["output_1"], row["output_2"]
        c1, c2, flipped = cache.canonical(o1, o2)
        entry = {"annotator": name, "flipped": flipped, "swapped": False, "noised": False}
        settled = cache.without_judge(cfg, ins, inp, o1, o2)
        if settled:
            entry |= settled
        else:
            entry["key"] = cache.row_key(ahash, ins, inp, c1, c2)
            if entry["key"] not in ok:
                todo[entry["key"]] = (ins, inp, c1, c2)
        plan.append(entry)

    stats = HFStats()
    waiting = Counter(e["key"] for e in plan if e.get("key") in todo)  # rows per pair to judge (a pair can repeat)
    if progress:
        progress(len(plan) - sum(waiting.values()))
    results: dict[str, dict] = {}
    loaded: list[Judge] = []
    passes_before: list[int] = []

    def ask(batch: planning.Todo, claims: planning.Claims | None) -> bool:
        """Judge the pairs this run holds, a chunk at a time; each chunk's leases go once its rows are cached."""
        pending = [p for pend in batch.values() for p in pend.values()]
        if not loaded:  # loaded only when this run judges something
            loaded.append(load_judge(cfg.hf))
            passes_before.append(loaded[0].forward_passes)
            log(
                "annotate: the hf judge %s judges %d pairs in both orders (%d cached)",
                name,
                len(todo),
                len(plan) - sum(waiting.values()),
            )
        judge = loaded[0]
        for lo in range(0, len(pending), cfg.chunk_size):
            chunk = pending[lo : lo + cfg.chunk_size]
            pairs = [(p.instruction, p.input, p.output_1, p.output_2) for p in chunk]
            t0 = time.perf_counter()
            verdicts = judge_pairs(judge, pairs, cfg.hf.batch_size)
            seconds = (time.perf_counter() - t0) / len(chunk)
            new = [_cache_row(cfg, ahash, p.key, pair, v, seconds) for p, pair, v in zip(chunk, pairs, verdicts)]
            if store is not None:
                store.append_rows(cache.NAMESPACE, cache.to_table(new), cache.NAMESPACE)
            if claims is not None:
                claims.release([p.key for p in chunk])
            results.update({r["key"]: r for r in new})
            cut = [(pair, v) for pair, v in zip(pairs, verdicts) if v.cut_tokens]
            stats.truncated += len(cut)
            stats.truncated_examples += [pair[0][:60] for pair, _ in cut][: max(0, 3 - len(stats.truncated_examples))]
            stats.judged += len(chunk)
            stats.prompt_tokens += sum(v.prompt_tokens for v in verdicts)
            if progress:
                progress(sum(waiting[p.key] for p in chunk))
        return True

    if todo:
        start = time.perf_counter()
        pending = {key: planning.Pending(key, *pair, swapped=False) for key, pair in todo.items()}
        answered = planning.settle({0: pending}, store, [ahash], ask, progress)  # pairs judged by another run
        ok = ok | answered
        stats.seconds = time.perf_counter() - start
        if loaded:
            stats.forward_passes = loaded[0].forward_passes - passes_before[0]
        if stats.truncated:
            log(
                "annotate: %d of %d pairs were longer than the hf judge's %d-token prompt: their outputs were cut "
                "in the middle (e.g. instructions %s)",
                stats.truncated,
                stats.judged,
                loaded[0].limit,
                stats.truncated_examples,
            )
        log(
            "annotate: the hf judge judged %d pairs in %d forward passes, %.1fs%s",
            stats.judged,
            stats.forward_passes,
            stats.seconds,
            f"; {len(answered)} judged by another run at the same time" if answered else "",
        )

    out = []
    for e in plan:
        if "key" in e:
            hit = results.get(e["key"]) or ok[e["key"]]
            s1, s2 = hit["p_1_shown_first"], hit["p_1_shown_second"]
            if e["flipped"]:  # the row's output_1 is the canonical output_2
                s1, s2 = 1.0 - s2, 1.0 - s1
            e |= {
                "preference": 3.0 - hit["preference"] if e["flipped"] else hit["preference"],
                "status": "ok",
                "p_1_shown_first": s1,
                "p_1_shown_second": s2,
                "cached": e["key"] not in results,
            }
            stats.cached += e["key"] not in results
        out.append(e)
    return out, stats


__all__ = [
    "ANSWERS",
    "ANSWER_LEAD",
    "CUT_MARK",
    "HFStats",
    "Judge",
    "PROMPT_VERSION",
    "Prompt",
    "QUESTION",
    "SYSTEM",
    "Verdict",
    "annotate_hf",
    "answer_probs",
    "cut_middle",
    "encode",
    "fit",
    "judge_hash",
    "judge_identity",
    "judge_name",
    "judge_pairs",
    "judge_source",
    "load_judge",
    "render",
]
