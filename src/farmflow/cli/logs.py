"""The run log: every line of a run, with tracebacks, in a file; the console keeps what a person follows.

A command that runs a flow calls `start(name)` just before the flow starts. From then on everything logged in
this process (Prefect's flow and task runs, farmflow's stages, warnings of the libraries) also goes to
``$FARMFLOW_LOG_DIR/<UTC time>-<name>-<pid>.log`` (default folder ``./.farmflow/logs``, beside the default store and
Prefect home; delete old logs at will). If the run fails, the error's traceback is appended and the command's error
line names the file (`cli.errors`).

On the console, Prefect's engine would repeat each stage and each error: a "Finished in state Cached" line beside
the stage's own "X: cache hit" line (the same `Task run 'evaluate' - Finished in state Cached(...)` line once per
evaluation), and a failing stage's traceback twice (task and flow) above the command's own error line. `Quiet`
leaves those records to the log file and Prefect's API (the UI shows them); `farmflow --debug` shows them all.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

LOG_DIR_ENV = "FARMFLOW_LOG_DIR"
FORMAT = "%(asctime)s | %(levelname)-7s | %(name)s - %(message)s"
ENGINE_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


class Quiet(logging.Filter):
    """The console's filter: drops what the stages' own lines or the command's error line already say."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(ENGINE_LOGGERS):
            return True
        if record.exc_info:  # the engine reporting an exception: the command's error line says it once
            return False
        # a task's state: its stage line says it; a failed flow's: the command's error line
        if str(record.msg).startswith("Finished in state"):
            return record.name.startswith("prefect.flow_runs") and "Completed(" in record.getMessage()
        return True


class State:
    """This process's run log: set by `start`, cleared by `stop`; `debug` by `farmflow --debug`."""

    debug = False
    path: Path | None = None
    handler: logging.Handler | None = None
    quieted: list[logging.Handler] = []


def log_dir() -> Path:
    return Path(os.environ.get(LOG_DIR_ENV) or ".farmflow/logs").expanduser().absolute()


def new_path(name: str) -> Path:
    folder = log_dir()
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{name}-{os.getpid()}.log"


def start(name: str) -> Path:
    """Start this process's run log (module doc) and return its path; a second call returns the same path."""
    if State.path is not None:
        return State.path
    from prefect.logging.configuration import PROCESS_LOGGING_CONFIG, setup_logging
    from prefect.logging.formatters import PrefectFormatter
    from prefect.logging.handlers import PrefectConsoleHandler

    if not PROCESS_LOGGING_CONFIG:  # Prefect configures logging once per process; our handler comes after
        setup_logging()
    path = new_path(name)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(
        PrefectFormatter(
            FORMAT,
            flow_run_fmt=FORMAT.replace("%(name)s", "Flow run %(flow_run_name)r"),
            task_run_fmt=FORMAT.replace("%(name)s", "Task run %(task_run_name)r"),
        )
    )
    root = logging.getLogger()
    root.addHandler(handler)
    if not State.debug:
        State.quieted = [h for h in root.handlers if isinstance(h, PrefectConsoleHandler)]
        for h in State.quieted:
            h.addFilter(QUIET)
    State.path, State.handler = path, handler
    return path


def stop() -> None:
    """Close the run log and take the console filter off (the command is over)."""
    if State.handler is not None:
        logging.getLogger().removeHandler(State.handler)
        State.handler.close()
    for h in State.quieted:
        h.removeFilter(QUIET)
    State.path, State.handler, State.quieted = None, None, []


@contextmanager
def session() -> Iterator[None]:
    """One command: its run log, if it starts one, ends with it."""
    try:
        yield
    finally:
        stop()


def record_error(err: BaseException) -> Path | None:
    """Append `err` with its traceback to the run log and return the log's path; None without a run log."""
    if State.handler is None:
        return None
    record = logging.LogRecord(
        "farmflow.cli",
        logging.ERROR,
        __file__,
        0,
        "the command failed: %s: %s",
        (type(err).__name__, err),
        (type(err), err, err.__traceback__),
    )
    State.handler.handle(record)
    return State.path


QUIET = Quiet()
