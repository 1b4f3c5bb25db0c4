"""Analysis stages: the proxy reward of a set of outputs, and over-optimization curves.

* ``proxy_reward``: the reward model's score of every evaluation-set output (reused from
  best-of-n's table when that reward model chose them, computed otherwise, e.g. for PPO
  checkpoints' generations); its mean is a point's proxy reward.
* ``overoptimization``: the curve table (``overoptimization`` schema), ``curve.md`` and
  ``curve.png``, from the points' proxy rewards and evaluations. Its config names every
  input by key, so the stage key covers all of them.
* ``reward_report``: the reward model's held-out accuracy beside baselines, overall and per
  task family (``reward_report`` schema and ``report.md``; `farmflow.evaluation.reward_report`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pyarrow as pa

from farmflow.data import prompts_of
from farmflow.config import AnnotatorConfig
from farmflow.evaluation.overopt import curve_markdown, curve_rows, plot_curves
from farmflow.evaluation.reward_report import report_markdown, report_rows
from farmflow.storage import ArtifactRef
from farmflow.storage.schemas import SCHEMAS
from farmflow.tasks.core import log, lookup, stage_task


@stage_task("proxy_reward", version="1")
def proxy_reward_task(store_uri: str, config: dict, outputs: ArtifactRef, reward: ArtifactRef, batch_size: int = 64) -> ArtifactRef:
    """The outputs table with `score` = the reward model's score; mean_reward in the metrics.

    config: {} (the output depends only on the inputs). `batch_size` (outputs scored per
    forward pass) is an option: memory only, not part of the key.
    """
    store, key, hit = lookup("proxy_reward", store_uri, config, outputs=outputs, reward=reward)
    if hit:
        return hit
    rows = store.read_table(outputs).to_pylist()
    chosen_by = store.record(outputs).get("inputs", {}).get("reward")
    if chosen_by == reward.key and all(r["score"] is not None for r in rows):
        scores = [r["score"] for r in rows]  # best-of-n already scored them with this reward model
    else:
        from farmflow.models import load_reward, score

        model, tokenizer = load_reward(store.model_dir(reward))
        scores = score(model, tokenizer, prompts_of(rows), [r["output"] for r in rows], batch_size=batch_size).tolist()
    table = pa.Table.from_pylist([r | {"score": float(s)} for r, s in zip(rows, scores)], schema=SCHEMAS["outputs"])
    mean = sum(scores) / max(1, len(scores))
    log("proxy_reward: mean %.3f over %d outputs", mean, len(scores))
    return store.put_table("proxy_reward", key, table, "outputs", config=config, inputs={"outputs": outputs, "reward": reward},
                           metrics={"mean_reward": mean, "n": float(len(scores))})


@stage_task("overoptimization", version="2")
def overoptimization_task(store_uri: str, config: dict) -> ArtifactRef:
    """The over-optimization curve of the points in `config`.

    config: {"title": str, "points": [{"label", "labeller", "family", "pressure", "outputs": key,
    "proxy": proxy_reward key, "evaluations": {annotator label: evaluate key}}]}; `labeller` names the
    annotator whose labels trained the reward model (several labellers make several curves).
    """
    store, key, hit = lookup("overoptimization", store_uri, config)
    if hit:
        return hit
    points = []
    for p in config["points"]:
        proxy = store.get("proxy_reward", p["proxy"])
        evals = {a: store.get("evaluate", k) for a, k in p["evaluations"].items()}
        missing = [f"proxy_reward/{p['proxy']}"] * (proxy is None) + [f"evaluate/{k}" for a, k in p["evaluations"].items() if evals[a] is None]
        if missing:
            raise ValueError(f"over-optimization point {p['label']!r} (reward model on {p['labeller']} labels): artifact(s) {missing} not in the store")
        points.append({**{k: p[k] for k in ("label", "labeller", "family", "pressure")}, "outputs_key": p["outputs"],
                       "proxy_reward": proxy.metrics["mean_reward"],
                       "evaluations": {a: {"key": ref.key, "metrics": ref.metrics} for a, ref in evals.items()}})
    rows = curve_rows(points)
    markdown = curve_markdown(rows, config["title"])
    with tempfile.TemporaryDirectory() as tmp:
        plot_curves(rows, f"{tmp}/curve.png", config["title"])
        png = Path(f"{tmp}/curve.png").read_bytes()
    return store.put_table("overoptimization", key, pa.Table.from_pylist(rows, schema=SCHEMAS["overoptimization"]), "overoptimization",
                           config=config, metrics={"points": float(len(points))},
                           extra_files={"curve.md": markdown.encode(), "curve.png": png})


@stage_task("reward_report", version="2")
def reward_report_task(
    store_uri: str, config: dict, preferences: ArtifactRef, sft: ArtifactRef, reward: ArtifactRef, batch_size: int = 64,
) -> ArtifactRef:
    """The reward model against baselines on the held-out (val) preference pairs.

    Scorers: ``reward_model``; ``longer_output`` (characters); ``policy_loglik``, the SFT
    policy's mean token log-likelihood of each output (no training: what the policy's own
    confidence knows); on synthetic rows ``gold`` (the gold reward itself) and, when the
    labels came from the oracle pool, ``pool_bayes`` (the Bayes-optimal guess,
    `farmflow.annotators.oracle.pool_preference`).

    config: {"annotation": AnnotatorConfig (or its dict), "title": str}. `batch_size` is an
    option (memory only).
    """
    store, key, hit = lookup("reward_report", store_uri, config, preferences=preferences, sft=sft, reward=reward)
    if hit:
        return hit
    from farmflow.annotators import build_pool
    from farmflow.annotators.oracle import pool_preference
    from farmflow.data import split_rows
    from farmflow.methods.dpo import reference_logps
    from farmflow.models import load_policy, load_reward, score

    rows = split_rows(store.read_table(preferences), "val")
    if not rows:
        raise ValueError(f"reward_report: preferences {preferences.key} have no val pairs to measure on")
    prompts, out_1, out_2 = prompts_of(rows), [r["output_1"] for r in rows], [r["output_2"] for r in rows]
    model, tokenizer = load_reward(store.model_dir(reward))
    scorers = {"reward_model": (score(model, tokenizer, prompts, out_1, batch_size=batch_size).tolist(),
                                score(model, tokenizer, prompts, out_2, batch_size=batch_size).tolist())}
    scorers["longer_output"] = ([len(o) for o in out_1], [len(o) for o in out_2])
    policy, tokenizer = load_policy(store.model_dir(sft))
    scorers["policy_loglik"] = reference_logps(policy, tokenizer, prompts, out_1, out_2, policy.config.max_position_embeddings,
                                               batch_size, average=True, label="reward_report: policy log-likelihood")
    if all(r["gold_1"] is not None and r["gold_2"] is not None for r in rows):
        scorers["gold"] = ([r["gold_1"] for r in rows], [r["gold_2"] for r in rows])
        annotation = AnnotatorConfig.model_validate(config["annotation"])
        if annotation.kind == "oracle":
            pool = build_pool(annotation)
            scorers["pool_bayes"] = ([0.5] * len(rows), [pool_preference(pool, r) for r in rows])
    table = report_rows(rows, scorers)
    headline = {f"{r['scorer']}_{r['target']}": r["accuracy"] for r in table if r["family"] == "all"}
    log("reward_report: reward model %.3f, policy log-likelihood %.3f, longer output %.3f against labels on %d val pairs",
        headline["reward_model_labels"], headline["policy_loglik_labels"], headline["longer_output_labels"], len(rows))
    return store.put_table("reward_report", key, pa.Table.from_pylist(table, schema=SCHEMAS["reward_report"]), "reward_report",
                           config=config, inputs={"preferences": preferences, "sft": sft, "reward": reward}, metrics=headline,
                           extra_files={"report.md": report_markdown(table, config.get("title", "Reward model report")).encode()})
