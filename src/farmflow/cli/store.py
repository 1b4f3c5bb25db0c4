"""`farmflow sql` and `farmflow artifacts`: look into a store (local or S3) with SQL."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

artifacts_app = typer.Typer(help="List and inspect the committed artifacts of a store.", no_args_is_help=True)
console = Console()
STORE_HELP = "Artifact store: a folder or s3://bucket/prefix[?endpoint_url=...] (default $FARMFLOW_STORE, else ./.farmflow/store)."


def _open(store: Optional[str]):
    """The store, or one line on stderr and exit code 2."""
    from farmflow.config import StoreConfig
    from farmflow.storage import StoreError, open_store

    try:
        return open_store(store or StoreConfig().location)
    except (StoreError, ValueError) as err:
        Console(stderr=True).print(f"[red]store error:[/red] {err}", soft_wrap=True, highlight=False)
        raise typer.Exit(2)


def _print_table(columns: list[str], rows: list[tuple]) -> None:
    table = Table(*columns, show_lines=False, header_style="bold")
    for row in rows:
        table.add_row(*("" if v is None else str(v) for v in row))
    Console(width=max(console.width, 40 + 24 * len(columns))).print(table)


def sql(
    query: Optional[str] = typer.Argument(None, help="SQL over the views artifacts, instructions, pairs, preferences, outputs, evaluations, leaderboard, overoptimization, reward_report, annotations, runs, leaderboard_history."),
    store: Optional[str] = typer.Option(None, help=STORE_HELP),
    format: str = typer.Option("table", "--format", "-f", help="table (aligned), csv, json (a list of objects) or parquet (needs --output)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write the result to this file instead of stdout."),
    print_views: bool = typer.Option(False, "--print-views", help="Print the CREATE VIEW statements (for the DuckDB CLI or a notebook) and exit."),
) -> None:
    """Run SQL over everything in the store with DuckDB."""
    import duckdb

    from farmflow.storage.sql import connect, create_views_sql

    if format not in ("table", "csv", "json", "parquet"):
        raise typer.BadParameter(f"unknown format {format!r}; use table, csv, json or parquet", param_hint="--format")
    st = _open(store)
    if print_views:
        text = create_views_sql(st)
        output.write_text(text) if output else sys.stdout.write(text)
        return
    if not query:
        raise typer.BadParameter("give a query, e.g. \"SELECT stage, count(*) FROM artifacts GROUP BY stage\"", param_hint="QUERY")
    if format == "parquet" and output is None:
        raise typer.BadParameter("--format parquet needs --output FILE", param_hint="--output")
    con = connect(st)
    try:
        rel = con.sql(query)
        if rel is None:  # a statement without a result
            return
        if format == "parquet":
            rel.write_parquet(str(output))
            return
        columns, rows = rel.columns, rel.fetchall()
    except duckdb.Error as err:
        Console(stderr=True).print(f"[red]sql error:[/red] {err}", soft_wrap=True, highlight=False)
        raise typer.Exit(1)
    if format == "table":
        _print_table(columns, rows)
        return
    out = output.open("w", newline="") if output else sys.stdout
    try:
        if format == "csv":
            writer = csv.writer(out)
            writer.writerow(columns)
            writer.writerows(rows)
        else:
            json.dump([dict(zip(columns, r)) for r in rows], out, default=str, indent=1)
            out.write("\n")
    finally:
        if output:
            out.close()


@artifacts_app.command("ls")
def artifacts_ls(
    store: Optional[str] = typer.Option(None, help=STORE_HELP),
    stage: Optional[str] = typer.Option(None, help="Only this stage."),
) -> None:
    """The committed artifacts, oldest first: stage, key, kind, format, rows, created."""
    refs = [r for r in _open(store).list() if stage is None or r.stage == stage]
    _print_table(["stage", "key", "kind", "format", "rows", "created"],
                 [(r.stage, r.key, r.kind, r.format, r.rows, r.created[:19].replace("T", " ")) for r in refs])


@artifacts_app.command("show")
def artifacts_show(
    key: str = typer.Argument(..., help="An artifact key, a unique prefix of one, or stage/key."),
    store: Optional[str] = typer.Option(None, help=STORE_HELP),
) -> None:
    """An artifact's commit record (ref, config, inputs, metrics) and its files, as JSON."""
    st = _open(store)
    stage, _, wanted = key.rpartition("/")
    matches = [r for r in st.list() if r.key.startswith(wanted) and (not stage or r.stage == stage)]
    if len(matches) != 1:
        found = ", ".join(f"{r.stage}/{r.key}" for r in matches[:5])
        Console(stderr=True).print(f"{'no' if not matches else len(matches)} artifacts match {key!r}" + (f": {found}" if found else ""),
                                   soft_wrap=True, highlight=False)
        raise typer.Exit(1)
    ref = matches[0]
    record = st.record(ref) | {"ref": ref.model_dump(mode="json"), "files": st.files(ref)}
    print(json.dumps(record, indent=2, sort_keys=True))


def register(app: typer.Typer) -> None:
    """Add `sql` and `artifacts` to the `farmflow` command."""
    app.command("sql")(sql)
    app.add_typer(artifacts_app, name="artifacts")
