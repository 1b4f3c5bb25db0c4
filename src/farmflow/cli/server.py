"""`farmflow server`: one Prefect server for repeated local runs; and the check that PREFECT_API_URL answers.

Without PREFECT_API_URL, every `farmflow run` and `farmflow demo` starts a temporary Prefect server and stops
it at exit, a fixed cost of several seconds per run (bench/results/cli.json). With a server started once and
PREFECT_API_URL exported, a run only connects to it, and its runs stay in one database and one UI.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import typer

from farmflow.cli.errors import CliError

HEALTH_TIMEOUT_S = 3.0


def prefect_env() -> None:
    """Keep Prefect's state in the project (never ~/.prefect) and its analytics off."""
    os.environ.setdefault("PREFECT_HOME", str(Path(".farmflow/prefect").absolute()))
    # Prefect opens its SQLite database inside PREFECT_HOME without creating the folder
    Path(os.environ["PREFECT_HOME"]).expanduser().mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "farmflow")
    # Prefect gives the extra loggers its handlers, not a level: without one, farmflow's INFO lines
    # outside a run (progress, annotation totals) would be dropped
    logging.getLogger("farmflow").setLevel(logging.INFO)
    # the first start of the temporary API creates and migrates its database: on a busy
    # 2-core machine that can take longer than Prefect's default 20 s
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


def api_url(host: str, port: int) -> str:
    """The PREFECT_API_URL of a server listening on host:port (a wildcard host is reached on loopback here)."""
    host = "127.0.0.1" if host in ("", "0.0.0.0") else "::1" if host == "::" else host
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/api"


def redacted(url: str) -> str:
    """`url` without a user name or password, for messages."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))


def check_api(timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    """With PREFECT_API_URL set (environment or Prefect profile), its server must answer `GET /health` within
    `timeout_s`; otherwise a CliError (one line, exit code 1) before a run starts any work. Without the check a
    run would import torch and the flows first (seconds) and then end in a screenful of traceback."""
    import httpx
    import prefect.settings

    api = prefect.settings.get_current_settings().api
    if not api.url:
        return
    shown = redacted(api.url)
    headers = {"Authorization": f"Bearer {api.key.get_secret_value()}"} if api.key else {}
    try:
        response = httpx.get(
            api.url.rstrip("/") + "/health", headers=headers, timeout=timeout_s, verify=not api.tls_insecure_skip_verify
        )
    except httpx.HTTPError as err:
        timed_out = isinstance(err, httpx.TimeoutException)
        reason = f"no answer within {timeout_s:g} s" if timed_out else " ".join(str(err).split()) or type(err).__name__
        raise CliError(
            f"the Prefect API at PREFECT_API_URL={shown} does not answer ({reason}); start it "
            "(`farmflow server`) or unset PREFECT_API_URL to let each run start a temporary one"
        ) from None
    if response.status_code >= 400:
        raise CliError(
            f"PREFECT_API_URL={shown} answered HTTP {response.status_code} to GET /health; "
            "expected a Prefect API URL, e.g. http://127.0.0.1:4200/api"
        )


def register(app: typer.Typer) -> None:
    """Add `server` to the `farmflow` command."""

    @app.command()
    def server(
        host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0: reachable from other machines)."),
        port: int = typer.Option(4200, min=1, max=65535, help="Port to listen on."),
    ) -> None:
        """Run a Prefect server in the foreground (Ctrl-C stops it); runs in shells that export the printed
        PREFECT_API_URL use it instead of starting a temporary server each, and its UI shows them all.

        It is `prefect server start` with farmflow's environment: database in $PREFECT_HOME (./.farmflow/prefect).

        SIGINT and SIGTERM stop it gracefully; after SIGTERM it exits with that signal's status."""
        prefect_env()
        typer.echo(f"# in the shells that run farmflow (its database: {os.environ['PREFECT_HOME']}):")
        typer.echo(f"export PREFECT_API_URL={api_url(host, port)}")
        sys.stdout.flush()
        # exec: the server is this process, so a signal to it reaches Prefect's server directly
        argv = [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port)]
        os.execv(sys.executable, argv)
