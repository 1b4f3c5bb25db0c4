"""CLI commands of the annotators: `judge-server`, `annotate FILE`, `annotations reparse`.

`register(app)` adds them to the `farmflow` command; `local_judge()` starts a loopback
judge server for `farmflow demo --annotator api-local`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Optional

import typer

from farmflow.cli.errors import CliError, UsageError
from farmflow.cli.guard import wrap as guarded
from farmflow.cli.preflight import check_store, existing_store, location_of, writable_output

annotations_app = typer.Typer(help="The row-level annotation cache.", no_args_is_help=True)

LOCAL_JUDGE_PORT = 8787  # fixed, so the api-local demo's stage keys (which include base_url) stay the same across runs


def judge_server(
    host: str = typer.Option("127.0.0.1", help="Interface to listen on."),
    port: int = typer.Option(LOCAL_JUDGE_PORT, min=0, max=65535, help="Port (0: any free port; the URL is printed)."),
    latency_ms: float = typer.Option(0.0, help="Milliseconds every answer takes."),
    fault_rate: float = typer.Option(0.0, help="Probability that a request gets an injected fault."),
    faults: str = typer.Option(
        "429,500,400,409,timeout,garbage,truncated,wrong_count,html,truncated_body",
        help="Fault kinds to draw from (in turn), comma-separated.",
    ),
    retry_after: float = typer.Option(1.0, help="Retry-After seconds of injected 429s."),
    timeout_sleep: float = typer.Option(30.0, help="Seconds an injected timeout holds the answer."),
    api_key_env: Optional[str] = typer.Option(
        None, help="Require the key in this environment variable (401 otherwise); default: any key."
    ),
    models: Optional[str] = typer.Option(
        None, help="Known model names, comma-separated (404 otherwise); default: any."
    ),
    seed: int = typer.Option(0, help="Seed of fault and judgement draws."),
) -> None:
    """An OpenAI-compatible judge on loopback that answers our annotator prompts with the oracle pool."""
    from farmflow.annotators.server import FAULTS, JudgeConfig, serve

    kinds = [f.strip() for f in faults.split(",") if f.strip()]
    unknown = sorted(set(kinds) - set(FAULTS))
    if unknown:
        raise UsageError(f"unknown fault kinds {unknown}; known: {', '.join(FAULTS)}")
    key = None
    if api_key_env:
        key = os.environ.get(api_key_env)
        if not key:
            raise UsageError(f"environment variable {api_key_env} is not set")
    cfg = JudgeConfig(
        latency_s=latency_ms / 1000,
        fault_rate=fault_rate,
        faults=kinds,
        retry_after_s=retry_after,
        timeout_sleep_s=timeout_sleep,
        api_key=key,
        models=models.split(",") if models else None,
        seed=seed,
    )

    def ready(url: str) -> None:
        print(f"judge server listening on {url}", flush=True)

    try:
        serve(cfg, host, port, ready=ready)
    except OSError as err:
        raise CliError(f"cannot listen on {host}:{port}: {err.strerror}") from None
    except KeyboardInterrupt:
        pass


def _annotator_config(
    name: str,
    base_url: Optional[str],
    max_cost_usd: Optional[float],
    max_in_flight: Optional[int],
    served_model: Optional[str] = None,
):
    from pydantic import ValidationError

    from farmflow.config import ANNOTATOR_PRESETS, AnnotatorConfig, ConfigError, describe_validation_error

    given = {
        "base_url": base_url,
        "max_cost_usd": max_cost_usd,
        "max_in_flight": max_in_flight,
        "served_model": served_model,
    }
    extra = {k: v for k, v in given.items() if v is not None}
    try:
        if name == "oracle":
            return AnnotatorConfig(label_noise=0.0, **extra)
        if name in ANNOTATOR_PRESETS:
            return AnnotatorConfig(preset=name, **extra)
        path = Path(name)
        if path.is_file():
            return AnnotatorConfig.model_validate(json.loads(path.read_text()) | extra)
    except ValidationError as err:  # one line naming each field, as for --set
        raise UsageError(f"annotator {name!r}: {describe_validation_error(err)}") from None
    except (ValueError, ConfigError) as err:  # json.JSONDecodeError is a ValueError
        raise UsageError(f"annotator {name!r}: {err}") from None
    raise UsageError(
        f"unknown annotator {name!r}: use oracle, a preset ({', '.join(sorted(ANNOTATOR_PRESETS))}) "
        "or a JSON file with an annotation config"
    )


def read_alpaca_eval(path: Path) -> list[dict]:
    """AlpacaEval-format pairs: a JSON list of objects with instruction, output_1, output_2 (input optional)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of objects")
    for i, r in enumerate(data):
        if not isinstance(r, dict):
            raise ValueError(f"{path}: row {i} is not an object")
        for k in ("instruction", "output_1", "output_2"):
            if not isinstance(r.get(k), str):
                raise ValueError(f"{path}: row {i} has no string field {k!r}")
        if r.get("input") is not None and not isinstance(r["input"], str):
            raise ValueError(f"{path}: row {i}: 'input' must be a string")
    return data


