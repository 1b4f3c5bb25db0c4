"""`farmflow leaderboard` and `farmflow history`: one run's leaderboard, and each method's trend across runs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from farmflow.cli.boards import print_board
from farmflow.cli.errors import CliError, UsageError
from farmflow.cli.output import check_format, emit, format_option, print_json, say
from farmflow.cli.preflight import existing_store, location_of, writable_output

STORE_HELP = "Artifact store (default $FARMFLOW_STORE, else ./.farmflow/store)."


def leaderboard(
    store: Optional[str] = typer.Option(None, help=STORE_HELP),
    run: Optional[str] = typer.Option(
        None, "--run", help="The run to show: its run id or flow-run id (or a unique prefix of one)."
    ),
    preset: Optional[str] = typer.Option(
        None, "--preset", help="Show the newest run of this preset (default: synthetic-tiny, else the newest run's)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the run, its leaderboard rows and artifact as JSON."),
    fmt: str = format_option(
        "table (aligned, for people, with the run and the judge), json (the rows as a list of "
        "objects), csv or md (a Markdown table)."
    ),
    judge: Optional[str] = typer.Option(
        None,
        "--judge",
        help="human (every person's labels in the store) or human:NAME: win rates over the evaluation pairs people "
        "labeled, and the Spearman correlation with the simulated judge's ranking.",
    ),
    cost: bool = typer.Option(
        False, "--cost", help="Each row's cost beside its quality: compute seconds, API spend, wall time, Pareto."
    ),
    cost_plot: Optional[Path] = typer.Option(
        None, "--cost-plot", help="With --cost: write the win rate vs cost plot (PNG, Pareto frontier) here."
    ),
) -> None:
    """Print one run's leaderboard from the store's runs table, and where its Parquet, Markdown and plot are."""
    from farmflow.evaluation.history import RUN_COLUMNS, pick_run
    from farmflow.storage import SCHEMAS

    check_format(fmt)
    if run and preset:
        raise UsageError("give --run or --preset, not both")
    st = existing_store(location_of(store))  # reading creates nothing
    recorded = st.read_rows("runs", "runs").to_pylist()
    if recorded:
        try:
            rows, why = pick_run(recorded, run, preset)
        except LookupError as err:
            raise UsageError(str(err)) from None
        about = {k: rows[0][k] for k in RUN_COLUMNS}
        rows = [{k: r[k] for k in SCHEMAS["leaderboard"].names} for r in rows]
        latest = st.get("leaderboard", about["leaderboard_key"])
        created = about["run_at"].isoformat()
        title = f"Leaderboard ({about['preset']}, run {about['run_id']}, {created[:16].replace('T', ' ')} UTC)"
    else:  # a store written before the runs table: its newest leaderboard artifact
        boards = [r for r in st.list() if r.stage == "leaderboard"]
        if not boards:
            raise CliError(f"no leaderboard in {st.root} yet: run `farmflow demo` first")
        if run or preset:
            raise CliError(
                f"--run and --preset read the runs table, and {st.root} has none yet "
                "(`farmflow leaderboard` alone shows its newest leaderboard)"
            )
        latest, about, why = boards[-1], None, "the newest leaderboard artifact (this store has no runs table)"
        rows, created = st.read_table(latest).to_pylist(), latest.created
        title = f"Leaderboard ({created})"
    uri = latest.uri if latest else None
    if judge or cost:
        from farmflow.cli.quality import cost_board, human_board, ranking_line

        if judge:
            rows, ranks = human_board(st, rows, judge)
            title += f", judged by {judge}"
        if cost:
            cost_board(st, rows, title, fmt, cost_plot, as_json)
        elif as_json:
            print_json({"leaderboard": rows, "ranking": ranks})
        else:
            print_board(rows, title, fmt)
        if judge and not as_json and fmt == "table":
            say(ranking_line(ranks))
        return
    if as_json:
        run_json = about and about | {"run_at": created}
        print_json({"shown": why, "run": run_json, "artifact": uri, "created": created, "leaderboard": rows})
        return
    if fmt != "table":
        print_board(rows, title, fmt)
        return
    say(f"showing {why}")
    print_board(rows, title)
    if about:
        say(f"flow run {about['flow_run_name'] or about['flow_run_id'] or '?'}; config key {about['config_key']}")
    if rows and rows[0].get("annotator"):
        from farmflow.evaluation.leaderboard import judge_quality

        note = judge_quality(rows[0]["annotator"])
        say(
            f"annotator: {rows[0]['annotator']}; reference: {rows[0].get('reference') or '?'}"
            + (f"; the judge {note}" if note else "")
        )
    gold = [r for r in rows if r["mean_gold"] is not None and r["mean_gold"] == r["mean_gold"]]
    if len(gold) >= 3:  # the synthetic farm: does the simulated ranking match the true (gold) one?
        from farmflow.evaluation.analysis import ranking_correlation

        for col in ("win_rate", "lc_win_rate"):
            if all(r.get(col) is not None for r in gold):
                c = ranking_correlation(
                    {r["method"]: r[col] for r in gold}, {r["method"]: r["mean_gold"] for r in gold}
                )
                say(
                    f"{col.replace('_', ' ')} vs mean gold over {c['n']} methods: "
                    f"Spearman {c['spearman']:.2f}, Pearson {c['pearson']:.2f}"
                )
    if uri:
        say(f"files: {uri}/data.parquet, leaderboard.md, leaderboard.png")


def history(
    preset: Optional[str] = typer.Option(
        None, "--preset", help="Preset whose runs to show (default: synthetic-tiny, else the newest run's preset)."
    ),
    last: int = typer.Option(10, "--last", min=1, help="Show the newest N runs."),
    as_json: bool = typer.Option(
        False, "--json", help="Print the runs, one row per (run, method) and the flagged changes as JSON."
    ),
    fmt: str = format_option(
        "table (one column per run, for people; text: the same), json or csv (one row per run and method) or md "
        "(Markdown, one column per run)."
    ),
    plot: Optional[Path] = typer.Option(
        None, "--plot", help="Also write the plot of win rate ± SE per method across runs (PNG) here."
    ),
    store: Optional[str] = typer.Option(None, help=STORE_HELP),
) -> None:
    """Win rate ± SE of each method across runs, oldest first; ▲/▼ marks a change larger than 2 combined SEs."""
    from farmflow.evaluation.history import (
        LONG_COLUMNS,
        pick_preset,
        plot_trend,
        trend,
        trend_long,
        trend_markdown,
        trend_text,
    )

    fmt = "table" if fmt == "text" else fmt
    check_format(fmt)
    writable_output(plot, "--plot")
    rows = existing_store(location_of(store)).read_rows("runs", "runs").to_pylist()
    try:
        name, why = pick_preset(rows, preset)
    except LookupError as err:
        raise (UsageError if rows else CliError)(str(err)) from None
    t = trend([r for r in rows if r["preset"] == name], last)
    if plot:
        plot_trend(t, str(plot), f"Win rate across runs: {name}")
    title = f"History of {why}: {len(t['runs'])} run(s), oldest first"
    long = [r | {"run_at": r["run_at"].isoformat()} for r in trend_long(t)]
    if as_json:
        runs = [r | {"run_at": r["run_at"].isoformat()} for r in t["runs"]]
        print_json({"preset": name, "shown": why, "runs": runs, "trend": long, "changes": t["changes"]})
    elif fmt in ("csv", "json"):
        emit(LONG_COLUMNS, [[r.get(c) for c in LONG_COLUMNS] for r in long], fmt)
    else:
        sys.stdout.write((trend_markdown if fmt == "md" else trend_text)(t, title))
    if plot:
        typer.echo(f"plot: {plot}", err=as_json or fmt != "table")


def register(app: typer.Typer) -> None:
    """Add `leaderboard` and `history` to the `farmflow` command."""
    app.command()(leaderboard)
    app.command()(history)
