"""Prefect flows: they only wire stage tasks together (see `farmflow.tasks`).

Every flow runs the shared upstream stages (`Upstream`: data → base model → SFT →
pairs → annotation → reward model, each only when a method needs it), then its
method's stages (`method_outputs`), generation on the evaluation set, evaluation of the
method and of the baselines (untrained, SFT) against the reference outputs, and one
leaderboard. There is one flow per method (`best_of_n_flow`, `dpo_flow`, ...) and
`compare_flow`, which runs any list of methods over the same upstream artifacts, the
methods in parallel (`fan_out`, `execution.max_parallel_methods`), and ends with the
over-optimization curve. Every run appends its leaderboard to the store's ``runs`` table; the
nightly deployment (``history``) also publishes the trend across runs.

Where a stage runs is `StageRunner`'s business (`execution.mode`): in this process, or,
for GPU stages in distributed mode, as a flow run on the GPU work pool
(`farmflow.flows.distributed`). Stages that touch the network are retried with backoff.

Every stage is cached by its stage key: a rerun with the same config executes nothing;
a changed hyperparameter reruns only the stages downstream of it (e.g. `best_of_n.n`:
best-of-n and its evaluation).

Prefect's result records (the persisted `ArtifactRef`s) are kept inside the store under
``_prefect/``, so wiping the store also wipes Prefect's cache, and a cached ref whose
artifact has disappeared from the store is recomputed instead of trusted.
"""

from __future__ import annotations

import hashlib
import threading
import time
from contextlib import nullcontext
from datetime import datetime, timezone
from typing import Any, Callable, Literal

import pyarrow as pa
from prefect import flow, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from farmflow.config import METHODS, PRESETS, BestOfNConfig, ConfigError, ExecutionConfig, FarmConfig, load_config, validate_config
from farmflow.storage import ArtifactRef, StoreError, canonical_json, open_store
from farmflow.storage.schemas import SCHEMAS
from farmflow.tasks import (
    annotate_task, base_model_task, best_of_n_task, data_task, evaluate_task, generate_task, leaderboard_task,
    sample_pairs_task, sft_task, train_reward_task,
)
from farmflow.tasks.analysis import proxy_reward_task
from farmflow.tasks.core import is_complete, launching, log
from farmflow.tasks.methods import dpo_task, expert_iteration_task, feedme_task, reference_logps_task, reward_conditioning_task


# ------------------------------------------------------------------ running stages
def network_stage(stage: str, config: Any, store_uri: str) -> bool:
    """Does this stage touch the network? Every stage on an s3:// store; annotate/evaluate with API annotators."""
    return store_uri.startswith("s3://") or (stage in ("annotate", "evaluate") and getattr(config, "kind", None) == "api")


def transient(err: BaseException | None) -> bool:
    """Is a stage's error worth a retry? Store/network errors and annotation runs with failed pairs (not a spent cost cap)."""
    from farmflow.annotators import AnnotationIncomplete

    if isinstance(err, AnnotationIncomplete):  # failed pairs are re-asked, judged ones come from the row cache
        return "max_cost_usd" not in str(err)  # a retry would spend the cap again
    return isinstance(err, (StoreError, ConnectionError, TimeoutError))


def _retry_condition(_task, _task_run, state) -> bool:
    return transient(state.result(raise_on_failure=False))


def retry_options(stage: str, config: Any, store_uri: str, execution: ExecutionConfig) -> dict[str, Any]:
    """Prefect task options for a stage: retries with exponential backoff on transient errors of network stages."""
    if not execution.retries or not network_stage(stage, config, store_uri):
        return {}
    return {"retries": execution.retries, "retry_delay_seconds": [execution.retry_delay_s * 2**i for i in range(execution.retries)],
            "retry_condition_fn": _retry_condition}


MODEL_LOCK = threading.Lock()
"""Stages that load a model (`execution.gpu_stages`) take turns within a process: one device, and
loading Hugging Face models while another thread trains is not safe. Other stages (evaluation,
API annotation) of parallel methods overlap them."""


