"""The `farmflow` command."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="farmflow: AlpacaFarm as a cached Prefect pipeline.", no_args_is_help=True, add_completion=False)
config_app = typer.Typer(help="Inspect presets and configurations.", no_args_is_help=True)
app.add_typer(config_app, name="config")
eval_app = typer.Typer(help="Evaluation statistics (AlpacaEval definitions).", no_args_is_help=True)
app.add_typer(eval_app, name="eval")
def print_json(obj) -> None:
    """Strict JSON on stdout: NaN and infinities (e.g. mean gold on real data, which has none) become null."""
    import math

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    print(json.dumps(clean(obj), indent=2, allow_nan=False))


console = Console()
err_console = Console(stderr=True)


def _prefect_env() -> None:
    """Keep Prefect's state in the project (never ~/.prefect) and its analytics off."""
    os.environ.setdefault("PREFECT_HOME", str(Path(".farmflow/prefect").absolute()))
    # Prefect opens its SQLite database inside PREFECT_HOME without creating the folder
    Path(os.environ["PREFECT_HOME"]).expanduser().mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "farmflow")
    # Prefect gives the extra loggers its handlers, not a level: without one, farmflow's INFO lines
    # outside a run (progress, annotation totals) would be dropped
    logging.getLogger("farmflow").setLevel(logging.INFO)
    # the first start of the temporary API creates and migrates its database: on a busy
    # 2-core machine that can take longer than Prefect's default 20 s
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


def _config(preset: str, overrides: list[str], store: Optional[str]):
    from farmflow.config import ConfigError, load_config

    try:
        cfg = load_config(preset, list(overrides) + ([f"store.uri={json.dumps(store)}"] if store else []))
    except ConfigError as err:
        console.print(f"[red]config error:[/red] {err}")
        raise typer.Exit(2)
    return cfg


def _check_model(cfg) -> None:
    """A model.pretrained that cannot be loaded here (not a folder, not cached, hub unreachable) fails now, in one
    line, before Prefect's temporary API starts."""
    from farmflow.modelcache import ModelUnavailable, check_available

    if cfg.model.pretrained:
        try:
            check_available(cfg.model.pretrained, cfg.model.revision)
        except ModelUnavailable as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(err.exit_code)


def _num(x: float | None) -> str:
    """Three decimals, or a dash where there is no value (no gold reward in the real farm)."""
    return "—" if x is None or x != x else f"{x:.3f}"


def _board(rows: list[dict], title: str) -> Table:
    board = Table(title=title)
    for col in ("method", "win rate", "± SE", "discrete", "LC win rate", "± SE", "mean gold", "± SE", "avg length", "n"):
        # method names wrap rather than being cut to "best_of…" on a narrow terminal
        board.add_column(col, justify="left" if col == "method" else "right", overflow="fold", min_width=10 if col == "method" else None)
    one = lambda x: "—" if x is None or x != x else f"{x:.1f}"  # noqa: E731
    for r in rows:
        board.add_row(r["method"], one(r["win_rate"]), one(r["standard_error"]), one(r.get("discrete_win_rate")), one(r.get("lc_win_rate")),
                      one(r.get("lc_standard_error")), _num(r["mean_gold"]), _num(r.get("gold_standard_error")), str(r["avg_length"]), str(r["n"]))
    return board


def _print_summary(summary: dict, wall: float) -> None:
    from rich.markup import escape

    judges = sorted({r["annotator"] for r in summary["leaderboard"] if r.get("annotator")})
    console.print(_board(summary["leaderboard"], escape(f"Leaderboard ({summary['preset']}, vs reference outputs)")))
    from farmflow.evaluation.leaderboard import judge_quality

    for judge in judges:
        note = judge_quality(judge)
        console.print(escape(f"judged by {judge}" + (f"; the judge {note}" if note else "")), soft_wrap=True, highlight=False)
    console.print(f"reference outputs: mean gold {_num(summary['reference_mean_gold'])}")
    rm = summary["reward_model"]
    if rm:
        console.print(
            "reward model, held-out val pairs: accuracy "
            + ", ".join(f"{k.removeprefix('heldout_').replace('accuracy', 'vs labels').replace('vs labels_unnoised', 'vs un-noised labels').replace('gold_vs labels', 'vs gold')} {v:.3f}" for k, v in rm.items())
            + " (per task family, beside baselines: farmflow reward-report)"
        )
    stages = Table(title="Stages", caption="seconds include waiting: stages that load a model take turns (one device)")
    for col in ("stage", "seconds", "waiting", "cached", "key"):
        stages.add_column(col, justify="right" if col in ("seconds", "waiting") else "left")
    for s in summary["stages"]:
        waited = s.get("waited_seconds", 0.0)
        stages.add_row(s["stage"], f"{s['seconds']:.1f}", f"{waited:.1f}" if waited >= 0.05 else "", "cached" if s["cached"] else "", s["key"][:12])
    console.print(stages)
    console.print(f"wall time {wall:.1f}s; artifacts in {summary['store']}")
    for name, uri in summary["artifacts"].items():
        console.print(f"  {name}: {uri}")


