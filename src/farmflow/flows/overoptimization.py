"""The over-optimization flow (AlpacaFarm Fig. 5 and 12): curves of proxy reward, win rate and gold reward.

One curve per *labeller* (paper Fig. 5: p_sim^ann and the single greedy annotator). For
each labeller the flow reuses the shared upstream stages (data → base → SFT → pairs), has
the labeller annotate the PREF pairs (`annotate`), trains a reward model on those labels
(`train_reward`) and optimizes against it: best-of-n for each n in `ns` (best-of-n's own
stage, so a point the best-of-n flow already computed comes from the cache) and, with
`ppo_every`, PPO's snapshots. Every point gets its proxy reward under that reward model
(`proxy_reward`) and its evaluation (`evaluate`) under the labeller itself — or under the
`annotators` given, for every curve. One `overoptimization` artifact holds the table,
``curve.md`` and ``curve.png`` with all curves.

Labellers and evaluating annotators by name: p_sim^ann (the farm's annotation pool, label
noise included), greedy (`evaluation.overopt.GREEDY_ORACLE`, the synthetic farm's
p_sim^GPT-4), p_sim^eval (the evaluation pool). The single-reward-model curve judged by
two annotators is ``labellers=["p_sim^ann"], annotators=["p_sim^ann", "greedy"]``.

PPO's curve over training steps (`ppo_every`): PPO runs with `snapshot_every` set, each
committed snapshot is generated on the evaluation set and becomes a point (family
"ppo", pressure = PPO step; step 0 is the SFT model). More points (Quark...) come in as
`CurvePoint`s: pass them as `extra_points` (they join the first labeller's curve), or call
`evaluate_points` / `point_configs` with an `Upstream`.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from farmflow.config import FarmConfig
from farmflow.evaluation.overopt import GREEDY_ORACLE, LABELLERS, CurvePoint, annotator_labels
from farmflow.flows.form import PresetName, prefect_run_name, run_config, with_form_doc
from farmflow.flows.pipeline import Upstream, best_of_n_outputs, generate_outputs
from farmflow.flows.runner import StageRunner
from farmflow.storage import ArtifactRef
from farmflow.tasks import best_of_n_prefix_task, best_of_n_rescore_task, evaluate_task, reward_model_summary
from farmflow.tasks.analysis import overoptimization_task, proxy_reward_task

DEFAULT_NS = (1, 2, 4, 8, 16)


def evaluating_annotators(
    cfg: FarmConfig, names: list[str] | tuple[str, ...] = ("p_sim^ann", "greedy")
) -> dict[str, Any]:
    """Annotator label → AnnotatorConfig: p_sim^ann (cfg.annotation), greedy (GREEDY_ORACLE), p_sim^eval
    (cfg.evaluation.annotator).

    The preset spelling p_sim_ann / p_sim_eval is accepted too; the labels are always p_sim^ann / p_sim^eval.
    """
    known = {"p_sim^ann": cfg.annotation, "greedy": GREEDY_ORACLE, "p_sim^eval": cfg.evaluation.annotator}
    label = annotator_labels(names)
    return {label[n]: known[label[n]] for n in names}


def labelled_upstream(run: StageRunner, cfg: FarmConfig, labeller: str) -> Upstream:
    """The upstream stages with the PREF pairs labelled by `labeller`: data, SFT and pairs are shared
    (same stage keys), the preferences and the reward model are the labeller's own."""
    annotator = evaluating_annotators(cfg, [labeller])[labeller]
    return Upstream(run, cfg.model_copy(update={"annotation": annotator}))


def best_of_n_points(
    up: Upstream, ns: list[int] | tuple[int, ...] = DEFAULT_NS, tag: str = "", sampled: ArtifactRef | None = None
) -> list[CurvePoint]:
    """Best-of-n of the SFT model for each n, ranked by `up`'s reward model (`tag` marks the stage labels).

    The largest n is sampled and scored once (`best_of_n`), or with `sampled` (another labeller's
    largest-n artifact: the same SFT model and sampling settings) its candidates are only
    rescored (`best_of_n_rescore`); every smaller n takes the first n candidates
    (`best_of_n_prefix`: candidates nest, so that is best-of-n up to float rounding).
    """
    if not ns or any(n < 1 for n in ns):
        raise ValueError(f"ns must be positive sample counts, got {list(ns)}")
    ns = sorted(set(ns))
    top = ns[-1]
    if sampled is None:
        largest = best_of_n_outputs(
            up, up.sft, up.cfg.best_of_n.model_copy(update={"n": top}), "eval", f"best_of_{top}{tag}"
        )
    else:
        largest = up.run(
            best_of_n_rescore_task,
            {},
            f"best_of_{top}{tag} (rescored)",
            best_of_n=sampled,
            reward=up.reward,
            batch_size=up.cfg.generation.batch_size,
        )
    return [
        CurvePoint(
            label=f"best_of_{n}",
            family="best_of_n",
            pressure=n,
            outputs=largest
            if n == top
            else up.run(best_of_n_prefix_task, {"n": n}, f"best_of_{n}{tag}", best_of_n=largest, reward=up.reward),
        )
        for n in ns
    ]


def check_ppo_every(every: int | None) -> None:
    """A PPO curve's snapshot interval is a positive number of steps (None: no PPO curve); flows check it before any
    stage runs."""
    if every is not None and every < 1:
        raise ValueError(f"ppo_every must be a positive number of PPO steps, got {every}")


