"""The commands that run flows, `demo`, `run`, `overopt`, `reward-report`, and `deploy`, which registers them.

Each checks its names, config and model before anything expensive starts (a bad name is refused in a second, not
after Prefect's temporary API has started), then runs the flow in this process with its run log (`cli.logs`).
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any, Callable, Optional

import typer

from farmflow.cli.boards import print_summary
from farmflow.cli.errors import CliError, UsageError
from farmflow.cli.guard import api_start_failed, guard_temporary_api
from farmflow.cli.logs import State
from farmflow.cli.logs import start as start_log
from farmflow.cli.output import console, emit, print_json, say
from farmflow.cli.preflight import check_store
from farmflow.cli.server import check_api, prefect_env
from farmflow.evaluation.overopt import annotator_labels

STORE_HELP = "Artifact store (default $FARMFLOW_STORE, else ./.farmflow/store)."


def load(preset: str, overrides: list[str], store: Optional[str]):
    """The preset with its overrides (and --store); a bad name or value raises ConfigError (exit code 2)."""
    from farmflow.config import load_config

    return load_config(preset, list(overrides) + ([f"store.uri={json.dumps(store)}"] if store else []))


def check_model(cfg) -> None:
    """A model.pretrained that cannot be loaded here (not a folder, not cached, hub unreachable) fails now, in one
    line, before Prefect's temporary API starts; so does a store that does not answer or cannot be written."""
    from farmflow.modelcache import check_available

    check_store(cfg.store.location)
    if cfg.model.pretrained:
        check_available(cfg.model.pretrained, cfg.model.revision)


def methods_of(methods: list[str]) -> Optional[list[str]]:
    """--method values (repeated or comma-separated, hyphens allowed) as method names; None for all."""
    from farmflow.config import METHODS

    chosen = [m.strip().replace("-", "_") for item in methods for m in item.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in METHODS]
    if unknown:
        raise UsageError(
            f"unknown method(s) {', '.join(unknown)}; known: {', '.join(METHODS)} (hyphens work too: best-of-n)"
        )
    return chosen or None


def start_temporary_api() -> Callable[[], Any]:
    """Start the temporary Prefect API that a flow run without PREFECT_API_URL starts, in a
    background thread, so its start (a server process, ~8 s) overlaps the imports of the flows
    and of what the leaderboard uses (`farmflow.evaluation.LEADERBOARD_LIBRARIES`). Returns a
    function that waits until it is up; it does nothing when an API URL is set or temporary
    servers are off. If the start fails here, the flow run starts the server itself and reports
    the error."""
    import importlib
    import threading

    import prefect.settings

    settings = prefect.settings.get_current_settings()
    if settings.api.url or not settings.server.ephemeral.enabled:
        return lambda: None
    guard_temporary_api()  # the server dies with this process, even on SIGKILL

    def start() -> None:
        from prefect.server.api.server import SubprocessASGIServer

        try:
            SubprocessASGIServer().start()
        except Exception:  # noqa: BLE001 - the flow run retries the start and reports it
            pass

    thread = threading.Thread(target=start, name="prefect-temporary-api", daemon=True)
    thread.start()

    def ready() -> None:
        from farmflow.evaluation import LEADERBOARD_LIBRARIES

        for module in LEADERBOARD_LIBRARIES:
            importlib.import_module(module)
        thread.join()

    return ready


def run_flow(name: str, flow: Any, **kwargs: Any) -> Any:
    """Call a flow in this process with a run log named `name` and return its result (a failed flow raises its
    error, as a direct call would); with the temporary API, wait until it has recorded the run (`settle`)."""
    import prefect.flow_engine
    import prefect.settings

    from farmflow import shutdown

    start_log(name)
    # SIGTERM/SIGINT: training checkpoints, the run stops within seconds (farmflow.shutdown). Prefect's own SIGTERM
    # handler, for flow runs a Prefect runner cancels, would raise inside the running stage before it could save.
    prefect.flow_engine.capture_sigterm = contextlib.nullcontext
    temporary_api = not prefect.settings.get_current_settings().api.url
    with shutdown.handling():
        try:
            state = flow(**kwargs, return_state=True)
        except RuntimeError as err:
            if line := api_start_failed(err):
                raise CliError(line) from err
            raise
    if temporary_api and shutdown.requested() is None:
        settle(state.state_details.flow_run_id)
    return state.result()