class StageRunner:
    """Runs stage tasks against one store and records, per stage, seconds, rows and cache hits.

    `execution` says where: in this process (Prefect task, cached by stage key, retried when
    it touches the network) or, for GPU stages in distributed mode, as a flow run of the
    stage deployment on the GPU pool (`farmflow.flows.distributed`). Safe to call from
    several threads (parallel methods; model stages in this process take turns, `MODEL_LOCK`).
    """

    def __init__(self, store_uri: str, execution: ExecutionConfig | None = None, preset: str = ""):
        self.store_uri = store_uri
        self.store = open_store(store_uri)
        self.result_storage = self.store.result_storage()  # <store>/_prefect: a Path locally, a saved block on S3
        self.execution = execution or ExecutionConfig()
        self.preset = preset
        self.timings: list[dict[str, Any]] = []

    def remote(self, stage: str) -> bool:
        """Does `stage` run on the GPU pool (distributed mode) rather than in this process?"""
        return self.execution.mode == "distributed" and stage in self.execution.gpu_stages

    def __call__(self, task, config: Any, label: str | None = None, **inputs: Any) -> ArtifactRef:
        """Run `task` with `config` and keyword inputs (ArtifactRefs, plus options such as `checkpoints`)."""
        label = label or task.name
        remote = self.remote(task.name)
        start = time.perf_counter()
        try:
            if remote:
                from farmflow.flows.distributed import run_remote

                ref, cached = run_remote(self, task, config, label, inputs)
                waited = 0.0
            else:
                ref, cached, waited = self._local(task, config, inputs, start)
        except BaseException as err:
            log("%s: failed after %.1fs (%s); its inputs stay cached, a rerun resumes here", label, time.perf_counter() - start, type(err).__name__)
            raise
        seconds = time.perf_counter() - start
        where = f"pool {self.execution.gpu_pool}" if remote else "local"
        self.timings.append({"stage": label, "key": ref.key, "seconds": seconds, "waited_seconds": waited, "cached": cached,
                             "rows": ref.rows, "where": where})
        size = f"{ref.rows} rows" if ref.rows is not None else f"{ref.format} model"
        queued = f" ({waited:.1f}s of it waiting for another model stage)" if waited >= 0.05 else ""
        log("%s: %s, %s, %.1fs%s, key %s (%s)", label, "cache hit" if cached else "ran", size, seconds, queued, ref.key[:12], where)
        return ref

    def _local(self, task, config: Any, inputs: dict[str, Any], start: float) -> tuple[ArtifactRef, bool, float]:
        """(ref, cached, seconds spent waiting for MODEL_LOCK before running)."""
        model = task.name in self.execution.gpu_stages
        with MODEL_LOCK if model else nullcontext():
            waited = time.perf_counter() - start if model else 0.0
            return *self._run_task(task, config, inputs, start), waited

    def _run_task(self, task, config: Any, inputs: dict[str, Any], start: float) -> tuple[ArtifactRef, bool]:
        options = retry_options(task.name, config, self.store_uri, self.execution)
        bound = task.with_options(result_storage=self.result_storage, **options)
        with launching(self.execution):  # GPU stages in a child process when execution.launcher says so
            state = bound(self.store_uri, config, return_state=True, **inputs)
            ref: ArtifactRef = state.result()
            if not self.store.exists(ref) or not is_complete(task.name, self.store, ref, config):
                # Prefect remembered a result the store no longer has, or one without what this config asks for
                state = bound.with_options(refresh_cache=True)(self.store_uri, config, return_state=True, **inputs)
                ref = state.result()
        started = time.time() - (time.perf_counter() - start)
        return ref, state.name == "Cached" or _created_before(ref, started)


def _created_before(ref: ArtifactRef, epoch: float) -> bool:
    return datetime.fromisoformat(ref.created).timestamp() < epoch


def config_key(cfg: FarmConfig) -> str:
    """Short content hash of what a farm computes: the stage-key view of its sections (no operational fields such as
    batch sizes, backends or API limits), not its name, store, checkpoints or execution."""
    from farmflow.tasks.core import key_config

    sections = {name: getattr(cfg, name) for name in type(cfg).model_fields if name not in ("name", "store", "checkpoints", "execution")}
    payload = canonical_json(key_config(sections))
    return hashlib.sha256(payload.encode()).hexdigest()[:8]


def _flow_run_name() -> str:
    """'<flow>[:<methods>]/<preset>/<config key>', e.g. 'compare:dpo+ppo/synthetic-tiny/3fa2c1e0'."""
    from prefect.runtime import flow_run

    p = flow_run.parameters
    try:
        cfg = _cfg(p.get("config"), p.get("preset") or "synthetic-tiny", p.get("overrides"))
    except (ConfigError, ValueError):
        return f"{flow_run.flow_name}/invalid-config"
    methods = p.get("methods")
    what = f"{flow_run.flow_name}:{'+'.join(methods)}" if methods else flow_run.flow_name
    return f"{what}/{cfg.name}/{config_key(cfg)}"


