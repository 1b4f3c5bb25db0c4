"""The validation study flow (``validation-study``; `farmflow study validate`): does the simulator rank methods like
humans do, and does over-optimization show? (AlpacaFarm Fig. 3, Fig. 5, Table 2; `farmflow.evaluation.study`.)

1. Every chosen method and the baselines under K replicates (`farmflow.flows.replicates`: K seeds, SFT replicated
   unless ``evaluation.replicate_sft`` is False), each judged by the simulated evaluator p_sim^eval; the leaderboard
   with intervals and each method's paired difference to SFT. Beside them, baselines of lesser quality for the
   all-systems ranking (the paper's Fig. 3 spans LLaMA 7B to GPT-4): SFT stopped after a quarter and half of its
   epochs (`short_sft_outputs`; ``sft_epochs``: snapshots of the replicate's SFT run, ``sft.snapshot_epochs``), the
   way the paper sets SFT on 10k demonstrations beside 52k; and,
   as the paper ranks its methods beside API models, the farm's writers (the reference policy, the demonstrator, the
   reference policy without mistakes; `farmflow.evaluation.study.writers`), each a `write` stage.
2. The human-like arm: a gold-based annotator whose sharpness makes one of its judgements agree with the mode of three
   others as often as a crowdworker with the other three (65.7%), calibrated on replicate 0's method pairs; it
   judges the same outputs (`evaluate` stages).
3. Over-optimization (the over-optimization flow's pieces): for each labeller (p_sim^ann, greedy) a reward model on
   its labels, best-of-n for each n (and PPO snapshots with `ppo_every`), every point judged by p_sim^ann, greedy and
   the human-like arm; the gold reward comes with every evaluation. With ``curve_replicates`` C the curves are drawn
   under the first C replicates' seeds (each its own SFT, labels and reward models), since which reward model
   over-optimizes further changes from seed to seed; each finding is kept per seed and pooled over them.
4. `study_task`: the ``validation_study`` table (one row per method), ``study_summary.parquet`` (Spearman and Pearson
   between the arms with bootstrap intervals, what the evaluation set resolves, over-optimization per curve and the
   contrast of p_sim^ann's fall with greedy's per judge and with each curve judged by its labeller, as in the paper,
   beside each reward model's agreement with gold, held out and among the best-of-n candidates it scores highest
   (a weaker proxy falls further too, above all one that misorders that tail); over C seeds
   also their mean with a Student-t interval over the seeds),
   ``study.md``, ``rankings.png``, ``overoptimization.png`` (replicate 0's curves); over C seeds also the curves
   pooled point by point (``study_curves.parquet``, ``overoptimization_seeds.png``: each point's mean over the seeds
   with its Student-t band, and a table of them in ``study.md``); Prefect markdown and table artifacts.

Every stage is cached by its key: a rerun executes nothing, a larger K runs only the new replicates.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from prefect import flow, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext

from farmflow.config import METHODS, FarmConfig
from farmflow.data import gold_reward
from farmflow.evaluation.bootstrap import N_BOOT
from farmflow.evaluation.overopt import LABELLERS
from farmflow.evaluation.study import (
    HUMAN,
    HUMAN_AGREEMENT,
    LEFT_OUT,
    SHORT_SFT,
    calibrate_sharpness,
    curves_over_seeds,
    gold_differences,
    human_like_annotator,
    is_method,
    over_seeds,
    overoptimization_findings,
    proxy_fall_correlations,
    proxy_findings,
    study_markdown,
    study_rows,
    study_summary,
    top_agreement,
    top_candidates,
    writers,
)
from farmflow.evaluation.study_plots import plot_curves_over_seeds, plot_overoptimization, plot_rankings
from farmflow.flows.form import MethodName, PresetName, prefect_run_name, run_config, with_form_doc
from farmflow.flows.overoptimization import (
    best_of_n_points,
    check_ppo_every,
    evaluating_annotators,
    labelled_upstream,
    point_configs,
    ppo_points,
)
from farmflow.flows.pipeline import Upstream, generate_outputs
from farmflow.flows.replicates import replicate_board_task, replicate_config, replicate_evaluations
from farmflow.flows.runner import StageRunner
from farmflow.storage import ArtifactRef, open_store, stage_key
from farmflow.storage.schemas import SCHEMAS
from farmflow.tasks import evaluate_task, sft_snapshot, write_task
from farmflow.tasks.analysis import overoptimization_task
from farmflow.tasks.methods import read_candidates

STUDY_NS = (1, 2, 4, 8, 16, 64)
VERSION = "13"  # 13: the curves' reward models' agreement with gold among their top best-of-n candidates


def _tables(store, refs: list[dict[str, ArtifactRef]]) -> dict[str, list[list[dict]]]:
    """method → [replicate r's evaluation rows]."""
    return {m: [store.read_table(evs[m]).to_pylist() for evs in refs] for m in refs[0]}


@task(name="validation_study", cache_policy=NO_CACHE, persist_result=False)
def study_task(
    store_uri: str,
    sim: list[dict[str, ArtifactRef]],
    human: list[dict[str, ArtifactRef]],
    curves: list[ArtifactRef],
    rewards: list[dict[str, ArtifactRef]],
    candidates: list[dict[str, ArtifactRef]],
    calibration: dict[str, float],
    title: str,
    n_boot: int = N_BOOT,
) -> ArtifactRef:
    """The study's table, findings and figures from its evaluations (flow doc, step 4); content-keyed, rebuilt only
    when an input changed. `curves`: replicate r's over-optimization curve at index r (empty: none); `rewards[r]`:
    its reward models by labeller, the proxies the curve optimized, and `candidates[r]` each one's largest best-of-n
    (their agreement with gold, held out and on those candidates, sits beside the curve's findings)."""
    store = open_store(store_uri)
    inputs = {
        f"{arm}:{m}@{r}": ref
        for arm, refs in (("sim", sim), ("human", human))
        for r, evs in enumerate(refs)
        for m, ref in evs.items()
    } | {("curve" if r == 0 else f"curve@{r}"): c for r, c in enumerate(curves)}
    inputs |= {
        f"{what}:{lab}@{r}": ref
        for what, each in (("reward", rewards), ("candidates", candidates))
        for r, refs in enumerate(each)
        for lab, ref in refs.items()
    }
    key = stage_key("validation_study", VERSION, {"title": title, "n_boot": n_boot, **calibration}, inputs)
    ref = store.get("validation_study", key)
    if ref is None:
        sim_rows, human_rows = _tables(store, sim), _tables(store, human)
        rows = study_rows(sim_rows, human_rows, n_boot=n_boot, sharpness=calibration["sharpness"])
        summary = study_summary(sim_rows, human_rows, rows, calibration, n_boot)
        curve_rows = [store.read_table(c).to_pylist() for c in curves]
        per_seed = [
            overoptimization_findings(curve_points(store, rows), n_boot)
            + proxy_findings(
                {
                    lab: ref.metrics["heldout_gold_accuracy"]
                    for lab, ref in reward.items()
                    if "heldout_gold_accuracy" in ref.metrics
                },
                *tail_agreements(store, best),
            )
            for rows, reward, best in zip(curve_rows, rewards, candidates, strict=True)
        ]
        seed_rows = [
            f | ({"quantity": f"{f['quantity']} [replicate {r}]"} if r else {})
            for r, fs in enumerate(per_seed)
            for f in fs
        ]
        pooled = curves_over_seeds(curve_rows) if len(curve_rows) > 1 else []
        if pooled:  # over several seeds the pooled findings lead; each seed's follow in a section of their own
            summary += over_seeds(per_seed) + proxy_fall_correlations(per_seed, n_boot)
            markdown = study_markdown(rows, summary, title, pooled, seed_rows)
            summary += seed_rows
        else:
            summary += seed_rows
            markdown = study_markdown(rows, summary, title)
        tables = {"study_summary.parquet": (pa.Table.from_pylist(summary), "study_summary")}
        with tempfile.TemporaryDirectory() as tmp:
            plot_rankings(rows, summary, f"{tmp}/rankings.png", title)
            files = {"study.md": markdown.encode(), "rankings.png": Path(f"{tmp}/rankings.png").read_bytes()}
            if curve_rows:
                plot_overoptimization(curve_rows[0], f"{tmp}/overoptimization.png", f"Over-optimization ({title})")
                files["overoptimization.png"] = Path(f"{tmp}/overoptimization.png").read_bytes()
            if pooled:
                plot_curves_over_seeds(pooled, f"{tmp}/overoptimization_seeds.png", f"Over-optimization ({title})")
                files["overoptimization_seeds.png"] = Path(f"{tmp}/overoptimization_seeds.png").read_bytes()
                tables["study_curves.parquet"] = (
                    pa.Table.from_pylist(pooled, schema=SCHEMAS["study_curves"]),
                    "study_curves",
                )
        ref = store.put_table(
            "validation_study",
            key,
            pa.Table.from_pylist(rows, schema=SCHEMAS["validation_study"]),
            "validation_study",
            config={"title": title, **calibration},
            inputs=inputs,
            metrics={q["quantity"]: q["value"] for q in summary if q["quantity"].startswith(("Spearman", "Pearson"))},
            extra_files=files,
            extra_tables=tables,
        )
    if TaskRunContext.get() is not None:
        markdown = store.read_file(ref, "study.md").decode()
        create_markdown_artifact(
            markdown + f"\nParquet, Markdown and plots: `{ref.uri}`\n", key="validation-study", description=title
        )
        summary = store.read_table(ref, "study_summary.parquet", "study_summary").to_pylist()
        create_table_artifact(
            [{k: (None if v != v else v) for k, v in r.items()} for r in summary],
            key="validation-study-findings",
            description=title,
        )
    return ref


def tail_agreements(store, candidates: dict[str, ArtifactRef]) -> tuple[dict[str, float], str]:
    """Each labeller's `top_agreement` on its curve's largest best-of-n artifact (`candidates`: labeller → artifact;
    the candidates' stored proxy rewards against their gold), and which candidates it read ("top 8 of 64")."""
    out, tail = {}, ""
    for labeller, ref in candidates.items():
        rows, every, big = read_candidates(store, ref, "validation_study")
        task = {r["id"]: r["task"] for r in rows}
        shape = (len(rows), big)
        proxy = np.array([c["reward"] for c in every], dtype=float).reshape(shape)
        gold = np.array([gold_reward(task[c["id"]], c["output"]) for c in every], dtype=float).reshape(shape)
        top = top_candidates(big)
        out[labeller], _ = top_agreement(proxy, gold, top)
        tail = f"top {top} of {big}"
    return out, tail


def curve_points(store, curve_rows: list[dict]) -> dict[tuple[str, str, str], list[dict]]:
    """(labeller, family, judge) → its points with their evaluation rows; judge 'gold' once per labeller and family."""
    curves: dict[tuple[str, str, str], list[dict]] = {}
    for r in curve_rows:
        rows = store.read_table(store.get("evaluate", r["evaluation_key"])).to_pylist()
        curves.setdefault((r["labeller"], r["family"], r["annotator"]), []).append(
            {"pressure": r["pressure"], "rows": rows}
        )
        gold = curves.setdefault((r["labeller"], r["family"], "gold"), [])
        if all(p["pressure"] != r["pressure"] for p in gold):
            gold.append({"pressure": r["pressure"], "rows": rows})
    return curves


def overoptimization_curve(
    run: StageRunner,
    cfg: FarmConfig,
    judges: dict[str, Any],
    ns: tuple[int, ...],
    ppo_every: int | None,
    replicate: str = "",
) -> tuple[ArtifactRef, dict[str, ArtifactRef], dict[str, ArtifactRef]]:
    """Best-of-n (and PPO) against a reward model per labeller, every point judged by every judge (flow doc, step 3);
    `replicate` marks the stage labels of a replicate's curve. Returns the curve, and by labeller its reward models
    and their largest best-of-n (every candidate scored)."""
    configs, sampled, rewards, candidates = [], None, {}, {}
    for labeller in LABELLERS:
        up = labelled_upstream(run, cfg, labeller)
        tag = f" [{labeller}]{replicate}"
        points = best_of_n_points(up, ns, tag, sampled)
        rewards[labeller], candidates[labeller] = up.reward, points[-1].outputs
        sampled = sampled or points[-1].outputs
        points += ppo_points(up, ppo_every, tag) if ppo_every else []
        configs += point_configs(up, points, judges, labeller, replicate)
    curve = run(
        overoptimization_task, {"title": f"Over-optimization ({cfg.name})", "points": configs}, "overoptimization"
    )
    return curve, rewards, candidates


def default_sft_epochs(cfg: FarmConfig) -> tuple[float, ...]:
    """The shortened SFT baselines' epochs: a quarter and a half of the preset's."""
    return (cfg.sft.epochs / 4, cfg.sft.epochs / 2)


def short_sft_outputs(up: Upstream, epochs: float) -> tuple[str, ArtifactRef]:
    """(name, evaluation-set outputs) of SFT stopped after `epochs`: the snapshot `up`'s SFT run committed there
    (``sft.snapshot_epochs`` holds `epochs`), partway through its learning-rate schedule. One run gives every
    baseline, where a run of their own per baseline would cost their epochs in training again."""
    name = SHORT_SFT.format(epochs=epochs)
    return name, generate_outputs(up, sft_snapshot(up.run.store_uri, up.sft, epochs), name)


def writer_outputs(up: Upstream, name: str, writer: str, error_rate: float, tag: str = "") -> ArtifactRef:
    """The evaluation-set answers of one of the farm's writers, drawn with the replicate's generation seed."""
    config = {"writer": writer, "error_rate": error_rate, "generator": name, "seed": up.cfg.generation.seed}
    return up.run(write_task, config, f"write {name}{tag}", data=up.data)


def run_study(
    cfg: FarmConfig,
    methods: list[str] | tuple[str, ...],
    replicates: int,
    ns: tuple[int, ...] = STUDY_NS,
    ppo_every: int | None = None,
    target_agreement: float = HUMAN_AGREEMENT,
    n_boot: int = N_BOOT,
    sft_epochs: tuple[float, ...] | None = None,
    with_writers: bool = True,
    curve_replicates: int = 1,
) -> dict[str, Any]:
    """The study (module doc) on one farm config; returns a JSON-able summary (findings, rows, artifacts, stages).
    `sft_epochs`: the shortened SFT baselines (None: `default_sft_epochs`; empty: none). `with_writers`: also rank the
    farm's writers (`writers`). `curve_replicates`: the over-optimization curves are drawn under this many
    replicates' seeds (`replicate_config`; they need no more replicates of the methods), each one's findings kept and
    pooled over the seeds (`over_seeds`)."""
    if cfg.data.source != "synthetic":
        raise ValueError(
            f"the validation study needs the synthetic farm's gold reward; data.source is {cfg.data.source!r}"
        )
    run = StageRunner(cfg.store.location, cfg.execution, cfg.name)
    outputs, sim, data = [], [], None
    short = sorted({float(e) for e in (default_sft_epochs(cfg) if sft_epochs is None else sft_epochs)})
    if any(not 0 < e < cfg.sft.epochs for e in short):
        raise ValueError(f"sft_epochs must lie between 0 and the preset's {cfg.sft.epochs:g} epochs, got {short}")
    check_ppo_every(ppo_every)
    if curve_replicates < 1:
        raise ValueError(f"curve_replicates must be at least 1, got {curve_replicates}")
    # every replicate's SFT run also commits the shortened baselines (snapshot_epochs is not in its key)
    cfg = cfg.model_copy(update={"sft": cfg.sft.model_validate(cfg.sft.model_dump() | {"snapshot_epochs": short})})
    snapshots = cfg
    if ns and ppo_every:
        # a replicate's PPO is also its p_sim^ann curve's (snapshot_every is not in its key): committing the snapshots
        # the curve reads the first time trains it once, not once without them and again with them
        snapshots = cfg.model_copy(update={"ppo": cfg.ppo.model_copy(update={"snapshot_every": ppo_every})})
    for r in range(replicates):
        up, done = replicate_evaluations(run, snapshots if r < curve_replicates else cfg, methods, r)
        data = data or up.data
        tag = f" [replicate {r}]" if r else ""
        extra = dict(short_sft_outputs(up, e) for e in short)
        if with_writers:
            extra |= {
                name: writer_outputs(up, name, writer, rate, tag) for name, (writer, rate) in writers(cfg.data).items()
            }
        for name, o in extra.items():
            done[name] = (
                o,
                run(evaluate_task, up.cfg.evaluation.annotator, f"evaluate {name}{tag}", outputs=o, data=data),
            )
        outputs.append({m: o for m, (o, _) in done.items()})
        sim.append({m: ev for m, (_, ev) in done.items()})
    calib_rows = [row for m, ev in sim[0].items() if is_method(m) for row in run.store.read_table(ev).to_pylist()]
    sharpness, reached = calibrate_sharpness(gold_differences(calib_rows), target_agreement)
    human = []
    for r in range(replicates):
        judge = human_like_annotator(sharpness, seed=replicate_config(cfg, r).evaluation.annotator.seed)
        tag = f" [replicate {r}]" if r else ""
        human.append(
            {
                m: run(evaluate_task, judge, f"evaluate {m} ({HUMAN}){tag}", outputs=o, data=data)
                for m, o in outputs[r].items()
            }
        )
    # the leaderboard's systems: the methods and the untrained model, not the study's shortened SFTs and writers
    methods_only = [{m: ev for m, ev in evs.items() if is_method(m) or m in LEFT_OUT} for evs in sim]
    board = replicate_board_task(
        run.store_uri, methods_only, f"Leaderboard: {cfg.name}, {replicates} replicate(s)", n_boot
    )
    curves, rewards, candidates = [], [], []
    for r in range(curve_replicates if ns else 0):
        cfg_r = replicate_config(cfg, r)
        # the labellers judge too (each curve is also judged by its own labeller, as in the paper), and the human arm
        judges = evaluating_annotators(cfg_r, LABELLERS) | {
            HUMAN: human_like_annotator(sharpness, seed=cfg_r.evaluation.annotator.seed)
        }
        curve, reward, best = overoptimization_curve(
            run, cfg_r, judges, tuple(ns), ppo_every, f" [replicate {r}]" if r else ""
        )
        curves.append(curve)
        rewards.append(reward)
        candidates.append(best)
    title = f"Validation study: {cfg.name}, {replicates} replicate(s)"
    calibration = {"sharpness": sharpness, "agreement": reached}
    ref = study_task(run.store_uri, sim, human, curves, rewards, candidates, calibration, title, n_boot)
    return {
        "preset": cfg.name,
        "replicates": replicates,
        "store": str(run.store.root),
        "rows": run.store.read_table(ref).to_pylist(),
        "findings": run.store.read_table(ref, "study_summary.parquet", "study_summary").to_pylist(),
        "curves": run.store.read_table(ref, "study_curves.parquet", "study_curves").to_pylist()
        if len(curves) > 1
        else [],
        "markdown": run.store.read_file(ref, "study.md").decode(),
        "leaderboard": run.store.read_file(board, "leaderboard.md").decode(),
        "artifacts": {"study": ref.uri, "leaderboard": board.uri}
        | {("overoptimization" if r == 0 else f"overoptimization@{r}"): c.uri for r, c in enumerate(curves)},
        "stages": run.timings,
    }


@flow(name="validation-study", flow_run_name=prefect_run_name, log_prints=True)
@with_form_doc("""    methods: Methods to study (default: all); the baselines (untrained, SFT) are always evaluated.
    replicates: Seeds of the whole experiment (None: evaluation.replicates).
    ns: Best-of-n sample counts of the over-optimization curves (default 1, 2, 4, 8, 16, 64; empty: no curves).
    ppo_every: Also PPO's curves: a snapshot every this many PPO steps, each a point (None: best-of-n only).
    agreement: Leave-one-out agreement the human-like arm is calibrated to: one judgement vs the mode of three others
        (humans on AlpacaEval's cross-annotations: 0.657).
    sft_epochs: Epochs after which SFT's snapshots are the shortened baselines (all-systems ranking; None: a quarter
        and half of sft.epochs).
    writers: Also rank the farm's writers as systems beside the pipeline's (the paper's API models).
    curve_replicates: Draw the over-optimization curves under this many replicates' seeds (their own SFT, labels and
        reward models; the methods need not be replicated as often) and pool each finding, and each curve point by
        point, over the seeds.
""")
def study_flow(
    preset: PresetName | None = None,
    methods: list[MethodName] | None = None,
    seed: int | None = None,
    eval_size: int | None = None,
    pref_size: int | None = None,
    replicates: int | None = None,
    ns: list[int] | None = None,
    ppo_every: int | None = None,
    agreement: float = HUMAN_AGREEMENT,
    sft_epochs: list[float] | None = None,
    writers: bool = True,
    curve_replicates: int = 1,
    overrides: list[str] | None = None,
    advanced: FarmConfig | None = None,
) -> dict[str, Any]:
    """The validation study: simulated vs human-like win rates over methods (Spearman, Pearson, intervals), each method
    against SFT, over-optimization under p_sim^ann, a greedy annotator and gold; table, plots and Prefect artifacts."""
    cfg = run_config(preset, advanced, overrides, seed, eval_size, pref_size)
    chosen = list(methods) if methods else list(METHODS)
    k = replicates or cfg.evaluation.replicates
    short = None if sft_epochs is None else tuple(sft_epochs)
    ns_ = tuple(STUDY_NS if ns is None else ns)
    return run_study(
        cfg,
        chosen,
        k,
        ns_,
        ppo_every,
        agreement,
        sft_epochs=short,
        with_writers=writers,
        curve_replicates=curve_replicates,
    )
