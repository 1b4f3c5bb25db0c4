"""`farmflow eval winrate | leaderboard | annotators | rankings`: statistics with AlpacaEval's definitions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from farmflow.cli.errors import CliError, UsageError
from farmflow.cli.output import check_format, emit, format_option, print_json, say
from farmflow.cli.preflight import existing_store

eval_app = typer.Typer(help="Evaluation statistics (AlpacaEval definitions).", no_args_is_help=True)


def annotation_rows(path: Path) -> list[dict]:
    """The rows of an AlpacaEval-style annotations JSON file; a UsageError naming the file otherwise."""
    try:
        rows = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UsageError(f"cannot read {path}: {err}") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise UsageError(f"{path}: expected a JSON list of annotation objects")
    return rows


@eval_app.command("winrate")
def winrate(
    path: Path = typer.Argument(
        ..., help="AlpacaEval annotations JSON: a list of rows with 'preference' and 'output_2'."
    ),
    difficulty: list[Path] = typer.Option(
        [],
        "--difficulty",
        help="Other annotation files (other models, same references and judge) "
        "to estimate instruction difficulty from; repeatable.",
    ),
    lc_method: str = typer.Option(
        "alpaca_eval",
        "--lc-method",
        help="alpaca_eval: AlpacaEval 2's GLM; ridge: an L2-penalized fit with a leave-one-run-out difficulty table "
        "(docs/evaluation.md).",
    ),
) -> None:
    """Win rate, standard error, counts, discrete win rate, average length and length-controlled win rate, as JSON.

    The LC win rate (docs/evaluation.md) needs 'instruction', 'output_1' and 'output_2'; its
    instruction difficulty comes from the --difficulty files (alpaca_eval: fitted over them and
    PATH; ridge: over them alone; none: no difficulty term).
    """
    from farmflow.evaluation import alpaca_eval_winrate, lc_of_rows, run_of_rows
    from farmflow.evaluation.lc import METHODS

    if lc_method not in METHODS:
        raise UsageError(f"--lc-method: unknown method {lc_method!r}; use {' or '.join(METHODS)}")

    rows = annotation_rows(path)
    peers = {p: annotation_rows(p) for p in difficulty}
    for p, peer in peers.items():  # a peer without references would read as a huge length difference
        if not all("output_1" in r for r in peer):
            raise UsageError(f"{p}: --difficulty files need 'output_1' (the reference output) in every row")
    stats = alpaca_eval_winrate(rows, where=str(path))
    runs = [run_of_rows(peer) for peer in peers.values()]
    lc = lc_of_rows(rows, runs, method=lc_method) if all("output_1" in r for r in rows) else {}
    if stats["n_invalid"]:
        typer.echo(
            f"warning: {int(stats['n_invalid'])} rows with a missing or malformed preference were left out", err=True
        )
    if not lc:
        typer.echo("warning: no 'output_1' (reference output) in every row: no length-controlled win rate", err=True)
    out = {k: (int(v) if k.startswith("n_") or k == "avg_length" else v) for k, v in stats.items()}
    out |= {k: lc[k] for k in ("lc_win_rate", "lc_standard_error", "lc_length_coef", "lc_difficulty_coef") if k in lc}
    if lc:
        out["lc_difficulty_runs"] = int(lc["lc_difficulty_runs"])
    print_json(out)


@eval_app.command("leaderboard")
def leaderboard(
    path: Path = typer.Argument(
        ...,
        help="Judgments: a Parquet file, or a folder of them, with generator, index (or instruction), preference, "
        "len_1 (baseline output length), len_2 (model output length).",
    ),
    published: Optional[Path] = typer.Option(
        None, "--published", help="An AlpacaEval leaderboard CSV: adds its LC and ours − published per model."
    ),
    baseline: Optional[str] = typer.Option(
        None, "--baseline", help="The baseline generator (default: the one judged against itself)."
    ),
    by_instruction: bool = typer.Option(
        False,
        "--by-instruction",
        help="Look each row's difficulty up by its instruction; default: by its position among the model's rows, "
        "as AlpacaEval does (its published LC of a model with missing rows carries this).",
    ),
    held_out: int = typer.Option(
        0,
        "--held-out",
        min=0,
        help="Score the --published models in K folds, each with a difficulty table fitted without its fold's "
        "judgments (what a new model gets from a table fitted before it); 0: one table over every run.",
    ),
    fmt: str = format_option(),
) -> None:
    """Win rate, SE, AlpacaEval 2 LC win rate and LC SE of every model in a judgments table (docs/evaluation.md).

    One instruction-difficulty table is fitted over all runs, then each model alone (AlpacaEval 2's GLM).
    """
    from farmflow.evaluation import glm_leaderboard as gl

    check_format(fmt)
    try:
        rows, dups = gl.read_judgments(path)
        pub = gl.read_published(published) if published else None
        if held_out and not pub:
            raise ValueError("--held-out K scores the --published models: give --published CSV")
        if held_out:
            board, info = gl.held_out(rows, list(pub), held_out, baseline=baseline, by_position=not by_instruction)
        else:
            board, info = gl.leaderboard(rows, baseline=baseline, by_position=not by_instruction)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if dups:
        typer.echo(f"note: {dups} exact duplicate rows left out", err=True)
    summary = gl.compare(board, pub) if pub else {}
    cols = ["model", "n_total", "win_rate", "standard_error", "lc_win_rate", "lc_standard_error", "avg_length"]
    cols += ["published_lc", "lc_delta"] if pub else []
    caption = f"baseline {info['baseline']}; gamed-baseline rows: {info['gamed_rows']}; "
    Cs = info["difficulty_C"] if held_out else [info["difficulty_C"]]
    caption += f"difficulty C {', '.join(f'{c:.3g}' for c in Cs)}"
    caption += f" ({info['folds']} held-out folds)" if held_out else ""
    if summary.get("n"):
        caption += (
            f"; vs published ({summary['n']} models): median |Δ| {summary['median_abs_delta']:.2f}, "
            f"{100 * summary['within_1']:.0f}% within 1 point, max |Δ| {summary['max_abs_delta']:.2f}, "
            f"Spearman {summary['spearman']:.4f}"
        )
    one = lambda x: "—" if x is None or x != x else f"{x:.2f}"  # noqa: E731
    emit(
        cols,
        [[r.get(c) for c in cols] for r in board],
        fmt,
        title=f"AlpacaEval 2 leaderboard of {path.name}",
        caption=caption,
        cells={c: one for c in cols[2:] if c not in ("n_total", "avg_length")},
        right=cols[1:],
    )
    if fmt != "table":
        typer.echo(caption, err=True)


@eval_app.command("annotators")
def annotators(
    files: list[Path] = typer.Argument(
        None,
        help="Label files: AlpacaEval annotation JSON or Parquet tables (annotations cache, preferences); with "
        "--judge one AlpacaEval annotations JSON whose preferences are the reference.",
    ),
    oracle: bool = typer.Option(
        False,
        "--oracle",
        help="Synthetic farm: every oracle annotator of the preset's evaluation pool labels the same pairs (offline).",
    ),
    preset: str = typer.Option("synthetic-tiny", help="Preset whose data and evaluation pool --oracle uses."),
    store: Optional[str] = typer.Option(
        None,
        help="With --oracle: take the val pairs of the latest sample_pairs artifact in this store (default: "
        "generated pairs). With --judge: the store holding the annotation row cache (default $FARMFLOW_STORE, else "
        "./.farmflow/store).",
    ),
    pairs: int = typer.Option(400, min=1, help="With --oracle: at most this many pairs."),
    draws: int = typer.Option(3, min=1, help="With --oracle: labels per annotator and pair (variance needs >= 2)."),
    reference: str = typer.Option(
        "auto",
        help="Agreement reference: gold, others (majority of the other annotators), auto (gold when known) or human "
        "(the people's labels in --store, annotators human:NAME; with --oracle the oracle pool labels the pairs they "
        "labeled, without FILES the row cache's labels of those pairs count; people are also compared with each "
        "other).",
    ),
    plot: Optional[Path] = typer.Option(None, help="Write the agreement-vs-price plot (PNG) here."),
    as_json: bool = typer.Option(False, "--json", help="Print the table as JSON (with the reference used)."),
    fmt: str = format_option(),
    judge: list[str] = typer.Option(
        [],
        "--judge",
        metavar="SPEC",
        help="Measure a judge against FILE's reference preferences (repeatable), beside the baselines 'longer' and "
        "'coin' (always included). SPEC: hf:MODEL (a model-cache name, folder or hub id), api:BASE_URL@MODEL (an "
        "OpenAI-compatible endpoint serving MODEL; key in $OPENAI_API_KEY, any value for a local server without one; "
        "prompt format choice, temperature 0), longer, coin. Options follow '?', joined by '&': for hf batch_size, "
        "max_prompt_tokens, dtype, device, gguf_file, revision; for api temperature, format (choice, json, logprobs), "
        "style. Examples: hf:smollm2-135m-instruct, hf:smollm2-135m-instruct?batch_size=4, "
        "api:http://localhost:8000/v1@m, 'api:http://localhost:8000/v1@m?temperature=1'.",
    ),
    limit: Optional[int] = typer.Option(
        None,
        "--limit",
        min=1,
        help="With --judge: the first N pairs of FILE with a decisive (non-tie, readable) reference; default: all.",
    ),
    seed: int = typer.Option(0, "--seed", help="With --judge: seed of the coin baseline."),
) -> None:
    """Agreement, bias, variance, length/list preference, price and time per 1000 of each annotator on shared pairs.

    With --judge: agreement with FILE's reference preferences, position and length bias, beside baselines.
    """
    from farmflow.evaluation import analysis

    check_format(fmt)
    if judge:
        if oracle or len(files or []) != 1:
            raise UsageError("--judge needs exactly one annotations FILE (and no --oracle)")
        from farmflow.evaluation.judge_quality import judge_quality, report_markdown

        try:
            report = judge_quality(files[0], judge, limit, seed, store)
        except RuntimeError as err:  # a judge that could not answer (server, model): the run failed, not the input
            raise CliError(str(err)) from err
        if as_json:
            print_json(report)
        else:
            say(report_markdown(report))
        return
    if reference == "human":
        from farmflow.cli.annotators import human_reference

        return human_reference(files or [], oracle, preset, store, draws, as_json, plot)
    if bool(files) == oracle:
        raise UsageError("give label FILES or --oracle (not both)")
    if oracle:
        from farmflow.config import load_config

        cfg = load_config(preset)
        shared = oracle_pairs(cfg, store, pairs)
        rows = analysis.oracle_labels(shared, cfg.evaluation.annotator, draws)
    else:
        rows = [r for f in files for r in analysis.load_labels(str(f))]
    table = analysis.annotator_table(rows, reference)
    used = reference if reference != "auto" else ("gold" if any(r["annotator"] == "gold" for r in table) else "others")
    if plot:
        analysis.plot_agreement(table, str(plot))
    if as_json:
        print_json({"reference": used, "annotators": table})
        return
    # (column, field, shown as): fractions as percentages
    pct = lambda x: "—" if x is None or x != x else f"{100 * x:.1f}"  # noqa: E731
    cols = (
        ("annotator", "annotator", str),
        ("labels", "labels", str),
        ("agreement %", "agreement", pct),
        ("bias %", "bias", pct),
        ("variance %", "variance", pct),
        ("prefers longer %", "length_pref", pct),
        ("prefers list %", "list_pref", pct),
        ("$ / 1000", "price_per_1000", lambda x: "—" if x != x else f"{x:.2f}"),
        ("s / 1000", "seconds_per_1000", None),
    )
    ref = "gold reward" if used == "gold" else "majority of the other annotators"
    emit(
        [c for c, _, _ in cols],
        [[r[f] for _, f, _ in cols] for r in table],
        fmt,
        title=f"Annotators ({len(rows)} labels; reference: {ref})",
        cells={c: show for c, _, show in cols if show},
        right=[c for c, _, _ in cols[1:]],
    )
    if plot:
        typer.echo(f"plot: {plot}", err=fmt != "table")


def oracle_pairs(cfg, store: Optional[str], limit: int) -> list[dict]:
    """Val pairs of the latest sample_pairs artifact in `store`, else pairs generated from the preset's data."""
    if store:
        st = existing_store(store)  # reading creates nothing
        found = [r for r in st.list() if r.stage == "sample_pairs"]
        if not found:
            raise UsageError(f"no sample_pairs artifact in {store}: run a flow first, or leave out --store")
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
            raise UsageError(f"cannot read {path}: {err}") from None
        if not isinstance(obj, dict) or not all(isinstance(v, (int, float)) for v in obj.values()):
            raise UsageError(f"{path}: expected a JSON object of method -> number")
        scores.append(obj)
    print_json(ranking_correlation(*scores))


def register(app: typer.Typer) -> None:
    """Add `eval` to the `farmflow` command."""
    app.add_typer(eval_app, name="eval")