# ------------------------------------------------------------------- the pipeline
BASELINES = ("untrained", "sft")
"""Evaluated in every flow for context: the randomly initialized model and the SFT model."""


class Upstream:
    """The shared stages every method builds on; each is run (or fetched from the cache) on first use."""

    def __init__(self, run: StageRunner, cfg: FarmConfig):
        self.run, self.cfg = run, cfg
        self._refs: dict[str, ArtifactRef] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def _get(self, name: str, make) -> ArtifactRef:
        with self._guard:  # one lock per stage: parallel methods wait for a shared stage instead of running it twice
            lock = self._locks.setdefault(name, threading.Lock())
        with lock:
            if name not in self._refs:
                self._refs[name] = make()
        return self._refs[name]

    @property
    def data(self) -> ArtifactRef:
        return self._get("data", lambda: self.run(data_task, self.cfg.data))

    @property
    def base(self) -> ArtifactRef:
        return self._get("base", lambda: self.run(base_model_task, self.cfg.model, data=self.data))

    @property
    def sft(self) -> ArtifactRef:
        return self._get("sft", lambda: self.run(sft_task, self.cfg.sft, data=self.data, base=self.base, checkpoints=self.cfg.checkpoints))

    @property
    def preferences(self) -> ArtifactRef:
        def make() -> ArtifactRef:
            pairs = self.run(sample_pairs_task, self.cfg.pairs, data=self.data, policy=self.sft)
            return self.run(annotate_task, self.cfg.annotation, pairs=pairs)

        return self._get("preferences", make)

    @property
    def reward(self) -> ArtifactRef:
        return self._get("reward", lambda: self.run(train_reward_task, self.cfg.reward, preferences=self.preferences, sft=self.sft))

    def refs(self) -> dict[str, ArtifactRef]:
        return dict(self._refs)


def _generate(up: Upstream, policy: ArtifactRef, generator: str, control: str = "") -> ArtifactRef:
    config = {"sample": up.cfg.generation, "generator": generator, "control": control}
    return up.run(generate_task, config, f"generate {generator}", data=up.data, policy=policy)


def _best_of_n(up: Upstream, policy: ArtifactRef, cfg: BestOfNConfig, split: str, label: str, max_prompts: int | None = None) -> ArtifactRef:
    config = {"best_of_n": cfg, "max_new_tokens": up.cfg.generation.max_new_tokens, "split": split, "max_prompts": max_prompts}
    return up.run(best_of_n_task, config, label, data=up.data, policy=policy, reward=up.reward, backend=up.cfg.generation.backend,
                  batch_size=up.cfg.generation.batch_size)


def method_outputs(up: Upstream, method: str) -> ArtifactRef:
    """Train `method` (from the shared upstream artifacts) and return its evaluation-set outputs."""
    cfg, run, ck = up.cfg, up.run, up.cfg.checkpoints
    if method == "untrained":
        return _generate(up, up.base, "untrained")
    if method == "sft":
        return _generate(up, up.sft, "sft")
    if method == "feedme":
        return _generate(up, run(feedme_task, cfg.feedme, preferences=up.preferences, sft=up.sft, checkpoints=ck), "feedme")
    if method == "reward_conditioning":
        rc = cfg.reward_conditioning
        policy = run(reward_conditioning_task, rc, preferences=up.preferences, sft=up.sft, checkpoints=ck)
        return _generate(up, policy, "reward_conditioning", control=rc.good_token)
    if method == "dpo":
        reference = run(reference_logps_task, {}, preferences=up.preferences, sft=up.sft, batch_size=cfg.generation.batch_size)
        return _generate(up, run(dpo_task, cfg.dpo, preferences=up.preferences, sft=up.sft, reference=reference, checkpoints=ck), "dpo")
    if method == "best_of_n":
        return _best_of_n(up, up.sft, cfg.best_of_n, "eval", "best_of_n")
    if method == "expert_iteration":
        ei = cfg.expert_iteration
        bon = BestOfNConfig(n=ei.n, temperature=ei.temperature, top_p=ei.top_p, seed=ei.seed)
        policy = up.sft
        for r in range(1, ei.rounds + 1):
            # each round its own sample streams (round 1 keeps the seed): with the same seed, round r's policy would
            # redraw from round 1's random numbers and largely re-propose its candidates
            round_bon = bon if r == 1 else bon.model_copy(update={"seed": round_seed(ei.seed, r)})
            selections = _best_of_n(up, policy, round_bon, "unlabeled", f"expert_iteration select {r}", ei.max_prompts)
            policy = run(expert_iteration_task, ei.train, f"expert_iteration train {r}", sft=up.sft, selections=selections, checkpoints=ck)
        return _generate(up, policy, "expert_iteration")
    if method in ("ppo", "quark"):
        from farmflow.tasks import rl

        task = rl.ppo_task if method == "ppo" else rl.quark_task
        policy = run(task, getattr(cfg, method), data=up.data, sft=up.sft, reward=up.reward, checkpoints=ck)
        return _generate(up, policy, method)
    raise ValueError(f"unknown method {method!r}; known: {', '.join(BASELINES + METHODS)}")