def annotate_file(
    path: Path = typer.Argument(
        ..., help="AlpacaEval-format JSON: a list of {instruction, output_1, output_2[, input]}."
    ),
    annotator: str = typer.Option(
        "p_sim_eval",
        help="oracle, a preset (alpacafarm-pool, p_sim_eval, p_sim_ann, p_sim_gpt4) "
        "or the path of a JSON file holding an annotation config.",
    ),
    output: Optional[Path] = typer.Option(
        None, help="Where to write the annotated rows (default FILE with .annotated.json)."
    ),
    store: Optional[str] = typer.Option(
        None, help="Store holding the row cache (default $FARMFLOW_STORE, else ./.farmflow/store)."
    ),
    base_url: Optional[str] = typer.Option(
        None, help="OpenAI-compatible endpoint (default: the config's, $OPENAI_BASE_URL or OpenAI)."
    ),
    max_cost_usd: Optional[float] = typer.Option(None, help="Stop sending requests once this much is spent."),
    max_in_flight: Optional[int] = typer.Option(None, help="Requests in flight at once."),
    served_model: Optional[str] = typer.Option(
        None,
        help="Send every request with this model name (an endpoint serving one model, e.g. transformers serve); "
        "each annotator keeps its prompt format, style, temperature and batch size.",
    ),
) -> None:
    """Annotate an AlpacaEval-format file; writes the same rows with 'preference' (1: output_1, 2: output_2) and
    'annotator'."""
    from farmflow.annotators import AnnotationError, annotate, task_from_text
    from farmflow.config import StoreConfig
    from farmflow.data.synthetic import task_to_json
    from farmflow.progress import progress

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("farmflow").setLevel(logging.INFO)
    cfg = _annotator_config(annotator, base_url, max_cost_usd, max_in_flight, served_model)
    data = read_alpaca_eval(path)  # a ValueError naming the file and row: exit code 2
    writable_output(output or path.with_suffix(".annotated.json"))  # before any request is paid
    rows = [
        {
            "id": str(r.get("id", i)),
            "split": "",
            "instruction": r["instruction"],
            "input": r.get("input") or "",
            "output_1": r["output_1"],
            "output_2": r["output_2"],
            "task": None,
        }
        for i, r in enumerate(data)
    ]
    if cfg.kind == "oracle":  # the oracle needs the synthetic task behind each row
        for i, r in enumerate(rows):
            task = task_from_text(r["instruction"], r["input"])
            if task is None:
                raise UsageError(
                    f"{path}: row {i} is not a synthetic-farm task; the oracle cannot judge it (use an API annotator)"
                )
            r["task"] = task_to_json(task)
    check_store(location_of(store))
    error = None
    try:
        with progress("annotate", len(rows), unit="pair") as bar:
            table, totals = annotate(rows, cfg, store or StoreConfig().uri, allow_incomplete=True, progress=bar.update)
        judged = table.to_pylist()
    except AnnotationError as err:
        if err.judged is None:  # nothing was asked (e.g. no API key): nothing to write
            raise CliError(f"annotation failed: {err}") from err
        error, judged, totals = err, err.judged, _totals(err.judged, err.stats)
    out = [r | {"preference": j["preference"], "annotator": j["annotator"]} for r, j in zip(data, judged)]
    target = output or path.with_suffix(".annotated.json")
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(json.dumps(out, indent=2, ensure_ascii=False))
    os.replace(tmp, target)
    missing = sum(j["preference"] is None for j in judged)
    print(
        json.dumps(
            {"file": str(target), **{k: (int(v) if float(v).is_integer() else v) for k, v in totals.items()}}, indent=2
        )
    )
    if error is not None:
        raise CliError(f"annotation failed: {error}") from error
    if missing:
        raise CliError(f"{missing} rows have no preference (failed or not sent; see above); rerun to ask them again")


def _totals(judged: list[dict], stats) -> dict[str, float]:
    """The summary of a run that stopped at an error, from its per-row results and its `RunStats`."""
    count = lambda status: float(sum(j["status"] == status for j in judged))  # noqa: E731
    return {
        "pairs": float(len(judged)),
        "noised": count("noised"),
        "ties": count("tie"),
        "cached": float(sum(bool(j.get("cached")) and j["status"] == "ok" for j in judged)),
        "judged": float(sum(j["status"] == "ok" and not j.get("cached") for j in judged)),
        "failed": count("failed"),
        "unsent": count("unsent"),
        "requests": float(stats.requests if stats else 0),
        "cost_usd": stats.cost_usd if stats else 0.0,
    }


