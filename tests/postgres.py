"""A private PostgreSQL cluster for tests: Prefect's database where many processes write at once.

SQLite serializes writers, and a server that several workers and their flow-run processes talk to at once answers
"database is locked" (a 503) once a lock is held past the client's retries; Prefect's guidance, and
docs/orchestration.md's, is PostgreSQL for such servers. The cluster lives in a temporary folder, listens on a free
port on 127.0.0.1 with trust authentication, and is removed at the end. Debian's `postgresql` package provides the
binaries (.ci/run installs it); as root, they run as its `postgres` user, since PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from farmflow import loopback

USER = "farmflow"


def _find(name: str) -> str | None:
    return shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)


def installed() -> bool:
    """Whether PostgreSQL's server binaries are on this machine."""
    return _find("initdb") is not None and _find("pg_ctl") is not None


def _bin(name: str) -> str:
    found = _find(name)
    if found is None:
        raise RuntimeError(f"PostgreSQL's {name} not found: install Debian's postgresql package (.ci/run does)")
    return found


def _as_owner(args: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *args] if os.geteuid() == 0 else args


def _run(args: list[str]) -> None:
    done = subprocess.run(_as_owner(args), capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(args[0]).name} failed ({done.returncode}): {(done.stdout + done.stderr)[-2000:]}")


class Cluster:
    def __init__(self, port: int, data: Path):
        self.port, self.data = port, data

    def database(self, name: str) -> str:
        """Create an empty database `name`; its SQLAlchemy URL for Prefect (asyncpg, Prefect's driver)."""
        _run([_bin("createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", USER, name])
        return f"postgresql+asyncpg://{USER}@127.0.0.1:{self.port}/{name}"


@contextmanager
def postgres_cluster() -> Iterator[Cluster]:
    """initdb, start on a free port (fsync off: a test's data need not survive a power cut), yield, stop, remove."""
    root = Path(tempfile.mkdtemp(prefix="farmflow-postgres-"))
    if os.geteuid() == 0:
        shutil.chown(root, user="postgres")
    data, port = root / "data", loopback.free_port()
    try:
        _run([_bin("initdb"), "-D", str(data), "-U", USER, "--auth=trust", "-E", "UTF8", "--no-sync"])
        options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        _run([_bin("pg_ctl"), "-D", str(data), "-o", options, "-l", str(root / "log"), "-w", "start"])
        try:
            yield Cluster(port, data)
        finally:
            _run([_bin("pg_ctl"), "-D", str(data), "-m", "immediate", "stop"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
