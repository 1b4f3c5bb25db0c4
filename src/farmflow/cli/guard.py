"""Child servers that die with the process that started them, even when it is killed with SIGKILL.

The CLI starts helper servers as child processes: Prefect's temporary API (`farmflow run`, `farmflow demo`) and the
loopback judge server (`farmflow demo --annotator api-local`). A parent that exits normally stops them; one killed
with SIGKILL (or by the out-of-memory killer) cannot, and they would live on, holding a port and a database.

So each runs under this file as its ``python`` entry: ``python guard.py PARENT_PID -m MODULE ARGS...`` runs
MODULE as ``python -m MODULE ARGS...`` would, in this process, while a thread checks every `POLL_S` seconds that
PARENT_PID is still its parent. Once it is not (the parent died and the child was re-parented), the thread sends
this process SIGTERM (a server's graceful stop) and, `EXIT_AFTER_S` later, exits it. Polling works wherever the
parent dies and from any thread that started the child (Linux's PR_SET_PDEATHSIG fires when the *thread* that
forked exits, and the temporary API is started from a short-lived thread).

Run by path, not as ``-m farmflow.cli.guard``: the child then imports nothing of farmflow (and its start stays as
fast as the module's own).
"""

from __future__ import annotations

import os
import re
import runpy
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

POLL_S = 0.25
EXIT_AFTER_S = 5.0


def wrap(argv: list[str], parent: int | None = None) -> list[str]:
    """``[python, -m, module, ...]`` as the same command under the guard of `parent` (default: this process)."""
    if argv[1:2] != ["-m"]:
        raise ValueError(f"expected [python, -m, module, ...], got {argv[:3]}")
    return [argv[0], str(Path(__file__).resolve()), str(parent or os.getpid()), *argv[1:]]


API_OUTPUT: list[Path] = []  # the file the temporary API's output goes to, every start of this process appending


def guard_temporary_api() -> None:
    """Start Prefect's temporary API server (`SubprocessASGIServer`) under the guard from now on, in this process.

    Its start command is Prefect's own (prefect/server/api/server.py, `_run_uvicorn_command`) with the guard in
    front; tests/test_shutdown.py checks that a killed run leaves no server behind. Its output (errors only) goes to
    one file, ``<run log folder>/<time>-prefect-api-<pid>.log``, not to the run's terminal: a server that cannot
    start (a full disk, a broken database) prints thousands of lines while Prefect starts it again and again, and
    the command's one error line names the file instead (`api_start_failed`)."""
    import subprocess

    import prefect
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import get_current_settings

    from farmflow.cli.logs import new_path

    def run_uvicorn_command(self: Any) -> subprocess.Popen:
        app = ["--app-dir", str(prefect.__module_path__.parent), "--factory", "prefect.server.api.server:create_app"]
        serve = ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error", "--lifespan", "on"]
        env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
        if not API_OUTPUT:
            API_OUTPUT.append(new_path("prefect-api"))
        with open(API_OUTPUT[0], "ab") as output:  # the child keeps its own handle
            return subprocess.Popen(
                args=wrap([sys.executable, "-m", "uvicorn", *app, *serve]),
                env={**os.environ, **env, **get_current_settings().to_environment_variables(exclude_unset=True)},
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in a terminal reaches the run, which stops it when done with it
            )

    SubprocessASGIServer._run_uvicorn_command = run_uvicorn_command


def api_start_failed(err: BaseException) -> str | None:
    """The one line for a temporary API that did not start (Prefect raises a RuntimeError saying so): where its output
    is and the last exception it printed (else its last line), which usually says why. None for any other error."""
    if not isinstance(err, RuntimeError) or "ephemeral Prefect API" not in str(err) or not API_OUTPUT:
        return None
    try:
        lines = [line.strip() for line in API_OUTPUT[0].read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    errors = [line for line in lines if re.match(r"[\w.]*(Error|Exception)\b.*:", line)]  # an exception's own line
    last = f"; its last error: {errors[-1][:300]}" if errors else f"; its last line: {lines[-1][:300]}" if lines else ""
    return f"Prefect's temporary API did not start ({str(err).strip()}); its output: {API_OUTPUT[0]}{last}"


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(EXIT_AFTER_S)
    os._exit(1)


def main(argv: list[str]) -> None:
    parent, flag, module, *rest = argv
    if flag != "-m":
        raise SystemExit("usage: python guard.py PARENT_PID -m MODULE [ARGS...]")
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)  # this file's folder is not a place to import from (cli/logs.py is not `logs`)
    sys.path.insert(0, os.getcwd())  # as `python -m` has it
    if os.getppid() != int(parent):  # the parent died before this started
        raise SystemExit(1)
    threading.Thread(target=_watch, args=(int(parent),), name="parent-watch", daemon=True).start()
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