def round_seed(seed: int, r: int) -> int:
    """The candidate sampler's seed in expert-iteration round `r` (1-based): `seed` itself in round 1."""
    return seed if r == 1 else seed + 1_000_003 * (r - 1)


def method_label(cfg: FarmConfig, method: str) -> str:
    """The leaderboard name of a method (best-of-n carries its n)."""
    return f"best_of_{cfg.best_of_n.n}" if method == "best_of_n" else method


PREFERENCE_METHODS = ("feedme", "reward_conditioning", "dpo")
REWARD_METHODS = ("best_of_n", "expert_iteration", "ppo", "quark")


def shared_upstream(up: Upstream, methods: list[str] | tuple[str, ...]) -> None:
    """Run (or fetch) the upstream stages the methods share, before they fan out."""
    needed = ["base", "sft"]  # the baselines
    if any(m in REWARD_METHODS for m in methods):
        needed.append("reward")
    elif any(m in PREFERENCE_METHODS for m in methods):
        needed.append("preferences")
    for name in needed:
        getattr(up, name)


@task(name="method", task_run_name="method {branch}", cache_policy=NO_CACHE, persist_result=False)
def _branch_task(work: Callable[[str], Any], branch: str) -> Any:
    """One method's stages (train, generate, evaluate) as a task run, so the UI shows each branch and its time."""
    return work(branch)


def fan_out(branches: list[str], work: Callable[[str], Any], execution: ExecutionConfig) -> dict[str, Any]:
    """`work(branch)` for every branch, at most `execution.max_parallel_methods` at once (threads).

    Every branch finishes (and its artifacts are committed) before the first error is raised.
    """
    parallel = min(execution.max_parallel_methods, len(branches))
    if parallel <= 1:  # one at a time, with the same promise: a failure does not skip the branches after it
        results, errors = {}, {}
        for b in branches:
            try:
                results[b] = work(b)
            except Exception as err:  # noqa: BLE001 - raised below, once every branch has run
                errors[b] = err
        if errors:
            log("methods failed: %s; the others finished and are cached", ", ".join(errors))
            raise next(iter(errors.values()))
        return results
    from prefect.task_runners import ThreadPoolTaskRunner

    with ThreadPoolTaskRunner(max_workers=parallel) as runner:
        futures = {b: runner.submit(_branch_task, {"work": work, "branch": b}) for b in branches}
        for future in futures.values():
            future.wait()
        states = {b: f.state for b, f in futures.items()}
    failed = [b for b, st in states.items() if not st.is_completed()]
    if failed:
        log("methods failed: %s; the others finished and are cached", ", ".join(failed))
    return {b: st.result() for b, st in states.items()}  # raises the first failure


def _publish_curve(run: StageRunner, curve: ArtifactRef, title: str) -> list[dict]:
    """The over-optimization curve as Prefect markdown and table artifacts (with where its files are)."""
    rows = run.store.read_table(curve).to_pylist()
    markdown = run.store.read_file(curve, "curve.md").decode()
    create_markdown_artifact(markdown + f"\nParquet, Markdown and plot (curve.png): `{curve.uri}`\n", key="overoptimization", description=title)
    cols = ("label", "family", "pressure", "labeller", "annotator", "proxy_reward", "win_rate", "standard_error", "mean_gold", "avg_length")
    create_table_artifact([{k: (None if r[k] != r[k] else r[k]) for k in cols} for r in rows], key="overoptimization-table", description=title)
    return rows


