"""`farmflow sql` and `farmflow artifacts`: look into a store (local or S3) with SQL, list and verify its artifacts."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Optional

import typer

from farmflow.cli.errors import CliError, UsageError
from farmflow.cli.output import FORMAT_HELP, check_format, emit, exact, format_option
from farmflow.cli.preflight import writable_output

artifacts_app = typer.Typer(help="List and inspect the committed artifacts of a store.", no_args_is_help=True)
STORE_HELP = (
    "Artifact store: a folder or s3://bucket/prefix[?endpoint_url=...] "
    "(default $FARMFLOW_STORE, else ./.farmflow/store)."
)


def open_given(store: Optional[str]):
    """The existing store `--store` names (default $FARMFLOW_STORE, else ./.farmflow/store); reading creates none."""
    from farmflow.cli.preflight import existing_store, location_of

    return existing_store(location_of(store))


def sql(
    query: Optional[str] = typer.Argument(
        None,
        help="SQL over the views artifacts, instructions, pairs, preferences, outputs, evaluations, leaderboard, "
        "overoptimization, reward_report, annotations, runs, leaderboard_history, training_metrics.",
    ),
    store: Optional[str] = typer.Option(None, help=STORE_HELP),
    fmt: str = format_option(FORMAT_HELP.removesuffix(".") + "; parquet (needs --output)."),
    output: Optional[Path] = typer.Option(
        None, "--output", "-o", help="Write the result to this file instead of stdout."
    ),
    print_views: bool = typer.Option(
        False, "--print-views", help="Print the CREATE VIEW statements (for the DuckDB CLI or a notebook) and exit."
    ),
) -> None:
    """Run SQL over everything in the store with DuckDB."""
    import duckdb

    from farmflow.storage.sql import connect, create_views_sql

    check_format(fmt, ("table", "json", "csv", "md", "parquet"))
    writable_output(output)
    st = open_given(store)
    if print_views:
        text = create_views_sql(st)
        output.write_text(text) if output else sys.stdout.write(text)
        return
    if not query:
        raise UsageError('give a query, e.g. "SELECT stage, count(*) FROM artifacts GROUP BY stage"')
    if fmt == "parquet" and output is None:
        raise UsageError("--format parquet needs --output FILE")
    con = connect(st, warn=lambda line: print(f"warning: {line}", file=sys.stderr))
    try:
        rel = con.sql(query)
        if rel is None:  # a statement without a result
            return
        if fmt == "parquet":
            rel.write_parquet(str(output))
            return
        columns, rows = rel.columns, rel.fetchall()
    except duckdb.Error as err:
        raise CliError(f"sql: {err}") from None
    if output is None:
        emit(columns, rows, fmt, default=exact)
        return
    with output.open("w", newline="") as out:
        if fmt == "csv":
            writer = csv.writer(out)
            writer.writerow(columns)
            writer.writerows(rows)
        elif fmt == "json":
            json.dump([dict(zip(columns, r)) for r in rows], out, default=str, indent=1)
            out.write("\n")
        else:
            raise UsageError(f"--output writes csv, json or parquet, not {fmt}")


@artifacts_app.command("ls")
def artifacts_ls(
    store: Optional[str] = typer.Option(None, help=STORE_HELP),
    stage: Optional[str] = typer.Option(None, help="Only this stage."),
    fmt: str = format_option(),
) -> None:
    """The committed artifacts, oldest first: stage, key, kind, format, rows, created."""
    check_format(fmt)
    refs = [r for r in open_given(store).list() if stage is None or r.stage == stage]
    emit(
        ["stage", "key", "kind", "format", "rows", "created"],
        [(r.stage, r.key, r.kind, r.format, r.rows, r.created[:19].replace("T", " ")) for r in refs],
        fmt,
        right=["rows"],
        default=exact,
    )


@artifacts_app.command("show")
def artifacts_show(
    key: str = typer.Argument(..., help="An artifact key, a unique prefix of one, or stage/key."),
    store: Optional[str] = typer.Option(None, help=STORE_HELP),
) -> None:
    """An artifact's commit record (ref, config, inputs, metrics) and its files, as JSON."""
    st = open_given(store)
    stage, _, wanted = key.rpartition("/")
    matches = [r for r in st.list() if r.key.startswith(wanted) and (not stage or r.stage == stage)]
    if len(matches) != 1:
        found = ", ".join(f"{r.stage}/{r.key}" for r in matches[:5])
        raise CliError(
            f"{'no' if not matches else len(matches)} artifacts match {key!r}" + (f": {found}" if found else "")
        )
    ref = matches[0]
    record = st.record(ref) | {"ref": ref.model_dump(mode="json"), "files": st.files(ref)}
    print(json.dumps(record, indent=2, sort_keys=True))


@artifacts_app.command("verify")
def artifacts_verify(
    store: Optional[str] = typer.Option(None, help=STORE_HELP),
    repair: bool = typer.Option(
        False, "--repair", help="Move what is corrupt to _quarantine/ in the store, so the next run computes it again."
    ),
    quick: bool = typer.Option(False, "--quick", help="Sizes only (one listing per artifact), no hashing."),
    fmt: str = format_option(),
) -> None:
    """Check every artifact's files and every row-log chunk against the size and sha256 they were committed with.

    Lists what is corrupt (exit code 1 unless --repair moved it all to _quarantine/)."""
    check_format(fmt)
    st = open_given(store)
    found = st.verify(hashes=not quick, repair=repair)
    if not found:
        print(f"verified {len(st.records())} artifacts and the row logs of {st.root}: nothing corrupt", file=sys.stderr)
        return
    emit(
        ["kind", "stage", "key", "problem", "quarantined"],
        [(f["kind"], f["stage"], f["key"], f["problem"], f["quarantined"] or "") for f in found],
        fmt,
        default=exact,
    )
    if not repair:
        raise CliError(f"{len(found)} corrupt in {st.root}; `farmflow artifacts verify --repair` moves them away")


def register(app: typer.Typer) -> None:
    """Add `sql` and `artifacts` to the `farmflow` command."""
    app.command("sql")(sql)
    app.add_typer(artifacts_app, name="artifacts")