def _start_temporary_api():
    """Start the temporary Prefect API that a flow run without PREFECT_API_URL starts, in a
    background thread, so its start (a server process, ~8 s) overlaps the imports of torch,
    transformers and the flows (~6 s). Returns a function that waits until it is up; it does
    nothing when an API URL is set or temporary servers are off. If the start fails here,
    the flow run starts the server itself and reports the error."""
    import threading

    import prefect.settings

    settings = prefect.settings.get_current_settings()
    if settings.api.url or not settings.server.ephemeral.enabled:
        return lambda: None

    def start() -> None:
        from prefect.server.api.server import SubprocessASGIServer

        try:
            SubprocessASGIServer().start()
        except Exception:  # noqa: BLE001 - the flow run retries the start and reports it
            pass

    thread = threading.Thread(target=start, name="prefect-temporary-api", daemon=True)
    thread.start()
    return thread.join


def _run(preset: str, overrides: list[str], store: Optional[str], as_json: bool, flow: str = "compare", methods: Optional[list[str]] = None,
         api_ready=lambda: None, cfg=None) -> None:
    import time

    check_api()  # a set PREFECT_API_URL whose server does not answer: one line now, before the flows' imports
    cfg = cfg or _config(preset, overrides, store)
    from farmflow.flows import FLOWS

    api_ready()
    start = time.perf_counter()
    summary = _run_flow(FLOWS[flow], advanced=cfg, **({"methods": methods} if flow == "compare" else {}))
    wall = time.perf_counter() - start
    if as_json:
        print_json(summary | {"wall_seconds": wall})
    else:
        _print_summary(summary, wall)


def _run_flow(flow: Any, **kwargs: Any) -> Any:
    """Call a flow in this process and return its result (a failed flow raises its error, as a
    direct call would); with the temporary API, wait until it has recorded the run (`_settle`)."""
    import prefect.settings

    temporary_api = not prefect.settings.get_current_settings().api.url
    state = flow(**kwargs, return_state=True)
    if temporary_api:
        _settle(state.state_details.flow_run_id)
    return state.result()


def _settle(flow_run_id, timeout_s: float = 10.0) -> bool:
    """Wait until the API has recorded every task run of `flow_run_id` as finished.

    The temporary API stops when this process exits. Its task-run recorder writes task runs
    from events that arrive after the flow returns; stopped mid-write it printed
    "Error flushing ... events" with tracebacks under a finished demo (about every other
    cached rerun) and the run's last task runs were missing from the Prefect database.
    Returns False when `timeout_s` passed first (nothing else happens then).
    """
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterState, TaskRunFilterStateType
    from prefect.client.schemas.objects import TERMINAL_STATES, StateType
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all(timeout=timeout_s)  # what this process has not sent yet
    unfinished = TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=[t for t in StateType if t not in TERMINAL_STATES])))
    this_run = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
    deadline, clean = time.monotonic() + timeout_s, 0
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            # twice in a row, 0.2 s apart: events sent last may not have reached the recorder at the first look
            clean = 0 if client.read_task_runs(flow_run_filter=this_run, task_run_filter=unfinished, limit=1) else clean + 1
            if clean == 2:
                return True
            time.sleep(0.2)
    return False


def _methods(methods: list[str]) -> Optional[list[str]]:
    from farmflow.config import METHODS

    chosen = [m.strip().replace("-", "_") for item in methods for m in item.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in METHODS]
    if unknown:
        console.print(f"[red]unknown method(s) {', '.join(unknown)}[/red]; known: {', '.join(METHODS)} (hyphens work too: best-of-n)")
        raise typer.Exit(2)
    return chosen or None