def ppo_points(up: Upstream, every: int, tag: str = "") -> list[CurvePoint]:
    """PPO from SFT against `up`'s reward model, a policy snapshot every `every` steps; one point per snapshot,
    step 0 = SFT."""
    from farmflow.tasks import rl

    check_ppo_every(every)
    config = up.cfg.ppo.model_copy(update={"snapshot_every": every})
    final = up.run(
        rl.ppo_task,
        config,
        f"ppo (snapshots){tag}",
        data=up.data,
        sft=up.sft,
        reward=up.reward,
        checkpoints=up.cfg.checkpoints,
    )
    points = [CurvePoint(label="ppo_step_0", family="ppo", pressure=0, outputs=generate_outputs(up, up.sft, "sft"))]
    for step, snapshot in rl.ppo_snapshots(up.run.store_uri, final).items():
        points.append(
            CurvePoint(
                label=f"ppo_step_{step}",
                family="ppo",
                pressure=step,
                outputs=generate_outputs(up, snapshot, f"ppo_step_{step}{tag}"),
            )
        )
    return points


def point_configs(
    up: Upstream, points: list[CurvePoint], annotators: dict[str, Any], labeller: str = "p_sim^ann", replicate: str = ""
) -> list[dict]:
    """Proxy reward (under `up`'s reward model) and evaluations of every point: the `overoptimization` stage's points.

    `labeller` names whose labels trained `up`'s reward model (the farm's own cfg.annotation is p_sim^ann);
    `replicate` marks a replicate's stage labels.
    """
    run, tag = up.run, f" [{labeller}]{replicate}"
    out = []
    for p in points:
        proxy = run(
            proxy_reward_task,
            {},
            f"proxy_reward {p.label}{tag}",
            outputs=p.outputs,
            reward=up.reward,
            batch_size=up.cfg.generation.batch_size,
        )
        evals = {
            a: run(evaluate_task, ann, f"evaluate {p.label}{tag} ({a})", outputs=p.outputs, data=up.data)
            for a, ann in annotators.items()
        }
        out.append(
            {
                "label": p.label,
                "labeller": labeller,
                "family": p.family,
                "pressure": p.pressure,
                "outputs": p.outputs.key,
                "proxy": proxy.key,
                "evaluations": {a: ref.key for a, ref in evals.items()},
            }
        )
    return out


def evaluate_points(
    up: Upstream, points: list[CurvePoint], annotators: dict[str, Any], title: str, labeller: str = "p_sim^ann"
) -> ArtifactRef:
    """Proxy reward and evaluations of every point (one reward model), then the curve artifact."""
    return up.run(
        overoptimization_task,
        {"title": title, "points": point_configs(up, points, annotators, labeller)},
        "overoptimization",
    )


@flow(name="overoptimization", flow_run_name=prefect_run_name, log_prints=True)
@with_form_doc("""    ns: Best-of-n sample counts, one point each (default 1, 2, 4, 8, 16).
    labellers: Whose labels train each curve's reward model: p_sim^ann, greedy, p_sim^eval
        (default p_sim^ann and greedy).
    annotators: Who judges every point (default: each curve's own labeller).
    ppo_every: A PPO snapshot every this many steps, one point each (empty: no PPO curve).
    extra_points: More points (label, family, pressure, outputs ref) for the first labeller's curve.
""")
def overoptimization_flow(
    preset: PresetName | None = None,
    seed: int | None = None,
    eval_size: int | None = None,
    pref_size: int | None = None,
    ns: list[int] | None = None,
    labellers: list[str] | None = None,
    annotators: list[str] | None = None,
    ppo_every: int | None = None,
    extra_points: list[CurvePoint] | None = None,
    overrides: list[str] | None = None,
    advanced: FarmConfig | None = None,
) -> dict[str, Any]:
    """One curve per labeller (default p_sim^ann and greedy): the labeller's preferences train a reward model;
    best-of-n for each n in `ns` and PPO snapshots every `ppo_every` steps optimize against it; each point is judged
    by the labeller (or by every annotator in `annotators`). `extra_points` join the first labeller's curve.

    Returns a JSON-able summary: the curve rows, the artifact, each labeller's preferences and reward model, per-stage
    timing.
    """
    cfg = run_config(preset, advanced, overrides, seed, eval_size, pref_size)
    chosen = list(
        evaluating_annotators(cfg, tuple(dict.fromkeys(labellers or LABELLERS)))
    )  # unknown names fail here, before any stage
    evaluators = evaluating_annotators(cfg, tuple(annotators)) if annotators else None
    check_ppo_every(ppo_every)
    run = StageRunner(cfg.store.location, cfg.execution, cfg.name)  # its execution settings, like every other flow
    configs, models, sampled = [], {}, None
    for i, labeller in enumerate(chosen):
        up = labelled_upstream(run, cfg, labeller)
        tag = f" [{labeller}]"
        curve = best_of_n_points(up, tuple(ns or DEFAULT_NS), tag, sampled)
        sampled = sampled or curve[-1].outputs  # later labellers rescore the first one's candidates
        points = curve + (ppo_points(up, ppo_every, tag) if ppo_every else [])
        points += list(extra_points or []) if i == 0 else []
        configs += point_configs(up, points, evaluators or evaluating_annotators(cfg, [labeller]), labeller)
        models[labeller] = {
            "preferences": up.preferences.key,
            "reward_model": up.reward.key,
            **reward_model_summary(up.reward.metrics),
        }
    curve = run(
        overoptimization_task, {"title": f"Over-optimization ({cfg.name})", "points": configs}, "overoptimization"
    )
    return {
        "preset": cfg.name,
        "store": str(run.store.root),
        "curve": run.store.read_table(curve).to_pylist(),
        "markdown": run.store.read_file(curve, "curve.md").decode(),
        "artifact": curve.uri,
        "reward_models": models,
        "stages": run.timings,
    }
