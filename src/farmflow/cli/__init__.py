"""The `farmflow` command: the commands live in one module per group; errors are reported in `cli.errors`.

| module | commands |
|---|---|
| `runs` | demo, run, deploy, overopt, reward-report |
| `history` | leaderboard, history |
| `evaluate` | eval winrate, eval leaderboard, eval annotators, eval rankings |
| `config` | config presets, config show, config diff |
| `store` | sql, artifacts ls, artifacts show, artifacts verify |
| `annotators` | judge-server, annotate, annotations reparse |
| `models` | models get, models import, models ls |
| `server` | server |
| `label` | label serve, label export, label import |
| `study` | study validate, study feedback |
| `plot` | plot curves |
| `samples` | samples |
"""

from __future__ import annotations

import sys

import typer

from farmflow.cli import (
    annotators,
    config,
    evaluate,
    feedback,
    history,
    label,
    models,
    plot,
    runs,
    samples,
    server,
    store,
    study,
)
from farmflow.cli.errors import FarmflowGroup
from farmflow.cli.logs import LOG_DIR_ENV, State
from farmflow.cli.output import print_json  # noqa: F401 - part of the package's interface

app = typer.Typer(
    cls=FarmflowGroup,
    help="farmflow: AlpacaFarm as a cached Prefect pipeline.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


@app.callback()
def options(
    debug: bool = typer.Option(
        False,
        "--debug",
        envvar="FARMFLOW_DEBUG",
        help="On an error, print the traceback too, and every log line (by default Prefect's repeats of each stage's "
        "state and error stay in the run's log file, in $" + LOG_DIR_ENV + ", else ./.farmflow/logs).",
    ),
) -> None:
    """farmflow: AlpacaFarm as a cached Prefect pipeline."""
    State.debug = debug


GROUPS = (runs, history, evaluate, config, store, annotators, models, server, label, study, feedback, plot, samples)
for group in GROUPS:
    group.register(app)


def main() -> None:
    """The `farmflow` console script."""
    sys.exit(app())


if __name__ == "__main__":
    main()
