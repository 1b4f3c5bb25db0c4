"""`farmflow study feedback`: how much feedback is enough (`farmflow.flows.feedback`).

`register` adds the command to the `study` group when another module made one, else makes the group."""

from __future__ import annotations

import time
from typing import Optional

import typer

from farmflow.cli.output import console, print_json

STORE_HELP = "Artifact store (default $FARMFLOW_STORE, else ./.farmflow/store)."


def feedback(
    preset: str = typer.Option("synthetic-tiny", help="Preset to start from."),
    method: list[str] = typer.Option(
        [], "--method", help="Methods (repeatable or comma-separated): default best_of_n and dpo."
    ),
    fraction: list[float] = typer.Option(
        [], "--fraction", help="Shares of the PREF pairs (repeatable); default 0.125 0.25 0.5 1."
    ),
    set_: list[str] = typer.Option([], "--set", help="Override a field (section.field=value)."),
    store: Optional[str] = typer.Option(None, help=STORE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Train the reward-model methods on 1/8, 1/4, 1/2 and all of the preference pairs (each share cached like any
    stage) and show win rate against the number of pairs (table, feedback.png)."""
    from farmflow.cli.errors import UsageError
    from farmflow.cli.runs import load, run_flow, start_temporary_api
    from farmflow.cli.server import prefect_env
    from farmflow.config import METHODS

    prefect_env()
    cfg = load(preset, set_, store)
    methods = [x.strip().replace("-", "_") for m in method for x in m.split(",") if x.strip()] or None
    unknown = [m for m in methods or [] if m not in METHODS]
    if unknown:
        raise UsageError(f"--method: unknown method(s) {unknown}; known: {', '.join(METHODS)}")
    if any(not 0 < f <= 1 for f in fraction):
        raise UsageError("--fraction: each share must be in (0, 1]")
    api_ready = start_temporary_api()
    from farmflow.flows.feedback import feedback_flow

    api_ready()
    start = time.perf_counter()
    summary = run_flow(
        f"feedback-{cfg.name}", feedback_flow, advanced=cfg, methods=methods, fractions=list(fraction) or None
    )
    if as_json:
        print_json(summary | {"wall_seconds": time.perf_counter() - start})
        return
    console().print(summary["markdown"])
    console().print(
        f"wall time {time.perf_counter() - start:.1f}s; table, feedback.md and feedback.png in {summary['artifact']}"
    )


def register(app: typer.Typer) -> None:
    """Add `study feedback` to the `farmflow` command (into an existing `study` group if there is one)."""
    group = next((g.typer_instance for g in app.registered_groups if g.name == "study"), None)
    if group is None:
        group = typer.Typer(help="Studies over many runs.", no_args_is_help=True)
        app.add_typer(group, name="study")
    group.command("feedback")(feedback)