@task(name="record_run", cache_policy=NO_CACHE, persist_result=False)
def record_run_task(store_uri: str, board: ArtifactRef, preset: str, key: str, history: bool = False) -> dict[str, Any]:
    """Append the run's leaderboard rows to the store's ``runs`` row log; returns its run id and the rows appended."""
    from prefect.runtime import flow_run

    from farmflow.evaluation.history import run_id_of, run_rows

    store = open_store(store_uri)
    run = {"run_id": run_id_of(flow_run.id), "flow_run_id": str(flow_run.id or ""),
           "flow_run_name": flow_run.name or "", "flow": flow_run.flow_name or "", "run_at": datetime.now(timezone.utc),
           "preset": preset, "config_key": key, "history": history, "leaderboard_key": board.key}
    table = run_rows(store.read_table(board).to_pylist(), run)
    store.append_rows("runs", table, "runs")
    log("runs: run %s, %d rows appended", run["run_id"], table.num_rows)
    return {"run_id": run["run_id"], "rows": table.num_rows}


HISTORY_RUNS = 10
"""How many of a preset's newest runs the published trend shows."""


@task(name="history", cache_policy=NO_CACHE, persist_result=False)
def history_task(store_uri: str, preset: str) -> ArtifactRef | None:
    """The trend of the preset's newest runs (`HISTORY_RUNS`) as a ``history`` artifact (the runs rows, ``history.md``,
    ``history.png``) and a Prefect markdown artifact (key ``history``); nothing with fewer than 2 runs of the preset."""
    import tempfile
    from pathlib import Path

    from farmflow.evaluation.history import plot_trend, trend, trend_markdown
    from farmflow.storage import stage_key

    store = open_store(store_uri)
    rows = [r for r in store.read_rows("runs", "runs").to_pylist() if r["preset"] == preset]
    t = trend(rows, last=HISTORY_RUNS)
    if len(t["runs"]) < 2:
        log("history: %d run(s) of %s so far, no trend to publish", len(t["runs"]), preset)
        return None
    ids = [r["run_id"] for r in t["runs"]]
    title = f"History: {preset}, the newest {len(ids)} runs"
    markdown = trend_markdown(t, title)
    key = stage_key("history", "1", {"preset": preset, "runs": ids})
    ref = store.get("history", key)
    if ref is None:
        with tempfile.TemporaryDirectory() as tmp:
            plot_trend(t, f"{tmp}/history.png", f"Win rate across runs: {preset}")
            png = Path(f"{tmp}/history.png").read_bytes()
        table = pa.Table.from_pylist([r for r in rows if r["run_id"] in set(ids)], schema=SCHEMAS["runs"])
        ref = store.put_table("history", key, table, "runs", config={"preset": preset, "runs": ids},
                              extra_files={"history.md": markdown.encode(), "history.png": png})
    where = f"\nRows, Markdown and plot (history.png): `{ref.uri}`\n"
    create_markdown_artifact(markdown + where, key="history", description=title)
    log("history: %d runs of %s, %d flagged change(s), plot in %s", len(ids), preset, len(t["changes"]), ref.uri)
    return ref


