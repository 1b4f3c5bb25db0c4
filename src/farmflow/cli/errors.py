"""The one place where the `farmflow` command turns an exception into what a person reads, and an exit code.

Commands raise; they never print an error and exit. `FarmflowGroup.invoke` (the `farmflow` group, so every
command and every test that invokes `app`) catches what a command raises and prints one line on stderr:
``error: <what went wrong, naming the field, file or row>``. When the command had started a run, a second line
gives the file that holds the run's full log and the traceback (`cli.logs`); `farmflow --debug ...` prints the
traceback too.

Exit codes: 2 for bad input (a usage, config or data error: fix it and run again), 1 for a failed run or an
unexpected error, 130 for Ctrl-C. `FAMILIES` says which exception means which.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

import typer
from typer.core import TyperGroup

try:  # the Click that parses the options: typer vendors its own
    from typer._click.exceptions import UsageError as ClickUsageError
except ImportError:  # pragma: no cover - a typer that uses Click itself
    from click.exceptions import UsageError as ClickUsageError

import farmflow.cli.logs as logs
from farmflow import shutdown


class CliError(Exception):
    """An expected failure of a command: its message is the one line the user reads."""

    exit_code = 1


class UsageError(CliError):
    """A bad name, option or combination of options."""

    exit_code = 2


# (module, exception class, exit code), the first match wins. Matched through sys.modules, so reporting an error
# imports nothing: an exception of a module that was never imported cannot have been raised. None: the
# exception's own `exit_code` (ModelUnavailable: 1 when a known model is not available here, 2 for a bad name).
FAMILIES: tuple[tuple[str, str, int | None], ...] = (
    ("farmflow.cli.errors", "CliError", None),
    ("farmflow.modelcache", "ModelUnavailable", None),
    ("farmflow.config", "ConfigError", 2),
    ("farmflow.data.alpaca", "DataError", 2),
    ("farmflow.storage", "StoreError", 2),
    ("farmflow.annotators", "AnnotationError", 1),
    ("farmflow.annotators", "AnnotationIncomplete", 1),
    ("farmflow.tasks.launch", "StageLaunchError", 1),
    ("farmflow.flows.distributed", "StageRunError", 1),
    # the library functions the commands call say "bad input" with a ValueError (a file's rows, a name, an option)
    ("builtins", "ValueError", 2),
)


def classify(err: BaseException) -> tuple[int, bool]:
    """(exit code, expected?) of an exception a command raised."""
    signum = shutdown.requested()
    if signum is not None and isinstance(err, (KeyboardInterrupt, shutdown.Stopped)):
        return 128 + signum, True  # what a shell reports for a process the signal ended: 143 SIGTERM, 130 SIGINT
    if isinstance(err, KeyboardInterrupt):
        return 130, True
    for module, name, code in FAMILIES:
        family = getattr(sys.modules.get(module), name, None)
        if isinstance(family, type) and isinstance(err, family):
            return (getattr(err, "exit_code", 1) if code is None else code), True
    return 1, False


def one_line(err: BaseException | str) -> str:
    """The exception's message on one line (its lines joined by '; ')."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return "; ".join(lines) or type(err).__name__


def report(err: BaseException) -> int:
    """Print `err` for people (module doc) and return the exit code."""
    code, expected = classify(err)
    signum = shutdown.requested()
    if signum is not None and isinstance(err, (KeyboardInterrupt, shutdown.Stopped)):
        line = shutdown.message()
    elif isinstance(err, KeyboardInterrupt):
        line = "interrupted"
    elif expected:
        line = one_line(err)
    else:
        line = f"{type(err).__name__}: {one_line(err)} (unexpected"
        line += "; the log has the traceback)" if logs.State.path else "; `farmflow --debug ...` shows the traceback)"
    log = logs.record_error(err)
    if logs.State.debug:
        traceback.print_exception(err, file=sys.stderr)
    sys.stdout.flush()
    typer.echo(f"error: {line}", err=True)
    if log is not None:
        typer.echo(f"full log: {log}", err=True)
    return code


class FarmflowGroup(TyperGroup):
    """The `farmflow` group: each command runs inside the error boundary (`report`) and its run log's session."""

    def invoke(self, ctx: Any) -> Any:
        with logs.session():
            try:
                return super().invoke(ctx)
            except ClickUsageError as err:  # a bad option or argument: one line too, not Click's framed usage text
                where = f"`{err.ctx.command_path} --help`" if err.ctx else "`farmflow --help`"
                typer.echo(f"error: {one_line(err.format_message())}; {where} lists the options", err=True)
                raise typer.Exit(err.exit_code) from None
            except (typer.Exit, typer.Abort, typer.exceptions.TyperException, BrokenPipeError):
                raise  # Click's own: usage errors, --help, an explicit exit status, a reader that left (`| head`)
            except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - the one place that reports them
                code = report(err)
        raise typer.Exit(code)