@app.command()
def demo(
    preset: str = typer.Option("synthetic-tiny", help="Preset to run (synthetic-tiny: a few minutes on 2 CPU cores)."),
    store: Optional[str] = typer.Option(None, help="Artifact store (default $FARMFLOW_STORE, else ./.farmflow/store)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON instead of tables."),
    methods: list[str] = typer.Option([], "--method", help="Run only these methods (repeat or comma-separate); default: all."),
    annotator: str = typer.Option("oracle", help="oracle: the offline annotator pool; api-local: the API annotators (p_sim_ann/p_sim_eval) through a loopback judge server started for the run."),
) -> None:
    """Run the offline synthetic farm end to end: SFT, pairs, annotation, reward model, every method, one leaderboard."""
    _prefect_env()
    chosen = _methods(methods)  # wrong names and presets fail at once, before Prefect's temporary API starts
    if annotator not in ("oracle", "api-local"):
        console.print(f"[red]unknown annotator {annotator!r}[/red]; use oracle or api-local")
        raise typer.Exit(2)
    cfg = _config(preset, [], store)
    _check_model(cfg)
    api_ready = _start_temporary_api()
    if annotator == "api-local":
        from farmflow.cli.annotators import local_judge

        with local_judge(store) as overrides:
            return _run(preset, overrides, store, as_json, methods=chosen, api_ready=api_ready)
    _run(preset, [], store, as_json, methods=chosen, api_ready=api_ready, cfg=cfg)


