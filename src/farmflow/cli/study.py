"""`farmflow study validate`: the validation study (`farmflow.flows.study`) on a synthetic preset."""

from __future__ import annotations

import time
from typing import Optional

import typer

from farmflow.cli.errors import UsageError
from farmflow.cli.output import console, print_json
from farmflow.cli.runs import STORE_HELP, load, methods_of, run_flow, start_temporary_api
from farmflow.cli.server import check_api, prefect_env

study_app = typer.Typer(help="Studies that validate the simulator (AlpacaFarm Fig. 3 and 5).", no_args_is_help=True)


@study_app.command()
def validate(
    preset: str = typer.Option("synthetic-tiny", help="Synthetic preset to study (the human-like arm needs gold)."),
    replicates: Optional[int] = typer.Option(
        None, "--replicates", min=1, help="Seeds of the whole experiment (default: the preset's evaluation.replicates)."
    ),
    methods: list[str] = typer.Option([], "--method", help="Methods to study (repeat or comma-separate); default all."),
    n: list[int] = typer.Option(
        [], "--n", min=1, help="Best-of-n counts of the over-optimization curves (default 1..64)."
    ),
    ppo_every: Optional[int] = typer.Option(
        None, "--ppo-every", min=1, help="Also PPO's curves: a snapshot every N steps."
    ),
    agreement: float = typer.Option(
        0.657,
        help="Leave-one-out agreement of the human-like arm: a judgement vs the mode of three others (humans: 0.657).",
    ),
    sft_epochs: list[float] = typer.Option(
        [],
        "--sft-epochs",
        help="Epochs of an SFT baseline stopped early, for the all-systems ranking: the SFT run's policy after them "
        "(repeat; default: a quarter and half of the preset's sft.epochs; 0: none).",
    ),
    writers: bool = typer.Option(
        True,
        "--writers/--no-writers",
        help="Also rank the farm's writers beside the pipeline (the paper's API models).",
    ),
    curve_replicates: int = typer.Option(
        1,
        "--curve-replicates",
        min=1,
        help="Draw the over-optimization curves under this many replicates' seeds and pool each finding, and each "
        "curve point by point, over them.",
    ),
    seed: Optional[int] = typer.Option(
        None,
        "--seed",
        min=0,
        help="One seed for every stage but the data splits, as the run form's seed knob (replicate r of a preset whose "
        "seeds are 0 is seed 1000·r, so its stages come from, and go to, the same cache entries).",
    ),
    set_: list[str] = typer.Option([], "--set", help="Override a field (section.field=value)."),
    store: Optional[str] = typer.Option(None, help=STORE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Simulated vs human-like win rates over methods (Spearman, Pearson, bootstrap intervals), every method against
    SFT, over-optimization under p_sim^ann, a greedy annotator and gold: a Parquet table, plots, Prefect artifacts."""
    prefect_env()
    chosen = methods_of(methods)
    if not 0.5 < agreement < 1:
        raise UsageError(f"--agreement must lie between 0.5 (coin flips) and 1, got {agreement}")
    cfg = load(preset, set_, store)
    if seed is not None:
        from farmflow.flows.form import with_seed  # the flows package loads Prefect: only when a seed is set

        cfg = with_seed(cfg, seed)
    if any(not 0 <= e < cfg.sft.epochs for e in sft_epochs):
        raise UsageError(f"--sft-epochs must lie between 0 and the preset's sft.epochs ({cfg.sft.epochs:g})")
    if cfg.data.source != "synthetic":
        raise UsageError(
            f"the study needs the synthetic farm's gold reward; preset {preset} has data.source {cfg.data.source!r}"
        )
    api_ready = start_temporary_api()
    check_api()
    from farmflow.flows.study import study_flow

    api_ready()
    start = time.perf_counter()
    summary = run_flow(
        f"study-{cfg.name}",
        study_flow,
        advanced=cfg,
        methods=chosen,
        replicates=replicates,
        ns=list(n) or None,
        ppo_every=ppo_every,
        agreement=agreement,
        sft_epochs=[e for e in sft_epochs if e] if sft_epochs else None,
        writers=writers,
        curve_replicates=curve_replicates,
    )
    wall = time.perf_counter() - start
    if as_json:
        print_json(summary | {"wall_seconds": wall})
        return
    console().print(summary["markdown"])
    console().print(summary["leaderboard"])
    console().print(f"wall time {wall:.1f}s; table, study.md and plots in {summary['artifacts']['study']}")


def register(app: typer.Typer) -> None:
    """Add `study` to the `farmflow` command."""
    app.add_typer(study_app, name="study")