def run_methods(cfg: FarmConfig, methods: list[str] | tuple[str, ...], title: str, curve: bool = False,
                history: bool = False) -> dict[str, Any]:
    """Baselines plus `methods` on one farm config: train, generate, evaluate, one leaderboard.

    The shared upstream stages run first, then the methods fan out (`fan_out`). With
    `curve`, a proxy reward per method joins its branch and the over-optimization curve
    (proxy reward vs win rate and gold reward, one point per method) ends the run, when a
    reward model was trained. Every run appends its leaderboard rows to the store's ``runs``
    table (`record_run_task`); with `history`, the trend of the preset's runs is published too
    (`history_task`). Returns a JSON-able summary: leaderboard rows, the run's id,
    reward-model metrics (when a method used it), per-stage timing, rows and cache hits.
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; known: {', '.join(METHODS)}")
    run = StageRunner(cfg.store.location, cfg.execution, cfg.name)
    up = Upstream(run, cfg)
    shared_upstream(up, methods)
    with_proxy = curve and "reward" in up.refs()
    names = {m: method_label(cfg, m) for m in (*BASELINES, *methods)}

    def branch(m: str) -> tuple[ArtifactRef, ArtifactRef]:
        outputs = method_outputs(up, m)
        evaluation = run(evaluate_task, cfg.evaluation.annotator, f"evaluate {names[m]}", outputs=outputs, data=up.data)
        if with_proxy and m != "untrained":
            run(proxy_reward_task, {}, f"proxy_reward {names[m]}", outputs=outputs, reward=up.reward, batch_size=cfg.generation.batch_size)
        return outputs, evaluation

    done = fan_out(list(names), branch, cfg.execution)
    outputs = {names[m]: done[m][0] for m in names}
    evaluations = {names[m]: done[m][1] for m in names}
    board = leaderboard_task(run.store_uri, evaluations, title)
    refs = up.refs()
    summary = {
        "preset": cfg.name,
        "config_key": config_key(cfg),
        "store": str(run.store.root),
        "leaderboard": run.store.read_table(board).to_pylist(),
        "reference_mean_gold": next(iter(evaluations.values())).metrics.get("reference_mean_gold"),
        "reward_model": {k: v for k, v in refs["reward"].metrics.items() if k.startswith("heldout")} if "reward" in refs else {},
        "stages": run.timings,
        "artifacts": {**{name: ref.uri for name, ref in refs.items() if name in ("sft", "reward", "preferences")}, "leaderboard": board.uri},
    }
    if with_proxy:
        from farmflow.evaluation.overopt import CurvePoint
        from farmflow.flows.overoptimization import evaluate_points

        points = [CurvePoint(label=names[m], family=m, pressure=cfg.best_of_n.n if m == "best_of_n" else float(m != "sft"), outputs=outputs[names[m]])
                  for m in ("sft", *methods)]
        curve_title = f"Over-optimization: {cfg.name} (one point per method)"
        curve_ref = evaluate_points(up, points, {"p_sim^eval": cfg.evaluation.annotator}, curve_title)
        summary["overoptimization"] = {"rows": _publish_curve(run, curve_ref, curve_title), "artifact": curve_ref.uri}
        summary["artifacts"]["overoptimization"] = curve_ref.uri
    summary["run"] = record_run_task(run.store_uri, board, cfg.name, summary["config_key"], history)
    if history and (published := history_task(run.store_uri, cfg.name)) is not None:
        summary["artifacts"]["history"] = published.uri
    return summary


def _summary_title(cfg: FarmConfig, methods) -> str:
    return f"{', '.join(methods)} on {cfg.name}"


def _cfg(config: FarmConfig | dict | None, preset: str, overrides: list[str] | None = None) -> FarmConfig:
    """The flow's farm config: `config` when given (a full config, `overrides` applied on top), else the preset with `overrides`.

    A deployment made with `farmflow deploy --set ...` carries its overrides in every run, so a full config
    filled in the UI gets them too (they are the deployment's own settings, e.g. its store)."""
    if config is None:
        return load_config(preset, list(overrides or []))
    cfg = config if isinstance(config, FarmConfig) else validate_config(config)
    if not overrides:
        return cfg
    return load_config(preset, list(overrides), base=cfg)


PresetName = Literal[tuple(PRESETS)]  # type: ignore[valid-type] - the UI renders a drop-down of the presets
MethodName = Literal[METHODS]  # type: ignore[valid-type]

FLOW_ARGS = """

Args:
    config: The whole farm configuration (every field described). When given, it replaces the preset; the overrides still apply on top.
    preset: Named farm configuration to start from (synthetic-tiny: the demo; synthetic-micro: tests).
    overrides: Changes to the preset, one per item, as section.field=value (values parsed as JSON), e.g. dpo.beta=0.2 or execution.mode=distributed.
"""


def _args_doc(extra: str = ""):
    """Appends the shared parameter descriptions to a flow's docstring (the Prefect UI shows them in the form)."""
    def wrap(fn):
        fn.__doc__ = (fn.__doc__ or "") + FLOW_ARGS + extra
        return fn

    return wrap


# ---------------------------------------------------------------------- flows
@flow(name="compare", flow_run_name=_flow_run_name, log_prints=True)
@_args_doc("""    methods: Methods to compare (default: all); the baselines (untrained, SFT) are always evaluated.
    history: Publish the trend of this preset's runs (Prefect artifact history, plot in the store) and count the run
        in the leaderboard_history view (the nightly comparison does); every run is recorded in the store's runs table.
""")
def compare_flow(
    config: FarmConfig | None = None, preset: PresetName = "synthetic-tiny", methods: list[MethodName] | None = None,
    overrides: list[str] | None = None, history: bool = False,
) -> dict[str, Any]:
    """Every chosen method (default: all) on one farm; shared stages run once, methods in parallel; leaderboard and over-optimization curve."""
    cfg = _cfg(config, preset, overrides)
    chosen = list(methods) if methods else list(METHODS)
    return run_methods(cfg, chosen, f"Leaderboard: {cfg.name}", curve=True, history=history)


@flow(name="best-of-n", flow_run_name=_flow_run_name, log_prints=True)
@_args_doc()
def best_of_n_flow(config: FarmConfig | None = None, preset: PresetName = "synthetic-tiny", overrides: list[str] | None = None) -> dict[str, Any]:
    """SFT → pairs → simulated preferences → reward model → best-of-n reranking, evaluated with the baselines."""
    cfg = _cfg(config, preset, overrides)
    return run_methods(cfg, ["best_of_n"], _summary_title(cfg, ["best_of_n"]))


@flow(name="feedme", flow_run_name=_flow_run_name, log_prints=True)
@_args_doc()
def feedme_flow(config: FarmConfig | None = None, preset: PresetName = "synthetic-tiny", overrides: list[str] | None = None) -> dict[str, Any]:
    """SFT → pairs → simulated preferences → binary FeedME (SFT on the preferred outputs), evaluated."""
    cfg = _cfg(config, preset, overrides)
    return run_methods(cfg, ["feedme"], _summary_title(cfg, ["feedme"]))


@flow(name="reward-conditioning", flow_run_name=_flow_run_name, log_prints=True)
@_args_doc()
def reward_conditioning_flow(config: FarmConfig | None = None, preset: PresetName = "synthetic-tiny", overrides: list[str] | None = None) -> dict[str, Any]:
    """SFT → pairs → simulated preferences → binary reward conditioning (good/bad control tokens), evaluated."""
    cfg = _cfg(config, preset, overrides)
    return run_methods(cfg, ["reward_conditioning"], _summary_title(cfg, ["reward_conditioning"]))


@flow(name="dpo", flow_run_name=_flow_run_name, log_prints=True)
@_args_doc()
def dpo_flow(config: FarmConfig | None = None, preset: PresetName = "synthetic-tiny", overrides: list[str] | None = None) -> dict[str, Any]:
    """SFT → pairs → simulated preferences → reference log-probs → DPO, evaluated."""
    cfg = _cfg(config, preset, overrides)
    return run_methods(cfg, ["dpo"], _summary_title(cfg, ["dpo"]))


@flow(name="expert-iteration", flow_run_name=_flow_run_name, log_prints=True)
@_args_doc()
def expert_iteration_flow(config: FarmConfig | None = None, preset: PresetName = "synthetic-tiny", overrides: list[str] | None = None) -> dict[str, Any]:
    """SFT → preferences → reward model → best-of-n on the unlabeled split → SFT on the selections, evaluated."""
    cfg = _cfg(config, preset, overrides)
    return run_methods(cfg, ["expert_iteration"], _summary_title(cfg, ["expert_iteration"]))


@flow(name="ppo", flow_run_name=_flow_run_name, log_prints=True)
@_args_doc()
def ppo_flow(config: FarmConfig | None = None, preset: PresetName = "synthetic-tiny", overrides: list[str] | None = None) -> dict[str, Any]:
    """SFT → preferences → reward model → PPO against it with a KL penalty to SFT, evaluated."""
    cfg = _cfg(config, preset, overrides)
    return run_methods(cfg, ["ppo"], _summary_title(cfg, ["ppo"]))


@flow(name="quark", flow_run_name=_flow_run_name, log_prints=True)
@_args_doc()
def quark_flow(config: FarmConfig | None = None, preset: PresetName = "synthetic-tiny", overrides: list[str] | None = None) -> dict[str, Any]:
    """SFT → preferences → reward model → Quark (top-quantile variant), evaluated."""
    cfg = _cfg(config, preset, overrides)
    return run_methods(cfg, ["quark"], _summary_title(cfg, ["quark"]))


FLOWS = {
    "compare": compare_flow, "best-of-n": best_of_n_flow, "feedme": feedme_flow, "reward-conditioning": reward_conditioning_flow,
    "dpo": dpo_flow, "expert-iteration": expert_iteration_flow, "ppo": ppo_flow, "quark": quark_flow,
}
"""Flow name → flow, for the CLI and deployments."""