def settle(flow_run_id, timeout_s: float = 10.0) -> bool:
    """Wait until the API has recorded every task run of `flow_run_id` as finished.

    The temporary API stops when this process exits. Its task-run recorder writes task runs
    from events that arrive after the flow returns; stopped mid-write it printed
    "Error flushing ... events" with tracebacks under a finished demo (about every other
    cached rerun) and the run's last task runs were missing from the Prefect database.
    Returns False when `timeout_s` passed first (nothing else happens then).
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import TERMINAL_STATES, StateType
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all(timeout=timeout_s)  # what this process has not sent yet
    unfinished = TaskRunFilter(
        state=TaskRunFilterState(type=TaskRunFilterStateType(any_=[t for t in StateType if t not in TERMINAL_STATES]))
    )
    this_run = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
    deadline, clean = time.monotonic() + timeout_s, 0
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            # twice in a row, 0.2 s apart: events sent last may not have reached the recorder at the first look
            clean = (
                0 if client.read_task_runs(flow_run_filter=this_run, task_run_filter=unfinished, limit=1) else clean + 1
            )
            if clean == 2:
                return True
            time.sleep(0.2)
    return False


def compare(
    cfg,
    as_json: bool,
    flow: str = "compare",
    methods: Optional[list[str]] = None,
    api_ready: Callable[[], Any] = lambda: None,
) -> None:
    """Run `flow` on `cfg` and print its summary."""
    check_api()  # a set PREFECT_API_URL whose server does not answer: one line now, before the flows' imports
    from farmflow.flows import FLOWS

    api_ready()
    start = time.perf_counter()
    chosen = {"methods": methods} if flow == "compare" else {}
    summary = run_flow(f"{flow}-{cfg.name}", FLOWS[flow], advanced=cfg, **chosen)
    wall = time.perf_counter() - start
    if as_json:
        print_json(summary | {"wall_seconds": wall})
    else:
        print_summary(summary, wall, str(State.path))
        if summary.get("replicates", 1) > 1:  # the intervals, differences to SFT and rank ranges
            console().print(summary["markdown"])


def demo(
    preset: str = typer.Option("synthetic-tiny", help="Preset to run (synthetic-tiny: a few minutes on 2 CPU cores)."),
    store: Optional[str] = typer.Option(None, help=STORE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON instead of tables."),
    methods: list[str] = typer.Option(
        [], "--method", help="Run only these methods (repeat or comma-separate); default: all."
    ),
    annotator: str = typer.Option(
        "oracle",
        help="oracle: the offline annotator pool; api-local: the API annotators (p_sim_ann/p_sim_eval) "
        "through a loopback judge server started for the run.",
    ),
) -> None:
    """Run the offline synthetic farm end to end: SFT, pairs, annotation, reward model, every method, one
    leaderboard."""
    prefect_env()
    chosen = methods_of(methods)  # wrong names and presets fail at once, before Prefect's temporary API starts
    if annotator not in ("oracle", "api-local"):
        raise UsageError(f"unknown annotator {annotator!r}; use oracle or api-local")
    cfg = load(preset, [], store)
    check_model(cfg)
    api_ready = start_temporary_api()
    if annotator == "api-local":
        from farmflow.cli.annotators import local_judge

        with local_judge(store) as overrides:
            return compare(load(preset, overrides, store), as_json, methods=chosen, api_ready=api_ready)
    compare(cfg, as_json, methods=chosen, api_ready=api_ready)


def run(
    flow: str = typer.Argument(
        ..., help="Flow to run: compare, or one method's flow (best-of-n, dpo, ...; a wrong name lists them)."
    ),
    preset: str = typer.Option("synthetic-tiny", help="Preset to start from."),
    set_: list[str] = typer.Option(
        [], "--set", help="Override a field: --set best_of_n.n=8 (values parsed as JSON when possible)."
    ),
    methods: list[str] = typer.Option(
        [], "--method", help="compare only: the methods to run (repeat or comma-separate); default: all."
    ),
    store: Optional[str] = typer.Option(None, help=STORE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    replicates: Optional[int] = typer.Option(
        None,
        "--replicates",
        min=1,
        help="compare only: run under K seeds (evaluation.replicates) and show means, 95%% intervals and each "
        "method's paired difference to SFT; each replicate's stages are cached (K=3 after K=2 runs one more).",
    ),
) -> None:
    """Run a flow on a preset with overrides; unchanged stages come from the cache."""
    from farmflow.config import FLOW_NAMES

    prefect_env()
    if flow not in FLOW_NAMES:  # wrong names, flags and overrides fail at once, before Prefect's temporary API starts
        raise UsageError(f"unknown flow {flow!r}; known flows: {', '.join(FLOW_NAMES)}")
    chosen = methods_of(methods)
    if chosen and flow != "compare":
        raise UsageError("--method only applies to the compare flow")
    if replicates is not None and flow != "compare":
        raise UsageError("--replicates only applies to the compare flow")
    cfg = load(preset, list(set_) + ([f"evaluation.replicates={replicates}"] if replicates else []), store)
    check_api()  # before the store check, which creates the store: a run that cannot reach its API leaves nothing
    check_model(cfg)
    compare(cfg, as_json, flow=flow, methods=chosen, api_ready=start_temporary_api())


def overopt(
    preset: str = typer.Option("synthetic-tiny", help="Preset to start from."),
    n: list[int] = typer.Option([], "--n", min=1, help="Best-of-n sample counts (repeatable); default 1 2 4 8 16."),
    labeller: list[str] = typer.Option(
        [],
        "--labeller",
        help="Who labels the PREF pairs, one reward model and one curve each: p_sim^ann, greedy, p_sim^eval "
        "(or p_sim_ann, p_sim_eval; repeatable or comma-separated); default p_sim^ann and greedy (paper Fig. 5).",
    ),
    annotator: list[str] = typer.Option(
        [],
        "--annotator",
        help="Judge every curve with these annotators (repeatable or comma-separated) instead of its own labeller; "
        "the single-reward-model curve: --labeller p_sim^ann --annotator p_sim^ann,greedy.",
    ),
    ppo_every: Optional[int] = typer.Option(
        None, "--ppo-every", min=1, help="Also PPO's curve: a policy snapshot every this many PPO steps, each a point."
    ),
    set_: list[str] = typer.Option([], "--set", help="Override a field (section.field=value)."),
    store: Optional[str] = typer.Option(None, help=STORE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Over-optimization curves, one per labeller: best-of-n for growing n (and PPO snapshots) against a reward model
    trained on that labeller's preferences; proxy reward, win rate under the labeller and gold reward (table + plot)."""
    prefect_env()
    cfg = load(preset, set_, store)  # a bad preset or override fails before Prefect's temporary API starts
    check_model(cfg)
    names = lambda opts: [x.strip() for o in opts for x in o.split(",") if x.strip()] or None  # noqa: E731
    for option, given in (("--labeller", labeller), ("--annotator", annotator)):
        try:
            annotator_labels(names(given) or [])
        except ValueError as err:
            raise UsageError(f"{option}: {err}") from None
    api_ready = start_temporary_api()
    from farmflow.flows.overoptimization import overoptimization_flow

    api_ready()
    start = time.perf_counter()
    summary = run_flow(
        f"overopt-{cfg.name}",
        overoptimization_flow,
        advanced=cfg,
        ns=list(n) or None,
        labellers=names(labeller),
        annotators=names(annotator),
        ppo_every=ppo_every,
    )
    if as_json:
        print_json(summary | {"wall_seconds": time.perf_counter() - start})
        return
    console().print(summary["markdown"])
    console().print(
        f"wall time {time.perf_counter() - start:.1f}s; table, curve.md and curve.png in {summary['artifact']}"
    )