@app.command()
def run(
    flow: str = typer.Argument(..., help="Flow to run: compare, best-of-n, feedme, reward-conditioning, dpo, expert-iteration, ppo, quark."),
    preset: str = typer.Option("synthetic-tiny", help="Preset to start from."),
    set_: list[str] = typer.Option([], "--set", help="Override a field: --set best_of_n.n=8 (values parsed as JSON when possible)."),
    methods: list[str] = typer.Option([], "--method", help="compare only: the methods to run (repeat or comma-separate); default: all."),
    store: Optional[str] = typer.Option(None, help="Artifact store (default $FARMFLOW_STORE, else ./.farmflow/store)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Run a flow on a preset with overrides; unchanged stages come from the cache."""
    from farmflow.config import FLOW_NAMES

    _prefect_env()
    if flow not in FLOW_NAMES:  # wrong names, flags and overrides fail at once, before Prefect's temporary API starts
        console.print(f"[red]unknown flow {flow!r}[/red]; known flows: {', '.join(FLOW_NAMES)}")
        raise typer.Exit(2)
    chosen = _methods(methods)
    if chosen and flow != "compare":
        console.print("[red]--method only applies to the compare flow[/red]")
        raise typer.Exit(2)
    cfg = _config(preset, set_, store)
    _check_model(cfg)
    api_ready = _start_temporary_api()
    _run(preset, set_, store, as_json, flow=flow, methods=chosen, api_ready=api_ready, cfg=cfg)


@app.command()
def deploy(
    preset: str = typer.Option("synthetic-tiny", help="Default preset of every deployment (each run can pick another in the UI)."),
    set_: list[str] = typer.Option([], "--set", help="Default overrides of every deployment, e.g. --set execution.mode=distributed."),
    store: Optional[str] = typer.Option(None, help="Store the flows use (an s3:// URI when workers run on several machines); default: each worker's $FARMFLOW_STORE or ./.farmflow/store."),
    nightly_cron: str = typer.Option("0 3 * * *", help="Cron schedule of the nightly-compare deployment."),
    timezone: str = typer.Option("UTC", help="Timezone of the nightly schedule (IANA name, e.g. Europe/Paris)."),
    nightly_methods: list[str] = typer.Option([], "--nightly-method", help="Methods the nightly comparison runs (repeat or comma-separate); default: all."),
    gpu_slots: Optional[int] = typer.Option(1, min=0, help="Concurrency limit of the GPU pool when it is created (flow runs at once; 0 pauses)."),
    cpu_slots: Optional[int] = typer.Option(None, min=0, help="Concurrency limit of the CPU pool when it is created (default: unlimited)."),
    create_pools: bool = typer.Option(True, help="Create the work pools (execution.cpu_pool, execution.gpu_pool; process type) when missing."),
) -> None:
    """Register a deployment per flow, the nightly comparison, the GPU stage runner and the unresponsive-run automation on the Prefect server at PREFECT_API_URL."""
    _prefect_env()
    from farmflow.config import ConfigError
    from farmflow.deployments import deploy as register

    overrides = list(set_) + ([f"store.uri={json.dumps(store)}"] if store else [])
    try:
        registered = register(preset, overrides, nightly_cron, timezone, _methods(nightly_methods), gpu_slots, cpu_slots, create_pools)
    except (ConfigError, ValueError, RuntimeError) as err:
        console.print(f"[red]deploy failed:[/red] {err}", soft_wrap=True, highlight=False)
        raise typer.Exit(2)
    table = Table(title="Deployments")
    for col in ("deployment", "work pool", "id"):
        table.add_column(col)
    for d in registered:
        if "pool" in d:
            table.add_row(d["name"], d["pool"], d["id"])
    console.print(table)
    for d in registered:
        if "pool" not in d:
            console.print(f"{d['name']} ({d['id']})", soft_wrap=True, highlight=False)
    pools = sorted({d["pool"] for d in registered if "pool" in d})
    console.print("start a worker per pool: " + "; ".join(f"prefect worker start --pool {p}" for p in pools), soft_wrap=True, highlight=False)


@app.command()
def overopt(
    preset: str = typer.Option("synthetic-tiny", help="Preset to start from."),
    n: list[int] = typer.Option([], "--n", help="Best-of-n sample counts (repeatable); default 1 2 4 8 16."),
    labeller: list[str] = typer.Option(
        [], "--labeller", help="Who labels the PREF pairs, one reward model and one curve each: p_sim^ann, greedy, p_sim^eval "
        "(or p_sim_ann, p_sim_eval; repeatable or comma-separated); default p_sim^ann and greedy (paper Fig. 5)."),
    annotator: list[str] = typer.Option(
        [], "--annotator", help="Judge every curve with these annotators (repeatable or comma-separated) instead of its own labeller; "
        "the single-reward-model curve: --labeller p_sim^ann --annotator p_sim^ann,greedy."),
    ppo_every: Optional[int] = typer.Option(None, "--ppo-every", help="Also PPO's curve: a policy snapshot every this many PPO steps, each a point."),
    set_: list[str] = typer.Option([], "--set", help="Override a field (section.field=value)."),
    store: Optional[str] = typer.Option(None, help="Artifact store (default $FARMFLOW_STORE, else ./.farmflow/store)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Over-optimization curves, one per labeller: best-of-n for growing n (and PPO snapshots) against a reward model
    trained on that labeller's preferences; proxy reward, win rate under the labeller and gold reward (table + plot)."""
    import time

    _prefect_env()
    cfg = _config(preset, set_, store)  # a bad preset or override fails before Prefect's temporary API starts
    _check_model(cfg)
    api_ready = _start_temporary_api()
    from farmflow.flows.overoptimization import overoptimization_flow

    api_ready()
    start = time.perf_counter()
    try:
        names = lambda opts: [x.strip() for o in opts for x in o.split(",") if x.strip()] or None  # noqa: E731
        summary = _run_flow(overoptimization_flow, advanced=cfg, ns=list(n) or None, labellers=names(labeller), annotators=names(annotator), ppo_every=ppo_every)
    except ValueError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2)
    if as_json:
        print_json(summary | {"wall_seconds": time.perf_counter() - start})
        return
    console.print(summary["markdown"])
    console.print(f"wall time {time.perf_counter() - start:.1f}s; table, curve.md and curve.png in {summary['artifact']}")


@app.command("reward-report")
def reward_report(
    preset: str = typer.Option("synthetic-tiny", help="Preset to start from."),
    set_: list[str] = typer.Option([], "--set", help="Override a field (section.field=value)."),
    store: Optional[str] = typer.Option(None, help="Artifact store (default $FARMFLOW_STORE, else ./.farmflow/store)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """How good is the reward model? Held-out accuracy against labels, un-noised labels and gold, per task family,
    beside baselines: the longer output, the SFT policy's log-likelihood, the gold reward, the pool's Bayes optimum."""
    _prefect_env()
    api_ready = _start_temporary_api()
    cfg = _config(preset, set_, store)
    from farmflow.flows.reward_report import reward_report_flow

    api_ready()
    try:
        summary = _run_flow(reward_report_flow, advanced=cfg)
    except ValueError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2)
    if as_json:
        print_json(summary)
        return
    console.print(summary["markdown"], soft_wrap=True, highlight=False, markup=False)
    console.print(f"table and report.md in {summary['artifact']}", soft_wrap=True, highlight=False)


@app.command()
def leaderboard(
    store: Optional[str] = typer.Option(None, help="Artifact store (default $FARMFLOW_STORE, else ./.farmflow/store)."),
    run: Optional[str] = typer.Option(
        None, "--run", help="The run to show: its run id or flow-run id (or a unique prefix of one)."),
    preset: Optional[str] = typer.Option(
        None, "--preset", help="Show the newest run of this preset (default: synthetic-tiny, else the newest run's)."),
    as_json: bool = typer.Option(False, "--json", help="Print the run, its leaderboard rows and artifact as JSON."),
) -> None:
    """Print one run's leaderboard from the store's runs table, and where its Parquet, Markdown and plot are."""
    from rich.markup import escape

    from farmflow.config import StoreConfig
    from farmflow.evaluation.history import RUN_COLUMNS, pick_run
    from farmflow.storage import SCHEMAS, open_store

    if run and preset:
        typer.echo("error: give --run or --preset, not both", err=True)
        raise typer.Exit(2)
    st = open_store(store or StoreConfig().location)
    recorded = st.read_rows("runs", "runs").to_pylist()
    if recorded:
        try:
            rows, why = pick_run(recorded, run, preset)
        except LookupError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(2)
        about = {k: rows[0][k] for k in RUN_COLUMNS}
        rows = [{k: r[k] for k in SCHEMAS["leaderboard"].names} for r in rows]
        latest = st.get("leaderboard", about["leaderboard_key"])
        created = about["run_at"].isoformat()
        title = f"Leaderboard ({about['preset']}, run {about['run_id']}, {created[:16].replace('T', ' ')} UTC)"
    else:  # a store written before the runs table: its newest leaderboard artifact
        boards = [r for r in st.list() if r.stage == "leaderboard"]
        if not boards:
            typer.echo(f"error: no leaderboard in {st.root} yet: run `farmflow demo` first", err=True)
            raise typer.Exit(1)
        if run or preset:
            typer.echo(f"error: --run and --preset read the runs table, and {st.root} has none yet "
                       "(`farmflow leaderboard` alone shows its newest leaderboard)", err=True)
            raise typer.Exit(1)
        latest, about, why = boards[-1], None, "the newest leaderboard artifact (this store has no runs table)"
        rows, created = st.read_table(latest).to_pylist(), latest.created
        title = f"Leaderboard ({created})"
    uri = latest.uri if latest else None
    if as_json:
        run_json = about and about | {"run_at": created}
        print_json({"shown": why, "run": run_json, "artifact": uri, "created": created, "leaderboard": rows})
        return
    say = lambda text: console.print(escape(text), soft_wrap=True, highlight=False)  # noqa: E731
    say(f"showing {why}")
    Console(width=max(console.width, 120)).print(_board(rows, escape(title)))  # never cut to 80 columns in a pipe
    if about:
        say(f"flow run {about['flow_run_name'] or about['flow_run_id'] or '?'}; config key {about['config_key']}")
    if rows and rows[0].get("annotator"):
        from farmflow.evaluation.leaderboard import judge_quality

        note = judge_quality(rows[0]["annotator"])
        say(f"annotator: {rows[0]['annotator']}; reference: {rows[0].get('reference') or '?'}"
            + (f"; the judge {note}" if note else ""))
    gold = [r for r in rows if r["mean_gold"] is not None and r["mean_gold"] == r["mean_gold"]]
    if len(gold) >= 3:  # the synthetic farm: does the simulated ranking match the true (gold) one?
        from farmflow.evaluation.analysis import ranking_correlation

        for col in ("win_rate", "lc_win_rate"):
            if all(r.get(col) is not None for r in gold):
                c = ranking_correlation({r["method"]: r[col] for r in gold}, {r["method"]: r["mean_gold"] for r in gold})
                say(f"{col.replace('_', ' ')} vs mean gold over {c['n']} methods: "
                    f"Spearman {c['spearman']:.2f}, Pearson {c['pearson']:.2f}")
    if uri:
        say(f"files: {uri}/data.parquet, leaderboard.md, leaderboard.png")


@config_app.command("presets")
def presets() -> None:
    """List the named presets."""
    from farmflow.config import PRESETS

    for name, factory in sorted(PRESETS.items()):
        first = " ".join((factory.__doc__ or "").strip().split("\n\n")[0].split())  # its first paragraph
        console.print(f"[bold]{name}[/bold]: {first}", highlight=False, soft_wrap=True)
    console.print("(`farmflow config show NAME` prints one in full; `farmflow config diff NAME` how it differs from the defaults)", soft_wrap=True)


@config_app.command("show")
def show(
    preset: str = typer.Argument("synthetic-tiny", help="Preset name."),
    set_: list[str] = typer.Option([], "--set", help="Override a field (section.field=value)."),
) -> None:
    """Print a preset (with overrides) as JSON."""
    print(_config(preset, set_, None).model_dump_json(indent=2))


@config_app.command("diff")
def diff(
    preset: str = typer.Argument("synthetic-tiny", help="Preset to compare with the defaults (the paper's settings)."),
    section: list[str] = typer.Option([], "--section", help="Only these sections (repeatable), e.g. --section dpo --section ppo."),
    all_: bool = typer.Option(False, "--all", help="Also list the settings the preset leaves at the paper's value."),
) -> None:
    """Settings of a preset side by side with the defaults, which follow the paper (Appendix B)."""
    from farmflow.config import FarmConfig

    def flat(value, prefix: str) -> dict:
        if isinstance(value, dict):
            return {k: v for key, sub in value.items() for k, v in flat(sub, f"{prefix}.{key}" if prefix else key).items()}
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):  # annotator pools
            return {k: v for i, sub in enumerate(value) for k, v in flat(sub, f"{prefix}[{i}]").items()}
        return {prefix: value}

    cfg = _config(preset, [], None)
    paper, chosen = flat(FarmConfig().model_dump(), ""), flat(cfg.model_dump(), "")
    # an annotator preset fixes its pool: its row says so, the pool's ~100 fields would only repeat it
    by_preset = tuple(f"{where}.api_pool" for where, ann in (("annotation", cfg.annotation), ("evaluation.annotator", cfg.evaluation.annotator))
                      if ann.preset)
    table = Table(title=f"{preset} vs the defaults (the methods' defaults are the paper's; data and model default to the synthetic farm)")
    for col in ("setting", "default", preset):
        table.add_column(col)
    for key in dict.fromkeys([*paper, *chosen]):  # both: a preset's pool may be longer than the default's
        top = key.split(".")[0].split("[")[0]
        if top in ("name", "store", "checkpoints", "execution") or (section and top not in section) or key.startswith(by_preset):
            continue
        if all_ or chosen.get(key, "—") != paper.get(key, "—"):
            table.add_row(key, repr(paper.get(key, "—")), repr(chosen.get(key, "—")))
    console.print(table)


def _annotation_rows(path: Path) -> list[dict]:
    """The rows of an AlpacaEval-style annotations JSON file; exits with a clear message otherwise."""
    try:
        rows = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        console.print(f"[red]cannot read {path}:[/red] {err}")
        raise typer.Exit(2)
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        console.print(f"[red]{path}:[/red] expected a JSON list of annotation objects")
        raise typer.Exit(2)
    return rows


@eval_app.command("winrate")
def winrate(
    path: Path = typer.Argument(..., help="AlpacaEval annotations JSON: a list of rows with 'preference' and 'output_2'."),
    difficulty: list[Path] = typer.Option(
        [], "--difficulty", help="Other annotation files (other models, same references and judge) to estimate instruction difficulty from; repeatable."),
) -> None:
    """Win rate, standard error, counts, discrete win rate, average length and length-controlled win rate, as JSON.

    The LC win rate (docs/evaluation.md) needs 'instruction', 'output_1' and 'output_2'; its
    instruction difficulty comes from the --difficulty files (never from PATH's own labels;
    none: the length term alone).
    """
    from farmflow.evaluation import alpaca_eval_winrate, lc_of_rows, run_of_rows

    rows = _annotation_rows(path)
    peers = {p: _annotation_rows(p) for p in difficulty}
    for p, peer in peers.items():  # a peer without references would read as a huge length difference
        if not all("output_1" in r for r in peer):
            console.print(f"[red]{p}: --difficulty files need 'output_1' (the reference output) in every row[/red]")
            raise typer.Exit(2)
    try:
        stats = alpaca_eval_winrate(rows, where=str(path))
        lc = lc_of_rows(rows, [run_of_rows(peer) for peer in peers.values()]) if all("output_1" in r for r in rows) else {}
    except ValueError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2)
    if stats["n_invalid"]:
        err_console.print(f"[yellow]{int(stats['n_invalid'])} rows with a missing or malformed preference were left out[/yellow]")
    if not lc:
        err_console.print("[yellow]no 'output_1' (reference output) in every row: no length-controlled win rate[/yellow]")
    out = {k: (int(v) if k.startswith("n_") or k == "avg_length" else v) for k, v in stats.items()}
    out |= {k: lc[k] for k in ("lc_win_rate", "lc_standard_error", "lc_length_coef", "lc_difficulty_coef") if k in lc}
    if lc:
        out["lc_difficulty_runs"] = int(lc["lc_difficulty_runs"])
    print_json(out)


from farmflow.cli.store import register as _register_store_commands  # noqa: E402 - `sql`, `artifacts`

_register_store_commands(app)


@eval_app.command("annotators")
def annotators(
    files: list[Path] = typer.Argument(
        None, help="Label files: AlpacaEval annotation JSON or Parquet tables (annotations cache, preferences); with "
        "--judge one AlpacaEval annotations JSON whose preferences are the reference."),
    oracle: bool = typer.Option(False, "--oracle", help="Synthetic farm: every oracle annotator of the preset's evaluation pool labels the same pairs (offline)."),
    preset: str = typer.Option("synthetic-tiny", help="Preset whose data and evaluation pool --oracle uses."),
    store: Optional[str] = typer.Option(
        None, help="With --oracle: take the val pairs of the latest sample_pairs artifact in this store (default: "
        "generated pairs). With --judge: the store holding the annotation row cache (default $FARMFLOW_STORE, else "
        "./.farmflow/store)."),
    pairs: int = typer.Option(400, min=1, help="With --oracle: at most this many pairs."),
    draws: int = typer.Option(3, min=1, help="With --oracle: labels per annotator and pair (variance needs >= 2)."),
    reference: str = typer.Option("auto", help="Agreement reference: gold, others (majority of the other annotators) or auto (gold when known)."),
    plot: Optional[Path] = typer.Option(None, help="Write the agreement-vs-price plot (PNG) here."),
    as_json: bool = typer.Option(False, "--json", help="Print the table as JSON."),
    judge: list[str] = typer.Option(
        [], "--judge", metavar="SPEC",
        help="Measure a judge against FILE's reference preferences (repeatable), beside the baselines 'longer' and "
        "'coin' (always included). SPEC: hf:MODEL (a model-cache name, folder or hub id), api:BASE_URL@MODEL (an "
        "OpenAI-compatible endpoint serving MODEL; key in $OPENAI_API_KEY, any value for a local server without one; "
        "prompt format choice, temperature 0), longer, coin. Options follow '?', joined by '&': for hf batch_size, "
        "max_prompt_tokens, dtype, device, gguf_file, revision; for api temperature, format (choice, json, logprobs), "
        "style. Examples: hf:smollm2-135m-instruct, hf:smollm2-135m-instruct?batch_size=4, "
        "api:http://localhost:8000/v1@m, 'api:http://localhost:8000/v1@m?temperature=1'."),
    limit: Optional[int] = typer.Option(
        None, "--limit", min=1,
        help="With --judge: the first N pairs of FILE with a decisive (non-tie, readable) reference; default: all."),
    seed: int = typer.Option(0, "--seed", help="With --judge: seed of the coin baseline."),
) -> None:
    """Agreement, bias, variance, length/list preference, price and time per 1000 of each annotator on shared pairs.

    With --judge: agreement with FILE's reference preferences, position and length bias, beside baselines.
    """
    from farmflow.evaluation import analysis

    if judge:
        if oracle or len(files or []) != 1:
            console.print("[red]--judge needs exactly one annotations FILE (and no --oracle)[/red]")
            raise typer.Exit(2)
        from farmflow.annotators import AnnotationError
        from farmflow.evaluation.judge_quality import judge_quality, report_markdown
        from farmflow.modelcache import ModelUnavailable

        try:
            report = judge_quality(files[0], judge, limit, seed, store)
        except ModelUnavailable as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(2)
        except ValueError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(2)
        except (AnnotationError, RuntimeError) as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(1)
        if as_json:
            print_json(report)
        else:
            console.print(report_markdown(report), soft_wrap=True, highlight=False, markup=False)
        return
    if bool(files) == oracle:
        console.print("[red]give label FILES or --oracle (not both)[/red]")
        raise typer.Exit(2)
    try:
        if oracle:
            cfg = _config(preset, [], None)
            shared = _oracle_pairs(cfg, store, pairs)
            rows = analysis.oracle_labels(shared, cfg.evaluation.annotator, draws)
        else:
            rows = [r for f in files for r in analysis.load_labels(str(f))]
        table = analysis.annotator_table(rows, reference)
    except ValueError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2)
    used = reference if reference != "auto" else ("gold" if any(r["annotator"] == "gold" for r in table) else "others")
    if plot:
        analysis.plot_agreement(table, str(plot))
    if as_json:
        print_json({"reference": used, "annotators": table})
        return
    out = Table(title=f"Annotators ({len(rows)} labels; reference: {'gold reward' if used == 'gold' else 'majority of the other annotators'})")
    for col in ("annotator", "labels", "agreement %", "bias %", "variance %", "prefers longer %", "prefers list %", "$ / 1000", "s / 1000"):
        out.add_column(col, justify="left" if col == "annotator" else "right")
    pct = lambda x: "—" if x != x else f"{100 * x:.1f}"  # noqa: E731
    for r in table:
        out.add_row(r["annotator"], str(r["labels"]), pct(r["agreement"]), pct(r["bias"]), pct(r["variance"]), pct(r["length_pref"]),
                    pct(r["list_pref"]), "—" if r["price_per_1000"] != r["price_per_1000"] else f"{r['price_per_1000']:.2f}",
                    "—" if r["seconds_per_1000"] != r["seconds_per_1000"] else f"{r['seconds_per_1000']:.3f}")
    console.print(out)
    if plot:
        console.print(f"plot: {plot}")


def _oracle_pairs(cfg, store: Optional[str], limit: int) -> list[dict]:
    """Val pairs of the latest sample_pairs artifact in `store`, else pairs generated from the preset's data."""
    if store:
        from farmflow.storage import open_store

        st = open_store(store)
        found = [r for r in st.list() if r.stage == "sample_pairs"]
        if not found:
            raise ValueError(f"no sample_pairs artifact in {store}: run a flow first, or leave out --store")
        rows = [r for r in st.read_table(found[-1]).to_pylist() if r["split"] == "val"]
        return rows[:limit]
    from farmflow.data import build_synthetic_farm, split_rows
    from farmflow.evaluation.analysis import synthetic_pairs

    data = cfg.data.model_copy(update={"sft_size": 1, "pref_size": 1, "unlabeled_size": 0, "val_size": limit})
    return synthetic_pairs(split_rows(build_synthetic_farm(data), "val"), seed=cfg.data.seed)


@eval_app.command("rankings")
def rankings(
    first: Path = typer.Argument(..., help="JSON object: method -> score under the first evaluator."),
    second: Path = typer.Argument(..., help="JSON object: method -> score under the second evaluator."),
) -> None:
    """Spearman and Pearson correlation of two evaluators' scores of the same methods, as JSON."""
    from farmflow.evaluation.analysis import ranking_correlation

    scores = []
    for path in (first, second):
        try:
            obj = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            console.print(f"[red]cannot read {path}:[/red] {err}")
            raise typer.Exit(2)
        if not isinstance(obj, dict) or not all(isinstance(v, (int, float)) for v in obj.values()):
            console.print(f"[red]{path}:[/red] expected a JSON object of method -> number")
            raise typer.Exit(2)
        scores.append(obj)
    print_json(ranking_correlation(*scores))


from farmflow.cli.annotators import register as _register_annotators  # noqa: E402

_register_annotators(app)  # judge-server, annotate FILE, annotations reparse

from farmflow.cli.models import register as _register_models  # noqa: E402

_register_models(app)  # models get | import | ls

from farmflow.cli.history import register as _register_history  # noqa: E402
from farmflow.cli.server import check_api, register as _register_server  # noqa: E402

_register_history(app)  # history
_register_server(app, _prefect_env)  # server


def main() -> None:
    from farmflow.modelcache import ModelUnavailable

    try:
        app()
    except ModelUnavailable as err:  # e.g. a worker whose machine lacks the model: one line, not a traceback
        typer.echo(f"error: {err}", err=True)
        sys.exit(err.exit_code)


if __name__ == "__main__":
    sys.exit(main())
