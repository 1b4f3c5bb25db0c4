"""A real `prefect server start` for tests: its own PREFECT_HOME and SQLite database (or a database URL given), on
127.0.0.1, a free port."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Iterator

from farmflow import loopback

_MIGRATED: list[Path] = []  # the database this test process migrated, once


def migrated_home(home: Path) -> Path:
    """Make `home` a Prefect home whose SQLite database is already at the newest migration (a home that has a
    database keeps it): a copy of one this test process migrates once. A server on a new database file runs every
    migration first (~25 s on 2 cores), which the tests that start a server in a home of their own would each pay."""
    if not _MIGRATED:
        template = Path(tempfile.mkdtemp(prefix="farmflow-prefect-template-"))
        env = os.environ | {"PREFECT_HOME": str(template)}
        env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
        exe = str(Path(sys.executable).parent / "prefect")
        done = subprocess.run(
            [exe, "server", "database", "upgrade", "-y"], env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        _MIGRATED.append(template / "prefect.db")
    home.mkdir(parents=True, exist_ok=True)
    if (home / "prefect.db").exists():
        return home
    with closing(sqlite3.connect(_MIGRATED[0])) as source, closing(sqlite3.connect(home / "prefect.db")) as copy:
        source.backup(copy)
    return home


def prefect_cli(*args: str, env: dict, log: Path) -> subprocess.Popen:
    """``prefect ARGS`` from this venv in its own process group, output to `log`."""
    exe = str(Path(sys.executable).parent / "prefect")
    return subprocess.Popen(
        [exe, *args], env=env, cwd=log.parent, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group (`prefect_cli` starts each in a session of its own), SIGKILL after 20 s."""
    loopback.stop(proc, signal.SIGTERM, grace=20, group=True)


@contextmanager
def prefect_server(home: Path, **settings: str) -> Iterator[tuple[str, dict, Path]]:
    """Start a server (extra `settings` as environment variables); yields (api_url, environment for clients, server
    log)."""
    port = loopback.free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    own_database = "PREFECT_SERVER_DATABASE_CONNECTION_URL" in settings  # the server migrates it as it starts
    home.mkdir(parents=True, exist_ok=True)
    env = os.environ | {
        "PREFECT_HOME": str(home if own_database else migrated_home(home)),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_URL": api_url,
        "PREFECT_LOGGING_LEVEL": "INFO",
        "PREFECT_SERVER_LOGGING_LEVEL": "INFO",
        **settings,
    }
    log = home / "server.log"
    proc = prefect_cli("server", "start", "--host", "127.0.0.1", "--port", str(port), env=env, log=log)
    try:
        loopback.wait_healthy(proc, f"{api_url}/health", 120, "prefect server", log)
        yield api_url, env, log
    finally:
        stop(proc)


def all_artifacts(client) -> list:
    """Every artifact a (sync) client's server holds. One read answers at most PREFECT_API_DEFAULT_LIMIT (200) rows,
    and a session-wide test server holds more than that by the end of a full run, so read page by page."""
    found: list = []
    while True:
        page = client.read_artifacts(offset=len(found), limit=200)
        found += page
        if len(page) < 200:
            return found