def reward_report(
    preset: str = typer.Option("synthetic-tiny", help="Preset to start from."),
    set_: list[str] = typer.Option([], "--set", help="Override a field (section.field=value)."),
    store: Optional[str] = typer.Option(None, help=STORE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """How good is the reward model? Held-out accuracy against labels, un-noised labels and gold, per task family,
    beside baselines: the longer output, the SFT policy's log-likelihood, the gold reward, the pool's Bayes optimum."""
    prefect_env()
    cfg = load(preset, set_, store)
    check_model(cfg)
    api_ready = start_temporary_api()
    from farmflow.flows.reward_report import reward_report_flow

    api_ready()
    summary = run_flow(f"reward-report-{cfg.name}", reward_report_flow, advanced=cfg)
    if as_json:
        print_json(summary)
        return
    console().print(summary["markdown"])
    console().print(f"table and report.md in {summary['artifact']}")


def deploy(
    preset: str = typer.Option(
        "synthetic-tiny", help="Default preset of every deployment (each run can pick another in the UI)."
    ),
    set_: list[str] = typer.Option(
        [], "--set", help="Default overrides of every deployment, e.g. --set execution.mode=distributed."
    ),
    store: Optional[str] = typer.Option(
        None,
        help="Store the flows use (an s3:// URI when workers run on several machines); "
        "default: each worker's $FARMFLOW_STORE or ./.farmflow/store.",
    ),
    nightly_cron: str = typer.Option("0 3 * * *", help="Cron schedule of the nightly-compare deployment."),
    timezone: str = typer.Option("UTC", help="Timezone of the nightly schedule (IANA name, e.g. Europe/Paris)."),
    nightly_methods: list[str] = typer.Option(
        [], "--nightly-method", help="Methods the nightly comparison runs (repeat or comma-separate); default: all."
    ),
    gpu_slots: Optional[int] = typer.Option(
        1, min=0, help="Concurrency limit of the GPU pool when it is created (flow runs at once; 0 pauses)."
    ),
    cpu_slots: Optional[int] = typer.Option(
        None, min=0, help="Concurrency limit of the CPU pool when it is created (default: unlimited)."
    ),
    create_pools: bool = typer.Option(
        True, help="Create the work pools (execution.cpu_pool, execution.gpu_pool; process type) when missing."
    ),
) -> None:
    """Register a deployment per flow, the nightly comparison, the GPU stage runner and the unresponsive-run
    automation on the Prefect server at PREFECT_API_URL."""
    prefect_env()
    from farmflow.config import ConfigError
    from farmflow.deployments import deploy as register_deployments

    overrides = list(set_) + ([f"store.uri={json.dumps(store)}"] if store else [])
    try:
        registered = register_deployments(
            preset, overrides, nightly_cron, timezone, methods_of(nightly_methods), gpu_slots, cpu_slots, create_pools
        )
    except (ConfigError, ValueError, RuntimeError) as err:  # the server refused or could not be reached
        raise UsageError(f"deploy failed: {err}") from err
    emit(
        ["deployment", "work pool", "id"],
        [[d["name"], d["pool"], d["id"]] for d in registered if "pool" in d],
        title="Deployments",
    )
    for d in registered:
        if "pool" not in d:
            say(f"{d['name']} ({d['id']})")
    pools = sorted({d["pool"] for d in registered if "pool" in d})
    say("start a worker per pool: " + "; ".join(f"prefect worker start --pool {p}" for p in pools))


def register(app: typer.Typer) -> None:
    """Add `demo`, `run`, `deploy`, `overopt` and `reward-report` to the `farmflow` command."""
    app.command()(demo)
    app.command()(run)
    app.command()(deploy)
    app.command()(overopt)
    app.command("reward-report")(reward_report)
