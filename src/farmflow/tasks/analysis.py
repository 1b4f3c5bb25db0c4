"""Analysis stages: the proxy reward of a set of outputs, and over-optimization curves.

* ``proxy_reward``: the reward model's score of every evaluation-set output (reused from
  best-of-n's table when that reward model chose them, computed otherwise, e.g. for PPO
  checkpoints' generations); its mean is a point's proxy reward.
* ``overoptimization``: the curve table (``overoptimization`` schema), ``curve.md`` and
  ``curve.png``, from the points' proxy rewards and evaluations. Its config names every
  input by key, so the stage key covers all of them.
* ``reward_report``: the reward model's held-out accuracy beside baselines, overall and per
  task family (``reward_report`` schema and ``report.md``; `farmflow.evaluation.reward_report`).

The leaderboard (`leaderboard_task`) is a plain Prefect task, not a stage: it is rebuilt on every run.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pyarrow as pa
from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext

from farmflow.annotators import build_pool
from farmflow.annotators.oracle import pool_preference
from farmflow.config import AnnotatorConfig
from farmflow.data import prompts_of, split_rows
from farmflow.evaluation import leaderboard_markdown, leaderboard_rows, plot_leaderboard, run_of_rows
from farmflow.evaluation.cost import cost_report
from farmflow.evaluation.leaderboard import annotator_label, reference_label
from farmflow.evaluation.overopt import curve_markdown, curve_rows, plot_curves
from farmflow.evaluation.reward_report import report_markdown, report_rows
from farmflow.labeling.labels import simulated_labels
from farmflow.progress import progress
from farmflow.storage import ArtifactRef, canonical_json, open_store, stage_key
from farmflow.storage.schemas import SCHEMAS
from farmflow.tasks.registry import STAGES
from farmflow.tasks.stage import StageRun, Table, stage_task


@stage_task(STAGES["proxy_reward"])
def proxy_reward_task(
    run: StageRun, config: dict, outputs: ArtifactRef, reward: ArtifactRef, batch_size: int = 64
) -> Table:
    """The outputs table with `score` = the reward model's score; mean_reward in the metrics.

    config: {} (the output depends only on the inputs). `batch_size` (outputs scored per
    forward pass) is an option: memory only, not part of the key.
    """
    rows = run.store.read_table(outputs).to_pylist()
    chosen_by = run.store.record(outputs).get("inputs", {}).get("reward")
    if chosen_by == reward.key and all(r["score"] is not None for r in rows):
        scores = [r["score"] for r in rows]  # best-of-n already scored them with this reward model
    else:
        from farmflow.models import load_reward, score

        model, tokenizer = load_reward(run.store.model_dir(reward))
        with progress("proxy_reward", len(rows), unit="output") as bar:
            outs, prompts = [r["output"] for r in rows], prompts_of(rows)
            scores = score(model, tokenizer, prompts, outs, batch_size=batch_size, progress=bar).tolist()
    table = pa.Table.from_pylist([r | {"score": float(s)} for r, s in zip(rows, scores)], schema=SCHEMAS["outputs"])
    return Table(table, "outputs", {"mean_reward": sum(scores) / max(1, len(scores)), "n": float(len(scores))})


@stage_task(STAGES["overoptimization"])
def overoptimization_task(run: StageRun, config: dict) -> Table:
    """The over-optimization curve of the points in `config`.

    config: {"title": str, "points": [{"label", "labeller", "family", "pressure", "outputs": key,
    "proxy": proxy_reward key, "evaluations": {annotator label: evaluate key}}]}; `labeller` names the
    annotator whose labels trained the reward model (several labellers make several curves).
    """
    points = []
    for p in config["points"]:
        proxy = run.store.get("proxy_reward", p["proxy"])
        evals = {a: run.store.get("evaluate", k) for a, k in p["evaluations"].items()}
        missing = [f"proxy_reward/{p['proxy']}"] * (proxy is None) + [
            f"evaluate/{k}" for a, k in p["evaluations"].items() if evals[a] is None
        ]
        if missing:
            raise ValueError(
                f"over-optimization point {p['label']!r} (reward model on {p['labeller']} labels): "
                f"artifact(s) {missing} not in the store"
            )
        points.append(
            {
                **{k: p[k] for k in ("label", "labeller", "family", "pressure")},
                "outputs_key": p["outputs"],
                "proxy_reward": proxy.metrics["mean_reward"],
                "evaluations": {a: {"key": ref.key, "metrics": ref.metrics} for a, ref in evals.items()},
            }
        )
    rows = curve_rows(points)
    markdown = curve_markdown(rows, config["title"])
    with tempfile.TemporaryDirectory() as tmp:
        plot_curves(rows, f"{tmp}/curve.png", config["title"])
        png = Path(f"{tmp}/curve.png").read_bytes()
    return Table(
        pa.Table.from_pylist(rows, schema=SCHEMAS["overoptimization"]),
        "overoptimization",
        {"points": float(len(points))},
        extra_files={"curve.md": markdown.encode(), "curve.png": png},
    )


@stage_task(STAGES["reward_report"])
def reward_report_task(
    run: StageRun,
    config: dict,
    preferences: ArtifactRef,
    sft: ArtifactRef,
    reward: ArtifactRef,
    batch_size: int = 64,
) -> Table:
    """The reward model against baselines on the held-out (val) preference pairs.

    Scorers: ``reward_model``; ``longer_output`` (characters); ``policy_loglik``, the SFT
    policy's mean token log-likelihood of each output (no training: what the policy's own
    confidence knows); on synthetic rows ``gold`` (the gold reward itself) and, when the
    labels came from the oracle pool, ``pool_bayes`` (the Bayes-optimal guess,
    `farmflow.annotators.oracle.pool_preference`).

    config: {"annotation": AnnotatorConfig (or its dict), "title": str}. `batch_size` is an
    option (memory only).
    """
    rows = split_rows(run.store.read_table(preferences), "val")
    if not rows:
        raise ValueError(f"reward_report: preferences {preferences.key} have no val pairs to measure on")
    from farmflow.methods.dpo import reference_logps
    from farmflow.models import load_policy, load_reward, score

    prompts, out_1, out_2 = prompts_of(rows), [r["output_1"] for r in rows], [r["output_2"] for r in rows]
    model, tokenizer = load_reward(run.store.model_dir(reward))
    with progress("reward_report: score", 2 * len(rows), unit="output") as bar:
        scorers = {
            "reward_model": (
                score(model, tokenizer, prompts, out_1, batch_size=batch_size, progress=bar).tolist(),
                score(model, tokenizer, prompts, out_2, batch_size=batch_size, progress=bar).tolist(),
            )
        }
    scorers["longer_output"] = ([len(o) for o in out_1], [len(o) for o in out_2])
    policy, tokenizer = load_policy(run.store.model_dir(sft))
    scorers["policy_loglik"] = reference_logps(
        policy,
        tokenizer,
        prompts,
        out_1,
        out_2,
        policy.config.max_position_embeddings,
        batch_size,
        average=True,
        label="reward_report: policy log-likelihood",
    )
    if all(r["gold_1"] is not None and r["gold_2"] is not None for r in rows):
        scorers["gold"] = ([r["gold_1"] for r in rows], [r["gold_2"] for r in rows])
        annotation = AnnotatorConfig.model_validate(config["annotation"])
        if annotation.kind == "oracle":
            pool = build_pool(annotation)
            scorers["pool_bayes"] = ([0.5] * len(rows), [pool_preference(pool, r) for r in rows])
    table = report_rows(rows, scorers)
    headline = {f"{r['scorer']}_{r['target']}": r["accuracy"] for r in table if r["family"] == "all"}
    return Table(
        pa.Table.from_pylist(table, schema=SCHEMAS["reward_report"]),
        "reward_report",
        headline,
        extra_files={"report.md": report_markdown(table, config.get("title", "Reward model report")).encode()},
    )


def board_entry(store, method: str, ref: ArtifactRef, record: dict, rows: list[dict], group: str) -> dict:
    """One evaluation as a leaderboard entry (`evaluation.leaderboard_rows`): its metrics and rows, its group, and
    the judge and references it was judged with, named from its record."""
    data_key = record["inputs"].get("data") or "?"
    data = store.get("data", data_key)  # its config names the evaluation file of the real farm
    return {
        "method": method,
        "metrics": ref.metrics,
        "rows": rows,
        "group": group,
        "annotator": annotator_label(record["config"]),
        "reference": reference_label(data_key, data and store.record(data)["config"]),
        "evaluation_key": ref.key,
    }


@task(name="leaderboard", cache_policy=NO_CACHE, persist_result=False)
def leaderboard_task(store_uri: str, evaluations: dict[str, ArtifactRef], title: str = "Leaderboard") -> ArtifactRef:
    """One row per method from the evaluations (`evaluation.leaderboard_rows`), computed when its key is new (its
    evaluations, their difficulty peers and the title) and read back from the store otherwise: the LC win rate's
    leave-one-out difficulty fits take minutes on the synthetic-tiny evaluation set.

    The LC win rate's instruction difficulty is pooled over the board's evaluations plus
    every other evaluation in the store with the same annotator config and the same
    evaluation split (its content digest; their keys enter the leaderboard's key). The artifact holds the Parquet
    table plus
    ``leaderboard.md`` and ``leaderboard.png``; inside a flow the table is also published
    as Prefect markdown and table artifacts.
    """
    store = open_store(store_uri)
    committed = store.records()
    records = {r["ref"]["key"]: r for r in committed if r["ref"]["stage"] == "evaluate"}
    data_refs = {
        r["ref"]["key"]: ArtifactRef.model_validate(r["ref"]) for r in committed if r["ref"]["stage"] == "data"
    }

    def group(
        record: dict,
    ) -> str:  # same judge, same references (the eval split's content): difficulties are comparable
        data_key = record["inputs"].get("data")
        data = data_refs.get(data_key)
        return canonical_json([record["config"], data.parts.get("eval", data_key) if data else data_key])

    board = {method: records.get(ref.key) or store.record(ref) for method, ref in evaluations.items()}
    groups = {group(record) for record in board.values()}
    board_keys = {ref.key for ref in evaluations.values()}
    peers = [r for k, r in records.items() if k not in board_keys and group(r) in groups]
    key = stage_key("leaderboard", "5", {"title": title, "peers": sorted(r["ref"]["key"] for r in peers)}, evaluations)
    ref = store.get("leaderboard", key)
    if ref is not None:
        rows = store.read_table(ref).to_pylist()
        markdown, cost_md = (store.read_file(ref, name).decode() for name in ("leaderboard.md", "cost.md"))
    else:
        entries = [
            board_entry(store, method, ref, board[method], store.read_table(ref).to_pylist(), group(board[method]))
            for method, ref in evaluations.items()
        ]
        peer_runs: dict[str, list[dict]] = {}
        for r in peers:
            peer_runs.setdefault(group(r), []).append(
                run_of_rows(store.read_table(ArtifactRef.model_validate(r["ref"])).to_pylist())
            )
        rows = leaderboard_rows(entries, peer_runs)
        markdown = leaderboard_markdown(rows, title)
        judged = {e["evaluation_key"]: e["rows"] for e in entries}  # the judges' API spend on them, from the row cache
        cache = simulated_labels(store)
        rows, cost_md, cost_png = cost_report(rows, committed, f"{title}: win rate vs cost", cache, judged)
        with tempfile.TemporaryDirectory() as tmp:
            plot_leaderboard(rows, f"{tmp}/leaderboard.png", title)
            png = Path(f"{tmp}/leaderboard.png").read_bytes()
        ref = store.put_table(
            "leaderboard",
            key,
            pa.Table.from_pylist(rows, schema=SCHEMAS["leaderboard"]),
            "leaderboard",
            inputs=evaluations,
            metrics={"difficulty_peer_runs": float(len(peers))},
            extra_files={
                "leaderboard.md": markdown.encode(),
                "leaderboard.png": png,
                "cost.md": cost_md.encode(),
                "cost.png": cost_png,
            },
        )
    if TaskRunContext.get() is not None:  # not when called as task.fn(...) outside a flow
        create_markdown_artifact(
            markdown + f"\nParquet, Markdown and plot: `{ref.uri}`\n", key="leaderboard", description=title
        )
        create_markdown_artifact(  # each row's cost beside its quality (farmflow leaderboard --cost)
            cost_md + f"\nPlot (win rate vs cost, Pareto frontier): `{ref.uri}/cost.png`\n",
            key="leaderboard-cost",
            description=f"{title}: quality and cost",
        )
        cols = (
            "method",
            "win_rate",
            "standard_error",
            "discrete_win_rate",
            "lc_win_rate",
            "mean_gold",
            "gold_standard_error",
            "avg_length",
            "n",
        )
        create_table_artifact(
            [{k: (None if r[k] != r[k] else r[k]) for k in cols} for r in rows],  # NaN is not JSON
            key="leaderboard-table",
            description=title,
        )
    return ref
