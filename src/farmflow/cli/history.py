"""`farmflow history`: the trend of each method across the runs of a preset, and what changed."""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Optional

import typer


def history(
    preset: Optional[str] = typer.Option(
        None, "--preset", help="Preset whose runs to show (default: synthetic-tiny, else the newest run's preset)."
    ),
    last: int = typer.Option(10, "--last", min=1, help="Show the newest N runs."),
    as_json: bool = typer.Option(
        False, "--json", help="Print the runs, one row per (run, method) and the flagged changes as JSON."
    ),
    format: str = typer.Option(
        "text", "--format", "-f", help="text (one column per run), md (Markdown) or csv (one row per run and method)."
    ),
    plot: Optional[Path] = typer.Option(
        None, "--plot", help="Also write the plot of win rate ± SE per method across runs (PNG) here."
    ),
    store: Optional[str] = typer.Option(None, help="Artifact store (default $FARMFLOW_STORE, else ./.farmflow/store)."),
) -> None:
    """Win rate ± SE of each method across runs, oldest first; ▲/▼ marks a change larger than 2 combined SEs."""
    from farmflow.cli import print_json
    from farmflow.config import StoreConfig
    from farmflow.evaluation.history import (
        LONG_COLUMNS,
        pick_preset,
        plot_trend,
        trend,
        trend_long,
        trend_markdown,
        trend_text,
    )

    if format not in ("text", "md", "csv"):
        raise typer.BadParameter(f"unknown format {format!r}; use text, md or csv", param_hint="--format")
    from farmflow.storage import StoreError, open_store

    try:
        rows = open_store(store or StoreConfig().location).read_rows("runs", "runs").to_pylist()
    except (StoreError, ValueError) as err:
        typer.echo(f"store error: {err}", err=True)
        raise typer.Exit(2)
    try:
        name, why = pick_preset(rows, preset)
    except LookupError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2 if rows else 1)
    t = trend([r for r in rows if r["preset"] == name], last)
    if plot:
        plot_trend(t, str(plot), f"Win rate across runs: {name}")
    title = f"History of {why}: {len(t['runs'])} run(s), oldest first"
    long = [r | {"run_at": r["run_at"].isoformat()} for r in trend_long(t)]
    if as_json:
        runs = [r | {"run_at": r["run_at"].isoformat()} for r in t["runs"]]
        print_json({"preset": name, "shown": why, "runs": runs, "trend": long, "changes": t["changes"]})
    elif format == "csv":
        writer = csv.DictWriter(sys.stdout, LONG_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(long)
    elif format == "md":
        sys.stdout.write(trend_markdown(t, title))
    else:
        sys.stdout.write(trend_text(t, title))
    if plot:
        typer.echo(f"plot: {plot}", err=as_json or format != "text")


def register(app: typer.Typer) -> None:
    """Add `history` to the `farmflow` command."""
    app.command("history")(history)