@annotations_app.command("reparse")
def reparse(
    store: Optional[str] = typer.Option(
        None, help="Store holding the row cache (default $FARMFLOW_STORE, else ./.farmflow/store)."
    ),
) -> None:
    """Parse the stored raw completions of failed rows again, without any API call; rows that now parse become ok."""
    from farmflow.annotators import cache

    print(json.dumps(cache.reparse(existing_store(location_of(store))), indent=2))  # creates no store


@contextlib.contextmanager
def local_judge(store: Optional[str] = None, port: int = LOCAL_JUDGE_PORT) -> Iterator[list[str]]:
    """Start a loopback judge server (a subprocess) and yield config overrides that annotate through it."""
    from farmflow import loopback

    cmd = guarded([sys.executable, "-m", "farmflow.cli.annotators", "--port", str(port)])  # dies with this process
    # its own session: Ctrl-C in a terminal reaches the run only, which stops the server when done with it
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if "listening on" not in line:
            err = proc.stderr.read() if proc.stderr and proc.poll() is not None else ""
            raise RuntimeError(f"the local judge server did not start on port {port}: {err.strip()[-300:]}")
        url = line.rsplit(" ", 1)[1].strip()
        os.environ.setdefault("OPENAI_API_KEY", "local-judge")  # the loopback server accepts any key
        if store:  # anything that falls back to the default store uses this one too
            os.environ["FARMFLOW_STORE"] = store
        typer.echo(f"local judge server at {url}", err=True)
        yield [
            f"annotation={json.dumps({'preset': 'p_sim_ann', 'base_url': url})}",
            f"evaluation.annotator={json.dumps({'preset': 'p_sim_eval', 'base_url': url})}",
        ]
    finally:
        loopback.stop(proc, grace=10)


def human_reference(
    files: list[Path],
    oracle: bool,
    preset: str,
    store: Optional[str],
    draws: int,
    as_json: bool,
    plot: Optional[Path] = None,
) -> None:
    """`farmflow eval annotators --reference human`: every simulated annotator against the people's labels in the
    store, and the people against each other (`farmflow.evaluation.human`).

    The simulated labels: with --oracle, every oracle annotator of the preset's evaluation pool labels the pairs
    people labeled (`draws` times each); with FILES, the files' labels; else the row cache's labels of those pairs."""
    from farmflow.cli.output import print_json, say
    from farmflow.cli.store import open_given
    from farmflow.evaluation import analysis
    from farmflow.evaluation.human import agreement_markdown, human_agreement
    from farmflow.labeling.labels import all_labels, simulated_labels

    st = open_given(store)
    people = all_labels(st)
    if not people:
        raise UsageError(f"no human labels in {st.root}: label pairs with `farmflow label serve` or import a file")
    if oracle:
        from farmflow.annotators import task_from_text
        from farmflow.config import load_config
        from farmflow.data.synthetic import task_to_json

        pairs = {analysis.pair_key(r)[0]: r for r in people}.values()
        tasked = [r | {"task": task_to_json(t)} for r in pairs if (t := task_from_text(r["instruction"], r["input"]))]
        if not tasked:
            raise UsageError("--oracle: none of the labeled pairs is a synthetic-farm task; give label FILES instead")
        others = analysis.oracle_labels(tasked, load_config(preset).evaluation.annotator, draws)
    elif files:
        others = [r for f in files for r in analysis.load_labels(str(f))]
    else:
        others = simulated_labels(st)
    try:
        report = human_agreement(people + others)
    except ValueError as err:
        raise UsageError(str(err)) from None
    boards = [r for r in st.list() if r.stage == "leaderboard"]
    if boards:  # the newest leaderboard's methods ranked by people and by the simulated judge, when people judged it
        from farmflow.cli.quality import ranking_line
        from farmflow.evaluation.cost import by_evaluation
        from farmflow.evaluation.human import human_preferences, ranking_agreement

        rows = st.read_table(boards[-1]).to_pylist()
        evaluations = by_evaluation(st, rows)
        ranks = ranking_agreement(
            {r["method"]: evaluations.get(r["evaluation_key"], []) for r in rows}, human_preferences(people)
        )
        if ranks["methods"]:
            report["rankings"] = ranks | {"leaderboard": boards[-1].key}
    if plot and report["annotators"]:
        analysis.plot_agreement(report["annotators"], str(plot), "Simulated annotators vs people: agreement vs cost")
    if as_json:
        print_json(report)
        return
    if not report["annotators"]:
        say("no simulated annotator labeled the pairs people labeled (try --oracle or label FILES)")
    say(agreement_markdown(report))
    if "rankings" in report:
        say(ranking_line(report["rankings"]) + f" (leaderboard {report['rankings']['leaderboard'][:12]})")


def register(app: typer.Typer) -> None:
    app.command("judge-server")(judge_server)
    app.command("annotate")(annotate_file)
    app.add_typer(annotations_app, name="annotations")


if __name__ == "__main__":  # python -m farmflow.cli.annotators: the judge server alone
    typer.run(judge_server)
