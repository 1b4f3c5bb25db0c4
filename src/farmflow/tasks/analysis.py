"""Analysis stages: the proxy reward of a set of outputs, and over-optimization curves.

* ``proxy_reward``: the reward model's score of every evaluation-set output (reused from
  best-of-n's table when that reward model chose them, computed otherwise, e.g. for PPO
  checkpoints' generations); its mean is a point's proxy reward.
* ``overoptimization``: the curve table (``overoptimization`` schema), ``curve.md`` and
  ``curve.png``, from the points' proxy rewards and evaluations. Its config names every
  input by key, so the stage key covers all of them.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pyarrow as pa

from farmflow.data import prompts_of
from farmflow.evaluation.overopt import curve_markdown, curve_rows, plot_curves
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
