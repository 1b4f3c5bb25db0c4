"""`farmflow server` (a real Prefect server on loopback) and the PREFECT_API_URL check of `farmflow run`."""

from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prefect_server import migrated_home
from procs import python_env

from farmflow.loopback import free_port

CLI = "from farmflow.cli import main; main()"
# after the CLI exits: did it get as far as the heavy imports (the flows, torch)?
CLI_REPORTING_IMPORTS = f"""
import sys
try:
    {CLI}
finally:
    print("flows imported" if "farmflow.flows" in sys.modules or "torch" in sys.modules else "nothing heavy imported")
"""


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize(
    "sig, home",
    [(signal.SIGINT, "default"), (signal.SIGTERM, "set")],
    ids=["SIGINT-default-home", "SIGTERM-PREFECT_HOME-set"],
)
def test_server_answers_health_and_stops_on_signal(tmp_path, sig, home):
    """The printed export line names a server that answers; SIGINT/SIGTERM shut it down gracefully, nothing
    is left running and the port is free again. PREFECT_HOME: as set, else ./.farmflow/prefect."""
    port = free_port()
    env = python_env(PREFECT_SERVER_LOGGING_LEVEL="INFO")  # uvicorn's shutdown lines
    env.pop("PREFECT_API_URL", None)
    prefect_home = tmp_path / ".farmflow" / "prefect"
    if home == "set":
        prefect_home = migrated_home(tmp_path / "elsewhere")  # default-home checks that a fresh one is created
        env["PREFECT_HOME"] = str(prefect_home)
    else:
        env.pop("PREFECT_HOME")
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", CLI, "server", "--port", str(port)],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}/api"
        deadline = time.monotonic() + 50
        while not answers(url + "/health"):
            assert proc.poll() is None, "the server exited: " + log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no answer from /health: " + log.read_text()[-3000:]
            time.sleep(0.2)
        assert f"export PREFECT_API_URL={url}\n" in log.read_text()
        assert f"its database: {prefect_home})" in log.read_text() and (prefect_home / "prefect.db").is_file()
        assert httpx.get(url + "/health").json() is True

        os.kill(proc.pid, sig)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    # uvicorn shuts down gracefully, then re-raises SIGTERM (exit status -15); Prefect returns after SIGINT
    assert proc.returncode == (0 if sig == signal.SIGINT else -signal.SIGTERM), text[-3000:]
    assert "Application shutdown complete." in text and "Traceback" not in text, text[-3000:]
    with pytest.raises(ProcessLookupError):  # no process of its session is left
        os.killpg(proc.pid, 0)
    assert not answers(url + "/health")


def run_cli(*args: str, api_url: str, tmp_path) -> tuple[subprocess.CompletedProcess, float]:
    env = python_env(PREFECT_API_URL=api_url, PREFECT_HOME=str(tmp_path / "prefect"))
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CLI_REPORTING_IMPORTS, *args], env=env, capture_output=True, text=True, timeout=120
    )
    return done, time.perf_counter() - start


def test_run_fails_in_one_line_when_the_api_url_does_not_answer(tmp_path):
    with socket.socket() as closed:  # bound, never listening: connections are refused, and no one else takes it
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/api"
        done, seconds = run_cli(
            "run",
            "best-of-n",
            "--preset",
            "synthetic-micro",
            "--store",
            str(tmp_path / "store"),
            api_url=url,
            tmp_path=tmp_path,
        )
    assert done.returncode == 1
    assert done.stderr.startswith(f"error: the Prefect API at PREFECT_API_URL={url} does not answer (")
    assert "Connection refused" in done.stderr and "farmflow server" in done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stdout.split("\n")[-2] == "nothing heavy imported"  # the check ran before the flows' imports
    assert not (tmp_path / "store").exists()
    assert seconds < 20  # ~1.5 s here when idle: the CLI's own imports (typer, Prefect's settings)


class NotFound(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_error(404)

    def log_message(self, *args):
        pass


def test_run_names_a_url_that_is_not_a_prefect_api(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://user:secret@127.0.0.1:{server.server_address[1]}"  # the /api suffix forgotten
        done, _ = run_cli(
            "demo", "--preset", "synthetic-micro", "--store", str(tmp_path / "store"), api_url=url, tmp_path=tmp_path
        )
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 1 and "Traceback" not in done.stderr
    shown = f"http://***@127.0.0.1:{server.server_address[1]}"
    assert (
        done.stderr == f"error: PREFECT_API_URL={shown} answered HTTP 404 to GET /health; expected a Prefect API "
        "URL, e.g. http://127.0.0.1:4200/api\n"
    )
    assert "secret" not in done.stderr + done.stdout
